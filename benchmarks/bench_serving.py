"""Serving: the bundle's scorer against the same model held in memory as a TorchRec module; export cost.

1. Trains a small tiered DLRM (1 rank, ``--features`` tables of ``--id-space`` ids, ``--steps`` steps of
   2,048) into ``--dir`` once (reused when its summary.json exists).
2. ``recsys export`` of its final checkpoint, each in a fresh process, with ``--buffer-rows`` and with a
   buffer larger than every table: wall time and peak RSS (VmHWM) beside the same process's RSS right
   after its imports, and the tables' rows.
3. Scores held-out batches of 1, 64 and 1,024 samples, each call timed, with
   - ``torchrec``: TorchRec's ``DLRM`` over an unsharded ``EmbeddingBagCollection`` holding every row of
     every id space (trained rows from the bundle, the rest their initial values), fed a
     ``KeyedJaggedTensor`` built from the same raw ids — the baseline;
   - ``cached``: ``load_bundle(cache_rows=)`` large enough for every stored row (warm);
   - ``cache_10pct``: a cache of a tenth of each tiered table's stored rows (misses read LMDB).
   Each is first run once over the batches it is timed on (warm caches); then calls alternate between
   the three on the same inputs, so machine noise hits all alike.

Prints throughput (samples/s) and p50/p99 latency side by side; the last line is one JSON object of
ratios, candidate speed over baseline speed (higher is better), plus the export figures.

Usage: python benchmarks/bench_serving.py [--dir /tmp/bench_serving] [--steps 60] [--id-space 200000]
       [--smoke]   (seconds at tiny sizes; the trained run in --dir is reused when it exists)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from harness import alternate, emit, machine_info, peak_rss_mib, run_child, timed

from recsys.table_names import feature_of

ROOT = Path(__file__).resolve().parents[1]
BATCH_SIZES = (1, 64, 1024)
CALLS = {1: 2000, 64: 400, 1024: 60}
SMOKE_CALLS = {1: 20, 64: 5, 1024: 2}


def export_child(run: Path, out: Path, buffer_rows: int) -> None:
    """The export in this fresh process (``--export-child``): its time, peak RSS and RSS after imports."""
    import recsys.train  # noqa: F401 - what `recsys export` imports too
    from recsys.serving.export import ExportOptions, export_bundle

    before = peak_rss_mib()
    start = time.perf_counter()
    report = export_bundle(run, out, options=ExportOptions(buffer_rows=buffer_rows))
    seconds = time.perf_counter() - start
    emit(
        {
            "seconds": seconds,
            "rss_after_imports_mib": before,
            "peak_rss_mib": peak_rss_mib(),
            "tables": report["tables"],
            "bytes": report["bytes"],
        },
        digits=None,
    )


def _config(args: argparse.Namespace) -> str:
    return f"""
[synthetic]
num_sparse = {args.features}
id_space = {args.id_space}
eval_samples = {65536 if not args.smoke else 4096}
[model]
embedding_dim = 16
[train]
steps = {args.steps}
batch_size = 2048
checkpoint_every = {args.steps}
log_every = 20
[store]
tiered = true
device_rows = 20000
host_rows = 20000
[eval]
batch_size = 8192
"""


def train(args: argparse.Namespace) -> Path:
    run = args.dir / "run"
    if (run / "summary.json").exists():
        return run
    args.dir.mkdir(parents=True, exist_ok=True)
    config = args.dir / "config.toml"
    config.write_text(_config(args))
    cmd = [sys.executable, "-m", "recsys", "train", "--config", str(config), "--out", str(run)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return run


def export(run: Path, out: Path, buffer_rows: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return run_child([__file__, "--export-child", str(run), str(out), str(buffer_rows)], cwd=ROOT)


def torchrec_model(bundle_path: Path):
    """TorchRec's DLRM with every row of every table in memory, weights from the bundle."""
    from safetensors.torch import load_file
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from embedding_store.init import init_rows
    from recsys.models import table_configs
    from recsys.serving.bundle import read_bundle
    from recsys.serving.cache import open_rows

    bundle = read_bundle(bundle_path)
    feats = bundle.features
    tables = table_configs(
        [f.name for f in feats], dim=feats[0].dim, num_embeddings=[f.id_space or f.rows for f in feats]
    )
    arch = bundle.arch
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
        dense_in_features=bundle.num_dense,
        dense_arch_layer_sizes=list(arch["dense_arch"]),
        over_arch_layer_sizes=[*arch["over_arch"], 1],
    )
    state = {k.removeprefix("model."): v for k, v in load_file(bundle.file("dense.safetensors")).items()}
    seed, scale = bundle.init
    reader = open_rows(
        bundle.file("tiered/data.mdb").parent, tables=[f.table for f in feats], row_floats=bundle.row_floats
    )
    for f in feats:
        weight = init_rows(np.arange(f.id_space), dim=f.dim, seed=seed, table=f.table, scale=scale)
        for ids, rows in reader.scan(f.table):
            weight[torch.from_numpy(ids)] = torch.from_numpy(rows[:, : f.dim].copy())
        state[f"sparse_arch.embedding_bag_collection.embedding_bags.{f.table}.weight"] = weight
    model.load_state_dict(state)
    return model.eval()


def inputs(run: Path, batch_size: int, count: int) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    from recsys.config import config_from_dict
    from recsys.data.source import build_dataset

    config = config_from_dict(json.loads((run / "summary.json").read_text())["config"])
    data = build_dataset(config.data, synthetic=config.synthetic, seed=config.train.seed)
    out = []
    start = 0
    while len(out) < count:
        index = np.arange(start, start + batch_size, dtype=np.uint64) % np.uint64(
            config.synthetic.eval_samples
        )
        batch = data.samples(index, split="eval")
        out.append(
            (batch.dense.numpy(), {k: jt.values().numpy() for k, jt in batch.sparse.to_dict().items()})
        )
        start += batch_size
    return out


def measure(candidates: dict, batches: list) -> dict[str, np.ndarray]:
    """Seconds of every call per candidate, calls interleaved in alternating order (``harness.alternate``)
    on the same batch, after a warm-up pass over the same batches (the caches then hold what they would
    in a steady state: every stored row, or a tenth)."""
    for fn in candidates.values():
        for dense, ids in batches:
            fn(dense, ids)
    times = alternate(
        list(candidates), len(batches), lambda name, i: timed(lambda: candidates[name](*batches[i]))
    )
    return {name: np.array(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_serving"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--id-space", type=int, default=200_000)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--buffer-rows", type=int, default=4096)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: 2 tables of 5,000 ids, 4 steps, a few calls (a test run)",
    )
    parser.add_argument(
        "--export-child", nargs=3, metavar=("RUN", "OUT", "BUFFER_ROWS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.export_child:
        run, out, buffer_rows = args.export_child
        export_child(Path(run), Path(out), int(buffer_rows))
        return
    calls = CALLS
    if args.smoke:
        args.steps, args.id_space, args.features, calls = 4, 5000, 2, SMOKE_CALLS
    emit(machine_info("torch", "numpy"))

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys.serving import load_bundle

    started = time.perf_counter()
    run = train(args)
    print(f"# trained (or reused) {run} in {time.perf_counter() - started:.0f} s")
    small = export(run, args.dir / "bundle", args.buffer_rows)
    large = export(run, args.dir / "bundle_large_buffer", 1 << 24)
    stored = {t: v["rows"] for t, v in small["tables"].items() if v["kind"] == "tiered"}
    print(
        f"export: {len(stored)} tiered tables of {min(stored.values()):,}-{max(stored.values()):,} stored rows, bundle {small['bytes'] / 2**20:.1f} MiB"
    )
    for name, r, buf in (("buffer", small, args.buffer_rows), ("large buffer", large, 1 << 24)):
        print(
            f"  --buffer-rows {buf:>9,} ({name}): {r['seconds']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB "
            f"({r['peak_rss_mib'] - r['rss_after_imports_mib']:+.0f} MiB over the {r['rss_after_imports_mib']:.0f} MiB after imports)"
        )

    bundle = args.dir / "bundle"
    most = max(stored.values())
    baseline = torchrec_model(bundle)
    cached = load_bundle(bundle, cache_rows=most)
    tenth = load_bundle(bundle, cache_rows={feature_of(t): max(1, n // 10) for t, n in stored.items()})
    features = cached.features

    def torchrec_call(dense, ids):
        with torch.no_grad():
            values = torch.from_numpy(np.concatenate([ids[f] for f in features]))
            lengths = torch.ones(values.shape[0], dtype=torch.int32)
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=features, values=values, lengths=lengths)
            return baseline(torch.from_numpy(dense), kjt).squeeze(-1)

    candidates = {"torchrec": torchrec_call, "cached": cached.logits, "cache_10pct": tenth.logits}
    check = inputs(run, 1024, 1)[0]
    diff = max(float((torchrec_call(*check) - c(*check)).abs().max()) for c in (cached.logits, tenth.logits))
    print(f"largest |logit difference| to the TorchRec model on 1,024 samples: {diff:.2e}")

    ratios: dict[str, float] = {}
    print(f"{'batch':>6} {'model':>12} {'samples/s':>12} {'p50 ms':>9} {'p99 ms':>9}")
    for b in BATCH_SIZES:
        times = measure(candidates, inputs(run, b, calls[b]))
        base = times["torchrec"]
        for name, t in times.items():
            print(
                f"{b:>6} {name:>12} {b * len(t) / t.sum():>12,.0f} {np.percentile(t, 50) * 1e3:>9.3f} {np.percentile(t, 99) * 1e3:>9.3f}"
            )
            if name != "torchrec":
                ratios[f"b{b}_{name}_throughput_vs_torchrec"] = round(float(base.sum() / t.sum()), 3)
                ratios[f"b{b}_{name}_p50_vs_torchrec"] = round(
                    float(np.percentile(base, 50) / np.percentile(t, 50)), 3
                )
                ratios[f"b{b}_{name}_p99_vs_torchrec"] = round(
                    float(np.percentile(base, 99) / np.percentile(t, 99)), 3
                )
    rates = {f: round(s.hit_rate, 3) for f, s in tenth.cache_stats().items()}
    print(f"cache_10pct hit rates over all calls: {rates}")
    ratios.update(
        export_seconds=round(small["seconds"], 2),
        export_peak_rss_mib=round(small["peak_rss_mib"], 1),
        export_rss_over_imports_mib=round(small["peak_rss_mib"] - small["rss_after_imports_mib"], 1),
        export_large_buffer_rss_over_imports_mib=round(
            large["peak_rss_mib"] - large["rss_after_imports_mib"], 1
        ),
        export_buffer_rows=args.buffer_rows,
        export_largest_table_rows=most,
    )
    emit(ratios)


if __name__ == "__main__":
    main()
