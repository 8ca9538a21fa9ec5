"""Test utilities shared by several test files: small models and result gathering.

Nothing here computes a reference; references live in :mod:`reference`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from backprism import collect


class TinyGPT(nn.Module):
    """Token + position embeddings, one pre-norm block (causal attention, GELU MLP), final
    LayerNorm, output projection tied to the token embedding.

    Logits ``[N, V, T]`` (CrossEntropyLoss's layout) or, with ``flat=True``, ``[N·T, V]``.
    Positions carry a batch axis (``arange(T).expand(N, T)``) so the position embedding's call
    is per-sample too.
    """

    def __init__(
        self, vocab: int = 5, d: int = 4, heads: int = 2, t_max: int = 4, flat: bool = False
    ) -> None:
        super().__init__()
        self.flat = flat
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(t_max, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        n, t = idx.shape
        pos = torch.arange(t, device=idx.device).expand(n, t)
        z = self.tok(idx) + self.pos(pos)
        h = self.ln1(z)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), 1)
        z = z + self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        z = z + self.mlp(self.ln2(z))
        logits = self.head(self.ln_f(z))  # [N, T, V]
        return logits.flatten(0, 1) if self.flat else logits.transpose(1, 2)


class ResNetBlock(nn.Module):
    """Conv-BN-ReLU-Conv-BN plus a 1×1 conv skip, ``out_act`` (ReLU or Tanh), global average
    pool, linear head; BatchNorm (use it in eval mode) with non-trivial running statistics."""

    def __init__(
        self, cin: int = 2, c: int = 3, classes: int = 3, out_act: str = "relu"
    ) -> None:
        super().__init__()
        self.out_act = out_act
        self.conv1 = nn.Conv2d(cin, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.skip = nn.Conv2d(cin, c, 1)
        self.head = nn.Linear(c, classes)
        with torch.no_grad():
            for bn in (self.bn1, self.bn2):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        z = self.bn1(self.conv1(x)).relu()
        z = self.bn2(self.conv2(z)) + self.skip(x)
        z = z.tanh() if self.out_act == "tanh" else z.relu()
        return self.head(z.mean((2, 3)))


class Siamese(nn.Module):
    """One Linear used by two parallel branches (not nested), ``tanh`` and ``second`` on
    them, concatenated into a linear head."""

    def __init__(self, second: Any = torch.sigmoid) -> None:
        super().__init__()
        self.second = second
        self.lin, self.head = nn.Linear(3, 3), nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        a, b = torch.tanh(self.lin(x[:, :3])), self.second(self.lin(x[:, 3:]))
        return self.head(torch.cat([a, b], 1))


class TiedDecoder(nn.Module):
    """Token embedding, a Linear+tanh block, and the embedding reused *functionally* as the
    output layer: ``logits = h @ emb.weight.T`` inside the forward (no module call for the
    second use). Input ``[N, T]`` token ids, logits ``[N, V, T]``."""

    def __init__(self, vocab: int = 5, d: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lin = nn.Linear(d, d)

    def forward(self, idx: Tensor) -> Tensor:
        h = torch.tanh(self.lin(self.emb(idx)))  # [N, T, d]
        return (h @ self.emb.weight.T).transpose(1, 2)  # [N, V, T]


def first_order_expected(gb: Tensor) -> dict[str, Tensor]:
    """What each first-order extension stores, from per-sample gradients ``gb = [N, *p]``."""
    f = gb.flatten(1)
    return {
        "grad_batch": gb,
        "batch_l2": f.square().sum(1),
        "sum_grad_squared": gb.square().sum(0),
        "variance": gb.var(0, unbiased=False),
        "batch_dot": f @ f.t(),
    }


FIRST_ORDER_FIELDS = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")


def assert_first_order(model: nn.Module, ref: dict[str, Tensor], **tol: Any) -> None:
    """Every trainable parameter's first-order fields (BatchGrad, BatchL2Grad, SumGradSquared,
    Variance of one backward pass) equal those of the reference per-sample gradients
    ``ref[name] = [N, *p]``, and ``Σₙ grad_batch = .grad``; a parameter without a gradient
    has none (shared parameters are checked once, under their first name)."""
    seen: set[int] = set()
    for k, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if p.grad is None:
            assert not hasattr(p, "grad_batch") or not p.grad_batch.any(), k
            continue
        expected = first_order_expected(ref[k])
        for field in FIRST_ORDER_FIELDS:
            torch.testing.assert_close(getattr(p, field), expected[field], **tol)
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, **tol)


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(k, p) for k, p in model.named_parameters() if p.requires_grad]


def gather(model: nn.Module, attr: str, lead: int) -> Tensor:
    """Concatenate ``param.<attr>`` over trainable parameters, keeping ``lead`` leading axes."""
    parts = []
    for _, p in trainable(model):
        v = getattr(p, attr)
        parts.append(v.reshape(*v.shape[:lead], -1))
    return torch.cat(parts, -1)


def backward(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor, *exts, **kw) -> None:
    """One forward and a backward pass inside ``collect(*exts, **kw)``."""
    xs = X if isinstance(X, tuple) else (X,)
    loss = lossfunc(model(*xs), y)
    with collect(*exts, **kw):
        loss.backward()


def assert_mc_within(value: Tensor, draws: Tensor, ref: Tensor, n_se: float = 6.0) -> None:
    """``value`` is the mean of i.i.d. ``draws`` (dim 0) and within ``n_se`` standard errors
    of ``ref``."""
    se = draws.std(0) / math.sqrt(draws.shape[0])
    torch.testing.assert_close(value, draws.mean(0), atol=1e-10, rtol=1e-8)
    err = (value - ref).abs()
    bad = err > n_se * se + 1e-10
    assert not bad.any(), f"MC off by {err[bad]} (se {se[bad]})"
