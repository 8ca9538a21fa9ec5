r"""Rule for :class:`torch.nn.MultiheadAttention`: the Linear closed forms per projection.

Every parameter of an attention layer enters through a linear projection (or as an extra key /
value position). With ``batch_first=True`` inputs ``query [N, L, E_q]``, ``key [N, S, E_k]``,
``value [N, S, E_v]``, ``H`` heads of width ``d = E/H`` and ``scale = 1/√d``:

.. math::

    q = \mathrm{query}\,W_q^⊤ + b_q,\quad k = \mathrm{key}\,W_k^⊤ + b_k,\quad
    v = \mathrm{value}\,W_v^⊤ + b_v \quad(\text{then } k, v \text{ get } b_{k}^{kv}, b_{v}^{kv}
    \text{ appended as one more position with } \texttt{add\_bias\_kv}),

    P = \mathrm{softmax}(q_h k_h^⊤ \cdot \mathrm{scale} + \mathrm{mask}),\quad
    o = \mathrm{concat}_h(P v_h),\quad \mathrm{out} = o W_o^⊤ + b_o .

So every weight gradient is a Linear layer's gradient with a sequence axis,
``Vₘₙ(W) = Σₜ δₘₙₜ xₙₜᵀ`` (``x`` the projection's input, ``δ`` the gradient at its output), and
all statistics come from :class:`~backprism.rules.linear.LinearRule`'s closed forms (the Gram
form ``‖Vₘₙ‖² = Σₜₛ ⟨δₘₙₜ, δₘₙₛ⟩⟨xₙₜ, xₙₛ⟩`` for ``batch_l2``, ``batch_dot``; BLAS products for
the rest) — no per-sample ``vmap`` of the module. What the rule needs per call:

* the projections' inputs: ``query``, ``key``, ``value`` (recorded) and the attention output
  ``o`` before ``out_proj`` (recomputed once per call from the recorded inputs);
* the gradients at the projections' outputs for the columns ``g`` (``[M, N, L, E]``, plus the
  attention weights' columns when ``need_weights=True``), by one batched backward pass of the
  attention core written out (no autograd graph; ``M`` broadcast over the recorded ``P``):

  .. math::

      δo = g W_o,\quad δv_h = P^⊤ δo_h,\quad δP = δo_h v_h^⊤ (+ \text{weights' columns}),

      δS = P ⊙ (δP − \mathrm{rowsum}(δP ⊙ P)),\quad δq_h = δS\,k_h\,\mathrm{scale},\quad
      δk_h = δS^⊤ q_h\,\mathrm{scale}.

Parameters, keyed like :attr:`~backprism.engine.state.Call.params`: ``out_proj.weight`` /
``out_proj.bias`` (input ``o``, gradient ``g``); the packed ``in_proj_weight`` ``[3E, E]`` /
``in_proj_bias`` — for self-attention (``query``, ``key``, ``value`` the same tensor) one Linear
with gradient ``[δq, δk, δv]`` concatenated along features, otherwise three row blocks whose
results are concatenated (sums for ``batch_l2`` / ``batch_dot``); ``q_proj_weight``,
``k_proj_weight``, ``v_proj_weight`` (``kdim``/``vdim`` ≠ ``embed_dim``); ``bias_k`` / ``bias_v``
(``add_bias_kv``): the gradient at the appended key / value position, ``[1, 1, E]`` per sample.
Masks (``attn_mask`` 2-d or per-sample 3-d, ``key_padding_mask``, bool or float), ``is_causal``,
``add_zero_attn`` and ``need_weights`` / ``average_attn_weights`` follow
``F.multi_head_attention_forward`` exactly.

Kronecker factors: the Linear rule's, per projection. The packed ``in_proj_weight`` of
cross-attention has three different inputs, so it is no single Kronecker product: it is taken
block-diagonal over the query, key and value rows, ``[B_g, A_g]`` stacked ``[3, E, E]`` as a
grouped convolution's (:meth:`MultiheadAttentionRule.kronecker_factors`); ``bias_k``/``bias_v``
get ``[B]``, ``B = Σₘₙ δₘₙ δₘₙᵀ`` at their position.

The module is not linear in its parameters (``W_q``, ``W_k`` enter through the softmax), so
``linear_in_params`` is ``False``.

**Self-attention with the packed projection** (``query is key is value``, no
``bias_k``/``add_zero_attn``, ``batch_first`` either way — every
``TransformerEncoderLayer``/``DecoderLayer`` self-attention, with its defaults too)
takes a shorter way (:meth:`MultiheadAttentionRule.inside`): the extended forward runs
:func:`_self_attention_forward`, PyTorch's own sequence of operations written out, so that the
forward mode sees ``F.linear(query, in_proj_weight, in_proj_bias)`` and captures it as a Linear
call of its own (the attention call *releases* those parameters), and keeps ``o``, the input of
``out_proj``. The real backward pass then delivers ``[δq, δk, δv]`` at the projection's output
— masks, causal attention, returned weights, the fused kernels and **dropout in train mode**
included — and nothing is recomputed. Other configurations (cross-attention, ``kdim``/``vdim``,
``bias_k``, ``add_zero_attn``) recompute the forward as above; there, dropout in train mode and
``batch_first=False`` or unbatched input go to the generic ``torch.func`` rule this class
derives from (which explains its refusals).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism.engine.gram import gram
from backprism.engine.rule import Call, Rule, register_rule
from backprism.engine.state import AXIS, FORWARD, Inside
from backprism.rules.generic import GenericRule
from backprism.rules.linear import LinearRule, linear_shell

__all__ = ["MultiheadAttentionRule"]

_LINEAR = LinearRule()
#: rule methods whose per-parameter results are concatenated along the output-feature axis for
#: row blocks of one packed parameter (axis of the result), and those that are summed
_CAT_AXIS = {"per_sample": 2, "summed": 1, "sum_squared": 0, "batch_sum_squared": 1}
_SUMMED = frozenset({"batch_l2", "batch_dot"})
_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _self_attention_forward(
    mode: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    training: bool = True,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    static_k: Tensor | None = None,
    static_v: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> Any:
    """``F.multi_head_attention_forward`` for batched self-attention with the packed input
    projection (``query is key is value``, ``[L, N, E]``; no ``bias_k``/``bias_v``,
    ``add_zero_attn``, static keys/values) — PyTorch's own sequence of operations, written
    out. ``mode.call`` (the forward mode's, or a direct attribution outside the mode) runs
    the input projection ``F.linear(query, W, b)`` — a Linear call of its own —,
    ``out_proj``'s ``F.linear`` (whose input is kept) and the attention kernel (which the mode
    may route to the math kernel); the rest runs without its per-operation cost.
    ``NotImplemented`` for every other configuration (the function then runs as one
    operation)."""
    if (
        query is not key
        or key is not value
        or query.dim() != 3
        or in_proj_weight is None
        or bias_k is not None
        or bias_v is not None
        or add_zero_attn
        or use_separate_proj_weight
        or static_k is not None
        or static_v is not None
    ):
        return NotImplemented
    F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    tgt_len, bsz, embed_dim = query.shape
    src_len = tgt_len
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
            "module method `generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA's is_causal instead
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
            target_type=query.dtype, check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False
    if embed_dim != embed_dim_to_check:
        raise AssertionError(
            f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}"
        )
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
    # the packed projection: one F.linear (a Linear call of its own, the batch on axis 1 of
    # its input), split as PyTorch splits it
    setattr(query, AXIS, 1)
    proj = mode.call(F.linear, query, in_proj_weight, in_proj_bias)
    proj = proj.unflatten(-1, (3, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2)
    # unbind, not three selects (PyTorch's proj[0], proj[1], proj[2]): the same views, whose
    # backward stacks the three gradients instead of zero-filling and adding three [3, L, N, E]
    # buffers
    q, k, v = proj.contiguous().unbind(0)
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                    f"{(tgt_len, src_len)}."
                )
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                    f"{(bsz * num_heads, tgt_len, src_len)}."
                )
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    src_len = k.size(1)
    if key_padding_mask is not None:
        check = getattr(F, "_check_key_padding_mask", None)
        if check is not None:
            check(key_padding_mask, src_len, bsz)
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len)
            .expand(-1, num_heads, -1, -1)
            .reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    if not training:
        dropout_p = 0.0
    if need_weights:
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v)
        out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        out = mode.call(F.linear, out, out_proj_weight, out_proj_bias)
        out = out.view(tgt_len, bsz, out.size(1))
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return _batch_axes(out, 1), _batch_axes(weights, 0)
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    out = mode.call(F.scaled_dot_product_attention, q, k, v, attn_mask, dropout_p, is_causal)
    del q, k, v
    out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = mode.call(F.linear, out, out_proj_weight, out_proj_bias)
    return _batch_axes(out.view(tgt_len, bsz, out.size(1)), 1), None


def _batch_axes(t: Tensor, axis: int) -> Tensor:
    """Mark ``t``'s batch axis where the forward follows it (after a ``batch_first=False``
    RNN): as for the function run as one operation."""
    if FORWARD.layouts:
        setattr(t, AXIS, axis)
    return t


_NOTHING = Inside()
_RELEASE = Inside(
    release=("in_proj_weight", "in_proj_bias"),
    keep=("out_proj.weight",),
    functions={"multi_head_attention_forward": _self_attention_forward},
)


class _Fixed(Rule):
    """The :class:`Rule` defaults applied to given dense per-sample gradients."""

    def __init__(self, dense: dict[str, Tensor]) -> None:
        self.dense = dense

    def per_sample(self, call: Call, g: Any) -> dict[str, Tensor]:
        return self.dense


@dataclass
class _Piece:
    """One Linear sub-problem: ``x`` ``[N, T, I]``, columns ``g`` ``[M, N, T, O]`` and the
    parameter names its weight / bias results go to (``None``: not wanted)."""

    call: Call
    g: Tensor
    weight: str | None
    bias: str | None
    rows: slice | None = None  # row block of a packed parameter


@dataclass
class _Pieces:
    linear: list[_Piece] = field(default_factory=list)
    #: small parameters as dense per-sample gradients ``[M, N, *p]`` (``bias_k``, ``bias_v``)
    dense: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class _Forward:
    """What one call's attention core needs, recomputed from the recorded inputs."""

    query: Tensor  # [N, L, E_q]
    key: Tensor  # [N, S, E_k]
    value: Tensor  # [N, S, E_v]
    self_attention: bool
    qh: Tensor  # [N, H, L, d], already multiplied by scale
    kh: Tensor  # [N, H, S2, d]  (S2 = S + bias_kv + zero_attn)
    vh: Tensor  # [N, H, S2, d]
    probs: Tensor  # [N, H, L, S2]
    o: Tensor  # [N, L, E], the input of out_proj
    src: int  # S
    need_weights: bool
    average: bool


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``F._canonical_mask``: a boolean mask becomes ``-inf`` where ``True``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf")
        )
    return mask.to(dtype)


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(GenericRule):
    """Linear closed forms per projection (see the module docstring); unsupported
    configurations take the generic ``torch.func`` path of :class:`GenericRule`."""

    linear_in_params = False
    folds_rows = False  # (its closed forms compute per row; a folded batch sums rows)

    def __init__(self) -> None:
        super().__init__()
        self._fw: tuple[weakref.ref, _Forward] | None = None
        self._bw: tuple[weakref.ref, weakref.ref, tuple, _Pieces] | None = None

    # -- what the forward attributes where the parameters enter -------------------------------
    def inside(self, module: nn.Module, args: tuple, kwargs: dict) -> Inside:
        """Self-attention with the packed projection (``TransformerEncoderLayer``'s case):
        ``in_proj_weight``/``in_proj_bias`` are released — their ``F.linear`` inside the forward
        becomes a Linear call of its own, whose output gradient ``[δq, δk, δv]`` the real
        backward pass computes (masks, dropout and the fused kernels included) — and the input
        ``o`` of ``out_proj`` is kept: no recomputed forward, no written-out attention
        backward for first-order statistics."""
        if (
            type(module) is not nn.MultiheadAttention
            or not module._qkv_same_embed_dim
            or module.bias_k is not None
            or module.in_proj_weight is None
        ):
            return _NOTHING
        query = args[0] if args else kwargs.get("query")
        key = args[1] if len(args) > 1 else kwargs.get("key")
        value = args[2] if len(args) > 2 else kwargs.get("value")
        if (
            not isinstance(query, Tensor)
            or query is not key
            or key is not value
            or query.dim() != 3
            or query.is_nested
        ):
            return _NOTHING
        return _RELEASE

    def is_linear_in_params(self, call: Call) -> bool:
        """Linear where the call released its input projection and keeps ``out_proj`` only
        (self-attention, :meth:`inside`): ``y = o W_outᵀ + b_out`` with ``o`` free of them, the
        attention before it recorded operation by operation (its kernel, the released
        projection's Linear call); otherwise ``W_q``, ``W_k`` enter through the softmax."""
        return bool(call.params) and set(call.params) <= {"out_proj.weight", "out_proj.bias"}

    def _kept_o(self, call: Call) -> Tensor | None:
        """``o`` ``[N, L, E]`` (the input of ``out_proj``) as the forward kept it, if the call
        released its input projection and the kept ``F.linear`` is the one whose output the
        module returned: ``y [L·N, E]`` viewed as ``[L, N, E]`` and transposed (the layout of
        ``F.multi_head_attention_forward``, checked through the output's storage and strides,
        so a PyTorch that lays it out otherwise takes the recomputing path)."""
        kept = call.inner
        if kept is None or not kept.outs or any(k in call.params for k in _RELEASE.release):
            return None
        rec = kept.linear.get("out_proj.weight")
        if rec is None:
            return None
        x, y_ptr, y_shape = rec
        first = call.module.batch_first
        if first:  # the output is y.view(L, N, E).transpose(0, 1)
            n, length, e = call.out_shapes[0]
            stride = (e, n * e, 1)
        else:  # the output is y.view(L, N, E)
            length, n, e = call.out_shapes[0]
            stride = (n * e, e, 1)
        out_ptr, out_stride = kept.outs[0]
        if (
            y_ptr != out_ptr
            or tuple(y_shape) != (length * n, e)
            or tuple(x.shape) != (length * n, x.shape[-1])
            or (n > 1 and length > 1 and tuple(out_stride) != stride)
        ):
            return None
        return x.view(length, n, x.shape[-1]).transpose(0, 1)

    # -- which calls take the closed forms --------------------------------------------------
    @staticmethod
    def _arguments(call: Call) -> dict[str, Any]:
        bound = _SIGNATURE.bind(call.module, *call.args, **call.kwargs)
        bound.apply_defaults()
        args = dict(bound.arguments)
        args.pop("self", None)
        return args

    def _supported(self, call: Call) -> bool:
        if call.inner is not None and self._kept_o(call) is not None:
            return True
        module = call.module
        if type(module) is not nn.MultiheadAttention or not module.batch_first:
            return False
        if call.training and module.dropout > 0:
            return False  # the generic rule refuses it with the explanation
        try:
            a = self._arguments(call)
        except TypeError:
            return False
        q, k, v = a["query"], a["key"], a["value"]
        if not all(isinstance(t, Tensor) and t.dim() == 3 and not t.is_nested for t in (q, k, v)):
            return False
        n = call.batch_size
        if q.shape[0] != n or k.shape[0] != n or v.shape[0] != n:
            return False
        # a 3-d mask must hold N·heads rows (not so for a sample subset, BatchGrad(subsampling))
        mask = a["attn_mask"]
        return not (
            isinstance(mask, Tensor) and mask.dim() == 3 and mask.shape[0] != n * module.num_heads
        )

    # -- the recomputed forward -------------------------------------------------------------
    def _forward(self, call: Call) -> _Forward:
        hit = self._fw
        if hit is not None and hit[0]() is call:
            return hit[1]
        fw = self._compute_forward(call)
        self._fw = (weakref.ref(call), fw)
        # drop it when the surrounding backward pass ends (outside one, keep it until the next)
        with contextlib.suppress(RuntimeError):
            torch.autograd.Variable._execution_engine.queue_callback(self._clear)
        return fw

    def _clear(self) -> None:
        self._fw = None
        self._bw = None

    def _compute_forward(self, call: Call) -> _Forward:
        m: nn.MultiheadAttention = call.module
        a = self._arguments(call)
        query, key, value = a["query"], a["key"], a["value"]
        n, length, e = query.shape
        src = key.shape[1]
        h = m.num_heads
        d = e // h
        dt = query.dtype
        self_attention = _same_tensor(query, key) and _same_tensor(key, value)
        bias = None if m.in_proj_bias is None else m.in_proj_bias.detach()
        bq, bk, bv = (None, None, None) if bias is None else bias.chunk(3)
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                w = m.in_proj_weight.detach()
                if self_attention:
                    qkv = F.linear(query, w, bias)
                    q, k, v = qkv.chunk(3, dim=-1)
                else:
                    wq, wk, wv = w.chunk(3)
                    q = F.linear(query, wq, bq)
                    k, v = F.linear(key, wk, bk), F.linear(value, wv, bv)
            else:
                q = F.linear(query, m.q_proj_weight.detach(), bq)
                k = F.linear(key, m.k_proj_weight.detach(), bk)
                v = F.linear(value, m.v_proj_weight.detach(), bv)
            if m.bias_k is not None and m.bias_v is not None:
                k = torch.cat([k, m.bias_k.detach().to(dt).expand(n, 1, e)], 1)
                v = torch.cat([v, m.bias_v.detach().to(dt).expand(n, 1, e)], 1)
            fused = m._qkv_same_embed_dim and self_attention
            if fused and not m.add_zero_attn and m.bias_k is None:
                # one copy into the head layout [3, N, H, L, d]
                heads = qkv.view(n, length, 3, h, d).permute(2, 0, 3, 1, 4)
                qh, kh, vh = heads.contiguous().unbind(0)
            else:
                qh, kh, vh = (
                    t.reshape(n, t.shape[1], h, d).transpose(1, 2).contiguous() for t in (q, k, v)
                )
            if m.add_zero_attn:
                zeros = kh.new_zeros(n, h, 1, d)
                kh, vh = torch.cat([kh, zeros], 2), torch.cat([vh, zeros], 2)
            mask = self._mask(call, a, n, length, kh.shape[2], dt)
            qh.mul_(1.0 / math.sqrt(d))  # q·scale, kept so (δk = δSᵀ (q·scale))
            scores = torch.matmul(qh, kh.transpose(-1, -2))
            if mask is not None:
                scores.add_(mask)
            probs = torch.softmax(scores, dim=-1)
            if mask is not None and not a["need_weights"]:
                # scaled_dot_product_attention gives rows whose keys are all masked zero
                # weights (the explicit softmax of the need_weights path gives NaN, as here)
                probs.masked_fill_((scores == float("-inf")).all(-1, keepdim=True), 0.0)
            del scores
            o = torch.matmul(probs, vh).transpose(1, 2).reshape(n, length, e)
        return _Forward(
            query=query, key=key, value=value, self_attention=self_attention, qh=qh, kh=kh,
            vh=vh, probs=probs, o=o, src=src, need_weights=bool(a["need_weights"]),
            average=bool(a["average_attn_weights"]),
        )

    @staticmethod
    def _mask(
        call: Call, a: dict[str, Any], n: int, length: int, src2: int, dt: torch.dtype
    ) -> Tensor | None:
        """The additive mask ``[N|1, H|1, L, S2]`` as ``F.multi_head_attention_forward``
        builds it (``is_causal`` without padding mask and weights: SDPA's causal mask)."""
        m: nn.MultiheadAttention = call.module
        h = m.num_heads
        kpm = _float_mask(a["key_padding_mask"], dt)
        need_weights, is_causal = bool(a["need_weights"]), bool(a["is_causal"])
        dev = a["query"].device
        if is_causal and kpm is None and not need_weights:
            keep = torch.ones(length, src2, dtype=torch.bool, device=dev).tril()
            mask = torch.zeros(length, src2, dtype=dt, device=dev)
            return mask.masked_fill_(~keep, float("-inf"))[None, None]
        am = _float_mask(a["attn_mask"], dt)
        if am is not None:
            am = am[None, None] if am.dim() == 2 else am.reshape(n, h, *am.shape[1:])
        extra = int(m.bias_k is not None) + int(m.add_zero_attn)
        if extra:
            am = None if am is None else F.pad(am, (0, extra))
            kpm = None if kpm is None else F.pad(kpm, (0, extra))
        if kpm is not None:
            kpm = kpm.reshape(n, 1, 1, src2)
            am = kpm if am is None else am + kpm
        return am

    # -- the backward of the attention core --------------------------------------------------
    def _pieces(self, call: Call, g: Any) -> _Pieces:
        first = g[0] if isinstance(g, tuple) else g
        key = _g_key(g)
        hit = self._bw
        if hit is not None and hit[0]() is call and hit[1]() is first and hit[2] == key:
            return hit[3]
        pieces = self._compute_pieces(call, g)
        self._bw = (weakref.ref(call), weakref.ref(first), key, pieces)
        return pieces

    def _compute_pieces(self, call: Call, g: Any) -> _Pieces:
        m: nn.MultiheadAttention = call.module
        params = call.params
        gs = list(g) if isinstance(g, tuple) else [g]
        g_out = gs[0]
        kept_o = self._kept_o(call)
        if kept_o is not None and not m.batch_first:  # [M, L, N, E] as the module returned it
            g_out = g_out.transpose(1, 2)
        fw = None if kept_o is not None else self._forward(call)
        o = kept_o if fw is None else fw.o
        g_w = gs[1] if len(gs) > 1 and fw is not None and fw.need_weights else None
        mcols, n, length, e = g_out.shape
        h = m.num_heads
        d = e // h
        dt = o.dtype
        g_out = g_out.to(dt)
        out = _Pieces()
        wo = m.out_proj.weight.detach()

        def name(k: str) -> str | None:
            return k if k in params else None

        def piece(x: Tensor, gp: Tensor, w: Tensor, b: Tensor | None, wn: str | None,
                  bn: str | None, rows: slice | None = None) -> None:
            if wn is None and bn is None:
                return
            shell = linear_shell(w, b if bn is not None else None)
            sub = Call(
                module=shell, args=(x,), kwargs={}, out_shapes=[torch.Size(gp.shape[1:])],
                batch_size=n, training=False,
                params={"weight": w} | ({} if bn is None or b is None else {"bias": b}),
            )
            out.linear.append(_Piece(sub, gp, wn, bn, rows))

        ob = m.out_proj.bias
        piece(o, g_out, wo, None if ob is None else ob.detach(),
              name("out_proj.weight"), name("out_proj.bias") if ob is not None else None)
        in_names = ["in_proj_weight"] if m._qkv_same_embed_dim else [
            "q_proj_weight", "k_proj_weight", "v_proj_weight"
        ]
        wanted = [k for k in (*in_names, "in_proj_bias", "bias_k", "bias_v") if k in params]
        if not wanted:
            return out
        assert fw is not None  # a released input projection is not among the call's params
        # δo = g W_o, by heads [M, N, H, L, d] (contiguous: used by two products)
        do = torch.matmul(g_out, wo).view(mcols, n, length, h, d).transpose(2, 3).contiguous()
        probs = fw.probs
        scale = 1.0 / math.sqrt(d)
        fused = (
            m._qkv_same_embed_dim and fw.self_attention and m.bias_k is None
            and not m.add_zero_attn
        )
        # fused: δq, δk, δv written into one [3, M, N, H, L, d] buffer, then one copy into
        # the feature layout [M, N, L, 3E] of the packed projection's output
        buf = do.new_empty(3, *do.shape) if fused else None
        # P [N, H, L, S2] broadcasts over the column axis (no copy for M = 1)
        dv = torch.matmul(probs.transpose(-1, -2), do, out=None if buf is None else buf[2])
        dp = torch.matmul(do, fw.vh.transpose(-1, -2))
        del do
        if g_w is not None:
            g_w = g_w.to(dt)
            dp.add_(g_w.unsqueeze(2) / h if fw.average else g_w)
        # δS = P ⊙ (δP − rowsum(δP ⊙ P)), in place on the temporary δP
        ds = dp.mul_(probs)
        ds.addcmul_(probs, ds.sum(-1, keepdim=True), value=-1.0)
        if buf is not None:
            torch.matmul(ds, fw.kh, out=buf[0]).mul_(scale)
            torch.matmul(ds.transpose(-1, -2), fw.qh, out=buf[1])  # fw.qh holds q·scale
            del ds, dp, dv
            g_in = buf.permute(1, 2, 4, 0, 3, 5).reshape(mcols, n, length, 3 * e)
            bias = None if m.in_proj_bias is None else m.in_proj_bias.detach()
            piece(fw.query, g_in, m.in_proj_weight.detach(), bias, name("in_proj_weight"),
                  name("in_proj_bias") if bias is not None else None)
            return out
        dq = torch.matmul(ds, fw.kh).mul_(scale)
        dk = torch.matmul(ds.transpose(-1, -2), fw.qh)  # fw.qh holds q·scale
        del ds, dp
        dq = dq.transpose(2, 3).reshape(mcols, n, length, e)
        src2 = fw.kh.shape[2] - int(m.add_zero_attn)  # the zero position has no parameter
        dk = dk.transpose(2, 3).reshape(mcols, n, -1, e)[:, :, :src2]
        dv = dv.transpose(2, 3).reshape(mcols, n, -1, e)[:, :, :src2]
        s = fw.src
        if m.bias_k is not None:
            for k, grad in (("bias_k", dk), ("bias_v", dv)):
                if k in params:
                    out.dense[k] = grad[:, :, s].reshape(mcols, n, *params[k].shape)
            dk, dv = dk[:, :, :s], dv[:, :, :s]
        bias = None if m.in_proj_bias is None else m.in_proj_bias.detach()
        bn = name("in_proj_bias") if bias is not None else None
        if m._qkv_same_embed_dim:
            w = m.in_proj_weight.detach()
            wn = name("in_proj_weight")
            if fw.self_attention:
                piece(fw.query, torch.cat([dq, dk, dv], -1), w, bias, wn, bn)
            else:
                for i, (x, gp) in enumerate(((fw.query, dq), (fw.key, dk), (fw.value, dv))):
                    rows = slice(i * e, (i + 1) * e)
                    piece(x, gp, w[rows], None if bias is None else bias[rows], wn, bn, rows)
        else:
            for i, (k, x, gp) in enumerate(
                (("q_proj_weight", fw.query, dq), ("k_proj_weight", fw.key, dk),
                 ("v_proj_weight", fw.value, dv))
            ):
                rows = slice(i * e, (i + 1) * e)
                w = getattr(m, k).detach()
                piece(x, gp, w, None if bias is None else bias[rows], name(k), bn, rows)
        return out

    # -- combining the pieces ----------------------------------------------------------------
    def _apply(self, method: str, call: Call, g: Any, *args: Any) -> dict[str, Tensor]:
        pieces = self._pieces(call, g)
        parts: dict[str, list[Tensor]] = {}
        for pc in pieces.linear:
            res = getattr(_LINEAR, method)(pc.call, pc.g, *args)
            for key, target in (("weight", pc.weight), ("bias", pc.bias)):
                if target is not None and key in res:
                    parts.setdefault(target, []).append(res[key])
        out: dict[str, Tensor] = {}
        for target, values in parts.items():
            if len(values) == 1:
                out[target] = values[0]
            elif method in _SUMMED:
                out[target] = torch.stack(values).sum(0)
            else:
                out[target] = torch.cat(values, _CAT_AXIS[method])
        if pieces.dense:
            out.update(getattr(_Fixed(pieces.dense), method)(call, g, *args))
        return out

    def builds_per_sample(self, call: Call) -> bool:
        return True

    def per_sample(self, call: Call, g: Any) -> dict[str, Tensor]:
        if not self._supported(call):
            return super().per_sample(call, g)
        return self._apply("per_sample", call, g)

    def summed(self, call: Call, g: Any) -> dict[str, Tensor]:
        if not self._supported(call):
            return super().summed(call, g)
        return self._apply("summed", call, g)

    def sum_squared(self, call: Call, g: Any, weights: Tensor | None = None) -> dict[str, Tensor]:
        if not self._supported(call):
            return super().sum_squared(call, g, weights)
        return self._apply("sum_squared", call, g, weights)

    def batch_sum_squared(
        self, call: Call, g: Any, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        if not self._supported(call):
            return super().batch_sum_squared(call, g, weights)
        return self._apply("batch_sum_squared", call, g, weights)

    def batch_l2(self, call: Call, g: Any) -> dict[str, Tensor]:
        if not self._supported(call):
            return super().batch_l2(call, g)
        return self._apply("batch_l2", call, g)

    def batch_dot(self, call: Call, g: Any) -> dict[str, Tensor]:
        if not self._supported(call):
            return super().batch_dot(call, g)
        return self._apply("batch_dot", call, g)

    def batch_dot_with(self, call: Call, g: Any, vectors: dict[str, Tensor]) -> dict[str, Tensor]:
        if not self._supported(call):
            return super().batch_dot_with(call, g, vectors)
        pieces = self._pieces(call, g)
        out: dict[str, Tensor] = {}
        for pc in pieces.linear:
            sub: dict[str, Tensor] = {}
            for key, target in (("weight", pc.weight), ("bias", pc.bias)):
                if target is not None and target in vectors:
                    vec = vectors[target]
                    if pc.rows is not None and vec.shape[0] == 3 * pc.g.shape[-1]:
                        vec = vec[pc.rows]
                    sub[key] = vec
            res = _LINEAR.batch_dot_with(pc.call, pc.g, sub)
            for key, target in (("weight", pc.weight), ("bias", pc.bias)):
                if target is not None and key in res:
                    out[target] = out[target] + res[key] if target in out else res[key]
        dense = {k: v for k, v in vectors.items() if k in pieces.dense}
        if dense:
            out.update(_Fixed(pieces.dense).batch_dot_with(call, g, dense))
        return out

    def kronecker_form(self, call: Call) -> bool:
        return self._supported(call)

    def kronecker_factors(
        self, call: Call, g: Any, approx: str | None = None
    ) -> dict[str, list[Tensor]]:
        """The Linear rule's factors per projection; ``bias_k``/``bias_v``: ``[B]``.

        The packed ``in_proj_weight`` of cross-attention (query, key and value not one tensor)
        has three row blocks with different inputs: block-diagonal over the projections, the
        factors stacked along a leading axis as a grouped convolution's, ``[B_g, A_g]`` of
        shapes ``[3, E, E]`` (rows ``iE … (i+1)E`` of the weight ``≈ B_g[i] ⊗ A_g[i]``,
        ``i`` = query, key, value). ``in_proj_bias`` keeps its full ``[B]`` ``[3E, 3E]`` (the
        ``B_g[i]`` are its diagonal blocks); under ``"expand"`` its blocks between two
        projections are zero (query and key positions are different tokens, so no position
        pairs them)."""
        if not self._supported(call):
            return super().kronecker_factors(call, g, approx)
        pieces = self._pieces(call, g)
        out: dict[str, list[Tensor]] = {}
        blocks: dict[str, list[list[Tensor]]] = {}
        split: dict[str, list[Tensor]] = {}  # in_proj_bias: the projections' B
        for pc in pieces.linear:
            res = _LINEAR.kronecker_factors(pc.call, pc.g, approx)
            if pc.weight is not None and "weight" in res:
                if pc.rows is not None and pc.weight == "in_proj_weight":
                    blocks.setdefault(pc.weight, []).append(list(res["weight"]))
                else:
                    out[pc.weight] = list(res["weight"])
            if pc.bias is not None and "bias" in res:
                if pc.rows is None:
                    out[pc.bias] = list(res["bias"])
                else:
                    split.setdefault(pc.bias, []).append(res["bias"][0])
        for k, fs in blocks.items():  # rows in order: query, key, value
            out[k] = [torch.stack(f) for f in zip(*fs, strict=True)]
        for k, parts in split.items():  # in_proj_bias of three projections
            if approx == "expand":  # per position, each projection over its own positions
                out[k] = [torch.block_diag(*parts)]
            else:  # B of the concatenated per-sample gradients
                f = self._apply("per_sample", call, g)[k].flatten(0, 1)
                out[k] = [gram(f.t())]
        for k, v in pieces.dense.items():
            f = v.reshape(-1, v[0, 0].numel())
            out[k] = [gram(f.t())]
        return out


def _g_key(g: Any) -> tuple:
    gs = g if isinstance(g, tuple) else (g,)
    return tuple((id(x), tuple(x.shape)) for x in gs)
