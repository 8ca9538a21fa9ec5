"""``HessMaxEV`` (``backprism.monitor.quantities.hess_max_ev``): the largest eigenvalue of the
mini-batch loss Hessian by Lanczos on Hessian-vector products against ``eigvalsh`` of the dense
Hessian (``tests/reference.py::loss_hessian``) — with a dominant negative eigenvalue, warm
started over steps; and on every device (the ``device`` fixture), at two steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backprism import extend
from backprism.monitor import Monitor, quantities, schedules
from tests import reference
from tests.common import build_on_device, cpu_data, monitor_setup
from tests.reference import loss_hessian


def test_hessmaxev_negative_dominant_warm_start() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), nn.Tanh())
    torch.manual_seed(0)
    model, lossf = monitor_setup(model, nn.MSELoss())
    with torch.no_grad():
        model[2].bias.fill_(-1.0)
    q = quantities.HessMaxEV(schedules.linear(1))
    monitor = Monitor(model.parameters(), [q])
    X = torch.randn(8, 3, dtype=torch.float64)
    y = 5 * torch.ones(8, 1, dtype=torch.float64)
    for step in range(3):
        model.zero_grad()
        out = model(X)
        loss = lossf(out, y)
        assert monitor.create_graph(step)
        with monitor(step, info={"loss": loss}):
            loss.backward(create_graph=monitor.create_graph(step))
        H = reference.loss_hessian(model, nn.MSELoss(), X, y)
        ev = torch.linalg.eigvalsh(H)
        assert -ev[0] > 1.5 * ev[-1] > 0  # a power iteration would return ev[0]
        assert monitor.get_output()["HessMaxEV"][step] == pytest.approx(float(ev[-1]), rel=1e-3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
    # warm start: the later steps (nearby point) need fewer products than the first
    assert q.iterations[2] <= q.iterations[0]


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_monitor_hess_max_ev_on_device(name, device):
    """Lanczos on Hessian-vector products on the device, against ``eigvalsh`` of the dense
    Hessian, at two steps (the second warm-started)."""
    model, lossfunc, _, _, _ = build_on_device(name, device, seed=13)
    with torch.device("cpu"):
        randn, labels = cpu_data(14)
        shape = {"mlp": (4,), "resnet": (2, 3, 3)}[name]
        X, y = randn(6, *shape).to(device), labels(3, 6).to(device)
    expected = float(torch.linalg.eigvalsh(loss_hessian(model, lossfunc, X, y))[-1])
    extend(model), extend(lossfunc)
    monitor = Monitor(model.parameters(), [quantities.HessMaxEV(schedules.linear(1))])
    for step in range(2):
        model.zero_grad()
        loss = lossfunc(model(X), y)
        with monitor(step, info={"loss": loss}):
            loss.backward(create_graph=monitor.create_graph(step))
        for p in model.parameters():
            p.grad = None  # drop the graph kept by create_graph
    for value in monitor.get_output()["HessMaxEV"].values():
        assert value == pytest.approx(expected, rel=1e-3)
