"""``[split] group_by``: a group never straddles the split; the chronological cut; refusals.

The oracle is written out here, row by row in plain Python: group keys are the SplitMix64 token hash
(:func:`hash_strings`), groups are ordered by (first order_by value, key hash, first row), the cut is
the group boundary nearest to ``round(N * eval_fraction)`` held-out rows (ties: more held out, at least
one group), and without ``order_by`` a group is held out when ``splitmix64(key ^ salt) / 2**64`` falls
below ``eval_fraction``.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys.data.source import DataConfig, build_dataset
from recsys.data.synthetic import SyntheticConfig
from recsys.data.tokens import hash_strings
from recsys.errors import UserError

SPEC = """
name = "groups"
format = "{fmt}"
[source]
files = ["rows.{ext}"]
[read]
delimiter = ","
[label]
column = "y"
[split]
eval_fraction = {ef}
group_by = "g"
order_by = "{order_by}"
shuffle = {shuffle}
[[sparse]]
name = "row"
kind = "int"
"""

M64 = (1 << 64) - 1
SALT = 0x6A09E667F3BCC909


def _splitmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _key(group: str) -> int:
    return -1 if group == "" else int(hash_strings([group])[0])


def _write(folder: Path, groups: list[str], times: list[int] | None, labels: list[int] | None = None) -> None:
    labels = labels or [i % 2 for i in range(len(groups))]
    lines = ["row,g,t,y"] + [
        f"{i},{g},{'' if times is None else times[i]},{labels[i]}" for i, g in enumerate(groups)
    ]
    (folder / "rows.csv").write_text("\n".join(lines) + "\n")


def _build(folder: Path, *, ef: float, order_by: str = "", shuffle: bool = False, fmt: str = "csv"):
    ext = "csv" if fmt == "csv" else "parquet"
    spec = SPEC.format(fmt=fmt, ext=ext, ef=ef, order_by=order_by, shuffle=str(shuffle).lower())
    (folder / "spec.toml").write_text(spec)
    return build_dataset(DataConfig(source=str(folder / "spec.toml")), synthetic=SyntheticConfig(), seed=0)


def _rows(ds) -> tuple[list[int], list[int]]:
    """Row numbers of the training and held-out splits, in the order each is read."""
    train = ds.train_source.block.ids[0].values.tolist()
    held = ds.eval_source.block.ids[0].values.tolist()
    return train, held


def _oracle(groups: list[str], times: list[int] | None, ef: float) -> tuple[list[int], list[int]]:
    n = len(groups)
    order = list(range(n)) if times is None else sorted(range(n), key=lambda i: times[i])  # stable
    members: dict[str, list[int]] = {}
    for i in range(n):
        members.setdefault(groups[i], []).append(i)
    if times is None:
        held_groups = {g for g in members if (_splitmix64((_key(g) & M64) ^ SALT) >> 11) / 2**53 < ef}
    else:
        ranked = sorted(members, key=lambda g: (min(times[i] for i in members[g]), _key(g), members[g][0]))
        target = round(n * ef)
        best_k, best_gap, held = 0, abs(target), 0
        for k, g in enumerate(reversed(ranked), start=1):
            held += len(members[g])
            if abs(held - target) <= best_gap:  # ties: the larger k
                best_k, best_gap = k, abs(held - target)
        if target > 0:
            best_k = max(best_k, 1)
        held_groups = set(ranked[len(ranked) - best_k :])
    train = [i for i in order if groups[i] not in held_groups]
    held_rows = [i for i in order if groups[i] in held_groups]
    return train, held_rows


PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@PROPERTY
@given(
    groups=st.lists(
        st.sampled_from(["u1", "u2", "u3", "u10", "x", "", "long-session-id"]), min_size=1, max_size=40
    ),
    times=st.one_of(st.none(), st.lists(st.integers(-5, 20), min_size=40, max_size=40)),
    ef=st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.9]),
    shuffle=st.booleans(),
)
def test_a_group_never_straddles_the_split(groups, times, ef, shuffle):
    times = None if times is None else times[: len(groups)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _write(folder, groups, times)
        ds = _build(folder, ef=ef, order_by="" if times is None else "t", shuffle=shuffle)
        train, held = _rows(ds)
        assert sorted(train + held) == list(range(len(groups)))  # every row once
        assert not {groups[i] for i in train} & {groups[i] for i in held}  # no group on both sides
        assert (train, held) == _oracle(groups, times, ef)
        if train:  # training batches read the training rows, shuffled per epoch when asked
            batches = ds.train_batches(rank=0, world_size=1, batch_size=len(train), start_step=0)
            epochs = [next(batches).sparse.to_dict()["row"].values().tolist() for _ in range(2)]
            for epoch in epochs:
                assert sorted(epoch) == sorted(train)
            if not shuffle:
                assert epochs[0] == train


def test_chronological_group_cut_by_hand(tmp_path):
    # (group, time) by row: first times A 1, B 2, C 4, D 6, E 9; two rows each; N = 10.
    groups = ["A", "B", "A", "C", "B", "D", "C", "D", "E", "E"]
    times = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    _write(tmp_path, groups, times)
    # eval_fraction 0.3: target 3 held-out rows; boundaries hold 2 (E) or 4 (D, E): a tie, the larger wins.
    assert _rows(_build(tmp_path, ef=0.3, order_by="t")) == ([0, 1, 2, 3, 4, 6], [5, 7, 8, 9])
    # 0.2: target 2, exactly the last group.
    assert _rows(_build(tmp_path, ef=0.2, order_by="t")) == ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
    # A row split would hold out rows 7, 8, 9 here and put group D on both sides.


def test_chronological_group_cut_nearest_boundary_and_at_least_one_group(tmp_path):
    # Groups by first time: P (1 row), Q (1 row), R (3 rows, first at t=3): held 0, 3, 4, 5 rows.
    groups = ["P", "Q", "R", "R", "R"]
    _write(tmp_path, groups, [1, 2, 3, 4, 5])
    assert _rows(_build(tmp_path, ef=0.4, order_by="t"))[1] == [2, 3, 4]  # target 2: 3 is nearest
    # Target 1: holding out 0 rows is 1 away, 3 rows 2 away; the nearest is 0, but a positive target
    # holds out at least the last group.
    assert _rows(_build(tmp_path, ef=0.2, order_by="t"))[1] == [2, 3, 4]
    assert _rows(_build(tmp_path, ef=0.0, order_by="t"))[1] == []


def test_groups_with_the_same_first_time_are_ordered_by_key_hash(tmp_path):
    groups = ["a", "b", "a", "b"]
    _write(tmp_path, groups, [5, 5, 6, 7])
    later = "a" if _key("a") > _key("b") else "b"  # the larger hash comes later, so it is held out
    held = _rows(_build(tmp_path, ef=0.5, order_by="t"))[1]
    assert {groups[i] for i in held} == {later}


def test_hash_assignment_ignores_the_seed_and_grows_with_the_fraction(tmp_path):
    groups = [f"user{i % 97}" for i in range(600)]
    _write(tmp_path, groups, None)
    spec_ds = _build(tmp_path, ef=0.2)
    other_seed = build_dataset(
        DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=123
    )
    assert _rows(spec_ds) == _rows(other_seed)
    held_20 = {groups[i] for i in _rows(spec_ds)[1]}
    held_40 = {groups[i] for i in _rows(_build(tmp_path, ef=0.4))[1]}
    assert held_20 < held_40  # a larger fraction only adds groups
    assert 0.1 < len(held_20) / 97 < 0.3  # about eval_fraction of the groups


def test_parquet_groups_like_csv(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(3)
    groups = [f"s{int(v)}" for v in rng.integers(0, 30, 300)]
    times = [int(v) for v in rng.integers(0, 1000, 300)]
    _write(tmp_path, groups, times)
    table = pa.table({"row": list(range(300)), "g": groups, "t": times, "y": [i % 2 for i in range(300)]})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=70)
    for order_by in ("", "t"):
        csv = _rows(_build(tmp_path, ef=0.25, order_by=order_by))
        parquet = _rows(_build(tmp_path, ef=0.25, order_by=order_by, fmt="parquet"))
        assert csv == parquet == _oracle(groups, None if not order_by else times, 0.25)


def test_integer_group_ids_in_parquet_group_like_their_text(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    groups = [str(i % 13) for i in range(200)]
    _write(tmp_path, groups, None)
    pq.write_table(
        pa.table(
            {"row": list(range(200)), "g": [i % 13 for i in range(200)], "t": [0] * 200, "y": [0] * 200}
        ),
        tmp_path / "rows.parquet",
    )
    assert _rows(_build(tmp_path, ef=0.3)) == _rows(_build(tmp_path, ef=0.3, fmt="parquet"))


# -- refusals -----------------------------------------------------------------------------------------


def _spec_error(tmp_path: Path, spec: str) -> str:
    (tmp_path / "spec.toml").write_text(spec)
    with pytest.raises(UserError) as err:
        build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("split", "join", "expected"),
    [
        (
            'group_by = "g"\neval_files = ["rows.csv"]',
            "",
            "[split] group_by = 'g' cannot be combined with eval_files",
        ),
        (
            'group_by = "session"',
            "",
            "[split] group_by = 'session': no such column in the data (columns: row, g, t, y)",
        ),
        (
            'group_by = "region"',
            '[[join]]\nfile = "groups.csv"\non = "g"\n',
            "[split] group_by = 'region': a column of the joined file ",
        ),
    ],
)
def test_a_group_by_that_cannot_work_is_refused(tmp_path, split, join, expected):
    _write(tmp_path, ["a", "b"], [1, 2])
    (tmp_path / "groups.csv").write_text("g,region\na,north\nb,south\n")
    spec = SPEC.format(fmt="csv", ext="csv", ef=0.1, order_by="", shuffle="false")
    spec = spec.replace('group_by = "g"', split).replace("[label]", f"{join}[label]")
    message = _spec_error(tmp_path, spec)
    assert expected in message
    if join:
        assert "groups.csv" in message


@pytest.mark.parametrize(
    ("fmt", "key"), list(itertools.product(["criteo_tsv", "torchrec_npy"], ["group_by", "order_by"]))
)
def test_split_columns_need_a_format_with_named_columns(tmp_path, fmt, key):
    spec = f'name = "c"\nformat = "{fmt}"\n[source]\nfiles = ["day_0"]\n[split]\n{key} = "c1"\n'
    message = _spec_error(tmp_path, spec)
    assert f"[split] {key} = 'c1': format '{fmt}' has no named columns" in message


def test_a_split_column_must_be_a_string(tmp_path):
    spec = 'name = "c"\nformat = "csv"\n[source]\nfiles = ["x.csv"]\n[split]\ngroup_by = 3\n[[sparse]]\nname = "a"\n'
    assert "[split] group_by must be a column name (a string), got 3" in _spec_error(tmp_path, spec)
