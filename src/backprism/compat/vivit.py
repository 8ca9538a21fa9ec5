"""ViViT-compatible names: ``backprism.compat.vivit`` mirrors ``vivit``'s public paths.

================================================  ==========================================
ViViT                                             ``backprism.spectral``
================================================  ==========================================
``vivit.linalg.eigvalsh.EigvalshComputation``     ``EigvalshComputation``
``vivit.linalg.eigh.EighComputation``             ``EighComputation``
``vivit.optim.directional_derivatives.…``         ``DirectionalDerivativesComputation``
``vivit.optim.directional_damped_newton.…``       ``DirectionalDampedNewtonComputation``
================================================  ==========================================

All four are also available as ``backprism.compat.vivit.<Name>`` (ViViT's top-level names).

``vivit.extensions.secondorder.vivit.ViViTGGNExact(subsampling=None)`` /
``ViViTGGNMC(mc_samples=1, subsampling=None)`` store, per parameter, ViViT's dictionary
``param.vivit_ggn_exact`` (``vivit_ggn_mc``) of functions of the GGN square root
``V`` (``[C, N, *p]``, as ``sqrt_ggn_exact``): ``"gram_mat"()`` → ``Vᵀ V`` ``[C, N, C, N]``,
``"V_t_mat_prod"(mat)``: ``[M, *p] → [M, C, N]``, ``"V_mat_prod"(mat)``: ``[M, C, N] → [M, *p]``.
With ``subsampling`` (repeated indices allowed, as in ViViT) ``N`` becomes ``len(subsampling)``
and ``V`` the column blocks ``V[:, subsampling]`` of the full factor, so that
``V Vᵀ = Σᵢ GGN_{subsampling[i]}`` counts a repeated sample once per occurrence (see
:class:`backprism.extensions.SqrtGGNExact`; MC draws are per mini-batch sample, a repeated index
repeats the draw). ViViT's computations (``EighComputation``, …) reject repeated indices, as do
backprism's.

Use with ``backprism.collect`` in place of ``backpack.backpack``::

    from backprism.compat.vivit.linalg.eigh import EighComputation
    with backprism.collect(comp.get_extension(), extension_hook=comp.get_extension_hook(groups)):
        loss.backward()

The sub-modules (``linalg``, ``linalg.eigh``, ``linalg.eigvalsh``, ``optim``,
``optim.directional_derivatives``, ``optim.directional_damped_newton``) are registered in
``sys.modules`` so that ``from backprism.compat.vivit.linalg.eigh import EighComputation`` works.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from backprism.compat import _vivit_extras as _vx
from backprism.compat import _vivit_hessianfree as _vhf
from backprism.compat._modules import alias_module
from backprism.compat.backpack.extensions import _BackpackDraw
from backprism.engine.rule import Call, Rule
from backprism.extensions import secondorder as _so
from backprism.spectral import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
)

__all__ = [
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "EighComputation",
    "EigvalshComputation",
    "extensions",
    "linalg",
    "optim",
]


def _module(name: str, doc: str, **attrs: object) -> types.ModuleType:
    full = f"{__name__}.{name}"
    mod = types.ModuleType(full, doc)
    mod.__dict__.update(attrs)
    mod.__all__ = sorted(k for k in attrs if not isinstance(attrs[k], types.ModuleType))  # type: ignore[attr-defined]
    mod.__path__ = []  # type: ignore[attr-defined]  # package-like, as the other alias modules
    sys.modules[full] = mod
    return mod


_eigh = _module("linalg.eigh", "GGN eigenpairs (ViViT path).", EighComputation=EighComputation)
_eigvalsh = _module(
    "linalg.eigvalsh", "GGN eigenvalues (ViViT path).", EigvalshComputation=EigvalshComputation
)
linalg = _module(
    "linalg", "GGN eigenvalues and eigenpairs (ViViT path).",
    eigh=_eigh, eigvalsh=_eigvalsh,
    EighComputation=EighComputation, EigvalshComputation=EigvalshComputation,
)
_dd = _module(
    "optim.directional_derivatives", "Directional derivatives (ViViT path).",
    DirectionalDerivativesComputation=DirectionalDerivativesComputation,
)
_ddn = _module(
    "optim.directional_damped_newton", "Directionally damped Newton steps (ViViT path).",
    DirectionalDampedNewtonComputation=DirectionalDampedNewtonComputation,
)
optim = _module(
    "optim", "Directional derivatives and damped Newton steps (ViViT path).",
    directional_derivatives=_dd, directional_damped_newton=_ddn,
    DirectionalDerivativesComputation=DirectionalDerivativesComputation,
    DirectionalDampedNewtonComputation=DirectionalDampedNewtonComputation,
)
__path__: list[str] = []  # lets the import system treat this module as a package


# -- ViViT's extensions ------------------------------------------------------------------------
class _ViViTFactor(Mapping):
    """ViViT's per-parameter dictionary of functions of the GGN square root ``V``
    (``[C, N, *p]``, kept in the column chunks the engine produced)."""

    def __init__(self, chunks: list[Tensor]) -> None:
        self._chunks = chunks

    def __add__(self, other: _ViViTFactor) -> _ViViTFactor:
        return _ViViTFactor(self._chunks + other._chunks)

    def __mul__(self, factor: float) -> _ViViTFactor:
        return _ViViTFactor([c * factor for c in self._chunks])

    @property
    def V_t(self) -> Tensor:
        """The factor ``[C, N, *p]``."""
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0]

    def _fns(self) -> dict[str, Callable[..., Tensor]]:
        return {"V_mat_prod": self.V_mat_prod, "V_t_mat_prod": self.V_t_mat_prod,
                "gram_mat": self.gram_mat}

    def __getitem__(self, key: str) -> Callable[..., Tensor]:
        return self._fns()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(("V_mat_prod", "V_t_mat_prod", "gram_mat"))

    def __len__(self) -> int:
        return 3

    def V_mat_prod(self, mat: Tensor) -> Tensor:
        """``V`` applied to ``mat`` ``[M, C, N]``: ``[M, *p]``."""
        v = self.V_t
        return torch.einsum("mcn,cn...->m...", mat.to(v.dtype), v)

    def V_t_mat_prod(self, mat: Tensor) -> Tensor:
        """``Vᵀ`` applied to ``mat`` ``[M, *p]``: ``[M, C, N]``."""
        v = self.V_t
        return torch.einsum("cni,mi->mcn", v.flatten(2), mat.flatten(1).to(v.dtype))

    def gram_mat(self) -> Tensor:
        """``Vᵀ V`` as ``[C, N, C, N]``."""
        v = self.V_t.flatten(2)
        return torch.einsum("cni,dmi->cndm", v, v)


class _ViViTGGN:
    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        out = super().from_rule(rule, call, g, weights)  # type: ignore[misc]
        return {k: _ViViTFactor([v]) for k, v in out.items()}

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        return _ViViTFactor([super().from_dense(dense, call, weights)])  # type: ignore[misc]

    def accumulate(self, old: _ViViTFactor, new: _ViViTFactor) -> _ViViTFactor:
        return old + new

    def builds_per_sample(self, rule: Rule, call: Call) -> bool:
        return True


class ViViTGGNExact(_ViViTGGN, _so.SqrtGGNExact):
    """Functional access to the exact GGN square root: ``param.vivit_ggn_exact`` (ViViT)."""

    savefield = "vivit_ggn_exact"

    def get_subsampling(self) -> list[int] | None:
        return self.subsampling


class ViViTGGNMC(_BackpackDraw, _ViViTGGN, _so.SqrtGGNMC):
    """Functional access to the MC GGN square root: ``param.vivit_ggn_mc`` (ViViT). The
    targets are drawn as ViViT draws them, through BackPACK's ``SqrtGGNMC`` (one call on
    torch's global RNG per extension and pass; see :class:`~backprism.compat.backpack.
    extensions._BackpackDraw`)."""

    savefield = "vivit_ggn_mc"

    def get_subsampling(self) -> list[int] | None:
        return self.subsampling

    def get_num_mc_samples(self) -> int:
        return self.mc_samples


extensions = alias_module(f"{__name__}.extensions", "ViViT's extensions.")
alias_module(f"{__name__}.extensions.secondorder", "ViViT's second-order extensions.")
alias_module(
    f"{__name__}.extensions.secondorder.vivit",
    "ViViT's functional access to the GGN square root.",
    ViViTGGNExact=ViViTGGNExact,
    ViViTGGNMC=ViViTGGNMC,
)

# -- ViViT's Gram-matrix hooks and utilities (backprism.compat._vivit_extras) ------------------
alias_module(f"{__name__}.extensions.firstorder", "ViViT's first-order extension hooks.")
alias_module(f"{__name__}.extensions.firstorder.batch_grad", "ViViT's BatchGrad hooks.")
alias_module(
    f"{__name__}.extensions.firstorder.batch_grad.gram_batch_grad",
    "Gram matrices of the individual gradients (hooks for BatchGrad).",
    CenteredBatchGrad=_vx.CenteredBatchGrad,
    GramBatchGrad=_vx.GramBatchGrad,
    CenteredGramBatchGrad=_vx.CenteredGramBatchGrad,
)
alias_module(f"{__name__}.extensions.secondorder.sqrt_ggn", "ViViT's GGN square root hooks.")
alias_module(
    f"{__name__}.extensions.secondorder.sqrt_ggn.gram_sqrt_ggn",
    "Gram matrices of the GGN square root (hooks for SqrtGGNExact/SqrtGGNMC).",
    GramSqrtGGNExact=_vx.GramSqrtGGNExact,
    GramSqrtGGNMC=_vx.GramSqrtGGNMC,
)
_utils_gram = alias_module(
    f"{__name__}.utils.gram", "ViViT's Gram-matrix utilities.",
    pairwise_dot=_vx.pairwise_dot, reshape_as_square=_vx.reshape_as_square,
)
_utils_eig = alias_module(
    f"{__name__}.utils.eig", "ViViT's symmetric eigen-decomposition utilities.",
    symeig=_vx.symeig, symeig_psd=_vx.symeig_psd, shift_diag=_vx.shift_diag,
    remove_zero_evals=_vx.remove_zero_evals,
)
_utils_checks = alias_module(
    f"{__name__}.utils.checks", "ViViT's checks of parameter groups and sub-sampling.",
    check_key_exists=_vx.check_key_exists, check_unique_params=_vx.check_unique_params,
    check_subsampling_unique=_vx.check_subsampling_unique,
)
utils = alias_module(
    f"{__name__}.utils", "ViViT's utilities.",
    gram=_utils_gram, eig=_utils_eig, checks=_utils_checks,
)
alias_module(
    f"{__name__}.hessianfree",
    "ViViT's Hessian and GGN of a data set's loss as SciPy linear operators.",
    GGNLinearOperator=_vhf.GGNLinearOperator,
    HessianLinearOperator=_vhf.HessianLinearOperator,
)
