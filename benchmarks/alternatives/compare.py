"""bench_alternatives' summaries: an arm's repeats as one record, and one arm against another."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["MEDIAN_KEYS", "headline_keys", "median_record", "versus"]

# The figures of an arm's record that are reported as the median of its repeats, with their range.
MEDIAN_KEYS = (
    "samples_per_s",
    "samples_per_s_first_tenth",
    "samples_per_s_last_tenth",
    "auc",
    "logloss",
    "disk_bytes",
    "cpu_s_per_1k_samples",
    "cores_used",
    "major_faults",
    "peak_rss_gib",
)


def median_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm's repeats as one record: the last repeat's, with each of ``MEDIAN_KEYS`` replaced by the
    median over the repeats and ``<key>_range`` [min, max] beside it; ``repeats`` holds every record."""
    out = dict(records[-1])
    for key in MEDIAN_KEYS:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
            out[f"{key}_range"] = [min(values), max(values)]
    out["repeats"] = records
    return out


def versus(candidate: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """One arm against another, from their median records: last-tenth samples/s ratio, AUC difference,
    ratios of bytes written to the disk and of CPU seconds per sample (None where a figure is missing or a
    divisor is 0); with repeats, ``last_tenth_pairs``: the ratio of each repeat's two runs."""

    def ratio(a: Any, b: Any) -> float | None:
        return a / b if a is not None and b else None

    auc_a, auc_b = candidate.get("auc"), baseline.get("auc")
    out: dict[str, Any] = {
        "last_tenth": ratio(
            candidate.get("samples_per_s_last_tenth"), baseline.get("samples_per_s_last_tenth")
        ),
        "auc": auc_a - auc_b if auc_a is not None and auc_b is not None else None,
        "disk_bytes": ratio(candidate.get("disk_bytes"), baseline.get("disk_bytes")),
        "cpu_per_sample": ratio(candidate.get("cpu_s_per_1k_samples"), baseline.get("cpu_s_per_1k_samples")),
    }
    pairs = zip(candidate.get("repeats", []), baseline.get("repeats", []), strict=False)
    ratios = [ratio(a["samples_per_s_last_tenth"], b["samples_per_s_last_tenth"]) for a, b in pairs]
    if len(ratios) > 1 and None not in ratios:
        out["last_tenth_pairs"] = ratios
    return out


def headline_keys(of_tierrec: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The flat keys of tierrec's ``versus`` records against each other arm: ``over_ram_vs_<arm>_last_tenth``
    and ``over_ram_<figure>_vs_<arm>`` for the AUC difference and the bytes and CPU ratios."""
    out: dict[str, Any] = {}
    for other, ratios in of_tierrec.items():
        for key, value in ratios.items():
            if key == "last_tenth":
                out[f"over_ram_vs_{other}_last_tenth"] = value
            elif key != "last_tenth_pairs":
                out[f"over_ram_{key}_vs_{other}"] = value
    return out
