"""Per-batch id traces of one store shard and the cache simulations over them.

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
from collections import deque
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from embedding_store import PolicyKind
from embedding_store.hashing import mix64
from recsys.tune.cache_sim import NO_USE, Future, SimulatedTier

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


BIG = NO_USE  # "no later use" in the next-use arrays


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
    flight). Misses take free rows, else evict unpinned rows chosen by the store's own policy classes,
    driven as the store's device tier drives them (:class:`recsys.tune.cache_sim.SimulatedTier`): LRU (oldest batch first), LFU (fewest batches since
    it entered, then LRU), LOOKAHEAD (rows no batch of the next ``lookahead`` training batches uses
    first, LRU among them; then the furthest next use; evaluation batches announce nothing), BELADY
    (furthest next use of any batch); ties go to the lower position, as in the store.

    Raises:
        CapacityTooSmall: a batch does not fit beside the pinned rows.
    """
    if capacity <= 0:
        raise CapacityTooSmall(f"capacity must be positive, got {capacity}")
    next_any, next_train = prepared if prepared is not None else _next_use(trace)
    tier = SimulatedTier(trace.num_ids, capacity, None if policy is BELADY else policy)
    # Per position, its row's next use: the batch (Belady), or the training index (LOOKAHEAD).
    nxt = np.full(capacity, BIG, dtype=np.int64)
    next_of = next_any if policy is BELADY else next_train
    held_of = trace.held_batches(pinned_batches)
    in_flight: deque[np.ndarray] = deque(maxlen=max(0, pinned_batches - 1))  # positions of training batches
    k = 0  # training index of the next training batch

    def announced(candidates: np.ndarray) -> np.ndarray:
        dist = nxt[candidates] - k  # training batches from the one being filled to the next use
        return np.where((dist >= 1) & (dist <= lookahead), dist, -1)

    def next_use(candidates: np.ndarray) -> np.ndarray:
        return nxt[candidates]

    hits = requests = miss_rows = 0.0
    peak = 0
    per_batch: list[int] = []
    for b in range(trace.num_batches):
        lo, hi = trace.offsets[b], trace.offsets[b + 1]
        ids = trace.ids[lo:hi]
        train = bool(trace.train[b])
        held = int(held_of[b])
        future: Future | None = next_use if policy is BELADY else None
        if policy is PolicyKind.LOOKAHEAD and train and lookahead > 0:
            future = announced
        slots, hit, evicted = tier.fill(ids, list(in_flight)[len(in_flight) - held :] if held else [], future)
        if evicted < 0:
            raise CapacityTooSmall(
                f"batch {b} needs {int((~hit).sum())} new rows, more than the free or evictable ones of "
                f"{capacity} beside the rows of the batches in flight"
            )
        if train:
            w = trace.weights[lo:hi]
            hits += float(w[hit].sum())
            requests += float(w.sum())
            filled = int(ids.shape[0] - np.count_nonzero(hit))
            miss_rows += filled
            peak = max(peak, filled)
            per_batch.append(filled)
            in_flight.append(slots)
            k += 1
        nxt[slots] = next_of[lo:hi]
    return SimResult(
        hits=hits,
        requests=requests,
        miss_rows=miss_rows,
        capacity=capacity,
        peak_miss_rows=peak,
        batch_miss_rows=np.array(per_batch, dtype=np.int64),
    )


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
