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


@pytest.fixture(scope="module", params=[True, False], ids=["tiered", "in_memory"])
def bounded_fp16(request, tmp_path_factory):
    """A 10-step run with admission (store.bounds) and fp16 rows, tiered or in memory."""
    from tests.conftest import subprocess_env

    tmp = tmp_path_factory.mktemp("fixed")
    config = tmp / "c.toml"
    config.write_text(
        tiny_config(
            train={"steps": 10, "nproc": 1, "log_every": 10, "checkpoint_every": 10},
            store={"tiered": request.param},
            sparse={"weights_precision": "fp16"},
        )
        + "[store.bounds]\nadmit_after = 2\n"
    )
    run_train(config, tmp / "run", env=subprocess_env())
    return config, tmp / "run"


@pytest.mark.parametrize(
    ("change", "key", "was", "now"),
    [
        ("store.bounds={}", "store.bounds", '{"admit_after": 2}', "{}"),
        ("store.bounds={admit_after=3}", "store.bounds", '{"admit_after": 2}', '{"admit_after": 3}'),
        ("sparse.weights_precision=fp32", "sparse.weights_precision", '"fp16"', '"fp32"'),
    ],
)
def test_bounds_and_precision_cannot_change_on_resume_even_when_allowed(
    bounded_fp16, cli_env, change, key, was, now
):
    """Nothing converts a checkpoint's rows to other bounds or another precision: the resume is refused in
    one line before any worker starts, in both modes (issue 50, defect a; was a StoreIncompatibleError
    traceback when tiered and a tensor-shape error in memory)."""
    config, run = bounded_fp16
    before = (run / "metrics.jsonl").read_text()
    proc = run_train(
        config, run, "--resume", "--allow-config-change", "--set", change, env=cli_env, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"recsys: error: --resume: {run / 'checkpoints' / 'step_00000010'} was trained with {key}={was}, this "
        f"run has {key}={now}; {key} cannot change on resume, not even with --allow-config-change ("
        + proc.stderr.split("--allow-config-change (", 1)[1].strip()
    ]  # one line, and no worker's log before it
    assert (run / "metrics.jsonl").read_text() == before


def test_adding_bounds_on_resume_is_refused(trained, cli_env):
    config, run = trained
    last = _refused(
        run_train(
            config, run, "--resume", "--allow-config-change", "--set", "store.bounds={max_rows=100}",
            env=cli_env, check=False,
        )
    )  # fmt: skip
    assert 'was trained with store.bounds={}, this run has store.bounds={"max_rows": 100}' in last
    assert last.endswith("restore it, or train a new run in another --out")
