"""Criteo TSV reader: rows/s against pyarrow's CSV reader on the same file, and peak RSS on a big file.

    .venv/bin/python benchmarks/bench_readers.py                 # compare, a ~270 MB file (1M rows)
    .venv/bin/python benchmarks/bench_readers.py --rows 2000000
    .venv/bin/python benchmarks/bench_readers.py --rss --gb 5    # stream a 5 GB file, sample RSS
    .venv/bin/python benchmarks/bench_readers.py --smoke         # seconds: the code path, not a figure

The file is generated under /tmp in the exact Criteo layout (empty fields, negative counts, 8-digit hex
ids ≥ 2**31) and deleted afterwards. Both readers parse everything: ours into the trainer's columns (int64
ids, log-transformed float32 counts, float32 labels); pyarrow into int64 counts and string categoricals
(it cannot parse hexadecimal), with its default threads. Ours runs as the trainer runs it (parser
processes for a file this big) and, for reference, with parser threads ("threads"). The page cache is
warmed first so both read from memory. The last line is JSON with the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import CpuProbe, Periodic, emit, machine_info, peak_rss_mib  # noqa: E402

from recsys.data.criteo import CriteoParser  # noqa: E402
from recsys.data.issues import OnError  # noqa: E402
from recsys.data.row_sources import TextReading, TextSource  # noqa: E402


def _chunk_of_lines(rows: int, seed: int) -> bytes:
    """``rows`` Criteo lines, generated vectorised (bytes joined per column, not per row)."""
    rng = np.random.default_rng(seed)
    cols = [rng.integers(0, 2, rows).astype(str)]
    for _ in range(13):
        v = rng.integers(-3, 5000, rows).astype(str)
        cols.append(np.where(rng.random(rows) < 0.15, "", v))
    for _ in range(26):
        ids = rng.integers(0, 2**32, rows, dtype=np.uint64)
        hexed = np.char.zfill(
            np.char.lower(np.array([format(int(x), "x") for x in ids[: min(rows, 4096)]])), 8
        )
        v = hexed[rng.integers(0, hexed.shape[0], rows)]  # a vocabulary of ≤ 4096 values per column
        cols.append(np.where(rng.random(rows) < 0.1, "", v))
    table = np.stack(cols, axis=1)
    return ("\n".join("\t".join(r) for r in table.tolist()) + "\n").encode()


def make_file(path: Path, total_bytes: int, block_rows: int = 240_000) -> int:
    """Write ~``total_bytes`` of Criteo lines by repeating a 64 MB block; returns the line count."""
    block = _chunk_of_lines(block_rows, seed=0)
    lines_per_block = block.count(b"\n")
    written = lines = 0
    with open(path, "wb") as fh:
        while written < total_bytes:
            fh.write(block)
            written += len(block)
            lines += lines_per_block
    return lines


def _warm(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(64 << 20):
            pass


CHUNK_KIB: int | None = None  # --chunk-kib; None: the reader's default


def _source(path: Path, workers: int, processes: bool | str = "auto") -> TextSource:
    chunk_bytes = None if CHUNK_KIB is None else CHUNK_KIB << 10
    reading = TextReading(chunk_bytes=chunk_bytes, workers=workers, processes=processes)
    return TextSource([path], CriteoParser(), on_error=OnError.RAISE, reading=reading)


def read_ours(path: Path, workers: int, processes: bool | str = "auto") -> tuple[int, float]:
    t0 = time.perf_counter()
    rows = sum(b.num_rows for b in _source(path, workers, processes).blocks())
    return rows, time.perf_counter() - t0


def read_pyarrow(path: Path) -> tuple[int, float]:
    import pyarrow as pa
    import pyarrow.csv as pc

    names = ["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]
    types = {"label": pa.int64(), **{f"I{i}": pa.int64() for i in range(1, 14)}}
    types.update({f"C{i}": pa.string() for i in range(1, 27)})
    t0 = time.perf_counter()
    table = pc.read_csv(
        path,
        read_options=pc.ReadOptions(column_names=names, block_size=4 << 20),
        parse_options=pc.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pc.ConvertOptions(column_types=types),
    )
    return table.num_rows, time.perf_counter() - t0


def _pss_mb(pid: int | str) -> float:
    """Proportional set size: resident pages, each shared page split among the processes sharing it."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _tree_rss_mb() -> float:
    """Memory of this process plus its child processes (the parser workers, forked from it): the sum of
    their proportional set sizes, so pages they share (the libraries, the parent's heap) count once."""
    kids: list[str] = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            kids += (task / "children").read_text().split()
    return _pss_mb("self") + sum(_pss_mb(k) for k in kids)


def compare(args: argparse.Namespace) -> dict[str, object]:
    path = Path(args.dir) / "bench_criteo.tsv"
    try:
        lines = make_file(path, int(args.rows * 270), min(240_000, args.rows))
        size_mb = path.stat().st_size / 1e6
        _warm(path)
        best: dict[str, float] = {}
        best_cpu: dict[str, float] = {}
        for _ in range(args.repeat):
            for name, fn in (
                ("ours", lambda: read_ours(path, args.workers)),
                ("threads", lambda: read_ours(path, args.workers, processes=False)),
                ("pyarrow", lambda: read_pyarrow(path)),
            ):
                # CPU time of this process's threads and of its ended child processes (our parser processes)
                with CpuProbe(children=True) as probe:
                    rows, secs = fn()
                assert probe.share is not None and rows == lines, (name, rows, lines)
                best[name] = max(best.get(name, 0.0), rows / secs)
                best_cpu[name] = max(best_cpu.get(name, 0.0), rows / probe.share.cpu_s)
        for name, rate in best.items():
            print(
                f"{name:8s} {rate:12,.0f} rows/s  {rate * size_mb / lines:8.1f} MB/s  "
                f"{best_cpu[name]:12,.0f} rows per CPU-second"
            )
        return {
            "mode": "compare",
            "file_mb": round(size_mb, 1),
            "rows": lines,
            "ours_rows_per_s": round(best["ours"]),
            "pyarrow_rows_per_s": round(best["pyarrow"]),
            "ours_over_pyarrow": round(best["ours"] / best["pyarrow"], 3),
            "ours_over_pyarrow_per_cpu_s": round(best_cpu["ours"] / best_cpu["pyarrow"], 3),
            "threads_rows_per_s": round(best["threads"]),
            "threads_over_pyarrow": round(best["threads"] / best["pyarrow"], 3),
            "load_avg_1min": os.getloadavg()[0],
        }
    finally:
        path.unlink(missing_ok=True)


def rss(args: argparse.Namespace) -> dict[str, object]:
    path = Path(args.dir) / "bench_criteo_big.tsv"
    try:
        t0 = time.perf_counter()
        # Generate in a child process, so that this process's peak RSS (ru_maxrss) is the reader's alone.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            lines = pool.apply(make_file, (path, int(args.gb * 1e9), min(240_000, int(args.gb * 1e9) // 270)))
        print(
            f"wrote {path.stat().st_size / 1e9:.2f} GB ({lines:,} lines) in {time.perf_counter() - t0:.0f} s"
        )
        samples: list[tuple[int, float]] = []
        rows_read = [0]
        start_rss = _tree_rss_mb()
        t0 = time.perf_counter()
        with Periodic(lambda: samples.append((rows_read[0], _tree_rss_mb())), 0.25):
            for block in _source(path, args.workers).blocks():
                rows_read[0] += block.num_rows
        secs = time.perf_counter() - t0
        assert rows_read[0] == lines
        by_decile = {}
        for rows, mb in samples:
            by_decile.setdefault(min(9, rows * 10 // lines), []).append(mb)
        deciles = [round(max(by_decile.get(d, [float("nan")])), 1) for d in range(10)]
        peak = peak_rss_mib()
        print(f"read {lines:,} rows in {secs:.0f} s ({lines / secs:,.0f} rows/s)")
        tree_peak = max(mb for _, mb in samples)
        print(
            f"PSS before {start_rss:.0f} MB; max PSS of reader + parser processes per tenth of the file (MB): "
            f"{deciles}; peak {tree_peak:.0f} MB (reader process alone: peak RSS {peak:.0f} MB)"
        )
        return {
            "mode": "rss",
            "file_gb": round(path.stat().st_size / 1e9, 2),
            "rows": lines,
            "rows_per_s": round(lines / secs),
            "pss_start_mb": round(start_rss, 1),
            "pss_max_per_tenth_mb": deciles,
            "peak_pss_mb": round(tree_peak, 1),
            "reader_process_peak_rss_mb": round(peak, 1),
            "first_tenth_over_last_tenth": round(deciles[0] / deciles[-1], 3),
        }
    finally:
        path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, default=1_000_000, help="rows of the comparison file (~270 B each)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per reader; the best is kept")
    parser.add_argument("--workers", type=int, default=2, help="parser processes (or threads) of our reader")
    parser.add_argument(
        "--chunk-kib", type=int, default=None, help="bytes per parsed chunk of our reader (default: its own)"
    )
    parser.add_argument("--rss", action="store_true", help="stream a big file and report RSS instead")
    parser.add_argument("--gb", type=float, default=5.0, help="size of the --rss file")
    parser.add_argument("--dir", default="/tmp", help="where the generated file goes (deleted afterwards)")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds: a 20,000-row file (or 5 MB with --rss), one run each"
    )
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.repeat, args.gb = 20_000, 1, 0.005
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    global CHUNK_KIB
    CHUNK_KIB = args.chunk_kib
    emit(machine_info("numpy", "pyarrow"))
    result = rss(args) if args.rss else compare(args)
    emit(result)


if __name__ == "__main__":
    main()
