"""End-to-end first-order extensions on whole architectures against dense float64 references.

Every model mixes layers with registered rules (Linear, and Conv/Norm/Embedding where their rules
exist) with the generic ``torch.func`` rule (MultiheadAttention, LSTM, and every layer without a
rule) and with code the engine never sees (residual additions, pooling, functional ops). The
numbers are compared with ``reference.per_sample_grads`` (``∂L/∂θₙ`` with one parameter copy per
sample, ``vmap``-ped) or, for the LSTM, with the same definition evaluated by a loop over samples.

Also checked: ``.grad`` is exactly the plain backward's; ``extension_hook`` runs once per module
and may delete ``grad_batch``; weight sharing across calls and tied weights sum per-sample
gradients before squaring; frozen parameters get nothing; reduction ``"sum"``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad
from tests.common import ResNetBlock, TinyGPT, check_first_order
from tests.reference import per_sample_grads, per_sample_grads_loop

DT = torch.float64
N = 3


# -- architectures ---------------------------------------------------------------------------
class ResidualMLP(nn.Module):
    """``x ↦ x + W₂ tanh(W₁ x)`` twice between an input and an output layer."""

    def __init__(self, i: int = 3, h: int = 4, c: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(i, h)
        self.f1 = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h))
        self.f2 = nn.Sequential(nn.Linear(h, h), nn.Sigmoid(), nn.Linear(h, h, bias=False))
        self.out = nn.Linear(h, c)

    def forward(self, x: Tensor) -> Tensor:
        z = self.inp(x)
        z = z + self.f1(z)
        z = z + self.f2(z)
        return self.out(z)


class TransformerClassifier(nn.Module):
    """``nn.TransformerEncoderLayer(batch_first=True, dropout=0)``, mean-pooled, linear head."""

    def __init__(self, d: int = 4, heads: int = 2, classes: int = 3, norm_first: bool = False):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d, heads, dim_feedforward=6, dropout=0.0, batch_first=True, norm_first=norm_first
        )
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).mean(1))


class LSTMClassifier(nn.Module):
    def __init__(self, f: int = 3, h: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.lstm = nn.LSTM(f, h, num_layers=2, batch_first=True)
        self.head = nn.Linear(h, classes)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class SharedLinear(nn.Module):
    """The same Linear called twice (weight sharing across calls)."""

    def __init__(self, d: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lin(self.lin(x).tanh()))


class Gate(nn.Module):
    """Custom module (generic rule) with one trainable and one frozen parameter."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(d))
        self.b = nn.Parameter(torch.randn(d), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.a * x + self.b)


class PartlyFrozen(nn.Module):
    def __init__(self, d: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.first = nn.Linear(d, d)
        self.first.requires_grad_(False)
        self.gate = Gate(d)
        self.last = nn.Linear(d, classes)
        self.last.bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.last(self.gate(self.first(x)))


def _labels(shape: tuple[int, ...], c: int) -> Tensor:
    return torch.randint(0, c, shape, generator=torch.Generator().manual_seed(0))


Case = tuple[Callable[[], nn.Module], Callable[[], Tensor], Callable[[], Tensor], Callable]


def _vmap_ref(model: nn.Module, lossfunc: nn.Module, x: Tensor, y: Tensor) -> dict:
    return per_sample_grads(model, lossfunc, x, y)


CASES: dict[str, Case] = {
    "residual_mlp": (
        ResidualMLP, lambda: torch.randn(N, 3, dtype=DT), lambda: _labels((N,), 3), _vmap_ref
    ),
    "resnet_block": (
        lambda: ResNetBlock().eval(),
        lambda: torch.randn(N, 2, 4, 4, dtype=DT),
        lambda: _labels((N,), 3),
        _vmap_ref,
    ),
    "transformer": (
        TransformerClassifier, lambda: torch.randn(N, 3, 4, dtype=DT), lambda: _labels((N,), 3),
        _vmap_ref,
    ),
    "transformer_norm_first_eval": (
        lambda: TransformerClassifier(norm_first=True).eval(),
        lambda: torch.randn(N, 2, 4, dtype=DT),
        lambda: _labels((N,), 3),
        _vmap_ref,
    ),
    "gpt": (
        TinyGPT,
        lambda: _labels((N, 4), 5),
        lambda: torch.randint(0, 5, (N, 4), generator=torch.Generator().manual_seed(1)),
        _vmap_ref,
    ),
    "lstm": (
        LSTMClassifier, lambda: torch.randn(N, 3, 3, dtype=DT), lambda: _labels((N,), 3),
        per_sample_grads_loop,
    ),
    "shared_linear": (
        SharedLinear, lambda: torch.randn(N, 3, dtype=DT), lambda: _labels((N,), 2), _vmap_ref
    ),
    "frozen": (
        PartlyFrozen, lambda: torch.randn(N, 3, dtype=DT), lambda: _labels((N,), 3), _vmap_ref
    ),
}


def _build(name: str, reduction: str = "mean") -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    make, make_x, make_y, _ = CASES[name]
    model = extend(make().to(DT))
    return model, extend(nn.CrossEntropyLoss(reduction=reduction)), make_x(), make_y()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(CASES))
def test_first_order(name: str, reduction: str) -> None:
    model, lossfunc, x, y = _build(name, reduction)
    ref = CASES[name][3](model, lossfunc, x, y)
    if name == "gpt":
        assert "head.weight" not in ref  # tied: one parameter, gradients of both uses summed
    if name == "frozen":
        assert set(ref) == {"gate.a", "last.weight"}
    check_first_order(model, lossfunc, x, y, ref)


@pytest.mark.parametrize("name", list(CASES))
def test_grad_unchanged(name: str) -> None:
    """Hooks never change ``.grad``: identical to a plain backward without ``collect``."""
    model, lossfunc, x, y = _build(name)
    lossfunc(model(x), y).backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    with collect(BatchGrad(), BatchL2Grad()):
        lossfunc(model(x), y).backward()
    for k, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, plain[k], rtol=0, atol=0, msg=k)
        else:
            assert p.grad is None


@pytest.mark.parametrize(
    "name",
    ["residual_mlp", "transformer", "gpt", "lstm", "frozen"],
)
def test_extension_hook_once_per_module_and_frees(name: str) -> None:
    """``extension_hook`` runs once per parameter-owning module that got extensions; deleting
    ``grad_batch`` there frees it, and what the hook reduced it to is correct."""
    model, lossfunc, x, y = _build(name)
    ref = CASES[name][3](model, lossfunc, x, y)
    calls: Counter[str] = Counter()
    norms: dict[str, Tensor] = {}
    names = {id(m): k for k, m in model.named_modules()}
    params = {id(p): k for k, p in model.named_parameters()}

    def hook(module: nn.Module) -> None:
        calls[names[id(module)]] += 1
        for p in module.parameters():  # MHA: out_proj's parameters belong to its call
            if hasattr(p, "grad_batch"):
                norms[params[id(p)]] = p.grad_batch.flatten(1).norm(dim=1)
                del p.grad_batch

    with collect(BatchGrad(), extension_hook=hook):
        lossfunc(model(x), y).backward()
    owners = {
        names[id(m)]
        for m in model.modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
        and not names[id(m)].endswith("out_proj")  # never called: part of the attention call
    }
    assert set(calls) == owners and all(c == 1 for c in calls.values()), calls
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())
    assert set(norms) == set(ref)
    for k, r in ref.items():
        torch.testing.assert_close(norms[k], r.flatten(1).norm(dim=1), msg=k)
