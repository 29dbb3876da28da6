"""The arms' repeats of ``bench_exchange.py`` summarised and set against each other (its docstring defines
every key): bytes per sample (the same in every repeat, or the program stops), step time, CPU per sample."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from harness import paired_ratios

ARMS = ("pooled", "rows", "rows_clustered")
CANDIDATES = ("rows", "rows_clustered")
Records = Sequence[Mapping[str, Any]]


def same_bytes(name: str, runs: Records) -> float:
    """The arm's bytes per sample: a function of the stream and the arm alone, so every repeat must give
    the same; the program stops when one does not."""
    values = [r["bytes_per_sample"] for r in runs]
    if len(set(values)) != 1:
        raise SystemExit(f"bench_exchange: {name}'s bytes per sample differ over the repeats: {values}")
    return values[0]


def cpu_per_1k(full: Mapping[str, Any], startup_cpu_s: float, startup_samples: int) -> float:
    """CPU seconds per 1,000 trained samples of one run, start-up left out: its CPU less the median CPU of
    its arm's short runs, over the samples of the steps between them."""
    return 1e3 * (full["cpu_s"] - startup_cpu_s) / (full["samples"] - startup_samples)


def median_range(values: Sequence[float]) -> tuple[float, list[float]]:
    return statistics.median(values), [min(values), max(values)]


def arm_figures(name: str, full: Records, short: Records) -> dict[str, Any]:
    """One arm's figures over its repeats (``full``) and its short runs (``short``)."""
    startup_cpu_s = statistics.median(r["cpu_s"] for r in short)
    startup_samples = short[0]["samples"]
    cpu = [cpu_per_1k(r, startup_cpu_s, startup_samples) for r in full]
    return {
        "bytes_per_sample": same_bytes(name, full),
        "exchange": full[0]["exchange"],
        "step_time_ms": [r["step_time_ms"] for r in full],
        "cpu_s_per_1k_samples": cpu,
        "cpu_s_per_1k_samples_with_startup": [1e3 * r["cpu_s"] / r["samples"] for r in full],
        "startup_cpu_s": startup_cpu_s,
        "digests": sorted({r["model_digest"] for r in full}),
    }


def ratio(a: float, b: float) -> float | None:
    """``a / b`` (None where ``b`` is 0)."""
    return a / b if b else None


def compare(prefix: str, runs: Mapping[str, Records], short: Mapping[str, Records]) -> dict[str, Any]:
    """The keys of one mode (``prefix`` "" for the local ranks, "two_node_" for torchrun's nodes)."""
    arms = {arm: arm_figures(prefix + arm, runs[prefix + arm], short[prefix + arm]) for arm in ARMS}
    out: dict[str, Any] = {}
    pooled = arms["pooled"]
    for cand in CANDIDATES:
        out[f"{prefix}{cand}_bytes_ratio"] = ratio(arms[cand]["bytes_per_sample"], pooled["bytes_per_sample"])
    out[f"{prefix}clustered_vs_arrival_bytes"] = ratio(
        arms["rows_clustered"]["bytes_per_sample"], arms["rows"]["bytes_per_sample"]
    )
    for cand in CANDIDATES:  # pooled's step time over the candidate's, per repeat: higher is better
        speed = paired_ratios(pooled["step_time_ms"], arms[cand]["step_time_ms"])
        out[f"{prefix}{cand}_speedup"] = speed["median"]
        out[f"{prefix}{cand}_speedup_pairs"] = speed["ratios"]
        out[f"{prefix}{cand}_speedup_range"] = [min(speed["ratios"]), max(speed["ratios"])]
        time_ratio = paired_ratios(arms[cand]["step_time_ms"], pooled["step_time_ms"])
        out[f"{prefix}{cand}_step_time_ratio"] = time_ratio["median"]
        out[f"{prefix}{cand}_step_time_ratio_range"] = [min(time_ratio["ratios"]), max(time_ratio["ratios"])]
    for key in ("bytes_per_sample", "startup_cpu_s", "exchange", "digests"):
        out[prefix + key] = {arm: f[key] for arm, f in arms.items()}
    for key in ("step_time_ms", "cpu_s_per_1k_samples", "cpu_s_per_1k_samples_with_startup"):
        spread = {arm: median_range(f[key]) for arm, f in arms.items()}
        out[prefix + key] = {arm: m for arm, (m, _) in spread.items()}
        out[f"{prefix}{key}_range"] = {arm: r for arm, (_, r) in spread.items()}
        out[f"{prefix}{key}_repeats"] = {arm: f[key] for arm, f in arms.items()}
    return out


def two_node_checks(result: Mapping[str, Any]) -> dict[str, Any]:
    """The torchrun nodes against the local ranks: the same model (``model_digest``, every repeat) and the
    same bytes per sample, per arm; ``two_node_digest_equal`` is the rows arm's."""
    local, nodes = result["digests"], result["two_node_digests"]
    digests = {arm: len(local[arm]) == 1 and local[arm] == nodes[arm] for arm in ARMS}
    local_bytes, node_bytes = result["bytes_per_sample"], result["two_node_bytes_per_sample"]
    return {
        "two_node_digest_equal": digests["rows"],
        "two_node_digest_equal_by_arm": digests,
        "two_node_bytes_equal": all(local_bytes[arm] == node_bytes[arm] for arm in ARMS),
    }
