"""Cockpit 1.0's surface for custom quantities through ``backprism.compat.cockpit``:
``cockpit.context`` getters, methods with Cockpit's signatures (``_compute(global_step, params,
batch_loss)``, ``track(...)``, ``extension_hooks``), the base classes of the built-in quantities,
bin-adaptation policies overriding ``_get_abs_max``, ``cockpit.utils.optim.ComputeStep``,
``CABS.get_lr`` and the α helpers. Numbers against float64 ``torch.func`` references."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from torch import nn

from backprism.compat.backpack import extend
from backprism.compat.cockpit import Cockpit, quantities
from backprism.compat.cockpit.utils.schedules import linear
from tests.reference import loss_hessian, per_sample_grads

DT = torch.double


def _problem(seed: int = 0, n: int = 6):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    X = torch.randn(n, 4, dtype=DT)
    y = torch.randint(0, 2, (n,))
    return model, X, y


def _run(model, X, y, qs, steps: int = 2, lr: float = 0.1):
    """Cockpit's training loop (one fixed batch) over ``steps`` steps."""
    model = extend(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    ind_fn = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cockpit = Cockpit(model.parameters(), quantities=qs)
    states = []
    for step in range(steps):
        opt.zero_grad()
        out = model(X)
        loss = loss_fn(out, y)
        info = {"batch_size": X.shape[0], "individual_losses": ind_fn(out, y), "loss": loss,
                "optimizer": opt}
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    return cockpit, states


def _clone(model, state):
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    m.load_state_dict(state)
    return m


def test_module_paths():
    """``cockpit.context``, ``cockpit.cockpit``, ``cockpit.plotter``, ``cockpit.utils.optim``
    and the α helpers resolve."""
    import backprism.compat.cockpit as cp

    assert importlib.import_module("backprism.compat.cockpit.cockpit").Cockpit is cp.Cockpit
    assert importlib.import_module("backprism.compat.cockpit.plotter").CockpitPlotter is (
        cp.CockpitPlotter
    )
    ctx = importlib.import_module("backprism.compat.cockpit.context")
    for name in ("CockpitCTX", "get_batch_size", "get_individual_losses", "get_optimizer",
                 "get_loss"):
        assert hasattr(ctx, name)
    assert hasattr(importlib.import_module("backprism.compat.cockpit.utils.optim"),
                   "ComputeStep")
    alpha = importlib.import_module("backprism.compat.cockpit.quantities.alpha")
    for name in ("_projected_gradient", "_exact_variance", "_fit_quadratic", "_get_alpha",
                 "_root_sum_of_squares"):
        assert callable(getattr(alpha, name))


def test_builtin_quantities_are_instances_of_cockpit_bases():
    """Cockpit code tells single- from two-step quantities with ``isinstance``."""
    from backprism.compat.cockpit.quantities.quantity import (
        ByproductQuantity,
        SingleStepQuantity,
        TwoStepQuantity,
    )

    every = linear(1)
    for cls in (quantities.Loss, quantities.GradNorm, quantities.HessTrace, quantities.CABS,
                quantities.HessMaxEV, quantities.TICDiag, quantities.GradHist1d):
        assert isinstance(cls(track_schedule=every), SingleStepQuantity), cls
    for cls in (quantities.Alpha, quantities.Distance, quantities.UpdateSize):
        assert isinstance(cls(track_schedule=every), TwoStepQuantity), cls
    assert isinstance(quantities.Loss(track_schedule=every), ByproductQuantity)


def test_context_getters_and_cockpit_compute_signature():
    """A custom quantity written for Cockpit reads ``info`` through ``cockpit.context`` and
    gets ``(global_step, params, batch_loss)``; a returned tensor is stored as numpy (Cockpit's
    save format)."""
    from backprism.compat.cockpit.context import (
        get_batch_size,
        get_individual_losses,
        get_loss,
        get_optimizer,
    )
    from backprism.compat.cockpit.quantities.quantity import SingleStepQuantity

    seen = {}

    class MeanIndividualLoss(SingleStepQuantity):
        def _compute(self, global_step, params, batch_loss):
            seen[global_step] = (get_batch_size(global_step), get_optimizer(global_step),
                                 len(params), float(batch_loss.detach()),
                                 float(get_loss(global_step)))
            return get_individual_losses(global_step).detach().mean().reshape(1)

    model, X, y = _problem()
    q = MeanIndividualLoss(track_schedule=linear(1))
    _, states = _run(model, X, y, [q])
    for step, state in enumerate(states):
        ref = nn.CrossEntropyLoss()(_clone(model, state)(X), y)
        value = q.get_output()[step]
        assert isinstance(value, np.ndarray)
        assert value.shape == (1,)
        assert math.isclose(float(value[0]), float(ref), rel_tol=1e-12)
        n, opt, n_params, batch_loss, loss = seen[step]
        assert n == X.shape[0] and isinstance(opt, torch.optim.SGD) and n_params == 4
        assert math.isclose(batch_loss, float(ref), rel_tol=1e-12) and loss == batch_loss
    from backprism.compat.cockpit.context import CockpitCTX

    assert CockpitCTX.INFO == {}  # erased after the step
    with pytest.raises(KeyError, match=r"cockpit\(info=\.\.\.\)"):
        get_batch_size(0)


def test_subclass_overriding_compute_and_extensions():
    """Subclassing a built-in quantity with Cockpit's ``_compute`` (and ``extensions`` /
    ``extension_hooks`` returning nothing) replaces its value; the built-in HessTrace agrees
    with the dense float64 Hessian's per-parameter traces."""

    class DenseHessTrace(quantities.HessTrace):
        def extensions(self, global_step):
            return []

        def extension_hooks(self, global_step):
            return []

        def create_graph(self, global_step):
            return self.should_compute(global_step)

        def _compute(self, global_step, params, batch_loss):
            out = []
            for p in params:
                (g,) = torch.autograd.grad(batch_loss, p, create_graph=True)
                diag = torch.stack([
                    torch.autograd.grad(g.reshape(-1)[i], p, retain_graph=True)[0]
                    .reshape(-1)[i] for i in range(p.numel())
                ])
                out.append(diag.sum().item())
            return out

    model, X, y = _problem(1)
    builtin = quantities.HessTrace(track_schedule=linear(1))
    dense = DenseHessTrace(track_schedule=linear(1))
    _, states = _run(model, X, y, [builtin, dense])
    for step, state in enumerate(states):
        m = _clone(model, state)
        H = loss_hessian(m, nn.CrossEntropyLoss(), X, y)
        sizes = [p.numel() for p in m.parameters()]
        blocks = torch.split(torch.diagonal(H), sizes)
        ref = [float(b.sum()) for b in blocks]
        np.testing.assert_allclose(builtin.get_output()[step], ref, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(dense.get_output()[step], ref, rtol=1e-8, atol=1e-12)


def test_extension_hooks_run_per_module():
    """A custom quantity's ``extension_hooks`` (BackPACK-style ``hook(module)``) run once per
    module during the backward, with the quantity's extensions' results on the parameters:
    here the per-sample gradient norms, against ``torch.func``."""
    from backprism.compat.backpack.extensions import BatchGrad
    from backprism.compat.cockpit.quantities.quantity import SingleStepQuantity

    class Norms(SingleStepQuantity):
        def extensions(self, global_step):
            return [BatchGrad()]

        def extension_hooks(self, global_step):
            def hook(module):
                for name, p in module.named_parameters(recurse=False):
                    self.seen[(id(module), name)] = p.grad_batch.flatten(1).norm(dim=1)

            return [hook]

        def _compute(self, global_step, params, batch_loss):
            return len(self.seen)

    model, X, y = _problem()
    q = Norms(track_schedule=linear(1))
    q.seen = {}
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    _run(model, X, y, [q], steps=1)
    named = {(id(m), n): f"{k}.{n}" if k else n for k, m in model.named_modules()
             for n, _ in m.named_parameters(recurse=False)}
    assert set(q.seen) == set(named)
    for key, norms in q.seen.items():
        expected = ref[named[key]].flatten(1).norm(dim=1)
        torch.testing.assert_close(norms, expected, rtol=1e-8, atol=1e-12)
    assert q.get_output()[0] == len(named)


def test_quantity_with_cockpit_track():
    """A ``Quantity`` subclass implementing Cockpit's ``track(global_step, params,
    batch_loss)`` (and no ``should_compute``) is called every step."""
    from backprism.compat.cockpit.quantities.quantity import Quantity

    class ParamNorm(Quantity):
        def track(self, global_step, params, batch_loss):
            self.output[global_step] = float(sum(p.detach().square().sum() for p in params))

    model, X, y = _problem()
    q = ParamNorm(track_schedule=linear(1))
    _, states = _run(model, X, y, [q])
    for step, state in enumerate(states):
        ref = sum(float(v.square().sum()) for v in state.values())
        assert math.isclose(q.output[step], ref, rel_tol=1e-12)


@pytest.mark.parametrize("kind", ["grad", "param"])
def test_bin_adaptation_custom_abs_max(kind):
    """A policy overriding Cockpit's ``_get_abs_max(global_step, params, batch_loss, range)``
    sets the histogram limits to ``±value``; the built-in policies give ``±max|∇ℓₙ|`` /
    ``±max|θ|`` (float64 references)."""
    from backprism.compat.cockpit.quantities.bin_adaptation import GradAbsMax, ParamAbsMax

    base = GradAbsMax if kind == "grad" else ParamAbsMax

    class Fixed(base):
        def _get_abs_max(self, global_step, params, batch_loss, range):
            return 0.25 + global_step

    model, X, y = _problem(2)
    adapt_at = linear(1)
    builtin = quantities.GradHist1d(track_schedule=linear(1), bins=8,
                                    adapt=base(adapt_at))
    custom = quantities.GradHist1d(track_schedule=linear(1), bins=8,
                                   adapt=Fixed(adapt_at))
    _, states = _run(model, X, y, [builtin, custom], steps=2)
    # the limits adapted at step 0 are used for the histogram of step 1
    edges_custom = np.asarray(custom.get_output()[1]["edges"])
    assert math.isclose(edges_custom[0], -0.25) and math.isclose(edges_custom[-1], 0.25)
    m0 = _clone(model, states[0])
    if kind == "grad":
        # Cockpit's histograms hold the individual gradients ∇ℓₙ (BatchGrad's × N)
        gb = per_sample_grads(m0, nn.CrossEntropyLoss(reduction="sum"), X, y)
        ref = max(float(g.abs().max()) for g in gb.values())
    else:
        ref = max(float(v.abs().max()) for v in states[0].values())
    edges = np.asarray(builtin.get_output()[1]["edges"])
    assert math.isclose(edges[-1], ref, rel_tol=1e-6) and math.isclose(edges[0], -ref,
                                                                       rel_tol=1e-6)


def test_compute_step_and_get_lr():
    """``ComputeStep`` gives zero-momentum SGD's step ``−lr·Σₙ grad_batch[n]``; other
    optimizers are refused. ``CABS.get_lr`` is the shared learning rate."""
    from backprism.compat.cockpit.utils.optim import ComputeStep

    model, X, y = _problem(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    gb = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    for p, g in zip(model.parameters(), gb.values()):
        p.grad_batch = g
    ids = [id(p) for p in model.parameters()]
    steps = ComputeStep.compute_update_step(opt, ids)
    for p, g in zip(model.parameters(), gb.values()):
        torch.testing.assert_close(steps[id(p)], -0.3 * g.sum(0))
    assert ComputeStep.is_sgd_default_kwargs(opt)
    adam = torch.optim.Adam(model.parameters())
    assert not ComputeStep.is_sgd_default_kwargs(adam)
    with pytest.raises(NotImplementedError):
        ComputeStep.compute_update_step(adam, ids)
    assert quantities.CABS(linear(1)).get_lr(opt) == 0.3
    opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": 0.1})
    with pytest.raises(ValueError):
        quantities.CABS(linear(1)).get_lr(opt)


def test_alpha_helpers():
    """Cockpit's α helpers: projection length ``⟨u, v⟩/‖v‖``, the sample variance of the
    projected individual gradients, the quadratic fit and α (exact data)."""
    from backprism.compat.cockpit.quantities import alpha

    torch.manual_seed(4)
    u = [torch.randn(3, 2, dtype=DT), torch.randn(4, dtype=DT)]
    v = [torch.randn(3, 2, dtype=DT), torch.randn(4, dtype=DT)]
    flat_u = torch.cat([t.reshape(-1) for t in u])
    flat_v = torch.cat([t.reshape(-1) for t in v])
    assert math.isclose(alpha._projected_gradient(u, v),
                        float(flat_u @ flat_v / flat_v.norm()), rel_tol=1e-12)
    assert math.isclose(alpha._root_sum_of_squares([3.0, 4.0]), 5.0)
    grads = [torch.randn(5, 3, 2, dtype=DT), torch.randn(5, 4, dtype=DT)]
    flat_g = torch.cat([g.reshape(5, -1) for g in grads], 1)
    proj = flat_g @ flat_v / flat_v.norm()
    assert math.isclose(alpha._exact_variance(grads, v), float(proj.var(unbiased=True)),
                        rel_tol=1e-10)
    # f(x) = 1 − 2x + 3x² observed exactly at 0 and t = 1: fit recovers it, α = 2t/ᾱ − 1
    mu = alpha._fit_quadratic(1.0, [1.0, 2.0], [-2.0, 4.0], [1.0, 1.0], [1.0, 1.0])
    np.testing.assert_allclose(mu, [1.0, -2.0, 3.0], atol=1e-10)
    assert math.isclose(alpha._get_alpha(mu, 1.0), 2 * 1.0 / (2.0 / 3.0) - 1, rel_tol=1e-10)


def test_plot_written_log_next_to_a_savedir_of_the_same_name(tmp_path):
    """Cockpit's advanced example saves frames into ``savedir=logpath`` (a directory) and then
    plots ``logpath``: the log written by ``Cockpit.write`` (``logpath + ".json"``) is read."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from backprism.compat.cockpit import CockpitPlotter

    model, X, y = _problem()
    cockpit, _ = _run(model, X, y, [quantities.Loss(linear(1)), quantities.GradNorm(linear(1))])
    logpath = tmp_path / "cockpit_output"
    logpath.mkdir()
    cockpit.write(str(logpath))
    assert (tmp_path / "cockpit_output.json").is_file()
    CockpitPlotter().plot(str(logpath), savedir=str(logpath), show_plot=False, save_plot=True)
    assert (logpath / "cockpit.png").is_file()


def test_batch_grad_transforms_hooks_merge_and_run():
    """Cockpit's ``BatchGradTransformsHook``: two quantities' hooks are merged (one
    ``grad_batch_transforms`` dict per parameter inside the context, holding both), their
    values are the transforms of the per-sample gradients (against ``torch.func``), the dict
    is gone after the context, and merging one name with two functions is refused."""
    from backprism.compat.backpack.extensions import BatchGrad
    from backprism.compat.cockpit.quantities.quantity import SingleStepQuantity
    from backprism.compat.cockpit.quantities.utils_transforms import (
        BatchGradTransformsHook,
        BatchGradTransformsHook_BatchL2Grad,
        BatchGradTransformsHook_SumGradSquared,
    )

    seen: dict = {}

    class WithHook(SingleStepQuantity):
        def __init__(self, make, track_schedule):
            super().__init__(track_schedule)
            self.make = make

        def extensions(self, global_step):
            return [BatchGrad()]

        def extension_hooks(self, global_step):
            return [self.make()]

        def _compute(self, global_step, params, batch_loss):
            for i, p in enumerate(params):
                seen[i] = dict(p.grad_batch_transforms)
            return 0.0

    model, X, y = _problem()
    qs = [
        WithHook(BatchGradTransformsHook_BatchL2Grad, linear(1)),
        WithHook(BatchGradTransformsHook_SumGradSquared, linear(1)),
    ]
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    _run(model, X, y, qs, steps=1)
    for i, (name, p) in enumerate(model.named_parameters()):
        gb = ref[name]
        assert set(seen[i]) == {"batch_l2", "sum_grad_squared"}
        torch.testing.assert_close(seen[i]["batch_l2"], gb.flatten(1).square().sum(1))
        torch.testing.assert_close(seen[i]["sum_grad_squared"], gb.square().sum(0))
        assert not hasattr(p, "grad_batch_transforms")
    with pytest.raises(ValueError):
        BatchGradTransformsHook.merge(
            [BatchGradTransformsHook({"x": abs}), BatchGradTransformsHook({"x": len})]
        )
