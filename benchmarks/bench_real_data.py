"""Real data: each shipped config against its baselines on several seeds (MovieLens-1M/100k, Open Bandit).

    .venv/bin/python benchmarks/bench_real_data.py                       # all three configs, seeds 0,1,2
    .venv/bin/python benchmarks/bench_real_data.py --only movielens-100k --seeds 0-4
    .venv/bin/python benchmarks/bench_real_data.py --smoke   # seconds: the code path, not a result

For every config it runs, through the CLI in subprocesses and one after another, ``recsys train --config C
--seeds S`` (the config's model) and the same with ``--set model.name=logistic`` (the baseline), into
``--out`` (a fresh folder under /tmp by default). The result is the final model's held-out metrics, the
top-level ``auc``/``logloss`` of each ``summary.json``. A config passes on a seed when

- its held-out logloss is below the constant predictor's (``constant_logloss``: always the training
  split's positive rate), and its AUC is above the logistic baseline's on the same seed and split;
- where the held-out split has fewer than 100 positives (Open Bandit: 6 clicks) AUC is noise: it is
  reported, not compared, and the logloss may be up to 1.005 times the constant predictor's.

MovieLens-1M must also reach a median AUC of at least 0.775 over the seeds. It prints a table per config
and, last, one JSON object with every figure and ``all_pass``. The data is fetched into the cache
(``$TIERREC_CACHE`` or ~/.cache/tierrec) on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The tests load this file by its path (benchmarks/ is not a package), so its folder may not be on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "movielens-1m": "configs/movielens-1m.toml",
    "movielens-100k": "configs/movielens-100k.toml",
    "open-bandit": "configs/open-bandit.toml",
}
MIN_POSITIVES = 100  # below this many held-out positives AUC is not compared
FEW_POSITIVES_TOLERANCE = 1.005  # there the logloss may be this many times the constant predictor's
MEDIAN_AUC = {"movielens-1m": 0.775}  # median over the seeds of the config's model


def cli_env() -> dict[str, str]:
    """The environment of the CLI subprocesses: no inherited torchrun variables, the repository importable."""
    env = {
        k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"}
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def train(
    config: str, out: Path, seeds: str, *sets: str, python: str = sys.executable, timeout_s: float = 7200
) -> tuple[dict[int, dict[str, Any]], float]:
    """``recsys train --config config --seeds seeds --out out [--set ...]``: each seed's summary, and the
    wall time of the whole command. A previous run in ``out`` is removed first."""
    if out.exists():
        shutil.rmtree(out)
    args = [python, "-m", "recsys", "train", "--config", config, "--seeds", seeds, "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    done = json.loads((out / "seeds.json").read_text())["seeds"]
    return {s: json.loads((out / f"seed_{s}" / "summary.json").read_text()) for s in done}, wall


def compare(
    name: str, model: dict[int, dict[str, Any]], logistic: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """Every seed's figures and checks (see the module docstring), and whether the config passes."""
    rows = []
    for seed in sorted(model):
        m, lr = model[seed], logistic[seed]
        positives = m["splits"]["eval"]["positives"]
        few = positives < MIN_POSITIVES
        limit = m["constant_logloss"] * (FEW_POSITIVES_TOLERANCE if few else 1.0)
        logloss_pass = m["logloss"] <= limit if few else m["logloss"] < limit
        auc_pass = None if few else m["auc"] > lr["auc"]
        rows.append(
            {
                "seed": seed,
                "model": m["model"],
                "auc": m["auc"],
                "logistic_auc": lr["auc"],
                "logloss": m["logloss"],
                "logistic_logloss": lr["logloss"],
                "constant_logloss": m["constant_logloss"],
                "logloss_limit": limit,
                "eval_rows": m["splits"]["eval"]["rows"],
                "eval_positives": positives,
                "logloss_pass": logloss_pass,
                "auc_pass": auc_pass,
                "pass": logloss_pass and auc_pass is not False,
            }
        )
    median = statistics.median(r["auc"] for r in rows)
    need = MEDIAN_AUC.get(name)
    median_pass = None if need is None else median >= need
    return {
        "config": CONFIGS[name],
        "seeds": rows,
        "median_auc": median,
        "logistic_median_auc": statistics.median(r["logistic_auc"] for r in rows),
        "median_auc_required": need,
        "median_pass": median_pass,
        "pass": all(r["pass"] for r in rows) and median_pass is not False,
    }


def bench(
    name: str, out: Path, seeds: str = "0,1,2", *, python: str = sys.executable, sets: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The config ``name``'s model and its logistic baseline on ``seeds``, compared (``sets``: more
    ``--set`` overrides for both)."""
    model, model_wall = train(CONFIGS[name], out / name / "model", seeds, *sets, python=python)
    logistic, lr_wall = train(
        CONFIGS[name], out / name / "logistic", seeds, *sets, "model.name=logistic", python=python
    )
    result = compare(name, model, logistic)
    result["wall_s"] = {"model": round(model_wall, 1), "logistic": round(lr_wall, 1)}
    return result


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else "pass" if ok else "FAIL"


def table(name: str, result: dict[str, Any]) -> str:
    """The per-seed table of one config, as Markdown."""
    model = result["seeds"][0]["model"]
    lines = [
        f"{name} ({result['config']}, model {model}; {result['wall_s']['model']:.0f} s model, "
        f"{result['wall_s']['logistic']:.0f} s logistic)",
        "",
        "| seed | held-out positives | model AUC | logistic AUC | AUC > logistic | model logloss "
        "| constant logloss | logloss limit | logloss check | seed passes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["seeds"]:
        strict = "<" if r["eval_positives"] >= MIN_POSITIVES else "≤"
        lines.append(
            f"| {r['seed']} | {r['eval_positives']:,} | {r['auc']:.4f} | {r['logistic_auc']:.4f} | "
            f"{_mark(r['auc_pass'])} | {r['logloss']:.4f} | {r['constant_logloss']:.4f} | "
            f"{strict} {r['logloss_limit']:.4f} | {_mark(r['logloss_pass'])} | {_mark(r['pass'])} |"
        )
    median = f"median AUC {result['median_auc']:.4f} (logistic {result['logistic_median_auc']:.4f})"
    if result["median_auc_required"] is not None:
        median += f", required ≥ {result['median_auc_required']}: {_mark(result['median_pass'])}"
    lines += ["", median, f"{name}: {_mark(result['pass'])}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", action="append", choices=sorted(CONFIGS), help="this config only (repeatable)"
    )
    parser.add_argument("--seeds", default="0,1,2", help="seeds, as recsys train --seeds takes them (0,1,2)")
    parser.add_argument("--out", type=Path, help="run folder (default: a fresh folder under /tmp)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: MovieLens-100k, seed 0, 4 steps (the code path; its checks are expected to fail)",
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="tierrec-real-data-", dir="/tmp"))
    names = args.only or list(CONFIGS)
    sets: tuple[str, ...] = ()
    if args.smoke:
        names, args.seeds = ["movielens-100k"], "0"
        sets = ("train.steps=4", "eval.every=0", "train.log_every=2")
    emit({**machine_info(), "runs_in": str(out)})
    start = time.perf_counter()
    results = {}
    for name in names:
        results[name] = bench(name, out, args.seeds, sets=sets)
        print(table(name, results[name]) + "\n", flush=True)
    wall = time.perf_counter() - start
    print(f"wall time {wall:.0f} s")
    summary = {
        "seeds": args.seeds,
        "out": str(out),
        "wall_s": round(wall, 1),
        "configs": results,
        "all_pass": all(r["pass"] for r in results.values()),
    }
    emit(summary, digits=None)


if __name__ == "__main__":
    main()
