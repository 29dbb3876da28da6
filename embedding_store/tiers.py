"""The two cache tiers above LMDB, the host arena and the device slot table.

The tiers are free of I/O and of locking (the store serialises calls); they keep an id map, a position ->
id array, a free-position stack and an eviction policy, and move packed float32 rows (see ``config``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from embedding_store.config import PolicyKind, TableSpec, WeightsPrecision
from embedding_store.index import make_id_map
from embedding_store.memory import empty_host, to_device, to_host
from embedding_store.policies import make_policy
from embedding_store.rows import pack_weights, weights_of

__all__ = ["DeviceTier", "FutureIds", "HostTier"]

# Lazily: the announced batches of the window as (batches from now, the sorted unique ids it uses),
# nearest first; empty when nothing is announced.
FutureIds = Callable[[], "list[tuple[int, np.ndarray]]"]


class _Positions:
    """id map + position owner array + free stack + policy over ``capacity`` positions."""

    def __init__(self, spec: TableSpec, capacity: int, policy: PolicyKind) -> None:
        self.capacity = capacity
        self.map = make_id_map(spec.num_embeddings, capacity)
        self.ids = np.full(capacity, -1, dtype=np.int64)  # (capacity,) id held by each position
        self.policy = make_policy(policy, capacity)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # stack, pops from the end
        self._num_free = capacity

    @property
    def num_free(self) -> int:
        return self._num_free

    def __len__(self) -> int:
        return self.capacity - self._num_free

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """(N,) ids -> (N,) positions, -1 where absent."""
        return self.map.lookup(ids)

    def occupied(self) -> np.ndarray:
        """(K,) positions holding a row."""
        return np.flatnonzero(self.ids >= 0)

    def resident_ids(self) -> np.ndarray:
        """(K,) ids held, unordered."""
        return self.ids[self.ids >= 0]

    def future_mask(self, positions: np.ndarray, future: FutureIds) -> np.ndarray | None:
        """(K,) batches until an announced batch next uses the row at each position; -1 where none does."""
        if not self.policy.needs_future:
            return None
        window = future()
        if not window:
            return None
        mark = np.full(self.capacity, -1, dtype=np.int64)
        for distance, ids in reversed(window):  # the nearest use is marked last: it wins
            self.map.mark(ids, distance, mark)
        return mark[positions]

    def allocate(self, ids: np.ndarray) -> np.ndarray:
        """Give (N,) absent unique ids free positions; returns (N,) positions."""
        n = ids.shape[0]
        assert n <= self._num_free, "allocate beyond free positions"
        pos = self._free[self._num_free - n : self._num_free][::-1].copy()  # ascending when unfragmented
        self._num_free -= n
        self.ids[pos] = ids
        self.map.insert(ids, pos)
        self.policy.insert(pos)
        return pos

    def deallocate(self, pos: np.ndarray) -> None:
        """Empty (N,) distinct occupied positions."""
        n = pos.shape[0]
        self.map.remove(self.ids[pos])
        self.ids[pos] = -1
        self.policy.remove(pos)
        self._free[self._num_free : self._num_free + n] = pos
        self._num_free += n


class HostTier(_Positions):
    """Host DRAM arena of ``capacity`` packed rows with dirty bits.

    A row here is authoritative unless the device tier holds the same id (the store moves rows up by
    *taking* them, so the tiers stay exclusive). Clean rows equal their LMDB copy (or the lazy init);
    dirty rows must be written back when evicted.
    """

    def __init__(self, spec: TableSpec, capacity: int, policy: PolicyKind) -> None:
        super().__init__(spec, capacity, policy)
        self.arena = empty_host(capacity, spec.row_floats)  # (H, R) pinned when CUDA is present
        self._arena_np = self.arena.numpy()  # (H, R) view
        self.dirty = np.zeros(capacity, dtype=bool)  # (H,)

    def gather(self, pos: np.ndarray) -> np.ndarray:
        """(N,) positions -> (N, R) copies of their rows."""
        return np.take(self._arena_np, pos, axis=0)

    def take(self, pos: np.ndarray) -> np.ndarray:
        """Remove (N,) distinct positions and return their (N, R) rows."""
        rows = self.gather(pos)
        self.drop(pos)
        return rows

    def drop(self, pos: np.ndarray) -> None:
        """Empty (N,) distinct positions without reading their rows, dirty or not (nothing is written
        back: the caller spills the dirty rows it keeps, and a deleted row is gone)."""
        self.dirty[pos] = False
        self.deallocate(pos)

    def put(
        self, ids: np.ndarray, rows: np.ndarray, *, dirty: bool, future: FutureIds
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Insert (N,) absent unique ids with (N, R) rows, evicting as needed.

        Returns:
            spill_ids (M,), spill_rows (M, R): dirty rows that did not fit or were evicted; the caller
            must hand them to the writer. Also the number of evicted rows.
        """
        spill_ids: list[np.ndarray] = []
        spill_rows: list[np.ndarray] = []
        if ids.shape[0] > self.capacity:  # more than the arena holds: the overflow goes straight down
            if dirty:
                spill_ids.append(ids[self.capacity :])
                spill_rows.append(rows[self.capacity :])
            ids, rows = ids[: self.capacity], rows[: self.capacity]
        need = ids.shape[0] - self.num_free
        if need > 0:
            cand = self.occupied()
            victims = self.policy.victims(need, cand, self.future_mask(cand, future))
            # Only the dirty victims' rows are copied out (once): clean ones equal their LMDB copy.
            dirty_victims = victims[self.dirty[victims]]
            spill_ids.append(self.ids[dirty_victims])
            spill_rows.append(self.gather(dirty_victims))
            self.drop(victims)
        if ids.shape[0]:
            pos = self.allocate(ids)
            if pos[-1] - pos[0] == pos.shape[0] - 1 and (np.diff(pos) == 1).all():  # one contiguous block
                self._arena_np[pos[0] : pos[-1] + 1] = rows
            else:
                self._arena_np[pos] = rows
            self.dirty[pos] = dirty
        evicted = max(need, 0)
        if not spill_ids:
            return np.empty(0, dtype=np.int64), np.empty((0, self.arena.shape[1]), np.float32), evicted
        if len(spill_ids) == 1:  # the usual case: no second copy of the rows
            return spill_ids[0], spill_rows[0], evicted
        return np.concatenate(spill_ids), np.concatenate(spill_rows), evicted

    def dirty_positions(self) -> np.ndarray:
        """(K,) positions of dirty rows."""
        return np.flatnonzero(self.dirty)


class DeviceTier(_Positions):
    """Slots of an externally owned slot table: its weights (S, D) and optimizer state, read and written
    in place (FBGEMM's ``split_embedding_weights()``/``split_optimizer_states()`` alias live storage).

    Pins are kept per in-flight batch as the slot arrays it uses (duplicates allowed); a slot in any
    of them is never evicted or overwritten. The pinned mask is derived only when evicting, so a
    batch whose rows are all resident costs one lookup and no per-slot bookkeeping beyond the policy.
    """

    def __init__(
        self, spec: TableSpec, weights: torch.Tensor, state: torch.Tensor | None, policy: PolicyKind
    ) -> None:
        # An fp16 table's slot table may hold its float16 values as float32 (rounded by its trainer).
        dtypes = {getattr(torch, spec.weights_precision.dtype), torch.float32}
        if weights.dim() != 2 or weights.shape[1] != spec.dim or weights.dtype not in dtypes:
            raise ValueError(
                f"weights of table {spec.name!r} must be (S, {spec.dim}) {spec.weights_precision.dtype}, got "
                f"{tuple(weights.shape)} {weights.dtype}"
            )
        num_slots = weights.shape[0]
        state_floats = spec.state_floats
        if state_floats == 0:
            if state is not None and state.numel() != 0:
                raise ValueError(
                    f"table {spec.name!r} ({spec.optimizer.name}) has no optimizer state, got {state.shape}"
                )
            state_2d = None
        else:
            if state is None or state.numel() != num_slots * state_floats or state.dtype != torch.float32:
                raise ValueError(
                    f"optimizer state of table {spec.name!r} must hold {num_slots}x{state_floats} float32, got "
                    f"{None if state is None else (tuple(state.shape), state.dtype)}"
                )
            state_2d = state.view(num_slots, state_floats)  # a view: writes reach the caller's storage
        super().__init__(spec, num_slots, policy)
        self.weights = weights  # (S, D)
        self.state = state_2d  # (S, Z) or None
        self.spec = spec
        self.words = spec.weight_words  # the packed rows' weight words
        self.fp32 = spec.weights_precision is WeightsPrecision.FP32
        # CPU slot tables are read and written through numpy views of the same storage (no autograd
        # version bump, as with ``.data``): a few rows cost ~1 us instead of torch's per-call ~5 us.
        self._host_views: tuple[np.ndarray, np.ndarray | None] | None = None
        if weights.device.type == "cpu":
            views = weights.detach().numpy(), None if state_2d is None else state_2d.detach().numpy()
            self._host_views = views
        self._pins: dict[int, list[np.ndarray]] = {}  # in-flight batch -> slot arrays it pinned

    def read(self, slots: np.ndarray) -> np.ndarray:
        """(N,) slots -> (N, R) packed rows (weights then optimizer state), copied to the host."""
        if self._host_views is None:
            index = torch.from_numpy(slots).to(self.weights.device)
            weights = self.weights.index_select(0, index)  # (N, D)
            if self.fp32:
                if self.state is not None:
                    weights = torch.cat([weights, self.state.index_select(0, index)], dim=1)  # (N, R)
                return to_host(weights).numpy()
            weights_np = to_host(weights).numpy()
            state_np = None if self.state is None else to_host(self.state.index_select(0, index)).numpy()
            slots = np.arange(slots.shape[0])
        else:
            weights_np, state_np = self._host_views
        if self.fp32:
            rows = np.take(weights_np, slots, axis=0)
            return rows if state_np is None else np.concatenate([rows, np.take(state_np, slots, axis=0)], 1)
        rows = np.empty((slots.shape[0], self.spec.row_floats), dtype=np.float32)
        pack_weights(self.spec, np.take(weights_np, slots, axis=0), rows[:, : self.words])  # exact: fp16
        if state_np is not None:
            rows[:, self.words :] = np.take(state_np, slots, axis=0)
        return rows

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Write (N, R) packed rows into (N,) slots, in place."""
        if self._host_views is not None:
            weights_np, state_np = self._host_views
            weights_np[slots] = weights_of(self.spec, rows)
            if state_np is not None:
                state_np[slots] = rows[:, self.words :]
            return
        index = torch.from_numpy(slots).to(self.weights.device)
        src = to_device(torch.from_numpy(weights_of(self.spec, rows)), self.weights.device)  # (N, D)
        src = src.to(self.weights.dtype)  # exact: an fp16 table's float32 slot table holds float16 values
        self.weights.index_copy_(0, index, src)
        if self.state is not None:
            state = to_device(
                torch.from_numpy(np.ascontiguousarray(rows[:, self.words :])), self.weights.device
            )
            self.state.index_copy_(0, index, state)

    def pinned_mask(self) -> np.ndarray:
        """(S,) True where an in-flight batch pinned the slot."""
        mask = np.zeros(self.capacity, dtype=bool)
        arrays = [slots for pinned in self._pins.values() for slots in pinned]
        if arrays:
            mask[np.concatenate(arrays)] = True
        return mask

    def evictable(self) -> np.ndarray:
        """(K,) occupied, unpinned slots."""
        return np.flatnonzero((self.ids >= 0) & ~self.pinned_mask())

    def pin(self, slots: np.ndarray, key: int) -> None:
        """Pin (N,) slots (duplicates allowed) for in-flight batch ``key``; the array must not change."""
        self._pins.setdefault(key, []).append(slots)

    def unpin(self, key: int) -> None:
        """Drop every pin of batch ``key``."""
        self._pins.pop(key, None)
