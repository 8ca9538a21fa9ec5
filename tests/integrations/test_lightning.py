"""Lightning callback (``backprism.integrations.lightning``) in a real ``Trainer.fit``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from backprism.plot import read_log


def test_lightning_callback_in_trainer_fit(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning", reason="lightning not installed (pip install lightning)")
    from backprism.integrations.lightning import MonitorCallback
    from backprism.monitor import quantities, schedules

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
            self.lossfunc = nn.CrossEntropyLoss()
            self.backprism_info: dict = {}

        def training_step(self, batch, batch_idx):
            X, y = batch
            out = self.net(X)
            loss = self.lossfunc(out, y)
            self.backprism_info = {
                "individual_losses": nn.functional.cross_entropy(out, y, reduction="none")
            }
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            X, y = batch
            out = self.net(X)
            self.log("val_loss", self.lossfunc(out, y))
            self.log("val_acc", (out.argmax(1) == y).float().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    X, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    ds = torch.utils.data.TensorDataset(X, y)
    train = torch.utils.data.DataLoader(ds, batch_size=16)
    valid = torch.utils.data.DataLoader(ds, batch_size=32)
    every = schedules.linear(1)
    qs = [quantities.Loss(every), quantities.GradNorm(every), quantities.NormTest(every),
          quantities.Alpha(every)]
    cb = MonitorCallback(qs, log_path=tmp_path / "monitor.jsonl",
                         report=tmp_path / "report.html")
    trainer = L.Trainer(max_epochs=2, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, default_root_dir=tmp_path,
                        num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), train, valid)
    log = read_log(tmp_path / "monitor.jsonl")
    steps, _loss = log.scalar("Loss")
    assert steps.tolist() == list(range(8))
    assert log.scalar("NormTest")[1].size == 8
    # Alpha finishes one step later: every step but the last has a value
    assert log.scalar("Alpha")[0].tolist() == list(range(7))
    assert "valid_accuracy" in log.metrics() and "learning_rate" in log.metrics()
    assert log.metric("learning_rate")[1].tolist()[0] == pytest.approx(0.1)
    assert (tmp_path / "report.html").stat().st_size > 0


def test_lightning_callback_rejects_create_graph_quantities(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning", reason="lightning not installed (pip install lightning)")
    from backprism.integrations.lightning import MonitorCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 2)
            self.lossfunc = nn.CrossEntropyLoss()

        def training_step(self, batch, batch_idx):
            return self.lossfunc(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randint(0, 2, (8,)))
    cb = MonitorCallback("full", log_path=tmp_path / "m.jsonl")
    trainer = L.Trainer(max_steps=2, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"HessMaxEV need loss\.backward"):
            trainer.fit(Module(), torch.utils.data.DataLoader(ds, batch_size=4))
