"""Monitor quantities vs brute force from their definitions.

Per-sample gradients come from a loop of autograd calls (one sample at a time), histograms from
``numpy.histogram``/``histogram2d``, curvature from dense ``torch.func`` references. Each run
trains a tiny float64 model (a chain and a residual net) for a few steps with SGD or Adam under
two schedules, with every quantity tracked alone and all together, and compares the monitor's
output at every tracked step with the recomputation.

Every quantity of ``backprism.monitor.quantities`` goes through here (the per-quantity modules
of this directory test what is particular to one).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import backprism
from backprism.monitor import Monitor, quantities, schedules
from backprism.monitor.configuration import TRACKED
from tests import reference
from tests.common import TanhReluResidual, individual_grads

N, D_IN, C = 6, 4, 3
STEPS = 4


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "chain":
        model = nn.Sequential(nn.Linear(D_IN, 5), nn.Tanh(), nn.Linear(5, C))
    else:
        model = TanhReluResidual(D_IN, 5, C)
    return model.double()


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.3)
    return torch.optim.Adam(model.parameters(), lr=0.05)


def split_sizes(model: nn.Module) -> list[int]:
    return [p.numel() for p in model.parameters()]


def alpha_ref(t, fs, dfs, var_fs, var_dfs) -> float:
    """Weighted least squares by ``lstsq`` on rows scaled by 1/σ (independent of the monitor)."""
    A = np.array([[1, 0, 0], [1, t, t * t], [0, 1, 0], [0, 1, 2 * t]], dtype=float)
    b = np.array([*fs, *dfs], dtype=float)
    s = 1 / np.sqrt(np.array([*var_fs, *var_dfs], dtype=float))
    mu = np.linalg.lstsq(A * s[:, None], b * s, rcond=None)[0]
    if mu[2] < 0:
        return -1.0
    return 2 * t / (-mu[1] / mu[2]) - 1


ALL = list(TRACKED)
HIST1 = {"bins": 12, "range": (-0.6, 0.6)}
HIST2 = {"bins": (5, 4), "range": ((-0.5, 0.5), (-0.8, 0.8))}


def build(name: str, schedule) -> quantities.Quantity:
    cls = getattr(quantities, name)
    if name == "GradHist1d":
        return cls(schedule, **HIST1)
    if name == "GradHist2d":
        return cls(schedule, keep_individual=True, **HIST2)
    if name in ("TICDiag", "TICTrace", "HessTrace"):
        return cls(schedule, curvature="diag_ggn_exact")
    return cls(schedule)


def run(kind: str, opt_name: str, names: list[str], schedule):
    """Train with the monitor; return its output and the brute-force references."""
    model = make_model(kind)
    backprism.extend(model)
    lossf = backprism.extend(nn.CrossEntropyLoss())
    indiv = nn.CrossEntropyLoss(reduction="none")
    opt = make_optimizer(opt_name, model)
    params = list(model.parameters())
    monitor = Monitor(params, [build(n, schedule) for n in names])
    torch.manual_seed(1)
    ref: dict[str, dict[int, object]] = {n: {} for n in names}
    snaps, Gs, fs, vfs = {}, {}, {}, {}
    theta0 = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    for step in range(STEPS):
        X = torch.randn(N, D_IN, dtype=torch.float64)
        y = torch.randint(0, C, (N,))
        theta = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        G = individual_grads(model, X, y)
        g = G.mean(0)
        snaps[step], Gs[step] = theta, G
        opt.zero_grad()
        out = model(X)
        loss = lossf(out, y)
        losses = indiv(out, y)
        fs[step], vfs[step] = float(loss.detach()), float(losses.detach().var())
        if schedule(step):
            _reference_single(
                ref, step, names, model, X, y, G, g, theta, theta0, float(loss.detach()), opt
            )
        info = {"loss": loss, "individual_losses": losses, "batch_size": N, "optimizer": opt}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with monitor(step, info=info):
                loss.backward(create_graph=monitor.create_graph(step))
        opt.step()
    theta_end = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    snaps[STEPS] = theta_end
    sizes = split_sizes(model)
    for s in range(STEPS - 1):
        if not schedule(s):
            continue
        d = snaps[s + 1] - snaps[s]
        if "UpdateSize" in names:
            ref["UpdateSize"][s] = [float(x.norm()) for x in d.split(sizes)]
        if "Alpha" in names:
            t = float(d.norm())
            p0, p1 = Gs[s] @ d / t, Gs[s + 1] @ d / t
            ref["Alpha"][s] = alpha_ref(
                t,
                [fs[s], fs[s + 1]],
                [float(p0.mean()), float(p1.mean())],
                [vfs[s], vfs[s + 1]],
                [float(p0.var()), float(p1.var())],
            )
    return monitor.get_output(), ref, sizes


def _reference_single(ref, step, names, model, X, y, G, g, theta, theta0, loss, opt) -> None:
    sizes = split_sizes(model)
    n = G.shape[0]
    g2 = float(g.square().sum())
    out: dict[str, object] = {}
    out["Loss"] = loss
    out["GradNorm"] = [float(x.norm()) for x in g.split(sizes)]
    out["Distance"] = [float(x.norm()) for x in (theta - theta0).split(sizes)]
    out["NormTest"] = math.sqrt(float((G - g).square().sum()) / (n - 1) / n / g2)
    proj = G @ g
    out["InnerTest"] = math.sqrt(float(proj.var()) / n / g2**2)
    ortho = G - torch.outer(proj / g2, g)
    out["OrthoTest"] = math.sqrt(float(ortho.square().sum()) / (n - 1) / n / g2)
    out["GradHist1d"] = sum(
        reference.hist1d_ref(c.numpy(), HIST1["bins"], *HIST1["range"])
        for c in G.split(sizes, dim=1)
    )
    out["GradHist2d"] = [
        reference.hist2d_ref(c.numpy(), t.numpy(), HIST2["bins"], HIST2["range"])
        for c, t in zip(G.split(sizes, dim=1), theta.split(sizes))
    ]
    var_b = G.var(0, unbiased=False)
    out["MeanGSNR"] = float((g.square() / (var_b + 1e-5)).mean())
    var_u = G.var(0)
    out["EarlyStopping"] = 1 - n * float((g.square() / (var_u + 1e-5)).mean())
    lr = opt.param_groups[0]["lr"]
    out["CABS"] = lr * float((G.square().sum(0) - n * g.square()).sum()) / (n * loss)
    if any(k in names for k in ("TICDiag", "TICTrace", "HessTrace")):
        ggn = reference.ggn(model, nn.CrossEntropyLoss(), X, y)
        diag = torch.diagonal(ggn)
        m2 = G.square().mean(0)
        out["TICDiag"] = float((m2 / (diag + 1e-7)).sum())
        out["TICTrace"] = float(m2.sum() / (diag.sum() + 1e-7))
        out["HessTrace"] = [float(x.sum()) for x in diag.split(sizes)]
    if "HessMaxEV" in names:
        H = reference.loss_hessian(model, nn.CrossEntropyLoss(), X, y)
        out["HessMaxEV"] = float(torch.linalg.eigvalsh(H)[-1])
    for k in names:
        if k in out:
            ref[k][step] = out[k]


def compare(name: str, got, want, sizes) -> None:
    if name == "GradHist1d":
        diff = np.abs(np.asarray(got["hist"]) - want).sum()
        assert diff <= 2, (got["hist"], want)
        assert np.asarray(got["hist"]).sum() == want.sum()
    elif name == "GradHist2d":
        total = sum(want)
        assert np.abs(np.asarray(got["hist"]) - total).sum() <= 2
        assert got["param_groups"] == len(sizes)
        for i, w in enumerate(want):
            assert np.abs(np.asarray(got[f"param_{i}"]["hist"]) - w).sum() <= 2
        assert len(got["edges"]) == 2
    elif name == "CABS":
        assert got["cabs"] == pytest.approx(want, rel=1e-6, abs=1e-10)
    elif name == "HessMaxEV":
        assert got == pytest.approx(want, rel=1e-3)
    elif isinstance(want, list):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-10)
    else:
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), name


def check(kind, opt_name, names, schedule) -> None:
    output, ref, sizes = run(kind, opt_name, names, schedule)
    for name in names:
        got = output[name]
        want = ref[name]
        assert set(got) == set(want), (name, sorted(got), sorted(want))
        for step in want:
            compare(name, got[step], want[step], sizes)


SCHEDULES = {
    "every": schedules.linear(1),
    "sparse": schedules.linear(2, offset=1),
}


@pytest.mark.parametrize("kind", ["chain", "residual"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("sched", ["every", "sparse"])
def test_all_together(kind: str, opt_name: str, sched: str) -> None:
    names = [n for n in ALL if not (opt_name == "adam" and n in ("CABS", "EarlyStopping"))]
    check(kind, opt_name, names, SCHEDULES[sched])


@pytest.mark.parametrize("name", ALL)
def test_alone(name: str) -> None:
    opt_name = "sgd"
    check("chain", opt_name, [name], schedules.logarithmic(0, 0.5, steps=3))


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_alpha_alone_both_paths(opt_name: str) -> None:
    check("residual", opt_name, ["Alpha"], SCHEDULES["every"])
    check("chain", opt_name, ["Alpha"], SCHEDULES["sparse"])
