"""The matplotlib dashboard (``backprism.plot.dashboard``) on synthetic monitor logs and on a
real monitor: panels and titles, image formats, untracked quantities, monitor-like objects,
the live mode following a growing log.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.synthetic_log import synthetic_records, write_synthetic_log

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from backprism.plot import Dashboard, RunLog, build_panels, read_log  # noqa: E402

EXPECTED_TITLES = {
    "α gauge", "Distance & update size", "Gradient norm", "Hyperparameters", "Gradient tests",
    "norm test", "inner-product test", "orthogonality test", "Max. Hessian eigenvalue",
    "Hessian trace", "Takeuchi information criterion", "GSNR & early stopping", "Performance",
}


def test_dashboard_png(log_path: Path, tmp_path: Path) -> None:
    dash = Dashboard(figsize=(12, 9), dpi=60)
    fig = dash.draw(log_path)
    titles = {ax.get_title(loc="left") for ax in fig.axes}
    assert titles >= EXPECTED_TITLES
    assert any(t.startswith("Gradient histogram (step 39)") for t in titles)
    assert any(t.startswith("Gradient vs. parameter (step 38)") for t in titles)
    assert all(p.tracked for p in dash.panels)
    out = dash.save(tmp_path / "dash.png")
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (9 * 60, 12 * 60)
    for fmt in ("pdf", "svg"):
        assert dash.save(tmp_path / f"dash.{fmt}").stat().st_size > 1000
    with pytest.raises(ValueError, match="unsupported image format"):
        dash.save(tmp_path / "dash.gif")
    dash.close()


def test_missing_quantities_say_not_tracked(tmp_path: Path) -> None:
    p = write_synthetic_log(tmp_path / "r.jsonl", steps=12, quantities=["Loss", "GradNorm"])
    dash = Dashboard(figsize=(10, 8), dpi=40)
    fig = dash.draw(p)
    panels = {q.key: q for q in dash.panels}
    assert panels["gradnorm"].tracked and panels["performance"].tracked
    assert not panels["alpha"].tracked and "Alpha" in panels["alpha"].note
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any(t.startswith("not tracked (add Alpha)") for t in texts)
    dash.close()


def test_draw_accepts_monitor_like_object(tmp_path: Path) -> None:
    recs = synthetic_records(steps=8, quantities=["Loss", "Alpha"])

    class Recorded:
        def get_output(self) -> list[dict]:
            return recs

    fig = Dashboard(figsize=(8, 6), dpi=30).draw(Recorded())
    assert "α gauge" in {ax.get_title(loc="left") for ax in fig.axes}
    by_step = {r["step"]: r["values"] for r in recs if r["kind"] == "step"}
    log = RunLog.from_records(recs)
    from backprism.plot import load

    assert load(by_step).scalar("Loss")[1].tolist() == log.scalar("Loss")[1].tolist()


def test_watch_redraws_growing_log(tmp_path: Path) -> None:
    recs = synthetic_records(steps=10, quantities=["Loss", "GradNorm"])
    p = tmp_path / "live.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs[:4]))
    seen: list[int] = []

    def grow(log: RunLog) -> None:
        seen.append(log.num_steps)
        with p.open("a") as f:  # the run goes on: more steps, the last one half-written
            f.write("".join(json.dumps(r) + "\n" for r in recs[4:8]) + json.dumps(recs[8])[:15])

    dash = Dashboard(figsize=(8, 6), dpi=30)
    n = dash.watch(p, interval=0.01, out=tmp_path / "live.png", max_updates=2, timeout=20,
                   on_update=grow)
    assert n == 2 and seen == [3, 7]
    assert (tmp_path / "live.png").exists()
    dash.close()


def test_draw_real_monitor_and_its_log(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import warnings

    from torch import nn

    import backprism
    from backprism.monitor import Monitor, quantities, schedules

    torch.manual_seed(0)
    model = backprism.extend(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)))
    lossfunc = backprism.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    every = schedules.linear(1)
    qs = [quantities.Loss(every), quantities.GradNorm(every), quantities.Alpha(every),
          quantities.GradHist1d(every), quantities.CABS(every)]
    monitor = Monitor(model.parameters(), qs, log_path=tmp_path / "m.jsonl")
    for step in range(5):
        X, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
        opt.zero_grad()
        out = model(X)
        loss = lossfunc(out, y)
        info = {"loss": loss, "batch_size": 16, "optimizer": opt,
                "individual_losses": nn.functional.cross_entropy(out, y, reduction="none")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with monitor(step, info=info):
                loss.backward()
        opt.step()
        monitor.log(step, epoch=0, train_loss=float(loss.detach()), learning_rate=0.1)
    monitor.close()
    from backprism.plot import load

    live, saved = load(monitor), read_log(tmp_path / "m.jsonl")
    for key in ("Loss", "GradNorm", "Alpha", "CABS"):
        assert live.scalar(key)[0].tolist() == saved.scalar(key)[0].tolist()
        assert np.allclose(live.scalar(key)[1], saved.scalar(key)[1], equal_nan=True)
    assert saved.scalar("Alpha")[0].tolist() == [0, 1, 2, 3]  # arrives one step late
    assert "Alpha/fit" in saved.tracked  # auxiliary record: no panel of its own
    assert [p.key for p in build_panels(saved) if p.group == "Other"] == []
    assert live.metric("train_loss")[0].tolist() == [0, 1, 2, 3, 4]
    dash = Dashboard(figsize=(10, 8), dpi=40)
    dash.draw(monitor)
    panels = {p.key: p for p in dash.panels}
    assert all(panels[k].tracked for k in ("alpha", "hist1d", "hyperparameters"))
    dash.close()
