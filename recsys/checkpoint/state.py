"""The dense model, the fused optimizers' state and the embedding shards of one rank, in its rank file."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from recsys.checkpoint import files as ckpt_files
from recsys.checkpoint.files import META, CheckpointError, _rank_world
from recsys.checkpoint.verify import _short, checkpoint_meta


def _leaves(value: Any) -> Any:
    """A state dict with every tensor (or ShardedTensor's local shards) detached to CPU."""
    if hasattr(value, "local_shards"):
        return [s.tensor.detach().cpu().clone() for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _leaves(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_leaves(v) for v in value]
    return value


@torch.no_grad()
def _copy_into(live: Any, saved: Any, where: str, skip: Callable[[str], bool] = lambda _: False) -> None:
    """Copy saved tensors into the live ones, in place (live storage is aliased by the kernels); what
    ``skip(path)`` names is left alone."""
    if skip(where):
        return
    if hasattr(live, "local_shards"):
        shards = live.local_shards()
        if len(shards) != len(saved):
            raise CheckpointError(f"checkpoint does not match the model at {where}: shard count differs")
        for shard, tensor in zip(shards, saved, strict=True):
            _copy_tensor(shard.tensor, tensor, where)
    elif isinstance(live, torch.Tensor):
        _copy_tensor(live, saved, where)
    elif isinstance(live, dict):
        for key, value in live.items():
            if skip(f"{where}.{key}"):
                continue
            if key not in saved:
                raise CheckpointError(f"checkpoint does not match the model: {where}.{key} is missing")
            _copy_into(value, saved[key], f"{where}.{key}", skip)


def _offsets(value: Any, where: str) -> dict[str, list[list[int]]]:
    """``{dotted path: [offsets of each local shard]}`` of every sharded tensor in a (nested) state dict."""
    if hasattr(value, "local_shards"):
        return {where: [list(s.metadata.shard_offsets) for s in value.local_shards()]}
    out: dict[str, list[list[int]]] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(_offsets(item, f"{where}.{key}"))
    return out


@torch.no_grad()
def _reshard_into(
    live: Any, saved: list[tuple[Any, dict[str, Any]]], where: str, skip: Callable[[str], bool]
) -> None:
    """Fill ``live`` (this rank's state under the new sharding) from every old rank's ``(state, offsets)``.

    A sharded tensor's local shard is assembled from the saved shards that overlap it (by their global
    offsets); anything else is replicated, and taken from old rank 0.
    """
    if skip(where):
        return
    if hasattr(live, "local_shards"):
        for shard in live.local_shards():
            lo = list(shard.metadata.shard_offsets)
            filled = 0
            for state, offsets in saved:
                for piece, off in zip(state, offsets.get(where, []), strict=True):
                    region = [
                        (max(a, b), min(a + n, b + m))
                        for a, n, b, m in zip(lo, shard.tensor.shape, off, piece.shape, strict=True)
                    ]
                    if any(start >= stop for start, stop in region):
                        continue
                    dst = tuple(
                        slice(start - a, stop - a) for (start, stop), a in zip(region, lo, strict=True)
                    )
                    src = tuple(
                        slice(start - b, stop - b) for (start, stop), b in zip(region, off, strict=True)
                    )
                    shard.tensor[dst] = piece[src]
                    filled += math.prod(stop - start for start, stop in region)
            if filled != shard.tensor.numel():
                raise CheckpointError(
                    f"checkpoint does not cover {where} at offsets {lo} under the new sharding"
                )
    elif isinstance(live, torch.Tensor):
        _copy_tensor(live, saved[0][0], where)
    elif isinstance(live, dict):
        for key, value in live.items():
            # Under table-wise sharding only the ranks that held a table saved its optimizer state.
            parts = [(state[key], offsets) for state, offsets in saved if key in state]
            if not parts:
                raise CheckpointError(f"checkpoint does not match the model: {where}.{key} is missing")
            _reshard_into(value, parts, f"{where}.{key}", skip)


def _copy_tensor(live: torch.Tensor, saved: torch.Tensor, where: str) -> None:
    if live.shape != saved.shape:
        raise CheckpointError(
            f"checkpoint does not match the model at {where}: shape {tuple(saved.shape)} vs {tuple(live.shape)}"
        )
    live.copy_(saved)


_PAYLOAD_KEYS = ("step", "world_size", "model", "fused_optimizer", "dense_optimizer", "rng")
# What torch.load and restoring a state raise for a file that is damaged or does not fit the model.
_LOAD_ERRORS = (
    OSError,
    RuntimeError,
    EOFError,
    pickle.UnpicklingError,
    KeyError,
    IndexError,
    TypeError,
    ValueError,
    AttributeError,
)


def _one_line(err: BaseException) -> str:
    """The error's type and first sentence (torch's messages go on with advice, such as loading the file
    with ``weights_only=False``, that does not apply to a damaged checkpoint)."""
    lines = str(err).strip().splitlines()
    first = lines[0].split(". ")[0].rstrip(".") if lines else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _load_rank_file(path: Path, rank: int, meta: dict[str, Any], *, mmap: bool = False) -> dict[str, Any]:
    """The payload of ``rank_{rank}.pt``, checked against ``meta.json``."""
    file = path / f"rank_{rank}.pt"
    try:
        payload = torch.load(file, weights_only=True, mmap=mmap)
    except _LOAD_ERRORS as err:
        raise CheckpointError(f"checkpoint file {file} cannot be loaded ({_one_line(err)})") from None
    if not isinstance(payload, dict) or not set(_PAYLOAD_KEYS) <= payload.keys():
        raise CheckpointError(
            f"checkpoint file {file} is not a rank file (it lacks {', '.join(_PAYLOAD_KEYS)})"
        )
    for key in ("step", "world_size"):
        if payload[key] != meta[key]:
            raise CheckpointError(
                f"checkpoint file {file} has {key} {_short(payload[key])}, {META} says {meta[key]}"
            )
    return payload


def load_checkpoint(path: Path, *, dmp: Any, dense_optimizer: Any, skip_tables: Collection[str] = ()) -> int:
    """Restore this rank's state from checkpoint ``path``; returns the step to continue from.

    A checkpoint written by another number of ranks is re-partitioned: every sharded tensor (embedding
    shards and their fused-optimizer state) is assembled from the old ranks' shards by global offsets;
    dense parameters and the dense optimizer are replicated and come from old rank 0. ``skip_tables``
    (tiered slot tables, whose rows the store restores into an empty device tier) are left alone, so
    their slots per owner may differ from the checkpoint's.

    Raises:
        CheckpointError: ``meta.json`` is refused by :func:`checkpoint_meta`, a rank file does not load,
            or its contents do not fit the model (one line, naming the file).
    """
    rank, world = _rank_world()
    meta = checkpoint_meta(path)
    old_world = meta["world_size"]

    def skip(where: str) -> bool:  # a tiered slot table, or its optimizer state
        return any(f"embedding_bags.{name}." in f"{where}." for name in skip_tables)

    try:
        if old_world == world:
            payload = _load_rank_file(path, rank, meta)
            _copy_into(dmp.state_dict(), payload["model"], "model", skip)
            fused = dmp.fused_optimizer.state_dict()["state"]
            _copy_into(fused, payload["fused_optimizer"], "fused_optimizer", skip)
        else:
            # mmap: the old ranks' files are read piece by piece, never all in memory at once.
            payloads = [_load_rank_file(path, q, meta, mmap=True) for q in range(old_world)]
            if any("shard_offsets" not in p for p in payloads):
                raise CheckpointError(
                    f"checkpoint {path} was written by {old_world} ranks, this run has {world}, and it "
                    "predates resharding (no shard offsets)"
                )

            for part in ("model", "fused_optimizer"):
                live = dmp.state_dict() if part == "model" else dmp.fused_optimizer.state_dict()["state"]
                _reshard_into(live, [(p[part], p["shard_offsets"]) for p in payloads], part, skip)
            payload = payloads[min(rank, old_world - 1)]
            payload["dense_optimizer"] = payloads[0]["dense_optimizer"]
        # Optimizers such as Adam create their state lazily on the first step; a zero-gradient step creates
        # it (leaving the parameters unchanged) so that the saved state can be loaded into it.
        dense_optimizer.init_state()
        dense_optimizer.load_state_dict(payload["dense_optimizer"])
        torch.set_rng_state(payload["rng"])
    except CheckpointError:  # a UserError, hence a ValueError: already says what does not fit
        raise
    except _LOAD_ERRORS as err:  # a file that verified but whose contents do not fit
        raise CheckpointError(f"checkpoint {path} does not fit this run ({_one_line(err)})") from None
    return int(meta["step"])


class ModelState:
    """The checkpoint part of the sharded model: dense parameters, embedding shards, the fused and the
    dense optimizers' state and the RNG, in ``rank_<r>.pt`` (``torch.load(weights_only=True)``).

    Args:
        dmp: the DistributedModelParallel (``state_dict()``, ``fused_optimizer``).
        dense_optimizer: the optimizer of the dense parameters.
        skip_tables: tables whose rows another part restores (tiered slot tables: the store's) and that
            re-partitioning leaves alone.
    """

    def __init__(self, dmp: Any, dense_optimizer: Any, *, skip_tables: Collection[str] = ()) -> None:
        self.dmp = dmp
        self.dense_optimizer = dense_optimizer
        self.skip_tables = tuple(skip_tables)

    def save(self, into: Any) -> list[Path]:
        model_state, fused_state = self.dmp.state_dict(), self.dmp.fused_optimizer.state_dict()["state"]
        payload = {
            "step": into.step,
            "world_size": into.world_size,
            "model": _leaves(model_state),
            "fused_optimizer": _leaves(fused_state),
            "dense_optimizer": _leaves(self.dense_optimizer.state_dict()),
            "rng": torch.get_rng_state(),
            # Where each local shard sits in its table: a checkpoint can be loaded by another number of ranks.
            "shard_offsets": _offsets(model_state, "model") | _offsets(fused_state, "fused_optimizer"),
        }
        final = into.path / f"rank_{into.rank}.pt"
        return [ckpt_files.write_file_durably(final, lambda f: torch.save(payload, f))]

    def restore(self, source: Any) -> None:
        load_checkpoint(
            source.path, dmp=self.dmp, dense_optimizer=self.dense_optimizer, skip_tables=self.skip_tables
        )
