"""A dataset from your own Python code: a ``module:function`` factory for ``[data] source``.

Run it (from the repository root)::

    recsys train --config configs/quickstart.toml --out runs/custom \\
        --set data.source=examples.custom_dataset:make_dataset --set train.steps=300

``recsys`` imports ``examples.custom_dataset`` (the working directory is on the import path) and calls
``make_dataset(config, seed=seed)`` in every rank; ``config`` is the ``[data]`` section (its ``path`` key
is free for your own use). Return any object with the Dataset protocol's methods
(``recsys/data/source.py``); :class:`recsys.data.array_dataset.ArrayDataset` turns numpy arrays into
one, with rank shares, per-epoch shuffles and exact resume handled for you.

Here the "own data" is a toy shop log: users, items and a weekday, clicked when a hidden user taste
matches a hidden item style — replace ``_load`` with reading your files.
"""

from __future__ import annotations

import numpy as np

from recsys.data.array_dataset import ArrayDataset
from recsys.data.source import DataConfig

NUM_USERS, NUM_ITEMS = 5_000, 2_000


def _load(seed: int, rows: int = 200_000) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    users = rng.zipf(1.3, rows) % NUM_USERS
    items = rng.zipf(1.2, rows) % NUM_ITEMS
    weekday = rng.integers(0, 7, rows)
    taste = np.random.default_rng(1).normal(size=(NUM_USERS, 4))
    style = np.random.default_rng(2).normal(size=(NUM_ITEMS, 4))
    logit = (taste[users] * style[items]).sum(axis=1) - 1.0
    clicked = rng.random(rows) < 1 / (1 + np.exp(-logit))
    price = rng.lognormal(3.0, 1.0, rows)
    dense = np.log1p(price)[:, None].astype(np.float32)  # (N, 1)
    return dense, {"user": users, "item": items, "weekday": weekday}, clicked


def make_dataset(config: DataConfig, *, seed: int) -> ArrayDataset:
    """The factory ``recsys`` calls; the last 10% of rows are held out."""
    dense, ids, labels = _load(seed)
    return ArrayDataset.from_arrays(
        dense=dense,
        ids=ids,
        labels=labels,
        id_spaces={"user": NUM_USERS, "item": NUM_ITEMS, "weekday": 7},
        eval_fraction=0.1,
        seed=seed,
    )
