r"""``DampedNewton``: a ``torch.optim`` optimizer stepping along directionally damped Newton steps.

Each step computes, in one backward pass, the GGN eigenvectors ``e_d`` selected by the group's
``criterion``, the mean directional gradients ``γ̄_d`` and curvatures ``λ̄_d`` and applies

.. math:: θ ← θ + η \sum_d \frac{-\bar γ_d}{\bar λ_d + δ} e_d

(:class:`~backprism.spectral.DirectionalDampedNewtonComputation`, one GGN block per group).

Two ways to drive it:

* closure (the closure runs the *forward pass only* and returns the loss)::

      opt = DampedNewton(model.parameters(), damping=1.0)
      for X, y in loader:
          opt.step(lambda: lossfunc(model(X), y))

* backward inside the optimizer's context, then step::

      with opt.collect():
          lossfunc(model(X), y).backward()
      opt.step()

With ``adaptive=True`` (closure required) the damping follows the Levenberg–Marquardt rule: with
the quadratic model ``m(a) = Σ_d (γ̄_d a_d + ½ λ̄_d a_d²)`` of the loss change along the applied
step ``a = η c`` and the observed change ``ΔL``, ``ρ = ΔL / m`` multiplies ``δ`` by ``boost``
if ``ρ < 1/4`` and by ``drop`` if ``ρ > 3/4`` (clamped to ``damping_bounds``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from backprism.engine.collect import collect as _collect
from backprism.spectral.computations import DirectionalDampedNewtonComputation

__all__ = ["ConstantDamping", "DampedNewton", "positive_eigenvalues"]


class ConstantDamping:
    """Constant directional damping ``δ_d = damping`` (ViViT's ``'damping'`` callable form)."""

    def __init__(self, damping: float = 1.0) -> None:
        if damping < 0:
            raise ValueError(f"damping must be non-negative, got {damping}")
        self.damping = float(damping)

    def __call__(self, evals: Tensor, evecs: Tensor, gammas: Tensor, lambdas: Tensor) -> Tensor:
        return torch.full_like(evals, self.damping)

    def __repr__(self) -> str:
        return f"ConstantDamping({self.damping!r})"


def positive_eigenvalues(evals: Tensor, rtol: float = 1e-4) -> list[int]:
    """Criterion keeping the eigenvalues above ``rtol · max(evals)`` (and above zero)."""
    top = float(evals.max()) if evals.numel() else 0.0
    if top <= 0:
        return []
    return torch.nonzero(evals > rtol * top).flatten().tolist()


class DampedNewton(torch.optim.Optimizer):
    """Directionally damped Newton optimizer on GGN eigenvectors (one GGN block per group).

    Args:
        params: parameters or ``torch.optim`` groups (each may set ``lr``, ``damping``,
            ``criterion``).
        lr: step scale ``η``.
        damping: initial constant damping ``δ ≥ 0`` (stored and adapted per group).
        criterion: picks the eigenvalue indices used as directions (default:
            :func:`positive_eigenvalues`).
        adaptive: adapt ``δ`` with the Levenberg–Marquardt rule (needs a closure).
        subsampling_grad, subsampling_ggn, mc_samples_ggn: GGN / gradient approximations, as in
            :class:`~backprism.spectral.DirectionalDampedNewtonComputation`.
        boost, drop: damping factors for a poor (``ρ < 1/4``) / good (``ρ > 3/4``) step.
        damping_bounds: ``(min, max)`` of the adapted damping.
        warn_small_eigvals: passed to the computation.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1.0,
        damping: float = 1.0,
        criterion: Callable[[Tensor], Sequence[int]] | None = None,
        adaptive: bool = False,
        subsampling_grad: Sequence[int] | None = None,
        subsampling_ggn: Sequence[int] | None = None,
        mc_samples_ggn: int = 0,
        boost: float = 1.5,
        drop: float = 2.0 / 3.0,
        damping_bounds: tuple[float, float] = (1e-8, 1e8),
        warn_small_eigvals: float = 0.0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if damping < 0:
            raise ValueError(f"damping must be non-negative, got {damping}")
        if not (boost > 1 and 0 < drop < 1):
            raise ValueError(f"need boost > 1 and 0 < drop < 1, got {boost}, {drop}")
        defaults = {"lr": lr, "damping": damping, "criterion": criterion or positive_eigenvalues}
        super().__init__(params, defaults)
        self.adaptive = adaptive
        self.boost, self.drop = boost, drop
        self.damping_bounds = damping_bounds
        self.computation = DirectionalDampedNewtonComputation(
            subsampling_grad=subsampling_grad,
            subsampling_ggn=subsampling_ggn,
            mc_samples_ggn=mc_samples_ggn,
            warn_small_eigvals=warn_small_eigvals,
        )
        self._blocks: list[dict] | None = None

    def _make_blocks(self) -> list[dict]:
        return [
            {
                "params": [p for p in g["params"] if p.requires_grad],
                "criterion": g["criterion"],
                "damping": ConstantDamping(g["damping"]),
            }
            for g in self.param_groups
        ]

    @contextmanager
    def collect(self) -> Iterator[None]:
        """Context to run ``loss.backward()`` in; computes the Newton step for :meth:`step`."""
        blocks = self._make_blocks()
        with _collect(
            *self.computation.get_extensions(),
            extension_hook=self.computation.get_extension_hook(blocks),
        ):
            yield
        self._blocks = blocks

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:  # type: ignore[override]
        """Apply the damped Newton step.

        Args:
            closure: runs the forward pass and returns the (mean-reduced) loss; the optimizer
                runs the backward pass itself. Without a closure, the backward pass must have
                run inside :meth:`collect` since the last step.

        Returns:
            the loss returned by the closure (``None`` without closure).
        """
        loss = None
        if closure is not None:
            self.zero_grad()
            with torch.enable_grad():
                loss = closure()
                with self.collect():
                    loss.backward()
        elif self.adaptive:
            raise RuntimeError(
                "DampedNewton(adaptive=True) needs a closure to re-evaluate the loss"
            )
        if self._blocks is None:
            raise RuntimeError(
                "DampedNewton.step(): no Newton direction computed; pass a closure or run "
                "loss.backward() inside `with optimizer.collect():` first"
            )
        blocks, self._blocks = self._blocks, None
        predicted = 0.0
        for group, block in zip(self.param_groups, blocks):
            steps = self.computation.get_result(block)
            for p, s in zip(block["params"], steps):
                p.add_(s.to(p.dtype), alpha=group["lr"])
            _, gbar, lbar, _, coeff = self.computation._stats[id(block)]
            a = group["lr"] * coeff
            predicted += float((gbar * a + 0.5 * lbar * a.square()).sum())
        if self.adaptive and closure is not None and loss is not None:
            new_loss = float(closure())
            change = new_loss - float(loss)
            rho = change / predicted if predicted < 0 else -1.0
            lo, hi = self.damping_bounds
            for group in self.param_groups:
                if rho < 0.25:
                    group["damping"] = min(hi, max(group["damping"], lo) * self.boost)
                elif rho > 0.75:
                    group["damping"] = max(lo, group["damping"] * self.drop)
            self.last_rho = rho
        return loss
