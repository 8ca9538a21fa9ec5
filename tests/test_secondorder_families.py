"""Second-order extensions on every layer family, end to end through ``extend``/``collect``.

Each family gets a tiny model (family layer → nonlinearity → Linear head) and is checked against
dense float64 references built from the definitions (``tests/reference.py::ggn_blocks``; a
loop-based reference without ``vmap`` where ``vmap`` cannot be used):

* ``DiagGGNExact`` = diag of the GGN, ``BatchDiagGGNExact`` = diags of the per-sample blocks,
  ``SqrtGGNExact``: ``V[:, n]ᵀ V[:, n]`` = the per-sample GGN block ``G[n, n]`` (1e-9);
* ``DiagGGNMC`` / ``BatchDiagGGNMC`` in expectation: with ``M`` MC columns the ``M·V[m]²`` of
  ``SqrtGGNMC(M)`` (same columns, same ``collect``) are i.i.d. unbiased draws; the result must be
  their mean and lie within 6 standard errors (+1e-10) of the reference;
* ``KFLR`` in its exact limit (N = 1, one output position): the Kronecker product of the stored
  factors (in stored order) equals the GGN block of the parameter;
* chunking (``chunk_size=1``, a small ``memory_budget``) does not change exact results; a
  C = 1000-class classifier is pushed through many chunks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.autograd.functional import jacobian
from torch.func import functional_call, hessian, jacrev

from backprism import extend
from backprism.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
)
from common import assert_mc_within, backward, gather, trainable

from reference import diag_blocks, ggn_blocks

DT = torch.float64
N, C = 2, 3
M = 1000
TOL = {"atol": 1e-9, "rtol": 1e-9}
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
CHUNKING = st.sampled_from([{}, {"chunk_size": 1}, {"memory_budget": 700}])


# --------------------------------------------------------------------------- helpers
def param_blocks(model: nn.Module, G: Tensor) -> dict[str, Tensor]:
    """Diagonal blocks ``{name: [p, p]}`` of a ``[P, P]`` matrix in parameter order."""
    out, i = {}, 0
    for k, p in trainable(model):
        out[k] = G[i : i + p.numel(), i : i + p.numel()]
        i += p.numel()
    return out


def kron(factors: list[Tensor]) -> Tensor:
    m = factors[0]
    for f in factors[1:]:
        m = torch.kron(m, f)
    return m


def ggn_blocks_loop(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor) -> Tensor:
    """``[N, N, P, P]`` GGN blocks without ``vmap`` (``padding_idx`` breaks its batching rule):
    ``G[n, n] = Jₙᵀ (∂²L/∂fₙ²) Jₙ`` from a looped Jacobian of sample ``n``'s output and the
    Hessian of the *batch* loss w.r.t. that output (other outputs fixed); ``G[n, m≠n] = 0`` for
    the sample-separable losses used here."""
    names = [k for k, _ in trainable(model)]
    shapes = [p.shape for _, p in trainable(model)]
    sizes = [p.numel() for _, p in trainable(model)]
    flat = torch.cat([p.detach().reshape(-1) for _, p in trainable(model)])
    xs = X if isinstance(X, tuple) else (X,)
    n = xs[0].shape[0]
    with torch.no_grad():
        out = model(*xs)
    G = flat.new_zeros(n, n, flat.numel(), flat.numel())
    for i in range(n):

        def f(theta: Tensor, i: int = i) -> Tensor:
            p = {k: t.reshape(s) for k, t, s in zip(names, torch.split(theta, sizes), shapes)}
            return functional_call(model, p, tuple(x[i : i + 1] for x in xs))[0]

        def loss_i(o: Tensor, i: int = i) -> Tensor:
            return lossfunc(torch.cat([out[:i], o[None], out[i + 1 :]]), y)

        J = jacobian(f, flat).reshape(-1, flat.numel())  # looped, no vmap
        H = hessian(loss_i)(out[i]).reshape(J.shape[0], J.shape[0])
        G[i, i] = J.T @ H @ J
    return G


def check_exact(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor, G: Tensor, **kw) -> None:
    """Exact diagonal, per-sample diagonals and square root against the reference blocks."""
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), **kw)
    n = G.shape[0]
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **TOL
    )
    torch.testing.assert_close(gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **TOL)
    V = gather(model, "sqrt_ggn_exact", 2)
    assert V.shape[1] == n
    for i in range(n):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[i, i], **TOL)


def check_mc(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor, G: Tensor) -> None:
    extend(model), extend(lossfunc)
    torch.manual_seed(0)
    backward(model, lossfunc, X, y, DiagGGNMC(M), BatchDiagGGNMC(M), SqrtGGNMC(M))
    V = gather(model, "sqrt_ggn_mc", 2)  # [M, N, P]
    assert V.shape[:2] == (M, G.shape[0])
    per = V.square() * M
    assert_mc_within(gather(model, "diag_ggn_mc", 0), per.sum(1), torch.diagonal(G.sum((0, 1))))
    assert_mc_within(gather(model, "diag_ggn_mc_batch", 1), per, diag_blocks(G))


def check_kflr_exact(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor) -> None:
    """N = 1 and one output position: ``kron(factors)`` is the exact GGN block."""
    G = ggn_blocks(model, lossfunc, X, y)[0][0, 0]
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, KFLR())
    for name, block in param_blocks(model, G).items():
        p = dict(model.named_parameters())[name]
        torch.testing.assert_close(kron(p.kflr), block, **TOL)


class Head(nn.Module):
    """``layer → tanh → flatten → Linear(C)``; the head's input size is found by a dry run."""

    def __init__(self, layer: nn.Module, example: Any, classes: int = C) -> None:
        super().__init__()
        self.layer = layer.to(DT)
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


def labels(n: int, classes: int = C, seed: int = 0) -> Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


def run_family(model: nn.Module, X: Any, y: Tensor, chunking: dict, loop: bool = False) -> None:
    lossfunc = nn.CrossEntropyLoss()
    G = (ggn_blocks_loop if loop else lambda *a: ggn_blocks(*a)[0])(model, lossfunc, X, y)
    check_exact(model, lossfunc, X, y, G, **chunking)


# --------------------------------------------------------------------------- Linear
@SETTINGS
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    bias=st.booleans(),
    chunking=CHUNKING,
    seed=st.integers(0, 2**16),
)
def test_linear_leading_axes(lead, bias, chunking, seed):
    torch.manual_seed(seed)
    X = torch.randn(N, *lead, 3, dtype=DT)
    model = Head(nn.Linear(3, 2, bias=bias), X).to(DT)
    run_family(model, X, labels(N, seed=seed), chunking)


def test_linear_positions_loss_mse_sum():
    """Leading axes kept until the loss: MSE(sum) on ``[N, T, C]`` outputs."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    X, y = torch.randn(N, 2, 3, 3, dtype=DT), torch.randn(N, 2, 3, 2, dtype=DT)
    lossfunc = nn.MSELoss(reduction="sum")
    G = ggn_blocks(model, lossfunc, X, y)[0]
    check_exact(model, lossfunc, X, y, G, chunk_size=5)


# --------------------------------------------------------------------------- Conv
@st.composite
def conv_cases(draw: st.DrawFn, transpose: bool) -> dict:
    d = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.sampled_from([1, 2]))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    k = draw(st.integers(1, 3 if d < 3 else 2))
    stride = draw(st.sampled_from([1, 2]))
    dil = draw(st.sampled_from([1, 2]))
    kw: dict[str, Any] = {"stride": stride, "dilation": dil, "groups": groups}
    kw["bias"] = draw(st.booleans())
    span = dil * (k - 1) + 1
    if transpose:
        kw["padding"] = draw(st.integers(0, min(1, span - 1)))
        kw["output_padding"] = draw(st.integers(0, max(stride, dil) - 1))
        size = draw(st.integers(1, 3 if d < 3 else 2))
    else:
        mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
        pad = draw(st.sampled_from([0, 1, 2] + (["same"] if stride == 1 else [])))
        kw["padding"], kw["padding_mode"] = pad, mode
        size = span + draw(st.integers(0, 2 if d < 3 else 1))
        if isinstance(pad, int):
            size = max(size, pad + 1)  # reflect needs padding < size
    return {"d": d, "cin": cin, "cout": cout, "k": k, "kw": kw, "size": size}


def _conv(case: dict, transpose: bool) -> nn.Module:
    cls = {
        (False, 1): nn.Conv1d,
        (False, 2): nn.Conv2d,
        (False, 3): nn.Conv3d,
        (True, 1): nn.ConvTranspose1d,
        (True, 2): nn.ConvTranspose2d,
        (True, 3): nn.ConvTranspose3d,
    }[(transpose, case["d"])]
    return cls(case["cin"], case["cout"], case["k"], **case["kw"])


@SETTINGS
@given(case=conv_cases(transpose=False), chunking=CHUNKING, seed=st.integers(0, 2**16))
def test_conv(case, chunking, seed):
    torch.manual_seed(seed)
    X = torch.randn(N, case["cin"], *[case["size"]] * case["d"], dtype=DT)
    model = Head(_conv(case, False), X).to(DT)
    run_family(model, X, labels(N, seed=seed), chunking)


@SETTINGS
@given(case=conv_cases(transpose=True), chunking=CHUNKING, seed=st.integers(0, 2**16))
def test_conv_transpose(case, chunking, seed):
    torch.manual_seed(seed)
    X = torch.randn(N, case["cin"], *[case["size"]] * case["d"], dtype=DT)
    model = Head(_conv(case, True), X).to(DT)
    run_family(model, X, labels(N, seed=seed), chunking)


# --------------------------------------------------------------------------- Embedding
@SETTINGS
@given(
    t=st.integers(1, 4),
    vocab=st.integers(2, 5),
    padding=st.booleans(),
    chunking=CHUNKING,
    seed=st.integers(0, 2**16),
)
def test_embedding_repeated_tokens(t, vocab, padding, chunking, seed):
    torch.manual_seed(seed)
    X = torch.randint(0, vocab, (N, t))
    X[:, 0] = X[0, 0]  # a token repeated across samples
    if t > 1:
        X[0, 1] = X[0, 0]  # and within a sample
    layer = nn.Embedding(vocab, 2, padding_idx=int(X[1, -1]) if padding else None)
    model = Head(layer, X).to(DT)
    run_family(model, X, labels(N, seed=seed), chunking, loop=padding)


# --------------------------------------------------------------------------- normalisation
def _randomize(module: nn.Module) -> nn.Module:
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
}


def _norm_model(kind: str, seed: int) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(seed)
    make, shape = NORMS[kind]
    layer = _randomize(make())
    if isinstance(layer, nn.modules.batchnorm._BatchNorm):
        layer.running_mean.uniform_(-0.5, 0.5)
        layer.running_var.uniform_(0.5, 2.0)
    X = torch.randn(N, *shape, dtype=DT)
    model = Head(layer, X).to(DT).eval()
    return model, X


@pytest.mark.parametrize("kind", list(NORMS))
def test_norm(kind):
    model, X = _norm_model(kind, seed=3)
    run_family(model, X, labels(N, seed=3), {"chunk_size": 2})


# --------------------------------------------------------------------------- generic rule
class Custom(nn.Module):
    """Parameters used nonlinearly: ``sin(x W) ⊙ exp(s) + x``."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(i, i))
        self.s = nn.Parameter(0.3 * torch.randn(i))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x @ self.W) * self.s.exp() + x


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _generic(kind: str, seed: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    if kind == "mha":
        X: Any = torch.randn(N, 3, 4, dtype=DT)
        layer: nn.Module = Attention()
    elif kind == "bilinear":
        X = (torch.randn(N, 2, dtype=DT), torch.randn(N, 3, dtype=DT))
        layer = nn.Bilinear(2, 3, 2)
    else:
        X = torch.randn(N, 2, 3, dtype=DT)
        layer = Custom(3)
    return Head(layer, X).to(DT), X


@pytest.mark.parametrize("kind", ["mha", "bilinear", "custom"])
def test_generic(kind):
    model, X = _generic(kind, seed=4)
    run_family(model, X, labels(N, seed=4), {"memory_budget": 200})


# --------------------------------------------------------------------------- MC in expectation
def _mc_models() -> dict[str, Any]:
    def conv():
        torch.manual_seed(5)
        X = torch.randn(N, 2, 4, 4, dtype=DT)
        layer = nn.Conv2d(2, 2, 2, stride=2, groups=2, padding=1, padding_mode="reflect")
        return Head(layer, X).to(DT), X

    def convt():
        torch.manual_seed(6)
        X = torch.randn(N, 2, 3, dtype=DT)
        return Head(nn.ConvTranspose1d(2, 2, 2, stride=2, dilation=2), X).to(DT), X

    def linear():
        torch.manual_seed(7)
        X = torch.randn(N, 2, 3, dtype=DT)
        return Head(nn.Linear(3, 2), X).to(DT), X

    def embedding():
        torch.manual_seed(8)
        X = torch.tensor([[1, 1, 3], [1, 0, 2]])
        return Head(nn.Embedding(4, 2), X).to(DT), X

    return {
        "linear": linear,
        "conv": conv,
        "convt": convt,
        "embedding": embedding,
        "layernorm": lambda: _norm_model("layernorm", 9),
        "groupnorm": lambda: _norm_model("groupnorm", 9),
        "rmsnorm": lambda: _norm_model("rmsnorm", 9),
        "batchnorm2d": lambda: _norm_model("batchnorm2d", 9),
        "mha": lambda: _generic("mha", 10),
        "bilinear": lambda: _generic("bilinear", 10),
        "custom": lambda: _generic("custom", 10),
    }


@pytest.mark.parametrize("kind", list(_mc_models()))
def test_mc_in_expectation(kind):
    model, X = _mc_models()[kind]()
    y = labels(N, seed=11)
    lossfunc = nn.CrossEntropyLoss()
    G = ggn_blocks(model, lossfunc, X, y)[0]
    check_mc(model, lossfunc, X, y, G)


# --------------------------------------------------------------------------- KFLR exact limit
@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["linear", "conv1d", "conv2d", "conv3d", "embedding"]),
    k=st.integers(1, 2),
    dil=st.integers(1, 2),
    stride=st.integers(1, 2),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kflr_exact_limit(kind, k, dil, stride, bias, seed):
    torch.manual_seed(seed)
    if kind == "linear":
        X: Tensor = torch.randn(1, 1, 3, dtype=DT)  # a leading axis of size 1
        layer: nn.Module = nn.Linear(3, 2, bias=bias)
    elif kind == "embedding":
        X = torch.tensor([[2]])
        layer = nn.Embedding(4, 3)
    else:
        d = int(kind[-2])
        cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1]
        X = torch.randn(1, 2, *[dil * (k - 1) + 1] * d, dtype=DT)  # one output position
        layer = cls(2, 2, k, stride=stride, dilation=dil, bias=bias)
    model = Head(layer, X).to(DT)
    check_kflr_exact(model, nn.CrossEntropyLoss(), X, labels(1, seed=seed))


# --------------------------------------------------------------------------- many classes
def test_thousand_classes_many_chunks():
    """C = 1000 exact columns through a small ``memory_budget`` (≥ 20 chunks): equal to the
    unchunked result, and to the reference on a subset of entries (per-sample looped
    Jacobians restricted to those entries, Hessian of the loss w.r.t. the logits)."""
    torch.manual_seed(12)
    classes, n = 1000, 2
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, classes)).to(DT)
    lossfunc = nn.CrossEntropyLoss()
    X, y = torch.randn(n, 3, dtype=DT), labels(n, classes, seed=12)
    extend(model), extend(lossfunc)
    per_col = (4 + classes) * n * 8  # bytes of the captured outputs per column
    exts = (DiagGGNExact(), BatchDiagGGNExact())
    backward(model, lossfunc, X, y, *exts, memory_budget=per_col * 40)
    chunked = [gather(model, a, k) for a, k in (("diag_ggn_exact", 0), ("diag_ggn_exact_batch", 1))]
    backward(model, lossfunc, X, y, *exts)
    full = [gather(model, a, k) for a, k in (("diag_ggn_exact", 0), ("diag_ggn_exact_batch", 1))]
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-12)

    # reference on a subset: all first-layer entries, a few rows of the head, some biases
    sizes = [p.numel() for p in model.parameters()]
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    idx = torch.cat(
        [
            torch.arange(offsets[2]),  # first layer
            offsets[2] + torch.tensor([0, 1, 4 * int(y[0]), 4 * int(y[0]) + 3, 4 * 999 + 2]),
            offsets[3] + torch.tensor([0, int(y[1]), 500, 999]),
        ]
    )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    shapes = [p.shape for p in model.parameters()]
    names = [k for k, _ in model.named_parameters()]
    with torch.no_grad():
        logits = model(X)
    ref = []
    for i in range(n):

        def f(sub: Tensor, i: int = i) -> Tensor:
            theta = flat.index_put((idx,), sub)
            p = {k: t.reshape(s) for k, t, s in zip(names, torch.split(theta, sizes), shapes)}
            return functional_call(model, p, (X[i : i + 1],))[0]

        J = jacrev(f)(flat[idx])  # [C, |idx|]
        H = hessian(lambda o, i=i: lossfunc(torch.cat([logits[:i], o[None], logits[i + 1 :]]), y))(
            logits[i]
        )
        ref.append(torch.einsum("cp,cd,dp->p", J, H, J))
    ref_batch = torch.stack(ref)
    torch.testing.assert_close(full[1][:, idx], ref_batch, **TOL)
    torch.testing.assert_close(full[0][idx], ref_batch.sum(0), **TOL)


def test_memory_budget_counts_per_sample_gradients(monkeypatch):
    """The column chunk leaves room for the per-sample gradients the rules build from it: with
    tied embeddings every column carries an ``[N, V, d]`` gradient of the shared matrix (a
    2048-token decoder overran a 512 MiB budget 23-fold before). Chunked results are equal."""
    from backprism.engine import backward as engine_backward
    from common import TinyGPT

    chunks: list[int] = []
    real = engine_backward.backprop_columns

    def spy(origins, cols, outputs, chunk):
        chunks.append(chunk)
        yield from real(origins, cols, outputs, chunk)

    torch.manual_seed(3)
    vocab, d, t, n = 40, 64, 1, 2  # the tied [V, d] matrix outweighs all outputs
    model = TinyGPT(vocab=vocab, d=d, t_max=t).to(DT)
    lossfunc = nn.CrossEntropyLoss()
    X = torch.randint(0, vocab, (n, t))
    y = torch.randint(0, vocab, (n, t))
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, DiagGGNExact())
    full = gather(model, "diag_ggn_exact", 0)
    budget = 2**16
    monkeypatch.setattr(engine_backward, "backprop_columns", spy)
    backward(model, lossfunc, X, y, DiagGGNExact(), memory_budget=budget)
    assert chunks and max(chunks) * n * vocab * d * 8 <= budget  # the tied matrix's share
    assert max(chunks) < vocab * t  # K = C·T columns per sample: several chunks
    torch.testing.assert_close(gather(model, "diag_ggn_exact", 0), full, atol=1e-13, rtol=1e-10)
