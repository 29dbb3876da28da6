"""``recsys export``: a checkpoint of any number of ranks as one self-contained serving bundle.

The bundle (layout in :mod:`recsys.serving.bundle`) is written into a temporary sibling folder and
renamed into place once its manifest is written, so a bundle directory is either complete or absent: a
failure (a full disk included) or SIGINT removes the temporary folder, and the temporary folder of an
export killed outright is removed by the next export to the same place (:mod:`recsys.serving.output`).

Streaming, with memory bounded by ``buffer_rows`` rows rather than by the tables:

- tiered tables: every rank's store snapshot is scanned in ascending id order, ``buffer_rows / ranks``
  rows at a time; the scans are merged (row-wise sharding spreads a table over every rank, table-wise
  puts it on one) and appended to the bundle's LMDB in order with ``putmulti(append=True)``, one
  transaction per buffer, so its pages are filled and the file is compact;
- plain tables: each rank file is memory-mapped, and each table's shards are copied into
  ``tables.safetensors`` by row offset, ``buffer_rows`` rows at a time.

Optimizer state is dropped (weights only) unless ``keep_optimizer_state``. A bounded table keeps only
the rows its bounds say exist and its default row (:mod:`recsys.serving.export_bounds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch

from embedding_store import OptimizerKind, StoreError, TableSpec
from embedding_store.backends import open_snapshot
from recsys.checkpoint import checkpoint_meta
from recsys.config import config_to_dict
from recsys.errors import UserError
from recsys.serving.bundle import DENSE, FORMAT, MANIFEST, MODEL, TABLES, TIERED, VERSION, describe_files
from recsys.serving.export_bounds import kept_rows, restricted_chunks
from recsys.serving.export_tiered import copy_tiered
from recsys.serving.output import remove_stale, temporary, write_failure
from recsys.serving.runs import find_checkpoint, run_config
from recsys.serving.safetensors_stream import (
    DTYPE_BYTES,
    SAFETENSORS_DTYPES,
    Chunks,
    tensor_chunks,
    write_safetensors,
)
from recsys.table_names import feature_of, table_name

__all__ = ["ExportOptions", "export_bundle"]

_TABLE_KEY = re.compile(r"(?:^|\.)embedding_bags\.(?P<table>[^.]+)\.weight$")
# LMDB page and key overhead over the packed rows, for the first map size (it doubles when full).
_MAP_SLACK = 1.5


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class ExportOptions:
    """How to export.

    Attributes:
        buffer_rows: rows held in memory at once while copying a table (bounds the peak memory).
        keep_optimizer_state: also write each row's optimizer state (to continue training elsewhere).
    """

    buffer_rows: int = 1 << 16
    keep_optimizer_state: bool = False

    def __post_init__(self) -> None:
        if self.buffer_rows < 1:
            raise UserError(f"--buffer-rows must be >= 1, got {self.buffer_rows}")


# -- the checkpoint's pieces --------------------------------------------------------------------------


def _load_rank(checkpoint: Path, rank: int) -> dict[str, Any]:
    # Memory-mapped: shards are read page by page as they are copied, never all at once.
    return torch.load(checkpoint / f"rank_{rank}.pt", weights_only=True, mmap=True)


def _snapshot_tables(snapshot: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """The seed and per-table description recorded in a store snapshot (read-only, no lock file)."""
    try:
        reader = open_snapshot(snapshot, seed=None)
        try:
            return int(reader.seed), {name: dict(desc) for name, desc in reader.tables.items()}
        finally:
            reader.close()
    except (StoreError, ValueError, TypeError) as err:
        raise UserError(f"store snapshot {snapshot} is unreadable ({type(err).__name__}: {err})") from None


def _table_blocks(payload: dict[str, Any], key: str, part: str) -> list[tuple[int, torch.Tensor]]:
    """``(row offset, block)`` of every local shard of one tensor of a rank file (``part``: model or a
    fused-optimizer state path)."""
    if part == "model":
        shards, where = payload["model"][key], f"model.{key}"
    else:
        shards, where = payload["fused_optimizer"][key][part], f"fused_optimizer.{key}.{part}"
    offsets = payload["shard_offsets"].get(where, [])
    return [(int(off[0]), t) for t, off in zip(shards, offsets, strict=True)]


def _assembled(
    checkpoint: Path, world: int, key: str, part: str, rows: int
) -> tuple[tuple[int, ...], Chunks]:
    """Shape and chunked rows of a table (or its state) assembled from every rank's blocks by offset."""
    blocks = []
    for rank in range(world):
        payload = _load_rank(checkpoint, rank)
        if part == "model" or key in payload["fused_optimizer"]:
            blocks += [(off, rank, tuple(t.shape)) for off, t in _table_blocks(payload, key, part)]
        del payload
    blocks.sort()
    total = 0
    for off, _rank, shape in blocks:
        if off != total:
            raise UserError(
                f"checkpoint {checkpoint}: the shards of {key} do not tile it (rows {total}..{off} missing)"
            )
        total += shape[0]
    if not blocks:
        raise UserError(f"checkpoint {checkpoint}: no rank holds {key} ({part})")
    shape = (total, *blocks[0][2][1:])

    def chunks() -> Iterator[np.ndarray]:
        for off, rank, _ in blocks:
            payload = _load_rank(checkpoint, rank)  # the mapping ends with this block: RSS stays bounded
            block = dict(_table_blocks(payload, key, part))[off]
            yield from tensor_chunks(block, rows)()
            del payload, block

    return shape, chunks


def _state_name(payload: dict[str, Any], key: str, table: str) -> str | None:
    for name in payload["fused_optimizer"].get(key, {}):
        if name.startswith(f"{table}.momentum"):
            return name
    return None


def _in_precision(chunks: Chunks, dtype: type, what: str) -> Chunks:
    """``chunks`` as ``dtype``: an fp16 table trained with stochastic rounding is checkpointed as float32
    holding float16 values; a value the conversion would change is refused, never rounded."""

    def converted() -> Iterator[np.ndarray]:
        for chunk in chunks():
            if chunk.dtype != dtype:
                narrow = chunk.astype(dtype)
                if not np.array_equal(narrow.astype(chunk.dtype), chunk, equal_nan=True):
                    raise UserError(
                        f"export: {what} holds values that are not {np.dtype(dtype).name} numbers"
                    )
                chunk = narrow
            yield chunk

    return converted


# -- tiered tables: merge the ranks' snapshots into one LMDB ------------------------------------------


class _TieredWriter:
    """The bundle's LMDB: one named DB per table, rows appended in ascending id order."""

    def __init__(self, path: Path, *, tables: int, map_bytes: int) -> None:
        path.mkdir(parents=True)
        # lock=False: one writer, and the result is read-only (no lock.mdb in the bundle).
        self._env = lmdb.open(
            str(path), map_size=max(map_bytes, 1 << 20), subdir=True, max_dbs=tables + 1,
            lock=False, sync=False, metasync=False, readahead=False,
        )  # fmt: skip
        self._dbs: dict[str, Any] = {}

    def append(self, table: str, ids: np.ndarray, values: np.ndarray) -> None:
        keys = np.ascontiguousarray(ids, dtype=">u8").view("V8").tolist()
        vals = np.ascontiguousarray(values, dtype="<f4")
        items = list(zip(keys, vals.view(f"V{vals.shape[1] * 4}").reshape(-1).tolist(), strict=True))
        if table not in self._dbs:
            self._dbs[table] = self._env.open_db(table.encode(), create=True)
        while True:
            try:
                with self._env.begin(write=True, db=self._dbs[table]) as txn:
                    _, added = txn.cursor().putmulti(items, append=True)
                if added != len(items):
                    raise UserError(
                        f"export: table {table}: {len(items) - added} rows were not appended in id order"
                    )
                return
            except lmdb.MapFullError:  # the transaction was aborted: grow the map and write it again
                self._env.set_mapsize(2 * self._env.info()["map_size"])

    def close(self) -> None:
        try:
            self._env.sync(True)
        finally:
            self._env.close()


# -- the export ---------------------------------------------------------------------------------------


def _arch(config: Any) -> dict[str, Any]:
    return config_to_dict(config.model)


def export_bundle(
    run: Path, out: Path, *, checkpoint: str | None = None, options: ExportOptions = ExportOptions()
) -> dict[str, Any]:
    """Write the serving bundle of a checkpoint of ``run`` (default: the newest) to ``out``.

    Returns a report: the checkpoint, per table its kind and rows, the bundle's bytes and the seconds.

    Raises:
        UserError: ``out`` exists, no such checkpoint, a damaged one, or one that does not fit its config.
    """
    started = time.perf_counter()
    if os.path.lexists(out):
        raise UserError(f"--out {out} exists; remove it or choose another bundle directory")
    path = find_checkpoint(run, checkpoint)
    config, source = run_config(run, path, [])
    meta = checkpoint_meta(path)
    remove_stale(out)  # what an export killed outright (SIGKILL) left beside it
    tmp = temporary(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        order = meta.get("features") or _dataset_order(config)
        spec = meta.get("spec") if meta.get("features") else _recorded_spec(config)
        report = _write(path, tmp, config=config, meta=meta, order=order, options=options)
        model = {
            **report.pop("model"),
            "source": {
                "run": str(run.resolve()),
                "checkpoint": path.name,
                "step": int(meta["step"]),
                "world_size": int(meta["world_size"]),
                "config_from": str(source),
                "model_digest": _digest_of(run, int(meta["step"])),
            },
            "config": config_to_dict(config),
            "spec": spec,  # the dataset spec's field transforms, for raw records (recsys.serving.raw)
        }
        (tmp / MODEL).write_text(json.dumps(model, indent=1) + "\n", encoding="utf-8")
        files = [MODEL, DENSE, TABLES] + ([TIERED] if (tmp / TIERED).exists() else [])
        manifest = {"format": FORMAT, "version": VERSION, "files": describe_files(tmp, files)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        for name in [*files, MANIFEST]:
            os.chmod(tmp / name, 0o444)  # a bundle is read-only; the scorer opens its LMDB read-only
        tmp.rename(out)
    except BaseException as err:  # an error, a full disk, SIGINT: no half-written bundle stays
        shutil.rmtree(tmp, ignore_errors=True)
        failure = write_failure(err, out, "export again")
        if failure is None:
            raise
        raise failure from err
    report.update(
        bundle=str(out),
        checkpoint=str(path),
        step=int(meta["step"]),
        bytes=sum((out / n).stat().st_size for n in files),
        seconds=time.perf_counter() - started,
    )
    return report


def _recorded_spec(config: Any) -> dict[str, Any] | None:
    """The dataset spec the config names, for a checkpoint saved before checkpoints recorded it."""
    from recsys.data.source import spec_of
    from recsys.data.spec import spec_to_dict

    spec = spec_of(config.data)
    return None if spec is None else spec_to_dict(spec)


def _dataset_order(config: Any) -> list[str]:
    """The sparse features in the dataset's order, which the model was built in, for a checkpoint saved
    before checkpoints recorded the model's order (``meta.json``'s ``features``)."""
    from recsys.data.source import build_dataset

    return list(build_dataset(config.data, synthetic=config.synthetic, seed=config.train.seed).feature_names)


def _digest_of(run: Path, step: int) -> str | None:
    """``summary.json``'s model digest when it describes this step (the final checkpoint), else None."""
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads((run / "summary.json").read_text())
        if summary.get("steps") == step:
            return summary.get("model_digest")
    return None


def _write(
    checkpoint: Path,
    out: Path,
    *,
    config: Any,
    meta: dict[str, Any],
    order: list[str],
    options: ExportOptions,
) -> dict[str, Any]:
    """Write dense.safetensors, tables.safetensors and tiered/data.mdb; returns the model description.
    ``meta``: the checkpoint's :func:`recsys.checkpoint.checkpoint_meta`; ``order``: the sparse features
    in the order the model's interaction consumes them."""
    world = int(meta["world_size"])
    first = _load_rank(checkpoint, 0)
    table_keys = {m["table"]: key for key in first["model"] if (m := _TABLE_KEY.search(key))}
    if sorted(table_name(f) for f in order) != sorted(table_keys):
        raise UserError(
            f"checkpoint {checkpoint}: the model's features {order} do not match its tables {sorted(table_keys)}"
        )
    dense = {k: v for k, v in first["model"].items() if not _TABLE_KEY.search(k)}
    bad = sorted(
        k for k, v in dense.items() if not isinstance(v, torch.Tensor) or v.dtype not in SAFETENSORS_DTYPES
    )
    if bad:
        raise UserError(
            f"checkpoint {checkpoint}: dense state {bad[0]} is not a plain float or integer tensor"
        )
    entries = [
        (k, tuple(v.shape), SAFETENSORS_DTYPES[v.dtype], tensor_chunks(v, options.buffer_rows))
        for k, v in dense.items()
    ]
    write_safetensors(out / DENSE, entries, {"format": FORMAT})
    first_layer = dense.get(
        "model.dense_arch.weight", dense.get("model.dense_arch.model._mlp.0._linear.weight")
    )
    if first_layer is None:
        raise UserError(f"checkpoint {checkpoint}: no dense_arch weights; is it a model of recsys.models?")
    num_dense = int(first_layer.shape[1])
    del first, dense
    kept = kept_rows(checkpoint, sorted(table_keys), meta["bounds"])  # bounded tables' rows
    state_names: dict[str, str | None] = dict.fromkeys(table_keys)
    for rank in range(world):  # table-wise, only the rank holding a table has its optimizer state
        payload = _load_rank(checkpoint, rank)
        for t, k in table_keys.items():
            state_names[t] = state_names[t] or _state_name(payload, k, t)
        del payload

    snapshots = sorted(checkpoint.glob("store_rank_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    layouts: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for snap in snapshots:
        seed, tables = _snapshot_tables(snap)
        if seed != config.train.seed:
            raise UserError(
                f"store snapshot {snap} was written with seed {seed}, the config says train.seed={config.train.seed}"
            )
        for name, layout in tables.items():
            layouts.setdefault(name, []).append((snap, layout))

    precision = config.sparse.weights_precision
    weight_type = SAFETENSORS_DTYPES[getattr(torch, precision.dtype)]  # plain tables keep their precision
    features, plain_entries = [], []
    for table, key in table_keys.items():
        if table in layouts:
            continue
        shape, chunks = _assembled(checkpoint, world, key, "model", options.buffer_rows)
        keep = kept.get(table)
        feature = {
            "name": feature_of(table),
            "table": table,
            "kind": "plain",
            "dim": shape[1],
            "rows": shape[0],
        }
        if keep is not None:  # only the kept rows, then their ids (the default row's last)
            if shape[0] != int(keep[-1]) + 1:
                raise UserError(
                    f"checkpoint {checkpoint}: table {table} has {shape[0]} rows, its default row's id is {int(keep[-1])}"
                )
            chunks = restricted_chunks(chunks, keep, table)
            shape = (keep.shape[0], shape[1])
            feature.update(rows=shape[0], default_id=int(keep[-1]))
        chunks = _in_precision(
            chunks, getattr(np, precision.dtype), f"checkpoint {checkpoint}: table {table}"
        )
        plain_entries.append((f"{table}.weight", shape, weight_type, chunks))
        if keep is not None:
            plain_entries.append((f"{table}.ids", keep.shape, "I64", lambda k=keep: iter([k])))
        features.append(feature)
        if options.keep_optimizer_state and state_names[table] is not None:
            state_shape, state_chunks = _assembled(
                checkpoint, world, key, state_names[table], options.buffer_rows
            )  # type: ignore[arg-type]
            if keep is not None:
                state_chunks = restricted_chunks(state_chunks, keep, table)
                state_shape = (keep.shape[0], *state_shape[1:])
            plain_entries.append((f"{table}.state", state_shape, "F32", state_chunks))
    write_safetensors(out / TABLES, plain_entries, {"format": FORMAT})
    table_bytes: dict[str, int] = {}  # what each table's rows take in the bundle (its tensors' bytes)
    for name, shape, kind, _ in plain_entries:
        table = name.rsplit(".", 1)[0]
        table_bytes[table] = table_bytes.get(table, 0) + math.prod(shape) * DTYPE_BYTES[kind]

    tiered = [t for t in table_keys if t in layouts]
    row_floats = None
    if tiered:
        map_bytes = int(_MAP_SLACK * sum((s / "data.mdb").stat().st_size for s in snapshots))
        writer = _TieredWriter(out / Path(TIERED).parent, tables=len(tiered), map_bytes=map_bytes)
        try:
            for table in tiered:
                rows, floats, spec_layout = copy_tiered(
                    writer, table, layouts[table], (config, kept.get(table)), options
                )
                row_floats = floats if row_floats is None else row_floats
                table_bytes[table] = rows * floats * 4  # a stored row is ``floats`` 4-byte words
                if floats != row_floats:
                    raise UserError(f"export: tiered tables have rows of {row_floats} and {floats} floats")
                features.append(
                    {"name": feature_of(table), "table": table, "kind": "tiered", "dim": spec_layout["dim"],
                     "rows": rows, "id_space": spec_layout["num_embeddings"]}
                    | ({"default_id": int(kept[table][-1])} if table in kept else {})
                )  # fmt: skip
        finally:
            writer.close()
    # The model's feature order (its interaction's), never the state dict's (sorted) key order.
    position = {table_name(name): i for i, name in enumerate(order)}
    features.sort(key=lambda f: position[f["table"]])
    optimizer = OptimizerKind(config.sparse.optimizer.value)
    dim = features[0]["dim"]
    spec = TableSpec(name="t", dim=dim, optimizer=optimizer, weights_precision=precision)
    kept = optimizer.state_floats(dim) if options.keep_optimizer_state else 0
    model = {
        "model": _arch(config),
        "num_dense": num_dense,
        "interaction_order": list(order),
        "features": features,
        "init": {"seed": config.train.seed, "scale": config.sparse.init_scale},
        "row_floats": row_floats if row_floats is not None else spec.weight_words + kept,
        "weights_precision": precision.value,
        "optimizer": {
            "name": optimizer.value,
            "state_floats": optimizer.state_floats(dim),
            "kept": options.keep_optimizer_state,
        },
    }
    return {
        "model": model,
        "tables": {
            f["table"]: {"kind": f["kind"], "rows": f["rows"], "bytes": table_bytes[f["table"]]}
            for f in features
        },
    }
