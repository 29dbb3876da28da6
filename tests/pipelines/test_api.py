"""The public surface: docstring examples run, Stage names flow through, constructors stay small."""

from __future__ import annotations

import doctest
import inspect
import json

import pytest

import pipelines
from pipelines import (
    DeviceContext,
    PipelineConfig,
    Stage,
    StagedPipeline,
    StageFailed,
    StageSpec,
    device,
    staged,
    timeline,
)
from pipelines import config as config_module


@pytest.mark.parametrize("module", [config_module, device, staged, timeline])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.failed == 0


@pytest.mark.parametrize("cls", [StagedPipeline, DeviceContext, pipelines.Timeline])
def test_constructors_take_at_most_five_arguments(cls):
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    assert len(params) <= 5
    assert all(p.kind is p.KEYWORD_ONLY for p in params[1:] if p.default is not p.empty)


def test_stage_enum_names_read_plain_in_stats_and_errors():
    def fail(item):
        raise OSError("disk gone")

    stages = [StageSpec(name=Stage.PREFETCH, fn=lambda x: x), StageSpec(name=Stage.FILL, fn=fail)]
    config = PipelineConfig(source_name=Stage.LOAD)
    pipe = StagedPipeline(range(3), stages, config=config, device=DeviceContext("cpu"))
    with pytest.raises(StageFailed, match=r"stage 'fill' failed on batch 0: OSError: disk gone"), pipe:
        list(pipe)
    assert json.loads(json.dumps(pipe.stats()))["stages"].keys() == {"load", "prefetch", "fill", "compute"}
