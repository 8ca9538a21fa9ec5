"""Policies adapting histogram bin limits during training (Cockpit's ``bin_adaptation``).

A policy runs on its own schedule *after* the histogram of the step was taken, so new limits
apply from the next histogram on.

* :class:`NoAdaptation` — keep the limits.
* :class:`GradAbsMax` — ``[−m, m]`` with ``m = (1 + padding)·max(min_size/2, maxₙᵢ |gₙᵢ|)``,
  ``gₙ = ∇ℓₙ`` the individual gradients (needs per-sample gradients on its steps).
* :class:`ParamAbsMax` — the same with ``m`` from the parameter values ``maxᵢ |θᵢ|``.

The new limits are computed on the device: ``grad_abs_max`` is a 0-dim device tensor and the
returned limits may be tensors too (the histogram quantities keep them on the device and bin
with them, see :mod:`backprism.monitor.histograms`); nothing is read on the host. A policy
written for host floats still works (its floats are used as they are).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from backprism.monitor.quantities.base import Schedule

__all__ = ["BinAdaptation", "GradAbsMax", "NoAdaptation", "ParamAbsMax"]


class BinAdaptation:
    """Base class: ``compute(params, abs_max_grad) -> (start, end)`` on scheduled steps."""

    #: needs the per-sample gradients' absolute maximum on its steps
    needs_grad_batch = False

    def __init__(self, track_schedule: Schedule, verbose: bool = False) -> None:
        self._track_schedule = track_schedule
        self._verbose = verbose

    def should_compute(self, global_step: int) -> bool:
        return bool(self._track_schedule(global_step))

    def compute(
        self, global_step: int, params: list[Tensor], grad_abs_max: Any, range: Any
    ) -> tuple[Any, Any]:
        """New limits ``(start, end)`` (floats or 0-dim device tensors); ``grad_abs_max`` is
        ``maxₙᵢ |gₙᵢ|`` as a 0-dim tensor (or ``None`` if the policy does not need it)."""
        start, end = self._compute(params, grad_abs_max, range)
        if self._verbose:
            print(
                f"[Step {global_step} | {type(self).__name__}] New limits: {start:.5f}, {end:.5f}"
            )
        return start, end

    def _compute(self, params: list[Tensor], grad_abs_max: Any, range: Any) -> Any:
        raise NotImplementedError


class NoAdaptation(BinAdaptation):
    """Never changes the limits."""

    def __init__(self, verbose: bool = False) -> None:
        super().__init__(lambda step: False, verbose=verbose)

    def _compute(self, params: list[Tensor], grad_abs_max: Any, range: Any) -> Any:
        return tuple(range)


class _AbsMax(BinAdaptation):
    def __init__(
        self,
        track_schedule: Schedule,
        verbose: bool = False,
        padding: float = 0.0,
        min_size: float = 1e-6,
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._padding = padding
        self._min_size = min_size

    def _compute(self, params: list[Tensor], grad_abs_max: Any, range: Any) -> Any:
        m = self._abs_max(params, grad_abs_max)
        if isinstance(m, Tensor):
            end = (1.0 + self._padding) * m.double().clamp_min(self._min_size / 2)
        else:
            end = (1.0 + self._padding) * max(self._min_size / 2, float(m))
        return -end, end

    def _abs_max(self, params: list[Tensor], grad_abs_max: Any) -> Any:
        raise NotImplementedError


class GradAbsMax(_AbsMax):
    """Limits ``±(1 + padding)·max(min_size/2, max |∇ℓₙ|)`` from the individual gradients."""

    needs_grad_batch = True

    def _abs_max(self, params: list[Tensor], grad_abs_max: Any) -> Any:
        assert grad_abs_max is not None
        return grad_abs_max


class ParamAbsMax(_AbsMax):
    """Limits ``±(1 + padding)·max(min_size/2, max |θ|)`` from the parameter values."""

    def _abs_max(self, params: list[Tensor], grad_abs_max: Any) -> Tensor:
        ref = params[0]
        maxima = [p.detach().abs().max().to(ref.device, torch.float64) for p in params]
        return torch.stack(maxima).max()
