"""``recsys plot``: the PNG of a real run, the curves' values, and one-line refusals of bad input."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recsys.cli import main
from recsys.plot import PLOTS_HINT, curves, read_records, table_rates
from tests.conftest import subprocess_env
from tests.recsys.tiny import run_train, tiny_config

image = pytest.importorskip("matplotlib.image")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny tiered run (one rank, 40 steps, an evaluation every 10) and what ``recsys train`` printed."""
    root = tmp_path_factory.mktemp("plot")
    config = root / "tiny.toml"
    config.write_text(tiny_config(train={"steps": 40, "log_every": 10, "nproc": 1}, eval={"every": 10}))
    proc = run_train(config, root / "run", env=subprocess_env())
    return root / "run", proc.stdout


def _copy(run: Path, tmp_path: Path, lines: list[str] | None = None) -> Path:
    """A run directory holding ``run``'s metrics.jsonl (or ``lines``) and nothing else."""
    out = tmp_path / "copy"
    out.mkdir()
    text = (run / "metrics.jsonl").read_text() if lines is None else "".join(lines)
    (out / "metrics.jsonl").write_text(text)
    return out


def test_train_suggests_the_plot(trained):
    run, stdout = trained
    assert f"curves: recsys plot --run {run}" in stdout.splitlines()


def test_plot_of_a_real_run_is_a_png(trained, tmp_path, capsys):
    run, _ = trained
    out = tmp_path / "picture.png"
    assert main(["plot", "--run", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote {out}"
    assert printed[0].startswith("best held-out log loss ")
    height, width, channels = image.imread(out).shape
    assert height >= 600 and width >= 1200 and channels in (3, 4)


def test_default_out_is_curves_png_in_the_run(trained, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trained[0] / "metrics.jsonl", run)
    shutil.copy(trained[0] / "summary.json", run)
    assert main(["plot", "--run", str(run)]) == 0
    assert image.imread(run / "curves.png").ndim == 3


def test_curves_hold_the_file_values_and_the_best_step_is_the_argmin(trained):
    run, _ = trained
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if r["kind"] == "eval"]
    train = [r for r in lines if r["kind"] == "train"]
    c = curves(read_records(run / "metrics.jsonl")[0])
    assert c.eval_steps == [10, 20, 30, 40] == [r["step"] for r in evals]
    assert c.logloss == [r["logloss"] for r in evals]
    assert c.loss == [r["loss"] for r in train]
    assert c.tiers["device_hit_rate"] == [r["tiers"]["device_hit_rate"] for r in train]
    best = min(evals, key=lambda r: r["logloss"])
    assert (c.best_step, c.best_logloss) == (best["step"], best["logloss"])
    assert c.constant_logloss == evals[-1]["constant_logloss"]
    assert c.best_auc_step == max(evals, key=lambda r: r["auc"])["step"]


def test_table_rates_come_from_the_summary_in_natural_order(trained):
    summary = json.loads((trained[0] / "summary.json").read_text())
    rates = table_rates({"tiers": {f"t_cat_{i}": summary["tiers"]["t_cat_0"] for i in (10, 2, 1)}})
    assert list(rates) == ["t_cat_1", "t_cat_2", "t_cat_10"]
    assert rates["t_cat_2"] == {
        k: summary["tiers"]["t_cat_0"][k] for k in ("device_hit_rate", "host_hit_rate")
    }
    assert table_rates({}) == {} and table_rates({"tiers": {"t": "bad"}}) == {}


def test_overfitting_is_found_and_ties_keep_the_earliest():
    records = [
        {"kind": "eval", "step": s, "logloss": v, "auc": 0.7, "constant_logloss": 0.65}
        for s, v in ((50, 0.62), (100, 0.60), (150, 0.60), (200, 0.70), (250, None))
    ]
    c = curves(records)
    assert (c.best_step, c.best_logloss) == (100, 0.60)
    assert c.best_auc_step == 50
    assert c.not_finite() == {"held-out log loss": [250]}


def test_a_nan_loss_is_marked_not_fatal(trained, tmp_path, capsys):
    lines = (trained[0] / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(1, '{"kind": "train", "step": 15, "loss": NaN, "samples_per_s": 1.0}\n')
    lines.insert(1, '{"kind": "train", "step": 5, "loss": null, "samples_per_s": 1.0}\n')
    run = _copy(trained[0], tmp_path, lines)
    assert main(["plot", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "note: training loss is not finite at 2 step(s) (5, 15); marked with x" in out
    c = curves(read_records(run / "metrics.jsonl")[0])
    assert math.isnan(c.loss[0]) and math.isnan(c.loss[2]) and math.isfinite(c.loss[1])
    assert image.imread(run / "curves.png").ndim == 3


def test_untiered_runs_and_unfinished_last_lines(trained, tmp_path, capsys):
    lines = []
    for line in (trained[0] / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        record.pop("tiers", None)
        lines.append(json.dumps(record) + "\n")
    run = _copy(trained[0], tmp_path, [*lines, '{"kind": "train", "st'])
    assert main(["plot", "--run", str(run)]) == 0
    assert "unfinished last line" in capsys.readouterr().out
    assert curves(read_records(run / "metrics.jsonl")[0]).tiers == {}
    height, width, _ = image.imread(run / "curves.png").shape
    assert height < width / 2  # one row of panels


def _seeds(d: Path) -> Path:
    (d / "seed_0").mkdir()
    (d / "seed_0" / "metrics.jsonl").write_text("")
    return d


def _file(d: Path) -> Path:
    (d / "f.txt").write_text("x")
    return d / "f.txt"


def _metrics(content: bytes):
    def make(d: Path) -> Path:
        (d / "metrics.jsonl").write_bytes(content)
        return d

    return make


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "nowhere", "does not exist"),
        (_file, "is not a directory"),
        (lambda d: d, "has no metrics.jsonl: not a run directory"),
        (_seeds, "holds the runs of recsys train --seeds (seed_0): plot one"),
        (_metrics(b""), "metrics.jsonl has no records yet"),
        (_metrics(b'{"kind": "train", "st'), "metrics.jsonl has no records yet (only an unfinished line)"),
        (
            _metrics(b'{"kind": "train", "step": 1, "loss": 0.6}\n{oops\n'),
            "metrics.jsonl line 2 is not a JSON object: '{oops'",
        ),
        (_metrics(b"[1, 2]\n"), "line 1 is not a JSON object"),
        (_metrics(b"\xff\xfe\n"), "line 1 is not a JSON object"),
        (
            _metrics(b'{"kind": "train", "step": "ten", "loss": 1}\n'),
            "line 1: step is 'ten', not a whole number",
        ),
        (
            _metrics(b'{"kind": "train", "step": true, "loss": 1}\n'),
            "line 1: step is True, not a whole number",
        ),
        (
            _metrics(b'{"kind": "eval", "step": 3, "logloss": "low"}\n'),
            "line 1: logloss is 'low', not a number",
        ),
        (
            _metrics(b'{"kind": "train", "step": 3, "loss": 1, "tiers": 7}\n'),
            "line 1: tiers is 7, not an object",
        ),
        (_metrics(b'{"kind": "other"}\n'), "no training or evaluation records"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input_is_one_line_and_exit_2(make, message, tmp_path, capsys):
    run = make(tmp_path)
    assert main(["plot", "--run", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recsys: error: ") and len(err.splitlines()) == 1
    assert message in err


def test_out_must_be_a_png(trained, tmp_path, capsys):
    assert main(["plot", "--run", str(trained[0]), "--out", str(tmp_path / "c.jpg")]) == 2
    assert "ending in .png" in capsys.readouterr().err


def test_without_matplotlib_the_hint_and_exit_2(trained, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["plot", "--run", str(trained[0]), "--out", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err.strip() == f"recsys: error: {PLOTS_HINT}"


def test_the_command_imports_no_torch_and_never_a_traceback(trained, tmp_path, python, repo_root):
    script = (
        "import sys\nfrom recsys.cli import main\n"
        f"assert main(['plot', '--run', {str(trained[0])!r}, '--out', {str(tmp_path / 'c.png')!r}]) == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchrec', 'fbgemm_gpu'))\n"
        "assert not heavy, heavy[:5]\n"
    )
    env = subprocess_env()
    proc = subprocess.run([python, "-c", script], cwd=repo_root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bad = _copy(trained[0], tmp_path, ['{"kind": "train", "step": 1, "loss": 1}\n', "garbage\n"])
    proc = subprocess.run(
        [python, "-m", "recsys", "plot", "--run", str(bad)],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        == f"recsys: error: {bad / 'metrics.jsonl'} line 2 is not a JSON object: 'garbage'"
    )


def test_bounded_rows_default_share_and_epochs_are_drawn(tmp_path):
    from recsys.plot import epoch_steps, load_run, plot_run

    run = tmp_path / "bounded"
    run.mkdir()
    records = []
    for step in (10, 20, 30):
        tables = {
            "t_a": {"rows": 100 * step, "default_share": 0.1},
            "t_b": {"rows": step, "default_share": 0.2},
        }
        records.append(
            {
                "kind": "train",
                "step": step,
                "loss": 0.6,
                "bounds": {"default_share": 0.3 / step, "tables": tables},
            }
        )
        records.append(
            {
                "kind": "eval",
                "step": step,
                "auc": 0.70 + step / 1000,
                "logloss": 0.6,
                "constant_logloss": 0.65,
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {
        "splits": {"train": {"rows": 1000, "sampled": False}},
        "config": {"train": {"batch_size": 128}},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    c, _, _ = load_run(run)
    assert c.bounds_steps == [10, 20, 30] and c.bounds_rows == [1010, 2020, 3030]
    assert c.default_share == [0.03, 0.015, 0.01]
    assert c.epoch_steps == [8, 16, 23] == epoch_steps(summary, 30)  # 1,000 rows / 128 a step
    assert epoch_steps({**summary, "splits": {"train": {"rows": 1000, "sampled": True}}}, 30) == []
    out, _, _ = plot_run(run)
    height, width, _ = image.imread(out).shape
    assert height > width / 2  # a second row of panels: the bounded tables
