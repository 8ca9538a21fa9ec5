"""Terminal summary and diagnostics of a monitor log (``backprism.plot.diagnose``)."""

from __future__ import annotations

from pathlib import Path

from backprism.plot import RunLog, diagnose, inspect_log
from tests.synthetic_log import synthetic_records


def test_diagnose_flags_large_lr_and_small_batch(tmp_path: Path) -> None:
    bad = RunLog.from_records(synthetic_records(steps=50, overshoot=True))
    warnings = " | ".join(diagnose(bad))
    assert "α > 1 for the last 20% of steps" in warnings and "learning rate likely too large" \
        in warnings
    assert "gradient tests fail" in warnings and "batch too small" in warnings
    good = RunLog.from_records(synthetic_records(steps=50, quantities=["Loss", "Alpha"]))
    assert diagnose(good) == []


def test_inspect_log_lists_last_values(log_path: Path) -> None:
    text = inspect_log(log_path)
    assert "tracked steps: 40" in text
    assert "GradHist1d" in text and "histogram" in text
    assert "valid_accuracy" in text
    assert "steps/s" in text
