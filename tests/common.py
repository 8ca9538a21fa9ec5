"""Helpers shared by several test modules: small models, result gathering and the checks
that many tests repeat. Nothing here computes a reference; references live in
:mod:`tests.reference`.

Sections: models; results of a backward pass; engine checks (``tests/engine``); first-order
checks; second-order checks on one layer family (family layer → tanh → Linear head); rule
checks (a rule's methods against per-sample VJPs); models on a device (the tests parametrised
over the ``device`` fixture of ``conftest.py``); the monitor.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from torch import Tensor, nn

import backprism
from backprism import collect, extend
from backprism.engine.rule import Call, get_rule
from backprism.engine.state import suspended
from backprism.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from tests.reference import (
    diag_blocks,
    ggn_blocks,
    ggn_blocks_loop,
    param_blocks,
    per_sample_grads,
    per_sample_grads_replacing,
    vjp_per_sample,
)


# ------------------------------------------------------------------------------------------- models
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


class Encoder(nn.Module):
    """``nn.TransformerEncoderLayer`` (batch first, no dropout), mean over positions, linear
    head."""

    def __init__(self, d: int = 4, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d, heads, dim_feedforward=6, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).mean(1))


class SequenceModel(nn.Module):
    """Embedding → LayerNorm → Linear, mean over positions."""

    def __init__(self, vocab: int, dim: int, classes: int, padding_idx: int | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(self.norm(self.emb(x))).mean(1)


class SoftmaxAttention(nn.Module):
    """Hand-written single-head attention ``softmax(q kᵀ) v`` of Linear projections, mean over
    positions."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(3, 3) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:  # x [N, T, 3]
        a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), dim=-1)
        return self.o(a @ self.v(x)).mean(1)


class LayerNormBetween(nn.Module):
    """``Linear → LayerNorm → Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.ln, self.b = nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.ln(self.a(x)))


# ----------------------------------------------------------------------- results of a backward pass
def first_order_expected(gb: Tensor) -> dict[str, Tensor]:
    """What each first-order extension stores, from per-sample gradients ``gb = [N, *p]``."""
    f = gb.reshape(gb.shape[0], -1)  # (also a 0-d parameter's [N])
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


# ----------------- engine checks (tests/engine): float64 tolerances, nothing written after an error
ENGINE_TOL = {"rtol": 1e-7, "atol": 1e-10}
WRITTEN_ATTRS = (
    "grad_batch", "batch_l2", "sum_grad_squared", "variance", "diag_ggn_exact", "diag_h", "kflr"
)
CLEAR_ERRORS = (RuntimeError, ValueError, NotImplementedError)


def seeded_labels(shape: tuple[int, ...], c: int, seed: int = 0) -> Tensor:
    """Class labels of ``shape`` in ``[0, c)`` from a seeded generator."""
    return torch.randint(0, c, shape, generator=torch.Generator().manual_seed(seed))


def small_mlp(d_in: int = 4, h: int = 5, c: int = 3) -> nn.Module:
    """``Linear → tanh → Linear``."""
    return nn.Sequential(nn.Linear(d_in, h), nn.Tanh(), nn.Linear(h, c))


def assert_close_labelled(actual: Tensor, expected: Tensor, label: str, **tol: float) -> None:
    """``assert_close`` (float64 tolerances unless given) whose message keeps torch's own
    (greatest absolute/relative difference) after ``label``."""
    torch.testing.assert_close(
        actual, expected, **(tol or ENGINE_TOL), msg=lambda m: f"{label}: {m}"
    )


def check_first_order_fields(model: nn.Module, ref: dict[str, Tensor]) -> None:
    """Every first-order attribute equals the reference, plus the invariants between them
    and ``.grad``."""
    for name, p in trainable(model):
        gb = p.grad_batch
        for field, value in first_order_expected(ref[name]).items():
            if field == "batch_dot":
                continue
            assert_close_labelled(getattr(p, field), value, f"{name}.{field}")
        assert_close_labelled(gb.sum(0), p.grad, f"{name}: Σ grad_batch ≠ grad")
        assert_close_labelled(p.batch_l2, gb.flatten(1).square().sum(1), name)
        assert_close_labelled(p.variance, gb.var(0, unbiased=False), name)
        assert_close_labelled(p.grad, ref[name].sum(0), f"{name}.grad")


def check_diag_attr(model: nn.Module, attr: str, ref: dict[str, Tensor]) -> None:
    """``param.<attr>`` equals ``ref[name]`` for every trainable parameter."""
    for name, p in trainable(model):
        assert_close_labelled(getattr(p, attr), ref[name], f"{name}.{attr}")


def assert_nothing_written(model: nn.Module, grad_too: bool = False) -> None:
    """No extension result (and, with ``grad_too``, no ``.grad``) on any parameter."""
    for name, p in model.named_parameters():
        for attr in WRITTEN_ATTRS:
            assert getattr(p, attr, None) is None, f"{name}.{attr} written despite the error"
        if grad_too:
            assert p.grad is None, f"{name}.grad written despite the error"


def clear_error_or_raise(err: Exception, pattern: str) -> None:
    """``err`` is acceptable only if its message matches ``pattern`` (names the problem)."""
    if not isinstance(err, CLEAR_ERRORS) or not re.search(pattern, str(err), re.IGNORECASE):
        raise AssertionError(f"unclear error (wanted /{pattern}/): {err!r}") from err


# ------------------------------------------------------------------------------- first-order checks
FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad)


def run_first_order(model: nn.Module, lossfunc: nn.Module, X: Tensor | tuple, y: Tensor) -> None:
    """One backward pass with all five first-order extensions."""
    xs = X if isinstance(X, tuple) else (X,)
    model.zero_grad()
    with collect(*(e() for e in FIRST_ORDER)):
        lossfunc(model(*xs), y).backward()


def check_first_order(
    model: nn.Module, lossfunc: nn.Module, X: Tensor | tuple, y: Tensor, ref: dict[str, Tensor]
) -> None:
    """All five first-order extensions and ``.grad`` against per-sample references ``ref``."""
    run_first_order(model, lossfunc, X, y)
    checked = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "grad_batch"), name
            continue
        for field, value in first_order_expected(ref[name]).items():
            torch.testing.assert_close(
                getattr(p, field), value, rtol=1e-7, atol=1e-10, msg=f"{name}.{field}"
            )
        torch.testing.assert_close(p.grad, ref[name].sum(0), rtol=1e-7, atol=1e-10)
        checked += 1
    assert checked == len(ref)


def check_first_order_vs_vmap(model, lossfunc, X, y, rtol=1e-7, atol=1e-10):
    """All five first-order extensions of one backward pass and ``.grad`` against
    ``reference.per_sample_grads`` (computed here, before the pass)."""
    ref = per_sample_grads(model, lossfunc, X, y)
    model.zero_grad()
    with collect(*(e() for e in FIRST_ORDER)):
        lossfunc(model(X), y).backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        for field, value in first_order_expected(ref[name]).items():
            torch.testing.assert_close(
                getattr(p, field), value, rtol=rtol, atol=atol, msg=f"{name}.{field}"
            )
        torch.testing.assert_close(p.grad, ref[name].sum(0), rtol=rtol, atol=atol)


# ------------------------------ second-order checks on one layer family: layer → tanh → Linear head
FAMILY_DT = torch.float64
FAMILY_N, FAMILY_C = 2, 3
FAMILY_MC = 1000
FAMILY_TOL = {"atol": 1e-9, "rtol": 1e-9}
#: hypothesis settings of the family tests (derandomized: each test's source fixes its
#: examples)
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
CHUNKING = st.sampled_from([{}, {"chunk_size": 1}, {"memory_budget": 700}])


def kron(factors: list[Tensor]) -> Tensor:
    """``factors[0] ⊗ factors[1] ⊗ …``."""
    m = factors[0]
    for f in factors[1:]:
        m = torch.kron(m, f)
    return m


def check_exact(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor, G: Tensor, **kw) -> None:
    """Exact diagonal, per-sample diagonals and square root against the reference blocks."""
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), **kw)
    n = G.shape[0]
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **FAMILY_TOL
    )
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **FAMILY_TOL
    )
    V = gather(model, "sqrt_ggn_exact", 2)
    assert V.shape[1] == n
    for i in range(n):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[i, i], **FAMILY_TOL)


def check_mc(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor, G: Tensor) -> None:
    """``DiagGGNMC``/``BatchDiagGGNMC`` are the mean of the i.i.d. draws ``M·V[m]²`` of
    ``SqrtGGNMC(M)`` (same columns) and within 6 standard errors of the reference blocks ``G``."""
    extend(model), extend(lossfunc)
    torch.manual_seed(0)
    exts = (DiagGGNMC(FAMILY_MC), BatchDiagGGNMC(FAMILY_MC), SqrtGGNMC(FAMILY_MC))
    backward(model, lossfunc, X, y, *exts)
    V = gather(model, "sqrt_ggn_mc", 2)  # [M, N, P]
    assert V.shape[:2] == (FAMILY_MC, G.shape[0])
    per = V.square() * FAMILY_MC
    assert_mc_within(gather(model, "diag_ggn_mc", 0), per.sum(1), torch.diagonal(G.sum((0, 1))))
    assert_mc_within(gather(model, "diag_ggn_mc_batch", 1), per, diag_blocks(G))


def check_kflr_exact(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor) -> None:
    """N = 1 and one output position: ``kron(factors)`` is the exact GGN block."""
    G = ggn_blocks(model, lossfunc, X, y)[0][0, 0]
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, KFLR())
    for name, block in param_blocks(model, G).items():
        p = dict(model.named_parameters())[name]
        torch.testing.assert_close(kron(p.kflr), block, **FAMILY_TOL)


class Head(nn.Module):
    """``layer → tanh → flatten → Linear(C)``; the head's input size is found by a dry run."""

    def __init__(self, layer: nn.Module, example: Any, classes: int = FAMILY_C) -> None:
        super().__init__()
        self.layer = layer.to(FAMILY_DT)
        xs = example if isinstance(example, tuple) else (example,)
        with torch.no_grad():
            width = self.body(*xs).shape[1]
        self.head = nn.Linear(width, classes)

    def body(self, *xs: Tensor) -> Tensor:
        out = self.layer(*xs)
        if isinstance(out, tuple):  # MultiheadAttention
            out = out[0]
        return out.tanh().flatten(1)

    def forward(self, *xs: Tensor) -> Tensor:
        return self.head(self.body(*xs))


def labels(n: int, classes: int = FAMILY_C, seed: int = 0) -> Tensor:
    """``n`` class labels from a seeded generator."""
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


def run_family(model: nn.Module, X: Any, y: Tensor, chunking: dict, loop: bool = False) -> None:
    """The exact GGN extensions under ``collect(**chunking)`` against the reference blocks
    (``reference.ggn_blocks``, or ``reference.ggn_blocks_loop`` with ``loop``)."""
    lossfunc = nn.CrossEntropyLoss()
    G = (ggn_blocks_loop if loop else lambda *a: ggn_blocks(*a)[0])(model, lossfunc, X, y)
    check_exact(model, lossfunc, X, y, G, **chunking)


def randomize_affine(module: nn.Module) -> nn.Module:
    """Weights uniform in ``[0.5, 1.5]``, biases in ``[-0.5, 0.5]``."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.uniform_(0.5, 1.5) if name == "weight" else p.uniform_(-0.5, 0.5)
    return module


NORMS = {
    "layernorm": (lambda: nn.LayerNorm(3), (2, 3)),
    "layernorm_2d_shape": (lambda: nn.LayerNorm((2, 3)), (2, 3)),
    "layernorm_nobias": (lambda: nn.LayerNorm(3, bias=False), (2, 3)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (4, 3)),
    "groupnorm_2d": (lambda: nn.GroupNorm(1, 2), (2, 2, 2)),
    "rmsnorm": (lambda: nn.RMSNorm(3), (2, 3)),
    "batchnorm1d": (lambda: nn.BatchNorm1d(3), (3,)),
    "batchnorm1d_seq": (lambda: nn.BatchNorm1d(2), (2, 3)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(2), (2, 2, 2)),
    "batchnorm3d": (lambda: nn.BatchNorm3d(2), (2, 1, 2, 2)),
    "instancenorm1d": (lambda: nn.InstanceNorm1d(2, affine=True), (2, 3)),
    "instancenorm2d": (lambda: nn.InstanceNorm2d(2, affine=True), (2, 2, 3)),
    "instancenorm3d_running": (
        lambda: nn.InstanceNorm3d(2, affine=True, track_running_stats=True), (2, 1, 2, 2)
    ),
}


def norm_model(kind: str, seed: int) -> tuple[nn.Module, Tensor]:
    """``Head`` on the norm layer ``NORMS[kind]`` (random affine parameters and running statistics,
    eval mode) and an input batch."""
    torch.manual_seed(seed)
    make, shape = NORMS[kind]
    layer = randomize_affine(make())
    if isinstance(layer, nn.modules.batchnorm._NormBase) and layer.track_running_stats:
        layer.running_mean.uniform_(-0.5, 0.5)
        layer.running_var.uniform_(0.5, 2.0)
    X = torch.randn(FAMILY_N, *shape, dtype=FAMILY_DT)
    model = Head(layer, X).to(FAMILY_DT).eval()
    return model, X


class SinExpCustom(nn.Module):
    """Parameters used nonlinearly: ``sin(x W) ⊙ exp(s) + x``."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(i, i))
        self.s = nn.Parameter(0.3 * torch.randn(i))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x @ self.W) * self.s.exp() + x


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` as self-attention, output only."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def generic_model(kind: str, seed: int) -> tuple[nn.Module, Any]:
    """``Head`` on a layer without a registered rule (``mha``, ``bilinear``, ``custom``) and its
    input."""
    torch.manual_seed(seed)
    if kind == "mha":
        X: Any = torch.randn(FAMILY_N, 3, 4, dtype=FAMILY_DT)
        layer: nn.Module = SelfAttention()
    elif kind == "bilinear":
        X = (torch.randn(FAMILY_N, 2, dtype=FAMILY_DT), torch.randn(FAMILY_N, 3, dtype=FAMILY_DT))
        layer = nn.Bilinear(2, 3, 2)
    else:
        X = torch.randn(FAMILY_N, 2, 3, dtype=FAMILY_DT)
        layer = SinExpCustom(3)
    return Head(layer, X).to(FAMILY_DT), X


# -------------------------------------- rule checks: every method of a rule against per-sample VJPs
RULE_COLUMNS = 3
RULE_SETTINGS = settings(max_examples=20, deadline=None)
RULE_ATOL, RULE_RTOL = 1e-10, 1e-8


def make_call(module: nn.Module, x: Tensor) -> tuple[Call, torch.Size]:
    """The engine's record of the call ``module(x)``, and the output shape."""
    with torch.no_grad():
        out = module(x)
    call = Call(
        module=module,
        args=(x,),
        kwargs={},
        out_shapes=[out.shape],
        batch_size=x.shape[0],
        training=module.training,
        params=dict(module.named_parameters()),
    )
    return call, out.shape


def close(actual: Tensor, expected: Tensor) -> None:
    """Equal shapes and values within the rule tests' float64 tolerances."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=RULE_ATOL, rtol=RULE_RTOL)


def check_rule(
    module: nn.Module, x: Tensor, seed: int, reference: nn.Module | None = None
) -> None:
    """Every statistic of ``module``'s rule against the dense per-sample reference (the VJPs of
    ``reference``, a module computing the same function, where ``module`` cannot be vmapped)."""
    gen = torch.Generator().manual_seed(seed)
    call, out_shape = make_call(module, x)
    n = x.shape[0]
    g = torch.randn(RULE_COLUMNS, *out_shape, generator=gen, dtype=torch.float64)
    w = torch.randn(RULE_COLUMNS, n, generator=gen, dtype=torch.float64)
    ref = vjp_per_sample(reference if reference is not None else module, x, g)
    rule = get_rule(module)
    assert type(rule).__module__ != "backprism.rules.generic"
    check_rule_statistics(rule, call, g, ref, w, atol=RULE_ATOL, rtol=RULE_RTOL)


def check_rule_statistics(
    rule: Any,
    call: Any,
    g: Any,
    ref: dict[str, Tensor],
    w: Tensor,
    vectors: dict[str, Tensor] | None = None,
    **tol: float,
) -> None:
    """Every statistic of ``rule`` on ``call`` for the columns ``g`` against the dense per-sample,
    per-column reference ``ref`` (``{name: [M, N, *p]}``, ``Vₘₙ = Jₙᵀ g[m, n]``): per-sample,
    summed, squared (plain and weighted by ``w`` ``[M, N]``), ``batch_l2``, ``batch_dot`` and,
    given ``vectors``, ``batch_dot_with``; equal shapes and values within ``tol``."""
    m, n = w.shape

    def stats(p: Tensor) -> dict[str, Tensor]:
        wsq = p.square() * w.reshape(m, n, *([1] * (p.dim() - 2)))
        f = p.flatten(2)
        return {
            "per_sample": p,
            "summed": p.sum(1),
            "sum_squared": p.square().sum((0, 1)),
            "sum_squared_w": wsq.sum((0, 1)),
            "batch_sum_squared": p.square().sum(0),
            "batch_sum_squared_w": wsq.sum(0),
            "batch_l2": f.square().sum((0, 2)),
            "batch_dot": torch.einsum("mni,mki->nk", f, f),
        }

    expected = {k: stats(p) for k, p in ref.items()}
    computed = {
        "per_sample": rule.per_sample(call, g),
        "summed": rule.summed(call, g),
        "sum_squared": rule.sum_squared(call, g),
        "sum_squared_w": rule.sum_squared(call, g, w),
        "batch_sum_squared": rule.batch_sum_squared(call, g),
        "batch_sum_squared_w": rule.batch_sum_squared(call, g, w),
        "batch_l2": rule.batch_l2(call, g),
        "batch_dot": rule.batch_dot(call, g),
    }
    results = {
        what: (got, {k: expected[k][what] for k in expected}) for what, got in computed.items()
    }
    if vectors is not None:
        results["batch_dot_with"] = (
            rule.batch_dot_with(call, g, vectors),
            {k: p.flatten(2).sum(0) @ vectors[k].reshape(-1) for k, p in ref.items()},
        )
    tol = tol or {"atol": RULE_ATOL, "rtol": RULE_RTOL}
    for what, (got, want) in results.items():
        assert set(got) == set(want), (what, set(got), set(want))
        for k in want:
            assert got[k].shape == want[k].shape, (what, k, got[k].shape, want[k].shape)
            torch.testing.assert_close(got[k], want[k], **tol, msg=f"{what}[{k}]")


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter drawn from a seeded standard normal."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


FIRST_ORDER_EXTENSIONS = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad())


def check_first_order_e2e(model: nn.Module, loss_fn: nn.Module, x: Tensor, y: Tensor) -> None:
    """``extend`` model and loss, then the five first-order extensions and ``.grad`` against
    per-sample references (looped where an embedding has a ``padding_idx``)."""
    backprism.extend(model)
    backprism.extend(loss_fn)
    padded = any(getattr(m, "padding_idx", None) is not None for m in model.modules())
    ref = (per_sample_grads_replacing if padded else per_sample_grads)(model, loss_fn, x, y)
    n = x.shape[0]
    with backprism.collect(*FIRST_ORDER_EXTENSIONS):
        loss_fn(model(x), y).backward()
    checked = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        r = ref[name]
        close(p.grad_batch, r)
        close(p.batch_l2, r.flatten(1).square().sum(1))
        close(p.sum_grad_squared, r.square().sum(0))
        close(p.variance, r.square().mean(0) - r.mean(0).square())
        close(p.batch_dot, r.flatten(1) @ r.flatten(1).t())
        close(p.grad, r.sum(0))
        assert p.grad_batch.shape == (n, *p.shape)
        checked += 1
    assert checked > 0


# ------------------------------ models on a device (tests parametrised over the ``device`` fixture)
#: the models every device test runs (:func:`build_on_device`)
DEVICE_MODELS = ["mlp", "mlp_mse", "cnn", "resnet", "transformer", "gpt", "gpt_flat"]
DEVICE_DT = torch.float64
DEVICE_N = 3
DEVICE_MC = 2000  # MC samples
DEVICE_VOCAB, DEVICE_T = 5, 3
DEVICE_TOL = {"rtol": 1e-8, "atol": 1e-10}


def resolved(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` → ``cuda:0``), as tensors report it."""
    return torch.empty(0, device=device).device


def assert_on_device(value: Any, device: torch.device, what: str) -> None:
    """Every tensor in ``value`` (nested lists/tuples/dicts) lives on ``device``."""
    if isinstance(value, Tensor):
        want = resolved(device)
        assert value.device == want, f"{what} is on {value.device}, not {want}"
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_on_device(v, device, f"{what}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            assert_on_device(v, device, f"{what}[{k!r}]")


def check_stored(model: nn.Module, device: torch.device, *fields: str) -> None:
    """``param.<field>`` exists, lies on the device and is finite, for every trainable param;
    ``.grad`` too."""
    for name, p in trainable(model):
        assert_on_device(p.grad, device, f"{name}.grad")
        for field in fields:
            value = getattr(p, field)
            assert_on_device(value, device, f"{name}.{field}")
            for t in value if isinstance(value, (list, tuple)) else [value]:
                assert torch.isfinite(t).all(), f"{name}.{field}"


def cpu_data(seed: int):
    """``randn(*shape)`` and ``labels(c, *shape)`` drawing from one CPU generator."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=DEVICE_DT, device="cpu")

    def labels(c: int, *shape: int) -> Tensor:
        return torch.randint(0, c, shape, generator=g, device="cpu")

    return randn, labels


def build_on_device(
    name: str, device: torch.device, seed: int = 0
) -> tuple[nn.Module, nn.Module, Tensor, Tensor, Any]:
    """``model, lossfunc, X, y, ref_loss`` on ``device`` (``ref_loss`` acts on the outputs
    stacked per sample, as ``reference`` evaluates them). Built on the CPU, then moved with
    ``.to(device)`` — no ``torch.set_default_device`` — so library code that creates a tensor
    without ``device=`` fails on an accelerator (a device mismatch) instead of passing
    silently."""
    with torch.device("cpu"):
        torch.manual_seed(seed)
        randn, labels = cpu_data(seed)
        lossfunc: nn.Module = nn.CrossEntropyLoss()
        ref_loss: Any = lossfunc
        if name in ("mlp", "mlp_mse"):
            model: nn.Module = nn.Sequential(
                nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3)
            )
            X = randn(DEVICE_N, 4)
            if name == "mlp_mse":
                lossfunc = ref_loss = nn.MSELoss()
                y = randn(DEVICE_N, 3)
            else:
                y = labels(3, DEVICE_N)
        elif name == "cnn":
            model = nn.Sequential(
                nn.Conv2d(2, 3, 3, padding=1),
                nn.Tanh(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(12, 3),
            )
            X, y = randn(DEVICE_N, 2, 4, 4), labels(3, DEVICE_N)
        elif name == "resnet":
            model = ResNetBlock(out_act="tanh").eval()
            X, y = randn(DEVICE_N, 2, 3, 3), labels(3, DEVICE_N)
        elif name == "transformer":
            model = Encoder()
            X, y = randn(DEVICE_N, 3, 4), labels(3, DEVICE_N)
        elif name in ("gpt", "gpt_flat"):
            model = TinyGPT(vocab=DEVICE_VOCAB, t_max=DEVICE_T, flat=name == "gpt_flat")
            X = labels(DEVICE_VOCAB, DEVICE_N, DEVICE_T)
            X[1, 2] = X[1, 0] = X[0, 1]  # repeated tokens within and across samples
            y = labels(DEVICE_VOCAB, DEVICE_N, DEVICE_T)
            if name == "gpt_flat":
                y = y.flatten()
                ce = lossfunc

                def ref_loss(o: Tensor, y: Tensor) -> Tensor:  # o: [N, T, V]
                    return ce(o.reshape(-1, DEVICE_VOCAB), y)

        else:
            raise ValueError(name)
    model = model.to(device=device, dtype=DEVICE_DT)
    return model, lossfunc, X.to(device), y.to(device), ref_loss


def fresh_backward(
    model: nn.Module, lossfunc: nn.Module, X: Tensor, y: Tensor, *exts, **kw
) -> Tensor:
    """``model.zero_grad()``, then one forward and a backward pass inside ``collect``."""
    model.zero_grad()
    loss = lossfunc(model(X), y)
    with collect(*exts, **kw):
        loss.backward()
    return loss


def expected_kronecker_shapes(model: nn.Module) -> dict[str, list[tuple[int, ...]]]:
    """The KFLR/KFAC factor shapes ``[B, A]`` (``[B]`` for biases) of every trainable parameter."""
    out = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            key = f"{mod_name}.{pname}" if mod_name else pname
            o = p.shape[0]
            if isinstance(mod, nn.Embedding):
                shapes = [(o, o), (p.shape[1], p.shape[1])]
            elif pname == "bias":
                shapes = [(o, o)]
            else:
                i = p[0].numel()
                shapes = [(o, o), (i, i)]
            out.setdefault(key, shapes)
    return out


def freeze_kronecker_unsupported(model: nn.Module) -> None:
    """Freeze the parameters of layers that have no Kronecker factors."""
    for mod in model.modules():
        if not isinstance(mod, (nn.Linear, nn.Conv2d, nn.Embedding)) or isinstance(
            mod, nn.modules.linear.NonDynamicallyQuantizableLinear
        ):
            for p in mod.parameters(recurse=False):
                p.requires_grad_(False)


# -------------------------------------------------------------------------------------- the monitor
def monitor_setup(model: nn.Module | None = None, loss: nn.Module | None = None):
    """An extended float64 model (default: a ReLU MLP 4 → 5 → 3) and loss (cross-entropy)."""
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    return backprism.extend(model.double()), backprism.extend(loss or nn.CrossEntropyLoss())


def monitor_step(monitor, model, lossf, step, opt=None, info_extra=None, exts=(), X=None, y=None):
    """One tracked step on a batch of 6 (random unless given); returns the loss."""
    X = torch.randn(6, 4, dtype=torch.float64) if X is None else X
    y = torch.randint(0, 3, (6,)) if y is None else y
    out = model(X)
    loss = lossf(out, y)
    info = {"loss": loss, "batch_size": X.shape[0], "individual_losses": loss.new_zeros(6)}
    if opt is not None:
        info["optimizer"] = opt
    info.update(info_extra or {})
    with monitor(step, *exts, info=info):
        loss.backward(create_graph=monitor.create_graph(step))
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return loss


def individual_grads(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` individual gradients ``gₙ = ∇ℓₙ`` by one autograd call per sample."""
    params = [p for p in model.parameters()]
    lossf = nn.CrossEntropyLoss()
    rows = []
    with suspended():  # reference forwards are not the monitored step's calls
        for n in range(X.shape[0]):
            g = torch.autograd.grad(lossf(model(X[n : n + 1]), y[n : n + 1]), params)
            rows.append(torch.cat([t.reshape(-1) for t in g]).detach())
    return torch.stack(rows)


# -- distributed tests (gloo processes spawned by a test) ---------------------------------------
class TanhReluResidual(nn.Module):
    """Two Linear branches meeting in a sum, a smooth and a piecewise-linear nonlinearity (the
    monitor's quantity tests)."""

    def __init__(self, d: int = 4, h: int = 5, c: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.block = nn.Linear(h, h)
        self.out = nn.Linear(h, c)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        h = h + torch.relu(self.block(h))
        return self.out(h)


class TanhResidual(nn.Module):
    """Linear layers with tanh and a skip connection (Hessian residual terms, glue code)."""

    def __init__(self, d: int = 5, h: int = 6, c: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.block = nn.Linear(h, h)
        self.out = nn.Linear(h, c)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.block(h))
        return self.out(h)


def init_gloo(rank: int, world: int, rendezvous: str) -> None:
    """Join a gloo process group through the rendezvous file ``rendezvous`` (one CPU thread)."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
