"""The trainer's parts own their state: the run's progress (TrainState) checkpointed as before, the
capacity advice passed in, the store shard built whole or closed again."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_store import (
    OptimizerKind,
    ShardDirectory,
    StoreCapacityError,
    StoreConfig,
    StoreLockedError,
    TableSpec,
)
from recsys.capacities import Capacities
from recsys.capacity_advice import SlotsNeeded, too_few_slots
from recsys.checkpoint import Checkpoint
from recsys.config import config_from_dict
from recsys.errors import UserError
from recsys.selection import BestTracker, Evaluation
from recsys.sharding import LocalShard
from recsys.tier_shard import TierShard, claim_shard
from recsys.tiered import row_bytes
from recsys.train_state import TrainState
from tests.multiprocess import run_ranks

# One tiered table whose 16 device slots cannot hold a batch of 128 samples' ids.
TOO_FEW_SLOTS = [
    "synthetic.num_sparse=2",
    "synthetic.id_space=5000",
    "synthetic.eval_samples=256",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "store.tiered=true",
    'store.tables=["cat_0"]',
    "store.device_rows=16",
    "store.host_rows=400",
    "train.steps=6",
    "train.batch_size=128",
    "train.threads_per_rank=1",
    "eval.batch_size=256",
    "pipeline.mode=sequential",
]


# -- the run's progress ---------------------------------------------------------------------------------


def _tracker() -> BestTracker:
    return BestTracker(select="logloss", patience=3)


def test_train_state_saves_the_trainer_entry_of_meta_json_and_restores_it():
    state = TrainState(selection=_tracker(), step=40, saved_step=30, held_out={"rows": 256, "positives": 61})
    state.selection.update(Evaluation(step=20, auc=0.71, logloss=0.52, digest="ab" * 16))
    state.selection.update(Evaluation(step=40, auc=0.70, logloss=0.55))
    into = Checkpoint(path=Path("step_00000040"), step=40, rank=0, world_size=1)
    assert state.save(into) == []
    # The entry the trainer's RunState wrote before TrainState existed: old checkpoints resume alike.
    assert into.meta == {
        "trainer": {
            "selection": {"best": {"step": 20, "auc": 0.71, "logloss": 0.52, "digest": "ab" * 16}, "bad": 1},
            "held_out": {"rows": 256, "positives": 61},
        }
    }
    restored = TrainState(selection=_tracker())
    restored.restore(
        Checkpoint(path=into.path, step=40, rank=0, world_size=1, meta={"step": 40, **into.meta})
    )
    assert (restored.step, restored.held_out) == (40, {"rows": 256, "positives": 61})
    assert restored.selection.state() == state.selection.state()
    assert restored.saved_step == -1  # this process has written no checkpoint yet


def test_train_state_restored_from_a_checkpoint_without_a_record_starts_its_selection_afresh():
    state = TrainState(selection=_tracker())
    state.restore(Checkpoint(path=Path("step_00000008"), step=8, rank=0, world_size=1, meta={"step": 8}))
    assert (state.step, state.held_out, state.selection.best, state.selection.bad) == (8, None, None, 0)


# -- the device-tier error --------------------------------------------------------------------------------


def _capacities(config):
    return Capacities.resolve(
        config.store, ["cat_0"], row_bytes=row_bytes(config.sparse, config.model.table_dim)
    )


def test_device_tier_error_names_the_advised_slots_of_the_tables_below_them():
    config = config_from_dict({}, TOO_FEW_SLOTS)
    capacities = _capacities(config)
    cause = StoreCapacityError("table 't_cat_0' needs 90 new slots, only 3 free; ... needs at least 101")
    key = capacities.device_key("cat_0")
    advised = too_few_slots(
        cause, config=config, capacities=capacities, needed=SlotsNeeded(in_flight=3, need={"cat_0": 1234})
    )
    assert f"table t_cat_0 needs at least 1,234 device slots per owner ({key} is 16)" in advised
    assert "up to 3 training batches" in advised and str(cause) not in advised
    enough = too_few_slots(
        cause, config=config, capacities=capacities, needed=SlotsNeeded(in_flight=3, need={"cat_0": 16})
    )
    assert str(cause) in enough and "device slots per owner" not in enough  # 16 is not below 16
    plain = too_few_slots(cause, config=config, capacities=capacities, needed=None)
    assert plain.startswith("the device tier is too small for the batches in flight (an evaluation batch")
    assert str(cause) in plain and "store.device_rows (now 16)" in plain


def _advice(config, *, step, world_size):
    return SlotsNeeded(in_flight=7, need={"cat_0": 10_000 + 100 * step + world_size})


def _failing_advice(config, *, step, world_size):
    raise RuntimeError("no replay")


def _fit_too_few_slots(rank: int, world_size: int, advices: list) -> list[str]:
    """The error of a fit that fails at its first batch's fill, with each capacity advice."""
    from recsys.build import TrainSpec
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    cfg = config_from_dict({}, TOO_FEW_SLOTS)
    env = init_distributed(threads_per_rank=1)
    out = []
    for advice in advices:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp), spec=TrainSpec(capacity_advice=advice))
            try:
                trainer.start(resume=False)
                with pytest.raises(UserError) as err:
                    trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
                assert trainer.step == 0
                out.append(str(err.value))
            finally:
                trainer.close(flush=False)
    return out


def test_the_caller_s_capacity_advice_words_the_device_tier_error_of_a_fit():
    advices = [_advice, _failing_advice, None]
    advised, failed, none = run_ranks(world_size=1, fn=_fit_too_few_slots, arg=advices)[0]
    # Called with the config, the step the run failed at (0) and the world size (1).
    assert "table t_cat_0 needs at least 10,001 device slots per owner" in advised, advised
    assert "up to 7 training batches" in advised
    for message in (failed, none):  # an advice that fails is no advice: the store's own figure
        assert message.startswith("the device tier is too small for the batches in flight (an evaluation")
        assert "device slots per owner" not in message and "needs at least" in message, message


# -- the store shard --------------------------------------------------------------------------------------


def _spec(device_rows: int = 8) -> TableSpec:
    return TableSpec(
        name="t",
        dim=4,
        optimizer=OptimizerKind.EXACT_SGD,
        num_embeddings=100,
        device_capacity_rows=device_rows,
    )


def _slots(rows: int) -> dict[str, LocalShard]:
    return {"t": LocalShard(table="t", row_offset=0, col_offset=0, weight=torch.zeros(rows, 4), state=None)}


def _owns_all(name: str, ids: np.ndarray) -> np.ndarray:
    return np.ones(ids.shape[0], dtype=bool)


def _is_free(path: Path) -> bool:
    """Whether the shard ``path`` can be claimed now (its lock is not held by any handle)."""
    try:
        ShardDirectory(path).close()
    except StoreLockedError:
        return False
    return True


def _shard(path: Path, tables: list[TableSpec], slots: dict[str, LocalShard]) -> TierShard:
    config = StoreConfig(seed=0, device_capacity_rows=8, host_capacity_rows=8)
    directory = claim_shard(path, exchange=None, world_size=1)  # type: ignore[arg-type]
    return TierShard(directory, config=config, tables=tables, slots=slots, owns=_owns_all)


def test_a_store_that_cannot_be_bound_to_its_slot_tables_is_closed_and_its_shard_released(tmp_path):
    shard = _shard(tmp_path / "rank_0", [_spec()], _slots(6))  # 6 rows for 8 device slots: bind refuses
    assert not _is_free(tmp_path / "rank_0")
    with pytest.raises(ValueError, match="has 6 rows, config says 8"):
        shard.open()
    assert shard.store is None and _is_free(tmp_path / "rank_0")


def test_a_shard_bound_to_its_slot_tables_opens_trains_rows_and_closes(tmp_path):
    shard = _shard(tmp_path / "rank_0", [_spec()], _slots(8))
    shard.open()
    assert shard.store is not None
    shard.store.make_resident(0, {"t": torch.tensor([3, 70])})
    shard.store.release(0)
    assert [ids.tolist() for ids, _, _ in shard.local_rows("t")] == [[3, 70]]
    assert shard.snapshot(tmp_path / "snap") == [tmp_path / "snap"]
    assert [ids.tolist() for ids, _, _ in shard.snapshot_rows("t", tmp_path / "snap")] == [[3, 70]]
    shard.close()
    assert shard.store is None and _is_free(tmp_path / "rank_0")


def test_a_rank_that_holds_no_tiered_table_never_opens_a_store(tmp_path):
    shard = _shard(tmp_path / "rank_1", [], {})
    shard.open()
    assert shard.store is None and shard.snapshot(tmp_path / "snap") == []
    assert list(shard.local_rows("t")) == [] and list(shard.snapshot_rows("t", tmp_path / "snap")) == []
    assert not (tmp_path / "rank_1").exists()  # nothing touched its directory
    shard.close()
    assert _is_free(tmp_path / "rank_1")


def test_a_shard_whose_slots_are_not_its_tables_is_refused_and_a_held_shard_is_not_claimed(tmp_path):
    directory = claim_shard(tmp_path / "rank_0", exchange=None, world_size=1)  # type: ignore[arg-type]
    config = StoreConfig(seed=0, device_capacity_rows=8, host_capacity_rows=8)
    with pytest.raises(ValueError, match=r"slots: \[\] are not the tables \['t'\]"):
        TierShard(directory, config=config, tables=[_spec()], slots={}, owns=_owns_all)
    with pytest.raises(UserError, match=rf"store .*rank_0 is in use by process {os.getpid()}"):
        claim_shard(tmp_path / "rank_0", exchange=None, world_size=1)  # type: ignore[arg-type]
    directory.close()
    assert _is_free(tmp_path / "rank_0")


class _Unlistable:
    def __iter__(self):
        raise RuntimeError("the tier binding's names cannot be listed")


def _broken_tables(dmp, tables, *, plan):
    from recsys.tiered import TieredTables

    binding = TieredTables(dmp, tables, plan=plan)
    binding.store_tables = _Unlistable()  # type: ignore[assignment] - the trainer's assembly fails on it
    return binding


def _assemble_failing(rank: int, world_size: int, _arg: None) -> tuple[str, bool]:
    from recsys.build import TrainSpec
    from recsys.distributed import init_distributed
    from recsys.trainer import Trainer

    cfg = config_from_dict({}, TOO_FEW_SLOTS)
    env = init_distributed(threads_per_rank=1)
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(RuntimeError) as err:
            Trainer(cfg, env, out_dir=Path(tmp), spec=TrainSpec(tables=_broken_tables))
        return str(err.value), _is_free(Path(tmp) / "store" / "rank_0")


def test_a_trainer_whose_parts_fail_to_assemble_releases_the_store_shard_its_tier_binding_claimed():
    message, free = run_ranks(world_size=1, fn=_assemble_failing, arg=None)[0]
    assert message == "the tier binding's names cannot be listed"
    assert free


# -- tables in memory: loading overlaps compute ---------------------------------------------------------


def _in_memory(rank: int, world_size: int, overrides: list[str]) -> dict:
    """The threads that read each batch, the digest and the load stage's count, in each pipeline mode."""
    import threading

    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer
    from tests.recsys.test_tiered import BASE as TIERED_BASE

    env = init_distributed(threads_per_rank=1)
    out = {}
    for mode in ("pipelined", "sequential"):
        cfg = config_from_dict({}, [*TIERED_BASE, *overrides, "train.steps=40", f"pipeline.mode={mode}"])
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp))
            trainer.start(resume=False)
            read = trainer.data.train_batches
            threads: list[str] = []

            def recorded(*args, _read=read, _threads=threads, **kwargs):
                for batch in _read(*args, **kwargs):
                    _threads.append(threading.current_thread().name)
                    yield batch

            trainer.data.train_batches = recorded
            trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
            stats = trainer.pipeline_stats
            out[mode] = {
                "threads": sorted(set(threads)),
                "digest": trainer.digest(),
                "loaded": stats["stages"]["load"]["items"],
            }
            trainer.close()
    return out


@pytest.mark.parametrize("bounds", [[], ["store.bounds={admit_after=2, expire_after_steps=10}"]])
def test_in_memory_batches_are_read_on_a_worker_and_train_the_sequential_model(bounds):
    [result] = run_ranks(world_size=1, fn=_in_memory, arg=["store.tiered=false", *bounds])
    assert result["pipelined"]["threads"] and "MainThread" not in result["pipelined"]["threads"]
    assert result["sequential"]["threads"] == ["MainThread"]
    assert result["pipelined"]["digest"] == result["sequential"]["digest"]
    assert result["pipelined"]["loaded"] == result["sequential"]["loaded"] == 40
