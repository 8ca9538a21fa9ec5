r"""GGN eigenvalues, eigenvectors, directional derivatives and damped Newton steps.

Notation (ViViT's conventions). Mini-batch of ``N`` samples, mean loss ``L = (1/N) Σₙ ℓₙ``.
``V`` (``[K, N, *θ]``, ``V[k, n] = Jₙᵀ Sₙ[:, k] / √N``) is the GGN square root of one parameter
group; sub-sampling keeps the ``N'`` samples ``𝒮`` and rescales so that the approximated GGN is
the mean over the kept samples:

.. math::
    Ṽ = \sqrt{N/N'}\, V_{:, 𝒮}, \qquad
    \mathrm{GGN}_{𝒮} = Ṽ Ṽ^\top = \frac{1}{N'} \sum_{n ∈ 𝒮} J_n^\top ∇^2ℓ_n J_n .

MC (``mc_samples = M ≥ 1``) replaces ``Sₙ`` by ``M`` sampled columns (``E[Ṽ Ṽᵀ] = GGN_𝒮``).

* Gram matrix ``G̃ = ṼᵀṼ`` (``[KN', KN']``), accumulated parameter by parameter during the
  backward pass; its eigenvalues ``λ₁ ≤ … ≤ λ_{KN'}`` (ascending) are the non-zero eigenvalues
  of ``GGN_𝒮`` padded with zeros.
* Eigenvectors ``e_d = Ṽ u_d / √λ_d`` for Gram eigenvectors ``u_d``, returned in parameter
  format with a leading axis (``[D, *θ]`` per parameter) and normalised to unit length.
* First-order directional derivatives ``γ[n, d] = e_dᵀ ∇ℓₙ`` for the gradient samples
  (``[N_grad, D]``; ``∇ℓₙ = N · grad_batch[n]``) and second-order ones
  ``λ[n, d] = e_dᵀ (Jₙᵀ∇²ℓₙJₙ) e_d = N' λ_d Σₖ ũ_d[k, n]²`` with ``ũ_d = G̃ u_d / λ_d``
  (``[N', D]``, mean over ``n`` equals ``λ_d``).
* Directionally damped Newton step ``s = Σ_d −γ̄_d / (λ̄_d + δ_d) · e_d`` with the means
  ``γ̄_d = mean_n γ[n, d]``, ``λ̄_d = mean_n λ[n, d]`` and dampings
  ``δ = group['damping'](evals, gram_evecs, gammas, lambdas)``.

Usage (the loss must use ``reduction='mean'``)::

    comp = EighComputation()
    group = {"params": list(model.parameters()), "criterion": lambda ev: [ev.numel() - 1]}
    with backprism.collect(*comp.get_extensions(),
                           extension_hook=comp.get_extension_hook([group])):
        loss.backward()
    evals, evecs = comp.get_result(group)
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from backprism.engine.backward import current_pass
from backprism.extensions.base import Extension, check_subsampling
from backprism.extensions.firstorder import BatchGrad
from backprism.spectral.factors import GramFactor, SpectralFactorExtension

__all__ = [
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "EighComputation",
    "EigvalshComputation",
]


#: CPU threads for the Gram eigendecomposition (``None``: torch's setting). LAPACK's symmetric
#: tridiagonalisation synchronises its threads once per row; when the cores are shared (more
#: runnable threads than cores) every synchronisation can cost a scheduler time slice, and on a
#: 2-core machine with other work ``eigh`` of a 1280 × 1280 matrix took 20 s with 2 threads
#: against 0.24 s with one. One thread loses at most the parallel speed-up on an idle machine.
EIGH_THREADS: int | None = 1


@contextlib.contextmanager
def _eigh_threads() -> Iterator[None]:
    """Run the block with ``EIGH_THREADS`` CPU threads (restored afterwards)."""
    old = torch.get_num_threads()
    if EIGH_THREADS is None or old <= EIGH_THREADS:
        yield
        return
    torch.set_num_threads(EIGH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _Accumulator:
    """Per-group accumulation during one backward pass."""

    def __init__(self) -> None:
        self.gram: Tensor | None = None
        self.vtg: Tensor | None = None  # Vᵀ grad_batch: [KN', N_grad]
        self.factors: dict[int, GramFactor] = {}
        self.done: set[int] = set()
        self.batch_size = 0
        self.num_samples = 0
        self.num_cols = 0


def _check_groups(param_groups: Any, keys: Sequence[str]) -> list[dict]:
    if not isinstance(param_groups, (list, tuple)) or not param_groups:
        raise TypeError(
            "param_groups must be a non-empty list of dicts in torch.optim format, e.g. "
            "[{'params': list(model.parameters()), 'criterion': ...}]"
        )
    seen: dict[int, int] = {}
    for i, group in enumerate(param_groups):
        if not isinstance(group, dict):
            raise TypeError(f"param_groups[{i}] must be a dict, got {type(group).__name__}")
        for key in ("params", *keys):
            if key not in group:
                raise KeyError(f"param_groups[{i}] has no {key!r} entry (required here)")
        for key in keys:
            if not callable(group[key]):
                raise TypeError(f"param_groups[{i}][{key!r}] must be callable")
        params = group["params"]
        if isinstance(params, Tensor) or not isinstance(params, (list, tuple)):
            raise TypeError(
                f"param_groups[{i}]['params'] must be a list of parameters (materialise "
                "generators with list(...))"
            )
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"param_groups[{i}]['params'] holds a {type(p).__name__}")
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is in param_groups[{seen[id(p)]}] "
                    f"and param_groups[{i}]: every parameter may belong to one group only"
                )
            seen[id(p)] = i
    return list(param_groups)


def _select(criterion: Callable[[Tensor], Any], evals: Tensor) -> list[int]:
    keep = criterion(evals)
    if isinstance(keep, Tensor):
        keep = keep.tolist()
    keep = [int(k) for k in keep]
    n = evals.numel()
    bad = [k for k in keep if not -n <= k < n]
    if bad:
        raise IndexError(f"'criterion' returned indices {bad} out of range for {n} eigenvalues")
    if len(set(k % n for k in keep)) != len(keep):
        raise ValueError(f"'criterion' returned repeated indices {keep}")
    return keep


def _safe(evals: Tensor) -> Tensor:
    """Eigenvalues as denominators: clamped to ``eps·max(1, max|λ|)`` so that (numerically)
    zero or negative ones, which trigger the ``warn_small_eigvals`` warning, stay finite."""
    if evals.numel() == 0:
        return evals
    tiny = torch.finfo(evals.dtype).eps * max(1.0, float(evals.abs().max()))
    return evals.clamp_min(tiny)


class _SpectralComputation:
    """Shared machinery: extensions, the per-module hook, group accumulation."""

    _needs_grad = False
    _needs_vectors = False  # keep the factors to map Gram vectors to parameter space
    _needs_eigenvectors = True  # Gram eigenvectors (all computations but eigenvalues only)
    _group_keys: tuple[str, ...] = ()

    def __init__(
        self,
        subsampling_ggn: Sequence[int] | None,
        mc_samples: int,
        verbose: bool,
        warn_small_eigvals: float,
        subsampling_grad: Sequence[int] | None = None,
    ) -> None:
        self._factor_ext = SpectralFactorExtension(subsampling_ggn, mc_samples)
        self._subsampling_ggn = self._factor_ext.subsampling
        self._subsampling_grad = check_subsampling(subsampling_grad)
        self._mc_samples = mc_samples
        self._verbose = bool(verbose)
        if warn_small_eigvals < 0:
            raise ValueError(f"warn_small_eigvals must be non-negative, got {warn_small_eigvals}")
        self._warn_small_eigvals = float(warn_small_eigvals)
        self._results: dict[int, Any] = {}
        # groups seen in the latest backward pass, still to be finished: id -> (group, acc)
        self._pending: dict[int, tuple[dict, _Accumulator]] = {}

    # -- extensions ---------------------------------------------------------------------------
    def get_extension(self) -> Extension:
        """The extension storing the GGN square-root factor (pass it to ``backprism.collect``)."""
        return self._factor_ext

    def get_extensions(self) -> list[Extension]:
        """All extensions this computation needs, for ``backprism.collect(*...)``."""
        exts: list[Extension] = [self._factor_ext]
        if self._needs_grad:
            exts.append(BatchGrad(subsampling=self._subsampling_grad))
        return exts

    # -- hook ---------------------------------------------------------------------------------
    def get_extension_hook(self, param_groups: list[dict]) -> Callable[[nn.Module], None]:
        """The ``extension_hook`` that accumulates the Gram matrix per group and finishes a group
        once all its parameters are processed; the stored factors are deleted as consumed.

        Args:
            param_groups: ``torch.optim`` style groups; one group = one GGN block (``[{'params':
                list(model.parameters()), ...}]`` for the full GGN, ``[{'params': [p], ...} for
                p in model.parameters()]`` for a per-parameter block-diagonal approximation).
        """
        groups = _check_groups(param_groups, self._group_keys)
        owner = {id(p): g for g in groups for p in g["params"]}
        state: dict[str, Any] = {"bs": None}
        savefield = self._factor_ext.savefield

        def extension_hook(module: nn.Module) -> None:
            bs = current_pass()
            if bs is None:
                return
            if state["bs"] is None or state["bs"]() is not bs:
                state["bs"] = weakref.ref(bs)
                self._new_pass(groups, bs)
            for p in module.parameters():
                if id(p) in owner and hasattr(p, savefield):
                    self._process(owner[id(p)], p)
                elif hasattr(p, savefield):
                    delattr(p, savefield)

        return extension_hook

    def _new_pass(self, groups: list[dict], bs: Any) -> None:
        for rec in bs.loss_records:
            reduction = getattr(rec.module, "reduction", "mean")
            if reduction != "mean":
                raise ValueError(
                    f"{type(self).__name__} needs a loss with reduction='mean' (ViViT's "
                    f"convention), got {type(rec.module).__name__}(reduction={reduction!r})"
                )
        for g in groups:
            self._results.pop(id(g), None)
            self._pending[id(g)] = (g, _Accumulator())

    def _log(self, msg: str) -> None:
        if self._verbose:
            print(f"[{type(self).__name__}] {msg}")

    def _process(self, group: dict, p: Tensor) -> None:
        """Consume ``p``'s factor (and per-sample gradient) into its group's accumulator."""
        savefield = self._factor_ext.savefield
        if self._needs_grad and not hasattr(p, "grad_batch"):
            return  # per-sample gradient not there yet: the module's own hook comes later
        entry = self._pending.get(id(group))
        if entry is None:
            return
        acc = entry[1]
        f: GramFactor = getattr(p, savefield)
        delattr(p, savefield)
        self._log(f"param {tuple(p.shape)}: Gram block, delete '{savefield}'")
        if acc.gram is not None and acc.gram.shape[0] != f.num_cols * f.num_samples:
            raise RuntimeError(
                "parameters of one group received different numbers of GGN square-root columns "
                f"({acc.num_cols} vs {f.num_cols}); they must all be reached by the same losses"
            )
        if self._needs_grad:
            gb = p.grad_batch
            del p.grad_batch
            gram, vtg = f.gram_tmatmul(gb)
            acc.vtg = vtg if acc.vtg is None else acc.vtg.add_(vtg)
            del gb, vtg
        else:
            gram = f.gram()
        acc.gram = gram if acc.gram is None else acc.gram.add_(gram)
        del gram
        acc.batch_size, acc.num_samples, acc.num_cols = f.batch_size, f.num_samples, f.num_cols
        if self._needs_vectors:
            acc.factors[id(p)] = f
        acc.done.add(id(p))
        expected = {id(q) for q in group["params"] if q.requires_grad}
        if expected <= acc.done:
            self._finish(group)

    def _finish(self, group: dict) -> None:
        _, acc = self._pending.pop(id(group))
        if acc.gram is None:
            raise RuntimeError(
                f"{type(self).__name__}: no parameter of the group received GGN factors; was "
                "the loss computed from this group's parameters with extended modules?"
            )
        self._log(f"group {id(group)}: eigendecomposition of a {tuple(acc.gram.shape)} Gram matrix")
        scale = acc.batch_size / acc.num_samples
        gram = acc.gram.mul_(scale) if scale != 1 else acc.gram
        acc.gram = None
        with _eigh_threads():
            if self._needs_eigenvectors:
                evals, evecs = torch.linalg.eigh(gram)
            else:  # eigenvalues only: no eigenvector back-transformation
                evals, evecs = torch.linalg.eigvalsh(gram), gram.new_empty(gram.shape[0], 0)
        self._results[id(group)] = self._group_result(group, acc, gram, evals, evecs, scale)

    def _complete_pending(self, group: dict) -> None:
        """Finish ``group`` after the backward pass if some of its parameters never got a hook
        call (no factor: they are treated as not influencing the loss)."""
        entry = self._pending.get(id(group))
        if entry is None:
            return
        savefield = self._factor_ext.savefield
        for p in group["params"]:
            if hasattr(p, savefield):
                if self._needs_grad and not hasattr(p, "grad_batch"):
                    raise RuntimeError("per-sample gradients missing for a parameter of the group")
                self._process(group, p)
                if id(group) not in self._pending:
                    return
        self._finish(group)

    def _group_result(
        self, group: dict, acc: _Accumulator, gram: Tensor, evals: Tensor, evecs: Tensor,
        scale: float,
    ) -> Any:
        raise NotImplementedError

    # -- shared maths -------------------------------------------------------------------------
    def _selected(self, group: dict, evals: Tensor, evecs: Tensor) -> tuple[Tensor, Tensor]:
        """The eigenpairs ``group['criterion']`` picks; warns about small selected ones."""
        keep = _select(group["criterion"], evals)
        evals, evecs = evals[keep], evecs[:, keep]
        if evals.numel() and bool((evals.abs() < self._warn_small_eigvals).any()):
            warnings.warn(
                f"{type(self).__name__}: selected eigenvalues below warn_small_eigvals="
                f"{self._warn_small_eigvals:g} (smallest {float(evals.abs().min()):.3g}); the "
                "mapping to parameter space divides by their square root and is numerically "
                "unstable. Use a more restrictive 'criterion'.",
                UserWarning,
                stacklevel=3,
            )
        return evals, evecs

    @staticmethod
    def _to_params(group: dict, acc: _Accumulator, u: Tensor) -> list[Tensor]:
        """``Ṽ``-products ``V u`` per group parameter (``[D, *p]``; zeros without a factor)."""
        out = []
        for p in group["params"]:
            f = acc.factors.get(id(p))
            if f is None:
                out.append(u.new_zeros(u.shape[1], *p.shape))
            else:
                out.append(f.matmul(u).to(p.dtype))
        return out

    def _directional(
        self, acc: _Accumulator, gram: Tensor, evals: Tensor, evecs: Tensor, scale: float
    ) -> tuple[Tensor, Tensor]:
        """``γ`` (``[N_grad, D]``) and ``λ`` (``[N', D]``) for the kept Gram eigenpairs."""
        k, n_ggn = acc.num_cols, acc.num_samples
        sqrt_evals = _safe(evals).sqrt()
        assert acc.vtg is not None
        gammas = (acc.batch_size * math.sqrt(scale)) * (acc.vtg.t() @ evecs) / sqrt_evals
        ge = (gram @ evecs).reshape(k, n_ggn, -1)
        lambdas = n_ggn * ge.square().sum(0) / _safe(evals)
        return gammas, lambdas

    # -- results ------------------------------------------------------------------------------
    def get_result(self, group: dict) -> Any:
        """Result for ``group`` after the backward pass (see the subclass)."""
        if id(group) in self._pending:
            self._complete_pending(group)
        try:
            return self._results[id(group)]
        except KeyError:
            raise KeyError(
                f"{type(self).__name__}: no result for this group; pass the same group dicts "
                "to get_extension_hook and run loss.backward() inside backprism.collect(...)"
            ) from None


class EigvalshComputation(_SpectralComputation):
    """GGN eigenvalues (ascending) per parameter group.

    ``get_result(group)`` returns the ``KN'`` eigenvalues of the Gram matrix ``G̃ = ṼᵀṼ``:
    the non-zero GGN eigenvalues, padded with (numerically) zero ones.

    Args:
        subsampling: indices of the samples used for the GGN (default: all), see
            :mod:`backprism.spectral.computations` for the ``N/N'`` scaling.
        mc_samples: ``0`` exact GGN; ``M ≥ 1`` MC approximation with ``M`` sampled labels.
        verbose: print what happens during the backward pass.
    """

    _needs_eigenvectors = False

    def __init__(
        self, subsampling: Sequence[int] | None = None, mc_samples: int = 0, verbose: bool = False
    ) -> None:
        super().__init__(subsampling, mc_samples, verbose, 0.0)

    def _group_result(self, group, acc, gram, evals, evecs, scale) -> Tensor:
        return evals


class EighComputation(_SpectralComputation):
    """GGN eigenpairs per parameter group; ``'criterion'`` picks the eigenvectors.

    ``get_result(group)`` returns ``(evals, evecs)``: the selected eigenvalues (ascending, as
    ordered by the criterion's indices) and one ``[D, *p.shape]`` tensor per group parameter;
    ``[v[d] for v in evecs]`` is the unit eigenvector of ``evals[d]``, ``GGN e = λ e``.

    Args:
        subsampling, mc_samples, verbose: as :class:`EigvalshComputation`.
        warn_small_eigvals: warn when a selected eigenvalue's magnitude is below this.
    """

    _needs_vectors = True
    _group_keys = ("criterion",)

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
    ) -> None:
        super().__init__(subsampling, mc_samples, verbose, warn_small_eigvals)

    def _group_result(self, group, acc, gram, evals, evecs, scale):
        evals, evecs = self._selected(group, evals, evecs)
        # e_d = Ṽ u_d / √λ_d has unit norm; normalising Ṽ u_d directly avoids dividing by
        # √λ_d (finite results for (numerically) zero eigenvalues)
        vecs = self._to_params(group, acc, evecs)
        norm = sum(v.flatten(1).square().sum(1) for v in vecs).sqrt()
        norm = torch.where(norm > 0, norm, torch.ones_like(norm))
        vecs = [v / norm.reshape(-1, *([1] * (v.dim() - 1))) for v in vecs]
        return evals, vecs


class DirectionalDerivativesComputation(_SpectralComputation):
    """First- and second-order directional derivatives along GGN eigenvectors.

    ``get_result(group)`` returns ``(gammas, lambdas)`` of shapes ``[N_grad, D]`` and
    ``[N', D]``: ``γ[n, d] = e_dᵀ∇ℓₙ`` and ``λ[n, d] = e_dᵀ GGNₙ e_d`` (see the module
    docstring), ``D`` the directions selected by ``'criterion'``.

    Args:
        subsampling_grad: samples whose gradients give ``γ`` (default: all).
        subsampling_ggn: samples of the GGN, its eigenvectors and ``λ`` (default: all).
        mc_samples_ggn: ``0`` exact GGN, ``M ≥ 1`` MC approximation.
        verbose: print what happens during the backward pass.
        warn_small_eigvals: warn when a selected eigenvalue's magnitude is below this.
    """

    _needs_grad = True
    _group_keys = ("criterion",)

    def __init__(
        self,
        subsampling_grad: Sequence[int] | None = None,
        subsampling_ggn: Sequence[int] | None = None,
        mc_samples_ggn: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
    ) -> None:
        super().__init__(
            subsampling_ggn, mc_samples_ggn, verbose, warn_small_eigvals, subsampling_grad
        )

    def _group_result(self, group, acc, gram, evals, evecs, scale):
        evals, evecs = self._selected(group, evals, evecs)
        return self._directional(acc, gram, evals, evecs, scale)


class DirectionalDampedNewtonComputation(_SpectralComputation):
    r"""Directionally damped Newton steps along GGN eigenvectors.

    .. math:: s = \sum_d \frac{-\bar γ_d}{\bar λ_d + δ_d} e_d,\quad
              \bar γ_d = \frac{1}{N_\text{grad}}\sum_n γ[n, d],\quad
              \bar λ_d = \frac{1}{N'}\sum_n λ[n, d]

    Groups need ``'criterion'`` and ``'damping'``; the latter is called as
    ``damping(evals, gram_evecs, gammas, lambdas)`` (``[D]``, ``[KN', D]``, ``[N_grad, D]``,
    ``[N', D]``) and returns ``δ`` (``[D]`` or a scalar). ``get_result(group)`` returns the step
    in parameter format: one tensor per ``group['params']`` entry, of the parameter's shape.

    Args: as :class:`DirectionalDerivativesComputation`.
    """

    _needs_grad = True
    _needs_vectors = True
    _group_keys = ("criterion", "damping")

    def __init__(
        self,
        subsampling_grad: Sequence[int] | None = None,
        subsampling_ggn: Sequence[int] | None = None,
        mc_samples_ggn: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
    ) -> None:
        super().__init__(
            subsampling_ggn, mc_samples_ggn, verbose, warn_small_eigvals, subsampling_grad
        )
        #: per group id: (evals, gamma_mean, lambda_mean, damping, coefficients) of the last step
        self._stats: dict[int, tuple[Tensor, Tensor, Tensor, Tensor, Tensor]] = {}

    def _group_result(self, group, acc, gram, evals, evecs, scale):
        evals, evecs = self._selected(group, evals, evecs)
        gammas, lambdas = self._directional(acc, gram, evals, evecs, scale)
        delta = group["damping"](evals, evecs, gammas, lambdas)
        delta = torch.as_tensor(delta, dtype=evals.dtype, device=evals.device)
        if delta.dim() > 1 or (delta.dim() == 1 and delta.numel() != evals.numel()):
            raise ValueError(
                f"'damping' must return a scalar or a tensor of shape [{evals.numel()}], got "
                f"shape {tuple(delta.shape)}"
            )
        gbar, lbar = gammas.mean(0), lambdas.mean(0)
        coeff = -gbar / (lbar + delta)
        self._stats[id(group)] = (evals, gbar, lbar, delta.expand_as(evals), coeff)
        u = evecs @ (coeff * math.sqrt(scale) / _safe(evals).sqrt())
        return [v[0] for v in self._to_params(group, acc, u[:, None])]
