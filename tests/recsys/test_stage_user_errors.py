"""A user error met inside a pipeline stage ends the run as it does without the pipeline (issue 41).

A NaN in a dense column of a CSV dataset is a one-line ``MalformedInputError`` (a UserError) naming file,
line and field. An untiered run meets it on the training thread; a tiered run meets it in the pipeline's
load stage, on a worker thread in ``pipelined`` mode and inline in ``sequential`` mode. Every one of them,
on 1 and on 2 ranks, must print the same single ``recsys: error:`` line and exit 2, without a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recsys.tiny import run_train

ROWS = 2000
NAN_ROW = 1500  # the NaN's line in the file: the header is line 1
SPEC = """name = "nan"
format = "csv"
[source]
files = ["a.csv"]
[read]
delimiter = ","
[label]
column = "y"
[split]
eval_fraction = 0.1
[[dense]]
name = "x"
[[dense]]
name = "z"
[[sparse]]
name = "u"
[[sparse]]
name = "i"
"""


def _config(tmp_path: Path, *, tiered: bool) -> Path:
    store = "tiered = true\ndevice_rows = 200\nhost_rows = 100\n" if tiered else "tiered = false\n"
    config = tmp_path / ("tiered.toml" if tiered else "plain.toml")
    config.write_text(
        f'[data]\nsource = "{tmp_path / "spec.toml"}"\n'
        "[model]\nembedding_dim = 8\ndense_arch = [16, 8]\nover_arch = [32]\n"
        "[train]\nbatch_size = 64\nthreads_per_rank = 1\nsteps = 20\n"
        "[eval]\nbatch_size = 256\n"
        f"[store]\n{store}"
    )
    return config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, str]:
    """A CSV dataset with a NaN dense value on one line, and the untiered run's error line for it."""
    from tests.conftest import subprocess_env

    tmp = tmp_path_factory.mktemp("nan")
    lines = ["u,i,x,z,y"]
    for n in range(ROWS):
        x = "NaN" if n == NAN_ROW - 2 else f"{(n * 37 % 101) / 101:.3f}"
        lines.append(f"{n * 7 % 500},{n * 13 % 800},{x},{(n % 17) / 17:.3f},{n % 2}")
    (tmp / "a.csv").write_text("\n".join(lines) + "\n")
    (tmp / "spec.toml").write_text(SPEC)
    proc = run_train(_config(tmp, tiered=False), tmp / "plain", env=subprocess_env(), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("recsys: error:")]
    assert errors == [
        f"recsys: error: {tmp / 'a.csv'}:{NAN_ROW}: field 'x' (column 3): not a finite number: 'NaN'"
    ]
    return tmp, errors[0]


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("mode", ["pipelined", "sequential"])
def test_a_malformed_line_met_in_a_stage_is_the_untiered_runs_one_line(
    mode, nproc, dataset, tmp_path, cli_env
):
    data, expected = dataset
    proc = run_train(
        _config(data, tiered=True),
        tmp_path / "run",
        "--set",
        f"pipeline.mode={mode}",
        "--nproc",
        str(nproc),
        env=cli_env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [expected], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "StageFailed" not in proc.stderr


def test_the_stage_is_named_in_a_note_and_never_in_the_message():
    from pipelines import StageFailed
    from recsys.data.issues import MalformedInputError
    from recsys.loop import _raised_in_stage

    err = MalformedInputError("a.csv:3: field 'x' (column 2): not a finite number: 'nan'")
    failed = StageFailed("load", 4, err)
    assert _raised_in_stage(err, failed) is err
    assert _raised_in_stage(err, failed) is err  # raised again: one note
    assert err.__notes__ == ["raised in pipeline stage 'load' on batch 4"]
    assert str(err) == "a.csv:3: field 'x' (column 2): not a finite number: 'nan'"
