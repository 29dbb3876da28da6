"""The model digest: one hash of a model's whole state that does not depend on sharding or tiering.

It covers the dense parameters (by name) and, per table (by name), every row that differs from its
deterministic initial value together with its optimizer state, in ascending id order. Rows still at their
initial value with zero optimizer state are *pristine* and skipped: an untiered table holds all of them,
a tiered table never materialises most of them, and both must hash the same. Two runs that end in the
same state, bit for bit, have the same digest, however their tables were placed or cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embedding_store.init import init_rows
from recsys.sharding import local_shards

__all__ = ["model_digest", "touched_rows", "hash_rows", "Rows"]

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # ids (n,), weights (n, D), state or None


@torch.no_grad()
def touched_rows(
    rows: Rows, *, table: str, seed: int, scale: float, dtype: torch.dtype = torch.float32
) -> Rows:
    """The non-pristine rows of a block: those that differ from their initial value or have state.
    ``dtype``: the weights' storage precision; fp16 tables start from the initial rows rounded to nearest
    even (as the store rounds them), whether a block holds them as float16 or float32."""
    ids, weight, state = rows
    weight = weight.cpu()
    initial = (
        init_rows(ids, dim=weight.shape[1], seed=seed, table=table, scale=scale).to(dtype).to(weight.dtype)
    )
    changed = (weight != initial).any(dim=1)
    if state is not None:
        state = state.cpu()
        changed |= (state.reshape(len(ids), -1) != 0).any(dim=1)
    keep = changed.nonzero().squeeze(1)
    return ids[keep], weight[keep], None if state is None else state[keep]


def hash_rows(h: hashlib._Hash, rows: Rows) -> None:
    """Feed rows to a hash in ascending id order (little-endian ids, float32 weights, then state)."""
    ids, weight, state = rows
    order = torch.argsort(ids)
    parts = [ids[order].numpy().astype("<i8").reshape(-1, 1).view(np.uint8)]
    parts.append(weight[order].contiguous().numpy().astype("<f4").view(np.uint8))
    if state is not None:
        parts.append(state[order].reshape(len(ids), -1).contiguous().numpy().astype("<f4").view(np.uint8))
    h.update(np.ascontiguousarray(np.concatenate(parts, axis=1)).tobytes())


def dense_rows(dmp: DistributedModelParallel, tables: list[EmbeddingBagConfig]) -> Iterator[tuple[str, Rows]]:
    """This rank's rows of in-memory tables: each local shard, ids from its row offset."""
    for shard in local_shards(dmp, tables):
        assert shard.col_offset == 0, "column-wise sharding is not offered"
        n = shard.weight.shape[0]
        ids = torch.arange(shard.row_offset, shard.row_offset + n, dtype=torch.int64)
        yield shard.table, (ids, shard.weight, shard.state)


def model_digest(
    dmp: DistributedModelParallel,
    table_names: list[str],
    local_rows: Iterable[tuple[str, Rows]],
    *,
    seed: int,
    init_scale: float,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Hex digest of dense parameters and touched rows; collective over all ranks, every rank gets it.

    Args:
        dmp: the sharded model (its dense parameters are read).
        table_names: every embedding table of the model.
        local_rows: this rank's rows, as ``(table, (ids, weights, state))`` blocks; a row id appears on
            exactly one rank.
        seed: the run's seed (initial values come from it).
        init_scale: the tables' initialisation scale.
        dtype: the tables' weights precision (``sparse.weights_precision``).
    """
    h = hashlib.blake2b(digest_size=16)
    state = dmp.state_dict()
    for name in sorted(state):
        value = state[name]
        if "embedding_bags." in name or not isinstance(value, torch.Tensor) or hasattr(value, "local_shards"):
            continue
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().astype("<f4").tobytes())
    mine: dict[str, list[Rows]] = {}
    for table, rows in local_rows:
        mine.setdefault(table, []).append(
            touched_rows(rows, table=table, seed=seed, scale=init_scale, dtype=dtype)
        )
    gathered: list[dict[str, list[Rows]]] = [mine]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        gathered = [{} for _ in range(world)]
        dist.all_gather_object(gathered, mine)
    for table in sorted(table_names):
        blocks = [blk for part in gathered for blk in part.get(table, [])]
        h.update(table.encode())
        if not blocks:
            continue
        ids = torch.cat([b[0] for b in blocks])
        weight = torch.cat([b[1] for b in blocks])
        stacked = None if blocks[0][2] is None else torch.cat([b[2] for b in blocks])  # type: ignore[misc]
        hash_rows(h, (ids, weight, stacked))
    return h.hexdigest()
