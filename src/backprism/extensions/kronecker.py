r"""Kronecker-factored curvature: ``KFAC``, ``KFLR`` (and ``KFRA`` on chains).

For a weight-like parameter the block of the GGN is approximated as ``B ⊗ A`` and stored as the
list ``[B, A]`` (``param.kfac`` / ``param.kflr``), for a bias as ``[B]``, following BackPACK:

* ``A = (1/N) Σₙ Σₜ xₙₜ xₙₜᵀ`` — the module's (unfolded) inputs, ``t`` over positions;
* ``B = Σₘ Σₙ (Σₜ gₘₙₜ)(Σₜ gₘₙₜ)ᵀ`` — the backpropagated loss-Hessian square-root columns
  (``1/√N`` of a mean loss included): Monte-Carlo with ``mc_samples`` sampled labels (KFAC) or
  exact (KFLR). ``B`` alone is the exact/MC GGN block of the bias.

For ``N = 1`` and no positions, ``B ⊗ A`` equals the exact GGN block of the weight (KFLR).
A parameter used by several calls (weight sharing) gets the sums of the calls' ``A`` and ``B``
factors (the "expand" convention for shared weights). Embedding weights ``[V, D]`` store
``[A_tokens, B]`` in the weight's own axis order (see the Embedding rule).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch import Tensor

from backprism.extensions.base import SecondOrderExtension
from backprism.extensions.secondorder import _check_mc
from backprism.rules.base import Call, Rule

__all__ = ["KFAC", "KFLR"]


class KroneckerFactors(list):
    """A list of Kronecker factors that remembers which calls its input-side factor came from,
    so that column chunks of one call add their ``B`` without adding ``A`` twice."""

    def __init__(self, factors: list[Tensor], calls: set[int], grad_side: list[bool]) -> None:
        super().__init__(factors)
        self.calls = calls
        self.grad_side = grad_side  # which factors depend on the backpropagated columns


class _Kronecker(SecondOrderExtension):
    additive = True

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        if weights is not None:
            raise ValueError(f"{type(self).__name__} does not take signed columns")
        factors = rule.kronecker_factors(call, g)
        out = {}
        for name, fs in factors.items():
            side = rule.kronecker_grad_side(call, name, len(fs))
            out[name] = KroneckerFactors(list(fs), {id(call)}, side)
        return out

    def accumulate(self, old: KroneckerFactors, new: KroneckerFactors) -> KroneckerFactors:
        same_call = new.calls <= old.calls
        merged = [o + n if (g or not same_call) else o for o, n, g in zip(old, new, old.grad_side)]
        return KroneckerFactors(merged, old.calls | new.calls, old.grad_side)


class KFAC(_Kronecker):
    """Kronecker-factored approximate curvature with a Monte-Carlo ``B`` factor
    (``mc_samples`` sampled labels), stored in ``param.kfac``."""

    savefield = "kfac"

    def __init__(self, mc_samples: int = 1) -> None:
        self.mc_samples = _check_mc(mc_samples)

    def column_key(self) -> Hashable:
        return ("mc", self.mc_samples)


class KFLR(_Kronecker):
    """Kronecker-factored low-rank curvature: exact ``B`` factor from the exact loss-Hessian
    square root, stored in ``param.kflr``."""

    savefield = "kflr"

    def column_key(self) -> Hashable:
        return ("exact",)
