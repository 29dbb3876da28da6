"""A store's metadata: what it records about itself, and the checks made when it is opened again.

Every backend records (LMDB: JSON in the ``__meta__`` database; memory: the file's header) ``format``,
``seed``, ``layout``, the LMDB ``page_size`` (LMDB layouts only) and per table its identity (``dim``,
``optimizer``, ``num_embeddings``, ``init_scale``, ``dtype``), its ``row_bytes`` and, in the log layout,
its geometry (``block_rows``, ``segment_rows``). A store is read with what it recorded, never with this
code's constants, and what this code cannot read is refused with StoreIncompatibleError naming the
field, the recorded value and this code's. A leaf module: no LMDB.

Format 1 (the previous format) recorded no geometry: its log blocks held ``LEGACY_BLOCK_BYTES //
row_bytes`` rows, its segment size was the top-level ``segment_rows``. :func:`upgrade` describes such a
store as format 2 with that geometry (the caller writes it back only when it may write).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from embedding_store.config import OptimizerKind, TableSpec
from embedding_store.errors import StoreCorruptError, StoreIncompatibleError

__all__ = [
    "FORMAT_VERSION",
    "LAYOUTS",
    "LEGACY_BLOCK_BYTES",
    "check_tables",
    "decode",
    "encode",
    "max_block_bytes",
    "new_meta",
    "table_meta",
    "upgrade",
]

FORMAT_VERSION = 2
LAYOUTS = ("log", "btree", "memory")
# Format 1's block bytes (rows per block: LEGACY_BLOCK_BYTES // row_bytes); kept apart from the current
# BLOCK_BYTES so that a change of that constant never changes how a format-1 store is read.
LEGACY_BLOCK_BYTES = 2016
# The identity of a table: a store of other values holds other rows.
_IDENTITY = ("dim", "optimizer", "num_embeddings", "init_scale", "dtype")

Meta = dict[str, Any]


def max_block_bytes(page_size: int) -> int:
    """The largest log block LMDB keeps inside a leaf page of ``page_size`` bytes (two nodes a page, a
    16-byte page header, a node header and an 8-byte key each): 2016 bytes for 4 KiB pages."""
    return (page_size - 16) // 2 - 24


def table_meta(spec: TableSpec) -> dict[str, object]:
    """The identity of ``spec``'s table as recorded."""
    return {
        "dim": spec.dim,
        "optimizer": spec.optimizer.value,
        "num_embeddings": spec.num_embeddings,
        "init_scale": spec.init_scale,
        "dtype": spec.weights_precision.dtype,
    }


def new_meta(*, seed: int, layout: str, page_size: int | None) -> Meta:
    """The metadata of a new, empty store (tables are added by :func:`check_tables`)."""
    meta: Meta = {"format": FORMAT_VERSION, "seed": seed, "layout": layout, "tables": {}}
    if page_size is not None:
        meta["page_size"] = page_size
    return meta


def encode(meta: Meta) -> bytes:
    return json.dumps(meta, sort_keys=True).encode()


def decode(raw: bytes, where: str) -> Meta:
    """Parse recorded metadata (any format); StoreCorruptError when it is not a JSON object with tables."""
    try:
        meta = json.loads(bytes(raw))
        if not isinstance(meta, dict) or not isinstance(meta.get("tables"), dict):
            raise ValueError("no tables")
    except (ValueError, TypeError) as err:
        raise StoreCorruptError(f"unreadable store metadata in {where}") from err
    return meta


def _refuse(where: str, field: str, recorded: object, have: str) -> StoreIncompatibleError:
    return StoreIncompatibleError(f"store {where}: {field} is recorded as {recorded!r}, {have}")


def upgrade(meta: Meta, where: str, *, page_size: int | None) -> tuple[Meta, bool]:
    """``meta`` in format 2 and whether it was upgraded from format 1 (geometry of format 1's code).

    Raises:
        StoreIncompatibleError: a format this code cannot read (newer, or unknown).
    """
    fmt = meta.get("format")
    if fmt == FORMAT_VERSION:
        return meta, False
    if fmt != 1:
        newer = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > FORMAT_VERSION
        raise _refuse(
            where,
            "format",
            fmt,
            f"{'newer than' if newer else 'unknown to'} this code, which reads formats 1 and {FORMAT_VERSION}",
        )
    layout, segment_rows = meta.get("layout", "btree"), meta.get("segment_rows", 0)
    if (
        layout not in ("btree", "log")
        or not isinstance(segment_rows, int)
        or (layout == "log" and segment_rows < 1)
    ):
        raise StoreCorruptError(f"unknown store layout {layout!r} (segment rows {segment_rows!r}) in {where}")
    out = new_meta(seed=meta.get("seed"), layout=layout, page_size=page_size)  # type: ignore[arg-type]
    for name, have in meta["tables"].items():
        try:
            row_bytes = 4 * (have["dim"] + OptimizerKind(have["optimizer"]).state_floats(have["dim"]))
        except (KeyError, TypeError, ValueError) as err:
            raise StoreCorruptError(f"unreadable description of table {name!r} in {where}") from err
        table = {**have, "row_bytes": row_bytes}
        if layout == "log":
            block = max(1, LEGACY_BLOCK_BYTES // row_bytes)
            table.update(block_rows=block, segment_rows=block * max(1, segment_rows // block))
        out["tables"][name] = table
    return out, True


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_tables(
    meta: Meta,
    where: str,
    *,
    seed: int,
    tables: Sequence[TableSpec],
    geometry: Callable[[TableSpec], tuple[int, int]] | None,
) -> bool:
    """Check a format-2 ``meta`` against this opener (seed, tables) and add the tables it lacks.

    Args:
        geometry: (block rows, segment rows) of a new table of the log layout (None: other layouts).

    Returns:
        whether ``meta`` changed (a table was added).

    Raises:
        StoreIncompatibleError: another seed, an unknown layout, a table of another identity or row size,
            or a log geometry this code cannot read (the field, its recorded value and ours named).
    """
    if meta.get("seed") != seed:
        raise StoreIncompatibleError(f"store {where} was written with seed {meta.get('seed')!r}, not {seed}")
    layout = meta.get("layout")
    if layout not in LAYOUTS:
        raise _refuse(where, "layout", layout, f"this code knows {', '.join(LAYOUTS)}")
    page_size = meta.get("page_size")
    if layout != "memory" and (not _int(page_size) or page_size < 512):
        raise _refuse(where, "page_size", page_size, "not a page size")
    page_size = page_size or 0
    changed = False
    for spec in tables:
        have = meta["tables"].get(spec.name)
        want = table_meta(spec)
        if have is None:
            have = {**want, "row_bytes": spec.row_bytes}
            if layout == "log":
                assert geometry is not None
                have["block_rows"], have["segment_rows"] = geometry(spec)
            meta["tables"][spec.name] = have
            changed = True
            continue
        identity = {key: have.get(key) for key in _IDENTITY}
        if identity != want:
            raise StoreIncompatibleError(
                f"table {spec.name!r} in {where} is {identity}, the spec asks for {want}"
            )
        if have.get("row_bytes") != spec.row_bytes:
            raise _refuse(
                where,
                f"table {spec.name!r} row_bytes",
                have.get("row_bytes"),
                f"its spec has {spec.row_bytes}",
            )
        if layout == "log":
            _check_geometry(where, spec, have, page_size)
    return changed


def _check_geometry(where: str, spec: TableSpec, have: dict[str, Any], page_size: int) -> None:
    block, segment = have.get("block_rows"), have.get("segment_rows")
    limit = max(1, max_block_bytes(page_size) // spec.row_bytes)
    if not _int(block) or not 1 <= block <= limit:
        raise _refuse(
            where,
            f"table {spec.name!r} block_rows",
            block,
            f"more than fit a leaf page of {page_size} bytes ({limit} rows of {spec.row_bytes} bytes)"
            if _int(block) and block > limit
            else "not a block size",
        )
    if not _int(segment) or segment < block or segment % block:
        raise _refuse(
            where, f"table {spec.name!r} segment_rows", segment, f"not a multiple of block_rows {block}"
        )
