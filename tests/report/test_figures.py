"""The instrument panels as Plotly figures (``backprism.report.figures``), for notebooks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from backprism.report import build_figures
from tests.synthetic_log import write_synthetic_log

needs_plotly = pytest.mark.skipif(importlib.util.find_spec("plotly") is None,
                                  reason="plotly not installed (pip install 'backprism[report]')")


@needs_plotly
def test_build_figures_for_notebooks(tmp_path: Path) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=10, quantities=["Loss", "Alpha"])
    figs = build_figures(log, smoothing=0)
    assert sorted(figs) == ["alpha", "hyperparameters", "performance"]
    assert type(figs["performance"]).__name__ == "Figure"
