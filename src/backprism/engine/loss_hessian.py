r"""Square roots of loss Hessians with respect to the model outputs.

:func:`loss_hessian_sqrt` returns lazily generated columns ``S[k]`` (one tensor per differentiable
loss input, each ``[K, *input.shape]``) such that for every model sample ``n``

.. math::  \sum_k S_k[n] S_k[n]^\top = \nabla^2_{f_n} L \quad\text{(exact)}, \qquad
           \mathbb{E}\Big[\sum_k S_k[n] S_k[n]^\top\Big] = \nabla^2_{f_n} L \quad\text{(MC)},

where ``L`` is the loss *as reduced by the module* (``reduction="mean"`` divides by the number of
loss elements — or by the summed class weights of the targets for weighted ``CrossEntropyLoss`` /
``NLLLoss`` with class-index targets, exactly as PyTorch does; ``"sum"`` divides by 1). Only the
per-sample diagonal blocks matter (the losses are sums over samples), so a column is in general
nonzero in all samples at once.

Samples and positions. The model's batch has ``n_samples`` samples; the loss input's rows are
grouped *sample-major*: if it has ``R = n_samples·P`` rows (e.g. a ``[N, T, C]`` output flattened
to ``[N·T, C]``), rows ``n·P, …, n·P + P − 1`` belong to sample ``n``. ``R`` must be a multiple of
``n_samples``.

Supported losses (``reduction`` ``"mean"`` or ``"sum"``):

* ``CrossEntropyLoss`` — input ``[R, C, d₁, …]`` (``D = d₁·d₂·…`` spatial positions), class-index
  targets (with ``ignore_index``, class ``weight``, ``label_smoothing``) or probability targets
  (same shape as the input). Per position with softmax ``p`` the Hessian is
  ``a·(diag p − p pᵀ)/Z`` with ``a = (1−ε)·w_y + (ε/C)·Σ_c w_c`` (``a = 0`` for ignored
  positions; probability targets ``q``: ``a = Σ_c w_c q̃_c``, ``q̃ = (1−ε)q + ε/C``) and ``Z`` the
  reduction's denominator. Exact: ``K = C·P·D`` columns, column ``(c, p, d)`` (index
  ``k = c·P·D + p·D + d``) is ``√(a/Z)·√p_c (e_c − p)`` at row ``n·P + p``, position ``d`` of
  every sample ``n`` and zero elsewhere. MC: column ``m`` is ``√(a/Z)(p − e_ŷ)/√M`` at every
  position, with independent ``ŷ ~ Cat(p)`` per position (``E[(p − e_ŷ)(p − e_ŷ)ᵀ] =
  diag p − p pᵀ`` and cross-position terms vanish in expectation).
* ``NLLLoss`` fed by ``log_softmax`` over the class axis: the columns live at the
  log-probabilities ``l`` (``p = exp l``). Exact: ``√(a/Z)·√p_c e_c`` (backpropagated through
  ``log_softmax``, whose Jacobian transpose maps ``e_c ↦ e_c − p``, they become the
  cross-entropy columns above); MC: ``−√(a/Z)·e_ŷ/√M``, ``ŷ ~ Cat(p)``. ``a = w_y`` (0 if
  ignored). An input that does not come straight from ``log_softmax`` is refused: NLL alone is
  linear in its input and its Hessian is zero.
* ``MSELoss`` — any shape (broadcasting included), ``∇² = 2/Z·I``. Exact: one column per loss
  element of a sample, ``√(2/Z)·e_j``; MC: ``√(2/Z)·z/√M``, ``z ~ N(0, I)`` (the gradient at a
  target sampled from ``N(f, I/2)``). If the target requires grad too, its columns are the
  negated input columns (the joint Hessian is ``2/Z·[[I, −I], [−I, I]]``).
* ``BCEWithLogitsLoss`` — any shape, ``weight`` ``w``, ``pos_weight`` ``w⁺``:
  ``∇² = diag(w·σ(1−σ)·(w⁺y + 1 − y))/Z`` (``w⁺ = 1`` when absent). Exact: ``√h_j e_j``. MC
  without ``pos_weight``: ``√(w/Z)(σ − ŷ)/√M`` with ``ŷ ~ Bernoulli(σ)`` (the Hessian does not
  depend on the target then); with ``pos_weight``: Rademacher-signed ``±√h/√M`` (the Hessian
  depends on the observed target, so sampling labels would estimate a different matrix).
* ``GaussianNLLLoss(input=μ, target, var)`` — with ``v = max(var, eps)`` (broadcast as PyTorch
  does), ``∇²_μ = diag(1/v)/Z`` (``full`` adds a constant only). Exact: ``e_j/√(v_j Z)``; needs
  ``var`` not to require grad (the Hessian in ``var`` is indefinite). MC: gradients at
  ``y ~ N(μ, v)`` scaled by ``1/√(Z M)``: ``−z/√v`` for ``μ`` and, when ``var`` requires grad,
  ``(1 − z²)/(2v)`` for ``var`` (columns for inputs ``[0, 2]``); their expected outer product is
  the Fisher information ``diag(1/v, 1/(2v²))/Z`` = the expected Hessian over the targets.
  A target that requires grad gets the negated ``μ`` columns (if ``var`` does not).

Cost at language-model scale. Exact cross-entropy columns number ``K = C·P·D`` per sample
(vocabulary × positions: 65,536 for a 2048-token vocabulary at 32 positions), and each one is
pushed back through the whole model, so exact curvature costs about ``K`` backward passes. No
exact square root has fewer columns: the Hessian of one position, ``diag p − p pᵀ``, has rank
``C − 1``, and the positions of a sample are independent blocks. What is cheap here: a chunk of
exact columns is a contiguous range of classes (a vocabulary chunk, sized by the engine from
``collect(memory_budget=)``) written straight into the input's layout, and MC columns cost one
binary search per position plus one scatter (no one-hot tensor). Above
:data:`EXACT_COLUMNS_WARNING` exact columns per sample a :class:`CurvatureCostWarning` (once
per ``(C, positions)`` and process) points to the Monte-Carlo extensions (``DiagGGNMC``,
``KFAC``, ``SqrtGGNMC``), which need ``mc_samples`` columns whatever the vocabulary.

MC columns use torch's global RNG: one draw seeds a generator per column, so the numbers do not
depend on how the engine chunks the columns, and ``torch.manual_seed`` makes them reproducible.

BackPACK's draw (the column key ``("mc", M, BACKPACK_DRAW, owner)``, see :func:`backpack_mc_key`;
the BackPACK shim's MC extensions ask for it). BackPACK 1.7 samples targets from the likelihood
whose negative log is the loss, all ``M`` samples at once with one call on torch's global RNG per
extension, and takes the gradients at the sampled targets; the shim reproduces those calls (same
distribution, same shapes, same order), so a script seeded with ``torch.manual_seed`` gets
BackPACK's numbers. With ``x`` the loss input, ``M`` samples and ``Z`` the reduction's
denominator:

* ``CrossEntropyLoss``: ``ŷ = Categorical(p).sample((M,))`` with ``p = softmax(x, 1)`` moved to
  the last axis (``torch.multinomial(p, M, replacement=True)ᵀ`` on the ``[rows·D, C]``
  probabilities), column ``m`` = ``√(a/Z)(p − e_ŷₘ)/√M`` (``a = 1`` without weights or label
  smoothing, as BackPACK supports).
* ``MSELoss``: ``y = Normal(x, σ).sample((M,))`` with ``σ = torch.tensor(√½)`` of torch's default
  dtype (float32 unless changed: BackPACK's columns carry its rounding, ``2σ ≈ √2(1 − 1.7e-8)``),
  column ``m`` = ``2(yₘ − x)/√(M Z)``.
* ``BCEWithLogitsLoss`` without ``pos_weight``: ``ŷ = Binomial(1, σ(x)).sample((M,))`` (one
  ``torch.binomial`` call), column ``m`` = ``√(w/Z)(σ(x) − ŷₘ)/√M``.

The columns are drawn when :func:`loss_hessian_sqrt` is called (all ``M`` at once, so chunking
only slices them). Losses BackPACK does not sample (``NLLLoss``, ``GaussianNLLLoss``,
``BCEWithLogitsLoss`` with ``pos_weight``) keep the per-column generators. Each distinct key
is one draw: the engine builds columns once per distinct key in a backward pass, so the
``owner`` (the extension) makes every MC extension draw on its own, in the order the extensions
were given, as BackPACK does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from backprism.engine.columns import Columns
from backprism.engine.fold import saved_dim

__all__ = [
    "BACKPACK_DRAW",
    "EXACT_COLUMNS_WARNING",
    "SUPPORTED_LOSSES",
    "CurvatureCostWarning",
    "backpack_mc_key",
    "check_supported",
    "loss_hessian_sqrt",
]

#: third element of a Monte-Carlo column key ``("mc", M, BACKPACK_DRAW, owner)``: draw the
#: columns with BackPACK 1.7's calls on torch's global RNG (see the module docstring)
BACKPACK_DRAW = "backpack"

#: loss modules :func:`loss_hessian_sqrt` knows
SUPPORTED_LOSSES: tuple[type[nn.Module], ...] = (
    nn.CrossEntropyLoss,
    nn.NLLLoss,
    nn.MSELoss,
    nn.BCEWithLogitsLoss,
    nn.GaussianNLLLoss,
)


def loss_hessian_sqrt(
    module: nn.Module, inputs: Sequence[Any], key: Hashable, n_samples: int
) -> Columns:
    """Columns ``S`` with ``Σₖ Sₖ[n] Sₖ[n]ᵀ = ∇²_{fₙ} L`` (exactly or in expectation).

    Args:
        module: the loss module (see :data:`SUPPORTED_LOSSES`).
        inputs: its positional (then keyword) arguments as passed to the forward call;
            tensors that require grad are the differentiable loss inputs.
        key: ``("exact",)`` or ``("mc", M)`` with ``M`` the number of Monte-Carlo samples;
            ``("mc", M, BACKPACK_DRAW, owner)`` (:func:`backpack_mc_key`) draws them as
            BackPACK does (``owner`` only tells keys apart).
        n_samples: the model's batch size ``N``; the loss input's rows are grouped sample-major
            into ``N`` samples of ``rows / N`` rows each.

    Returns:
        :class:`~backprism.engine.columns.Columns` whose ``chunk(start, stop)`` gives one
        ``[stop − start, *input.shape]`` tensor per differentiable loss input listed in
        ``.inputs`` (indices into ``inputs``). See the module docstring for every loss's formulas.
    """
    name = type(module).__name__
    check_supported(module)
    reduction = getattr(module, "reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"backprism: {name}(reduction={reduction!r}) gives no per-sample scaling; use "
            "reduction='mean' or 'sum'"
        )
    mc, backpack = _parse_key(key)
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}")
    inputs = list(inputs)
    if isinstance(module, nn.CrossEntropyLoss):
        return _cross_entropy(module, inputs, mc, n_samples, backpack)
    if isinstance(module, nn.NLLLoss):
        return _nll(module, inputs, mc, n_samples)
    if isinstance(module, nn.MSELoss):
        return _mse(module, inputs, mc, n_samples, backpack)
    if isinstance(module, nn.BCEWithLogitsLoss):
        return _bce_with_logits(module, inputs, mc, n_samples, backpack)
    return _gaussian_nll(module, inputs, mc, n_samples)


def check_supported(module: nn.Module) -> None:
    """Raise ``NotImplementedError`` unless :func:`loss_hessian_sqrt` knows ``module``'s loss:
    an instance of a :data:`SUPPORTED_LOSSES` type whose ``forward`` is that type's own (a
    subclass that overrides ``forward`` — a focal loss, a temperature — computes another
    function, whose Hessian the base class's formulas would silently misstate)."""
    name = type(module).__name__
    base = next((t for t in type(module).__mro__ if t in SUPPORTED_LOSSES), None)
    if base is None:
        supported = ", ".join(t.__name__ for t in SUPPORTED_LOSSES)
        hint = ""
        if isinstance(module, nn.BCELoss):
            hint = " (use BCEWithLogitsLoss on logits instead)"
        raise NotImplementedError(
            f"backprism: no loss-Hessian square root for {name}{hint}; second-order extensions "
            f"support {supported}"
        )
    if type(module).forward is not base.forward:
        raise NotImplementedError(
            f"backprism: {name} derives from {base.__name__} but overrides forward(), so its "
            f"Hessian is not {base.__name__}'s and second-order extensions cannot use "
            f"{base.__name__}'s formulas for it. Compute the loss as an extended "
            f"{base.__name__} applied to the model's outputs (e.g. fold a temperature into the "
            "model), or use first-order extensions, which do not depend on the loss's Hessian"
        )


def backpack_mc_key(mc_samples: int, owner: Hashable = None) -> tuple:
    """The column key of ``mc_samples`` Monte-Carlo columns drawn as BackPACK 1.7 draws them.

    Args:
        mc_samples: the number ``M`` of sampled targets.
        owner: tells apart the keys of extensions that must draw separately (the engine builds
            columns once per distinct key in a backward pass); e.g. ``id(extension)``.

    Returns:
        ``("mc", mc_samples, BACKPACK_DRAW, owner)``.
    """
    return ("mc", mc_samples, BACKPACK_DRAW, owner)


# -- helpers -----------------------------------------------------------------------------------


def _parse_key(key: Hashable) -> tuple[int | None, bool]:
    """``(None, False)`` for exact columns, ``(M, backpack)`` for Monte-Carlo (``backpack``:
    BackPACK's draw, key ``("mc", M, BACKPACK_DRAW, owner)``)."""
    if isinstance(key, tuple) and key == ("exact",):
        return None, False
    if (
        isinstance(key, tuple)
        and len(key) in (2, 4)
        and key[0] == "mc"
        and isinstance(key[1], int)
        and not isinstance(key[1], bool)
        and key[1] >= 1
        and (len(key) == 2 or key[2] == BACKPACK_DRAW)
    ):
        return key[1], len(key) == 4
    raise ValueError(
        "column key must be ('exact',), ('mc', M) or ('mc', M, 'backpack', owner) with M >= 1, "
        f"got {key!r}"
    )


def _arg(inputs: list[Any], i: int, what: str, name: str) -> Any:
    if len(inputs) <= i:
        raise ValueError(f"backprism: {name} was called without its {what} argument")
    return inputs[i]


def _model_input(inputs: list[Any], name: str) -> Tensor:
    x = _arg(inputs, 0, "input", name)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"backprism: the input of {name} must be a floating-point tensor")
    if not x.requires_grad:
        raise ValueError(
            f"backprism: the input of {name} does not require grad, so the loss has no curvature "
            "with respect to the model; pass the model output as the first argument"
        )
    return x


def _refuse_target_grad(target: Any, name: str) -> None:
    if isinstance(target, Tensor) and target.requires_grad:
        raise ValueError(
            f"backprism: the target of {name} requires grad; the loss Hessian w.r.t. "
            "(input, target) is indefinite, so it has no square root. Detach the target"
        )


def _rows_per_sample(rows: int, n_samples: int, name: str, layout: str) -> int:
    if rows < n_samples or rows % n_samples:
        raise ValueError(
            f"backprism: the input of {name} has {rows} rows (layout {layout}), not a multiple "
            f"of the model's batch size {n_samples}. Rows must be grouped sample-major "
            "(e.g. flatten [N, T, C] to [N·T, C], not [T·N, C])"
        )
    return rows // n_samples


def _seed() -> int:
    """One draw from torch's global RNG (so ``torch.manual_seed`` controls MC columns)."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _generator(seed: int, k: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed + k)
    return g


def _mc_columns(
    m: int, device: torch.device, draw: Callable[[torch.Generator], list[Tensor]], inputs: list[int]
) -> Columns:
    """``M`` columns, column ``k`` = ``draw(generator_k)/√M`` (one generator per column)."""
    seed = _seed()
    scale = 1.0 / math.sqrt(m)

    def make(a: int, b: int) -> list[Tensor]:
        per_col = [draw(_generator(seed, k, device)) for k in range(a, b)]
        return [torch.stack([c[i] for c in per_col]).mul_(scale) for i in range(len(inputs))]

    return Columns(m, make, inputs)


# -- cross-entropy family ------------------------------------------------------------------------


def _class_layout(x: Tensor, n_samples: int, name: str) -> tuple[int, int, int, int]:
    """``(N, P, D, C)`` for an input ``[N·P, C, *spatial]`` with ``D = prod(spatial)``."""
    if x.dim() < 2:
        raise ValueError(
            f"backprism: {name} input of shape {tuple(x.shape)} has no batch axis; use "
            "[N, C] or [N, C, d1, ...]"
        )
    rows, c = x.shape[0], x.shape[1]
    d = math.prod(x.shape[2:])
    p = _rows_per_sample(rows, n_samples, name, "[N·P, C, d1, ...]")
    return n_samples, p, d, c


def _to_positions(t: Tensor, n: int, q: int, c: int) -> Tensor:
    """``[N·P, C, *spatial]`` → ``[N, Q, C]`` with position ``q = p·D + d``."""
    return t.reshape(t.shape[0], c, -1).transpose(1, 2).reshape(n, q, c)


def _class_index_factor(
    target: Tensor, weight: Tensor | None, ignore_index: int, smoothing: float, c: int,
    reduction: str, x: Tensor,
) -> Tensor:
    """Per-position factor ``a/Z`` for class-index targets (any shape)."""
    target = target.to(x.device)
    keep = target != ignore_index
    y = torch.where(keep, target, torch.zeros_like(target))
    if weight is None:
        w_y = keep.to(x.dtype)
        w_sum = torch.tensor(float(c), dtype=x.dtype, device=x.device)
    else:
        w = weight.to(device=x.device, dtype=x.dtype)
        w_y = w[y] * keep
        w_sum = w.sum()
    a = (1 - smoothing) * w_y + (smoothing / c) * w_sum * keep
    if reduction == "mean":
        z = w_y.sum()
        a = torch.where(z > 0, a / z, torch.zeros_like(a))
    return a


def _cross_entropy(
    module: nn.CrossEntropyLoss,
    inputs: list[Any],
    mc: int | None,
    n_samples: int,
    backpack: bool = False,
) -> Columns:
    name = type(module).__name__
    x = _model_input(inputs, name)
    target = _arg(inputs, 1, "target", name)
    _refuse_target_grad(target, name)
    n, p_rows, d, c = _class_layout(x, n_samples, name)
    q = p_rows * d
    xd = x.detach()
    eps = float(module.label_smoothing)
    weight = module.weight
    if not isinstance(target, Tensor):
        raise TypeError(f"backprism: the target of {name} must be a tensor")
    if target.is_floating_point():
        if target.shape != x.shape:
            raise ValueError(
                f"backprism: {name} probability targets must have the input's shape "
                f"{tuple(x.shape)}, got {tuple(target.shape)}"
            )
        qt = target.detach().to(xd.dtype)
        qt = qt * (1 - eps) + eps / c
        w = (
            torch.ones(c, dtype=xd.dtype, device=xd.device)
            if weight is None
            else weight.to(device=xd.device, dtype=xd.dtype)
        )
        a = torch.einsum("rc...,c->r...", qt, w)
        if (a < 0).any():
            raise ValueError(
                f"backprism: {name} has probability targets with negative total weight "
                "Σ_c weight_c·target_c; the loss is not convex in the input"
            )
        if module.reduction == "mean":
            a = a / (xd.numel() // c)
    else:
        if target.shape != (x.shape[0], *x.shape[2:]):
            raise ValueError(
                f"backprism: {name} class-index targets must have shape "
                f"{(x.shape[0], *tuple(x.shape[2:]))} for an input of shape {tuple(x.shape)}, "
                f"got {tuple(target.shape)}"
            )
        if weight is not None and (weight < 0).any():
            raise ValueError(f"backprism: {name} has negative class weights; its GGN is not PSD")
        a = _class_index_factor(
            target, weight, module.ignore_index, eps, c, module.reduction, xd
        )
    soft = torch.softmax(xd, dim=1)  # [N·P, C, *spatial]
    probs = _to_positions(soft, n, q, c)  # [N, Q, C]
    f = a.reshape(n, q).sqrt()  # [N, Q]
    if mc is None:
        return _exact_class_columns(probs, f, x.shape, p_rows, d, c, centered=True)
    if backpack:
        return _backpack_class_columns(soft, f, mc)
    return _mc_class_columns(probs, f, x.shape, p_rows, d, c, mc, centered=True)


def _nll(module: nn.NLLLoss, inputs: list[Any], mc: int | None, n_samples: int) -> Columns:
    name = type(module).__name__
    lp = _model_input(inputs, name)
    target = _arg(inputs, 1, "target", name)
    _refuse_target_grad(target, name)
    fn = lp.grad_fn
    dim = getattr(fn, "_saved_dim", None)
    if dim is not None:  # (saved as an unsigned integer: -1 is 2**64 - 1)
        dim = saved_dim(dim, max(lp.dim(), 1))
    if type(fn).__name__ != "LogSoftmaxBackward0" or dim is None or (
        lp.dim() >= 2 and dim != 1
    ):
        raise ValueError(
            f"backprism: the input of {name} must be the direct output of log_softmax over the "
            f"class axis (dim=1); got one computed by {type(fn).__name__}"
            f"{'' if dim is None else f' over dim={dim}'}. NLLLoss alone is linear in its "
            "input (zero Hessian): use log_softmax(dim=1) right before it, or CrossEntropyLoss "
            "on the logits"
        )
    n, p_rows, d, c = _class_layout(lp, n_samples, name)
    q = p_rows * d
    if not isinstance(target, Tensor) or target.is_floating_point():
        raise TypeError(f"backprism: {name} needs integer class-index targets")
    if target.shape != (lp.shape[0], *lp.shape[2:]):
        raise ValueError(
            f"backprism: {name} targets must have shape {(lp.shape[0], *tuple(lp.shape[2:]))} "
            f"for an input of shape {tuple(lp.shape)}, got {tuple(target.shape)}"
        )
    if module.weight is not None and (module.weight < 0).any():
        raise ValueError(f"backprism: {name} has negative class weights; its GGN is not PSD")
    lpd = lp.detach()
    a = _class_index_factor(
        target, module.weight, module.ignore_index, 0.0, c, module.reduction, lpd
    )
    probs = _to_positions(lpd.exp(), n, q, c)
    f = a.reshape(n, q).sqrt()
    if mc is None:
        return _exact_class_columns(probs, f, lp.shape, p_rows, d, c, centered=False)
    return _mc_class_columns(probs, f, lp.shape, p_rows, d, c, mc, centered=False)


def _exact_class_columns(
    probs: Tensor, f: Tensor, shape: torch.Size, p_rows: int, d: int, c: int, centered: bool
) -> Columns:
    """Column ``k = c·Q + q``: ``f[:, q]·√p_c·(e_c − p)`` (centered) or ``f[:, q]·√p_c·e_c`` at
    position ``q`` of every sample.

    A chunk of ``k`` columns is written straight into the loss input's layout
    (``[k, N·P, C, *spatial]``): one zero-filled output plus ``[k, N, C]`` values, no
    position-major intermediate and no transposed copy. The columns are class-major, so a
    chunk covers a contiguous range of classes (a vocabulary chunk) at all positions."""
    n, q = probs.shape[0], probs.shape[1]
    _warn_exact_cost(c * q, c, q)

    def make(a: int, b: int) -> list[Tensor]:
        ks = torch.arange(a, b, device=probs.device)
        cls, pos = ks // q, ks % q
        k = b - a
        idx = torch.arange(k, device=probs.device)
        pq = probs[:, pos, :].transpose(0, 1)  # [k, N, C]
        pc = pq[idx, :, cls]  # [k, N]
        scale = f[:, pos].t() * pc.sqrt()  # [k, N]
        if centered:
            vals = pq * scale.unsqueeze(-1).neg()
            vals[idx, :, cls] += scale
        else:
            vals = torch.zeros_like(pq)
            vals[idx, :, cls] = scale
        out = probs.new_zeros(k, n, p_rows, c, d)
        out[idx, :, pos // d, :, pos % d] = vals
        return [out.view(k, *shape)]

    return Columns(c * q, make, [0])


def _mc_class_columns(
    probs: Tensor, f: Tensor, shape: torch.Size, p_rows: int, d: int, c: int, m: int,
    centered: bool,
) -> Columns:
    """Column: ``f·(p − e_ŷ)`` (centered) or ``−f·e_ŷ`` with ``ŷ ~ Cat(p)`` per position.

    ``ŷ`` is the first class whose cumulative probability reaches a uniform draw (a binary
    search per position, ``O(log C)``); the column is ``f·p`` in the input's layout with
    ``f`` subtracted at ``ŷ`` by one scatter — no one-hot ``[N, Q, C]`` tensor."""
    n = probs.shape[0]
    cdf = probs.cumsum(-1)
    cdf[..., -1] = float("inf")  # round-off: every draw u < 1 finds a class
    fx = f.reshape(n, p_rows, 1, d)
    # f·p in the input layout [N, P, C, D]
    px = (probs.reshape(n, p_rows, d, c).transpose(2, 3) * fx).contiguous() if centered else None

    def draw(g: torch.Generator) -> list[Tensor]:
        u = torch.rand(cdf.shape[:-1], generator=g, device=cdf.device, dtype=cdf.dtype)
        y = torch.searchsorted(cdf, u.unsqueeze(-1)).reshape(n, p_rows, 1, d)
        col = (
            px.clone(memory_format=torch.contiguous_format)
            if px is not None
            else probs.new_zeros(n, p_rows, c, d)
        )
        col.scatter_add_(2, y, -fx.expand(n, p_rows, 1, d))
        return [col.view(shape)]

    return _mc_columns(m, probs.device, draw, [0])


def _backpack_class_columns(soft: Tensor, f: Tensor, m: int) -> Columns:
    r"""BackPACK's MC cross-entropy columns: ``f·(p − e_ŷₘ)/√M``, ``ŷ ~ Categorical(p)``.

    ``soft`` is ``p = softmax(x, 1)`` in the input's layout ``[R, C, *spatial]``, ``f`` the
    factor ``√(a/Z)`` per position (``[N, Q]``, positions in the order ``(row, spatial)``). The
    ``M`` labels of every position come from one call on torch's global RNG,
    ``Categorical(p moved to the last axis).sample((M,))`` (``[M, R, *spatial]``), the call
    BackPACK 1.7 makes; the columns are built at once (chunks slice them)."""
    rows = soft.shape[0]
    spatial = soft.shape[2:]
    dist = torch.distributions.Categorical(probs=soft.movedim(1, -1), validate_args=False)
    y = dist.sample(torch.Size([m]))  # [M, R, *spatial]
    fx = f.reshape(rows, 1, *spatial)  # [R, 1, *spatial]
    cols = (soft * fx).unsqueeze(0).expand(m, *soft.shape).contiguous()
    cols.scatter_add_(2, y.unsqueeze(2), -fx.unsqueeze(0).expand(m, *fx.shape))
    cols.mul_(1.0 / math.sqrt(m))
    return Columns.from_tensors([cols], [0])


#: exact loss-Hessian square roots with more columns per sample than this get a warning
EXACT_COLUMNS_WARNING = 4096
_WARNED_COST: set[tuple[int, int]] = set()


class CurvatureCostWarning(UserWarning):
    """Exact curvature needs very many loss-Hessian columns (each one a backward pass)."""


def _warn_exact_cost(k: int, c: int, q: int) -> None:
    """Warn once per ``(C, Q)`` and process when exact columns exceed
    :data:`EXACT_COLUMNS_WARNING` per sample."""
    if k <= EXACT_COLUMNS_WARNING or (c, q) in _WARNED_COST:
        return
    _WARNED_COST.add((c, q))
    warnings.warn(
        f"backprism: the exact loss-Hessian square root of this cross-entropy has K = C·Q = "
        f"{c}·{q} = {k} columns per sample ({c} classes at {q} positions); every column is "
        "pushed back through the model, so exact curvature (DiagGGNExact, KFLR, SqrtGGNExact, "
        "DiagHessian) costs about K backward passes — no exact square root has fewer "
        "(the Hessian of each position has rank C − 1). Use the Monte-Carlo extensions "
        "(DiagGGNMC, KFAC, SqrtGGNMC: mc_samples columns), or a smaller collect(memory_budget=) "
        "to bound the memory of each chunk",
        CurvatureCostWarning,
        stacklevel=3,
    )


# -- elementwise losses ------------------------------------------------------------------------


def _sum_to(col: Tensor, shape: Sequence[int]) -> Tensor:
    """Sum ``[k, *B]`` over broadcast dimensions to ``[k, *shape]``."""
    k, b = col.shape[0], col.shape[1:]
    if tuple(b) == tuple(shape):
        return col
    pad = (1,) * (len(b) - len(shape)) + tuple(shape)
    return col.sum_to_size((k, *pad)).reshape(k, *shape)


def _loss_shape(shapes: list[torch.Size], n_samples: int, name: str) -> torch.Size:
    b = torch.broadcast_shapes(*shapes)
    if len(b) == 0:
        raise ValueError(
            f"backprism: {name} was called on 0-dimensional tensors; give the inputs a batch axis"
        )
    _rows_per_sample(b[0], n_samples, name, "[N·P, ...]")
    return b


def _elementwise(
    shape: torch.Size,
    n_samples: int,
    sqrt_h: Tensor,
    targets: list[tuple[int, Sequence[int], float]],
    mc: int | None,
    draw: Callable[[torch.Generator], list[Tensor]] | None = None,
) -> Columns:
    """Columns of a loss that is a sum of per-element terms.

    Exact: column ``j`` (``j`` < elements per sample) is ``√h_j e_j`` at loss element ``j`` of
    every sample, summed over broadcast dimensions into each input ``i``'s shape and multiplied
    by its sign (``targets = [(i, shape_i, sign_i)]``). MC: ``draw(generator)`` returns one
    loss-element-shaped tensor per input; they are summed to the input shapes the same way.
    """
    inputs = [i for i, _, _ in targets]
    if mc is not None:
        assert draw is not None

        def draw_inputs(g: torch.Generator) -> list[Tensor]:
            out = draw(g)
            return [
                _sum_to(t.unsqueeze(0), s)[0] * sign
                for t, (_, s, sign) in zip(out, targets)
            ]

        return _mc_columns(mc, sqrt_h.device, draw_inputs, inputs)
    e = sqrt_h.numel() // n_samples
    flat = sqrt_h.reshape(n_samples, e)

    def make(a: int, b: int) -> list[Tensor]:
        k = b - a
        idx = torch.arange(k, device=flat.device)
        col = flat.new_zeros(k, n_samples, e)
        col[idx, :, a + idx] = flat[:, a:b].t()
        col = col.reshape(k, *shape)
        return [_sum_to(col, s) * sign for _, s, sign in targets]

    return Columns(e, make, inputs)


def _mse(
    module: nn.MSELoss, inputs: list[Any], mc: int | None, n_samples: int, backpack: bool = False
) -> Columns:
    name = type(module).__name__
    x = _arg(inputs, 0, "input", name)
    y = _arg(inputs, 1, "target", name)
    if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
        raise TypeError(f"backprism: {name} needs tensor input and target")
    targets = [(i, t.shape, s) for i, t, s in ((0, x, 1.0), (1, y, -1.0)) if t.requires_grad]
    if not targets:
        raise ValueError(f"backprism: neither input nor target of {name} requires grad")
    ref = x if x.requires_grad else y
    shape = _loss_shape([x.shape, y.shape], n_samples, name)
    z = math.prod(shape) if module.reduction == "mean" else 1
    coef = math.sqrt(2.0 / z)
    sqrt_h = torch.full(shape, coef, dtype=ref.dtype, device=ref.device)
    if mc is not None and backpack:
        return _backpack_mse_columns(x.detach().to(ref.dtype), shape, z, mc, targets)

    def draw(g: torch.Generator) -> list[Tensor]:
        noise = torch.randn(shape, generator=g, dtype=ref.dtype, device=ref.device) * coef
        return [noise for _ in targets]

    return _elementwise(shape, n_samples, sqrt_h, targets, mc, draw)


def _backpack_mse_columns(
    x: Tensor,
    shape: torch.Size,
    z: int,
    m: int,
    targets: list[tuple[int, Sequence[int], float]],
) -> Columns:
    r"""BackPACK's MC ``MSELoss`` columns: ``2(yₘ − x)/√(M Z)`` with ``y ~ Normal(x, σ)``.

    ``MSELoss`` is ``Σ (x − y)²`` (over ``Z``), the negative log-likelihood of ``N(x, ½ I)`` up
    to constants; its gradient at a sampled target is ``2(x − y)`` (the sign does not matter).
    One call on torch's global RNG draws all ``M`` targets, ``Normal(x, σ).sample((M,))`` with
    ``σ = torch.tensor(√½)`` (torch's default dtype, as BackPACK 1.7 builds it). ``x`` is
    broadcast to the loss shape; each differentiable input gets the columns summed to its
    shape, times its sign."""
    loc = x if tuple(x.shape) == tuple(shape) else x.expand(shape)
    sd = torch.tensor(math.sqrt(0.5), device=x.device)
    y = torch.distributions.Normal(loc, sd, validate_args=False).sample(torch.Size([m]))
    cols = 2 * (y - loc) / math.sqrt(m)  # [M, *shape]
    if z != 1:
        cols = cols / math.sqrt(z)
    return Columns.from_tensors(
        [_sum_to(cols, s) * sign for _, s, sign in targets], [i for i, _, _ in targets]
    )


def _bce_with_logits(
    module: nn.BCEWithLogitsLoss,
    inputs: list[Any],
    mc: int | None,
    n_samples: int,
    backpack: bool = False,
) -> Columns:
    name = type(module).__name__
    x = _model_input(inputs, name)
    y = _arg(inputs, 1, "target", name)
    _refuse_target_grad(y, name)
    if not isinstance(y, Tensor) or y.shape != x.shape:
        raise ValueError(
            f"backprism: {name} needs a target tensor of the input's shape {tuple(x.shape)}"
        )
    shape = _loss_shape([x.shape], n_samples, name)
    xd, yd = x.detach(), y.detach().to(x.dtype)
    sig = torch.sigmoid(xd)
    w = (
        torch.ones_like(xd)
        if module.weight is None
        else module.weight.to(device=xd.device, dtype=xd.dtype).expand_as(xd)
    )
    pos = module.pos_weight
    coef = (
        torch.ones_like(xd)
        if pos is None
        else pos.to(device=xd.device, dtype=xd.dtype) * yd + 1 - yd
    )
    z = xd.numel() if module.reduction == "mean" else 1
    h = w * sig * (1 - sig) * coef / z
    if (h < 0).any():
        raise ValueError(
            f"backprism: {name} has a negative Hessian entry (negative weight, or targets outside "
            "[0, 1] with pos_weight); its GGN is not PSD"
        )
    sqrt_h = h.sqrt()
    targets = [(0, x.shape, 1.0)]
    if pos is None:
        sw = (w / z).sqrt()
        if mc is not None and backpack:
            return _backpack_bce_columns(sig, sw, mc)

        def draw(g: torch.Generator) -> list[Tensor]:
            u = torch.rand(shape, generator=g, dtype=xd.dtype, device=xd.device)
            return [sw * (sig - (u < sig).to(xd.dtype))]
    else:

        def draw(g: torch.Generator) -> list[Tensor]:
            u = torch.rand(shape, generator=g, dtype=xd.dtype, device=xd.device)
            return [torch.where(u < 0.5, -sqrt_h, sqrt_h)]

    return _elementwise(shape, n_samples, sqrt_h, targets, mc, draw)


def _backpack_bce_columns(sig: Tensor, sw: Tensor, m: int) -> Columns:
    r"""BackPACK's MC ``BCEWithLogitsLoss`` columns: ``√(w/Z)(σ − ŷₘ)/√M``,
    ``ŷ ~ Binomial(1, σ)``.

    The loss is the negative log-likelihood of Bernoulli(σ(x)) labels, with gradient
    ``σ − y``. One call on torch's global RNG draws all ``M`` labels,
    ``Binomial(probs=σ).sample((M,))`` (``torch.binomial``), as BackPACK 1.7 does."""
    y = torch.distributions.Binomial(probs=sig, validate_args=False).sample(torch.Size([m]))
    cols = (sig - y) / math.sqrt(m) * sw  # [M, *shape]
    return Columns.from_tensors([cols], [0])


def _gaussian_nll(
    module: nn.GaussianNLLLoss, inputs: list[Any], mc: int | None, n_samples: int
) -> Columns:
    name = type(module).__name__
    mu = _model_input(inputs, name)
    y = _arg(inputs, 1, "target", name)
    var = _arg(inputs, 2, "var", name)
    if not isinstance(y, Tensor):
        raise TypeError(f"backprism: the target of {name} must be a tensor")
    var_grad = isinstance(var, Tensor) and var.requires_grad
    if isinstance(var, Tensor):
        var_b = var.detach().to(mu.dtype)
        if var.shape != mu.shape and mu.shape[:-1] == var.shape:
            var_b = var_b.unsqueeze(-1)
    else:
        var_b = torch.full_like(mu.detach(), float(var))
    v = var_b.clamp_min(module.eps)
    shape = _loss_shape([mu.shape, y.shape, v.shape], n_samples, name)
    z = math.prod(shape) if module.reduction == "mean" else 1
    inv_sd = v.rsqrt().expand(shape) / math.sqrt(z)  # √(1/(v Z)) per loss element
    targets: list[tuple[int, Sequence[int], float]] = [(0, mu.shape, 1.0)]
    if y.requires_grad:
        if var_grad:
            raise ValueError(
                f"backprism: {name} with both target and var requiring grad is not supported; "
                "detach the target"
            )
        targets.append((1, y.shape, -1.0))
    if var_grad and mc is None:
        raise ValueError(
            f"backprism: {name}'s var requires grad; the exact loss Hessian w.r.t. (mean, var) "
            "is indefinite. Use the Monte-Carlo extensions (Fisher = expected Hessian), or "
            "detach var"
        )
    if var_grad:
        assert isinstance(var, Tensor)
        targets.append((2, var_b.shape, 1.0))
        var_coef = (1.0 / (2.0 * v * math.sqrt(z))).expand(shape)

        def draw(g: torch.Generator) -> list[Tensor]:
            e = torch.randn(shape, generator=g, dtype=mu.dtype, device=mu.device)
            return [-e * inv_sd, (1 - e * e) * var_coef]

        cols = _elementwise(shape, n_samples, inv_sd, targets, mc, draw)
        make = cols._make
        var_shape = var.shape

        def reshape_var(a: int, b: int) -> list[Tensor]:
            mean_cols, var_cols = make(a, b)
            return [mean_cols, var_cols.reshape(var_cols.shape[0], *var_shape)]

        return Columns(cols.num, reshape_var, cols.inputs)

    def draw_mean(g: torch.Generator) -> list[Tensor]:
        e = torch.randn(shape, generator=g, dtype=mu.dtype, device=mu.device) * inv_sd
        return [-e for _ in targets]

    return _elementwise(shape, n_samples, inv_sd, targets, mc, draw_mean)
