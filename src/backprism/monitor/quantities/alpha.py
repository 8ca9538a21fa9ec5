r"""The normalized step length α from a noise-aware quadratic fit (Cockpit's ``Alpha``).

Between a *start* step ``s`` (scheduled) and the *end* step ``s + 1`` the parameters move by
``d = θ_end − θ_start``, ``t = ‖d‖``. Along the line, with ``x`` the distance travelled, we observe

* the mini-batch losses ``f₀ = L(θ_start)``, ``f_t = L(θ_end)`` with variances
  ``Var(ℓₙ)`` (unbiased sample variance of ``info['individual_losses']``),
* the projected gradients ``df = mean_n πₙ`` with ``πₙ = gₙᵀd/‖d‖``, ``gₙ = ∇ℓₙ`` (so
  ``df = gᵀd/‖d‖``), and variances ``Var(πₙ)`` (unbiased), at both points.

A quadratic ``q(x) = c₀ + c₁x + c₂x²`` is fitted by weighted least squares (maximum likelihood
with the observation variances, zero variances replaced by ``1e-10`` with a warning) to
``[f₀, f_t, df₀, df_t]`` with design rows ``[1,0,0], [1,t,t²], [0,1,0], [0,1,2t]``. Then

    α = 2t / ᾱ − 1,   ᾱ = −c₁/c₂  (the point of the same height as the start),

so ``α = −1`` means no progress, ``0`` stepping to the minimum of ``q``, ``1`` to the opposite
side; a concave fit (``c₂ < 0``) gives ``−1`` (``−1`` also when ``t = 0`` and the fit fails),
an impossible fit ``None`` (not stored). The value is stored under the start step
(``SAVE_SHIFT = 1``); the fit data go to ``fit_output`` (log key ``"<key>/fit"``).

Two ways to get ``πₙ`` (Cockpit's), neither materialising per-sample gradients in the SGD case:

* **SGD fast path** (``info['optimizer']`` is SGD without momentum/weight decay): the update is
  known during the start backward, ``d = −lr·g``; the start projections are
  ``gₙᵀd = −lr·N·Σₘ batch_dot[n, m]`` (``BatchProjGrad``, shared with InnerTest/OrthoTest) and
  the end projections ``N·grad_batch[n]ᵀd`` come from ``BatchDotWith(d)`` (Linear:
  ``δₙᵀ D xₙ``).
* **optimizer-agnostic fallback**: the start step keeps ``grad_batch`` (memory ``N × D``) and
  ``θ_start``; at the end, ``d = θ_end − θ_start`` is known before the backward pass, the end
  projections come from ``BatchDotWith(d)`` and the start ones from the kept gradients.

Under distributed data parallelism (a global step, :mod:`backprism.monitor.distributed`) the
losses, the projections and their variances are the global batch's (every rank's rows
gathered), ``g`` its gradient. The fast path then assumes the update ``−lr·g``; with unequal
local batch sizes DDP's ``.grad`` is not ``g`` and the fast path warns once. Start and end
steps must both be global or both local (otherwise no value is recorded, with a warning).

Everything up to the four observations and their variances is computed on the device; the
3×3 weighted least-squares fit (and its warnings) runs on the host when the step's values are
written (:class:`~backprism.monitor.deferred.Pending`), so no value is read during the step.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from backprism.extensions import BatchDotWith, BatchGrad, BatchProjGrad
from backprism.extensions.base import Extension
from backprism.monitor.quantities.base import Pending, Schedule, StepData, TwoStepQuantity
from backprism.monitor.quantities.optim import is_sgd_default_kwargs, lr_of

__all__ = ["Alpha", "fit_quadratic", "get_alpha"]


def _proj(grad_batch: Tensor, d: Tensor, n: int | None = None) -> Tensor:
    """``[N_rows]``: ``N · grad_batch[n]ᵀ d`` (individual gradients ``gₙ = N·grad_batch[n]``;
    ``N`` the batch size, by default the number of rows)."""
    rows = grad_batch.shape[0]
    n = rows if n is None else n
    return n * (grad_batch.detach().reshape(rows, -1) @ d.reshape(-1).to(grad_batch.dtype))


class Alpha(TwoStepQuantity):
    """Normalized step length α (float) from the noise-aware quadratic fit; see module doc.

    Needs ``info['loss']``, ``info['individual_losses']``, ``info['batch_size']`` and (for the
    SGD fast path) ``info['optimizer']`` on start and end steps.
    """

    SAVE_SHIFT = 1
    POINTS = ("start", "end")
    per_sample = True

    def __init__(self, track_schedule: Schedule, verbose: bool = False) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self.fit_output: dict[int, dict[str, Any]] = {}
        self._fresh_fit: list[int] = []

    def trim_history(self) -> None:
        """The fit records are streamed as ``"<key>/fit"``; only the latest stays."""
        super().trim_history()
        for step in list(self.fit_output)[:-1]:
            del self.fit_output[step]

    def take_fresh(self) -> list[tuple[str, int, Any]]:
        out = super().take_fresh()
        for step in dict.fromkeys(self._fresh_fit):
            if step in self.fit_output:
                out.append(("/fit", step, self.fit_output[step]))
        self._fresh_fit.clear()
        return out

    def is_start(self, global_step: int) -> bool:
        return bool(self._track_schedule(global_step))

    def is_end(self, global_step: int) -> bool:
        return bool(self._track_schedule(global_step - self.SAVE_SHIFT))

    def _block(self, start: int, end: int) -> Any:
        return lambda step: start <= step <= end

    def _has_start(self, end_step: int) -> bool:
        return self.in_cache(end_step - self.SAVE_SHIFT, "mode")

    def _fast(self, data: StepData) -> bool:
        try:
            optimizer = data.info["optimizer"]
        except KeyError:
            warnings.warn("No 'optimizer' handed in via info", stacklevel=4)
            return False
        return is_sgd_default_kwargs(optimizer)

    def info_keys(self, global_step: int) -> set[str]:
        if self.should_compute(global_step):
            return {"loss", "individual_losses", "batch_size"}
        return set()

    # -- what the backward pass computes -----------------------------------------------------
    def _plan(self, global_step: int, data: StepData) -> dict[str, Any]:
        """Per step: whether it starts (and how) and ends with a known start."""
        plan = getattr(self, "_plans", {}).get(global_step)
        if plan is None:
            start = self.is_start(global_step)
            end = self.is_end(global_step) and self._has_start(global_step)
            mode = None
            if start:
                mode = "fast" if self._fast(data) else "fallback"
            plan = {"start": start, "mode": mode, "end": end}
            self._plans = {global_step: plan}
        return plan

    def begin_step(self, global_step: int, data: StepData) -> None:
        self._plans = {}
        self._params = data.params
        if self.should_compute(global_step):
            self._plan(global_step, data)

    def extensions(self, global_step: int) -> list[Extension]:
        plan = getattr(self, "_plans", {}).get(global_step)
        if plan is None:
            return []
        out: list[Extension] = []
        if plan["start"]:
            out.append(BatchProjGrad() if plan["mode"] == "fast" else BatchGrad())
        if plan["end"]:
            ext = self._end_ext(global_step, plan)
            out.append(ext)
        return out

    def _end_ext(self, global_step: int, plan: dict[str, Any]) -> BatchDotWith:
        """``BatchDotWith(d)`` for the end step (built once per step)."""
        ext = plan.get("end_ext")
        if ext is None:
            start = global_step - self.SAVE_SHIFT
            if self.load_from_cache(start, "mode") == "fast":
                dirs = self.load_from_cache(start, "update")
            else:
                old = self.load_from_cache(start, "params")
                dirs = {id(p): p.detach() - old[id(p)] for p in self._params}
            plan["dirs"] = dirs
            ext = plan["end_ext"] = BatchDotWith((p, dirs[id(p)]) for p in self._params)
        return ext

    # -- after the backward pass -------------------------------------------------------------
    def track(self, global_step: int, data: StepData) -> None:
        if not self.should_compute(global_step):
            return
        plan = self._plan(global_step, data)
        if plan["start"]:
            self._compute_start(global_step, data)
        if plan["end"]:
            start = global_step - self.SAVE_SHIFT
            first = self.load_from_cache(start, "finite")
            flags = [f for f in (first, *self._flags) if f is not None]
            value = self._compute_end(global_step, data)
            if value is not None:
                self._save(start, value, flags=flags)
        elif self.is_end(global_step) and self._verbose:
            print(f"[Step {global_step} | {self.key}] no start point cached, skipping")
        self.free_cache(global_step + 1)
        self._plans = {}

    def track_nonfinite(self, global_step: int, data: StepData) -> None:
        if self.is_end(global_step) and self._has_start(global_step):
            self._save(global_step - self.SAVE_SHIFT, self.nan_value())
        self._cache.pop(global_step, None)
        self.free_cache(global_step + 1)
        self._plans = {}

    def _save_0th_order(self, step: int, data: StepData, point: str, until: int) -> None:
        block = self._block(step, until)
        loss = data.loss_of(self)
        loss = torch.as_tensor(loss).detach().double().reshape(())
        self.save_to_cache(step, f"f_{point}", loss, block)
        losses = torch.as_tensor(data.individual_losses_of(self)).detach().double()
        self.save_to_cache(step, f"var_f_{point}", losses.var(), block)

    def _warn_unequal(self, data: StepData) -> None:
        """The fast path under DDP with unequal local batch sizes: warned once."""
        if data.dist is None or data.dist.same_sizes or getattr(self, "_warned_unequal", False):
            return
        self._warned_unequal = True
        warnings.warn(
            f"{self.key}: the SGD fast path takes the update to be −lr·g with g the global "
            f"batch's gradient, but the local batch sizes differ {data.dist.batch.sizes}, and "
            "then DDP's .grad, which SGD steps along, is not that gradient (it weights rank r's "
            "samples 1/(R·N_r) instead of 1/N; docs/distributed.md). α then mixes two "
            "directions; use equal local batch sizes for α (DistributedSampler gives every "
            "rank the same number of samples)",
            RuntimeWarning,
            stacklevel=5,
        )

    def _compute_start(self, global_step: int, data: StepData) -> None:
        plan = self._plan(global_step, data)
        until = global_step + self.SAVE_SHIFT
        block = self._block(global_step, until)
        self._save_0th_order(global_step, data, "start", until)
        self.save_to_cache(global_step, "mode", plan["mode"], block)
        self.save_to_cache(global_step, "finite", data.finite_t, block)
        self.save_to_cache(global_step, "dist", data.dist, block)
        if plan["mode"] == "fast":
            # gₙᵀd = −lr (N grad_batch[n])ᵀ Σₘ grad_batch[m] = −lr N Σₘ batch_dot[n, m]
            lrs = lr_of(data.get("optimizer", self))
            n = data.batch_size_of(self)
            rows = data.rows(BatchProjGrad())  # Σₘ batch_dot[n, m] per parameter
            self._warn_unequal(data)
            dirs = {
                id(p): -lrs[id(p)] * g.clone()  # type: ignore[union-attr]
                for p, g in zip(data.params, data.grads)
            }
            dots = torch.stack(
                [-lrs[id(p)] * n * r.to(rows[0].device, torch.float64)
                 for p, r in zip(data.params, rows)]
            ).sum(0)
            self.save_to_cache(global_step, "update", dirs, block)
            self.save_to_cache(global_step, "dots_start", dots, block)
        else:
            params = {id(p): p.detach().clone() for p in data.params}
            kept = {id(p): g.detach() for p, g in zip(data.params, data.fetch(BatchGrad()))}
            self.save_to_cache(global_step, "params", params, block)
            self.save_to_cache(global_step, "grad_batch", kept, block)

    def _compute_end(self, global_step: int, data: StepData) -> Pending | None:
        start = global_step - self.SAVE_SHIFT
        start_dist = self.load_from_cache(start, "dist")
        if (start_dist is None) != (data.dist is None):
            warnings.warn(
                f"{self.key}: step {start} and step {global_step} are not both global (the "
                "backward pass of one was distributed, of the other not, e.g. inside "
                "DDP's no_sync()); no value is recorded for this pair",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        self._save_0th_order(global_step, data, "end", global_step)
        mode = self.load_from_cache(start, "mode")
        plan = self._plan(global_step, data)
        ext = self._end_ext(global_step, plan)
        dirs = plan["dirs"]
        n = data.batch_size_of(self)
        dev = data.device
        dots_end = torch.stack([n * r.to(dev, torch.float64) for r in data.rows(ext)]).sum(0)
        norms = torch._foreach_norm([dirs[id(p)] for p in data.params], 2)
        sq = torch.stack([n.to(dev, torch.float64) for n in norms]).square().sum()
        if mode == "fast":
            dots_start = self.load_from_cache(start, "dots_start")
        else:
            kept = self.load_from_cache(start, "grad_batch")
            n0 = None if start_dist is None else start_dist.n
            dots_start = torch.stack(
                [_proj(kept[id(p)], dirs[id(p)], n0).to(dev, torch.float64) for p in data.params]
            ).sum(0)
            if start_dist is not None:  # the start step's rows of all ranks
                dots_start = start_dist.reduce([], [dots_start])[1][0]
        t = sq.sqrt()
        moving = t > 0
        scale = torch.where(moving, 1 / torch.where(moving, t, 1), 0)
        proj = [dots_start * scale, dots_end * scale]
        tensors = [
            t,
            self.load_from_cache(start, "f_start"),
            self.load_from_cache(global_step, "f_end"),
            self.load_from_cache(start, "var_f_start"),
            self.load_from_cache(global_step, "var_f_end"),
            proj[0].mean(),
            proj[1].mean(),
            proj[0].var(),
            proj[1].var(),
        ]
        return Pending(tensors, lambda a: self._fit(start, [float(x) for x in a]))

    def _fit(self, start: int, values: list[float]) -> float | None:
        """The host part: the quadratic fit, α and the fit record (when the step is written)."""
        t, f0, f1, vf0, vf1, df0, df1, vdf0, vdf1 = values
        fs, var_fs, dfs, var_dfs = [f0, f1], [vf0, vf1], [df0, df1], [vdf0, vdf1]
        mu = fit_quadratic(t, fs, dfs, var_fs, var_dfs)
        alpha = get_alpha(mu, t)
        self.fit_output[start] = {
            "t": t,
            "f": fs,
            "df": dfs,
            "var_f": var_fs,
            "var_df": var_dfs,
            "mu": None if mu is None else [float(m) for m in mu],
            "alpha": alpha,
        }
        self._fresh_fit.append(start)
        return alpha


def fit_quadratic(
    t: float, fs: list[float], dfs: list[float], fs_var: list[float], dfs_var: list[float]
) -> np.ndarray | None:
    """Weighted least-squares fit of ``q(x) = c₀ + c₁x + c₂x²`` to ``q(0) = f₀``,
    ``q(t) = f_t``, ``q'(0) = df₀``, ``q'(t) = df_t`` with the given variances; ``[c₀, c₁, c₂]``
    or ``None`` if the system is singular."""
    phi = np.array([[1, 0, 0], [1, t, t**2], [0, 1, 0], [0, 1, 2 * t]], dtype=np.float64).T
    eps = 1e-10
    if 0 in fs_var:
        warnings.warn("The variance of f is 0, using a small value instead.", stacklevel=2)
        fs_var = [eps if v == 0 else v for v in fs_var]
    if 0 in dfs_var:
        warnings.warn("The variance of df is 0, using a small value instead.", stacklevel=2)
        dfs_var = [eps if v == 0 else v for v in dfs_var]
    if t == 0.0:
        warnings.warn("The two observations were (almost) at the same point.", stacklevel=2)
    try:
        lam_inv = np.linalg.inv(np.diag(list(fs_var) + list(dfs_var)))
        y = np.array(list(fs) + list(dfs), dtype=np.float64)
        return np.linalg.inv(phi @ lam_inv @ phi.T) @ phi @ lam_inv @ y
    except np.linalg.LinAlgError:
        warnings.warn(
            "Couldn't compute a quadratic fit due to Singular matrix, returning None",
            stacklevel=2,
        )
        return None


def get_alpha(mu: np.ndarray | None, t: float) -> float | None:
    """``α = 2t/ᾱ − 1`` with ``ᾱ = −c₁/c₂``; ``−1`` for a concave fit (or ``t = 0`` without
    fit), ``None`` if there is no fit."""
    if mu is None:
        return -1.0 if t == 0.0 else None
    if mu[2] < 0:
        return -1.0
    alpha_bar = -mu[1] / mu[2]
    return float((2 * t) / alpha_bar - 1)
