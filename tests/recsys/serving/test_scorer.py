"""The scorer computes what the trained model computes: bit for bit on the same batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedding_store.init import init_rows
from recsys.models import LogisticRegression, table_configs
from recsys.serving import load_bundle
from recsys.serving.model import build_dense_model
from tests.recsys.serving.conftest import EVERY_RUN, held_out_batches, summary


@pytest.mark.parametrize("name", EVERY_RUN)
def test_scores_equal_the_training_processes_own_predictions(name, trained, exported, training_logits):
    """Rank r's held-out batches, scored by the bundle, give rank r's logits of the trained model exactly:
    the same rows, the same float32 operations in the same order (a bag's rows are added in its order)."""
    run = trained(name)
    world = summary(run)["world_size"]
    scorer = load_bundle(exported(name), cache_rows=64)
    for rank, oracle in enumerate(training_logits(name)):
        batches = held_out_batches(run, rank, world)
        logits = torch.cat([scorer.logits(b.dense, b.sparse) for b in batches])
        assert torch.equal(logits, oracle["logits"]), (rank, (logits - oracle["logits"]).abs().max())
        probs = torch.cat([scorer(b.dense, b.sparse) for b in batches])
        assert torch.equal(probs, torch.sigmoid(oracle["logits"]))


def test_other_batch_sizes_agree_to_float32_rounding(trained, exported, training_logits):
    """Batches of other sizes change only how the matrix products block their sums: ~1e-7 relative."""
    run = trained("table_wise_2")
    scorer = load_bundle(exported("table_wise_2"))
    oracle = training_logits("table_wise_2")[0]["logits"]
    (batch,) = held_out_batches(run, 0, 2)
    singles = torch.cat([scorer.logits(batch.dense[i : i + 1], _sample(batch, i)) for i in range(0, 256, 37)])
    torch.testing.assert_close(singles, oracle[0:256:37], rtol=1e-6, atol=1e-6)


def _sample(batch, i):
    return {k: jt.values()[i : i + 1] for k, jt in batch.sparse.to_dict().items()}


def test_a_table_ten_times_its_cache_serves_the_same_scores(trained, exported):
    run = trained("row_wise_2")
    bundle = exported("row_wise_2")
    uncached = load_bundle(bundle, cache_rows=0)
    small = load_bundle(bundle, cache_rows=150)
    batches = held_out_batches(run, 0, 1) + held_out_batches(run, 0, 1)  # twice: the second pass hits
    tiered = [f for f in small.bundle.features if f.kind == "tiered"]
    assert tiered and all(f.rows >= 10 * 150 for f in tiered)
    for batch in batches:
        assert torch.equal(
            small.logits(batch.dense, batch.sparse), uncached.logits(batch.dense, batch.sparse)
        )
    for f in tiered:
        stats = small.cache_stats()[f.name]
        assert 0.0 < stats.hit_rate < 1.0 and stats.rows <= 150 and stats.hits + stats.misses > 0
        assert uncached.cache_stats()[f.name].hit_rate == 0.0


def test_unseen_ids_get_their_initial_rows_or_zeros(exported):
    bundle = exported("table_wise_2")
    scorer = load_bundle(bundle)
    f = next(f for f in scorer.bundle.features if f.kind == "tiered")
    stored = scorer._caches[f.name]._source  # the ids the bundle holds
    ids = np.arange(f.id_space, dtype=np.int64)
    found, _ = stored.read(f.table, ids, f.dim)
    never = ids[~found][:5]
    rows = scorer._caches[f.name].lookup(never)
    seed, scale = scorer.bundle.init
    assert torch.equal(rows, init_rows(never, dim=f.dim, seed=seed, table=f.table, scale=scale))
    assert scorer.cache_stats()[f.name].unseen == 5
    zeros = load_bundle(bundle, unseen="zeros")
    assert torch.equal(zeros._caches[f.name].lookup(never), torch.zeros(5, f.dim))
    with pytest.raises(ValueError, match="outside its id space"):
        scorer(
            np.zeros((1, scorer.num_dense)), {n: [f.id_space if n == f.name else 0] for n in scorer.features}
        )


def test_inputs_in_every_accepted_form_score_alike(exported, trained):
    scorer = load_bundle(exported("table_wise_2"))
    (batch, *_) = held_out_batches(trained("table_wise_2"), 0, 1)
    want = scorer(batch.dense, batch.sparse)
    single = {k: jt.values().numpy() for k, jt in batch.sparse.to_dict().items()}
    jagged = {k: (v.tolist(), [1] * len(v)) for k, v in single.items()}
    assert torch.equal(scorer(batch.dense.numpy(), single), want)
    assert torch.equal(scorer(batch.dense.tolist(), jagged), want)
    with pytest.raises(ValueError, match="missing \\['cat_3'\\]"):
        scorer(batch.dense, {k: v for k, v in single.items() if k != "cat_3"})
    with pytest.raises(ValueError, match="dense features must be"):
        scorer(batch.dense[:, :3], single)
    # A bag is the sum of its rows, in its order; an empty bag pools to zeros.
    for f in scorer.bundle.features:
        ids = single[f.name][:3]
        bags = scorer._pool(f, np.concatenate([ids[:1], ids, ids[:0]]), np.array([1, 3, 0]))
        rows = scorer._pool(f, ids, np.ones(3, dtype=np.int64))
        assert torch.equal(bags[0], rows[0]) and torch.equal(bags[2], torch.zeros(f.dim))
        assert torch.equal(bags[1], rows[0] + rows[1] + rows[2])


# -- the dense model against TorchRec's, on random weights ---------------------------------------------


def _torchrec_model(name: str, num_dense: int, features: list[str]):
    torch.manual_seed(0)
    dim = 4 if name == "logistic" else 8
    tables = table_configs(features, dim=dim, num_embeddings=[50] * len(features))
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    if name == "logistic":
        return LogisticRegression(ebc, num_dense=num_dense), dim
    kwargs = dict(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=[16, dim],
        over_arch_layer_sizes=[32, 8, 1],
    )
    if name == "dcn":
        return DLRM_DCN(**kwargs, dcn_num_layers=2, dcn_low_rank_dim=3), dim
    return DLRM(**kwargs), dim


@pytest.mark.parametrize("name", ["dlrm", "dcn", "logistic"])
def test_the_dense_model_is_torchrecs_model(name):
    features = ["a", "b", "c"]
    model, dim = _torchrec_model(name, 5, features)
    state = {f"model.{k}": v for k, v in model.state_dict().items() if "embedding_bags." not in k}
    arch = {
        "name": name,
        "embedding_dim": dim,
        "dense_arch": [16, dim],
        "over_arch": [32, 8],
        "dcn_num_layers": 2,
        "dcn_low_rank_dim": 3,
    }
    mine = build_dense_model(arch, state, num_dense=5, num_sparse=3)
    rng = np.random.default_rng(0)
    dense = torch.from_numpy(rng.normal(size=(33, 5)).astype(np.float32))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=features,
        values=torch.from_numpy(rng.integers(0, 50, 99)),
        lengths=torch.ones(99, dtype=torch.int32),
    )
    with torch.no_grad():
        want = model(dense, kjt).squeeze(-1)
        pooled = model.sparse_arch(kjt) if name != "logistic" else None
        if pooled is None:
            kt = model.sparse_arch(kjt).to_dict()
            pooled = torch.stack([kt[f] for f in features], dim=1)
        got = mine(dense, pooled)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="do not fit"):
        build_dense_model(arch, {k: v for k, v in list(state.items())[1:]}, num_dense=5, num_sparse=3)
