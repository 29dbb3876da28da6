"""The CLI surface and its user errors: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import subprocess

import pytest

from recsys.cli import build_parser, main


def test_cli_surface_is_frozen():
    """Renaming or dropping a flag breaks users' scripts: change this test only on purpose."""
    train = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    flags = sorted(opt for action in train._actions for opt in action.option_strings)
    assert flags == sorted(
        [
            "--config",
            "--nproc",
            "--out",
            "--resume",
            "--allow-config-change",
            "--seeds",
            "--set",
            "-h",
            "--help",
        ]
    )
    prep = build_parser()._subparsers._group_actions[0].choices["preprocess"]  # type: ignore[union-attr]
    flags = sorted(opt for action in prep._actions for opt in action.option_strings)
    assert flags == sorted(["--out", "--no-label", "--on-error", "-h", "--help"])
    tune = build_parser()._subparsers._group_actions[0].choices["tune-cache"]  # type: ignore[union-attr]
    flags = sorted(opt for action in tune._actions for opt in action.option_strings)
    assert flags == sorted(
        [
            "--config",
            "--set",
            "--device-budget",
            "--host-budget",
            "--batches",
            "--nproc",
            "--out",
            "-h",
            "--help",
        ]
    )
    plan = build_parser()._subparsers._group_actions[0].choices["plan-exchange"]  # type: ignore[union-attr]
    flags = sorted(opt for action in plan._actions for opt in action.option_strings)
    assert flags == sorted(["--config", "--set", "--steps", "-h", "--help"])
    assert sorted(build_parser()._subparsers._group_actions[0].choices) == [  # type: ignore[union-attr]
        "evaluate",
        "export",
        "plan-exchange",
        "plot",
        "predict",
        "preprocess",
        "recommend",
        "train",
        "tune-cache",
    ]
    recommend = build_parser()._subparsers._group_actions[0].choices["recommend"]  # type: ignore[union-attr]
    flags = sorted(opt for action in recommend._actions for opt in action.option_strings)
    assert flags == sorted(
        ["--bundle", "--users", "--candidates", "--k", "--out", "--user-column", "--item-column", "--batch-size",
         "--cache-rows", "-h", "--help"]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "train.stepz=3"], "unknown config key 'train.stepz'; valid keys of [train]:"),
        (["--set", "train.steps=many"], "train.steps must be an integer, got 'many'"),
        (["--set", "oops"], "--set expects section.key=value, got 'oops'"),
        (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    ],
)
def test_user_errors_exit_2_with_one_line(argv, message, repo_root, tmp_path, capsys):
    code = main(
        ["train", "--config", str(repo_root / "configs/quickstart.toml"), "--out", str(tmp_path), *argv]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err
    assert len(err.splitlines()) == 1


def test_missing_config_file_exits_2(tmp_path, capsys):
    code = main(["train", "--config", str(tmp_path / "missing.toml")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"recsys: error: config file not found: {tmp_path / 'missing.toml'}"


def test_resume_without_checkpoints_exits_2(repo_root, tmp_path, capsys):
    code = main(
        ["train", "--config", str(repo_root / "configs/quickstart.toml"), "--out", str(tmp_path), "--resume"]
    )
    assert code == 2 and "no checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "configs/quickstart.toml", "--set", "model.name=transformer"],
        ["train", "--config", "configs/quickstart.toml", "--bogus-flag"],
        ["train", "--config", "does/not/exist.toml"],
    ],
)
def test_process_exit_code_and_no_traceback(argv, python, cli_env, repo_root):
    proc = subprocess.run(
        [python, "-m", "recsys", *argv],
        cwd=repo_root,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and lines[0].startswith("recsys")


LIGHT = """
import sys
from pathlib import Path
import recsys.cli, recsys.launch, recsys.local_env
from recsys.config import load_config
from recsys.data.source import check_source
config = load_config(Path("configs/quickstart.toml"), [])
check_source(config.data)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu", "numba"))
assert not heavy, heavy[:5]
import pipelines, recsys.data
names = [getattr(pipelines, n) for n in pipelines.__all__] + [getattr(recsys.data, n) for n in recsys.data.__all__]
print(len(names))
"""


def test_reading_a_config_and_launching_import_no_torch(python, repo_root, cli_env):
    """The CLI answers a bad config, and the launcher starts its workers, without the seconds torch,
    TorchRec and FBGEMM take to import; the packages' lazily loaded names all resolve."""
    proc = subprocess.run(
        [python, "-c", LIGHT], cwd=repo_root, env=cli_env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["17"]
