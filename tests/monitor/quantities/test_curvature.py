"""Curvature modes of HessTrace, TICDiag and TICTrace against dense float64 references.

References come from ``tests/reference.py`` (``torch.func``: the dense Hessian of the loss, the
dense GGN, per-sample gradients), never from another backprism path. Monte-Carlo modes
(``diag_ggn_mc``, ``hutchinson``) are checked in expectation: the mean of ``R`` independent
draws must lie within ``6`` standard errors of the dense value (the standard error estimated
from the draws), plus a small absolute floor for quantities whose variance is ~0.

Covers ``backprism.monitor.quantities.curvature`` and the trace extensions of
``backprism.monitor.traces``; also ``HessTrace`` with its default curvature (the exact Hessian)
against the dense Hessian.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import backprism
from backprism.monitor import Monitor, configuration, quantities, schedules
from backprism.monitor.quantities.curvature import TRACE_CURVATURES
from backprism.monitor.traces import GGNTrace, HessianTrace
from tests import reference
from tests.common import TanhReluResidual, monitor_setup, monitor_step

N, D_IN, C = 6, 4, 3
EVERY = schedules.linear(1)


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "tanh":
        model: nn.Module = nn.Sequential(nn.Linear(D_IN, 5), nn.Tanh(), nn.Linear(5, C))
    elif kind == "residual":
        model = TanhReluResidual(D_IN, 5, C)
    elif kind == "conv":
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(3 * 4 * 4, C)
        )
    else:
        raise KeyError(kind)
    return model.double()


def batch(kind: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    shape = (N, 2, 6, 6) if kind == "conv" else (N, D_IN)
    return torch.randn(*shape, dtype=torch.float64), torch.randint(0, C, (N,))


def run_step(model, qs, X, y, exts=()):
    """One monitored backward pass; returns the monitor's output."""
    lossf = backprism.extend(nn.CrossEntropyLoss())
    backprism.extend(model)
    monitor = Monitor(model.parameters(), qs)
    model.zero_grad()
    out = model(X)
    loss = lossf(out, y)
    info = {
        "loss": loss,
        "batch_size": N,
        "individual_losses": nn.functional.cross_entropy(out.detach(), y, reduction="none"),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with monitor(0, *exts, info=info):
            loss.backward(create_graph=monitor.create_graph(0))
    return monitor.get_output()


def dense(model, X, y, curvature: str) -> torch.Tensor:
    if curvature in ("diag_h", "hutchinson"):
        return reference.loss_hessian(model, nn.CrossEntropyLoss(), X, y)
    return reference.ggn(model, nn.CrossEntropyLoss(), X, y)


def traces(model, M: torch.Tensor) -> list[float]:
    sizes = [p.numel() for p in model.parameters()]
    return [float(d.sum()) for d in torch.diagonal(M).split(sizes)]


def second_moment(model, X, y) -> torch.Tensor:
    """``(1/N) Σₙ gₙ²`` (elementwise, ``gₙ = ∇ℓₙ``) from per-sample reference gradients."""
    G = reference.per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    flat = torch.cat([g.reshape(N, -1) for g in G.values()], 1) * N  # gₙ = N·∇(ℓₙ/N)
    return flat.square().mean(0)


def assert_expectation(draws: np.ndarray, want: np.ndarray, n_se: float = 6.0, floor=1e-9):
    """The mean of ``draws`` (``[R, ...]``) lies within ``n_se`` standard errors of ``want``."""
    mean = draws.mean(0)
    se = draws.std(0, ddof=1) / np.sqrt(draws.shape[0])
    assert np.all(np.abs(mean - want) <= n_se * se + floor * (1 + np.abs(want))), (
        mean,
        want,
        se,
    )


# -- exact modes ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tanh", "residual", "conv"])
@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
def test_hess_trace_exact_modes(kind: str, curvature: str) -> None:
    model = make(kind)
    X, y = batch(kind)
    want = traces(model, dense(model, X, y, curvature))
    out = run_step(model, [quantities.HessTrace(EVERY, curvature=curvature)], X, y)
    np.testing.assert_allclose(out["HessTrace"][0], want, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("kind", ["tanh", "residual", "conv"])
@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
def test_tic_exact_modes(kind: str, curvature: str) -> None:
    model = make(kind)
    X, y = batch(kind)
    M = dense(model, X, y, curvature)
    m2 = second_moment(model, X, y)
    diag = torch.diagonal(M)
    qs = [
        quantities.TICDiag(EVERY, curvature=curvature),
        quantities.TICTrace(EVERY, curvature=curvature),
    ]
    out = run_step(model, qs, X, y)
    assert out["TICDiag"][0] == pytest.approx(float((m2 / (diag + 1e-7)).sum()), rel=1e-8)
    assert out["TICTrace"][0] == pytest.approx(float(m2.sum() / (diag.sum() + 1e-7)), rel=1e-8)


def test_trace_extensions_per_parameter_and_shared_parameters() -> None:
    """The engine-level trace extensions: 0-dim per parameter, equal to the dense traces, also
    for a parameter used by two calls (its per-sample gradients summed before squaring)."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D_IN, D_IN)
            self.out = nn.Linear(D_IN, C)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.sigmoid(self.lin(x)) + self.lin(x.flip(1)))

    torch.manual_seed(0)
    model = Shared().double()
    X, y = batch("tanh")
    G = reference.ggn(model, nn.CrossEntropyLoss(), X, y)
    H = reference.loss_hessian(model, nn.CrossEntropyLoss(), X, y)
    backprism.extend(model)
    lossf = backprism.extend(nn.CrossEntropyLoss())
    with backprism.collect(GGNTrace(), HessianTrace()):
        lossf(model(X), y).backward()
    got_g = [float(p.monitor_ggn_trace) for p in model.parameters()]
    got_h = [float(p.monitor_hess_trace) for p in model.parameters()]
    assert all(p.monitor_ggn_trace.dim() == 0 for p in model.parameters())
    np.testing.assert_allclose(got_g, traces(model, G), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(got_h, traces(model, H), rtol=1e-8, atol=1e-12)


def test_trace_is_read_from_the_diagonal_computed_anyway(monkeypatch) -> None:
    """HessTrace next to TICDiag of the same curvature reads the diagonal: the trace extension
    is not run."""

    def refuse(*args, **kwargs):
        raise AssertionError("the trace extension ran although the diagonal was computed")

    monkeypatch.setattr(GGNTrace, "from_rule", refuse)
    monkeypatch.setattr(HessianTrace, "from_rule", refuse)
    for curvature in ("diag_h", "diag_ggn_exact"):
        model = make("tanh")
        X, y = batch("tanh")
        want = traces(model, dense(model, X, y, curvature))
        qs = [
            quantities.HessTrace(EVERY, curvature=curvature),
            quantities.TICDiag(EVERY, curvature=curvature),
        ]
        out = run_step(model, qs, X, y)
        np.testing.assert_allclose(out["HessTrace"][0], want, rtol=1e-8, atol=1e-12)
        for p in model.parameters():
            assert not hasattr(p, "monitor_ggn_trace") and not hasattr(p, "diag_h")


# -- Monte-Carlo modes, in expectation --------------------------------------------------------
R = 300


@pytest.mark.parametrize("kind", ["tanh", "conv"])
def test_ggn_mc_modes_in_expectation(kind: str) -> None:
    """``diag_ggn_mc``: HessTrace, TICTrace's trace and TICDiag's diagonal are unbiased (one
    sampled label per sample); checked over R = 300 draws within 6 standard errors."""
    model = make(kind)
    X, y = batch(kind)
    G = dense(model, X, y, "diag_ggn_exact")
    want = np.asarray(traces(model, G))
    m2 = second_moment(model, X, y)
    draws_tr, draws_tic = [], []
    lossf = backprism.extend(nn.CrossEntropyLoss())
    backprism.extend(model)
    qs = [quantities.HessTrace(EVERY, curvature="diag_ggn_mc")]
    monitor = Monitor(model.parameters(), qs)
    torch.manual_seed(5)
    for step in range(R):
        model.zero_grad()
        loss = lossf(model(X), y)
        with monitor(step, info={"loss": loss, "batch_size": N}):
            loss.backward()
    out = monitor.get_output()["HessTrace"]
    draws_tr = np.asarray([out[s] for s in range(R)])
    assert_expectation(draws_tr, want)
    # TICTrace's denominator is the same trace: its reciprocal's argument, checked directly
    tic = Monitor(model.parameters(), [quantities.TICTrace(EVERY, curvature="diag_ggn_mc")])
    for step in range(60):
        model.zero_grad()
        out_ = model(X)
        loss = lossf(out_, y)
        info = {"loss": loss, "batch_size": N,
                "individual_losses": nn.functional.cross_entropy(out_.detach(), y,
                                                                 reduction="none")}
        with tic(step, info=info):
            loss.backward()
    values = np.asarray(list(tic.get_output()["TICTrace"].values()))
    draws_tic = float(m2.sum()) / values - 1e-7  # = the sampled trace
    assert_expectation(draws_tic, np.asarray(want.sum()))


def test_hutchinson_trace_in_expectation() -> None:
    """``hutchinson``: ``v_pᵀ(Hv)_p`` over Rademacher ``v`` is unbiased for ``tr(H_p)``;
    checked with ``samples=2`` over R = 300 draws within 6 standard errors."""
    model = make("residual")
    X, y = batch("residual")
    H = dense(model, X, y, "hutchinson")
    want = np.asarray(traces(model, H))
    lossf = backprism.extend(nn.CrossEntropyLoss())
    backprism.extend(model)
    q = quantities.HessTrace(EVERY, curvature="hutchinson", samples=2)
    assert q.hyperparameters() == {"curvature": "hutchinson", "samples": 2}
    monitor = Monitor(model.parameters(), [q])
    torch.manual_seed(7)
    for step in range(R):
        model.zero_grad()
        loss = lossf(model(X), y)
        with monitor(step, info={"loss": loss}):
            loss.backward()
    out = monitor.get_output()["HessTrace"]
    assert_expectation(np.asarray([out[s] for s in range(R)]), want)


# -- choices and errors -----------------------------------------------------------------------
def test_curvature_choices() -> None:
    assert TRACE_CURVATURES == ("diag_h", "diag_ggn_exact", "diag_ggn_mc", "hutchinson")
    with pytest.raises(KeyError, match="hutchinson"):
        quantities.HessTrace(EVERY, curvature="kfac")
    with pytest.raises(KeyError):
        quantities.TICDiag(EVERY, curvature="hutchinson")
    with pytest.raises(ValueError, match="samples"):
        quantities.HessTrace(EVERY, curvature="hutchinson", samples=0)
    qs = configuration("business", curvature="diag_ggn_mc")
    curv = {type(q).__name__: q.hyperparameters()["curvature"] for q in qs if
            type(q).__name__ in ("HessTrace", "TICDiag")}
    assert curv == {"HessTrace": "diag_ggn_mc", "TICDiag": "diag_ggn_mc"}
    qs = configuration("full", curvature={"HessTrace": "hutchinson", "TICDiag": "diag_ggn_mc"})
    assert [q.hyperparameters()["curvature"] for q in qs if type(q).__name__ == "HessTrace"] == [
        "hutchinson"
    ]
    with pytest.raises(ValueError, match="HessTrace only"):
        configuration("business", curvature="hutchinson")
    default = configuration("business")
    assert {q.hyperparameters()["curvature"] for q in default if hasattr(q, "_curvature")} == {
        "diag_h"
    }


def test_hesstrace_diag_h_matches_dense_hessian() -> None:
    model, lossf = monitor_setup(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    monitor = Monitor(model.parameters(), [quantities.HessTrace(schedules.linear(1))])
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    monitor_step(monitor, model, lossf, 0, X=X, y=y)
    H = reference.loss_hessian(model, nn.CrossEntropyLoss(), X, y)
    sizes = [p.numel() for p in model.parameters()]
    want = [float(d.sum()) for d in torch.diagonal(H).split(sizes)]
    np.testing.assert_allclose(monitor.get_output()["HessTrace"][0], want, rtol=1e-8)
