"""Which records of a log-layout table are live: a bit per record of each segment, and per-segment counts.

The log index (:mod:`embedding_store.log_index`) maps an id to its newest record; a record is *live* when
the index points at it. Compaction needs a segment's live records and the victim choice needs each
segment's live count. Asking the index for every record of a 1 M-record segment costs ~0.15 s (one
random lookup per record); the writer already knows, at each publication, which records it makes live
(the new ones) and which die (the ones the index pointed at before), so it keeps one bit per record
instead: 1 bit per record, 16 MiB for 128 M records. The bits live in RAM and are rebuilt on open from
the index, like the index itself from the runs (docs/tiers.md, "Write-back by write time").

The loops are numba functions that release the interpreter lock, as the index's are.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

__all__ = ["Liveness"]


@numba.njit("int64(uint8[:], int64[:], int64)", nogil=True, cache=True)
def _clear(bits, seqs, base):  # type: ignore[no-untyped-def] # pragma: no cover
    """Clear the bits of ``seqs - base``; returns how many were set."""
    cleared = 0
    for s in seqs:
        off = s - base
        mask = np.uint8(1 << (off & 7))
        if bits[off >> 3] & mask:
            cleared += 1
            bits[off >> 3] &= ~mask
    return cleared


@numba.njit("void(uint8[:], int64[:], int64)", nogil=True, cache=True)
def _set(bits, seqs, base):  # type: ignore[no-untyped-def] # pragma: no cover
    for s in seqs:
        off = s - base
        bits[off >> 3] |= np.uint8(1 << (off & 7))


class Liveness:
    """Live records of one table's segments (every segment that holds records has an entry).

    Args:
        segment: sequence numbers per segment.
        records: records written into each segment (segments without records may be absent).
        live_seqs: the sequence numbers the index points at (any order).
        tombs: tombstone records of each segment (counted in ``records`` too; absent: none).

    Attributes:
        records: segment -> records written into it (tombstones included).
        live: segment -> records of it the index points at.
        tombs: segment -> tombstone records written into it (never live).
    """

    def __init__(
        self,
        segment: int,
        records: dict[int, int],
        live_seqs: np.ndarray,
        *,
        tombs: dict[int, int] | None = None,
    ) -> None:
        self._segment = segment
        self.records: dict[int, int] = {}
        self.live: dict[int, int] = {}
        self.tombs: dict[int, int] = {}
        self._bits: dict[int, np.ndarray] = {}
        for seg in records:
            self.open(seg)
            self.records[seg] = records[seg]
            self.tombs[seg] = (tombs or {}).get(seg, 0)
        self._for_segments(np.sort(np.asarray(live_seqs, dtype=np.int64)), self._set_live)

    def open(self, seg: int) -> None:
        """Start segment ``seg`` (no records yet); a segment already open is left as it is."""
        if seg not in self._bits:
            self._bits[seg] = np.zeros(-(-self._segment // 8), dtype=np.uint8)
            self.records[seg] = 0
            self.live[seg] = 0
            self.tombs[seg] = 0

    def publish(self, old: np.ndarray, seqs: np.ndarray) -> None:
        """The index moved ids from records ``old`` (-1: none) to the new records ``seqs``, ascending
        consecutive numbers (segments already opened)."""
        dead = np.sort(old[old >= 0])
        self._for_segments(dead, self._set_dead)
        self._for_segments(np.ascontiguousarray(seqs, dtype=np.int64), self._set_new)

    def add_tombs(self, seqs: np.ndarray) -> None:
        """Tombstone records were written at ascending ``seqs`` (segments already opened)."""
        segs, counts = np.unique(seqs // self._segment, return_counts=True)
        for seg, n in zip(segs.tolist(), counts.tolist(), strict=True):
            self.records[seg] += n
            self.tombs[seg] += n

    def live_seqs(self, seg: int) -> np.ndarray:
        """Ascending sequence numbers of segment ``seg``'s live records."""
        bits = np.unpackbits(self._bits[seg], bitorder="little")
        return np.flatnonzero(bits).astype(np.int64) + seg * self._segment

    def drop(self, seg: int) -> None:
        del self._bits[seg], self.records[seg], self.live[seg], self.tombs[seg]

    def totals(self) -> tuple[int, int]:
        """(records, live records) over all segments."""
        return sum(self.records.values()), sum(self.live.values())

    # -------------------------------------------------------------------------------------- internals
    def _for_segments(self, ordered: np.ndarray, apply: Callable[[int, np.ndarray], None]) -> None:
        """Call ``apply(seg, part)`` for each segment's part of ascending ``ordered``."""
        if not ordered.shape[0]:
            return
        segs = ordered // self._segment
        cuts = [0, *(np.flatnonzero(np.diff(segs)) + 1).tolist(), ordered.shape[0]]
        for a, b in zip(cuts, cuts[1:], strict=False):
            apply(int(segs[a]), ordered[a:b])

    def _set_live(self, seg: int, part: np.ndarray) -> None:
        _set(self._bits[seg], part, seg * self._segment)
        self.live[seg] += part.shape[0]

    def _set_dead(self, seg: int, part: np.ndarray) -> None:
        cleared = _clear(self._bits[seg], part, seg * self._segment)
        if cleared != part.shape[0]:
            raise RuntimeError(
                f"log segment {seg}: {part.shape[0] - cleared} records the index left were not live"
            )
        self.live[seg] -= cleared

    def _set_new(self, seg: int, part: np.ndarray) -> None:
        self._set_live(seg, part)
        self.records[seg] += part.shape[0]
