"""The pre-defined configurations (``backprism.monitor.configuration``): their default schedules,
and training with them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import backprism
from backprism.monitor import Monitor, configuration, schedules
from backprism.monitor.configuration import DEFAULT_INTERVALS


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6).eval(), nn.ReLU(), nn.Linear(6, 3))
    return backprism.extend(model)


def test_default_schedules_of_the_configurations() -> None:
    for label in ("economy", "business", "full"):
        for q in configuration(label):
            k = DEFAULT_INTERVALS[type(q).__name__]
            tracked = [s for s in range(2 * k + 1) if q.schedule(s)]
            assert tracked == [0, k, 2 * k], (type(q).__name__, tracked)
    every = configuration("full", schedules.linear(1))
    assert all(all(q.schedule(s) for s in range(5)) for q in every)
    cheap = {"Loss", "GradNorm", "Distance", "UpdateSize"}
    assert {n for n, k in DEFAULT_INTERVALS.items() if k == 1} >= cheap


@pytest.mark.parametrize("label", ["economy", "full"])
def test_default_configuration_trains_and_logs(tmp_path, label) -> None:
    model = make()
    lossf = backprism.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model.parameters(), configuration(label), log_path=tmp_path / "r.jsonl")
    for step in range(12):
        X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        out = model(X)
        loss = lossf(out, y)
        info = {"loss": loss, "batch_size": 8, "optimizer": opt,
                "individual_losses": nn.functional.cross_entropy(out.detach(), y,
                                                                 reduction="none")}
        with monitor(step, info=info):
            loss.backward(create_graph=monitor.create_graph(step))
        opt.step()
        opt.zero_grad()
    monitor.close()
    out = monitor.get_output()
    assert sorted(out["Loss"]) == list(range(12))
    assert sorted(out["NormTest"]) == [0, 10]
    assert sorted(out["Alpha"]) == [0, 10] or sorted(out["Alpha"]) == [0]
    if label == "full":
        assert sorted(out["HessMaxEV"]) == [0]
        assert np.asarray(out["GradHist2d"][0]["hist"]).shape == (40, 50)
