"""Safetensors files written in chunks: a table larger than memory goes out a buffer of rows at a time
(``recsys export``)."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Chunks", "DTYPE_BYTES", "SAFETENSORS_DTYPES", "write_safetensors", "tensor_chunks"]

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
}
DTYPE_BYTES = {"F32": 4, "F16": 2, "F64": 8, "I64": 8, "I32": 4}

Chunks = Callable[[], Iterator[np.ndarray]]


def write_safetensors(
    path: Path, entries: list[tuple[str, tuple[int, ...], str, Chunks]], meta: dict[str, str]
) -> None:
    """Write a safetensors file whose tensors arrive in chunks (rows of each, in order).

    The format: an 8-byte little-endian header length, a JSON header of every tensor's dtype, shape and
    byte range (padded with spaces to 8 bytes), then the tensors' bytes back to back.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, _shape, _dtype, chunks in entries:
            start = f.tell()
            for chunk in chunks():
                f.write(np.ascontiguousarray(chunk).data)
            begin, end = header[name]["data_offsets"]
            if f.tell() - start != end - begin:
                raise RuntimeError(f"export: {name} wrote {f.tell() - start} bytes, expected {end - begin}")
        f.flush()
        os.fsync(f.fileno())


def tensor_chunks(tensor: torch.Tensor, rows: int) -> Chunks:
    """A tensor's bytes, ``rows`` rows at a time."""

    def chunks() -> Iterator[np.ndarray]:
        if tensor.dim() == 0 or tensor.shape[0] == 0:
            yield tensor.detach().contiguous().numpy()
            return
        for start in range(0, tensor.shape[0], rows):
            yield tensor[start : start + rows].detach().contiguous().numpy()

    return chunks
