r"""Hessian residual terms of nonlinearities (the non-GGN part of ``DiagHessian``).

For a loss ``L`` reached from the parameters ``θ`` through an elementwise nonlinearity
``a = σ(z)`` (``z = z(θ)``), the exact Hessian is the GGN plus one *residual* term per
nonlinearity:

.. math::

    ∇²_θ L = J_θ(f)ᵀ ∇²_f L\, J_θ(f) + \sum_{σ} J_θ(z)ᵀ \operatorname{diag}(r)\, J_θ(z) + (\ldots),
    \qquad r = \frac{∂L}{∂a} ⊙ σ''(z),

where ``(…)`` collects the terms of the other operations that are *not* linear in their inputs.
*Row-wise* nonlinearities (``layer_norm``, ``rms_norm``, ``group_norm``, ``instance_norm``,
``normalize``, ``softmax``, ``softmin``: each row of ``d`` entries on its own) contribute one
``d × d`` block per row, eigen-decomposed into signed columns (:class:`RowSite`,
:func:`push_rows`); so do smooth reductions of some axes (``norm``/``vector_norm`` of order 2,
``var``, ``std``, ``logsumexp``: one output per row, :class:`ReductionSite`). Products of two
values that depend on the same parameters (attention's ``q kᵀ`` on hidden features, SwiGLU)
contribute an off-diagonal bilinear form, eigen-decomposed from the SVD of the product's output
gradient into signed columns on both operands (:class:`BilinearSite`,
:mod:`backprism.engine.bilinear`), found on the products' nodes; a division ``x / y`` by a
parameter-dependent ``y`` that product's term for ``x · (1/y)`` plus the reciprocal's residual
on ``y`` (:class:`DivisionSite`); fused attention kernels the
terms of the three operations they compose (:class:`AttentionSite`,
:mod:`backprism.engine.attention`); a Linear weight that also feeds its layer's input (a tied
output layer) the term of the product of its uses (:class:`NestedSite`, columns with a part
in the weight's own space). Other normalisations (batch statistics, local response) and
parameters entering a module nonlinearly are refused for the DiagHessian family with a clear
error; everything linear or piecewise linear (Linear, Conv, ReLU, LeakyReLU, max/avg pooling,
Flatten, residual additions, dropout) contributes nothing.

``r`` already carries the loss's scaling (``1/N`` for a mean reduction), because ``∂L/∂a`` does.
The residual is written with *signed columns*: for every element ``j`` of ``zₙ`` (sample ``n``),
column ``cⱼ = √|rₙⱼ| eⱼ`` with weight ``sign(rₙⱼ)``, so that
``Σⱼ sign(rₙⱼ) (Jₙᵀcⱼ)(Jₙᵀcⱼ)ᵀ = Jₙᵀ diag(rₙ) Jₙ``. The engine pushes them from ``z`` to all
captured module outputs exactly like the loss-Hessian square root and lets the layer rules
reduce them (``Σₖₙ wₖₙ Vₖₙ²`` for the diagonal).

How the nonlinearities are found
--------------------------------

* :data:`FORWARD_LISTENERS` entry: a :class:`torch.overrides.TorchFunctionMode` is active during
  every top-level forward of an extended model. It sees functional calls (``torch.tanh``,
  ``F.gelu``, ``x.sigmoid()``, and the calls made inside ``nn.Tanh``, ``nn.GELU``, …) and, for each
  smooth elementwise nonlinearity whose input ``z`` requires grad, stores a
  :class:`ResidualSite` (holding ``z`` and the function, upstream of ``a``: no reference cycle
  through autograd nodes) in the metadata of ``a``'s node; nothing is computed (and no hook is
  registered) unless a DiagHessian-family backward pass reaches the site, which then registers
  a pre-hook on that node.
* An in-place nonlinearity (``nn.SiLU(inplace=True)``, ``F.hardswish(x, inplace=True)``)
  overwrites ``z``; where its autograd node keeps a copy of the input for its own derivative
  (``_saved_self``: SiLU, Hardswish, Mish) the site reads ``z`` there and pushes its columns
  into the node's input edge; where it keeps only the result (``tanh_``, ``sigmoid_``) it is
  refused, naming ``inplace=False`` as the way out.
* Non-elementwise nonlinear operations between parameters and loss leave an
  :class:`ErrorSite`; a DiagHessian-family pass that reaches one refuses before anything is
  written (:func:`check_pass`).
* :func:`activation_forward_hook` is the fallback for activation modules called while the mode is
  not active (e.g. a sub-module called by hand).

Overhead when no DiagHessian is requested: a forward that runs inside ``collect(...)`` without a
DiagHessian-family extension is not recorded at all (its calls are marked ``unrecorded``, and
such an extension in a later backward refuses them with a clear error). A forward outside any
context is recorded, since its backward may ask for DiagHessian: one Python dispatch per
operation and one small record per smooth nonlinearity (holding ``z``, usually kept alive
anyway as the output of a captured layer) — unless the model's recorded forward showed that only
activation modules (whose hooks record their own sites) have nonlinearities, or the model has
not used the DiagHessian family (:func:`want_residuals`), in which case its later forwards run
without the mode.
``record_nonlinearities(False)`` removes even that; the DiagHessian family then refuses to run.

Only the forward of an extended model is watched: a nonlinearity applied to its output outside
it (``loss(torch.tanh(model(X)), y)``), one in a sub-module called on its own, and one in a
forward that ran without the mode (``engine.functional``: models whose recorded forward showed
the mode has nothing to do) is found in the graph by :func:`check_pass`, which classifies the
nodes outside recorded forwards as :func:`record` classifies operations, and refused with a
clear error — put it inside the model.
"""

from __future__ import annotations

import copy as _copy
import inspect
import re
import weakref
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backprism.engine import backward as _backward
from backprism.engine.attention import attention_columns, sdpa_arguments
from backprism.engine.bilinear import BilinearForm, balance, bilinear_form, signed_columns
from backprism.engine.columns import Columns
from backprism.engine.decompositions import decomposed
from backprism.engine.fold import _IDENTITIES, _param_only
from backprism.engine.graph import _upstream
from backprism.engine.parametrized import parametrized
from backprism.engine.rows import row_axes, row_columns
from backprism.engine.rule import get_rule
from backprism.engine.state import AXIS, CALLS, FORWARD, MODE_FREE, SITES, active

__all__ = [
    "ACTIVATION_TYPES",
    "NonlinearityError",
    "activation_forward_hook",
    "check_linear_in_params",
    "check_pass",
    "check_recording",
    "classify",
    "node_ops",
    "op_name",
    "push_residual",
    "record_nonlinearities",
    "want_residuals",
]

#: activation modules with a non-zero second derivative (hooked by ``extend``)
ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.SiLU,
    nn.Softplus,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.Mish,
    nn.LogSigmoid,
    nn.Softsign,
    nn.Tanhshrink,
    nn.Hardswish,
)


class NonlinearityError(RuntimeError):
    """An operation between parameters and loss whose Hessian term DiagHessian cannot build."""


_WAY_OUT = (
    "Use DiagGGNExact() for the GGN diagonal (no residual terms), or HutchinsonDiagHessian() for "
    "an unbiased estimate of the exact Hessian diagonal on any graph."
)


# -- classification of operations by name ------------------------------------------------------
def _words(text: str) -> list[str]:
    return text.split()


_SMOOTH = frozenset(
    _words(
    """tanh sigmoid gelu silu softplus elu selu celu mish log_sigmoid logsigmoid softsign
    tanhshrink hardswish exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal square sin cos
    tan sinh cosh asinh atan atanh asin acos erf erfc erfinv lgamma digamma sinc logit pow
    float_power __pow__ __rpow__ special_expit expit xlogy"""
    )
)
_PIECEWISE_OR_LINEAR = frozenset(
    _words(
    """relu relu6 leaky_relu hardtanh threshold abs absolute clamp clip clamp_min clamp_max
    hardsigmoid hardshrink softshrink rrelu max_pool1d max_pool2d max_pool3d
    max_pool1d_with_indices max_pool2d_with_indices max_pool3d_with_indices adaptive_max_pool1d
    adaptive_max_pool2d adaptive_max_pool3d adaptive_max_pool1d_with_indices
    adaptive_max_pool2d_with_indices adaptive_max_pool3d_with_indices fractional_max_pool2d
    fractional_max_pool3d max min amax amin maximum minimum fmax fmin sort topk cummax cummin
    where masked_fill floor ceil round trunc sign sgn frac dropout dropout1d dropout2d dropout3d
    alpha_dropout feature_alpha_dropout feature_dropout native_dropout add sub rsub neg negative
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __neg__ __pos__ positive sum mean nansum
    nanmean cumsum cat concat concatenate stack hstack vstack dstack split chunk unbind
    tensor_split narrow select index_select gather scatter scatter_add index_add index_copy
    index_put take take_along_dim masked_select masked_scatter __getitem__ __setitem__ view
    view_as reshape reshape_as flatten unflatten squeeze unsqueeze expand expand_as repeat
    repeat_interleave tile broadcast_to broadcast_tensors transpose t permute movedim moveaxis
    swapaxes swapdims T mT H mH contiguous clone detach to type type_as float double half bfloat16
    cpu cuda flip fliplr flipud roll rot90 diagonal diag diag_embed diagflat tril triu trace pad
    avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
    pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle unfold fold interpolate
    upsample upsample_nearest upsample_bilinear real imag conj zeros_like ones_like empty_like
    full_like rand_like randn_like new_zeros new_ones new_empty new_full new_tensor
    requires_grad_ retain_grad register_hook as_strided unsqueeze_ squeeze_ copy_ zero_ fill_
    cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
    binary_cross_entropy_with_logits kl_div poisson_nll_loss gaussian_nll_loss
    soft_margin_loss multilabel_soft_margin_loss embedding embedding_bag one_hot linear conv1d
    conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d _convolution
    convolution"""
    )
)
_PRODUCTS = frozenset(
    _words(
    """mul multiply __mul__ __rmul__ __imul__ matmul __matmul__ __rmatmul__ mm bmm mv dot vdot
    inner outer ger einsum tensordot kron addmm addmv addbmm baddbmm addcmul bilinear linear
    conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution
    _convolution lerp prelu"""
    )
)
_QUOTIENTS = frozenset(
    _words(
    "div divide true_divide __truediv__ __rtruediv__ __itruediv__ __div__ __rdiv__ addcdiv "
    "floor_divide remainder fmod atan2 hypot"
    )
)
_NONLINEAR = frozenset(
    _words(
    """softmax _softmax softmin log_softmax layer_norm group_norm rms_norm instance_norm
    local_response_norm normalize batch_norm scaled_dot_product_attention
    multi_head_attention_forward norm vector_norm linalg_vector_norm matrix_norm logsumexp
    logcumsumexp var std var_mean std_mean prod cumprod cdist pdist cosine_similarity
    pairwise_distance gumbel_softmax glu lp_pool1d lp_pool2d lp_pool3d dist renorm det
    slogdet logdet inverse solve cholesky svd eigh lstm gru rnn_tanh rnn_relu lstm_cell
    gru_cell rnn_tanh_cell rnn_relu_cell"""
    )
)

_LINEAR, _SMOOTH_KIND, _PRODUCT, _QUOTIENT, _NONLIN, _UNKNOWN = range(6)


def op_name(func: Any) -> str:
    """The name of a function the forward mode sees (``x.T``: the property's name)."""
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # property access (``x.T``): name the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def classify(name: str) -> int:
    """The kind of the operation ``name`` (``tanh``, ``addmm``, ``log_softmax``, …): the
    forward mode caches it per function and passes it to :func:`record`."""
    return _classify_name(name)[0]


def _classify_name(name: str) -> tuple[int, str]:
    """The kind of an operation by its name (``tanh``, ``addmm``, ``log_softmax``, ...)."""
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    if base in _SMOOTH:
        kind = _SMOOTH_KIND
    elif base in _PRODUCTS:
        kind = _PRODUCT
    elif base in _QUOTIENTS:
        kind = _QUOTIENT
    elif base in _NONLINEAR:
        kind = _NONLIN
    elif base in _PIECEWISE_OR_LINEAR or name.startswith("_set_") or name in ("size", "dim"):
        kind = _LINEAR
    else:
        kind = _UNKNOWN
    return kind, name


def _grad_tensors(args: Any, kwargs: dict) -> list[Tensor]:
    """Tensors requiring grad among ``args``/``kwargs`` (lists and tuples one level deep, as in
    ``einsum``/``cat``); cheaper than a full pytree flatten on this hot path."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            if a.requires_grad:
                found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, Tensor) and t.requires_grad)
    return found


# -- sites: records of nonlinearities in node metadata ------------------------------------------
def _names(exts: list) -> str:
    """The extensions' class names, for error messages."""
    return ", ".join(sorted({type(e).__name__ for e in exts}))


class ErrorSite:
    """An operation whose Hessian term the DiagHessian family cannot build; a backward pass with
    such an extension that reaches it refuses before anything is written. Holds a string and at
    most a weak reference (no tensors)."""

    __slots__ = ("advice", "nll_output", "pass_", "what", "why")

    def __init__(
        self, what: str, nll_output: weakref.ref | None = None, why: str | None = None,
        advice: str = "",
    ) -> None:
        self.what = what
        self.nll_output = nll_output
        #: why its term cannot be built (default: it is not an elementwise residual)
        self.why = why
        #: how to avoid the refusal, before the general way out
        self.advice = advice
        self.pass_: Any = None


class ProductSite(ErrorSite):
    """A product of two (or more) differentiable operands outside module calls. Its Hessian
    term couples the operands: within one parameter's block (the diagonal, the per-parameter
    blocks) it appears only if a parameter lies upstream of two operands (``x * tanh(x)``,
    ``h = W₁x; (W₂h) * (W₃h)``). With disjoint parameters (a learnable gate ``out * α``, LoRA's
    ``x Aᵀ Bᵀ``) the term is off the blocks, and the columns pushed through the product (each
    operand's partial, the other held fixed) are the whole story. Decided per pass from the
    product's node (:func:`shares_parameters`)."""

    __slots__ = ()

    def node_hook(self, bp: Any, node: Any) -> None:
        """No hook: the site is only looked at in the pass's check (with its node)."""
        return None


class QuotientSite(ProductSite):
    """A division ``z = x / y`` by a parameter-dependent ``y``, recorded by the forward mode;
    its term is built per pass (:func:`quotient_site`, :class:`DivisionSite`) or the pass
    refuses with the reason."""

    __slots__ = ()


#: operations the forward mode records as a :class:`QuotientSite` (a true division; not one
#: rounded, in place or reflected, which stay refused)
_TRUE_DIVISIONS = frozenset({"div", "divide", "true_divide", "__truediv__", "__div__"})

#: reshaping nodes between a product's own node and the output the forward mode saw (a batched
#: ``matmul`` ends in ``_unsafe_view`` of its ``bmm``)
_PRODUCT_VIEWS = frozenset({
    "UnsafeViewBackward0", "ViewBackward0", "ReshapeAliasBackward0", "AliasBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0",
    "ExpandBackward0", "TransposeBackward0", "PermuteBackward0", "TBackward0",
})


def product_node(node: Any) -> Any:
    """The node of the product whose output node is ``node``: behind the reshaping nodes
    (:data:`_PRODUCT_VIEWS`) that end a batched ``matmul``."""
    for _ in range(8):
        inputs = [f for f, _ in node.next_functions if f is not None]
        if len(inputs) != 1 or type(node).__name__ not in _PRODUCT_VIEWS:
            break
        node = inputs[0]
    return node


class _PassSite:
    """A site a DiagHessian-family pass finds at its check (made per pass): :meth:`push` runs
    from a pre-hook on its node with the gradient of the node's first output, in the pass's
    own backward only."""

    __slots__ = ("pass_",)

    def __init__(self, bp: Any) -> None:
        self.pass_ = bp

    def push(self, bp: Any, exts: list, grad: Tensor) -> None:
        raise NotImplementedError

    def node_hook(self, bp: Any, node: Any) -> Callable[[tuple], None] | None:
        exts = [e for e in bp.second if e.needs_residual]

        def hook(grad_outputs: tuple) -> None:
            grad = grad_outputs[0]
            if grad is None or self.pass_ is not bp or bp.in_columns:
                return
            self.push(bp, exts, grad)

        return hook


class BilinearSite(_PassSite):
    """A product of two values that depend on the same parameters, found by a DiagHessian-family
    pass (:func:`bilinear_site`): its term lies inside those parameters' blocks, pushed as the
    signed columns of :mod:`backprism.engine.bilinear` from a pre-hook on the product's node.
    Holds shapes, no tensors."""

    __slots__ = ("form",)

    def __init__(self, form: BilinearForm, bp: Any) -> None:
        super().__init__(bp)
        self.form = form

    def push(self, bp: Any, exts: list, grad: Tensor) -> None:
        push_bilinear(bp, exts, self.form, grad)


class DivisionSite(_PassSite):
    r"""A division ``z = x / y`` (``DivBackward0``; ``y`` parameter-dependent, broadcast to
    ``z``) found by a DiagHessian-family pass (:func:`quotient_site`). With ``G = ∂L/∂z`` and
    ``r = 1/y``, ``z = x · r(y)``, so its Hessian term is

    .. math::  2 ⟨−G / y², dx ∘ dy⟩ + ⟨Σ_b G x, \tfrac{2}{y³} dy²⟩

    (``Σ_b``: over the axes ``y`` is broadcast along): the product's bilinear term with
    gradient ``−G/y²`` on the operands ``(x, y)`` (:mod:`backprism.engine.bilinear`; only where
    ``x`` depends on parameters ``y`` depends on, else it lies off the parameters' blocks), and
    the reciprocal's elementwise residual on ``y`` (:func:`push_residual`). Holds the node and
    the form, per pass."""

    __slots__ = ("form", "node")

    def __init__(self, node: Any, form: BilinearForm | None, bp: Any) -> None:
        super().__init__(bp)
        self.node = node
        self.form = form

    def push(self, bp: Any, exts: list, grad: Tensor) -> None:
        if not bp.loss_calls():
            return
        x, y = self.node._saved_self, self.node._saved_other
        g = grad.detach()
        y = y.detach()
        coef = (g * x.detach()).sum_to_size(y.shape)
        origin = GradientEdge(*self.node.next_functions[1])
        push_residual(bp, exts, torch.reciprocal, y, coef, origin=origin, axis=0)
        if self.form is not None:
            push_bilinear(bp, exts, self.form, -g / y.square())


class NestedSite(_PassSite):
    """A Linear call ``y = x Wᵀ + b`` whose weight ``W`` also feeds its input ``x`` through
    other calls (a tied output layer, an unrolled recurrence, ``lin(lin(x))``): the product of
    its uses adds ``2⟨G, dx dWᵀ⟩`` (``G = ∂L/∂y``) to ``W``'s Hessian block. Per sample, with
    ``Gₙ = Σᵣ σₙᵣ uₙᵣ vₙᵣᵀ`` (``[T, out]`` over the positions ``T``), that form is
    ``Σᵣₖ σₙᵣ/2 [(aᵣₖ·dx + bᵣₖ·dW)² − (aᵣₖ·dx − bᵣₖ·dW)²]`` with ``aᵣₖ = uₙᵣ ⊗ eₖ``,
    ``bᵣₖ = vₙᵣ ⊗ eₖ``: signed columns ``√(σₙᵣ/2)(aᵣₖ, ±bᵣₖ)`` (weights ``±1``), the first part
    pushed into ``x`` to every call upstream, the second ``W``'s own per-sample gradient of the
    column, added to the pushed parts' before squaring (:func:`push_nested`). Exact; costs
    ``2·rank(Gₙ)·in`` columns per sample. Made per pass by :func:`check_pass`."""

    __slots__ = ("call", "name")

    def __init__(self, call: Any, name: str, bp: Any) -> None:
        super().__init__(bp)
        self.call = call
        self.name = name

    def push(self, bp: Any, exts: list, grad: Tensor) -> None:
        push_nested(bp, exts, self.call, self.name, grad)


def push_nested(bp: Any, exts: list, call: Any, name: str, grad: Tensor) -> None:
    """Push the signed columns of a :class:`NestedSite` (``grad = ∂L/∂y``, ``[N, *, out]``)."""
    x = call.input
    w = call.params[name]
    n, k_in = x.shape[0], x.shape[-1]
    g = grad.detach().reshape(n, -1, grad.shape[-1])
    u, sv, vh = decomposed(lambda t: torch.linalg.svd(t, full_matrices=False), g)
    rank = sv.shape[1]
    pm = sv.new_tensor([0.5, -0.5])
    values = (sv[:, :, None, None] * pm).expand(n, rank, k_in, 2).reshape(n, -1)
    v = vh.mT  # [N, out, R]
    edge = call.input_edges[0]

    def parts(idx: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return idx // (2 * k_in), (idx // 2) % k_in, torch.arange(idx.numel(), device=idx.device)

    def make(idx: Tensor, scale: Tensor) -> list[Tensor]:
        r, k, j = parts(idx, scale)
        cols = x.new_zeros(idx.numel(), n, g.shape[1], k_in)
        cols[j, :, :, k] = (u[:, :, r] * scale[:, None, :]).permute(2, 0, 1).to(x.dtype)
        return [cols.reshape(idx.numel(), *x.shape)]

    def direct(idx: Tensor, scale: Tensor) -> list[Any]:
        r, k, j = parts(idx, scale)
        sign = 1 - 2 * (idx % 2).to(scale.dtype)
        d = w.new_zeros(idx.numel(), n, v.shape[1], k_in)
        d[j, :, :, k] = (v[:, :, r] * (scale * sign)[:, None, :]).permute(2, 0, 1).to(w.dtype)
        return [(call, name, d.reshape(idx.numel(), n, *w.shape))]

    push_signed(bp, exts, [edge], values, make, direct=direct)


def _fed_params(call: Any, shared: AbstractSet[int]) -> list[str]:
    """Names of ``call``'s parameters among ``shared`` (ids) that lie upstream of its inputs."""
    starts = [e.node for e in call.input_edges]
    found = {
        id(var) for fn in _upstream(starts, set()).values()
        if (var := getattr(fn, "variable", None)) is not None and id(var) in shared
    }
    return [k for k, p in call.params.items() if id(p) in found]


def nested_site(call: Any, bp: Any, exts: list, shared: AbstractSet[int]) -> Any:
    """For a call among nested uses of parameters (ids ``shared``), every extension building
    such terms: ``None`` where none of its parameters in a product with its input feeds that
    input (its uses come first: the products lie downstream; a Linear bias is only added), a
    :class:`NestedSite` for a Linear call whose weight does; else why not (a phrase)."""
    unable = sorted({type(e).__name__ for e in exts if not e.nested_products})
    if unable:
        return f"{', '.join(unable)} does not build the term of a product of uses"
    fed = _fed_params(call, shared)
    if not fed:
        return None
    weight = get_rule(call.module).product_weight
    if weight is None or parametrized(call):
        return (
            f"{call.name}'s {', '.join(fed)} feeds its own input (built for a Linear layer's "
            "weight only)"
        )
    if weight not in fed:
        return None  # (a bias: added, in no product with the input)
    if call.fold != 1 or call.batch_axis or call.rebased or len(call.input_edges) != 1:
        return f"{call.name}'s input does not hold the samples on axis 0"
    return NestedSite(call, weight, bp)


class AttentionSite:
    """``O = F.scaled_dot_product_attention(q, k, v, …)`` (a fused kernel: one node); holds its
    inputs (which the node saves anyway) and options. A DiagHessian-family pass that reaches it
    pushes the attention's three families of columns
    (:func:`backprism.engine.attention.attention_columns`) from a pre-hook on ``O``'s node."""

    __slots__ = (
        "gqa", "is_causal", "k", "mask", "mask_in", "output_nr", "pass_", "q", "scale", "v"
    )

    def __init__(self, bound: dict, nr: int) -> None:
        self.q, self.k, self.v = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        self.mask = mask.detach() if isinstance(mask, Tensor) else None
        #: the additive mask where it depends on parameters (T5's, BEiT's relative position
        #: bias): the columns enter it too
        self.mask_in = mask if isinstance(mask, Tensor) and mask.requires_grad else None
        self.is_causal = bool(bound.get("is_causal", False))
        self.scale = bound.get("scale")
        self.gqa = bool(bound.get("enable_gqa", False))
        self.output_nr = nr
        self.pass_: Any = None

    def _inputs(self) -> tuple[Tensor, ...]:
        """The inputs the columns enter: query, key, value and a mask that depends on
        parameters."""
        return (self.q, self.k, self.v, self.mask_in) if self.mask_in is not None else (
            self.q, self.k, self.v
        )

    def refusal(self, bp: Any) -> str | None:
        """Why the pass cannot build the term (the samples not on the first axis of the inputs
        that take columns — a mask that depends on parameters among them), or ``None``."""
        inputs = [t for t in self._inputs() if t.requires_grad]
        if _samples_first(bp, [(t.grad_fn, t.output_nr) for t in inputs], self.q.shape[0]):
            return None
        if self.mask_in is not None:
            return (
                "its query, key, value and additive attn_mask (which depends on parameters) do "
                "not all hold the samples on their first axis"
            )
        return "its query, key and value do not all hold the samples on their first axis"

    def node_hook(self, bp: Any, node: Any) -> Callable[[tuple], None] | None:
        exts = [e for e in bp.second if e.needs_residual]
        if not exts:
            return None

        def hook(grad_outputs: tuple) -> None:
            grad = grad_outputs[self.output_nr]
            if grad is None or self.pass_ is not bp or bp.in_columns or not bp.loss_calls():
                return
            families = attention_columns(
                self.q, self.k, self.v, self.mask, self.is_causal, self.scale, self.gqa, grad,
                bp.n_samples, bp.ctx.memory_budget, mask_grad=self.mask_in is not None,
            )
            # (columns enter at the inputs that need gradients: a constant one takes none)
            inputs = self._inputs()
            live = [i for i, t in enumerate(inputs) if t.requires_grad]
            origins = [inputs[i] for i in live]
            for values, make, paired in families:

                def entering(idx: Tensor, sc: Tensor, make: Callable = make) -> list[Tensor]:
                    cols = make(idx, sc)
                    return [cols[i] for i in live]

                push_signed(bp, exts, origins, values, entering, paired=paired)

        return hook


def _attention_site(args: tuple, kwargs: dict, out: Tensor) -> AttentionSite | ErrorSite | None:
    """The site of one ``scaled_dot_product_attention`` call: an :class:`AttentionSite`, a
    refusal (dropout: its random mask is not kept), or ``None`` (not recognised: refused as a
    non-elementwise nonlinearity)."""
    bound = sdpa_arguments(args, kwargs)
    if bound is None or out.shape[:-1] != bound["query"].shape[:-1]:
        return None
    if float(bound.get("dropout_p", 0.0) or 0.0) > 0:
        return ErrorSite(
            "scaled_dot_product_attention with dropout",
            why="its random dropout mask is not kept",
            advice="Run the model in eval mode (or with attention dropout 0) for the Hessian. ",
        )
    return AttentionSite(bound, out.output_nr)


def bilinear_site(bp: Any, node: Any) -> tuple[BilinearSite, Any] | str:
    """The :class:`BilinearSite` of the product whose output node is ``node`` (with the
    product's own node), or why its term cannot be built: an operation other than ``*`` and a
    batched ``matmul``, or operands that do not both hold the pass's samples on their first
    axis (the columns cover every sample at once; a product across samples, or with a value
    that holds none, has no such columns)."""
    node = product_node(node)
    form = bilinear_form(node)
    if form is None:
        return (
            f"its operation ({_node_op(node)}) is not one whose term is built: an elementwise "
            "product of tensors of equal dimensions and the same first axis, or a batched "
            "matmul"
        )
    if not _samples_first(bp, [(e.node, e.output_nr) for e in form.edges], form.lead):
        return "its operands do not both hold the samples on their first axis"
    return BilinearSite(form, bp), node


def quotient_site(bp: Any, node: Any) -> tuple[DivisionSite, Any] | str:
    """The :class:`DivisionSite` of the division whose output node is ``node`` (with that
    node), or why its term cannot be built: not a true division of tensors (``DivBackward0``),
    or a numerator that shares parameters with the denominator (:func:`shares_parameters`)
    but whose operands' shapes or sample axes have no bilinear form."""
    if type(node).__name__ != "DivBackward0" or node.next_functions[1][0] is None:
        return f"its operation ({_node_op(node)}) is not a true division of two tensors"
    try:  # (read by the pass's hook: an operand modified in place since cannot be)
        node._saved_self, node._saved_other  # noqa: B018
    except RuntimeError:
        return "an operand it saved was modified in place after the division"
    form = None
    if node.next_functions[0][0] is not None and shares_parameters(node, bp.view.params.keys()):
        form = bilinear_form(node)
        if form is None:
            return (
                "its numerator and denominator depend on the same parameters and are not of "
                "equal dimensions with the same first axis"
            )
        if not _samples_first(bp, [(e.node, e.output_nr) for e in form.edges], form.lead):
            return "its numerator and denominator do not both hold the samples on their first axis"
    return DivisionSite(node, form, bp), node


def _samples_first(bp: Any, edges: list[tuple[Any, int]], lead: int) -> bool:
    """Whether the tensors at ``edges`` (first axis of size ``lead``) all hold pass ``bp``'s
    samples on their first axis, folded alike sample-major (``lead = N·g``): then one column
    covers every sample. Always with one sample."""
    if bp.n_samples == 1:
        return True
    folds = {bp.sample_fold(node, nr) for node, nr in edges}
    fold = folds.pop() if len(folds) == 1 else None
    return fold is not None and lead == fold * bp.n_samples


def push_bilinear(bp: Any, exts: list, form: BilinearForm, grad: Tensor) -> None:
    """Push the signed columns of a bilinear product's Hessian term (pass ``bp``, ``grad =
    ∂L/∂Z``) into both operands at once (:func:`backprism.engine.bilinear.signed_columns`)."""
    if not bp.loss_calls():
        return
    exact = all(e.any_decomposition for e in exts)
    alpha = balance(form, lambda i: _pull_ones(bp, form, i, grad)) if exact else None
    values, make = signed_columns(form, grad.detach(), bp.n_samples, alpha)
    push_signed(bp, exts, list(form.edges), values, make, paired=True)


#: how many nodes above an operand :func:`_pull_ones` looks for the other operand
_DERIVED_DEPTH = 12


def _pull_ones(bp: Any, form: BilinearForm, i: int, like: Tensor) -> Tensor | None:
    """``J_fᵀ 1`` for a product whose operand ``i`` is computed from the other, ``f``, within
    :data:`_DERIVED_DEPTH` nodes (all ones on operand ``i``, in ``like``'s dtype, pulled back
    to the other, in its shape); ``None`` if it is not."""
    assert form.edges is not None
    start, target = form.edges[i], form.edges[1 - i]
    seen: set[int] = set()
    stack = [start.node]
    while stack and len(seen) < _DERIVED_DEPTH:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for f, nr in fn.next_functions:
            if f is None:
                continue
            if f is target.node and nr == target.output_nr:
                shape = form.y_shape if i == 1 else form.x_shape
                return _probe(bp, start, target, like.new_ones(shape))
            stack.append(f)
    return None


def _probe(bp: Any, start: GradientEdge, target: GradientEdge, ones: Tensor) -> Tensor | None:
    bp.in_columns += 1  # (the pass's own hooks on the nodes between stay silent)
    try:
        (got,) = torch.autograd.grad(
            [start], [target], grad_outputs=[ones], retain_graph=True, allow_unused=True
        )
    except RuntimeError:  # (an operand of another dtype than the product's gradient: the
        return None  # balance only serves precision, the term is exact without it)
    finally:
        bp.in_columns -= 1
    return got


def push_signed(
    bp: Any, exts: list, origins: list[Any], values: Tensor,
    make: Callable[[Tensor, Tensor], list[Tensor]], batched: bool = True,
    direct: Callable[[Tensor, Tensor], list[Any]] | None = None, paired: bool = False,
) -> None:
    """Push signed columns from ``origins`` (tensors or gradient edges) to the pass's calls:
    ``values [n, C]`` (each column's eigenvalue, per sample if ``batched``, else one row for
    the whole batch) and ``make(idx, scale)``, the columns ``idx`` scaled by ``scale =
    √|values|`` (``[n, c]``), one tensor ``[c, *origin.shape]`` per origin. Each column's
    squared contributions are weighed by its value's sign (:func:`_signed`). ``direct(idx,
    scale)``: parts of the same columns that lie in a parameter's space itself (a product
    with the parameter as an operand, :class:`NestedSite`), as ``(call, name, [c, n, *p])``,
    added to that parameter's per-sample gradients from the pushed parts before squaring.
    ``paired``: the columns are a product's pairs ``(a, ±b)`` (see
    :meth:`~backprism.engine.backward.BackwardPass.process_columns`)."""
    signed = _signed(values, batched, bp.n_samples)
    if signed is None:
        return
    active, sqrt_abs, weights = signed

    def chunk(start: int, stop: int) -> list[Tensor]:
        return make(active[start:stop], sqrt_abs[:, start:stop])

    def direct_chunk(start: int, stop: int) -> list[Any]:
        assert direct is not None
        return direct(active[start:stop], sqrt_abs[:, start:stop])

    bp.process_columns(
        bp.loss_calls(), origins, Columns(active.numel(), chunk), exts, weights,
        direct_chunk if direct is not None else None, paired=paired and direct is None,
    )


def shares_parameters(node: Any, params: AbstractSet[int]) -> bool:
    """Whether an extended parameter (its id in ``params``) lies upstream of two of the inputs
    of the product whose output node is ``node`` (reached through the reshaping nodes that end
    a batched ``matmul``). A node of fewer than two inputs that is no such view counts as
    sharing (the operands cannot be told apart)."""
    node = product_node(node)
    if sum(f is not None for f, _ in node.next_functions) < 2:
        return True
    owner: dict[int, int] = {}
    for i, (start, _) in enumerate(node.next_functions):
        if start is None:
            continue
        stack, seen = [start], {id(start)}
        while stack:
            fn = stack.pop()
            var = getattr(fn, "variable", None)
            if var is not None and id(var) in params:
                if owner.setdefault(id(var), i) != i:
                    return True
                continue
            for f, _ in fn.next_functions:
                if f is not None and id(f) not in seen:
                    seen.add(id(f))
                    stack.append(f)
    return False


class ResidualSite:
    """``a = fn(z)`` for a smooth elementwise ``fn``; holds ``z`` (upstream of ``a``), never
    ``a``. A DiagHessian-family pass that reaches the site registers a pre-hook on ``a``'s node
    (:meth:`node_hook`) that pushes the residual columns."""

    __slots__ = ("axis", "fn", "name", "output_nr", "pass_", "z")

    def __init__(
        self, fn: Callable[[Tensor], Tensor], z: Tensor | None, name: str, nr: int,
        axis: int = 0,
    ) -> None:
        self.fn = fn
        #: ``None`` for an in-place ``a = fn(z)``, which overwrote ``z``: its values are the
        #: node's saved input (autograd keeps a copy for its own derivative) and its columns
        #: enter the graph at the node's input edge
        self.z = z
        self.name = name
        self.output_nr = nr
        self.axis = axis  # the batch axis of ``z`` (an in-place site's, read before the op)
        self.pass_: Any = None

    def node_hook(self, bp: Any, node: Any) -> Callable[[tuple], None] | None:
        """The pre-hook pass ``bp`` registers on ``a``'s node, or ``None`` if it builds no
        residual terms."""
        exts = [e for e in bp.second if e.needs_residual]
        if not exts:
            return None

        def hook(grad_outputs: tuple) -> None:
            grad_a = grad_outputs[self.output_nr]
            if grad_a is None or self.pass_ is not bp or bp.in_columns:
                return
            self.push(bp, exts, grad_a, node)

        return hook

    def push(self, bp: Any, exts: list, grad_a: Tensor, node: Any) -> None:
        """Push the site's residual columns (pass ``bp``, ``grad_a = ∂L/∂a``)."""
        if self.z is not None:
            push_residual(bp, exts, self.fn, self.z, grad_a)
        else:  # in place: z's values saved by the node, its graph behind the node's input
            edge = GradientEdge(*node.next_functions[0])
            push_residual(bp, exts, self.fn, node._saved_self, grad_a, edge, self.axis)


class RowSite(ResidualSite):
    """``a = fn(z)`` for a smooth ``fn`` acting on rows of ``z`` independently: the last
    ``trailing`` axes (``layer_norm``, ``rms_norm`` over their ``normalized_shape``) or axis
    ``dim`` (``softmax``, ``softmin``; several axes, :class:`ReductionSite`). Its Hessian term
    is block-diagonal over the rows, one ``d × d`` block per row (``d`` entries),
    :func:`push_rows`."""

    __slots__ = ("dim", "trailing", "view")

    def __init__(
        self, fn: Callable[[Tensor], Tensor], z: Tensor, name: str, nr: int,
        dim: int | tuple[int, ...] | None, trailing: int, view: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(fn, z, name, nr, getattr(z, AXIS, 0) or 0)
        self.dim = dim
        self.trailing = trailing
        #: the shape in which the rows are trailing axes (``group_norm``: ``[N, G, C/G, *S]``)
        self.view = view

    def push(self, bp: Any, exts: list, grad_a: Tensor, node: Any) -> None:
        assert self.z is not None
        push_rows(
            bp, exts, self.fn, self.z, grad_a, self.dim, self.trailing, self.axis, self.view
        )


def _add_site(out: Tensor, site: Any) -> None:
    if out.grad_fn is not None:
        out.grad_fn.metadata.setdefault(SITES, []).append(site)


def _add_error(
    out: Tensor, what: str, nll_output: weakref.ref | None = None, why: str | None = None,
    advice: str = "",
) -> None:
    _add_site(out, ErrorSite(what, nll_output, why, advice))


def add_error(out: Tensor, what: str, why: str) -> None:
    """Record on ``out``'s node an operation whose Hessian term the DiagHessian family cannot
    build (:class:`ErrorSite`: ``what`` lies between parameters and loss; ``why``)."""
    _add_error(out, what, why=why)


def nonlinear_in(name: str, pos: int | str) -> bool:
    """Whether the operation ``name`` is nonlinear in its one differentiable operand, at
    position ``pos`` (an index or a keyword): a smooth or other nonlinearity, one of unknown
    kind, a division by it (``x / t``; ``c / t`` is the reflected ``t.__rtruediv__(c)``) — not a
    product with constants, a division of it or a view."""
    kind = classify(name)
    if kind in (_SMOOTH_KIND, _NONLIN, _UNKNOWN):
        return True
    divisor = 0 if name.startswith("__r") else 1
    return kind == _QUOTIENT and pos == divisor


def _add_residual(
    out: Tensor, fn: Callable[[Tensor], Tensor], z: Tensor | None, name: str, axis: int = 0
) -> None:
    _add_recorded(out, ResidualSite(fn, z, name, out.output_nr, axis))


def _add_recorded(out: Tensor, site: Any) -> None:
    """Add a site only the forward mode records (its Hessian term, read by the DiagHessian
    family alone; refusals the graph walk finds without it, ``engine.functional``); an
    activation module's own site is taken back by its hook."""
    _add_site(out, site)
    FORWARD.acted += 1
    FORWARD.residual_acts += 1


def _nll_inputs(bp: Any) -> list[Tensor]:
    """The inputs of the pass's ``NLLLoss`` modules (a ``log_softmax`` producing one is part of
    the loss)."""
    return [
        rec.inputs[0]
        for rec in bp.loss_records
        if isinstance(rec.module, nn.NLLLoss) and rec.inputs and isinstance(rec.inputs[0], Tensor)
    ]


def _feeds_nll(bp: Any, output: weakref.ref) -> bool:
    """Whether the ``log_softmax`` output (weakly referenced) is the input of an ``NLLLoss`` of
    this backward pass. Compared by tensor identity."""
    return any(x is output() for x in _nll_inputs(bp))


def _node_op(node: Any) -> str:
    """The operation an autograd node differentiates, in :func:`classify`'s spelling:
    ``TanhBackward0`` → ``tanh``, ``MaxPool2DWithIndicesBackward0`` →
    ``max_pool2d_with_indices``, ``CopySlices`` → ``copy_slices``."""
    name = type(node).__name__
    cut = name.find("Backward")
    name = name[:cut] if cut > 0 else name
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    return re.sub(r"(?<=\d)_", "", snake)


#: node-only spellings of operations that are linear in their tensor operands (those
#: :func:`classify` does not know by these names)
_NODE_LINEAR = frozenset(
    _words(
        """to_copy unsafe_view reshape_alias alias slice index copy_slices constant_pad_nd
    reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d split_with_sizes
    unsafe_split unfold_backward accumulate_grad im2col col2im upsample_nearest1d
    upsample_nearest2d upsample_nearest3d upsample_linear1d upsample_bilinear2d
    upsample_bicubic2d upsample_trilinear3d _ddp_sink"""
    )
)


def node_ops(
    output: Any, refused_only: bool = False, params: AbstractSet[int] = frozenset()
) -> frozenset[str] | None:
    """The operations (:func:`_node_op`) of the graph upstream of ``output`` (tensors, or
    containers of them) that carry no refusal site: what a later forward of the same model
    without the forward mode may contain outside module calls (:func:`_unrecorded_nonlinearity`).
    An operation refused anywhere in this graph is left out.

    ``refused_only``: the forward recorded Hessian residuals of elementwise nonlinearities and
    nothing else the mode alone does; ``None`` (keep the mode, which records them) unless the
    graph also holds an operation that the DiagHessian family refuses (a batch norm with batch
    statistics, attention with dropout, a product of two values that depend on the same
    parameters among ``params`` (ids) that :mod:`backprism.engine.bilinear` does not
    decompose; a module call
    whose parameters enter nonlinearly, :func:`check_linear_in_params`), so that no extension
    can use those records. Without the mode such nonlinearities carry no site, and the
    DiagHessian family refuses a pass through them (:func:`_unrecorded_nonlinearity`)."""
    outs = [output] if isinstance(output, Tensor) else torch.utils._pytree.tree_flatten(output)[0]
    starts = [o.grad_fn for o in outs if isinstance(o, Tensor) and o.grad_fn is not None]
    ok: set[str] = set()
    refused: set[str] = set()
    blocked = False
    for fn in _upstream(starts, set()).values():
        op = _node_op(fn)
        sites = fn.metadata.get(SITES, ()) if fn.metadata else ()
        errors = [x for x in sites if isinstance(x, ErrorSite)]
        # (a product or division is allowed where its operands depend on different
        # parameters, or where its term is built)
        blocked = blocked or any(
            e.nll_output is None
            and (
                not isinstance(e, ProductSite)
                or (shares_parameters(fn, params) and not _decomposable(fn, e))
            )
            for e in errors
        )
        if not blocked and fn.metadata:
            blocked = any(
                call.params and _nonlinear_in_params(call, [fn])
                for call, *_ in fn.metadata.get(CALLS, ())
            )
        (refused if errors else ok).add(op)
    if refused_only and not blocked:
        return None
    return frozenset(ok - refused)


def _decomposable(node: Any, site: ProductSite) -> bool:
    """Whether the product or division recorded on ``node`` has the form whose term a pass
    builds (:func:`bilinear_form`; a true division, :func:`quotient_site`) — its samples'
    layout is checked by the pass."""
    if isinstance(site, QuotientSite):
        return type(node).__name__ == "DivBackward0" and (
            node.next_functions[0][0] is None or bilinear_form(node) is not None
        )
    return bilinear_form(product_node(node)) is not None


_NODE_NONLINEAR = ("native_layer_norm", "native_group_norm", "linalg_vector_norm", "linalg_norm")
_NODE_BATCH_NORM = ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")


def _node_kind(node: Any, op: str) -> int:
    """:func:`classify`'s kind of the operation of ``node`` (named ``op``), deciding as the
    forward mode's :func:`record` does from the node's operands (``next_functions``): ``x * c``
    is linear in ``x`` while ``x * y`` with both differentiable is a product; a quotient is
    nonlinear only in a differentiable denominator; a normalisation of parameters alone is
    linear in the data; eval-mode batch norm is affine."""
    nexts = [f for f, _ in node.next_functions if f is not None]
    kind = classify(op)
    if kind == _UNKNOWN:
        if op in _NODE_LINEAR:
            kind = _LINEAR
        elif op.startswith(_NODE_BATCH_NORM):
            if not getattr(node, "_saved_training", True):
                return _LINEAR
            kind = _NONLIN
        elif op.startswith(_NODE_NONLINEAR) or "attention" in op:
            kind = _NONLIN
    if kind in (_PRODUCT, _QUOTIENT):
        if kind == _QUOTIENT:
            fns = node.next_functions
            return _QUOTIENT if len(fns) > 1 and fns[1][0] is not None else _LINEAR
        return _PRODUCT if len(nexts) > 1 else _LINEAR
    if kind == _SMOOTH_KIND and len(nexts) > 1:  # x ** y, xlogy: a second operand
        return _PRODUCT
    if kind == _NONLIN and all(getattr(f, "variable", None) is not None for f in nexts):
        return _LINEAR  # of parameters alone: linear in the data
    return kind


def _region(outputs: list[Any], inputs: list[Any]) -> dict[int, Any]:
    """The nodes of a recorded computation: upstream of its ``outputs``, down to (excluding)
    the nodes that produced its ``inputs``."""
    return _upstream(outputs, {id(n) for n in inputs if n is not None})


def _param_dependent(view: Any) -> set[int]:
    """Ids of the graph's nodes from which an extended parameter is reached (their curvature
    terms reach the parameters)."""
    consumers: dict[int, list[Any]] = {}
    for fn in view.nodes.values():
        for f, _ in fn.next_functions:
            if f is not None:
                consumers.setdefault(id(f), []).append(fn)
    found: set[int] = set()
    stack = [node for _, node in view.params.values()]
    while stack:
        fn = stack.pop()
        for c in consumers.get(id(fn), ()):
            if id(c) not in found:
                found.add(id(c))
                stack.append(c)
    return found


def _unrecorded_nonlinearity(
    bp: Any, product: Callable[[Any], str | None]
) -> tuple[str, int, str | None] | None:
    """A nonlinear operation (its name, :func:`classify`'s kind and, for a product, why its
    term cannot be built) between the extended losses and the parameters that no forward
    recording saw (so its Hessian term has no site), if any. ``product(node)`` takes a product
    (``None``: its operands depend on different parameters, or its term is built, a
    :class:`BilinearSite`) or says why not.

    The regions of top-level forwards that ran with the recording mode
    (:class:`~backprism.engine.state.RootRecord` ``recorded``) carry sites for everything the
    mode found. Elsewhere — forwards without the mode (:data:`~backprism.engine.state.MODE_FREE`),
    sub-modules called on their own, code between models and the loss — the nodes on a path to a
    parameter are classified as the mode classifies operations (:func:`record`): an elementwise
    nonlinearity needs a site (activation modules' hooks record one), a non-elementwise one is
    refused, a product of two differentiable operands or a division by one is refused outside a
    module call (inside, the module's rule accounts for it) unless ``product`` takes it, and
    an operation of unknown kind
    is accepted inside a module call, or where the model's recorded forward had it without a
    refusal."""
    view = bp.view
    trusted: set[int] = set()
    known_ops: set[str] = set()
    for root, node in view.root_nodes:
        if root.recorded:
            trusted.update(_region([node], list(root.stops)))
        elif root.modeless is not None:
            known_ops.update(root.modeless)
    inside: set[int] = set()
    for call, edges in view.calls.items():
        inside.update(
            _region(
                [e[0] for e in edges if e is not None],
                [e.node for e in call.input_edges],
            )
        )
    dependent: set[int] | None = None
    seen: set[int] = set()
    stack = [
        x.grad_fn
        for rec, _ in view.losses
        for x in rec.inputs
        if isinstance(x, Tensor) and x.grad_fn is not None
    ]
    while stack:
        fn = stack.pop()
        if id(fn) in seen or getattr(fn, "variable", None) is not None:
            continue
        seen.add(id(fn))
        stack.extend(f for f, _ in fn.next_functions if f is not None)
        custom = _custom_function(fn)
        if id(fn) in trusted and not custom:
            continue
        if dependent is None:
            dependent = _param_dependent(view)
        if id(fn) not in dependent:
            continue
        if custom:
            # (the forward mode does not see inside an autograd.Function: no recorded forward
            # vouches for it, and its second derivative is not known)
            if type(fn).__name__ == "_SpreadFunctionBackward":
                if _linear_spread(fn):
                    continue
                return "_SpreadFunction", _UNKNOWN, _SPREAD_WHY
            return type(fn).__name__.removesuffix("Backward"), _UNKNOWN, _CUSTOM_WHY
        op = _node_op(fn)
        kind = _node_kind(fn, op)
        if kind == _LINEAR:
            continue
        if kind == _SMOOTH_KIND:
            if any(isinstance(x, ResidualSite) for x in fn.metadata.get(SITES, ())):
                continue  # an activation module's hook recorded it
            return op, kind, None
        if kind in (_PRODUCT, _UNKNOWN):
            if kind == _UNKNOWN and (id(fn) in inside or op in known_ops):
                continue
            if kind == _PRODUCT:
                if id(fn) in inside and _values(fn) < 2:
                    continue  # a module's own parameter times its input (its rule's part)
                why = product(fn)
                if why is None:
                    continue
                return op, kind, why
            return op, kind, None
        if op == "log_softmax" and any(x.grad_fn is fn for x in _nll_inputs(bp)):
            continue
        if kind == _QUOTIENT and type(fn).__name__ == "DivBackward0":
            why = product(fn)  # (a true division: its term built, or why not)
            if why is None:
                continue
            return op, kind, why
        return op, kind, None  # a quotient, or a non-elementwise nonlinearity
    return None


def _linear_spread(node: Any) -> bool:
    """Whether the engine's copies of a shared call over the samples (``node``: a
    ``_SpreadFunctionBackward``) are of a layer linear in its input (Linear, a convolution:
    DeBERTa-v2's key and query projections of its relative embeddings), whose Hessian terms
    are those of any call of it (the per-sample pull-back of the copies is its Jacobian)."""
    call = getattr(getattr(node, "spread", None), "call", None)
    module = getattr(call, "module", None)
    # (copies of an input computed by a nonlinear operation carry their own refusal:
    # engine.broadcast._widen_shared)
    return isinstance(module, (nn.Linear, nn.modules.conv._ConvNd))


_SPREAD_WHY = (
    "it is computed by a module with parameters from inputs that need gradients (DeBERTa-v2's "
    "relative embeddings through their LayerNorm, Swin V2's position-bias MLP) and copied "
    "over the samples by backprism, whose copies take each sample's gradient but not the "
    "Hessian terms of that computation"
)
_CUSTOM_WHY = (
    "it is a custom autograd.Function, whose forward backprism's forward mode does not see and "
    "whose second derivative it cannot read (its backward need not be differentiable)"
)


def _custom_function(node: Any) -> bool:
    """Whether ``node`` is the backward of a custom ``torch.autograd.Function`` (Bloom's
    ``GeLUFunction``) other than one known to be the identity (DDP's ``_DDPSink``) or a
    ``torch.compile`` region (AOTAutograd's ``CompiledFunction``, whose operations the forward
    mode sees while it runs: their sites are on the region's node). The engine's own copies of
    a shared call over the samples (``engine.broadcast._SpreadFunction``) count: the Hessian
    terms of the call's computation, which the copies pull back per sample, are not built."""
    return isinstance(node, torch.autograd.function.BackwardCFunction) and (
        type(node).__name__ not in _IDENTITIES and type(node).__name__ != "CompiledFunctionBackward"
    )


def _values(node: Any) -> int:
    """The operands of product ``node`` that are not parameters (read through views)."""
    return sum(not _param_only(f) for f, _ in node.next_functions if f is not None)


def nested_uses(call: Any, bp: Any) -> bool:
    """Whether a parameter of ``call`` is used by several calls of backward pass ``bp`` of which
    one feeds another (RNN unrolling, ``lin(lin(x))``, tied input/output embeddings). Parallel
    uses (siamese branches) are not nested. Decided by walking the autograd graph upstream from
    each user's outputs to the outputs of the other users."""
    pids = {id(p) for p in call.params.values()}
    users = [
        edges
        for c, edges in bp.loss_calls()
        if any(id(p) in pids for p in c.params.values())
    ]
    # node wrappers are held while their ids are compared (torch may free and re-create them)
    nodes = [(e[0], i) for i, edges in enumerate(users) for e in edges if e is not None]
    owner = {id(fn): i for fn, i in nodes}
    for i, edges in enumerate(users):
        stack = [e[0] for e in edges if e is not None]
        seen: dict[int, Any] = {}
        while stack:
            fn = stack.pop()
            if id(fn) in seen:
                continue
            seen[id(fn)] = fn
            if owner.get(id(fn), i) != i:
                return True
            stack.extend(f for f, _ in fn.next_functions if f is not None)
    return False


def shared_message(names: str, call: Any) -> str:
    """The refusal of a parameter used by nested calls (:func:`nested_uses`)."""
    return (
        f"backprism {names}: a parameter of {type(call.module).__name__} is used by several "
        "calls of which one feeds another (unrolled recurrence, tied weights); the Hessian "
        "term from the product of its uses is built from columns for a Linear weight that "
        "feeds its layer's input, by DiagHessian and BatchDiagHessian only. Use DiagGGNExact() for "
        "the GGN diagonal or HutchinsonDiagHessian() for an unbiased estimate of the exact "
        "Hessian diagonal."
    )


def check_pass(bp: Any, exts: list) -> None:
    """The DiagHessian-family checks of a backward pass, before anything is written."""
    check_recording(exts)
    names = _names(exts)
    calls = bp.loss_calls()
    note = _backward.modeless_note(bp.view)
    for call, edges in calls:
        check_linear_in_params(call, exts, [e[0] for e in edges if e is not None], note, bp)
    uses: dict[int, int] = {}
    for call, _ in calls:
        for p in call.params.values():
            uses[id(p)] = uses.get(id(p), 0) + 1
    shared = {k for k, v in uses.items() if v > 1}
    nested: list[tuple[NestedSite, Any]] = []
    for call, edges in calls:
        if any(id(p) in shared for p in call.params.values()) and nested_uses(call, bp):
            site = nested_site(call, bp, exts, shared)
            if isinstance(site, str):
                raise NonlinearityError(f"{shared_message(names, call)} ({site})")
            if site is not None and edges and edges[0] is not None:
                nested.append((site, edges[0][0]))
    # (the products inside those calls: their terms are the sites')
    inside_nested = {
        k for site, node in nested for k in _region([node], [e.node for e in site.call.input_edges])
    }
    products = {
        id(site): node for site, node in bp.view.site_nodes if isinstance(site, ProductSite)
    }
    bilinear: dict[int, tuple[BilinearSite, Any]] = {}

    def product(node: Any) -> str | None:
        """``None`` where the product's term is off the parameters' blocks or built (a
        division, which the graph walk of forwards without the mode passes here too: where
        :func:`quotient_site` builds its term)."""
        if type(node).__name__ == "DivBackward0":
            return quotient(node)
        if id(node) in inside_nested or not shares_parameters(node, bp.view.params.keys()):
            return None
        found = bilinear_site(bp, node)
        if isinstance(found, str):
            return found
        bilinear.setdefault(id(found[1]), found)
        return None

    def quotient(node: Any) -> str | None:
        """``None`` where the division's term is built (:func:`quotient_site`)."""
        found = quotient_site(bp, node)
        if isinstance(found, str):
            return found
        bilinear.setdefault(id(found[1]), found)  # type: ignore[arg-type]
        return None

    for site in bp.view.sites:
        if isinstance(site, AttentionSite):
            why = site.refusal(bp)
            if why is not None:
                raise NonlinearityError(
                    f"backprism {names}: scaled_dot_product_attention lies between the "
                    f"parameters and the loss; {why}, so the exact Hessian diagonal/blocks "
                    f"cannot be built from columns. {_WAY_OUT}"
                )
        if isinstance(site, ErrorSite):
            if site.nll_output is not None and _feeds_nll(bp, site.nll_output):
                continue
            why = site.why
            if isinstance(site, QuotientSite) and id(site) in products:
                why = quotient(products[id(site)])
                if why is None:
                    continue
            elif isinstance(site, ProductSite) and id(site) in products:
                why = product(products[id(site)])
                if why is None:
                    continue
            why = why or "its Hessian term is not an elementwise residual"
            raise NonlinearityError(
                f"backprism {names}: {site.what} lies between the parameters and the loss; "
                f"{why}, so the exact Hessian diagonal/blocks cannot be built from columns. "
                f"{site.advice}{_WAY_OUT}"
            )
    found = _unrecorded_nonlinearity(bp, product)
    if found is None:
        bp.bilinear_sites = [*bilinear.values(), *nested]
        # (every nested use passed its check: its term built, or none needed)
        bp.nested_params = frozenset(shared)
        params = [p for call, _ in calls for p in call.params.values()]
        if not all(p.__dict__.get(_WANTED, False) for p in params):
            want_residuals(params)
            for root, _ in bp.view.root_nodes:  # (decided without: their next forward decides)
                table = MODE_FREE.get(root.module)
                if table is not None:
                    table.pop(True, None)
                    table.pop(False, None)
        return
    op, kind, why = found
    note = _backward.modeless_note(bp.view)  # (". (…)": after the way out, less its period)
    way_out = f"{_WAY_OUT[:-1]}{note}" if note else _WAY_OUT
    if kind == _SMOOTH_KIND and note:
        # (the likelier cause first: a forward without the mode records no nonlinearity)
        raise NonlinearityError(
            f"backprism {names}: this pass's forward ran without backprism's forward mode, "
            "which the model's earlier forwards did not need, so the nonlinear operation "
            f"'{op}' between the parameters and the loss was not recorded: repeat the forward "
            "and backward pass. If the operation lies outside the extended model's forward "
            "(applied to its outputs), apply it inside the forward instead, as an activation "
            f"module or as part of an extended loss. {way_out}"
        )
    if kind == _SMOOTH_KIND:
        raise NonlinearityError(
            f"backprism {names}: the nonlinear operation '{op}' lies between the parameters "
            "and the loss where no recorded forward saw it (outside the extended model's "
            "forward, e.g. applied to its outputs, or inside a sub-module called on its own), "
            "so its Hessian residual term is not recorded. Apply it inside the forward of the "
            "extended model and call that model, as an activation module (nn.Tanh, nn.GELU, "
            f"...) or as part of an extended loss. {way_out}"
        )
    what = {
        _PRODUCT: f"the product '{op}' of two values that depend on the same parameters",
        _QUOTIENT: f"the division '{op}' by a parameter-dependent tensor",
        _NONLIN: f"the non-elementwise nonlinear operation '{op}'",
    }.get(kind, f"the operation '{op}' (not known to be linear)")
    if why is _SPREAD_WHY:
        what = "a value all samples share"
    why = why or "its Hessian term is not an elementwise residual"
    raise NonlinearityError(
        f"backprism {names}: {what} lies between the parameters and the loss; {why}, so the "
        f"exact Hessian diagonal/blocks cannot be built from columns. {way_out}"
    )


def second_derivative(fn: Callable[[Tensor], Tensor], z: Tensor) -> Tensor:
    """``σ''(z)`` elementwise for an elementwise ``σ = fn``, by double backward."""
    with torch.enable_grad():
        zz = z.detach().requires_grad_(True)
        a = fn(zz)
        (d1,) = torch.autograd.grad(a.sum(), zz, create_graph=True)
        if not d1.requires_grad:
            return torch.zeros_like(zz)
        (d2,) = torch.autograd.grad(d1.sum(), zz, allow_unused=True)
    return torch.zeros_like(z) if d2 is None else d2.detach()


def _nonlinear_in_params(call: Any, outputs: list[Any] | None = None, bp: Any = None) -> bool:
    """Whether ``call``'s parameters enter its output nonlinearly (a parametrized weight, a
    rule not linear in them): no column construction covers its own Hessian term. A rule
    only affine in each parameter (:meth:`~backprism.engine.rule.Rule.is_affine_in_params`)
    passes where every operation of the call's body, between its inputs and its output nodes
    ``outputs``, has a known kind and, if nonlinear, its recorded site (:func:`_body_recorded`):
    the term in its inputs is then those operations' terms, and its parameters' own terms are
    zero. Decided once per call and pass (``BackwardPass.body_verdicts``, by the call's
    number, which the views of a call computed on a folded batch keep); later checks without
    ``outputs`` read the verdict."""
    if parametrized(call):
        return True
    rule = get_rule(call.module)
    if rule.is_linear_in_params(call):
        return False
    bp = bp if bp is not None else _backward.current_pass()
    verdicts = getattr(bp, "body_verdicts", None)
    if verdicts is not None and call.seq in verdicts:
        return not verdicts[call.seq]
    if outputs is None:
        return True
    verdict = rule.is_affine_in_params(call) and _body_recorded(call, outputs)
    if verdicts is not None:
        verdicts[call.seq] = verdict
    return not verdict


def _body_recorded(call: Any, outputs: list[Any]) -> bool:
    """Whether every node between ``call``'s input edges and its output nodes is linear, a
    product (whose term :class:`BilinearSite` builds where its operands share parameters), or
    a nonlinearity with a site the forward mode recorded (elementwise, row-wise, attention;
    or a refusal, which the pass raises with its own reason) — no operation of unknown kind,
    which inside a module call the mode passes over."""
    stop = {id(e.node) for e in call.input_edges}
    region = _upstream(outputs, stop)
    covered = _composite_nodes(region)
    for node in region.values():
        if id(node) in covered:
            continue
        op = _node_op(node)
        kind = _node_kind(node, op)
        if kind in (_LINEAR, _PRODUCT):
            continue
        sites = node.metadata.get(SITES, ()) if node.metadata else ()
        if kind == _UNKNOWN or not any(
            isinstance(x, (ResidualSite, AttentionSite, ErrorSite)) for x in sites
        ):
            return False
    return True


def _composite_nodes(region: dict[int, Any]) -> set[int]:
    """Ids of the nodes inside the row-wise operations of ``region`` (node id → node): those
    on a path from a :class:`RowSite`'s input ``z`` to its output node. Its term covers the
    whole operation, however autograd decomposes it (``F.rms_norm`` on the CPU records
    ``pow``, ``mean``, ``rsqrt`` and ``mul`` nodes)."""
    covered: set[int] = set()
    for node in region.values():
        for site in node.metadata.get(SITES, ()) if node.metadata else ():
            z = site.z if isinstance(site, RowSite) else None
            if z is None or z.grad_fn is None:
                continue
            start = z.grad_fn
            inner = _upstream([node], {id(start)})
            reaches: dict[int, bool] = {}

            def leads(fn: Any, start: Any = start, inner: dict = inner,
                      reaches: dict = reaches) -> bool:
                if id(fn) not in reaches:
                    reaches[id(fn)] = False  # (no cycles in a graph; guards the recursion)
                    reaches[id(fn)] = any(
                        f is start or (f is not None and id(f) in inner and leads(f))
                        for f, _ in fn.next_functions
                    )
                return reaches[id(fn)]

            covered.update(k for k, fn in inner.items() if fn is not node and leads(fn))
    return covered


def check_linear_in_params(
    call: Any, exts: list, outputs: list[Any] | None = None, note: str = "", bp: Any = None
) -> None:
    """Raise if ``call``'s module has parameters entering nonlinearly (DiagHessian family), or
    if recording is switched off; ``outputs``: the call's output nodes, where known
    (:func:`_nonlinear_in_params`); ``note``: the pass's sentence on forwards without the
    forward mode (:func:`~backprism.engine.backward.modeless_note`), whose bodies carry no
    sites; ``bp``: the pass (else the one running)."""
    check_recording(exts)
    if call.unrecorded:
        names = _names(exts)
        raise RuntimeError(
            f"backprism {names}: the forward pass of this backward ran inside a collect() "
            "without a DiagHessian-family extension, so its nonlinearities were not recorded "
            "and the Hessian residual terms would be missing. Run the forward pass inside the "
            f"collect() that holds {names}, or outside any collect()."
        )
    if _nonlinear_in_params(call, outputs, bp):
        names = _names(exts)
        raise NonlinearityError(
            f"backprism {names}: the parameters of {call.name} enter its output "
            "nonlinearly, or are not known to enter it linearly (a module without a "
            "closed-form rule counts as linear only when its output is affine in each "
            "parameter and, in its inputs, affine too or computed by operations whose Hessian "
            "terms the forward recorded: no operation of unknown kind, such as a custom "
            "autograd.Function), so its own Hessian term is missing from the column "
            f"construction. {f'{_WAY_OUT[:-1]}{note}' if note else _WAY_OUT}"
        )


def push_residual(
    bp: Any, exts: list, fn: Callable[[Tensor], Tensor], z: Tensor, grad_a: Tensor,
    origin: Any = None, axis: int | None = None,
) -> None:
    r"""Push the signed residual columns of ``a = fn(z)`` back from ``z`` (pass ``bp``).

    ``r = ∂L/∂a ⊙ σ''(z)``; for every element ``j`` of one sample's ``z``, column
    ``cⱼ[n] = √|rₙⱼ| eⱼ`` with weight ``wⱼₙ = sign(rₙⱼ)`` (``K`` = elements per sample). If
    ``z``'s first axis is not the calls' batch axis (different size, or ``z`` carries a batch
    axis other than 0 from a ``batch_first=False`` RNN), every element of ``z`` gets
    its own column instead (``K = z.numel()``), which is exact whatever the layout. Columns whose
    weights are all zero are skipped; chunks follow the context's memory budget. ``origin``:
    where the columns enter the graph (default ``z``; an in-place operation's input edge), with
    ``z``'s batch ``axis``.
    """
    if not bp.loss_calls():
        return
    r = grad_a.detach() * second_derivative(fn, z)
    n_calls = bp.n_samples
    # one column per element of a sample, covering all samples at once, needs z's first axis to
    # hold the calls' samples (the graph tells, not the size alone: a transposed activation's
    # first axis may have the batch's size); otherwise one column per element of z (always
    # exact)
    edge = (origin.node, origin.output_nr) if origin is not None else (z.grad_fn, z.output_nr)
    batched = (
        r.dim() > 0 and r.shape[0] == n_calls
        and not (getattr(z, AXIS, 0) if axis is None else axis)
        and bp.samples_on_axis_0(*edge)
    )
    n = r.shape[0] if batched else 1
    flat = r.reshape(n, -1)
    d = flat.shape[1]
    shape = z.shape

    def make(idx: Tensor, scale: Tensor) -> list[Tensor]:
        k = idx.numel()
        cols = flat.new_zeros(k, n, d)
        cols[torch.arange(k, device=flat.device), :, idx] = scale.t()
        return [cols.reshape(k, *shape)]

    push_signed(bp, exts, [z if origin is None else origin], flat, make, batched)


def _signed(
    flat: Tensor, batched: bool, n_calls: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """For residual values ``flat`` ``[n, K]`` (one column each, ``n`` samples or one row for
    all): the columns to push (on the CPU those whose value vanishes for every sample are
    skipped; on an accelerator that selection would read back to the host: all), their
    scales ``√|flat|`` ``[n, K']`` and weights ``sign(flat)`` ``[K', N]``; ``None`` if none."""
    if flat.device.type == "cpu":
        active = (flat != 0).any(0).nonzero().flatten()  # [K'] column indices
        if active.numel() == 0:
            return None
    else:
        active = torch.arange(flat.shape[1], device=flat.device)
    sqrt_abs = flat.abs().sqrt()[:, active]
    signs = flat.sign()[:, active].t()
    weights = (signs if batched else signs.expand(-1, n_calls)).contiguous()
    return active, sqrt_abs, weights


def push_rows(
    bp: Any, exts: list, fn: Callable[[Tensor], Tensor], z: Tensor, grad_a: Tensor,
    dim: int | tuple[int, ...] | None, trailing: int, axis: int = 0,
    view: tuple[int, ...] | None = None,
) -> None:
    """Push the signed residual columns of a row-wise ``a = fn(z)`` (:class:`RowSite`,
    :func:`backprism.engine.rows.row_columns`) back from ``z`` (pass ``bp``), covering all
    samples at once where ``z``'s first axis holds them (the layout rules of
    :func:`push_residual`), else one column per row and eigenvector of the whole batch. With
    ``view`` the rows are the trailing axes of ``z`` in that shape (same first axis)."""
    if not bp.loss_calls():
        return
    axes = row_axes(dim, z.dim()) or ()
    zv, ga, f = z, grad_a, fn
    if view is not None:
        zv, ga = z.detach().reshape(view), grad_a.reshape(view)

        def f(t: Tensor) -> Tensor:
            return fn(t.reshape(z.shape)).reshape(view)

    batched = (
        zv.dim() > trailing and z.shape[0] == bp.n_samples and not axis and 0 not in axes
        and bp.samples_on_axis_0(z.grad_fn, z.output_nr)
    )
    n = z.shape[0] if batched else 1
    values, make = row_columns(f, zv, ga, dim, trailing, n, bp.ctx.memory_budget)
    if view is not None:
        inner = make

        def make(idx: Tensor, scale: Tensor) -> list[Tensor]:
            return [c.reshape(c.shape[0], *z.shape) for c in inner(idx, scale)]

    push_signed(bp, exts, [z], values, make, batched)


# -- recording during forward ------------------------------------------------------------------
_RECORDING = [True]


def record_nonlinearities(enabled: bool = True) -> bool:
    """Switch the forward-time recording on or off globally; returns the previous setting.

    Off, extended models run their forward without the ``TorchFunctionMode`` (no per-operation
    Python dispatch), and the DiagHessian family (``DiagHessian``, ``BatchDiagHessian``,
    ``HMP``, ``PCHMP``) refuses to run rather than silently miss residual terms.
    """
    previous = _RECORDING[0]
    _RECORDING[0] = bool(enabled)
    return previous


def check_recording(exts: list) -> None:
    """Raise if nonlinearities are not being recorded (see :func:`record_nonlinearities`)."""
    if not _RECORDING[0]:
        names = _names(exts)
        raise RuntimeError(
            f"backprism {names}: recording of nonlinearities is switched off "
            "(backprism.engine.residual.record_nonlinearities(False)), so the Hessian residual "
            "terms would be missing. Call record_nonlinearities(True) before the forward pass."
        )


def _unary(func: Any, args: tuple, kwargs: dict) -> Callable[[Tensor], Tensor]:
    rest = args[1:]
    kw = dict(kwargs)

    def fn(zz: Tensor) -> Tensor:
        return func(zz, *rest, **kw)

    return fn


def _add_in_place(out: Tensor, fn: Callable[[Tensor], Tensor] | None, name: str) -> None:
    """The site of an in-place nonlinearity ``out = fn_(z)`` (``fn``: its out-of-place form,
    or ``None``): a residual reading ``z`` from the node where the node kept it
    (:func:`_saves_input`), else a refusal saying so."""
    if fn is not None and _saves_input(out):
        _add_residual(out, fn, None, name, getattr(out, AXIS, 0) or 0)
        return
    _add_error(
        out, f"the in-place nonlinearity {name}",
        why=f"it overwrites its input z, which its Hessian term ({name}''(z)) needs",
        advice="Construct it with inplace=False (nn.SiLU(inplace=False); in a built model set "
        "the activation modules' inplace attribute to False): that is supported. ",
    )


def _saves_input(out: Tensor) -> bool:
    """Whether the node of an in-place elementwise ``out = fn_(z)`` kept the input ``z`` (a
    copy autograd makes for its own derivative: ``silu_``, ``hardswish_``, ``mish_``; not
    ``tanh_``/``sigmoid_``, whose derivatives read the result)."""
    try:
        return isinstance(getattr(out.grad_fn, "_saved_self", None), Tensor)
    except RuntimeError:  # (freed)
        return False


def _out_of_place(
    func: Any, name: str, args: tuple, kwargs: dict
) -> Callable[[Tensor], Tensor] | None:
    """The out-of-place form of an in-place elementwise nonlinearity (``F.silu(x,
    inplace=True)``, ``x.hardswish_()``), or ``None``."""
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    target = getattr(F, base, None) or getattr(torch, base, None)
    if target is None:
        return None
    rest = tuple(a for a in args[1:] if not isinstance(a, bool))  # (an inplace flag)
    kw = {k: v for k, v in kwargs.items() if k != "inplace"}

    def fn(zz: Tensor) -> Tensor:
        return target(zz, *rest, **kw)

    return fn


def record(func: Any, name: str, kind: int, args: tuple, kwargs: dict, out: Any) -> None:
    """Register what DiagHessian will need of one operation ``func`` (named ``name``, of
    :func:`classify`'s ``kind``); cheap."""
    if kind == _LINEAR:
        return
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, Tensor) and o.requires_grad), None)
    if not isinstance(out, Tensor) or not out.requires_grad or not out.is_floating_point():
        return
    # inside the forward of a hooked module whose call its rule computes as a whole (linear in
    # input and parameters, or refused: check_linear_in_params); not in the body of a module
    # that released its parameters to functional attribution (a container's position
    # embedding or layer scale), whose operations no rule covers
    stack = FORWARD.call_stack
    inside_module = bool(stack) and not stack[-1][2]
    if kind == _SMOOTH_KIND:
        z = args[0] if args else None
        others = _grad_tensors(args[1:], kwargs)
        if others:
            _add_error(out, f"{name} with a parameter-dependent second operand")
            return
        if not isinstance(z, Tensor) or not z.requires_grad:
            return
        if out is z:
            _add_in_place(out, _out_of_place(func, name, args, kwargs), name)
            return
        if out.shape != z.shape:
            _add_error(out, f"{name} (broadcasting its input)")
            return
        _add_residual(out, _unary(func, args, kwargs), z, name)
        return
    grads = _grad_tensors(args, kwargs)
    if kind == _PRODUCT:
        if len(grads) < 2:
            return
        if inside_module and sum(not isinstance(t, nn.Parameter) for t in grads) < 2:
            # a module's own parameter times its input: the module's rule covers it (a
            # parameter upstream of its own module's input is refused as a nested use)
            return
        _add_site(out, ProductSite(f"{name} (a product of two parameter-dependent tensors)"))
        return
    if kind == _QUOTIENT:
        denom = args[1] if len(args) > 1 else kwargs.get("other")
        if name in ("__rtruediv__", "__rdiv__"):
            denom = args[0]
        if isinstance(denom, Tensor) and denom.requires_grad:
            what = f"{name} (division by a parameter-dependent tensor)"
            if name in _TRUE_DIVISIONS and kwargs.get("rounding_mode") is None:
                _add_site(out, QuotientSite(what))  # (resolved per pass: quotient_site)
            else:
                _add_error(out, what)
        return
    inputs = [t for t in grads if not isinstance(t, nn.Parameter)]
    if not inputs:
        return  # nonlinear only in data: linear in the module's parameters
    if kind == _NONLIN:
        if name == "batch_norm" and not _bn_training(args, kwargs):
            return  # eval-mode batch norm is affine in its input
        if name == "instance_norm" and not _arguments(F.instance_norm, args, kwargs)[
            "use_input_stats"
        ]:
            return  # with running statistics: affine in its input
        if name in _ROW_WISE:
            site = _row_site(func, name, args, kwargs, out)
            if site is not None:
                _add_recorded(out, site)
                return
        if name in _REDUCTIONS:
            site = _reduction_site(func, name, args, kwargs, out)
            if site is not None:
                _add_recorded(out, site)
                return
        if name == "scaled_dot_product_attention":
            attention = _attention_site(args, kwargs, out)
            if isinstance(attention, AttentionSite):
                _add_recorded(out, attention)
                return
            if attention is not None:  # (a refusal)
                _add_site(out, attention)
                return
        if name == "log_softmax":
            _add_error(out, "log_softmax", weakref.ref(out))
            return
        _add_error(out, f"the non-elementwise nonlinear operation {name}")
        return
    if inside_module:
        return  # the module's rule accounts for its internals
    _add_error(out, f"the operation {name or func!r} (not known to be linear)")


#: smooth nonlinear operations acting on rows of their input independently (:class:`RowSite`)
_ROW_WISE = frozenset(
    {
        "softmax", "_softmax", "softmin", "layer_norm", "rms_norm", "group_norm",
        "instance_norm", "normalize",
    }
)

_SIGNATURES = {f: inspect.signature(f) for f in (F.instance_norm, F.normalize)}


def _arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of ``func`` (in :data:`_SIGNATURES`) by name, defaults filled."""
    bound = _SIGNATURES[func].bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _row_site(func: Any, name: str, args: tuple, kwargs: dict, out: Tensor) -> RowSite | None:
    """The :class:`RowSite` of a row-wise operation ``out = func(z, ...)``, or ``None``
    (refused as before): an input ``z`` that needs gradients, of ``out``'s shape, its rows
    known (``dim`` of a softmax given; ``normalized_shape`` of a norm), every other tensor
    argument (a norm's weight and bias) taken as fixed — their own terms are linear."""
    z = args[0] if args else None
    if not isinstance(z, Tensor) or not z.requires_grad or out.shape != z.shape or out is z:
        return None
    rest = tuple(a.detach() if isinstance(a, Tensor) else a for a in args[1:])
    kw = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}

    def fn(zz: Tensor) -> Tensor:
        return func(zz, *rest, **kw)

    if name == "instance_norm":  # rows: each sample's channels with their positions
        a = _arguments(F.instance_norm, args, kwargs)
        if z.dim() < 3:
            return None  # (an unbatched input: its rows are not samples)
        w, b = (t.detach() if isinstance(t, Tensor) else t for t in (a["weight"], a["bias"]))
        eps = a["eps"]

        def fn_inst(zz: Tensor) -> Tensor:  # (without the running statistics' update)
            return F.instance_norm(zz, None, None, w, b, True, 0.0, eps)

        return RowSite(fn_inst, z, name, out.output_nr, None, z.dim() - 2)
    if name == "normalize":  # x / max(‖x‖_p, eps) along dim (cosine attention, XCiT)
        a = _arguments(F.normalize, args, kwargs)
        p_, dim, eps = a["p"], a["dim"], a["eps"]
        if a.get("out") is not None or not isinstance(dim, int) or z.dim() == 0:
            return None

        def fn_normalize(zz: Tensor) -> Tensor:
            return F.normalize(zz, p_, dim, eps)

        return RowSite(fn_normalize, z, name, out.output_nr, dim, 1)
    if name == "group_norm":  # rows: the groups of channels with their positions
        groups = args[1] if len(args) > 1 else kwargs.get("num_groups")
        if not isinstance(groups, int) or z.dim() < 2 or groups < 1 or z.shape[1] % groups:
            return None
        view = (z.shape[0], groups, z.shape[1] // groups, *z.shape[2:])
        return RowSite(fn, z, name, out.output_nr, None, z.dim() - 1, view)
    params = ("dim",) if "softmax" in name or "softmin" in name else ("normalized_shape",)
    spec = args[1] if len(args) > 1 else kwargs.get(params[0])
    if "norm" in name:
        if spec is None:
            return None
        trailing = 1 if isinstance(spec, int) else len(spec)
        if trailing == 0 or trailing > z.dim():
            return None
        dim = None
    else:
        if not isinstance(spec, int) or z.dim() == 0:
            return None  # (softmax without dim: PyTorch's implicit choice)
        dim, trailing = spec, 1
    return RowSite(fn, z, name, out.output_nr, dim, trailing)


#: smooth reductions of axes (:class:`ReductionSite`): name → (positions of ``dim`` and
#: ``keepdim`` among the arguments, the argument that must keep a smooth default, its name)
_REDUCTIONS: dict[str, tuple[int, int, int, str]] = {
    "norm": (2, 3, 1, "p"),  # torch.norm / Tensor.norm(p, dim, keepdim)
    "vector_norm": (2, 3, 1, "ord"),  # torch.linalg.vector_norm(x, ord, dim, keepdim)
    "linalg_vector_norm": (2, 3, 1, "ord"),  # (its name as the forward mode sees it)
    "var": (1, 3, -1, ""),  # var(dim, unbiased | *, correction, keepdim)
    "std": (1, 3, -1, ""),
    "logsumexp": (1, 2, -1, ""),
}


class ReductionSite(RowSite):
    """``a = fn(z)`` reducing axes ``dim`` of ``z`` smoothly (``x.norm(dim=-1)``,
    ``torch.linalg.vector_norm``, ``var``, ``std``, ``logsumexp``; a response norm's
    ``x.norm(dim=(1, 2))``): a row-wise operation whose rows (the reduced axes, moved last)
    have one output each, ``R_ρ = (∂L/∂a_ρ) ∇²a_ρ(z_ρ)`` (:func:`push_rows`). ``fn`` keeps the
    reduced axes; ``squeezed``: the call dropped them (``keepdim=False``), so ``∂L/∂a`` gets
    them back before the rows are formed."""

    __slots__ = ("squeezed",)

    def __init__(
        self, fn: Callable[[Tensor], Tensor], z: Tensor, name: str, nr: int,
        dims: tuple[int, ...], squeezed: bool,
    ) -> None:
        super().__init__(fn, z, name, nr, dims, len(dims))
        self.squeezed = squeezed

    def push(self, bp: Any, exts: list, grad_a: Tensor, node: Any) -> None:
        if self.squeezed:
            assert isinstance(self.dim, tuple)
            for d in self.dim:  # (ascending)
                grad_a = grad_a.unsqueeze(d)
        super().push(bp, exts, grad_a, node)


def _reduction_site(
    func: Any, name: str, args: tuple, kwargs: dict, out: Tensor
) -> ReductionSite | None:
    """The :class:`ReductionSite` of ``out = func(z, ...)`` reducing axes of ``z``, or ``None``
    (refused as before): ``dim`` one axis or several (not all), ``out`` of ``z``'s shape
    without them (or with them of size 1), a norm of order 2."""
    z = args[0] if args else None
    if not isinstance(z, Tensor) or not z.requires_grad or z.dim() == 0 or out is z:
        return None
    dim_at, keep_at, order_at, order_name = _REDUCTIONS[name]

    def arg(pos: int, key: str, default: Any) -> Any:
        return args[pos] if len(args) > pos else kwargs.get(key, default)

    if order_name and arg(order_at, order_name, 2) not in (2, 2.0, "fro", None):
        return None  # (a norm of another order: not smooth, or not one the tests cover)
    dim = arg(dim_at, "dim", None)
    if name in ("var", "std") and isinstance(dim, bool):
        return None  # (var(x, unbiased): every element, across the samples)
    dims_given = (dim,) if isinstance(dim, int) else dim
    if not isinstance(dims_given, (tuple, list)) or not dims_given or not all(
        isinstance(d, int) for d in dims_given
    ):
        return None
    dims = tuple(sorted({d % z.dim() for d in dims_given}))
    if len(dims) != len(dims_given) or len(dims) == z.dim():
        return None  # (repeated axes; every axis, across the samples)
    keep = bool(arg(keep_at, "keepdim", False))
    shape = [1 if d in dims else s for d, s in enumerate(z.shape)] if keep else [
        s for d, s in enumerate(z.shape) if d not in dims
    ]
    if list(out.shape) != shape:
        return None
    rest = tuple(a.detach() if isinstance(a, Tensor) else a for a in args[1:])
    kw = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}

    def fn(zz: Tensor) -> Tensor:
        a = func(zz, *rest, **kw)
        if not keep:
            for d in dims:
                a = a.unsqueeze(d)
        return a

    return ReductionSite(fn, z, name, out.output_nr, dims, not keep)


def _bn_training(args: tuple, kwargs: dict) -> bool:
    if "training" in kwargs:
        return bool(kwargs["training"])
    return bool(args[5]) if len(args) > 5 else False


def recording_enabled() -> bool:
    """The global setting of :func:`record_nonlinearities`."""
    return _RECORDING[0]


#: ``Tensor.__dict__`` key marking parameters whose models record their nonlinearities in
#: every forward (:func:`want_residuals`)
_WANTED = "_backprism_residual"


def want_residuals(params: Iterable[Tensor]) -> None:
    """Have the models holding ``params`` record the nonlinearities of every later forward
    outside ``collect()`` (a DiagHessian-family extension used them, or a monitor plans one).
    Other models' forwards run without the forward mode once their first forward showed that
    only such records would need it (``engine.functional``): a DiagHessian-family backward
    through one of those refuses once and records from the next forward on."""
    for p in params:
        p.__dict__[_WANTED] = True


def residuals_wanted(module: nn.Module) -> bool:
    """Whether :func:`want_residuals` marked a parameter of ``module``."""
    return any(p.__dict__.get(_WANTED, False) for p in module.parameters())


def recording_wanted() -> bool:
    """Whether this top-level forward must record nonlinearities: recording is on, and the
    forward runs outside any ``collect()`` (its backward may ask for DiagHessian) or inside one
    that holds a DiagHessian-family extension."""
    if not _RECORDING[0]:
        return False
    ctx = active()
    return ctx is None or any(e.needs_residual for e in ctx.second)


def activation_forward_hook(module: nn.Module, args: tuple, output: Any) -> None:
    """Forward hook of activation modules: records ``a = module(z)`` when the recording mode is
    not active (a sub-module called on its own); otherwise the mode saw its functional call."""
    if FORWARD.recording:
        # the mode recorded the module's operation; without the mode this hook records it, so
        # it is no reason to keep the mode for this model (engine.functional)
        fn = getattr(output, "grad_fn", None)
        if fn is not None:
            sites = fn.metadata.get(SITES, ()) if fn.metadata else ()
            mine = sum(isinstance(x, ResidualSite) for x in sites)
            FORWARD.acted -= mine
            FORWARD.residual_acts -= mine
        return
    if not _RECORDING[0] or FORWARD.suspended or not torch.is_grad_enabled():
        return
    if FORWARD.unrecorded:  # inside a forward deliberately not recorded
        return
    if not args or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
        return
    z = args[0]
    if not z.requires_grad or not output.requires_grad:
        return
    if output is z:
        fn = None
        if getattr(module, "inplace", None) is True:
            copy = _copy.copy(module)  # (an activation: no parameters, no state)
            copy.inplace = False
            fn = copy.forward
        _add_in_place(output, fn, type(module).__name__)
        return
    _add_residual(output, module.forward, z, type(module).__name__)


_backward.RESIDUAL_CHECK[0] = check_pass
