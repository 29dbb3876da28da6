"""Token ids are folded into a spec's declared id space the same way in tiered and untiered runs.

The oracle is the other mode: both train the same model (equal digests), and FBGEMM never sees an id
outside its table (it would log "Out of bounds" and silently train on row 0).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recsys.data.source import DataConfig, build_dataset
from tests.recsys.tiny import ROOT

SPEC = """name = "tokens"
format = "csv"
[source]
files = ["clicks.csv"]
[read]
delimiter = ","
[label]
column = "click"
[[dense]]
name = "price"
[[sparse]]
name = "user"
column = "user"
id_space = 400
[[sparse]]
name = "item"
column = "item"
id_space = {item_space}
"""

CONFIG = """[data]
source = "{spec}"
[model]
embedding_dim = 8
dense_arch = [16, 8]
over_arch = [16]
[train]
steps = 30
batch_size = 64
[store]
device_rows = 300
host_rows = 100
[eval]
batch_size = 256
"""


def _write(tmp_path: Path, item_space: int) -> Path:
    rng = random.Random(0)
    lines = ["user,item,price,click"]
    for _ in range(3000):
        lines.append(
            f"u{rng.randint(0, 3000)},item{rng.randint(0, 900)},{rng.random():.3f},{int(rng.random() < 0.3)}"
        )
    (tmp_path / "clicks.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "spec.toml").write_text(SPEC.format(item_space=item_space))
    (tmp_path / "c.toml").write_text(CONFIG.format(spec=tmp_path / "spec.toml"))
    return tmp_path / "c.toml"


def test_hashed_tokens_lie_inside_the_declared_id_space(tmp_path):
    _write(tmp_path, item_space=1000)
    data = build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=None, seed=0)  # type: ignore[arg-type]
    assert data.id_spaces == [400, 1000]
    seen = {0: set(), 1: set()}
    for batch in data.train_batches(rank=0, world_size=1, batch_size=256, start_step=0):
        for k, key in enumerate(("user", "item")):
            ids = batch.sparse[key].values().numpy()
            assert ((ids >= 0) & (ids < data.id_spaces[k])).all()
            seen[k] |= set(ids.tolist())
        if len(seen[0]) > 300:
            break
    assert len(seen[0]) > 300  # 3,000 users over 400 ids: folded, not dropped
    assert np.all(np.array(sorted(seen[0])) < 400)


def _train(config: Path, out: Path, tiered: bool, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "recsys", "train", "--config", str(config), "--out", str(out)]
    cmd += ["--set", f"store.tiered={str(tiered).lower()}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Out of bounds" not in proc.stderr and "out of bounds" not in proc.stderr.lower()
    return proc


def test_a_small_token_id_space_trains_the_same_model_tiered_and_untiered(tmp_path, cli_env):
    config = _write(tmp_path, item_space=1000)
    for tiered in (True, False):
        proc = _train(config, tmp_path / f"run_{tiered}", tiered, cli_env)
        assert "fold ids modulo" not in proc.stderr
    digests = {
        json.loads((tmp_path / f"run_{t}" / "summary.json").read_text())["model_digest"]
        for t in (True, False)
    }
    assert len(digests) == 1


@pytest.mark.slow
def test_an_id_space_larger_than_an_in_memory_table_is_warned_about(tmp_path, cli_env):
    config = _write(tmp_path, item_space=1 << 40)
    proc = _train(config, tmp_path / "run", False, cli_env)
    assert "the in-memory tables of item (1,099,511,627,776 ids) fold ids modulo" in proc.stderr
    assert "Each of these tables holds 1,000,000 rows" in proc.stderr


def test_criteo_hex_ids_are_folded_into_a_declared_id_space(tmp_path):
    from tests.recsys.data.conftest import criteo_lines

    lines = criteo_lines(300)
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    sparse = "".join(f'[[sparse]]\nname = "c{j}"\nkind = "hex"\nid_space = {1000 + j}\n' for j in range(26))
    (tmp_path / "spec.toml").write_text(
        f'name = "crit"\nformat = "criteo_tsv"\n[source]\nfiles = ["day_0"]\n[split]\neval_fraction = 0.5\n{sparse}'
    )
    data = build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=None, seed=0)  # type: ignore[arg-type]
    assert data.id_spaces == [1000 + j for j in range(26)]
    batch = next(iter(data.train_batches(rank=0, world_size=1, batch_size=150, start_step=0)))  # endless
    raw = [[int(x, 16) if x else 0 for x in line.split("\t")[14:]] for line in lines[:150]]  # empty: id 0
    for j in range(26):
        ids = batch.sparse[f"c{j}"].values().numpy()
        expected = [r[j] % (1000 + j) for r in raw]
        assert ids.tolist() == expected


def test_the_folding_warning_says_what_the_folded_tables_weigh(caplog) -> None:
    from dataclasses import replace

    from recsys.build import _warn_folded
    from recsys.config import RunConfig

    config = RunConfig()
    config = replace(config, sparse=replace(config.sparse, max_rows_per_table=100_000))
    with caplog.at_level("WARNING", logger="recsys"):
        _warn_folded(config, ["a", "b", "c"], [1 << 63, 11, 1 << 40], [100_000, 0, 100_000])
    (message,) = [r.getMessage() for r in caplog.records]
    assert "the in-memory tables of a (9,223,372,036,854,775,808 ids), c (1,099,511,627,776 ids)" in message
    row = 16 * 4 + 4  # dim-16 float32 weights and row-wise Adagrad's one float
    mib = 100_000 * row / 2**20
    assert (
        f"Each of these tables holds 100,000 rows ({mib:.1f} MiB with its optimizer state; {2 * mib:.1f} "
        in message
    )
    assert "declare a feature's id_space in the dataset spec" in message
