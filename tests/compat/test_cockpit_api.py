"""Cockpit 1.0's public names, output formats and example flows through
``backprism.compat.cockpit`` (+ ``backprism.compat.backpack``), with float64 references.

Also: a Cockpit script runs with changed imports on an extended MLP; ``CockpitPlotter`` runs on
backprism's dashboard, from a Cockpit or its written log.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import warnings

import pytest
import torch
from torch import nn

import backprism
from backprism.compat.backpack import extend, extensions
from backprism.compat.cockpit import Cockpit, CockpitPlotter, quantities
from backprism.compat.cockpit.utils import schedules
from backprism.compat.cockpit.utils.configuration import configuration
from tests.common import monitor_setup
from tests.reference import loss_hessian, per_sample_grads

DT = torch.double


def fmnist_like(steps: int, n: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    return [(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))) for _ in range(steps)]


def train(cockpit, model, loss_fn, individual_loss_fn, opt, data, *exts, after=None):
    for global_step, (inputs, labels) in enumerate(data):
        opt.zero_grad()
        outputs = model(inputs)
        loss = loss_fn(outputs, labels)
        losses = individual_loss_fn(outputs, labels)
        info = {"batch_size": inputs.shape[0], "individual_losses": losses, "loss": loss,
                "optimizer": opt}
        with cockpit(global_step, *exts, info=info):
            loss.backward(create_graph=cockpit.create_graph(global_step))
        if after is not None:
            after(global_step, inputs, labels, loss)
        opt.step()


def test_public_paths():
    names = {
        "": ["Cockpit", "CockpitPlotter", "quantities"],
        ".quantities": [
            "Loss", "Parameters", "Distance", "UpdateSize", "GradNorm", "Time", "Alpha", "CABS",
            "EarlyStopping", "GradHist1d", "GradHist2d", "NormTest", "InnerTest", "OrthoTest",
            "HessMaxEV", "HessTrace", "TICDiag", "TICTrace", "MeanGSNR",
        ],
        ".quantities.quantity": ["Quantity", "SingleStepQuantity", "TwoStepQuantity",
                                 "ByproductQuantity"],
        ".quantities.bin_adaptation": ["NoAdaptation", "GradAbsMax", "ParamAbsMax"],
        ".quantities.cabs": ["CABS"],
        ".quantities.tic": ["TICDiag", "TICTrace"],
        ".utils.schedules": ["linear", "logarithmic"],
        ".utils.configuration": ["configuration", "quantities_cls_for_configuration"],
        ".instruments": ["alpha_gauge", "cabs_gauge", "histogram_2d_gauge", "trace_gauge"],
    }
    for path, attrs in names.items():
        mod = importlib.import_module(f"backprism.compat.cockpit{path}")
        for a in attrs:
            assert hasattr(mod, a), f"cockpit{path}.{a}"
    assert Cockpit.BACKPACK_CONV_SAVE_MEMORY is True
    gauges = importlib.import_module("backprism.compat.cockpit.instruments")
    with pytest.raises(NotImplementedError, match="CockpitPlotter"):
        gauges.alpha_gauge(None, None, None)
    from backprism.compat.cockpit.utils.configuration import quantities_cls_for_configuration

    assert quantities.HessMaxEV in quantities_cls_for_configuration("full")


def test_basic_example_flow_and_output_format(tmp_path):
    """Cockpit's 01_basic_fmnist example (random Fashion-MNIST-shaped data, 3 steps) plus the
    single-step quantities outside the configurations; CABS is a float, as in Cockpit."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    model = extend(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)))
    loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="mean"))
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    every = schedules.linear(1)
    qs = [
        *configuration("full"), quantities.CABS(every), quantities.EarlyStopping(every),
        quantities.MeanGSNR(every), quantities.TICTrace(every), quantities.Time(every),
    ]
    cockpit = Cockpit(model.parameters(), quantities=qs)
    plotter = CockpitPlotter()
    expected_cabs = {}

    def cabs_reference(step, inputs, labels, loss):
        m = nn.Sequential(nn.Flatten(), nn.Linear(784, 10)).to(DT)
        m.load_state_dict(model.state_dict())
        gb = per_sample_grads(m, nn.CrossEntropyLoss(), inputs.to(DT), labels)
        g = torch.cat([v.sum(0).reshape(-1) for v in gb.values()])
        sgs = torch.cat([v.square().sum(0).reshape(-1) for v in gb.values()])
        n = inputs.shape[0]
        expected_cabs[step] = float(1e-2 * (n**2 * sgs - n * g**2).sum() / (n * loss.item()))

    train(cockpit, model, loss_fn, individual_loss_fn, opt, fmnist_like(3), after=cabs_reference)
    plotter.plot(cockpit, show_plot=False)
    out = cockpit.get_output()
    assert sorted(out) == [0, 1, 2]
    for step, cabs in expected_cabs.items():
        assert isinstance(out[step]["CABS"], float)
        assert math.isclose(out[step]["CABS"], cabs, rel_tol=1e-4)
    assert isinstance(out[0]["GradHist1d"]["hist"], torch.Tensor)
    assert isinstance(out[0]["GradHist2d"]["edges"][0], torch.Tensor)
    for key in ("Loss", "Alpha", "HessMaxEV", "TICDiag", "NormTest", "EarlyStopping"):
        assert isinstance(out[1][key], float), key
    assert len(out[1]["GradNorm"]) == 2  # one entry per parameter
    cockpit.write(os.fspath(tmp_path / "log"))
    with open(tmp_path / "log.json", encoding="utf-8") as f:
        written = json.load(f)
    assert math.isclose(written["1"]["CABS"], out[1]["CABS"])


def test_advanced_example_flow(tmp_path):
    """Cockpit's 02_advanced_fmnist example: a CNN, an extended individual loss, an extra
    BackPACK extension next to the quantities, plots saved during and after training."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(
        torch.nn.Conv2d(1, 11, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2, 2),
        torch.nn.Conv2d(11, 16, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2, 2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 80), torch.nn.ReLU(),
        torch.nn.Linear(80, 84), torch.nn.ReLU(), torch.nn.Linear(84, 10),
    ))
    loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="mean"))
    individual_loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="none"))
    opt = torch.optim.SGD(model.parameters(), lr=5e-1)
    qs = [
        quantities.GradNorm(schedules.linear(interval=1)),
        quantities.Distance(schedules.linear(interval=1)),
        quantities.UpdateSize(schedules.linear(interval=1)),
        quantities.HessMaxEV(schedules.linear(interval=3)),
        quantities.GradHist1d(schedules.linear(interval=2), bins=10),
    ]
    cockpit = Cockpit(model.parameters(), quantities=qs)
    plotter = CockpitPlotter()
    logpath = os.fspath(tmp_path / "cockpit_output")

    def check(step, *_):
        for p in model.parameters():
            assert p.diag_h.shape == p.shape  # the extra extension's result stays
        if step % 2 == 1:
            plotter.plot(cockpit, savedir=tmp_path, show_plot=False, save_plot=True,
                         savename_append=str(step))

    train(cockpit, model, loss_fn, individual_loss_fn, opt, fmnist_like(4, n=8),
          extensions.DiagHessian(), after=check)
    cockpit.write(logpath)
    plotter.plot(logpath, savedir=tmp_path, show_plot=False, save_plot=True,
                 savename_append="_final")
    out = cockpit.get_output()
    assert set(out[0]) == {"GradNorm", "Distance", "UpdateSize", "HessMaxEV", "GradHist1d"}
    assert "HessMaxEV" not in out[1] and out[0]["GradHist1d"]["hist"].shape == (10,)
    for name in ("cockpit1.png", "cockpit3.png", "cockpit_final.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_hess_max_ev_value_and_use_power():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT))
    loss_fn = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(8, 5, dtype=DT), torch.randint(0, 3, (8,))
    top = torch.linalg.eigvalsh(loss_hessian(model, loss_fn, X, y))[-1].item()
    for use_power in (True, False):
        q = quantities.HessMaxEV(schedules.linear(1), use_power=use_power)
        cockpit = Cockpit(model.parameters(), quantities=[q])
        loss = loss_fn(model(X), y)
        with cockpit(0, info={"loss": loss, "batch_size": 8}):
            loss.backward(create_graph=cockpit.create_graph(0))
        assert math.isclose(cockpit.get_output()[0]["HessMaxEV"], top, rel_tol=2e-3)
        model.zero_grad()


def test_custom_quantity_with_cockpit_signature():
    from backprism.compat.cockpit.quantities.quantity import SingleStepQuantity

    class SumOfParams(SingleStepQuantity):
        def _compute(self, global_step, params, batch_loss):
            return float(sum(p.detach().sum() for p in params)) + 0 * float(batch_loss.detach())

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 2)))
    loss_fn = extend(nn.MSELoss())
    cockpit = Cockpit(model.parameters(), quantities=[SumOfParams(schedules.linear(1))])
    X, y = torch.randn(4, 3), torch.randn(4, 2)
    loss = loss_fn(model(X), y)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    ref = float(sum(p.detach().sum() for p in model.parameters()))
    assert math.isclose(cockpit.get_output()[0]["SumOfParams"], ref, rel_tol=1e-6)


def test_plotter_discard_and_animation(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    import matplotlib

    matplotlib.use("Agg")
    model = extend(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    train(cockpit, model, loss_fn, torch.nn.CrossEntropyLoss(reduction="none"), opt,
          fmnist_like(4, n=8))
    logpath = os.fspath(tmp_path / "run")
    cockpit.write(logpath)
    plotter = CockpitPlotter()
    for epoch in (1, 2):
        plotter.plot(logpath, show_plot=False, save_plot=True, savedir=tmp_path,
                     savename="run", savename_append=f"__primary__epoch__{epoch:04d}",
                     discard=epoch)
    plotter.build_animation(logpath + ".json")
    assert (tmp_path / "run__primary.gif").stat().st_size > 0


def test_cockpit_script_runs_with_changed_imports() -> None:
    from backprism.compat.cockpit import Cockpit
    from backprism.compat.cockpit import quantities as cq
    from backprism.compat.cockpit.utils import schedules as cs
    from backprism.compat.cockpit.utils.configuration import configuration as cconf

    model, lossf = monitor_setup()
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


def test_cockpit_plotter_from_object_and_file(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from backprism.compat.cockpit import Cockpit, CockpitPlotter
    from backprism.compat.cockpit.utils.configuration import configuration

    torch.manual_seed(0)
    model = backprism.extend(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    lossfunc = backprism.extend(nn.CrossEntropyLoss())
    individual = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    for step in range(4):
        X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        opt.zero_grad()
        out = model(X)
        loss, losses = lossfunc(out, y), individual(out, y)
        info = {"batch_size": 16, "individual_losses": losses, "loss": loss, "optimizer": opt}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    cockpit.write(os.fspath(tmp_path / "log"))
    plotter = CockpitPlotter()
    fig = plotter.plot(cockpit, show_plot=False, save_plot=True, savedir=tmp_path)
    titles = {ax.get_title(loc="left") for ax in fig.axes}
    assert "Gradient norm" in titles and "α gauge" in titles
    plotter.plot(
        tmp_path / "log.json", show_plot=False, save_plot=True, savename_append="_f", discard=1
    )
    assert (tmp_path / "cockpit.png").stat().st_size > 0
    assert (tmp_path / "cockpit_f.png").stat().st_size > 0
