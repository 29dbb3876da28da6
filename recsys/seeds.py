"""``recsys train --seeds 0,1,2``: the same config trained once per seed, and the spread of the results.

One seed's figure is an anecdote: on MovieLens-1M two seeds of the same config differ by more than the
gap between two models. Each seed trains into ``<out>/seed_<s>/`` exactly as ``recsys train --set
train.seed=<s>`` would; ``<out>/seeds.json`` then holds every seed's held-out metrics and, per metric, the
median, mean, standard deviation, minimum and maximum over the seeds. With ``--resume`` a seed whose run
has finished is not trained again.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recsys.errors import UserError
from recsys.metrics import write_json

__all__ = ["parse_seeds", "seed_summary", "train_seeds"]

METRICS = ("auc", "logloss", "constant_logloss")


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` or ``"0-4"`` → the seeds, in order, each once."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part[1:]:  # a range; a leading "-" is a negative number, refused below
                first, _, hi = part[1:].partition("-")
                lo = part[0] + first
                seeds += range(int(lo), int(hi) + 1)
            else:
                seeds.append(int(part))
    except ValueError:
        raise UserError(f"--seeds: expected a list like 0,1,2 or a range like 0-4, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds: expected distinct seeds >= 0, got {text!r}")
    return seeds


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "mean": None, "std": None, "min": None, "max": None}
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def seed_summary(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per-seed metrics (of the final and, when kept, the best model) and their spread over seeds."""
    per_seed = {
        str(seed): {
            "auc": s.get("auc"),
            "logloss": s.get("logloss"),
            "constant_logloss": s.get("constant_logloss"),
            "best": s.get("best"),
            "model_digest": s.get("model_digest"),
            "steps": s.get("steps"),
        }
        for seed, s in runs.items()
    }
    out: dict[str, Any] = {"seeds": sorted(runs), "runs": per_seed, "final": {}, "best": {}}
    for metric in METRICS:
        out["final"][metric] = _spread([v[metric] for v in per_seed.values() if v[metric] is not None])
    for metric in ("auc", "logloss"):
        best = [v["best"][metric] for v in per_seed.values() if v["best"] and v["best"][metric] is not None]
        out["best"][metric] = _spread(best)
    return out


def _finished(summary_path: Path, steps: int) -> bool:
    """True when ``summary_path`` is the summary of a run of ``train.steps = steps`` (done or stopped early)."""
    try:
        summary = json.loads(summary_path.read_text())
        return int(summary["config"]["train"]["steps"]) == steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def train_seeds(
    seeds: list[int], out: Path, *, steps: int, resume: bool, train_one: Callable[[int, Path, bool], int]
) -> tuple[int, dict[str, Any] | None]:
    """Train every seed with ``train_one(seed, run_dir, resume)`` (an exit code); returns the first
    non-zero code (or 0) and the summary written to ``out/seeds.json`` (None when a seed failed).

    With ``resume``, a seed whose run of ``steps`` steps has finished is taken as it is, and one with
    checkpoints continues from them."""
    runs: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        run_dir = out / f"seed_{seed}"
        summary_path = run_dir / "summary.json"
        done = resume and _finished(summary_path, steps)
        if not done:
            again = resume and (run_dir / "checkpoints").is_dir()
            code = train_one(seed, run_dir, again)
            if code:
                return code, None
        runs[seed] = json.loads(summary_path.read_text())
    summary = seed_summary(runs)
    write_json(out / "seeds.json", summary)
    return 0, summary
