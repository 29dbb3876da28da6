"""Serving bounded tables (issue 38 point 6): the bundle holds the rows the bounds kept and the default
rows, and every id without a row scores with exactly the training-time default row.

Two small runs, 30 steps with a checkpoint every 10, where cat_0 and cat_2 admit an id at its 2nd
occurrence and expire rows unused for 8 steps: one tiered, one in memory with ids folded modulo 5,000
(the default row is then id 5,000). The oracles: the trained model's own held-out logits
(:func:`recsys.serving.evaluate.evaluate_checkpoint`, which reads ids without a row as the default row),
the checkpoints' bounds state (which ids have a row) and the default rows read from the bundle's files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file, save_file

from embedding_store.init import init_rows
from recsys.errors import UserError
from recsys.serving import BundleError, load_bundle
from recsys.serving.export import ExportOptions, export_bundle
from recsys.serving.predict import predict
from tests.conftest import subprocess_env
from tests.recsys.serving.conftest import (
    bundle_digest,
    cli,
    held_out_batches,
    summary,
    tiered_rows,
    writable_copy,
)
from tests.recsys.serving.test_faults import _one_line, _rehash, _rewrite_rows
from tests.recsys.tiny import run_train, tiny_config

BOUNDED = ("cat_0", "cat_2")
FOLD = 5000  # the in-memory run's sparse.max_rows_per_table: its default rows are id 5000
RUNS = {
    "tiered": {"store": {"tables": list(BOUNDED)}},
    "memory": {"store": {"tiered": False, "tables": list(BOUNDED)}, "sparse": {"max_rows_per_table": FOLD}},
    # 2 ranks, row-wise: each rank owns (decides for) part of every table's ids, whose rows' union is kept.
    "tiered_2": {
        "store": {"tables": list(BOUNDED)},
        "train": {"nproc": 2},
        "sparse": {"sharding": "row_wise"},
    },
    "memory_2": {
        "store": {"tiered": False, "tables": list(BOUNDED)},
        "train": {"nproc": 2},
        "sparse": {"sharding": "row_wise", "max_rows_per_table": FOLD},
    },
}


def _config(kind: str) -> str:
    sections = {k: dict(v) for k, v in RUNS[kind].items()}
    sections["train"] = sections.get("train", {}) | {
        "steps": 30,
        "checkpoint_every": 10,
        "keep_checkpoints": 3,
    }
    sections["eval"] = {"every": 10}
    sections["pipeline"] = {"mode": "sequential"}
    sections["store.bounds"] = {"admit_after": 2, "admit_window_steps": 50, "expire_after_steps": 8}
    return tiny_config(**sections)


@pytest.fixture(scope="module")
def bounded_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``bounded_run(kind) -> (run, bundle of the final checkpoint)``, each trained and exported once."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"bounded_{kind}")
            (root / "config.toml").write_text(_config(kind))
            run_train(root / "config.toml", root / "run", env=subprocess_env())
            export_bundle(root / "run", root / "bundle")
            cache[kind] = (root / "run", root / "bundle")
        return cache[kind]

    return get


def _row_ids(checkpoint: Path, table: str) -> np.ndarray:
    """The ids that have a row at a checkpoint (its bounds state, all ranks)."""
    parts = [load_numpy(str(f)).get(f"{table}/row_ids") for f in checkpoint.glob("bounds_rank_*.safetensors")]
    return np.unique(np.concatenate([p for p in parts if p is not None]))


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _default_row(bundle: Path, feature: dict[str, Any], row_floats: int) -> torch.Tensor:
    """The default row as the bundle's files hold it (read here, not through the scorer)."""
    if feature["kind"] == "plain":
        tables = load_file(bundle / "tables.safetensors")
        ids = tables[f"{feature['table']}.ids"]
        assert int(ids[-1]) == feature["default_id"]
        return tables[f"{feature['table']}.weight"][-1]
    ids, weights, _ = tiered_rows(bundle, feature["table"], feature["dim"], row_floats)
    (at,) = torch.nonzero(ids == feature["default_id"])[:, 0].tolist()
    return weights[at]


def _model(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "model.json").read_text())


def _folded(kind: str, ids: np.ndarray) -> np.ndarray:
    return ids % FOLD if kind == "memory" else ids


@pytest.mark.parametrize(
    "kind",
    [
        "tiered",
        "memory",
        pytest.param("tiered_2", marks=pytest.mark.slow),
        pytest.param("memory_2", marks=pytest.mark.slow),
    ],
)
def test_the_bundle_holds_the_kept_rows_and_scores_as_training_evaluates(kind, bounded_run):
    """model.json names each bounded table's default row; the bundle holds the rows the bounds kept and
    it; the held-out split scored from the bundle equals the trained model's evaluation bit for bit,
    where many of its ids have no row (the default row serves them)."""
    from recsys.serving.evaluate import evaluate_checkpoint

    run, bundle = bounded_run(kind)
    model = _model(bundle)
    final = _checkpoint(run, 30)
    world = summary(run)["world_size"]
    in_memory = kind.startswith("memory")
    for f in model["features"]:
        if f["name"] not in BOUNDED:
            assert "default_id" not in f
            continue
        assert f["default_id"] == (FOLD if in_memory else 20000)
        kept = _row_ids(final, f["table"])
        owners = [load_numpy(str(p)).get(f"{f['table']}/row_ids") for p in final.glob("bounds_rank_*")]
        assert sum(o is not None and o.shape[0] > 0 for o in owners) == world  # every rank kept rows
        if in_memory:
            ids = load_file(bundle / "tables.safetensors")[f"{f['table']}.ids"].numpy()
        else:
            ids = tiered_rows(bundle, f["table"], f["dim"], model["row_floats"])[0].numpy()
        assert np.array_equal(ids, np.append(kept, f["default_id"])) and f["rows"] == ids.shape[0]
    scorer = load_bundle(bundle, cache_rows=64)  # a small cache: default rows are evicted and read again
    for rank, oracle in enumerate(evaluate_checkpoint(run, keep_logits=True)):
        assert oracle["auc"] == summary(run)["auc"]
        batches = held_out_batches(run, rank, world)
        logits = torch.cat([scorer.logits(b.dense, b.sparse) for b in batches])
        assert torch.equal(logits, oracle["logits"]), (rank, (logits - oracle["logits"]).abs().max())
    shares = {f: s.share for f, s in scorer.default_stats().items()}
    assert sorted(shares) == sorted(BOUNDED) and all(0.05 < s < 0.95 for s in shares.values()), shares


@pytest.mark.parametrize("kind", ["tiered", "memory"])
def test_a_bundle_with_optimizer_state_has_the_runs_digest(kind, bounded_run, tmp_path):
    """Exported with the optimizer state, the kept rows and the default rows are the whole trained state:
    an in-memory bounded table spread back to all its rows (the others at their initial value with zero
    state, as the trained table holds them) gives the run's model digest."""
    run, _ = bounded_run(kind)
    bundle = tmp_path / "full"
    export_bundle(run, bundle, options=ExportOptions(keep_optimizer_state=True, buffer_rows=50))
    bundle = writable_copy(bundle, tmp_path / "spread")
    model = _model(bundle)
    tables = load_file(bundle / "tables.safetensors")
    seed, scale = model["init"]["seed"], model["init"]["scale"]
    for f in model["features"]:
        if f["kind"] == "plain" and "default_id" in f:
            ids = tables.pop(f"{f['table']}.ids")
            everything = torch.arange(f["default_id"] + 1)
            weight = init_rows(everything, dim=f["dim"], seed=seed, table=f["table"], scale=scale)
            weight[ids] = tables[f"{f['table']}.weight"]
            state = torch.zeros(everything.shape[0])
            state[ids] = tables[f"{f['table']}.state"]
            tables[f"{f['table']}.weight"], tables[f"{f['table']}.state"] = weight, state
    save_file(tables, bundle / "tables.safetensors")
    assert bundle_digest(bundle) == summary(run)["model_digest"]


@pytest.mark.parametrize("kind", ["tiered", "memory"])
def test_ids_without_a_row_score_with_the_default_row(kind, bounded_run):
    """Ids the bundle has no row of score exactly as a hand computation with the default rows read from
    the bundle's files; for a tiered table that is not the ids' initial rows."""
    run, bundle = bounded_run(kind)
    model = _model(bundle)
    scorer = load_bundle(bundle)
    (batch,) = held_out_batches(run, 0, 1)[:1]
    sparse = {k: jt.values().numpy() for k, jt in batch.sparse.to_dict().items()}
    features = {f["name"]: f for f in model["features"]}
    pooled = torch.empty(batch.dense.shape[0], len(scorer.features), 8)
    for i, name in enumerate(scorer.features):
        f = features[name]
        if name in BOUNDED:
            kept = _row_ids(_checkpoint(run, 30), f["table"])
            unknown = np.setdiff1d(np.arange(30000, dtype=np.int64), kept)  # past 20000: tiered ids fold too
            if kind == "tiered":
                unknown = unknown[unknown < 20000]
            else:
                unknown = unknown[~np.isin(unknown % FOLD, kept)]
            sparse[name] = unknown[np.arange(batch.dense.shape[0]) * 37 % unknown.shape[0]]
            pooled[:, i] = _default_row(bundle, f, model["row_floats"])
        else:  # the unbounded tables' rows as the scorer reads them
            pooled[:, i] = scorer._pool(scorer._specs[name], sparse[name], np.ones_like(sparse[name]))
    logits = scorer.logits(batch.dense, sparse)
    assert torch.equal(logits, scorer._model(batch.dense, pooled).float())
    for name in BOUNDED:
        assert scorer.default_stats()[name].share == 1.0
    if kind == "tiered":
        f = features["cat_0"]
        seed, scale = scorer.bundle.init
        initial = init_rows(sparse["cat_0"][:4], dim=8, seed=seed, table=f["table"], scale=scale)
        assert not torch.equal(
            scorer._pool(scorer._specs["cat_0"], sparse["cat_0"][:4], np.ones(4, dtype=np.int64)), initial
        )


@pytest.mark.parametrize("kind", ["tiered", "memory"])
def test_an_expired_id_scores_with_the_default_row(kind, bounded_run, tmp_path):
    """Ids with a row at step 10 and none at step 30 (expired: no cap here) read their own row from the
    step-10 bundle and the default row from the final one."""
    run, bundle = bounded_run(kind)
    early = tmp_path / "early"
    export_bundle(run, early, checkpoint="10")
    model = _model(bundle)
    for f in model["features"]:
        if f["name"] not in BOUNDED:
            continue
        expired = np.setdiff1d(
            _row_ids(_checkpoint(run, 10), f["table"]), _row_ids(_checkpoint(run, 30), f["table"])
        )
        assert expired.shape[0] > 0
        ones = np.ones_like(expired)
        now, then = load_bundle(bundle), load_bundle(early)
        rows = now._pool(now._specs[f["name"]], expired, ones)
        assert torch.equal(rows, _default_row(bundle, f, model["row_floats"]).expand_as(rows))
        before = then._pool(then._specs[f["name"]], expired, ones)
        assert not (before == _default_row(early, f, model["row_floats"])).all(dim=1).any()


@pytest.mark.parametrize("kind", ["tiered", "memory"])
def test_predict_reports_the_share_of_default_lookups(kind, bounded_run, tmp_path):
    """The share predict reports is the share of held-out lookups whose id (folded, in memory) has no
    row in the final checkpoint's bounds state, counted here; whatever the cache's size."""
    run, bundle = bounded_run(kind)
    model = _model(bundle)
    batches = held_out_batches(run, 0, 1)
    expected = {}
    for f in model["features"]:
        if f["name"] in BOUNDED:
            ids = np.concatenate([b.sparse[f["name"]].values().numpy() for b in batches])
            kept = _row_ids(_checkpoint(run, 30), f["table"])
            expected[f["name"]] = (ids.shape[0], int((~np.isin(_folded(kind, ids), kept)).sum()))
    for cache_rows in (16, 1 << 16):
        report = predict(
            bundle, tmp_path / f"s{cache_rows}.csv", options={"cache_rows": cache_rows, "batch_size": 100}
        )
        got = {f: (d["lookups"], d["defaults"]) for f, d in report["defaults"].items()}
        assert got == expected
        assert all(d["share"] == expected[f][1] / expected[f][0] for f, d in report["defaults"].items())
    proc = cli("predict", "--bundle", str(bundle), "--out", str(tmp_path / "cli.csv"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shares = ", ".join(f"{f} {d / n:.3f}" for f, (n, d) in expected.items())
    assert f"; default row shares: {shares}" in proc.stdout


def _edit_model(bundle: Path, change) -> None:
    model = _model(bundle)
    change(model)
    (bundle / "model.json").write_text(json.dumps(model))
    _rehash(bundle, "model.json")


def _set_default(value: Any):
    def change(model: dict[str, Any]) -> None:
        next(f for f in model["features"] if f["name"] == "cat_0")["default_id"] = value

    return change


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        ("tiered", _set_default(20001), r"feature 'cat_0' names default row id 20001, outside \[0, 20001\)"),
        ("tiered", _set_default(-1), r"feature 'cat_0' names default row id -1, outside"),
        ("memory", _set_default(0), r"feature 'cat_0' names default row id 0, outside \[1, "),
        ("memory", _set_default("5000"), r"feature 'cat_0' names default row id '5000'"),
        ("tiered", _set_default(19999), r"bounded table t_cat_0 lacks its default row 19999"),
        (
            "memory",
            _set_default(4999),
            r"bounded table t_cat_0 in tables.safetensors: its last row is id 5000",
        ),
    ],
    ids=["past-the-ids", "negative", "zero-modulus", "not-a-number", "tiered-no-such-row", "plain-not-last"],
)
def test_a_bundle_naming_a_bad_default_row_is_refused_in_one_line(
    kind, change, message, bounded_run, tmp_path
):
    bundle = writable_copy(bounded_run(kind)[1], tmp_path / "bundle")
    _edit_model(bundle, change)
    with pytest.raises(BundleError, match=message) as err:
        load_bundle(bundle)
    assert "\n" not in str(err.value)
    line = _one_line(cli("predict", "--bundle", str(bundle), "--out", str(tmp_path / "s.csv")))
    assert line.startswith(f"recsys: error: bundle {bundle}")


def test_a_tiered_bounded_table_without_its_default_row_is_refused(bounded_run, tmp_path):
    bundle = writable_copy(bounded_run("tiered")[1], tmp_path / "bundle")
    default = (20000).to_bytes(8, "big")
    _rewrite_rows(bundle, lambda rows: [(k, v) for k, v in rows if k != default])

    def fewer(model: dict[str, Any]) -> None:  # the row count as the LMDB now holds it
        for f in model["features"]:
            if f["name"] in BOUNDED:
                f["rows"] -= 1

    _edit_model(bundle, fewer)
    with pytest.raises(
        BundleError, match=r"bounded table t_cat_0 lacks its default row 20000 in tiered/data.mdb"
    ):
        load_bundle(bundle)


@pytest.mark.parametrize(
    ("kind", "bounds", "message"),
    [
        ("tiered", None, r"has bounded tables but its meta.json does not record their default rows"),
        ("tiered", {"t_cat_0": 20001}, r"table t_cat_0's default row id 20001 is outside its 20001 ids"),
        ("memory", {"t_cat_0": 4999}, r"table t_cat_0 has 5001 rows, its default row's id is 4999"),
        ("memory", {"t_cat_0": 100}, r"table t_cat_0 has a row for id \d+, outside \[0, 100\)"),
        ("memory", {"t_cat_9": 5000}, r"meta.json bounds table t_cat_9, which the model lacks"),
        (
            "memory",
            {"t_cat_0": True},
            r"bounds must map table names to default row ids in \[1, 2\*\*63\), got \{'t_cat_0': True",
        ),
    ],
    ids=["unrecorded", "past-the-ids", "not-the-last-row", "below-a-row", "unknown-table", "not-an-id"],
)
def test_export_refuses_a_checkpoint_whose_bounds_do_not_fit(kind, bounds, message, bounded_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(bounded_run(kind)[0], run)
    meta_path = _checkpoint(run, 30) / "meta.json"
    meta = json.loads(meta_path.read_text())
    if bounds is None:
        del meta["bounds"]
    else:
        meta["bounds"].update(bounds)  # the recorded ones, one changed or added
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(UserError, match=message) as err:
        export_bundle(run, tmp_path / "bundle")
    assert "\n" not in str(err.value) and not (tmp_path / "bundle").exists()
