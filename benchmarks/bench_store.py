"""Benchmark of embedding_store against raw baselines run side by side on the same keys.

Prints the machine and versions, each measurement, and as its LAST line one JSON object of speed
ratios (candidate speed / baseline speed, higher is better):

- remap_vs_unique: ``make_resident`` (+ ``release``) of an all-hit batch of 400k Zipf ids (62-bit
  hashed, unbounded table) vs ``torch.unique(ids, return_inverse=True)`` on the same ids.
- ssd_read_vs_lmdb: ``prefetch`` of 10k rows that live only in LMDB vs raw py-lmdb ``getmulti`` of the
  same keys (sorted, encoded) in another environment holding the same rows; both warm. The store uses
  its default log layout (a row is found through its block); ``ssd_read_vs_lmdb_btree`` the same with
  the B-tree layout (a row per key, as the baseline stores them).
- writeback_vs_lmdb: ``evict`` + ``wait_for_writes`` of 10k updated device rows (host tier of 0 rows,
  so they go device -> writer -> LMDB) vs raw py-lmdb ``putmulti`` of the same rows in one transaction.
- host_gather_vs_index_select: ``read_rows`` of 100k ids held by the host tier (id -> arena lookup and
  gather) vs ``torch.index_select`` of the same rows at known positions from an arena of the same size
  (the rows read from the store beforehand, untimed).

``--smoke`` runs every measurement at tiny sizes in seconds (a test of the code path, not a figure).

``--scale`` instead runs a 2^62 id space with 30M touched rows (more than the host tier holds) through
the store and reports the peak RSS against the host-tier budget.

Usage: python benchmarks/bench_store.py [--scale] [--dir /tmp/bench_store] [--touched 30000000] [--smoke]
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import torch
from harness import RssPeak, alternate, emit, machine_info, order_of, paired_ratios, status_kib, timed

from embedding_store import (
    LmdbOptions,
    OptimizerKind,
    PolicyKind,
    StoreConfig,
    TableSpec,
    Tier,
    TieredStore,
    init_rows,
)
from embedding_store.backends import open_backend

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SPEC = TableSpec(name="t", dim=64, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)  # 260-byte rows
LMDB_KW = {"map_size": 1 << 34, "subdir": True, "sync": False, "metasync": False, "readahead": False}
PAIR = ("baseline", "store")  # the two sides of every measurement, alternating (harness.order_of)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizes:
    """How big each measurement is: the full run, or ``SMOKE`` (seconds; the code path, not a figure)."""

    remap_ids: int = 400_000
    reps: int = 15
    stored_rows: int = 200_000
    sets: int = 16
    set_rows: int = 10_000
    queries: int = 100_000


SMOKE = Sizes(remap_ids=4_000, reps=3, stored_rows=4_000, sets=4, set_rows=500, queries=2_000)
SIZE = Sizes()


def encode_keys(ids: np.ndarray) -> list[bytes]:
    """(N,) int64 ids -> N 8-byte big-endian keys, as the store's B-tree layout keys its rows."""
    return np.ascontiguousarray(ids, dtype=">u8").view("V8").tolist()


def hashed(raw: np.ndarray) -> np.ndarray:
    """Spread small ints over [0, 2^62): what a raw hashed id stream looks like."""
    return ((raw.astype(np.uint64) * GOLDEN) >> np.uint64(2)).astype(np.int64)


def paired(
    base: Callable[[], object], cand: Callable[[], object], reps: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``reps`` baseline and candidate calls, alternating (``harness.alternate``), so that
    noise from a shared machine hits both alike."""
    fns = dict(zip(PAIR, (base, cand), strict=True))
    times = alternate(PAIR, reps, lambda name, _: timed(fns[name]))
    return times["baseline"], times["store"]


def report(name: str, base_t: list[float], cand_t: list[float], n: int) -> float:
    """Median of the per-pair speed ratios (baseline time / candidate time), printed with its quartiles."""
    pairs = paired_ratios(base_t, cand_t)
    base_s, cand_s = np.median(base_t), np.median(cand_t)
    print(
        f"{name}: baseline {base_s * 1e3:.2f} ms, store {cand_s * 1e3:.2f} ms (medians of {len(base_t)}), "
        f"{n} items, median pair ratio {pairs['median']:.2f} (quartiles {pairs['q1']:.2f}-{pairs['q3']:.2f})"
    )
    return pairs["median"]


def bench_remap(root: Path) -> float:
    rng = np.random.default_rng(0)
    ids = hashed(rng.zipf(1.1, SIZE.remap_ids))  # (400k,)
    ids_t = torch.from_numpy(ids)
    num_unique = np.unique(ids).shape[0]
    spec = TableSpec(name="t", dim=16, optimizer=OptimizerKind.EXACT_SGD)
    config = StoreConfig(seed=0, device_capacity_rows=1 << 18, host_capacity_rows=0, policy=PolicyKind.LRU)
    with TieredStore(root / "remap", config=config, tables=[spec]) as store:
        store.bind("t", weights=torch.zeros(1 << 18, 16))
        store.make_resident(0, {"t": ids_t})
        store.release(0)
        warm_misses = store.stats().tables["t"][Tier.DEVICE].misses
        batch = iter(range(1, 1 << 30))

        def remap() -> None:
            b = next(batch)
            store.make_resident(b, {"t": ids_t})
            store.release(b)

        base, cand = paired(lambda: torch.unique(ids_t, return_inverse=True), remap, SIZE.reps)
        misses = store.stats().tables["t"][Tier.DEVICE].misses - warm_misses
        print(f"remap: {num_unique} unique ids; device misses after warm-up: {misses}")
        store.close(flush=False)
    return report("remap_vs_unique", base, cand, ids.shape[0])


def populate(
    root: Path, num_rows: int, rng: np.random.Generator, *, layout: str = "log"
) -> tuple[np.ndarray, Path, Path]:
    """The same ``num_rows`` rows in a store directory (``layout``) and in a raw LMDB environment."""
    ids = np.unique(hashed(rng.integers(0, 1 << 40, size=num_rows)))
    rows = rng.standard_normal((ids.shape[0], SPEC.row_floats)).astype(np.float32)
    store_dir, raw_dir = root / "store", root / "raw"
    options = LmdbOptions(initial_map_size_bytes=1 << 34, layout=layout)
    store_dir.mkdir(parents=True)
    with_backend = open_backend(store_dir.absolute(), options=options, seed=0, tables=[SPEC])
    with_backend.put_rows([("t", ids, rows)])
    with_backend.close()
    env = lmdb.open(str(raw_dir), max_dbs=2, **LMDB_KW)
    db = env.open_db(b"t")
    buf = memoryview(rows.tobytes())
    with env.begin(write=True) as txn:
        values = [buf[i : i + 260] for i in range(0, len(buf), 260)]
        txn.cursor(db=db).putmulti(zip(encode_keys(ids), values, strict=True))
    env.close()
    return ids, store_dir, raw_dir


def warm(env: lmdb.Environment, db: object, ids: np.ndarray) -> None:
    with env.begin(db=db) as txn:
        txn.cursor().getmulti(encode_keys(ids))


def bench_ssd_and_writeback(root: Path, *, layout: str = "log") -> tuple[float, float | None]:
    """``ssd_read_vs_lmdb`` and ``writeback_vs_lmdb`` of a store of ``layout``; the B-tree layout's reads
    only (``ssd_read_vs_lmdb_btree``: rows keyed one by one, as the raw baseline keys them)."""
    rng = np.random.default_rng(1)
    ids, store_dir, raw_dir = populate(root / f"ssd_{layout}", SIZE.stored_rows, rng, layout=layout)
    env = lmdb.open(str(raw_dir), max_dbs=2, **LMDB_KW)
    db = env.open_db(b"t")
    warm(env, db, ids)
    # 16 disjoint sets of 10k ids
    sets = [np.sort(s) for s in np.array_split(rng.permutation(ids)[: SIZE.sets * SIZE.set_rows], SIZE.sets)]

    def raw_read(keys_ids: np.ndarray) -> None:
        with env.begin(db=db) as txn:
            txn.cursor().getmulti(encode_keys(keys_ids))

    config = StoreConfig(
        seed=0,
        device_capacity_rows=SIZE.set_rows,
        host_capacity_rows=SIZE.stored_rows,
        lmdb=LmdbOptions(initial_map_size_bytes=1 << 34, layout=layout),
    )
    with TieredStore(store_dir, config=config, tables=[SPEC]) as store:
        for chunk in np.array_split(ids, 20):  # warm the store's pages too
            store.read_rows("t", chunk)

        def read(name: str, b: int) -> float:
            if name == "baseline":
                return timed(lambda: raw_read(sets[b]))
            store.lookahead(b, {"t": sets[b]})  # announced untimed, then its rows read from LMDB
            return timed(lambda: store.prefetch(b))

        times = alternate(PAIR, len(sets), read)
        assert store.stats().resident_rows["t"][Tier.HOST] == SIZE.sets * SIZE.set_rows
        store.close(flush=False)
    name = "ssd_read_vs_lmdb" if layout == "log" else f"ssd_read_vs_lmdb_{layout}"
    ssd = report(name, times["baseline"], times["store"], SIZE.set_rows)
    if layout != "log":
        env.close()
        return ssd, None

    config = StoreConfig(
        seed=0,
        device_capacity_rows=SIZE.set_rows,
        host_capacity_rows=0,
        lmdb=LmdbOptions(initial_map_size_bytes=1 << 34, writer_batch_rows=1 << 16),
    )
    base_t: list[float] = []
    cand_t: list[float] = []
    evicted: list[int] = []
    with TieredStore(store_dir, config=config, tables=[SPEC]) as store:
        weights, state = torch.zeros(SIZE.set_rows, 64), torch.zeros(SIZE.set_rows)
        store.bind("t", weights=weights, state=state)
        for b, keys in enumerate(sets):
            store.make_resident(b, {"t": keys})
            weights += 1.0  # every resident row is updated in place, as training would
            state += 1.0
            store.release(b)
            store.wait_for_writes()
            rows = store.read_rows("t", keys)
            packed = torch.cat([rows.weights, rows.state[:, None]], 1).numpy()
            buf = memoryview(packed.tobytes())

            def raw_write(keys: np.ndarray = keys, buf: memoryview = buf) -> None:
                with env.begin(write=True) as txn:
                    pairs = zip(
                        encode_keys(keys), [buf[i : i + 260] for i in range(0, len(buf), 260)], strict=True
                    )
                    txn.cursor(db=db).putmulti(pairs)

            def write_back() -> None:
                evicted.append(store.evict("t"))
                store.wait_for_writes()

            for name in order_of(PAIR, b):  # the two sides in alternating order, as harness.alternate
                (base_t if name == "baseline" else cand_t).append(
                    timed(raw_write if name == "baseline" else write_back)
                )
        assert evicted == [keys.shape[0] for keys in sets], "every updated row is written back"
        store.close(flush=False)
    env.close()
    wb = report("writeback_vs_lmdb", base_t, cand_t, SIZE.set_rows)
    return ssd, wb


def bench_host_gather(root: Path) -> float:
    rng = np.random.default_rng(2)
    ids, store_dir, _ = populate(root / "host", SIZE.stored_rows, rng)
    config = StoreConfig(seed=0, device_capacity_rows=1024, host_capacity_rows=ids.shape[0])
    with TieredStore(store_dir, config=config, tables=[SPEC]) as store:
        for b, chunk in enumerate(np.array_split(ids, 10)):
            store.lookahead(b, {"t": chunk})
            store.prefetch(b)
        assert store.stats().resident_rows["t"][Tier.HOST] == ids.shape[0]
        query = rng.choice(ids, size=SIZE.queries)  # (100k,) with repeats
        # The baseline gathers the same rows from an arena of the same size, read from the store untimed,
        # at positions looked up untimed.
        rows = store.read_rows("t", ids)
        arena = torch.cat([rows.weights, rows.state.reshape(ids.shape[0], -1)], dim=1)
        positions = torch.from_numpy(np.searchsorted(ids, query))
        base, cand = paired(
            lambda: torch.index_select(arena, 0, positions), lambda: store.read_rows("t", query), SIZE.reps
        )
        store.close(flush=False)
    return report("host_gather_vs_index_select", base, cand, SIZE.queries)


def rss_kib() -> dict[str, int]:
    return status_kib("VmHWM", "VmRSS", "RssAnon", "RssFile")


def scale(root: Path, touched: int, unmap_every: int | None, writer_batch: int) -> None:
    """A 2^62 id space, ``touched`` rows, a host tier far smaller than that."""
    spec = TableSpec(name="big", dim=32, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)  # 132-byte rows
    device_rows, host_rows, batch_new, hot = 1 << 18, 4_000_000, 100_000, 50_000
    if SIZE is SMOKE:
        device_rows, host_rows, batch_new, hot = 8192, 8192, 2_000, 1_000
    config = StoreConfig(
        seed=0,
        device_capacity_rows=device_rows,
        host_capacity_rows=host_rows,
        policy=PolicyKind.LOOKAHEAD,
        lmdb=LmdbOptions(
            initial_map_size_bytes=1 << 30,
            writer_max_pending_rows=1 << 19,
            writer_batch_rows=writer_batch,
            unmap_every_rows=unmap_every,
        ),
    )
    budget = host_rows * spec.row_bytes + device_rows * spec.row_bytes
    rng = np.random.default_rng(3)
    hot_ids = rng.integers(0, 1 << 62, size=hot)
    num_batches = -(-touched // batch_new)
    next_new = [0]

    def batch_ids(b: int) -> np.ndarray:
        new = rng.integers(0, 1 << 62, size=batch_new)  # fresh random 62-bit ids
        next_new[0] += batch_new
        return np.concatenate([new, rng.choice(hot_ids, size=batch_new // 2)])

    start = time.perf_counter()
    # RSS every 50 ms, split into anonymous memory and mapped file pages
    with (
        RssPeak(("RssAnon", "RssFile", "VmRSS"), interval_s=0.05) as sampler,
        TieredStore(root / "scale", config=config, tables=[spec]) as store,
    ):
        weights, state = torch.zeros(device_rows, 32), torch.zeros(device_rows)
        store.bind("big", weights=weights, state=state)
        pending = {0: batch_ids(0)}
        sample = pending[0][:1000].copy()
        store.lookahead(0, {"big": pending[0]})
        store.prefetch(0)
        for b in range(num_batches):
            if b + 1 < num_batches:
                pending[b + 1] = batch_ids(b + 1)
                store.lookahead(b + 1, {"big": pending[b + 1]})
                store.prefetch(b + 1)
            slots = store.make_resident(b, {"big": pending.pop(b)})["big"]
            uniq = slots.unique()
            weights[uniq] += 1.0
            state[uniq] += 1.0
            store.release(b)
            if b % 25 == 0 or b == num_batches - 1:
                s = store.stats()
                print(
                    f"batch {b}/{num_batches} {time.perf_counter() - start:.0f}s rss {rss_kib()} "
                    f"lmdb rows {s.resident_rows['big'][Tier.SSD]} writer pending {s.writer_pending_rows}",
                    flush=True,
                )
        store.flush()
        stats = store.stats()
        # Every row of the first batch's new ids was updated exactly once: init + 1, state 1.
        got = store.read_rows("big", sample)
        want = init_rows(sample, dim=spec.dim, seed=0, table=spec.name, scale=spec.init_scale) + 1.0
        assert torch.equal(got.weights, want) and bool((got.state == 1.0).all()), "scale: rows are wrong"
        print(f"scale: {sample.shape[0]} sampled rows of batch 0 read back exactly")
    elapsed = time.perf_counter() - start
    peaks = sampler.peak
    rss = rss_kib()
    print(f"scale: {num_batches} batches, {touched} new ids + {hot} hot ids, {elapsed:.0f} s")
    print(
        f"scale: rows in LMDB {stats.resident_rows['big'][Tier.SSD]}, map {stats.map_size_bytes / 2**30:.1f} GiB"
    )
    print(f"scale: tiers {stats.tables['big']}")
    result = {
        "peak_rss_gib": round(rss["VmHWM"] / 2**20, 3),
        "peak_rss_sampled_gib": round(peaks["VmRSS"] / 2**20, 3),
        "peak_rss_anon_gib": round(peaks["RssAnon"] / 2**20, 3),
        "peak_rss_file_gib": round(peaks["RssFile"] / 2**20, 3),
        "host_budget_gib": round(budget / 2**30, 3),
        "peak_rss_minus_budget_gib": round(rss["VmHWM"] / 2**20 - budget / 2**30, 3),
        "touched_rows": touched + hot,
        "unmap_every_rows": unmap_every,
        "writer_batch_rows": writer_batch,
        "seconds": round(elapsed, 1),
    }
    emit(result, digits=3)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir", type=Path, default=Path("/tmp/bench_store"), help="scratch directory (wiped)"
    )
    parser.add_argument("--scale", action="store_true", help="run the 2^62-id-space scale test instead")
    parser.add_argument("--touched", type=int, default=30_000_000, help="new rows of the scale test")
    parser.add_argument(
        "--unmap-every",
        type=int,
        default=2048,
        help="scale test: LmdbOptions.unmap_every_rows (0: never drop mapped LMDB pages)",
    )
    parser.add_argument(
        "--writer-batch", type=int, default=2048, help="scale test: LmdbOptions.writer_batch_rows"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds at tiny sizes (a test run, not a figure)"
    )
    args = parser.parse_args()
    if args.smoke:
        global SIZE
        SIZE = SMOKE
        args.touched = 20_000
    if args.threads:
        torch.set_num_threads(args.threads)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    emit(machine_info("torch", "numpy", "lmdb"))
    try:
        if args.scale:
            scale(args.dir, args.touched, args.unmap_every or None, args.writer_batch)
            return
        ratios = {"remap_vs_unique": bench_remap(args.dir)}
        ratios["ssd_read_vs_lmdb"], ratios["writeback_vs_lmdb"] = bench_ssd_and_writeback(args.dir)
        ratios["ssd_read_vs_lmdb_btree"], _ = bench_ssd_and_writeback(args.dir, layout="btree")
        ratios["host_gather_vs_index_select"] = bench_host_gather(args.dir)
        emit(ratios, digits=3)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
