"""Every pipeline test must leave no worker thread behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

PREFIX = "tierrec-pipeline-"


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(PREFIX)]


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    assert not pipeline_threads(), "a previous test leaked pipeline workers"
    yield
    # no grace period: close() (called at end of stream, on error, and by the with block) joins every
    # worker before it returns, so any worker still alive here is a leak
    assert not pipeline_threads(), f"leaked pipeline workers: {pipeline_threads()}"
