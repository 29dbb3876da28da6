"""What the benchmark programs in this folder share: the machine, CPU and memory probes, paired A/B runs
and their output.

- The machine: :func:`machine_info` (platform, cores, memory, load, versions) and
  :func:`two_thread_speedup` (how much a second thread gains at all on this machine right now).
- CPU time: :func:`cpu_seconds` (this process, optionally its children), :class:`CpuProbe` (over a
  block: this process's cores used, other processes' cores and the hypervisor's steal, from
  ``/proc/stat``) and :class:`ThreadCpu` (per named thread, from ``/proc/self/task``).
- Memory: :func:`status_kib` (fields of ``/proc/<pid>/status``), :func:`peak_rss_mib` (VmHWM) and
  :class:`RssPeak` (peaks of sampled fields over a block).
- Paired A/B runs: :func:`alternate` (every variant once per repeat, the order reversed on every other
  repeat by :func:`order_of`, so drift in the machine's speed hits all alike) and
  :func:`paired_ratios` (the median of the per-pair ratios with their quartiles: how far one pair
  strays).
- Output: :func:`emit` prints one JSON record per line (a program's LAST line is its result);
  :func:`run_child` runs a command in a fresh process and returns the JSON object of its last line.

The programs import it as ``harness`` (their own folder is the first entry of ``sys.path`` when run as
``python benchmarks/<program>``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

R = TypeVar("R")

# -- the machine ------------------------------------------------------------------------------------


def machine_info(*packages: str) -> dict[str, Any]:
    """The machine, its load, and the versions of Python and of ``packages`` (imported here; "?" for one
    without ``__version__``); with torch among them, its intra-op threads and whether CUDA is there."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for name in packages:
        info[name] = getattr(importlib.import_module(name), "__version__", "?")
    if "torch" in packages:
        torch = sys.modules["torch"]
        info.update(torch_threads=torch.get_num_threads(), cuda=torch.cuda.is_available())
    return info


def two_thread_speedup() -> float:
    """How much faster two threads sort two arrays than one thread sorts both (numpy releases the GIL):
    ~2 on an idle 2-core machine, ~1 when other processes take the second core. Overlapping work on
    threads can only gain where this is above 1, so programs print it beside their ratios."""
    import numpy as np

    arrays = [np.random.default_rng(i).random(1_000_000) for i in range(2)]

    def work(x: np.ndarray) -> None:
        for _ in range(4):
            np.sort(x)

    start = time.perf_counter()
    for x in arrays:
        work(x)
    serial = time.perf_counter() - start
    threads = [threading.Thread(target=work, args=(x,)) for x in arrays]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return serial / (time.perf_counter() - start)


# -- CPU time ---------------------------------------------------------------------------------------


def cpu_seconds(*, children: bool = False) -> float:
    """User + system CPU seconds of all this process's threads so far; with ``children``, plus those of
    its ended (waited-for) child processes."""
    who = [resource.RUSAGE_SELF, *([resource.RUSAGE_CHILDREN] if children else [])]
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))


def machine_cpu() -> tuple[float, float, float]:
    """(busy, steal, total) CPU seconds of the whole machine so far, all CPUs together (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0
    total = sum(fields[:8])
    return (total - idle - steal) / tick, steal / tick, total / tick


@dataclass(frozen=True)
class CpuShare:
    """CPU time over one block: this process's and the whole machine's (see :class:`CpuProbe`)."""

    wall_s: float
    cpu_s: float  # this process (and its children, where asked)
    machine_busy_s: float
    machine_steal_s: float
    machine_total_s: float  # every CPU's seconds, busy or not

    def cores_used(self, seconds: float | None = None) -> float:
        """CPU seconds per second of ``seconds`` (default: the block's wall time): > 1 only where threads
        ran at the same time."""
        return self.cpu_s / max(seconds or self.wall_s, 1e-9)

    @property
    def other_processes_cores(self) -> float:
        """The CPU other processes took meanwhile, in cores."""
        cpus = os.cpu_count() or 1
        return max(0.0, self.machine_busy_s - self.cpu_s) * cpus / max(self.machine_total_s, 1e-9)

    @property
    def steal_fraction(self) -> float:
        """The share of the machine's CPU time the hypervisor took meanwhile."""
        return self.machine_steal_s / max(self.machine_total_s, 1e-9)


class CpuProbe:
    """``with CpuProbe() as probe: ...``; then ``probe.share`` is the block's :class:`CpuShare`."""

    def __init__(self, *, children: bool = False) -> None:
        self._children = children
        self.share: CpuShare | None = None

    def __enter__(self) -> CpuProbe:
        self._start = (time.perf_counter(), cpu_seconds(children=self._children), *machine_cpu())
        return self

    def __exit__(self, *exc: object) -> None:
        now = (time.perf_counter(), cpu_seconds(children=self._children), *machine_cpu())
        self.share = CpuShare(*(b - a for a, b in zip(self._start, now, strict=True)))


class Periodic:
    """Calls ``fn`` once on entering the block, every ``interval_s`` seconds on a daemon thread while it
    runs, and once on leaving it."""

    def __init__(self, fn: Callable[[], None], interval_s: float, *, name: str = "bench-sampler") -> None:
        self._fn = fn
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._fn()

    def __enter__(self) -> Any:
        self._fn()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._fn()


class ThreadCpu(Periodic):
    """CPU seconds of each named thread of this process over the block (read from ``/proc`` every 0.25 s,
    so threads that end keep their last reading). Threads whose names start with one of ``groups`` are
    counted together under that prefix."""

    def __init__(self, groups: Sequence[str] = ()) -> None:
        self._groups = tuple(groups)
        self._tick = os.sysconf("SC_CLK_TCK")
        self._seen: dict[str, tuple[str, float]] = {}  # native thread id -> (name, CPU seconds)
        self._start: dict[str, tuple[str, float]] | None = None
        super().__init__(self._read, 0.25, name="bench-thread-cpu")

    def _read(self) -> None:
        names = {str(t.native_id): t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                self._seen[tid] = (names.get(tid, "other"), (int(fields[11]) + int(fields[12])) / self._tick)
        if self._start is None:  # the reading on entering the block
            self._start = dict(self._seen)

    def per_name(self) -> dict[str, float]:
        """CPU seconds per thread name (or group), most first; those under 5 ms are left out."""
        start = self._start or {}
        out: dict[str, float] = {}
        for tid, (name, cpu) in self._seen.items():
            name = next((g for g in self._groups if name.startswith(g)), name)
            out[name] = out.get(name, 0.0) + cpu - start.get(tid, (name, 0.0))[1]
        return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0.005}


# -- memory -----------------------------------------------------------------------------------------


def status_kib(*fields: str, pid: int | str = "self") -> dict[str, int]:
    """The named memory fields of ``/proc/<pid>/status`` in KiB (VmRSS, VmHWM, RssAnon, RssFile, ...);
    a field the kernel does not report is 0."""
    out = dict.fromkeys(fields, 0)
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1])
    return out


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (VmHWM: mapped file pages included), in MiB."""
    return status_kib("VmHWM")["VmHWM"] / 1024


class RssPeak(Periodic):
    """Peaks of memory fields of ``/proc/self/status`` sampled every ``interval_s`` over the block:
    ``start`` and ``peak`` map each field to KiB (VmHWM is the kernel's own peak; RssAnon, what the
    process itself allocated, has none)."""

    def __init__(
        self, fields: Sequence[str] = ("VmRSS", "RssAnon", "RssFile"), interval_s: float = 0.05
    ) -> None:
        self.fields = tuple(fields)
        self.start = status_kib(*self.fields)
        self.peak = dict(self.start)
        super().__init__(self._sample, interval_s, name="bench-rss")

    def _sample(self) -> None:
        for key, value in status_kib(*self.fields).items():
            self.peak[key] = max(self.peak[key], value)


# -- paired A/B runs --------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def order_of(names: Sequence[str], repeat: int) -> list[str]:
    """The variants' order in repeat ``repeat``: as given on even repeats, reversed on odd ones."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


def alternate(names: Sequence[str], repeats: int, run: Callable[[str, int], R]) -> dict[str, list[R]]:
    """``run(name, repeat)`` for every name, ``repeats`` times, in :func:`order_of` (A B C, C B A, A B C,
    ...), so that drift in the machine's speed hits every variant alike and each pair of neighbouring
    runs is back to back. Each name's results by repeat."""
    out: dict[str, list[R]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in order_of(names, repeat):
            out[name].append(run(name, repeat))
    return out


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, Any]:
    """The ratio of each pair (one repeat's candidate and baseline, run back to back), their median and
    quartiles: on a machine whose speed swings between runs, the spread says how far one ratio can be
    trusted. Pass speeds as (candidate, baseline), times as (baseline, candidate)."""
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "ratios": [round(r, 4) for r in ratios],
        "q1": low,
        "median": statistics.median(ratios),
        "q3": high,
    }


def window_rate(windows: Sequence[Mapping[str, Any]], start_step: int, *, part: slice | None = None) -> float:
    """Samples/s over training log windows (records with ``step``, the window's last step, and
    ``samples_per_s``): total samples over total time, each window weighted by its steps (the batch size is
    the same in every window). ``part`` picks windows, e.g. :func:`last_tenth`; ``start_step``: the step the
    fit started at (the first window's start). The one definition every program's first/last tenth uses."""
    starts = [start_step] + [int(w["step"]) for w in windows[:-1]]
    spans = [(int(w["step"]) - s, float(w["samples_per_s"])) for w, s in zip(windows, starts, strict=True)]
    chosen = spans[part] if part is not None else spans
    return sum(n for n, _ in chosen) / sum(n / rate for n, rate in chosen)


def first_tenth(count: int) -> slice:
    """The first tenth of ``count`` windows (at least one)."""
    return slice(0, max(1, count // 10))


def last_tenth(count: int) -> slice:
    """The last tenth of ``count`` windows (at least one)."""
    return slice(count - max(1, count // 10), count)


# -- output -----------------------------------------------------------------------------------------


def rounded(value: Any, digits: int | None = 4) -> Any:
    """``value`` with every float in it (in dicts, lists and tuples too) rounded to ``digits``."""
    if digits is None:
        return value
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, Mapping):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def emit(record: Mapping[str, Any], *, digits: int | None = 4) -> None:
    """Print ``record`` as one JSON line, floats rounded to ``digits`` (None: as they are)."""
    print(json.dumps(rounded(record, digits)), flush=True)


def last_json(text: str) -> dict[str, Any]:
    """The JSON object on the last non-empty line of ``text`` (a program's result)."""
    return json.loads(text.strip().splitlines()[-1])


def run_child(
    args: Sequence[str], *, cwd: Path | str | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run ``python args...`` in a fresh process (its own peak RSS, no warm caches of this one) and return
    the JSON object of its last output line; a failure raises with the child's stderr."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return last_json(proc.stdout)


def quiet() -> None:
    """No planner chatter or warnings: the output is one JSON record per line (a trainer's progress
    bar is silenced through its spec, see ``tiered_training.runs``)."""
    logging.getLogger().setLevel(logging.ERROR)
    for name in ("torchrec", "recsys", "pipelines", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
