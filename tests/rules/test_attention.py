"""``nn.MultiheadAttention`` through its own rule (Linear closed forms per projection) against
dense float64 ``torch.func`` references, and the generic rule's fallback warning.

Covered: self- and cross-attention, packed ``in_proj_weight`` and separate ``q/k/v_proj_weight``
(``kdim``/``vdim``), with and without biases, ``add_bias_kv``, ``add_zero_attn``, every mask
(2-d bool / float, per-sample 3-d, key padding, ``is_causal``), ``need_weights`` with averaged and
per-head weights used in the loss, frozen parameters; first-order statistics, exact GGN
diagonals (also per sample), GGN square roots and KFLR factors; columns ``M > 1`` through every
rule method against autograd; transformer layers (encoder and decoder with cross-attention).

References: ``reference.per_sample_grads`` (a parameter copy per sample, ``vmap``) and
``reference.ggn_blocks`` (``Jᵀ H J`` with per-sample parameter copies).
"""

from __future__ import annotations

import copy
import warnings
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine.rule import Call, get_rule
from backprism.extensions import (
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from backprism.rules import generic
from backprism.rules.attention import MultiheadAttentionRule
from tests.common import TinyGPT, check_rule_statistics, first_order_expected
from tests.reference import diag_blocks, ggn_blocks, per_sample_grads, split

DT = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-11}
FIRST = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad)


class Attn(nn.Module):
    """One attention layer and a linear head; the attention weights enter the output when
    returned. ``mask``: none, bool2d (causal, bool), float2d, per_sample3d, key_padding,
    causal (``is_causal=True`` with its mask)."""

    def __init__(
        self, e: int = 4, heads: int = 2, kdim: int | None = None, bias: bool = True,
        bias_kv: bool = False, zero_attn: bool = False, mask: str = "none",
        weights: str = "none", classes: int = 3,
    ) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(
            e, heads, batch_first=True, kdim=kdim, vdim=kdim, bias=bias, add_bias_kv=bias_kv,
            add_zero_attn=zero_attn,
        )
        self.head = nn.Linear(e, classes)
        self.mask, self.weights = mask, weights

    def forward(self, x: Tensor, mem: Tensor, kpm: Tensor, mask3: Tensor) -> Tensor:
        length, src = x.shape[1], mem.shape[1]
        kw: dict = {"need_weights": self.weights != "none"}
        if self.weights == "per_head":
            kw["average_attn_weights"] = False
        if self.mask in ("bool2d", "causal"):
            kw["attn_mask"] = torch.triu(torch.ones(length, src, dtype=torch.bool), 1)
            kw["is_causal"] = self.mask == "causal"
        elif self.mask == "float2d":
            kw["attn_mask"] = torch.linspace(-1, 1, length * src, dtype=x.dtype).view(length, src)
        elif self.mask == "per_sample3d":
            kw["attn_mask"] = mask3.reshape(-1, length, src)
        elif self.mask == "key_padding":
            kw["key_padding_mask"] = kpm
        out, w = self.attn(x, mem, mem, **kw)
        y = self.head(out.tanh().mean(1))
        if w is not None:
            y = y + w.square().flatten(1).sum(1, keepdim=True).sin()
        return y


CASES = {
    "self": {},
    "self_nobias": {"bias": False},
    "self_causal": {"mask": "causal"},
    "self_bool2d_weights": {"mask": "bool2d", "weights": "mean"},
    "self_kv_zero_float2d": {"bias_kv": True, "zero_attn": True, "mask": "float2d"},
    "self_key_padding_per_head": {"mask": "key_padding", "weights": "per_head"},
    "cross_packed_3d": {"cross": True, "mask": "per_sample3d"},
    "cross_kdim": {"cross": True, "kdim": 3, "weights": "mean"},
    "cross_kdim_kv_padding": {"cross": True, "kdim": 3, "bias_kv": True, "mask": "key_padding"},
    "cross_kdim_zero_nobias": {"cross": True, "kdim": 3, "zero_attn": True, "bias": False},
}


def _make(case: str, n: int = 3, length: int = 3, src: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    cfg = dict(CASES[case])
    cross = cfg.pop("cross", False)
    if not cross:
        src = length
    e, heads = 4, 2
    model = Attn(e, heads, **cfg).to(DT)
    x = torch.randn(n, length, e, dtype=DT)
    kdim = cfg.get("kdim") or e
    mem = torch.randn(n, src, kdim, dtype=DT) if cross else x
    kpm = torch.zeros(n, src, dtype=torch.bool)
    kpm[:, -1] = torch.arange(n) % 2 == 0  # one padded key in every other sample
    mask3 = torch.randn(n, heads, length, src, dtype=DT)
    y = torch.randint(0, 3, (n,))
    return model, (x, mem, kpm, mask3), y


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _run(model: nn.Module, X: tuple, y: Tensor, *exts, reduction: str = "mean") -> nn.Module:
    lossfunc = extend(nn.CrossEntropyLoss(reduction=reduction))
    extend(model)
    model.zero_grad()
    with collect(*exts):
        lossfunc(model(*X), y).backward()
    return lossfunc


@pytest.mark.parametrize("case", list(CASES))
def test_first_order(case: str):
    model, X, y = _make(case)
    assert type(get_rule(model.attn)) is MultiheadAttentionRule
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", generic.GenericRuleWarning)  # no generic fallback
        _run(model, X, y, *(e() for e in FIRST))
    for name, p in model.named_parameters():
        for field, value in first_order_expected(ref[name]).items():
            torch.testing.assert_close(getattr(p, field), value, **TOL, msg=f"{name}.{field}")
        torch.testing.assert_close(p.grad, ref[name].sum(0), **TOL)


@pytest.mark.parametrize("case", ["self_kv_zero_float2d", "cross_kdim", "self_bool2d_weights"])
def test_exact_ggn(case: str):
    """DiagGGNExact, BatchDiagGGNExact and SqrtGGNExact (``Σ VVᵀ`` = GGN block)."""
    model, X, y = _make(case, n=2, length=2, src=3)
    G, _, sizes = ggn_blocks(model, nn.CrossEntropyLoss(), X, y)
    diag = split(torch.diagonal(G.sum((0, 1))), model)
    batch = split(diag_blocks(G), model, lead=1)
    _run(model, X, y, DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact())
    full = G.sum((0, 1))
    start = 0
    for (name, p), size in zip(trainable(model).items(), sizes):
        torch.testing.assert_close(p.diag_ggn_exact, diag[name], **TOL, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, batch[name], **TOL, msg=name)
        v = p.sqrt_ggn_exact.flatten(2).flatten(0, 1)  # [K·N, P]
        block = full[start : start + size, start : start + size]
        torch.testing.assert_close(v.t() @ v, block, **TOL, msg=name)
        start += size


def _ggn_blocks(model: nn.Module, X: tuple, y: Tensor) -> dict[str, Tensor]:
    """The exact GGN's diagonal block of every trainable parameter, by name (dense)."""
    G, _, sizes = ggn_blocks(model, nn.CrossEntropyLoss(), X, y)
    full, blocks, start = G.sum((0, 1)), {}, 0
    for name, size in zip(trainable(model), sizes):
        blocks[name] = full[start : start + size, start : start + size]
        start += size
    return blocks


def test_kflr_factors():
    """Self-attention: ``in_proj_weight ≈ B ⊗ A`` with ``A = (1/N) Σ xxᵀ`` over the query
    positions and ``B`` the exact GGN block of ``in_proj_bias`` (the Linear convention); the
    same for ``out_proj`` with the attention output ``o``; ``bias_k``/``bias_v`` get their GGN
    block."""
    torch.manual_seed(3)
    n, t, e = 3, 3, 4
    model = Attn(e, 2, bias_kv=True).to(DT)
    x = torch.randn(n, t, e, dtype=DT)
    X = (x, x, torch.zeros(n, t, dtype=torch.bool), torch.zeros(n, 2, t, t, dtype=DT))
    y = torch.randint(0, 3, (n,))
    blocks = _ggn_blocks(model, X, y)
    _run(model, X, y, KFLR())
    a = model.attn
    B, A = a.in_proj_weight.kflr
    torch.testing.assert_close(A, x.reshape(-1, e).t() @ x.reshape(-1, e) / n, **TOL)
    torch.testing.assert_close(B, blocks["attn.in_proj_bias"], **TOL)
    torch.testing.assert_close(a.in_proj_bias.kflr[0], blocks["attn.in_proj_bias"], **TOL)
    torch.testing.assert_close(a.out_proj.weight.kflr[0], blocks["attn.out_proj.bias"], **TOL)
    for k in ("bias_k", "bias_v"):
        torch.testing.assert_close(getattr(a, k).kflr[0], blocks[f"attn.{k}"], **TOL)
    # the attention output o (input of out_proj) from the module's own computation
    with torch.no_grad():  # out_proj is used functionally: its input o by hand
        q, k, v = nn.functional.linear(x, a.in_proj_weight, a.in_proj_bias).chunk(3, -1)
        k = torch.cat([k, a.bias_k.expand(n, 1, e)], 1)
        v = torch.cat([v, a.bias_v.expand(n, 1, e)], 1)
        heads = [z.view(n, -1, 2, 2).transpose(1, 2) for z in (q, k, v)]
        att = torch.softmax(heads[0] @ heads[1].transpose(-1, -2) / 2**0.5, -1) @ heads[2]
        oo = att.transpose(1, 2).reshape(-1, e)
    torch.testing.assert_close(a.out_proj.weight.kflr[1], oo.t() @ oo / n, **TOL)


@pytest.mark.parametrize("ext", [KFLR, KFAC])
def test_kronecker_packed_cross_attention(ext: type) -> None:
    """Cross-attention's packed ``in_proj_weight``: block-diagonal over the query, key and
    value rows, ``[B_g, A_g]`` ``[3, E, E]``: ``B_g[i]`` the diagonal blocks of the bias's
    ``B`` — for KFLR the exact GGN block of ``in_proj_bias`` (dense reference) — and ``A_g[i]``
    ``(1/N) Σ xxᵀ`` of the projection's input (query, or the memory for key and value)."""
    model, X, y = _make("cross_packed_3d")
    x, mem = X[0], X[1]
    n, e = x.shape[0], x.shape[-1]
    blocks = _ggn_blocks(model, X, y)
    _run(model, X, y, ext())
    a = model.attn
    field = ext.savefield
    B, A = getattr(a.in_proj_weight, field)
    assert B.shape == A.shape == (3, e, e)
    (Bb,) = getattr(a.in_proj_bias, field)
    for i, inp in enumerate((x, mem, mem)):
        rows = slice(i * e, (i + 1) * e)
        z = inp.reshape(-1, e)
        torch.testing.assert_close(A[i], z.t() @ z / n, **TOL)
        torch.testing.assert_close(B[i], Bb[rows, rows], **TOL)
    if ext is KFLR:
        torch.testing.assert_close(Bb, blocks["attn.in_proj_bias"], **TOL)


def test_frozen_parameters_and_sum_reduction():
    model, X, y = _make("cross_kdim_kv_padding")
    model.attn.k_proj_weight.requires_grad_(False)
    model.attn.out_proj.bias.requires_grad_(False)
    ref = per_sample_grads(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    _run(model, X, y, BatchGrad(), BatchL2Grad(), reduction="sum")
    assert not hasattr(model.attn.k_proj_weight, "grad_batch")
    assert not hasattr(model.attn.out_proj.bias, "grad_batch")
    for name, p in trainable(model).items():
        torch.testing.assert_close(p.grad_batch, ref[name], **TOL, msg=name)
        torch.testing.assert_close(p.batch_l2, ref[name].flatten(1).square().sum(1), **TOL)


def test_subsampling():
    model, X, y = _make("self_bool2d_weights", n=4)
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    _run(model, X, y, BatchGrad(subsampling=[3, 1]))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[name][[3, 1]], **TOL, msg=name)


# -- columns M > 1 through every rule method -------------------------------------------------
@pytest.mark.parametrize("case", ["self_bool2d_weights", "self_key_padding_per_head",
                                  "cross_kdim_kv_padding", "self_kv_zero_float2d"])
def test_rule_columns(case: str):
    """``Vₘₙ = Jₙᵀ g[m, n]`` for ``M = 3`` random columns on every output (the attention
    weights too), by autograd on each sample alone; then every statistic from them."""
    model, X, _ = _make(case, n=3)
    module = model.attn
    x, mem, kpm, _ = X
    n, length = x.shape[:2]
    kwargs: dict = {"need_weights": model.weights != "none"}
    if model.weights == "per_head":
        kwargs["average_attn_weights"] = False
    if model.mask == "bool2d":
        kwargs["attn_mask"] = torch.triu(torch.ones(length, mem.shape[1], dtype=torch.bool), 1)
    elif model.mask == "float2d":
        kwargs["attn_mask"] = torch.linspace(-1, 1, length * length, dtype=DT).view(length, -1)
    elif model.mask == "key_padding":
        kwargs["key_padding_mask"] = kpm

    def one(i: int) -> list[Tensor]:
        kw = dict(kwargs)
        if "key_padding_mask" in kw:
            kw["key_padding_mask"] = kpm[i : i + 1]
        out = module(x[i : i + 1], mem[i : i + 1], mem[i : i + 1], **kw)
        return [o for o in out if o is not None]

    with torch.no_grad():
        full = [o for o in module(x, mem, mem, **kwargs) if o is not None]
    m = 3
    g = tuple(torch.randn(m, *o.shape, dtype=DT) for o in full)
    params = dict(module.named_parameters())
    call = Call(
        module=module, args=(x, mem, mem), kwargs=kwargs, out_shapes=[o.shape for o in full],
        batch_size=n, training=module.training, params=params,
    )
    gg = g if len(g) > 1 else g[0]
    rule = MultiheadAttentionRule()
    ref = {k: torch.zeros(m, n, *p.shape, dtype=DT) for k, p in params.items()}
    for i in range(n):
        outs = one(i)
        for k in range(m):
            cot = [gj[k, i : i + 1] for gj in g]
            grads = torch.autograd.grad(outs, list(params.values()), cot, retain_graph=True)
            for name, gr in zip(params, grads):
                ref[name][k, i] = gr
    w = torch.rand(m, n, dtype=DT) - 0.3  # signed weights, as DiagHessian's residuals
    vec = {k: torch.randn_like(p) for k, p in params.items()}
    check_rule_statistics(rule, call, gg, ref, w, vec, **TOL)


# -- whole transformer layers ----------------------------------------------------------------
class Seq2Seq(nn.Module):
    """An encoder layer on the source and a decoder layer (causal self-attention, cross-attention
    to the encoder output) on the target, classifying the mean decoder state."""

    def __init__(self, d: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(d, heads, 8, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(d, heads, 8, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        t = tgt.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=tgt.dtype)
        h = self.dec(tgt, self.enc(src), tgt_mask=mask, tgt_is_causal=True)
        return self.head(h.mean(1))


def test_transformer_layers_first_order_and_ggn():
    torch.manual_seed(5)
    model = Seq2Seq().to(DT)
    X = (torch.randn(2, 3, 4, dtype=DT), torch.randn(2, 2, 4, dtype=DT))
    _check_first_order_and_ggn(model, X, torch.randint(0, 3, (2,)))


def _check_first_order_and_ggn(model: nn.Module, X: tuple, y: Tensor) -> None:
    """BatchGrad, BatchL2Grad, Variance and DiagGGNExact of one pass (no generic fallback)
    against ``torch.func`` per-sample gradients and the dense GGN."""
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    G, _, _ = ggn_blocks(model, nn.CrossEntropyLoss(), X, y)
    diag = split(torch.diagonal(G.sum((0, 1))), model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", generic.GenericRuleWarning)
        _run(model, X, y, BatchGrad(), BatchL2Grad(), Variance(), DiagGGNExact())
    for name, p in model.named_parameters():
        exp = first_order_expected(ref[name])
        for field in ("grad_batch", "batch_l2", "variance"):
            torch.testing.assert_close(getattr(p, field), exp[field], **TOL, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact, diag[name], **TOL, msg=name)


def _check_same_graph(model: nn.Module, X: tuple, y: Tensor) -> None:
    """First-order statistics (no generic fallback) against the gradients of each sample's loss
    term through the same forward graph — the reference for random forwards (dropout)."""
    lossfunc = extend(nn.CrossEntropyLoss())
    extend(model)
    out = model(*X)
    terms = nn.functional.cross_entropy(out, y, reduction="none") / y.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", generic.GenericRuleWarning)
        with collect(BatchGrad(), BatchL2Grad(), Variance()):
            lossfunc(out, y).backward(retain_graph=True)
    for name, p in trainable(model).items():
        ref = torch.stack([torch.autograd.grad(t, p, retain_graph=True)[0] for t in terms])
        exp = first_order_expected(ref)
        for field in ("grad_batch", "batch_l2", "variance"):
            torch.testing.assert_close(getattr(p, field), exp[field], **TOL, msg=name)


def test_tiny_gpt_tied_embeddings():
    """Causal self-attention in a decoder with tied embeddings (dense path for the tied
    weight), token-level cross-entropy."""
    torch.manual_seed(6)
    model = TinyGPT(vocab=5, d=4, heads=2, t_max=4).to(DT)
    x, y = torch.randint(0, 5, (3, 4)), torch.randint(0, 5, (3, 4))
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    _run(model, (x,), y, BatchGrad(), SumGradSquared(), BatchL2Grad())
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        exp = first_order_expected(ref[name])
        for field in ("grad_batch", "sum_grad_squared", "batch_l2"):
            torch.testing.assert_close(getattr(p, field), exp[field], **TOL, msg=name)


# -- what goes to the generic rule -----------------------------------------------------------
@pytest.mark.parametrize("case", ["self", "self_bool2d_weights", "self_key_padding_per_head"])
def test_dropout_in_train_mode_self_attention(case: str):
    """Self-attention with dropout in train mode (``TransformerEncoderLayer``'s default): the
    input projection is a Linear call of its own and ``out_proj``'s input is kept, so the
    real backward's gradients — dropout masks included — give the statistics. Reference: the
    gradient of each sample's loss term through the same forward graph (the same masks)."""
    model, X, y = _make(case, n=4)
    model.attn.dropout = 0.5
    _check_same_graph(model, X, y)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("cross")])
def test_extended_forward_and_grad_are_pytorchs(case: str, dropout: float):
    """The extended model runs self-attention through backprism's copy of PyTorch's
    ``multi_head_attention_forward`` (so that the input projection is seen): outputs and
    ``.grad`` are bitwise PyTorch's, dropout masks included; released configurations never
    recompute the forward."""
    model, X, y = _make(case)
    model.attn.dropout = dropout
    plain = copy.deepcopy(model)
    torch.manual_seed(1)
    ref = plain(*X)
    nn.functional.cross_entropy(ref, y).backward()
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    released = "kv" not in case
    with mock.patch.object(
        MultiheadAttentionRule, "_compute_forward",
        side_effect=AssertionError("recomputed") if released else
        MultiheadAttentionRule._compute_forward, autospec=True,
    ), warnings.catch_warnings():
        warnings.simplefilter("ignore", generic.GenericRuleWarning)
        torch.manual_seed(1)
        out = model(*X)
        assert torch.equal(out, ref)
        if dropout and not released:  # the recomputing path has no masks (test above)
            return
        with collect(BatchGrad()):
            lossfunc(out, y).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert p.grad_batch.shape == (y.shape[0], *p.shape)


def test_dropout_in_train_mode_is_refused_for_cross_attention():
    """Cross-attention keeps the closed forms of the recomputed forward, which has no dropout
    masks: refused by the generic path; in eval mode the closed forms again."""
    model, X, y = _make("cross_packed_3d", n=2)
    model.attn.dropout = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", generic.GenericRuleWarning)
        with pytest.raises(RuntimeError, match="dropout"):
            _run(model, X, y, BatchGrad())
    model.eval()  # dropout off: the closed forms again
    _run(model, X, y, BatchGrad())
    assert model.attn.in_proj_weight.grad_batch.shape == (2, 12, 4)


class Gain(nn.Module):
    """A module without a closed-form rule (a parameter used nonlinearly)."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.g.exp()


class Gain2(Gain):
    pass


def test_generic_fallback_warns_once_per_module_type():
    model = extend(nn.Sequential(Gain(), Gain2(), nn.Linear(3, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    generic._ANNOUNCED.difference_update({"Gain", "Gain2"})
    with pytest.warns(generic.GenericRuleWarning, match="Gain, Gain2") as record, collect(
        BatchL2Grad()
    ):
        lossfunc(model(x), y).backward()
    assert len([w for w in record if issubclass(w.category, generic.GenericRuleWarning)]) == 1
    assert "vmap" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", generic.GenericRuleWarning)
        with collect(BatchL2Grad()):
            lossfunc(model(x), y).backward()


class SeqFirstEncoder(nn.Module):
    """``nn.TransformerEncoderLayer`` with its defaults (``batch_first=False``, ReLU) on
    batch-first input transposed to ``[T, N, E]`` inside, a mean over time and a head."""

    def __init__(self, d: int = 4, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(d, heads, 8, dropout=dropout)
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(x.transpose(0, 1)).mean(0))


def test_sequence_first_encoder_layer_releases_its_projection():
    """``batch_first=False`` self-attention takes the released path too (no recomputed
    forward): first-order statistics and the exact GGN diagonal against dense references."""
    torch.manual_seed(3)
    model = SeqFirstEncoder().to(DT)
    x, y = torch.randn(3, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
    with mock.patch.object(
        MultiheadAttentionRule, "_compute_forward", side_effect=AssertionError("recomputed")
    ):
        _check_first_order_and_ggn(model, (x,), y)


def test_sequence_first_encoder_layer_with_default_dropout():
    """The encoder layer exactly as ``nn.TransformerEncoderLayer(d, heads)`` builds it (dropout
    0.1, train mode): per-sample gradients through the same forward graph (same masks)."""
    torch.manual_seed(4)
    model = SeqFirstEncoder(dropout=0.1).to(DT)
    _check_same_graph(model, (torch.randn(5, 4, 4, dtype=DT),), torch.randint(0, 3, (5,)))


def test_sequence_first_extended_forward_and_grad_are_pytorchs():
    torch.manual_seed(6)
    model = SeqFirstEncoder(dropout=0.1).to(DT)
    plain = copy.deepcopy(model)
    x, y = torch.randn(5, 4, 4, dtype=DT), torch.randint(0, 3, (5,))
    torch.manual_seed(1)
    ref = plain(x)
    nn.functional.cross_entropy(ref, y).backward()
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    torch.manual_seed(1)
    out = model(x)
    assert torch.equal(out, ref)
    with collect(BatchGrad()):
        lossfunc(out, y).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
