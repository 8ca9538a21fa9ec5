"""DiagHessian, BatchDiagHessian and HMP/PCHMP through products of two values that depend on the
same parameters (``backprism.engine.bilinear``): attention on hidden features, SwiGLU, a
hand-written RMSNorm, GPT-2's tanh-GELU, a squeeze-and-excitation gate, ``x * x``, an outer
product — and through fused attention (``backprism.engine.attention``: masks, causal, scale,
grouped-query heads), against the dense float64 Hessian of ``torch.func``
(``tests.reference``), in forwards with and without the recording mode; and the refusals
(products whose operands do not hold the samples on axis 0, attention dropout).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine.residual import NonlinearityError
from backprism.engine.state import MODE_FREE
from backprism.extensions.hessian import BatchDiagHessian, DiagHessian
from tests.engine.test_residual import (
    BodyProduct,
    HiddenAttention,
    LinearAttention,
    SharedProduct,
)
from tests.extensions.test_hessian import check_diag
from tests.extensions.test_matprod import check_hmp
from tests.reference import loss_hessian, split

pytestmark = pytest.mark.usefixtures("float64_default")


class Attention(nn.Module):
    """Multi-head causal self-attention written out (``[N, H, T, d]`` matmuls: batched ``bmm``
    on ``N·H`` rows), with ``einsum``, or with ``baddbmm`` adding a position bias."""

    def __init__(self, d: int = 4, heads: int = 2, how: str = "matmul") -> None:
        super().__init__()
        self.heads, self.how = heads, how
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        N, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(N, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if self.how == "einsum":
            s = torch.einsum("nhtd,nhsd->nhts", q, k) / math.sqrt(q.shape[-1])
        elif self.how == "baddbmm":  # Bloom's ALiBi: a position bias added by the product
            d, h = q.shape[-1], self.heads
            bias = torch.arange(T, dtype=q.dtype).repeat(N * h, 1, 1) * -0.1  # [N·H, 1, T]
            s = torch.baddbmm(
                bias, q.reshape(N * h, T, d), k.transpose(-2, -1).reshape(N * h, d, T),
                beta=1.0, alpha=1 / math.sqrt(d),
            ).view(N, h, T, T)
        else:
            s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        a = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        o = torch.einsum("nhts,nhsd->nhtd", a, v) if self.how == "einsum" else a @ v
        return self.out(o.transpose(1, 2).reshape(N, T, D))


class RMSNorm(nn.Module):
    """An RMSNorm written out, ``x * rsqrt(mean(x²) + ε)`` (a module of its own with a weight
    takes the generic rule, refused: its parameters' part is not known to be linear; Hugging
    Face's classes have a rule, tested below)."""

    def forward(self, x: Tensor) -> Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6)


def gelu_new(x: Tensor) -> Tensor:
    """GPT-2's tanh approximation, written as Hugging Face writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class Block(nn.Module):
    """A pre-norm transformer block with hand-written RMSNorm and a SwiGLU or tanh-GELU MLP."""

    def __init__(self, d: int = 4, mlp: str = "swiglu", how: str = "matmul") -> None:
        super().__init__()
        self.mlp = mlp
        self.n1, self.n2 = RMSNorm(), nn.LayerNorm(d)
        self.att = Attention(d, how=how)
        self.up, self.down = nn.Linear(d, 5), nn.Linear(5, d)
        self.gate = nn.Linear(d, 5) if mlp == "swiglu" else None

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.att(self.n1(x))
        h = self.n2(x)
        if self.mlp == "swiglu":
            h = F.silu(self.gate(h)) * self.up(h)
        else:
            h = gelu_new(self.up(h))
        return x + self.down(h)


class Decoder(nn.Module):
    """Linear embedding of the inputs → a block → mean over positions → head: every parameter
    of the block lies upstream of both operands of its products."""

    def __init__(self, mlp: str = "swiglu", how: str = "matmul") -> None:
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(3, 4), Block(4, mlp, how), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.embed(x)).mean(1))


class SqueezeExcite(nn.Module):
    """Conv → ``h * sigmoid(fc(pool(h)))`` (``[N, C, H, W] * [N, C, 1, 1]``) → head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Conv2d(3, 3, 1)
        self.head = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x))
        h = h * torch.sigmoid(self.fc(h.mean((2, 3), keepdim=True)))
        return self.head(h.flatten(1))


class Elementwise(nn.Module):
    """``h * h`` (one tensor, both operands) and an outer product ``[N, T, 1] * [N, 1, D]``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.c = nn.Linear(3, 4), nn.Linear(4, 3)
        self.b = nn.Linear(4, 2) if how == "outer" else None

    def forward(self, x: Tensor) -> Tensor:  # x [N, T, 3]
        h = torch.tanh(self.a(x))
        if self.how == "square":
            return self.c(h * h).mean(1)
        outer = self.b(h)[..., :1] * h.mean(1, keepdim=True)  # [N, T, 1] * [N, 1, 4]
        return self.c(outer).mean(1)


class SharedGate(nn.Module):
    """``h * g`` where ``g = a(c)`` of a constant ``[1, 3]`` input: both depend on ``a``; the
    call on one row is split per sample where it meets them (``engine.broadcast``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h * self.a(torch.ones(1, 3)))


class ScaledRmsNorm(nn.Module):
    """``weight · F.rms_norm(x)`` in a module of its own (generic rule): on the CPU ``rms_norm``
    reaches autograd as ``pow``, ``mean``, ``rsqrt`` and ``mul`` nodes, all inside the one
    row-wise term."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x, x.shape[-1:], eps=1e-6)


class FunctionalLayerNorm(nn.Module):
    """``F.layer_norm`` with the module's own weight and bias (generic rule)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w, self.b)


class FunctionalNorms(nn.Module):
    """Linear → :class:`ScaledRmsNorm` → tanh → :class:`FunctionalLayerNorm` → head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.rms, self.ln = nn.Linear(3, 4), ScaledRmsNorm(4), FunctionalLayerNorm(4)
        self.c = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.c(self.ln(torch.tanh(self.rms(self.a(x))))).mean(1)


class DividedLayerNorm(nn.Module):
    """DeBERTa (v1)'s LayerNorm: ``w · (x − μ) / sqrt(var + ε) + b``, a division by a
    parameter-dependent value computed from the numerator."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        c = x - x.mean(-1, keepdim=True)
        return self.weight * (c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)) + self.bias


class Divisions(nn.Module):
    """Divisions by parameter-dependent values: DeBERTa's LayerNorm (in a module with a
    generic rule), an embedding normalised by its length (a top-level ``h / ‖h‖``, with
    ``‖h‖ = sqrt(Σ h²)`` written out), a constant divided by ``1 + u²`` and ``u / v`` of two
    values with disjoint parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.ln, self.c = nn.Linear(3, 4), DividedLayerNorm(4), nn.Linear(4, 3)
        self.u, self.v = nn.Linear(4, 4), nn.Linear(3, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(torch.tanh(self.a(x)))
        h = h / torch.sqrt((h * h).sum(-1, keepdim=True))
        u = self.u(h)
        h = h + torch.full_like(u, 0.5) / (1 + u * u) + u / (2 + torch.sigmoid(self.v(x)))
        return self.c(h).mean(1)


class Reductions(nn.Module):
    """Smooth reductions of one axis between the parameters and the loss: a LayerNorm with
    ``var`` (``keepdim``), a CLIP-like ``h / h.norm(dim=-1, keepdim=True)``, ``vector_norm``
    and ``std`` without ``keepdim`` (put back by ``unsqueeze``), and ``logsumexp`` pooling over
    the positions (axis 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x [N, T, 3]
        h = torch.tanh(self.a(x))
        h = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True, unbiased=False)
                                                        + 1e-5)
        h = self.b(h)
        h = h / h.norm(dim=-1, keepdim=True)
        h = h * torch.linalg.vector_norm(self.b(h), dim=-1).unsqueeze(-1)
        h = h + h.std(-1).unsqueeze(-1)
        return self.c(torch.logsumexp(h, dim=1))


def _perturbed(model: nn.Module, seed: int) -> nn.Module:
    """``model`` away from its initialisation (norm weights 1, biases 0)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


MODELS = {
    "attention_swiglu_rmsnorm": (lambda: Decoder("swiglu"), (3, 4, 3)),
    "attention_einsum_gelu_tanh": (lambda: Decoder("gelu_new", "einsum"), (3, 4, 3)),
    "attention_baddbmm_alibi": (lambda: Decoder("swiglu", "baddbmm"), (3, 4, 3)),
    "squeeze_excite": (SqueezeExcite, (3, 2, 4, 4)),
    "square": (lambda: Elementwise("square"), (3, 2, 3)),
    "outer": (lambda: Elementwise("outer"), (3, 2, 3)),
    "gate_of_a_batch_of_one": (lambda: SharedGate(), (4, 3)),
    "functional_norms_in_a_module": (FunctionalNorms, (3, 2, 3)),
    "divisions": (Divisions, (3, 2, 3)),
    "reductions": (Reductions, (3, 2, 3)),
    # (refused before: tests/engine/test_residual.py)
    "single_head_attention": (HiddenAttention, (4, 2, 3)),
    "linear_attention": (LinearAttention, (4, 2, 3)),
    "position_embedding_product": (BodyProduct, (4, 2, 3)),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_products_of_shared_values(name: str, loss: str):
    """DiagHessian and BatchDiagHessian (and Σₙ of the latter) equal the dense Hessian's
    diagonal, per sample and summed."""
    make, shape = MODELS[name]
    model = _perturbed(make(), 31)
    X = torch.randn(*shape)
    y = torch.randint(0, 3, (shape[0],)) if loss == "ce" else torch.randn(shape[0], 3)
    check_diag(model, nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss(), X, y)


def test_hmp_and_pchmp_through_attention():
    """HMP's parameter blocks through attention, SwiGLU and RMSNorm against the dense
    Hessian; PCHMP's (the products' negative eigenvalues ``−σ`` clipped) are PSD."""
    model = _perturbed(Decoder("swiglu"), 32)
    check_hmp(model, nn.CrossEntropyLoss(), torch.randn(3, 4, 3), torch.randint(0, 3, (3,)))


class SharedQuotient(nn.Module):
    """``b(h) / (2 + c(h)²)`` with ``h = tanh(a(x))`` (a Tanh module): a division whose
    numerator and denominator share ``a``'s parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(3, 3) for _ in range(4))
        self.act = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.a(x))
        c = self.c(h)
        return self.d(self.b(h) / (2 + c * c))


@pytest.mark.parametrize("make", [SharedProduct, SharedQuotient], ids=["product", "quotient"])
def test_product_in_a_forward_without_the_mode(make: type[nn.Module]):
    """``b(h) * c(h)`` (or ``b(h) / (2 + c(h)²)``) with ``h = tanh(a(x))`` (a Tanh module):
    after the first forward the model runs without the recording mode, and the product (the
    division) is read off its autograd node alone; every forward, recorded or not, gives the
    exact diagonal."""
    torch.manual_seed(33)
    model = make()
    ref = copy.deepcopy(model)
    lf = nn.CrossEntropyLoss()
    extend(model)
    extend(lf)
    for step in range(3):
        X, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
        expected = torch.diagonal(loss_hessian(ref, lf, X, y))
        loss = lf(model(X), y)  # (outside collect: recorded, then without the mode)
        if step:
            assert MODE_FREE[model][True] is not None
        with collect(DiagHessian()):
            loss.backward()
        got = torch.cat([p.diag_h.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10)


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 3), t=st.integers(1, 4), heads=st.sampled_from([1, 2]),
    how=st.sampled_from(["matmul", "einsum"]), seed=st.integers(0, 2**16),
)
def test_attention_shapes_fuzzed(n: int, t: int, heads: int, how: str, seed: int):
    """Attention on hidden features over batch sizes, sequence lengths (including one
    position: rank-one score matrices) and head counts."""
    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.att = nn.Linear(2, 4), Attention(4, heads, how)
            self.head = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.att(torch.tanh(self.embed(x))).mean(1))

    X, y = torch.randn(n, t, 2), torch.randint(0, 2, (n,))
    check_diag(_perturbed(Net(), seed), nn.CrossEntropyLoss(), X, y)


class Transposed(nn.Module):
    """``hᵀ * hᵀ`` (``[3, N]``): the samples on axis 1 of the product, whose columns are built
    for samples on axis 0 only (refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x)).t()
        return self.b((h * h).t())


def test_product_with_samples_off_axis_0_refused():
    model, lf = extend(Transposed()), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    for ext in (DiagHessian(), BatchDiagHessian()):
        refused = pytest.raises(NonlinearityError, match=r"mul.*samples on their first axis")
        with refused as info, collect(ext):
            lf(model(X), y).backward()
        assert "HutchinsonDiagHessian" in str(info.value)
        assert all(not hasattr(p, "diag_h") for p in model.parameters())


# -- fused attention (F.scaled_dot_product_attention) ---------------------------------------------
class Fused(nn.Module):
    """Multi-head self-attention on hidden features through ``F.scaled_dot_product_attention``
    (one fused node), with its options."""

    def __init__(
        self, mask: Tensor | None = None, causal: bool = False, gqa: bool = False,
        scale: float | None = None, dropout: float = 0.0, mqa: bool = False,
    ) -> None:
        super().__init__()
        self.mask, self.causal, self.gqa = mask, causal, gqa
        self.scale, self.dropout = scale, dropout
        self.embed, self.q, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        # (grouped-query: one key/value head for two query heads; multi-query: one key/value
        # head broadcast over the query heads, without enable_gqa, as Falcon passes them)
        kv = 2 if gqa or mqa else 4
        self.k, self.v = nn.Linear(4, kv), nn.Linear(4, kv)

    def forward(self, x: Tensor) -> Tensor:
        N, T, _ = x.shape
        h = torch.tanh(self.embed(x))
        q = self.q(h).view(N, T, 2, 2).transpose(1, 2)
        k, v = (f(h).view(N, T, -1, 2).transpose(1, 2) for f in (self.k, self.v))
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, dropout_p=self.dropout, is_causal=self.causal,
            scale=self.scale, enable_gqa=self.gqa,
        )
        return self.head(o.transpose(1, 2).reshape(N, T, 4)).mean(1)


def _bool_mask(t: int) -> Tensor:
    mask = torch.rand(t, t, generator=torch.Generator().manual_seed(0)) > 0.4
    mask[:, 0] = True  # (every query sees a key)
    return mask


def _left_padded(n: int, t: int) -> Tensor:
    """A causal mask per sample with sample 1 left-padded by two positions: its first two
    queries see no key (PyTorch's kernels give them zero attention)."""
    mask = torch.ones(t, t, dtype=torch.bool).tril().expand(n, 1, t, t).clone()
    mask[1, :, :, :2] = False
    return mask


FUSED = {
    "plain": dict,
    "causal": lambda: {"causal": True},
    "float_mask": lambda: {"mask": torch.randn(4, 4)},
    "bool_mask": lambda: {"mask": _bool_mask(4)},
    "grouped_query_causal": lambda: {"gqa": True, "causal": True},
    "multi_query_broadcast": lambda: {"mqa": True},
    "left_padded_rows_without_keys": lambda: {"mask": _left_padded(3, 4)},
    "scale": lambda: {"scale": 0.7},
}


@pytest.mark.parametrize("option", list(FUSED))
def test_fused_attention(option: str):
    """DiagHessian and BatchDiagHessian through the fused kernel against the dense Hessian
    (computed through the math kernel: the fused one has no forward-mode derivative)."""
    _check_fused(_perturbed(Fused(**FUSED[option]()), 34), torch.randn(3, 4, 3))


def _check_fused(model: nn.Module, X: Tensor) -> None:
    """DiagHessian and BatchDiagHessian of ``model`` (fused attention inside) on ``X`` against
    the dense Hessian and its per-sample diagonals, computed through the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.extensions.test_hessian import per_sample_hessian_diags, run

    y = torch.randint(0, 3, (X.shape[0],))
    lf = nn.CrossEntropyLoss()
    ref = copy.deepcopy(model)
    with sdpa_kernel(SDPBackend.MATH):
        diag = torch.diagonal(loss_hessian(ref, lf, X, y))
        per_sample = per_sample_hessian_diags(ref, lf, X, y)
    run(model, copy.deepcopy(lf), X, y, DiagHessian(), BatchDiagHessian())
    got = torch.cat([p.diag_h.flatten() for p in model.parameters()])
    got_n = torch.cat([p.diag_h_batch.flatten(1) for p in model.parameters()], 1)
    torch.testing.assert_close(got, diag, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(got_n, per_sample, rtol=1e-8, atol=1e-12)


def test_hmp_through_fused_attention():
    """HMP's parameter blocks through the fused kernel against the dense Hessian."""
    model = _perturbed(Fused(causal=True), 35)
    X, y = torch.randn(3, 4, 3), torch.randint(0, 3, (3,))
    check_hmp(model, nn.CrossEntropyLoss(), X, y, pchmp=False)


def test_fused_attention_with_dropout_refused():
    """Attention dropout draws a random mask the pass cannot see: refused before anything is
    written, naming the way out."""
    model, lf = extend(Fused(dropout=0.5)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(3, 4, 3), torch.randint(0, 3, (3,))
    with pytest.raises(NonlinearityError, match=r"dropout.*eval mode"), collect(DiagHessian()):
        lf(model(X), y).backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())


class BiasedFused(Fused):
    """Fused attention with a relative position bias from a table of its own passed as the
    additive mask (Hugging Face's T5 and BEiT under SDPA): ``[1, H, T, T]`` as it is, plus a
    constant padding mask per sample (``padded``: ``[N, 1, 1, T]``, as T5 adds its attention
    mask), or expanded over the batch first (``expanded``)."""

    def __init__(self, kind: str = "shared") -> None:
        super().__init__()
        self.bias = nn.Embedding(7, 2)
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        n, t = x.shape[:2]
        idx = (torch.arange(t)[None] - torch.arange(t)[:, None]).clamp(-3, 3) + 3
        self.mask = self.bias(idx).permute(2, 0, 1)[None]  # [1, H, T, T]
        if self.kind == "padded":
            pad = torch.zeros(n, 1, 1, t, dtype=x.dtype)
            pad[1, ..., -1] = torch.finfo(x.dtype).min  # (sample 1 padded at its end)
            self.mask = self.mask + pad
        elif self.kind == "expanded":
            self.mask = self.mask.expand(n, -1, -1, -1)
        return super().forward(x)


@pytest.mark.parametrize("kind", ["shared", "padded", "expanded"])
def test_fused_attention_with_a_parameter_dependent_mask(kind: str):
    """An additive mask that depends on parameters (a relative position bias): the softmax's
    and ``P V``'s columns enter it as they enter ``Q Kᵀ``, so the bias table's diagonal and
    every other one match the dense Hessian (through the math kernel), per sample too. (Before:
    refused; before that, the table's diagonal 1–8 % off without an error.)"""
    model = _perturbed(BiasedFused(kind), 38)
    _check_fused(model, torch.randn(3, 4, 3))
    assert model.bias.weight.diag_h.abs().max() > 1e-4  # (the table's term is not zero)


class TableBias(nn.Module):
    """A relative position bias ``[1, H, T, T]`` read from a table of its own, called without
    tensor inputs (Hugging Face's ``SwinRelativePositionBias``)."""

    def __init__(self, t: int, heads: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * t - 1, heads))
        pos = torch.arange(t)
        self.register_buffer("index", pos[:, None] - pos[None, :] + t - 1)

    def forward(self) -> Tensor:
        return self.table[self.index].permute(2, 0, 1).unsqueeze(0)


class WindowedBiasedFused(nn.Module):
    """Hugging Face's Swin under SDPA: windows of ``T`` positions folded sample-major into the
    batch (``[N·W, H, T, E]``), a :class:`TableBias` as the fused attention's additive mask,
    with ``shifted`` first combined with a constant ``[N·W, 1, T, T]`` mask."""

    def __init__(self, w: int, t: int, shifted: bool) -> None:
        super().__init__()
        self.w, self.t = w, t
        self.embed, self.qkv, self.head = nn.Linear(3, 4), nn.Linear(4, 12), nn.Linear(4, 3)
        self.bias = TableBias(t, 2)
        shift = torch.zeros(w, 1, t, t)
        shift[1:, :, 0, 1:] = -1e4
        self.shift = shift if shifted else None

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        h = torch.tanh(self.embed(x)).reshape(n * self.w, self.t, 4)  # [N·W, T, 4]
        q, k, v = self.qkv(h).view(n * self.w, self.t, 3, 2, 2).permute(2, 0, 3, 1, 4)
        mask = self.bias()
        if self.shift is not None:
            mask = mask + self.shift.expand(n, -1, -1, -1, -1).reshape(-1, 1, self.t, self.t)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(o.transpose(1, 2).reshape(n, self.w * self.t, 4)).mean(1)


@pytest.mark.parametrize("shifted", [False, True])
def test_fused_attention_over_windows_with_a_bias_table_mask(shifted: bool):
    """Swin's windows under SDPA: the widened bias's rows are the windows' (the samples folded
    sample-major), so the mask takes columns like the queries: exact against the dense
    Hessian, per sample too."""
    _check_fused(_perturbed(WindowedBiasedFused(3, 2, shifted), 40), torch.randn(3, 6, 3))


def test_hmp_through_fused_attention_with_a_parameter_dependent_mask():
    """HMP's blocks through fused attention with a bias table as its mask."""
    model = _perturbed(BiasedFused("padded"), 39)
    X, y = torch.randn(3, 4, 3), torch.randint(0, 3, (3,))
    check_hmp(model, nn.CrossEntropyLoss(), X, y, pchmp=False)


class ConstantValues(nn.Module):
    """Fused attention whose values are the (constant) input itself: no column enters there."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.head = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        q, k = torch.tanh(self.q(x)), self.k(x)
        return self.head(F.scaled_dot_product_attention(q, k, x)).mean(1)


def test_fused_attention_with_a_constant_input():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _perturbed(ConstantValues(), 36)
    X, y = torch.randn(3, 4, 3), torch.randint(0, 3, (3,))
    with sdpa_kernel(SDPBackend.MATH):
        check_diag(model, nn.CrossEntropyLoss(), X, y)


@pytest.mark.parametrize("model_name", ["attention_swiglu_rmsnorm", "fused"])
def test_products_and_attention_in_bfloat16(model_name: str):
    """Products and fused attention in bfloat16: the singular value decompositions run in
    float32 (there are none in half precision); the results keep the parameters' dtype and
    follow float64's to bfloat16's precision."""
    from tests.extensions.test_hessian import run

    torch.manual_seed(37)
    model = Fused(causal=True) if model_name == "fused" else MODELS[model_name][0]()
    model = _perturbed(model, 37)
    X, y = torch.randn(6, 4, 3), torch.randint(0, 3, (6,))
    ref = copy.deepcopy(model)
    run(ref, nn.CrossEntropyLoss(), X, y, DiagHessian())
    low = copy.deepcopy(model).to(torch.bfloat16)
    run(low, nn.CrossEntropyLoss(), X.to(torch.bfloat16), y, DiagHessian())
    scale = max(float(q.diag_h.abs().max()) for q in ref.parameters())
    for (name, p), q in zip(low.named_parameters(), ref.parameters(), strict=True):
        assert p.diag_h.dtype == torch.bfloat16
        torch.testing.assert_close(
            p.diag_h.double(), q.diag_h, atol=0.1 * scale, rtol=0, msg=name
        )


@pytest.mark.parametrize("model_name", ["attention_swiglu_rmsnorm", "fused"])
def test_products_and_attention_under_autocast(model_name: str):
    """A float32 model run under CPU autocast to bfloat16 (its matmuls in bfloat16): DiagHessian
    through its products and attention follows the float32 model's to bfloat16's precision,
    in the parameters' dtype."""
    from tests.extensions.test_hessian import run

    torch.manual_seed(38)
    model = Fused(causal=True) if model_name == "fused" else MODELS[model_name][0]()
    model = _perturbed(model, 38).float()
    X, y = torch.randn(6, 4, 3, dtype=torch.float32), torch.randint(0, 3, (6,))
    ref = copy.deepcopy(model)
    run(ref, nn.CrossEntropyLoss(), X, y, DiagHessian())
    low = extend(copy.deepcopy(model))
    lf = extend(nn.CrossEntropyLoss())
    with collect(DiagHessian()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = low(X)
        lf(out.float(), y).backward()
    scale = max(float(q.diag_h.abs().max()) for q in ref.parameters())
    for (name, p), q in zip(low.named_parameters(), ref.parameters(), strict=True):
        assert p.diag_h.dtype == torch.float32
        torch.testing.assert_close(p.diag_h, q.diag_h, atol=0.1 * scale, rtol=0, msg=name)


@pytest.mark.parametrize("model_name", ["attention_swiglu_rmsnorm", "fused"])
def test_a_sample_with_a_nan_gradient(model_name: str):
    """A sample whose gradient is NaN (a NaN in its input) gets NaN per-sample results, as its
    gradient, and the others their exact ones — the products' SVDs and the rows' eigen-
    decompositions take NaN matrices as NaN factors instead of failing mid-backward."""
    from tests.extensions.test_hessian import per_sample_hessian_diags

    make = {"attention_swiglu_rmsnorm": MODELS["attention_swiglu_rmsnorm"][0],
            "fused": lambda: Fused(causal=True)}[model_name]
    model = _perturbed(make(), 37)
    X, y = torch.randn(3, 4, 3), torch.randint(0, 3, (3,))
    lf = nn.CrossEntropyLoss()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        per_sample = per_sample_hessian_diags(copy.deepcopy(model), lf, X, y)
    X[0, 1, 2] = float("nan")
    extend(model)
    with collect(BatchDiagHessian()):
        extend(copy.deepcopy(lf))(model(X), y).backward()
    got = torch.cat([p.diag_h_batch.flatten(1) for p in model.parameters()], 1)
    assert got[0].isnan().any()
    torch.testing.assert_close(got[1:], per_sample[1:], rtol=1e-8, atol=1e-12)


class TorchEncoder(nn.Module):
    """PyTorch's own attention layers: ``nn.MultiheadAttention`` (its packed projection taken
    apart sequence-first, then the fused kernel) and ``nn.TransformerEncoderLayer``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed, self.head = nn.Linear(3, 4), nn.Linear(4, 3)
        if kind == "encoder_layer":
            self.body = nn.TransformerEncoderLayer(
                4, 2, 6, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
            )
        else:
            self.body = nn.MultiheadAttention(4, 2, batch_first=kind == "mha_batch_first")

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.embed(x))
        if self.kind == "encoder_layer":
            mask = nn.Transformer.generate_square_subsequent_mask(4)
            h = self.body(h, is_causal=True, src_mask=mask)
        elif self.kind == "mha_batch_first":
            h = self.body(h, h, h, need_weights=False)[0]
        else:  # sequence-first [T, N, E]
            h = h.transpose(0, 1)
            h = self.body(h, h, h, need_weights=False)[0].transpose(0, 1)
        return self.head(h).mean(1)


@pytest.mark.parametrize("kind", ["mha_batch_first", "mha_sequence_first", "encoder_layer"])
def test_torch_attention_layers(kind: str):
    """DiagHessian and BatchDiagHessian through ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` against the dense Hessian: the samples are followed through
    the packed projection's ``unflatten``/``unsqueeze``/``squeeze``/``unbind`` to the kernel's
    inputs, and the attention call keeps only ``out_proj``, which enters linearly. (Before:
    refused, 'do not all hold the samples on their first axis'.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _perturbed(TorchEncoder(kind), 38).eval()
    X, y = torch.randn(3, 4, 3), torch.randint(0, 3, (3,))
    with sdpa_kernel(SDPBackend.MATH):
        check_diag(model, nn.CrossEntropyLoss(), X, y)


class CenteredNorm(nn.Module):
    """A LayerNorm without affine parameters written out, ``c · rsqrt(mean(c²) + ε)`` with
    ``c = x − mean(x)`` (its scale computed from the centred operand)."""

    def forward(self, x: Tensor) -> Tensor:
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)


class SmallScaleMlp(nn.Module):
    """A token embedding of small weights (a Hugging Face initialisation, std 0.02) → a
    hand-written RMSNorm or LayerNorm, or none → a SwiGLU MLP with a residual → head on the
    last token."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.norm = {"rmsnorm": RMSNorm, "layernorm": CenteredNorm}.get(norm, nn.Identity)()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 3, bias=False)
        self.gate, self.up = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16, bias=False)
        torch.manual_seed(41)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.02)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        n = self.norm(h)
        h = h + self.down(F.silu(self.gate(n)) * self.up(n))
        return self.head(h[:, -1])


@pytest.mark.parametrize("norm", ["none", "rmsnorm", "layernorm"])
def test_float32_products_keep_float32_precision(norm: str):
    """DiagHessian of a float32 model through SwiGLU's product and a hand-written RMSNorm's
    ``x · rsqrt(mean(x²) + ε)`` (or LayerNorm's), at a small weight scale, stays within
    float32's precision (5e-6 of each parameter's largest entry; here 3e-7 to 5e-7,
    autograd's own float32 double backward 4e-7) of the float64 Hessian diagonal. A product's
    pair of columns ``(a, ±b)`` that reaches a projection of one operand only (gate, up) is
    dropped there, as it cancels exactly; summed with the rest it left ``ε·V²``, more than
    those weights' curvature (up's diagonal 11× off, 4e-3 with the norm). A norm's parts are
    balanced where they meet (``bilinear.balance``); unbalanced they lose digits in the
    difference of squares (2e-5)."""
    from tests.extensions.test_hessian import run

    model = SmallScaleMlp(norm)
    X, y = torch.randint(0, 50, (3, 6)), torch.randint(0, 3, (3,))
    ref = copy.deepcopy(model)
    expected = split(torch.diagonal(loss_hessian(ref, nn.CrossEntropyLoss(), X, y)), ref)
    low = copy.deepcopy(model).float()
    run(low, nn.CrossEntropyLoss(), X, y, DiagHessian())
    for name, p in low.named_parameters():
        scale = float(expected[name].abs().max())
        err = float((p.diag_h.double() - expected[name]).abs().max()) / scale
        assert err < 5e-6, (name, err)


class GatedLinear(nn.Module):
    """``down(gate(h) ⊙ up(h))`` with ``h = inp(x)``: a product whose only nonlinearity is the
    product itself, the gate and up projections each reached by one operand's part."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gate, self.up = nn.Linear(3, 4), nn.Linear(4, 5), nn.Linear(4, 5)
        self.down = nn.Linear(5, 3)

    def forward(self, x: Tensor, operands: bool = False) -> Any:
        h = self.inp(x)
        g, u = self.gate(h), self.up(h)
        return (g, u) if operands else self.down(g * u).mean(1)


def test_pchmp_of_a_product_clips_its_eigen_decomposition():
    """PCHMP("clip") through an elementwise product ``z = g ⊙ u`` keeps, per element, the
    positive eigenvalue of the product's term on the operands: the block is the GGN plus
    ``Σₙₑ (|Gₙₑ|/2) vₙₑ vₙₑᵀ``, ``vₙₑ = sign(Gₙₑ) ∇θ gₙₑ + ∇θ uₙₑ`` (``G = ∂L/∂z``), built
    densely here from the definition. The engine's precision measures for the exact Hessian
    (pairs dropped where they cancel, parts rebalanced) would change it, and are not applied
    to PCHMP; HMP in the same pass stays exact."""
    from torch.func import functional_call, jacrev

    from backprism.extensions import HMP, PCHMP
    from tests.reference import ggn

    model = _perturbed(GatedLinear(), 43)
    X, y = torch.randn(3, 2, 3), torch.randint(0, 3, (3,))
    lf = nn.CrossEntropyLoss()
    ref = copy.deepcopy(model)
    flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])

    def operands(vec: Tensor) -> tuple[Tensor, Tensor]:
        return functional_call(ref, split(vec, ref), (X,), {"operands": True})

    g, u = operands(flat)
    z = (g * u).detach().requires_grad_(True)
    (G,) = torch.autograd.grad(lf(ref.down(z).mean(1), y), z)
    jg, ju = jacrev(operands)(flat)  # [N, T, E, P] each
    v = G.sign()[..., None] * jg + ju
    expected = ggn(copy.deepcopy(model), lf, X, y) + torch.einsum(
        "nte,ntep,nteq->pq", G.abs() / 2, v, v
    )
    hessian = loss_hessian(copy.deepcopy(model), lf, X, y)
    extend(model)
    with collect(PCHMP("clip"), HMP()):
        extend(copy.deepcopy(lf))(model(X), y).backward()
    start = 0
    for name, p in model.named_parameters():
        k = p.numel()
        eye = torch.eye(k).reshape(k, *p.shape)
        block = slice(start, start + k)
        torch.testing.assert_close(p.pchmp(eye).reshape(k, k), expected[block, block],
                                   rtol=1e-8, atol=1e-10, msg=name)
        torch.testing.assert_close(p.hmp(eye).reshape(k, k), hessian[block, block],
                                   rtol=1e-8, atol=1e-10, msg=name)
        start += k


def test_a_weight_inside_a_row_wise_operation_of_its_module_refused():
    """``F.layer_norm(w · F.rms_norm(x))`` in one module (generic rule): ``w`` enters the
    layer norm, so the module's output is not affine in it; the row-wise terms of the two
    norms, which cover their decomposed nodes, do not hide that — refused before anything is
    written."""

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4) + 0.1 * torch.randn(4))

        def forward(self, x: Tensor) -> Tensor:
            h = self.weight * F.rms_norm(x, x.shape[-1:], eps=1e-6)
            return F.layer_norm(h, h.shape[-1:])

    model = extend(nn.Sequential(nn.Linear(3, 4), Nested(), nn.Linear(4, 3)))
    X, y = torch.randn(3, 3), torch.randint(0, 3, (3,))
    lf = extend(nn.CrossEntropyLoss())
    with pytest.raises(NonlinearityError, match="Nested enter"), collect(DiagHessian()):
        lf(model(X), y).backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())


_REDUCE = {
    "norm": lambda h, d, k: h.norm(dim=d, keepdim=k),
    "vector_norm": lambda h, d, k: torch.linalg.vector_norm(h, dim=d, keepdim=k),
    "var": lambda h, d, k: h.var(d, keepdim=k),
    "std": lambda h, d, k: h.std(d, keepdim=k, correction=0),
    "logsumexp": lambda h, d, k: torch.logsumexp(h, d, keepdim=k),
}


class Reduced(nn.Module):
    """``h = tanh(a(x))`` ``[N, T, 2, D]``, a reduction ``r`` of axes of ``h`` put back (with
    ``keepdim`` or ``unsqueeze``), then ``h / (1 + r²)`` or ``h · r`` → head."""

    def __init__(self, op: str, dim: Any, keep: bool, divide: bool) -> None:
        super().__init__()
        self.op, self.dim, self.keep, self.divide = op, dim, keep, divide
        self.a, self.c = nn.Linear(3, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        r = _REDUCE[self.op](h, self.dim, self.keep)
        if not self.keep:
            for d in sorted(x % 4 for x in (self.dim if isinstance(self.dim, tuple) else
                                             (self.dim,))):
                r = r.unsqueeze(d)
        h = h / (1 + r * r) if self.divide else h * r
        return self.c(h).mean((1, 2))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    op=st.sampled_from(sorted(_REDUCE)), dim=st.sampled_from([1, 2, -1, (1, 2), (-1, 1)]),
    keep=st.booleans(),
    divide=st.booleans(), n=st.integers(1, 3), t=st.integers(2, 3),
)
def test_reductions_and_divisions_fuzzed(
    op: str, dim: Any, keep: bool, divide: bool, n: int, t: int
):
    """A smooth reduction of one axis or two (``residual.ReductionSite``; ``(1, -1)``: not the
    trailing ones) multiplied into or divided out of the values it reduces
    (``residual.DivisionSite``), with or without ``keepdim``: DiagHessian and
    BatchDiagHessian against the dense Hessian."""
    model = _perturbed(Reduced(op, dim, keep, divide), 44)
    X, y = torch.randn(n, t, 2, 3), torch.randint(0, 3, (n,))
    check_diag(model, nn.CrossEntropyLoss(), X, y)


def test_a_division_whose_denominator_is_then_modified_in_place_refused():
    """``h / d`` with ``d`` modified in place afterwards (autograd's own backward would fail
    at the division): refused at the check, before anything is written, naming it."""

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.c = nn.Linear(3, 4), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.a(x))
            d = 1 + h * h
            out = self.c(h / d)
            d.mul_(2)
            return out

    model, lf = extend(Late()), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(3, 3), torch.randint(0, 3, (3,))
    with pytest.raises(NonlinearityError, match="modified in place"), collect(DiagHessian()):
        lf(model(X), y).backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())
