"""Compiled loops (numba) for the ``rows`` exchange's per-batch planning: one pass over a batch's ids
instead of a chain of tensor operations, each of which walks the batch again.

- :func:`plan_requests`: the batch's distinct (feature, id) pairs, found with an open-addressing hash
  table in one pass; each with its window mask; in send order (owner, then feature, then the order in
  which the batch first uses them); and the request each id occurrence reads.
- :func:`pooling_plan`: per window, which of its received rows each id occurrence reads and the bag it
  adds into, in occurrence order.
- :func:`lookup_layout`: how an owner looks up the rows asked of it, each FBGEMM module once.
- :func:`window_members`: per window, the requests (or served rows) whose mask has the window's bit, and
  how many of them go to (or come from) each rank.

All are integer loops whose results depend on the batch alone, so every machine plans a batch the
same way. No id is compared with another id, only tested for equality: a tiered run, whose ids are
slots, sends its requests in the same order as the in-memory run it must equal. ``recsys.exchange_plan`` and ``recsys.exchange_windows`` wrap them; their tests compare
the wrappers against plain Python references.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["ID_BITS", "lookup_layout", "plan_requests", "pooling_plan", "window_members"]

ID_BITS = 48  # a local row index sits in the low 48 bits of a sent id; the window mask above it
_LOW = (1 << ID_BITS) - 1
_MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of key * 2^64 / phi


# Signatures given: compiled (or loaded from numba's cache) on import, not in a batch's first call.
@numba.njit(
    "Tuple((int64[:], int64[:], int64[:], int64[:], int64[:], int64[:], int64[:, :], int64[:, :]))"
    "(int64[:], int64[:], int64, int64[:], boolean[:], int64[:], int64[:], int64[:], int64)",
    nogil=True,
    cache=True,
)
def plan_requests(  # pragma: no cover - compiled
    values: np.ndarray,
    lengths: np.ndarray,
    batch: int,
    window_of_sample: np.ndarray,
    rows_feature: np.ndarray,
    bounds: np.ndarray,
    starts: np.ndarray,
    owners: np.ndarray,
    world: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows requests of one rank's batch.

    Args: ``values`` (N,) ids, features in key order; ``lengths`` (F * B,) bag lengths; ``batch`` B;
    ``window_of_sample`` (B,); ``rows_feature`` (F,) the features exchanged as rows; ``bounds`` the
    first key (``feature << ID_BITS | row``) of every shard, ascending, with ``starts`` its first row and
    ``owners`` its rank; ``world`` the world size.

    Returns: ``sent`` (U,) ``local row | mask << ID_BITS``, ``feature`` (U,), ``owner`` (U,),
    ``per_owner`` (world,), ``mask`` (U,), all in send order (owner, feature, first use), and ``occurrence`` (N,), the request each id
    occurrence reads (-1 for features not exchanged as rows); and per (owner, feature), (world, F): the
    requests, and the rows the windows receive for them (the masks' bits).
    """
    n = values.shape[0]
    cap, bits = 16, 4
    while cap < 2 * n:  # at most half full: ~1.5 probes a lookup
        cap, bits = cap * 2, bits + 1
    shift = np.uint64(64 - bits)
    table = np.full(2 * cap, -1, dtype=np.int64)  # cell c: its key at 2c, the key's first-seen index at 2c+1
    firsts = np.empty(n, dtype=np.int64)  # distinct keys in first-seen order
    masks = np.zeros(n, dtype=np.int64)
    inverse = np.full(n, -1, dtype=np.int64)
    num_features = rows_feature.shape[0]
    if lengths.shape[0] != num_features * batch:
        raise ValueError("the bag lengths are not one per feature and sample")
    if np.sum(lengths) != n:
        raise ValueError("the bag lengths do not add up to the batch's ids")
    distinct = 0
    i = 0
    for f in range(num_features):
        if not rows_feature[f]:
            i += np.sum(lengths[f * batch : (f + 1) * batch])
            continue
        high = np.int64(f) << ID_BITS
        for s in range(batch):
            bit = np.int64(1) << window_of_sample[s]
            for _ in range(lengths[f * batch + s]):
                v = values[i]
                if v < 0 or v > _LOW:
                    raise ValueError("ids must lie in [0, 2**48) for the rows exchange")
                key = high | v
                cell = np.int64((np.uint64(key) * _MUL) >> shift)
                while True:  # linear probing; key and index side by side, one cache line a probe
                    if table[2 * cell] == key:
                        u = table[2 * cell + 1]
                        break
                    if table[2 * cell] < 0:
                        u = distinct
                        table[2 * cell], table[2 * cell + 1] = key, u
                        firsts[u] = key
                        distinct += 1
                        break
                    cell = (cell + 1) & (cap - 1)
                masks[u] |= bit
                inverse[i] = u
                i += 1
    # send order: a stable counting sort of the first-seen order by (owner, feature)
    group = np.empty(distinct, dtype=np.int64)
    shard_owner = np.empty(distinct, dtype=np.int64)
    local = np.empty(distinct, dtype=np.int64)
    start = np.zeros(world * num_features + 1, dtype=np.int64)
    first_shard = np.searchsorted(bounds >> ID_BITS, np.arange(num_features + 1))  # each feature's shards
    for u in range(distinct):
        key = firsts[u]
        lo, hi = first_shard[key >> ID_BITS], first_shard[(key >> ID_BITS) + 1]
        while hi - lo > 1:  # the feature's last shard starting at or below the key
            mid = (lo + hi) // 2
            if bounds[mid] <= key:
                lo = mid
            else:
                hi = mid
        shard = lo
        shard_owner[u] = owners[shard]
        group[u] = owners[shard] * num_features + (key >> ID_BITS)
        local[u] = (key & _LOW) - starts[shard]
        start[group[u] + 1] += 1
    asked = np.empty((world, num_features), dtype=np.int64)
    for g in range(world * num_features):
        asked[g // num_features, g % num_features] = start[g + 1]
        start[g + 1] += start[g]
    per_owner = np.empty(world, dtype=np.int64)
    for r in range(world):
        per_owner[r] = start[(r + 1) * num_features] - start[r * num_features]
    sent = np.empty(distinct, dtype=np.int64)
    feature = np.empty(distinct, dtype=np.int64)
    owner = np.empty(distinct, dtype=np.int64)
    mask = np.empty(distinct, dtype=np.int64)
    position = np.empty(distinct, dtype=np.int64)  # first-seen index -> send position
    for u in range(distinct):
        g = group[u]
        p = start[g]
        start[g] += 1
        sent[p] = local[u] | (masks[u] << ID_BITS)
        feature[p] = firsts[u] >> ID_BITS
        owner[p] = shard_owner[u]
        mask[p] = masks[u]
        position[u] = p
    uses = np.zeros((world, num_features), dtype=np.int64)
    for p in range(distinct):
        bits, m = 0, mask[p]
        while m:
            bits += m & 1
            m >>= 1
        uses[owner[p], feature[p]] += bits
    occurrence = np.full(n, -1, dtype=np.int64)
    for i in range(n):
        if inverse[i] >= 0:
            occurrence[i] = position[inverse[i]]
    return sent, feature, owner, per_owner, mask, occurrence, asked, uses


@numba.njit(
    "Tuple((int64[:], int64[:], int64[:], boolean[:]))(int64[:], int64[:], int64, int64[:], int64[:], int64[:])",
    nogil=True,
    cache=True,
)
def pooling_plan(  # pragma: no cover - compiled
    occurrence: np.ndarray,
    lengths: np.ndarray,
    batch: int,
    window_of_sample: np.ndarray,
    window_start: np.ndarray,
    mask: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """How each window pools its bags from its received rows.

    Args: ``occurrence`` (N,) the request each id occurrence reads (-1 for every id of a feature not
    exchanged as rows);
    ``lengths`` (F * B,); ``window_of_sample`` (B,); ``window_start`` (W + 1,) each window's first sample
    and the batch size; ``mask`` (U,) the requests' window masks in send order. Window ``w`` receives,
    in send order, the requests whose mask has bit ``w``.

    Returns: ``index`` and ``bag``, window by window and in occurrence order within one: the received row
    an occurrence reads and its bag (``feature * window size + sample in window``); ``offsets``
    (W + 1,) where each window's part starts; and ``one_hot`` (W,): every bag of the window holds one id
    of a rows feature. A one-hot window's pooled vectors are its rows: its ``index`` is sample by sample
    (``sample * F + feature``), the (b, F * D) output's row order, and its ``bag`` is unused.
    """
    windows = window_start.shape[0] - 1
    place = np.empty((mask.shape[0], windows), dtype=np.int64)  # request u among window w's rows
    seen = np.zeros(windows, dtype=np.int64)
    for u in range(mask.shape[0]):
        for w in range(windows):
            place[u, w] = seen[w]
            seen[w] += (mask[u] >> w) & 1
    num_features = lengths.shape[0] // batch if batch else 0
    # a feature's ids are its samples' in order, and a window's samples are contiguous: walk (feature,
    # window) blocks, each read once, with its fill position in a register
    offsets = np.zeros(windows + 1, dtype=np.int64)
    one_hot = np.ones(windows, dtype=np.bool_)
    i = 0
    for f in range(num_features):
        for w in range(windows):
            count, ones = 0, True
            for j in range(f * batch + window_start[w], f * batch + window_start[w + 1]):
                count += lengths[j]
                ones &= lengths[j] == 1
            if count and occurrence[i] >= 0:  # a feature's ids all go as rows, or none does
                offsets[w + 1] += count
            else:
                ones = False
            one_hot[w] &= ones
            i += count
    for w in range(windows):
        offsets[w + 1] += offsets[w]
    index = np.empty(offsets[windows], dtype=np.int64)
    bag = np.empty(offsets[windows], dtype=np.int64)
    fill = offsets[:-1].copy()
    i = 0
    for f in range(num_features):
        for w in range(windows):
            first, size, at = window_start[w], window_start[w + 1] - window_start[w], fill[w]
            if one_hot[w]:
                for s in range(first, first + size):
                    index[offsets[w] + (s - first) * num_features + f] = place[occurrence[i], w]
                    i += 1
                fill[w] = at + size
                continue
            for s in range(first, first + size):
                for _ in range(lengths[f * batch + s]):
                    u = occurrence[i]
                    if u >= 0:
                        index[at] = place[u, w]
                        bag[at] = f * size + s - first
                        at += 1
                    i += 1
            fill[w] = at
    return index, bag, offsets, one_hot


@numba.njit("Tuple((int64[:], int64[:, :]))(int64[:], int64[:], int64, int64)", nogil=True, cache=True)
def window_members(  # pragma: no cover - compiled
    mask: np.ndarray, rank: np.ndarray, windows: int, world: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per window, the indices (ascending) whose ``mask`` has the window's bit, concatenated window by
    window; and ``counts`` (W, world): how many of them belong to each ``rank``."""
    # branch-free (a mask's bits are as good as random, so a branch on one is mispredicted half the time):
    # every index is written, and the write position moves on only past a member
    counts = np.zeros((windows, world), dtype=np.int64)
    members = np.empty(mask.shape[0] * windows + 1, dtype=np.int64)
    total = 0
    for w in range(windows):
        for u in range(mask.shape[0]):
            bit = (mask[u] >> w) & 1
            members[total] = u
            total += bit
            counts[w, rank[u]] += bit
    return members[:total].copy(), counts


@numba.njit(
    "Tuple((int64[:], int64[:], int64[:], int64[:]))(int64[:, :], int64[:], int64[:], int64[:], int64[:])",
    nogil=True,
    cache=True,
)
def lookup_layout(  # pragma: no cover - compiled
    asked: np.ndarray, local: np.ndarray, module_of: np.ndarray, position_of: np.ndarray, tables: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """How an owner looks up the rows asked of it, each FBGEMM module once, a row as a bag of one.

    Args: ``asked`` (world, F) rows each rank asked per feature, and ``local`` (S,) their rows, in the
    order asked (requester, then feature); ``module_of`` (F,) the module holding each feature's shard
    here (-1: none), ``position_of`` (F,) its table among the module's; ``tables`` (M,) per module.

    Returns: per module in turn, its ``values`` table by table (a table's rows in the order asked) and
    its ``lengths`` (T * bags, table-major: a table's first bags hold one row each, the rest none);
    ``bags`` (M,) each module's bags (its largest table's rows); and ``index`` (S,): where each asked row
    sits among the modules' outputs stacked as rows of D (a module's ``bag * T + table``).
    """
    world, num_features = asked.shape
    modules = tables.shape[0]
    table_base = np.zeros(modules + 1, dtype=np.int64)
    for m in range(modules):
        table_base[m + 1] = table_base[m] + tables[m]
    count = np.zeros(table_base[modules], dtype=np.int64)  # rows asked per (module, table)
    for r in range(world):
        for f in range(num_features):
            if asked[r, f]:
                if module_of[f] < 0:
                    raise ValueError("rows were asked of a table this rank holds no shard of")
                count[table_base[module_of[f]] + position_of[f]] += asked[r, f]
    bags = np.zeros(modules, dtype=np.int64)
    for m in range(modules):
        for t in range(tables[m]):
            bags[m] = max(bags[m], count[table_base[m] + t])
    fill = np.empty(table_base[modules], dtype=np.int64)  # where each table's next row goes in values
    out_base = np.zeros(modules, dtype=np.int64)  # each module's first row among the stacked outputs
    length_base = np.zeros(modules + 1, dtype=np.int64)
    at, rows_at = 0, 0
    for m in range(modules):
        out_base[m] = rows_at
        rows_at += bags[m] * tables[m]
        length_base[m + 1] = length_base[m] + bags[m] * tables[m]
        for t in range(tables[m]):
            fill[table_base[m] + t] = at
            at += count[table_base[m] + t]
    lengths = np.zeros(length_base[modules], dtype=np.int64)
    for m in range(modules):
        for t in range(tables[m]):
            start = length_base[m] + t * bags[m]
            lengths[start : start + count[table_base[m] + t]] = 1
    first = fill.copy()
    values = np.empty(local.shape[0], dtype=np.int64)
    index = np.empty(local.shape[0], dtype=np.int64)
    k = 0
    for r in range(world):
        for f in range(num_features):
            if not asked[r, f]:
                continue
            m, t = module_of[f], position_of[f]
            slot = table_base[m] + t
            for _ in range(asked[r, f]):
                p = fill[slot]
                fill[slot] += 1
                values[p] = local[k]
                index[k] = out_base[m] + (p - first[slot]) * tables[m] + t
                k += 1
    return values, lengths, bags, index
