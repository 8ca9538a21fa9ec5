"""The extension contract: what an extension asks of the engine and how it reduces it.

An extension names a parameter attribute (``savefield``) and computes it either

* directly from a layer rule for one call (:meth:`Extension.from_rule`), or
* for a parameter used by several calls in one backward pass (RNN unrolling, tied weights,
  several forwards), where the contributions of one sample must be summed *before* squaring:
  from the rule statistic it names (:attr:`Extension.tied_statistic`) of the sum, which the
  engine assembles from the calls' own statistics and cross terms when every call's rule has
  outer factors (:meth:`Extension.from_statistic`), else from dense per-sample, per-column
  gradients ``P`` of shape ``[M, N, *param.shape]`` (:meth:`Extension.from_dense`).

Extensions whose result is linear in the per-call contributions (``additive = True``: per-sample
gradients, Kronecker factors) skip the dense path and are summed over calls directly.

Every point the engine may call is declared here with its default; the engine never probes for
attributes.

**Distributed data parallelism** (:mod:`backprism.engine.distributed`). When a backward pass runs
on several ranks (``DDP``), each rank first computes its results on its own samples with the
local convention; the engine then asks every extension how its result combines over the ranks
(:meth:`Extension.distributed_unsupported`, :meth:`Extension.distributed_parts`,
:meth:`Extension.distributed_result`) and packs the parts of all extensions into few collective
calls. :class:`GlobalBatch` says what a rank knows about the global batch then.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from backprism.engine.rule import Rule
from backprism.engine.state import Call, LossRecord

__all__ = [
    "CatPart",
    "Extension",
    "FirstOrderExtension",
    "GlobalBatch",
    "SecondOrderExtension",
    "SumPart",
]


@dataclass(frozen=True)
class GlobalBatch:
    r"""The global batch of a distributed backward pass, as one rank sees it.

    The global batch is the concatenation of the ranks' local batches in rank order, ``N =
    Σ_r N_r``. A rank's local results follow the local convention (``grad_batch[n] =
    ∇(c·ℓₙ/N_r)`` for a mean loss, ``c`` any factor common to all ranks); the one-process
    result on the global batch weights sample ``n`` by ``c/N`` instead, so a quantity that is
    homogeneous of degree ``d`` in the per-sample loss weights is this rank's value times
    ``loss_weight ** d``:

    * ``loss_weight`` ``ρ = N_r/N`` for ``reduction="mean"``, ``1`` for ``"sum"``;
    * ``batch_weight`` ``α = N_r/N``: the weight of a batch average ``(1/N_r) Σₙ`` that does not
      come from the loss (Kronecker input factors ``A``).

    Attributes:
        rank: this rank's index in the process group.
        sizes: the local batch sizes ``N_r`` of all ranks, in rank order.
        reduction: ``"mean"`` or ``"sum"``, the reduction of the pass's extended losses (a pass
            without an extended loss is taken as ``"mean"``).
    """

    rank: int
    sizes: tuple[int, ...]
    reduction: str = "mean"

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def n(self) -> int:
        """``N``, the global batch size."""
        return sum(self.sizes)

    @property
    def local(self) -> int:
        """``N_r``, this rank's batch size."""
        return self.sizes[self.rank]

    @property
    def offset(self) -> int:
        """Index of this rank's first sample in the global batch."""
        return sum(self.sizes[: self.rank])

    @property
    def loss_weight(self) -> float:
        """``ρ = N_r/N`` (mean) or ``1`` (sum)."""
        return self.local / self.n if self.reduction == "mean" else 1.0

    @property
    def batch_weight(self) -> float:
        """``α = N_r/N``."""
        return self.local / self.n


class SumPart:
    """``scale · tensor`` summed over the ranks (the rank's scaling for the global batch). The
    engine sends a tensor that several parts share with the same scale only once (e.g. the
    ``B`` factor of a Linear weight and its bias, or ``Σ gb²`` of SumGradSquared and Variance),
    so pass the result's own tensor with ``scale`` rather than a scaled copy."""

    __slots__ = ("scale", "tensor")

    def __init__(self, tensor: Tensor, scale: float = 1.0) -> None:
        self.tensor = tensor
        self.scale = float(scale)


class CatPart:
    """A tensor concatenated over the ranks along its first axis, in rank order (``rows``: the
    first-axis length of every rank's tensor if known to all ranks, else ``None`` and the engine
    exchanges them)."""

    __slots__ = ("rows", "tensor")

    def __init__(self, tensor: Tensor, rows: Sequence[int] | None = None) -> None:
        self.tensor = tensor
        self.rows = None if rows is None else tuple(int(r) for r in rows)


class Extension:
    """Base class. Subclasses set ``savefield`` and implement the two reductions."""

    savefield: str = ""
    #: contributions of several calls (and several losses) are summed, no dense path needed
    additive: bool = False
    #: needs per-sample separation of the batch (refused with BatchNorm in train mode)
    per_sample: bool = True
    #: defined for the whole batch even when the samples are mixed (BatchNorm in train mode):
    #: the engine then pushes one column per loss row and per loss-Hessian column, and rules
    #: see the batch as one sample (``M·R`` columns ``Σₙ Vₘᵣₙ``); GGN diagonals and square
    #: roots
    whole_batch: bool = False
    #: differentiates the backward graph a second time (Hessian-vector products): a forward
    #: run inside a ``collect`` holding such an extension computes attention with PyTorch's
    #: math kernel (the fused kernels have no second derivative)
    needs_double_backward: bool = False
    #: computes calls on a folded batch (``Call.fold``: rows that fold the samples with
    #: another axis, sample-major); refused there before anything is written otherwise
    supports_folded: bool = True
    #: statistics this extension hands to the per-call memo while computing its own
    #: (``memo.provide``); such extensions run before the others
    provides: tuple[str, ...] = ()
    #: :meth:`from_rule` returns a *partial* result per parameter that :meth:`finish` completes
    #: with the parameter's gradient of the same backward pass (Variance takes the mean from it)
    needs_param_grad: bool = False
    #: the rule statistic the result is a function of (``"batch_l2"`` or ``"sum_squared"``,
    #: :meth:`from_statistic`); a parameter used by several calls then gets it from the calls'
    #: own statistics and their cross terms (:mod:`backprism.engine.tied`) instead of from
    #: dense per-sample gradients. ``None``: always the dense path (:meth:`from_dense`)
    tied_statistic: str | None = None
    #: the degree of the result in the per-sample loss weights, for distributed passes
    #: (:class:`GlobalBatch`): per-sample gradients 1, their squares 2, GGN and Hessian terms 1,
    #: GGN square roots 1/2
    distributed_degree: float = 1.0
    #: in a distributed pass the engine scales what :meth:`from_rule` receives for the global
    #: batch (output gradients by ``ρ``, second-order columns by ``√ρ``) and multiplies results
    #: of parameters used by several calls by ``ρ ** distributed_degree``, so that the stored
    #: value already is this rank's rows of the global result and :meth:`distributed_result`
    #: receives it so: no rescaling pass over ``[N, *p]`` tensors. Only for results computed
    #: from ``g`` alone and homogeneous of degree ``distributed_degree`` in the loss weights
    #: (not for results with Hessian residual terms, which the backward adds unscaled)
    scaled_in_pass: bool = False

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict[str, Any]:
        """The result per parameter name of ``call`` from the rule's statistics of ``g``
        (``[M, *out.shape]``); ``weights`` ``[M, N]`` multiply squared contributions."""
        raise NotImplementedError

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        """The result from dense per-sample, per-column gradients ``[M, N, *p]`` (summed over
        the calls that use the parameter)."""
        raise NotImplementedError

    def from_statistic(self, statistic: Tensor, call: Call) -> Any:
        """The result from the :attr:`tied_statistic` of a parameter used by several calls
        (``call`` is one of them; a ``needs_param_grad`` extension returns its partial result).
        Default: the statistic itself."""
        return statistic

    def finish(self, partial: Any, grad: Tensor) -> Any:
        """Complete a partial result with the parameter's gradient (``needs_param_grad``)."""
        raise NotImplementedError

    def accumulate(self, old: Any, new: Any) -> Any:
        """Combine results of two contributions (column chunks, calls or losses)."""
        return old + new

    def additive_over_calls(self, kronecker: bool) -> bool:
        """Whether the results of a parameter used by several calls are the sum of the calls'
        (:meth:`accumulate`) rather than computed from all its uses at once
        (:meth:`from_dense` / :meth:`from_statistic`); ``kronecker``: every call gives the
        parameter Kronecker factors (:meth:`~backprism.engine.rule.Rule.kronecker_form`).
        Default: :attr:`additive`."""
        return self.additive

    def check_call(
        self, call: Call, kronecker: Callable[[], bool], label: Callable[[nn.Parameter], str]
    ) -> None:
        """Raise if this extension cannot store its results for ``call``'s parameters (a
        result too large to build); asked before anything is written. ``kronecker()``: whether
        the rule the pass computes ``call`` with gives Kronecker factors
        (:meth:`~backprism.engine.rule.Rule.kronecker_form`); ``label(p)``: the parameter's
        name in the model, for the message. Default: nothing to refuse."""

    def whole_batch_result(self, value: Any, rows: int) -> Any:
        """The final result of a whole-batch pass (``whole_batch``) from the accumulated one,
        whose columns are ``k·rows + r`` (loss-Hessian column ``k``, loss row ``r``)."""
        return value

    def builds_per_sample(self, rule: Rule, call: Call) -> bool:
        """Whether :meth:`from_rule` may build per-sample, per-column gradients ``[N, *p]`` of
        ``call``'s parameters (the engine sizes column chunks by it); by default, whether the
        rule's statistics may (:meth:`Rule.builds_per_sample`)."""
        return rule.builds_per_sample(call)

    # -- distributed data parallelism (engine.distributed) ------------------------------------
    def distributed_unsupported(self, params: list[nn.Parameter]) -> str | None:
        """``None`` if this extension's results for ``params`` combine over the ranks of a
        distributed backward pass (:meth:`distributed_parts`, :meth:`distributed_result`), else
        the reason why not; a distributed pass then refuses the extension before anything is
        written. Default: no reduction is declared, so distributed passes refuse it."""
        return f"{type(self).__name__} declares no reduction over the ranks"

    def distributed_parts(self, value: Any, batch: GlobalBatch) -> list[SumPart | CatPart]:
        """What this rank contributes to the global result from its local ``value`` (the
        result stored for one parameter; for ``needs_param_grad`` extensions the partial
        result): tensors summed (:class:`SumPart`) or concatenated (:class:`CatPart`) over the
        ranks, already scaled by this rank for the global batch. The engine packs the parts of
        all extensions and parameters into few collective calls. Default: nothing (per-sample
        results that only need rescaling)."""
        return []

    def distributed_result(self, value: Any, reduced: list[Tensor], batch: GlobalBatch) -> Any:
        """The one-process result on the global batch (this rank's rows of it for per-sample
        results) from the local ``value`` and the reduced parts (in the order of
        :meth:`distributed_parts`); for ``needs_param_grad`` extensions the global partial,
        which :meth:`finish` completes with the global gradient of the pass. A tensor
        ``value`` has its own storage (no other result of the pass shares it) and may be
        rescaled in place."""
        raise NotImplementedError(f"{type(self).__name__} declares no reduction over the ranks")

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
    #: takes the signed residual columns only through the term they sum to, ``Σₖ wₖ cₖcₖᵀ``,
    #: so any decomposition of it serves (the engine balances and drops a product's pairs
    #: for precision: :func:`backprism.engine.bilinear.balance`); ``False`` for one that
    #: changes the weights (PCHMP's clipped eigenvalues), which needs the sites' own
    #: eigen-decompositions
    any_decomposition: bool = True
    #: takes the Hessian term of a product of a parameter's nested uses (a Linear weight that
    #: also feeds the layer's input: :class:`~backprism.engine.residual.NestedSite`) from
    #: columns with direct parts in the parameter's space, through :meth:`from_dense`
    nested_products: bool = False
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
