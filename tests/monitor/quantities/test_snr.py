"""Signal-to-noise quantities (``backprism.monitor.quantities.snr``): ``CABS`` and
``EarlyStopping`` need zero-momentum SGD and say so.
"""

from __future__ import annotations

import pytest
import torch

from backprism.monitor import Monitor, quantities, schedules
from tests.common import monitor_setup, monitor_step


def test_cabs_and_early_stopping_need_sgd() -> None:
    for cls in (quantities.CABS, quantities.EarlyStopping):
        model, lossf = monitor_setup()
        opt = torch.optim.Adam(model.parameters())
        monitor = Monitor(model.parameters(), [cls(schedules.linear(1))])
        with pytest.raises(ValueError, match="zero-momentum SGD"):
            monitor_step(monitor, model, lossf, 0, opt)
