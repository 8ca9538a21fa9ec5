"""Dashboard, log reader and diagnostics on synthetic monitor logs.

``write_synthetic_log`` simulates the quantities of a training run from plausible dynamics (a
noisy quadratic: loss decaying to a floor, α drifting with the learning rate, gradient tests
growing as the signal fades) in the monitor's JSONL schema; the other viewer tests import it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from backprism.plot import Dashboard, RunLog, build_panels, diagnose, inspect_log, read_log  # noqa: E402
from backprism.plot.logdata import combine  # noqa: E402
from backprism.plot.panels import ema  # noqa: E402

ALL_QUANTITIES = [
    "Loss", "Alpha", "Distance", "UpdateSize", "GradNorm", "NormTest", "InnerTest",
    "OrthoTest", "GradHist1d", "GradHist2d", "TICDiag", "TICTrace", "HessTrace", "HessMaxEV",
    "MeanGSNR", "CABS", "EarlyStopping", "Time",
]


def synthetic_records(
    steps: int = 60,
    quantities: list[str] | None = None,
    lr: float = 0.1,
    overshoot: bool = False,
    seed: int = 0,
    n_params: int = 4,
) -> list[dict]:
    """Records of a simulated run on a noisy quadratic with ``n_params`` parameter tensors.

    Loss ``L_t = L_* + (L_0 − L_*) e^{−t/τ}`` plus noise; the gradient norm is ``√(2 λ (L−L_*))``;
    α follows ``η λ − 1`` (with ``overshoot``, η λ grows beyond 2 late in training, α > 1).
    """
    rng = np.random.default_rng(seed)
    quantities = ALL_QUANTITIES if quantities is None else quantities
    recs: list[dict] = [{"kind": "meta", "version": 1, "quantities": list(quantities)}]
    theta = np.zeros(n_params)
    t0 = 0.0
    for t in range(steps):
        frac = t / max(1, steps - 1)
        lam = 2.0 + 0.5 * math.sin(t / 7) + rng.normal(0, 0.05)
        eta = lr * (3 + 2 * frac if overshoot else 1.0) * 10 / lam
        gap = 2.0 * math.exp(-t / (steps / 4)) + 0.05
        loss = 0.1 + gap + rng.normal(0, 0.03)
        gnorm = math.sqrt(2 * lam * gap) * (1 + rng.normal(0, 0.05))
        per = np.abs(rng.dirichlet(np.ones(n_params))) ** 0.5 * gnorm
        update = per * eta
        theta += update
        alpha = eta * lam / 2 - 1 + rng.normal(0, 0.15)
        noise = 0.3 + 3 * frac  # gradient becomes noise-dominated
        t0 += 0.02 + rng.uniform(0, 0.005)
        g = rng.normal(0, gnorm / 30, 2000)
        w = rng.normal(0, 0.3, 2000)
        h1, e1 = np.histogram(g, bins=30)
        h2, xe, ye = np.histogram2d(g, w, bins=(20, 25))
        values = {
            "Loss": loss,
            "Alpha": alpha,
            "Distance": [float(v) for v in np.abs(theta)],
            "UpdateSize": [float(v) for v in update],
            "GradNorm": [float(v) for v in per],
            "NormTest": noise * (1 + rng.normal(0, 0.1)),
            "InnerTest": 0.5 * noise * (1 + rng.normal(0, 0.1)),
            "OrthoTest": 0.7 * noise * (1 + rng.normal(0, 0.1)),
            "GradHist1d": {"hist": h1.tolist(), "edges": e1.tolist()},
            "GradHist2d": {"hist": h2.tolist(), "edges": [xe.tolist(), ye.tolist()]},
            "TICDiag": 5 + 3 * frac + rng.normal(0, 0.2),
            "TICTrace": 4 + 2 * frac + rng.normal(0, 0.2),
            "HessTrace": [float(v) for v in rng.uniform(0.5, 1.5, n_params) * lam],
            "HessMaxEV": lam * 3,
            "MeanGSNR": 2.0 / (1 + 5 * frac) + rng.normal(0, 0.02),
            "CABS": {"cabs": 32 * (1 + 3 * frac)},
            "EarlyStopping": -1.0 + 1.2 * frac,
            "Time": t0,
        }
        every_other = {"GradHist2d", "HessMaxEV", "HessTrace", "TICDiag", "TICTrace"}
        vals = {k: v for k, v in values.items() if k in quantities
                and (k not in every_other or t % 2 == 0)}
        if t == 5 and "Alpha" in vals:
            vals["Alpha"] = None  # a NaN is logged as null
        recs.append({"kind": "step", "step": t, "values": vals})
        if t % 10 == 9:
            recs.append({
                "kind": "log", "step": t, "epoch": t // 10, "train_loss": loss,
                "valid_loss": loss + 0.05 + 0.01 * frac, "train_accuracy": 1 - gap / 2.5,
                "valid_accuracy": 0.97 - gap / 2.5, "learning_rate": lr,
            })
    return recs


def write_synthetic_log(path: Path, **kwargs) -> Path:
    """Write :func:`synthetic_records` as a JSONL log at ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records(**kwargs)))
    return path


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return write_synthetic_log(tmp_path / "run.jsonl", steps=40)


# ---------------------------------------------------------------------------- reader
def test_read_log_roundtrip(log_path: Path) -> None:
    log = read_log(log_path)
    assert log.quantities == ALL_QUANTITIES
    assert log.num_steps == 40
    x, y = log.scalar("Alpha")
    assert x.size == 40 and math.isnan(y[5])
    x, gn = log.scalar("GradNorm")
    raw = json.loads(log_path.read_text().splitlines()[1])["values"]["GradNorm"]
    assert gn[0] == pytest.approx(math.sqrt(sum(v * v for v in raw)))
    assert log.scalar("HessTrace")[0].size == 20
    assert log.metrics() == ["train_loss", "valid_loss", "train_accuracy", "valid_accuracy",
                             "learning_rate"]
    assert log.scalar("CABS")[1][0] == pytest.approx(32)
    (_step, hist, edges), *_ = log.histograms("GradHist2d")
    assert hist.shape == (20, 25) and [e.size for e in edges] == [21, 26]


def test_combine_rules() -> None:
    assert combine("GradNorm#2", [3.0, 4.0]) == pytest.approx(5.0)
    assert combine("Distance(x=1)", [3.0, 4.0]) == pytest.approx(5.0)
    assert combine("CABS", {"cabs": 8.0}) == 8.0
    assert combine("HessTrace", [1.0, 2.0]) == pytest.approx(3.0)
    assert math.isnan(combine("Loss", None))


def test_truncated_last_line_is_skipped(log_path: Path) -> None:
    text = log_path.read_text()
    log_path.write_text(text[: len(text) - 40])
    log = read_log(log_path)
    assert log.truncated and log.num_steps >= 38


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "not found"),
        ("", "empty"),
        ("\n\n", "empty"),
        ("step,loss\n1,2\n", "not a backprism monitor log"),
        ('{"foo": 1}\n', "not a backprism monitor log"),
        ('{"kind": "meta", "vers', "truncated"),
        ('{"kind": "meta", "version": 99, "quantities": []}\n', "unsupported"),
        ('{"kind": "meta", "version": 1, "quantities": []}\n{bad\n{"kind": "log", "step": 1}\n',
         "line 2"),
    ],
)
def test_bad_logs_raise_one_line_value_error(tmp_path: Path, content, message) -> None:
    p = tmp_path / "x.jsonl"
    if content is not None:
        p.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        read_log(p)
    assert "\n" not in str(info.value)


def test_ema_debiased() -> None:
    y = np.array([1.0, 1.0, np.nan, 1.0])
    assert np.allclose(ema(y, 0.9), 1.0)
    assert np.allclose(ema(y, 0.0)[[0, 1, 3]], 1.0)


# ---------------------------------------------------------------------------- dashboard
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


def test_unknown_quantities_get_their_own_panel(tmp_path: Path) -> None:
    recs = synthetic_records(steps=6, quantities=["Loss"])
    for r in recs[1:]:
        if r["kind"] == "step":
            r["values"]["MyMetric"] = r["step"] * 0.5
    panels = build_panels(RunLog.from_records(recs))
    assert [p.title for p in panels if p.group == "Other"] == ["MyMetric"]


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


# ---------------------------------------------------------------------------- diagnostics
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
