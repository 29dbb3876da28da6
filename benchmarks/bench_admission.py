"""Admission's curve: stored rows and held-out AUC / log loss against ``admit_after``, on the synthetic stream
and on MovieLens-1M, several seeds each (medians).

    .venv/bin/python benchmarks/bench_admission.py                 # both data sets, admit_after 1,2,3,5, seeds 0-2
    .venv/bin/python benchmarks/bench_admission.py --only synthetic --admit 1,2 --seeds 0
    .venv/bin/python benchmarks/bench_admission.py --smoke          # seconds: the code path, not a result

Every run goes through the CLI (``recsys train --config C --seeds S --set store.bounds=...``, as
``bench_real_data.py`` does), one after another, into ``--out``. ``admit_after = 1`` is the table without
admission: it runs with ``max_rows`` far above any table's rows, which makes the bounds count the rows
without ever removing one (the model is the unbounded one; the tables gain one unused default row).
Stored rows are the ids with a row of their own at the end, summed over tables and ranks, read from the
final checkpoint's ``bounds_rank_<r>.safetensors``; AUC and log loss are the final model's on the
held-out split (``summary.json``). Each data set's figure is the median over the seeds.

Data sets:

- ``synthetic``: ``configs/quickstart.toml`` on one rank, 8 sparse features of 2,000,000 ids each
  (Zipf 1.05, so most ids occur once), tables in memory, ``--synthetic-steps`` steps of 2,048 samples;
- ``movielens-1m``: ``configs/movielens-1m.toml`` as shipped (the data is fetched on first use).

The last line is one JSON object: per data set and ``admit_after``, the medians of ``rows``, ``auc`` and
``logloss``, ``rows_ratio`` and ``auc_delta`` against ``admit_after = 1``, and every seed's figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real_data import train  # noqa: E402
from harness import emit, machine_info  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

NO_CAP = 1 << 40  # max_rows far above any table: the bounds count rows and never remove one


def stored_rows(run: Path) -> int:
    """Ids with a row of their own at the end of the seed's run ``run``: the final checkpoint's bounds."""
    steps = sorted((run / "checkpoints").glob("step_*"))
    if not steps:
        raise RuntimeError(f"{run} has no checkpoint (the bounds are read from the final one)")
    total = 0
    for part in steps[-1].glob("bounds_rank_*.safetensors"):
        total += sum(int(v.shape[0]) for k, v in load_file(str(part)).items() if k.endswith("/row_ids"))
    return total


def bounds_setting(admit_after: int) -> str:
    """The ``--set`` of one point of the curve."""
    if admit_after == 1:
        return f"store.bounds={{max_rows={NO_CAP}}}"
    return f"store.bounds={{admit_after={admit_after}}}"


def curve(
    name: str, config: str, sets: list[str], admits: list[int], seeds: str, out: Path
) -> dict[str, Any]:
    """Every ``admit_after`` on every seed of one data set."""
    points: dict[str, Any] = {}
    for admit in admits:
        where = out / f"{name}_admit{admit}"
        summaries, wall = train(config, where, seeds, *sets, bounds_setting(admit))
        runs = [
            {"seed": s, "rows": stored_rows(where / f"seed_{s}"), "auc": r["auc"], "logloss": r["logloss"]}
            for s, r in sorted(summaries.items())
        ]
        shutil.rmtree(where, ignore_errors=True)  # checkpoints of large tables take GBs
        points[str(admit)] = {
            "rows": statistics.median(r["rows"] for r in runs),
            "auc": statistics.median(r["auc"] for r in runs),
            "logloss": statistics.median(r["logloss"] for r in runs),
            "wall_s": round(wall, 1),
            "runs": runs,
        }
        print(
            f"{name} admit_after={admit}: {json.dumps({k: v for k, v in points[str(admit)].items() if k != 'runs'})}"
        )
    base = points.get("1")
    if base:
        for p in points.values():
            p["rows_ratio"] = round(p["rows"] / base["rows"], 4) if base["rows"] else None
            p["auc_delta"] = round(p["auc"] - base["auc"], 5)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["synthetic", "movielens-1m"], default=None)
    parser.add_argument("--admit", default="1,2,3,5", help="admit_after values (1: no admission)")
    parser.add_argument("--seeds", default="0-2")
    parser.add_argument("--synthetic-steps", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: a fresh one under /tmp)")
    parser.add_argument("--smoke", action="store_true", help="tiny synthetic runs, seconds (a test run)")
    args = parser.parse_args()
    admits = [1, 2] if args.smoke else [int(a) for a in args.admit.split(",")]
    steps = 6 if args.smoke else args.synthetic_steps
    synthetic = [
        "train.nproc=1",
        f"train.steps={steps}",
        "train.log_every=1000000",
        "synthetic.num_sparse=8",
        f"synthetic.id_space={20_000 if args.smoke else 2_000_000}",
        f"synthetic.eval_samples={2048 if args.smoke else 262_144}",
        "sparse.max_rows_per_table=2000000",
        "store.tiered=false",
        "store.tables=[]",
        "eval.every=0",
    ]
    if args.smoke:
        synthetic += ["train.batch_size=256", "model.embedding_dim=8", "model.dense_arch=[16, 8]"]
    sets = {
        "synthetic": ("configs/quickstart.toml", synthetic),
        "movielens-1m": ("configs/movielens-1m.toml", []),
    }
    chosen = ["synthetic"] if args.smoke else [args.only] if args.only else list(sets)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_admission_"))
    result: dict[str, Any] = {"machine": machine_info(), "admit_after": admits, "seeds": args.seeds}
    for name in chosen:
        config, extra = sets[name]
        result[name] = curve(name, config, extra, admits, "0" if args.smoke else args.seeds, out)
    emit(result)


if __name__ == "__main__":
    main()
