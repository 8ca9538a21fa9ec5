"""ViViT 1.0 names beyond the spectral computations: the Gram-matrix extension hooks and the
utilities ``vivit.utils.gram``, ``vivit.utils.eig``, ``vivit.utils.checks``.

The hooks are used as ``extension_hook`` of ``backprism.compat.backpack.backpack`` (or
``backprism.collect``) with the matching extension active:

* ``GramBatchGrad`` / ``CenteredGramBatchGrad`` with ``BatchGrad``: ``get_result()`` is the
  ``[N, N]`` matrix of pairwise scalar products of the (centered) individual gradients
  ``param.grad_batch``, summed over parameters (``layerwise=True`` also stores each parameter's
  ``[N, N]`` contribution in ``param.<savefield>``);
* ``CenteredBatchGrad`` with ``BatchGrad``: ``param.centered_grad_batch = grad_batch − mean``;
* ``GramSqrtGGNExact`` / ``GramSqrtGGNMC`` with ``SqrtGGNExact`` / ``SqrtGGNMC``:
  ``get_result()`` is the ``[C·N, C·N]`` Gram matrix ``Vᵀ V`` of the GGN square root ``V``
  (``param.sqrt_ggn_exact`` / ``sqrt_ggn_mc``, ``[C, N, *p]``).

As in ViViT, an instance is single-use (create a new one per backward pass).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter

__all__ = [
    "CenteredBatchGrad",
    "CenteredGramBatchGrad",
    "GramBatchGrad",
    "GramSqrtGGNExact",
    "GramSqrtGGNMC",
    "check_key_exists",
    "check_subsampling_unique",
    "check_unique_params",
    "pairwise_dot",
    "remove_zero_evals",
    "reshape_as_square",
    "shift_diag",
    "symeig",
    "symeig_psd",
]


# -- vivit.utils.gram ---------------------------------------------------------------------------
def reshape_as_square(tensor: Tensor) -> Tensor:
    """The elements of ``tensor`` as a square matrix ``[√numel, √numel]``."""
    dim = math.isqrt(tensor.numel())
    return tensor.reshape(dim, dim)


def pairwise_dot(tensor: Tensor, start_dim: int = 1, flatten: bool = True) -> Tensor:
    """Pairwise scalar products of the slices ``tensor[i₀, …, i_{start_dim−1}]``: shape
    ``[*d, *d]`` with ``d = tensor.shape[:start_dim]``, or (``flatten``) ``[∏d, ∏d]``."""
    lead = tensor.shape[:start_dim]
    flat = tensor.reshape(math.prod(lead), -1)
    gram = flat @ flat.transpose(0, 1)
    return gram if flatten else gram.reshape(*lead, *lead)


# -- vivit.utils.eig ----------------------------------------------------------------------------
def shift_diag(input: Tensor, shift: float, inplace: bool = False) -> Tensor:
    """``input`` with ``shift`` added to its diagonal (a copy unless ``inplace``)."""
    if shift == 0.0:
        return input
    result = input if inplace else input.clone()
    n = min(input.shape)
    result[range(n), range(n)] += shift
    return result


def _eigh(input: Tensor, eigenvectors: bool, upper: bool) -> tuple[Tensor, Tensor]:
    if input.dim() != 2:
        raise ValueError(f"Input must have dimension 2. Got {input.dim()}.")
    try:
        evals, evecs = torch.linalg.eigh(input, UPLO="U" if upper else "L")
    except RuntimeError as e:
        raise RuntimeError(f"Tensor contains NaNs: {bool(torch.isnan(input).any())}") from e
    if not eigenvectors:
        evecs = torch.empty(0, dtype=input.dtype, device=input.device)
    return evals, evecs


def remove_zero_evals(
    evals: Tensor, evecs: Tensor, atol: float = 1e-7, rtol: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """Drop the eigenpairs whose eigenvalue is close to zero (``torch.isclose`` with ``atol``,
    ``rtol``); ``evecs`` holds eigenvectors column-wise (or is empty)."""
    keep = ~torch.isclose(evals, torch.zeros_like(evals), rtol=rtol, atol=atol)
    return evals[keep], (evecs[:, keep] if evecs.numel() else evecs)


def symeig(
    input: Tensor,
    eigenvectors: bool = False,
    upper: bool = True,
    atol: float = 1e-7,
    rtol: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and, with ``eigenvectors``, column-wise eigenvectors of the
    symmetric 2d ``input`` (triangle ``upper``), without the pairs whose eigenvalue is ≈ 0."""
    evals, evecs = _eigh(input, eigenvectors, upper)
    return remove_zero_evals(evals, evecs, atol=atol, rtol=rtol)


def symeig_psd(
    input: Tensor,
    eigenvectors: bool = False,
    upper: bool = True,
    shift: float = 0.0,
    shift_inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of a symmetric positive semi-definite 2d ``input``, computed on
    ``input + shift·I`` (better conditioned) and shifted back."""
    if input.dim() != 2:
        raise ValueError(f"Input must have dimension 2. Got {input.dim()}.")
    shifted = shift_diag(input, shift, inplace=shift_inplace)
    evals, evecs = _eigh(shifted, eigenvectors, upper)
    if shift_inplace:
        shift_diag(shifted, -shift, inplace=True)
    return evals - shift, evecs


# -- vivit.utils.checks -------------------------------------------------------------------------
def check_key_exists(param_groups: list[dict], key: str) -> None:
    """``ValueError`` if a parameter group lacks ``key``."""
    if any(key not in group for group in param_groups):
        raise ValueError(f"At least one group is not specifying '{key}'.")


def check_unique_params(param_groups: list[dict]) -> None:
    """``ValueError`` if a parameter is in more than one group."""
    ids = [id(p) for group in param_groups for p in group["params"]]
    if len(set(ids)) != len(ids):
        raise ValueError("At least one parameter is in more than one group.")


def check_subsampling_unique(subsampling: list[int] | None) -> None:
    """``ValueError`` if ``subsampling`` repeats a sample index."""
    if subsampling is not None and len(set(subsampling)) != len(subsampling):
        raise ValueError("Detected repeated index in subsampling.")


# -- extension hooks ----------------------------------------------------------------------------
class ParameterHook:
    """ViViT's per-parameter extension hook: ``param_hook(param)`` runs on each parameter of a
    module right after the extension; a non-``None`` result is stored in ``param.<savefield>``."""

    def __init__(self, savefield: str | None = None) -> None:
        self.savefield = savefield
        self.processed: set[int] = set()

    def __call__(self, module: Module) -> None:
        for param in module.parameters():
            if self.should_run_hook(param, module):
                self.processed.add(id(param))
                self._save(self.param_hook(param), param)

    def should_run_hook(self, param: Parameter, module: Module) -> bool:
        """Once per trainable parameter (containers reach their children's parameters)."""
        return param.requires_grad and id(param) not in self.processed

    def param_hook(self, param: Parameter) -> Any:
        raise NotImplementedError

    def _save(self, value: Any, param: Parameter) -> None:
        """``param.<savefield> = value`` (also ``None``: the hook ran but keeps no result)."""
        if self.savefield is None:
            if value is not None:
                raise ValueError(
                    f"Hook has no savefield, but produced output of type {type(value)}."
                )
            return
        setattr(param, self.savefield, value)


class CenteredBatchGrad(ParameterHook):
    """Stores the individual gradients minus their batch mean, ``[N, *p]``, in
    ``param.<savefield>`` (needs ``BatchGrad``)."""

    _SAVEFIELD_GRAD_BATCH = "grad_batch"

    def __init__(self, savefield: str = "centered_grad_batch") -> None:
        super().__init__(savefield)

    def param_hook(self, param: Parameter) -> Tensor:
        grad_batch = getattr(param, self._SAVEFIELD_GRAD_BATCH)
        return grad_batch - grad_batch.mean(0)


class _GramHook(ParameterHook):
    """Sums the Gram matrices of a per-parameter factor over parameters."""

    source: str = ""
    start_dim: int = 1
    center: bool = False

    def __init__(self, savefield: str, layerwise: bool, free: bool) -> None:
        super().__init__(savefield)
        self._layerwise = layerwise
        self._free = free
        self._gram_mat: Tensor | None = None

    def param_hook(self, param: Parameter) -> Tensor | None:
        factor = getattr(param, self.source)
        if self.center:
            factor = factor - factor.mean(0)
        gram = pairwise_dot(factor.detach(), start_dim=self.start_dim)
        self._gram_mat = gram.clone() if self._gram_mat is None else self._gram_mat + gram
        if self._free:
            delattr(param, self.source)
        return gram if self._layerwise else None

    def get_result(self) -> Tensor | None:
        """The Gram matrix summed over all parameters seen in the backward pass."""
        return self._gram_mat


class GramBatchGrad(_GramHook):
    """``[N, N]`` Gram matrix ``⟨gᵢ, gⱼ⟩`` of the individual gradients as BatchGrad computes
    them (``1/N`` scaled for a mean-reduced loss); needs ``BatchGrad``."""

    source = "grad_batch"
    #: the attribute of the individual gradients the hook reads (ViViT's name)
    _SAVEFIELD_GRAD_BATCH = "grad_batch"

    def __init__(
        self, savefield: str = "gram_grad_batch", layerwise: bool = False,
        free_grad_batch: bool = False,
    ) -> None:
        super().__init__(savefield, layerwise, free_grad_batch)


class CenteredGramBatchGrad(GramBatchGrad):
    """``[N, N]`` Gram matrix of the individual gradients minus their mean; needs
    ``BatchGrad``."""

    center = True

    def __init__(
        self, savefield: str = "centered_gram_grad_batch", layerwise: bool = False,
        free_grad_batch: bool = False,
    ) -> None:
        super().__init__(savefield, layerwise, free_grad_batch)


class GramSqrtGGNExact(_GramHook):
    """``[C·N, C·N]`` Gram matrix ``Vᵀ V`` of the exact GGN square root; needs
    ``SqrtGGNExact``."""

    source = "sqrt_ggn_exact"
    start_dim = 2

    def __init__(
        self, savefield: str = "gram_sqrt_ggn_exact", layerwise: bool = False,
        free_sqrt_ggn: bool = False,
    ) -> None:
        super().__init__(savefield, layerwise, free_sqrt_ggn)


class GramSqrtGGNMC(_GramHook):
    """``[M·N, M·N]`` Gram matrix ``Vᵀ V`` of the Monte-Carlo GGN square root; needs
    ``SqrtGGNMC``."""

    source = "sqrt_ggn_mc"
    start_dim = 2

    def __init__(
        self, savefield: str = "gram_sqrt_ggn_mc", layerwise: bool = False,
        free_sqrt_ggn: bool = False,
    ) -> None:
        super().__init__(savefield, layerwise, free_sqrt_ggn)
