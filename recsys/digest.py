"""The model digest: one hash of a model's whole state that does not depend on sharding or tiering.

It covers the dense parameters (by name) and, per table (by name), every row that differs from its
deterministic initial value together with its optimizer state, in ascending id order. Rows still at their
initial value with zero optimizer state are *pristine* and skipped: an untiered table holds all of them,
a tiered table never materialises most of them, and both must hash the same. Two runs that end in the
same state, bit for bit, have the same digest, however their tables were placed.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embedding_store.init import init_rows
from recsys.sharding import local_shards

__all__ = ["model_digest", "touched_rows", "hash_rows"]


@torch.no_grad()
def touched_rows(
    weight: torch.Tensor, state: torch.Tensor | None, *, table: str, row_offset: int, seed: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The non-pristine rows of one block: (ids (k,), weights (k, D), state (k,) / (k, D) / None)."""
    n, d = weight.shape
    ids = torch.arange(row_offset, row_offset + n, dtype=torch.int64)
    initial = init_rows(ids, dim=d, seed=seed, table=table, scale=scale)
    changed = (weight.cpu() != initial).any(dim=1)
    if state is not None:
        flat = state.cpu().reshape(n, -1)
        changed |= (flat != 0).any(dim=1)
    keep = changed.nonzero().squeeze(1)
    return ids[keep], weight.cpu()[keep], None if state is None else state.cpu()[keep]


def hash_rows(h: hashlib._Hash, ids: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> None:
    """Feed rows to a hash in ascending id order (little-endian ids, float32 weights, then state)."""
    order = torch.argsort(ids)
    parts = [ids[order].numpy().astype("<i8").reshape(-1, 1).view(np.uint8)]
    parts.append(weight[order].contiguous().numpy().astype("<f4").view(np.uint8))
    if state is not None:
        parts.append(state[order].reshape(len(ids), -1).contiguous().numpy().astype("<f4").view(np.uint8))
    h.update(np.ascontiguousarray(np.concatenate(parts, axis=1)).tobytes())


def model_digest(
    dmp: DistributedModelParallel, tables: list[EmbeddingBagConfig], *, seed: int, init_scale: float
) -> str:
    """Hex digest of the model's dense parameters and touched embedding rows; collective over all ranks.

    Every rank must call it; every rank gets the digest.
    """
    h = hashlib.blake2b(digest_size=16)
    dense = {
        k: v
        for k, v in dmp.state_dict().items()
        if isinstance(v, torch.Tensor) and not hasattr(v, "local_shards")
    }
    for name in sorted(dense):
        if "embedding_bags." in name:
            continue
        h.update(name.encode())
        h.update(dense[name].detach().cpu().contiguous().numpy().astype("<f4").tobytes())
    mine: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
    for shard in local_shards(dmp, tables):
        assert shard.col_offset == 0, "column-wise sharding is not offered"
        mine.setdefault(shard.table, []).append(
            touched_rows(
                shard.weight,
                shard.state,
                table=shard.table,
                row_offset=shard.row_offset,
                seed=seed,
                scale=init_scale,
            )
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered: list[dict] = [mine]
    if world > 1:
        gathered = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine)
    for table in sorted(t.name for t in tables):
        blocks = [blk for part in gathered for blk in part.get(table, [])]
        ids = torch.cat([b[0] for b in blocks])
        weight = torch.cat([b[1] for b in blocks])
        state = None if blocks[0][2] is None else torch.cat([b[2] for b in blocks])
        h.update(table.encode())
        hash_rows(h, ids, weight, state)
    return h.hexdigest()
