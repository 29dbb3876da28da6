"""Kill anywhere: a 2-rank tiered run SIGKILLed at random moments and resumed ends with the same model.

One worker SIGKILLs itself (tests/faults/sitecustomize.py, test-only) at five moments drawn from a seeded
RNG: inside an LMDB write-back transaction of the background writer, during a checkpoint (its store
snapshot written, the checkpoint not yet complete), or mid training step (in the model's forward). The
launcher then stops the other worker. After each kill the run resumes from the newest complete checkpoint,
never from the one being written when the kill landed; the final ``model_digest`` must equal that of a run
never interrupted. ``make crash-test`` runs this file; ``TIERREC_CRASH_SEED`` picks other moments.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest

from recsys.checkpoint import META
from tests.recsys.tiny import run_train, tiny_config

FAULTS = Path(__file__).resolve().parents[1] / "faults"
ROOT = Path(__file__).resolve().parents[2]

CONFIG = tiny_config(
    synthetic={"eval_samples": 1024},
    train={"steps": 320, "nproc": 2, "log_every": 40, "checkpoint_every": 20, "keep_checkpoints": 3},
)

# (site, range of the call to kill at, counted from the start of each attempt in the killed process).
# Small enough that five kills never use up the run (each attempt resumes from the last checkpoint).
MOMENTS = {"writer": (1, 6), "snapshot": (1, 2), "step": (5, 40)}
KILLS = 5


def _checkpoints(out: Path) -> tuple[set[str], set[str]]:
    """Names of (complete, incomplete) checkpoint directories."""
    root = out / "checkpoints"
    dirs = list(root.glob("step_*")) if root.is_dir() else []
    return {d.name for d in dirs if (d / META).is_file()}, {d.name for d in dirs if not (d / META).is_file()}


def _resumed_from(stderr: str) -> str | None:
    match = re.search(r"resumed from \S*/(step_\d+) \(step \d+\)", stderr)
    return match.group(1) if match else None


@pytest.mark.slow
def test_kill_anywhere_and_resume_reaches_the_uninterrupted_model(tmp_path, cli_env):
    seed = int(os.environ.get("TIERREC_CRASH_SEED", "0"))
    rng = random.Random(seed)
    kinds = ["writer", "snapshot", "step"] + [rng.choice(list(MOMENTS)) for _ in range(KILLS - 3)]
    rng.shuffle(kinds)
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    whole = run_train(config, tmp_path / "whole", env=cli_env, check=False)
    assert whole.returncode == 0, whole.stderr[-3000:]

    out, log = tmp_path / "run", tmp_path / "faults.log"
    history = []
    left_incomplete: set[str] = set()
    for kind in kinds:
        low, high = MOMENTS[kind]
        spec = f"{kind}:kill:{rng.randint(low, high)}:{rng.randint(0, 1)}"
        env = dict(cli_env, TIERREC_FAULT=spec, TIERREC_FAULT_LOG=str(log))
        env["PYTHONPATH"] = str(FAULTS) + os.pathsep + env["PYTHONPATH"]
        complete, _ = _checkpoints(out)
        proc = run_train(config, out, *(["--resume"] if complete else []), env=env, check=False)
        resumed = _resumed_from(proc.stderr)
        fired = log.read_text().count("\n") if log.exists() else 0
        history.append((spec, resumed, proc.returncode))
        assert proc.returncode != 0 and fired == len(history), f"{spec}: the kill did not land: {history}"
        assert "recsys: error: worker" in proc.stderr, proc.stderr[-2000:]
        if resumed is not None:  # never the checkpoint being written when the previous kill landed
            assert resumed in complete and resumed not in left_incomplete, (history, left_incomplete)
        complete_now, left_incomplete = _checkpoints(out)
        if kind == "snapshot":
            assert left_incomplete, f"{spec}: the kill should leave the checkpoint being written incomplete"

    final = run_train(config, out, "--resume", env=cli_env, check=False)
    assert final.returncode == 0, final.stderr[-3000:]
    resumed = _resumed_from(final.stderr)
    assert resumed is not None and resumed not in left_incomplete
    digests = [
        json.loads((d / "summary.json").read_text())["model_digest"] for d in (tmp_path / "whole", out)
    ]
    print(f"seed {seed}: kills {history}; final resume from {resumed}; digests {digests}")
    assert digests[0] == digests[1], history
