"""Forward recording (``backprism.engine.forward``, the ``Call`` records of
``backprism.engine.state``): a parameter used by several calls, several forwards before one
backward (same and different batch sizes), a forward for evaluation between the recorded forward
and the loss, forwards under autocast, and in-place operations on the inputs and outputs the
forward captured.

References are dense float64 from the definitions (``tests/reference.py``: ``torch.func``
per-sample gradients with one parameter copy per sample, ``Jᵀ H J`` GGNs); where "the right
number or a clear error" is accepted, a clear error is a ``RuntimeError``/``ValueError``/
``NotImplementedError`` whose message names the problem, and after it no parameter carries a
(possibly partial) result.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import (
    KFLR,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SumGradSquared,
    Variance,
)
from tests.common import (
    CLEAR_ERRORS,
    assert_close_labelled,
    assert_nothing_written,
    check_diag_attr,
    check_first_order_fields,
    check_first_order_vs_vmap,
    clear_error_or_raise,
    seeded_labels,
    small_mlp,
    trainable,
)
from tests.reference import (
    diag_ggn,
    ggn,
    param_blocks,
    per_sample_grads,
    per_sample_grads_multi,
    split,
)

DT = torch.float64
FIRST = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)


def test_weight_shared_across_calls():
    torch.manual_seed(2)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.out = nn.Linear(3, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))

    model = extend(Twice()).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=torch.double), torch.randint(0, 2, (5,))
    check_first_order_vs_vmap(model, lossfunc, X, y)


def _two_forward_loss(model: nn.Module, lf: nn.Module, data: tuple, order: str) -> Tensor:
    X1, y1, X2, y2 = data
    if order == "outputs_first":
        out1, out2 = model(X1), model(X2)
        return lf(out1, y1) + lf(out2, y2)
    l1 = lf(model(X1), y1)
    l2 = lf(model(X2), y2)
    return l1 + l2


def _two_batches(n1: int = 5, n2: int = 5) -> tuple[nn.Module, nn.Module, tuple]:
    torch.manual_seed(3)
    model, lf = extend(small_mlp().to(DT)), extend(nn.CrossEntropyLoss())
    data = (
        torch.randn(n1, 4, dtype=DT), seeded_labels((n1,), 3, 4),
        torch.randn(n2, 4, dtype=DT), seeded_labels((n2,), 3, 5),
    )
    return model, lf, data


class _ScaledAttention(nn.Module):
    """A module with a parameter of its own around an attention layer (whose ``out_proj`` is
    never called: the attention call claims it)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0] * self.gamma


def test_enclosing_call_claims_nothing_of_a_finished_subtree() -> None:
    """A parameter-owning module around ``MultiheadAttention`` claimed ``out_proj`` too (a
    descendant that never ran), so its per-sample gradients were counted twice; now the
    finished attention call's whole subtree is its own."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(_ScaledAttention(), nn.Flatten(), nn.Linear(12, 3)).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic rule for the enclosing module
        check_first_order_vs_vmap(model, lossfunc, x, torch.randint(0, 3, (5,)))


@pytest.mark.parametrize("order", ["outputs_first", "alternating"])
def test_two_forwards_first_order(order: str) -> None:
    model, lf, data = _two_batches()
    X1, y1, X2, y2 = data
    ref = per_sample_grads_multi(model, lambda o1, o2: lf(o1, y1) + lf(o2, y2), [X1, X2])
    model.zero_grad(set_to_none=True)
    loss = _two_forward_loss(model, lf, data, order)
    with collect(*(e() for e in FIRST)):
        loss.backward()
    check_first_order_fields(model, ref)


@pytest.mark.parametrize("order", ["outputs_first", "alternating"])
def test_two_forwards_diag_ggn(order: str) -> None:
    model, lf, data = _two_batches()
    X1, y1, X2, y2 = data
    d1, d2 = diag_ggn(model, lf, X1, y1), diag_ggn(model, lf, X2, y2)
    loss = _two_forward_loss(model, lf, data, order)
    with collect(DiagGGNExact()):
        loss.backward()
    check_diag_attr(model, "diag_ggn_exact", {k: d1[k] + d2[k] for k in d1})


@pytest.mark.parametrize("order", ["outputs_first", "alternating"])
def test_two_forwards_different_batch_sizes_error(order: str) -> None:
    model, lf, data = _two_batches(6, 4)
    model.zero_grad(set_to_none=True)
    loss = _two_forward_loss(model, lf, data, order)
    sizes = r"(?s)\b6\b.*\b4\b|\b4\b.*\b6\b"
    with pytest.raises((RuntimeError, ValueError), match=sizes), collect(BatchL2Grad()):
        loss.backward()
    assert_nothing_written(model, grad_too=True)
    # and the model stays usable
    X1, y1 = data[0], data[1]
    with collect(BatchL2Grad()):
        lf(model(X1), y1).backward()
    assert model[0].weight.batch_l2.shape == (6,)


def test_evaluation_forward_between_forward_and_loss_keeps_second_order():
    from backprism.extensions import DiagGGNExact
    from tests.reference import ggn, split

    torch.manual_seed(6)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=torch.double), torch.randint(0, 2, (5,))
    out = model(X)
    with torch.no_grad():
        model(torch.randn(7, 3, dtype=torch.double))  # e.g. a validation batch
    with collect(DiagGGNExact()):
        lossfunc(out, y).backward()
    diag = split(torch.diagonal(ggn(model, lossfunc, X, y)), model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diag[name])


def test_in_place_input_modification_detected():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            h = x * 1.0
            out = self.lin(h)
            h.mul_(2.0)
            return out

    model = extend(Bad())
    X = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="in place"), collect(BatchGrad()):
        model(X).square().mean().backward()


def test_autocast_bfloat16_forward() -> None:
    torch.manual_seed(13)
    model = extend(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)))  # float32
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(8, 6), seeded_labels((8,), 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lf(model(X), y)
    try:
        with collect(BatchGrad(), Variance(), DiagGGNExact()):
            loss.backward()
    except CLEAR_ERRORS as err:
        clear_error_or_raise(err, r"autocast")
        return
    for name, p in model.named_parameters():
        for attr in ("grad_batch", "variance", "diag_ggn_exact"):
            v = getattr(p, attr)
            assert v.dtype == p.dtype, f"{name}.{attr} is {v.dtype}, parameter {p.dtype}"
            assert torch.isfinite(v).all(), f"{name}.{attr} not finite"
        assert_close_labelled(p.grad_batch.sum(0), p.grad, name, rtol=2e-2, atol=1e-3)
        assert_close_labelled(
            p.variance, p.grad_batch.var(0, unbiased=False), name, rtol=2e-2, atol=1e-5
        )
        assert (p.diag_ggn_exact >= -1e-6).all(), name


class InplaceResidual(nn.Module):
    """``z = lin1(x); z += lin2(tanh(z))``: a module output changed in place afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 4)
        self.lin2 = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        z = self.lin1(x)
        z += self.lin2(torch.tanh(z))
        return self.out(z)


class InplaceMask(nn.Module):
    """``out = lin(h); out.masked_fill_(mask, 0.)`` with a per-sample mask."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 4)
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        out = self.lin(torch.tanh(self.inp(x)))
        out.masked_fill_(x[:, :3] > 0.3, 0.0)
        return out


def _relu_inputs(m: nn.Module, x: Tensor) -> dict[str, Tensor]:
    return {"0": x, "2": F.linear(x, m[0].weight, m[0].bias).relu()}


def _residual_inputs(m: nn.Module, x: Tensor) -> dict[str, Tensor]:
    z = F.linear(x, m.lin1.weight, m.lin1.bias)
    t = torch.tanh(z)
    return {"lin1": x, "lin2": t, "out": z + F.linear(t, m.lin2.weight, m.lin2.bias)}


def _mask_inputs(m: nn.Module, x: Tensor) -> dict[str, Tensor]:
    return {"inp": x, "lin": torch.tanh(F.linear(x, m.inp.weight, m.inp.bias))}


INPLACE: dict[str, tuple[Callable[[], nn.Module], Callable]] = {
    "relu_inplace": (
        lambda: nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)),
        _relu_inputs,
    ),
    "residual_iadd": (InplaceResidual, _residual_inputs),
    "masked_fill_": (InplaceMask, _mask_inputs),
}
INPLACE_EXTS = {
    "BatchGrad": BatchGrad, "BatchL2Grad": BatchL2Grad, "DiagGGNExact": DiagGGNExact,
    "KFLR": KFLR,
}


class ScaledInPlace(nn.Module):
    """A Linear's output on a 3-d input (a view of its 2-d product) scaled in place
    (Hugging Face's Longformer does so with its global queries)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        h /= 2.0
        return self.head(h.mean(1))


class ScaledAfterUse(ScaledInPlace):
    """The same, with a use of the output before the in-place operation."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        a = h.sum(1)  # a use of the output before the in-place operation
        h /= 2.0
        return self.head(h.mean(1) + a)


@pytest.mark.parametrize("make", [ScaledInPlace, ScaledAfterUse], ids=["alone", "after_a_use"])
def test_in_place_through_a_view_of_an_output(make: Callable[[], nn.Module]) -> None:
    """``h /= s`` on a Linear's 3-d output, a view of its 2-d product: autograd replaces the
    output's node (HF Longformer's global queries; refused as "used outside the forward"
    before), or, after another use of ``h``, lets part of the gradient bypass it (silently
    wrong before: per-sample gradients off by 0.17). The pass reads the call at the product's
    node, whose gradient is the output's: first order and the GGN diagonal against
    ``torch.func``."""
    torch.manual_seed(3)
    model, lf = extend(make().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(3, 4, 5, dtype=DT), seeded_labels((3,), 3)
    ref_g = per_sample_grads(model, lf, X, y)
    G = ggn(model, lf, X, y)
    with collect(BatchGrad(), BatchL2Grad(), Variance(), DiagGGNExact()):
        lf(model(X), y).backward()
    for k, p in trainable(model):
        assert_close_labelled(p.grad_batch, ref_g[k], k)
        assert_close_labelled(p.grad_batch.sum(0), p.grad, k)
        assert_close_labelled(p.batch_l2, ref_g[k].flatten(1).square().sum(1), k)
        assert_close_labelled(p.variance, ref_g[k].var(0, unbiased=False), k)
    check_diag_attr(model, "diag_ggn_exact", split(torch.diagonal(G), model))


class FirstHalf(nn.Module):
    """A module whose output is a slice (a view) of what it computes."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 5))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.weight.t())[:, :2]


class HalfScaledAfterUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.head = FirstHalf(), nn.Linear(2, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        a = h.sum(1, keepdim=True)
        h /= 2.0
        return self.head(h + a)


def test_other_views_written_in_place_after_a_use_are_refused() -> None:
    """An output that is a slice of the module's result, written in place after a use: the
    graph walk cannot read the call elsewhere, so the pass is refused before writing."""
    torch.manual_seed(0)
    model, lf = extend(HalfScaledAfterUse().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(3, 5, dtype=DT), seeded_labels((3,), 3)
    refused = pytest.raises(RuntimeError, match=r"is a view of another tensor.*h = h / s")
    with refused, warnings.catch_warnings(), collect(BatchGrad()):
        warnings.simplefilter("ignore")
        lf(model(X), y).backward()
    assert_nothing_written(model)


@pytest.mark.parametrize("ext_name", list(INPLACE_EXTS))
@pytest.mark.parametrize("name", list(INPLACE))
def test_inplace_after_captured_output(name: str, ext_name: str) -> None:
    torch.manual_seed(14)
    make, layer_inputs = INPLACE[name]
    model, lf = extend(make().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(6, 5, dtype=DT), seeded_labels((6,), 3)
    with torch.no_grad():
        inputs = layer_inputs(model, X)
    ref_g = per_sample_grads(model, lf, X, y)
    G = ggn(model, lf, X, y)
    try:
        with collect(INPLACE_EXTS[ext_name]()):
            lf(model(X), y).backward()
    except CLEAR_ERRORS as err:
        clear_error_or_raise(err, r"in[- ]?place")
        assert_nothing_written(model)
        return
    params = dict(trainable(model))
    if ext_name == "BatchGrad":
        for k, p in params.items():
            assert_close_labelled(p.grad_batch, ref_g[k], k)
    elif ext_name == "BatchL2Grad":
        for k, p in params.items():
            assert_close_labelled(p.batch_l2, ref_g[k].flatten(1).square().sum(1), k)
    elif ext_name == "DiagGGNExact":
        check_diag_attr(model, "diag_ggn_exact", split(torch.diagonal(G), model))
    else:
        blocks, n = param_blocks(model, G), X.shape[0]
        for layer, h in inputs.items():
            B = blocks[f"{layer}.bias"]  # the layer's output GGN (KFLR's B)
            w, b = params[f"{layer}.weight"], params[f"{layer}.bias"]
            assert_close_labelled(b.kflr[0], B, f"{layer}.bias B")
            assert_close_labelled(w.kflr[0], B, f"{layer}.weight B")
            assert_close_labelled(w.kflr[1], h.t() @ h / n, f"{layer}.weight A")


def test_torch_func_through_an_extended_attention_model() -> None:
    """``jacrev`` of ``functional_call`` on an extended model with ``nn.MultiheadAttention``
    (tensors without storage inside the transform) equals that of an unextended copy."""
    import copy

    from torch.func import functional_call, jacrev

    from backprism import extend

    torch.manual_seed(0)

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    plain = Attn().double()
    model = extend(copy.deepcopy(plain))
    X = torch.randn(3, 5, 4, dtype=torch.float64)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (X,)))(params)
    ref = jacrev(lambda p: functional_call(plain, p, (X,)))(params)
    for k in ref:
        torch.testing.assert_close(jac[k], ref[k])
