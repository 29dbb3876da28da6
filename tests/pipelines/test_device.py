"""DeviceContext: the CPU branch for real here; the CUDA branch where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from pipelines import DeviceContext, PipelineConfig, PipelineMode, StagedPipeline, StageSpec

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_branch_is_null_streams_complete_events_plain_tensors():
    ctx = DeviceContext("cpu")
    assert not ctx.is_cuda
    ctx.bind_thread()
    stream = ctx.new_stream()
    assert stream is None
    x = torch.arange(6.0)
    with ctx.stream(stream):
        pinned = ctx.pin(x)
        moved = ctx.to_device(pinned)
        ctx.record_stream({"x": moved, "list": [moved, (moved,)], "other": 3})
        event = ctx.record()
    assert pinned is x and moved is x  # the device is the host: nothing to copy
    assert event.query() is True
    event.synchronize()
    ctx.wait(event)
    ctx.wait(None)
    ctx.synchronize()


def test_default_device_follows_cuda_availability():
    assert DeviceContext().is_cuda == torch.cuda.is_available()


def test_rejects_other_devices():
    with pytest.raises(ValueError, match="cuda or cpu"):
        DeviceContext("meta")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"source_capacity": 0}, "source_capacity"),
        ({"trace_batches": -1}, "trace_batches"),
        ({"stall_fraction": 0.0}, "stall_fraction"),
        ({"join_timeout_s": 0}, "join_timeout_s"),
        ({"source_name": ""}, "source_name"),
        ({"source_name": "x", "consumer_name": "x"}, "consumer_name"),
        ({"mode": "pipelined"}, "mode"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PipelineConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"name": "", "fn": abs}, "name"),
        ({"name": "a", "fn": 3}, "fn"),
        ({"name": "a", "fn": abs, "capacity": 0}, "capacity"),
    ],
)
def test_stage_spec_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StageSpec(**kwargs)


@cuda
@pytest.mark.timeout(60)
def test_cuda_streams_order_copies_and_kernels_across_stages():
    """Pinned non_blocking copies on one stream, big kernels on the next, read on the consumer's stream.

    Without the events between streams the second stage or the consumer would read half-copied or
    half-computed tensors; the result must equal the sequential run bit for bit.
    """
    ctx = DeviceContext("cuda")
    n = 2048

    def make(seed: int) -> torch.Tensor:
        return torch.randn(n, n, generator=torch.Generator().manual_seed(seed))

    def h2d(x: torch.Tensor) -> torch.Tensor:
        return ctx.to_device(ctx.pin(x))

    def square(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):  # long enough that an unordered reader would overtake it
            x = x @ x / n
        return x

    stages = [StageSpec(name="h2d", fn=h2d), StageSpec(name="square", fn=square)]

    def run(mode: PipelineMode) -> list[torch.Tensor]:
        config = PipelineConfig(mode=mode)
        with StagedPipeline((make(s) for s in range(6)), stages, config=config, device=ctx) as pipe:
            return [y.sum(dim=0).cpu() for y in pipe]

    pipelined, sequential = run(PipelineMode.PIPELINED), run(PipelineMode.SEQUENTIAL)
    for a, b in zip(pipelined, sequential, strict=True):
        assert torch.equal(a, b)


@cuda
@pytest.mark.timeout(60)
def test_cuda_sync_with_consumer_orders_fill_after_consumer_kernels():
    """A fill stage overwrites a shared device buffer the consumer read two batches earlier.

    The fill of batch j reuses buffer j % 2, which the consumer's (slow) kernels of batch j - 2 read;
    ``sync_with_consumer`` makes the fill's stream wait for them, so every batch sees its own values.
    """
    ctx = DeviceContext("cuda")
    n = 2048
    slots = [torch.zeros(n, n, device=ctx.device) for _ in range(2)]

    def fill(batch: int) -> int:
        slots[batch % 2].fill_(float(batch))
        return batch

    stages = [StageSpec(name="fill", fn=fill, capacity=1, sync_with_consumer=True)]
    results = []
    with StagedPipeline(range(8), stages, device=ctx) as pipe:
        for batch in pipe:
            x = slots[batch % 2]
            acc = x.clone()
            for _ in range(6):
                acc = acc @ (x / n)  # slow reader of the slot
            results.append((batch, x.mean()))
    ctx.synchronize()
    for batch, mean in results:
        assert mean.item() == float(batch)


def test_record_stream_walk_finds_device_data_only():
    """Which objects would get ``record_stream`` on CUDA; CPU tensors never do (they have no streams)."""
    import dataclasses

    from pipelines.device import _walk

    class FakeCudaKjt:
        def device(self) -> torch.device:
            return torch.device("cuda", 0)

        def record_stream(self, stream) -> None:  # pragma: no cover - only found, never called here
            pass

    class FakeHostKjt(FakeCudaKjt):
        def device(self) -> torch.device:
            return torch.device("cpu")

    @dataclasses.dataclass
    class Batch:
        dense: torch.Tensor
        sparse: object

        def record_stream(self, stream) -> None:  # pragma: no cover - fields are walked instead
            raise AssertionError

    kjt = FakeCudaKjt()
    found = list(_walk({"a": [torch.ones(2), (kjt, FakeHostKjt())], "b": Batch(torch.ones(1), kjt), "c": 3}))
    assert found == [kjt, kjt]
