"""Compact GGN square-root factors (``backprism.spectral.factors``): the kernel form's Gram
matrix and products against the materialised square root, whole and in column chunks; the
block-triangular symmetric rank-k update.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backprism.spectral.factors import KernelFactor


@settings(max_examples=20, deadline=None)
@given(
    k=st.integers(1, 3), n=st.integers(1, 20), t=st.integers(1, 4), o=st.integers(1, 4),
    i=st.integers(1, 4), d=st.integers(1, 3),
)
def test_kernel_factor_matches_dense(k, n, t, o, i, d):
    """Kernel-form Gram/products equal those of the materialised ``V = Σₜ gₜ xₜᵀ``, for ``g``
    in one piece and in column chunks (as several column chunks of one backward pass leave it)."""
    import backprism.spectral.factors as fac

    torch.manual_seed(k * 1000 + n * 100 + t * 10 + o)
    x, g = torch.randn(n, t, i, dtype=torch.float64), torch.randn(k, n, t, o, dtype=torch.float64)
    V = torch.einsum("knto,nti->knoi", g, x).reshape(k * n, o * i)
    u, w = torch.randn(k * n, d, dtype=torch.float64), torch.randn(d, o, i, dtype=torch.float64)

    def factors():  # fresh each time: reading .g joins the chunks
        yield KernelFactor(x, g, (o, i), n)
        src = object()
        chunks = [KernelFactor(x, c, (o, i), n, source=src) for c in g.split(1)]
        f = chunks[0]
        for c in chunks[1:]:
            f = f.cat(c)
        assert f.num_cols == k
        yield f

    # one block; one channel a time batched over samples; one channel a time per column
    for block_elems, min_channels in ((fac.BLOCK_ELEMENTS, 32), (1, 32), (1, 1)):
        old = fac.BLOCK_ELEMENTS, fac.MIN_BLOCK_CHANNELS
        fac.BLOCK_ELEMENTS, fac.MIN_BLOCK_CHANNELS = block_elems, min_channels
        try:
            for method in (None, "kernel", "materialise"):
                for f in factors():
                    torch.testing.assert_close(f.gram(method), V @ V.T)
            for method in (None, "contract", "materialise"):
                for f in factors():
                    torch.testing.assert_close(f.matmul(u, method).reshape(d, -1), u.T @ V)
            for f in factors():
                torch.testing.assert_close(f.tmatmul(w), V @ w.reshape(d, -1).T)
            for f in factors():
                gram, vtw = f.gram_tmatmul(w)  # fused when V is materialised
                torch.testing.assert_close(gram, V @ V.T)
                torch.testing.assert_close(vtw, V @ w.reshape(d, -1).T)
            for f in factors():
                gram, vtw = f._gram_materialised(w, out := []), out[0]
                torch.testing.assert_close(gram, V @ V.T)
                torch.testing.assert_close(vtw, V @ w.reshape(d, -1).T)
        finally:
            fac.BLOCK_ELEMENTS, fac.MIN_BLOCK_CHANNELS = old


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 13, 17, 40])
def test_syrk_blocks(rows):
    """The block-triangular ``out += v vᵀ`` followed by the mirroring equals the full product
    for 1 to 8 row blocks."""
    from backprism.spectral.factors import _mirror_upper, _syrk_upper_

    torch.manual_seed(rows)
    v = torch.randn(rows, 7, dtype=torch.float64)
    out = torch.randn(rows, rows, dtype=torch.float64)
    out = out + out.T
    expected = out + v @ v.T
    torch.testing.assert_close(_mirror_upper(_syrk_upper_(out, v, min_rows=2)), expected)
