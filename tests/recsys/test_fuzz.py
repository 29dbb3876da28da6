"""Fuzzing (Hypothesis): configs, ``--set`` overrides and data files in every reader format.

The only acceptable outcomes are a result or a clear error — a ``UserError`` (``ConfigError``,
``MalformedInputError``, ...: the CLI prints its one line and exits 2) — within a few seconds. Any other
exception, or an example that runs past its time limit (a hang), fails the test. The default run tries a
few dozen examples per target; ``make test-slow`` runs the ``slow`` variants with thousands.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import signal
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys.config import RunConfig, _section_types, config_from_dict, load_config
from recsys.data.issues import OnError
from recsys.data.source import DataConfig, build_dataset
from recsys.data.synthetic import SyntheticConfig
from recsys.errors import UserError
from tests.recsys.data.conftest import criteo_lines

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_LIMIT_S = 10  # one example past this is a hang

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
MANY = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))


class Hang(Exception):
    """An example ran past EXAMPLE_LIMIT_S."""


@contextmanager
def time_limit(seconds: float = EXAMPLE_LIMIT_S):
    def expire(signum: int, frame: Any) -> None:
        raise Hang(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def clear_error_or_result(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; a UserError is a clear answer (returned), anything else propagates and fails."""
    with time_limit():
        try:
            return fn()
        except UserError as err:
            message = str(err)
            assert message and "\n" not in message, f"a user error must be one line: {message!r}"
            return err


# -- configs ----------------------------------------------------------------------------------------

SECTIONS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in _section_types().items()}
ENUM_WORDS = ["dlrm", "dcn", "logistic", "row_wise", "table_wise", "exact_sgd", "exact_adagrad", "lru",
              "lookahead", "lfu", "adam", "sgd", "synthetic", "pipelined", "sequential", "raise", "skip",
              "criteo-kaggle", "movielens-1m", "examples.custom_dataset:make", "os:system", "1MiB"]  # fmt: skip

scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(ENUM_WORDS),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["device", "host", "x", "cat_0"]), inner, max_size=3),
    ),
    max_leaves=6,
)


def toml_literal(value: Any) -> str:
    """A TOML literal for a generated value (strings via JSON escapes; TOML may still reject some)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_literal(v)}" for k, v in value.items()) + "}"


section_names = st.one_of(st.sampled_from(sorted(SECTIONS)), st.text(min_size=1, max_size=8))


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    lines = []
    for section in draw(st.lists(section_names, max_size=4, unique=True)):
        lines.append(f"[{json.dumps(section)}]")
        known = SECTIONS.get(section, [])
        keys = st.one_of(st.sampled_from(known), st.text(max_size=8)) if known else st.text(max_size=8)
        for key in draw(st.lists(keys, max_size=5, unique=True)):
            lines.append(f"{json.dumps(key)} = {toml_literal(draw(values))}")
    text = "\n".join(lines) + "\n"
    if draw(st.integers(0, 9)) == 0:  # now and then, damage the text itself
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=6)) + text[at:]
    return text


def _check_config(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.toml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        out = clear_error_or_result(lambda: load_config(path))
    assert isinstance(out, RunConfig | UserError)


@FAST
@given(config_texts())
def test_fuzz_config_files(text):
    _check_config(text)


@pytest.mark.slow
@MANY
@given(config_texts())
def test_fuzz_config_files_many(text):
    _check_config(text)


override_texts = st.one_of(
    st.text(max_size=30),
    st.builds(
        lambda s, k, v: f"{s}.{k}={v}",
        section_names,
        st.one_of(
            st.sampled_from(sorted({k for keys in SECTIONS.values() for k in keys})), st.text(max_size=6)
        ),
        st.one_of(values.map(toml_literal), st.text(max_size=12)),
    ),
)


def _check_overrides(overrides: list[str]) -> None:
    out = clear_error_or_result(lambda: config_from_dict({}, overrides))
    assert isinstance(out, RunConfig | UserError)


@FAST
@given(st.lists(override_texts, max_size=4))
def test_fuzz_set_overrides(overrides):
    _check_overrides(overrides)


@pytest.mark.slow
@MANY
@given(st.lists(override_texts, max_size=4))
def test_fuzz_set_overrides_many(overrides):
    _check_overrides(overrides)


# -- data files -------------------------------------------------------------------------------------

CRITEO_SPEC = (
    'name = "c"\nformat = "criteo_tsv"\n[source]\nfiles = ["day_0"]\n[split]\neval_fraction = {ef}\n'
)

CSV_SPEC = """
name = "rows"
format = "{fmt}"
[source]
files = ["rows.{ext}"]
[read]
delimiter = ","
[label]
column = "y"
[split]
eval_fraction = {ef}
[[dense]]
name = "x"
[[sparse]]
name = "row"
kind = "int"
id_space = 100000
[[sparse]]
name = "tags"
separator = "|"
max_length = 2
[[sparse]]
name = "zip3"
column = "zip"
prefix = 3
"""

RECBOLE_SPEC = """
name = "d"
format = "recbole"
[source]
files = ["d.inter"]
[label]
column = "rating"
threshold = 4
[split]
order_by = "timestamp"
eval_fraction = {ef}
[[sparse]]
name = "user"
column = "user_id"
[[sparse]]
name = "item"
column = "item_id"
"""

NPY_SPEC = 'name = "n"\nformat = "torchrec_npy"\n[source]\nfiles = ["day_0"]\n[split]\neval_fraction = {ef}\n'

junk = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
numbers = st.one_of(
    st.integers(-(2**66), 2**66).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "-", "+", "1e999", "0x1f", " 1", "1 ", "nan", "NaN", "-0", "00000000000000000001"]),
)
cells = st.one_of(numbers, junk, st.sampled_from(["a|bb", "|", "||", "12345", "a", "0", "1", "5"]))


def _read_everything(folder: Path, spec: str, on_error: str) -> None:
    (folder / "spec.toml").write_text(spec)

    def read() -> None:
        ds = build_dataset(
            DataConfig(source=str(folder / "spec.toml"), on_error=OnError(on_error)),
            synthetic=SyntheticConfig(),
            seed=0,
        )
        for rank in (0, 1):
            list(itertools.islice(ds.train_batches(rank=rank, world_size=2, batch_size=4, start_step=0), 6))
            list(itertools.islice(ds.eval_batches(rank=rank, world_size=2, batch_size=4), 50))

    clear_error_or_result(read)


@st.composite
def criteo_files(draw: st.DrawFn) -> bytes:
    good = criteo_lines(draw(st.integers(0, 12)), seed=draw(st.integers(0, 1000)))
    lines = []
    for line in good:
        fields = line.split("\t")
        for _ in range(draw(st.integers(0, 2))):
            fields[draw(st.integers(0, len(fields) - 1))] = draw(cells)
        if draw(st.integers(0, 6)) == 0:
            fields = fields[: draw(st.integers(0, len(fields)))]
        lines.append("\t".join(fields))
    for _ in range(draw(st.integers(0, 2))):
        lines.insert(draw(st.integers(0, len(lines))), draw(junk))
    text = "\n".join(lines) + draw(st.sampled_from(["\n", "", "\r\n", "\n\n"]))
    return text.encode("utf-8", errors="surrogatepass")


@st.composite
def csv_rows(draw: st.DrawFn) -> list[list[Any]]:
    rows = []
    for i in range(draw(st.integers(0, 12))):
        row = [str(i), repr(float(i) / 7), str(i % 2), "a|bb", "12345", str(i)]
        for _ in range(draw(st.integers(0, 2))):
            row[draw(st.integers(0, 5))] = draw(cells)
        if draw(st.integers(0, 8)) == 0:
            row = row[: draw(st.integers(0, 6))] + draw(st.lists(cells, max_size=2))
        rows.append(row)
    return rows


def _data_example(kind: str, draw_data: st.DataObject, on_error: str, ef: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if kind == "criteo":
            (folder / "day_0").write_bytes(draw_data.draw(criteo_files()))
            spec = CRITEO_SPEC.format(ef=ef)
        elif kind == "csv":
            rows = draw_data.draw(csv_rows())
            header = draw_data.draw(st.sampled_from(["row,x,y,tags,zip,t", "row,x,y,tags,zip", "x,y", ""]))
            text = "\n".join([header] + [",".join(r) for r in rows]) + "\n"
            (folder / "rows.csv").write_bytes(text.encode("utf-8", errors="surrogatepass"))
            spec = CSV_SPEC.format(fmt="csv", ext="csv", ef=ef)
        elif kind == "recbole":
            header = draw_data.draw(
                st.sampled_from(
                    [
                        "user_id:token\titem_id:token\trating:float\ttimestamp:float",
                        "user_id:token\titem_id:token\trating:float",
                        "user_id\titem_id\trating\ttimestamp",
                        "user_id:token\titem_id:token_seq\trating:float\ttimestamp:float",
                    ]
                )
            )
            rows = ["\t".join(r[:4]) for r in draw_data.draw(csv_rows())]
            (folder / "d.inter").write_bytes(
                ("\n".join([header, *rows]) + "\n").encode("utf-8", "surrogatepass")
            )
            spec = RECBOLE_SPEC.format(ef=ef)
        elif kind == "npy":
            n = draw_data.draw(st.integers(0, 6))
            dtypes = st.sampled_from(
                ["float32", "float64", "int64", "int32", "bool", "<U3", "complex64", "uint8"]
            )
            for part, shape in (("dense", (n, 3)), ("sparse", (n, 2)), ("labels", (n,))):
                shape = draw_data.draw(
                    st.one_of(st.just(shape), st.lists(st.integers(0, 4), max_size=3).map(tuple))
                )
                if draw_data.draw(st.integers(0, 12)) == 0:
                    (folder / f"day_0_{part}.npy").write_bytes(draw_data.draw(st.binary(max_size=64)))
                    continue
                arr = np.zeros(shape, dtype=draw_data.draw(dtypes))
                np.save(folder / f"day_0_{part}.npy", arr)
            spec = NPY_SPEC.format(ef=ef)
        else:  # parquet
            pa = pytest.importorskip("pyarrow")
            pq = pytest.importorskip("pyarrow.parquet")
            rows = draw_data.draw(csv_rows())
            names = draw_data.draw(
                st.sampled_from([["row", "x", "y", "tags", "zip", "t"], ["row", "x", "y"]])
            )
            columns: dict[str, Any] = {}
            for j, name in enumerate(names):
                col = [r[j] if j < len(r) else None for r in rows]
                as_type = draw_data.draw(st.sampled_from(["str", "int", "float", "null"]))
                try:
                    if as_type == "int":
                        col = [int(c) if c is not None else None for c in col]
                    elif as_type == "float":
                        col = [float(c) if c is not None else None for c in col]
                    elif as_type == "null":
                        col = [None] * len(col)
                except (ValueError, OverflowError):
                    pass
                columns[name] = col
            try:
                table = pa.table(columns)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                table = pa.table({k: [None if v is None else str(v) for v in c] for k, c in columns.items()})
            pq.write_table(table, folder / "rows.parquet")
            spec = CSV_SPEC.format(fmt="parquet", ext="parquet", ef=ef)
        _read_everything(folder, spec, on_error)


KINDS = ["criteo", "csv", "recbole", "npy", "parquet"]


@pytest.mark.parametrize("kind", KINDS)
@FAST
@given(data=st.data(), on_error=st.sampled_from(["raise", "skip"]), ef=st.sampled_from([0.0, 0.25]))
def test_fuzz_data_files(kind, data, on_error, ef):
    _data_example(kind, data, on_error, ef)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@MANY
@given(data=st.data(), on_error=st.sampled_from(["raise", "skip"]), ef=st.sampled_from([0.0, 0.25]))
def test_fuzz_data_files_many(kind, data, on_error, ef):
    _data_example(kind, data, on_error, ef)


# -- no untrusted pickle ----------------------------------------------------------------------------


def test_no_untrusted_pickle_anywhere():
    """Checkpoints load with weights_only=True; nothing unpickles files (np.load keeps allow_pickle off)."""
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    code = [f for f in files if not f.startswith("tests/")]
    for name in code:
        text = (ROOT / name).read_text()
        for call in re.finditer(r"torch\.load\((.*?)\)", text, flags=re.S):
            assert "weights_only=True" in call.group(1), f"{name}: {call.group(0)}"
        unpickles = re.search(r"\bpickle\.loads?\(|\bdill\b|\bjoblib\.load|cloudpickle", text)
        # The one exception: parser workers hand their results back to the process that forked them
        # (through a memfd only that process tree maps), as multiprocessing itself does; never a file.
        assert not unpickles or name == "recsys/data/parallel.py", name
        assert "allow_pickle=True" not in text, name
