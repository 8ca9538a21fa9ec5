"""TensorBoard writer (read back with TensorBoard's EventAccumulator) and Lightning callback
(real ``Trainer.fit``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from backprism.plot import read_log
from test_plot import synthetic_records, write_synthetic_log


def _accumulator(log_dir: Path):
    ea_mod = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard not installed (pip install tensorboard)",
    )
    acc = ea_mod.EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0,
                                                               "images": 0})
    acc.Reload()
    return acc


def test_tensorboard_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install tensorboard)")
    from backprism.integrations.tensorboard import TensorBoardWriter

    log_path = write_synthetic_log(tmp_path / "run.jsonl", steps=12)
    log = read_log(log_path)
    with TensorBoardWriter(tmp_path / "tb") as tb:
        n = tb.update(log_path)
        assert n > 0 and tb.update(log_path) == 0  # nothing new the second time
    acc = _accumulator(tmp_path / "tb")
    tags = acc.Tags()
    _x, gn = log.scalar("GradNorm")
    events = acc.Scalars("backprism/GradNorm")
    assert [e.step for e in events] == list(range(12))
    assert [e.value for e in events] == pytest.approx(gn.tolist(), rel=1e-6)
    assert "backprism/GradNorm/param_3" in tags["scalars"]
    assert [e.step for e in acc.Scalars("backprism/HessMaxEV")] == list(range(0, 12, 2))
    assert acc.Scalars("backprism/CABS")[0].value == pytest.approx(32)
    assert [e.step for e in acc.Scalars("metrics/valid_accuracy")] == [9]
    # Alpha is null at step 5: skipped, not written as NaN
    assert 5 not in [e.step for e in acc.Scalars("backprism/Alpha")]
    hist = acc.Histograms("backprism/GradHist1d")
    assert len(hist) == 12
    raw = json.loads(log_path.read_text().splitlines()[1])["values"]["GradHist1d"]
    assert hist[0].histogram_value.num == pytest.approx(sum(raw["hist"]))
    assert list(hist[0].histogram_value.bucket) == pytest.approx(raw["hist"])
    assert "backprism/GradHist2d" in tags["images"]
    assert len(acc.Images("backprism/GradHist2d")) == 6


def test_tensorboard_update_follows_growing_log(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install tensorboard)")
    from backprism.integrations.tensorboard import TensorBoardWriter

    recs = synthetic_records(steps=6, quantities=["Loss"])
    p = tmp_path / "run.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs[:4]))
    tb = TensorBoardWriter(tmp_path / "tb")
    assert tb.update(p) == 3
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tb.update(p) == 3
    tb.close()
    assert [e.step for e in _accumulator(tmp_path / "tb").Scalars("backprism/Loss")] == list(
        range(6))


# ---------------------------------------------------------------------------- Lightning
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


# ---------------------------------------------------------------------------- extras
def test_missing_integration_dependency_names_its_extra(monkeypatch) -> None:
    import importlib
    import sys

    from backprism.integrations.tensorboard import TensorBoardWriter

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'backprism\[tensorboard\]'"):
        TensorBoardWriter("unused")
    for mod in ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks",
                "pytorch_lightning", "pytorch_lightning.callbacks"):
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.delitem(sys.modules, "backprism.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'backprism\[lightning\]'"):
        importlib.import_module("backprism.integrations.lightning")
    monkeypatch.delitem(sys.modules, "backprism.integrations.lightning", raising=False)


def test_integrations_and_report_are_optional_extras() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    meta = tomllib.loads(pyproject.read_text())["project"]
    extras = meta["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        return {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}

    assert names(meta["dependencies"]) == {"torch", "numpy"}
    for extra, dist in (("tensorboard", "tensorboard"), ("lightning", "lightning"),
                        ("wandb", "wandb"), ("report", "plotly")):
        assert dist in names(extras[extra]), extra
        assert dist in names(extras["test"]), extra
    assert {"tensorboard", "lightning", "wandb"} <= names(extras["integrations"])
    assert {"plotly", "tqdm"} <= names(extras["demo"])
