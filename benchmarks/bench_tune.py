"""Benchmark of ``recsys tune-cache``: replay plus curves for 10M ids per table, and the sampling error.

Runs the real tuner (:func:`recsys.tune.tuner.tune`: the synthetic reader, routing to owners, curves of
LRU/LFU/LOOKAHEAD/Belady, the budget split and the final simulations) on a Zipf(1.05) config whose
two tiered tables each receive ``--ids`` raw ids (batches x batch size), and times it. Then, on the first
table's trace, it computes the exact LRU curve (stack distances over the whole trace) beside the curve
of the SHARDS sample the tuner uses, and a LOOKAHEAD simulation of the whole trace beside the sampled
one at three capacities, and reports the largest absolute differences in hit rate.

Prints the machine and versions first and, as its LAST line, one JSON object with seconds (tune, of which
replay), raw ids and trace accesses per table, the sample rate, lru_max_abs_error,
lookahead_max_abs_error and the 60 s target.

Usage: python benchmarks/bench_tune.py [--ids 10000000] [--batch-size 16384] [--smoke]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from harness import emit, machine_info

from embedding_store import PolicyKind
from recsys.config import config_from_dict
from recsys.tune import tuner
from recsys.tune.curves import capacity_grid, lru_curve
from recsys.tune.replay import replay
from recsys.tune.trace import prepare, simulate

TARGET_S = 60.0


def config(ids: int, batch_size: int):
    steps = -(-ids // batch_size)
    tree = {
        "synthetic": {
            "num_dense": 1,
            "num_sparse": 2,
            "id_space": 4_000_000,
            "zipf_alpha": 1.05,
            "eval_samples": 1024,
        },
        "model": {"embedding_dim": 16, "dense_arch": [16, 16], "over_arch": [16]},
        "store": {"tiered": True, "policy": "lookahead", "lookahead": 4},
        "train": {"steps": steps, "batch_size": batch_size, "nproc": 1},
        "eval": {"every": 0},
    }
    return config_from_dict(tree), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", type=int, default=10_000_000, help="raw ids per table")
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--smoke", action="store_true", help="seconds: 40,000 ids per table (a test run)")
    args = parser.parse_args()
    if args.smoke:
        args.ids, args.batch_size = 40_000, 2048
    emit(machine_info("numpy", "torch"))
    cfg, steps = config(args.ids, args.batch_size)
    row_bytes = 4 * 17
    start = time.perf_counter()
    rep = replay(cfg)
    replay_s = time.perf_counter() - start
    # The tuner replays again inside tune(); time the whole command path on its own.
    start = time.perf_counter()
    result = tuner.tune(cfg, device_budget=2 * 200_000 * row_bytes, host_budget=2 * 400_000 * row_bytes)
    tune_s = time.perf_counter() - start
    name = next(iter(rep.traces))
    trace = rep.traces[name][0]
    # The sample the tuner predicts from: about SAMPLE_ABOVE_ACCESSES accesses, at least MIN_SAMPLED_IDS ids.
    want = max(
        tuner.SAMPLE_ABOVE_ACCESSES / max(1, trace.ids.shape[0]),
        tuner.MIN_SAMPLED_IDS / max(1, trace.num_ids),
    )
    sample = trace.sample(want) if want < 1 else trace
    rate = sample.sample_rate
    floor = result.doc["tables"][name]["min_device_rows"]
    caps = capacity_grid(floor, trace.num_ids, 16).astype(np.float64)
    start = time.perf_counter()
    exact = lru_curve(trace, caps).hit_rates
    exact_lru_s = time.perf_counter() - start
    sampled = lru_curve(sample, caps).hit_rates
    look_caps = [int(c) for c in np.geomspace(max(floor, 1) * 1.5, trace.num_ids / 2, 3)]
    full_prep, samp_prep = prepare(trace), prepare(sample)
    look_err = []
    start = time.perf_counter()
    for cap in look_caps:
        full = simulate(trace, cap, policy=PolicyKind.LOOKAHEAD, lookahead=4, prepared=full_prep).hit_rate
        approx = simulate(
            sample, max(1, round(cap * rate)), policy=PolicyKind.LOOKAHEAD, lookahead=4, prepared=samp_prep
        ).hit_rate
        look_err.append(abs(full - approx))
    exact_look_s = time.perf_counter() - start
    out = {
        "tune_seconds": round(tune_s, 2),
        "replay_seconds": round(replay_s, 2),
        "target_seconds": TARGET_S,
        "under_target": tune_s < TARGET_S,
        "tables": len(rep.traces),
        "raw_ids_per_table": steps * args.batch_size,
        "trace_accesses_per_table": int(trace.ids.shape[0]),
        "distinct_ids_per_table": int(trace.num_ids),
        "sample_rate": round(rate, 4),
        "lru_max_abs_error": round(float(np.max(np.abs(exact - sampled))), 4),
        "lru_mean_abs_error": round(float(np.mean(np.abs(exact - sampled))), 4),
        "lookahead_abs_errors": [round(e, 4) for e in look_err],
        "lookahead_max_abs_error": round(max(look_err), 4),
        "lookahead_capacities": look_caps,
        "exact_lru_curve_seconds": round(exact_lru_s, 2),
        "exact_lookahead_seconds": round(exact_look_s, 2),
        "predicted_device_hit_rate": round(result.doc["total"]["predicted_device_hit_rate"], 4),
    }
    emit(out)


if __name__ == "__main__":
    main()
