"""Rule for ``nn.Linear`` (``backprism.rules.linear``), end to end through ``extend``/``collect``,
against dense float64 ``torch.func`` references (``tests/reference.py``).

First order: every first-order extension (``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared``,
``Variance``, ``BatchDotGrad``) and ``.grad`` on Linear models with any number of leading axes,
both reductions and both float dtypes. Second order: ``DiagGGNExact``, ``BatchDiagGGNExact`` and
``SqrtGGNExact`` on ``Linear → tanh → Linear`` with leading axes (also chunked), and with the
position axes kept until an MSE(sum) loss.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from backprism import extend
from tests.common import (
    CHUNKING,
    SETTINGS,
    Head,
    check_exact,
    check_first_order_vs_vmap,
    labels,
    run_family,
)
from tests.reference import ggn_blocks

DT = torch.float64
N = 2  # batch of the second-order family tests


# -------------------------------------------------------------------------------------- first order
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 5),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    d_in=st.integers(1, 4),
    d_out=st.integers(1, 4),
    bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_first_order_leading_axes(n, lead, d_in, d_out, bias, reduction):
    torch.manual_seed(n + 10 * d_in + 100 * d_out)
    model = extend(
        nn.Sequential(nn.Linear(d_in, 3, bias=bias), nn.Tanh(), nn.Linear(3, d_out, bias=bias))
    ).double()
    lossfunc = extend(nn.MSELoss(reduction=reduction))
    X = torch.randn(n, *lead, d_in, dtype=torch.double)
    y = torch.randn(n, *lead, d_out, dtype=torch.double)
    check_first_order_vs_vmap(model, lossfunc, X, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_dtypes(dtype):
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))).to(dtype)
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(8, 6, dtype=dtype), torch.randint(0, 4, (8,))
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else {}
    check_first_order_vs_vmap(model, lossfunc, X, y, **tol)


# ------------------------------------------------------------------------------------- second order
@SETTINGS
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    bias=st.booleans(),
    chunking=CHUNKING,
    seed=st.integers(0, 2**16),
)
def test_linear_leading_axes(lead, bias, chunking, seed):
    torch.manual_seed(seed)
    X = torch.randn(N, *lead, 3, dtype=DT)
    model = Head(nn.Linear(3, 2, bias=bias), X).to(DT)
    run_family(model, X, labels(N, seed=seed), chunking)


def test_linear_positions_loss_mse_sum():
    """Leading axes kept until the loss: MSE(sum) on ``[N, T, C]`` outputs."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    X, y = torch.randn(N, 2, 3, 3, dtype=DT), torch.randn(N, 2, 3, 2, dtype=DT)
    lossfunc = nn.MSELoss(reduction="sum")
    G = ggn_blocks(model, lossfunc, X, y)[0]
    check_exact(model, lossfunc, X, y, G, chunk_size=5)
