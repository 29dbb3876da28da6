"""Criteo TSV readers against a slow oracle, on files in the exact Criteo layout; preprocess round trip."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.cli import main
from recsys.data.chunks import count_lines, count_newlines, iter_chunks
from recsys.data.criteo import CriteoParser, parse_criteo
from recsys.data.issues import Issues, OnError
from recsys.data.row_sources import TextReading, TextSource
from recsys.data.source import DataConfig, build_dataset
from recsys.data.synthetic import SyntheticConfig
from tests.recsys.data.conftest import criteo_lines, criteo_oracle


def _rows(block) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.stack([j.values for j in block.ids], axis=1)
    return block.dense, ids, block.labels


def _check_against_oracle(block, lines: list[str], *, label: bool = True) -> None:
    dense, ids, labels = _rows(block)
    assert dense.shape == (len(lines), 13) and ids.shape == (len(lines), 26)
    for i, line in enumerate(lines):
        d, c, y = criteo_oracle(line, label=label)
        assert dense[i].tolist() == d, i
        assert ids[i].tolist() == c, i
        assert labels[i] == y


def test_parser_matches_oracle_on_exact_layout(criteo_file):
    path, lines = criteo_file
    block = parse_criteo(
        path.read_bytes(), first_line=1, has_label=True, issues=Issues(str(path), OnError.RAISE)
    )
    _check_against_oracle(block, lines)
    ids = np.stack([j.values for j in block.ids], axis=1)
    assert ids.dtype == np.int64 and ids.max() >= 2**31 and (ids >= 0).all()  # no int32 overflow


def test_extremes_and_empty_fields():
    line = "\t".join(
        ["1", *[""] * 12, "-3", "ffffffff", "80000000", "7fffffff", "00000000", "", *["0A1b2C3d"] * 21]
    )
    block = parse_criteo(
        (line + "\n").encode(), first_line=1, has_label=True, issues=Issues("x", OnError.RAISE)
    )
    ids = [int(j.values[0]) for j in block.ids]
    assert ids[:5] == [2**32 - 1, 2**31, 2**31 - 1, 0, 0] and ids[5] == 0x0A1B2C3D
    assert block.dense[0].tolist() == [0.0] * 13  # empty and negative counts → log1p(0)


def test_kaggle_test_file_without_label(tmp_path):
    lines = criteo_lines(200, seed=3, label=False)
    block = parse_criteo(
        ("\n".join(lines) + "\n").encode(), first_line=1, has_label=False, issues=Issues("t", OnError.RAISE)
    )
    _check_against_oracle(block, lines, label=False)


@pytest.mark.parametrize("chunk_bytes", [9973, 1 << 20])
def test_chunked_and_gzip_streams_match_oracle(criteo_file, tmp_path, chunk_bytes):
    path, lines = criteo_file
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    for f in (path, gz):
        source = TextSource(
            [f], CriteoParser(), on_error=OnError.RAISE, reading=TextReading(chunk_bytes=chunk_bytes)
        )
        blocks = list(source.blocks())
        assert len(blocks) > 1 or chunk_bytes > 10**5
        from recsys.data.block import Block

        _check_against_oracle(Block.concat(blocks), lines)
        assert source.num_rows() == len(lines)
        # Starting after k rows gives exactly the rows from k on.
        _check_against_oracle(Block.concat(list(source.blocks(skip_rows=1234))), lines[1234:])


@pytest.mark.parametrize("skip", [0, 1, 37, 5000])
def test_iter_chunks_cover_the_lines_after_skip(tmp_path, skip):
    """Chunks hold whole lines, in order, with their first line number and line count (oracle: splitlines)."""
    rng = np.random.default_rng(skip)
    lines = [b"x" * int(n) for n in rng.integers(0, 300, 4000)]
    path = tmp_path / "lines.txt"
    path.write_bytes(b"\n".join(lines))  # the last line has no newline
    got, expect_first = [], skip + 1
    for data, first, n in iter_chunks(path, chunk_bytes=4096, skip_lines=skip):
        assert data.endswith(b"\n") and first == expect_first
        assert n == len(data.splitlines()) == count_newlines(data)
        got += data.splitlines()
        expect_first += n
    assert got == lines[skip:]
    assert count_lines(path) == len(lines)
    big = b"\n".join(lines) * 600  # over a MiB: counted in several numpy passes
    assert count_newlines(big) == big.count(b"\n")


def _spec(tmp_path: Path, body: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _dataset(spec: Path, **kw):
    return build_dataset(DataConfig(source=str(spec), **kw), synthetic=SyntheticConfig(), seed=0)


def _same_batches(a, b) -> None:
    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(
        a.sparse.lengths(), b.sparse.lengths()
    )


def test_preprocess_round_trip_tsv_npy_batches(criteo_file, tmp_path, capsys):
    path, lines = criteo_file
    out = tmp_path / "npy"
    assert main(["preprocess", str(path), "--out", str(out)]) == 0
    assert (out / "day_0_dense.npy").is_file() and "wrote" in capsys.readouterr().out
    assert np.load(out / "day_0_sparse.npy").dtype == np.int64
    tsv = _dataset(
        _spec(tmp_path, 'name = "c"\nformat = "criteo_tsv"\n[source]\nfiles = ["day_0"]\n', "tsv.toml")
    )
    npy = _dataset(
        _spec(out, 'name = "c"\nformat = "torchrec_npy"\n[source]\nfiles = ["day_0"]\n', "npy.toml")
    )
    assert tsv.feature_names == npy.feature_names and tsv.id_spaces == npy.id_spaces == [2**32] * 26
    for rank in (0, 1):
        # 2,700 training rows in batches of 512: steps 0-12 cross an epoch boundary.
        a = tsv.train_batches(rank=rank, world_size=2, batch_size=512, start_step=0)
        b = npy.train_batches(rank=rank, world_size=2, batch_size=512, start_step=0)
        for _ in range(13):
            _same_batches(next(a), next(b))
        ea = list(tsv.eval_batches(rank=rank, world_size=2, batch_size=64))
        eb = list(npy.eval_batches(rank=rank, world_size=2, batch_size=64))
        assert len(ea) == len(eb) > 1
        for x, y in zip(ea, eb, strict=True):
            _same_batches(x, y)


def test_preprocess_user_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\n")
    assert main(["preprocess", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"recsys: error: {bad}:1: expected 40 fields, got 2"


def test_terabyte_layout_days_and_held_out_day(tmp_path):
    days = [criteo_lines(n, seed=20 + d) for d, n in enumerate((300, 200, 100))]
    for d, lines in enumerate(days):
        (tmp_path / f"day_{d}").write_text("\n".join(lines) + "\n")
    spec = 'name = "tb"\nformat = "criteo_tsv"\n[source]\nfiles = ["day_[01]"]\n[split]\neval_files = ["day_2"]\n'
    ds = _dataset(_spec(tmp_path, spec))
    assert ds.train_source.num_rows() == 500 and ds.eval_source.num_rows() == 100
    from recsys.data.block import Block

    _check_against_oracle(Block.concat(list(ds.train_source.blocks())), days[0] + days[1])
    _check_against_oracle(Block.concat(list(ds.eval_source.blocks())), days[2])
    _check_against_oracle(Block.concat(list(ds.train_source.blocks(skip_rows=250))), days[0][250:] + days[1])
