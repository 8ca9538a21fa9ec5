r"""Rules for :class:`torch.nn.Conv1d`, :class:`~torch.nn.Conv2d`, :class:`~torch.nn.Conv3d`.

Input ``x`` ``[N, C_in, *S]`` is padded as the module pads it (``padding`` as int, tuple,
``'same'`` or ``'valid'``; ``padding_mode`` zeros/reflect/replicate/circular — the convolution
sees the padded input) and unfolded into ``X`` ``[N, G, (C_in/G)·K, L]`` with
``X[n, c, κ, l] = x̃[n, c, s·l + d·κ]``. Then, per group and sample,

* weight: ``V_{mn} = g_{mn} X_nᵀ`` reshaped to ``[C_out, C_in/G, *k]``; bias: ``Σ_l g_{mnl}``;
* statistics and Kronecker factors as in :mod:`backprism.rules.unfold`:
  ``A = (1/N) Σ_{n,l} X_{nl} X_{nl}ᵀ`` (``[C_in·K, C_in·K]``) and
  ``B = Σ_{m,n} (Σ_l g_{mnl})(Σ_l g_{mnl})ᵀ`` (``[C_out, C_out]``), as BackPACK; ``groups = 1``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism.engine.rule import Call, register_rule
from backprism.rules.conv_factor import input_factor_by_shifts, shifts_cheaper
from backprism.rules.unfold import (
    UnfoldRule,
    conv_padding,
    padded_input,
    unfold_conv,
    unfold_conv_rows,
    windows,
)

__all__ = ["Conv1dRule", "Conv2dRule", "Conv3dRule"]


class _ConvRule(UnfoldRule):
    #: statistics are polynomials in the unfolded live input and the output gradient (and
    #: ``convolution_backward``, which has a derivative of its own)
    differentiable = True

    def unfold_input(self, call: Call) -> Tensor:
        mod = call.module
        return unfold_conv(
            call.input, mod.kernel_size, mod.stride, mod.dilation, conv_padding(mod),
            mod.padding_mode,
        )

    def unfold_rows(self, call: Call) -> Tensor:
        if self._cache.peek(call) is not None:  # unfolded already (first order, same pass)
            return super().unfold_rows(call)
        self.check_call(call)
        mod = call.module
        return unfold_conv_rows(
            call.input, mod.kernel_size, mod.stride, mod.dilation, conv_padding(mod),
            mod.padding_mode,
        )

    def positions_first(self, call: Call) -> bool:
        """Whether ``batch_l2`` takes :meth:`unfold_positions`: on the CPU (where it was
        measured), one group, at least 16 input channels and a short last output axis (fewer
        than 16 positions, more than one position in all), where :meth:`_samples` unfolds. The
        unfold then copies runs of a few positions of a row; from the input laid out
        channels-last it copies runs of ``C_in`` channels. ResNet stages at 4×4 and 8×8,
        ``N = 128``, 2 threads: unfold 4.5 → 1.3 ms and 3.6 → 2.1 ms; ``batch_l2`` of a
        128-channel 4×4 layer 6.6 → 3.4 ms, of a 64-channel 8×8 one 9.8 → 8.8 ms. (``Σ V²``
        keeps the unfold: its ``V`` came out slower from this layout, 17 → 22 ms.)"""
        x = call.input
        out = call.out_shapes[0][2:]
        return (
            x.device.type == "cpu"
            and call.module.groups == 1
            and x.dim() == self.n_spatial + 2
            and x.shape[1] >= 16
            and out[-1] < 16
            and math.prod(out) > 1
            and not self._grouped(call)
        )

    def unfold_positions(self, call: Call) -> Tensor:
        """``[N, L, K·C_in]``, ``X[n, l, κ·C_in + c] = x̃[n, c, s·l + d·κ]``, copied from the
        padded input laid out channels-last (one more copy, ``1/K`` of the unfold's size)."""
        self.check_call(call)
        mod = call.module
        d = self.n_spatial
        xp = padded_input(call.input, conv_padding(mod), mod.padding_mode)
        xt = xp.movedim(1, -1).contiguous()  # [N, *S̃, C]
        v = windows(xt.unsqueeze(1), mod.kernel_size, mod.stride, mod.dilation)
        v = v[:, 0].permute(0, *range(1, 1 + d), *range(2 + d, 2 + 2 * d), 1 + d)  # [N,*L,*k,C]
        n, length = v.shape[0], math.prod(v.shape[1 : 1 + d])
        return v.reshape(n, length, -1)

    def kfac_input(self, call: Call, approx: str | None = None) -> dict[str, Tensor]:
        """As :meth:`UnfoldRule.kfac_input`; with stride 1 and one group, from shifted
        products of the input where they are cheaper than the unfold
        (:mod:`backprism.rules.conv_factor`)."""
        mod = call.module
        out = call.out_shapes[0][2:]
        if (
            approx != "reduce"
            and self._has_weight(call)
            and mod.groups == 1
            and all(s == 1 for s in mod.stride)
            and call.input.dim() == self.n_spatial + 2
            and shifts_cheaper(call.input.shape[2:], mod.kernel_size, mod.dilation, out)
        ):
            x, pads = _padded(mod, call.input)
            factor = input_factor_by_shifts(
                x, mod.kernel_size, mod.dilation, [a for a, _ in pads], out
            )
            scale = call.input.shape[0] * (math.prod(out) if approx == "expand" else 1)
            return {"weight": factor / scale}
        return super().kfac_input(call, approx)

    def weight_grad(self, call: Call, g: Tensor) -> Tensor:
        mod = call.module
        x, pads = _padded(mod, call.input)
        d = len(mod.kernel_size)
        return torch.ops.aten.convolution_backward(
            g, x, mod.weight.detach(), None, mod.stride, [a for a, _ in pads], mod.dilation,
            False, [0] * d, mod.groups, [False, True, False],
        )[1]

    def _samples(self, call: Call, g5: Tensor, sl: slice) -> Tensor:
        """``V`` for the samples ``sl`` (``[M, n, G, O, I]``). Where the unfolded input would be
        large next to ``V`` (many output positions, few input channels per group), by
        PyTorch's convolution weight gradient with the samples as groups — ``x`` as
        ``[1, n·C_in, *S]``, ``g_m`` as ``[1, n·C_out, *S']``, ``groups = n·G`` gives
        ``[n·C_out, C_in/G, *k]`` = ``V_{mn}`` for every sample at once, no unfolded copy —
        else from the unfolded input."""
        if self._depthwise(call):
            return self._depthwise_samples(call, g5, sl)
        if not self._grouped(call):
            return super()._samples(call, g5, sl)
        mod = call.module
        x, pads = _padded(mod, call.input[sl])
        n, cin = x.shape[:2]
        grp, o = g5.shape[2:4]
        d = len(mod.kernel_size)
        xs = x.reshape(1, n * cin, *x.shape[2:])
        out_spatial = call.out_shapes[0][2:]
        # only the weight's shape matters for the weight gradient
        w = x.new_empty(n * grp * o, cin // grp, *mod.kernel_size)
        cols = []
        for gm in g5[:, sl]:
            v = torch.ops.aten.convolution_backward(
                gm.reshape(1, n * grp * o, *out_spatial), xs, w, None, mod.stride,
                [a for a, _ in pads], mod.dilation, False, [0] * d, n * grp,
                [False, True, False],
            )[1]
            cols.append(v.reshape(n, grp, o, -1))
        return torch.stack(cols)

    def _depthwise(self, call: Call) -> bool:
        """Whether :meth:`_samples` takes :meth:`_depthwise_samples`: one input channel per
        group (ConvNeXt's and MobileNet's depthwise convolutions), on the CPU, where it was
        measured 5–40× faster than unfolding (ConvNeXt stages, ``N = 32``: 8×8 maps 2.4 →
        0.36 ms, 56×56 maps 756 → 59 ms); elsewhere (unmeasured) the unfolded input."""
        x = call.input
        return (
            x.device.type == "cpu" and x.shape[1] == call.module.groups
            and x.dim() == self.n_spatial + 2
        )

    def _depthwise_samples(self, call: Call, g5: Tensor, sl: slice) -> Tensor:
        r"""``V`` (``[M, n, G, O, K]``) of a depthwise convolution (``C_in = G``) for the
        samples ``sl`` as one convolution, no unfolded copy. With one input channel per group,

        .. math:: V_{mngo}[κ] = Σ_l g_{mngol}\, x̃_{ng}[s·l + d·κ],

        the cross-correlation of the padded input channel ``x̃_{ng}`` with the output
        gradient ``g_{mngo}`` taken as a kernel whose taps are ``s`` (stride) apart, at
        output positions ``d`` (dilation) apart: a convolution of ``x̃`` as ``[1, n·G, *S̃]``
        with the columns as weights ``[n·G·M·O, 1, *S']``, ``groups = n·G``, stride ``d``,
        dilation ``s``; its first ``k`` output positions per axis are ``V``."""
        mod = call.module
        x = padded_input(call.input[sl], conv_padding(mod), mod.padding_mode)
        m, _, grp, o = g5.shape[:4]
        n = x.shape[0]
        d = len(mod.kernel_size)
        out_spatial = call.out_shapes[0][2:]
        if math.prod(out_spatial) == 1:
            # one output position: Vₘₙ[κ] = gₘₙ x̃ₙ[d·κ], a product (the convolution with a
            # kernel of one tap is a slow case of PyTorch's: 10 ms against 0.2 ms at N = 128)
            taps = x[(..., *(slice(0, dl * (k - 1) + 1, dl) for k, dl in zip(
                mod.kernel_size, mod.dilation)))]
            return g5[:, sl, :, :, :1] * taps.reshape(1, n, grp, 1, -1).to(g5.dtype)
        w = g5[:, sl].permute(1, 2, 0, 3, 4).reshape(n * grp * m * o, 1, *out_spatial)
        v = torch.ops.aten.convolution(
            x.reshape(1, n * grp, *x.shape[2:]).to(w.dtype), w, None, list(mod.dilation),
            [0] * d, list(mod.stride), False, [0] * d, n * grp,
        )
        v = v[(0, slice(None), *(slice(0, k) for k in mod.kernel_size))]
        return v.reshape(n, grp, m, o, -1).permute(2, 0, 1, 3, 4)

    def _grouped(self, call: Call) -> bool:
        """Whether :meth:`_samples` takes the grouped weight gradient: on the CPU (where it was
        measured: up to 2× faster than unfolding for ``8 ≤ C_in/G``, ``(C_in/G)·K ≤ 288`` and
        ``L ≥ 64`` output positions, 2–3× slower for larger ``(C_in/G)·K``) for such layers;
        elsewhere the unfolded input. Fewer than 8 input channels per group hit a slow kernel
        of PyTorch's grouped weight gradient: 5–180× slower than unfolding (ResNet's first
        layer, 3 → 16 channels at 32×32, N = 128: 318 ms against 5 ms)."""
        x = call.input
        if x.device.type != "cpu":
            return False
        length = math.prod(call.out_shapes[0][2:])
        per_group = x.shape[1] // call.module.groups
        return per_group >= 8 and self._in_features(call) <= 288 and length >= 64

    def batch_dot_with(
        self, call: Call, g: Tensor, vectors: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        r"""``⟨Vₙ, V⟩ = Σ_{o,l} δₙₒₗ conv(xₙ, V)ₒₗ`` (the module's own convolution with weight
        ``V``, padding mode included; columns summed first): no unfolding, no ``[N, O, I]``."""
        self.check_call(call)
        gs = g.sum(0)  # [N, C_out, *S]
        out = {}
        if "weight" in vectors and self._has_weight(call):
            w = vectors["weight"].to(call.input.dtype)
            y = call.module._conv_forward(call.input, w, None)
            out["weight"] = (gs * y).flatten(1).sum(1)
        if "bias" in vectors and self._has_bias(call):
            out["bias"] = gs.flatten(2).sum(-1) @ vectors["bias"].to(gs.dtype)
        return out

    def to_param(self, call: Call, v: Tensor) -> Tensor:
        w = call.module.weight
        lead = v.shape[:-3]
        return v.reshape(*lead, *w.shape)


def _padded(mod: nn.Module, x: Tensor) -> tuple[Tensor, list[tuple[int, int]]]:
    """``x`` and the ``(left, right)`` padding per axis for PyTorch's weight gradient, which
    pads symmetrically with zeros only: other modes and asymmetric ``'same'`` padding are
    applied to ``x`` here (then no padding is left)."""
    pads = conv_padding(mod)
    if mod.padding_mode != "zeros" or any(a != b for a, b in pads):
        mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
        x = F.pad(x, [p for pair in reversed(pads) for p in pair], mode=mode)
        pads = [(0, 0)] * len(pads)
    return x, pads


@register_rule(nn.Conv1d)
class Conv1dRule(_ConvRule):
    n_spatial = 1


@register_rule(nn.Conv2d)
class Conv2dRule(_ConvRule):
    n_spatial = 2


@register_rule(nn.Conv3d)
class Conv3dRule(_ConvRule):
    n_spatial = 3
