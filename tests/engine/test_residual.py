"""Hessian residual terms of elementwise nonlinearities (``backprism.engine.residual``, the
non-GGN part of ``DiagHessian``): the recording of nonlinearities during the forward (switch,
no reference cycles, forwards inside a context without the DiagHessian family) and the clear
refusals, before anything is written, of what has no residual decomposition (in-place
nonlinearities, LocalResponseNorm between parameters, a parameter used by several calls, parameters
entering a generic-rule module nonlinearly, parameter-only values broadcast into the
activations).

The values of ``DiagHessian`` against dense Hessians are tested in
``tests/extensions/test_hessian.py``.
"""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine.residual import NonlinearityError
from backprism.engine.state import MODE_FREE
from backprism.extensions.hessian import BatchDiagHessian, DiagHessian
from backprism.extensions.secondorder import DiagGGNExact
from tests.common import SoftmaxAttention
from tests.reference import diag_ggn, loss_hessian, split

DT = torch.float64

pytestmark = pytest.mark.usefixtures("float64_default")


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.l1(x).tanh_())


def test_inplace_nonlinearity_refused():
    model, lf = extend(InPlace()), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(2, 3), torch.randint(0, 3, (2,))
    refused = pytest.raises(NonlinearityError, match=r"in-place .* overwrites its input")
    with refused, collect(DiagHessian()):
        lf(model(X), y).backward()


class _FunctionalInPlace(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.hardswish(x, inplace=True)


@pytest.mark.parametrize(
    "act", ["silu_module", "hardswish_module", "hardswish_functional", "silu_after_residual"]
)
def test_inplace_activations_that_keep_their_input(act: str):
    """In-place SiLU / Hardswish (timm's EfficientNet and MobileNetV3 build them so): their
    autograd nodes keep the input, from which the Hessian term ``σ''(z)`` is read, and its
    columns enter the graph at the node's input edge (they were refused). DiagHessian against
    the dense autograd Hessian's diagonal."""
    torch.manual_seed(0)
    act_module = {
        "silu_module": nn.SiLU(inplace=True),
        "hardswish_module": nn.Hardswish(inplace=True),
        "hardswish_functional": _FunctionalInPlace(),
        "silu_after_residual": nn.SiLU(inplace=True),
    }[act]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.act, self.l2 = nn.Linear(3, 4), act_module, nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = self.l1(x)
            if act == "silu_after_residual":
                h = h + x.sum(1, keepdim=True)
            return self.l2(self.act(3 * h))

    model = Net()
    X, y = torch.randn(3, 3), torch.randint(0, 3, (3,))
    params = dict(model.named_parameters())

    def loss(*flat: Tensor) -> Tensor:
        values = dict(zip(params, flat))
        return F.cross_entropy(torch.func.functional_call(model, values, (X,)), y)

    H = torch.autograd.functional.hessian(loss, tuple(p.detach() for p in params.values()))
    lf = extend(nn.CrossEntropyLoss())
    extend(model)
    with collect(DiagHessian()):
        lf(model(X), y).backward()
    for i, (name, p) in enumerate(params.items()):
        want = torch.diagonal(H[i][i].reshape(p.numel(), p.numel())).reshape(p.shape)
        torch.testing.assert_close(p.diag_h, want, msg=name)


def test_recording_switch():
    from backprism.engine.residual import record_nonlinearities

    model, lf = extend(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))), extend(
        nn.CrossEntropyLoss()
    )
    X, y = torch.randn(2, 3), torch.randint(0, 2, (2,))
    assert record_nonlinearities(False) is True
    try:
        with pytest.raises(RuntimeError, match="record_nonlinearities"), collect(DiagHessian()):
            lf(model(X), y).backward()
        with collect(DiagGGNExact()):  # unaffected
            lf(model(X), y).backward()
    finally:
        assert record_nonlinearities(True) is False


def test_recording_keeps_no_reference_cycles():
    """The residual hook on ``a = tanh(z)`` holds ``z`` only: after the backward pass both are
    freed by reference counting alone (a cycle through an autograd node would leak)."""
    model = extend(nn.Sequential(nn.Linear(3, 3), nn.Tanh()))
    lf = extend(nn.MSELoss())
    refs = []
    model[0].register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    X, y = torch.randn(2, 3), torch.randn(2, 3)
    for ctx in (contextlib.nullcontext(), collect(DiagHessian())):
        out = model(X)
        refs.append(weakref.ref(out))
        with ctx:
            lf(out, y).backward()
        del out
        assert all(r() is None for r in refs)


# -- refusals --------------------------------------------------------------------------------------
class Product(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.c(self.a(x) * self.b(x))


class Towers(nn.Module):
    """Two towers on two inputs, multiplied: ``d(tanh(a(x₁)) * tanh(b(x₂)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.d = (nn.Linear(3, 3) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.d(torch.tanh(self.a(x)) * torch.tanh(self.b(x.flip(1))))


class SharedProduct(nn.Module):
    """A product whose operands both depend on ``a``'s parameters: its Hessian diagonal has a
    term from the product (``tests/extensions/test_bilinear.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(3, 3) for _ in range(4))
        self.act = nn.Tanh()  # a module: later forwards may run without the mode

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.a(x))
        return self.d(self.b(h) * self.c(h))


class Shared(nn.Module):
    """A LayerNorm applied to a value its own scale feeds: the product of its uses (its scale
    times its normalised input) is no Linear layer's (those are built:
    ``tests/extensions/test_hessian.py::test_nested_linear_uses``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(3, 3), nn.LayerNorm(3)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(torch.tanh(self.norm(self.lin(x))))


class OwnParam(nn.Module):
    """Generic-rule module: its parameter enters nonlinearly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w.exp()


class FunctionalParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)) + self.a.bias.sum())


class Derived(nn.Module):
    """A container using a value computed from its own parameter alone (released to
    functional attribution: the value is rebuilt where it meets the samples)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.s = nn.Parameter(torch.randn(3) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h * self.s.exp() if self.how == "exp" else h + 2 * self.s)


class HiddenAttention(nn.Module):
    """Attention on hidden features: its query and key both depend on ``inp``'s parameters,
    so the product ``q kᵀ`` has a term in their diagonal blocks (``tests/extensions/
    test_bilinear.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.att = nn.Linear(3, 3), SoftmaxAttention()

    def forward(self, x: Tensor) -> Tensor:
        return self.att(torch.tanh(self.inp(x)))


class LinearAttention(nn.Module):
    """``(q kᵀ) v`` without a softmax on hidden features: a batched ``matmul``, whose output
    node is a view of its ``bmm`` (the products' operands are read behind it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 3)
        self.q, self.k, self.v, self.o = (nn.Linear(3, 3) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.o((self.q(h) @ self.k(h).transpose(1, 2)) @ self.v(h)).mean(1)


class BodyProduct(nn.Module):
    """A product of two values of the same parameters in the body of a module that uses a
    parameter of its own there (a position embedding, released to functional attribution): no
    rule covers that body. (Before, such a product was taken for part of a module call and not
    recorded: DiagHessian was wrong by up to 0.16, with no error.)"""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(3, 3), nn.Linear(3, 3)
        self.pos = nn.Parameter(torch.randn(1, 2, 3))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.embed(x)) + self.pos
        return self.head(((h @ h.transpose(1, 2)) @ h).mean(1))


class _CustomTanh(torch.autograd.Function):
    """A nonlinearity as a custom autograd.Function (Bloom's ``GeLUFunction`` is one): the
    forward mode does not see inside it. (Before: DiagHessian 80 % off, no error.)"""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g * (1 - torch.tanh(x) ** 2)


class CustomAct(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _CustomTanh.apply(x)


CASES = {
    "local_response_norm": (
        lambda: nn.Sequential(
            nn.Conv1d(3, 4, 1), nn.LocalResponseNorm(2), nn.Flatten(), nn.Linear(8, 3)
        ),
        (4, 3, 2),
        "local_response_norm",
    ),
    "shared": (Shared, (4, 3), "several calls"),
    "custom_function": (
        lambda: nn.Sequential(nn.Linear(3, 4), CustomAct(), nn.Linear(4, 3)), (4, 3),
        "custom autograd.Function",
    ),
    "generic": (lambda: nn.Sequential(nn.Linear(3, 3), OwnParam()), (4, 3), "nonlinearly"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refuses_non_elementwise_nonlinearities(case: str):
    torch.manual_seed(8)
    make, shape, what = CASES[case]
    X, y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))
    model, lf = extend(make()), extend(nn.CrossEntropyLoss())
    for ext in (DiagHessian(), BatchDiagHessian()):
        with pytest.raises(NonlinearityError, match=what) as info, collect(ext):
            lf(model(X), y).backward()
        assert "HutchinsonDiagHessian" in str(info.value)
    # other extensions and plain backward passes are unaffected
    if case != "generic":
        with collect(DiagGGNExact()):
            lf(model(X), y).backward()
    lf(model(X), y).backward()


@pytest.mark.parametrize(
    "make, refusal",
    [(FunctionalParam, "several calls"), (lambda: Derived("exp"), "nonlinearly"),
     (lambda: Derived("twice"), None)],
    ids=["bias-sum", "exp", "twice"],
)
def test_parameter_only_op_broadcast_into_activations(make, refusal):
    """``x + self.a.bias.sum()``, ``x * exp(self.s)``, ``x + 2 * self.s``: a value computed
    from one parameter alone is rebuilt from it where it meets the samples, so every extension
    attributes it. DiagHessian is exact where the value is linear in the parameter and the
    parameter has no other use upstream, and refused clearly otherwise."""
    torch.manual_seed(8)
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    model, lf = extend(make().double()), extend(nn.CrossEntropyLoss())
    G = diag_ggn(model, lf, X, y)
    with collect(DiagGGNExact()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, G[k])
    model.zero_grad()
    if refusal is None:
        H = split(torch.diagonal(loss_hessian(model, lf, X, y)), model)
        with collect(DiagHessian()):
            lf(model(X), y).backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.diag_h, H[k])
    else:
        with pytest.raises(RuntimeError, match=refusal), collect(DiagHessian()):
            lf(model(X), y).backward()
        assert all(p.grad is None for p in model.parameters())


def test_forward_not_recorded_inside_a_context_without_diag_hessian():
    """A forward inside ``collect()`` without the DiagHessian family skips the nonlinearity
    recording; a later DiagHessian backward of that graph refuses instead of missing terms,
    while forwards outside any context or inside a DiagHessian context are exact."""
    from backprism.extensions import BatchL2Grad

    torch.manual_seed(3)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    lossfunc = extend(nn.MSELoss())
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    # (a context that sees no backward complains on exit; the graph stays usable)
    with pytest.raises(RuntimeError, match="no extended module"), collect(BatchL2Grad()):
        loss = lossfunc(model(X), y)
    with pytest.raises(RuntimeError, match="not recorded"), collect(DiagHessian()):
        loss.backward()
    model.zero_grad()
    H = torch.diagonal(loss_hessian(model, lossfunc, X, y))
    for inside in (False, True):
        loss = None if inside else lossfunc(model(X), y)  # forward outside any context
        with collect(DiagHessian()):
            (loss if loss is not None else lossfunc(model(X), y)).backward()
        got = torch.cat([p.diag_h.flatten() for p in model.parameters()])
        torch.testing.assert_close(got, H, rtol=1e-8, atol=1e-10)


class _TanhBlock(nn.Module):
    """A block whose nonlinearity is functional (``torch.tanh``) or a module (``nn.Tanh``)."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.act = (lambda z: torch.tanh(z)) if functional else nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.act(self.a(x)))


class _Wrapper(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.block = _TanhBlock(functional)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)


def _dense_diag_h(model: nn.Module, lossfunc: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    return torch.diagonal(loss_hessian(model, lossfunc, X, y))


@pytest.mark.parametrize("functional", [True, False])
def test_sub_module_called_on_its_own(functional: bool):
    """A sub-module of an extended model called by hand runs without the recording mode. A
    functional nonlinearity in it has no residual site: refused before anything is written
    (it used to miss the residual term silently). An activation module records its own site,
    and the diagonal is exact."""
    torch.manual_seed(3)
    model, lf = extend(_Wrapper(functional)), extend(nn.MSELoss())
    X, y = torch.randn(5, 3), torch.randn(5, 2)
    if functional:
        match = r"'tanh'.*sub-module called on its own"
        with pytest.raises(NonlinearityError, match=match), collect(DiagHessian()):
            lf(model.block(X), y).backward()
        assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())
        return
    with collect(DiagHessian()):
        lf(model.block(X), y).backward()
    ours = torch.cat([p.diag_h.flatten() for p in model.parameters()])
    torch.testing.assert_close(ours, _dense_diag_h(model, lf, X, y))


def test_nonlinearity_between_two_extended_models_refused():
    """``m2(torch.tanh(m1(X)))``: the tanh lies outside both recorded forwards."""
    torch.manual_seed(4)
    m1, m2 = extend(nn.Linear(3, 4)), extend(nn.Linear(4, 2))
    lf = extend(nn.MSELoss())
    X, y = torch.randn(5, 3), torch.randn(5, 2)
    with pytest.raises(NonlinearityError, match="'tanh'"), collect(DiagHessian()):
        lf(m2(torch.tanh(m1(X))), y).backward()
    assert all(p.grad is None for p in [*m1.parameters(), *m2.parameters()])
    # linear glue between the models is fine, and exact
    with collect(DiagHessian()):
        lf(m2(2.0 * m1(X)[:, [1, 0, 2, 3]]), y).backward()
    ours = torch.cat([p.diag_h.flatten() for p in [*m1.parameters(), *m2.parameters()]])

    class Glued(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m1, self.m2 = m1, m2

        def forward(self, x: Tensor) -> Tensor:
            return self.m2(2.0 * self.m1(x)[:, [1, 0, 2, 3]])

    torch.testing.assert_close(ours, _dense_diag_h(Glued(), lf, X, y))


def test_nested_uses_refused_before_anything_is_written() -> None:
    """A LayerNorm applied twice in a chain under DiagHessian (with other extensions in the
    same pass): refused in the pass's check, so no extension's field appears and ``.grad``
    keeps what it held."""
    from backprism.extensions import BatchGrad, DiagGGNExact, DiagHessian

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.norm, self.out = nn.Linear(5, 5), nn.LayerNorm(5), nn.Linear(5, 3)

        def forward(self, x):
            return self.out(torch.tanh(self.norm(torch.tanh(self.norm(self.l1(x))))))

    torch.manual_seed(0)
    model = extend(Twice().double())
    lf = extend(nn.CrossEntropyLoss())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    X, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.raises(NonlinearityError, match="feeds another"), collect(
        DiagGGNExact(), BatchGrad(), DiagHessian()
    ):
        lf(model(X), y).backward()
    for p in model.parameters():
        assert torch.equal(p.grad, torch.ones_like(p))
        assert not any(hasattr(p, f) for f in ("diag_ggn_exact", "grad_batch", "diag_h"))


@pytest.mark.parametrize("model_cls", [Product, Towers])
@pytest.mark.parametrize("later", [False, True])
def test_products_of_disjoint_parameters(model_cls: type, later: bool) -> None:
    """Products whose operands depend on different parameters (``a(x) * b(x)``, two towers)
    add no term to any parameter's Hessian block: the
    DiagHessian equals the dense Hessian's diagonal, in the first forward and in a ``later``
    one outside collect, after a DiagHessian pass (without the mode where only activation
    modules need records, with it where a functional tanh does)."""
    torch.manual_seed(3)
    model = model_cls()
    lf = nn.CrossEntropyLoss()
    X, y = torch.randn(5, 3), torch.randint(0, 3, (5,))
    H = _dense_diag_h(model, lf, X, y)
    extend(model), extend(lf)
    if later:
        with collect(DiagHessian()):
            lf(model(X), y).backward()
        for _ in range(2):
            model.zero_grad()
            lf(model(X), y).backward()  # (outside collect)
        loss = lf(model(X), y)
        assert (MODE_FREE[model][True] is None) == (model_cls is Towers)
        with collect(DiagHessian()):
            loss.backward()
    else:
        with collect(DiagHessian()):
            lf(model(X), y).backward()
    got = torch.cat([p.diag_h.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, H)


