"""Read-ahead of compacted segments: the runs it asks for hold the pages compaction then reads."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from embedding_store import LmdbOptions, OptimizerKind, TableSpec
from embedding_store.backends import open_backend
from embedding_store.backends.log_format import encode_keys
from embedding_store.backends.readahead import PAGE, MappedFile, page_runs

SPEC = TableSpec(name="t", dim=64, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)  # 7 rows a block


def _layout(rng: np.random.Generator, blocks: int, per_page: int) -> np.ndarray:
    """The page of each block: runs of consecutive pages at random places, ascending inside a run."""
    pages, b = np.empty(blocks, dtype=np.int64), 0
    while b < blocks:
        n = int(rng.integers(1, 400))  # blocks in this run
        start = int(rng.integers(0, 1 << 20))
        take = min(n, blocks - b)
        pages[b : b + take] = start + np.arange(take) // per_page
        b += take
    return pages


@pytest.mark.parametrize("seed", range(5))
def test_page_runs_hold_every_block_between_probes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    per_page, every = 2, 64
    pages = _layout(rng, 20_000, per_page)
    probed = np.arange(0, pages.shape[0], every)
    runs = page_runs(probed, pages[probed], pad=every // per_page)
    inside = np.zeros(pages.shape[0], dtype=bool)
    for lo, hi in runs:
        inside |= (pages >= lo) & (pages < hi)
    # a run that starts and ends between two probes is not seen; every other block is inside
    breaks = int(np.count_nonzero(np.abs(np.diff(pages)) > 1))
    assert np.count_nonzero(~inside) <= breaks * every // 4, (np.count_nonzero(~inside), breaks)
    assert all(a[1] < b[0] for a, b in zip(runs, runs[1:], strict=False))  # sorted, disjoint
    asked = sum(hi - lo for lo, hi in runs)
    assert asked <= np.unique(pages).shape[0] + 2 * (every // per_page + 1) * (breaks + 1)


def test_page_runs_of_nothing() -> None:
    assert page_runs(np.empty(0, np.int64), np.empty(0, np.int64), pad=4) == []


class _Recording(MappedFile):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.asked: list[tuple[int, int]] = []

    def willneed(self, runs: list[tuple[int, int]]) -> int:
        self.asked.extend(runs)
        return super().willneed(runs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read-ahead needs /proc/self/maps")
def test_compaction_asks_for_the_pages_of_the_rows_it_copies(tmp_path: Path) -> None:
    options = LmdbOptions(initial_map_size_bytes=1 << 22, log_segment_rows=1 << 14)
    backend = open_backend(tmp_path / "env", options=options, seed=0, tables=[SPEC])
    log = backend.log  # type: ignore[attr-defined]
    assert log is not None
    mapped = _Recording(backend._data_file)
    backend._mapped = mapped  # the map grows during the run: its start is found again
    log._io = dataclasses.replace(log._io, mapped=mapped)
    compact, seen = log.compact, []

    def watched(table: str, seg: int) -> None:
        t = log._tables[table]
        _, (ids, seqs), _ = log._runs_of(t, seg)
        blocks = np.unique(seqs[t.index.lookup(ids) == seqs] // t.geo.block)
        with backend._env.begin(buffers=True) as txn:
            got = txn.cursor(db=t.segs[seg]).getmulti(encode_keys(blocks))
            at = [(np.frombuffer(v, np.uint8).ctypes.data - mapped.base()) // PAGE for _, v in got]
            every = [  # the pages of all the segment's blocks, live or dead
                (np.frombuffer(v, np.uint8).ctypes.data - mapped.base()) // PAGE
                for _, v in txn.cursor(db=t.segs[seg])
            ]
        pages, segment_pages = np.unique(at), np.unique(every)
        mapped.asked.clear()
        compact(table, seg)
        inside = np.zeros(pages.shape[0], dtype=bool)
        for lo, hi in mapped.asked:
            inside |= (pages >= lo) & (pages < hi)
        seen.append((inside.mean(), sum(hi - lo for lo, hi in mapped.asked) / segment_pages.shape[0]))

    log.compact = watched  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    oracle: dict[int, np.ndarray] = {}
    for step in range(50):
        ids = np.unique(rng.integers(0, 80_000, size=8_000 if step else 80_000)).astype(np.int64)
        rows = rng.standard_normal((ids.shape[0], SPEC.row_floats)).astype(np.float32)
        backend.put_rows([("t", ids, rows)])
        oracle.update(zip(ids.tolist(), rows, strict=True))
    assert len(seen) > 5 and log.stats.readahead_bytes > 0
    cover = sorted(c for c, _ in seen)  # where the free list is fragmented, some pages are not seen
    assert cover[len(cover) // 2] >= 0.95 and cover[0] >= 0.8, cover  # nearly every page it read
    assert max(r for _, r in seen) <= 1.5, seen  # little beyond its own pages (and the pads of small appends)
    want = np.array(sorted(oracle), dtype=np.int64)
    found, rows = backend.get_rows("t", want)
    assert found.all() and np.array_equal(rows, np.stack([oracle[i] for i in want.tolist()]))
    backend.close()


def _mapped_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) == 6 and fields[5] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_mapped_pages_are_dropped_through_the_kept_map_address(tmp_path: Path, monkeypatch) -> None:
    import embedding_store.backends.lmdb_env as lmdb_env

    def no_scan(path: str) -> None:
        raise AssertionError("the drop read /proc/self/maps instead of using the map's kept address")

    backend = open_backend(
        tmp_path / "env", options=LmdbOptions(unmap_every_rows=1 << 30), seed=0, tables=[SPEC]
    )
    ids = np.arange(20_000, dtype=np.int64) * 7_919
    rows = np.random.default_rng(0).standard_normal((ids.shape[0], SPEC.row_floats)).astype(np.float32)
    for a in range(0, ids.shape[0], 1_000):
        backend.put_rows([("t", ids[a : a + 1_000], rows[a : a + 1_000])])
    found, got = backend.get_rows("t", ids)
    assert found.all() and np.array_equal(got, rows)
    before = _mapped_bytes(backend._data_file)
    assert before > 1 << 20  # the read mapped the pages it touched
    monkeypatch.setattr(lmdb_env, "drop_mapped_pages", no_scan)
    backend._count_read(1 << 30)
    assert _mapped_bytes(backend._data_file) < before // 8
    found, again = backend.get_rows("t", ids)  # the pages fault back in from the page cache
    assert found.all() and np.array_equal(again, rows)
    backend.close()
