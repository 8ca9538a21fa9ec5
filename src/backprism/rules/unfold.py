r"""Shared machinery of the convolution rules: unfolding the input and the per-sample algebra.

Both convolution and transpose convolution are, per group, a matrix product with an *unfolded*
input. With ``G`` groups, ``O = C_out/G`` output channels per group, ``I = (C_in/G)·K`` unfolded
input features per group (``K`` kernel elements) and ``L`` output positions,

.. math::  \mathrm{out}[n, g, o, l] = Σ_i W[g, o, i]\, X[n, g, i, l] (+ b[g, o]),

so that the per-sample, per-column weight gradient for columns ``g_{mn}`` (``[M, N, C_out, *S]``)
is ``V_{mn} = g_{mn} X_nᵀ`` (``[G, O, I]`` per sample) and the bias gradient ``Σ_l g_{mnl}``.
The statistics follow:

* ``Σₙ V_{mn}`` (the ordinary gradient for ``M = 1``) — PyTorch's own convolution weight
  gradient per column (``aten.convolution_backward``, no unfolding), or, for free, from cached
  per-sample gradients or the chunks :meth:`UnfoldRule.sum_squared` already built;
* ``Σ_{mn} w_{mn} V_{mn}²`` and ``Σ_m w_{mn} V_{mn}²`` — ``V`` materialised in sample chunks of
  at most :data:`CHUNK_ELEMENTS` entries (no closed form with spatial positions), squared per
  column and reduced over ``(m, n)`` by one matrix-vector product;
* ``Σ_m ‖V_{mn}‖² = Σ_{l,l'} (Σ_m g_{mnl}ᵀ g_{mnl'})(X_{nl}ᵀ X_{nl'})`` (Gram form, cost
  ``N L² (M O + I)``) or by materialising ``V`` (cost ``N M O I L``), whichever is cheaper;
* ``Σ_m ⟨V_{mn}, V_{mk}⟩`` from the materialised ``V``.

Kronecker factors (BackPACK's convention):
``A = (1/N) Σ_{n,l} X_{nl} X_{nl}ᵀ`` (``[I, I]``) and ``B = Σ_{m,n} (Σ_l g_{mnl})(Σ_l g_{mnl})ᵀ``
(``[C_out, C_out]``, the exact/MC GGN of the bias; the ``1/N`` of a mean loss sits in ``g``).
The bias gets ``[B]``. A grouped convolution's weight (``G > 1``, e.g. depthwise) has a
block-diagonal curvature over its groups; its factors carry a leading group axis,
``[B_g, A_g]`` of shapes ``[G, O, O]`` and ``[G, I, I]`` (``B_g`` the diagonal blocks of ``B``),
and the block of group ``g`` is ``≈ B_g[g] ⊗ A_g[g]``. Transpose convolutions: ``groups = 1``.

The unfolded input of the most recent call is cached (weakly keyed on the call, one entry), so
that several extensions of one backward step unfold once; the per-sample gradients computed by
:meth:`per_sample` are reused by the other statistics for the same columns tensor.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism.engine.gram import gram
from backprism.engine.rule import Call, Outer, Rule

__all__ = ["UnfoldRule", "unfold_conv", "unfold_conv_transpose"]

#: elements of a materialised per-sample chunk ``[M, n, G, O, I]`` (or Gram chunk) at once
CHUNK_ELEMENTS = 2**22


def _patch_view(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[tuple[int, int]],
    padding_mode: str,
) -> Tensor:
    """The patches of ``x`` as a view (no copy but the padding): ``[N, C, *L_shape, *k]``."""
    return windows(padded_input(x, padding, padding_mode), kernel_size, stride, dilation)


def padded_input(
    x: Tensor, padding: Sequence[tuple[int, int]], padding_mode: str
) -> Tensor:
    """``x`` (``[N, C, *S]``) padded by ``(left, right)`` per spatial axis in ``padding_mode``."""
    if any(p for pair in padding for p in pair):
        pad = [p for pair in reversed(padding) for p in pair]
        mode = "constant" if padding_mode == "zeros" else padding_mode
        x = F.pad(x, pad, mode=mode)
    return x


def windows(
    x: Tensor, kernel_size: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> Tensor:
    """The windows of axes ``2 … 2+d−1`` of ``x`` (already padded) as a view:
    ``[A, B, *L_shape, *rest, *k]`` (``rest``: trailing axes after the spatial ones)."""
    d = len(kernel_size)
    v = x
    for i in range(d):
        v = v.unfold(2 + i, dilation[i] * (kernel_size[i] - 1) + 1, stride[i])
    if any(dl != 1 for dl in dilation):
        v = v[(..., *(slice(None, None, dl) for dl in dilation))]
    return v


def unfold_conv(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[tuple[int, int]],
    padding_mode: str = "zeros",
) -> Tensor:
    """Unfold ``x`` (``[N, C, *S]``) into the patches a convolution sees: ``[N, C, K, L]``.

    ``X[n, c, κ, l] = x̃[n, c, s·l + d·κ]`` with ``x̃`` the input padded by ``padding``
    (``(left, right)`` per spatial axis) in ``padding_mode`` (``"zeros"``, ``"reflect"``,
    ``"replicate"``, ``"circular"``), ``K = Π kernel_size`` and ``L`` the output positions.
    One copy of size ``N·C·K·L`` is made (plus the padded input).
    """
    d = len(kernel_size)
    n, c = x.shape[:2]
    v = _patch_view(x, kernel_size, stride, dilation, padding, padding_mode)
    out_size = v.shape[2 : 2 + d]
    v = v.permute(0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d))
    return v.reshape(n, c, math.prod(kernel_size), math.prod(out_size))


def unfold_conv_rows(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[tuple[int, int]],
    padding_mode: str = "zeros",
) -> Tensor:
    """The same patches as :func:`unfold_conv` with the features first: ``[C·K, N·L]`` — the
    operand of the Kronecker input factor ``X Xᵀ``, in one copy (not an unfold and a
    transposed copy of it). Row ``c·K + κ`` holds ``x̃[n, c, s·l + d·κ]`` for every sample and
    output position ``(n, l)``, in an order that ``X Xᵀ`` does not see: sample-major
    (``n·L + l``), or position-major (``l·N + n``) where the last output axis is short
    (fewer than 16 positions, more than one in all): then the copy reads runs of ``N``
    samples from the padded input laid out samples-last (one more copy, ``1/K`` of the
    unfold's size) instead of runs of a few positions — ConvNeXt's 7×7 depthwise stages at
    ``N = 32``: 3.9 → 0.8 ms on 2×2 maps, 1.5 → 0.6 ms on 8×8 (CPU, 2 threads)."""
    d = len(kernel_size)
    n, c = x.shape[:2]
    xp = padded_input(x, padding, padding_mode)
    v = windows(xp, kernel_size, stride, dilation)
    out_size = v.shape[2 : 2 + d]
    k, length = math.prod(kernel_size), math.prod(out_size)
    if out_size[-1] < 16 and length > 1:
        xt = xp.movedim(0, -1).contiguous()  # [C, *S̃, N]
        v = windows(xt.unsqueeze(0), kernel_size, stride, dilation)[0]  # [C, *L, N, *k]
        v = v.permute(0, *range(2 + d, 2 + 2 * d), *range(1, 2 + d))
        return v.reshape(c * k, length * n)
    v = v.permute(1, *range(2 + d, 2 + 2 * d), 0, *range(2, 2 + d))
    return v.reshape(c * k, n * length)


def unfold_conv_transpose(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    out_size: Sequence[int],
) -> Tensor:
    """Unfold the input of a transpose convolution: ``[N, C, *S] → [N, C, K, L_out]``.

    ``X[n, c, κ, t] = x[n, c, j]`` where ``t = s·j + d·κ − p`` (zero where no ``j`` fits), so
    that ``out[n, o, t] = Σ_{c,κ} W[c, o, κ] X[n, c, κ, t]``. ``out_size`` is the spatial output
    shape (it fixes ``output_padding`` / ``output_size``). Built by ``K`` strided copies.
    """
    d = len(kernel_size)
    n, c, *size = x.shape
    out = x.new_zeros(n, c, *kernel_size, *out_size)
    for kappa in itertools.product(*(range(k) for k in kernel_size)):
        src: list[slice] = [slice(None), slice(None)]
        dst: list[int | slice] = [slice(None), slice(None), *kappa]
        for i in range(d):
            s, off = stride[i], kappa[i] * dilation[i] - padding[i]
            lo = max(0, (-off + s - 1) // s)
            hi = min(size[i] - 1, (out_size[i] - 1 - off) // s)
            if lo > hi:
                break
            src.append(slice(lo, hi + 1))
            dst.append(slice(lo * s + off, hi * s + off + 1, s))
        else:
            out[tuple(dst)] = x[tuple(src)]
    return out.reshape(n, c, math.prod(kernel_size), math.prod(out_size))


def _one_entry(
    cache: weakref.WeakKeyDictionary[Call, Tensor], call: Call, make: Callable[[Call], Tensor]
) -> Tensor:
    """``cache[call]``, made (and the only entry) if missing."""
    x = cache.get(call)
    if x is None:
        cache.clear()
        x = make(call)
        cache[call] = x
    return x


class _UnfoldCache:
    """One entry each: the unfolded input of the latest call (features first, and positions
    first), and ``per_sample``'s result for the latest columns tensor. Weakly keyed, so nothing
    outlives the call / columns."""

    def __init__(self) -> None:
        self._x: weakref.WeakKeyDictionary[Call, Tensor] = weakref.WeakKeyDictionary()
        self._xp: weakref.WeakKeyDictionary[Call, Tensor] = weakref.WeakKeyDictionary()
        self._v: weakref.WeakKeyDictionary[Call, tuple[weakref.ref[Tensor], Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    def peek(self, call: Call) -> Tensor | None:
        """The call's unfolded input if it is cached, else ``None``."""
        return self._x.get(call)

    def unfolded(self, call: Call, make: Callable[[Call], Tensor]) -> Tensor:
        return _one_entry(self._x, call, make)

    def positions_first(self, call: Call, make: Callable[[Call], Tensor]) -> Tensor:
        return _one_entry(self._xp, call, make)

    def get_v(self, call: Call, g: Tensor) -> Tensor | None:
        hit = self._v.get(call)
        return hit[1] if hit is not None and hit[0]() is g else None

    def set_v(self, call: Call, g: Tensor, v: Tensor) -> None:
        self._v.clear()
        self._v[call] = (weakref.ref(g), v)


def pair_form_cheaper(m: int, length: int) -> bool:
    """Whether ``Σ_{m,n} V_{mn}²`` is cheaper by pairs of output positions
    (:meth:`UnfoldRule._squares_by_pairs`: one product over ``N·L(L+1)/2`` terms, no ``V``)
    than by materialising ``V`` (``M·L`` multiply-adds per entry of ``[M, N, O, I]`` plus
    memory-bound squares and sums, weighted as four more): ``L(L+1)/2 < M (L + 4)``. Few
    positions (the last stages of a ResNet on small images: ``L = 1``, ``4``) or many
    columns (exact curvature) favour the pairs."""
    return length * (length + 1) < 2 * m * (length + 4)


def gram_form_cheaper(m: int, o: int, i: int, length: int) -> bool:
    """Whether ``Σ_m ‖V_{mn}‖²`` is cheaper in the Gram form (``L²(M·O + I)`` multiply-adds
    per sample) than by materialising ``V`` (``M·O·I·L``)."""
    return length * length * (m * o + i) < m * o * i * length


def _sample_chunks(n: int, per_sample: int) -> Iterator[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, per_sample))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


class UnfoldRule(Rule):
    """Base of the convolution rules; subclasses provide :meth:`unfold_input`,
    :meth:`to_param` and :meth:`weight_grad` (and set :attr:`n_spatial`)."""

    #: number of spatial axes (1, 2, 3)
    n_spatial: int = 2
    #: whether the weight has the transpose convolution's layout ``[C_in, C_out/G, *k]``
    transposed: bool = False

    def __init__(self) -> None:
        self._cache = _UnfoldCache()

    # -- to be provided by subclasses ----------------------------------------------------
    def unfold_input(self, call: Call) -> Tensor:
        """The unfolded input ``[N, C_in, K, L]``."""
        raise NotImplementedError

    def unfold_rows(self, call: Call) -> Tensor:
        """The unfolded input with the features first, ``[C_in·K, N·L]`` (rows ``c·K + κ``):
        here a transposed copy of :meth:`_x`; convolutions unfold into it directly."""
        x = self._x(call)  # [N, G, I, L]
        return x.permute(1, 2, 0, 3).reshape(x.shape[1] * x.shape[2], -1)

    def to_param(self, call: Call, v: Tensor) -> Tensor:
        """Reshape ``[..., G, O, I]`` into ``[..., *weight.shape]``."""
        raise NotImplementedError

    # -- shared helpers ------------------------------------------------------------------
    def check_call(self, call: Call) -> None:
        x = call.input
        name = type(call.module).__name__
        if x.dim() != self.n_spatial + 2:
            raise ValueError(
                f"backprism: {name} was called with an input of shape {tuple(x.shape)}; "
                f"per-sample quantities need a batch axis ([N, C, {self.n_spatial} spatial "
                "axes]). Call the module on x.unsqueeze(0) for a single sample."
            )

    def _x(self, call: Call) -> Tensor:
        """Unfolded input grouped: ``[N, G, I, L]`` (cached)."""

        def make(c: Call) -> Tensor:
            self.check_call(c)
            x = self.unfold_input(c)
            n, cin, k, length = x.shape
            groups = c.module.groups
            out_len = math.prod(c.out_shapes[0][2:])
            if length != out_len:
                raise RuntimeError(
                    f"backprism: unfolding the input of {type(c.module).__name__} gave {length} "
                    f"output positions, but its output has {out_len}"
                )
            return x.reshape(n, groups, (cin // groups) * k, length)

        return self._cache.unfolded(call, make)

    def positions_first(self, call: Call) -> bool:
        """Whether :meth:`unfold_positions` serves ``call`` (faster than :meth:`unfold_input`
        there); ``False`` here."""
        return False

    def unfold_positions(self, call: Call) -> Tensor:
        """The unfolded input of a one-group call with the positions first and the features
        last, ``[N, L, I]``, the features in the order ``(κ, c)`` (kernel element major,
        channel minor; the weight's is ``(c, κ)``): for the per-sample norms (``batch_l2``),
        which do not see the order of the features, where :meth:`positions_first`."""
        raise NotImplementedError

    def _xp(self, call: Call) -> Tensor | None:
        """:meth:`unfold_positions` (cached) where :meth:`positions_first`, else ``None``; also
        ``None`` when the features-first unfold is cached already (it serves as well, without
        another copy)."""
        if self._cache.peek(call) is not None or not self.positions_first(call):
            return None
        return self._cache.positions_first(call, self.unfold_positions)

    def _g(self, call: Call, g: Tensor) -> Tensor:
        """Columns grouped: ``[M, N, G, O, L]``."""
        m, n, cout = g.shape[:3]
        groups = call.module.groups
        return g.reshape(m, n, groups, cout // groups, -1)

    def _in_features(self, call: Call) -> int:
        """``I = (C_in/G)·K``, the unfolded input features per group (without unfolding)."""
        return call.input.shape[1] // call.module.groups * math.prod(call.module.kernel_size)

    def _samples(self, call: Call, g5: Tensor, sl: slice) -> Tensor:
        """``V`` for the samples ``sl``: ``[M, n, G, O, I]`` (from the unfolded input)."""
        return self._vmat(g5[:, sl], self._x(call)[sl])

    @staticmethod
    def _vp(g5: Tensor, xp: Tensor, sl: slice) -> Tensor:
        """``V`` for the samples ``sl`` from :meth:`unfold_positions` (one group): ``[M, n, 1,
        O, I]``, the input features in its ``(κ, c)`` order."""
        x = xp[sl]
        return torch.stack([torch.bmm(gm[:, 0], x) for gm in g5[:, sl]]).unsqueeze(2)

    @staticmethod
    def _vmat(g5: Tensor, x: Tensor) -> Tensor:
        """``V = g Xᵀ``: ``[M, n, G, O, L] × [n, G, I, L] → [M, n, G, O, I]``."""
        if g5.shape[0] == 1:
            return torch.matmul(g5[0], x.transpose(-1, -2)).unsqueeze(0)
        return torch.einsum("mngol,ngil->mngoi", g5, x)

    @staticmethod
    def _has_bias(call: Call) -> bool:
        return call.module.bias is not None and "bias" in call.params

    @staticmethod
    def _has_weight(call: Call) -> bool:
        return "weight" in call.params

    def _bias_cols(self, g: Tensor) -> Tensor:
        """Per-sample bias gradients ``Σ_l g_{mnl}``: ``[M, N, C_out]``."""
        return g.flatten(3).sum(-1)

    # -- rule methods --------------------------------------------------------------------
    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if self._has_weight(call):
            v = self._cache.get_v(call, g)
            if v is None:
                v = self.to_param(call, self._samples(call, self._g(call, g), slice(None)))
                self._cache.set_v(call, g, v)
            out["weight"] = v
        if self._has_bias(call):
            out["bias"] = self._bias_cols(g)
        return out

    def weight_grad(self, call: Call, g: Tensor) -> Tensor:
        """``Σₙ gₙ Xₙᵀ`` for one column ``g`` (``[N, C_out, *S]``) in the weight's layout, by
        PyTorch's own convolution weight gradient (no unfolding)."""
        raise NotImplementedError

    def summed(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if self._has_weight(call):
            v = self._cache.get_v(call, g)
            if v is not None:
                out["weight"] = v.sum(1)
            else:
                self.check_call(call)
                out["weight"] = torch.stack([self.weight_grad(call, gm) for gm in g])
        if self._has_bias(call):
            out["bias"] = g.flatten(3).sum((1, 3))
        return out

    def _squares(
        self, call: Call, g: Tensor, weights: Tensor | None, keep_batch: bool
    ) -> Tensor:
        """``Σ_m w_{mn} V_{mn}²`` summed over ``n`` unless ``keep_batch`` (``[G, O, I]`` layout
        or, from the cache, the parameter layout)."""
        v = self._cache.get_v(call, g)
        if v is not None:
            sq = v.square()
            if weights is not None:
                sq = sq * weights.reshape(weights.shape + (1,) * (sq.dim() - 2))
            return sq.sum(0) if keep_batch else sq.sum((0, 1))
        g5 = self._g(call, g)
        m, n, grp, o, length = g5.shape
        if not keep_batch and pair_form_cheaper(m, length):
            return self.to_param(call, self._squares_by_pairs(call, g5, weights))
        per = m * grp * o * self._in_features(call)
        parts: list[Tensor] = []
        total: Tensor | None = None
        for sl in _sample_chunks(n, per):
            v = self._samples(call, g5, sl)
            k = v.shape[1]
            flat = v.reshape(m * k, -1)
            flat.square_()
            if keep_batch:
                if weights is not None:
                    flat.mul_(weights[:, sl].reshape(-1, 1))
                parts.append(flat.reshape(m, k, -1).sum(0))
            else:
                # Σ over (m, n) as one matrix-vector product (BLAS) instead of a reduction
                wv = (
                    weights[:, sl].reshape(1, -1).to(flat.dtype)
                    if weights is not None
                    else flat.new_ones(1, m * k)
                )
                term = (wv @ flat)[0]
                total = term if total is None else total.add_(term)
        res = torch.cat(parts) if keep_batch else total
        assert res is not None
        return self.to_param(call, res.reshape(*res.shape[:-1], grp, o, -1))

    def _squares_by_pairs(self, call: Call, g5: Tensor, weights: Tensor | None) -> Tensor:
        r"""``Σ_{m,n} w_{mn} V_{mn}²`` (``[G, O, I]``) without materialising ``V``: with
        ``V_{mn}[o, i] = Σ_l g_{mnol} X_{nil}``,

        .. math:: Σ_{m,n} w_{mn} V_{mn}[o, i]^2 = Σ_n Σ_{l \le l'} c_{ll'}
            \Big(Σ_m w_{mn} g_{mnol} g_{mnol'}\Big) X_{nil} X_{nil'},
            \qquad c_{ll} = 1,\ c_{ll'} = 2,

        one matrix product per group over ``(n, l ≤ l')`` (see :func:`pair_form_cheaper`)."""
        m, n, grp, o, length = g5.shape
        x = self._x(call)  # [N, G, I, L]
        li, lj = torch.triu_indices(length, length, device=g5.device)
        coef = torch.where(li == lj, 1.0, 2.0).to(g5.dtype)
        pairs = li.numel()
        total: Tensor | None = None
        per = pairs * (m * grp * o + grp * x.shape[2])
        for sl in _sample_chunks(n, per):
            gs = g5[:, sl]
            k = gs.shape[1]
            gp = gs[..., li] * gs[..., lj]  # [M, k, G, O, P]
            if weights is not None:
                gp = gp * weights[:, sl].to(gp.dtype).reshape(m, k, 1, 1, 1)
            gp = gp.sum(0) * coef  # [k, G, O, P]
            xs = x[sl]
            xp = xs[..., li] * xs[..., lj]  # [k, G, I, P]
            a = gp.permute(1, 2, 0, 3).reshape(grp, o, k * pairs)
            b = xp.permute(1, 0, 3, 2).reshape(grp, k * pairs, -1)
            term = torch.bmm(a, b)
            total = term if total is None else total.add_(term)
        assert total is not None
        return total

    def _bias_squares(
        self, g: Tensor, weights: Tensor | None, keep_batch: bool
    ) -> Tensor:
        sq = self._bias_cols(g).square()
        if weights is not None:
            sq = sq * weights[..., None]
        return sq.sum(0) if keep_batch else sq.sum((0, 1))

    def sum_squared(
        self, call: Call, g: Tensor, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if self._has_weight(call):
            out["weight"] = self._squares(call, g, weights, keep_batch=False)
        if self._has_bias(call):
            out["bias"] = self._bias_squares(g, weights, keep_batch=False)
        return out

    def batch_sum_squared(
        self, call: Call, g: Tensor, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if self._has_weight(call):
            out["weight"] = self._squares(call, g, weights, keep_batch=True)
        if self._has_bias(call):
            out["bias"] = self._bias_squares(g, weights, keep_batch=True)
        return out

    def batch_l2(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if self._has_weight(call):
            v = self._cache.get_v(call, g)
            if v is not None:
                out["weight"] = torch.linalg.vector_norm(v.flatten(2), dim=-1).square().sum(0)
            else:
                out["weight"] = self._batch_l2_weight(call, g)
        if self._has_bias(call):
            out["bias"] = self._bias_cols(g).square().sum((0, 2))
        return out

    def _batch_l2_weight(self, call: Call, g: Tensor) -> Tensor:
        g5 = self._g(call, g)
        m, n, grp, o, length = g5.shape
        i = self._in_features(call)
        parts = []
        xp = self._xp(call)  # [N, L, I] or None
        if gram_form_cheaper(m, o, i, length):
            # [N, G, I, L] (a view of the positions-first unfold: the same products)
            x = self._x(call) if xp is None else xp.unsqueeze(1).transpose(-1, -2)
            for sl in _sample_chunks(n, grp * length * length * 2):
                gram_x = torch.matmul(x[sl].transpose(-1, -2), x[sl])  # [n, G, L, L]
                gs = g5[:, sl]
                if m == 1:
                    gram_g = torch.matmul(gs[0].transpose(-1, -2), gs[0])
                else:
                    gram_g = torch.einsum("mngol,mngok->ngkl", gs, gs)
                parts.append((gram_x * gram_g).sum((1, 2, 3)))
        else:
            for sl in _sample_chunks(n, m * grp * o * i):
                v = self._samples(call, g5, sl) if xp is None else self._vp(g5, xp, sl)
                k = v.shape[1]
                # fused norm: no squared temporary
                norms = torch.linalg.vector_norm(v.reshape(m, k, -1), dim=-1).square()
                parts.append(norms.sum(0))
        return torch.cat(parts)

    def batch_dot(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if self._has_weight(call):
            v = self.per_sample(call, g)["weight"].flatten(2)
            out["weight"] = torch.matmul(v, v.transpose(1, 2)).sum(0)
        if self._has_bias(call):
            b = self._bias_cols(g)
            out["bias"] = torch.matmul(b, b.transpose(1, 2)).sum(0)
        return out

    def outer_factors(self, call: Call, g: Tensor) -> dict[str, Outer]:
        """Convolutions with one group: ``Vₘₙ = Σ_l g_{mnl} X_{nl}ᵀ`` over the output positions
        (rows the columns ``g``, columns the unfolded input); the bias ``Σ_l g_{mnl} · 1``.
        Transposed and grouped convolutions have none (their weights are not one such
        matrix)."""
        if self.transposed or call.module.groups != 1:
            return {}
        rows = self._g(call, g)[:, :, 0].transpose(-1, -2)  # [M, N, L, C_out]
        out: dict[str, Outer] = {}
        if self._has_weight(call):
            x = self._x(call)[:, 0].transpose(-1, -2)  # [N, L, C_in·K]
            out["weight"] = Outer(rows, x[None], rows.shape[-1])
        if self._has_bias(call):
            ones = rows.new_ones(1, *rows.shape[1:3], 1)
            out["bias"] = Outer(rows, ones, rows.shape[-1])
        return out

    # -- Kronecker factors ---------------------------------------------------------------
    def _refuse_groups(self, call: Call) -> None:
        if call.module.groups != 1 and self.transposed:
            raise NotImplementedError(
                f"backprism: Kronecker factors (KFAC/KFLR/KFRA) of {type(call.module).__name__} "
                f"with groups={call.module.groups} are not supported (the weight's layout "
                "[C_in, C_out/G, *k] interleaves the groups' blocks). Use groups=1, or a "
                "diagonal curvature extension (DiagGGNExact/DiagGGNMC) for this layer."
            )

    def kfac_input(self, call: Call, approx: str | None = None) -> dict[str, Tensor]:
        r"""``A = (1/N) Σ_{n,l} X_{nl} X_{nl}ᵀ`` over the unfolded input, ``[I, I]``; with
        ``G > 1`` groups one factor per group, ``[G, I, I]`` (``I = (C_in/G)·K``).
        ``"expand"``: divided by the ``L`` output positions; ``"reduce"``:
        ``(1/N) Σₙ X̄ₙ X̄ₙᵀ`` of the patches averaged over the positions."""
        self._refuse_groups(call)
        if not self._has_weight(call):
            return {}
        n, groups = call.input.shape[0], call.module.groups
        length = math.prod(call.out_shapes[0][2:])
        if approx == "reduce" and length > 1:
            xm = self._x(call).mean(-1).transpose(0, 1)  # [G, N, I]
            a = gram(xm.transpose(1, 2), n)  # [G, I, I]
            return {"weight": a[0] if groups == 1 else a}
        rows = self.unfold_rows(call)  # [C_in·K, N·L]
        scale = n * length if approx == "expand" else n
        if groups == 1:
            return {"weight": gram(rows, scale)}
        return {"weight": gram(rows.reshape(groups, -1, rows.shape[-1]), scale)}  # [G, I, I]

    def kfac_output(
        self, call: Call, g: Tensor, approx: str | None = None
    ) -> dict[str, Tensor]:
        r"""``B = Σ_{m,n} (Σ_l g_{mnl})(Σ_l g_{mnl})ᵀ``, ``[C_out, C_out]`` (BackPACK): the
        bias's factor; with ``G > 1`` groups the weight's factor is its diagonal blocks,
        ``[G, O, O]`` (``O = C_out/G``), as the weight's curvature is block-diagonal over the
        groups (``B[g] ⊗ A[g]`` approximates the block of group ``g``). ``"expand"``:
        ``Σ_{m,n,l} g_{mnl} g_{mnl}ᵀ``, for the bias too."""
        self._refuse_groups(call)
        if approx == "expand":  # [M·N·L, C_out]
            b = g.flatten(3).transpose(2, 3).reshape(-1, g.shape[2])
        else:
            b = self._bias_cols(g).flatten(0, 1)  # [M·N, C_out]
        out = {}
        groups = call.module.groups
        if self._has_weight(call):
            if groups == 1:
                out["weight"] = gram(b.t())
            else:
                bg = b.reshape(b.shape[0], groups, -1).transpose(0, 1)  # [G, M·N, O]
                out["weight"] = gram(bg.transpose(1, 2))
        if self._has_bias(call):
            out["bias"] = out["weight"] if groups == 1 and "weight" in out else gram(b.t())
        return out


def conv_padding(module: nn.Module) -> list[tuple[int, int]]:
    """``(left, right)`` padding per spatial axis of a ``ConvNd`` (``'same'``: the extra
    element goes to the right, as in PyTorch)."""
    pad = module.padding
    if isinstance(pad, str):
        if pad == "valid":
            return [(0, 0)] * len(module.kernel_size)
        out = []
        for d, k in zip(module.dilation, module.kernel_size):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return out
    return [(p, p) for p in pad]
