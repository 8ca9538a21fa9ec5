"""Bin adaptation (``backprism.monitor.quantities.bin_adaptation``): ``GradAbsMax`` moves the
range of ``GradHist1d`` to the padded largest individual gradient element of the step (per-sample
gradients by a loop of autograd calls, ``numpy.histogram`` on the next step).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backprism.monitor import Monitor, quantities, schedules
from backprism.monitor.quantities.bin_adaptation import GradAbsMax
from tests.common import individual_grads, monitor_setup, monitor_step


def test_gradhist_range_adaptation() -> None:
    model, lossf = monitor_setup()
    hist = quantities.GradHist1d(
        schedules.linear(1), bins=10, adapt=GradAbsMax(schedules.linear(1), padding=0.1)
    )
    monitor = Monitor(model.parameters(), [hist])
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    monitor_step(monitor, model, lossf, 0, X=X, y=y)
    G = individual_grads(model, X, y)
    m = float(G.abs().max())
    assert hist._range == pytest.approx((-1.1 * m, 1.1 * m))
    X2, y2 = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    model.zero_grad()
    monitor_step(monitor, model, lossf, 1, X=X2, y=y2)
    G2 = individual_grads(model, X2, y2).numpy()
    got = monitor.get_output()["GradHist1d"][1]
    want = np.histogram(np.clip(G2, -1.1 * m, 1.1 * m), bins=10, range=(-1.1 * m, 1.1 * m))[0]
    assert np.abs(got["hist"] - want).sum() <= 2
    np.testing.assert_allclose(got["edges"], np.linspace(-1.1 * m, 1.1 * m, 11), atol=1e-12)
