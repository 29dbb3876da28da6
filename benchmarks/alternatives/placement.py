"""Where bench_alternatives' in-memory arms put each id: folded modulo a table's rows, or one row per id
through an id-to-row index (the mmap arm), and how many rows fit a share of the machine's memory."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys.config import RunConfig

__all__ = ["VOCAB_ENV", "VocabStream", "ram_sized_rows", "shared_fractions", "vocab_files", "vocab_stream"]

VOCAB_ENV = "BENCH_ALTERNATIVES_VOCAB"  # the folder holding the mmap arm's index (vocab/), for vocab_stream


def vocab_files(root: Path) -> list[Path]:
    """The id-to-row index under ``root``: ``vocab/table_<t>.npy``, in table order."""
    return sorted((root / "vocab").glob("table_*.npy"), key=lambda p: int(p.stem.split("_")[1]))


class VocabStream:
    """A dataset whose ids are looked up in each table's sorted distinct training ids (an id-to-row index
    such as a user of a mapped table builds): row = the id's rank, and ids the index lacks (held-out only)
    share the row past the last. Implements the Dataset protocol over ``data``'s batches."""

    def __init__(self, data: Any, vocab: list[np.ndarray]) -> None:
        self.data = data
        self.vocab = vocab  # per table, (V_t,) int64 sorted

    @property
    def feature_names(self) -> list[str]:
        return list(self.data.feature_names)

    @property
    def id_spaces(self) -> list[int]:
        return [v.shape[0] + 1 for v in self.vocab]

    @property
    def num_dense(self) -> int:
        return int(self.data.num_dense)

    def split_stats(self) -> Any:
        return self.data.split_stats()

    def _rows(self, batch: Any) -> Any:
        from recsys.routing import values_by_feature, with_values

        rows = {}
        for name, values in values_by_feature(batch.sparse).items():
            vocab = self.vocab[self.feature_names.index(name)]
            ids = values.numpy()
            at = np.minimum(np.searchsorted(vocab, ids), vocab.shape[0] - 1)
            rows[name] = torch.from_numpy(np.where(vocab[at] == ids, at, vocab.shape[0]))
        return with_values(batch, rows)

    def train_batches(self, **kwargs: Any) -> Any:
        return (self._rows(b) for b in self.data.train_batches(**kwargs))

    def eval_batches(self, **kwargs: Any) -> Any:
        return (self._rows(b) for b in self.data.eval_batches(**kwargs))


def vocab_stream(config: Any, *, seed: int) -> VocabStream:
    """The mmap arm's dataset (``data.source = "alternatives.placement:vocab_stream"``): the synthetic
    stream the parent replayed, through the index in ``$BENCH_ALTERNATIVES_VOCAB/vocab`` (its
    ``synthetic.json`` and one ``table_<t>.npy`` per table)."""
    from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo

    root = Path(os.environ[VOCAB_ENV])
    synthetic = SyntheticConfig(**json.loads((root / "vocab" / "synthetic.json").read_text()))
    return VocabStream(SyntheticCriteo(synthetic, seed=seed), [np.load(f) for f in vocab_files(root)])


def ram_sized_rows(
    cfg: RunConfig, available_bytes: int, *, share: float, reserve_gib: float, cap_rows: int
) -> dict[str, Any]:
    """Rows per table that ``share`` of ``available_bytes``, less ``reserve_gib`` for the process and the
    dense model, holds for every sparse table at the store's row bytes; at most ``cap_rows`` (0: no cap)."""
    from recsys.tiered import row_bytes

    tables = cfg.synthetic.num_sparse
    table_row_bytes = row_bytes(cfg.sparse, cfg.model.embedding_dim)
    budget = share * available_bytes - reserve_gib * 2**30
    rows = max(1, int(budget // (tables * table_row_bytes)))
    capped = min(rows, cap_rows) if cap_rows else rows
    return {
        "hashed_ram_sized_rows_per_table": capped,
        "hashed_ram_sized_rows_uncapped": rows,
        "hashed_ram_sized_gib": capped * tables * table_row_bytes / 2**30,
        "mem_available_gib_at_start": available_bytes / 2**30,
        "row_bytes": table_row_bytes,
    }


def shared_fractions(
    cfg: RunConfig, *, steps: int, batch: int, rows: dict[str, int | None], index_root: Path | None
) -> dict[str, float]:
    """Replay the training stream's ids (``steps`` global batches of ``batch``) and place them as each arm
    of ``rows`` does (its rows per table; None: one row per distinct id): the share of distinct ids whose
    row another id shares, and of lookups that read such a row, all tables together. With ``index_root``,
    each table's sorted distinct ids are written there (``vocab/``) for :func:`vocab_stream`."""
    from recsys.data.synthetic import SyntheticCriteo

    data = SyntheticCriteo(cfg.synthetic, seed=cfg.train.seed)
    tables = cfg.synthetic.num_sparse
    draws: list[list[np.ndarray]] = [[] for _ in range(tables)]
    for step in range(steps):
        block = data.sample_block(np.arange(step * batch, (step + 1) * batch, dtype=np.uint64))
        for table, jagged in enumerate(block.ids):
            draws[table].append(jagged.values)
    shared_ids = dict.fromkeys(rows, 0)
    shared_lookups = dict.fromkeys(rows, 0)
    distinct_total = lookups_total = 0
    vocab = None if index_root is None else index_root / "vocab"
    if vocab is not None:
        shutil.rmtree(vocab, ignore_errors=True)
        vocab.mkdir(parents=True)
        (vocab / "synthetic.json").write_text(json.dumps(dataclasses.asdict(cfg.synthetic)))
    for table in range(tables):
        ids, counts = np.unique(np.concatenate(draws[table]), return_counts=True)  # (V,) sorted, (V,)
        draws[table] = []
        distinct_total += ids.size
        lookups_total += int(counts.sum())
        if vocab is not None:
            np.save(vocab / f"table_{table}.npy", ids)
        for arm, per_table in rows.items():
            placed = np.searchsorted(ids, ids) if per_table is None else ids % per_table
            _, row_of, per_row = np.unique(placed, return_inverse=True, return_counts=True)
            shared = per_row[row_of] >= 2  # (V,)
            shared_ids[arm] += int(shared.sum())
            shared_lookups[arm] += int(counts[shared].sum())
    out: dict[str, float] = {"stream_distinct_ids": distinct_total}
    for arm in rows:
        out[f"{arm}_shared_row_fraction"] = shared_ids[arm] / distinct_total
        out[f"{arm}_shared_lookup_fraction"] = shared_lookups[arm] / lookups_total
    return out
