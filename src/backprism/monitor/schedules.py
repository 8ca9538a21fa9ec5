"""Tracking schedules: functions ``step -> bool`` deciding on which steps a quantity is computed.

Same semantics as Cockpit's ``cockpit.utils.schedules``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["linear", "logarithmic"]

Schedule = Callable[[int], bool]


def linear(interval: int, offset: int = 0) -> Schedule:
    """Track at the steps ``{offset + n · interval | n ≥ 0}``.

    Args:
        interval: the regular tracking interval (positive).
        offset: first tracked step (default 0); steps before it are never tracked.
    """
    if int(interval) < 1:
        raise ValueError(f"interval must be a positive integer, got {interval!r}")
    interval, offset = int(interval), int(offset)

    def schedule(global_step: int) -> bool:
        shifted = global_step - offset
        return shifted >= 0 and shifted % interval == 0

    schedule.__doc__ = "Track at iterations {" + f"{offset} + n * {interval} " + "| n >= 0}."
    return schedule


def logarithmic(
    start: float, end: float, steps: int = 300, base: float = 10, init: bool = True
) -> Schedule:
    """Track at ``steps`` logarithmically spaced steps ``⌊base^x⌋``, ``x ∈ linspace(start, end)``.

    The steps are ``torch.logspace(start, end, steps, base=base)`` (float64) truncated to
    integers, plus step 0 if ``init``. For integer exponents this is exactly Cockpit's set;
    Cockpit's ``dtype=int`` logspace also truncated non-integer ``start``/``end`` to integers
    before spacing, which we do not.

    Args:
        start: exponent of the first tracked step.
        end: exponent of the last tracked step.
        steps: number of log-spaced points (duplicates after truncation collapse).
        base: logarithmic base.
        init: also track step 0.
    """
    scheduled = torch.logspace(start, end, steps, base=base, dtype=torch.float64).long()
    tracked = {int(s) for s in scheduled.tolist()}
    if init:
        tracked.add(0)
    frozen = frozenset(tracked)

    def schedule(global_step: int) -> bool:
        return global_step in frozen

    schedule.__doc__ = f"Track at {len(frozen)} logarithmically spaced iterations."
    return schedule
