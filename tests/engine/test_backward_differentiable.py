"""First-order results are differentiable under ``backward(create_graph=True)``.

BackPACK's "gradient of the variance" use: ``loss.backward(create_graph=True)`` inside the
context, then differentiate a function of ``variance`` (or ``grad_batch``, ``batch_l2``,
``sum_grad_squared``) with respect to the parameters. Reference: the per-sample gradients as a
function of the parameters (one autograd ``grad(ℓₙ/N, create_graph=True)`` per sample), the
statistic built from its definition, and its gradient by autograd — float64, independent of
backprism.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import (
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SumGradSquared,
    Variance,
)

DT = torch.float64


class _EmbedMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.lin = nn.Linear(4, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.emb(tokens)).mean(1))


def _problem(name: str) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    n = 6
    if name == "mlp_mse":
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
        X, y = torch.randn(n, 5, dtype=DT), torch.randn(n, 2, dtype=DT)
        lf: nn.Module = nn.MSELoss()
    elif name == "mlp_ce_sum":
        model = nn.Sequential(nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3))
        X, y = torch.randn(n, 5, dtype=DT), torch.randint(0, 3, (n,))
        lf = nn.CrossEntropyLoss(reduction="sum")
    elif name == "sequence":  # Linear on [N, T, d]
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), nn.Flatten())
        X, y = torch.randn(n, 2, 5, dtype=DT), torch.randn(n, 6, dtype=DT)
        lf = nn.MSELoss()
    elif name == "conv":
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 2, stride=2), nn.Flatten(),
            nn.Linear(8, 2),
        )
        X, y = torch.randn(n, 2, 4, 4, dtype=DT), torch.randn(n, 2, dtype=DT)
        lf = nn.MSELoss()
    elif name == "norms":  # LayerNorm; GroupNorm and BatchNorm (eval) on feature maps
        model = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.BatchNorm2d(4),
            nn.Flatten(), nn.Linear(16, 5), nn.LayerNorm(5), nn.Sigmoid(), nn.Linear(5, 2),
        )
        model[3].eval()
        with torch.no_grad():
            model[3].running_mean.uniform_(-0.5, 0.5)
            model[3].running_var.uniform_(0.5, 2.0)
            for m in (model[1], model[3], model[6]):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
        X, y = torch.randn(n, 2, 2, 2, dtype=DT), torch.randn(n, 2, dtype=DT)
        lf = nn.MSELoss()
    else:  # embedding
        model = _EmbedMean()
        X, y = torch.randint(0, 7, (n, 3)), torch.randint(0, 3, (n,))
        lf = nn.CrossEntropyLoss()
    return model.to(DT), lf, X, y


def _grad_batch_loop(model: nn.Module, lf: nn.Module, X: Tensor, y: Tensor) -> dict:
    """``{name: [N, *p]}``, the per-sample gradients ``∇(ℓₙ/N)`` (mean) or ``∇ℓₙ`` (sum), one
    sample at a time with ``create_graph=True``: a differentiable function of the parameters.

    (A per-sample loop rather than ``vmap(grad(...))``: torch.func's second derivative through
    ``layer_norm`` disagrees with finite differences — −1.49 against −1.70 for one entry of a
    Linear weight before a LayerNorm — while autograd's agrees to 1e-9.)"""
    n = X.shape[0]
    scale = 1.0 / n if lf.reduction == "mean" else 1.0
    one = type(lf)(reduction=lf.reduction)  # one sample, the batch's reduction over the rest
    names = [k for k, _ in model.named_parameters()]
    params = list(model.parameters())
    rows: dict[str, list[Tensor]] = {k: [] for k in names}
    for i in range(n):
        loss = one(model(X[i : i + 1]), y[i : i + 1]) * scale
        for k, g in zip(names, torch.autograd.grad(loss, params, create_graph=True)):
            rows[k].append(g)
    return {k: torch.stack(v) for k, v in rows.items()}


def _reference(model: nn.Module, lf: nn.Module, X: Tensor, y: Tensor, objective: Callable) -> dict:
    """The gradient of ``objective(grad_batch)`` w.r.t. the parameters, by autograd."""
    total = objective(_grad_batch_loop(model, lf, X, y))
    names = [k for k, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(total, list(model.parameters()))))


STATS: dict[str, tuple[Callable[[], object], str, Callable[[Tensor], Tensor]]] = {
    "variance": (Variance, "variance", lambda gb: (gb.square().mean(0) - gb.mean(0).square())),
    "batch_l2": (BatchL2Grad, "batch_l2", lambda gb: gb.flatten(1).square().sum(1)),
    "sum_grad_squared": (SumGradSquared, "sum_grad_squared", lambda gb: gb.square().sum(0)),
    "grad_batch": (BatchGrad, "grad_batch", lambda gb: gb),
}


@pytest.mark.parametrize(
    "problem", ["mlp_mse", "mlp_ce_sum", "sequence", "conv", "norms", "embedding"]
)
@pytest.mark.parametrize("stat", list(STATS))
def test_gradient_of_first_order_result(problem: str, stat: str) -> None:
    ext_cls, field, definition = STATS[stat]
    model, lf, X, y = _problem(problem)
    names = [k for k, _ in model.named_parameters()]
    torch.manual_seed(1)
    # a fixed random weighting of the result makes every entry matter
    weights = {k: torch.rand_like(definition(torch.zeros(X.shape[0], *p.shape, dtype=DT)))
               for k, p in model.named_parameters()}

    def objective(gb: dict) -> Tensor:
        return sum((definition(gb[k]) * weights[k]).sum() for k in names)

    ref = _reference(model, lf, X, y, objective)

    extend(model)
    extend(lf)
    with collect(ext_cls()):
        lf(model(X), y).backward(create_graph=True)
    total = sum((getattr(p, field) * weights[k]).sum() for k, p in model.named_parameters())
    got = torch.autograd.grad(total, list(model.parameters()))
    for k, gk in zip(names, got):
        torch.testing.assert_close(gk, ref[k], rtol=1e-9, atol=1e-12, msg=f"{stat} {k}")


def test_gradient_of_variance_through_autograd_grad() -> None:
    """``torch.autograd.grad(loss, params, create_graph=True)`` is a create_graph pass too."""
    model, lf, X, y = _problem("mlp_mse")
    names = [k for k, _ in model.named_parameters()]

    def objective(gb: dict) -> Tensor:
        return sum(STATS["variance"][2](gb[k]).sum() for k in names)

    ref = _reference(model, lf, X, y, objective)
    extend(model)
    extend(lf)
    with collect(Variance()):
        torch.autograd.grad(lf(model(X), y), list(model.parameters()), create_graph=True)
    total = sum(p.variance.sum() for p in model.parameters())
    got = torch.autograd.grad(total, list(model.parameters()))
    for k, gk in zip(names, got):
        torch.testing.assert_close(gk, ref[k], rtol=1e-9, atol=1e-12)


def test_rule_without_differentiable_form_is_refused_before_writing() -> None:
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.GRU(4, 2, batch_first=True)).to(DT))
    lf = extend(nn.MSELoss())
    X, y = torch.randn(4, 2, 3, dtype=DT), torch.randn(4, 2, 2, dtype=DT)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*GRU"), collect(Variance()):
        lf(model(X)[0], y).backward(create_graph=True)
    for p in model.parameters():
        assert p.grad is None and not hasattr(p, "variance")


def test_second_order_under_create_graph_is_correct_and_detached() -> None:
    """Second-order results are computed as without ``create_graph`` (values from the
    definition), and are not part of a graph."""
    from tests.reference import diag_ggn

    model, lf, X, y = _problem("mlp_mse")
    ref = diag_ggn(model, lf, X, y)
    extend(model)
    extend(lf)
    with collect(DiagGGNExact()):
        lf(model(X), y).backward(create_graph=True)
    for k, p in model.named_parameters():
        assert not p.diag_ggn_exact.requires_grad
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], rtol=1e-10, atol=1e-12)


def test_differentiable_false_keeps_results_detached_for_any_rule() -> None:
    """``collect(differentiable=False)``: a graph created for Hessian-vector products (the
    monitor's HessMaxEV steps) neither refuses rules without a differentiable form nor puts
    results into the graph; values are those of a plain pass."""
    from tests.reference import per_sample_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 2)).to(DT)
    lf = nn.MSELoss()
    X, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    gb = per_sample_grads(model, lf, X, y)
    extend(model)
    extend(lf)
    with collect(Variance(), differentiable=False):
        lf(model(X), y).backward(create_graph=True)
    for k, p in model.named_parameters():
        assert not p.variance.requires_grad
        torch.testing.assert_close(p.variance, gb[k].var(0, unbiased=False))


@pytest.mark.parametrize("problem", ["mlp_mse", "sequence", "conv"])
def test_gradient_of_subsampled_grad_batch(problem: str) -> None:
    """``BatchGrad(subsampling=...)`` with repeated and permuted indices under
    ``create_graph=True``: the selected rows, and their gradient, are the reference's."""
    model, lf, X, y = _problem(problem)
    index = [2, 0, 2]
    names = [k for k, _ in model.named_parameters()]
    torch.manual_seed(2)
    weights = {k: torch.rand(len(index), *p.shape, dtype=DT) for k, p in model.named_parameters()}

    def objective(gb: dict) -> Tensor:
        return sum((gb[k][index] * weights[k]).sum() for k in names)

    rows = {k: v.detach() for k, v in _grad_batch_loop(model, lf, X, y).items()}
    ref = _reference(model, lf, X, y, objective)
    extend(model)
    extend(lf)
    with collect(BatchGrad(subsampling=index)):
        lf(model(X), y).backward(create_graph=True)
    total = sum((p.grad_batch * weights[k]).sum() for k, p in model.named_parameters())
    got = torch.autograd.grad(total, list(model.parameters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch.detach(), rows[name][index], rtol=1e-9, atol=1e-12)
    for k, gk in zip(names, got):
        torch.testing.assert_close(gk, ref[k], rtol=1e-9, atol=1e-12, msg=k)
