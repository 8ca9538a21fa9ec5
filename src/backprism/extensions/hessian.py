r"""Exact Hessian diagonals and a Hutchinson estimator.

With ``L = (1/N) Σₙ ℓₙ`` (``"sum"`` drops the ``1/N``), the Hessian of ``L`` w.r.t. the parameters
is the GGN plus one residual term per nonlinearity ``a = σ(z)`` between parameters and loss
(see :mod:`backprism.engine.residual`; for an elementwise ``σ``):

.. math::

    ∇²L = \frac{1}{N}\sum_n J_nᵀ S_n S_nᵀ J_n
          + \sum_σ J(z)ᵀ \operatorname{diag}\Big(\frac{∂L}{∂a} ⊙ σ''(z)\Big) J(z).

======================  =====================  ==========================================
extension               attribute              value
======================  =====================  ==========================================
DiagHessian             ``diag_h``             ``[*p]``: ``diag ∇²L``
BatchDiagHessian        ``diag_h_batch``       ``[N, *p]``: ``diag ∇²(ℓₙ/N)`` (sum: diag_h)
HutchinsonDiagHessian   ``diag_h_hutchinson``  ``[*p]``: ``(1/S) Σₛ vₛ ⊙ (∇²L vₛ)``
======================  =====================  ==========================================

(Hutchinson: ``vₛ`` Rademacher vectors.)

Under distributed data parallelism (:mod:`backprism.engine.distributed`, ``ρ = N_r/N`` for a
mean loss): ``diag_h`` and ``diag_h_hutchinson`` are ``Σ_r ρ_r · local`` (global), ``diag_h_batch``
this rank's rows ``ρ · local``. The Hutchinson estimate equals one process's when all ranks
draw the same Rademacher vectors (the same random state); otherwise it is still unbiased.

A row-wise nonlinearity (``layer_norm``, ``rms_norm``, ``group_norm`` — a row per group of
channels with its positions —, ``softmax``, ``softmin``) contributes
``Σ_ρ J(z_ρ)ᵀ R_ρ J(z_ρ)`` with ``R_ρ = Σₖ (∂L/∂a_ρₖ) ∇²a_ρₖ(z_ρ)`` per row ``ρ`` of ``d``
entries (``d`` Hessian-vector products and one ``d × d`` eigen-decomposition per row).

A product ``Z = X ∘ Y`` of two values that depend on the same parameters (``*``, batched
``@``) contributes ``2⟨∂L/∂Z, dX ∘ dY⟩``: per sample, the SVD ``∂L/∂Z_b = Σᵣ σ_br u_br v_brᵀ``
gives the signed columns ``√(σ_br/2)(u_br ⊗ eₖ, ±eₖ ⊗ v_br)`` (weight ``±1``) on both operands
(:mod:`backprism.engine.bilinear`); fused attention (``F.scaled_dot_product_attention``) the
terms of its ``Q Kᵀ``, softmax and ``P V`` (:mod:`backprism.engine.attention`).

``DiagHessian``/``BatchDiagHessian`` are exact for graphs built from layers that are linear in
their input and parameters (Linear, Conv, …), elementwise and row-wise nonlinearities (MLPs with
LayerNorm, ConvNeXt), products of parameter-dependent values (attention, eager or fused,
SwiGLU, Hugging Face's RMSNorm; GPT-2, BERT, ViT, Llama), piecewise-linear operations and
linear glue code, including parameters shared by parallel branches and Linear weights that also
feed their layer's input (a tied output layer, an unrolled cell:
:class:`~backprism.engine.residual.NestedSite`); anything else between
parameters and loss (other nested uses — a norm applied to its own output —, a custom
``autograd.Function`` such as Bloom's GeLU, attention dropout,
a product whose operands do not hold the samples on their first axis, a module without a rule
that is not affine in its parameters, or whose body holds an operation of unknown kind)
raises a clear error pointing to ``DiagGGNExact`` or ``HutchinsonDiagHessian``, which works on
any twice-differentiable graph.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor, nn

from backprism.engine.backward import current_pass
from backprism.engine.double_backward import explain_double_backward
from backprism.engine.residual import (
    NonlinearityError,
    check_linear_in_params,
    nested_uses,
    shared_message,
)
from backprism.engine.rule import Call, Rule
from backprism.engine.state import suspended
from backprism.extensions.base import PerSampleRows, SecondOrderExtension, SummedOverSamples

__all__ = ["BatchDiagHessian", "DiagHessian", "HutchinsonDiagHessian"]


def check_shared(ext: SecondOrderExtension, call: Call) -> None:
    """Refuse parameters used by nested calls unless the pass builds the term of the product
    of the uses (:class:`~backprism.engine.residual.NestedSite`, whose columns carry it). (The
    pass's check refuses them before anything is written,
    :func:`backprism.engine.residual.check_pass`; this guards the extensions' dense path
    itself.)"""
    bp = current_pass()
    if bp is None:
        raise NonlinearityError(shared_message(type(ext).__name__, call))
    if nested_uses(call, bp) and not (
        ext.nested_products and {id(p) for p in call.params.values()} <= bp.nested_params
    ):
        raise NonlinearityError(shared_message(type(ext).__name__, call))


def _weighted_squares(dense: Tensor, weights: Tensor | None) -> Tensor:
    sq = dense.square()
    if weights is not None:
        sq = sq * weights.reshape(weights.shape + (1,) * (dense.dim() - 2))
    return sq


class _Residual(SecondOrderExtension):
    needs_residual = True

    def column_key(self) -> Hashable:
        return ("exact",)


class DiagHessian(SummedOverSamples, _Residual):
    r"""Exact diagonal of the Hessian of the loss, ``diag_h``, shape ``param.shape``.

    ``diag_h = Σₖₙ V[k, n]² + Σ_σ Σⱼₙ sign(rₙⱼ) (∂zₙⱼ/∂θ)² |rₙⱼ|`` with the exact GGN square root
    ``V`` and the residuals ``r = ∂L/∂a ⊙ σ''(z)`` of the elementwise nonlinearities.
    """

    savefield = "diag_h"
    nested_products = True

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        check_linear_in_params(call, [self])
        return rule.sum_squared(call, g, weights)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        check_shared(self, call)
        return _weighted_squares(dense, weights).sum((0, 1))


class BatchDiagHessian(PerSampleRows, _Residual):
    r"""Per-sample terms of the Hessian diagonal, ``diag_h_batch``, ``[N, *param.shape]``:
    ``diag ∇²_θ(ℓₙ/N)`` (mean reduction; ``ℓₙ`` for ``"sum"``); they sum to ``diag_h``."""

    savefield = "diag_h_batch"
    nested_products = True
    #: (the residual terms are added unscaled during the backward: rescaled at the end)
    scaled_in_pass = False

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        check_linear_in_params(call, [self])
        return rule.batch_sum_squared(call, g, weights)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        check_shared(self, call)
        return _weighted_squares(dense, weights).sum(0)


class HutchinsonDiagHessian(SummedOverSamples, SecondOrderExtension):
    r"""Hutchinson estimate of the Hessian diagonal, ``diag_h_hutchinson``, shape ``param.shape``:

    .. math:: \hat d = \frac{1}{S}\sum_{s=1}^S v_s ⊙ (∇²L\, v_s),\qquad v_s ∼ \text{Rademacher}

    over all parameters of the extended model jointly, so ``E[\hat d] = diag ∇²L`` exactly and
    ``Var[\hat d_i] = (1/S) Σ_{j≠i} (∇²L)_{ij}²``. Works on any twice-differentiable graph
    (attention, LayerNorm, shared parameters). Fused attention kernels have no second
    derivative (PyTorch's CPU flash attention): a forward run inside the ``collect`` holding
    this extension computes attention with the math kernel automatically; a forward run
    outside it needs ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``, and the error says
    so. The
    Hessian-vector products are computed by double backward from the loss, re-evaluated from
    its recorded inputs when the backward pass starts (the forward graph is still intact then);
    cost ≈ ``1 + 2S`` extra backward passes.

    Args:
        samples: number ``S`` of Rademacher vectors (positive integer).
    """

    savefield = "diag_h_hutchinson"
    additive = True
    per_sample = False
    needs_double_backward = True

    def __init__(self, samples: int = 1) -> None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive integer, got {samples!r}")
        self.samples = samples

    def column_key(self) -> Hashable:
        # no columns: the work is done in handle_loss
        return ("hutchinson", self.samples)

    handles_loss = True

    def handle_loss(
        self, bp: Any, record: Any, calls: list, n_samples: int, scale: float
    ) -> None:
        """Engine hook at the loss (start of the backward pass): estimate and store."""
        bp.in_columns += 1  # the double backward below must not reach the call hooks
        try:
            estimates = self.estimate(record, [c for c, _ in calls], scale)
        finally:
            bp.in_columns -= 1
        for p, est in estimates.items():
            bp.store(p, self, est)
        for c, _ in calls:
            bp.touched[id(c.module)] = c.module

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        raise RuntimeError("HutchinsonDiagHessian is computed at the loss (handle_loss)")

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        raise RuntimeError("HutchinsonDiagHessian is computed at the loss (handle_loss)")

    def estimate(
        self, record: Any, calls: list[Call], scale: float = 1.0
    ) -> dict[nn.Parameter, Tensor]:
        """``(scale/S) Σₛ vₛ ⊙ ∇²L vₛ`` for the parameters of ``calls`` (upstream of the loss).

        The loss is recomputed from ``record.inputs`` (without being captured); ``scale`` is
        the gradient the backward pass feeds into it (``(c·L).backward()`` → ``c``)."""
        params: dict[int, nn.Parameter] = {}
        for c in calls:
            for p in c.params.values():
                params.setdefault(id(p), p)
        plist = list(params.values())
        if not plist:
            return {}
        with torch.enable_grad(), suspended():
            loss = record.module(*record.inputs)
            grads = torch.autograd.grad(
                loss, plist, create_graph=True, allow_unused=True
            )
            pairs = [(p, g) for p, g in zip(plist, grads) if g is not None and g.requires_grad]
            est = {p: torch.zeros_like(p).detach() for p in plist}
            if pairs:
                ps, gs = zip(*pairs)
                for _ in range(self.samples):
                    vs = [torch.randint_like(p, 2).mul_(2).sub_(1).detach() for p in ps]
                    with explain_double_backward("HutchinsonDiagHessian"):
                        hvs = torch.autograd.grad(
                            gs, ps, grad_outputs=vs, retain_graph=True, allow_unused=True
                        )
                    for p, v, hv in zip(ps, vs, hvs):
                        if hv is not None:
                            est[p] += v * hv.detach()
        return {p: e * (scale / self.samples) for p, e in est.items()}
