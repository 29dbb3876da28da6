"""A counting model of the log layout's compaction under uniform random write-back: how many segments each
compaction policy compacts and how many rows it copies, part by part, from the first compaction on.

It mirrors ``benchmarks/ssd_store_writeback.py`` at a smaller scale (the same ratios: a base of 50
segments filled in id order, transactions of 32,768 / 50 M of the base, warm-up until the first
compaction, then parts of 10 M / 50 M of the base each) and counts, without LMDB, what
``embedding_store.lmdb_log`` does: every write gives its ids new sequence numbers, the deadest sealed
segment is the victim, its live records are copied to the head. Policies:

- ``segment``: a segment is compacted once it is ``c`` dead, or the deadest once the log is (the rule
  until 2026-12-02);
- ``space``: the deadest sealed segment is compacted while the log is ``c`` dead (the rule since).

A part's modelled seconds at full scale are ``rows x ROW_S + compactions x COMPACTION_S``, two constants
fitted to the parts of one ``bench_ssd.py --skip-reads`` run at e97bb1e (docs/performance.md); the
model's value is the comparison of policies, not the absolute rate.

Usage: python benchmarks/compaction_policy_model.py [--base 2000000] [--parts 3]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

FULL_BASE = 50_000_000  # the benchmark's base rows
FULL_SEGMENT = 1 << 20
FULL_BATCH = 32_768
PART_SHARE = 0.2  # rows of a part / base rows (10 M of 50 M)
ROW_S = 0.76e-6  # fitted: seconds per written row, compaction aside
COMPACTION_S = 0.84  # fitted: seconds per compaction of a 1 M-row segment, its copies included


class Log:
    """Sequence numbers, segments and live counts of one table's log, without the rows."""

    def __init__(self, base: int, segment: int) -> None:
        self.segment = segment
        self.owner = np.arange(base, dtype=np.int64)  # id -> sequence number of its newest record
        self.id_of = np.full(base * 8, -1, dtype=np.int64)  # sequence number -> id (grown on demand)
        self.id_of[:base] = np.arange(base)
        self.live: dict[int, int] = {}
        self.records: dict[int, int] = {}
        for seg in range(-(-base // segment)):
            n = min(segment, base - seg * segment)
            self.live[seg] = self.records[seg] = n
        self.next_seq, self.base = base, base
        self.compactions = self.copies = 0

    def append(self, ids: np.ndarray) -> None:
        old_segs, counts = np.unique(self.owner[ids] // self.segment, return_counts=True)
        for seg, c in zip(old_segs.tolist(), counts.tolist(), strict=True):
            self.live[seg] -= c
        seqs = np.arange(self.next_seq, self.next_seq + ids.shape[0], dtype=np.int64)
        if seqs[-1] >= self.id_of.shape[0]:
            self.id_of = np.concatenate([self.id_of, np.full(self.id_of.shape[0], -1, np.int64)])
        self.owner[ids], self.id_of[seqs] = seqs, ids
        segs, counts = np.unique(seqs // self.segment, return_counts=True)
        for seg, c in zip(segs.tolist(), counts.tolist(), strict=True):
            self.records[seg] = self.records.get(seg, 0) + c
            self.live[seg] = self.live.get(seg, 0) + c
        self.next_seq += ids.shape[0]

    def victim(self, policy: str, c: float) -> int | None:
        head = self.next_seq // self.segment
        sealed = [s for s in self.records if s < head and self.records[s] > self.live[s]]
        if not sealed:
            return None
        seg = min(sealed, key=lambda s: self.live[s] / self.records[s])
        total = sum(self.records.values())
        log_dead = total - self.base >= c * total
        if policy == "space":
            return seg if log_dead else None
        return seg if log_dead or self.records[seg] - self.live[seg] >= c * self.records[seg] else None

    def compact(self, policy: str, c: float) -> None:
        while (seg := self.victim(policy, c)) is not None:
            seqs = np.arange(seg * self.segment, (seg + 1) * self.segment, dtype=np.int64)
            ids = self.id_of[seqs]
            keep = ids >= 0
            ids, seqs = ids[keep], seqs[keep]
            live = ids[self.owner[ids] == seqs]
            self.compactions += 1
            self.copies += live.shape[0]
            if live.shape[0]:
                self.append(np.sort(live))
            del self.records[seg], self.live[seg]


def run(policy: str, c: float, base: int, parts: int, seed: int = 0) -> dict:
    scale = FULL_BASE / base
    segment, batch = round(FULL_SEGMENT / scale), max(1, round(FULL_BATCH / scale))
    log, rng = Log(base, segment), np.random.default_rng(seed)

    def write() -> int:
        ids = np.unique(rng.integers(0, base, size=batch))
        log.append(ids)
        log.compact(policy, c)
        return int(ids.shape[0])

    warm = 0
    while log.compactions == 0:
        warm += write()
    out = []
    for _ in range(parts):
        comp, copies, rows, most = log.compactions, log.copies, 0, 0.0
        while rows < PART_SHARE * base:
            rows += write()
            most = max(most, sum(log.records.values()) / base)
        comp, copies = log.compactions - comp, log.copies - copies
        seconds = rows * scale * ROW_S + comp * COMPACTION_S * segment * scale / FULL_SEGMENT
        out.append(
            {
                "compactions": comp,
                "copies_per_row": round(copies / rows, 3),
                "records_per_live_row_max": round(most, 3),
                "modelled_rows_per_s": round(rows * scale / seconds),
            }
        )
    total = sum(p["modelled_rows_per_s"] ** -1 for p in out)
    return {
        "policy": policy,
        "compact_at": c,
        "warm_rows_per_base_row": round(warm / base, 3),
        "parts": out,
        "window_modelled_rows_per_s": round(len(out) / total),
        "records_per_live_row_end": round(sum(log.records.values()) / base, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=int, default=2_000_000, help="base rows of the model (50 segments)")
    parser.add_argument("--parts", type=int, default=3, help="parts of 0.2 x base rows after the warm-up")
    args = parser.parse_args()
    for policy, c in (("segment", 0.7), ("space", 0.7), ("space", 0.5), ("space", 0.4)):
        print(json.dumps(run(policy, c, args.base, args.parts)), flush=True)


if __name__ == "__main__":
    main()
