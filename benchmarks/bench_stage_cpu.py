"""CPU cost of the tier stages per routed id, next to the floor of the same work in raw torch and py-lmdb.

Every id of every batch passes through key routing, tier prefetch, device fill and write-back on host
threads (recsys/tiered.py's ``tiered_feed``). This program drives those calls in one thread, in the order
the pipeline makes them (the routing stage announces batch s+3, the prefetch stage reads batch s+2, the
fill stage makes batch s+1 resident while the consumer trains batch s, and batch s-2 is released after its
backward), and measures the CPU time of each call with ``time.thread_time_ns`` — what the stage threads
spend, whatever else runs on the machine. The background writer's CPU comes from
``/proc/self/task/<tid>/schedstat`` of the thread named ``tierrec-writer`` (and so does that of any other
thread of the process, e.g. reader threads of the backend, reported by name).

Per step and table the calls are the ones ``TieredTables`` makes on one rank:

- route: ``values_by_feature`` + ``Router.route`` (``torch.unique`` per table) + ``TieredStore.lookahead``;
- prefetch: ``TieredStore.prefetch``;
- fill: ``TieredStore.make_resident`` + ``Router.return_slots`` + the KJT of slot ids;
- release: ``TieredStore.release`` (its unpins are applied by the next locked call, counted there).

The floor, measured in the same run on the same ids: ``torch.unique(return_inverse=True)`` of each
table's ids of the step, an ``index_select`` of the step's unique rows from the slot table, and for
``ssd_bound`` raw py-lmdb: ``getmulti`` of the keys of the rows the store read from LMDB in the step (from
a second environment holding the same keys) and a sorted ``putmulti(append=True)`` of the rows the writer
committed, transaction for transaction; the two LMDB parts are the median of ``--floor-repeats`` runs
over all the measured steps' rows (on a shared machine single ones vary by +-20%).

Shapes:

- fits_cache: 8 tables of 10k-id Zipf(1.05) id spaces, 2,048 ids per table per step, 10,240 device slots
  per table: after a warm-up pass over every id, every lookup hits the device tier.
- ssd_bound: 4 tables of 2M-id Zipf(1.05) id spaces, 2,048 ids per table per step, a device tier of
  ``--ssd-device-rows`` slots and a host tier of ``--ssd-host-rows`` rows, so LMDB is read and written
  every step.

Prints each shape's figures and, as its LAST line, one JSON object: per shape ``stage_cpu_ns_per_id``,
``floor_ns_per_id``, ``ratio`` and the per-call breakdown (``calls_ns_per_id``), plus with ``--profile N``
the N functions of most own CPU (cProfile, ns per id) over extra steps after the measured ones.

Usage: python benchmarks/bench_stage_cpu.py [--steps 200] [--shapes fits_cache,ssd_bound] [--profile 15]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedding_store import OptimizerKind, StoreConfig, StoreStats, TableSpec, Tier, TieredStore
from recsys.routing import Ownership, RoutedIds, Router, values_by_feature

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
LMDB_KW = {"map_size": 1 << 36, "subdir": True, "sync": False, "metasync": False, "readahead": False}


@dataclass(frozen=True)
class Shape:
    name: str
    tables: int
    id_space: int
    device_rows: int
    host_rows: int
    ids_per_table: int = 2048
    alpha: float = 1.05


# ------------------------------------------------------------------------------------------ ids
def zipf_ids(rng: np.random.Generator, n: int, space: int, alpha: float, salt: int) -> np.ndarray:
    """(n,) ids of a bounded Zipf(alpha) law over popularity ranks, ranks scattered over the space by a
    hash (as hashed categorical features are)."""
    u = rng.random(n)
    top = (space + 1.0) ** (1.0 - alpha)
    rank = np.minimum(np.floor((1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - alpha)) - 1.0), space - 1)
    h = (rank.astype(np.uint64) + np.uint64(salt)) * GOLDEN
    h ^= h >> np.uint64(29)
    return (h % np.uint64(space)).astype(np.int64)


def make_batch(values: list[np.ndarray], keys: list[str]) -> KeyedJaggedTensor:
    """One id per sample and feature, as a KJT (feature-major values)."""
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.concatenate(values)),
        lengths=torch.ones(sum(v.shape[0] for v in values), dtype=torch.int32),
    )


# --------------------------------------------------------------------------------------- timers
class Timers:
    """Thread CPU ns per named call."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.thread_time_ns()
        try:
            yield
        finally:
            self.ns[name] += time.thread_time_ns() - start


def writer_tid() -> int:
    """Native id of the (one running) store writer thread."""
    tids = [t.native_id for t in threading.enumerate() if t.name == "tierrec-writer" and t.is_alive()]
    if len(tids) != 1 or tids[0] is None:
        raise RuntimeError(f"expected one tierrec-writer thread, found {len(tids)}")
    return tids[0]


def other_threads_cpu_ns() -> dict[str, int]:
    """CPU ns so far of every thread of this process but the calling one, summed by thread name (the
    store's writer, any reader threads the backend keeps); threads Python did not start count as "other"."""
    me = threading.get_native_id()
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = defaultdict(int)
    for entry in os.scandir("/proc/self/task"):
        tid = int(entry.name)
        if tid == me:
            continue
        try:
            cpu = thread_cpu_ns(tid)
        except OSError:  # ended meanwhile
            continue
        name = names.get(tid, "other")
        out["writer" if name == "tierrec-writer" else name.rstrip("0123456789_-") or "other"] += cpu
    return out


def thread_cpu_ns(tid: int) -> int:
    """CPU time of thread ``tid`` of this process (schedstat: ns; else stat's utime + stime ticks)."""
    try:
        return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ the stage calls
class Driver:
    """The calls ``TieredTables`` makes on one rank, over one store (recsys/tiered.py)."""

    def __init__(self, shape: Shape, path: Path, dim: int, timers: Timers) -> None:
        self.shape = shape
        self.names = [f"t{i}" for i in range(shape.tables)]
        self.keys = [f"f{i}" for i in range(shape.tables)]
        self.timers = timers
        config = StoreConfig(
            seed=0, device_capacity_rows=shape.device_rows, host_capacity_rows=shape.host_rows
        )
        specs = [
            TableSpec(
                name=n, dim=dim, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, num_embeddings=shape.id_space
            )
            for n in self.names
        ]
        self.store = TieredStore(path, config=config, tables=specs)
        self.weights = {n: torch.zeros(shape.device_rows, dim) for n in self.names}
        for n in self.names:
            self.store.bind(n, weights=self.weights[n], state=torch.zeros(shape.device_rows))
        owner = Ownership(world_size=1, row_wise=False, table_owner=dict.fromkeys(self.names, 0))
        self.router = Router(owner, names=self.names, held=self.names)
        self.routed: dict[int, RoutedIds] = {}
        self.batches: dict[int, KeyedJaggedTensor] = {}
        self.local: dict[int, dict[str, torch.Tensor]] = {}

    def route(self, step: int, kjt: KeyedJaggedTensor) -> None:
        t = self.timers
        self.batches[step] = kjt
        with t("route"):
            values = values_by_feature(kjt)
            ids = {n: values[k] for n, k in zip(self.names, self.keys, strict=True)}
            routed = self.router.route(ids, exchange=None)  # one rank: no collective
        with t("lookahead"):
            self.store.lookahead(step, routed.owner_ids)
        self.routed[step] = routed

    def prefetch(self, step: int) -> None:
        with self.timers("prefetch"):
            self.store.prefetch(step)

    def fill(self, step: int) -> KeyedJaggedTensor:
        t = self.timers
        routed = self.routed.pop(step)
        kjt = self.batches.pop(step)
        with t("make_resident"):
            local = self.store.make_resident(step, routed.owner_ids)
        with t("remap"):
            value_slots = self.router.return_slots(routed, local, exchange=None)
            values = values_by_feature(kjt)
            for n, k in zip(self.names, self.keys, strict=True):
                values[k] = value_slots[n]
            out = KeyedJaggedTensor(
                keys=kjt.keys(),
                values=torch.cat([values[k] for k in kjt.keys()]),
                lengths=kjt.lengths(),
                stride=kjt.stride(),
            )
        self.local[step] = local
        return out

    def release(self, step: int) -> None:
        self.local.pop(step, None)
        with self.timers("release"):
            self.store.release(step)

    def step(self, s: int, batch_of: Callable[[int], KeyedJaggedTensor]) -> None:
        """One consumer step s: route s+3, prefetch s+2, fill s+1, release s-2 (TorchRec's pipeline
        keeps two batches in flight besides the one being filled: four batches pinned at the fill)."""
        self.route(s + 3, batch_of(s + 3))
        self.prefetch(s + 2)
        self.fill(s + 1)
        if s - 2 in self.local:
            self.release(s - 2)

    def start(self, first: int, batch_of: Callable[[int], KeyedJaggedTensor]) -> None:
        """Prime the pipeline so that ``step(first)`` finds s+1 and s+2 routed and s+1 prefetched."""
        for b in (first + 1, first + 2):
            self.route(b, batch_of(b))
        self.prefetch(first + 1)


# --------------------------------------------------------------------------------- lmdb capture
class LmdbCapture:
    """Records the keys of the rows the store's backend reads and the groups its writer commits."""

    def __init__(self, store: TieredStore) -> None:
        backend = store._backend  # noqa: SLF001 - a benchmark's probe, wrapped on this instance only
        self.reads: list[np.ndarray] = []
        self.commits: list[list[tuple[str, np.ndarray, int]]] = []
        self.on = False
        get_rows, put_rows = backend.get_rows, backend.put_rows
        lock = threading.Lock()

        def get(table: str, ids: np.ndarray, *args: object, **kw: object) -> tuple[np.ndarray, np.ndarray]:
            found, rows = get_rows(table, ids, *args, **kw)
            if self.on and found.any():
                with lock:
                    self.reads.append(ids[found].copy())
            return found, rows

        def put(writes: list[tuple[str, np.ndarray, np.ndarray]], *args: object, **kw: object) -> None:
            put_rows(writes, *args, **kw)
            if self.on:
                with lock:
                    self.commits.append([(t, ids.copy(), rows.shape[1]) for t, ids, rows in writes])

        backend.get_rows, backend.put_rows = get, put


def lmdb_floor(capture: LmdbCapture, row_bytes: int, scratch: Path) -> tuple[int, int, int, int]:
    """Thread CPU ns of raw getmulti of every read key and of sorted putmulti(append=True) of every commit.

    Returns: (read ns, rows read, write ns, rows written).
    """
    reads = capture.reads
    every = np.unique(np.concatenate(reads)) if reads else np.empty(0, np.int64)
    env = lmdb.open(str(scratch / "get"), **LMDB_KW)
    value = bytes(row_bytes)
    with env.begin(write=True) as txn:  # untimed: a copy of the keys the store read
        txn.cursor().putmulti([(k, value) for k in _keys(every)], append=True)
    read_ns, n_read = 0, 0
    for ids in reads:
        start = time.thread_time_ns()
        with env.begin() as txn:
            pairs = txn.cursor().getmulti(_keys(ids))
        rows = np.frombuffer(b"".join(v for _, v in pairs), dtype=np.float32)
        read_ns += time.thread_time_ns() - start
        n_read += ids.shape[0]
        assert rows.shape[0] == ids.shape[0] * row_bytes // 4
    env.close()
    env = lmdb.open(str(scratch / "put"), max_dbs=64, **LMDB_KW)
    dbs: dict[str, object] = {}
    write_ns, n_written = 0, 0
    for base, groups in enumerate(capture.commits):
        prepared = []
        for table, ids, floats in groups:
            db = dbs.setdefault(table, env.open_db(table.encode()))
            rows = np.zeros((ids.shape[0], floats), dtype=np.float32)
            # ids < 2^32 here: keys above every earlier commit's, so each putmulti appends
            prepared.append((db, np.sort(ids) + (base << 32), rows))
        start = time.thread_time_ns()
        with env.begin(write=True) as txn:
            for db, ids, rows in prepared:
                values = rows.reshape(-1).view(f"V{rows.shape[1] * 4}").tolist()
                txn.cursor(db=db).putmulti(list(zip(_keys(ids), values, strict=True)), append=True)
        write_ns += time.thread_time_ns() - start
        n_written += sum(ids.shape[0] for _, ids, _ in prepared)
    env.close()
    return read_ns, n_read, write_ns, n_written


def _keys(ids: np.ndarray) -> list[bytes]:
    return np.ascontiguousarray(ids, dtype=">u8").view("V8").tolist()


# ---------------------------------------------------------------------------------------- a run
def floor_step(driver: Driver, kjt: KeyedJaggedTensor, local: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Thread CPU ns of the step's floor: torch.unique of each table's ids, index_select of its rows."""
    values = values_by_feature(kjt)
    unique_ns = gather_ns = 0
    for n, k in zip(driver.names, driver.keys, strict=True):
        ids = values[k].clone()
        start = time.thread_time_ns()
        torch.unique(ids, return_inverse=True)
        mid = time.thread_time_ns()
        driver.weights[n].index_select(0, local[n])
        gather_ns += time.thread_time_ns() - mid
        unique_ns += mid - start
    return unique_ns, gather_ns


def run_shape(shape: Shape, args: argparse.Namespace, root: Path) -> dict[str, object]:
    rng = np.random.default_rng(args.seed)
    keys = [f"f{i}" for i in range(shape.tables)]
    total = args.warmup + args.steps + args.profile_steps + 8
    cover = -(-shape.id_space // shape.ids_per_table) if shape.id_space <= shape.device_rows else 0
    # fits_cache: a first pass over every id of the space (so that all later lookups hit), then Zipf.
    batches: dict[int, KeyedJaggedTensor] = {}
    for s in range(cover + total):
        if s < cover:
            part = np.arange(s * shape.ids_per_table, (s + 1) * shape.ids_per_table) % shape.id_space
            vals = [part.astype(np.int64)] * shape.tables
        else:
            vals = [
                zipf_ids(rng, shape.ids_per_table, shape.id_space, shape.alpha, salt=1000 * t + 7)
                for t in range(shape.tables)
            ]
        batches[s] = make_batch(vals, keys)
    timers = Timers()
    driver = Driver(shape, root / shape.name, args.dim, timers)
    capture = LmdbCapture(driver.store)
    batch_of = batches.__getitem__
    first = -1  # step -1 fills batch 0
    driver.start(first, batch_of)
    warm_end = cover + args.warmup
    for s in range(first, warm_end):
        driver.step(s, batch_of)
    driver.store.wait_for_writes()  # nothing of the warm-up left for the writer in the measured window
    timers.ns.clear()
    before = driver.store.stats()
    threads0, proc0 = other_threads_cpu_ns(), time.process_time_ns()
    capture.on = True
    unique_ns = gather_ns = floor_proc_ns = 0
    for s in range(warm_end, warm_end + args.steps):
        kjt = batches[s + 1]
        driver.step(s, batch_of)
        f0 = time.process_time_ns()
        u, g = floor_step(driver, kjt, driver.local[s + 1])  # once: a repeat would find the rows in cache
        floor_proc_ns += time.process_time_ns() - f0
        unique_ns += u
        gather_ns += g
    drain0 = time.thread_time_ns()
    driver.store.wait_for_writes()  # the window's evictions committed, on the writer's clock
    drain_ns = time.thread_time_ns() - drain0
    capture.on = False
    threads = {k: v - threads0.get(k, 0) for k, v in other_threads_cpu_ns().items()}
    threads = {k: v for k, v in threads.items() if v > 0}
    proc_ns = time.process_time_ns() - proc0 - floor_proc_ns - drain_ns
    after = driver.store.stats()
    calls = dict(timers.ns)
    profile: list[dict[str, object]] = []
    if args.profile:
        prof = cProfile.Profile()
        end = warm_end + args.steps
        prof.enable()
        for s in range(end, end + args.profile_steps):
            driver.step(s, batch_of)
        prof.disable()
        profile = top_functions(prof, args.profile, args.profile_steps * shape.tables * shape.ids_per_table)
    driver.store.close(flush=False)
    row_bytes = 4 * (args.dim + 1)
    floors = [
        lmdb_floor(capture, row_bytes, Path(tempfile.mkdtemp(dir=root))) for _ in range(args.floor_repeats)
    ]
    read_ns, n_read, write_ns, n_written = (int(np.median([f[i] for f in floors])) for i in range(4))
    ids = args.steps * shape.tables * shape.ids_per_table
    stage_ns = sum(calls.values()) + sum(threads.values())
    floor = {
        "unique": unique_ns / ids,
        "index_select": gather_ns / ids,
        "lmdb_getmulti": read_ns / ids,
        "lmdb_putmulti": write_ns / ids,
    }
    floor_ns = sum(floor.values())
    return {
        "stage_cpu_ns_per_id": round(stage_ns / ids, 1),
        "floor_ns_per_id": round(floor_ns, 1),
        "ratio": round(stage_ns / ids / floor_ns, 2),
        "calls_ns_per_id": {k: round(v / ids, 1) for k, v in {**calls, **threads}.items()},
        "floor_parts_ns_per_id": {k: round(v, 1) for k, v in floor.items()},
        "stage_cpu_ms_per_step": round(stage_ns / args.steps / 1e6, 3),
        "process_cpu_ms_per_step": round(proc_ns / args.steps / 1e6, 3),
        "ids_per_step": shape.tables * shape.ids_per_table,
        "per_step": per_step_counts(before, after, args.steps),
        "lmdb_rows_read_per_step": round(n_read / args.steps, 1),
        "lmdb_rows_written_per_step": round(n_written / args.steps, 1),
        "profile": profile,
    }


def per_step_counts(before: StoreStats, after: StoreStats, steps: int) -> dict[str, float]:
    """Device and host hit rates and rows moved per step in the measured window, over all tables."""
    sums: dict[str, float] = defaultdict(float)
    for name, tiers in after.tables.items():
        old = before.tables[name]
        for tier, label in ((Tier.DEVICE, "device"), (Tier.HOST, "host"), (Tier.SSD, "ssd")):
            sums[f"{label}_hits"] += tiers[tier].hits - old[tier].hits
            sums[f"{label}_misses"] += tiers[tier].misses - old[tier].misses
    out = {}
    for label in ("device", "host", "ssd"):
        seen = sums[f"{label}_hits"] + sums[f"{label}_misses"]
        out[f"{label}_hit_rate"] = round(sums[f"{label}_hits"] / seen, 3) if seen else 0.0
    out["device_misses_per_step"] = round(sums["device_misses"] / steps, 1)
    return out


def top_functions(prof: cProfile.Profile, n: int, ids: int) -> list[dict[str, object]]:
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}:{func}" if line else func
        rows.append((tottime, where, calls, cumtime))
    rows.sort(reverse=True)
    return [
        {
            "fn": where,
            "calls": calls,
            "own_ns_per_id": round(tot * 1e9 / ids, 1),
            "cum_ns_per_id": round(cum * 1e9 / ids, 1),
        }
        for tot, where, calls, cum in rows[:n]
    ]


# --------------------------------------------------------------------------- through the trainer
TRAINER_SHAPES = {
    "fits_cache": ["synthetic.num_sparse=8", "synthetic.id_space=10000", "store.device_rows=10240"],
    "ssd_bound": ["synthetic.num_sparse=4", "synthetic.id_space=2000000"],
}


def run_trainer(name: str, args: argparse.Namespace, root: Path) -> dict[str, object]:
    """The same calls made by the real stage threads: ``recsys.trainer.Trainer`` over synthetic data with
    a ``TrainSpec`` whose tier binding times ``TieredTables``' stage methods (batches from ``--warmup``
    on; evaluation batches are not counted)."""
    from recsys.build import TrainSpec
    from recsys.config import config_from_dict
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.tiered import TieredTables
    from recsys.trainer import Trainer

    timers: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    first, last = args.warmup, args.warmup + args.steps
    writer = {}

    def timed(
        method: Callable[..., object], label: str, batch_of: Callable[..., int]
    ) -> Callable[..., object]:
        def call(self: TieredTables, *a: object, **kw: object) -> object:
            batch = batch_of(*a)
            if label == "fill" and batch == first:
                writer["start"] = thread_cpu_ns(writer_tid())
            start = time.thread_time_ns()
            try:
                return method(self, *a, **kw)
            finally:
                spent = time.thread_time_ns() - start
                if first <= batch < last:
                    with lock:
                        timers[label] += spent
                if label == "release" and batch == last - 1:
                    writer["end"] = thread_cpu_ns(writer_tid())

        return call

    class TimedTables(TieredTables):
        route = timed(TieredTables.route, "route", lambda b, *_: b)
        announce = timed(TieredTables.announce, "lookahead", lambda r: r.batch_id)
        prefetch = timed(TieredTables.prefetch, "prefetch", lambda r: r.batch_id)
        fill = timed(TieredTables.fill, "fill", lambda r: r.batch_id)
        release = timed(TieredTables.release, "release", lambda b: b)

    dim = args.dim
    overrides = [
        *TRAINER_SHAPES[name],
        f"model.embedding_dim={dim}",
        "model.dense_arch=[32, 16]" if dim == 16 else f"model.dense_arch=[32, {dim}]",
        "model.over_arch=[32]",
        "synthetic.eval_samples=256",
        "train.batch_size=2048",
        f"train.steps={last + 2}",
        "train.log_every=1000000",
        "eval.batch_size=256",
        "store.tiered=true",
    ]
    if name == "ssd_bound":
        overrides += [f"store.device_rows={args.ssd_device_rows}", f"store.host_rows={args.ssd_host_rows}"]
    cfg = config_from_dict({}, overrides)
    env = init_distributed(threads_per_rank=1)
    out = root / f"trainer_{name}"
    trainer = Trainer(cfg, env, out_dir=out, spec=TrainSpec(tables=TimedTables))
    trainer.start(resume=False)
    proc0 = time.process_time_ns()
    trainer.fit(MetricsLog(out / "m.jsonl", enabled=False))
    proc_ns = time.process_time_ns() - proc0
    trainer.close(flush=False)
    ids = args.steps * cfg.synthetic.num_sparse * cfg.train.batch_size
    calls = {**timers, "writer": writer.get("end", 0) - writer.get("start", 0)}
    total = sum(calls.values())
    return {
        "stage_cpu_ns_per_id": round(total / ids, 1),
        "calls_ns_per_id": {k: round(v / ids, 1) for k, v in calls.items()},
        "stage_cpu_ms_per_step": round(total / args.steps / 1e6, 3),
        "process_cpu_ms_per_step_whole_run": round(proc_ns / (last + 2) / 1e6, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="fits_cache,ssd_bound")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per shape")
    parser.add_argument("--warmup", type=int, default=60, help="steps before the measured ones")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ssd-device-rows", type=int, default=8192)
    parser.add_argument("--ssd-host-rows", type=int, default=8192)
    parser.add_argument("--profile", type=int, default=0, help="report the N functions of most own CPU")
    parser.add_argument("--profile-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--floor-repeats", type=int, default=3, help="LMDB floor: median of this many runs")
    parser.add_argument(
        "--trainer", action="store_true", help="also time the stage methods of a Trainer's real pipeline"
    )
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    if not args.profile:
        args.profile_steps = 0
    shapes = {
        "fits_cache": Shape("fits_cache", tables=8, id_space=10_000, device_rows=10_240, host_rows=4096),
        "ssd_bound": Shape(
            "ssd_bound",
            tables=4,
            id_space=2_000_000,
            device_rows=args.ssd_device_rows,
            host_rows=args.ssd_host_rows,
        ),
    }
    torch.set_num_threads(1)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_stage_cpu_"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} CPUs, python "
        f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, lmdb {lmdb.__version__}"
    )
    result: dict[str, object] = {}
    try:
        for name in args.shapes.split(","):
            res = run_shape(shapes[name], args, root)
            result[name] = res
            print(f"{name}: " + json.dumps({k: v for k, v in res.items() if k != "profile"}))
            for row in res["profile"]:  # type: ignore[union-attr]
                print(f"  {row}")
            if args.trainer:
                res["trainer"] = run_trainer(name, args, root)
                print(f"{name} (trainer): " + json.dumps(res["trainer"]))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
