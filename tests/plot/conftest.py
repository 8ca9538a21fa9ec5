"""Fixtures of the viewer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.synthetic_log import write_synthetic_log


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return write_synthetic_log(tmp_path / "run.jsonl", steps=40)
