"""The stall warning's advice names settings that exist, for every stage of the training pipeline."""

from __future__ import annotations

import re

from pipelines.config import Stage
from recsys.config import RunConfig
from recsys.loop import STALL_ADVICE


def test_every_feeding_stage_has_advice_naming_real_settings() -> None:
    assert set(STALL_ADVICE) == {s.value for s in Stage} - {Stage.COMPUTE.value}
    config = RunConfig()
    for advice in STALL_ADVICE.values():
        for section, key in re.findall(r"\b(store|data|pipeline|train)\.([a-z_]+)\b", advice):
            assert hasattr(getattr(config, section), key), f"{section}.{key}"
