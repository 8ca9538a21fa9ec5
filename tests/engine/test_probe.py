"""Custom ``autograd.Function`` s and ``torch.compile`` regions, probed through their backward
(:mod:`backprism.engine.probe`).

The batch-axis analysis cannot read a custom function; its backward shows whether one sample's
output gradient reaches other samples' inputs. A sample-wise function (also with non-tensor
arguments, several outputs, or the samples moved to another axis) gives per-sample results
equal to a loop over the samples; one that mixes them is refused before anything is written;
one the probe cannot read (no output axis of the batch size) is named in a warning, as before.
``torch.compile`` turns the code between the hooked layers into such functions: first-order
results and the GGN diagonal through compiled regions match the references, and a batch
statistic inside a compiled region is refused. The probe leaves the user's random state alone.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine import UncheckedOperationWarning
from backprism.engine.probe import _sample_sets
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, SumGradSquared, Variance
from tests.common import assert_first_order, assert_nothing_written
from tests.reference import per_sample_grads_loop

DT = torch.float64
TOL = {"atol": 1e-10, "rtol": 1e-8}
N, T, D, C = 5, 3, 4, 3


class _ScaledSwap(torch.autograd.Function):
    """``(s·hᵀ⁽⁰¹⁾, Σ_dim h)`` with non-tensor arguments, two outputs and the samples of the
    first output on axis 1: sample-wise."""

    @staticmethod
    def forward(ctx, h: Tensor, scale: float, dim: int) -> tuple[Tensor, Tensor]:
        ctx.scale, ctx.dim, ctx.shape = scale, dim, h.shape
        return h.transpose(0, 1) * scale, h.sum(dim)

    @staticmethod
    def backward(ctx, ga: Tensor, gs: Tensor) -> tuple[Tensor, None, None]:
        g = ga.transpose(0, 1) * ctx.scale + gs.unsqueeze(ctx.dim).expand(ctx.shape)
        return g, None, None


class _Shuffle(torch.autograd.Function):
    """Swaps samples 1 and 2 (a mixing that only some pairs of samples show)."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        idx = torch.arange(h.shape[0])
        idx[[1, 2]] = idx[[2, 1]]
        ctx.idx = idx
        return h[idx]

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g[ctx.idx.argsort()]


class _Flat(torch.autograd.Function):
    """Flattens the batch with the features: no output axis of the batch size to probe."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        ctx.shape = h.shape
        return h.reshape(-1) * 2

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g.reshape(ctx.shape) * 2


class Net(nn.Module):
    """Linear layers on ``[N, T, D]`` around ``between``."""

    def __init__(self, between) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, C)
        self.between = between

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.between(self.l1(x)))).mean(1)


def _swap(h: Tensor) -> Tensor:
    a, s = _ScaledSwap.apply(h, 0.5, 2)
    return a.transpose(0, 1) + s.unsqueeze(-1)


def _flat(h: Tensor) -> Tensor:
    return _Flat.apply(h).view(h.shape)


def _data() -> tuple[Tensor, Tensor]:
    torch.manual_seed(0)
    return torch.randn(N, T, D, dtype=DT), torch.randint(0, C, (N,))


def test_sample_sets_separate_every_pair() -> None:
    for n in range(2, 20):
        sets = [set(s) for s in _sample_sets(n)]
        assert len(sets) <= 2 * max(1, (n - 1).bit_length())
        for i in range(n):
            for j in range(n):
                assert i == j or any(i in s and j not in s for s in sets), (n, i, j)


def test_sample_wise_function_is_probed_not_warned() -> None:
    """Non-tensor arguments, two outputs, the samples on axis 1 of one of them: no warning,
    first-order statistics against a loop over the samples, the random state untouched."""
    x, y = _data()
    model = Net(_swap).to(DT)
    lossfunc = nn.CrossEntropyLoss()
    ref = per_sample_grads_loop(model, lossfunc, x, y)
    extend(model)
    state = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedOperationWarning)
        with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
            lossfunc(model(x), y).backward()
    assert torch.equal(torch.get_rng_state(), state)
    assert_first_order(model, ref, **TOL)


def test_function_probed_once_for_varying_lengths() -> None:
    """Batches of another length (dynamic padding) reuse the probe's verdict: the function's
    backward runs in the real backward only."""
    calls = []

    class Counted(_ScaledSwap):
        @staticmethod
        def backward(ctx, ga: Tensor, gs: Tensor) -> tuple[Tensor, None, None]:
            calls.append(1)
            return _ScaledSwap.backward(ctx, ga, gs)

    def swap(h: Tensor) -> Tensor:
        a, s = Counted.apply(h, 0.5, 2)
        return a.transpose(0, 1) + s.unsqueeze(-1)

    model = extend(Net(swap).to(DT))
    lossfunc = nn.CrossEntropyLoss()
    for t in (3, 5, 7):
        x, y = torch.randn(N, t, D, dtype=DT), torch.randint(0, C, (N,))
        calls.clear()
        with collect(BatchGrad()):
            lossfunc(model(x), y).backward()
        # (two outputs, each probed with the 2⌈log₂ 5⌉ = 6 sample sets; then none)
        assert len(calls) == (1 + 2 * 6 if t == 3 else 1)


def test_function_mixing_some_samples_is_refused() -> None:
    """Swapping two samples mixes them (probes of all sample sets find it); nothing written."""
    x, y = _data()
    model = extend(Net(_Shuffle.apply).to(DT))
    refused = pytest.raises(RuntimeError, match=r"_Shuffle \(probed through its backward")
    with refused, collect(BatchGrad()):
        nn.CrossEntropyLoss()(model(x), y).backward()
    assert_nothing_written(model, grad_too=True)


class _Centre(torch.autograd.Function):
    """Subtracts the mean along ``dim``: sample-wise along the features, mixing along the
    samples; the same function, so the probe's cache must tell the settings apart."""

    @staticmethod
    def forward(ctx, h: Tensor, dim: int) -> Tensor:
        ctx.dim = dim
        return h - h.mean(dim, keepdim=True)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        return g - g.mean(ctx.dim, keepdim=True), None


def test_function_probed_per_setting() -> None:
    x, y = _data()
    lossfunc = nn.CrossEntropyLoss()
    model = Net(lambda h: _Centre.apply(h, 2)).to(DT)
    ref = per_sample_grads_loop(model, lossfunc, x, y)
    extend(model)
    with collect(BatchGrad()):
        lossfunc(model(x), y).backward()
    torch.testing.assert_close(model.l1.weight.grad_batch, ref["l1.weight"], **TOL)
    model = extend(Net(lambda h: _Centre.apply(h, 0)).to(DT))
    with pytest.raises(RuntimeError, match="_Centre"), collect(BatchGrad()):
        lossfunc(model(x), y).backward()


def test_function_the_probe_cannot_read_is_named() -> None:
    x, y = _data()
    model = extend(Net(_flat).to(DT))
    with pytest.warns(UncheckedOperationWarning, match="_Flat"), collect(BatchGrad()):
        nn.CrossEntropyLoss()(model(x), y).backward()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)
        self.gamma = nn.Parameter(torch.rand(D))

    def forward(self, h: Tensor) -> Tensor:
        return h + self.gamma * torch.tanh(self.fc(self.norm(h)))


class _Residual(nn.Module):
    def __init__(self, centre: bool = False) -> None:
        super().__init__()
        self.inp, self.b1, self.b2, self.out = nn.Linear(D, D), _Block(), _Block(), nn.Linear(D, C)
        self.centre = centre

    def forward(self, x: Tensor) -> Tensor:
        h = self.b2(self.b1(self.inp(x)))
        if self.centre:
            h = h - h.mean(0, keepdim=True)
        return self.out(h).mean(1)


def _ggn_diag(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``Σₙ Jₙᵀ Hₙ Jₙ`` diagonal from ``torch.func`` (mean cross-entropy)."""
    from torch.func import functional_call, jacrev

    params = {k: v.detach() for k, v in model.named_parameters()}
    out = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(x.shape[0]):

        def f(ps, i=i):
            return functional_call(model, ps, (x[i : i + 1],))[0]

        jac, z = jacrev(f)(params), f(params).detach()
        p = z.softmax(-1)
        hess = (torch.diag(p) - torch.outer(p, p)) / x.shape[0]
        for k, v in params.items():
            j = jac[k].reshape(z.shape[0], -1)
            out[k] += torch.einsum("cp,cd,dp->p", j, hess, j).reshape(v.shape)
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")  # (dynamo's recompilation notes)
def test_torch_compile_regions() -> None:
    """``torch.compile`` (AOTAutograd, no C++ compiler needed): per-sample gradients, their
    statistics and the GGN diagonal through the compiled regions between the hooked layers
    against loop and ``torch.func`` references, also on the second step (compiled code
    reused); a batch mean inside a compiled region is refused with nothing written."""
    x, y = _data()
    model = _Residual().to(DT)
    lossfunc = nn.CrossEntropyLoss()
    ref = per_sample_grads_loop(model, lossfunc, x, y)
    ggn = _ggn_diag(model, x, y)
    extend(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    loss = extend(nn.CrossEntropyLoss())
    for _ in range(2):
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UncheckedOperationWarning)
            with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact()):
                loss(compiled(x), y).backward()
        assert_first_order(model, ref, **TOL)
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.diag_ggn_exact, ggn[k], **TOL)
    centred = extend(_Residual(centre=True).to(DT))
    compiled = torch.compile(centred, backend="aot_eager")
    with pytest.raises(RuntimeError, match="mixes the samples"), collect(BatchGrad()):
        loss(compiled(x), y).backward()
    assert_nothing_written(centred, grad_too=True)


class _Tanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.filterwarnings("ignore::UserWarning")  # (dynamo's recompilation notes)
def test_torch_compile_does_not_freeze_the_hooks() -> None:
    """The hooks read the active ``collect`` on every call: a compiled model first run inside
    a collect that records no nonlinearities, then inside one with ``DiagHessian`` (which
    needs them), gets the exact Hessian diagonal; ``HutchinsonDiagHessian`` (a second
    backward, which compiled regions lack) is refused with the way out."""
    from torch.func import functional_call, hessian

    from backprism.extensions import DiagHessian, HutchinsonDiagHessian

    torch.manual_seed(0)
    x, y = torch.randn(N, D, dtype=DT), torch.randint(0, C, (N,))
    model = _Tanh().to(DT)
    params = {k: v.detach() for k, v in model.named_parameters()}
    lossfunc = nn.CrossEntropyLoss()
    want = {}
    for k, v in params.items():

        def f(w, k=k):
            return lossfunc(functional_call(model, {**params, k: w}, (x,)), y)

        want[k] = torch.diagonal(hessian(f)(v).reshape(v.numel(), v.numel())).reshape(v.shape)
    extend(model)
    torch._dynamo.reset()  # (no recompilation limit reached by earlier tests: compiled here)
    compiled = torch.compile(model, backend="aot_eager")
    loss = extend(nn.CrossEntropyLoss())
    with collect(BatchGrad()):
        loss(compiled(x), y).backward()
    with collect(DiagHessian()):
        loss(compiled(x), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, want[k], **TOL)
    with pytest.raises(RuntimeError, match=r"_orig_mod"), collect(HutchinsonDiagHessian()):
        loss(compiled(x), y).backward()
