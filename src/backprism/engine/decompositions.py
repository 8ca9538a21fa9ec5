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
    """``fn(x)`` (``torch.linalg.eigh``, ``torch.linalg.svd``...), computed in float32 for a
    half-precision ``x``, its factors in ``x``'s dtype."""
    if x.dtype in _HALF:
        return tuple(t.to(x.dtype) for t in fn(x.float()))
    return tuple(fn(x))
