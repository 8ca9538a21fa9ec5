"""KFAC-expand and KFAC-reduce (``KFLR(kfac_approx=...)``, ``KFAC(kfac_approx=...)``) for
weights shared over positions, against their definitions (Eschenhagen et al. 2023):

* ``"expand"``: ``A = (1/(N·T)) Σₙₜ xₙₜ xₙₜᵀ``, ``B = Σₙₜ Gₙ[t, t]``;
* ``"reduce"``: ``A = (1/N) Σₙ x̄ₙ x̄ₙᵀ``, ``B = Σₙ Σₜₛ Gₙ[t, s]``;

with ``Gₙ[t, s]`` the ``[O, O]`` blocks of sample ``n``'s GGN with respect to the layer's output
at positions ``t`` and ``s``. The references are independent of backprism: the inputs ``x``
recorded by a forward hook on an unextended copy, and ``G`` the dense float64 GGN (looped
Jacobians and loss Hessians) of a zero offset ``β`` ``[T, O]`` added to the layer's output.
Linear layers on sequences (a language-model loss over positions and a pooled classifier),
Conv2d (grouped too) and ConvTranspose2d, an Embedding (with padding), self-attention's packed
projections and Hugging Face's ``Conv1D``; MC columns in expectation; BackPACK's convention
unchanged, and all three equal for one position; a rule without ``approx`` refused by name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import KFAC, KFLR
from tests.reference import ggn_blocks_loop

DT = torch.float64
TOL = {"rtol": 1e-7, "atol": 1e-10}
N, T, V, D, C = 3, 4, 7, 5, 3


# ------------------------------------------------------------------------------------ models
class Tokens(nn.Module):
    """Embedding → Linear → tanh → head; ``pool``: mean over positions before the head
    (classifier, logits ``[N, C]``), else logits per position ``[N, C, T]``."""

    def __init__(self, pool: bool, padding: bool = False) -> None:
        super().__init__()
        self.pool = pool
        self.emb = nn.Embedding(V, D, padding_idx=1 if padding else None)
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, idx: Tensor) -> Tensor:
        h = torch.tanh(self.lin(self.emb(idx)))
        return self.head(h.mean(1)) if self.pool else self.head(h).transpose(1, 2)


class Pixels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 2)
        self.head = nn.Linear(3 * 3 * 3, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, C)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        return self.head(self.attn(h, h, h, need_weights=False)[0]).transpose(1, 2)


def _data(model: nn.Module, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if isinstance(model, Pixels):
        return torch.randn(N, 2, 4, 4, dtype=DT, generator=gen), torch.randint(
            0, C, (N,), generator=gen
        )
    x = torch.randint(0, V, (N, T), generator=gen)
    pooled = getattr(model, "pool", False)
    return x, torch.randint(0, C, (N,) if pooled else (N, T), generator=gen)


def _randomized(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = model.to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.8)
    return model


# -------------------------------------------------------------------------------- references
def _inputs(model: nn.Module, layer: str, X: Tensor) -> Tensor:
    """The input of ``layer`` in an unextended copy's forward."""
    seen: list[Tensor] = []
    ref = copy.deepcopy(model)
    sub = dict(ref.named_modules())[layer]
    handle = sub.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        ref(X)
    handle.remove()
    return seen[0]


def _output_ggn(
    model: nn.Module, layer: str, X: Tensor, y: Tensor, view: Callable[[Tensor], Tensor]
) -> Tensor:
    """``[N, T, O, T, O]``: the per-sample GGNs ``Gₙ`` of a zero offset ``β`` added to
    ``layer``'s output (every other parameter frozen); ``view`` brings the output's per-sample
    ``[*, …]`` to ``[T, O]`` and ``β``'s gradient back."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    sub = dict(ref.named_modules())[layer]
    with torch.no_grad():
        out = sub(_inputs(model, layer, X))
    shape = view(out[0]).shape
    sub.beta = nn.Parameter(torch.zeros(shape, dtype=DT))

    def add(m: nn.Module, a: tuple, o: Tensor) -> Tensor:
        return o + m.beta.reshape(o.shape[1:]) if view is _LAST else o + _unview(o, m.beta)

    sub.register_forward_hook(add)
    G = ggn_blocks_loop(ref, nn.CrossEntropyLoss(), (X,), y)  # [N, N, P, P]
    t, o = shape
    return torch.stack([G[i, i] for i in range(G.shape[0])]).reshape(-1, t, o, t, o)


def _LAST(out: Tensor) -> Tensor:
    """``[*T, O]`` → ``[T, O]`` (features last: Linear, Embedding)."""
    return out.reshape(-1, out.shape[-1])


def _CHANNELS(out: Tensor) -> Tensor:
    """``[O, *L]`` → ``[L, O]`` (channels first: convolutions)."""
    return out.reshape(out.shape[0], -1).t()


def _unview(o: Tensor, beta: Tensor) -> Tensor:
    return beta.t().reshape(o.shape[1:])


def _expected(
    model: nn.Module, layer: str, X: Tensor, y: Tensor, approx: str, view=_LAST, x_rows=None,
    counted: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(B, A)`` of ``layer`` from the definitions; ``x_rows(x)`` gives ``[N, T, I]``;
    ``counted`` ``[N, T]``: the positions ``B`` sums over (all by default)."""
    G = _output_ggn(model, layer, X, y, view)
    if counted is not None:
        keep = counted.to(DT)
        G = G * keep[:, :, None, None, None] * keep[:, None, None, :, None]
    x = _inputs(model, layer, X)
    x = x_rows(x) if x_rows is not None else x.reshape(x.shape[0], -1, x.shape[-1])
    return _definitions(G, x, approx)


def _definitions(G: Tensor, x: Tensor, approx: str) -> tuple[Tensor, Tensor]:
    """``(B, A)`` in the convention ``approx`` from the output GGN ``G`` ``[N, T, O, T, O]``
    and the inputs ``x`` ``[N, T, *G, I]`` each position sees (``*G``: groups, one ``A`` per
    group)."""
    n, t = x.shape[:2]
    if approx == "expand":
        B = torch.einsum("ntatb->ab", G)
        A = torch.einsum("nt...i,nt...j->...ij", x, x) / (n * t)
    else:
        B = G.sum((0, 1, 3))
        xm = x.mean(1)
        A = torch.einsum("n...i,n...j->...ij", xm, xm) / n
    return B, A


def _patches(conv: nn.Conv2d) -> Callable[[Tensor], Tensor]:
    return lambda x: F.unfold(x, conv.kernel_size).transpose(1, 2)  # [N, L, C·K]


def _run(model: nn.Module, X: Tensor, y: Tensor, ext) -> None:
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    model.zero_grad()
    with collect(ext):
        lossfunc(model(X), y).backward()


def _assert_kflr(model: nn.Module, X: Tensor, y: Tensor, approx: str, p: Tensor, *want) -> None:
    """``KFLR(kfac_approx=approx)``'s factors of ``p`` are ``want``, in the rule's order."""
    _run(model, X, y, KFLR(kfac_approx=approx))
    assert len(p.kflr) == len(want)
    for got, expected in zip(p.kflr, want, strict=True):
        torch.testing.assert_close(got, expected, **TOL)


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("pool", [False, True])
def test_linear_on_sequences(approx: str, pool: bool) -> None:
    model = _randomized(Tokens(pool), seed=1)
    X, y = _data(model, 1)
    layers = ("lin",) if pool else ("lin", "head")
    refs = {k: _expected(model, k, X, y, approx) for k in layers}
    _run(model, X, y, KFLR(kfac_approx=approx))
    for k, (B, A) in refs.items():
        layer = dict(model.named_modules())[k]
        fb, fa = layer.weight.kflr
        torch.testing.assert_close(fb, B, **TOL, msg=k)
        torch.testing.assert_close(fa, A, **TOL, msg=k)
        torch.testing.assert_close(layer.bias.kflr[0], B, **TOL, msg=k)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("padding", [False, True])
def test_embedding(approx: str, padding: bool) -> None:
    """``A_tokens ⊗ B`` in the weight's axis order: the inputs are one-hot rows (zero for
    padding positions, which do not touch the weight and are left out of ``B``)."""
    model = _randomized(Tokens(pool=False, padding=padding), seed=2)
    X, y = _data(model, 2)
    X[0, 0] = 1  # a padding position where padding_idx = 1

    def one_hot(idx: Tensor) -> Tensor:
        rows = F.one_hot(idx, V).to(DT)
        return rows * (idx != 1)[..., None] if padding else rows

    # (B over the positions that touch the weight, as backprism's Embedding factors)
    counted = X != 1 if padding else None
    B, A = _expected(model, "emb", X, y, approx, x_rows=lambda _: one_hot(X), counted=counted)
    _assert_kflr(model, X, y, approx, model.emb.weight, A, B)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_conv2d(approx: str) -> None:
    model = _randomized(Pixels(), seed=3)
    X, y = _data(model, 3)
    B, A = _expected(model, "conv", X, y, approx, view=_CHANNELS, x_rows=_patches(model.conv))
    _assert_kflr(model, X, y, approx, model.conv.weight, B, A)
    torch.testing.assert_close(model.conv.bias.kflr[0], B, **TOL)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_self_attention_packed_projections(approx: str) -> None:
    """``in_proj_weight`` ``[3E, E]``: ``B`` over the three projections' outputs side by side
    (the reference's offset is added to the packed projection, rebuilt with the same
    weights), ``A`` of the shared input; ``out_proj`` as a Linear layer."""
    model = _randomized(Attention(), seed=4)
    X, y = _data(model, 4)

    class Packed(nn.Module):
        """The packed input projection as a module, whose output the reference offsets."""

        def __init__(self, attn: nn.MultiheadAttention) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, h: Tensor) -> Tensor:
            return F.linear(h, self.attn.in_proj_weight, self.attn.in_proj_bias)

    class Explicit(nn.Module):
        def __init__(self, m: Attention) -> None:
            super().__init__()
            self.m = m
            self.proj = Packed(m.attn)

        def forward(self, idx: Tensor) -> Tensor:
            a = self.m.attn
            h = self.m.emb(idx)
            q, k, v = self.proj(h).chunk(3, -1)
            e, heads = q.shape[-1], a.num_heads

            def split(z: Tensor) -> Tensor:
                return z.reshape(*z.shape[:2], heads, e // heads).transpose(1, 2)

            o = F.scaled_dot_product_attention(split(q), split(k), split(v))
            o = a.out_proj(o.transpose(1, 2).reshape(*h.shape[:2], e))
            return self.m.head(o).transpose(1, 2)

    explicit = Explicit(model)
    torch.testing.assert_close(explicit(X), model(X))
    B, A = _expected(explicit, "proj", X, y, approx)
    Bo, Ao = _expected(explicit, "m.attn.out_proj", X, y, approx)
    _run(model, X, y, KFLR(kfac_approx=approx))
    attn = model.attn
    for got, want in (
        (attn.in_proj_weight.kflr, [B, A]),
        (attn.in_proj_bias.kflr, [B]),
        (attn.out_proj.weight.kflr, [Bo, Ao]),
        (attn.out_proj.bias.kflr, [Bo]),
    ):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)


class CrossAttention(nn.Module):
    """Tokens attend to a shorter memory computed from them (``T - 1`` positions, key and
    value the same tensor, as an attention-pooling head): the packed ``in_proj_weight`` sees
    two different inputs. ``pool``: a classifier, else logits per token."""

    def __init__(self, pool: bool) -> None:
        super().__init__()
        self.pool = pool
        self.emb = nn.Embedding(V, 4)
        self.mem = nn.Linear(4, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, C)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        mem = torch.tanh(self.mem(h[:, 1:]))
        o = self.attn(h, mem, mem, need_weights=False)[0]
        return self.head(o.mean(1)) if self.pool else self.head(o).transpose(1, 2)


class _Rows(nn.Module):
    """Rows ``rows`` of the packed projection as a layer of its own (the reference's offset
    goes on its output)."""

    def __init__(self, attn: nn.MultiheadAttention, rows: slice) -> None:
        super().__init__()
        self.attn, self.rows = attn, rows

    def forward(self, z: Tensor) -> Tensor:
        a = self.attn
        return F.linear(z, a.in_proj_weight[self.rows], a.in_proj_bias[self.rows])


@pytest.mark.parametrize("approx", [None, "expand", "reduce"])
@pytest.mark.parametrize("pool", [False, True])
def test_cross_attention_packed_projections(approx: str | None, pool: bool) -> None:
    """Cross-attention's packed ``in_proj_weight`` ``[3E, E]``: block-diagonal over the query,
    key and value rows, ``[B_g, A_g]`` stacked ``[3, E, E]``, each block the Linear
    definitions of its rows (their own input and positions: ``T`` query tokens, ``T - 1``
    memory positions). ``in_proj_bias``: ``[B]`` of the concatenated gradient — its exact GGN
    (dense, every other parameter frozen) for BackPACK's convention and ``"reduce"``, the
    blocks' ``B`` on the diagonal and zeros between them for ``"expand"``."""
    model = _randomized(CrossAttention(pool), seed=6)
    X, y = _data(model, 6)

    class Explicit(nn.Module):
        def __init__(self, m: CrossAttention) -> None:
            super().__init__()
            self.m = m
            e = m.attn.embed_dim
            self.q, self.k, self.v = (_Rows(m.attn, slice(i * e, (i + 1) * e)) for i in range(3))

        def forward(self, idx: Tensor) -> Tensor:
            m, a = self.m, self.m.attn
            h = m.emb(idx)
            mem = torch.tanh(m.mem(h[:, 1:]))
            e, heads = h.shape[-1], a.num_heads

            def split(z: Tensor) -> Tensor:
                return z.reshape(*z.shape[:2], heads, e // heads).transpose(1, 2)

            o = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(mem)),
                                               split(self.v(mem)))
            o = a.out_proj(o.transpose(1, 2).reshape(*h.shape[:2], e))
            return m.head(o.mean(1)) if m.pool else m.head(o).transpose(1, 2)

    explicit = Explicit(model)
    torch.testing.assert_close(explicit(X), model(X))
    want = []
    for layer in ("q", "k", "v"):
        G = _output_ggn(explicit, layer, X, y, _LAST)
        x = _inputs(explicit, layer, X)
        if approx is None:  # BackPACK's: A over all positions / N, B of the summed columns
            want.append((G.sum((0, 1, 3)), torch.einsum("nti,ntj->ij", x, x) / x.shape[0]))
        else:
            want.append(_definitions(G, x, approx))
    _run(model, X, y, KFLR(kfac_approx=approx))
    B, A = model.attn.in_proj_weight.kflr
    torch.testing.assert_close(B, torch.stack([b for b, _ in want]), **TOL)
    torch.testing.assert_close(A, torch.stack([a for _, a in want]), **TOL)
    (Bb,) = model.attn.in_proj_bias.kflr
    if approx == "expand":
        torch.testing.assert_close(Bb, torch.block_diag(*(b for b, _ in want)), **TOL)
    else:
        ref = copy.deepcopy(model)
        for name, p in ref.named_parameters():
            p.requires_grad_(name == "attn.in_proj_bias")
        G = ggn_blocks_loop(ref, nn.CrossEntropyLoss(), (X,), y)
        torch.testing.assert_close(Bb, torch.einsum("nnab->ab", G), **TOL)


@pytest.mark.parametrize("approx", [None, "expand"])
def test_attention_called_as_self_and_cross_attention(approx: str | None) -> None:
    """One ``MultiheadAttention`` run as self-attention (its packed weight one product
    ``[B, A]``, ``B`` ``[3E, 3E]``) and then as cross-attention (block-diagonal): the calls'
    factors add in the block-diagonal form, the first call's ``B`` contributing its diagonal
    blocks and its ``A`` to every block."""
    torch.manual_seed(7)

    class Twice(Attention):
        def forward(self, idx: Tensor) -> Tensor:
            h = self.emb(idx)
            s = self.attn(h, h, h, need_weights=False)[0]
            o = self.attn(h, torch.tanh(s[:, 1:]), torch.tanh(s[:, 1:]), need_weights=False)[0]
            return self.head(o).transpose(1, 2)

    model = _randomized(Twice(), seed=7)
    X, y = _data(model, 7)
    e = 4

    class Explicit(nn.Module):
        def __init__(self, m: Twice) -> None:
            super().__init__()
            self.m = m
            self.packed = _Rows(m.attn, slice(None))
            self.q, self.k, self.v = (_Rows(m.attn, slice(i * e, (i + 1) * e)) for i in range(3))

        @staticmethod
        def core(a: nn.MultiheadAttention, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            def split(z: Tensor) -> Tensor:
                return z.reshape(*z.shape[:2], a.num_heads, e // a.num_heads).transpose(1, 2)

            o = F.scaled_dot_product_attention(split(q), split(k), split(v))
            return a.out_proj(o.transpose(1, 2).reshape(*q.shape[:2], e))

        def forward(self, idx: Tensor) -> Tensor:
            m, a = self.m, self.m.attn
            h = m.emb(idx)
            s = self.core(a, *self.packed(h).chunk(3, -1))
            mem = torch.tanh(s[:, 1:])
            o = self.core(a, self.q(h), self.k(mem), self.v(mem))
            return m.head(o).transpose(1, 2)

    explicit = Explicit(model)
    torch.testing.assert_close(explicit(X), model(X))

    def factors(layer: str) -> tuple[Tensor, Tensor]:
        G = _output_ggn(explicit, layer, X, y, _LAST)
        x = _inputs(explicit, layer, X)
        if approx is None:
            return G.sum((0, 1, 3)), torch.einsum("nti,ntj->ij", x, x) / x.shape[0]
        return _definitions(G, x, approx)

    Bs, As = factors("packed")
    blocks = [factors(k) for k in ("q", "k", "v")]
    _run(model, X, y, KFLR(kfac_approx=approx))
    B, A = model.attn.in_proj_weight.kflr
    diag = torch.stack([Bs[i * e : (i + 1) * e, i * e : (i + 1) * e] for i in range(3)])
    torch.testing.assert_close(B, diag + torch.stack([b for b, _ in blocks]), **TOL)
    torch.testing.assert_close(A, As + torch.stack([a for _, a in blocks]), **TOL)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_hugging_face_conv1d(approx: str) -> None:
    """GPT-2's ``Conv1D`` (``y = x W + b``, ``W`` ``[in, out]``): ``[A, B]`` in its axis
    order, the Linear rule's factors of ``Wᵀ``."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    model = _randomized(Tokens(pool=False), seed=5)
    model.lin = Conv1D(D, D).to(DT)
    with torch.no_grad():
        model.lin.weight.normal_(0, 0.8)
        model.lin.bias.normal_(0, 0.8)
    X, y = _data(model, 5)
    B, A = _expected(model, "lin", X, y, approx)
    _assert_kflr(model, X, y, approx, model.lin.weight, A, B)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_mc_factors_in_expectation(approx: str) -> None:
    """``KFAC``'s ``B`` from many MC columns: within a few per cent of the exact one (relative
    error ~ 1/√M); ``A`` does not depend on the columns."""
    model = _randomized(Tokens(pool=False), seed=6)
    X, y = _data(model, 6)
    B, A = _expected(model, "lin", X, y, approx)
    torch.manual_seed(0)
    _run(model, X, y, KFAC(mc_samples=4000, kfac_approx=approx))
    fb, fa = model.lin.weight.kfac
    torch.testing.assert_close(fa, A, **TOL)
    assert (fb - B).norm() <= 0.08 * B.norm()


def test_one_position_all_agree_and_backpack_is_unchanged() -> None:
    """Without positions the three conventions are the same factors; with positions the
    default stays BackPACK's (``A = (1/N) Σₙₜ xₙₜxₙₜᵀ``, ``B`` of the summed columns)."""
    torch.manual_seed(7)
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))
    results = []
    for approx in (None, "expand", "reduce"):
        with collect(KFLR(kfac_approx=approx)):
            lossfunc(model(X), y).backward()
        results.append([[f.clone() for f in p.kflr] for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            for fa, fb in zip(a, b):
                torch.testing.assert_close(fa, fb, rtol=0, atol=0)
    seq = _randomized(Tokens(pool=False), seed=8)
    X, y = _data(seq, 8)
    B, _ = _expected(seq, "lin", X, y, "reduce")
    x = _inputs(seq, "lin", X)
    _run(seq, X, y, KFLR())
    fb, fa = seq.lin.weight.kflr
    torch.testing.assert_close(fb, B, **TOL)
    torch.testing.assert_close(fa, torch.einsum("nti,ntj->ij", x, x) / N, **TOL)


def test_unknown_approximation_is_refused() -> None:
    with pytest.raises(ValueError, match="kfac_approx must be None"):
        KFAC(kfac_approx="mean")


class _Scaled(nn.Linear):
    """A Linear subclass with a rule of its own whose factors know no ``approx``."""


def test_a_rule_without_the_argument_is_refused_by_name() -> None:
    from backprism.engine.rule import register_rule
    from backprism.rules.linear import LinearRule

    @register_rule(_Scaled)
    class _Legacy(LinearRule):
        def kfac_input(self, call):  # type: ignore[override]
            return super().kfac_input(call)

        def kfac_output(self, call, g):  # type: ignore[override]
            return super().kfac_output(call, g)

    torch.manual_seed(9)
    model = extend(nn.Sequential(_Scaled(4, 3)).to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(N, 2, 4, dtype=DT), torch.randint(0, 3, (N, 2))
    with collect(KFLR()):
        lossfunc(model(X).transpose(1, 2), y).backward()
    assert len(model[0].weight.kflr) == 2
    model.zero_grad()
    refused = pytest.raises(NotImplementedError, match=r"_Legacy.*kfac_approx='expand'")
    with refused, collect(KFLR(kfac_approx="expand")):
        lossfunc(model(X).transpose(1, 2), y).backward()
    assert not hasattr(model[0].weight, "kflr") and model[0].weight.grad is None


class Grouped(nn.Module):
    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.conv = (
            nn.ConvTranspose2d(2, 3, 2, stride=2) if transposed else nn.Conv2d(4, 6, 2, groups=2)
        )
        self.head = nn.LazyLinear(C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def _weight_inputs(conv: nn.Module, x: Tensor) -> Tensor:
    """``x̃`` ``[N, L, G, I]`` with ``∂out[n, o, l]/∂W[o's group row, :] = x̃[n, l, g]``, read off
    the Jacobian of the layer's output with respect to its weight (autograd, no unfolding
    code): the inputs each output position sees, per group."""
    w = conv.weight.detach()
    fn = F.conv_transpose2d if isinstance(conv, nn.ConvTranspose2d) else F.conv2d
    kw = {"stride": conv.stride, "groups": conv.groups}
    rows = []
    for xn in x:
        J = torch.autograd.functional.jacobian(lambda v, xn=xn: fn(xn[None], v, **kw)[0], w)
        c_out = J.shape[0]
        J = J.reshape(c_out, -1, *w.shape)  # [O, L, *W]
        if isinstance(conv, nn.ConvTranspose2d):  # W [C_in, C_out, k]: column o of each row
            rows.append(torch.stack([J[o, :, :, o] for o in range(c_out)], 1)[:, :1].flatten(2))
        else:  # W [C_out, C_in/G, k]: row o; its group's first output channel suffices
            per = c_out // conv.groups
            rows.append(torch.stack([J[g * per, :, g * per] for g in range(conv.groups)], 1))
    return torch.stack(rows).flatten(3)  # [N, L, G, I]


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_and_transposed_convolutions(approx: str, transposed: bool) -> None:
    """A grouped convolution's factors per group (``[G, O, O]``, ``[G, I, I]``: ``B``'s
    diagonal blocks, ``A`` of the group's inputs) and a transposed convolution's, with the
    inputs each output position sees read off autograd's Jacobian."""
    model = Grouped(transposed)
    cin = 2 if transposed else 4
    X = torch.randn(N, cin, 3, 3, dtype=DT)
    model(X.float())  # (the lazy head's size)
    model = _randomized(model, seed=10)
    y = torch.randint(0, C, (N,))
    G = _output_ggn(model, "conv", X, y, _CHANNELS)  # [N, L, O, L, O]
    xt = _weight_inputs(model.conv, X)  # [N, L, G, I]
    groups = xt.shape[2]
    per = G.shape[2] // groups
    B, A = _definitions(G, xt, approx)
    Bg = torch.stack([B[g * per : (g + 1) * per, g * per : (g + 1) * per] for g in range(groups)])
    if groups == 1:
        Bg, A = Bg[0], A[0]
    _assert_kflr(model, X, y, approx, model.conv.weight, Bg, A)
    torch.testing.assert_close(model.conv.bias.kflr[0], B, **TOL)
