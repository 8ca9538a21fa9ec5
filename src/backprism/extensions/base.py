"""Extension base classes: what each extension asks of the engine and how it reduces it.

An extension names a parameter attribute (``savefield``) and computes it either

* directly from a layer rule for one module call (:meth:`Extension.from_rule`), or
* from dense per-sample, per-column gradients ``P`` of shape ``[M, N, *param.shape]``
  (:meth:`Extension.from_dense`), which the engine builds when a parameter is used by several
  calls (RNN unrolling, tied weights) so that contributions are summed *before* squaring.

Extensions whose result is linear in the per-call contributions (``additive = True``: per-sample
gradients, Kronecker factors) skip the dense path and are summed over calls directly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from backprism.rules.base import Call, Rule

__all__ = ["Extension", "FirstOrderExtension", "SecondOrderExtension"]


def check_subsampling(subsampling: Sequence[int] | None) -> list[int] | None:
    if subsampling is None:
        return None
    idx = [int(i) for i in subsampling]
    if len(set(idx)) != len(idx):
        raise ValueError(f"subsampling indices must be unique, got {list(subsampling)}")
    if any(i < 0 for i in idx):
        raise ValueError(f"subsampling indices must be non-negative, got {list(subsampling)}")
    return idx


def subsample_index(idx: list[int] | None, n: int, what: str) -> Tensor | None:
    if idx is None:
        return None
    if idx and max(idx) >= n:
        raise IndexError(
            f"{what}: subsampling index {max(idx)} is out of range for a batch of {n} samples"
        )
    return torch.tensor(idx, dtype=torch.long)


class Extension:
    """Base class. Subclasses set ``savefield`` and implement the two reductions."""

    savefield: str = ""
    #: contributions of several calls (and several losses) are summed, no dense path needed
    additive: bool = False
    #: needs per-sample separation of the batch (refused with BatchNorm in train mode)
    per_sample: bool = True

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict[str, Any]:
        raise NotImplementedError

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        raise NotImplementedError

    def accumulate(self, old: Any, new: Any) -> Any:
        """Combine results of two contributions (column chunks, calls or losses)."""
        return old + new

    def builds_per_sample(self, rule: Rule, call: Call) -> bool:
        """Whether :meth:`from_rule` may build per-sample, per-column gradients ``[N, *p]`` of
        ``call``'s parameters (the engine sizes column chunks by it); by default, whether the
        rule's statistics may (:meth:`Rule.builds_per_sample`)."""
        return rule.builds_per_sample(call)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class FirstOrderExtension(Extension):
    """Computed from ``∂L/∂out`` during the ordinary backward pass (``M = 1``)."""

    order = 1


class SecondOrderExtension(Extension):
    """Computed from loss-Hessian square-root columns pushed back from the loss."""

    order = 2

    def column_key(self) -> Hashable:
        """Which columns this extension needs: ``("exact",)`` or ``("mc", mc_samples)``."""
        raise NotImplementedError

    #: also needs the Hessian residual columns of nonlinearities (DiagHessian family)
    needs_residual: bool = False
