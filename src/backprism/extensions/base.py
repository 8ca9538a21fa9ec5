"""Extension base classes (the contract lives in :mod:`backprism.engine.extension`) and the
subsampling helpers shared by the extension families."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from backprism.engine.extension import Extension, FirstOrderExtension, SecondOrderExtension

__all__ = [
    "Extension",
    "FirstOrderExtension",
    "SecondOrderExtension",
    "check_subsampling",
    "subsample_index",
]


def check_subsampling(subsampling: Sequence[int] | None) -> list[int] | None:
    if subsampling is None:
        return None
    idx = [int(i) for i in subsampling]
    if len(set(idx)) != len(idx):
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
