"""Parameters used outside the forward of the module that owns them
(``backprism.engine.functional``), against dense float64 ``torch.func`` references.

Functional uses in an extended model's forward: each common op is attributed, alone and combined
with a module use of the same tensor; a use after the model's forward is refused. Parameters
outside their module: a tied decoder reusing its embedding functionally, ``F.linear`` on a
container's own Parameter, a hand-written LayerNorm whose affine Parameters live on the
container, a child run through ``torch.func.functional_call``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, SumGradSquared, Variance
from backprism.extensions.kronecker import KFLR
from tests.common import (
    TiedDecoder,
    assert_first_order,
    check_diag_attr,
    check_first_order_fields,
    seeded_labels,
)
from tests.reference import diag_ggn, ggn, per_sample_grads

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}
N = 4


class Holder(nn.Module):
    """Parameters kept in a module that is never called (its forward does not run)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5))
        self.b = nn.Parameter(torch.randn(3))
        self.conv_w = nn.Parameter(torch.randn(4, 2, 3, 3))
        self.conv_b = nn.Parameter(torch.randn(4))
        self.gamma = nn.Parameter(torch.rand(5) + 0.5)
        self.beta = nn.Parameter(torch.randn(5))


class Functional(nn.Module):
    """A model whose forward uses parameters functionally with op ``op`` (the model owns no
    parameter directly, so no module call covers them: each op is attributed on its own)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.params = Holder()
        self.emb = nn.Embedding(7, 5)
        self.head = nn.Linear(3, 3)

    def __getattr__(self, name: str):
        if name in ("w", "b", "conv_w", "conv_b", "gamma", "beta"):
            return getattr(self.params, name)
        return super().__getattr__(name)

    def forward(self, x: Tensor) -> Tensor:
        op = self.op
        if op == "conv2d":
            h = F.conv2d(x, self.conv_w, self.conv_b, stride=2, padding=1)  # [N, 4, 2, 2]
            return self.head(torch.tanh(h.flatten(2).mean(2))[:, :3])
        if op == "conv2d_same":
            h = F.conv2d(x, self.conv_w, None, padding="same")
            return self.head(torch.tanh(h.flatten(2).mean(2))[:, :3])
        if op == "embedding":
            h = F.embedding(x, self.emb.weight)  # [N, T, 5]
            return self.head(torch.tanh(F.linear(h, self.w, self.b)).mean(1))
        if op == "tied":  # module use and functional use of one matrix
            h = self.emb(x)  # [N, T, 5]
            logits = torch.tanh(h) @ self.emb.weight.T  # [N, T, 7]
            return logits.mean(1)[:, :3]
        if op == "linear":
            h = F.linear(x, self.w, self.b)
        elif op == "matmul_t":
            h = x @ self.w.T + self.b
        elif op == "addmm":
            h = torch.addmm(self.b, x, self.w.t())
        elif op == "scale_shift":
            h = F.linear(x * self.gamma + self.beta, self.w)
        elif op == "layer_norm":
            h = F.linear(F.layer_norm(x, (5,), self.gamma, self.beta, 1e-3), self.w)
        elif op == "einsum":
            h = torch.einsum("ni,oi->no", x, self.w)
        else:
            raise ValueError(op)
        return self.head(torch.tanh(h))


OPS = ["linear", "matmul_t", "addmm", "scale_shift", "layer_norm", "einsum", "embedding", "tied",
       "conv2d", "conv2d_same"]


def _problem(op: str):
    torch.manual_seed(0)
    model = Functional(op).to(DT)
    if op.startswith("conv2d"):
        X = torch.randn(N, 2, 4, 4, dtype=DT)
    elif op in ("embedding", "tied"):
        X = torch.randint(0, 7, (N, 3))
    else:
        X = torch.randn(N, 5, dtype=DT)
    return model, X, torch.randint(0, 3, (N,))


@pytest.mark.parametrize("op", OPS)
def test_first_order(op: str):
    model, X, y = _problem(op)
    lf = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lf, X, y)
    extend(model), extend(lf)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lf(model(X), y).backward()
    assert_first_order(model, ref, **TOL)


class _BorrowingLeaf(nn.Module):
    """A leaf module with a parameter of its own that also uses another module's weight."""

    def __init__(self, lender: nn.Linear) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        object.__setattr__(self, "lender", lender)  # not a sub-module

    def forward(self, x: Tensor) -> Tensor:
        return (x @ self.lender.weight.T) * self.g


class _Borrow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.leaf = _BorrowingLeaf(self.lin)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.leaf(self.lin(x))))


def test_foreign_parameter_inside_a_hooked_leaf_module():
    """Inside a hooked leaf module its own parameters are claimed by its call (the fast path);
    another module's parameter used there is still a functional use of its own."""
    torch.manual_seed(0)
    model = _Borrow().to(DT)
    X, y = torch.randn(N, 5, dtype=DT), torch.randint(0, 3, (N,))
    lf = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lf, X, y)
    extend(model), extend(lf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic rule of the leaf module
        with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
            lf(model(X), y).backward()
    assert_first_order(model, ref, **TOL)


@pytest.mark.parametrize("op", ["linear", "addmm", "scale_shift", "tied", "conv2d"])
def test_diag_ggn_exact(op: str):
    model, X, y = _problem(op)
    lf = nn.CrossEntropyLoss()
    ref = diag_ggn(model, lf, X, y)
    extend(model), extend(lf)
    with collect(DiagGGNExact()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], **TOL)


def test_use_after_the_model_forward_is_refused():
    """A parameter used outside the extended model's forward (in the training script) is not
    seen by the recording: refused with its name before anything is written."""
    torch.manual_seed(1)
    model = extend(nn.Sequential(nn.Linear(5, 4), nn.Tanh()).to(DT))
    head = model[0].weight  # reused after the forward: logits = h @ W (4×5)
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(N, 5, dtype=DT), torch.randint(0, 5, (N,))
    with pytest.raises(RuntimeError, match=r"'0.weight'.*outside the forward"), collect(
        BatchGrad()
    ):
        lf(model(X) @ head, y).backward()
    assert all(p.grad is None and not hasattr(p, "grad_batch") for p in model.parameters())


# ------------------------------------------------------------- parameters used outside their module
FIRST = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)


class LinearContainer(nn.Module):
    """``F.linear(h, self.w)`` with ``w`` a Parameter of a module that also has children."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.w = nn.Parameter(torch.randn(3, 5))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.inp(x)), self.w)


class HandNorm(nn.Module):
    """Hand-written LayerNorm ``x̂ * gamma + beta`` with the affine Parameters on the container."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.gamma = nn.Parameter(1.0 + 0.3 * torch.randn(5))
        self.beta = nn.Parameter(0.3 * torch.randn(5))
        self.out = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = (h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True, unbiased=False) + 1e-5).sqrt()
        return self.out(torch.tanh(h * self.gamma + self.beta))


class FunctionalCallChild(nn.Module):
    """A child run through ``torch.func.functional_call`` inside the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = functional_call(self.lin, dict(self.lin.named_parameters()), (x,))
        return self.out(torch.tanh(h))


class SwappedIntoChild(nn.Module):
    """``functional_call`` swaps another tensor into a child for one call (the container's own
    parameter, or a constant), and the child also runs with its own weight: the swapped call
    must not change which parameters the child's later calls own."""

    def __init__(self, swap: str) -> None:
        super().__init__()
        self.swap = swap
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        if swap == "parameter":
            self.w = nn.Parameter(torch.randn(4, 4))
        else:
            self.register_buffer("w", torch.randn(4, 4))
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        a = functional_call(self.seq, {"0.weight": self.w}, (x,))
        return self.out(a + self.seq(x))


N1 = 4
OUTSIDE: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor], Callable[[], Tensor]]] = {
    "tied_decoder": (
        TiedDecoder, lambda: seeded_labels((N1, 3), 5, 1), lambda: seeded_labels((N1, 3), 5, 2)
    ),
    "f_linear_container": (
        LinearContainer, lambda: torch.randn(N1, 4, dtype=DT), lambda: seeded_labels((N1,), 3)
    ),
    "hand_norm": (HandNorm, lambda: torch.randn(N1, 4, dtype=DT), lambda: seeded_labels((N1,), 3)),
    "functional_call_child": (
        FunctionalCallChild, lambda: torch.randn(N1, 4, dtype=DT), lambda: seeded_labels((N1,), 3)
    ),
    "functional_call_swap_parameter": (
        lambda: SwappedIntoChild("parameter"),
        lambda: torch.randn(N1, 4, dtype=DT),
        lambda: seeded_labels((N1,), 3),
    ),
    "functional_call_swap_constant": (
        lambda: SwappedIntoChild("constant"),
        lambda: torch.randn(N1, 4, dtype=DT),
        lambda: seeded_labels((N1,), 3),
    ),
}


def _build_outside(name: str) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    make, make_x, make_y = OUTSIDE[name]
    return extend(make().to(DT)), extend(nn.CrossEntropyLoss()), make_x(), make_y()


@pytest.mark.parametrize("name", list(OUTSIDE))
def test_param_outside_module_first_order(name: str) -> None:
    model, lf, X, y = _build_outside(name)
    ref = per_sample_grads(model, lf, X, y)
    model.zero_grad(set_to_none=True)
    with collect(*(e() for e in FIRST)):
        lf(model(X), y).backward()
    check_first_order_fields(model, ref)


@pytest.mark.parametrize("name", list(OUTSIDE))
def test_param_outside_module_diag_ggn(name: str) -> None:
    model, lf, X, y = _build_outside(name)
    ref = diag_ggn(model, lf, X, y)
    with collect(DiagGGNExact()):
        lf(model(X), y).backward()
    check_diag_attr(model, "diag_ggn_exact", ref)


@pytest.mark.parametrize("op", ["linear", "layer_norm", "embedding", "conv2d", "conv2d_same"])
def test_functional_stand_ins_across_steps_and_replaced_parameters(op: str) -> None:
    """The stand-in of a functional ``F.linear``, ``F.layer_norm``, ``F.embedding`` or
    ``F.conv2d`` is reused from forward to forward: results stay right over several steps,
    after the parameters are replaced (new objects under the same names), and for two forwards
    in one backward."""
    model, X, y = _problem(op)
    lf = nn.CrossEntropyLoss()
    extend(model), extend(lf)
    for step in range(3):
        if step == 1:  # new parameter objects under the same names
            with torch.no_grad():
                for holder in (model.params, model.emb):
                    for name, p in list(holder.named_parameters(recurse=False)):
                        setattr(holder, name, nn.Parameter(p.detach() * 0.5))
            extend(model)
        ref = per_sample_grads(model, lf, X, y)
        model.zero_grad()
        with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
            lf(model(X), y).backward()
        assert_first_order(model, ref, **TOL)
    # two forwards of the same model, one backward: per-sample gradients of the sum
    X2 = X.flip(0)
    model.zero_grad()
    ref1 = per_sample_grads(model, lf, X, y)
    ref2 = per_sample_grads(model, lf, X2, y)
    with collect(BatchGrad()):
        (lf(model(X), y) + lf(model(X2), y)).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad_batch, ref1[name] + ref2[name], **TOL)


def test_stand_ins_of_replaced_parameters_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters replaced again and again do not stay alive through the stand-ins kept for
    them: past the limit per model, those of parameters the model no longer holds go."""
    import weakref

    from backprism.engine import functional

    monkeypatch.setattr(functional, "_STAND_INS_PER_ROOT", 4)
    model, X, y = _problem("layer_norm")
    extend(model)
    old = []
    for _ in range(6):
        old.append(weakref.ref(model.params.gamma))
        with torch.no_grad():
            model.params.gamma = nn.Parameter(model.params.gamma.detach() + 0.1)
        extend(model)
        model(X)
    assert len(functional._STAND_INS[model]) <= 4
    assert sum(r() is None for r in old) >= 3
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        F.cross_entropy(model(X), y).backward()
    assert_first_order(model, ref, **TOL)


@pytest.mark.parametrize("op", ["linear", "conv2d"])
def test_bias_only_with_a_frozen_weight(op: str) -> None:
    """``F.linear``/``F.conv2d`` on a frozen weight with a trainable bias (bias-only
    fine-tuning in a layer subclass that calls the function itself, as timm's ``Linear``): the
    bias gets the layer's closed forms — KFLR's full ``[B]``, the exact GGN block of the bias —
    not the generic stand-in's diagonal factor (and no generic-rule warning)."""
    model, X, y = _problem(op)
    for p in model.parameters():
        p.requires_grad_(False)
    bias = model.params.b if op == "linear" else model.params.conv_b
    bias.requires_grad_(True)
    block = ggn(model, nn.CrossEntropyLoss(), X, y)  # the bias alone is trainable
    grads = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with collect(KFLR(), BatchGrad()):
            lossfunc(model(X), y).backward()
    torch.testing.assert_close(bias.kflr[0], block, **TOL)
    (ref,) = grads.values()
    torch.testing.assert_close(bias.grad_batch, ref, **TOL)
