"""``Monitor.cost_estimate`` (``backprism.monitor.cost``; no timings are asserted: only the
structure of the report and that the model and monitor are left as they were).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import backprism
from backprism.monitor import Monitor, configuration, quantities, schedules
from backprism.monitor.configuration import DEFAULT_INTERVALS
from backprism.monitor.cost import CostReport


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6).eval(), nn.ReLU(), nn.Linear(6, 3))
    return backprism.extend(model)


def test_cost_estimate_report_and_restored_state(capsys) -> None:
    model = make()
    X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    model[1].running_mean.fill_(0.25)
    qs = configuration("full", curvature="diag_ggn_mc")
    monitor = Monitor(model.parameters(), qs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    report = monitor.cost_estimate(model, X, y, steps=401, repeats=1)
    assert isinstance(report, CostReport)
    text = capsys.readouterr().out
    assert "amortised over steps 0..400" in text and "HessMaxEV" in text
    assert list(report.per_quantity) == monitor.keys()
    assert all(math.isfinite(r) and r > 0 for r in report.per_quantity.values())
    assert math.isfinite(report.together) and math.isfinite(report.amortised)
    assert sum(n for n, _, _ in report.patterns) == 401
    # the default schedules: cheap quantities every step, the others at multiples of k
    assert report.tracked["Loss"] == 401
    assert report.tracked["HessMaxEV"] == len(range(0, 401, DEFAULT_INTERVALS["HessMaxEV"]))
    assert report.tracked["Alpha"] == 2 * len(range(0, 401, DEFAULT_INTERVALS["Alpha"])) - 1
    after = model.state_dict()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)
    for p in model.parameters():
        assert torch.equal(p.grad, torch.ones_like(p))
    assert all(not q.output for q in monitor.quantities)  # the monitor itself tracked nothing


def test_cost_estimate_with_custom_loss_and_optimizer() -> None:
    model = make()
    X, y = torch.randn(8, 4), torch.randn(8, 3)
    lossf = backprism.extend(nn.MSELoss())
    monitor = Monitor(model.parameters(), [quantities.Loss(schedules.linear(1)),
                                           quantities.HessTrace(schedules.linear(3))])
    report = monitor.cost_estimate(
        model, X, y, lossfunc=lossf, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
        steps=9, repeats=1, verbose=False,
    )
    assert report.tracked == {"Loss": 9, "HessTrace": 3}
    keys = {tuple(sorted(k)) for _, k, _ in report.patterns}
    assert keys == {("HessTrace", "Loss"), ("Loss",)}
    # Loss alone after a HessTrace step (3 times) and after a Loss step (3 times)
    assert sorted(n for n, k, _ in report.patterns if k == ["Loss"]) == [3, 3]
