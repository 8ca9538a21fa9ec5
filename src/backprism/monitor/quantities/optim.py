"""Optimizer inspection (Cockpit's ``ComputeStep``): which quantities know the update step."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["is_sgd_default_kwargs", "single_lr"]


def is_sgd_default_kwargs(optimizer: Any) -> bool:
    """Whether ``optimizer`` is plain ``torch.optim.SGD`` without momentum, dampening, weight
    decay or Nesterov in every parameter group (its step is ``θ ← θ − lr·∇L``)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    for group in optimizer.param_groups:
        if not math.isclose(group.get("weight_decay", 0.0), 0.0, abs_tol=1e-8):
            return False
        if not math.isclose(group.get("momentum", 0.0), 0.0, abs_tol=1e-8):
            return False
        if not math.isclose(group.get("dampening", 0.0), 0.0, abs_tol=1e-8):
            return False
        if group.get("nesterov", False) is not False:
            return False
        if group.get("maximize", False):
            return False
    return True


def single_lr(optimizer: Any) -> float:
    """The learning rate shared by all parameter groups (``ValueError`` if they differ)."""
    lrs = {float(group["lr"]) for group in optimizer.param_groups}
    if len(lrs) != 1:
        raise ValueError(f"Found non-unique learning rates {lrs}")
    return lrs.pop()


def lr_of(optimizer: Any) -> dict[int, float]:
    """``id(param) -> lr`` for every parameter of ``optimizer``."""
    return {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
