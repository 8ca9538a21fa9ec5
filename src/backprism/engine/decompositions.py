r"""Matrix decompositions in any floating dtype.

PyTorch has no half-precision ``eigh`` or ``svd``; the row blocks of row-wise nonlinearities
(:mod:`backprism.engine.rows`) and the output gradients of products
(:mod:`backprism.engine.bilinear`) are decomposed in float32 there, and the factors cast back
to the input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["decomposed"]

_HALF = (torch.float16, torch.bfloat16)


def decomposed(fn: Callable[[Tensor], tuple[Tensor, ...]], x: Tensor) -> tuple[Tensor, ...]:
    """``fn(x)`` (``torch.linalg.eigh``, ``torch.linalg.svd``...) of a batch of matrices
    ``[B, I, J]``, computed in float32 for a half-precision ``x``, its factors in ``x``'s dtype.
    A matrix with a non-finite entry (a gradient that is NaN already) gets NaN factors, as the
    gradient it comes from, instead of failing the decomposition (checked on the device: no
    host read)."""
    bad = ~torch.isfinite(x).flatten(1).all(1)  # [B]
    clean = torch.where(bad[:, None, None], 0, x)
    out = fn(clean.float() if x.dtype in _HALF else clean)
    poison = torch.where(bad, float("nan"), 1.0).to(x.dtype)
    return tuple(
        (t.to(x.dtype) * poison.reshape(-1, *([1] * (t.dim() - 1)))) for t in out
    )
