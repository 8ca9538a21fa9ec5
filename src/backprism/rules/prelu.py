r"""Rule for :class:`torch.nn.PReLU`.

``y = max(0, x) + a ⊙ min(0, x)`` with ``a`` (``weight``) of shape ``[1]`` (one slope shared by
every element) or ``[C]`` (one slope per channel, the channel axis being axis 1 of the input
``x`` of shape ``[N, C, *S]``). The output is linear in ``a``: ``∂yₙ/∂a_c = min(0, xₙ)`` on the
elements of channel ``c`` (all elements for ``[1]``), zero elsewhere. With output columns ``g``
of shape ``[M, N, *out.shape]`` the per-sample, per-column gradients are

.. math::

    V_{mn}(a)_c = \sum_{r} g_{m,n,c,r}\, \min(0, x_{n,c,r}) \qquad [M, N, C],

summed over the spatial positions ``r`` (``[1]``: over all non-batch axes, one entry). The
scaling is that of ``g`` (first order: ``g[0] = ∂L/∂y`` holds the ``1/N`` of a mean loss, so
``V₀ₙ = ∇(ℓₙ/N)`` and ``Σₙ V₀ₙ = ∇L``; second order: ``g[m]`` are the backpropagated columns of
the loss-Hessian square root, so ``Σₘₙ Vₘₙ²`` is the GGN diagonal). At ``x = 0`` both
``min(0, x)`` and PyTorch's own derivative (which takes ``x > 0`` as the positive branch) are 0.

The parameter is small, so every statistic (``batch_l2``, ``sum_squared``, ``batch_dot``, …) is
the :class:`~backprism.engine.rule.Rule` default reduced from the ``[M, N, *a.shape]`` tensor.
``y`` is linear in ``a`` (``∂²y/∂a² = 0``), so ``a``'s own Hessian block is its GGN block and
``linear_in_params`` holds; in ``x`` the layer is piecewise linear (``∂²y/∂x² = 0`` away from
``x = 0``), so it adds no Hessian residual term to the parameters before it. No Kronecker
structure: KFAC / KFLR / KFRA store ``[diag(Σₘ Σₙ Vₘₙ²)]``
(:meth:`~backprism.engine.rule.Rule.kronecker_diagonal`).
"""

from __future__ import annotations

from torch import Tensor, nn

from backprism.engine.rule import Call, Rule, register_rule

__all__ = ["PReLURule"]


@register_rule(nn.PReLU)
class PReLURule(Rule):
    """``Vₘₙ(a)_c = Σ_r g[m, n, c, r] · min(0, x[n, c, r])`` (see the module docstring)."""

    #: the statistics are polynomials in ``min(0, x)`` and ``g``, computed from the live input
    differentiable = True

    def _wanted(self, call: Call) -> bool:
        return "weight" in call.params if call.params else True

    def _layout(self, call: Call, t: Tensor) -> Tensor:
        """``t`` of shape ``[M, N, *x.shape[1:]]`` as ``[M, N, P, R]`` (``P`` = the number of
        slopes, ``R`` = the positions each slope is shared over), a view where the layout allows."""
        if call.input.dim() == 0:
            raise ValueError(
                "backprism: PReLU got a 0-d input; per-sample quantities need a batch axis"
            )
        # F.prelu itself refuses [C] slopes unless the input has C channels on axis 1
        p = call.module.weight.numel()
        m, n = t.shape[:2]
        return t.reshape(m, n, p, -1)

    def _reduce(self, call: Call, g: Tensor, keep_batch: bool) -> dict[str, Tensor]:
        if not self._wanted(call):
            return {}
        gl = self._layout(call, g)
        neg = call.input.clamp(max=0).to(gl.dtype)  # min(0, x)
        xl = self._layout(call, neg[None])[0]  # [N, P, R]
        dims = (3,) if keep_batch else (1, 3)
        out = (gl * xl).sum(dims)  # [M, N, P] or [M, P]
        return {"weight": out.reshape(*out.shape[:-1], *call.module.weight.shape)}

    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        """``Vₘₙ(a) = Σ_r gₘₙ min(0, xₙ)`` per slope: ``[M, N, *a.shape]``."""
        return self._reduce(call, g, keep_batch=True)

    def summed(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        """``Σₙ Vₘₙ(a)``: ``[M, *a.shape]`` (for ``M = 1``, the gradient)."""
        return self._reduce(call, g, keep_batch=False)
