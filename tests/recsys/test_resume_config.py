"""``--resume`` checks the checkpoint's fingerprint of the settings that change the trained model."""

from __future__ import annotations

import json

import pytest

from tests.recsys.tiny import run_train, tiny_config

CONFIG = tiny_config(train={"steps": 20, "nproc": 1, "log_every": 10, "checkpoint_every": 10})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.conftest import subprocess_env

    tmp = tmp_path_factory.mktemp("fp")
    (tmp / "c.toml").write_text(CONFIG)
    run_train(tmp / "c.toml", tmp / "run", env=subprocess_env())
    return tmp / "c.toml", tmp / "run"


def _refused(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_resume_with_a_changed_model_setting_is_refused_naming_keys_and_values(trained, cli_env):
    config, run = trained
    before = (run / "metrics.jsonl").read_text()
    proc = run_train(
        config, run, "--resume", "--set", "train.batch_size=128", "--set", "sparse.learning_rate=0.5",
        env=cli_env, check=False,
    )  # fmt: skip
    last = _refused(proc)
    assert last.startswith(
        f"recsys: error: --resume: {run / 'checkpoints' / 'step_00000020'} was trained with other settings"
    )
    assert "train.batch_size: saved 256, now 128" in last
    assert "sparse.learning_rate: saved 0.05, now 0.5" in last
    assert last.endswith("restore them, or pass --allow-config-change to continue with the new ones")
    assert (run / "metrics.jsonl").read_text() == before  # nothing of the run was touched


def test_a_changed_seed_is_refused_with_one_line(trained, cli_env):
    config, run = trained
    last = _refused(run_train(config, run, "--resume", "--set", "train.seed=1", env=cli_env, check=False))
    assert "train.seed=0, this run has train.seed=1; the seed cannot change on resume" in last
    last = _refused(
        run_train(
            config,
            run,
            "--resume",
            "--allow-config-change",
            "--set",
            "train.seed=1",
            env=cli_env,
            check=False,
        )
    )
    assert "the seed cannot change on resume" in last


def test_settings_that_do_not_change_the_model_resume_and_a_deliberate_change_is_allowed(trained, cli_env):
    config, run = trained
    # More steps, another pipeline mode and lookahead: the same model, resumed silently.
    more = run_train(
        config, run, "--resume", "--set", "train.steps=30", "--set", "pipeline.mode=sequential",
        "--set", "store.lookahead=2",
        env=cli_env,
    )  # fmt: skip
    assert "changed settings" not in more.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 30
    allowed = run_train(
        config, run, "--resume", "--allow-config-change", "--set", "train.steps=40",
        "--set", "train.dense_learning_rate=0.01", env=cli_env,
    )  # fmt: skip
    assert (
        "resuming with changed settings (--allow-config-change): train.dense_learning_rate: saved"
        in allowed.stderr
    )
