"""``recsys export``'s tiered tables: every rank's store snapshot merged, in ascending id order, into the
bundle's LMDB (written by :mod:`recsys.serving.export`). Rows go out packed as the store packs them
(:mod:`embedding_store.rows`): the weights in the table's precision, then, if kept, the optimizer state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from embedding_store import OptimizerKind, StoreError, TableSpec, WeightsPrecision, scan_snapshot
from embedding_store.init import init_rows
from embedding_store.rows import pack_weights
from recsys.errors import UserError
from recsys.serving.export_bounds import restrict

if TYPE_CHECKING:
    from recsys.serving.export import ExportOptions

__all__ = ["RowAppender", "copy_tiered", "initial_rows", "merged_chunks", "precision_of"]

# The recorded description of a table that the ranks' snapshots must agree on (the rest, such as the
# log layout's geometry, is how one snapshot stores it).
_TABLE_IDENTITY = ("dim", "optimizer", "num_embeddings", "init_scale", "dtype", "row_bytes")


class RowAppender(Protocol):
    """Where a table's rows go, in ascending id order (the bundle's LMDB writer)."""

    def append(self, table: str, ids: np.ndarray, values: np.ndarray) -> None: ...


def precision_of(dtype: str, where: str) -> WeightsPrecision:
    """The precision whose stored weights are ``dtype`` (a store's or a bundle's record); another is one
    line: a row layout this tierrec cannot read is refused, never misread."""
    for precision in WeightsPrecision:
        if precision.dtype == dtype:
            return precision
    known = ", ".join(p.dtype for p in WeightsPrecision)
    raise UserError(f"{where}: weights of type {dtype!r}, not one of {known}")


def merged_chunks(
    streams: list[Iterator[tuple[np.ndarray, np.ndarray]]], table: str
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Merge ascending ``(ids, rows)`` chunk streams with disjoint ids into ascending chunks.

    Each round emits every id up to the smallest last id of the streams' current chunks: all ids up to
    it are in those chunks, as every stream ascends.
    """
    heads: list[tuple[np.ndarray, np.ndarray] | None] = [next(s, None) for s in streams]
    while True:
        live = [i for i, h in enumerate(heads) if h is not None]
        if not live:
            return
        bound = min(int(heads[i][0][-1]) for i in live)  # type: ignore[index]
        ids_parts, rows_parts = [], []
        for i in live:
            ids, rows = heads[i]  # type: ignore[misc]
            cut = int(np.searchsorted(ids, bound, side="right"))
            ids_parts.append(ids[:cut])
            rows_parts.append(rows[:cut])
            heads[i] = (ids[cut:], rows[cut:]) if cut < ids.shape[0] else next(streams[i], None)
        ids = np.concatenate(ids_parts)
        rows = np.concatenate(rows_parts)
        if len(ids_parts) > 1:
            order = np.argsort(ids, kind="stable")
            ids, rows = ids[order], rows[order]
        if ids.shape[0] > 1 and not (np.diff(ids) > 0).all():
            raise UserError(
                f"export: table {table} has an id in two ranks' store snapshots; the checkpoint is inconsistent"
            )
        yield ids, rows


def copy_tiered(
    writer: RowAppender,
    table: str,
    sources: list[tuple[Path, dict[str, Any]]],
    run: tuple[Any, np.ndarray | None],
    options: ExportOptions,
) -> tuple[int, int, dict[str, Any]]:
    """Stream one tiered table from its snapshots into the bundle; returns (rows, 4-byte words per row,
    layout).
    ``run``: the config and, for a bounded table, the ids of the rows kept (the default row's last)."""
    config, kept = run
    layout = sources[0][1]
    if any(
        {k: other.get(k) for k in _TABLE_IDENTITY} != {k: layout.get(k) for k in _TABLE_IDENTITY}
        for _, other in sources
    ):
        raise UserError(f"export: the store snapshots disagree on the layout of table {table}")
    spec = TableSpec(
        name=table,
        dim=int(layout["dim"]),
        optimizer=OptimizerKind(layout["optimizer"]),
        num_embeddings=layout["num_embeddings"],
        init_scale=float(layout["init_scale"]),
        weights_precision=precision_of(layout.get("dtype", "float32"), f"export: table {table}"),
    )
    if spec.weights_precision is not config.sparse.weights_precision:
        raise UserError(
            f"export: table {table} stores {spec.weights_precision.value} weights, the run's "
            f"sparse.weights_precision is {config.sparse.weights_precision.value}"
        )
    keep = spec.row_floats if options.keep_optimizer_state else spec.weight_words
    chunk = max(1, options.buffer_rows // len(sources))
    try:
        streams = [scan_snapshot(snap, spec, seed=config.train.seed, chunk_rows=chunk) for snap, _ in sources]
        merged = merged_chunks(streams, table)
        if kept is not None:
            if spec.num_embeddings is not None and int(kept[-1]) >= spec.num_embeddings:
                raise UserError(
                    f"export: table {table}'s default row id {int(kept[-1])} is outside its {spec.num_embeddings} ids"
                )
            merged = restrict(merged, kept, lambda ids: initial_rows(spec, ids, config.train.seed), chunk)
        rows = 0
        for ids, values in merged:
            writer.append(table, ids, values[:, :keep])
            rows += ids.shape[0]
    except StoreError as err:
        raise UserError(f"export: table {table}: {err}") from None
    return rows, keep, layout


def initial_rows(spec: TableSpec, ids: np.ndarray, seed: int) -> np.ndarray:
    """The stored rows of ids a store holds no row of: their initial weights and zero optimizer state."""
    rows = np.zeros((ids.shape[0], spec.row_floats), dtype=np.float32)
    weights = init_rows(ids, dim=spec.dim, seed=seed, table=spec.name, scale=spec.init_scale).numpy()
    pack_weights(spec, weights, rows[:, : spec.weight_words])  # fp16: rounded once, as training rounds them
    return rows
