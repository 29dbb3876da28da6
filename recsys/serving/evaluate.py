"""``recsys evaluate``: AUC and log loss of a checkpoint on the held-out split, on any number of ranks.

Each rank builds the trainer's own model for the checkpoint's config (:class:`recsys.trainer.Trainer`),
restores the checkpoint into it — plain tables and dense weights from the rank files, tiered rows from
the store snapshots copied into a scratch store, re-partitioned when the number of ranks differs — and
runs its :class:`~recsys.evaluation.Evaluator`, the very code that computed ``summary.json``'s figures. The run directory
is only read: its store and metrics are never touched, so a running training can be evaluated.

With the checkpoint's number of ranks and the config's ``eval.batch_size``, every batch is the one the
training run scored, so the final checkpoint reproduces ``summary.json``'s ``auc`` and ``logloss`` exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recsys.checkpoint import checkpoint_meta
from recsys.config import RunConfig
from recsys.data.source import check_source
from recsys.distributed import free_port, init_distributed, launched_by_torchrun, set_local_rank_env
from recsys.errors import UserError
from recsys.serving.runs import find_checkpoint, run_config
from recsys.trainer import Trainer

__all__ = ["evaluate_checkpoint", "held_out_logits", "restore"]

log = logging.getLogger("recsys")


def restore(trainer: Trainer, checkpoint: Path) -> int:
    """Load ``checkpoint`` into a fresh trainer (collective), as ``--resume`` would but without
    touching the run directory; returns its step."""
    return trainer.restore(checkpoint, check_fingerprint=False)


def held_out_logits(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's logits and labels of the held-out split (collective), batch by batch as
    :meth:`Evaluator.evaluate <recsys.evaluation.Evaluator.evaluate>` computes them before it reduces
    them to AUC and log loss."""
    return trainer.evaluator.predict()


@dataclasses.dataclass(frozen=True)
class _Job:
    config: RunConfig
    checkpoint: Path
    keep_logits: bool


def _evaluate_rank(job: _Job) -> dict[str, Any]:
    """One rank's evaluation; every rank returns the metrics (and, if asked, its logits and labels)."""
    env = init_distributed(
        threads_per_rank=job.config.train.threads_per_rank, timeout_s=job.config.train.collective_timeout_s
    )
    trainer = Trainer(job.config, env, out_dir=Path(job.config.store.path).parent)
    try:
        step = restore(trainer, job.checkpoint)
        scores = trainer.evaluator.evaluate()
        result: dict[str, Any] = {
            "step": step,
            "auc": scores.auc,
            "logloss": scores.logloss,
            **scores.ranking,
            "world_size": env.world_size,
        }
        if job.keep_logits:
            # As numpy: torch would pass tensors to the parent as shared memory, which this process
            # (about to exit) owns.
            result["logits"], result["labels"] = (t.numpy() for t in held_out_logits(trainer))
        return result
    finally:
        trainer.close(flush=False)  # the scratch store's rows are not needed again


def _entry(rank: int, nproc: int, port: int, job: _Job, queue: Any) -> None:
    """A spawned worker: one rank, its result or its one-line error sent to the parent."""
    from recsys.cli import quiet_libraries
    from recsys.lifetime import die_with_parent

    die_with_parent()
    set_local_rank_env(rank, nproc, port)
    quiet_libraries()
    code = 0
    try:
        queue.put(("ok", rank, _evaluate_rank(job)))
    except UserError as err:
        queue.put(("user", rank, str(err)))
        code = 2
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which prints it
        queue.put(("error", rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # As the training workers do: skip the interpreter's teardown, where gloo's threads may abort.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawn(nproc: int, job: _Job) -> list[dict[str, Any]]:
    """Run ``job`` on ``nproc`` local ranks; results by rank. A failure stops the others."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(
        _entry, args=(nproc, free_port(), job, queue), nprocs=nproc, join=False, start_method="spawn"
    )
    messages: list[tuple[str, int, Any]] = []

    def drain() -> None:  # while waiting: a large result must not fill the pipe and block its sender
        while not queue.empty():
            messages.append(queue.get())

    try:
        while not procs.join(timeout=0.2):
            drain()
    except mp.ProcessExitedException:
        pass
    drain()
    errors = [m for m in messages if m[0] != "ok"]
    if errors or len(messages) < nproc:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
        if not errors:
            raise RuntimeError("an evaluation worker exited without a result")
        kind, rank, message = errors[0]
        if kind == "user":
            raise UserError(message)
        raise RuntimeError(f"evaluation worker {rank} failed: {message}")
    return [m[2] for m in sorted(messages, key=lambda m: m[1])]


def evaluate_checkpoint(
    run: Path,
    *,
    checkpoint: str | None = None,
    overrides: tuple[str, ...] = (),
    nproc: int | None = None,
    keep_logits: bool = False,
) -> list[dict[str, Any]]:
    """Evaluate a checkpoint of ``run`` on ``nproc`` ranks (default: as many as wrote it).

    Returns per rank ``{"step", "auc", "logloss", "world_size", "checkpoint", "config_from"}`` (the
    metrics are over all ranks), with ``keep_logits`` also that rank's ``logits`` and ``labels``.
    Under torchrun, this process's rank only.

    Raises:
        UserError: no such checkpoint, a damaged one, a config that does not fit it (one line).
    """
    path = find_checkpoint(run, checkpoint)
    ranks = nproc or int(checkpoint_meta(path)["world_size"])
    if ranks < 1:
        raise UserError(f"--nproc must be >= 1, got {ranks}")
    config, source = run_config(run, path, [*overrides, f"train.nproc={ranks}"])
    check_source(config.data)
    with tempfile.TemporaryDirectory(prefix="tierrec-evaluate-") as scratch:
        # The scratch store: never the run's own, which a running training may hold.
        store = dataclasses.replace(config.store, path=str(Path(scratch) / "store"))
        job = _Job(dataclasses.replace(config, store=store), path, keep_logits)
        results = [_evaluate_rank(job)] if launched_by_torchrun() else _spawn(ranks, job)
    for result in results:
        result.update(checkpoint=str(path), config_from=str(source))
        for key in ("logits", "labels"):
            if key in result:
                result[key] = torch.from_numpy(result[key])
    return results
