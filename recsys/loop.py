"""The training loop: steps through TorchRec's pipeline, logs, evaluates, checkpoints and stops.

The loop advances the run's progress (:class:`~recsys.train_state.TrainState`: the step, the last
checkpoint, the evaluation record, the pipeline's statistics); the trainer's other parts it only calls.
:class:`TrainLoop` takes its collaborators as arguments — where the batches come from (``feed``), what
shows progress (``progress``) and where metrics go (``metrics``) — so that a benchmark or a test passes
its own instead of patching modules.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from embedding_store import StoreCapacityError, StoreFullError
from embedding_store.memory import release_free_heap
from pipelines import StagedPipeline, StageFailed
from recsys.capacity_advice import too_few_slots
from recsys.data.batch import Batch
from recsys.errors import UserError
from recsys.lifetime import RunStopped
from recsys.selection import Evaluation
from recsys.tier_metrics import BoundsMetrics
from recsys.tiered import row_bytes
from recsys.writing import writing

# Least seconds between two returns of malloc's free heap memory to the system (a logging step's; each
# takes a few ms to ~20 ms with a large heap).
TRIM_EVERY_S = 10.0

if TYPE_CHECKING:
    from recsys.trainer import Trainer

__all__ = ["MetricsSink", "TrainLoop"]

log = logging.getLogger("recsys")

# Warnings repeat at most every this many log points.
WARN_EVERY_LOGS = 10

# What would speed up the stage that bounds a stalled pipeline (the stall warning's last words).
STALL_ADVICE = {
    "load": "the data reader is the slow part; a columnar copy reads faster (Parquet; Criteo TSV: npy from "
    "`recsys preprocess`)",
    "route": "tier fewer tables (store.tables)",
    "prefetch": "raise store.host_rows for fewer LMDB reads a batch (`recsys tune-cache` recommends capacities)",
    "fill": "raise store.device_rows for fewer rows filled a batch (`recsys tune-cache` recommends capacities)",
}

Feed = Callable[[int, int], tuple[Iterator[Batch], StagedPipeline | None]]


def _raised_in_stage(err: UserError, failed: StageFailed) -> UserError:
    """``err`` (the cause of ``failed``) with a note naming the pipeline stage and batch that raised it:
    shown under its traceback, never in its one-line message."""
    note = f"raised in pipeline stage {failed.stage!r} on batch {failed.batch}"
    if note not in getattr(err, "__notes__", ()):
        err.add_note(note)
    return err


class MetricsSink(Protocol):
    """Where the loop's records go (``metrics.jsonl`` in a run: :class:`recsys.metrics.MetricsLog`)."""

    path: Any

    def write(self, **record: Any) -> None: ...


class TrainLoop:
    """One fit of a trainer from its current step to ``train.steps``.

    Args:
        trainer: the parts being trained (model, tiers, checkpoints, evaluation); its ``state`` is the
            progress this loop advances.
        feed: ``feed(start, stop)`` -> the batches of steps [start, stop), and the nested pipeline that
            produces them when the tables are tiered (None otherwise).
        progress: builds the progress bar (``total``, ``initial``, ``enabled``) whose ``write`` prints a line.
        metrics: the sink of the train and eval records.
    """

    def __init__(
        self, trainer: Trainer, *, feed: Feed, progress: Callable[..., Any], metrics: MetricsSink
    ) -> None:
        self.trainer = trainer
        self.state = trainer.state
        self.feed = feed
        self.progress = progress
        self.metrics = metrics
        self._warned: dict[str, int] = {}
        self._logs = 0
        self.ranking: dict[str, float | int] = {}  # the last evaluation's ranking metrics
        self._bounds: BoundsMetrics | None = None

    def _bounds_metrics(self) -> BoundsMetrics | None:
        """The bounded tables' metrics of this fit (None without ``[store.bounds]``)."""
        t = self.trainer
        bounded = t.binding.bounded
        if bounded is None:
            return None
        sizes = {c.name: row_bytes(t.config.sparse, c.embedding_dim) for c in t.tables}
        return BoundsMetrics(bounded, row_bytes=sizes, world_size=t.env.world_size)

    def run(self) -> dict[str, Any]:
        self._bounds = self._bounds_metrics()
        with contextlib.nullcontext() if self._bounds is None else self._bounds.recording():
            return self._run()

    def _run(self) -> dict[str, Any]:
        t = self.trainer
        steps = t.config.train.steps
        pipeline = TrainPipelineSparseDist(t.dmp, t.optimizer, t.env.device, execute_all_batches=True)
        batches, feed = self.feed(self.state.step, steps)
        bar = self.progress(total=steps, initial=self.state.step, enabled=t.env.is_main)
        user_error: UserError | None = None
        try:
            return self._steps(pipeline, batches, feed, bar)
        except (StageFailed, StoreCapacityError, StoreFullError) as err:
            cause = err.cause if isinstance(err, StageFailed) else err
            if isinstance(cause, StoreFullError):
                raise UserError(f"{cause}; raise store.max_lmdb_bytes or free disk space") from err
            if isinstance(cause, StoreCapacityError):
                raise UserError(self._too_few_slots(cause)) from err
            if not (isinstance(err, StageFailed) and isinstance(cause, UserError)):
                raise
            user_error = _raised_in_stage(cause, err)
        finally:
            bar.close()  # ends the bar's line before any error message
            if feed is not None:
                feed.close()
                if t.env.is_main and t.config.pipeline.trace_batches:
                    with writing(t.out_dir / "trace.json"):
                        feed.write_trace(t.out_dir / "trace.json")
                self.state.pipeline_stats = feed.stats()
        # A stage's UserError (a malformed line met by the load stage, ...) goes on as itself, as it would
        # without the pipeline: the CLI prints its one line (exit 2). Raised outside the handler, so that
        # its own __cause__ and __context__ stay as they were; the stage is named in a note of its traceback.
        assert user_error is not None
        raise user_error

    def _too_few_slots(self, cause: StoreCapacityError) -> str:
        """The device-tier error, with the trainer's capacity advice (``TrainSpec.capacity_advice``)."""
        t = self.trainer
        advice, needed = t.spec.capacity_advice, None
        if advice is not None:
            try:
                needed = advice(t.config, step=self.state.step, world_size=t.env.world_size)
            except Exception as err:  # noqa: BLE001 - the capacity error is the one to report
                log.debug("advice on the device slots needed: %s", err)
        return too_few_slots(cause, config=t.config, capacities=t.capacities, needed=needed)

    # -- one log window -----------------------------------------------------------------------------

    def _mean(self, value: float) -> float:
        v = torch.tensor([value], dtype=torch.float64)
        if self.trainer.env.world_size > 1:
            dist.all_reduce(v)
            v /= self.trainer.env.world_size
        return float(v[0])

    def _warn(self, message: str | None, bar: Any) -> None:
        """Show a warning on rank 0, at most once every ``WARN_EVERY_LOGS`` log points per kind."""
        if not message or not self.trainer.env.is_main:
            return
        kind = message[:12]
        if self._logs - self._warned.get(kind, -WARN_EVERY_LOGS) >= WARN_EVERY_LOGS:
            self._warned[kind] = self._logs
            bar.write(f"WARNING: {message}")
            log.warning(message)

    def _log(self, loss: float, steps: int, seconds: float, feed: StagedPipeline | None, bar: Any) -> None:
        t, state = self.trainer, self.state
        tcfg = t.config.train
        mean_loss = self._mean(loss / steps)
        rate = steps * tcfg.batch_size / max(1e-9, seconds)
        postfix = {"loss": f"{mean_loss:.4f}", "samples_per_s": f"{rate:,.0f}"}
        extra: dict[str, Any] = {}
        if t.tier_metrics is not None and feed is not None:
            tiers, thrash = t.tier_metrics.window(warm=state.step > 2 * tcfg.log_every, steps=tcfg.log_every)
            stats = feed.stats()
            extra = {"tiers": tiers, "pipeline": {"bound_by": stats.get("bound_by")}}
            postfix.update(hit=f"{tiers['device_hit_rate']:.3f}", bound=str(stats.get("bound_by")))
            self._logs += 1
            for message in (thrash, feed.stall_warning(STALL_ADVICE)):
                self._warn(message, bar)
        extra["exchange"] = wire = t.parts.exchange.window()
        postfix["wire_B"] = f"{wire['bytes_per_sample']:,.0f}"  # bytes per sample between ranks
        if self._bounds is not None:
            extra["bounds"] = bounds = self._bounds.window(state.step)
            share = bounds["default_share"]
            postfix["dflt"] = "n/a" if math.isnan(share) else f"{share:.2f}"
        bar.set_postfix(postfix)
        with writing(self.metrics.path):
            self.metrics.write(kind="train", step=state.step, loss=mean_loss, samples_per_s=rate, **extra)

    # -- evaluation ---------------------------------------------------------------------------------

    def evaluation(self, pipeline: TrainPipelineSparseDist, bar: Any) -> Evaluation:
        """Evaluate, log beside the constant baseline, and keep the checkpoint of a new best (collective)."""
        t, state = self.trainer, self.state
        scores = t.evaluator.evaluate(pipeline)
        state.held_out = scores.held_out  # the baseline's held-out split, and the checkpoints'
        auc, logloss = scores.auc, scores.logloss
        e = Evaluation(step=state.step, auc=None if math.isnan(auc) else auc, logloss=logloss)
        baseline = t.baseline()["constant_logloss"]
        keep = bool(t.config.eval.every) and state.selection.improves(e)
        if keep:
            path = t.save(best=True)
            e = Evaluation(step=e.step, auc=e.auc, logloss=e.logloss, digest=t.digest(checkpoint=path))
        state.selection.update(e)
        self.ranking = scores.ranking
        with writing(self.metrics.path):
            self.metrics.write(
                kind="eval",
                step=state.step,
                auc=auc,
                logloss=logloss,
                constant_logloss=baseline,
                best=keep,
                **scores.ranking,
            )
        if t.env.is_main:
            shown = "n/a" if e.auc is None else f"{e.auc:.4f}"
            versus = "" if baseline is None else f" (constant predictor {baseline:.4f})"
            ranked = "".join(
                f" {name} {scores.ranking[name]:.4f}"
                for name in ("gauc", "ndcg_at_10", "recall_at_10")
                if name in scores.ranking
            )
            bar.write(
                f"step {state.step}: eval auc {shown} logloss {logloss:.4f}{ranked}{versus}"
                + (" best" if keep else "")
            )
        return e

    # -- the steps ----------------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        """Checkpoint under ``checkpoints/`` (collective) and remember its step."""
        self.trainer.save()
        self.state.saved_step = self.state.step

    def _stop(self, signum: int) -> None:
        """After SIGTERM/SIGINT (agreed by every rank in the step's check): checkpoint, then stop. Called
        once the step's metrics row is written, so a resume from this checkpoint misses no row."""
        state = self.state
        if state.saved_step != state.step:
            self._checkpoint()
        raise RunStopped(signum, state.step)

    def _steps(
        self,
        pipeline: TrainPipelineSparseDist,
        batches: Iterator[Batch],
        feed: StagedPipeline | None,
        bar: Any,
    ) -> dict[str, Any]:
        t, state = self.trainer, self.state
        cfg = t.config
        tcfg = cfg.train
        train_time = 0.0
        trained_samples = 0
        window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        last_trim = time.monotonic()
        result: dict[str, Any] = {"stopped_early": False}
        last: Evaluation | None = None
        while state.step < tcfg.steps:
            t0 = time.perf_counter()
            loss, _, _ = pipeline.progress(batches)
            if t.rounding is not None:  # fp16 rows back to float16 values, before their slots are released
                t.rounding.after_step(state.step)
            t.binding.release(state.step)  # its backward and optimizer step are done
            state.step += 1
            trained_samples += tcfg.batch_size
            loss_value = float(loss)
            signum = t.health.check(loss_value, step=state.step)  # raises on a non-finite value
            if state.step % tcfg.log_every == 0 and time.monotonic() - last_trim >= TRIM_EVERY_S:
                release_free_heap()  # the steps' freed arrays, kept in malloc's heap (embedding_store.memory)
                last_trim = time.monotonic()
            train_time += time.perf_counter() - t0  # the checks are part of every step
            window_loss += loss_value
            window_steps += 1
            bar.update(1)
            if state.step % tcfg.log_every == 0 or state.step == tcfg.steps:
                self._log(window_loss, window_steps, time.perf_counter() - window_start, feed, bar)
                window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
            if signum:
                self._stop(signum)
            stop_early = False
            if cfg.eval.every and state.step % cfg.eval.every == 0 and state.step < tcfg.steps:
                last = self.evaluation(pipeline, bar)
                stop_early = state.selection.exhausted
                window_start = time.perf_counter()
            if tcfg.checkpoint_every and state.step % tcfg.checkpoint_every == 0 and state.step < tcfg.steps:
                self._checkpoint()
                window_start = time.perf_counter()
            if stop_early:
                assert state.selection.best is not None
                message = (
                    f"stopping early at step {state.step}: {cfg.eval.patience} evaluation(s) without a better "
                    f"held-out {cfg.eval.select} than step {state.selection.best.step}'s"
                )
                if t.env.is_main:
                    bar.write(message)
                    log.info(message)
                result["stopped_early"] = True
                break
        bar.close()
        if t.tier_metrics is not None:
            t.tier_metrics.training_done()
        if self._bounds is not None:  # the steps trained (a pipeline may have decided more)
            result["bounds"] = self._bounds.over_run(state.step)
        if not result.get("stopped_early") or last is None or last.step != state.step:
            # Drain the pipeline's prefetched batches (none remain: the iterator stops at train.steps).
            last = self.evaluation(pipeline, bar)
        if tcfg.final_checkpoint and state.saved_step != state.step:
            self._checkpoint()
        result["exchange"] = t.parts.exchange.over_run()
        result.update(
            **self.ranking,  # the last evaluation's, with eval.group_by
            auc=last.auc,
            logloss=last.logloss,
            steps=state.step,
            samples=state.step * tcfg.batch_size,  # the whole run's, resumed parts included
            samples_this_process=trained_samples,
            samples_per_s=trained_samples / train_time if train_time else math.nan,
            train_seconds=train_time,
        )
        return result
