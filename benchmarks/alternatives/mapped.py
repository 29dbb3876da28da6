"""bench_alternatives' memory-mapped table: FBGEMM's weights over one file-backed shared mapping, and the
kernel's settings and counters that decide how it behaves."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

__all__ = ["MADV_RANDOM", "MADV_SEQUENTIAL", "MappedWeights", "meminfo_kib", "vm_dirty_settings"]

MADV_RANDOM, MADV_SEQUENTIAL, MS_SYNC = 1, 2, 4
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = _LIBC.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class _Buffers(dict):  # type: ignore[type-arg]
    """FBGEMM's ``preallocated_host_buffers``, passed through TorchRec's fused parameters: TorchRec groups
    tables by those (so they must hash) and copies them per table (so a copy must be the same object, or
    each table would get its own group and the file would be copied into memory)."""

    __hash__ = object.__hash__

    def __copy__(self) -> _Buffers:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Buffers:
        return self


class MappedWeights:
    """Builds the weights of the in-memory tables over one file (``TrainSpec.fused_params``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.weights: torch.Tensor | None = None

    def __call__(self, tables: list[Any]) -> dict[str, Any]:
        total = sum(t.num_embeddings * t.embedding_dim for t in tables)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.weights = torch.from_file(str(self.path), shared=True, size=total, dtype=torch.float32)
        self.advise(MADV_SEQUENTIAL)  # the initialisation writes every row in order: read ahead for it
        return {"preallocated_host_buffers": _Buffers(weights=self.weights)}

    def advise(self, advice: int) -> None:
        """``madvise`` the whole mapping (MADV_RANDOM for training: no read-ahead around a fault)."""
        assert self.weights is not None
        if _LIBC.madvise(self.weights.data_ptr(), self.weights.numel() * 4, advice) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({advice}) failed")

    def msync(self) -> None:
        """Write the mapping's dirty pages to the file and wait for them (the model made durable)."""
        assert self.weights is not None
        if _LIBC.msync(self.weights.data_ptr(), self.weights.numel() * 4, MS_SYNC) != 0:
            raise OSError(ctypes.get_errno(), "msync failed")


def vm_dirty_settings() -> dict[str, int]:
    """The kernel's dirty-page write-back settings (``/proc/sys/vm/dirty_*``)."""
    out = {}
    for p in sorted(Path("/proc/sys/vm").glob("dirty_*")):
        try:
            out[p.name] = int(p.read_text().split()[0])
        except (OSError, ValueError):
            continue
    return out


def meminfo_kib(*fields: str) -> dict[str, int]:
    out = dict.fromkeys(fields, 0)
    for line in Path("/proc/meminfo").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in out:
            out[key] = int(line.split()[1])
    return out
