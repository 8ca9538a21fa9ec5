"""Tracking schedules (``backprism.monitor.schedules``): ``linear`` and ``logarithmic``, Cockpit's
semantics.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from backprism.monitor import schedules


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 7), st.integers(0, 5))
def test_linear_schedule(interval: int, offset: int) -> None:
    sched = schedules.linear(interval, offset)
    want = {offset + k * interval for k in range(50)}
    assert {s for s in range(-3, offset + 49 * interval + 1) if sched(s)} == want


@settings(max_examples=20, deadline=None)
@given(st.floats(0, 2), st.floats(2, 4), st.integers(1, 50), st.booleans())
def test_logarithmic_schedule(start: float, end: float, steps: int, init: bool) -> None:
    sched = schedules.logarithmic(start, end, steps, init=init)
    pts = {int(10**x) for x in np.linspace(start, end, steps)}
    got = {s for s in range(0, 10**4 + 2) if sched(s)}
    # float truncation may differ by one at exact powers (torch's 99.999… → 99 where
    # numpy's 10**x gives 100): a few steps may be off by one, none by more
    want = pts | ({0} if init else set())
    assert len(got) == len(want)
    assert len(got - want) <= max(2, len(pts) // 5)
    assert all(min(abs(g - w) for w in want) <= 1 for g in got)
    assert (0 in got) == (init or 0 in pts)
