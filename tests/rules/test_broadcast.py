"""Modules and parameters called once for the whole batch and broadcast over the samples
(position embeddings of ``position_ids`` ``[1, T]``, class tokens ``expand``-ed over the batch,
learned position tables added to activations): per-sample results against dense float64
``torch.func`` references."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, SumGradSquared, Variance
from tests.common import assert_first_order
from tests.reference import diag_ggn, per_sample_grads

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}


class PositionIds(nn.Module):
    """GPT-2/BERT style: ``wpe(arange(T)[None])`` is a batch-1 call broadcast in the add."""

    def __init__(self, vocab: int = 7, t: int = 4, d: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(t, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)  # [1, T]
        h = self.wte(idx) + self.wpe(pos)
        return self.head(torch.tanh(self.ln(h))).mean(1)


class ClassToken(nn.Module):
    """ViT style: a ``[1, 1, d]`` class token expanded over the batch, a ``[1, T + 1, d]``
    position table added, the class token's output classified."""

    def __init__(self, patch: int = 4, t: int = 3, d: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(patch, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, t + 1, d))
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        z = self.proj(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        z = torch.cat([cls, z], dim=1) + self.pos
        z = z + self.mlp(z)
        return self.head(z[:, 0])


def _problem(name: str):
    torch.manual_seed(0)
    n = 5
    if name == "position_ids":
        model = PositionIds().to(DT)
        X = torch.randint(0, 7, (n, 4))
    else:
        model = ClassToken().to(DT)
        X = torch.randn(n, 3, 4, dtype=DT)
    y = torch.randint(0, 3, (n,))
    return model, X, y


@pytest.mark.parametrize("name", ["position_ids", "class_token"])
def test_first_order_matches_reference(name: str):
    model, X, y = _problem(name)
    lf = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lf, X, y)
    extend(model), extend(lf)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lf(model(X), y).backward()
    assert_first_order(model, ref, **TOL)


@pytest.mark.parametrize("name", ["position_ids", "class_token"])
def test_diag_ggn_matches_reference(name: str):
    model, X, y = _problem(name)
    lf = nn.CrossEntropyLoss()
    ref = diag_ggn(model, lf, X, y)
    extend(model), extend(lf)
    with collect(DiagGGNExact()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], **TOL)


def test_batch_one_output_mixed_across_samples_is_refused():
    """A batch-1 module output used in a product that mixes it into every sample
    non-elementwise has no per-sample decomposition: a clear error naming the operation,
    nothing written."""

    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.key = nn.Linear(3, 3)
            self.head = nn.Linear(3, 2)

        def forward(self, x: Tensor) -> Tensor:
            k = self.key(torch.ones(1, 3, dtype=x.dtype))  # [1, 3]
            return self.head(x @ k.t() @ k)

    torch.manual_seed(1)
    model, lf = extend(Mix().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    with pytest.raises(RuntimeError, match=r"shared by all of them.*'matmul'"), collect(
        BatchL2Grad()
    ):
        lf(model(X), y).backward()
    assert all(p.grad is None and not hasattr(p, "batch_l2") for p in model.parameters())
