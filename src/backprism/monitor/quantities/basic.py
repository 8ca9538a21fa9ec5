"""Quantities read directly from the training state: loss, parameters, time, norms, distances.

==============  ==========================================  =====================================
quantity        value                                       stored under
==============  ==========================================  =====================================
Loss            mini-batch loss ``L`` (``info['loss']``)    the step
Parameters      ``[θ_p.tolist() for p]``                    the step
Time            ``time.time()`` at tracking                 the step
GradNorm        ``[‖∇_{θ_p} L‖₂ for p]``                    the step
Distance        ``[‖θ_p − θ_p(0)‖₂ for p]`` (``θ(0)`` at    the step
                step 0, or the first step seen)
UpdateSize      ``[‖θ_p(s+1) − θ_p(s)‖₂ for p]``             the start step ``s``
==============  ==========================================  =====================================

Norms are computed on the device (``torch._foreach_norm``, one fused reduction for all
parameters) and reach the host with the other values of the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from backprism.monitor.quantities.base import (
    ByproductQuantity,
    Pending,
    Schedule,
    StepData,
    TwoStepQuantity,
    grad_norms,
)

__all__ = ["Distance", "GradNorm", "Loss", "Parameters", "Time", "UpdateSize"]


class Loss(ByproductQuantity):
    """The mini-batch loss ``info['loss']`` as a float."""

    needs_finite = False

    def info_keys(self, global_step: int) -> set[str]:
        return {"loss"} if self.should_compute(global_step) else set()

    def _compute(self, global_step: int, data: StepData) -> Pending:
        loss = data.loss_of(self)
        if not isinstance(loss, Tensor):
            return Pending.ready(float(loss))
        return Pending.scalar(loss.detach().reshape(()))


class Parameters(ByproductQuantity):
    """The parameter values, ``[p.tolist() for p in params]`` (expensive: the whole model)."""

    needs_finite = False
    large_values = True

    def _compute(self, global_step: int, data: StepData) -> Pending:
        values = [p.detach().clone() for p in data.params]
        return Pending(values, lambda arrays: [a.tolist() for a in arrays])


class Time(ByproductQuantity):
    """Wall-clock time ``time.time()`` when the step is tracked."""

    needs_finite = False

    def _compute(self, global_step: int, data: StepData) -> float:
        return time.time()


class GradNorm(ByproductQuantity):
    """Per-parameter gradient norms ``[‖∇_{θ_p} L‖₂ for p]``."""

    def _compute(self, global_step: int, data: StepData) -> Pending:
        for p in data.params:
            _grad(p, self)
        ref = data.params[0]
        values = [n.to(ref.device, torch.float64) for n in grad_norms(data)]  # type: ignore[union-attr]
        return Pending.floats(torch.stack(values))


def norms(tensors: list[Tensor]) -> Tensor:
    """``[‖t‖₂ for t in tensors]`` as one device tensor (fused over the tensors)."""
    out = torch._foreach_norm(tensors, 2)
    ref = tensors[0]
    return torch.stack([o.to(ref.device, torch.float64) for o in out])


def _grad(p: Any, q: Any) -> Any:
    if p.grad is None:
        raise RuntimeError(
            f"{q.key}: a monitored parameter of shape {tuple(p.shape)} has no .grad after the "
            "backward pass; is it used in the forward pass?"
        )
    return p.grad


class Distance(TwoStepQuantity):
    """Per-parameter L2 distance to the initial parameters, ``[‖θ_p − θ_p(0)‖₂ for p]``.

    The start point is step ``INIT_GLOBAL_STEP = 0`` (Cockpit); if the monitor never sees
    step 0, the first step it sees serves as the initialization instead.
    """

    INIT_GLOBAL_STEP = 0
    CACHE_KEY = "params"
    needs_finite = False

    def __init__(self, track_schedule: Schedule, verbose: bool = False) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._init_step: int | None = None

    def is_start(self, global_step: int) -> bool:
        return self._init_step is None

    def is_end(self, global_step: int) -> bool:
        return bool(self._track_schedule(global_step))

    def _compute_start(self, global_step: int, data: StepData) -> None:
        self._init_step = global_step
        params = [p.detach().clone() for p in data.params]
        self.save_to_cache(global_step, self.CACHE_KEY, params, lambda step: True)

    def _compute_end(self, global_step: int, data: StepData) -> Pending:
        assert self._init_step is not None
        init = self.load_from_cache(self._init_step, self.CACHE_KEY)
        diffs = torch._foreach_sub([p.detach() for p in data.params], init)
        return Pending.floats(norms(diffs))


class UpdateSize(TwoStepQuantity):
    """Per-parameter update norms ``[‖θ_p(s+1) − θ_p(s)‖₂ for p]``, stored under step ``s``.

    Start at every scheduled step ``s``, end at ``s + 1`` (``SAVE_SHIFT = 1``).
    """

    SAVE_SHIFT = 1
    CACHE_KEY = "params"
    needs_finite = False

    def is_start(self, global_step: int) -> bool:
        return bool(self._track_schedule(global_step))

    def is_end(self, global_step: int) -> bool:
        return bool(self._track_schedule(global_step - self.SAVE_SHIFT))

    def _compute_start(self, global_step: int, data: StepData) -> None:
        params = [p.detach().clone() for p in data.params]
        shift = self.SAVE_SHIFT

        def block_fn(step: int) -> bool:
            return 0 <= step - global_step <= shift

        self.save_to_cache(global_step, self.CACHE_KEY, params, block_fn)

    def _compute_end(self, global_step: int, data: StepData) -> Pending | None:
        start = global_step - self.SAVE_SHIFT
        if not self.in_cache(start, self.CACHE_KEY):
            return None  # the start step was skipped (not seen)
        old = self.load_from_cache(start, self.CACHE_KEY)
        diffs = torch._foreach_sub([p.detach() for p in data.params], old)
        return Pending.floats(norms(diffs))
