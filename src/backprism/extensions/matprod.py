r"""Block curvature-matrix products (BackPACK's ``HMP``, ``GGNMP``, ``PCHMP``).

After the backward pass each parameter ``θ`` carries a callable attribute that multiplies the
parameter's diagonal block of a curvature matrix with ``V`` stacked vectors::

    param.hmp(mat)    # mat: [V, *param.shape] → [V, *param.shape]

Each block is assembled from the per-sample, per-column parameter gradients ``Vₖₙ = Jₙᵀ cₖ[n]``
of the columns the engine pushes back (exact loss-Hessian square root ``S/√N`` with weight ``+1``
and, for HMP/PCHMP, the signed residual columns ``√|r| eⱼ`` of the elementwise nonlinearities,
weight ``sign(r)``, see :mod:`backprism.engine.residual`):

.. math::

    B_θ = \sum_{k,n} w_{kn}\, \operatorname{vec}(V_{kn}) \operatorname{vec}(V_{kn})ᵀ,
    \qquad B_θ\, m = \sum_{k,n} w_{kn} V_{kn} ⟨V_{kn}, m⟩.

=========  ===========  ===========================================================
extension  attribute    block
=========  ===========  ===========================================================
HMP        ``hmp``      Hessian ``∇²_θ L`` (GGN + residuals with their signs)
GGNMP      ``ggnmp``    generalized Gauss-Newton ``J_θᵀ ∇²_f L J_θ``
PCHMP      ``pchmp``    positive-curvature Hessian: residual weights ``w ↦ max(w, 0)``
                        (``modify="clip"``) or ``w ↦ |w|`` (``modify="abs"``), i.e.
                        ``σ''``-residuals ``r`` replaced by ``max(r, 0)`` or ``|r|``; the loss
                        Hessian part (PSD for convex losses) is kept, so the block is PSD
=========  ===========  ===========================================================

Memory: a block keeps the weighted factor rows ``[R, P]`` (``P = param.numel()``) while
``R ≤ P`` and switches to the dense ``[P, P]`` matrix once more rows arrive, so it never holds more
than ``min(R, P) · P`` numbers, and nothing else (no module inputs, no graph).

Under distributed data parallelism (:mod:`backprism.engine.distributed`) each rank's block is
made dense and ``Σ_r ρ_r B_r`` is all-reduced (``P²`` numbers per parameter), so every rank
multiplies with the global batch's block; parameters with more than
``MAX_BLOCK_NUMEL = 8192`` entries are refused there.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from backprism.engine.distributed import MAX_BLOCK_NUMEL
from backprism.engine.extension import GlobalBatch, SumPart
from backprism.engine.residual import check_linear_in_params
from backprism.engine.rule import Call, Rule
from backprism.extensions.base import SecondOrderExtension
from backprism.extensions.hessian import check_shared

__all__ = ["GGNMP", "HMP", "PCHMP", "BlockProduct"]


class BlockProduct:
    r"""Callable ``mat ↦ B mat`` for one parameter's curvature block ``B`` (symmetric).

    ``B = Rᵀ diag(w) R + D`` with factor rows ``R`` (``[rows, P]``), weights ``w`` and an optional
    dense part ``D`` (``[P, P]``).
    """

    def __init__(self, shape: torch.Size, rows: Tensor, weights: Tensor) -> None:
        self.shape = torch.Size(shape)
        self.numel = rows.shape[1]
        keep = weights != 0
        self._rows: Tensor | None = rows[keep] if not bool(keep.all()) else rows
        self._w: Tensor | None = weights[keep] if not bool(keep.all()) else weights
        self._dense: Tensor | None = None
        self._compress()

    @classmethod
    def from_dense(cls, shape: torch.Size, dense: Tensor) -> BlockProduct:
        """The block with dense matrix ``dense`` (``[P, P]``)."""
        out = cls.__new__(cls)
        out.shape = torch.Size(shape)
        out.numel = dense.shape[0]
        out._rows, out._w, out._dense = None, None, dense
        return out

    def _compress(self) -> None:
        if self._rows is not None and self._rows.shape[0] > self.numel:
            d = self._rows.t() @ (self._w[:, None] * self._rows)
            self._dense = d if self._dense is None else self._dense + d
            self._rows, self._w = None, None

    def __add__(self, other: BlockProduct) -> BlockProduct:
        if not isinstance(other, BlockProduct) or other.shape != self.shape:
            return NotImplemented
        if other._dense is not None:
            self._dense = other._dense if self._dense is None else self._dense + other._dense
        if other._rows is not None:
            if self._rows is None:
                self._rows, self._w = other._rows, other._w
            else:
                self._rows = torch.cat([self._rows, other._rows])
                self._w = torch.cat([self._w, other._w])
        self._compress()
        return self

    def to_dense(self) -> Tensor:
        """The block as a dense ``[P, P]`` matrix (parameter entries flattened row-major)."""
        eye = torch.eye(self.numel, dtype=self._dtype(), device=self._device())
        return self(eye.reshape(self.numel, *self.shape)).reshape(self.numel, self.numel)

    def _dtype(self) -> torch.dtype:
        return (self._dense if self._dense is not None else self._rows).dtype

    def _device(self) -> torch.device:
        return (self._dense if self._dense is not None else self._rows).device

    def __call__(self, mat: Tensor) -> Tensor:
        """``B mat`` for ``mat`` of shape ``[V, *param.shape]``; returns ``[V, *param.shape]``."""
        if not isinstance(mat, Tensor):
            raise TypeError(f"expected a tensor of shape [V, {list(self.shape)}], got {type(mat)}")
        if mat.dim() != len(self.shape) + 1 or mat.shape[1:] != self.shape:
            dims = ", ".join(map(str, self.shape))
            raise ValueError(
                f"the matrix must have shape [V, *param.shape] = [V, {dims}], got "
                f"{list(mat.shape)}; add a leading axis for a single vector (mat[None])"
            )
        m = mat.reshape(mat.shape[0], self.numel).to(self._dtype())
        out = torch.zeros_like(m)
        if self._dense is not None:
            out = out + m @ self._dense
        if self._rows is not None:
            out = out + ((m @ self._rows.t()) * self._w) @ self._rows
        return out.reshape(mat.shape)

    def __repr__(self) -> str:
        kind = "dense" if self._rows is None else f"{self._rows.shape[0]} rows"
        return f"BlockProduct(shape={list(self.shape)}, {kind})"


class _MatProd(SecondOrderExtension):
    """Common reduction: per-sample, per-column gradients → :class:`BlockProduct`."""

    def column_key(self) -> Hashable:
        return ("exact",)

    def _weights(self, weights: Tensor | None, m: int, n: int, ref: Tensor) -> Tensor:
        if weights is None:
            return ref.new_ones(m * n)
        return self.modify_weights(weights.to(ref.dtype)).reshape(m * n)

    def modify_weights(self, weights: Tensor) -> Tensor:
        """Weights of residual columns (signs of ``r``) as used in the block."""
        return weights

    def _blocks(self, per_sample: dict[str, Tensor], weights: Tensor | None) -> dict:
        out = {}
        for name, v in per_sample.items():
            m, n = v.shape[:2]
            rows = v.detach().reshape(m * n, -1)
            out[name] = BlockProduct(v.shape[2:], rows, self._weights(weights, m, n, rows))
        return out

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        if self.needs_residual:
            check_linear_in_params(call, [self])
        return self._blocks(rule.per_sample(call, g), weights)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        if self.needs_residual:
            check_shared(self, call)
        return self._blocks({"p": dense}, weights)["p"]

    def distributed_unsupported(self, params: list) -> str | None:
        big = [p for p in params if p.numel() > MAX_BLOCK_NUMEL]
        if big:
            return (
                f"{type(self).__name__} all-reduces each parameter's dense [P, P] block, and a "
                f"parameter of shape {tuple(big[0].shape)} has P = {big[0].numel()} > "
                f"{MAX_BLOCK_NUMEL} entries"
            )
        return None

    def distributed_parts(self, value: BlockProduct, batch: GlobalBatch) -> list:
        return [SumPart(value.to_dense(), batch.loss_weight)]

    def distributed_result(
        self, value: BlockProduct, reduced: list[Tensor], batch: GlobalBatch
    ) -> BlockProduct:
        return BlockProduct.from_dense(value.shape, reduced[0])


class HMP(_MatProd):
    """Products with the parameter's block of the Hessian, ``param.hmp(mat)``:
    ``[V, *param.shape] → [V, *param.shape]``."""

    savefield = "hmp"
    needs_residual = True


class GGNMP(_MatProd):
    """Products with the parameter's block of the generalized Gauss-Newton matrix,
    ``param.ggnmp(mat)``: ``[V, *param.shape] → [V, *param.shape]``."""

    savefield = "ggnmp"
    needs_residual = False


class PCHMP(_MatProd):
    """Products with the parameter's block of the positive-curvature Hessian,
    ``param.pchmp(mat)``: ``[V, *param.shape] → [V, *param.shape]``.

    Args:
        modify: how negative residual curvature ``r = ∂L/∂a ⊙ σ''(z) < 0`` is made
            non-negative: ``"clip"`` sets it to zero, ``"abs"`` takes ``|r|`` (for a row-wise
            nonlinearity, a norm or a softmax: the eigenvalues of each row's residual block).
    """

    savefield = "pchmp"
    needs_residual = True
    any_decomposition = False

    def __init__(self, modify: str = "clip") -> None:
        if modify not in ("clip", "abs"):
            raise ValueError(f"PCHMP: modify must be 'clip' or 'abs', got {modify!r}")
        self.modify = modify

    def modify_weights(self, weights: Tensor) -> Tensor:
        return weights.clamp_min(0) if self.modify == "clip" else weights.abs()
