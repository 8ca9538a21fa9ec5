"""First-order invariants over every model family in the suite, from ONE backward pass with
``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared`` and ``Variance`` together:

* ``Σₙ grad_batch[n] = .grad``;
* ``batch_l2 = ‖grad_batch[n]‖²`` per parameter;
* ``sum_grad_squared = Σₙ grad_batch[n]²``;
* ``variance`` = biased variance of ``grad_batch`` over the batch;

and ``grad_batch`` against the dense float64 per-sample reference (``∂L/∂θₙ`` with one
parameter copy per sample: ``reference.per_sample_grads`` via ``vmap``, or
``reference.per_sample_grads_loop`` for modules ``vmap`` cannot run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from tests.common import Encoder, ResNetBlock, Siamese, TiedDecoder, TinyGPT
from tests.reference import per_sample_grads, per_sample_grads_loop

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")
DT = torch.float64
N = 3
TOL = {"rtol": 1e-7, "atol": 1e-10}
VOCAB, T = 5, 4


# ----------------------------------------------------------------------------------------- families
class CNNPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 2)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        z = nn.functional.max_pool2d(self.conv1(x).relu(), 2)  # [N, 3, 3, 3]
        z = nn.functional.avg_pool2d(torch.tanh(self.conv2(z)), 2)  # [N, 4, 1, 1]
        return self.head(z.flatten(1))


class RNNClassifier(nn.Module):
    def __init__(self, kind: type, f: int = 3, h: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.rnn = kind(f, h, batch_first=True)
        self.head = nn.Linear(h, classes)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class BagClassifier(nn.Module):
    def __init__(self, vocab: int = 7, d: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, d, mode="mean")
        self.head = nn.Linear(d, classes)

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(torch.tanh(self.bag(idx)))


class EmbeddingClassifier(nn.Module):
    def __init__(self, vocab: int = 7, d: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, classes)

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(idx)).mean(1))


def _randomize(model: nn.Module) -> nn.Module:
    """Norm affine parameters away from their (1, 0) initialisation."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm2d)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def _labels(shape: tuple[int, ...], c: int, seed: int = 0) -> Tensor:
    return torch.randint(0, c, shape, generator=torch.Generator().manual_seed(seed))


def _flat_loss(lossfunc: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """Reference loss for ``[N·T, V]`` logits: the per-sample forward stacks ``[N, T, V]``."""
    return lambda o, y: lossfunc(o.reshape(-1, VOCAB), y)


# name: (model, X, y, reference kind, reference loss transform)
Family = tuple[Callable[[], nn.Module], Callable[[], Any], Callable[[], Tensor], str, Any]
FAMILIES: dict[str, Family] = {
    "mlp": (
        lambda: nn.Sequential(
            nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)
        ),
        lambda: torch.randn(N, 4, dtype=DT), lambda: _labels((N,), 3), "vmap", None,
    ),
    "cnn_pool": (
        CNNPool, lambda: torch.randn(N, 2, 6, 6, dtype=DT), lambda: _labels((N,), 3), "vmap",
        None,
    ),
    "resnet_block_eval": (
        lambda: ResNetBlock().eval(), lambda: torch.randn(N, 2, 4, 4, dtype=DT),
        lambda: _labels((N,), 3), "vmap", None,
    ),
    "siamese": (
        Siamese, lambda: torch.randn(N, 6, dtype=DT), lambda: _labels((N,), 2), "vmap", None
    ),
    "tiny_gpt": (
        TinyGPT, lambda: _labels((N, T), VOCAB, 1), lambda: _labels((N, T), VOCAB, 2), "vmap",
        None,
    ),
    "tiny_gpt_flat": (
        lambda: TinyGPT(flat=True), lambda: _labels((N, T), VOCAB, 1),
        lambda: _labels((N * T,), VOCAB, 2), "vmap", _flat_loss,
    ),
    "transformer_encoder": (
        lambda: Encoder().eval(), lambda: torch.randn(N, 3, 4, dtype=DT),
        lambda: _labels((N,), 3), "vmap", None,
    ),
    "lstm": (
        lambda: RNNClassifier(nn.LSTM), lambda: torch.randn(N, 3, 3, dtype=DT),
        lambda: _labels((N,), 3), "loop", None,
    ),
    "gru": (
        lambda: RNNClassifier(nn.GRU), lambda: torch.randn(N, 3, 3, dtype=DT),
        lambda: _labels((N,), 3), "loop", None,
    ),
    "embedding_bag": (
        BagClassifier, lambda: _labels((N, 4), 7, 3), lambda: _labels((N,), 3), "loop", None,
    ),
    "embedding": (
        EmbeddingClassifier, lambda: _labels((N, 4), 7, 3), lambda: _labels((N,), 3), "vmap",
        None,
    ),
    "conv_transpose": (
        lambda: nn.Sequential(
            nn.ConvTranspose1d(2, 3, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(27, 3)
        ),
        lambda: torch.randn(N, 2, 4, dtype=DT), lambda: _labels((N,), 3), "vmap", None,
    ),
    "groupnorm": (
        lambda: _randomize(nn.Sequential(
            nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)
        )),
        lambda: torch.randn(N, 2, 4, 4, dtype=DT), lambda: _labels((N,), 3), "vmap", None,
    ),
    "instancenorm": (
        lambda: _randomize(nn.Sequential(
            nn.Conv2d(2, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.ReLU(), nn.Flatten(),
            nn.Linear(16, 3),
        )),
        lambda: torch.randn(N, 2, 4, 4, dtype=DT), lambda: _labels((N,), 3), "vmap", None,
    ),
    "layernorm": (
        lambda: _randomize(nn.Sequential(
            nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)
        )),
        lambda: torch.randn(N, 4, dtype=DT), lambda: _labels((N,), 3), "vmap", None,
    ),
    "tied_decoder": (
        TiedDecoder, lambda: _labels((N, 3), VOCAB, 1), lambda: _labels((N, 3), VOCAB, 2),
        "vmap", None,
    ),
}


def _build(name: str) -> tuple[nn.Module, nn.Module, Any, Tensor]:
    torch.manual_seed(0)
    make, make_x, make_y, _, _ = FAMILIES[name]
    return extend(make().to(DT)), extend(nn.CrossEntropyLoss()), make_x(), make_y()


def _run(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss = lossfunc(model(X), y)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        loss.backward()


def _close(actual: Tensor, expected: Tensor, label: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{label}: {m}")


# -------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(FAMILIES))
def test_invariants(name: str) -> None:
    model, lossfunc, X, y = _build(name)
    _run(model, lossfunc, X, y)
    n = (X[0] if isinstance(X, tuple) else X).shape[0]
    for k, p in model.named_parameters():
        gb = p.grad_batch
        assert gb.shape == (n, *p.shape), f"{k}.grad_batch shape {tuple(gb.shape)}"
        _close(gb.sum(0), p.grad, f"{k}: Σₙ grad_batch vs .grad")
        _close(p.batch_l2, gb.flatten(1).square().sum(1), f"{k}: batch_l2 vs ‖grad_batch‖²")
        _close(p.sum_grad_squared, gb.square().sum(0), f"{k}: sum_grad_squared vs Σ grad_batch²")
        _close(p.variance, gb.var(0, unbiased=False), f"{k}: variance vs var(grad_batch)")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_grad_batch_reference(name: str) -> None:
    model, lossfunc, X, y = _build(name)
    _, _, _, kind, transform = FAMILIES[name]
    ref_loss = transform(lossfunc) if transform is not None else lossfunc
    ref_fn = per_sample_grads if kind == "vmap" else per_sample_grads_loop
    ref = ref_fn(model, ref_loss, X, y)
    _run(model, lossfunc, X, y)
    assert set(ref) == {k for k, _ in model.named_parameters()}
    for k, p in model.named_parameters():
        _close(p.grad_batch, ref[k], f"{k}.grad_batch")
        _close(p.grad, ref[k].sum(0), f"{k}.grad")
