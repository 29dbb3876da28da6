"""What crosses the wire between ranks, and what it costs: TorchRec's pooled exchange against the rows
exchange (``sparse.exchange = "rows"``), in arrival order and with key-clustered windows, side by side.

    .venv/bin/python benchmarks/bench_exchange.py                          # requests stream, W = 4, 5 repeats
    .venv/bin/python benchmarks/bench_exchange.py --stream quickstart --torchrun-nodes 2
    .venv/bin/python benchmarks/bench_exchange.py --smoke                  # seconds: the code path, not a figure

Three arms, every one at ``pipeline.frozen_windows = --windows`` (4) on 2 ranks, tables in memory
(``store.tiered = false``; ``--tiered`` keeps the config's tiers), through the real CLI: ``recsys train
--config C --set ...`` in a subprocess per run, into ``--dir``:

- ``pooled``: ``sparse.exchange = pooled`` (TorchRec's EmbeddingBagCollection exchange), the baseline;
- ``rows``: ``sparse.exchange = rows``, windows in arrival order (``pipeline.cluster = none``);
- ``rows_clustered``: ``rows`` with ``pipeline.cluster = keys`` (samples that share ids share a window).

Streams (``--stream``): ``requests`` (default: ``configs/requests.toml`` at ``synthetic.interleave =
--interleave``, 64 by default, so a request's 16 samples spread over a whole rank batch of 1,024),
``quickstart`` (``configs/quickstart.toml``: 26 independent Zipf features) and ``movielens-1m``
(``configs/movielens-1m.toml`` on 2 ranks, its training split read in time order: a copy of the spec with
``shuffle = false`` in ``--dir``; the program stops with one line when the data cannot be had). Every run
has ``--steps`` steps (the config's batch, or ``--batch``), no evaluation but the one at the end (on
``--eval-samples`` held-out samples of a synthetic stream), no checkpoint, ``train.threads_per_rank`` =
the cores halved: what the launcher gives each of 2 local ranks, set for the torchrun nodes too, each of
which would otherwise take every core (on 2 cores that cost about 5 times the CPU of the local ranks).
``--smoke``: 4 steps, short runs of 2, one repeat, 1,024 held-out samples.

Order: the arms alternate over ``--repeats`` (5): pooled, rows, rows_clustered, then reversed on the next
repeat (``harness.alternate``), so drift in the machine's speed hits every arm alike and each pair of
neighbouring runs is back to back. In the first ``--startup-runs`` (2) repeats each arm's run is followed
by a short run of the same arm of ``--startup-steps`` (2) steps, which measures its start-up CPU.
``--torchrun-nodes 2`` adds the same three arms run as 2 "nodes" of one rank each on this host
(``python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank {0,1}``, static rendezvous at
a free loopback port, both agents started by this program) to the same alternation, after the local arms.

Per run (a JSON line each, ``kind`` ``full`` or ``startup``): ``bytes_per_sample`` and ``exchange`` (the
counts of ``summary.json["exchange"]``), ``step_time_ms`` = ``train_seconds`` / steps (``summary.json``,
rank 0's: the training steps alone, start-up and evaluation left out), ``cpu_s`` = user + system CPU seconds of the
run's whole process tree (``getrusage(RUSAGE_CHILDREN)`` around it: the CLI, its spawned workers, and for
torchrun both agents and their workers; checked against a ``/proc`` sampling of the tree, see
``exchange_arms/runs.py``), ``wall_s``, ``model_digest``. A run's folder is removed once measured
(``--keep`` keeps it); its output stays in ``<dir>/<run>.<i>.log`` (``<i>``: the torchrun node).

The LAST line is one JSON object. Per mode, the local ranks' keys bare and the torchrun nodes' prefixed
``two_node_``; ``{arm: value}`` maps hold the three arms:

- ``bytes_per_sample``: bytes sent between ranks per training sample (``summary.json``). It is a function
  of the stream and the arm alone, so every repeat must give the same: the program stops if one does not;
- ``rows_bytes_ratio``, ``rows_clustered_bytes_ratio``: the arm's bytes per sample over pooled's, and
  ``clustered_vs_arrival_bytes``: rows_clustered's over rows' (lower: fewer bytes);
- ``rows_speedup``, ``rows_clustered_speedup``: pooled's step time over the arm's, the median of the
  per-repeat pairs (higher is better: the project's convention for speed), with ``_pairs`` (each repeat's)
  and ``_range`` [min, max]; ``rows_step_time_ratio``, ``rows_clustered_step_time_ratio``: the other way
  round, the arm's step time over pooled's (lower is better), median and ``_range``;
- ``step_time_ms``: each arm's median step time, with ``_range`` and ``_repeats``;
- ``cpu_s_per_1k_samples``: each arm's CPU seconds per 1,000 trained samples, start-up left out: a run's
  ``cpu_s`` less the median ``cpu_s`` of its arm's short runs (``startup_cpu_s``: imports, process group,
  sharding, data, the final evaluation on the held-out samples, the summary), over the samples of the
  steps between the two; the median over the repeats, with ``_range`` and ``_repeats``. Beside it
  ``cpu_s_per_1k_samples_with_startup``: the run's whole ``cpu_s`` over its samples. Both count every
  rank's CPU (2 ranks) per global sample;
- ``exchange``: each arm's counts (``ids``, ``lengths``, ``rows``, ``grad_rows``, ``pooled``, ``bytes``,
  ``bytes_per_sample``, over every rank, of one repeat); ``digests``: the ``model_digest``s of its repeats.

With ``--torchrun-nodes 2`` also: ``two_node_digest_equal``: the 2-node rows runs trained the model of the
2-rank local rows runs (one ``model_digest`` over every repeat of both); ``two_node_digest_equal_by_arm``,
the same for every arm; ``two_node_bytes_equal``: every arm's bytes per sample are the local ones.

``simulated``: where ``recsys plan-exchange`` is in the tree, the JSON object of its last line (bytes per
sample of the three arms at simulated world sizes, ``{"world_2": {"pooled": ..., "rows": ...,
"rows_clustered": ...}, "world_8": ...}``), run first with ``--config`` and the runs' ``--set``s but the
arm's; otherwise null. ``simulated_note`` says which, or why it failed.

Also: ``machine`` (``harness.machine_info`` with torch, torchrec and fbgemm_gpu, and
``two_thread_speedup``), ``settings`` (stream, config, every run's ``--set``, the arms', the counts),
``wall_s`` (the whole program), ``runs_in`` (``--dir``).

Usage: python benchmarks/bench_exchange.py [--stream requests|quickstart|movielens-1m] [--interleave 64]
       [--windows 4] [--repeats 5] [--steps 300] [--batch N] [--startup-steps 2] [--startup-runs 2]
       [--eval-samples 4096] [--tiered] [--torchrun-nodes 2] [--dir /tmp/bench_exchange] [--keep] [--smoke]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exchange_arms.runs import ArmRun, plan_exchange, threads_per_rank, train  # noqa: E402
from exchange_arms.streams import STREAMS, stream  # noqa: E402
from exchange_arms.summary import ARMS, compare, same_bytes, two_node_checks  # noqa: E402
from harness import alternate, emit, machine_info, two_thread_speedup  # noqa: E402

ARM_SETS = {
    "pooled": ("sparse.exchange=pooled", "pipeline.cluster=none"),
    "rows": ("sparse.exchange=rows", "pipeline.cluster=none"),
    "rows_clustered": ("sparse.exchange=rows", "pipeline.cluster=keys"),
}
PREFIXES = {"local": "", "two_node": "two_node_"}


def say(text: str) -> None:
    print(f"[bench_exchange {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run_sets(args: argparse.Namespace, steps: int) -> list[str]:
    """The ``--set``s of every run of ``steps`` steps, whatever its arm."""
    sets = [
        "train.nproc=2",
        f"train.threads_per_rank={threads_per_rank()}",
        f"train.steps={steps}",
        f"train.log_every={steps}",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
        "eval.every=0",
        f"pipeline.frozen_windows={args.windows}",
    ]
    if args.batch:
        sets.append(f"train.batch_size={args.batch}")
    if not args.tiered:
        sets.append("store.tiered=false")
    return sets


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stream", choices=STREAMS, default="requests")
    parser.add_argument("--interleave", type=int, default=64, help="requests in flight (requests stream)")
    parser.add_argument("--windows", type=int, default=4, help="pipeline.frozen_windows of every arm")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=0, help="global batch (0: the config's)")
    parser.add_argument("--startup-steps", type=int, default=2, help="steps of the short runs")
    parser.add_argument("--startup-runs", type=int, default=2, help="short runs per arm")
    parser.add_argument("--eval-samples", type=int, default=4096, help="held-out samples (synthetic)")
    parser.add_argument("--tiered", action="store_true", help="keep the config's tiers")
    parser.add_argument(
        "--torchrun-nodes", type=int, choices=[2], default=None, help="also as torchrun nodes"
    )
    parser.add_argument("--dir", type=Path, default=None, help="run folder (default: a fresh one in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep every run's folder")
    parser.add_argument("--smoke", action="store_true", help="tiny runs, seconds (a test run)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.startup_steps, args.repeats, args.startup_runs = 4, 2, 1, 1
        args.eval_samples = 1024
    if not 0 < args.startup_steps < args.steps:
        parser.error(f"--startup-steps must be in 1..{args.steps - 1} (below --steps)")
    if not 1 <= args.startup_runs <= args.repeats:
        parser.error(f"--startup-runs must be in 1..{args.repeats} (--repeats)")
    return args


def main() -> None:
    args = parse_args()
    out = args.dir or Path(tempfile.mkdtemp(prefix="bench_exchange_"))
    start = time.perf_counter()
    chosen = stream(args.stream, interleave=args.interleave, eval_samples=args.eval_samples, scratch=out)
    full_sets = [*chosen.sets, *run_sets(args, args.steps)]
    short_sets = [*chosen.sets, *run_sets(args, args.startup_steps)]
    simulated, note = plan_exchange(chosen.config, tuple(full_sets))
    say(note)
    modes = ["local"] + (["two_node"] if args.torchrun_nodes else [])
    names = [PREFIXES[mode] + arm for mode in modes for arm in ARMS]
    short: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    full: dict[str, list[dict[str, Any]]] = {name: [] for name in names}

    def run(name: str, repeat: int) -> dict[str, Any]:
        mode = "two_node" if name.startswith(PREFIXES["two_node"]) else "local"
        arm = name.removeprefix(PREFIXES["two_node"])
        kinds = [("full", full_sets)] + ([("startup", short_sets)] if repeat < args.startup_runs else [])
        records = {}
        for kind, sets in kinds:
            where = out / f"{name}_{kind}_{repeat}"
            say(f"{name} repeat {repeat} ({kind})")
            records[kind] = train(ArmRun(chosen.config, (*sets, *ARM_SETS[arm]), where, mode))
            emit({"run": name, "repeat": repeat, "kind": kind, **records[kind]})
            if not args.keep:
                shutil.rmtree(where, ignore_errors=True)
        if "startup" in records:
            short[name].append(records["startup"])
        full[name].append(records["full"])
        same_bytes(name, full[name])  # stops at the first repeat that differs
        return records["full"]

    runs = alternate(names, args.repeats, run)
    result: dict[str, Any] = {}
    for mode in modes:
        result.update(compare(PREFIXES[mode], runs, short))
    if args.torchrun_nodes:
        result.update(two_node_checks(result))
    emit(
        {
            "machine": {
                **machine_info("torch", "torchrec", "fbgemm_gpu"),
                "two_thread_speedup": two_thread_speedup(),
            },
            "settings": {
                "stream": args.stream,
                "config": chosen.config,
                "sets": full_sets,
                "arm_sets": ARM_SETS,
                "windows": args.windows,
                "ranks": 2,
                "tiered": args.tiered,
                "interleave": args.interleave if args.stream == "requests" else None,
                "steps": args.steps,
                "repeats": args.repeats,
                "startup_steps": args.startup_steps,
                "startup_runs": args.startup_runs,
                "torchrun_nodes": args.torchrun_nodes,
                "order": "pooled, rows, rows_clustered (then the two_node ones); reversed every other repeat",
            },
            **result,
            "simulated": simulated,
            "simulated_note": note,
            "wall_s": time.perf_counter() - start,
            "runs_in": str(out),
        }
    )


if __name__ == "__main__":
    main()
