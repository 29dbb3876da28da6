"""metrics.jsonl and summary.json are strict JSON, and rewind_metrics cuts metrics.jsonl back on resume.

Oracle for "strict": ``json.loads`` with ``parse_constant`` raising, which rejects the ``NaN`` /
``Infinity`` / ``-Infinity`` tokens Python's json writes by default (as jq and JavaScript do).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from recsys import metrics
from recsys.metrics import MetricsLog, auc_logloss, rewind_metrics, to_json, write_json


def strict_loads(text: str):
    def refuse(token: str):
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(text, parse_constant=refuse)


NAN, INF = float("nan"), float("inf")


def test_strict_loads_refuses_what_default_json_writes():
    with pytest.raises(ValueError, match="not strict JSON: NaN"):
        strict_loads(json.dumps({"x": NAN}))


def test_summary_with_nonfinite_values_nested_and_numpy_torch_scalars(tmp_path):
    summary = {
        "auc": NAN,
        "samples_per_s": math.nan,
        "rate": INF,
        "low": -INF,
        "ok": 0.5,
        "steps": 3,
        "resumed": False,
        "none": None,
        "tiers": {
            "t_user": {"device_hit_rate": np.float64("nan"), "rows": np.int64(7), "f32": np.float32(0.25)}
        },
        "curve": [1.0, NAN, np.float32("inf"), [NAN, 2]],
        "pair": (INF, "a"),
        "tensor": torch.tensor(float("nan")),
        "vector": torch.tensor([1.0, float("inf")]),
        "array": np.array([[np.nan, 1.0]]),
        "by_rank": {np.int64(0): NAN},
    }
    path = tmp_path / "summary.json"
    write_json(path, summary)
    doc = strict_loads(path.read_text())
    assert doc == {
        "auc": None,
        "samples_per_s": None,
        "rate": None,
        "low": None,
        "ok": 0.5,
        "steps": 3,
        "resumed": False,
        "none": None,
        "tiers": {"t_user": {"device_hit_rate": None, "rows": 7, "f32": 0.25}},
        "curve": [1.0, None, None, [None, 2]],
        "pair": [None, "a"],
        "tensor": None,
        "vector": [1.0, None],
        "array": [[None, 1.0]],
        "by_rank": {"0": None},
    }
    assert type(doc["tiers"]["t_user"]["rows"]) is int and doc["resumed"] is False
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed over summary.json


def test_auc_of_constant_labels_is_written_as_null(tmp_path):
    auc, logloss = auc_logloss(torch.tensor([0.1, -0.2, 0.3]), torch.tensor([1.0, 1.0, 1.0]))
    assert math.isnan(auc)
    write_json(tmp_path / "summary.json", {"auc": auc, "logloss": logloss})
    doc = strict_loads((tmp_path / "summary.json").read_text())
    assert doc["auc"] is None and doc["logloss"] == pytest.approx(logloss)


def test_metrics_log_lines_are_strict(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    log.write(kind="train", step=1, loss=NAN, samples_per_s=INF)
    log.write(kind="eval", step=2, auc=np.float32("nan"), logloss=torch.tensor(0.5).item())
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [strict_loads(line) for line in lines]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("eval", 2)]
    assert records[0]["loss"] is None and records[0]["samples_per_s"] is None
    assert records[1]["auc"] is None and records[1]["logloss"] == 0.5


def test_a_float_that_escapes_the_cleaning_raises_instead_of_writing_nan(monkeypatch):
    monkeypatch.setattr(metrics, "json_safe", lambda obj: obj)  # a regression in the cleaning
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        to_json({"loss": NAN})


def test_unknown_types_still_raise():
    with pytest.raises(TypeError):
        to_json({"x": object()})


# -- rewind_metrics -----------------------------------------------------------------------------------


def _write_lines(path, lines: list[str], torn: str = "") -> None:
    path.write_text("".join(line + "\n" for line in lines) + torn)


RECORDS = [
    '{"time_s": 0.1, "kind": "train", "step": 10, "loss": 0.7}',
    '{"time_s": 0.2, "kind": "train", "step": 20, "loss": NaN}',  # written before strict JSON
    '{"time_s": 0.3, "kind": "note", "text": "no step"}',
    '{"time_s": 0.4, "kind": "eval", "step": 20, "auc": 0.6}',
    '{"time_s": 0.5, "kind": "train", "step": 30, "loss": 0.5}',
    '{"time_s": 0.6, "kind": "note", "text": "after 30, no step"}',
    '{"time_s": 0.7, "kind": "train", "step": 40, "loss": 0.4}',
]


def _records(path):
    return [strict_loads(line) for line in path.read_text().splitlines()]


def test_rewind_keeps_steps_up_to_k_and_records_without_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, RECORDS)
    rewind_metrics(path, 20)
    got = _records(path)
    assert [(r["kind"], r.get("step")) for r in got] == [
        ("train", 10),
        ("train", 20),
        ("note", None),
        ("eval", 20),
        ("note", None),
    ]
    assert got[1]["loss"] is None  # the old NaN token is rewritten as null
    assert path.read_text().endswith("\n")
    assert not list(tmp_path.glob(".*.tmp"))


def test_rewind_drops_a_torn_last_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, RECORDS[:2], torn='{"time_s": 0.9, "kind": "train", "st')
    rewind_metrics(path, 100)
    assert [r["step"] for r in _records(path)] == [10, 20]
    assert "dropped 1 unreadable line(s)" in caplog.text
    # A torn line that happens to be valid JSON is still a line without its newline: dropped.
    _write_lines(path, RECORDS[:1], torn='{"step": 11}')
    rewind_metrics(path, 100)
    assert [r["step"] for r in _records(path)] == [10]


def test_rewind_then_append_gives_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, RECORDS, torn='{"kind": "tra')
    rewind_metrics(path, 30)
    MetricsLog(path, enabled=True).write(kind="train", step=31, loss=0.3)
    assert [r.get("step") for r in _records(path)] == [10, 20, None, 20, 30, None, 31]


def test_rewind_to_before_every_step_and_of_an_empty_or_missing_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, RECORDS)
    rewind_metrics(path, 0)
    assert [r["text"] for r in _records(path)] == ["no step", "after 30, no step"]
    path.write_text("")
    rewind_metrics(path, 5)
    assert path.read_text() == ""
    missing = tmp_path / "absent.jsonl"
    rewind_metrics(missing, 5)
    assert not missing.exists() and not list(tmp_path.glob(".*"))


def test_rewind_is_atomic_when_the_rename_fails(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, RECORDS)
    before = path.read_bytes()
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(metrics.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))

    def fail(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(metrics.os, "replace", fail)
    with pytest.raises(OSError, match="disk gone"):
        rewind_metrics(path, 10)
    assert path.read_bytes() == before  # never half-written
    assert synced  # the temporary file was synced before the rename was attempted
