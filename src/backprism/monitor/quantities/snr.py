r"""Signal-to-noise quantities: mean GSNR, CABS batch size, evidence-based early stopping.

With ``gₙ = ∇ℓₙ``, ``g = (1/N)Σₙgₙ`` (mean reduction) and the engine's
``sum_grad_squared = Σₙ (gₙ/N)²`` (elementwise), so that ``N²·sum_grad_squared = Σₙ gₙ²``:

* **MeanGSNR** (Liu et al., 2020): mean over all parameter elements of
  ``g² / (N·sum_grad_squared − g² + ε)``, ``ε = 1e-5``; ``N·sum_grad_squared − g²`` is the
  (biased) variance of the individual gradients.
* **CABS** (Balles et al., 2017, Eq. 22): suggested batch size
  ``lr · Σ_i (N²·sum_grad_squared_i − N g_i²) / (N · L)``; stored as ``{"cabs": value}``.
* **EarlyStopping** (Mahsereci et al., 2017, Eq. 7): with the unbiased elementwise variance
  ``σ² = (N²·sum_grad_squared − N g²)/(N − 1)``, the criterion
  ``1 − N · mean_i(g_i² / (σ_i² + ε))``, ``ε = 1e-5``; stop training when it is ``> 0``.

Computed on the device in float64, moved to the host with the other values of the step (in a
global step under distributed data parallelism with the global batch's ``N``, gradient and
loss, :mod:`backprism.monitor.distributed`).
CABS and EarlyStopping are only defined for SGD without momentum/weight decay (``ValueError``
otherwise, as in Cockpit); they need ``info['optimizer']`` and ``info['batch_size']``.
"""

from __future__ import annotations

from typing import Any

from backprism.extensions import SumGradSquared
from backprism.extensions.base import Extension
from backprism.monitor.quantities.base import (
    Pending,
    Schedule,
    SingleStepQuantity,
    StepData,
    flat_cat,
)
from backprism.monitor.quantities.optim import is_sgd_default_kwargs, single_lr

__all__ = ["CABS", "EarlyStopping", "MeanGSNR"]


class _SGS(SingleStepQuantity):
    per_sample = True

    def extensions(self, global_step: int) -> list[Extension]:
        return [SumGradSquared()] if self.should_compute(global_step) else []

    def _stats(self, data: StepData) -> tuple[Any, Any, int]:
        grads = data.grads
        for p, g in zip(data.params, grads):
            if g is None:
                raise RuntimeError(
                    f"{self.key}: a monitored parameter of shape {tuple(p.shape)} has no .grad "
                    "after the backward pass; is it used in the forward pass?"
                )
        grad = flat_cat(grads).double()  # type: ignore[arg-type]
        sgs = flat_cat(data.fetch(SumGradSquared())).double()
        return grad, sgs, data.batch_size_of(self)


class _SGSEpsilon(_SGS):
    """A ``_SGS`` quantity with a stabilization constant ``epsilon``."""

    def __init__(self, track_schedule: Schedule, verbose: bool = False, epsilon: float = 1e-5):
        super().__init__(track_schedule, verbose=verbose)
        self._epsilon = epsilon

    def hyperparameters(self) -> dict[str, Any]:
        return {"epsilon": self._epsilon}


class MeanGSNR(_SGSEpsilon):
    """Mean gradient signal-to-noise ratio (float).

    Args:
        epsilon: stabilization constant (default ``1e-5``).
    """

    def info_keys(self, global_step: int) -> set[str]:
        return {"batch_size"} if self.should_compute(global_step) else set()

    def _compute(self, global_step: int, data: StepData) -> Pending:
        grad, sgs, n = self._stats(data)
        g2 = grad.square()
        return Pending.scalar((g2 / (n * sgs - g2 + self._epsilon)).mean())


def _check_sgd(optimizer: Any) -> None:
    if not is_sgd_default_kwargs(optimizer):
        raise ValueError("This criterion only supports zero-momentum SGD.")


class CABS(_SGS):
    """CABS batch size suggestion ``{"cabs": value}`` for zero-momentum SGD."""

    def info_keys(self, global_step: int) -> set[str]:
        return {"batch_size", "optimizer", "loss"} if self.should_compute(global_step) else set()

    def _compute(self, global_step: int, data: StepData) -> Pending:
        optimizer = data.get("optimizer", self)
        _check_sgd(optimizer)
        lr = single_lr(optimizer)
        grad, sgs, n = self._stats(data)
        loss = data.loss_of(self)
        loss = loss.detach().double() if hasattr(loss, "detach") else float(loss)
        value = lr * (n**2 * sgs - n * grad.square()).sum() / (n * loss)
        return Pending([value], lambda a: {"cabs": float(a[0])})

    def nan_value(self) -> Any:
        return {"cabs": float("nan")}


class EarlyStopping(_SGSEpsilon):
    """Evidence-based early-stopping criterion (float; stop when ``> 0``) for zero-momentum SGD.

    Args:
        epsilon: stabilization constant (default ``1e-5``).
    """

    def info_keys(self, global_step: int) -> set[str]:
        return {"batch_size", "optimizer"} if self.should_compute(global_step) else set()

    def _compute(self, global_step: int, data: StepData) -> Pending:
        _check_sgd(data.get("optimizer", self))
        grad, sgs, n = self._stats(data)
        g2 = grad.square()
        var = (n**2 * sgs - n * g2) / (n - 1)
        snr = g2 / (var + self._epsilon)
        return Pending.scalar(1 - n * snr.mean())
