"""``recsys export`` of bounded tables: only the rows the bounds say exist, and the default row.

A checkpoint of a run with bounded tables records each one's default row id in ``meta.json``
(``bounds``: ``{table: default_id}``) and each rank's bounds state in ``bounds_rank_<r>.safetensors``,
whose ``<table>/row_ids`` are the ids that have a row (admitted, not expired or capped) on that rank.
Their union and the default id are the rows the bundle holds (:mod:`recsys.serving.bounded`):

- a tiered table's store snapshots hold exactly those rows; :func:`restrict` keeps only them anyway
  and gives any of them the snapshots lack its initial row (what the store reads for it);
- an in-memory table holds every row, those of ids without a row at their initial value; the bundle
  gets only the kept ones, with their ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from recsys.errors import UserError
from recsys.serving.safetensors_stream import Chunks

__all__ = ["kept_rows", "restrict", "restricted_chunks"]

Rows = Iterator[tuple[np.ndarray, np.ndarray]]


def kept_rows(checkpoint: Path, tables: list[str], defaults: dict[str, int] | None) -> dict[str, np.ndarray]:
    """Per bounded table, the ids of the rows the bundle keeps: the union over ranks of the ids that
    have a row, then the default row's id (last: it is past every other id), (n,) int64 ascending.
    ``checkpoint``: one :func:`recsys.checkpoint.checkpoint_meta` accepted; ``defaults``: its ``bounds``
    (each bounded table's default row id, validated there).

    Raises:
        UserError: the checkpoint's bounds records are missing, unreadable or inconsistent.
    """
    files = sorted(checkpoint.glob("bounds_rank_*.safetensors"))
    if defaults is None:
        if files:
            raise UserError(
                f"checkpoint {checkpoint} has bounded tables but its meta.json does not record their default "
                "rows (saved by an older tierrec); resume it for a step and export the new checkpoint"
            )
        return {}
    if not files:
        raise UserError(
            f"checkpoint {checkpoint}: meta.json's bounds {str(defaults)[:80]} without bounds_rank files"
        )
    unknown = sorted(str(t) for t in defaults if t not in tables)
    if unknown:
        raise UserError(
            f"checkpoint {checkpoint}: meta.json bounds table {unknown[0]}, which the model lacks"
        )
    parts: dict[str, list[np.ndarray]] = {t: [] for t in defaults}
    for file in files:
        try:
            state = load_file(str(file))
        except (SafetensorError, OSError) as err:
            raise UserError(f"checkpoint {checkpoint}: {file.name} is unreadable ({err})") from None
        for table in defaults:
            if f"{table}/row_ids" in state:
                parts[table].append(state[f"{table}/row_ids"].astype(np.int64, copy=False))
    out = {}
    for table, d in defaults.items():
        ids = np.unique(np.concatenate(parts[table])) if parts[table] else np.empty(0, dtype=np.int64)
        if ids.shape[0] and (int(ids[0]) < 0 or int(ids[-1]) >= d):
            bad = int(ids[0]) if int(ids[0]) < 0 else int(ids[-1])
            raise UserError(
                f"checkpoint {checkpoint}: table {table} has a row for id {bad}, outside [0, {d}) (its default row's id)"
            )
        out[table] = np.append(ids, np.int64(d))
    return out


def restrict(chunks: Rows, keep: np.ndarray, fill: Callable[[np.ndarray], np.ndarray], step: int) -> Rows:
    """Ascending ``(ids, rows)`` chunks restricted to the ascending ids ``keep``: rows of other ids are
    dropped, ids of ``keep`` no chunk holds get ``fill(ids)``; ascending chunks (the leftover ids of
    ``keep`` past the last chunk in chunks of ``step``)."""
    done = 0  # keep[:done] went out
    for ids, rows in chunks:
        if not ids.shape[0]:
            continue
        end = int(np.searchsorted(keep, ids[-1], side="right"))
        want = keep[done:end]
        done = end
        if not want.shape[0]:
            continue
        pos = np.minimum(np.searchsorted(ids, want), ids.shape[0] - 1)
        found = ids[pos] == want
        out = np.empty((want.shape[0], *rows.shape[1:]), dtype=rows.dtype)
        out[found] = rows[pos[found]]
        if not found.all():
            out[~found] = fill(want[~found])
        yield want, out
    for start in range(done, keep.shape[0], step):
        rest = keep[start : start + step]
        yield rest, fill(rest)


def restricted_chunks(chunks: Chunks, keep: np.ndarray, table: str) -> Chunks:
    """The rows ``keep`` (ascending, all below the rows) of a whole table given as row chunks in order
    (an in-memory table, or its optimizer state)."""

    def missing(ids: np.ndarray) -> np.ndarray:
        raise UserError(
            f"export: table {table} has no row {int(ids[0])} (its default row's id is past its rows)"
        )

    def numbered() -> Rows:
        start = 0
        for chunk in chunks():
            yield np.arange(start, start + chunk.shape[0], dtype=np.int64), chunk
            start += chunk.shape[0]

    def out() -> Iterator[np.ndarray]:
        for _, rows in restrict(numbered(), keep, missing, max(1, keep.shape[0])):
            yield rows

    return out
