"""``recsys export`` writes every row of the checkpoint, merged from all ranks, into one bundle.

The oracle is the training run's model digest: a bundle exported with the optimizer state holds the
whole trained state, so the digest computed from the bundle alone must equal ``summary.json``'s.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from recsys.errors import UserError
from recsys.serving.export import ExportOptions, export_bundle
from tests.recsys.serving.conftest import EVERY_RUN, STEPS, bundle_digest, cli, summary, tiered_rows


@pytest.mark.parametrize("name", EVERY_RUN)
def test_a_bundle_with_optimizer_state_has_the_runs_digest(name, trained, exported):
    bundle = exported(name, keep_optimizer_state=True, buffer_rows=300)
    assert bundle_digest(bundle) == summary(trained(name))["model_digest"]


@pytest.mark.parametrize("name", ["table_wise_2", "row_wise_2"])
def test_weights_only_bundles_hold_the_same_weights(name, exported):
    full, lean = exported(name, keep_optimizer_state=True, buffer_rows=300), exported(name)
    model = json.loads((lean / "model.json").read_text())
    assert model["row_floats"] == 8 and not model["optimizer"]["kept"]
    assert json.loads((full / "model.json").read_text())["row_floats"] == 9  # + row-wise Adagrad's one float
    for f in model["features"]:
        if f["kind"] == "tiered":
            ids, weights, state = tiered_rows(lean, f["table"], 8, 8)
            full_ids, full_weights, _ = tiered_rows(full, f["table"], 8, 9)
            assert state is None and torch.equal(ids, full_ids) and torch.equal(weights, full_weights)
            assert bool((ids[1:] > ids[:-1]).all()) and ids.shape[0] == f["rows"]  # ascending, as counted
        else:
            lean_tables, full_tables = (
                load_file(lean / "tables.safetensors"),
                load_file(full / "tables.safetensors"),
            )
            assert f"{f['table']}.state" not in lean_tables and f"{f['table']}.state" in full_tables
            assert torch.equal(lean_tables[f"{f['table']}.weight"], full_tables[f"{f['table']}.weight"])
    assert {f["kind"] for f in model["features"]} == {"plain", "tiered"}


def test_the_buffer_size_does_not_change_the_bundle(trained, tmp_path):
    run = trained("row_wise_2")
    small = export_bundle(run, tmp_path / "small", options=ExportOptions(buffer_rows=7))
    large = export_bundle(run, tmp_path / "large", options=ExportOptions(buffer_rows=1 << 20))
    assert small["tables"] == large["tables"]
    # each table's bytes in the report: its rows as stored (plain: the safetensors tensor of float32
    # weights; tiered: the LMDB values of row_floats words)
    model = json.loads((tmp_path / "small" / "model.json").read_text())
    tensors = load_file(tmp_path / "small" / "tables.safetensors")
    for f in model["features"]:
        expected = (
            tensors[f"{f['table']}.weight"].numel() * 4
            if f["kind"] == "plain"
            else f["rows"] * model["row_floats"] * 4
        )
        assert small["tables"][f["table"]]["bytes"] == expected > 0
    for name in ("dense.safetensors", "tables.safetensors"):
        assert (tmp_path / "small" / name).read_bytes() == (tmp_path / "large" / name).read_bytes()
    model = json.loads((tmp_path / "small" / "model.json").read_text())
    for f in model["features"]:
        if f["kind"] == "tiered":
            a = tiered_rows(tmp_path / "small", f["table"], 8, 8)
            b = tiered_rows(tmp_path / "large", f["table"], 8, 8)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_tiered_lmdb_is_compact(exported):
    """Appended in id order, the rows fill LMDB's pages: the file is close to its keys and values."""
    bundle = exported("table_wise_2")
    model = json.loads((bundle / "model.json").read_text())
    rows = sum(f["rows"] for f in model["features"] if f["kind"] == "tiered")
    payload = rows * (8 + 4 * model["row_floats"] + 8 + 2)  # key, value, node header, page pointer
    size = (bundle / "tiered" / "data.mdb").stat().st_size
    assert size < 1.25 * payload + 16 * 4096, (size, payload)


def test_export_cli(trained, tmp_path):
    run = trained("table_wise_2")
    args = [
        "export",
        "--run",
        str(run),
        "--checkpoint",
        "10",
        "--out",
        str(tmp_path / "b"),
    ]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported step 10" in proc.stdout and "t_cat_0" in proc.stdout
    model = json.loads((tmp_path / "b" / "model.json").read_text())
    assert model["source"]["step"] == 10 and model["source"]["model_digest"] is None  # not the final step
    again = cli(*args)
    assert again.returncode == 2 and "exists" in again.stderr and again.stderr.strip().count("\n") == 0


def test_export_refuses_a_run_without_checkpoints(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match="no complete checkpoint"):
        export_bundle(tmp_path / "run", tmp_path / "b")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.tmp*"))


def test_final_step_bundle_records_the_digest(trained, exported):
    model = json.loads((exported("dcn_1") / "model.json").read_text())
    assert model["source"]["step"] == STEPS
    assert model["source"]["model_digest"] == summary(trained("dcn_1"))["model_digest"]
    assert model["model"]["name"] == "dcn" and model["num_dense"] == 13
    # The model's interaction order, not the checkpoint's sorted keys (cat_0, cat_1, cat_10, cat_11, cat_2, …).
    names = [f"cat_{i}" for i in range(12)]
    assert model["interaction_order"] == names != sorted(names)
    assert [f["name"] for f in model["features"]] == names


@pytest.mark.parametrize("final", [True, False])
def test_checkpoint_every_zero_checkpoints_only_at_the_end(tmp_path, final):
    """``checkpoint_every = 0`` means "only at the end" (exportable); ``final_checkpoint = false`` writes
    none, and export says why."""
    from tests.conftest import subprocess_env
    from tests.recsys.tiny import run_train, tiny_config

    config = tmp_path / "c.toml"
    config.write_text(tiny_config(train={"steps": 6, "checkpoint_every": 0, "final_checkpoint": final}))
    run_train(config, tmp_path / "run", env=subprocess_env())
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    if final:
        assert steps == ["step_00000006"]
        report = export_bundle(tmp_path / "run", tmp_path / "b")
        assert report["step"] == 6
    else:
        assert steps == []
        with pytest.raises(UserError, match="train.final_checkpoint = false"):
            export_bundle(tmp_path / "run", tmp_path / "b")


def test_float32_weights_become_float16_only_when_exact():
    """An fp16 table trained with stochastic rounding is checkpointed as float32 holding float16 values:
    the bundle's F16 copy is exact, and a value that is not a float16 number is refused, never rounded."""
    import numpy as np

    from recsys.serving.export import _in_precision

    halves = np.array([[0.5, -0.0009765625, 65504.0], [2.0**-24, 0.0, -3.0]], dtype=np.float32)
    out = list(_in_precision(lambda: iter([halves]), np.float16, "table t_x")())
    assert out[0].dtype == np.float16 and np.array_equal(out[0].astype(np.float32), halves)
    off = halves.copy()
    off[1, 2] = np.float32(1.0) + np.float32(2.0**-20)  # between two float16 numbers
    with pytest.raises(UserError, match="table t_x holds values that are not float16 numbers"):
        list(_in_precision(lambda: iter([off]), np.float16, "table t_x")())
