"""Second-order extensions on modern architectures, end to end through ``extend``/``collect``.

Architectures: a residual CNN block (Conv2d, BatchNorm2d in eval mode, 1×1-conv skip), an
``nn.TransformerEncoderLayer(batch_first=True, dropout=0)`` classifier and a GPT-style decoder
with tied input/output embeddings (token + position embeddings with positions expanded to
``[N, T]``, causal MHA, GELU MLP, LayerNorms) trained with CrossEntropy on ``[N, C, T]`` logits
— the per-sample loss Hessian is block-diagonal over positions and the engine pushes
``K = C·T`` exact columns — and the same decoder with flattened ``[N·T, C]`` logits
(rows are positions of samples, sample-major).

References are dense float64 GGN blocks from ``tests/reference.py::ggn_blocks``
(``functional_call`` ties the shared embedding, so the tied parameter's reference sums both
uses per sample before squaring). Exact quantities to 1e-9; MC in expectation: the result is the
mean of the i.i.d. draws ``M·V[m]²`` of ``SqrtGGNMC(M)`` (same columns) and within 6 standard
errors + 1e-10 of the reference. KFLR/KFAC: factor shapes for every parameter of the supported
layers (Linear, Conv, Embedding) and a clear error for the others.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from backprism import extend
from backprism.extensions import (
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
)
from tests.common import (
    Encoder,
    ResNetBlock,
    TinyGPT,
    assert_mc_within,
    backward,
    expected_kronecker_shapes,
    freeze_kronecker_unsupported,
    gather,
    trainable,
)
from tests.reference import diag_blocks, ggn_blocks

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")
DT = torch.float64
N = 2
M = 1000
TOL = {"atol": 1e-9, "rtol": 1e-9}
VOCAB, T = 5, 3


def build(name: str, seed: int = 0) -> tuple[nn.Module, nn.Module, Tensor, Tensor, Any]:
    """``model, lossfunc, X, y, ref_loss`` (``ref_loss`` acts on the per-sample-stacked
    outputs that ``ggn_blocks`` produces)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    lossfunc = nn.CrossEntropyLoss()
    ref_loss = lossfunc
    if name == "resnet":
        model = ResNetBlock(out_act="tanh").to(DT).eval()
        X, y = torch.randn(N, 2, 3, 3, dtype=DT), torch.randint(0, 3, (N,), generator=g)
    elif name == "transformer":
        model = Encoder().to(DT)
        X, y = torch.randn(N, 3, 4, dtype=DT), torch.randint(0, 3, (N,), generator=g)
    else:
        model = TinyGPT(vocab=VOCAB, t_max=T, flat=name == "gpt_flat").to(DT)
        X = torch.randint(0, VOCAB, (N, T), generator=g)
        X[1, 2] = X[1, 0] = X[0, 1]  # repeated tokens within and across samples
        y = torch.randint(0, VOCAB, (N, T), generator=g)
        if name == "gpt_flat":
            y = y.flatten()

            def ref_loss(o: Tensor, y: Tensor) -> Tensor:  # o: [N, T, V] stacked per sample
                return lossfunc(o.reshape(-1, VOCAB), y)

    return model, lossfunc, X, y, ref_loss


NAMES = ["resnet", "transformer", "gpt", "gpt_flat"]


# ------------------------------------------------------------------------------------------ helpers
# -------------------------------------------------------------------------------------------- exact
@pytest.mark.parametrize("chunking", [{}, {"chunk_size": 4}])
@pytest.mark.parametrize("name", NAMES)
def test_exact(name, chunking):
    model, lossfunc, X, y, ref_loss = build(name)
    G = ggn_blocks(model, ref_loss, X, y)[0]
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), **chunking)
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **TOL
    )
    torch.testing.assert_close(gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **TOL)
    V = gather(model, "sqrt_ggn_exact", 2)
    if name.startswith("gpt"):
        assert V.shape[0] == VOCAB * T  # K = C·T exact columns
    for n in range(N):
        torch.testing.assert_close(V[:, n].T @ V[:, n], G[n, n], **TOL)


def test_tied_embedding_is_not_a_sum_of_squares():
    """The tied weight's diagonal squares the per-sample *sum* of both uses: it differs from the
    sum of the diagonals the two uses would get separately (so summing squares is wrong)."""
    model, lossfunc, X, y, _ = build("gpt")
    G = ggn_blocks(model, lossfunc, X, y)[0]
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, DiagGGNExact())
    ref = torch.diagonal(G.sum((0, 1)))[: VOCAB * 4].reshape(VOCAB, 4)
    torch.testing.assert_close(model.tok.weight.diag_ggn_exact, ref, **TOL)
    # untie: separate copies, same values; the squares of separate uses do not add up to ref
    untied = TinyGPT(vocab=VOCAB, t_max=T).to(DT)
    untied.load_state_dict(model.state_dict())
    untied.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    Gu = ggn_blocks(untied, lossfunc, X, y)[0]
    du = torch.diagonal(Gu.sum((0, 1)))
    names = [k for k, _ in trainable(untied)]
    sizes = [p.numel() for _, p in trainable(untied)]
    parts = dict(zip(names, torch.split(du, sizes)))
    separate = parts["tok.weight"] + parts["head.weight"]
    assert not torch.allclose(separate.reshape(VOCAB, 4), ref, atol=1e-6)


# ----------------------------------------------------------------------------------------------- MC
@pytest.mark.parametrize("name", NAMES)
def test_mc_in_expectation(name):
    model, lossfunc, X, y, ref_loss = build(name, seed=1)
    G = ggn_blocks(model, ref_loss, X, y)[0]
    extend(model), extend(lossfunc)
    torch.manual_seed(0)
    backward(model, lossfunc, X, y, DiagGGNMC(M), BatchDiagGGNMC(M), SqrtGGNMC(M))
    V = gather(model, "sqrt_ggn_mc", 2)
    assert V.shape[:2] == (M, N)
    per = V.square() * M
    assert_mc_within(gather(model, "diag_ggn_mc", 0), per.sum(1), torch.diagonal(G.sum((0, 1))))
    assert_mc_within(gather(model, "diag_ggn_mc_batch", 1), per, diag_blocks(G))


@pytest.mark.parametrize("ext", [KFLR, KFAC])
@pytest.mark.parametrize("name", NAMES)
def test_kronecker_shapes(name, ext):
    model, lossfunc, X, y, _ = build(name, seed=2)
    freeze_kronecker_unsupported(model)
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, ext())
    field = ext.savefield
    expected = expected_kronecker_shapes(model)
    assert expected
    for key, p in trainable(model):
        factors = getattr(p, field)
        assert [tuple(f.shape) for f in factors] == expected[key], key
        for f in factors:
            assert torch.isfinite(f).all()
            torch.testing.assert_close(f, f.T)


@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_kronecker_factors_for_every_parameter(name):
    """Norm layers no longer stop KFLR: every parameter gets factors — ``[B, A]``/``[B]`` for
    Linear-like and Conv layers, one diagonal factor for elementwise parameters, equal to the
    exact GGN diagonal (tests/extensions/test_kronecker_norms.py checks them in detail)."""
    model, lossfunc, X, y, _ = build(name, seed=2)
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, KFLR(), DiagGGNExact())
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert 1 <= len(p.kflr) <= 2, pname
        if len(p.kflr) == 1 and p.kflr[0].shape[0] == p.numel() and p.dim() == 1:
            diag = torch.diagonal(p.kflr[0])
            if not torch.equal(p.kflr[0], torch.diag(diag)):
                continue  # a bias's full [B] block, not the diagonal form
            torch.testing.assert_close(diag, p.diag_ggn_exact.reshape(-1), **TOL)


def test_kflr_tied_chunk_invariant():
    """KFLR of the tied embedding (two calls, different factor roles) must not depend on how
    the exact columns are chunked."""
    model, lossfunc, X, y, _ = build("gpt", seed=3)
    freeze_kronecker_unsupported(model)
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, KFLR())
    full = [f.clone() for f in model.tok.weight.kflr]
    backward(model, lossfunc, X, y, KFLR(), chunk_size=2)
    for a, b in zip(model.tok.weight.kflr, full):
        torch.testing.assert_close(a, b, **TOL)
