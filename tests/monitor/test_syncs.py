"""No host synchronisation inside a tracked step.

On the CPU, :func:`backprism.monitor.syncs.count_syncs` records every operation that would make
the host wait for a CUDA device (``item``, ``nonzero``, boolean masks, ``unique``,
``bincount``, host copies, ...). Inside :func:`~backprism.monitor.deferred.accelerator_paths`
the CPU takes the code paths of accelerators (device-side histograms, Lanczos with a fixed
number of products), so these tests check, on any machine, what a GPU would run:

* every quantity alone and every configuration: no synchronising operation from the monitor
  inside a tracked step, at most one in all (the engine reads the loss-gradient scale of a
  backward pass with second-order extensions on the host: one read, outside the monitor);
* the values of a step reach the host in exactly one transfer, when the log line is written;
* the values are those the CPU's fast paths give;
* ``write_lag=1``: the write of a step happens at the end of the next one; ``close`` flushes;
* memory: streamed histograms keep only what the dashboard draws.

On a machine with a GPU, ``torch.cuda.set_sync_debug_mode("error")`` around the steps checks
the same for real (skipped elsewhere).
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import backprism
from backprism.monitor import Monitor, configuration, quantities, schedules
from backprism.monitor.configuration import TRACKED
from backprism.monitor.deferred import accelerator_paths
from backprism.monitor.quantities.bin_adaptation import GradAbsMax, ParamAbsMax
from backprism.monitor.syncs import count_syncs

EVERY = schedules.linear(1)
#: the monitor's log write (allowed to transfer, once)
WRITE = ("_write_oldest", "flush")

ALL = list(TRACKED)
CURVATURE_VARIANTS = [
    ("HessTrace", "diag_ggn_exact"),
    ("HessTrace", "diag_ggn_mc"),
    ("HessTrace", "hutchinson"),
    ("TICDiag", "diag_ggn_mc"),
    ("TICTrace", "diag_ggn_mc"),
    ("TICTrace", "diag_ggn_exact"),
]


def make_model(device: str = "cpu", dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 8),
        nn.ReLU(),
        nn.Linear(8, 3),
    ).to(device, dtype)
    return backprism.extend(model), backprism.extend(nn.CrossEntropyLoss())


def train(
    qs,
    steps: int = 4,
    device: str = "cpu",
    accelerator: bool = True,
    write_lag: int | None = None,
    log_path=None,
    nan_step: int | None = None,
    keep_history=None,
    counted: bool = True,
    quiet: bool = True,
):
    """Train a small ReLU net; returns the monitor and the sync counter of every step."""
    model, lossf = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(
        model.parameters(), qs, log_path=log_path, write_lag=write_lag, keep_history=keep_history
    )
    gen = torch.Generator().manual_seed(1)
    counters = []
    for step in range(steps):
        X = torch.randn(6, 2, 6, 6, generator=gen).to(device)
        y = torch.randint(0, 3, (6,), generator=gen).to(device)
        if step == nan_step:
            X[0, 0, 0, 0] = float("nan")
        out = model(X)
        loss = lossf(out, y)
        losses = nn.functional.cross_entropy(out.detach(), y, reduction="none")
        info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
            with accelerator_paths(accelerator), count_syncs() as counter:
                if not counted:
                    counter.paused += 1
                with monitor(step, info=info):
                    loss.backward(create_graph=monitor.create_graph(step))
        counters.append(counter)
        if step != nan_step:  # a NaN update would break every later step
            opt.step()
        opt.zero_grad()
    return monitor, counters


def build(name: str, curvature: str | None = None):
    cls = getattr(quantities, name)
    if curvature is not None:
        return cls(EVERY, curvature=curvature)
    if name in ("GradHist1d", "GradHist2d"):
        return cls(EVERY, bins=(5, 4) if name == "GradHist2d" else 12)
    return cls(EVERY)


def monitor_events(counter):
    """Synchronising events inside the monitor's own code (outside the log write)."""
    return [
        e
        for e in counter.events_outside(*WRITE)
        if any("backprism/monitor" in f.filename.replace("\\", "/") for f in e.stack[-8:])
    ]


# -- the counter itself -----------------------------------------------------------------------
def test_counter_records_what_synchronises_and_nothing_else() -> None:
    x = torch.randn(50)
    with count_syncs() as c:
        y = (x * 2 + 1).clamp(0, 1).floor()
        torch.histc(y, bins=4, min=-0.5, max=3.5)
        torch.nn.functional.one_hot(torch.tensor([0, 2]), 3)
    assert c.events == [], c.summary()
    with count_syncs() as c:
        float(x.sum())
        x.nonzero()
        x[x > 0]
        torch.unique(x)
        torch.bincount((x > 0).long(), minlength=2)
        x.tolist()
        np.asarray(x)
        bool(x.max() > 0)
    ops = [e.op for e in c.events]
    assert ops == [
        "_local_scalar_dense",
        "nonzero",
        "index with a boolean mask",
        "_unique2",
        "bincount",
        "Tensor.tolist",
        "Tensor.__array__",
        "_local_scalar_dense",
    ], ops
    assert "test_syncs.py" in c.events[0].where()


# -- every quantity ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "curvature"), [(n, None) for n in ALL] + CURVATURE_VARIANTS,
    ids=[n for n in ALL] + [f"{n}-{c}" for n, c in CURVATURE_VARIANTS],
)
def test_no_sync_inside_a_tracked_step(name: str, curvature: str | None) -> None:
    _, counters = train([build(name, curvature)])
    for step, counter in enumerate(counters[1:], 1):  # step 0: the one-off reduction check
        assert not monitor_events(counter), (step, counter.summary())
        # no sync outside the log write, second-order quantities included: the engine knows
        # the loss enters with factor 1 under loss.backward() without reading the gradient
        assert not counter.events_outside(*WRITE), (step, counter.summary())
        writes = counter.events_inside(*WRITE)
        assert len(writes) == 1 and writes[0].op == "Tensor.numpy", counter.summary()


@pytest.mark.parametrize("label", ["economy", "business", "full"])
def test_configurations_synchronise_at_most_once(label: str) -> None:
    _, counters = train(configuration(label, EVERY), steps=4)
    for counter in counters[1:]:
        assert not monitor_events(counter), counter.summary()
        outside = counter.events_outside(*WRITE)
        assert not outside, counter.summary()
        assert len(counter.events_inside(*WRITE)) == 1


def test_first_step_reads_the_reduction_check_once() -> None:
    _, counters = train([quantities.NormTest(EVERY)], steps=2)
    first = counters[0].events_outside(*WRITE)
    assert len(first) == 1 and "_check_mean_from_info" in first[0].where()
    assert not counters[1].events_outside(*WRITE)


# -- same values as the CPU's fast paths ------------------------------------------------------
def _outputs(accelerator: bool, names: list[str]):
    torch.manual_seed(3)
    qs = [build(n) for n in names]
    qs.append(quantities.GradHist1d(EVERY, bins=7, adapt=GradAbsMax(EVERY, padding=0.1)))
    qs.append(
        quantities.GradHist2d(
            EVERY, bins=(6, 5), adapt=(GradAbsMax(EVERY), ParamAbsMax(EVERY)), keep_individual=True
        )
    )
    monitor, _ = train(qs, steps=4, accelerator=accelerator, counted=False)
    return monitor.get_output()


def test_device_paths_give_the_cpu_values() -> None:
    names = [n for n in ALL if n not in ("HessMaxEV",)] + ["HessMaxEV"]
    names.remove("HessTrace")
    names.remove("TICDiag")
    names.remove("TICTrace")
    cpu, dev = _outputs(False, names), _outputs(True, names)
    assert set(cpu) == set(dev)
    for key in cpu:
        assert set(cpu[key]) == set(dev[key]), key
        for step in cpu[key]:
            a, b = cpu[key][step], dev[key][step]
            if key.startswith("GradHist"):
                assert np.abs(np.asarray(a["hist"]) - np.asarray(b["hist"])).sum() <= 2, key
                ea, eb = a["edges"], b["edges"]
                pairs = zip(ea, eb) if isinstance(ea, tuple) else [(ea, eb)]
                for x, z in pairs:
                    np.testing.assert_allclose(x, z, rtol=1e-6)
            elif key == "HessMaxEV":
                assert b == pytest.approx(a, rel=1e-3)
            elif key == "CABS":
                assert b["cabs"] == pytest.approx(a["cabs"], rel=1e-5)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=key)


def test_histograms_under_deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)``: the device path counts with an
    accumulating ``index_put_`` instead of ``histc``; same counts, still no host read."""
    a, _ = train([build("GradHist1d"), build("GradHist2d")], steps=2, counted=False)
    torch.use_deterministic_algorithms(True)
    try:
        b, counters = train([build("GradHist1d"), build("GradHist2d")], steps=2)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not counters[1].events_outside(*WRITE), counters[1].summary()
    for key in ("GradHist1d", "GradHist2d"):
        for step in (0, 1):
            np.testing.assert_array_equal(
                a.get_output()[key][step]["hist"], b.get_output()[key][step]["hist"]
            )


# -- lag, flush, memory -----------------------------------------------------------------------
def test_write_lag_writes_one_step_later_and_close_flushes(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    qs = [quantities.Loss(EVERY), quantities.GradNorm(EVERY), quantities.Alpha(EVERY)]
    monitor, counters = train(qs, steps=4, write_lag=1, log_path=path)
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    written = sorted({r["step"] for r in lines if r["kind"] == "step"})
    assert written == [0, 1, 2]  # step 3 still in flight
    # the transfer of a step is started in it and read in the next one
    assert not counters[0].events_inside(*WRITE)
    assert len(counters[1].events_inside(*WRITE)) == 1
    assert 3 in monitor.get_output()["Loss"]
    monitor.close()
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    assert sorted({r["step"] for r in lines if r["kind"] == "step"}) == [0, 1, 2, 3]
    ref, _ = train(
        [quantities.Loss(EVERY), quantities.GradNorm(EVERY), quantities.Alpha(EVERY)], steps=4
    )
    got, want = monitor.get_output(), ref.get_output()
    for key in want:
        for step in want[key]:
            np.testing.assert_allclose(got[key][step], want[key][step], rtol=1e-6)


def test_reading_a_quantity_while_its_values_are_in_flight() -> None:
    """``quantity.output`` builds values still in flight (its own transfer); the monitor's
    write of that step then skips them and writes the others."""
    qs = [quantities.Loss(EVERY), quantities.GradNorm(EVERY), quantities.NormTest(EVERY)]
    monitor, _ = train(qs, steps=3, write_lag=1)
    assert sorted(qs[1].output) == [0, 1, 2]  # step 2 was in flight
    ref, _ = train([quantities.Loss(EVERY), quantities.GradNorm(EVERY),
                    quantities.NormTest(EVERY)], steps=3)
    got, want = monitor.get_output(), ref.get_output()
    for key in want:
        assert sorted(got[key]) == sorted(want[key])
        for step in want[key]:
            np.testing.assert_allclose(got[key][step], want[key][step], rtol=1e-6)


def test_streamed_histograms_keep_first_and_latest(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    qs = [build("GradHist1d"), build("GradHist2d"), quantities.Loss(EVERY)]
    monitor, _ = train(qs, steps=6, log_path=path, counted=False)
    assert sorted(qs[0]._output) == [0, 5] and sorted(qs[1]._output) == [0, 5]
    assert sorted(qs[2]._output) == list(range(6))  # small values: all kept
    monitor.close()
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    hist_steps = {r["step"] for r in lines if "GradHist1d" in r.get("values", {})}
    assert hist_steps == set(range(6))
    keep = [build("GradHist1d")]
    train(keep, steps=4, log_path=tmp_path / "b.jsonl", keep_history=True, counted=False)
    assert sorted(keep[0]._output) == [0, 1, 2, 3]
    alone = [build("GradHist1d")]
    train(alone, steps=4, counted=False)  # no log: get_output has every step
    assert sorted(alone[0].output) == [0, 1, 2, 3]


def test_full_configuration_memory_does_not_grow_with_histograms(tmp_path) -> None:
    """Streaming the full configuration at every step: what stays in memory grows only by the
    small per-step values the dashboard draws as histories (a few floats per parameter), not by
    histograms (a 40 × 50 GradHist2d alone is 16 KB per step)."""
    import pickle

    qs = configuration("full", EVERY)
    _monitor, _ = train(qs, steps=3, log_path=tmp_path / "a.jsonl", counted=False)
    small = len(pickle.dumps({q.key: q._output for q in qs}))
    qs2 = configuration("full", EVERY)
    _monitor2, _ = train(qs2, steps=13, log_path=tmp_path / "b.jsonl", counted=False)
    large = len(pickle.dumps({q.key: q._output for q in qs2}))
    per_step = (large - small) / 10
    assert per_step < 1500, per_step
    fits = next(q for q in qs2 if type(q).__name__ == "Alpha").fit_output
    assert len(fits) == 1


# -- non-finite steps -------------------------------------------------------------------------
def test_nan_step_detected_on_the_device() -> None:
    hist = quantities.GradHist1d(EVERY, bins=7, adapt=GradAbsMax(EVERY, padding=0.1))
    qs = [quantities.NormTest(EVERY), hist, quantities.HessMaxEV(EVERY), quantities.Loss(EVERY)]
    with pytest.warns(RuntimeWarning, match="NaN"):
        monitor, counters = train(qs, steps=4, nan_step=2, quiet=False)
    for counter in counters[1:]:
        assert not monitor_events(counter), counter.summary()
    out = monitor.get_output()
    assert math.isnan(out["NormTest"][2]) and math.isnan(out["GradHist1d"][2])
    assert math.isnan(out["Loss"][2])
    assert all(math.isfinite(out["NormTest"][s]) for s in (0, 1, 3))
    lo, hi = hist._range  # the NaN step did not move the range
    assert math.isfinite(lo) and math.isfinite(hi) and lo < 0 < hi
    assert math.isfinite(out["HessMaxEV"][3])
    assert int(np.asarray(out["GradHist1d"][3]["hist"]).sum()) > 0


# -- a real GPU -------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("label", ["economy", "business", "full"])
def test_cuda_sync_debug_mode_error(label: str) -> None:
    model, lossf = make_model("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model.parameters(), configuration(label, EVERY, curvature="diag_ggn_mc"))
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        X = torch.randn(6, 2, 6, 6, generator=gen).cuda()
        y = torch.randint(0, 3, (6,), generator=gen).cuda()
        out = model(X)
        loss = lossf(out, y)
        losses = nn.functional.cross_entropy(out.detach(), y, reduction="none")
        info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
        strict = step >= 1 and label == "economy"  # the engine reads the loss scale otherwise
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with monitor(step, info=info):
                    loss.backward(create_graph=monitor.create_graph(step))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.step()
        opt.zero_grad()
    out = monitor.get_output()
    assert sorted(out["Loss"]) == [0, 1, 2, 3]
