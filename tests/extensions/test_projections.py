"""Streaming first-order extensions (``backprism.extensions.projections``: ``BatchDotWith``,
``BatchProjGrad``, ``GradHist``) against dense per-sample gradients from ``torch.func`` and
``numpy.histogram``/``histogram2d``; ``BatchL2Grad`` taking its norms from ``GradHist``'s
per-sample chunks. (The monitor's use of them: ``tests/monitor/test_monitor.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import backprism
from backprism.engine.state import suspended
from backprism.extensions import BatchDotWith, GradHist
from tests import reference


class Tied(nn.Module):
    """One Linear used twice (a parameter with two calls) and a LayerNorm (its own rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return self.out(self.norm(self.lin(h)))


class Seq(nn.Module):
    """Linear with a middle (sequence) axis."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(x)).mean(1))


def models():
    conv = nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1, padding_mode="reflect"),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, groups=2, padding="same"),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )
    return {
        "mlp": (nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), (4,)),
        "relu": (
            nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 8), nn.ReLU(), nn.Linear(8, 3)),
            (4,),
        ),
        "conv": (conv, (2, 8, 8)),
        "conv1d": (
            nn.Sequential(nn.Conv1d(2, 3, 3, dilation=2), nn.Flatten(), nn.Linear(3 * 4, 3)),
            (2, 8),
        ),
        "seq": (Seq(), (3, 4)),
        "tied": (Tied(), (4,)),
    }


def setup(kind: str, n: int = 7, seed: int = 0):
    torch.manual_seed(seed)
    model, shape = models()[kind]
    model = backprism.extend(model.double())
    lossf = backprism.extend(nn.CrossEntropyLoss())
    X = torch.randn(n, *shape, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    with suspended():
        ref = reference.per_sample_grads(model, lossf, X, y)
    return model, lossf, X, y, ref


@pytest.mark.parametrize("kind", ["mlp", "conv", "conv1d", "seq", "tied"])
def test_batch_dot_with(kind: str) -> None:
    model, lossf, X, y, ref = setup(kind)
    torch.manual_seed(1)
    vecs = {p: torch.randn_like(p) for p in model.parameters()}
    skip = next(iter(model.parameters()))  # a parameter without vector gets zeros
    del vecs[skip]
    with backprism.collect(BatchDotWith(vecs)):
        lossf(model(X), y).backward()
    for name, p in model.named_parameters():
        want = (
            torch.zeros(X.shape[0], dtype=torch.float64)
            if p is skip
            else ref[name].flatten(1) @ vecs[p].reshape(-1)
        )
        torch.testing.assert_close(p.batch_dot_with, want)


def test_batch_dot_with_checks_shapes() -> None:
    p = nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="shape"):
        BatchDotWith({p: torch.zeros(2, 3)})


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(["mlp", "relu", "conv", "conv1d", "seq", "tied"]),
    chunk=st.sampled_from([1, 7, 40, 2**18]),
    bins=st.integers(1, 9),
    width=st.floats(0.05, 1.0),
    seed=st.integers(0, 3),
)
def test_grad_hist(kind: str, chunk: int, bins: int, width: float, seed: int) -> None:
    model, lossf, X, y, ref = setup(kind, seed=seed)
    n = X.shape[0]
    rng2 = ((-width, width), (-0.4, 0.3))
    ext = GradHist(
        bins=bins, range=(-width, 0.5 * width), bins2d=(bins, 3), range2d=rng2, abs_max=True,
        chunk_elements=chunk,
    )
    with backprism.collect(ext):
        lossf(model(X), y).backward()
    for name, p in model.named_parameters():
        G = (n * ref[name]).numpy()
        got = p.grad_hist
        np.testing.assert_array_equal(
            got["hist"].numpy(), reference.hist1d_ref(G, bins, -width, 0.5 * width)
        )
        want2 = reference.hist2d_ref(G, p.detach().numpy(), (bins, 3), rng2)
        np.testing.assert_array_equal(got["hist2d"].numpy(), want2)
        np.testing.assert_allclose(float(got["abs_max"]), np.abs(G).max(), rtol=1e-6)


@settings(max_examples=10, deadline=None)
@given(
    half=st.integers(1, 6),
    width=st.floats(0.01, 1.0),
    seed=st.integers(0, 5),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_grad_hist_linear_rank_one(half: int, width: float, seed: int, dtype) -> None:
    """Linear weights (1d counts from the sorted inputs): ReLU zeros on the bin edge at 0."""
    model, lossf, X, y, ref = setup("relu", n=11, seed=seed)
    model, X = model.to(dtype), X.to(dtype)
    with suspended():
        ref = reference.per_sample_grads(model, lossf, X, y)
    with backprism.collect(GradHist(bins=2 * half, range=(-width, width), abs_max=True)):
        lossf(model(X), y).backward()
    for name, p in model.named_parameters():
        G = (X.shape[0] * ref[name]).double().numpy()
        if dtype == torch.float32:  # values within rounding of an edge may move by one bin
            got = p.grad_hist["hist"].numpy()
            want = reference.hist1d_ref(G, 2 * half, -width, width)
            assert got.sum() == want.sum() and np.abs(got - want).sum() <= 2
        else:
            np.testing.assert_array_equal(
                p.grad_hist["hist"].numpy(), reference.hist1d_ref(G, 2 * half, -width, width)
            )
        np.testing.assert_allclose(float(p.grad_hist["abs_max"]), np.abs(G).max(), rtol=1e-5)


def test_grad_hist_custom_scale_and_1d_only() -> None:
    model, lossf, X, y, ref = setup("mlp")
    with backprism.collect(GradHist(bins=5, range=(-0.1, 0.1), scale=1.0, chunk_elements=3)):
        lossf(model(X), y).backward()
    for name, p in model.named_parameters():
        assert set(p.grad_hist) == {"hist"}
        want = reference.hist1d_ref(ref[name].numpy(), 5, -0.1, 0.1)
        np.testing.assert_array_equal(p.grad_hist["hist"].numpy(), want)


@pytest.mark.parametrize("kind", ["mlp", "conv", "conv1d", "seq", "tied"])
def test_batch_proj_grad(kind: str) -> None:
    from backprism.extensions import BatchProjGrad

    model, lossf, X, y, ref = setup(kind)
    with backprism.collect(BatchProjGrad()):
        lossf(model(X), y).backward()
    for name, p in model.named_parameters():
        G = ref[name].flatten(1)
        torch.testing.assert_close(p.batch_proj_grad, G @ G.sum(0))


@pytest.mark.parametrize("order", ["hist_first", "l2_first"])
def test_batch_l2_shared_with_grad_hist(order, monkeypatch):
    """With GradHist in the same pass, BatchL2Grad takes its squared norms from GradHist's
    per-sample chunks (the rule's own ``batch_l2`` is not called for layers GradHist
    materialises), in either order of the extensions; values match the reference."""
    from backprism.extensions import BatchL2Grad
    from backprism.rules.conv import Conv2dRule

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    ).double()
    lossfunc = nn.CrossEntropyLoss()
    X, y = torch.randn(5, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    ref = reference.per_sample_grads(model, lossfunc, X, y)
    backprism.extend(model), backprism.extend(lossfunc)

    def refuse(*args, **kwargs):
        raise AssertionError("Conv2d batch_l2 recomputed although GradHist provided it")

    monkeypatch.setattr(Conv2dRule, "batch_l2", refuse)
    exts = [GradHist(bins=7, chunk_elements=60), BatchL2Grad()]
    with backprism.collect(*(exts if order == "hist_first" else exts[::-1])):
        lossfunc(model(X), y).backward()
    for name, p in model.named_parameters():
        expected = ref[name].flatten(1).square().sum(1)
        torch.testing.assert_close(p.batch_l2, expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(
    xbins=st.integers(1, 12),
    width=st.floats(0.01, 1.0),
    seed=st.integers(0, 5),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_grad_hist_2d_linear_rank_one(xbins: int, width: float, seed: int, dtype) -> None:
    """Linear weights' 2d counts from rows that stay in one gradient bin (their weight row's
    parameter-bin histogram) plus the built rows that span several: equal to numpy's
    ``histogram2d`` of the per-sample gradients (float32: an element within rounding of a
    gradient-bin edge may move by one bin)."""
    model, lossf, X, y, ref = setup("relu", n=11, seed=seed)
    model, X = model.to(dtype), X.to(dtype)
    with suspended():
        ref = reference.per_sample_grads(model, lossf, X, y)
    rng2 = ((-width, width), (-0.5, 0.4))
    with backprism.collect(GradHist(bins=None, bins2d=(xbins, 4), range2d=rng2, abs_max=True)):
        lossf(model(X), y).backward()
    for name, p in model.named_parameters():
        G = (X.shape[0] * ref[name]).double().numpy()
        got = p.grad_hist["hist2d"].numpy()
        want = reference.hist2d_ref(G, p.detach().double().numpy(), (xbins, 4), rng2)
        if dtype == torch.float32:
            assert got.sum() == want.sum() and np.abs(got - want).sum() <= 4
        else:
            np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(float(p.grad_hist["abs_max"]), np.abs(G).max(), rtol=1e-5)
