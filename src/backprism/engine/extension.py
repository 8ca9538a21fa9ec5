"""The extension contract: what an extension asks of the engine and how it reduces it.

An extension names a parameter attribute (``savefield``) and computes it either

* directly from a layer rule for one call (:meth:`Extension.from_rule`), or
* from dense per-sample, per-column gradients ``P`` of shape ``[M, N, *param.shape]``
  (:meth:`Extension.from_dense`), which the engine builds when a parameter is used by several
  calls in one backward pass (RNN unrolling, tied weights, several forwards) so that the
  contributions of one sample are summed *before* squaring.

Extensions whose result is linear in the per-call contributions (``additive = True``: per-sample
gradients, Kronecker factors) skip the dense path and are summed over calls directly.

Every point the engine may call is declared here with its default; the engine never probes for
attributes.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch import Tensor

from backprism.engine.rule import Rule
from backprism.engine.state import Call, LossRecord

__all__ = ["Extension", "FirstOrderExtension", "SecondOrderExtension"]


class Extension:
    """Base class. Subclasses set ``savefield`` and implement the two reductions."""

    savefield: str = ""
    #: contributions of several calls (and several losses) are summed, no dense path needed
    additive: bool = False
    #: needs per-sample separation of the batch (refused with BatchNorm in train mode)
    per_sample: bool = True
    #: statistics this extension hands to the per-call memo while computing its own
    #: (``memo.provide``); such extensions run before the others
    provides: tuple[str, ...] = ()
    #: :meth:`from_rule` returns a *partial* result per parameter that :meth:`finish` completes
    #: with the parameter's gradient of the same backward pass (Variance takes the mean from it)
    needs_param_grad: bool = False

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict[str, Any]:
        """The result per parameter name of ``call`` from the rule's statistics of ``g``
        (``[M, *out.shape]``); ``weights`` ``[M, N]`` multiply squared contributions."""
        raise NotImplementedError

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        """The result from dense per-sample, per-column gradients ``[M, N, *p]`` (summed over
        the calls that use the parameter)."""
        raise NotImplementedError

    def finish(self, partial: Any, grad: Tensor) -> Any:
        """Complete a partial result with the parameter's gradient (``needs_param_grad``)."""
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
    #: also needs the Hessian residual columns of nonlinearities (DiagHessian family)
    needs_residual: bool = False
    #: does its own work at the loss (:meth:`handle_loss`) instead of receiving columns
    handles_loss: bool = False

    def column_key(self) -> Hashable:
        """Which columns this extension needs: ``("exact",)`` or ``("mc", mc_samples)``."""
        raise NotImplementedError

    def handle_loss(
        self,
        bp: Any,
        record: LossRecord,
        calls: list[tuple[Call, list[Any]]],
        n_samples: int,
        scale: float,
    ) -> None:
        """Work done at the loss of backward pass ``bp`` (``handles_loss``): ``calls`` are the
        captured calls upstream of ``record`` with their output edges; results are stored with
        ``bp.store(param, self, value)``."""
        raise NotImplementedError
