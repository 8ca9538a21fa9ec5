"""Rule for ``nn.Embedding`` (``backprism.rules.embedding``) against dense float64 references
from ``torch.func``.

Rule level: every rule method against per-sample vector-Jacobian products of the module's own
forward (``tests.common.check_rule``: ``vmap`` over samples and columns of ``vjp``, random
cotangents for ``M = 3`` columns and random signed column weights), Kronecker factors, padding
and repeated tokens, unsupported options. End to end: the first-order extensions on an
Embedding → LayerNorm → Linear sequence model (padded embeddings against a per-sample loop,
since ``vmap``'s batching rule masks ``padding_idx`` for the first sample only), KFLR in its
exact limit, and the exact GGN extensions on ``Embedding → tanh → Linear`` with tokens repeated
within and across samples (``tests/reference.py::ggn_blocks``, looped where padding is used).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import backprism
from backprism.engine.rule import get_rule
from tests.common import (
    CHUNKING,
    RULE_COLUMNS,
    RULE_SETTINGS,
    SETTINGS,
    Head,
    SequenceModel,
    check_first_order_e2e,
    check_rule,
    close,
    labels,
    make_call,
    randomize,
    run_family,
)

DT = torch.float64
N = 2  # batch of the second-order family tests


@st.composite
def embedding_cases(draw):
    n = draw(st.integers(1, 3))
    positions = draw(st.lists(st.integers(1, 3), max_size=2))
    vocab = draw(st.integers(2, 5))
    dim = draw(st.integers(1, 3))
    padding = draw(st.one_of(st.none(), st.integers(-vocab, vocab - 1)))
    seed = draw(st.integers(0, 2**16))
    return n, positions, vocab, dim, padding, seed


def _embedding(n, positions, vocab, dim, padding, seed) -> tuple[nn.Embedding, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    module = nn.Embedding(vocab, dim, padding_idx=padding).double()
    idx = torch.randint(0, vocab, (n, *positions), generator=gen)
    if padding is not None and idx.numel() > 1:
        idx.view(-1)[0] = padding % vocab  # make sure a padding position occurs
    return module, idx


@RULE_SETTINGS
@given(embedding_cases())
def test_embedding_rule(case):
    module, idx = _embedding(*case)
    check_rule(module, idx, case[-1])


def test_embedding_repeated_tokens_and_padding():
    """All positions hold the same token or padding: per-sample sums before squaring."""
    module = nn.Embedding(4, 2, padding_idx=1).double()
    idx = torch.tensor([[2, 2, 2, 1], [1, 1, 1, 1], [3, 2, 3, 2]])
    check_rule(module, idx, 0)
    call, shape = make_call(module, idx)
    g = torch.randn(RULE_COLUMNS, *shape, dtype=torch.float64)
    ps = get_rule(module).per_sample(call, g)["weight"]
    assert ps[:, :, 1].abs().max() == 0  # the padding row gets no gradient
    close(ps[:, 0, 2], g[:, 0, :3].sum(1))
    assert ps[:, 1].abs().max() == 0  # a sample made only of padding


@RULE_SETTINGS
@given(embedding_cases())
def test_embedding_kronecker_factors(case):
    module, idx = _embedding(*case)
    n, _, vocab, dim, padding, seed = case
    call, shape = make_call(module, idx)
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(RULE_COLUMNS, *shape, generator=gen, dtype=torch.float64)
    a, b = get_rule(module).kronecker_factors(call, g)["weight"]
    onehot = nn.functional.one_hot(idx.reshape(-1), vocab).double()  # [N·T, V]
    gf = g.reshape(RULE_COLUMNS, -1, dim)
    if padding is not None:
        mask = (idx.reshape(-1) != padding % vocab).double()
        onehot = onehot * mask[:, None]
        gf = gf * mask[None, :, None]
    close(a, torch.einsum("pu,pv->uv", onehot, onehot) / n)
    close(b, torch.einsum("mpd,mpe->de", gf, gf))
    assert a.shape == (vocab, vocab) and b.shape == (dim, dim)


def test_embedding_kflr_exact_for_one_token():
    """One sample, one position: ``A_tokens ⊗ B`` is the exact GGN block of the weight."""
    pytest.importorskip("backprism.extensions.kronecker")
    from backprism.extensions.kronecker import KFLR
    from tests.reference import ggn

    model = randomize(nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 5)).double(), 4)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.tensor([2]), torch.tensor([1])
    block = ggn(model, loss_fn, x, y)[:12, :12]
    backprism.extend(model)
    backprism.extend(loss_fn)
    with backprism.collect(KFLR(), chunk_size=2):  # B summed over 3 chunks, A_tokens once
        loss_fn(model(x), y).backward()
    a, b = model[0].weight.kflr
    close(a, torch.diag(torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)))
    close(torch.kron(a, b), block)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_norm": 1.0}, "max_norm"), ({"scale_grad_by_freq": True}, "scale_grad_by_freq")],
)
def test_embedding_unsupported_options(kwargs, match):
    module = nn.Embedding(5, 2, **kwargs).double()
    idx = torch.tensor([[0, 1], [1, 1]])
    call, shape = make_call(module, idx)
    g = torch.randn(1, *shape, dtype=torch.float64)
    rule = get_rule(module)
    for method in (rule.per_sample, rule.batch_l2, rule.sum_squared, rule.batch_dot):
        with pytest.raises(NotImplementedError, match=match):
            method(call, g)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_sequence_model_end_to_end(reduction, padding_idx):
    torch.manual_seed(0)
    model = randomize(SequenceModel(5, 3, 4, padding_idx).double(), 0)
    x = torch.tensor([[0, 2, 2, 4], [1, 1, 0, 0], [3, 2, 3, 3]])
    y = torch.tensor([0, 3, 1])
    check_first_order_e2e(model, nn.CrossEntropyLoss(reduction=reduction), x, y)


def test_sequence_model_batch_size_one():
    model = randomize(SequenceModel(4, 2, 3, 1).double(), 1)
    x = torch.tensor([[1, 2, 2, 3, 1]])
    check_first_order_e2e(model, nn.CrossEntropyLoss(), x, torch.tensor([2]))


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
