"""Bounded tables (embedding_store.bounds) against a plain-dict oracle that applies the rules literally,
decision for decision: each rule alone and all together, with gaps between steps, across a checkpoint
round trip, across resharding, with and without the candidates' purge."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedding_store.bounds import PROTECT_STEPS, BoundsRule, Decision, TableBounds
from embedding_store.bounds_state import check_state, merge_states, split_state


class Oracle:
    """The rules of embedding_store.bounds, step by step on dicts (slow, obviously right)."""

    def __init__(self, rule: BoundsRule) -> None:
        self.rule = rule
        self.rows: dict[int, int] = {}  # id -> last use
        self.cands: dict[int, tuple[int, int]] = {}  # id -> (count, last occurrence)

    def decide(self, s: int, ids: list[int], counts: list[int]) -> dict:
        r = self.rule
        expired = []
        if r.expire_after_steps:  # 1.
            expired = sorted(i for i, u in self.rows.items() if s - u > r.expire_after_steps)
            for i in expired:
                del self.rows[i]
                self.cands[i] = (0, s)  # starts over as a candidate with count 0
        qualifying = []  # 2.
        for i, c in zip(ids, counts, strict=True):
            if i in self.rows:
                continue
            count, last = self.cands.get(i, (0, s))
            if s - last > r.admit_window_steps:
                count = 0
            self.cands[i] = (count + c, s)
            if count + c >= r.admit_after:
                qualifying.append(i)
        in_step = set(ids)
        admitted, capped = sorted(qualifying), []
        if r.max_rows:  # 3.
            protected = [i for i, u in self.rows.items() if i in in_step or s - u < PROTECT_STEPS]
            admitted = admitted[: max(r.max_rows - len(protected), 0)]
        for i in admitted:
            self.rows[i] = s
            del self.cands[i]
        if r.max_rows:
            unprotected = sorted(
                (u, i) for i, u in self.rows.items() if i not in in_step and s - u >= PROTECT_STEPS
            )
            for _, i in unprotected[: max(len(self.rows) - r.max_rows, 0)]:
                del self.rows[i]
                self.cands[i] = (0, s)
                capped.append(i)
        for i in ids:  # 4.
            if i in self.rows:
                self.rows[i] = s
        own = [i in self.rows for i in ids]
        return {
            "own": own,
            "admitted": admitted,
            "removed": sorted(expired + capped),
            "expired": len(expired),
            "capped": len(capped),
            "default_lookups": sum(c for c, o in zip(counts, own, strict=True) if not o),
        }


def stream(seed: int, steps: int = 60, universe: int = 200, per_step: int = 40, gaps: bool = True):
    """(step, ids, counts) of a skewed stream over a small id space; steps jump ahead when ``gaps``."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, universe + 1) ** 1.1
    ids_of = rng.permutation(universe).astype(np.int64) * 7919  # spread: not 0..U-1
    s = int(rng.integers(0, 3))
    for _ in range(steps):
        draws = rng.choice(universe, size=int(rng.integers(0, per_step + 1)), p=weights / weights.sum())
        ids, counts = np.unique(ids_of[draws], return_counts=True)
        yield s, ids, counts.astype(np.int64)
        s += int(rng.choice([1, 1, 1, 1, 2, 3, 7, 20])) if gaps else 1


def as_lists(d: Decision) -> dict:
    return {
        "own": d.own.tolist(),
        "admitted": d.admitted.tolist(),
        "removed": d.removed.tolist(),
        "expired": d.expired,
        "capped": d.capped,
        "default_lookups": d.default_lookups,
    }


def check_against_oracle(tb: TableBounds, oracle: Oracle, purged: bool = True) -> None:
    state = tb.state()
    assert dict(zip(state["row_ids"].tolist(), state["row_last_use"].tolist(), strict=True)) == oracle.rows
    cands = {
        i: (c, u)
        for i, c, u in zip(
            state["candidate_ids"].tolist(),
            state["candidate_count"].tolist(),
            state["candidate_last_seen"].tolist(),
            strict=True,
        )
    }
    window = tb.rule.admit_window_steps
    expect = {
        i: v for i, v in oracle.cands.items() if v[0] > 0 and (not purged or tb.last_step - v[1] < window)
    }
    assert cands == expect
    assert tb.rows == len(oracle.rows) and tb.candidates == len(expect)
    ids = np.array(sorted(set(oracle.rows) | set(oracle.cands) | {1, 2}), dtype=np.int64)
    assert tb.lookup(ids).tolist() == [i in oracle.rows for i in ids.tolist()]


RULES = {
    "none": BoundsRule(),
    "admission": BoundsRule(admit_after=3, admit_window_steps=5),
    "expiry": BoundsRule(expire_after_steps=PROTECT_STEPS + 1),
    "cap": BoundsRule(max_rows=30),
    "all": BoundsRule(admit_after=2, admit_window_steps=6, expire_after_steps=PROTECT_STEPS, max_rows=15),
}


def run_both(rule: BoundsRule, seed: int, *, sweep: bool = False, gaps: bool = True) -> TableBounds:
    tb, oracle = TableBounds(rule), Oracle(rule)
    if sweep:
        # Sweep the step groups whenever stale entries outnumber live ones, a few groups per step.
        tb._SWEEP_MIN, tb._SWEEP_BATCH = 0, 0
    totals = np.zeros(5, dtype=np.int64)
    for s, ids, counts in stream(seed, gaps=gaps):
        got = as_lists(tb.decide(s, ids, counts))
        want = oracle.decide(s, ids.tolist(), counts.tolist())
        assert got == want, f"step {s}"
        totals += (
            len(want["admitted"]),
            want["expired"],
            want["capped"],
            want["default_lookups"],
            counts.sum(),
        )
        check_against_oracle(tb, oracle)
    assert (tb.admitted_total, tb.expired_total, tb.capped_total) == tuple(totals[:3].tolist())
    assert (tb.default_lookups_total, tb.lookups_total) == tuple(totals[3:].tolist())
    return tb


@pytest.mark.parametrize("sweep", [False, True], ids=["lazy", "swept"])
@pytest.mark.parametrize("gaps", [False, True], ids=["consecutive", "gaps"])
@pytest.mark.parametrize("name", list(RULES))
def test_each_rule_matches_the_oracle(name, gaps, sweep):
    rule = RULES[name]
    tb = run_both(rule, seed=len(name), gaps=gaps, sweep=sweep)
    assert tb.nbytes() > 0
    # the stream reaches the rule under test (and only that one acts)
    assert (tb.expired_total > 0, tb.capped_total > 0) == (rule.expire_after_steps > 0, rule.max_rows > 0)
    assert (tb.default_lookups_total > 0) == (rule.admit_after > 1 or rule.max_rows > 0)


def test_the_streams_exercise_every_rule():
    """The oracle streams reach what they test: refused admissions, expiry, capping, re-admission in the
    step of an expiry."""
    seen = dict.fromkeys(["refused", "expired", "capped", "readmitted"], False)
    rule = RULES["all"]
    tb, oracle = TableBounds(rule), Oracle(rule)
    for s, ids, counts in stream(3):
        d = tb.decide(s, ids, counts)
        oracle.decide(s, ids.tolist(), counts.tolist())
        seen["expired"] |= d.expired > 0
        seen["capped"] |= d.capped > 0
        seen["readmitted"] |= bool(np.intersect1d(d.removed, d.admitted).size)
        seen["refused"] |= any(oracle.cands.get(i, (0, 0))[0] >= rule.admit_after for i in ids.tolist())
        assert tb.rows <= rule.max_rows  # the cap is hard
    assert all(seen.values()), seen


@settings(max_examples=40, deadline=None)
@given(
    admit_after=st.integers(1, 4),
    window=st.integers(1, 12),
    expire=st.sampled_from([0, PROTECT_STEPS, PROTECT_STEPS + 3, 25]),
    cap=st.sampled_from([0, 5, 20, 45]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_rules_match_the_oracle(admit_after, window, expire, cap, seed):
    rule = BoundsRule(
        admit_after=admit_after, admit_window_steps=window, expire_after_steps=expire, max_rows=cap
    )
    run_both(rule, seed, sweep=seed % 2 == 0)


def decide_all(tb: TableBounds, steps) -> list[dict]:
    return [as_lists(tb.decide(s, ids, counts)) for s, ids, counts in steps]


@pytest.mark.parametrize("name", ["admission", "expiry", "cap", "all"])
def test_a_state_round_trip_mid_stream_changes_no_later_decision(name):
    rule, steps = RULES[name], list(stream(11, steps=80))
    tb = TableBounds(rule)
    decide_all(tb, steps[:40])
    state = {k: v.copy() for k, v in tb.state().items()}
    assert all(v.dtype == np.int64 and v.ndim == 1 for v in state.values())
    restored = TableBounds.from_state(rule, state)
    assert restored.state().keys() == state.keys()
    assert all(np.array_equal(restored.state()[k], v) for k, v in state.items())
    assert decide_all(restored, steps[40:]) == decide_all(tb, steps[40:])
    assert all(np.array_equal(restored.state()[k], v) for k, v in tb.state().items())


def test_a_resume_under_a_smaller_cap_admits_nothing_until_the_rows_fit():
    """A state holding more rows than the new cap (another rule, another partition): the protected rows
    stay, nothing is admitted, and the rows fall to the cap as their protection lapses — as the oracle
    started from the same state decides."""
    steps = list(stream(12, steps=90, gaps=False))
    tb = TableBounds(BoundsRule(admit_after=2, admit_window_steps=6))
    decide_all(tb, steps[:30])
    rule = BoundsRule(admit_after=2, admit_window_steps=6, max_rows=10)
    state = tb.state()
    restored, oracle = TableBounds.from_state(rule, state), Oracle(rule)
    oracle.rows = dict(zip(state["row_ids"].tolist(), state["row_last_use"].tolist(), strict=True))
    cand_keys = ("candidate_ids", "candidate_count", "candidate_last_seen")
    oracle.cands = {i: (c, u) for i, c, u in zip(*(state[k].tolist() for k in cand_keys), strict=True)}
    assert restored.rows > 3 * rule.max_rows
    over = []
    for s, ids, counts in steps[30:]:
        assert as_lists(restored.decide(s, ids, counts)) == oracle.decide(s, ids.tolist(), counts.tolist())
        check_against_oracle(restored, oracle)
        over.append(restored.rows > rule.max_rows)
    assert over[0] and not over[-1]


def sharded_decisions(rule, steps, worlds, switch_at):
    """Decisions of owners id % world, resharded from worlds[0] to worlds[1] at ``switch_at``, reassembled."""
    ranks = [TableBounds(rule) for _ in range(worlds[0])]
    out = []
    for k, (s, ids, counts) in enumerate(steps):
        if k == switch_at:
            merged = merge_states([r.state() for r in ranks])
            parts = split_state(merged, lambda x: x % worlds[1], worlds[1])
            ranks = [TableBounds.from_state(rule, p) for p in parts]
        world = len(ranks)
        own = np.zeros(ids.size, dtype=bool)
        admitted, removed, default = [], [], 0
        for rank, tb in enumerate(ranks):
            mine = ids % world == rank
            d = tb.decide(s, ids[mine], counts[mine])
            own[mine] = d.own
            admitted += d.admitted.tolist()
            removed += d.removed.tolist()
            default += d.default_lookups
        out.append((own.tolist(), sorted(admitted), sorted(removed), default))
    return out, ranks


@pytest.mark.parametrize("worlds", [(1, 2), (2, 3), (3, 1), (2, 2)])
def test_resharding_keeps_admission_and_expiry_exact(worlds):
    rule = BoundsRule(admit_after=2, admit_window_steps=6, expire_after_steps=9)
    steps = list(stream(5, steps=90, universe=120, per_step=30))
    ref = TableBounds(rule)
    want = [
        (d.own.tolist(), d.admitted.tolist(), d.removed.tolist(), d.default_lookups)
        for d in (ref.decide(s, i, c) for s, i, c in steps)
    ]
    got, ranks = sharded_decisions(rule, steps, worlds, switch_at=45)
    assert got == want
    merged, whole = merge_states([r.state() for r in ranks]), ref.state()
    assert all(np.array_equal(merged[k], whole[k]) for k in whole)


def test_split_then_merge_is_the_identity_and_totals_are_kept():
    tb = TableBounds(RULES["all"])
    decide_all(tb, stream(6))
    state = tb.state()
    parts = split_state(state, lambda x: (x // 7919) % 3, 3)
    assert [int(p["totals"].sum() > 0) for p in parts] == [1, 0, 0]
    assert sum(p["row_ids"].size for p in parts) == state["row_ids"].size > 0
    assert all(int(p["last_step"][0]) == tb.last_step for p in parts)
    merged = merge_states(parts)
    assert all(np.array_equal(merged[k], state[k]) for k in state)


def test_the_purge_changes_no_decision_and_bounds_the_candidates():
    rule = BoundsRule(admit_after=4, admit_window_steps=3)
    purging, keeping, oracle = TableBounds(rule), TableBounds(rule), Oracle(rule)
    keeping._purge = False
    fewer = False
    for s, ids, counts in stream(8, steps=120, universe=400, per_step=40):
        a, b = purging.decide(s, ids, counts), keeping.decide(s, ids, counts)
        assert as_lists(a) == as_lists(b) == oracle.decide(s, ids.tolist(), counts.tolist())
        check_against_oracle(purging, oracle, purged=True)
        check_against_oracle(keeping, oracle, purged=False)
        fewer |= purging.candidates < keeping.candidates
    assert fewer, "the stream never left a candidate outside the window"


def test_sweeps_keep_the_step_groups_small_and_change_no_decision():
    """Rows used again leave stale entries in their old step's group; sweeps, a few groups per step, keep
    the entries within twice the live ones plus a step's ids, and the groups near the steps in use, where
    lazy groups grow with every step."""
    rule = BoundsRule(admit_after=2, admit_window_steps=50, max_rows=10**6)  # a cap that is never hit
    lazy, swept = TableBounds(rule), TableBounds(rule)
    lazy._SWEEP_MIN = 1 << 40
    swept._SWEEP_MIN, swept._SWEEP_BATCH = 0, 0
    for s, ids, counts in stream(9, steps=300, gaps=False):
        assert as_lists(lazy.decide(s, ids, counts)) == as_lists(swept.decide(s, ids, counts))
        for groups in (swept._row_groups, swept._cand_groups):
            assert groups.entries <= 2 * groups.live_total + ids.size
    assert lazy._row_groups.entries > 10 * lazy.rows == 10 * swept._row_groups.live_total
    # a pass drops the groups it emptied: about one group per step with a live row, not one per step
    steps_in_use = np.unique(swept.state()["row_last_use"]).size
    assert len(swept._row_groups) <= 2 * steps_in_use < len(lazy._row_groups)


def test_counts_saturate_without_changing_admission():
    """Counts are held as int32 and saturate at 2^31 - 1 (admit_after's largest value): a huge count kept
    by a candidate the cap refused stays a count, never wraps."""
    rule = BoundsRule(admit_after=(1 << 31) - 1, admit_window_steps=10)
    tb = TableBounds(rule)
    assert tb.decide(0, np.array([1, 2]), np.array([(1 << 31) - 2, 1 << 40])).own.tolist() == [False, True]
    assert tb.decide(1, np.array([1]), np.array([1])).own.tolist() == [True]
    capped = TableBounds(BoundsRule(max_rows=1))
    assert capped.decide(0, np.array([1, 2, 3]), np.array([1, (1 << 32) - 1, 1 << 33])).own.tolist() == [
        True,
        False,
        False,
    ]
    assert capped.state()["candidate_count"].tolist() == [(1 << 31) - 1] * 2
    assert capped.lookup(np.array([1, 2, 3])).tolist() == [True, False, False]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"admit_after": 0}, "BoundsRule.admit_after must be in [1, 2147483647], got 0"),
        ({"admit_after": 1 << 31}, "BoundsRule.admit_after must be in [1, 2147483647], got 2147483648"),
        ({"admit_window_steps": 0}, "BoundsRule.admit_window_steps must be >= 1, got 0"),
        ({"expire_after_steps": -1}, "BoundsRule.expire_after_steps must be >= 0, got -1"),
        (
            {"expire_after_steps": PROTECT_STEPS - 1},
            "expire_after_steps must be 0 (never) or >= PROTECT_STEPS",
        ),
        ({"max_rows": -5}, "BoundsRule.max_rows must be >= 0, got -5"),
        ({"max_rows": 2.5}, "BoundsRule.max_rows must be an integer, got 2.5"),
        ({"admit_after": True}, "BoundsRule.admit_after must be an integer, got True"),
    ],
)
def test_rule_validation(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        BoundsRule(**fields)


def test_rule_active():
    assert not BoundsRule().active
    assert not BoundsRule(admit_window_steps=5).active
    assert BoundsRule(admit_after=2).active
    assert BoundsRule(expire_after_steps=PROTECT_STEPS).active
    assert BoundsRule(max_rows=1).active


def test_decide_refuses_bad_arguments():
    tb = TableBounds(BoundsRule(admit_after=2))
    tb.decide(3, np.array([1, 2]), np.array([1, 1]))
    for step, ids, counts, message in [
        (3, [4], [1], "greater than the last step 3, got 3"),
        (4, [2, 1], [1, 1], "strictly ascending"),
        (4, [1, 1], [1, 1], "strictly ascending"),
        (4, [-1, 2], [1, 1], "ids must be >= 0, got -1"),
        (4, [1, 2], [1, 0], "counts must be >= 1, got 0"),
        (4, [1, 2], [1], r"counts have shape \(1,\) for ids of shape \(2,\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            tb.decide(step, np.array(ids), np.array(counts))
    assert tb.last_step == 3 and tb.lookups_total == 2


def test_from_state_and_split_refuse_bad_states():
    tb = TableBounds(BoundsRule(admit_after=2))
    tb.decide(0, np.array([1, 2, 3]), np.array([2, 1, 2]))
    good = tb.state()
    assert check_state(good)["row_ids"].tolist() == [1, 3]
    bad = [
        ({"row_ids": None}, "lacks 'row_ids'"),
        (
            {"candidate_count": np.array([0])},
            r"'candidate_count' must lie in \[1, 2147483647\], got \[0, 0\]",
        ),
        ({"candidate_ids": np.array([3])}, "holds 1 ids as both row and candidate, e.g. 3"),
        ({"row_last_use": np.array([0, 5])}, r"'row_last_use' must lie in \[0, last_step=0\], got \[0, 5\]"),
        ({"row_last_use": np.array([0])}, "'row_last_use' has 1 entries for 2 row_ids"),
        ({"row_ids": np.array([3, 1])}, "'row_ids' must be strictly ascending"),
        ({"totals": np.zeros(4, dtype=np.int64)}, r"shapes \(1,\) and \(5,\)"),
        ({"row_ids": np.array([1.0, 3.0])}, "must be a 1-D integer array, got float64"),
    ]
    for change, message in bad:
        state = {**good, **change}
        state = {k: v for k, v in state.items() if v is not None}
        with pytest.raises(ValueError, match=message):
            TableBounds.from_state(tb.rule, state)
    with pytest.raises(ValueError, match=r"owners in \[1, 3\], not \[0, 2\)"):
        split_state(good, lambda x: x, 2)
    with pytest.raises(ValueError, match="strictly ascending"):
        merge_states([good, good])  # an id held by two owners
