"""Streamed monitor log: schema, round trip, truncation tolerance, crash safety (SIGKILL)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import backprism
from backprism.monitor import Monitor, configuration, read_log, schedules

TRAIN = textwrap.dedent(
    """
    import sys, warnings, torch
    from torch import nn
    import backprism
    from backprism.monitor import Monitor, configuration, schedules
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = backprism.extend(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    lossf = backprism.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model.parameters(), configuration("economy"), log_path=sys.argv[1])
    step = 0
    while True:
        X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        out = model(X)
        loss = lossf(out, y)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
        with monitor(step, info=info):
            loss.backward()
        opt.step(); opt.zero_grad()
        if step % 5 == 0:
            monitor.log(step, step // 5, train_loss=float(loss))
        step += 1
    """
)


def train(path, steps: int = 4):
    torch.manual_seed(0)
    model = backprism.extend(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    lossf = backprism.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    qs = configuration("full", schedules.linear(1))
    monitor = Monitor(model.parameters(), qs, log_path=path)
    for step in range(steps):
        X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        out = model(X)
        loss = lossf(out, y)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with monitor(step, info=info):
                loss.backward(create_graph=monitor.create_graph(step))
        opt.step()
        opt.zero_grad()
    monitor.log(steps - 1, 0, train_loss=1.5, valid_accuracy=float("nan"), learning_rate=0.1)
    monitor.close()
    return monitor


def _same(a, b) -> bool:
    if isinstance(b, dict):
        return all(_same(a[k], v) for k, v in b.items())
    if isinstance(b, (list, tuple)) and any(isinstance(x, (list, tuple, np.ndarray)) for x in b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, (list, tuple, np.ndarray)):
        b = np.asarray(b, dtype=float)
        a = np.asarray(a, dtype=float)
        return a.shape == b.shape and np.allclose(a, b, rtol=1e-12, equal_nan=True)
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return a is None or (isinstance(a, float) and math.isnan(a))
    return a == pytest.approx(b, rel=1e-12)


def test_schema_and_round_trip(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    monitor = train(path)
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    assert lines[0] == {"kind": "meta", "version": 1, "quantities": monitor.keys()}
    kinds = {rec["kind"] for rec in lines}
    assert kinds == {"meta", "step", "log"}
    log = next(r for r in lines if r["kind"] == "log")
    assert log == {
        "kind": "log",
        "step": 3,
        "epoch": 0,
        "train_loss": 1.5,
        "valid_accuracy": None,
        "learning_rate": 0.1,
    }
    h2 = next(r["values"]["GradHist2d"] for r in lines if "GradHist2d" in r.get("values", {}))
    assert np.asarray(h2["hist"]).shape == (40, 50) and len(h2["edges"]) == 2
    data = read_log(path, as_frame=False)
    merged = {e["step"]: e["values"] for e in data["steps"]}
    keys = monitor.keys()
    for key, per_step in monitor.get_output().items():
        if key not in keys:
            continue
        for step, value in per_step.items():
            assert _same(merged[step][key], value), (key, step)
    fit = merged[0]["Alpha/fit"]
    assert set(fit) == {"t", "f", "df", "var_f", "var_df", "mu", "alpha"}
    assert fit["alpha"] == pytest.approx(merged[0]["Alpha"])
    frame = read_log(path)
    assert list(frame["step"]) == [0, 1, 2, 3]
    assert {"Loss", "Alpha", "HessMaxEV", "train_loss", "epoch"} <= set(frame.columns)
    assert frame.loc[3, "train_loss"] == 1.5
    np.testing.assert_allclose(
        frame["Loss"].to_numpy(dtype=float), [monitor.get_output()["Loss"][s] for s in range(4)]
    )
    out = tmp_path / "out.json"
    monitor.write(out)
    written = json.loads(out.read_text())
    assert written["Loss"]["0"] == pytest.approx(monitor.get_output()["Loss"][0])


def test_read_log_errors_and_truncation(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        read_log(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_log(empty)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match="not a backprism monitor log"):
        read_log(foreign)
    path = tmp_path / "run.jsonl"
    train(path)
    text = path.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[: len(text) - 40])  # last line truncated mid-record
    frame = read_log(cut)
    assert len(frame) >= 3


def test_crash_safety_sigkill(tmp_path) -> None:
    path = tmp_path / "crash.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(path)], env=env)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            if path.exists() and path.read_text().count('"kind":"step"') >= 8:
                break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    frame = read_log(path)
    assert len(frame) >= 5
    steps = list(frame["step"])
    assert steps == list(range(len(steps)))
    done = frame.dropna(subset=["Loss"])
    assert len(done) >= 5 and np.isfinite(done["Loss"].to_numpy(dtype=float)).all()
