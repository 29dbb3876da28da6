"""`recsys tune-cache` end to end: outputs, errors, and predicted hit rates against a training run's."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from recsys.capacities import Capacities
from recsys.cli import main
from recsys.config import ConfigError, load_config
from recsys.store_config import parse_size

# Three tiered tables of different id spaces: an even split of the budgets is far from the best one.
CONFIG = """
[synthetic]
num_sparse = 3
id_spaces = [600, 6000, 60000]
eval_samples = 2048

[model]
embedding_dim = 8
dense_arch = [16, 8]
over_arch = [16]

[store]
tiered = true

[train]
steps = 160
batch_size = 512
nproc = {nproc}
log_every = 40
threads_per_rank = 1

[eval]
every = {every}
batch_size = 512
"""
DEVICE, HOST = "160KiB", "200KiB"
TOLERANCE = 0.02


def write_config(tmp_path: Path, *, nproc: int = 1, every: int = 0, extra: str = "") -> Path:
    path = tmp_path / "tune.toml"
    path.write_text(CONFIG.format(nproc=nproc, every=every) + extra)
    return path


def test_sizes_and_capacity_errors(tmp_path):
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512k") == 512 << 10
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError, match="'12 parsecs'"):
        parse_size("12 parsecs")
    with pytest.raises(ConfigError, match=r"store\.capacity\.cat_0\] device: .*'64XB'"):
        load_config(write_config(tmp_path), ['store.capacity={cat_0={device="64XB"}}'])
    with pytest.raises(ConfigError, match=r"unknown config key 'store\.capacity\.cat_0\.rows'"):
        load_config(write_config(tmp_path), ["store.capacity={cat_0={rows=5}}"])
    cfg = load_config(
        write_config(tmp_path), ['store.capacity={cat_0={device=100, host="3600B"}, cat_2={device="36KiB"}}']
    )
    caps = Capacities.resolve(cfg.store, ["cat_0", "cat_1", "cat_2"], row_bytes=36)
    assert {f: caps.of(f) for f in caps.device_rows} == {
        "cat_0": (100, 100),
        "cat_1": (16_384, 65_536),
        "cat_2": (1024, 65_536),
    }


def test_capacities_from_a_missing_file_is_a_user_error(tmp_path, repo_root, capsys):
    code = main(
        [
            "train",
            "--config",
            str(write_config(tmp_path)),
            "--out",
            str(tmp_path / "run"),
            "--set",
            f"store.capacities_from={json.dumps(str(tmp_path / 'nope.json'))}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "store.capacities_from: file not found" in err and len(err.splitlines()) == 1


def test_budget_below_the_working_set_exits_2_with_the_minimum(tmp_path, capsys):
    code = main(
        [
            "tune-cache",
            "--config",
            str(write_config(tmp_path)),
            "--device-budget",
            "4KiB",
            "--host-budget",
            "1MiB",
            "--batches",
            "20",
            "--out",
            str(tmp_path / "tune"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "cannot hold the batches in flight" in err and "need at least" in err


def _tune(config: Path, out: Path, capsys, *flags: str) -> dict:
    code = main(
        [
            "tune-cache",
            "--config",
            str(config),
            "--device-budget",
            DEVICE,
            "--host-budget",
            HOST,
            "--out",
            str(out),
            *flags,
        ]
    )
    assert code == 0, capsys.readouterr().err
    return json.loads((out / "tune.json").read_text())


def apply_line(printed: str) -> tuple[Path, list[str]]:
    """The config and the ``--set`` overrides of the ``apply:`` line tune-cache printed, as a shell reads it."""
    (line,) = [x for x in printed.splitlines() if x.startswith("apply: ")]
    words = shlex.split(line.removeprefix("apply: "))
    assert words[:3] == ["recsys", "train", "--config"], words
    sets = words[4:]
    assert sets[::2] == ["--set"] * (len(sets) // 2) and len(sets) % 2 == 0, words
    return Path(words[3]), sets[1::2]


def ran_with(summary: dict) -> dict[str, tuple[int, int]]:
    """{table: (device_rows, host_rows)} that ``summary.json`` records each tiered table ran with."""
    return {n: (c["device_rows"], c["host_rows"]) for n, c in summary["capacities"].items()}


def tuned_rows(doc: dict) -> dict[str, tuple[int, int]]:
    return {n: (t["device_rows"], t["host_rows"]) for n, t in doc["tables"].items()}


def _train(python, cli_env, repo_root, config: Path, out: Path, *overrides: str) -> dict:
    args = [python, "-m", "recsys", "train", "--config", str(config), "--out", str(out)]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, cwd=repo_root, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def _check_prediction(doc: dict, summary: dict) -> None:
    for name, t in doc["tables"].items():
        measured = summary["tiers"][name]
        assert measured["predicted_device_hit_rate"] == t["predicted_device_hit_rate"]
        assert abs(measured["device_hit_rate"] - t["predicted_device_hit_rate"]) <= TOLERANCE, (
            name,
            measured,
        )
        assert abs(measured["host_hit_rate"] - t["predicted_host_hit_rate"]) <= TOLERANCE, (name, measured)


# A [store.capacity] section the tune's capacities must win over (cat_1: a size, rows of 36 bytes).
SECTION = '\n[store.capacity]\ncat_0 = { device = 700, host = 0 }\ncat_1 = { device = "36KiB" }\n'


def test_tuned_one_rank_run_measures_the_predicted_hit_rates(tmp_path, python, cli_env, repo_root, capsys):
    # evaluations pass through the caches mid-run; the config sizes two tables in [store.capacity]
    config = write_config(tmp_path, every=60, extra=SECTION)
    capsys.readouterr()
    doc = _tune(config, tmp_path / "tune", capsys)
    applied_config, overrides = apply_line(capsys.readouterr().out)
    # The printed line, applied to the config, gives every table the tune's capacities.
    cfg = load_config(applied_config, overrides)
    assert cfg.store.capacity  # the section is still there: capacities_from wins over it
    caps = Capacities.resolve(
        cfg.store, ["cat_0", "cat_1", "cat_2"], row_bytes=doc["tables"]["t_cat_0"]["row_bytes"]
    )
    assert {f"t_{f}": caps.of(f) for f in caps.device_rows} == tuned_rows(doc)
    assert tuned_rows(doc)["t_cat_0"] != (700, 0)  # else the test could not tell the two apart
    for name in ("tune.json", "tune.md"):
        assert (tmp_path / "tune" / name).exists()
    assert "[store.capacity]" in doc["snippet"]
    tables = doc["tables"]
    assert set(tables) == {"t_cat_0", "t_cat_1", "t_cat_2"}
    for t in tables.values():
        assert t["device_rows"] >= t["min_device_rows"]
        assert {"predicted_device_hit_rate", "predicted_host_hit_rate", "ssd_rows_per_step"} <= set(t)
    assert doc["device_bytes"] <= parse_size(DEVICE) and doc["host_bytes"] <= parse_size(HOST)
    # The recommendation beats an even split of the same budgets.
    equal = doc["equal_split"]
    assert doc["total"]["predicted_device_hit_rate"] > equal["predicted_device_hit_rate"]
    assert doc["total"]["ssd_rows_per_step"] < equal["ssd_rows_per_step"]
    summary = _train(python, cli_env, repo_root, applied_config, tmp_path / "run", *overrides)
    assert ran_with(summary) == tuned_rows(doc)
    assert {c["from"] for c in summary["capacities"].values()} == {"store.capacities_from"}
    assert summary["capacities_differ_from_tune"] == {}
    assert not any("predicted its hit rates for" in w for w in summary["warnings"])
    _check_prediction(doc, summary)


def test_a_tune_for_other_owners_is_warned_about(tmp_path, python, cli_env, repo_root, capsys):
    """Tuned for 1 rank, trained row-wise on 2 (the tune's apply: line left out): each table runs with
    the tune's rows on two owners instead of one, and the run says so at its start and in summary.json."""
    config = write_config(tmp_path, extra=SECTION)
    capsys.readouterr()
    doc = _tune(config, tmp_path / "tune", capsys, "--batches", "40", "--set", "sparse.sharding=row_wise")
    _, overrides = apply_line(capsys.readouterr().out)
    assert overrides[0] == "sparse.sharding=row_wise" and overrides[-1].startswith("store.capacities_from=")
    args = [python, "-m", "recsys", "train", "--config", str(config), "--out", str(tmp_path / "run")]
    args += ["--nproc", "2", "--set", "train.steps=40", *(w for o in overrides for w in ("--set", o))]
    proc = subprocess.run(args, cwd=repo_root, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert ran_with(summary) == tuned_rows(doc)  # the same rows per owner, on two owners instead of one
    differ = summary["capacities_differ_from_tune"]
    assert set(differ) == set(doc["tables"])
    for name, d in differ.items():
        assert d["ran"]["owners"] == 2 and d["tune"]["owners"] == 1, (name, d)
    warned = [w for w in summary["warnings"] if "predicted its hit rates for" in w]
    assert len(warned) == len(doc["tables"])
    assert proc.stderr.count("predicted its hit rates for") == 2 * len(doc["tables"])  # at start and end


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_tuned_two_rank_run_measures_the_predicted_hit_rates(
    tmp_path, python, cli_env, repo_root, capsys, sharding
):
    config = write_config(tmp_path, nproc=2, extra=f'\n[sparse]\nsharding = "{sharding}"\n')
    doc = _tune(config, tmp_path / "tune", capsys)
    assert doc["world_size"] == 2 and doc["sharding"] == sharding
    tuned = json.dumps(str(tmp_path / "tune" / "tune.json"))
    summary = _train(python, cli_env, repo_root, config, tmp_path / "run", f"store.capacities_from={tuned}")
    _check_prediction(doc, summary)
    # Measured, too, the recommendation beats an even split of the same budgets.
    equal = doc["equal_split"]
    caps = ", ".join(
        f"{t['feature']}={{device={equal['device_rows'][n]}, host={equal['host_rows'][n]}}}"
        for n, t in doc["tables"].items()
    )
    even = _train(python, cli_env, repo_root, config, tmp_path / "even", f"store.capacity={{{caps}}}")

    def total(summary: dict) -> float:  # over the training batches, all tables
        tiers = [summary["tiers"][n] for n in doc["tables"]]
        hits = sum(t["device_hit_rate"] * t["device_requests"] for t in tiers)
        return hits / sum(t["device_requests"] for t in tiers)

    assert total(summary) > total(even)
