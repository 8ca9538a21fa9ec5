"""Cockpit's CockpitPlotter runs on backprism's dashboard, from a Cockpit or its written log."""

import os

import pytest
import torch
from torch import nn

import backprism

pytest.importorskip("matplotlib")


def test_cockpit_plotter_from_object_and_file(tmp_path):
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
