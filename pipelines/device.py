"""One stream/event abstraction, so the same scheduling code runs on CUDA and on CPU.

On CUDA every pipeline stage gets its own side stream; an event recorded after a stage's work and waited
on by the next stage's stream orders the work between streams without blocking the host, host tensors
are pinned so host-to-device copies can be ``non_blocking``, and ``record_stream`` tells the caching
allocator that a tensor made on one stream is still in use on another.

On CPU there are no streams: ``stream()`` is a null context, events are already complete, ``wait`` is a
no-op and ``to_device`` returns the tensor itself (the device *is* the host, so the result may alias the
input). The worker threads of the pipeline still overlap, since the stages release the GIL in torch ops,
I/O and sleeps.

Which branch runs is decided once, from the device: ``DeviceContext()`` takes ``cuda`` when
``torch.cuda.is_available()`` and ``cpu`` otherwise.

Example:
    >>> ctx = DeviceContext("cpu")
    >>> stream = ctx.new_stream()
    >>> with ctx.stream(stream):
    ...     x = ctx.to_device(ctx.pin(torch.ones(4)))
    ...     done = ctx.record()
    >>> ctx.wait(done)  # the current stream now runs after everything enqueued before ``done``
    >>> done.query()
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = ["DeviceContext", "Event"]


class Event(Protocol):
    """A point in a stream's work: ``torch.cuda.Event`` on CUDA, an always-complete event on CPU."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _CompleteEvent:
    """CPU event: work on the CPU is done when the call that enqueued it returns."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_COMPLETE = _CompleteEvent()


class DeviceContext:
    """Streams, events, pinned memory and copies for one device (CUDA or CPU).

    Args:
        device: the compute device; None picks ``cuda`` (the current CUDA device) when
            ``torch.cuda.is_available()``, else ``cpu``.

    Streams and the current device are per thread in PyTorch: a worker thread calls ``bind_thread()``
    once, then enters ``stream(s)`` around its work.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"DeviceContext.device must be a cuda or cpu device, got {self.device}")

    @property
    def is_cuda(self) -> bool:
        """True when streams, events and pinned memory are real."""
        return self.device.type == "cuda"

    def bind_thread(self) -> None:
        """Make this device current in the calling thread (CUDA: a new thread starts on device 0)."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def new_stream(self) -> torch.cuda.Stream | None:
        """A new side stream (CUDA) or None (CPU: everything runs in the calling thread)."""
        return torch.cuda.Stream(device=self.device) if self.is_cuda else None

    def stream(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
        """Context manager making ``stream`` current in this thread; a null context for None / CPU."""
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def record(self) -> Event:
        """An event marking everything enqueued so far on this thread's current stream."""
        if not self.is_cuda:
            return _COMPLETE
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Event | None) -> None:
        """Make the current stream wait for ``event`` (device-side; the host does not block)."""
        if self.is_cuda and isinstance(event, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(event)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked copy of a host tensor on CUDA (so copies can be asynchronous); itself on CPU."""
        if self.is_cuda and tensor.device.type == "cpu" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the device; asynchronous on the current stream when it is pinned host memory.

        The copy is ordered on the current stream: a consumer on another stream must ``wait`` on an
        event recorded after it. On CPU this returns ``tensor`` itself.
        """
        non_blocking = self.is_cuda and tensor.device.type == "cpu" and tensor.is_pinned()
        return tensor.to(self.device, non_blocking=non_blocking)

    def record_stream(self, obj: Any) -> None:
        """Mark the device tensors in ``obj`` as used on the current stream (no-op on CPU).

        Without this the caching allocator could hand a tensor's memory, freed by the thread that made it
        on another stream, to new work while this stream still reads it. ``obj`` may be a tensor, an
        object with a ``record_stream(stream)`` method (TorchRec's KeyedJaggedTensor, Pipelineable),
        a dataclass, or a list/tuple/dict of these.
        """
        if not self.is_cuda:
            return
        current = torch.cuda.current_stream(self.device)
        for tensor_like in _walk(obj):
            tensor_like.record_stream(current)

    def synchronize(self) -> None:
        """Block the host until all work on the device has finished (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def __repr__(self) -> str:
        return f"DeviceContext({str(self.device)!r})"


def _walk(obj: Any) -> Iterator[Any]:
    """Yield the device tensors (and device objects that record their own streams) inside ``obj``.

    Host data is skipped: ``record_stream`` is defined for CUDA memory only, and a batch passes through
    stages while it still lives on the host (the loader, the host-to-device stage's input).
    """
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda":
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _walk(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _walk(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # the fields, not the dataclass's own record_stream: some fields may still be on the host
        for field in dataclasses.fields(obj):
            yield from _walk(getattr(obj, field.name))
    elif callable(getattr(obj, "record_stream", None)) and _device_type(obj) == "cuda":
        yield obj  # e.g. a KeyedJaggedTensor: it knows its own tensors


def _device_type(obj: Any) -> str | None:
    """``obj.device`` (attribute or method, as KeyedJaggedTensor has it) as a type string, if any."""
    dev = getattr(obj, "device", None)
    if callable(dev):
        dev = dev()
    return dev.type if isinstance(dev, torch.device) else None
