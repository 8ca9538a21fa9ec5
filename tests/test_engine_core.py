"""Engine behaviour the rewrite must have: graphs that are not a plain nest of module calls,
several forwards per backward, state that must not survive a pass or leak across models and
threads, gaps between the extended loss and the model, checks that must run before anything
is written, and in-place operations on captured outputs.

References are dense float64 from the definitions (``tests/reference.py``: ``torch.func``
per-sample gradients with one parameter copy per sample, ``Jᵀ H J`` GGNs, autograd Hessians),
never another backprism path. Where the brief accepts "the right number or a clear error", a
clear error is a ``RuntimeError``/``ValueError``/``NotImplementedError`` whose message names the
problem, and after it no parameter carries a (possibly partial) result.
"""

from __future__ import annotations

import gc
import re
import threading
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from backprism import collect, extend
from backprism.extensions import (
    KFLR,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SumGradSquared,
    Variance,
)
from common import TiedDecoder, first_order_expected

from reference import (
    diag_ggn,
    ggn,
    loss_hessian,
    param_blocks,
    per_sample_grads,
    per_sample_grads_multi,
    split,
)

DT = torch.float64
TOL = {"rtol": 1e-7, "atol": 1e-10}
FIRST = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)
ATTRS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance", "diag_ggn_exact", "diag_h",
         "kflr")
CLEAR = (RuntimeError, ValueError, NotImplementedError)


# --------------------------------------------------------------------------- helpers
def _labels(shape: tuple[int, ...], c: int, seed: int = 0) -> Tensor:
    return torch.randint(0, c, shape, generator=torch.Generator().manual_seed(seed))


def _mlp(d_in: int = 4, h: int = 5, c: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, h), nn.Tanh(), nn.Linear(h, c))


def _params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(k, p) for k, p in model.named_parameters() if p.requires_grad]


def _close(actual: Tensor, expected: Tensor, label: str, **tol: float) -> None:
    """``assert_close`` (float64 tolerances unless given) whose message keeps torch's own
    (greatest absolute/relative difference) after ``label``."""
    torch.testing.assert_close(actual, expected, **(tol or TOL), msg=lambda m: f"{label}: {m}")


def _check_first_order(model: nn.Module, ref: dict[str, Tensor]) -> None:
    """Every first-order attribute equals the reference, plus the invariants between them
    and ``.grad``."""
    for name, p in _params(model):
        gb = p.grad_batch
        for field, value in first_order_expected(ref[name]).items():
            if field == "batch_dot":
                continue
            _close(getattr(p, field), value, f"{name}.{field}")
        _close(gb.sum(0), p.grad, f"{name}: Σ grad_batch ≠ grad")
        _close(p.batch_l2, gb.flatten(1).square().sum(1), name)
        _close(p.variance, gb.var(0, unbiased=False), name)
        _close(p.grad, ref[name].sum(0), f"{name}.grad")


def _check_diag(model: nn.Module, attr: str, ref: dict[str, Tensor]) -> None:
    for name, p in _params(model):
        _close(getattr(p, attr), ref[name], f"{name}.{attr}")


def _assert_nothing_written(model: nn.Module, grad_too: bool = False) -> None:
    for name, p in model.named_parameters():
        for attr in ATTRS:
            assert getattr(p, attr, None) is None, f"{name}.{attr} written despite the error"
        if grad_too:
            assert p.grad is None, f"{name}.grad written despite the error"


def _clear_error_or_raise(err: Exception, pattern: str) -> None:
    """``err`` is acceptable only if its message matches ``pattern`` (names the problem)."""
    if not isinstance(err, CLEAR) or not re.search(pattern, str(err), re.IGNORECASE):
        raise AssertionError(f"unclear error (wanted /{pattern}/): {err!r}") from err


# ----------------------------------------------------- 1. parameters used outside their module
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


N1 = 4
OUTSIDE: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor], Callable[[], Tensor]]] = {
    "tied_decoder": (
        TiedDecoder, lambda: _labels((N1, 3), 5, 1), lambda: _labels((N1, 3), 5, 2)
    ),
    "f_linear_container": (
        LinearContainer, lambda: torch.randn(N1, 4, dtype=DT), lambda: _labels((N1,), 3)
    ),
    "hand_norm": (HandNorm, lambda: torch.randn(N1, 4, dtype=DT), lambda: _labels((N1,), 3)),
    "functional_call_child": (
        FunctionalCallChild, lambda: torch.randn(N1, 4, dtype=DT), lambda: _labels((N1,), 3)
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
    _check_first_order(model, ref)


@pytest.mark.parametrize("name", list(OUTSIDE))
def test_param_outside_module_diag_ggn(name: str) -> None:
    model, lf, X, y = _build_outside(name)
    ref = diag_ggn(model, lf, X, y)
    with collect(DiagGGNExact()):
        lf(model(X), y).backward()
    _check_diag(model, "diag_ggn_exact", ref)


# ------------------------------------------------------------- 2. two forwards, one backward
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
    model, lf = extend(_mlp().to(DT)), extend(nn.CrossEntropyLoss())
    data = (
        torch.randn(n1, 4, dtype=DT), _labels((n1,), 3, 4),
        torch.randn(n2, 4, dtype=DT), _labels((n2,), 3, 5),
    )
    return model, lf, data


@pytest.mark.parametrize("order", ["outputs_first", "alternating"])
def test_two_forwards_first_order(order: str) -> None:
    model, lf, data = _two_batches()
    X1, y1, X2, y2 = data
    ref = per_sample_grads_multi(model, lambda o1, o2: lf(o1, y1) + lf(o2, y2), [X1, X2])
    model.zero_grad(set_to_none=True)
    loss = _two_forward_loss(model, lf, data, order)
    with collect(*(e() for e in FIRST)):
        loss.backward()
    _check_first_order(model, ref)


@pytest.mark.parametrize("order", ["outputs_first", "alternating"])
def test_two_forwards_diag_ggn(order: str) -> None:
    model, lf, data = _two_batches()
    X1, y1, X2, y2 = data
    d1, d2 = diag_ggn(model, lf, X1, y1), diag_ggn(model, lf, X2, y2)
    loss = _two_forward_loss(model, lf, data, order)
    with collect(DiagGGNExact()):
        loss.backward()
    _check_diag(model, "diag_ggn_exact", {k: d1[k] + d2[k] for k in d1})


@pytest.mark.parametrize("order", ["outputs_first", "alternating"])
def test_two_forwards_different_batch_sizes_error(order: str) -> None:
    model, lf, data = _two_batches(6, 4)
    model.zero_grad(set_to_none=True)
    loss = _two_forward_loss(model, lf, data, order)
    sizes = r"(?s)\b6\b.*\b4\b|\b4\b.*\b6\b"
    with pytest.raises((RuntimeError, ValueError), match=sizes), collect(BatchL2Grad()):
        loss.backward()
    _assert_nothing_written(model, grad_too=True)
    # and the model stays usable
    X1, y1 = data[0], data[1]
    with collect(BatchL2Grad()):
        lf(model(X1), y1).backward()
    assert model[0].weight.batch_l2.shape == (6,)


# ------------------------------------------------------------------------ 3. stale results
class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 5)
        self.head1 = nn.Linear(5, 3)
        self.head2 = nn.Linear(5, 3)
        self.use_second = True

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head1(h) + self.head2(h) if self.use_second else self.head1(h)


@pytest.mark.parametrize("ext", [DiagGGNExact, BatchGrad], ids=["diag_ggn_exact", "grad_batch"])
def test_no_stale_results(ext: type) -> None:
    torch.manual_seed(4)
    model, lf = extend(TwoHeads().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 4, dtype=DT), _labels((5,), 3)
    attr = "diag_ggn_exact" if ext is DiagGGNExact else "grad_batch"
    with collect(ext()):
        lf(model(X), y).backward()
    assert all(hasattr(p, attr) for p in model.parameters())
    model.zero_grad(set_to_none=True)
    model.use_second = False
    X2, y2 = torch.randn(3, 4, dtype=DT), _labels((3,), 3, 1)
    if ext is DiagGGNExact:
        ref = diag_ggn(model, lf, X2, y2)
    else:
        ref = per_sample_grads(model, lf, X2, y2)
    with collect(ext()):
        lf(model(X2), y2).backward()
    for name, p in model.head2.named_parameters():
        assert getattr(p, attr, None) is None, f"stale head2.{name}.{attr} from the first pass"
    for name, p in _params(model):
        if not name.startswith("head2"):
            _close(getattr(p, attr), ref[name], name)


# ------------------------------------------------------------------------ 4. state isolation
def test_dropped_models_are_freed() -> None:
    models, losses = [], []
    for i in range(40):
        torch.manual_seed(i)
        model, lf = extend(_mlp().to(DT)), extend(nn.CrossEntropyLoss())
        X, y = torch.randn(3, 4, dtype=DT), _labels((3,), 3, i)
        with collect(BatchGrad()):
            lf(model(X), y).backward()
        models.append(weakref.ref(model))
        losses.append(weakref.ref(lf))
        del model, lf, X, y
    gc.collect()
    alive = sum(r() is not None for r in models)
    assert alive == 0, f"{alive} of 40 extended models still alive after gc.collect()"
    alive = sum(r() is not None for r in losses)
    assert alive == 0, f"{alive} of 40 extended loss modules still alive after gc.collect()"


def test_stray_forward_of_other_model() -> None:
    torch.manual_seed(5)
    a, b = extend(_mlp().to(DT)), extend(_mlp().to(DT))
    lf = extend(nn.CrossEntropyLoss())
    stray = a(torch.randn(7, 4, dtype=DT))  # grad enabled, never backpropagated, kept alive
    Xb, yb = torch.randn(5, 4, dtype=DT), _labels((5,), 3)
    ref = per_sample_grads(b, lf, Xb, yb)
    with collect(BatchGrad(), BatchL2Grad()):
        lf(b(Xb), yb).backward()
    for name, p in _params(b):
        expected = first_order_expected(ref[name])
        _close(p.grad_batch, expected["grad_batch"], name)
        _close(p.batch_l2, expected["batch_l2"], name)
    for p in a.parameters():
        assert getattr(p, "grad_batch", None) is None
    assert stray.shape == (7, 3)


def test_two_threads_concurrently() -> None:
    steps, errors = 20, []
    barrier = threading.Barrier(3)
    setups = []
    for seed, n in ((6, 4), (7, 6)):
        torch.manual_seed(seed)
        model, lf = extend(_mlp().to(DT)), extend(nn.CrossEntropyLoss())
        data = [
            (torch.randn(n, 4, dtype=DT), _labels((n,), 3, 100 * seed + s)) for s in range(steps)
        ]
        refs = [per_sample_grads(model, lf, X, y) for X, y in data]
        setups.append((model, lf, data, refs))
    plain = nn.Sequential(nn.Linear(4, 3)).to(DT)  # third party: never extended
    Xp, yp = torch.randn(5, 4, dtype=DT), _labels((5,), 3)

    def extended_worker(model: nn.Module, lf: nn.Module, data: list, refs: list) -> None:
        try:
            for (X, y), ref in zip(data, refs):
                barrier.wait(timeout=60)
                model.zero_grad(set_to_none=True)
                loss = lf(model(X), y)
                with collect(BatchGrad(), Variance()):
                    barrier.wait(timeout=60)  # both contexts open at the same time
                    loss.backward()
                for name, p in _params(model):
                    _close(p.grad_batch, ref[name], name)
                    _close(p.variance, ref[name].var(0, unbiased=False), name)
        except BaseException as err:
            errors.append(err)
            barrier.abort()

    def plain_worker() -> None:
        try:
            for _ in range(steps):
                barrier.wait(timeout=60)
                plain.zero_grad(set_to_none=True)
                loss = F.cross_entropy(plain(Xp), yp)
                barrier.wait(timeout=60)  # backward while the others' contexts are open
                loss.backward()
        except BaseException as err:
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=extended_worker, args=s) for s in setups]
    threads.append(threading.Thread(target=plain_worker))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    assert not real and not errors, f"errors in threads: {real or errors!r}"
    for name, p in plain.named_parameters():
        assert not hasattr(p, "grad_batch"), f"third-party {name} got grad_batch"
        assert not hasattr(p, "variance"), f"third-party {name} got variance"


# --------------------------------------------------------------- 5. silent gaps at the loss
@pytest.mark.parametrize("ext", [BatchGrad, DiagGGNExact], ids=["BatchGrad", "DiagGGNExact"])
def test_only_loss_extended(ext: type) -> None:
    torch.manual_seed(8)
    model, lf = _mlp().to(DT), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 4, dtype=DT), _labels((4,), 3)
    with pytest.raises((RuntimeError, ValueError), match="extend"), collect(ext()):
        lf(model(X), y).backward()
    _assert_nothing_written(model)


def test_functional_penalty_on_outputs_second_order() -> None:
    torch.manual_seed(9)
    model, lf = extend(_mlp().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 4, dtype=DT), _labels((4,), 3)
    out = model(X)
    loss = lf(out, y) + 0.1 * out.pow(2).mean()
    with pytest.raises(CLEAR) as info, collect(DiagGGNExact()):
        loss.backward()
    _clear_error_or_raise(info.value, r"term|loss")
    _assert_nothing_written(model)


def test_nonlinearity_between_model_and_loss_diag_hessian() -> None:
    torch.manual_seed(10)
    model, lf = extend(_mlp().to(DT)), extend(nn.MSELoss())
    X, y = torch.randn(4, 4, dtype=DT), torch.randn(4, 3, dtype=DT)
    ref = split(torch.diagonal(loss_hessian(model, lambda o, t: lf(torch.tanh(o), t), X, y)), model)
    try:
        with collect(DiagHessian()):
            lf(torch.tanh(model(X)), y).backward()
    except CLEAR as err:
        _clear_error_or_raise(err, r"tanh|loss|between|extend|output")
        _assert_nothing_written(model)
        return
    _check_diag(model, "diag_h", ref)


# ------------------------------------------------------------ 6. checks before writing
@pytest.mark.parametrize("ext", [BatchGrad, DiagGGNExact], ids=["BatchGrad", "DiagGGNExact"])
def test_batchnorm_train_mode_writes_nothing(ext: type) -> None:
    torch.manual_seed(11)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(DT))
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=DT), _labels((5,), 2)
    model.zero_grad(set_to_none=True)
    bn = r"(?i)eval\(\)|batchnorm"
    with pytest.raises((RuntimeError, ValueError), match=bn), collect(ext()):
        lf(model(X), y).backward()
    _assert_nothing_written(model, grad_too=True)


@pytest.mark.parametrize("ext", [BatchGrad, DiagGGNExact], ids=["BatchGrad", "DiagGGNExact"])
def test_empty_batch(ext: type) -> None:
    torch.manual_seed(12)
    model, lf = extend(_mlp().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(0, 4, dtype=DT), torch.zeros(0, dtype=torch.long)
    model.zero_grad(set_to_none=True)
    with pytest.raises((RuntimeError, ValueError)) as info, collect(ext()):
        lf(model(X), y).backward()
    _clear_error_or_raise(info.value, r"empty|no samples|zero samples|\bN\s*=\s*0|batch size 0")
    _assert_nothing_written(model, grad_too=True)


def test_autocast_bfloat16_forward() -> None:
    torch.manual_seed(13)
    model = extend(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)))  # float32
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(8, 6), _labels((8,), 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lf(model(X), y)
    try:
        with collect(BatchGrad(), Variance(), DiagGGNExact()):
            loss.backward()
    except CLEAR as err:
        _clear_error_or_raise(err, r"autocast")
        return
    for name, p in model.named_parameters():
        for attr in ("grad_batch", "variance", "diag_ggn_exact"):
            v = getattr(p, attr)
            assert v.dtype == p.dtype, f"{name}.{attr} is {v.dtype}, parameter {p.dtype}"
            assert torch.isfinite(v).all(), f"{name}.{attr} not finite"
        _close(p.grad_batch.sum(0), p.grad, name, rtol=2e-2, atol=1e-3)
        _close(p.variance, p.grad_batch.var(0, unbiased=False), name, rtol=2e-2, atol=1e-5)
        assert (p.diag_ggn_exact >= -1e-6).all(), name


# -------------------------------------------------- 7. in-place operations on captured outputs
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


@pytest.mark.parametrize("ext_name", list(INPLACE_EXTS))
@pytest.mark.parametrize("name", list(INPLACE))
def test_inplace_after_captured_output(name: str, ext_name: str) -> None:
    torch.manual_seed(14)
    make, layer_inputs = INPLACE[name]
    model, lf = extend(make().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(6, 5, dtype=DT), _labels((6,), 3)
    with torch.no_grad():
        inputs = layer_inputs(model, X)
    ref_g = per_sample_grads(model, lf, X, y)
    G = ggn(model, lf, X, y)
    try:
        with collect(INPLACE_EXTS[ext_name]()):
            lf(model(X), y).backward()
    except CLEAR as err:
        _clear_error_or_raise(err, r"in[- ]?place")
        _assert_nothing_written(model)
        return
    params = dict(_params(model))
    if ext_name == "BatchGrad":
        for k, p in params.items():
            _close(p.grad_batch, ref_g[k], k)
    elif ext_name == "BatchL2Grad":
        for k, p in params.items():
            _close(p.batch_l2, ref_g[k].flatten(1).square().sum(1), k)
    elif ext_name == "DiagGGNExact":
        _check_diag(model, "diag_ggn_exact", split(torch.diagonal(G), model))
    else:
        blocks, n = param_blocks(model, G), X.shape[0]
        for layer, h in inputs.items():
            B = blocks[f"{layer}.bias"]  # the layer's output GGN (KFLR's B)
            w, b = params[f"{layer}.weight"], params[f"{layer}.bias"]
            _close(b.kflr[0], B, f"{layer}.bias B")
            _close(w.kflr[0], B, f"{layer}.weight B")
            _close(w.kflr[1], h.t() @ h / n, f"{layer}.weight A")


# ------------------------------------------------- the loss's factor from an explicit gradient
@pytest.mark.parametrize("entry", ["backward", "autograd_backward", "autograd_grad"])
def test_explicit_seed_scales_curvature(entry: str) -> None:
    """``loss.backward(gradient=c)`` (and the autograd entry points with a seed) makes the loss
    enter the objective with factor ``c``: the GGN diagonal is ``c`` times the reference. (The
    implicit seed is known to be 1 without reading it; an explicit one is read.)"""
    torch.manual_seed(5)
    model, lf = extend(_mlp().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(6, 4, dtype=DT), _labels((6,), 3, 6)
    ref = {k: 2.5 * v for k, v in diag_ggn(model, lf, X, y).items()}
    seed = torch.tensor(2.5, dtype=DT)
    with collect(DiagGGNExact()):
        loss = lf(model(X), y)
        if entry == "backward":
            loss.backward(seed)
        elif entry == "autograd_backward":
            torch.autograd.backward(loss, grad_tensors=seed)
        else:
            torch.autograd.grad(loss, list(model.parameters()), grad_outputs=seed)
    _check_diag(model, "diag_ggn_exact", ref)
