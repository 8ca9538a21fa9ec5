r"""Kronecker-factored curvature: ``KFAC``, ``KFLR`` (and ``KFRA`` on chains).

For a weight-like parameter the block of the GGN is approximated as ``B ⊗ A`` and stored as the
list ``[B, A]`` (``param.kfac`` / ``param.kflr``), for a bias as ``[B]``, following BackPACK:

* ``A = (1/N) Σₙ Σₜ xₙₜ xₙₜᵀ`` — the module's (unfolded) inputs, ``t`` over positions;
* ``B = Σₘ Σₙ (Σₜ gₘₙₜ)(Σₜ gₘₙₜ)ᵀ`` — the backpropagated loss-Hessian square-root columns
  (``1/√N`` of a mean loss included): Monte-Carlo with ``mc_samples`` sampled labels (KFAC) or
  exact (KFLR). ``B`` alone is the exact/MC GGN block of the bias.

For ``N = 1`` and no positions, ``B ⊗ A`` equals the exact GGN block of the weight (KFLR).

**Positions** (``t`` over a call's middle axes: a sequence's tokens, a convolution's output
pixels; ``T`` of them). The factors above are BackPACK's convention (``kfac_approx=None``).
``KFAC(kfac_approx=...)`` and ``KFLR(kfac_approx=...)`` also give the two approximations of
Eschenhagen et al. (2023) for weights shared over positions, as curvlinops does:

* ``"expand"`` — every position a sample of its own (losses over positions, as a language
  model's): ``A = (1/(N·T)) Σₙₜ xₙₜ xₙₜᵀ``, ``B = Σₘₙₜ gₘₙₜ gₘₙₜᵀ`` (the bias gets this ``B``);
* ``"reduce"`` — positions aggregated first (a pooled output, as a classifier's):
  ``A = (1/N) Σₙ x̄ₙ x̄ₙᵀ`` with ``x̄ₙ = (1/T) Σₜ xₙₜ``, ``B = Σₘₙ (Σₜ gₘₙₜ)(Σₜ gₘₙₜ)ᵀ``.

For one position (no middle axes, a 1×1 output map) the three agree. Embedding weights:
``A_tokens = diag(counts)/N`` (``"expand"``: ``/T``; ``"reduce"``: the mean one-hot inputs'
``(1/N) Σₙ c̄ₙ c̄ₙᵀ``, dense), ``B = Σₘₙₜ gₘₙₜ gₘₙₜᵀ`` (``"reduce"``: of the summed columns).
KFRA takes the same ``A`` and, from its recursion, ``B = Σₜ Ḡ_out[t, t]`` (``"expand"``) or
``Σₜₛ Ḡ_out[t, s]`` (``None``, ``"reduce"``).

**Block-diagonal factors.** Weights whose row blocks see different inputs are taken
block-diagonal over the blocks, the factors stacked along a leading axis: ``[B_g, A_g]`` of
shapes ``[G, O, O]`` and ``[G, I, I]``, the block of rows ``g`` ``≈ B_g[g] ⊗ A_g[g]`` — a
grouped convolution's weight (``G`` groups) and the packed ``in_proj_weight`` of cross-attention
(``G = 3``: query, key and value rows; their biases keep the full ``[B]``).

A parameter used by several calls (weight sharing) gets the sums of the calls' ``A`` and ``B``
factors (the "expand" convention for shared weights); where one call gives the stacked form and
another a single product (one ``MultiheadAttention`` run as self- and as cross-attention), the
single product's ``B`` contributes its diagonal blocks and its ``A`` every block. Embedding
weights ``[V, D]`` store ``[A_tokens, B]`` in the weight's own axis order (see the Embedding rule).

**Size.** A factor above :data:`~backprism.engine.rule.KRONECKER_FACTOR_MAX_BYTES` (2 GiB) is
refused, naming the parameter, when the pass starts (before anything is computed or written):
a factor over a vocabulary (an Embedding's ``A_tokens``, a language model's output layer's
``B``) is ``[V, V]`` by definition, 9.4 GiB at ``V = 50 257`` in float32. Freeze such a
parameter for the Kronecker pass, or raise the limit.

**Parameters without Kronecker structure** — elementwise ones (LayerNorm, RMSNorm (also Hugging
Face's ``LlamaRMSNorm`` & co.), GroupNorm and eval-mode BatchNorm scales and shifts) and those of
any module whose rule has no Kronecker form (the generic ``torch.func`` rule): the single-factor
form of a bias, ``[D]`` with ``D = diag(Σₘ Σₙ vec(Vₘₙ)²)`` (``[P, P]``, ``P = θ.numel()``,
row-major ``vec``), ``Vₘₙ = Jₙᵀ gₘₙ`` the per-sample, per-column gradients of the same columns:
the MC GGN diagonal for KFAC (``mc_samples`` sampled labels, ``D = diag(diag_ggn_mc)`` of
``DiagGGNMC(mc_samples)``), the exact GGN diagonal for KFLR and KFRA
(``D = diag(diag_ggn_exact)``). See :meth:`~backprism.engine.rule.Rule.kronecker_diagonal`.
A parameter used by several calls of which one has no Kronecker structure (a norm module
called twice, DeBERTa's relative embeddings fed to two projections, a weight also used
elementwise) gets ``[D]`` from all its uses at once: ``Vₘₙ`` summed over the calls before
squaring, so ``D`` is ``diag(diag_ggn_exact)`` / ``diag(diag_ggn_mc)`` there too (cross terms
between the calls included). Only parameters whose every call has Kronecker factors add their
factors over the calls.

Under distributed data parallelism (:mod:`backprism.engine.distributed`) the factors are those of
the global batch on every rank: ``B = Σ_r ρ_r B_r`` (loss weights, ``ρ = N_r/N`` for a mean
loss) and ``A = Σ_r (N_r/N) A_r`` (batch averages). KFRA's recursion averages over the batch at
every layer, so in a distributed pass it all-reduces those averages as it goes (one collective
call per nonlinearity, per-sample normalisation or sample-dependent pooling layer, plus one
at the loss).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn

from backprism.engine.extension import GlobalBatch, SumPart
from backprism.engine.loss_hessian import loss_hessian_sqrt
from backprism.engine.rule import (
    KFAC_APPROXIMATIONS,
    Call,
    Rule,
    check_diagonal_size,
    check_factor_sizes,
    get_rule,
    with_approx,
)
from backprism.engine.state import suspended
from backprism.extensions.base import SecondOrderExtension
from backprism.extensions.secondorder import _check_mc

__all__ = ["KFAC", "KFLR", "KFRA"]


class KroneckerFactors(list):
    """A list of Kronecker factors that remembers which calls its input-side factor came from,
    so that column chunks of one call add their ``B`` without adding ``A`` twice."""

    def __init__(self, factors: list[Tensor], calls: set[int], grad_side: list[bool]) -> None:
        super().__init__(factors)
        self.calls = calls
        self.grad_side = grad_side  # which factors depend on the backpropagated columns


def _check_approx(kfac_approx: str | None) -> str | None:
    if kfac_approx is not None and kfac_approx not in KFAC_APPROXIMATIONS:
        raise ValueError(
            f"kfac_approx must be None (BackPACK's convention), 'expand' or 'reduce'; got "
            f"{kfac_approx!r}"
        )
    return kfac_approx


class _Kronecker(SecondOrderExtension):
    additive = True
    #: a parameter used by several calls without Kronecker factors in one of them: its single
    #: diagonal factor from the squares of its per-sample gradients summed over the calls
    tied_statistic = "sum_squared"
    #: how weights shared over positions are factored (None: BackPACK's convention)
    kfac_approx: str | None = None

    def additive_over_calls(self, kronecker: bool) -> bool:
        """Factors add over the calls of a parameter that every call gives Kronecker factors
        (weight sharing, the "expand" convention); any other parameter used by several calls
        gets the single diagonal factor of its exact (KFLR) or MC (KFAC) GGN diagonal, from
        all its uses at once."""
        return kronecker

    def check_call(
        self, call: Call, kronecker: Callable[[], bool], label: Callable[[nn.Parameter], str]
    ) -> None:
        _check_sizes(self, call, kronecker, label)

    def from_statistic(self, statistic: Tensor, call: Call) -> KroneckerFactors:
        return _diagonal_factor(statistic, call)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> KroneckerFactors:
        if weights is not None:
            raise ValueError(f"{type(self).__name__} does not take signed columns")
        return _diagonal_factor(dense.square().sum((0, 1)), call)

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        if weights is not None:
            raise ValueError(f"{type(self).__name__} does not take signed columns")
        factors = with_approx(rule.kronecker_factors, call, g, approx=self.kfac_approx)
        out = {}
        for name, fs in factors.items():
            side = rule.kronecker_grad_side(call, name, len(fs))
            out[name] = KroneckerFactors(list(fs), {id(call)}, side)
        return out

    def distributed_unsupported(self, params: list[nn.Parameter]) -> str | None:
        return None

    def distributed_parts(self, value: KroneckerFactors, batch: GlobalBatch) -> list:
        """Output-side factors weighted ``ρ`` (loss), input-side ones ``N_r/N`` (batch)."""
        return [
            SumPart(f, batch.loss_weight if side else batch.batch_weight)
            for f, side in zip(value, value.grad_side)
        ]

    def distributed_result(
        self, value: KroneckerFactors, reduced: list[Tensor], batch: GlobalBatch
    ) -> KroneckerFactors:
        return KroneckerFactors(list(reduced), value.calls, value.grad_side)

    def accumulate(self, old: KroneckerFactors, new: KroneckerFactors) -> KroneckerFactors:
        # ``new`` comes from one call: its own ``grad_side`` says which of its factors are
        # per-chunk sums (the calls of a tied parameter may give the factors different roles,
        # e.g. Embedding ``[A_tokens, B]`` and Linear ``[B, A]``)
        same_call = new.calls <= old.calls
        merged = [
            _add(o, n) if (g or not same_call) else o
            for o, n, g in zip(old, new, new.grad_side, strict=True)
        ]
        return KroneckerFactors(merged, old.calls | new.calls, new.grad_side)


def _check_sizes(
    ext: Any, call: Call, kronecker: Callable[[], bool], label: Callable[[nn.Parameter], str]
) -> None:
    """Refuse, before the pass computes anything, a factor of ``call``'s parameters above
    the size limits: Kronecker factors (:func:`~backprism.engine.rule.check_factor_sizes`),
    or the single diagonal factor ``[P, P]`` where ``call`` has no Kronecker form."""
    rule = get_rule(call.module)
    form = kronecker()
    for name, p in call.params.items():
        if form:
            check_factor_sizes(rule, call, name, type(ext).__name__, lambda p=p: label(p))
        else:
            check_diagonal_size(
                p, call, name, "the rule it is computed with gives none", lambda p=p: label(p)
            )


def _diagonal_factor(diagonal: Tensor, call: Call) -> KroneckerFactors:
    """``[D]``, ``D = diag(vec(diagonal))`` ``[P, P]``: the single-factor form of a parameter
    without Kronecker structure (:meth:`~backprism.engine.rule.Rule.kronecker_diagonal`)."""
    check_diagonal_size(diagonal, call)
    return KroneckerFactors([torch.diag(diagonal.reshape(-1))], {id(call)}, [True])


def _add(old: Tensor, new: Tensor) -> Tensor:
    """``old + new``; where one call gives a weight block-diagonal factors stacked over groups
    (``[G, O, O]``: a packed cross-attention projection) and another a single product, the
    single one is taken block-diagonal too: the diagonal blocks of its ``[G·O, G·O]`` output
    factor, its input factor ``[I, I]`` for every group."""
    if old.shape == new.shape:
        return old + new
    flat, stacked = (old, new) if old.dim() < new.dim() else (new, old)
    g, o = stacked.shape[0], stacked.shape[-1]
    if flat.dim() == 2 and stacked.dim() == 3:
        if flat.shape == stacked.shape[1:]:  # input side: the same for every group
            return stacked + flat
        if flat.shape == (g * o, g * o):  # output side: its diagonal blocks
            return stacked + torch.stack([flat[i * o : (i + 1) * o, i * o : (i + 1) * o]
                                          for i in range(g)])
    raise ValueError(
        f"backprism: Kronecker factors of shapes {tuple(old.shape)} and {tuple(new.shape)} of "
        "one parameter used by several calls cannot be added (neither is the other's "
        "block-diagonal form)"
    )


class KFAC(_Kronecker):
    r"""Kronecker-factored approximate curvature with a Monte-Carlo ``B`` factor
    (``mc_samples`` sampled labels), stored in ``param.kfac``.

    ``[B, A]`` per weight of Linear, Conv, ConvTranspose, Embedding (``[A_tokens, B]``), GPT-2
    ``Conv1D`` (``[A, B]``) and attention projections (cross-attention's packed
    ``in_proj_weight``: stacked ``[3, E, E]`` blocks, see the module docstring), ``[B]`` per
    bias. Every other trainable
    parameter (norm scales and shifts, parameters of generic modules) gets ``[D]``, the MC GGN
    diagonal of the same ``mc_samples`` columns as a ``[P, P]`` diagonal matrix:
    ``D = diag(Σₘ Σₙ vec(Vₘₙ)²)``, ``Vₘₙ = Jₙᵀ gₘₙ`` with the columns scaled ``1/√M`` (and
    ``1/√N`` for a mean loss), so ``E[D]`` is the exact GGN diagonal.

    Args:
        mc_samples: sampled labels per sample.
        kfac_approx: how a weight shared over a call's positions (a sequence's tokens, a
            convolution's output pixels) is factored: ``None`` (BackPACK's convention,
            ``A = (1/N) Σₙₜ xₙₜxₙₜᵀ``, ``B`` from the positions' summed columns), ``"expand"``
            (every position a sample: ``A = (1/(NT)) Σₙₜ xₙₜxₙₜᵀ``, ``B = Σₘₙₜ gₘₙₜgₘₙₜᵀ``; for
            losses over positions, as language models) or ``"reduce"`` (positions aggregated:
            ``A`` of the position means ``x̄ₙ``, ``B`` from the summed columns; for a pooled
            output, as classifiers), after Eschenhagen et al. (2023). With one position all
            agree. See the module docstring.
    """

    savefield = "kfac"

    def __init__(self, mc_samples: int = 1, kfac_approx: str | None = None) -> None:
        self.mc_samples = _check_mc(mc_samples)
        self.kfac_approx = _check_approx(kfac_approx)

    def column_key(self) -> Hashable:
        return ("mc", self.mc_samples)


class KFLR(_Kronecker):
    """Kronecker-factored low-rank curvature: exact ``B`` factor from the exact loss-Hessian
    square root, stored in ``param.kflr``.

    Layers and formats as :class:`KFAC`; parameters without Kronecker structure (norm scales
    and shifts, generic modules) get ``[D]`` with ``D`` the exact GGN diagonal
    (``diag(diag_ggn_exact)``, ``[P, P]``).

    Args:
        kfac_approx: ``None`` (BackPACK's convention), ``"expand"`` or ``"reduce"``, as for
            :class:`KFAC`.
    """

    savefield = "kflr"

    def __init__(self, kfac_approx: str | None = None) -> None:
        self.kfac_approx = _check_approx(kfac_approx)

    def column_key(self) -> Hashable:
        return ("exact",)


_ELEMENTWISE = (
    nn.ReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.ELU,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Softplus,
    nn.Mish,
    nn.Hardtanh,
    nn.SELU,
    nn.CELU,
    nn.ReLU6,
    nn.LogSigmoid,
    nn.Softsign,
)
_IDENTITY = (nn.Flatten, nn.Identity, nn.Dropout, nn.Unflatten)
_SAMPLE_INDEPENDENT = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.ZeroPad2d,
    nn.ConstantPad1d,
    nn.ConstantPad2d,
    nn.ConstantPad3d,
)
_SAMPLE_DEPENDENT = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
#: modules whose weights KFRA's recursion gives ``[Ḡ_out, A]``
_KRONECKER_TYPES = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: normalisation layers (per-sample in eval mode; their parameters get the exact GGN diagonal)
_NORMS = (nn.LayerNorm, nn.GroupNorm, *_BATCHNORM) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()
)


def _chain(module: nn.Module) -> list[nn.Module]:
    if isinstance(module, nn.Sequential):
        return [m for child in module for m in _chain(child)]
    return [module]


def _psd_factor(G: Tensor) -> Tensor:
    """``L`` with ``G ≈ L Lᵀ`` from the eigen-decomposition (negative round-off dropped)."""
    evals, evecs = torch.linalg.eigh((G + G.t()) / 2)
    keep = evals > evals.abs().max().clamp_min(1e-30) * 1e-10
    return evecs[:, keep] * evals[keep].sqrt()


class KFRA(SecondOrderExtension):
    r"""Kronecker-factored recursive approximation (Botev et al., 2017), stored in ``param.kfra``.

    The batch-averaged Hessian of the loss w.r.t. the model output, ``Ḡ = (1/N) Σₙ ∇²_{fₙ} ℓₙ``
    (for a mean loss; ``Σₙ`` for sum), is propagated backwards through the chain:
    ``Ḡ_in = (1/N) Σₙ Jₙᵀ Ḡ_out Jₙ`` (Linear: ``Wᵀ Ḡ W``, with middle axes ``T`` of the input
    ``[N, *T, I]`` ``(I_T ⊗ W)ᵀ Ḡ (I_T ⊗ W)``; elementwise σ: ``Ḡ ⊙ E[σ'σ'ᵀ]``; convolution /
    pooling: through autograd). A weight gets ``[B, A]`` with ``A`` as in :class:`KFLR` and
    ``B = Σₜₛ Ḡ_out[t, s]`` (the ``[O, O]`` / ``[C_out, C_out]`` blocks of ``Ḡ_out`` summed over
    output positions ``t, s`` — Linear middle axes or convolution positions, as BackPACK does for
    convolutions and as :class:`KFLR`'s ``B`` sums the columns over positions), a bias ``[B]``;
    a grouped convolution's weight ``B``'s diagonal blocks ``[G, O, O]`` (as :class:`KFLR`).

    ``kfac_approx`` as for :class:`KFAC` (Eschenhagen et al., 2023), with ``Ḡ`` in place of
    the columns' outer products: ``"expand"`` (every position a sample) takes ``A`` of
    :class:`KFLR`'s ``"expand"`` (divided by the ``T`` positions) and
    ``B = Σₜ Ḡ_out[t, t]``, the diagonal blocks only (the bias's ``B`` too); ``"reduce"``
    (positions aggregated first) takes ``A`` of the position means and ``B = Σₜₛ Ḡ_out[t, s]``
    as BackPACK's. With one position (no middle axes, a 1×1 output map) the three agree; for
    ``N = 1`` each equals :class:`KFLR` with the same ``kfac_approx``.

    Parameters without Kronecker structure — the scales and shifts of LayerNorm, RMSNorm,
    GroupNorm and eval-mode BatchNorm, and the parameters of any other module in the chain whose
    rule has no Kronecker form (a module of its own with the generic ``torch.func`` rule, e.g. a
    hand-written RMSNorm) — get ``[D]`` with ``D`` the **exact** GGN diagonal
    ``diag(Σₖ Σₙ vec(Vₖₙ)²)`` (``[P, P]``, as :class:`KFLR`; ``Vₖₙ = Jₙᵀ gₖₙ`` from the exact
    loss-Hessian square root, ``1/√N`` of a mean loss included), not a recursion value: the
    exact columns are pushed back to those layers' outputs once (their cost is that of KFLR
    for those layers). The recursion passes through them (``Ḡ_in = (1/N) Σₙ Jₙᵀ Ḡ_out Jₙ``
    with autograd; BatchNorm in eval mode with its sample-independent Jacobian).

    Only for models that are chains (``nn.Sequential``, nested allowed) of Linear, Conv,
    elementwise activations, pooling, Flatten, Dropout in eval mode, LayerNorm, RMSNorm,
    GroupNorm, BatchNorm in eval mode (with running statistics) and parameter-owning modules
    without Kronecker form (no parameter-owning descendants; they must not mix samples, as for
    every per-sample rule); anything else raises — residual connections and attention are not
    chains: use KFLR or KFAC there. ``Ḡ`` is dense over a layer's flattened output, so KFRA is
    practical only for small convolutional feature maps.
    """

    savefield = "kfra"
    additive = True
    #: how weights shared over positions are factored (None: BackPACK's convention)
    kfac_approx: str | None = None

    def __init__(self, kfac_approx: str | None = None) -> None:
        self.kfac_approx = _check_approx(kfac_approx)

    check_call = _Kronecker.check_call

    def column_key(self) -> Hashable:
        return ("exact",)

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        raise RuntimeError("KFRA is computed by its own recursion (handle_loss)")

    handles_loss = True
    supports_folded = False  # (its recursion runs call by call on unfolded batches)

    def handle_loss(self, bp: Any, record: Any, calls: list, n: int, scale: float) -> None:
        modules = {id(c.module) for c, _ in calls}
        roots = list(
            {
                id(r.module): (r.module, r.args)
                for r in bp.roots
                if any(id(sub) in modules for sub in r.module.modules())
            }.values()
        )
        if len(roots) != 1 or not isinstance(roots[0][0], nn.Sequential):
            raise NotImplementedError(
                "KFRA needs the extended model to be an nn.Sequential chain; use KFLR or KFAC "
                "for other architectures"
            )
        root, args = roots[0]
        chain = _chain(root)
        by_call = {id(c.module): c for c, _ in calls}
        diagonal: set[int] = set()  # modules whose parameters get the exact GGN diagonal
        for m in chain:
            if isinstance(m, _BATCHNORM) and (m.training or m.running_mean is None):
                raise NotImplementedError(
                    f"KFRA: {type(m).__name__} normalises with the statistics of the current "
                    "batch (train mode or track_running_stats=False), which mixes the samples. "
                    "Call model.eval() with track_running_stats=True for the backward pass"
                )
            call = by_call.get(id(m))
            if (
                call is not None
                and not isinstance(m, _KRONECKER_TYPES)
                and _owns_all_parameters(m)
                and not get_rule(m).kronecker_form(call)
            ):
                diagonal.add(id(m))
            ok = id(m) in diagonal or isinstance(
                m,
                (
                    nn.Linear,
                    *_ELEMENTWISE,
                    *_IDENTITY,
                    *_SAMPLE_INDEPENDENT,
                    *_SAMPLE_DEPENDENT,
                    *_NORMS,
                ),
            )
            if not ok or (isinstance(m, nn.Dropout) and m.training and m.p > 0):
                raise NotImplementedError(
                    f"KFRA does not support {type(m).__name__} in the chain; supported: Linear, "
                    "Conv, ConvTranspose, elementwise activations, pooling, Flatten, Dropout "
                    "(eval), LayerNorm, RMSNorm, GroupNorm, BatchNorm (eval) and parameter-owning "
                    "modules without Kronecker form. Use KFLR or KFAC instead"
                )
        cols = loss_hessian_sqrt(record.module, record.inputs, ("exact",), n).materialize()
        if len(cols) != 1:
            raise NotImplementedError("KFRA needs a loss with a single differentiable input")
        s = cols[0].flatten(2)  # [K, N, D]
        G = torch.einsum("kni,knj->ij", s, s) * scale
        dp = bp.distributed  # distributed: the batch averages of the recursion are global
        if dp is not None:
            G = dp.loss_average(G)
        with suspended(), torch.no_grad():
            xs = [args[0]]
            for m in chain:
                xs.append(m(xs[-1]))
        first_param = next((i for i, m in enumerate(chain) if _trainable(m)), len(chain))
        for i in reversed(range(first_param, len(chain))):
            m, x = chain[i], xs[i]
            if _trainable(m) and id(m) not in diagonal:
                self._store_factors(bp, by_call.get(id(m)), m, G, xs[i + 1])
            if i > first_param:
                G = self._backprop(m, x, G, None if dp is None else dp.batch_average)
        # parameters without Kronecker structure: the exact GGN diagonal from the exact
        # loss-Hessian square root pushed back to their outputs (as KFLR would)
        diag_calls = [(c, e) for c, e in calls if id(c.module) in diagonal]
        if diag_calls:
            origins, exact = bp.loss_columns(record, ("exact",), scale)
            bp.process_columns(diag_calls, origins, exact, [_KFRADiagonal()], None)
        return None

    def _store_factors(self, bp, call, m, G, out) -> None:
        if call is None:
            return
        a = with_approx(get_rule(m).kfac_input, call, approx=self.kfac_approx)
        expand = self.kfac_approx == "expand"
        if isinstance(m, nn.Linear):  # features last: output [N, *T, O], Ḡ over (t, o)
            c = out.shape[-1]
            positions = out[0].numel() // c
            G4 = G.reshape(positions, c, positions, c)
            pos = (0, 2)
        else:  # convolutions: channels first, output [N, C, *S], Ḡ over (c, s)
            c = out.shape[1]
            positions = out[0].numel() // c
            G4 = G.view(c, positions, c, positions)
            pos = (1, 3)
        if positions == 1:
            B = G
        elif expand:  # Σₜ Ḡ[t, t]: the positions' diagonal blocks
            B = torch.diagonal(G4, dim1=pos[0], dim2=pos[1]).sum(-1)
        else:
            B = G4.sum(pos)
        groups = getattr(m, "groups", 1)
        for name, p in call.params.items():
            bw = B
            if name in a and groups > 1:  # a grouped convolution: B's diagonal blocks
                o = c // groups
                blocks = [B[h * o : (h + 1) * o, h * o : (h + 1) * o] for h in range(groups)]
                bw = torch.stack(blocks)
            value = KroneckerFactors(
                [bw, a[name]] if name in a else [B],
                {id(call)},
                [True, False][: 2 if name in a else 1],
            )
            bp.store(p, self, value)
        bp.touched[id(m)] = m

    def accumulate(self, old: KroneckerFactors, new: KroneckerFactors) -> KroneckerFactors:
        return _Kronecker.accumulate(self, old, new)  # type: ignore[arg-type]

    def distributed_unsupported(self, params: list[nn.Parameter]) -> str | None:
        return None

    def distributed_parts(self, value: KroneckerFactors, batch: GlobalBatch) -> list:
        """``B = Ḡ_out`` is already global (the recursion reduced it); ``A`` is reduced here."""
        return [SumPart(f, batch.batch_weight) for f, s in zip(value, value.grad_side) if not s]

    def distributed_result(
        self, value: KroneckerFactors, reduced: list[Tensor], batch: GlobalBatch
    ) -> KroneckerFactors:
        it = iter(reduced)
        merged = [f if side else next(it) for f, side in zip(value, value.grad_side)]
        return KroneckerFactors(merged, value.calls, value.grad_side)

    @staticmethod
    def _backprop(m: nn.Module, x: Tensor, G: Tensor, average: Any = None) -> Tensor:
        """``Ḡ_in = (1/N) Σₙ Jₙᵀ Ḡ_out Jₙ``; ``average`` makes a local batch average global
        (distributed passes)."""
        n = x.shape[0]
        if average is None:

            def average(t: Tensor) -> Tensor:
                return t

        if isinstance(m, nn.Linear):
            w = m.weight.detach()
            t = x[0].numel() // x.shape[-1]  # positions: product of the middle axes
            if t == 1:
                return w.t() @ G @ w
            # Jₙ = I_T ⊗ W on the flattened [T, O] output:
            # Ḡ_in[s, a, u, b] = Σₒᵣ W[o, a] Ḡ[s, o, u, r] W[r, b]
            o = w.shape[0]
            Gin = torch.einsum("oa,sour,rb->saub", w, G.reshape(t, o, t, o), w)
            return Gin.reshape(t * w.shape[1], t * w.shape[1])
        if isinstance(m, _IDENTITY):
            return G
        x = x.detach().requires_grad_(True)
        with torch.enable_grad(), suspended():
            if isinstance(m, _ELEMENTWISE):
                (d,) = torch.autograd.grad(m(x).sum(), x)
                d = d.reshape(n, -1)
                return G * average(d.t() @ d / n)
            # eval-mode BatchNorm is affine with running statistics: the same Jacobian for
            # every sample; other normalisations and generic modules act per sample
            sample_independent = isinstance(m, (*_SAMPLE_INDEPENDENT, *_BATCHNORM))
            xin = x[:1] if sample_independent else x
            out = m(xin)
            L = _psd_factor(G)  # [D_out, r]
            res = x.new_zeros(x[0].numel(), x[0].numel())
            r = L.shape[1]
            step = max(1, int(2**26 // max(1, out.numel())))
            for start in range(0, r, step):
                cols = L[:, start : start + step].t()  # [c, D_out]
                go = cols[:, None].expand(-1, out.shape[0], -1).reshape(-1, *out.shape)
                (v,) = torch.autograd.grad(out, xin, go, retain_graph=True, is_grads_batched=True)
                v = v.reshape(-1, x[0].numel())
                res += v.t() @ v
            return res if sample_independent else average(res / n)


def _trainable(m: nn.Module) -> bool:
    return any(p.requires_grad for p in m.parameters(recurse=False))


def _owns_all_parameters(m: nn.Module) -> bool:
    """``m`` has trainable parameters of its own and its descendants have none (one call of
    its rule covers them)."""
    return _trainable(m) and not any(
        p.requires_grad for sub in m.modules() if sub is not m for p in sub.parameters(False)
    )


class _KFRADiagonal(_Kronecker):
    """KFRA's exact GGN diagonal ``[D]`` for parameters without Kronecker structure (the rules'
    :meth:`~backprism.engine.rule.Rule.kronecker_diagonal` on exact columns), stored in
    ``param.kfra``; reduced over ranks like KFLR's ``B`` (a loss-weighted local sum)."""

    savefield = "kfra"

    def column_key(self) -> Hashable:
        return ("exact",)
