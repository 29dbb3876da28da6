"""Fixtures of the serving tests: small trained runs (once per session), their bundles and oracles.

Each run trains a tiny synthetic model for 20 steps with a checkpoint every 10 steps (the trainer also
writes one at the end); two of its four tables are tiered and two are plain, so exports merge store
snapshots and assemble plain shards. The oracles are the training run itself: ``summary.json``'s AUC,
log loss and model digest, its metrics at step 10, and the logits its own model computes on the
held-out split (:func:`recsys.serving.evaluate.held_out_logits`, checked against ``summary.json``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from embedding_store import TableSpec, WeightsPrecision
from recsys.serving.cache import open_rows
from tests.conftest import ROOT, subprocess_env
from tests.recsys.tiny import run_train, tiny_config

STEPS = 20
RUNS: dict[str, dict[str, Any]] = {
    # 2 ranks, table-wise: each table whole on one rank.
    "table_wise_2": {"train": {"nproc": 2}, "sparse": {"sharding": "table_wise"}},
    # 2 ranks, row-wise: every table spread over both ranks (plain shards by offset, tiered rows by hash);
    # 12 features, whose names do not sort in the model's order (cat_10 before cat_2).
    "row_wise_2": {
        "train": {"nproc": 2},
        "sparse": {"sharding": "row_wise"},
        "synthetic": {"num_sparse": 12},
    },
    # 1 rank, DLRM-DCNv2, 12 features as above.
    "dcn_1": {
        "train": {"nproc": 1},
        "model": {"name": "dcn", "dcn_low_rank_dim": 4},
        "synthetic": {"num_sparse": 12},
    },
    # 2 ranks, table-wise, bags of 1 to 3 ids per feature (slow tests only).
    "multi_hot_2": {"train": {"nproc": 2}, "synthetic": {"multi_hot": 3}},
    # 2 ranks, table-wise, half-precision weights (132-byte rows in the store, float16 values in float32 slot
    # tables: stochastic rounding; F16 in the bundle).
    "fp16_2": {"train": {"nproc": 2}, "sparse": {"weights_precision": "fp16"}},
    # 1 rank, logistic regression (4-wide rows; slow tests only).
    "logistic_1": {"train": {"nproc": 1}, "model": {"name": "logistic"}, "synthetic": {"num_sparse": 12}},
}


# Every run, the slow ones marked: for the tests that check each kind of run against its oracle.
EVERY_RUN = [
    "table_wise_2",
    "row_wise_2",
    "dcn_1",
    "fp16_2",
    pytest.param("multi_hot_2", marks=pytest.mark.slow),
    pytest.param("logistic_1", marks=pytest.mark.slow),
]


def _config(name: str) -> str:
    sections = {k: dict(v) for k, v in RUNS[name].items()}
    sections["train"].update(steps=STEPS, checkpoint_every=10)
    sections["store"] = {"tables": ["cat_0", "cat_2"]}
    sections["eval"] = {"every": 10}
    # Sequential: an evaluation during pipelined training can meet a prefetch of a later batch in the
    # store, where embedding_store's PrefetchPlan equality (numpy fields) fails now and then.
    sections["pipeline"] = {"mode": "sequential"}
    return tiny_config(**sections)


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``trained(name) -> run directory``, training each run of :data:`RUNS` once per session."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            config = root / "config.toml"
            config.write_text(_config(name))
            run_train(config, root / "run", env=subprocess_env())
            cache[name] = root / "run"
        return cache[name]

    return get


@pytest.fixture(scope="session")
def exported(trained: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``exported(name, **options) -> bundle`` of a run's final checkpoint, each made once."""
    from recsys.serving.export import ExportOptions, export_bundle

    cache: dict[tuple, Path] = {}

    def get(name: str, **options: Any) -> Path:
        key = (name, *sorted(options.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("bundles") / "bundle"
            export_bundle(trained(name), out, options=ExportOptions(**options))
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def training_logits(trained: Any) -> Any:
    """``training_logits(name) -> [(logits, labels) of rank r]``: the trained model's own held-out logits,
    rank by rank, from its final checkpoint on as many ranks as trained it."""
    from recsys.serving.evaluate import evaluate_checkpoint

    cache: dict[str, list[dict[str, Any]]] = {}

    def get(name: str) -> list[dict[str, Any]]:
        if name not in cache:
            cache[name] = evaluate_checkpoint(trained(name), keep_logits=True)
        return cache[name]

    return get


def cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m recsys ARGS...`` from the repository root, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "recsys", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


def writable_copy(bundle: Path, dest: Path) -> Path:
    """A copy of a (read-only) bundle whose files may be altered."""
    shutil.copytree(bundle, dest)
    for path in dest.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def held_out_batches(run: Path, rank: int, world_size: int) -> list[Any]:
    """The held-out batches of rank ``rank`` of ``world_size``, as the run's evaluation reads them."""
    from recsys.config import config_from_dict
    from recsys.data.source import build_dataset

    config = config_from_dict(summary(run)["config"])
    data = build_dataset(config.data, synthetic=config.synthetic, seed=config.train.seed)
    return list(data.eval_batches(rank=rank, world_size=world_size, batch_size=config.eval.batch_size))


def bundle_digest(bundle: Path) -> str:
    """The model digest (recsys.digest's definition) of a bundle exported with its optimizer state.

    Dense parameters by name, then per table (by name) every row that differs from its initial value
    or has optimizer state, in ascending id order, with that state.
    """
    from recsys.digest import hash_rows, touched_rows

    model = json.loads((bundle / "model.json").read_text())
    seed, scale = model["init"]["seed"], model["init"]["scale"]
    h = hashlib.blake2b(digest_size=16)
    dense = load_file(bundle / "dense.safetensors")
    for name in sorted(dense):
        h.update(name.encode())
        h.update(dense[name].numpy().astype("<f4").tobytes())
    tables = load_file(bundle / "tables.safetensors")
    for f in sorted(model["features"], key=lambda f: f["table"]):
        if f["kind"] == "plain":
            weight = tables[f"{f['table']}.weight"]
            ids, state = torch.arange(weight.shape[0]), tables.get(f"{f['table']}.state")
        else:
            ids, weight, state = tiered_rows(bundle, f["table"], f["dim"], model["row_floats"])
        h.update(f["table"].encode())
        hash_rows(h, touched_rows((ids, weight, state), table=f["table"], seed=seed, scale=scale))
    return h.hexdigest()


def tiered_rows(
    bundle: Path, table: str, dim: int, row_floats: int
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Every stored row of a tiered table of a bundle: ids, weights and the state (None if not kept)."""
    precision = WeightsPrecision(json.loads((bundle / "model.json").read_text())["weights_precision"])
    reader = open_rows(bundle / "tiered", tables=[table], row_floats=row_floats, weights_precision=precision)
    chunks = list(reader.scan(table))
    ids = np.concatenate([c[0] for c in chunks])
    rows = np.concatenate([c[1] for c in chunks])
    words = TableSpec(name=table, dim=dim, weights_precision=precision).weight_words
    state = None if row_floats == words else torch.from_numpy(rows[:, words:].copy()).squeeze(1)
    return torch.from_numpy(ids), torch.from_numpy(reader.weights(rows, dim).copy()), state
