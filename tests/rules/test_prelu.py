"""``nn.PReLU``'s closed-form rule (``backprism.rules.prelu``) against float64 references from
the definition.

``y = max(0, x) + a ⊙ min(0, x)``, ``a`` of shape ``[1]`` or ``[C]`` (channel axis 1). Before this
rule PReLU took the generic ``torch.func`` rule, whose nested ``vmap`` hit PyTorch 2.13's broken
batching rule of ``prelu``'s backward and returned silently wrong per-sample gradients.

References (none uses backprism, none nests ``vmap`` over ``prelu``):

* rule level: ``V[m, n] = ∇_a ⟨prelu(xₙ; a), g[m, n]⟩`` by ``vmap(grad(·))`` over the samples,
  one column at a time, checked against the same ``grad`` in a Python loop;
* end to end: per-sample gradients ``∇(ℓₙ/N)`` from ``reference.per_sample_grads`` (one
  ``vmap`` over per-sample parameter copies, the real mean-reduced loss), checked against
  ``reference.per_sample_grads_loop`` (no ``vmap``); GGN diagonals from
  ``reference.batch_diag_ggn_loop`` (dense Jacobians per sample); the Hessian diagonal from
  ``torch.autograd.functional.hessian`` of the loss in the flattened parameters;
  gradients of first-order results under ``create_graph=True`` from a per-sample autograd loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from backprism import collect, extend
from backprism.engine.rule import get_rule
from backprism.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SumGradSquared,
    Variance,
)
from backprism.rules.prelu import PReLURule
from tests.common import check_rule_statistics, first_order_expected, make_call
from tests.reference import batch_diag_ggn_loop, per_sample_grads, per_sample_grads_loop

DT = torch.float64
TOL = {"rtol": 1e-7, "atol": 1e-10}
M = 3  # columns of the rule-level tests


# -- rule level -------------------------------------------------------------------------------
def _vjp_reference(module: nn.PReLU, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    """``{"weight": [M, N, *a.shape]}``: ``V[m, n] = ∇_a ⟨prelu(xₙ; a), g[m, n]⟩``."""
    a = module.weight.detach()

    def contribution(a: Tensor, xn: Tensor, gn: Tensor) -> Tensor:
        return (F.prelu(xn.unsqueeze(0), a).squeeze(0) * gn).sum()

    batched = torch.stack(
        [vmap(grad(contribution), in_dims=(None, 0, 0))(a, x, g[k]) for k in range(g.shape[0])]
    )
    looped = torch.stack(
        [
            torch.stack([grad(contribution)(a, x[i], g[k, i]) for i in range(x.shape[0])])
            for k in range(g.shape[0])
        ]
    )
    # the reference itself must not hit a batching bug
    torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-14)
    return {"weight": batched}


@pytest.mark.parametrize(
    ("slopes", "shape"),
    [
        (1, (4,)),
        (1, (4, 5)),
        (1, (3, 2, 4, 4)),
        (5, (4, 5)),
        (3, (4, 3, 6)),
        (3, (3, 3, 4, 4)),
        (2, (2, 2, 2, 3, 2)),
    ],
)
def test_prelu_rule_statistics(slopes: int, shape: tuple[int, ...]) -> None:
    """Every statistic of the rule (per-sample, summed, weighted and plain squares, batch_l2,
    batch_dot, batch_dot_with) for ``M = 3`` columns."""
    gen = torch.Generator().manual_seed(slopes * 100 + len(shape))
    module = nn.PReLU(slopes).to(DT)
    with torch.no_grad():
        module.weight.copy_(torch.rand(slopes, generator=gen, dtype=DT) * 2 - 1)
    x = torch.randn(*shape, generator=gen, dtype=DT)
    x.view(-1)[::7] = 0.0  # the kink: both min(0, x) and PyTorch's derivative are 0
    call, out_shape = make_call(module, x)
    g = torch.randn(M, *out_shape, generator=gen, dtype=DT)
    w = torch.randn(M, shape[0], generator=gen, dtype=DT)
    rule = get_rule(module)
    assert isinstance(rule, PReLURule)
    ref = _vjp_reference(module, x, g)
    vectors = {"weight": torch.randn(slopes, generator=gen, dtype=DT)}
    check_rule_statistics(rule, call, g, ref, w, vectors, **TOL)


def test_prelu_rule_refuses_a_0d_input() -> None:
    module = nn.PReLU().to(DT)
    call, _ = make_call(module, torch.tensor(-0.5, dtype=DT).reshape(1))
    call.args = (torch.tensor(-0.5, dtype=DT),)
    with pytest.raises(ValueError, match="0-d input"):
        get_rule(module).per_sample(call, torch.ones(1, 1, dtype=DT))


# -- end to end -------------------------------------------------------------------------------
def _model(kind: str) -> tuple[nn.Module, Tensor, Tensor]:
    """PReLU(1) and PReLU(C) after Linear (``mlp``) or Conv2d (``cnn``), with a Tanh between
    (a residual term of DiagHessian passes back through the PReLU layers), float64, slopes
    drawn from ``[-1, 1]``."""
    torch.manual_seed(3)
    n = 4
    if kind == "mlp":
        model = nn.Sequential(
            nn.Linear(5, 6), nn.PReLU(1), nn.Linear(6, 4), nn.PReLU(4), nn.Linear(4, 4),
            nn.Tanh(), nn.Linear(4, 3),
        )
        x = torch.randn(n, 5)
    else:
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.PReLU(3), nn.Conv2d(3, 2, 3), nn.PReLU(1),
            nn.Flatten(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3),
        )
        x = torch.randn(n, 2, 4, 4)
    model = model.to(DT)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.PReLU):
                mod.weight.uniform_(-1.0, 1.0)
    y = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(4))
    return model, x.to(DT), y


def _per_sample_reference(model: nn.Module, lf: nn.Module, x: Tensor, y: Tensor) -> dict:
    ref = per_sample_grads(model, lf, x, y)
    loop = per_sample_grads_loop(model, lf, x, y)
    for k in ref:  # the vmapped reference agrees with the loop (no batching bug in it)
        torch.testing.assert_close(ref[k], loop[k], rtol=1e-10, atol=1e-13)
    return ref


def _hessian_diagonal(model: nn.Module, lf: nn.Module, x: Tensor, y: Tensor) -> dict:
    """``{name: p-shaped}`` diagonal of ``∇²_θ L`` by ``torch.autograd.functional.hessian``
    (a loop of double backward passes, no ``vmap``)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = list(params)
    sizes = [params[k].numel() for k in names]
    flat = torch.cat([params[k].reshape(-1) for k in names])

    def loss(theta: Tensor) -> Tensor:
        parts = torch.split(theta, sizes)
        p = {k: t.reshape(params[k].shape) for k, t in zip(names, parts)}
        return lf(functional_call(model, p, (x,)), y)

    diag = torch.autograd.functional.hessian(loss, flat).diagonal()
    return {k: t.reshape(params[k].shape) for k, t in zip(names, torch.split(diag, sizes))}


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_prelu_first_order(kind: str) -> None:
    """BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad and ``.grad`` of every
    parameter (PReLU slopes included) against ``∇(ℓₙ/N)`` of the mean cross-entropy."""
    model, x, y = _model(kind)
    lf = nn.CrossEntropyLoss()
    ref = _per_sample_reference(model, lf, x, y)
    extend(model)
    extend(lf)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad()):
        lf(model(x), y).backward()
    for name, p in model.named_parameters():
        for field, value in first_order_expected(ref[name]).items():
            torch.testing.assert_close(getattr(p, field), value, **TOL, msg=f"{name}.{field}")
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, **TOL)
        torch.testing.assert_close(p.grad, ref[name].sum(0), **TOL)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_prelu_ggn_diagonals(kind: str) -> None:
    """DiagGGNExact, BatchDiagGGNExact and KFLR (a single diagonal factor for the slopes)
    against ``diag(Jₙᵀ ∇²_{fₙ}L Jₙ)`` from dense per-sample Jacobians."""
    model, x, y = _model(kind)
    lf = nn.CrossEntropyLoss()
    ref = batch_diag_ggn_loop(model, lf, x, y)
    extend(model)
    extend(lf)
    with collect(DiagGGNExact(), BatchDiagGGNExact(), KFLR()):
        lf(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[name].sum(0), **TOL, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, ref[name], **TOL, msg=name)
    for mod in model.modules():
        if isinstance(mod, nn.PReLU):
            (factor,) = mod.weight.kflr
            torch.testing.assert_close(factor, torch.diag(mod.weight.diag_ggn_exact), **TOL)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_prelu_diag_hessian(kind: str) -> None:
    """DiagHessian: the GGN diagonal plus the Tanh residual, pushed back through the PReLU
    layers (whose own second derivative in x vanishes away from 0), against the dense Hessian."""
    model, x, y = _model(kind)
    lf = nn.CrossEntropyLoss()
    ref = _hessian_diagonal(model, lf, x, y)
    extend(model)
    extend(lf)
    loss = lf(model(x), y)
    with collect(DiagHessian()):
        loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[name], **TOL, msg=name)


def test_prelu_reduction_sum_and_mse() -> None:
    """``reduction="sum"`` (per-sample gradients ``∇ℓₙ``, no ``1/N``) on an MSE loss."""
    model, x, _ = _model("mlp")
    y = torch.randn(x.shape[0], 3, dtype=DT, generator=torch.Generator().manual_seed(5))
    lf = nn.MSELoss(reduction="sum")
    ref = _per_sample_reference(model, lf, x, y)
    extend(model)
    extend(lf)
    with collect(BatchGrad(), BatchL2Grad()):
        lf(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[name], **TOL, msg=name)
        torch.testing.assert_close(p.batch_l2, ref[name].flatten(1).square().sum(1), **TOL)


def test_prelu_first_order_results_are_differentiable() -> None:
    """Under ``backward(create_graph=True)`` the gradient of a weighted ``Σ grad_batch²`` with
    respect to every parameter equals autograd's through per-sample gradients computed one
    sample at a time with ``create_graph=True``."""
    model, x, y = _model("mlp")
    lf = nn.CrossEntropyLoss()
    n = x.shape[0]
    names = [k for k, _ in model.named_parameters()]
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(6)
    weights = {k: torch.rand(n, *p.shape, generator=gen, dtype=DT) for k, p in zip(names, params)}

    rows: dict[str, list[Tensor]] = {k: [] for k in names}
    for i in range(n):
        li = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]) / n
        for k, gk in zip(names, torch.autograd.grad(li, params, create_graph=True)):
            rows[k].append(gk)
    total = sum((torch.stack(rows[k]).square() * weights[k]).sum() for k in names)
    ref = torch.autograd.grad(total, params)

    extend(model)
    extend(lf)
    with collect(BatchGrad()):
        torch.autograd.grad(lf(model(x), y), params, create_graph=True)
    got_total = sum((p.grad_batch.square() * weights[k]).sum() for k, p in zip(names, params))
    got = torch.autograd.grad(got_total, params)
    for k, a, b in zip(names, got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=k)
