r"""Rules for normalisation layers: LayerNorm, RMSNorm, GroupNorm, InstanceNorm and BatchNorm in
eval mode.

All of them compute ``y = x̂ ⊙ w + b`` where the normalised input ``x̂`` does not depend on the
parameters, so with output columns ``g`` (``[M, N, *out.shape]``) the per-sample, per-column
gradients are

    ``Vₘₙ(w) = Σ_r gₘₙ ⊙ x̂ₙ``,   ``Vₘₙ(b) = Σ_r gₘₙ``,

summed over the positions ``r`` that the parameter is broadcast over (leading axes for
LayerNorm/RMSNorm, spatial axes for GroupNorm/BatchNorm). ``x̂`` is recomputed from the captured
input and the module's hyper-parameters exactly as PyTorch computes it:

* ``LayerNorm``: ``x̂ = (x − E[x]) / √(Var[x] + eps)``, biased variance over the trailing
  ``normalized_shape`` axes;
* ``RMSNorm``: ``x̂ = x / √(E[x²] + eps)`` over the trailing ``normalized_shape`` axes, with
  ``eps = torch.finfo(x.dtype).eps`` when ``eps is None``;
* ``GroupNorm``: ``x̂ = (x − E[x]) / √(Var[x] + eps)``, biased variance over each group of
  ``C / num_groups`` channels and all spatial axes;
* ``InstanceNorm1d/2d/3d`` (``affine=True``): ``x̂ = (x − E[x]) / √(Var[x] + eps)`` per sample
  and channel over the spatial axes (biased variance) — ``GroupNorm`` with one channel per
  group —, or in eval mode with ``track_running_stats=True`` the running statistics per
  channel, as BatchNorm in eval mode;
* ``BatchNorm1d/2d/3d`` in eval mode: ``x̂ = (x − running_mean) / √(running_var + eps)`` per
  channel (axis 1). BatchNorm using batch statistics (train mode, or
  ``track_running_stats=False``) mixes the samples and is refused.

The parameters are small, so statistics are reduced from the materialised ``[M, N, *p.shape]``
per-sample gradients (the :class:`~backprism.engine.rule.Rule` defaults). ``x̂`` comes from
PyTorch's own normalisation kernels without affine parameters (``F.rms_norm``,
``F.group_norm``) or with neutral ones (``F.layer_norm``: unit weight, zero bias), so it is
the layer's own arithmetic; it is computed once per call: the last one is cached (keyed on
the call and its input's version counter) and dropped at the end of the backward pass.

The parameters are elementwise, without Kronecker structure: KFAC / KFLR / KFRA store for each
the single factor ``[diag(Σₘ Σₙ Vₘₙ²)]`` (``[P, P]``), the MC (KFAC) or exact (KFLR, KFRA) GGN
diagonal (:meth:`~backprism.engine.rule.Rule.kronecker_diagonal`).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism.engine.rule import Call, Rule, register_rule

__all__ = ["BatchNormRule", "GroupNormRule", "InstanceNormRule", "LayerNormRule", "RMSNormRule"]

#: ``(weakref to call, input version, x̂)`` of the most recent call; at most one x̂ is kept.
_LAST: tuple[weakref.ref, int, Tensor] | None = None


def _clear_cache() -> None:
    global _LAST
    _LAST = None


class _AffineNormRule(Rule):
    """``y = x̂ ⊙ w + b``; subclasses define ``x̂`` and whether parameters run along the channel
    axis 1 (``channel = True``) or the trailing axes."""

    channel: bool = False
    #: ``x̂`` is computed from the live input, and the statistics are polynomials in it and in
    #: the output gradient
    differentiable = True

    def validate(self, call: Call) -> None:
        """Raise if per-sample quantities are undefined for this call."""

    def normalized(self, call: Call) -> Tensor:
        """``x̂``, the normalised input, with the input's shape."""
        raise NotImplementedError

    def _xhat(self, call: Call) -> Tensor:
        global _LAST
        x = call.input
        last = _LAST
        if last is not None and last[0]() is call and last[1] == x._version:
            return last[2]
        xhat = self.normalized(call)
        _LAST = (weakref.ref(call), x._version, xhat)
        # drop the cached x̂ once the surrounding backward pass ends (outside a backward pass
        # this raises, and the entry is kept until the next call replaces it)
        with contextlib.suppress(RuntimeError):
            torch.autograd.Variable._execution_engine.queue_callback(_clear_cache)
        return xhat

    def _names(self, call: Call) -> list[str]:
        module = call.module
        return [
            k
            for k in ("weight", "bias")
            if getattr(module, k, None) is not None and (not call.params or k in call.params)
        ]

    def _layout(self, call: Call, t: Tensor) -> Tensor:
        """``t`` of shape ``[M, N, *x.shape[1:]]`` as ``[M, N, P, R]`` (channel layout: ``P``
        channels, ``R`` spatial positions) or ``[M, N, R, P]`` (trailing ``normalized_shape``
        with ``P`` entries, ``R`` leading positions) — never a transposed copy."""
        m, n = t.shape[:2]
        if self.channel:
            return t.reshape(m, n, t.shape[2], -1)
        p = math.prod(call.module.normalized_shape)
        return t.reshape(m, n, -1, p)

    def _reduce(self, call: Call, g: Tensor, keep_batch: bool) -> dict:
        self.validate(call)
        names = self._names(call)
        gl = self._layout(call, g)
        pos = 3 if self.channel else 2  # the axis of the positions r
        dims = (pos,) if keep_batch else (1, pos)
        out: dict[str, Tensor] = {}
        if "weight" in names:
            xhat = self._layout(call, self._xhat(call).to(gl.dtype)[None])[0]
            # Σ_r g ⊙ x̂ as one product and one reduction (an einsum would batch tiny matrix
            # products over (n, p))
            out["weight"] = (gl * xhat).sum(dims)
        if "bias" in names:
            out["bias"] = gl.sum(dims)
        return {
            k: v.reshape(*v.shape[:-1], *getattr(call.module, k).shape) for k, v in out.items()
        }

    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        """``Vₘₙ(w) = Σ_r gₘₙ ⊙ x̂ₙ`` and ``Vₘₙ(b) = Σ_r gₘₙ``: ``[M, N, *p.shape]``."""
        return self._reduce(call, g, keep_batch=True)

    def summed(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        """``Σₙ Vₘₙ``: ``[M, *p.shape]``."""
        return self._reduce(call, g, keep_batch=False)


def _check_batched(call: Call, ndim: int) -> None:
    x = call.input
    if x.dim() <= ndim:
        raise ValueError(
            f"backprism: {type(call.module).__name__} normalises over all {x.dim()} axes of its "
            f"input of shape {tuple(x.shape)}, including the batch axis, so the samples are "
            "mixed and per-sample quantities are undefined. Feed a batched input "
            "[N, *, *normalized_shape]."
        )


@register_rule(nn.LayerNorm)
class LayerNormRule(_AffineNormRule):
    """``x̂ = (x − E[x]) / √(Var[x] + eps)`` over ``normalized_shape`` (biased variance)."""

    #: normalises the trailing axes only: an input with the batch elsewhere is moved
    #: batch-first
    moves_batch_axis = True

    def validate(self, call: Call) -> None:
        _check_batched(call, len(call.module.normalized_shape))

    def normalized(self, call: Call) -> Tensor:
        module: nn.LayerNorm = call.module
        x = call.input
        shape = module.normalized_shape
        # PyTorch's own kernel: x̂ exactly as the layer computes it. With unit weight and zero
        # bias (exact: ·1 and +0) the CPU kernel takes its vectorised loop — the same numbers
        # bitwise as without affine parameters, whose scalar loop takes twice as long
        return F.layer_norm(x, shape, x.new_ones(shape), x.new_zeros(shape), module.eps)


@register_rule(nn.RMSNorm)
class RMSNormRule(_AffineNormRule):
    """``x̂ = x / √(E[x²] + eps)`` over ``normalized_shape`` (``eps=None``: ``finfo.eps``)."""

    #: normalises the trailing axes only: an input with the batch elsewhere is moved
    #: batch-first
    moves_batch_axis = True

    def validate(self, call: Call) -> None:
        _check_batched(call, len(call.module.normalized_shape))

    def normalized(self, call: Call) -> Tensor:
        module: nn.RMSNorm = call.module
        k = len(module.normalized_shape)
        x = call.input
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        if hasattr(F, "rms_norm"):  # torch >= 2.4: the layer's own kernel
            return F.rms_norm(x, module.normalized_shape, None, eps)
        dims = tuple(range(-k, 0))
        return x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)


@register_rule(nn.GroupNorm)
class GroupNormRule(_AffineNormRule):
    """``x̂ = (x − E[x]) / √(Var[x] + eps)`` per sample and group of channels (biased variance)."""

    channel = True

    def validate(self, call: Call) -> None:
        _check_batched(call, 1)

    def normalized(self, call: Call) -> Tensor:
        module: nn.GroupNorm = call.module
        return F.group_norm(call.input, module.num_groups, None, None, module.eps)


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(_AffineNormRule):
    """``x̂ = (x − E[x]) / √(Var[x] + eps)`` per sample and channel over the spatial axes
    (biased variance); with ``track_running_stats=True`` in eval mode, the running statistics
    (PyTorch's ``use_input_stats = training or not track_running_stats``)."""

    channel = True

    def validate(self, call: Call) -> None:
        module: Any = call.module
        x = call.input
        if x.dim() == module._get_no_batch_dim():
            raise ValueError(
                f"backprism: {type(module).__name__} got the unbatched input of shape "
                f"{tuple(x.shape)} (channels first, no batch axis), so there are no samples "
                "to compute per-sample quantities for. Feed a batched input [N, C, *spatial]."
            )

    def normalized(self, call: Call) -> Tensor:
        module: Any = call.module
        x = call.input
        if call.training or not module.track_running_stats:
            return F.instance_norm(x, None, None, None, None, True, 0.0, module.eps)
        mean = module.running_mean.to(x.dtype)
        var = module.running_var.to(x.dtype)
        return F.instance_norm(x, mean, var, None, None, False, 0.0, module.eps)


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class BatchNormRule(_AffineNormRule):
    """Eval mode: ``x̂ = (x − running_mean) / √(running_var + eps)`` per channel. Train mode
    (whole-batch passes only, ``call.whole_batch``): ``x̂`` with the batch's mean and biased
    variance, whose sums over the batch are all such a pass asks for."""

    channel = True

    def validate(self, call: Call) -> None:
        module: Any = call.module
        name = type(module).__name__
        batch_stats = module.running_mean is None or module.running_var is None
        if batch_stats and not call.whole_batch:
            raise RuntimeError(
                f"backprism: {name}(track_running_stats=False) normalises with the statistics "
                "of the current batch even in eval mode, which mixes the samples, so "
                "per-sample quantities are undefined. Use track_running_stats=True and "
                "model.eval() for the backward pass, or replace BatchNorm by GroupNorm/LayerNorm."
            )
        if call.training and not call.whole_batch:
            raise RuntimeError(
                f"backprism: {name} in train mode normalises with the statistics of the current "
                "batch, which mixes the samples. Call model.eval() for the backward pass, or "
                "replace BatchNorm by GroupNorm/LayerNorm."
            )
        _check_batched(call, 1)

    def normalized(self, call: Call) -> Tensor:
        module: Any = call.module
        x = call.input
        if call.training or module.running_mean is None or module.running_var is None:
            # a whole-batch pass: x̂ with the batch's own statistics
            return F.batch_norm(x, None, None, None, None, True, 0.0, module.eps)
        mean = module.running_mean.to(x.dtype)
        var = module.running_var.to(x.dtype)
        # PyTorch's eval-mode kernel without affine parameters (one pass over x)
        return F.batch_norm(x, mean, var, None, None, False, 0.0, module.eps)
