"""Fixtures of the embedding_store tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def store_dir(tmp_path):
    """A fresh store directory."""
    return tmp_path / "store"
