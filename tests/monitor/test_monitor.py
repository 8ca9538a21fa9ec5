"""The :class:`~backprism.monitor.Monitor` (``backprism.monitor.monitor``): two-step quantities
and the steps their values are stored under, output keys and the merging of the extensions the
quantities and the user ask for, one shared histogram pass and no engine work on untracked
steps, bad input (a missing ``info`` key, a NaN loss, a sum-reduced loss, BatchNorm in train
mode); and, on every device (the ``device`` fixture), the full configuration for a few steps
against brute force at step 0 (all outputs finite, the streamed log and the JSON output written
and read back), also under ``torch.device(device)`` as the default device.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import backprism
from backprism import extend
from backprism.engine.state import suspended
from backprism.extensions import BatchGrad, DiagGGNMC, GradHist, SumGradSquared
from backprism.monitor import Monitor, configuration, quantities, read_log, schedules
from backprism.monitor.quantities.bin_adaptation import GradAbsMax
from tests import reference
from tests.common import build_on_device, cpu_data, monitor_setup, monitor_step, resolved
from tests.reference import ggn_blocks, per_sample_grads


def projection_setup(kind: str, n: int = 7, seed: int = 0):
    """An extended float64 MLP (``kind="mlp"``), its loss and a batch, as in
    ``tests/extensions/test_projections.py``."""
    assert kind == "mlp"
    torch.manual_seed(seed)
    model = backprism.extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double())
    lossf = backprism.extend(nn.CrossEntropyLoss())
    X = torch.randn(n, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    return model, lossf, X, y, None


def test_two_step_events_and_output_steps() -> None:
    """UpdateSize/Alpha start at scheduled s, finish at s + 1 and store under s; Distance is
    stored at the scheduled steps; nothing is computed elsewhere."""
    model, lossf = monitor_setup()
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


def test_duplicate_keys_and_merged_extensions() -> None:
    model, lossf = monitor_setup()
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
    exts = (DiagGGNMC(mc_samples=4), SumGradSquared())
    monitor_step(monitor, model, lossf, 0, exts=exts, X=X, y=y)
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


def _step(monitor, model, lossf, X, y, step, opt):
    out = model(X)
    loss = lossf(out, y)
    info = {
        "loss": loss,
        "batch_size": X.shape[0],
        "individual_losses": nn.CrossEntropyLoss(reduction="none")(out.detach(), y),
        "optimizer": opt,
    }
    ctx = monitor(step, info=info)
    with ctx:
        loss.backward(create_graph=monitor.create_graph(step))
    opt.step()
    opt.zero_grad()
    return ctx


def test_monitor_shares_one_histogram_pass_and_builds_no_grad_batch(monkeypatch) -> None:
    model, lossf, X, y, _ = projection_setup("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    seen_exts = []
    orig_hist = GradHist.from_rule
    orig_batch = BatchGrad.from_rule

    def count_hist(self, *args, **kwargs):
        calls.append(self)
        return orig_hist(self, *args, **kwargs)

    def no_batch(self, *args, **kwargs):  # SGD: no quantity needs grad_batch
        seen_exts.append("BatchGrad")
        return orig_batch(self, *args, **kwargs)

    monkeypatch.setattr(GradHist, "from_rule", count_hist)
    monkeypatch.setattr(BatchGrad, "from_rule", no_batch)
    qs = [
        quantities.GradHist1d(schedules.linear(1)),
        quantities.GradHist2d(schedules.linear(1)),
        quantities.Alpha(schedules.linear(1)),
        quantities.InnerTest(schedules.linear(1)),
    ]
    monitor = Monitor(model.parameters(), qs)
    for step in range(3):
        calls.clear()
        _step(monitor, model, lossf, X, y, step, opt)
        assert len({id(e) for e in calls}) == 1  # one merged extension ...
        assert len(calls) == 2  # ... run once per Linear
        assert set(calls[0].__dict__) >= {"bins", "bins2d"}
        assert calls[0].bins == 100 and calls[0].bins2d == (40, 50)
    assert not seen_exts
    out = monitor.get_output()
    assert sorted(out["GradHist1d"]) == [0, 1, 2] and sorted(out["Alpha"]) == [0, 1]
    for p in model.parameters():
        assert not any(hasattr(p, f) for f in ("grad_batch", "grad_hist", "batch_dot_with"))


def test_untracked_steps_do_no_engine_work() -> None:
    model, lossf, X, y, _ = projection_setup("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model.parameters(), configuration("full", schedules.linear(3, offset=1)))
    for step in range(5):
        ctx = _step(monitor, model, lossf, X, y, step, opt)
        # Alpha/UpdateSize end at s + 1 (bookkeeping only for UpdateSize); step 0, 3: nothing
        if step in (0, 3):
            assert ctx.ctx is None, step
            assert not monitor.create_graph(step)
    assert sorted(monitor.get_output()["HessMaxEV"]) == [1, 4]


# -- bad input -------------------------------------------------------------------------------------
def test_missing_info_key_names_key_and_quantity() -> None:
    model, lossf = monitor_setup()
    monitor = Monitor(model.parameters(), [quantities.TICDiag(schedules.linear(1))])
    loss = lossf(model(torch.randn(6, 4, dtype=torch.float64)), torch.randint(0, 3, (6,)))
    with pytest.raises(KeyError, match=r"TICDiag.*batch_size"), monitor(0, info={"loss": loss}):
        loss.backward()


def test_nan_loss_records_nan_and_warns() -> None:
    model, lossf = monitor_setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    qs = configuration("economy", schedules.linear(1))
    monitor = Monitor(model.parameters(), qs)
    X = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor_step(monitor, model, lossf, 0, opt, X=X, y=y)
    X[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="NaN"):
        monitor_step(monitor, model, lossf, 1, opt, X=X, y=y)
    out = monitor.get_output()
    for key in ("NormTest", "InnerTest", "OrthoTest", "GradNorm", "GradHist1d", "Alpha"):
        v = out[key][1] if key != "Alpha" else out[key][0]
        assert isinstance(v, float) and math.isnan(v), key
    assert math.isnan(out["Loss"][1])


def test_sum_reduction_refused() -> None:
    model, lossf = monitor_setup(loss=nn.CrossEntropyLoss(reduction="sum"))
    monitor = Monitor(model.parameters(), [quantities.NormTest(schedules.linear(1))])
    with pytest.raises(ValueError, match="mean-reduced"):
        monitor_step(monitor, model, lossf, 0)


def test_batchnorm_train_mode() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    model, lossf = monitor_setup(net)
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
        monitor_step(monitor, model, lossf, step, opt)
    assert all(len(v) >= 1 for v in monitor.get_output().values())
    bad = Monitor(model.parameters(), [quantities.NormTest(sched)])
    with pytest.raises(RuntimeError, match=r"NormTest.*BatchNorm"):
        monitor_step(bad, model, lossf, 0, opt)


# -- on a device ----------------------------------------------------------------------------------
def _finite(value: Any) -> bool:
    if isinstance(value, Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return bool(np.isfinite(value.astype(np.float64)).all())
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, (bool, int, np.integer)):
        return True
    if isinstance(value, (float, np.floating)):
        return math.isfinite(float(value))
    return False


def _quantities(schedule, hess_max_ev: bool = True) -> list[quantities.Quantity]:
    """The full configuration plus variants that take other code paths (without HessMaxEV if
    ``hess_max_ev`` is false)."""
    extra = [
        quantities.GradHist1d(schedule, bins=12, range=(-0.5, 0.5), adapt=GradAbsMax(schedule)),
        quantities.GradHist2d(schedule, bins=(5, 4), keep_individual=True),
        quantities.HessTrace(schedule, curvature="diag_ggn_exact"),
        quantities.HessTrace(schedule, curvature="diag_ggn_mc"),
        quantities.TICDiag(schedule, curvature="diag_ggn_exact"),
        quantities.TICTrace(schedule, curvature="diag_ggn_exact"),
        quantities.Parameters(schedule),
    ]
    qs = configuration("full", schedule) + extra
    return [q for q in qs if hess_max_ev or not isinstance(q, quantities.HessMaxEV)]


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize(
    ("name", "opt_name"), [("mlp", "sgd"), ("mlp", "adam"), ("cnn", "sgd"), ("resnet", "sgd")]
)
def test_monitor_on_device(name, opt_name, tmp_path, device):
    model, lossfunc, _, _, _ = build_on_device(name, device, seed=9)
    nb = 6
    with torch.device("cpu"):
        randn, labels = cpu_data(10)
        shape = {"mlp": (4,), "cnn": (2, 4, 4), "resnet": (2, 3, 3)}[name]
        batches = [(randn(nb, *shape).to(device), labels(3, nb).to(device)) for _ in "ab"]
    individual = nn.CrossEntropyLoss(reduction="none")
    params = list(model.parameters())
    X0, y0 = batches[0]
    with suspended():  # brute force at step 0, before training
        ps = per_sample_grads(model, lossfunc, X0, y0)
        G = torch.cat([v.flatten(1) for v in ps.values()], 1) * nb  # [N, D]: ∇ℓₙ
        diag = torch.diagonal(ggn_blocks(model, lossfunc, X0, y0)[0].sum((0, 1)))
    extend(model), extend(lossfunc)
    if opt_name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.2)
    else:
        opt = torch.optim.Adam(params, lr=0.05)
    schedule = schedules.linear(1)
    qs = _quantities(schedule, hess_max_ev=False)  # tested alone below
    monitor = Monitor(params, qs, log_path=tmp_path / "run.jsonl")
    torch.manual_seed(0)
    losses = []
    for step, (X, y) in enumerate(batches):
        opt.zero_grad()
        out = model(X)
        loss = lossfunc(out, y)
        losses.append(float(loss.detach()))
        tracked_backward(monitor, step, loss, individual(out, y), nb, opt)
        opt.step()
        for p in params:
            assert p.device == resolved(device)
            for attr in vars(p):
                assert not isinstance(getattr(p, attr), Tensor), f"{attr} left on the parameter"
    monitor.log(1, 0, train_loss=torch.tensor(losses[-1], device=device), learning_rate=0.1)
    monitor.close()
    monitor.write(tmp_path / "out.json")

    out = monitor.get_output()
    for q in qs:
        assert 0 in out[q.key], q.key  # Alpha, UpdateSize: stored under the start step
        for step, value in out[q.key].items():
            if q.key.startswith("Alpha") and value == -1.0:
                continue  # concave fit: recorded as −1
            assert _finite(value), (q.key, step, value)

    # brute force at step 0
    g = G.mean(0)
    g2 = float(g.square().sum())
    sizes = [p.numel() for p in params]
    assert out["Loss"][0] == pytest.approx(losses[0], rel=1e-12)
    np.testing.assert_allclose(out["GradNorm"][0], [float(v.norm()) for v in g.split(sizes)])
    norm_test = math.sqrt(float((G - g).square().sum()) / (nb - 1) / nb / g2)
    assert out["NormTest"][0] == pytest.approx(norm_test, rel=1e-8)
    inner = math.sqrt(float((G @ g).var()) / nb / g2**2)
    assert out["InnerTest"][0] == pytest.approx(inner, rel=1e-8)
    trace = [float(d.sum()) for d in diag.split(sizes)]
    np.testing.assert_allclose(out["HessTrace(curvature=diag_ggn_exact)"][0], trace, rtol=1e-8)
    tic = float((G.square().mean(0) / (diag + 1e-7)).sum())
    assert out["TICDiag(curvature=diag_ggn_exact)"][0] == pytest.approx(tic, rel=1e-8)
    hist = [v for k, v in out.items() if k.startswith("GradHist1d")]
    assert {int(np.asarray(h[0]["hist"]).sum()) for h in hist} == {nb * sum(sizes)}

    log = read_log(tmp_path / "run.jsonl", as_frame=False)
    assert set(log["meta"]["quantities"]) == {q.key for q in qs}
    assert [s["step"] for s in log["steps"]] == [0, 1]
    assert set(log["steps"][0]["values"]) >= {q.key for q in qs}
    assert log["logs"][0]["train_loss"] == pytest.approx(losses[-1])
    assert log["steps"][0]["values"]["Loss"] == pytest.approx(losses[0], rel=1e-12)
    with open(tmp_path / "out.json", encoding="utf-8") as f:
        written = json.load(f)
    assert written["Loss"]["0"] == pytest.approx(losses[0], rel=1e-12)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_monitor_under_default_device(device):
    """A user who sets ``torch.set_default_device(device)`` (here scoped, ``with
    torch.device(device)``): tensors the library creates without ``device=`` land on the device
    and must still be usable (e.g. converted to NumPy for the output)."""
    model, lossfunc, _, _, _ = build_on_device("mlp", device, seed=11)
    with torch.device("cpu"):
        randn, labels = cpu_data(12)
        X, y = randn(6, 4).to(device), labels(3, 6).to(device)
    extend(model), extend(lossfunc)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = schedules.linear(1)
    qs = _quantities(schedule)
    monitor = Monitor(model.parameters(), qs)
    with torch.device(device):
        for step in range(2):
            opt.zero_grad()
            out = model(X)
            loss = lossfunc(out, y)
            individual = nn.functional.cross_entropy(out, y, reduction="none")
            tracked_backward(monitor, step, loss, individual, 6, opt)
            opt.step()
    out = monitor.get_output()
    for q in qs:
        assert 0 in out[q.key], q.key
        assert all(
            _finite(v) or (q.key.startswith("Alpha") and v == -1.0) for v in out[q.key].values()
        ), q.key


def tracked_backward(
    monitor: Monitor, step: int, loss: Tensor, individual: Tensor, batch_size: int, opt: Any
) -> None:
    """``loss.backward`` inside ``monitor(step, info=...)`` (warnings silenced)."""
    info = {
        "loss": loss,
        "individual_losses": individual,
        "batch_size": batch_size,
        "optimizer": opt,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with monitor(step, info=info):
            loss.backward(create_graph=monitor.create_graph(step))


@pytest.mark.parametrize("accelerator", [False, True])
@pytest.mark.parametrize("scale", [1.0, 1024.0, 0.25])
def test_a_backward_from_a_scaled_loss_is_warned_about(scale: float, accelerator: bool) -> None:
    """``scaler.scale(loss).backward()`` (``torch.amp.GradScaler``) or ``(loss / k)`` for
    gradient accumulation: the quantities computed from gradients are the scaled objective's
    while the loss values are ``info['loss']``'s — one warning naming the factor, on the
    first tracked step; none for the loss itself. On an accelerator's code paths the factor
    comes to the host with the step's values (no read of its own)."""
    from backprism.monitor.deferred import accelerator_paths

    model, lossf = monitor_setup()
    monitor = Monitor(model.parameters(), [quantities.GradNorm(schedules.linear(1))])
    for step in range(2):
        X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
        loss = lossf(model(X), y)
        info = {"loss": loss, "batch_size": 6}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with accelerator_paths(accelerator), monitor(step, info=info):
                (loss * scale).backward()
        said = [str(w.message) for w in caught if "info['loss']" in str(w.message)]
        if scale == 1.0 or step == 1:
            assert said == []
        else:
            assert len(said) == 1 and f"{scale:.6g} × info['loss']" in said[0]
        model.zero_grad()
