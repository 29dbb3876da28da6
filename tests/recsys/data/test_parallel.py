"""Parsing in worker processes: the same rows, messages and counts as parsing in threads."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from recsys.data.block import Block
from recsys.data.criteo import CriteoParser
from recsys.data.issues import Issues, MalformedInputError, OnError
from recsys.data.parallel import ProcessParsePool
from recsys.data.row_sources import TextReading, TextSource
from tests.recsys.data.conftest import criteo_lines, criteo_oracle


def _same_blocks(a: Block, b: Block) -> None:
    assert np.array_equal(a.dense, b.dense) and np.array_equal(a.labels, b.labels)
    for x, y in zip(a.ids, b.ids, strict=True):
        assert np.array_equal(x.values, y.values) and np.array_equal(x.lengths, y.lengths)


def _source(path, *, processes, on_error=OnError.RAISE, chunk_bytes=9973) -> TextSource:
    reading = TextReading(chunk_bytes=chunk_bytes, processes=processes)
    return TextSource([path], CriteoParser(), on_error=on_error, reading=reading)


def test_processes_give_the_oracle_rows_in_file_order(criteo_file):
    path, lines = criteo_file
    source = _source(path, processes=True)
    assert source.use_processes()
    blocks = list(source.blocks())
    assert len(blocks) > 10  # many chunks, parsed out of order by two workers
    whole = Block.concat(blocks)
    for i in range(0, len(lines), 97):
        dense, ids, label = criteo_oracle(lines[i])
        assert whole.dense[i].tolist() == dense and whole.labels[i] == label
        assert [int(j.values[i]) for j in whole.ids] == ids
    _same_blocks(whole, Block.concat(list(_source(path, processes=False).blocks())))
    _same_blocks(
        Block.concat(list(source.blocks(skip_rows=1234))),
        Block.concat(list(_source(path, processes=False).blocks(skip_rows=1234))),
    )


def _file_with_bad_lines(tmp_path, bad_at: list[int]):
    lines = criteo_lines(3000, seed=5)
    for k in bad_at:
        parts = lines[k - 1].split("\t")
        parts[20] = "0a1b2c3g"  # C7, column 21
        lines[k - 1] = "\t".join(parts)
    path = tmp_path / "day_1"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_malformed_line_in_a_later_chunk_is_named_by_file_and_line(tmp_path):
    path = _file_with_bad_lines(tmp_path, [2500, 2900])
    with pytest.raises(MalformedInputError) as info:
        list(_source(path, processes=True).blocks())
    assert str(info.value) == f"{path}:2500: field 'C7' (column 21): not a hexadecimal id: '0a1b2c3g'"


def test_skip_mode_counts_from_every_worker(tmp_path):
    bad = [3, 700, 1500, 2222, 2999]
    path = _file_with_bad_lines(tmp_path, bad)
    procs = _source(path, processes=True, on_error=OnError.SKIP)
    threads = _source(path, processes=False, on_error=OnError.SKIP)
    _same_blocks(Block.concat(list(procs.blocks())), Block.concat(list(threads.blocks())))
    assert procs.skipped == len(bad) and procs.num_rows() == 3000 - len(bad)
    assert procs.issues[str(path)].counts == threads.issues[str(path)].counts


def test_auto_uses_processes_only_for_big_files_and_picklable_parsers(criteo_file, monkeypatch):
    path, _ = criteo_file
    assert not _source(path, processes="auto").use_processes()  # a small file: threads
    monkeypatch.setattr(TextSource, "PROCESS_MIN_BYTES", 0)
    assert _source(path, processes="auto").use_processes()

    def closure(data, first, issues):  # not picklable: threads, and still correct
        return CriteoParser()(data, first, issues)

    source = TextSource([path], closure, on_error=OnError.RAISE, reading=TextReading(processes="auto"))
    assert not source.use_processes()
    assert source.num_rows() == sum(b.num_rows for b in source.blocks())


class _Inflate:
    """A parser whose result is far bigger than its input (it must travel through the pipe)."""

    def __call__(self, data: bytes, first: int, issues: Issues) -> tuple[np.ndarray, int]:
        return np.frombuffer(data, dtype=np.uint8).repeat(20), first


def test_results_bigger_than_a_slot_and_chunks_longer_than_a_slot():
    chunk = 4096
    inputs = [bytes(range(256)) * 8, bytes(range(256)) * 100, b"x" * (10 * chunk)]  # small, big, huge
    with ProcessParsePool(_Inflate(), workers=2, chunk_bytes=chunk, slots=3) as pool:
        futures = [pool.submit(data, k + 1, Issues("f", OnError.RAISE)) for k, data in enumerate(inputs * 3)]
        for k, fut in enumerate(futures):
            out, first = fut.result(timeout=60)
            data = inputs[k % 3]
            assert first == k + 1 and out.flags.writeable
            assert np.array_equal(out, np.frombuffer(data, dtype=np.uint8).repeat(20))


class _Fails:
    def __call__(self, data: bytes, first: int, issues: Issues) -> None:
        raise ZeroDivisionError(f"chunk at line {first}")


def test_a_parser_error_reaches_the_reader_with_its_type():
    pool = ProcessParsePool(_Fails(), workers=1, chunk_bytes=1024, slots=2)
    with pool, pytest.raises(ZeroDivisionError, match="chunk at line 7"):
        pool.submit(b"a\n", 7, Issues("f", OnError.RAISE)).result(timeout=60)


class _Dies:
    """Kills its own process on the chunk that starts at line 2 (as an out-of-memory kill would)."""

    def __call__(self, data: bytes, first: int, issues: Issues) -> int:
        if first == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return first


def test_a_dead_worker_fails_its_task_and_the_others_finish():
    with ProcessParsePool(_Dies(), workers=2, chunk_bytes=1024, slots=4) as pool:
        futures = [pool.submit(b"a\n", k, Issues("f", OnError.RAISE)) for k in (1, 2)]
        assert futures[0].result(timeout=60) == 1
        with pytest.raises(RuntimeError, match=r"a text parser process died \(exit code -9\)"):
            futures[1].result(timeout=60)
        # the surviving worker takes every later task
        later = [pool.submit(b"a\n", k, Issues("f", OnError.RAISE)) for k in (3, 4, 5)]
        assert [f.result(timeout=60) for f in later] == [3, 4, 5]


class _Slow:
    def __call__(self, data: bytes, first: int, issues: Issues) -> int:
        time.sleep(0.2)
        return first


def test_close_with_tasks_in_flight_cancels_them_and_stops_every_worker():
    pool = ProcessParsePool(_Slow(), workers=2, chunk_bytes=1024, slots=6)
    futures = [pool.submit(b"a\n", k, Issues("f", OnError.RAISE)) for k in range(6)]
    workers = [p.process for p in pool._procs]
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 5
    assert all(f.done() for f in futures)
    assert not any(w.is_alive() for w in workers)
    with pytest.raises(RuntimeError, match="the text parser pool is closed"):
        pool.submit(b"a\n", 9, Issues("f", OnError.RAISE))
