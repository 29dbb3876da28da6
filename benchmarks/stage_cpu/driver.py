"""Ids, batches and thread CPU timers, and :class:`Driver`: the calls ``TieredTables`` makes on one rank
over one :class:`~embedding_store.TieredStore`, in the pipeline's order (bench_stage_cpu.py)."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedding_store import OptimizerKind, StoreConfig, TableSpec, TieredStore
from embedding_store.backends import RowBackend, open_backend
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

    def __init__(
        self, shape: Shape, path: Path, dim: int, timers: Timers, wrap: Callable[[RowBackend], RowBackend]
    ) -> None:
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
        # The store's backend, as open_backend gives it, wrapped by ``wrap`` (the floor's recorder).
        self.backend = wrap(open_backend(path, options=config.lmdb, seed=config.seed, tables=specs))
        self.store = TieredStore(path, config=config, tables=specs, backend=self.backend)
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
