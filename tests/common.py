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
