"""TensorBoard writer (``backprism.integrations.tensorboard``), read back with TensorBoard's
``EventAccumulator``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backprism.plot import read_log
from tests.synthetic_log import synthetic_records, write_synthetic_log


def _accumulator(log_dir: Path):
    ea_mod = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard not installed (pip install tensorboard)",
    )
    acc = ea_mod.EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0,
                                                               "images": 0})
    acc.Reload()
    return acc


def test_tensorboard_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install tensorboard)")
    from backprism.integrations.tensorboard import TensorBoardWriter

    log_path = write_synthetic_log(tmp_path / "run.jsonl", steps=12)
    log = read_log(log_path)
    with TensorBoardWriter(tmp_path / "tb") as tb:
        n = tb.update(log_path)
        assert n > 0 and tb.update(log_path) == 0  # nothing new the second time
    acc = _accumulator(tmp_path / "tb")
    tags = acc.Tags()
    _x, gn = log.scalar("GradNorm")
    events = acc.Scalars("backprism/GradNorm")
    assert [e.step for e in events] == list(range(12))
    assert [e.value for e in events] == pytest.approx(gn.tolist(), rel=1e-6)
    assert "backprism/GradNorm/param_3" in tags["scalars"]
    assert [e.step for e in acc.Scalars("backprism/HessMaxEV")] == list(range(0, 12, 2))
    assert acc.Scalars("backprism/CABS")[0].value == pytest.approx(32)
    assert [e.step for e in acc.Scalars("metrics/valid_accuracy")] == [9]
    # Alpha is null at step 5: skipped, not written as NaN
    assert 5 not in [e.step for e in acc.Scalars("backprism/Alpha")]
    hist = acc.Histograms("backprism/GradHist1d")
    assert len(hist) == 12
    raw = json.loads(log_path.read_text().splitlines()[1])["values"]["GradHist1d"]
    assert hist[0].histogram_value.num == pytest.approx(sum(raw["hist"]))
    assert list(hist[0].histogram_value.bucket) == pytest.approx(raw["hist"])
    assert "backprism/GradHist2d" in tags["images"]
    assert len(acc.Images("backprism/GradHist2d")) == 6


def test_tensorboard_update_follows_growing_log(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install tensorboard)")
    from backprism.integrations.tensorboard import TensorBoardWriter

    recs = synthetic_records(steps=6, quantities=["Loss"])
    p = tmp_path / "run.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs[:4]))
    tb = TensorBoardWriter(tmp_path / "tb")
    assert tb.update(p) == 3
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tb.update(p) == 3
    tb.close()
    assert [e.step for e in _accumulator(tmp_path / "tb").Scalars("backprism/Loss")] == list(
        range(6))
