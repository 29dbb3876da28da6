"""SplitMix64, the 64-bit mixing hash behind row initialisation, id hashing and sampling (numpy only).

A leaf: it imports nothing but numpy, so the data readers (:mod:`recsys.data`) and the cache tuner
hash ids exactly as the store initialises rows without loading the store, torch or LMDB.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix64", "mix64_inplace"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64_inplace(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, in place on a uint64 array (wrapping arithmetic); returns ``x``."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser of a uint64 array: a new array of well-mixed 64-bit hashes."""
    return mix64_inplace(x.astype(np.uint64, copy=True))
