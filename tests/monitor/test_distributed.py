"""The monitor under distributed data parallelism on CPU with gloo (float64).

Every rank trains a ``DDP(extend(model))`` with a :class:`~backprism.monitor.Monitor` on its
local batch and, in the same process, one reference model with a monitor on the concatenated
global batch (``process_group=None``, no DDP). Rank 0's streamed log must equal the
reference's log, and every rank's :meth:`Monitor.get_output` the reference's output (rtol
1e-6), for every quantity of the ``full`` configuration at every step plus MeanGSNR, CABS,
EarlyStopping, TICTrace, HessTrace (GGN and Hessian traces without diagonals), Parameters and an
adapted GradHist1d; with equal and unequal local batch sizes, 2 and 3 ranks, a residual network
and α's optimizer-agnostic fallback (SGD with momentum). Ranks other than 0 write nothing.

Keeping the runs comparable: both runs step along the global batch's gradient (with unequal
local batch sizes DDP's ``.grad`` is not it, so the test copies the reference's ``.grad`` into
the DDP model before ``opt.step()``; with equal sizes it checks that they agree first), and both
seed the random number generator alike before every step, so HessMaxEV's random start vector
(rank 0's, broadcast) is the reference's; nothing else here is random. ``Time`` is not tracked.

``no_sync()`` steps keep this rank's values (compared with a reference on the local batch),
``Monitor(process_group=dist.group.WORLD)`` makes them global, ``process_group=None`` keeps
every step local.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as tmp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from backprism import extend  # noqa: E402
from backprism.monitor import (  # noqa: E402
    Monitor,
    accelerator_paths,
    configuration,
    count_syncs,
    quantities,
    schedules,
)
from backprism.monitor.quantities.bin_adaptation import GradAbsMax  # noqa: E402
from tests.common import TanhResidual, init_gloo  # noqa: E402

RTOL, ATOL = 1e-6, 1e-10
STEPS = 3


# -- process groups ---------------------------------------------------------------------------
def _spawn(fn, world: int, folder: str) -> None:
    ctx = multiprocessing.get_context("forkserver")
    # DDP imports torch._dynamo on construction (seconds): once, in the forkserver
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "backprism.monitor", __name__])
    tmp.start_processes(
        fn, args=(world, folder), nprocs=world, join=True, start_method="forkserver"
    )



# -- models, data, quantities -------------------------------------------------------------------
def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "residual":
        return TanhResidual().double()
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _batches(n: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        X = torch.randn(n, 5, generator=g, dtype=torch.float64)
        out.append((X, torch.randint(0, 3, (n,), generator=g)))
    return out


def _quantities(kind: str) -> list:
    every = schedules.linear(1)
    if kind == "full":
        return [
            *configuration("full", track_schedule=every),
            quantities.MeanGSNR(every),
            quantities.CABS(every),
            quantities.EarlyStopping(every),
            quantities.TICTrace(every),
            quantities.HessTrace(every, curvature="diag_ggn_exact"),  # GGN trace, no diagonal
            quantities.Parameters(every),
            quantities.GradHist1d(every, bins=30, adapt=GradAbsMax(every)),
        ]
    # economy with α's fallback (SGD with momentum) and the Hessian trace without diagonal
    return [*configuration("economy", track_schedule=every), quantities.HessTrace(every)]


def _slice(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _step(monitor: Monitor, forward, lossf, opt, X, y, step: int) -> None:
    opt.zero_grad(set_to_none=True)
    out = forward(X)
    loss = lossf(out, y)
    info = {
        "loss": loss,
        "batch_size": X.shape[0],
        "individual_losses": nn.functional.cross_entropy(out, y, reduction="none"),
        "optimizer": opt,
    }
    with monitor(step, info=info):
        loss.backward(create_graph=monitor.create_graph(step))


# -- comparing ----------------------------------------------------------------------------------
def _close(got: Any, ref: Any, what: str) -> None:
    if isinstance(ref, dict):
        assert isinstance(got, dict) and set(got) == set(ref), (what, got, ref)
        for k in ref:
            _close(got[k], ref[k], f"{what}[{k}]")
    elif isinstance(ref, (list, tuple)) or hasattr(ref, "tolist"):
        ref = ref.tolist() if hasattr(ref, "tolist") else ref
        got = got.tolist() if hasattr(got, "tolist") else got
        assert isinstance(got, (list, tuple)) and len(got) == len(ref), (what, got, ref)
        for i, (a, b) in enumerate(zip(got, ref)):
            _close(a, b, f"{what}[{i}]")
    elif isinstance(ref, (int, float)) and not isinstance(ref, bool):
        assert isinstance(got, (int, float)), (what, got, ref)
        ok = (math.isnan(got) and math.isnan(ref)) or math.isclose(
            got, ref, rel_tol=RTOL, abs_tol=ATOL
        )
        assert ok, f"{what}: {got!r} != {ref!r}"
    else:
        assert got == ref, f"{what}: {got!r} != {ref!r}"


def _read(path: str) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """The quantities of the meta line and the merged step lines of a log."""
    keys: list[str] = []
    steps: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec["kind"] == "meta":
                keys = rec["quantities"]
            elif rec["kind"] == "step":
                steps.setdefault(rec["step"], {}).update(rec["values"])
    return keys, steps


def _compare_runs(monitor: Monitor, ref: Monitor, rank: int, folder: str, what: str) -> None:
    """Every rank's in-memory output equals the reference's; rank 0's log the reference log;
    the other ranks wrote no file."""
    got, expect = monitor.get_output(), ref.get_output()
    assert set(got) == set(expect)
    for key in expect:
        assert set(got[key]) == set(expect[key]), (what, key, got[key], expect[key])
        _close(got[key], expect[key], f"{what} rank {rank} output {key}")
    monitor.close()
    ref.close()
    path = os.path.join(folder, f"{what}-{rank}.jsonl")
    monitor.write(os.path.join(folder, f"{what}-{rank}.json"))
    assert os.path.exists(os.path.join(folder, f"{what}-{rank}.json")) == (rank == 0)
    if rank != 0:
        assert not monitor.writes_log
        assert not os.path.exists(path), "a rank other than 0 wrote a log"
        return
    keys, steps = _read(path)
    ref_keys, ref_steps = _read(os.path.join(folder, f"{what}-ref-{rank}.jsonl"))
    assert keys == ref_keys
    assert sorted(steps) == list(range(STEPS))
    assert set(steps) == set(ref_steps)
    for s in ref_steps:
        _close(steps[s], ref_steps[s], f"{what} log step {s}")
    logged = {k.split("/")[0] for v in steps.values() for k in v}
    assert logged == set(keys), (logged, keys)  # every quantity reached the log


# -- checks -------------------------------------------------------------------------------------
def _check_global(
    rank: int, folder: str, name: str, sizes: list[int], kind: str, unused: bool = False
) -> None:
    """``STEPS`` monitored DDP steps against one process on the concatenated batches
    (``unused``: ``DDP(find_unused_parameters=True)``, DDP's autograd Function in the graph)."""
    n, sl = sum(sizes), _slice(sizes, rank)
    what = f"{name}-{kind}-{'-'.join(map(str, sizes))}"
    momentum = 0.9 if kind == "economy" else 0.0  # economy: α's fallback
    lossf = extend(nn.CrossEntropyLoss())
    ref_model = extend(_model(name))
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5, momentum=momentum)
    ref = Monitor(
        ref_model.parameters(),
        _quantities(kind),
        log_path=os.path.join(folder, f"{what}-ref-{rank}.jsonl"),
        process_group=None,
    )
    model = extend(_model(name))
    ddp = DDP(model, find_unused_parameters=unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    monitor = Monitor(
        model.parameters(), _quantities(kind), log_path=os.path.join(folder, f"{what}-{rank}.jsonl")
    )
    caught = []
    for step, (X, y) in enumerate(_batches(n, STEPS)):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            torch.manual_seed(100 + step)
            _step(ref, ref_model, lossf, ref_opt, X, y, step)
            torch.manual_seed(100 + step)
            _step(monitor, ddp, lossf, opt, X[sl], y[sl], step)
        caught += [str(w.message) for w in record]
        for p, q in zip(model.parameters(), ref_model.parameters()):
            if len(set(sizes)) == 1:  # DDP's .grad is the global batch's gradient
                torch.testing.assert_close(p.grad.detach(), q.grad.detach(), rtol=RTOL, atol=ATOL)
            p.grad = q.grad.detach().clone()  # both step along the global batch's gradient
            q.grad = q.grad.detach()
        opt.step()
        ref_opt.step()
    unequal = [m for m in caught if "local batch sizes differ" in m]
    assert bool(unequal) == (len(set(sizes)) > 1 and kind == "full")  # α's fast path warns
    _compare_runs(monitor, ref, rank, folder, what)


def _check_local_steps(rank: int, folder: str, sizes: list[int]) -> None:
    """Inside ``no_sync()`` (or with ``process_group=None``) a step is this rank's; with
    ``process_group=dist.group.WORLD`` a ``no_sync()`` step is global (HessMaxEV included: its
    graph is taken before the backward pass in every mode)."""
    n, sl = sum(sizes), _slice(sizes, rank)
    (X, y), = _batches(n, 1)
    lossf = extend(nn.CrossEntropyLoss())

    def run(batch, ddp_mode, group):
        model = extend(_model("residual"))
        forward = DDP(model) if ddp_mode else model
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        qs = [*_quantities("economy"), quantities.HessMaxEV(schedules.linear(1))]
        mon = Monitor(model.parameters(), qs, process_group=group)
        assert not mon.create_graph(0)  # DDP refuses create_graph=True
        torch.manual_seed(7)  # HessMaxEV's start vector
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if ddp_mode == "no_sync":
                with forward.no_sync():
                    _step(mon, forward, lossf, opt, *batch, 0)
            else:
                _step(mon, forward, lossf, opt, *batch, 0)
        return mon.get_output()

    local = run((X[sl], y[sl]), None, None)
    whole = run((X, y), None, None)
    for label, got, expect in [
        ("no_sync", run((X[sl], y[sl]), "no_sync", "auto"), local),
        ("process_group=None", run((X[sl], y[sl]), "sync", None), local),
        ("no_sync, WORLD", run((X[sl], y[sl]), "no_sync", dist.group.WORLD), whole),
    ]:
        assert set(got) == set(expect)
        for key in expect:
            _close(got[key], expect[key], f"{label} rank {rank} {key}")


def _check_syncs(rank: int, sizes: list[int]) -> None:
    """A global step on the accelerators' code paths: the monitor's own code reads nothing on
    the host (its collectives stay on the device) but the log write and the one-time check of
    the loss reduction, as in one process."""
    n, sl = sum(sizes), _slice(sizes, rank)
    lossf = extend(nn.CrossEntropyLoss())
    model = extend(_model("residual"))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    every = schedules.linear(1)
    qs = [*_quantities("full"), quantities.HessMaxEV(every, check_every=None, iterations=4)]
    monitor = Monitor(model.parameters(), qs)
    for step, (X, y) in enumerate(_batches(n, 2)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with accelerator_paths(), count_syncs() as counter:
                _step(monitor, ddp, lossf, opt, X[sl], y[sl], step)
        allowed = ("_write_oldest", "flush", "_check_mean_from_info")
        events = [e for e in counter.events_outside(*allowed) if e.where().startswith("monitor/")]
        assert not events, counter.summary()
        assert counter.events_inside("_header_read")  # the engine's size exchange, for contrast
        opt.step()


# -- workers ------------------------------------------------------------------------------------
def _two_ranks(rank: int, world: int, folder: str) -> None:
    init_gloo(rank, world, os.path.join(folder, "rendezvous"))
    try:
        _check_global(rank, folder, "residual", [4, 4], "full")
        _check_global(rank, folder, "residual", [3, 5], "full")
        _check_global(rank, folder, "chain", [3, 5], "economy")
        _check_local_steps(rank, folder, [4, 4])
        _check_syncs(rank, [3, 5])
    finally:
        dist.destroy_process_group()


def _three_ranks(rank: int, world: int, folder: str) -> None:
    init_gloo(rank, world, os.path.join(folder, "rendezvous"))
    try:
        _check_global(rank, folder, "residual", [2, 3, 4], "full", unused=True)
    finally:
        dist.destroy_process_group()


def _one_process(folder: str, name: str, sizes: list[int], kind: str) -> None:
    """Rank 0's log against the same run in this process, where torch.distributed is not
    initialised (the monitor's plain one-process code paths: ``create_graph=True``, ``.grad``);
    the workers' in-process references run with ``process_group=None`` under
    torch.distributed."""
    what = f"{name}-{kind}-{'-'.join(map(str, sizes))}"
    path = os.path.join(folder, f"{what}-plain.jsonl")
    lossf = extend(nn.CrossEntropyLoss())
    model = extend(_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9 if kind == "economy" else 0.0)
    monitor = Monitor(model.parameters(), _quantities(kind), log_path=path)
    assert not dist.is_initialized() and monitor.create_graph(0) == (kind == "full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, (X, y) in enumerate(_batches(sum(sizes), STEPS)):
            torch.manual_seed(100 + step)
            _step(monitor, model, lossf, opt, X, y, step)
            opt.step()
    monitor.close()
    keys, steps = _read(os.path.join(folder, f"{what}-0.jsonl"))
    ref_keys, ref_steps = _read(path)
    assert keys == ref_keys and set(steps) == set(ref_steps)
    for s in ref_steps:
        _close(steps[s], ref_steps[s], f"{what} log step {s} vs one process")


def test_two_ranks_log_the_global_batch(tmp_path):
    """Equal and unequal local batches, the full configuration and more on a residual network,
    α's fallback, no_sync() and the process_group switch."""
    _spawn(_two_ranks, 2, str(tmp_path))
    _one_process(str(tmp_path), "residual", [4, 4], "full")
    _one_process(str(tmp_path), "residual", [3, 5], "full")
    _one_process(str(tmp_path), "chain", [3, 5], "economy")


def test_three_ranks_unequal_batches(tmp_path):
    _spawn(_three_ranks, 3, str(tmp_path))
    _one_process(str(tmp_path), "residual", [2, 3, 4], "full")
