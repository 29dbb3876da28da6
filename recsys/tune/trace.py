"""Per-batch id traces of one store shard and the cache simulations over them (numpy only).

A :class:`Trace` is what one owner's store sees of one table: for every batch, in order, the distinct ids
it makes resident, each with a *weight* — the number of ranks that sent the id (the store counts device
hits and misses per id it receives, and a table-wise owner receives one copy per sending rank). Batches
of the evaluation channel are in the trace too (they change the cache) but carry no weight: predicted and
measured hit rates are over training batches.

Pins: a training batch is made resident beside the rows of the ``pinned_batches - 1`` training batches
before it (still in flight); an evaluation batch beside the rows of the last ``held[b]`` training batches
before it in the trace (the training batches the run has filled but not finished when it evaluates).

Shapes: ``ids`` (N,) int64 compact ids in ``[0, num_ids)``; ``offsets`` (B + 1,); ``weights`` (N,) int64;
``train`` (B,) bool; ``held`` (B,) int64.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from embedding_store import PolicyKind
from embedding_store.hashing import mix64

__all__ = [
    "BELADY",
    "SIM_POLICIES",
    "Belady",
    "SimPolicy",
    "SimResult",
    "Trace",
    "TraceBuilder",
    "belady_hits",
    "min_capacity",
    "simulate",
]


class Belady(enum.Enum):
    """Belady's MIN: the offline optimum with the store's pins, the tuner's upper bound (no store policy)."""

    BELADY = "belady"


BELADY = Belady.BELADY
# What simulate() replays: one of the store's own eviction policies, or Belady's MIN.
SimPolicy: TypeAlias = PolicyKind | Belady
SIM_POLICIES: tuple[SimPolicy, ...] = (*PolicyKind, BELADY)  # what the tuner draws curves of, in order


@dataclass(frozen=True)
class Trace:
    """The batches one store shard sees of one table (see the module docstring for shapes).

    Attributes:
        ids: (N,) compact ids, distinct within each batch.
        offsets: (B + 1,) batch b is ``ids[offsets[b]:offsets[b + 1]]``.
        weights: (N,) ranks that sent each id (0 in evaluation batches).
        train: (B,) True for training batches.
        num_ids: distinct ids in the trace.
        sample_rate: share of the id space kept by spatial sampling (1.0: the whole trace).
        held: (B,) for an evaluation batch, how many of the training batches before it are still pinned
            while it runs; -1 (and every training batch) means ``pinned_batches - 1``. None: all -1. As in
            the store, fewer only after the last training batch (the next training batch pins them all),
            and never more than the evaluation batch right before (released batches stay released).
    """

    ids: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray
    train: np.ndarray
    num_ids: int
    sample_rate: float = 1.0
    held: np.ndarray | None = None

    @property
    def num_batches(self) -> int:
        return int(self.train.shape[0])

    @property
    def num_train_batches(self) -> int:
        return int(self.train.sum())

    def held_batches(self, pinned_batches: int) -> np.ndarray:
        """(B,) training batches before each batch whose rows are pinned beside it."""
        default = max(0, pinned_batches - 1)
        if self.held is None:
            return np.full(self.num_batches, default, dtype=np.int64)
        return np.where(self.train | (self.held < 0), default, self.held).astype(np.int64)

    def sample(self, rate: float, *, seed: int = 0) -> Trace:
        """SHARDS-style spatial sampling: keep the ids whose hash falls below ``rate``.

        A cache of ``c`` rows over the sample behaves like one of ``c / rate`` rows over the whole trace;
        every batch stays (possibly empty), so pins and lookahead keep their meaning in batches.
        """
        if not 0 < rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {rate}")
        if rate >= 1:
            return self
        h = mix64(self.ids.astype(np.uint64) + np.uint64(seed))
        keep_id = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < rate
        batch = np.repeat(np.arange(self.num_batches), np.diff(self.offsets))
        uniq, ids = np.unique(self.ids[keep_id], return_inverse=True)
        counts = np.bincount(batch[keep_id], minlength=self.num_batches)
        return Trace(
            ids=ids.astype(np.int64),
            offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            weights=self.weights[keep_id],
            train=self.train,
            num_ids=int(uniq.shape[0]),
            sample_rate=self.sample_rate * rate,
            held=self.held,
        )


class TraceBuilder:
    """Collects batches of raw ids (with weights) and compacts them into a :class:`Trace`."""

    def __init__(self) -> None:
        self._ids: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self._train: list[bool] = []
        self._held: list[int] = []

    def add(self, ids: np.ndarray, weights: np.ndarray, *, train: bool, held: int = -1) -> None:
        """One batch: (n,) distinct raw ids and (n,) weights; ``held``: for an evaluation batch, the
        training batches before it still pinned while it runs (-1: ``pinned_batches - 1``)."""
        self._ids.append(np.asarray(ids, dtype=np.int64))
        self._weights.append(np.asarray(weights, dtype=np.int64) if train else np.zeros(len(ids), np.int64))
        self._train.append(train)
        self._held.append(-1 if train else held)

    def build(self) -> Trace:
        sizes = [a.shape[0] for a in self._ids]
        raw = np.concatenate(self._ids) if self._ids else np.empty(0, np.int64)
        uniq, ids = np.unique(raw, return_inverse=True)
        return Trace(
            ids=ids.astype(np.int64),
            offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            weights=np.concatenate(self._weights) if self._weights else np.empty(0, np.int64),
            train=np.array(self._train, dtype=bool),
            num_ids=int(uniq.shape[0]),
            held=np.array(self._held, dtype=np.int64),
        )


def _next_use(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per access: the next batch (any channel) using the same id, and the next *training* batch index
    (counted in training batches) using it; ``BIG`` where none does."""
    n_b = trace.num_batches
    batch = np.repeat(np.arange(n_b, dtype=np.int64), np.diff(trace.offsets))
    order = np.lexsort((batch, trace.ids))  # by id, then batch
    sid, sb = trace.ids[order], batch[order]
    same = np.zeros(sid.shape[0], dtype=bool)
    same[:-1] = sid[1:] == sid[:-1]
    nxt = np.full(sid.shape[0], BIG, dtype=np.int64)
    nxt[:-1][same[:-1]] = sb[1:][same[:-1]]
    next_any = np.empty_like(nxt)
    next_any[order] = nxt
    # The next training use: scan each id's accesses backwards, carrying the nearest training batch.
    train_index = np.cumsum(trace.train) - 1  # (B,) training index of each batch (eval: the last before)
    is_train = trace.train[sb]
    # For each access in sorted order, the first later access of the same id that is a training batch.
    pos = np.arange(sid.shape[0])
    cand = np.where(is_train, pos, sid.shape[0])  # positions of training accesses
    # Group-wise suffix minimum of `cand` shifted by one, within runs of equal ids.
    starts = np.flatnonzero(np.concatenate([[True], sid[1:] != sid[:-1]]))
    run_end = np.repeat(np.append(starts[1:], sid.shape[0]), np.diff(np.append(starts, sid.shape[0])))
    shifted = np.append(cand[1:], sid.shape[0])
    suffix = np.minimum.accumulate(shifted[::-1])[::-1]  # suffix min over the whole array
    # Crossing into the next id's run is harmless: its positions are >= run_end and get masked.
    nt = np.where(suffix < run_end, suffix, -1)
    next_train = np.full(sid.shape[0], BIG, dtype=np.int64)
    ok = nt >= 0
    next_train[ok] = train_index[sb[nt[ok]]]
    out = np.empty_like(next_train)
    out[order] = next_train
    return next_any, out


BIG = 1 << 40


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulation over the training batches of a trace.

    Attributes:
        hits, requests: weighted device hits and requests (the store's device counters).
        miss_rows: distinct rows filled into the cache (what enters from the tier below).
        capacity: rows simulated (in the sampled trace's scale).
        peak_miss_rows: the most rows one training batch filled.
        batch_miss_rows: (training batches,) rows each training batch filled.
    """

    hits: float
    requests: float
    miss_rows: float
    capacity: int
    peak_miss_rows: int = 0
    batch_miss_rows: np.ndarray | None = None

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 1.0


class CapacityTooSmall(ValueError):
    """The cache cannot hold a batch beside the rows pinned by the batches in flight."""


def min_capacity(trace: Trace, *, pinned_batches: int = 4) -> int:
    """Fewest rows that hold any batch together with the rows pinned beside it: for a training batch, those
    of the ``pinned_batches - 1`` training batches before it (still in flight); for an evaluation batch,
    those of the last ``trace.held_batches(pinned_batches)[b]`` training batches before it.

    The store refuses a batch exactly when its distinct ids and the pinned rows outnumber the slots, so
    this is the smallest capacity :func:`simulate` (and the store) runs the whole trace with.
    """
    if trace.ids.shape[0] == 0:
        return 0
    window = max(1, pinned_batches)
    train_idx = np.cumsum(trace.train) - 1  # (B,) training index (evaluation: the last one before)
    batch = np.repeat(np.arange(trace.num_batches), np.diff(trace.offsets))
    is_train = trace.train[batch]
    # Windows of `window` consecutive training batches: an access of training batch j whose id was last
    # used (in training) at training batch p counts in the windows ending at b in [max(j, p + window), j + w - 1].
    t_ids, t_b = trace.ids[is_train], train_idx[batch[is_train]]
    order = np.lexsort((t_b, t_ids))
    sid, sb = t_ids[order], t_b[order]
    prev = np.full(sid.shape[0], -BIG, dtype=np.int64)
    same = np.zeros(sid.shape[0], dtype=bool)
    same[1:] = sid[1:] == sid[:-1]
    prev[same] = sb[:-1][same[1:]]
    n_train = trace.num_train_batches
    lo = np.maximum(sb, prev + window)
    hi = sb + window  # exclusive
    delta = np.zeros(n_train + window + 1, dtype=np.int64)
    ok = lo < hi
    np.add.at(delta, lo[ok], 1)
    np.add.at(delta, hi[ok], -1)
    best = int(np.cumsum(delta)[:n_train].max()) if n_train else 0
    # An evaluation batch beside the last `held` training batches before it.
    held_of = trace.held_batches(window)
    eval_batches = np.flatnonzero(~trace.train)
    keep = int(held_of[eval_batches].max()) if eval_batches.shape[0] else 0
    held: list[np.ndarray] = []
    for b in range(trace.num_batches):
        ids = trace.ids[trace.offsets[b] : trace.offsets[b + 1]]
        if trace.train[b]:
            held = [*held, ids][-keep:] if keep else []
        else:
            h = int(held_of[b])
            beside = held[-h:] if h else []
            best = max(best, int(np.unique(np.concatenate([*beside, ids])).shape[0]))
    return best


def simulate(
    trace: Trace,
    capacity: int,
    *,
    policy: SimPolicy,
    lookahead: int = 0,
    pinned_batches: int = 4,
    prepared: tuple[np.ndarray, np.ndarray] | None = None,
) -> SimResult:
    """Replay ``trace`` through a cache of ``capacity`` rows the way the store's device tier runs it.

    Each batch pins its rows; a row used by one of the ``pinned_batches - 1`` training batches before
    it (an evaluation batch: the last ``trace.held_batches(pinned_batches)[b]``) is pinned too (still in
    flight). Misses take free rows, else evict unpinned rows chosen by the
    policy: LRU (oldest batch first), LFU (fewest batches since it entered, then LRU), LOOKAHEAD (rows
    no batch of the next ``lookahead`` training batches uses first, LRU among them; then the furthest
    next use), BELADY (furthest next use of any batch).

    Raises:
        CapacityTooSmall: a batch does not fit beside the pinned rows.
    """
    if capacity <= 0:
        raise CapacityTooSmall(f"capacity must be positive, got {capacity}")
    next_any, next_train = prepared if prepared is not None else _next_use(trace)
    u = trace.num_ids
    resident = np.zeros(u, dtype=bool)
    last_use = np.zeros(u, dtype=np.int64)  # batch tick of the last use
    last_train = np.full(u, -BIG, dtype=np.int64)  # training index of the last training use
    count = np.zeros(u, dtype=np.int64)  # LFU: batches since the row entered
    nxt = np.full(u, BIG, dtype=np.int64)  # next use (any batch / next training index)
    buf = np.empty(capacity, dtype=np.int64)  # buf[:filled]: the resident ids, by position
    pos_of = np.zeros(u, dtype=np.int64)  # position of each resident id in buf
    filled = 0  # positions in use; evicted positions are refilled by the same batch
    lazy = _LazyOrder() if policy in (PolicyKind.LRU, PolicyKind.LOOKAHEAD) else None
    held_of = trace.held_batches(pinned_batches)
    hits = requests = miss_rows = 0.0
    peak = 0
    per_batch: list[int] = []
    k = 0  # training index of the next training batch
    for b in range(trace.num_batches):
        lo, hi = trace.offsets[b], trace.offsets[b + 1]
        ids = trace.ids[lo:hi]
        train = bool(trace.train[b])
        hit = resident[ids]
        new = ids[~hit]
        if train:
            w = trace.weights[lo:hi]
            hits += float(w[hit].sum())
            requests += float(w.sum())
            miss_rows += new.shape[0]
            peak = max(peak, int(new.shape[0]))
            per_batch.append(int(new.shape[0]))
        need = filled + new.shape[0] - capacity
        if need > 0:
            last_use[ids] = BIG  # the batch's own rows are pinned
            depth = lookahead if train and policy is PolicyKind.LOOKAHEAD else 0
            floor = k - 1 - int(held_of[b])  # rows last used in training after this batch are pinned
            victims = None
            if lazy is not None:
                victims = lazy.take(need, buf[:filled], last_use, last_train, nxt, resident, k, floor, depth)
            if victims is None:
                res = buf[:filled]
                pinned = last_train[res] > floor
                pinned |= last_use[res] == BIG
                cand = res[~pinned]
                if need > cand.shape[0]:
                    raise CapacityTooSmall(
                        f"batch {b} needs {new.shape[0]} new rows, only {capacity - filled + cand.shape[0]} "
                        f"free or evictable of {capacity}"
                    )
                key = _key(policy, cand, last_use, count, nxt, k, depth)
                victims = cand if need == cand.shape[0] else cand[np.argpartition(key, need - 1)[:need]]
            resident[victims] = False
            slots = np.concatenate([pos_of[victims], np.arange(filled, capacity, dtype=np.int64)])
            filled = capacity
        else:
            slots = np.arange(filled, filled + new.shape[0], dtype=np.int64)
            filled += new.shape[0]
        resident[new] = True
        buf[slots] = new
        pos_of[new] = slots
        last_use[ids] = b + 1
        count[new] = 0
        count[ids] += 1
        if train:
            last_train[ids] = k
            k += 1
        nxt[ids] = (next_any if policy is BELADY else next_train)[lo:hi]
    return SimResult(
        hits=hits,
        requests=requests,
        miss_rows=miss_rows,
        capacity=capacity,
        peak_miss_rows=peak,
        batch_miss_rows=np.array(per_batch, dtype=np.int64),
    )


_TICK = 1 << 40


class _LazyOrder:
    """Victims of LRU and LOOKAHEAD from a sorted list of the resident rows, refreshed only when used up.

    Under both policies a row's key only grows when it is used and new rows arrive youngest, so an entry
    whose key is unchanged since the sort is still in LRU order; used, evicted and (LOOKAHEAD) announced
    rows are skipped. The list leaves out pinned rows (the youngest); when too few rows
    qualify, the caller falls back to a full scan.
    """

    def __init__(self) -> None:
        self.order = np.empty(0, dtype=np.int64)
        self.keys = np.empty(0, dtype=np.int64)
        self.ptr = 0
        self.floor = -BIG  # rows last used in training after this batch were left out of the list

    def take(  # noqa: PLR0913 - the simulation's state, passed in rather than copied
        self,
        need: int,
        res: np.ndarray,
        last_use: np.ndarray,
        last_train: np.ndarray,
        nxt: np.ndarray,
        resident: np.ndarray,
        k: int,
        floor: int,
        depth: int,
    ) -> np.ndarray | None:
        """``need`` victims, or None when the caller must scan every row; rows last used in training
        after batch ``floor`` are pinned."""
        got: list[np.ndarray] = []
        total = 0
        rebuilt = False
        if floor < self.floor:  # rows listed as unpinned may be pinned now: list them again
            self.ptr = self.order.shape[0]
        while total < need:
            if self.ptr >= self.order.shape[0]:
                if rebuilt:
                    for part in got:  # not evicted after all: the caller scans every row
                        resident[part] = True
                    return None
                # Pinned rows are the youngest: leave them out (used again, they would be skipped anyway).
                keys = last_use[res]
                free = (last_train[res] <= floor) & (keys != BIG)
                rows, keys = res[free], keys[free]
                o = np.argsort(keys, kind="stable")
                self.order, self.keys, self.ptr, self.floor = rows[o], keys[o], 0, floor
                rebuilt = True
            end = min(self.order.shape[0], self.ptr + max(2 * (need - total), 512))
            chunk = self.order[self.ptr : end]
            valid = resident[chunk] & (last_use[chunk] == self.keys[self.ptr : end])
            ok = valid
            if depth:
                dist = nxt[chunk] - k
                ok = valid & ~((dist >= 1) & (dist <= depth))
            idx = np.flatnonzero(ok)[: need - total]
            got.append(chunk[idx])
            resident[chunk[idx]] = False  # taken (a rebuilt list must not offer them again)
            total += idx.shape[0]
            self.ptr = self.ptr + int(idx[-1]) + 1 if total >= need else end
        return np.concatenate(got)


def _key(
    policy: SimPolicy,
    cand: np.ndarray,
    last_use: np.ndarray,
    count: np.ndarray,
    nxt: np.ndarray,
    k: int,
    lookahead: int,
) -> np.ndarray:
    """Eviction order of the candidates: smaller goes first (the store's sort keys)."""
    if policy is PolicyKind.LRU:
        return last_use[cand]
    if policy is PolicyKind.LFU:
        return np.minimum(count[cand], (1 << 22) - 1) * _TICK + last_use[cand]
    if policy is BELADY:
        return -nxt[cand]
    dist = nxt[cand] - k  # training batches from the one being filled to the next use
    needed = (dist >= 1) & (dist <= lookahead)
    far = (1 << 20) - 1
    rank = (far - np.minimum(dist, far)) * _TICK
    return np.where(needed, last_use[cand] + rank + (1 << 61), last_use[cand])


def prepare(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Next-use arrays of a trace, shared by several :func:`simulate` calls."""
    return _next_use(trace)


def belady_hits(batches: list[np.ndarray], capacity: int, pinned_batches: int) -> tuple[int, int]:
    """Belady's MIN over per-batch distinct ids of one table, every batch a training batch: (hits, misses).

    Batch i needs all of its ids resident at once; the rows of the ``pinned_batches - 1`` batches before
    it are pinned. A shorthand for :func:`simulate` with ``BELADY`` (used by
    ``benchmarks/bench_pipeline.py``).

    Raises:
        CapacityTooSmall: a batch does not fit beside the pinned rows.
    """
    builder = TraceBuilder()
    for ids in batches:
        builder.add(ids, np.ones(ids.shape[0], np.int64), train=True)
    res = simulate(builder.build(), capacity, policy=BELADY, pinned_batches=pinned_batches)
    return int(res.hits), int(res.requests - res.hits)
