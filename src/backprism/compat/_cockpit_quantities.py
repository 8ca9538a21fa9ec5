"""Cockpit 1.0 names below ``cockpit.quantities`` that need more than an alias.

* ``cockpit.quantities.bin_adaptation``: the policies take Cockpit's extension point
  ``_get_abs_max(global_step, params, batch_loss, range) -> float`` (a subclass that overrides it
  decides the limits ``±(1 + padding)·max(min_size/2, value)`` itself; the monitor then computes
  no per-sample gradient maximum for it);
* ``cockpit.quantities.alpha``: the helpers of Cockpit's α computation
  (``_projected_gradient``, ``_exact_variance``, ``_fit_quadratic``, ``_get_alpha``,
  ``_root_sum_of_squares``), which custom α variants reuse.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from backprism.compat._vivit_extras import ParameterHook
from backprism.monitor.quantities import bin_adaptation as _bins
from backprism.monitor.quantities.alpha import fit_quadratic, get_alpha

__all__ = [
    "BinAdaptation",
    "GradAbsMax",
    "NoAdaptation",
    "ParamAbsMax",
    "_exact_variance",
    "_fit_quadratic",
    "_get_alpha",
    "_projected_gradient",
    "_root_sum_of_squares",
]

BinAdaptation = _bins.BinAdaptation
NoAdaptation = _bins.NoAdaptation


class _CockpitAbsMax(_bins._AbsMax):
    """An absolute-maximum policy whose maximum a subclass may compute with Cockpit's
    ``_get_abs_max(global_step, params, batch_loss, range)``."""

    def _custom_abs_max(self) -> bool:
        """Whether a subclass overrides :meth:`_get_abs_max`."""
        own = next(c for c in type(self).__mro__ if "_get_abs_max" in c.__dict__)
        return own not in (GradAbsMax, ParamAbsMax)

    def compute(
        self, global_step: int, params: list[Tensor], grad_abs_max: Any, range: Any
    ) -> tuple[Any, Any]:
        self._cockpit_call = (global_step, range)
        return super().compute(global_step, params, grad_abs_max, range)

    def _abs_max(self, params: list[Tensor], grad_abs_max: Any) -> Any:
        if self._custom_abs_max():
            from backprism.compat.cockpit import CockpitCTX

            step, rng = self._cockpit_call
            loss = CockpitCTX.INFO.get(step, {}).get("loss")
            return float(self._get_abs_max(step, params, loss, rng))
        return super()._abs_max(params, grad_abs_max)

    def _get_abs_max(
        self, global_step: int, params: list[Tensor], batch_loss: Any, range: Any
    ) -> float:
        raise NotImplementedError


class GradAbsMax(_CockpitAbsMax, _bins.GradAbsMax):
    """Limits ``±(1 + padding)·max(min_size/2, max |∇ℓₙ|)`` from the individual gradients
    (Cockpit's ``GradAbsMax``)."""

    @property  # type: ignore[override]
    def needs_grad_batch(self) -> bool:
        """The monitor computes ``max |∇ℓₙ|`` unless a subclass overrides ``_get_abs_max``."""
        return not self._custom_abs_max()

    def _get_abs_max(
        self, global_step: int, params: list[Tensor], batch_loss: Any, range: Any
    ) -> float:
        """``max |∇ℓₙ|`` is computed by the monitor during the backward pass; a subclass
        overriding this method computes it itself."""
        raise NotImplementedError(
            "GradAbsMax gets max |∇ℓₙ| from the monitor; override _get_abs_max to compute it"
        )


class ParamAbsMax(_CockpitAbsMax, _bins.ParamAbsMax):
    """Limits ``±(1 + padding)·max(min_size/2, max |θ|)`` from the parameter values
    (Cockpit's ``ParamAbsMax``)."""

    def _get_abs_max(
        self, global_step: int, params: list[Tensor], batch_loss: Any, range: Any
    ) -> float:
        """``max |θ|`` over all parameters."""
        return float(max(p.detach().abs().max() for p in params))


# -- Cockpit's α helpers ------------------------------------------------------------------------
def _root_sum_of_squares(values: Iterable[float]) -> float:
    """``√(Σ xᵢ²)`` of a list of floats."""
    return math.sqrt(sum(float(v) ** 2 for v in values))


def _projected_gradient(u: Sequence[Tensor], v: Sequence[Tensor]) -> float:
    """Length of the projection of ``u`` onto the direction ``v`` (both lists of tensors, one
    per parameter): ``⟨u, v⟩ / ‖v‖``."""
    dot = sum(float(torch.sum(a * b)) for a, b in zip(u, v))
    return dot / _root_sum_of_squares(float(b.norm(2)) for b in v)


def _exact_variance(grads: Sequence[Iterable[Tensor]], search_dir: Sequence[Tensor]) -> float:
    """Sample variance (``ddof=1``) over the batch of the individual gradients projected onto
    ``search_dir``; ``grads`` holds per parameter the individual gradients (e.g. ``[N, *p]``)."""
    per_sample = [
        [g for g in sample if g is not None] for sample in itertools.zip_longest(*grads)
    ]
    projections = [_projected_gradient(sample, search_dir) for sample in per_sample]
    return float(np.var(projections, ddof=1))


def _fit_quadratic(
    t: float, fs: list[float], dfs: list[float], fs_var: list[float], dfs_var: list[float]
) -> np.ndarray | None:
    """Cockpit's noisy quadratic fit ``[c₀, c₁, c₂]`` to ``f(0), f(t), f'(0), f'(t)`` (see
    :func:`backprism.monitor.quantities.alpha.fit_quadratic`)."""
    return fit_quadratic(t, fs, dfs, fs_var, dfs_var)


def _get_alpha(mu: Any, t: float) -> float | None:
    """Cockpit's local step size α from the fit ``mu`` and step length ``t`` (see
    :func:`backprism.monitor.quantities.alpha.get_alpha`)."""
    return get_alpha(mu, t)


# -- Cockpit's extension hooks (cockpit.quantities.hooks.base, .utils_transforms) -------------
class ModuleExtensionHook(ParameterHook):
    """Cockpit's hook acting on a module right after the extensions ran on it (the monitor runs
    a quantity's ``extension_hooks`` per module): ``module_hook(param, module)`` runs once per
    trainable parameter of a leaf module, and a non-``None`` result is stored under
    ``savefield`` on the parameter (``savefield`` and storing as ViViT's hook, whose base this
    shares). One instance serves one backward pass."""

    def module_hook(self, param: Tensor, module: torch.nn.Module) -> Any:
        raise NotImplementedError

    def __call__(self, module: torch.nn.Module) -> None:
        for param in module.parameters():
            if self.should_run_hook(param, module):
                self.run_hook(param, module)

    def should_run_hook(self, param: Tensor, module: torch.nn.Module) -> bool:
        """Once per trainable parameter, on leaf modules only."""
        has_children = next(iter(module.children()), None) is not None
        return not has_children and super().should_run_hook(param, module)

    def run_hook(self, param: Tensor, module: torch.nn.Module) -> None:
        self._save(self.module_hook(param, module), param)
        self.processed.add(id(param))


class ParameterExtensionHook(ModuleExtensionHook):
    """:class:`ModuleExtensionHook` whose action needs the parameter only:
    ``param_hook(param)`` (declared by the shared base)."""

    def module_hook(self, param: Tensor, module: torch.nn.Module) -> Any:
        return self.param_hook(param)


#: the attribute under which :class:`BatchGradTransformsHook` stores its results
GRAD_BATCH_TRANSFORMS = "grad_batch_transforms"


class BatchGradTransformsHook(ParameterExtensionHook):
    """Applies ``transforms`` (``{name: fn(grad_batch)}``) to each parameter's per-sample
    gradients and stores ``{name: result}`` as ``param.grad_batch_transforms`` (needs
    ``BatchGrad`` among the step's extensions). Cockpit merges the hooks of all quantities of a
    step into one (:meth:`merge`), as does ``backprism.compat.cockpit.Cockpit``."""

    def __init__(self, transforms: dict[str, Any], savefield: str | None = None) -> None:
        super().__init__(savefield=savefield)
        self._transforms = dict(transforms)

    def param_hook(self, param: Tensor) -> None:
        grad_batch = param.grad_batch  # type: ignore[attr-defined]
        setattr(
            param,
            GRAD_BATCH_TRANSFORMS,
            {key: fn(grad_batch) for key, fn in self._transforms.items()},
        )

    @staticmethod
    def merge(hooks: Sequence[BatchGradTransformsHook]) -> BatchGradTransformsHook:
        """One hook with the transforms of all ``hooks``; ``ValueError`` for one name given
        different functions."""
        merged: dict[str, Any] = {}
        for hook in hooks:
            for key, fn in hook._transforms.items():
                if key in merged and merged[key] is not fn:
                    raise ValueError(
                        f"BatchGradTransformsHook: the transform {key!r} is given twice with "
                        "different functions"
                    )
                merged[key] = fn
        return BatchGradTransformsHook(merged)


class EngineTransformsHook(BatchGradTransformsHook):
    """A merged :class:`BatchGradTransformsHook` that also fills ``grad_batch_transforms`` with
    entries the engine computed in the same backward pass (``readers``: ``{name: fn(param)}``,
    returning the value — the engine's own tensor, no copy — or ``None`` where the parameter has
    none), for the parameters whose ids are in ``params``; built by ``Cockpit`` for the built-in
    quantities, which Cockpit 1.0 feeds through this dictionary. A transform given for a name
    that also has a reader is applied only if it is not the standard one of that name (then the
    engine's value stands in for it without building ``grad_batch``)."""

    def __init__(
        self,
        transforms: dict[str, Any],
        readers: dict[str, Callable[[Tensor], Any]],
        params: Iterable[int],
    ) -> None:
        super().__init__(transforms)
        self._readers = dict(readers)
        self._params = set(params)

    def param_hook(self, param: Tensor) -> None:
        out: dict[str, Any] = {}
        if id(param) in self._params:
            for key, read in self._readers.items():
                value = read(param)
                if value is not None:
                    out[key] = value
        todo = {
            key: fn
            for key, fn in self._transforms.items()
            if not (key in out and STANDARD_TRANSFORMS.get(key) is fn)
        }
        if todo:
            grad_batch = param.grad_batch  # type: ignore[attr-defined]
            out.update({key: fn(grad_batch) for key, fn in todo.items()})
        if out or self._transforms:
            setattr(param, GRAD_BATCH_TRANSFORMS, out)


def batch_l2_transform(batch_grad: Tensor) -> Tensor:
    """``‖gₙ‖²`` per sample from the per-sample gradients ``[N, ...]``."""
    return batch_grad.flatten(1).square().sum(1)


def batch_dot_transform(batch_grad: Tensor) -> Tensor:
    """``gₙᵀgₘ`` for all pairs ``[N, N]``."""
    flat = batch_grad.flatten(1)
    return flat @ flat.t()


def sum_grad_squared_transform(batch_grad: Tensor) -> Tensor:
    """``Σₙ gₙ²`` elementwise."""
    return batch_grad.square().sum(0)


def get_first_n_alphabet(n: int) -> str:
    """The first ``n`` lowercase letters."""
    return "abcdefghijklmnopqrstuvwxyz"[:n]


def BatchGradTransformsHook_BatchL2Grad() -> BatchGradTransformsHook:
    return BatchGradTransformsHook({"batch_l2": batch_l2_transform})


def BatchGradTransformsHook_BatchDotGrad() -> BatchGradTransformsHook:
    return BatchGradTransformsHook({"batch_dot": batch_dot_transform})


def BatchGradTransformsHook_SumGradSquared() -> BatchGradTransformsHook:
    return BatchGradTransformsHook({"sum_grad_squared": sum_grad_squared_transform})


#: the transforms of Cockpit's named hooks, whose values the engine also computes
STANDARD_TRANSFORMS: dict[str, Callable[[Tensor], Tensor]] = {
    "batch_l2": batch_l2_transform,
    "batch_dot": batch_dot_transform,
    "sum_grad_squared": sum_grad_squared_transform,
}
