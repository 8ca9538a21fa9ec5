"""Cockpit 1.0's ``param.grad_batch_transforms`` through ``backprism.compat.cockpit``.

In Cockpit the built-in quantities get their per-sample statistics from a
``BatchGradTransformsHook``, which stores ``{name: transform(grad_batch)}`` on each parameter
during the backward pass; Cockpit deletes the dict after the step. The shim fills the same dict
from the engine's results of the pass. Here: which names exist for which quantity, their values
against the definitions evaluated on per-sample gradients from ``torch.func`` (``vmap(grad)``,
with BackPACK's scaling ``grad_batch[n] = ∇ℓₙ/N`` of a mean-reduced loss), and the clean-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from backprism.compat.backpack import extend
from backprism.compat.backpack.extensions import BatchGrad, SumGradSquared
from backprism.compat.cockpit import Cockpit, quantities
from backprism.compat.cockpit.quantities.bin_adaptation import GradAbsMax
from backprism.compat.cockpit.utils.schedules import linear

DT = torch.float64
N = 8
BUFFER = "grad_batch_transforms"


def _problem(seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    X = torch.randn(N, 5, dtype=DT)
    y = torch.randint(0, 3, (N,))
    return model, X, y


def _individual_gradients(model: nn.Module, X: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``{name: [N, *p]}``: ``∇ℓₙ`` (unscaled) per sample, by ``vmap(grad)``."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_n(p: dict[str, Tensor], x: Tensor, t: Tensor) -> Tensor:
        out = functional_call(model, p, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(out, t.unsqueeze(0))

    return vmap(grad(loss_n), in_dims=(None, 0, 0))(params, X, y)


def _grad_batch(model: nn.Module, X: Tensor, y: Tensor) -> dict[str, Tensor]:
    """BackPACK's ``grad_batch``: ``∇ℓₙ/N`` for ``L = (1/N) Σₙ ℓₙ``."""
    return {k: g / X.shape[0] for k, g in _individual_gradients(model, X, y).items()}


def _step(
    qs: list[Any],
    steps: int = 1,
    exts: tuple = (),
    inspect: Callable[[int, nn.Module], None] | None = None,
    seed: int = 0,
) -> tuple[nn.Module, Tensor, Tensor, list[dict[str, dict[str, Any]]]]:
    """Cockpit's training loop on one batch; returns the model, the batch and, per step, each
    parameter's ``grad_batch_transforms`` inside the context, right after the backward pass
    (``inspect(step, model)`` runs there too)."""
    model, X, y = _problem(seed)
    model = extend(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    ind_fn = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=qs)
    seen: list[dict[str, dict[str, Any]]] = []
    for step in range(steps):
        opt.zero_grad()
        out = model(X)
        loss = loss_fn(out, y)
        info = {"batch_size": N, "individual_losses": ind_fn(out, y), "loss": loss,
                "optimizer": opt}
        with cockpit(step, *exts, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
            seen.append({
                name: dict(getattr(p, BUFFER)) if hasattr(p, BUFFER) else None
                for name, p in model.named_parameters()
            })
            if inspect is not None:
                inspect(step, model)
        for p in model.parameters():
            assert not hasattr(p, BUFFER), "grad_batch_transforms left after the step"
        if step < steps - 1:
            opt.step()
    return model, X, y, seen


SUM_GRAD_SQUARED = ["TICDiag", "TICTrace", "CABS", "EarlyStopping", "MeanGSNR"]


@pytest.mark.parametrize("name", SUM_GRAD_SQUARED)
def test_sum_grad_squared(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Σₙ grad_batch[n]² = Σₙ (∇ℓₙ/N)²`` per parameter, the engine's tensor itself
    (TICTrace computes from ``batch_l2``: the entry is asked for)."""
    if name == "TICTrace":
        monkeypatch.setattr(Cockpit, "TRANSFORMS_ON_TOP", True)

    def same_tensor(step: int, model: nn.Module) -> None:
        for p in model.parameters():
            assert p.grad_batch_transforms["sum_grad_squared"] is p.sum_grad_squared

    q = getattr(quantities, name)(track_schedule=linear(1))
    model, X, y, seen = _step([q], inspect=same_tensor)
    ref = _grad_batch(model, X, y)
    for pname, got in seen[0].items():
        assert got is not None and set(got) == {"sum_grad_squared"}
        torch.testing.assert_close(got["sum_grad_squared"], ref[pname].square().sum(0))


def test_batch_l2() -> None:
    """NormTest: ``batch_l2[n] = ‖grad_batch[n]‖²``, shape ``[N]``."""
    model, X, y, seen = _step([quantities.NormTest(track_schedule=linear(1))])
    ref = _grad_batch(model, X, y)
    for pname, got in seen[0].items():
        assert set(got) == {"batch_l2"}
        torch.testing.assert_close(got["batch_l2"], ref[pname].flatten(1).square().sum(1))


@pytest.mark.parametrize("name", ["InnerTest", "OrthoTest"])
def test_batch_dot(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """InnerTest/OrthoTest: ``batch_dot[n, m] = ⟨grad_batch[n], grad_batch[m]⟩``, ``[N, N]``
    (asked for: ``TRANSFORMS_ON_TOP = True``)."""
    monkeypatch.setattr(Cockpit, "TRANSFORMS_ON_TOP", True)
    q = getattr(quantities, name)(track_schedule=linear(1))
    model, X, y, seen = _step([q])
    ref = _grad_batch(model, X, y)
    for pname, got in seen[0].items():
        assert set(got) == {"batch_dot"}
        flat = ref[pname].flatten(1)
        torch.testing.assert_close(got["batch_dot"], flat @ flat.T)


def test_several_quantities_one_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    """TICDiag, NormTest and OrthoTest together: one dict per parameter with all their names
    (Cockpit merges the quantities' hooks into one)."""
    monkeypatch.setattr(Cockpit, "TRANSFORMS_ON_TOP", True)
    qs = [quantities.TICDiag(track_schedule=linear(1)), quantities.NormTest(linear(1)),
          quantities.OrthoTest(linear(1))]
    model, X, y, seen = _step(qs)
    ref = _grad_batch(model, X, y)
    for pname, got in seen[0].items():
        assert set(got) == {"sum_grad_squared", "batch_l2", "batch_dot"}
        flat = ref[pname].flatten(1)
        torch.testing.assert_close(got["batch_dot"], flat @ flat.T)
        torch.testing.assert_close(got["batch_l2"], flat.square().sum(1))


def test_hist_1d_and_abs_max() -> None:
    """GradHist1d: per parameter ``(counts, edges)`` of the individual gradient elements
    ``∇ℓₙ`` clipped into ``range``; a ``GradAbsMax`` adaptation adds
    ``grad_batch_abs_max = maxₙᵢ |∇ℓₙᵢ|``."""
    bins, rng = 7, (-0.3, 0.3)
    q = quantities.GradHist1d(track_schedule=linear(1), bins=bins, range=rng,
                              adapt=GradAbsMax(linear(1)))
    model, X, y, seen = _step([q])
    ind = _individual_gradients(model, X, y)
    for pname, got in seen[0].items():
        assert set(got) == {"hist_1d", "grad_batch_abs_max"}
        counts, edges = got["hist_1d"]
        g = ind[pname].numpy().ravel()
        expected, _ = np.histogram(np.clip(g, *rng), bins=bins, range=rng)
        np.testing.assert_array_equal(counts.cpu().numpy(), expected)
        np.testing.assert_allclose(edges.cpu().numpy(), np.linspace(*rng, bins + 1), atol=1e-7)
        torch.testing.assert_close(
            torch.as_tensor(got["grad_batch_abs_max"], dtype=DT), ind[pname].abs().max()
        )


def test_hist_2d() -> None:
    """GradHist2d: per parameter ``(counts [xbins, ybins], (xedges, yedges))`` of the pairs
    (individual gradient element, parameter value), each clipped to its outermost bin
    centres (Cockpit's convention)."""
    bins, rng = (5, 4), ((-0.3, 0.3), (-0.5, 0.5))
    q = quantities.GradHist2d(track_schedule=linear(1), bins=bins, range=rng)
    model, X, y, seen = _step([q])
    ind = _individual_gradients(model, X, y)
    params = dict(model.named_parameters())
    for pname, got in seen[0].items():
        assert set(got) == {"hist_2d"}
        counts, (xedges, yedges) = got["hist_2d"]
        g = ind[pname].numpy()
        theta = np.broadcast_to(params[pname].detach().numpy(), g.shape)
        clipped = []
        for values, (lo, hi), b in zip((g, theta), rng, bins):
            half = (hi - lo) / b / 2
            clipped.append(np.clip(values.ravel(), lo + half, hi - half))
        expected, _, _ = np.histogram2d(*clipped, bins=bins, range=rng)
        np.testing.assert_array_equal(counts.cpu().numpy(), expected.astype(np.int64))
        np.testing.assert_allclose(xedges.cpu().numpy(), np.linspace(*rng[0], bins[0] + 1),
                                   atol=1e-7)
        np.testing.assert_allclose(yedges.cpu().numpy(), np.linspace(*rng[1], bins[1] + 1),
                                   atol=1e-7)


def test_alpha_projection_markers() -> None:
    """Alpha with zero-momentum SGD: Cockpit's side-effect hooks leave
    ``_first_order_projections_start`` at a start step and ``_first_order_projections_end``
    at an end step, both ``{}``."""
    _, _, _, seen = _step([quantities.Alpha(track_schedule=linear(2))], steps=3)
    for got in seen[0].values():  # start (and not an end)
        assert got == {"_first_order_projections_start": {}}
    for got in seen[1].values():  # end of the step-0 start
        assert got == {"_first_order_projections_end": {}}
    for got in seen[2].values():
        assert got == {"_first_order_projections_start": {}}


def test_no_buffer_without_such_quantity() -> None:
    """Quantities Cockpit computes without the hook leave no dict."""
    qs = [quantities.Loss(linear(1)), quantities.GradNorm(linear(1)),
          quantities.HessTrace(linear(1)), quantities.Distance(linear(1))]
    _, _, _, seen = _step(qs)
    assert all(got is None for got in seen[0].values())


def test_not_on_unscheduled_steps() -> None:
    """Names exist only at steps where their quantity is active."""
    _, _, _, seen = _step([quantities.TICDiag(track_schedule=linear(2))], steps=2)
    assert all(got is not None for got in seen[0].values())
    assert all(got is None for got in seen[1].values())


def test_user_extension_kept_dict_deleted() -> None:
    """A user's (BackPACK-compat) ``SumGradSquared`` stays on the parameters after the step
    (protected, as in Cockpit); the dict, holding the same values inside the context, is
    deleted."""
    model, X, y, seen = _step([quantities.MeanGSNR(linear(1))], exts=(SumGradSquared(),))
    ref = _grad_batch(model, X, y)
    for pname, p in model.named_parameters():
        assert not hasattr(p, BUFFER)
        torch.testing.assert_close(p.sum_grad_squared, ref[pname].square().sum(0))
        torch.testing.assert_close(seen[0][pname]["sum_grad_squared"], p.sum_grad_squared)


def test_with_custom_hook() -> None:
    """A custom Cockpit-style quantity's ``BatchGradTransformsHook`` and the built-in names
    share one dict; a standard transform also named by a built-in quantity takes the engine's
    value, a custom one is applied to ``grad_batch``."""
    from backprism.compat.cockpit.quantities.quantity import SingleStepQuantity
    from backprism.compat.cockpit.quantities.utils_transforms import (
        BatchGradTransformsHook,
        sum_grad_squared_transform,
    )

    def abs_sum(batch_grad: Tensor) -> Tensor:
        return batch_grad.abs().sum(0)

    class Custom(SingleStepQuantity):
        def extensions(self, global_step: int) -> list:
            return [BatchGrad()]

        def extension_hooks(self, global_step: int) -> list:
            return [BatchGradTransformsHook({"sum_grad_squared": sum_grad_squared_transform,
                                             "abs_sum": abs_sum})]

        def _compute(self, global_step: int, params: list, batch_loss: Any) -> float:
            return float(sum(p.grad_batch_transforms["abs_sum"].sum() for p in params))

    def same_tensor(step: int, model: nn.Module) -> None:
        for p in model.parameters():
            assert p.grad_batch_transforms["sum_grad_squared"] is p.sum_grad_squared

    model, X, y, seen = _step([Custom(linear(1)), quantities.TICDiag(linear(1))],
                              inspect=same_tensor)
    ref = _grad_batch(model, X, y)
    for pname, got in seen[0].items():
        assert set(got) == {"sum_grad_squared", "abs_sum"}
        torch.testing.assert_close(got["abs_sum"], ref[pname].abs().sum(0))
        torch.testing.assert_close(got["sum_grad_squared"], ref[pname].square().sum(0))


def test_gone_before_hess_max_ev() -> None:
    """As in Cockpit, the dict is deleted with the step's buffers, before HessMaxEV (which
    runs after the clean-up) computes."""
    seen: list[bool] = []

    class Probe(quantities.HessMaxEV):
        def _compute(self, global_step: int, data: Any) -> Any:
            seen.append(any(hasattr(p, BUFFER) for p in data.params))
            return super()._compute(global_step, data)

    _step([quantities.TICDiag(linear(1)), Probe(linear(1))])
    assert seen == [False]


def test_without_entries_on_top(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Cockpit.TRANSFORMS_ON_TOP = False``: no extra ``BatchDotGrad``/``SumGradSquared`` for
    InnerTest/TICTrace, whose entries are then there only where the pass computes them anyway
    (here ``BatchDotGrad`` passed by the user: its tensor, kept after the step)."""
    from backprism.extensions import BatchDotGrad

    monkeypatch.setattr(Cockpit, "TRANSFORMS_ON_TOP", False)
    _, _, _, seen = _step([quantities.InnerTest(linear(1)), quantities.TICTrace(linear(1))])
    assert all(got is None for got in seen[0].values())

    def same_tensor(step: int, model: nn.Module) -> None:
        for p in model.parameters():
            assert p.grad_batch_transforms["batch_dot"] is p.batch_dot

    model, X, y, seen = _step([quantities.InnerTest(linear(1))], exts=(BatchDotGrad(),),
                              inspect=same_tensor)
    ref = _grad_batch(model, X, y)
    for pname, p in model.named_parameters():
        assert set(seen[0][pname]) == {"batch_dot"}
        flat = ref[pname].flatten(1)
        torch.testing.assert_close(p.batch_dot, flat @ flat.T)


def test_cockpit_style_subclass_reads_buffer() -> None:
    """A Cockpit-style subclass of TICDiag computing Cockpit's formula from
    ``grad_batch_transforms["sum_grad_squared"]`` and ``diag_h`` gives TICDiag's value."""
    from backprism.compat.cockpit.context import get_batch_size

    class MyTIC(quantities.TICDiag):
        def _compute(self, global_step: int, params: list, batch_loss: Any) -> float:
            sgs = torch.cat([p.grad_batch_transforms["sum_grad_squared"].flatten()
                             for p in params])
            curv = torch.cat([p.diag_h.flatten() for p in params])
            n = get_batch_size(global_step)
            return (n * sgs / (curv + 1e-7)).sum().item()

    mine, builtin = MyTIC(linear(1)), quantities.TICDiag(linear(1))
    _step([mine, builtin])
    assert mine.get_output()[0] == pytest.approx(builtin.get_output()[0], rel=1e-10)


def test_entries_on_top_by_default_for_subclasses_only() -> None:
    """By default the extra ``BatchDotGrad`` / ``SumGradSquared`` are requested for subclasses
    of InnerTest/OrthoTest/TICTrace only (which may read the dict), not for the built-in
    classes (which never do)."""

    class MyInner(quantities.InnerTest):
        pass

    _, _, _, seen = _step([quantities.InnerTest(linear(1)), quantities.TICTrace(linear(1))])
    assert all(got is None for got in seen[0].values())
    model, X, y, seen = _step([MyInner(linear(1))])
    ref = _grad_batch(model, X, y)
    for pname, got in seen[0].items():
        assert set(got) == {"batch_dot"}
        flat = ref[pname].flatten(1)
        torch.testing.assert_close(got["batch_dot"], flat @ flat.T)
