"""Extension base classes (the contract lives in :mod:`backprism.engine.extension`), the
subsampling helpers shared by the extension families and the two common distributed reductions
(:class:`PerSampleRows`, :class:`SummedOverSamples`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from backprism.engine.extension import (
    Extension,
    FirstOrderExtension,
    GlobalBatch,
    SecondOrderExtension,
    SumPart,
)

__all__ = [
    "Extension",
    "FirstOrderExtension",
    "PerSampleRows",
    "SecondOrderExtension",
    "SummedOverSamples",
    "check_subsampling",
    "dedupe_index",
    "subsample_index",
]


def check_subsampling(
    subsampling: Sequence[int] | None, unique: bool = True
) -> list[int] | None:
    """The validated sample indices; repeated indices only where ``unique`` is off (a row per
    index, as BackPACK's ``BatchGrad(subsampling=[0, 0])`` and ``SqrtGGNExact`` give).
    ``unique`` stays on where a repetition has no meaning the predecessors define (ViViT's
    spectral computations reject it)."""
    if subsampling is None:
        return None
    idx = [int(i) for i in subsampling]
    if unique and len(set(idx)) != len(idx):
        raise ValueError(f"subsampling indices must be unique, got {list(subsampling)}")
    if any(i < 0 for i in idx):
        raise ValueError(f"subsampling indices must be non-negative, got {list(subsampling)}")
    return idx


def subsample_index(idx: list[int] | None, n: int, what: str) -> Tensor | None:
    if idx is None:
        return None
    if idx and max(idx) >= n:
        raise IndexError(
            f"{what}: subsampling index {max(idx)} is out of range for a batch of {n} samples"
        )
    return torch.tensor(idx, dtype=torch.long)


def dedupe_index(idx: Tensor) -> tuple[Tensor, Tensor | None]:
    """Split a sample index with repetitions into its distinct entries and the rows to take.

    For ``idx = (s₁, …, s_{N'})`` returns ``distinct`` (the distinct ``sᵢ`` in order of first
    occurrence) and ``rows`` with ``distinct[rows[i]] = sᵢ``, so that a per-sample result ``R``
    computed on ``distinct`` gives ``R.index_select(axis, rows)``, the result on ``idx``
    (``index_select`` semantics: a repeated index repeats its row). ``rows`` is ``None`` when
    ``idx`` has no repetition (``distinct`` is then ``idx``).
    """
    values = [int(i) for i in idx.tolist()]
    first = list(dict.fromkeys(values))
    if len(first) == len(values):
        return idx, None
    pos = {i: k for k, i in enumerate(first)}
    return (
        torch.tensor(first, dtype=torch.long, device=idx.device),
        torch.tensor([pos[i] for i in values], dtype=torch.long, device=idx.device),
    )


class PerSampleRows:
    """Distributed reduction of a per-sample result (mixin, listed before the extension base):
    this rank's rows of the global batch's result are its local rows times ``ρ^degree``
    (:class:`~backprism.engine.extension.GlobalBatch`); nothing is communicated.
    ``distributed_degree``: the degree of the result in the per-sample loss weights (per-sample
    gradients 1, their squares 2, GGN square roots 1/2). The factor is applied while the result
    is computed (:attr:`~backprism.engine.extension.Extension.scaled_in_pass`: the output
    gradients or columns the rule receives are scaled, which costs far less than a pass over the
    ``[N, *p]`` result); an extension that sets ``scaled_in_pass = False`` (results with Hessian
    residual terms) is rescaled in place afterwards (the engine gives each result its own
    storage)."""

    distributed_degree: float = 1.0
    scaled_in_pass: bool = True

    def distributed_unsupported(self, params: list[nn.Parameter]) -> str | None:
        return None

    def distributed_result(self, value: Any, reduced: list[Tensor], batch: GlobalBatch) -> Any:
        if self.scaled_in_pass:
            return value
        f = batch.loss_weight**self.distributed_degree
        if f == 1.0:
            return value
        if isinstance(value, Tensor) and value.is_floating_point() and _no_overlap(value):
            return value.mul_(f)
        return value * f


def _no_overlap(t: Tensor) -> bool:
    """No two elements of ``t`` share memory (not an expanded view), so ``t.mul_`` is safe."""
    return all(st != 0 or sz <= 1 for sz, st in zip(t.shape, t.stride()))


class SummedOverSamples:
    """Distributed reduction of a result summed over the samples (mixin, listed before the
    extension base): ``Σ_r ρ_r^degree · value_r``, one summed part."""

    distributed_degree: float = 1.0

    def distributed_unsupported(self, params: list[nn.Parameter]) -> str | None:
        return None

    def distributed_parts(self, value: Any, batch: GlobalBatch) -> list[Any]:
        return [SumPart(value, batch.loss_weight**self.distributed_degree)]

    def distributed_result(self, value: Any, reduced: list[Tensor], batch: GlobalBatch) -> Any:
        return reduced[0]
