"""Benchmark of the pipeline core: injected per-stage delays, pipelined and sequential side by side.

Three stages sleep a fixed time per batch (default 5, 10 and 20 ms: think SSD read, key routing, device
fill) and the consumer sleeps 20 ms per batch (compute). Perfect overlap gives a step time equal to the
slowest stage; no overlap gives the sum. Sleeps release the GIL, as the real stages do in I/O, torch
ops and collectives, so this measures the scheduling core and not Python's GIL.

Step times are measured in the consumer, between the arrival of batch ``--warmup`` and the last batch
(so pipeline fill and drain are excluded); the stage times they are compared with are the busy seconds
per batch that the pipeline itself measured in the same run (a 20 ms sleep takes a little longer).

Prints the machine and versions, each run, and as its LAST line one JSON object:

- step_vs_slowest_stage: pipelined step time / the slowest stage's measured time per batch (target <= 1.15).
- sequential_step_vs_sum: sequential step time / the sum of the stages' measured times (close to 1).
- pipelined_vs_sequential: sequential step time / pipelined step time (speed-up).

Usage: python benchmarks/bench_pipeline_core.py [--steps 200] [--delays-ms 5,10,20] [--consumer-ms 20]
       [--repeats 3] [--trace /tmp/pipeline_trace.json] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from harness import alternate, emit, machine_info

from pipelines import DeviceContext, PipelineConfig, PipelineMode, StagedPipeline, StageSpec


def sleeper(delay_s: float) -> Any:
    def fn(item: int) -> int:
        time.sleep(delay_s)
        return item

    return fn


def run_once(
    mode: PipelineMode, delays_s: list[float], consumer_s: float, steps: int, warmup: int, trace: str | None
) -> dict[str, Any]:
    stages = [StageSpec(name=f"stage{k}_{round(d * 1e3)}ms", fn=sleeper(d)) for k, d in enumerate(delays_s)]
    config = PipelineConfig(mode=mode, trace_batches=50)
    arrivals: list[float] = []
    with StagedPipeline(range(steps), stages, config=config, device=DeviceContext("cpu")) as pipe:
        for _ in pipe:
            arrivals.append(time.perf_counter())
            time.sleep(consumer_s)
    if trace:
        pipe.write_trace(trace)
    stats = pipe.stats()
    step_s = (arrivals[-1] - arrivals[warmup]) / (len(arrivals) - 1 - warmup)
    per_item = {name: s["busy_per_item_s"] for name, s in stats["stages"].items() if name != "source"}
    return {
        "mode": mode.value,
        "step_s": step_s,
        "slowest_stage_s": max(per_item.values()),
        "sum_stages_s": sum(per_item.values()),
        "bound_by": stats["bound_by"],
        "per_item_s": per_item,
        "stall_warning": pipe.stall_warning(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--delays-ms", default="5,10,20")
    parser.add_argument("--consumer-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", default=None, help="write the first pipelined run's Chrome trace here")
    parser.add_argument("--smoke", action="store_true", help="seconds: 12 steps, one repeat (a test run)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeats = 12, 2, 1
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps must exceed --warmup + 1, got {args.steps}")
    delays_s = [float(d) / 1e3 for d in args.delays_ms.split(",")]
    consumer_s = args.consumer_ms / 1e3

    emit(machine_info("torch"))

    def run(name: str, repeat: int) -> dict[str, Any]:
        mode = PipelineMode(name)
        trace = args.trace if repeat == 0 and mode is PipelineMode.PIPELINED else None
        result = run_once(mode, delays_s, consumer_s, args.steps, args.warmup, trace)
        emit(result, digits=6)
        return result

    # the modes alternate (harness.alternate) so drift in the machine's speed hits both alike
    runs = alternate([PipelineMode.PIPELINED.value, PipelineMode.SEQUENTIAL.value], args.repeats, run)

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    pipelined_step = median("pipelined", "step_s")
    sequential_step = median("sequential", "step_s")
    emit(
        {
            "step_vs_slowest_stage": pipelined_step / median("pipelined", "slowest_stage_s"),
            "sequential_step_vs_sum": sequential_step / median("sequential", "sum_stages_s"),
            "pipelined_vs_sequential": sequential_step / pipelined_step,
            "pipelined_step_ms": pipelined_step * 1e3,
            "sequential_step_ms": sequential_step * 1e3,
            "delays_ms": [*(d * 1e3 for d in delays_s), args.consumer_ms],
            "steps": args.steps,
            "repeats": args.repeats,
        }
    )


if __name__ == "__main__":
    main()
