"""Key routing in one process: N ranks simulated by threads over an in-process exchange, every result
checked against a per-id oracle — who owns each id, what each owner receives, which slot comes back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.errors import UserError
from recsys.routing import Ownership, RoutedIds, Router, owner_of_ids, tiered_features, values_by_feature
from recsys.store_config import StoreSection

T = TypeVar("T")
M64 = (1 << 64) - 1
SLOT_BLOCK = 1 << 20  # owner o's slots are o * SLOT_BLOCK + its index among the ids it received


# -- the in-process exchange ------------------------------------------------------------------------


class _Hub:
    """What the simulated ranks of one group share: a mailbox per (sender, receiver) and a barrier."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.box: list[list[Any]] = [[None] * world_size for _ in range(world_size)]
        self.calls = 0


class FakeExchange:
    """The :class:`recsys.routing.Exchange` of one simulated rank: what it sends lands in the hub's
    mailboxes, the barrier waits for every rank, and each rank collects what was sent to it."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def _swap(self, outgoing: list[Any]) -> list[Any]:
        hub = self.hub
        for dest, item in enumerate(outgoing):
            hub.box[self.rank][dest] = item
        hub.barrier.wait()
        incoming = [hub.box[src][self.rank] for src in range(hub.world_size)]
        if self.rank == 0:
            hub.calls += 1
        hub.barrier.wait()  # nobody refills the mailboxes before every rank has read them
        return incoming

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        assert send.dim() == 1 and len(send_splits) == self.hub.world_size == len(recv_splits)
        assert sum(send_splits) == send.shape[0]
        got = self._swap([p.clone() for p in torch.split(send, send_splits)])
        assert [g.shape[0] for g in got] == recv_splits, "recv_splits must match what the peers send"
        return torch.cat(got)

    def all_gather(self, obj: T) -> list[T]:
        return self._swap([obj] * self.hub.world_size)


class NoExchange:
    """One rank must route without collectives."""

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        raise AssertionError("one rank must not exchange")

    def all_gather(self, obj: T) -> list[T]:
        raise AssertionError("one rank must not exchange")


def on_ranks(world_size: int, fn: Callable[[int, FakeExchange], T]) -> list[T]:
    """Run ``fn(rank, exchange)`` on ``world_size`` threads, one per simulated rank; results by rank."""
    hub = _Hub(world_size)
    with ThreadPoolExecutor(max_workers=world_size) as pool:
        futures = [pool.submit(_guarded, hub, fn, r) for r in range(world_size)]
        return [f.result(timeout=60) for f in futures]


def _guarded(hub: _Hub, fn: Callable[[int, FakeExchange], T], rank: int) -> T:
    try:
        return fn(rank, FakeExchange(hub, rank))
    except BaseException:
        hub.barrier.abort()  # the other ranks fail at their next collective instead of waiting
        raise


# -- the oracle -------------------------------------------------------------------------------------


def oracle_hash_owner(x: int, world_size: int) -> int:
    """The row-wise owner of id ``x``, in plain Python integers: the 64-bit mixer, then the signed
    64-bit result modulo the world size (floored, as ``torch.remainder``)."""
    x &= M64
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 29
    x = (x * 0x94D049BB133111EB) & M64
    x ^= x >> 32
    signed = x - (1 << 64) if x >> 63 else x
    return signed % world_size


def oracle_owner(x: int, table: str, *, row_wise: bool, world_size: int, table_owner: dict[str, int]) -> int:
    if row_wise and world_size > 1:
        return oracle_hash_owner(x, world_size)
    return table_owner[table]


def route_and_return(
    ownership: Ownership, held: list[set[str]], names: list[str], batches: list[dict[str, torch.Tensor]]
) -> list[tuple[RoutedIds, dict[str, torch.Tensor]]]:
    """Every rank routes its batch; each owner gives every id it received the slot
    ``o * SLOT_BLOCK + index among the distinct ids it received``; the slots go back. Per rank: its
    routing and the slot of each value."""

    def rank_fn(rank: int, exchange: Any) -> tuple[RoutedIds, dict[str, torch.Tensor]]:
        router = Router(ownership, names=names, held=held[rank])
        routed = router.route(batches[rank], exchange)
        slots = {}
        for name, ids in routed.owner_ids.items():
            distinct = np.unique(ids.numpy())
            slots[name] = torch.from_numpy(np.searchsorted(distinct, ids.numpy()) + rank * SLOT_BLOCK)
        return routed, router.return_slots(routed, slots, exchange)

    if ownership.world_size == 1:
        return [rank_fn(0, NoExchange())]
    return on_ranks(ownership.world_size, rank_fn)


def check_against_oracle(
    *,
    world_size: int,
    row_wise: bool,
    table_owner: dict[str, int],
    batches: list[dict[str, torch.Tensor]],
) -> None:
    names = list(batches[0])
    held = [set(names) if row_wise else {n for n in names if table_owner[n] == r} for r in range(world_size)]
    ownership = Ownership(world_size=world_size, row_wise=row_wise, table_owner=table_owner)
    results = route_and_return(ownership, held, names, batches)

    def owner(x: int, name: str) -> int:
        return oracle_owner(x, name, row_wise=row_wise, world_size=world_size, table_owner=table_owner)

    # What each owner must receive: from every sender in rank order, the sender's distinct ids it owns,
    # ascending.
    expected_ids = {
        (o, name): [
            x
            for s in range(world_size)
            for x in sorted(set(batches[s][name].tolist()))
            if owner(x, name) == o
        ]
        for o in range(world_size)
        for name in names
    }
    for o, (routed, _) in enumerate(results):
        assert sorted(routed.owner_ids) == sorted(held[o])
        for name in held[o]:
            assert routed.owner_ids[name].dtype == torch.int64
            assert routed.owner_ids[name].tolist() == expected_ids[(o, name)], (o, name)
        for name in set(names) - held[o]:
            assert not expected_ids[(o, name)], "ids routed to a rank that does not hold the table"
    for s, (routed, value_slots) in enumerate(results):
        for t, name in enumerate(names):
            sent = sorted(set(batches[s][name].tolist()))
            assert routed.send_counts[:, t].tolist() == [
                sum(owner(x, name) == d for x in sent) for d in range(world_size)
            ]
            expected = []
            for x in batches[s][name].tolist():
                o = owner(x, name)
                expected.append(o * SLOT_BLOCK + sorted(set(expected_ids[(o, name)])).index(x))
            assert value_slots[name].tolist() == expected, (s, name)


def _batch(rng: np.random.Generator, sizes: dict[str, int], high: int = 1 << 62) -> dict[str, torch.Tensor]:
    """Raw ids per table, with repeats (popular ids) and ids spread over the whole int64 range."""
    out = {}
    for name, n in sizes.items():
        ids = np.concatenate([rng.integers(0, 50, n // 2), rng.integers(0, high, n - n // 2)])
        rng.shuffle(ids)
        out[name] = torch.from_numpy(ids.astype(np.int64))
    return out


# -- the tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_table_wise_ids_go_to_the_rank_holding_the_table(world_size):
    rng = np.random.default_rng(world_size)
    table_owner = {"a": world_size - 1, "b": 0, "c": world_size - 1, "d": 1}  # some ranks hold none
    batches = [_batch(rng, {"a": 40, "b": 25, "c": 7, "d": 60}) for _ in range(world_size)]
    check_against_oracle(world_size=world_size, row_wise=False, table_owner=table_owner, batches=batches)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_row_wise_ids_go_to_their_hash_owner(world_size):
    rng = np.random.default_rng(10 + world_size)
    batches = [_batch(rng, {"a": 200, "b": 64}) for _ in range(world_size)]
    table_owner = {"a": world_size - 1, "b": world_size - 1}  # row-wise: unused
    check_against_oracle(world_size=world_size, row_wise=True, table_owner=table_owner, batches=batches)


@pytest.mark.parametrize("row_wise", [False, True])
def test_one_rank_routes_without_collectives(row_wise):
    rng = np.random.default_rng(1)
    batches = [_batch(rng, {"a": 50, "b": 9})]
    check_against_oracle(world_size=1, row_wise=row_wise, table_owner={"a": 0, "b": 0}, batches=batches)


@pytest.mark.parametrize("row_wise", [False, True])
def test_uneven_splits_ranks_send_different_numbers_of_ids(row_wise):
    rng = np.random.default_rng(2)
    sizes = [{"a": 0, "b": 300}, {"a": 1000, "b": 1}, {"a": 5, "b": 0}]
    batches = [_batch(rng, s) for s in sizes]
    check_against_oracle(world_size=3, row_wise=row_wise, table_owner={"a": 2, "b": 1}, batches=batches)


@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("world_size", [1, 3])
def test_empty_tables_and_empty_batches(row_wise, world_size):
    empty = torch.empty(0, dtype=torch.int64)
    rng = np.random.default_rng(3)
    table_owner = {"a": 0, "b": world_size - 1}
    all_empty = [{"a": empty, "b": empty} for _ in range(world_size)]
    check_against_oracle(world_size=world_size, row_wise=row_wise, table_owner=table_owner, batches=all_empty)
    one_empty_table = [{"a": empty, "b": _batch(rng, {"b": 30})["b"]} for _ in range(world_size)]
    check_against_oracle(
        world_size=world_size, row_wise=row_wise, table_owner=table_owner, batches=one_empty_table
    )


def test_repeated_ids_are_sent_once_and_every_repeat_gets_the_slot():
    batches = [{"a": torch.tensor([7, 7, 7, 3, 7, 3])}, {"a": torch.tensor([3, 3, 9])}]
    check_against_oracle(world_size=2, row_wise=True, table_owner={"a": 1}, batches=batches)
    check_against_oracle(world_size=2, row_wise=False, table_owner={"a": 1}, batches=batches)


def test_owner_of_ids_is_the_oracle_hash():
    rng = np.random.default_rng(4)
    ids = np.concatenate([np.arange(1000), rng.integers(0, (1 << 63) - 1, 5000), [(1 << 63) - 1]])
    for world_size in (1, 2, 3, 7, 8):
        got = owner_of_ids(torch.from_numpy(ids), world_size).tolist()
        assert got == [oracle_hash_owner(int(x), world_size) for x in ids]


@pytest.mark.parametrize("row_wise", [False, True])
def test_owns_and_split_follow_the_same_rule(row_wise):
    """The re-partition's keep (``owns``) and the tuner's replay (``split``) agree with the oracle."""
    world_size, table_owner = 3, {"a": 1}
    ownership = Ownership(world_size=world_size, row_wise=row_wise, table_owner=table_owner)
    ids = np.unique(np.random.default_rng(5).integers(0, 1 << 40, 500))
    owners = [
        oracle_owner(int(x), "a", row_wise=row_wise, world_size=3, table_owner=table_owner) for x in ids
    ]
    for rank in range(world_size):
        assert ownership.owns("a", ids, rank).tolist() == [o == rank for o in owners]
    shares = ownership.split("a", torch.from_numpy(ids))
    assert [s.tolist() for s in shares] == [
        [int(x) for x, o in zip(ids, owners, strict=True) if o == r] for r in range(3)
    ]


def test_ownership_agree_gives_each_table_to_the_rank_holding_it():
    held = [["c", "a"], [], ["b"]]

    def agree(rank: int, exchange: Any) -> Ownership:
        return Ownership.agree(held[rank], world_size=3, row_wise=False, exchange=exchange)

    results = on_ranks(3, agree)
    assert all(dict(r.table_owner) == {"a": 0, "c": 0, "b": 2} for r in results)
    one = Ownership.agree(["x"], world_size=1, row_wise=True, exchange=NoExchange())
    assert dict(one.table_owner) == {"x": 0}


def test_route_uses_two_all_to_alls_and_return_one():
    hub_calls = []

    def rank_fn(rank: int, exchange: FakeExchange) -> None:
        router = Router(Ownership(world_size=2, row_wise=True), names=["a"], held={"a"})
        routed = router.route({"a": torch.tensor([rank, 5, 9])}, exchange)
        if rank == 0:
            hub_calls.append(exchange.hub.calls)
        router.return_slots(routed, {"a": routed.owner_ids["a"]}, exchange)
        if rank == 0:
            hub_calls.append(exchange.hub.calls)

    on_ranks(2, rank_fn)
    assert hub_calls == [2, 3]


def test_values_by_feature_splits_a_kjt_by_key():
    kjt = KeyedJaggedTensor(
        keys=["f", "g"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 0, 1, 2])
    )
    values = values_by_feature(kjt)
    assert list(values) == ["f", "g"]
    assert values["f"].tolist() == [1, 2] and values["g"].tolist() == [3, 4, 5]


def test_tiered_features():
    features = ["u", "i", "c"]
    assert tiered_features(StoreSection(), features) == []
    assert tiered_features(StoreSection(tiered=True), features) == features
    assert tiered_features(StoreSection(tiered=True, tables=("c", "u")), features) == ["u", "c"]
    with pytest.raises(UserError, match=r"unknown features \['x'\]"):
        tiered_features(StoreSection(tiered=True, tables=("x",)), features)


@pytest.mark.parametrize(
    ("row_wise", "world_size"), [(False, 1), (True, 1), (False, 3), (True, 2), (True, 3)]
)
def test_counts_travel_with_the_ids_to_their_owner(row_wise, world_size):
    """With ``counts=True`` every owner learns, per id it received, how often it occurs in the sender's
    batch: summed over senders, each id's occurrences in the global batch (what bounded tables count)."""
    rng = np.random.default_rng(40 + world_size)
    names = ["a", "b"]
    table_owner = {"a": world_size - 1, "b": 0}
    sizes = [{"a": 90, "b": 0}, {"a": 7, "b": 120}, {"a": 300, "b": 5}][:world_size]
    batches = [_batch(rng, s) for s in sizes]
    ownership = Ownership(world_size=world_size, row_wise=row_wise, table_owner=table_owner)
    held = [{"a", "b"} if row_wise else {n for n in names if table_owner[n] == r} for r in range(world_size)]

    def rank_fn(rank: int, exchange: Any) -> RoutedIds:
        return Router(ownership, names=names, held=held[rank]).route(batches[rank], exchange, counts=True)

    routed = [rank_fn(0, NoExchange())] if world_size == 1 else on_ranks(world_size, rank_fn)
    for name in names:
        want: dict[int, int] = {}
        for b in batches:
            for x in b[name].tolist():
                want[x] = want.get(x, 0) + 1
        got: dict[int, int] = {}
        for rank, r in enumerate(routed):
            if name not in r.owner_ids:
                continue
            assert r.owner_counts is not None
            ids, occ = r.owner_ids[name].tolist(), r.owner_counts[name].tolist()
            assert len(ids) == len(occ)
            for x, c in zip(ids, occ, strict=True):
                assert (
                    oracle_owner(x, name, row_wise=row_wise, world_size=world_size, table_owner=table_owner)
                    == rank
                )
                got[x] = got.get(x, 0) + c
        assert got == want
    assert all(
        r.owner_counts is None
        for r in on_ranks(
            2,
            lambda rank, ex: Router(
                Ownership(world_size=2, row_wise=True, table_owner={"a": 1, "b": 1}),
                names=names,
                held={"a", "b"},
            ).route(_batch(np.random.default_rng(rank), {"a": 5, "b": 5}), ex),
        )
    )
