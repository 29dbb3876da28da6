"""Every program in ``benchmarks/`` runs with ``--smoke``: in a fresh process, at tiny sizes, through the same
code as a full run, and ends with its one JSON result line holding its headline keys.

The figures of a smoke run mean nothing (the sizes are too small to measure anything), so only the shape
of the result is checked (every headline key a finite number), plus what each program checks itself (exit 0: e.g. bench_scale's and bench_ssd's
rows read back equal to their oracles). The scratch folders go under pytest's ``tmp_path``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# program -> (the flag naming its scratch folder, or None; headline keys of its last line, dotted for nesting)
CASES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "bench_admission.py": ("--out", ("synthetic.1.rows", "synthetic.2.rows_ratio", "synthetic.2.auc_delta")),
    "bench_alternatives.py": (
        "--dir",
        (
            "fits_ram_vs_torchrec",
            "over_ram_vs_mmap_last_tenth",
            "over_ram_auc_vs_mmap",
            "over_ram_auc_vs_hashed_ram",
            "over_ram_disk_bytes_vs_mmap",
            "over_ram.mmap.major_faults",
            "over_ram.tierrec.disk_busy_fraction",
            "over_ram_auc_vs_hashed_ram_sized",
            "over_ram_vs_hashed_ram_sized_last_tenth",
            "hashed_ram_sized_shared_row_fraction",
            "hashed_ram_shared_row_fraction",
            "mmap_shared_row_fraction",
            *(f"over_ram_cpu_s_per_1k_samples.{arm}" for arm in ("tierrec", "hashed_ram_sized", "mmap")),
            "versus.tierrec_fp16.hashed_ram_sized.last_tenth",
            "versus.tierrec_admit2.mmap.disk_bytes",
            "over_ram.tierrec.samples_per_s_last_tenth_range.1",  # --smoke runs 2 alternating repeats
            "versus.tierrec.mmap.last_tenth_pairs.1",
        ),
    ),
    "bench_bounded.py": (
        "--dir",
        (
            "rows_ratio",
            "disk_bytes_ratio",
            "auc_delta",
            "last_tenth_speedup",
            "last_tenth_speedup_pairs.1",  # 2 alternating pairs by default
            "rows_growth_second_half_expire",
            "rows_growth_second_half_none",
            "cap_max_rows",
            "cap_log_bytes",
        ),
    ),
    "bench_checkpoint.py": ("--dir", ("snapshot_peak_anon_over_table", "reshard_peak_anon_over_table")),
    "bench_exchange.py": (
        "--dir",
        (
            "rows_bytes_ratio",
            "rows_clustered_bytes_ratio",
            "clustered_vs_arrival_bytes",
            "rows_speedup",
            "rows_clustered_speedup",
            "rows_step_time_ratio",
            "rows_clustered_step_time_ratio",
            *(
                f"{key}.{arm}"
                for key in ("bytes_per_sample", "step_time_ms", "cpu_s_per_1k_samples")
                for arm in ("pooled", "rows", "rows_clustered")
            ),
        ),
    ),
    "bench_pipeline.py": (
        "--dir",
        (
            "fits_cache_tiered_vs_untiered",
            "pipelined_vs_sequential",
            "ssd_bound_tiered_vs_untiered",
            "cold_tiered_vs_untiered",
            "step_vs_slowest_stage",
            "lookahead_hit_rate",
            "belady_hit_rate",
        ),
    ),
    "bench_pipeline_core.py": (
        None,
        ("step_vs_slowest_stage", "sequential_step_vs_sum", "pipelined_vs_sequential"),
    ),
    "bench_readers.py": ("--dir", ("ours_over_pyarrow", "ours_rows_per_s", "pyarrow_rows_per_s")),
    "bench_real_data.py": ("--out", ("all_pass", "configs.movielens-100k.median_auc")),
    "bench_recommend.py": ("--dir", ("recommend_pairs_per_s", "predict_pairs_per_s", "recommend_vs_predict")),
    "bench_scale.py": ("--dir", ("rows_in_lmdb", "peak_rss_gib", "writeback_rows_per_s", "rows_exact")),
    "bench_serving.py": (
        "--dir",
        ("b1024_cached_throughput_vs_torchrec", "b1_cache_10pct_p50_vs_torchrec", "export_seconds"),
    ),
    "bench_ssd.py": (
        "--dir",
        ("cold_read_vs_disk", "writeback_vs_append", "write_amplification", "btree_writeback_vs_append"),
    ),
    "bench_stage_cpu.py": ("--dir", ("fits_cache.ratio", "ssd_bound.ratio", "ssd_bound.stage_cpu_ns_per_id")),
    "bench_store.py": (
        "--dir",
        ("remap_vs_unique", "ssd_read_vs_lmdb", "writeback_vs_lmdb", "host_gather_vs_index_select"),
    ),
    "bench_tune.py": (None, ("tune_seconds", "lru_max_abs_error", "lookahead_max_abs_error")),
}
# The slowest, and the one that needs a data set in the user's cache: run by `make test-slow`.
SLOW = {"bench_real_data.py"}


def _lookup(record: dict, dotted: str) -> object:
    """``record``'s value at a dotted path; a part that is a number indexes a list."""
    value: object = record
    for part in dotted.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
            continue
        assert isinstance(value, dict) and part in value, f"no {dotted!r} in {sorted(record)}"
        value = value[part]
    return value


def test_every_benchmark_program_has_a_smoke_case():
    """A program added to benchmarks/ gets a case here (a case for a deleted one fails too)."""
    programs = {p.name for p in BENCHMARKS.glob("bench_*.py")}
    assert programs == set(CASES)


@pytest.mark.parametrize(
    "program",
    [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in sorted(CASES)],
)
def test_smoke_run_prints_its_result(program, tmp_path):
    flag, keys = CASES[program]
    if program == "bench_real_data.py":
        from tests.recsys.data.test_real_data import _fetched_or_skip

        _fetched_or_skip("movielens-100k")  # its smoke run trains on MovieLens-100k
    command = [sys.executable, str(BENCHMARKS / program), "--smoke"]
    if flag is not None:
        command += [flag, str(tmp_path / "scratch")]
    proc = subprocess.run(
        command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{program} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{program} printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict), lines[-1][:500]
    for key in keys:
        _require_number(key, _lookup(result, key))


def _require_number(key: str, value: object) -> None:
    """A headline is a finite number: a smoke run that prints None, NaN or a string for one has lost it."""
    assert isinstance(value, int | float) and not isinstance(value, bool), f"{key} = {value!r}: not a number"
    assert math.isfinite(value), f"{key} = {value!r}: not finite"


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), "1.0", True])
def test_a_headline_that_is_not_a_finite_number_fails(value):
    with pytest.raises(AssertionError, match="speedup"):
        _require_number("speedup", value)
    _require_number("speedup", 1.25)


def test_every_program_rates_a_tenth_as_total_samples_over_total_time():
    """harness.window_rate, the one definition of "the first/last tenth" (issue 51): windows of different
    lengths count by their steps, unlike a mean of the windows' rates."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from harness import first_tenth, last_tenth, window_rate
    finally:
        sys.path.remove(str(BENCHMARKS))
    # 10 steps at 100 steps/s, then 90 at 400: 100 steps in 0.1 + 0.225 s
    uneven = [{"step": 10, "samples_per_s": 100.0}, {"step": 100, "samples_per_s": 400.0}]
    assert window_rate(uneven, 0) == pytest.approx(100 / (10 / 100 + 90 / 400))  # 307.7, the mean is 250
    many = [{"step": 5 * (i + 1), "samples_per_s": float(i + 1)} for i in range(25)]
    assert first_tenth(25) == slice(0, 2) and last_tenth(25) == slice(23, 25)
    assert window_rate(many, 0, part=last_tenth(25)) == pytest.approx(10 / (5 / 24 + 5 / 25))
    assert window_rate(many, 0, part=first_tenth(1)) == pytest.approx(1.0)


def test_record_keeps_a_programs_last_line_with_its_commit(tmp_path):
    """benchmarks/record.py: the JSON line a program ends with, kept with the commit and the date."""
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "record.py"), "bench_pipeline_core.py", "--smoke"]
        + ["--results", str(results), "--allow-dirty"],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = results.glob("bench_pipeline_core_*.json")
    record = json.loads(path.read_text())
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    assert record["commit"].removesuffix("+dirty") == head.stdout.strip()
    assert record["argv"] == ["--smoke"] and record["exit_code"] == 0
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    assert record["result"] == json.loads(last)
    refused = subprocess.run(
        [sys.executable, str(BENCHMARKS / "record.py"), "no_such.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "not a benchmark program" in refused.stderr


def test_versus_of_two_recorded_runs_equals_one_run_holding_every_arm(tmp_path):
    """benchmarks/versus.py: a recorded run split in two (the mapped arm apart) gives back, for every arm
    against the mapped one, the figures the run printed itself; runs of different streams are refused."""
    (whole,) = (BENCHMARKS / "results").glob("bench_alternatives_20261207-052203_*.json")
    record = json.loads(whole.read_text())
    arms = record["result"]["over_ram"]
    part_a = record | {"result": {"over_ram": {k: v for k, v in arms.items() if k != "mmap"}}}
    part_b = record | {"result": {"over_ram": {"mmap": arms["mmap"]}}}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, part in zip(paths, (part_a, part_b), strict=True):
        path.write_text(json.dumps(part))
    run = [sys.executable, str(BENCHMARKS / "versus.py")]
    proc = subprocess.run(
        [*run, *map(str, paths)], env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    printed = record["result"]
    assert set(out["versus"]) == set(arms) - {"mmap"}
    for arm in out["versus"]:
        assert out["versus"][arm] == {"mmap": printed["versus"][arm]["mmap"]}
    for key in ("over_ram_vs_mmap_last_tenth", "over_ram_auc_vs_mmap", "over_ram_disk_bytes_vs_mmap"):
        assert out[key] == printed[key]
    assert "over_ram_vs_hashed_ram_sized_last_tenth" not in out  # A's arms are not compared with each other
    part_b["argv"] = [*record["argv"], "--steps", "100"]
    paths[1].write_text(json.dumps(part_b))
    refused = subprocess.run(
        [*run, *map(str, paths)], env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert (
        refused.returncode == 2 and "different streams" in refused.stderr and "[200, 100]" in refused.stderr
    )
