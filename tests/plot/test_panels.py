"""The instrument panels as data (``backprism.plot.panels``): the debiased EMA, unknown
quantities in panels of their own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from backprism.plot import RunLog, build_panels
from backprism.plot.panels import ema
from tests.synthetic_log import synthetic_records


def test_ema_debiased() -> None:
    y = np.array([1.0, 1.0, np.nan, 1.0])
    assert np.allclose(ema(y, 0.9), 1.0)
    assert np.allclose(ema(y, 0.0)[[0, 1, 3]], 1.0)


def test_unknown_quantities_get_their_own_panel(tmp_path: Path) -> None:
    recs = synthetic_records(steps=6, quantities=["Loss"])
    for r in recs[1:]:
        if r["kind"] == "step":
            r["values"]["MyMetric"] = r["step"] * 0.5
    panels = build_panels(RunLog.from_records(recs))
    assert [p.title for p in panels if p.group == "Other"] == ["MyMetric"]
