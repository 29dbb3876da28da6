"""Top-K recommendation: ``recsys recommend`` against scoring every pair with ``recsys predict``.

1. Writes a click log in CSV (users, items with multi-hot tags, prices), trains a small DLRM on it for
   ``--steps`` steps (1 rank, tables in memory) into ``--dir`` and exports its bundle; reused when the
   bundle exists.
2. Writes ``--users`` users and a catalogue of ``--candidates`` items, and, for the baseline, the file of
   every (user, item) pair in the spec's layout.
3. Runs each once untimed (imports, first calls), then times them, alternating, ``repeats`` times in this
   process, each run whole (reading its files and the bundle included):
   - ``recommend``: ``recommend()`` of every user over the catalogue, keeping the top 10 (the candidate);
   - ``predict``: ``predict()`` of the pairs file, one score per pair (the baseline, what a user would do
     without it: write every pair, score it, then still sort each user's scores, which is not timed).

Prints pairs per second of each and the ratio; the last line is one JSON object.

Usage: python benchmarks/bench_recommend.py [--dir /tmp/bench_recommend] [--users 20] [--candidates 20000]
       [--repeats 3] [--smoke]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from harness import alternate, emit, machine_info

ROOT = Path(__file__).resolve().parents[1]

SPEC = """name = "shop"
format = "csv"
[source]
files = ["clicks.csv"]
[read]
delimiter = ","
[label]
column = "click"
[split]
eval_fraction = 0.2
[[dense]]
name = "age"
transform = "log1p"
[[dense]]
name = "price"
invalid = "missing"
[[sparse]]
name = "user"
kind = "int"
id_space = 5000
[[sparse]]
name = "zip"
[[sparse]]
name = "item"
kind = "int"
id_space = 50000
[[sparse]]
name = "tags"
separator = "|"
"""

CONFIG = """[data]
source = "{spec}"
[model]
embedding_dim = 16
dense_arch = [32, 16]
over_arch = [64]
[sparse]
learning_rate = 0.05
[train]
steps = {steps}
batch_size = 1024
nproc = 1
threads_per_rank = 1
[eval]
batch_size = 4096
"""


def _tags(rng: np.random.Generator) -> str:
    return "|".join(f"t{rng.integers(0, 200)}" for _ in range(rng.integers(0, 4)))


def prepare(folder: Path, steps: int) -> Path:
    """The trained model's bundle (trained and exported once)."""
    bundle = folder / "bundle"
    if (bundle / "manifest.json").exists():
        return bundle
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = ["user,zip,age,item,tags,price,click"]
    for _ in range(60_000):
        user, item = int(rng.integers(0, 5000)), int(rng.zipf(1.2) % 50_000)
        click = int(rng.random() < 0.1 + 0.3 * ((user + item) % 5 == 0))
        lines.append(
            f"{user},z{user % 97},{rng.integers(18, 90)},{item},{_tags(rng)},{rng.random() * 50:.2f},{click}"
        )
    (folder / "clicks.csv").write_text("\n".join(lines) + "\n")
    (folder / "spec.toml").write_text(SPEC)
    (folder / "config.toml").write_text(CONFIG.format(spec=folder / "spec.toml", steps=steps))
    run = folder / "run"
    for argv in (
        ["train", "--config", str(folder / "config.toml"), "--out", str(run)],
        ["export", "--run", str(run), "--out", str(bundle)],
    ):
        subprocess.run([sys.executable, "-m", "recsys", *argv], cwd=ROOT, check=True, capture_output=True)
    return bundle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_recommend"))
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args()
    if args.smoke:
        args.users, args.candidates, args.repeats, args.steps = 3, 500, 1, 10
    bundle = prepare(args.dir, args.steps)

    from recsys.serving.predict import predict
    from recsys.serving.recommend import recommend

    rng = np.random.default_rng(1)
    users = [(int(u), f"z{u % 97}", int(rng.integers(18, 90))) for u in rng.integers(0, 5000, args.users)]
    items = [(i, _tags(rng), f"{rng.random() * 50:.2f}") for i in range(args.candidates)]
    work = args.dir / f"work_{args.users}x{args.candidates}"
    work.mkdir(exist_ok=True)
    (work / "users.csv").write_text("user,zip,age\n" + "".join(f"{u},{z},{a}\n" for u, z, a in users))
    (work / "items.csv").write_text("item,tags,price\n" + "".join(f"{i},{t},{p}\n" for i, t, p in items))
    with open(work / "pairs.csv", "w") as f:
        f.write("user,zip,age,item,tags,price\n")
        for u, z, a in users:
            f.writelines(f"{u},{z},{a},{i},{t},{p}\n" for i, t, p in items)
    pairs = args.users * args.candidates

    def run(name: str, repeat: int) -> float:
        start = time.perf_counter()
        if name == "recommend":
            recommend(bundle, work / "users.csv", work / "items.csv", work / f"top_{repeat}.csv", k=10)
        else:
            predict(bundle, work / f"scores_{repeat}.csv", inputs=[work / "pairs.csv"])
        return pairs / (time.perf_counter() - start)

    for name in ("recommend", "predict"):  # imports and first calls: not timed
        run(name, -1)
    speeds = alternate(["recommend", "predict"], args.repeats, run)
    median = {name: float(np.median(v)) for name, v in speeds.items()}
    print(
        f"{args.users} users x {args.candidates:,} candidates: recommend {median['recommend']:,.0f} pairs/s, "
        f"predict of every pair {median['predict']:,.0f} pairs/s"
    )
    emit(
        {
            "users": args.users,
            "candidates": args.candidates,
            "repeats": args.repeats,
            "recommend_pairs_per_s": median["recommend"],
            "predict_pairs_per_s": median["predict"],
            "recommend_vs_predict": median["recommend"] / median["predict"],
            "recommend_pairs_per_s_repeats": speeds["recommend"],
            "predict_pairs_per_s_repeats": speeds["predict"],
            "machine": machine_info(),
        }
    )


if __name__ == "__main__":
    main()
