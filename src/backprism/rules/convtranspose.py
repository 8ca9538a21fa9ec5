r"""Rules for :class:`torch.nn.ConvTranspose1d`, ``ConvTranspose2d``, ``ConvTranspose3d``.

The input ``x`` ``[N, C_in, *S]`` is unfolded onto the output grid:
``X[n, c, κ, t] = x[n, c, j]`` where ``t = s·j + d·κ − p`` (zero where no ``j`` fits), so that
``out[n, g, o, t] = Σ_{c,κ} W[g·C_in/G + c, o, κ] X[n, g, (c, κ), t]`` with
``O = C_out/G``. The output size (hence ``output_padding`` or ``output_size``) is taken from
the recorded output. Per sample and column,

* weight: ``V_{mn} = g_{mn} X_nᵀ`` (``[G, O, (C_in/G)·K]``), permuted to the weight layout
  ``[C_in, C_out/G, *k]``; bias: ``Σ_t g_{mnt}``;
* statistics as in :mod:`backprism.rules.unfold`.

Kronecker factors follow BackPACK: they approximate the curvature w.r.t.
``weight.transpose(0, 1)`` (``[C_out, C_in, *k]``, ``groups = 1``):
``A = (1/N) Σ_{n,t} X_{nt} X_{nt}ᵀ`` (``[C_in·K, C_in·K]``) and
``B = Σ_{m,n} (Σ_t g_{mnt})(Σ_t g_{mnt})ᵀ`` (``[C_out, C_out]``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from backprism.engine.rule import Call, register_rule
from backprism.rules.unfold import UnfoldRule, unfold_conv_transpose

__all__ = ["ConvTranspose1dRule", "ConvTranspose2dRule", "ConvTranspose3dRule"]


class _ConvTransposeRule(UnfoldRule):
    transposed = True

    def unfold_input(self, call: Call) -> Tensor:
        mod = call.module
        if mod.padding_mode != "zeros":  # PyTorch refuses these too
            raise ValueError(
                f"backprism: {type(mod).__name__} supports only padding_mode='zeros', "
                f"got {mod.padding_mode!r}"
            )
        return unfold_conv_transpose(
            call.input, mod.kernel_size, mod.stride, mod.dilation, mod.padding,
            call.out_shapes[0][2:],
        )

    def weight_grad(self, call: Call, g: Tensor) -> Tensor:
        mod = call.module
        x = call.input
        out_size = call.out_shapes[0][2:]
        opad = [
            o - ((i - 1) * s - 2 * p + d * (k - 1) + 1)
            for o, i, s, p, d, k in zip(
                out_size, x.shape[2:], mod.stride, mod.padding, mod.dilation, mod.kernel_size
            )
        ]
        return torch.ops.aten.convolution_backward(
            g, x, mod.weight.detach(), None, mod.stride, mod.padding, mod.dilation, True, opad,
            mod.groups, [False, True, False],
        )[1]

    def kronecker_sides(self, call: Call, name: str) -> tuple[int, ...]:
        """``B`` over the ``C_out`` output channels, ``A`` over the ``C_in·K`` unfolded input
        features (the weight is ``[C_in, C_out/G, *k]``)."""
        mod = call.module
        if name == "bias":
            return (mod.out_channels,)
        return (mod.out_channels, mod.in_channels * math.prod(mod.kernel_size))

    def to_param(self, call: Call, v: Tensor) -> Tensor:
        w = call.module.weight  # [C_in, O, *k]
        groups = call.module.groups
        lead = v.shape[:-3]
        o = w.shape[1]
        cg = w.shape[0] // groups
        v = v.reshape(*lead, groups, o, cg, -1).transpose(-2, -3)
        return v.reshape(*lead, *w.shape)


@register_rule(nn.ConvTranspose1d)
class ConvTranspose1dRule(_ConvTransposeRule):
    n_spatial = 1


@register_rule(nn.ConvTranspose2d)
class ConvTranspose2dRule(_ConvTransposeRule):
    n_spatial = 2


@register_rule(nn.ConvTranspose3d)
class ConvTranspose3dRule(_ConvTransposeRule):
    n_spatial = 3
