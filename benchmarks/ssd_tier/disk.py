"""The disk side of the SSD-tier benchmarks: this process's and the device's I/O counters (and their
rates over any span of a block), write amplification, dropping a store's file from the page cache, and store-like random 8-byte keys."""

from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path

import numpy as np
from harness import Periodic

from embedding_store.hashing import mix64

ROW_BYTES = 260  # 64 float32 + one row-wise Adagrad float


def _device_stat(path: Path) -> Path | None:
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


class DiskIo:
    """This process's and the store's device's I/O counters since construction (the device's: ios and bytes
    read, bytes written, and ``dev_busy_ms`` / ``dev_queue_ms``, its busy time and its time weighted by the
    requests in flight)."""

    def __init__(self, path: Path) -> None:
        self._dev = _device_stat(path)
        self._start = self._read()

    def _read(self) -> dict[str, int]:
        with open("/proc/self/io") as f:
            out = {k: int(v) for k, v in (line.split(": ") for line in f)}
        if self._dev is not None:
            f = [int(x) for x in self._dev.read_text().split()]
            out.update(dev_read_ios=f[0], dev_read_bytes=512 * f[2], dev_write_bytes=512 * f[6])
            out.update(dev_busy_ms=f[9], dev_queue_ms=f[10])
        return out

    def delta(self) -> dict[str, int]:
        end = self._read()
        keys = ("read_bytes", "write_bytes", "wchar", "dev_read_ios", "dev_read_bytes", "dev_write_bytes")
        keys += ("dev_busy_ms", "dev_queue_ms")
        return {k: end[k] - self._start[k] for k in keys if k in end}


class DiskTimeline(Periodic):
    """Major faults, CPU seconds and the disk's counters every ``interval_s`` over the block, so that the
    last tenth of the fit (by wall time) has its own rates: whether the table still faults and reads then."""

    def __init__(self, disk_path: Path, interval_s: float = 1.0) -> None:
        self._disk = DiskIo(disk_path)
        self.t0 = time.perf_counter()
        self.points: list[dict[str, float]] = []
        super().__init__(self._sample, interval_s, name="bench-timeline")

    def _sample(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        io = self._disk.delta()
        self.points.append(
            {
                "t": time.perf_counter() - self.t0,
                "major_faults": usage.ru_majflt,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                **{
                    k: io.get(k, 0)
                    for k in ("dev_read_bytes", "dev_write_bytes", "dev_busy_ms", "dev_queue_ms")
                },
            }
        )

    def rates(self, start_s: float, end_s: float) -> dict[str, float]:
        """Rates between the samples nearest ``start_s`` and ``end_s`` (seconds since the block began)."""
        if len(self.points) < 2:
            return {}
        a = min(self.points, key=lambda p: abs(p["t"] - start_s))
        b = min(self.points, key=lambda p: abs(p["t"] - end_s))
        span = b["t"] - a["t"]
        if span <= 0:
            return {}
        d = {k: b[k] - a[k] for k in a}
        return {
            "major_faults_per_s": d["major_faults"] / span,
            "cores_used": d["cpu_s"] / span,
            "disk_read_mb_per_s": d["dev_read_bytes"] / span / 1e6,
            "disk_write_mb_per_s": d["dev_write_bytes"] / span / 1e6,
            "disk_busy_fraction": d["dev_busy_ms"] / (1e3 * span),
            "disk_mean_queue": d["dev_queue_ms"] / (1e3 * span),
        }


def write_amplification(disk: dict[str, int], rows: int) -> dict[str, float]:
    """Bytes written / payload: ``disk`` = min(``write_syscalls``: what LMDB handed the kernel, which the
    page cache can only coalesce; ``device``: what the whole device wrote); ``proc_write_bytes`` is
    /proc/self/io's count, which charges a whole large folio per page dirtied in it."""
    payload = rows * ROW_BYTES
    out = {"proc_write_bytes": disk["write_bytes"] / payload, "write_syscalls": disk["wchar"] / payload}
    if "dev_write_bytes" in disk:
        out["device"] = disk["dev_write_bytes"] / payload
    out["disk"] = min(out["write_syscalls"], out.get("device", math.inf))
    return out


def drop_from_cache(path: Path) -> None:
    """fsync ``path/data.mdb`` and drop it from the page cache (its environment closed, or idle: pages its
    map holds stay cached)."""
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def hashed_ids(n: int) -> np.ndarray:
    """N distinct hashed ids (63-bit, as int64), sorted: random 8-byte keys like the store's."""
    ids = np.sort((mix64(np.arange(n, dtype=np.uint64)) >> np.uint64(1)).view(np.int64))
    assert bool((ids[1:] != ids[:-1]).all())
    return ids
