"""Monitor: schedules, output keys, merging, HessMaxEV (Lanczos), bad input, Cockpit compat."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import backprism
from backprism.extensions import DiagGGNMC, SumGradSquared
from backprism.monitor import Monitor, configuration, lanczos_max_eig, quantities, schedules
from backprism.monitor.quantities.bin_adaptation import GradAbsMax

import reference


def setup(model: nn.Module | None = None, loss: nn.Module | None = None):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    return backprism.extend(model.double()), backprism.extend(loss or nn.CrossEntropyLoss())


def step_once(monitor, model, lossf, step, opt=None, info_extra=None, exts=(), X=None, y=None):
    X = torch.randn(6, 4, dtype=torch.float64) if X is None else X
    y = torch.randint(0, 3, (6,)) if y is None else y
    out = model(X)
    loss = lossf(out, y)
    info = {"loss": loss, "batch_size": X.shape[0], "individual_losses": loss.new_zeros(6)}
    if opt is not None:
        info["optimizer"] = opt
    info.update(info_extra or {})
    with monitor(step, *exts, info=info):
        loss.backward(create_graph=monitor.create_graph(step))
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return loss


# -- schedules --------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(st.integers(1, 7), st.integers(0, 5))
def test_linear_schedule(interval: int, offset: int) -> None:
    sched = schedules.linear(interval, offset)
    want = {offset + k * interval for k in range(50)}
    assert {s for s in range(-3, offset + 49 * interval + 1) if sched(s)} == want


@settings(max_examples=20, deadline=None)
@given(st.floats(0, 2), st.floats(2, 4), st.integers(1, 50), st.booleans())
def test_logarithmic_schedule(start: float, end: float, steps: int, init: bool) -> None:
    sched = schedules.logarithmic(start, end, steps, init=init)
    pts = {int(10**x) for x in np.linspace(start, end, steps)}
    got = {s for s in range(0, 10**4 + 2) if sched(s)}
    # float truncation may differ by one at exact powers; compare up to that
    assert len(got ^ (pts | ({0} if init else set()))) <= max(2, len(pts) // 5)
    assert (0 in got) == (init or 0 in pts)


def test_two_step_events_and_output_steps() -> None:
    """UpdateSize/Alpha start at scheduled s, finish at s + 1 and store under s; Distance is
    stored at the scheduled steps; nothing is computed elsewhere."""
    model, lossf = setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = schedules.linear(3, offset=1)
    qs = [quantities.UpdateSize(sched), quantities.Distance(sched), quantities.Alpha(sched)]
    monitor = Monitor(model.parameters(), qs)
    for step in range(9):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            X = torch.randn(6, 4, dtype=torch.float64)
            y = torch.randint(0, 3, (6,))
            out = model(X)
            loss = lossf(out, y)
            info = {
                "loss": loss,
                "batch_size": 6,
                "optimizer": opt,
                "individual_losses": nn.functional.cross_entropy(out, y, reduction="none"),
            }
            with monitor(step, info=info):
                loss.backward()
        opt.step()
        opt.zero_grad()
    out = monitor.get_output()
    assert sorted(out["UpdateSize"]) == [1, 4, 7]
    assert sorted(out["Distance"]) == [1, 4, 7]
    assert sorted(out["Alpha"]) == [1, 4, 7]
    assert not qs[0]._cache and not qs[2]._cache  # caches freed after the end steps


# -- keys and merging -------------------------------------------------------------------------
def test_duplicate_keys_and_merged_extensions() -> None:
    model, lossf = setup()
    every = schedules.linear(1)
    qs = [
        quantities.HessTrace(every, curvature="diag_ggn_exact"),
        quantities.HessTrace(every, curvature="diag_ggn_mc"),
        quantities.TICDiag(every, curvature="diag_ggn_mc"),
        quantities.Loss(every),
        quantities.Loss(schedules.linear(2)),
    ]
    monitor = Monitor(model.parameters(), qs)
    assert monitor.keys() == [
        "HessTrace(curvature=diag_ggn_exact)",
        "HessTrace(curvature=diag_ggn_mc)",
        "TICDiag",
        "Loss#1",
        "Loss#2",
    ]
    # the user asks for DiagGGNMC with 4 samples on top: both MC variants are computed
    torch.manual_seed(3)
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    step_once(monitor, model, lossf, 0, exts=(DiagGGNMC(mc_samples=4), SumGradSquared()), X=X, y=y)
    for p in model.parameters():
        assert p.diag_ggn_mc.shape == p.shape  # the user's extension stays
        assert not hasattr(p, "diag_ggn_mc_1")  # the monitor's copy was freed
        assert hasattr(p, "sum_grad_squared")
    out = monitor.get_output()
    G = reference.ggn(model, nn.CrossEntropyLoss(), X, y)
    sizes = [p.numel() for p in model.parameters()]
    want = [float(d.sum()) for d in torch.diagonal(G).split(sizes)]
    np.testing.assert_allclose(out["HessTrace(curvature=diag_ggn_exact)"][0], want, rtol=1e-8)
    assert len(out["HessTrace(curvature=diag_ggn_mc)"][0]) == len(sizes)
    assert sorted(out["Loss#2"]) == [0]


def test_hesstrace_diag_h_matches_dense_hessian() -> None:
    model, lossf = setup(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    monitor = Monitor(model.parameters(), [quantities.HessTrace(schedules.linear(1))])
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    step_once(monitor, model, lossf, 0, X=X, y=y)
    H = reference.loss_hessian(model, nn.CrossEntropyLoss(), X, y)
    sizes = [p.numel() for p in model.parameters()]
    want = [float(d.sum()) for d in torch.diagonal(H).split(sizes)]
    np.testing.assert_allclose(monitor.get_output()["HessTrace"][0], want, rtol=1e-8)


def test_gradhist_range_adaptation() -> None:
    model, lossf = setup()
    hist = quantities.GradHist1d(
        schedules.linear(1), bins=10, adapt=GradAbsMax(schedules.linear(1), padding=0.1)
    )
    monitor = Monitor(model.parameters(), [hist])
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    step_once(monitor, model, lossf, 0, X=X, y=y)
    from test_monitor_quantities import per_sample_grads

    G = per_sample_grads(model, X, y)
    m = float(G.abs().max())
    assert hist._range == pytest.approx((-1.1 * m, 1.1 * m))
    X2, y2 = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    model.zero_grad()
    step_once(monitor, model, lossf, 1, X=X2, y=y2)
    G2 = per_sample_grads(model, X2, y2).numpy()
    got = monitor.get_output()["GradHist1d"][1]
    want = np.histogram(np.clip(G2, -1.1 * m, 1.1 * m), bins=10, range=(-1.1 * m, 1.1 * m))[0]
    assert np.abs(got["hist"] - want).sum() <= 2
    np.testing.assert_allclose(got["edges"], np.linspace(-1.1 * m, 1.1 * m, 11), atol=1e-12)


# -- HessMaxEV --------------------------------------------------------------------------------
def test_lanczos_on_matrix_with_dominant_negative_eigenvalue() -> None:
    torch.manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(40, 40, dtype=torch.float64))
    evals = torch.linspace(-10, 3, 40, dtype=torch.float64)
    A = Q @ torch.diag(evals) @ Q.t()
    theta, vec, _ = lanczos_max_eig(lambda v: A @ v, torch.randn(40, dtype=torch.float64))
    assert theta == pytest.approx(3.0, rel=1e-3)
    assert abs(float(vec @ Q[:, -1])) == pytest.approx(1.0, abs=1e-2)


def test_hessmaxev_negative_dominant_warm_start() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), nn.Tanh())
    torch.manual_seed(0)
    model, lossf = setup(model, nn.MSELoss())
    with torch.no_grad():
        model[2].bias.fill_(-1.0)
    q = quantities.HessMaxEV(schedules.linear(1))
    monitor = Monitor(model.parameters(), [q])
    X = torch.randn(8, 3, dtype=torch.float64)
    y = 5 * torch.ones(8, 1, dtype=torch.float64)
    for step in range(3):
        model.zero_grad()
        out = model(X)
        loss = lossf(out, y)
        assert monitor.create_graph(step)
        with monitor(step, info={"loss": loss}):
            loss.backward(create_graph=monitor.create_graph(step))
        H = reference.loss_hessian(model, nn.MSELoss(), X, y)
        ev = torch.linalg.eigvalsh(H)
        assert -ev[0] > 1.5 * ev[-1] > 0  # a power iteration would return ev[0]
        assert monitor.get_output()["HessMaxEV"][step] == pytest.approx(float(ev[-1]), rel=1e-3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
    # warm start: the later steps (nearby point) need fewer products than the first
    assert q.iterations[2] <= q.iterations[0]


# -- bad input --------------------------------------------------------------------------------
def test_missing_info_key_names_key_and_quantity() -> None:
    model, lossf = setup()
    monitor = Monitor(model.parameters(), [quantities.TICDiag(schedules.linear(1))])
    loss = lossf(model(torch.randn(6, 4, dtype=torch.float64)), torch.randint(0, 3, (6,)))
    with pytest.raises(KeyError, match=r"TICDiag.*batch_size"), monitor(0, info={"loss": loss}):
        loss.backward()


def test_nan_loss_records_nan_and_warns() -> None:
    model, lossf = setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    qs = configuration("economy", schedules.linear(1))
    monitor = Monitor(model.parameters(), qs)
    X = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step_once(monitor, model, lossf, 0, opt, X=X, y=y)
    X[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="NaN"):
        step_once(monitor, model, lossf, 1, opt, X=X, y=y)
    out = monitor.get_output()
    for key in ("NormTest", "InnerTest", "OrthoTest", "GradNorm", "GradHist1d", "Alpha"):
        v = out[key][1] if key != "Alpha" else out[key][0]
        assert isinstance(v, float) and math.isnan(v), key
    assert math.isnan(out["Loss"][1])


def test_cabs_and_early_stopping_need_sgd() -> None:
    for cls in (quantities.CABS, quantities.EarlyStopping):
        model, lossf = setup()
        opt = torch.optim.Adam(model.parameters())
        monitor = Monitor(model.parameters(), [cls(schedules.linear(1))])
        with pytest.raises(ValueError, match="zero-momentum SGD"):
            step_once(monitor, model, lossf, 0, opt)


def test_sum_reduction_refused() -> None:
    model, lossf = setup(loss=nn.CrossEntropyLoss(reduction="sum"))
    monitor = Monitor(model.parameters(), [quantities.NormTest(schedules.linear(1))])
    with pytest.raises(ValueError, match="mean-reduced"):
        step_once(monitor, model, lossf, 0)


def test_batchnorm_train_mode() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    model, lossf = setup(net)
    sched = schedules.linear(1)
    ok = [
        quantities.Loss(sched),
        quantities.GradNorm(sched),
        quantities.Distance(sched),
        quantities.UpdateSize(sched),
        quantities.HessMaxEV(sched),
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model.parameters(), ok)
    for step in range(2):
        step_once(monitor, model, lossf, step, opt)
    assert all(len(v) >= 1 for v in monitor.get_output().values())
    bad = Monitor(model.parameters(), [quantities.NormTest(sched)])
    with pytest.raises(RuntimeError, match=r"NormTest.*BatchNorm"):
        step_once(bad, model, lossf, 0, opt)


# -- Cockpit compat ---------------------------------------------------------------------------
def test_cockpit_script_runs_with_changed_imports() -> None:
    from backprism.compat.cockpit import Cockpit
    from backprism.compat.cockpit import quantities as cq
    from backprism.compat.cockpit.utils import schedules as cs
    from backprism.compat.cockpit.utils.configuration import configuration as cconf

    model, lossf = setup()
    indiv = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=[*cconf("economy"), cq.MeanGSNR(cs.linear(2))])
    for step in range(3):
        X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
        opt.zero_grad()
        out = model(X)
        loss, losses = lossf(out, y), indiv(out, y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(
                step,
                info={"batch_size": 6, "individual_losses": losses, "loss": loss, "optimizer": opt},
            ):
                loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    cockpit.log(2, 0, 1.0, 1.1, 1.2, 0.5, 0.4, 0.3, 0.1)
    out = cockpit.get_output()
    assert set(out[0]) >= {"Loss", "Alpha", "GradHist1d", "MeanGSNR", "UpdateSize"}
    assert out[2]["epoch_count"] == 0 and out[2]["learning_rate"] == 0.1
