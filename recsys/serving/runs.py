"""A run directory's checkpoints and config, as ``recsys evaluate`` and ``recsys export`` read them.

The config of a checkpoint is, in order of preference, ``<checkpoint>/config.json``, ``<run>/config.json``
(neither is written by the trainer yet) or ``<run>/summary.json``'s ``config``. As ``summary.json`` is
the last run's — a resumed run may have changed settings — the model-shaping keys of the config are
checked against the checkpoint's own fingerprint (``meta.json``) before anything is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recsys.checkpoint import checkpoint_meta, latest_checkpoint, verify_checkpoint
from recsys.config import RunConfig, config_from_dict
from recsys.errors import UserError

__all__ = ["find_checkpoint", "run_config", "STRUCTURAL"]

# Fingerprint keys that decide the shape and the rows of the model a checkpoint holds: a config that
# differs in one of them cannot be the checkpoint's (the learning rates may change on resume).
STRUCTURAL = (
    "model.", "sparse.optimizer", "sparse.sharding", "sparse.init_scale", "sparse.max_rows_per_table", "train.seed",
)  # fmt: skip


def find_checkpoint(run: Path, which: str | None) -> Path:
    """The checkpoint ``which`` names (a step number, ``best``, or a checkpoint directory; None: the
    newest complete one) of run directory ``run``, verified against its manifest.

    Raises:
        UserError: no such checkpoint, or it is damaged (one line naming the file).
    """
    root = run / "checkpoints"
    if not run.is_dir():
        raise UserError(f"--run {run}: no such run directory")
    if which is None:
        path = latest_checkpoint(root)
        if path is None:
            raise UserError(f"--run {run}: no complete checkpoint under {root}{_why_none(run)}")
    elif which == "best":  # the checkpoint of the best evaluation (eval.every > 0), kept in DIR/best
        path = latest_checkpoint(run / "best")
        if path is None:
            raise UserError(
                f"--checkpoint best: no checkpoint under {run / 'best'} (train with eval.every > 0)"
            )
    elif which.isdigit():
        path = root / f"step_{int(which):08d}"
        if not (path / "meta.json").is_file():
            steps = sorted(int(p.parent.name.removeprefix("step_")) for p in root.glob("step_*/meta.json"))
            raise UserError(
                f"--checkpoint {which}: no complete checkpoint {path} (complete: {', '.join(map(str, steps)) or 'none'})"
            )
    else:
        path = Path(which)
        if not (path / "meta.json").is_file():
            raise UserError(f"--checkpoint {which}: not a complete checkpoint directory (no meta.json)")
    problems = verify_checkpoint(path)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"checkpoint {path} is damaged: {problems[0]}{more}")
    return path


def _why_none(run: Path) -> str:
    """Why a run has no checkpoint, when its summary says it was asked for none."""
    try:
        train = json.loads((run / "summary.json").read_text(encoding="utf-8"))["config"]["train"]
    except (OSError, ValueError, KeyError, TypeError):
        return " (was the run stopped before its first checkpoint?)"
    if (
        isinstance(train, dict)
        and train.get("final_checkpoint") is False
        and not train.get("checkpoint_every")
    ):
        return (
            " (the run was trained with train.final_checkpoint = false and train.checkpoint_every = 0, "
            "which write none; train again without them)"
        )
    return " (was the run stopped before its first checkpoint?)"


def _config_tree(run: Path, checkpoint: Path) -> tuple[dict[str, Any], Path]:
    for candidate in (checkpoint / "config.json", run / "config.json"):
        if candidate.is_file():
            return _read_json(candidate), candidate
    summary = run / "summary.json"
    if not summary.is_file():
        raise UserError(f"--run {run}: no config.json and no summary.json to take the run's config from")
    tree = _read_json(summary).get("config")
    if not isinstance(tree, dict):
        raise UserError(f"{summary} has no config")
    return tree, summary


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path}: {err}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object")
    return value


def run_config(run: Path, checkpoint: Path, overrides: list[str]) -> tuple[RunConfig, Path]:
    """The config of ``checkpoint`` with ``overrides`` (``section.key=value``), and the file it came from.

    Raises:
        UserError: no config found, or one whose model-shaping settings differ from the checkpoint's.
    """
    from recsys.checkpoint import model_fingerprint

    tree, source = _config_tree(run, checkpoint)
    config = config_from_dict(tree, overrides)
    saved = checkpoint_meta(checkpoint).get("fingerprint") or {}
    now = json.loads(json.dumps(model_fingerprint(config)))
    differ = [
        f"{key}: checkpoint {json.dumps(saved[key])}, config {json.dumps(now.get(key))}"
        for key in sorted(saved)
        if key.startswith(STRUCTURAL) and saved[key] != now.get(key)
    ]
    if differ:
        raise UserError(
            f"the config from {source} does not describe checkpoint {checkpoint}: {'; '.join(differ)} "
            "(settings that shape the model cannot be overridden)"
        )
    return config, source
