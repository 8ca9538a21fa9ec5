"""Parameters of modules without a rule attributed where they enter (``GenericRule.inside``).

A container's own parameters (a ViT's ``pos_embed``/``cls_token``, a ConvNeXt block's layer
scale) and the parameters of a layer subclass that overrides ``forward`` (timm's
``LayerNorm2d``) are released to functional attribution: ``F.layer_norm``/``F.group_norm``/
``F.rms_norm`` take the norm closed forms, ``F.linear``/``F.conv*`` the Linear/Conv ones (also
with parameters passed by keyword and with frozen biases), values computed from one parameter
alone (``exp(s)``, ``2 * s``) are rebuilt where they meet the samples, elementwise operations
take a stand-in whose ``vmap`` is the closed form's arithmetic (no fallback warning). Every
number against the dense float64 references of ``tests/reference.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine.rule import get_rule
from backprism.extensions import (
    KFLR,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SumGradSquared,
    Variance,
)
from backprism.rules.generic import GenericRuleWarning
from tests.common import assert_first_order
from tests.reference import diag_ggn, loss_hessian, per_sample_grads, split

DT = torch.float64
N = 4


class PatchTokens(nn.Module):
    """ViT-like: class token concatenated, position embedding added, a block, mean head."""

    def __init__(self, d: int = 6, t: int = 3, c: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(5, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, t + 1, d) * 0.1)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, c)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
        h = h + self.pos_embed
        return self.head(torch.tanh(self.norm(h))[:, 0])


class ChannelsLastNorm(nn.LayerNorm):
    """timm's ``LayerNorm2d``: a LayerNorm over channels of ``[N, C, H, W]`` (overridden
    forward: permute, ``F.layer_norm``, permute back)."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ScaledBlock(nn.Module):
    """ConvNeXt-like: depthwise conv, channels-last norm, pointwise conv, layer scale
    ``gamma`` used directly in the block's forward, residual."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.norm = ChannelsLastNorm(c)
        self.pw = nn.Conv2d(c, c, 1)
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.pw(torch.tanh(self.norm(self.dw(x))))
        return x + h.mul(self.gamma.reshape(1, -1, 1, 1))


class ConvNet(nn.Module):
    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, c, 2)
        self.block = ScaledBlock(c)
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


class KeywordNorms(nn.Module):
    """Hand-written norms calling the functional forms, parameters passed by keyword, one
    with a frozen bias and one RMS norm."""

    def __init__(self, d: int = 6, c: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.w1, self.b1 = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))
        self.w2 = nn.Parameter(torch.rand(d) + 0.5)
        self.g = nn.Parameter(torch.rand(d) + 0.5)
        self.frozen = nn.Parameter(torch.randn(d), requires_grad=False)
        self.w3 = nn.Parameter(torch.randn(c, d) * 0.3)
        self.b3 = nn.Parameter(torch.randn(c))

    def forward(self, x: Tensor) -> Tensor:
        h = F.layer_norm(self.inp(x), (x.shape[-1] + 1,), weight=self.w1, bias=self.b1)
        h = F.layer_norm(torch.tanh(h), h.shape[-1:], self.w2, self.frozen, 1e-5)
        h = F.rms_norm(torch.tanh(h), (h.shape[-1],), weight=self.g, eps=1e-6)
        return F.linear(h, weight=self.w3, bias=self.b3).mean(1)


class GroupNormed(nn.Module):
    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, c, 2)
        self.w, self.b = nn.Parameter(torch.rand(c) + 0.5), nn.Parameter(torch.randn(c))
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.group_norm(self.conv(x), 2, self.w, self.b)
        return self.head(torch.tanh(h).mean((2, 3)))


MODELS = {
    "tokens": (PatchTokens, (N, 3, 5)),
    "convnext-like": (ConvNet, (N, 2, 5, 5)),
    "keyword-norms": (KeywordNorms, (N, 2, 5)),
    "group-norm": (GroupNormed, (N, 2, 4, 4)),
}


def _setup(name: str):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model = make().to(DT)
    x = torch.randn(*shape, dtype=DT)
    y = torch.randint(0, 3, (N,))
    return model, x, y, nn.CrossEntropyLoss()


def _first_order_without_fallback(
    model: nn.Module, x: Tensor, y: Tensor, lf: nn.Module
) -> nn.Module:
    """The first-order quantities of ``model`` against ``∇(ℓₙ/N)``, with the generic
    fallback's announcement an error; the extended model, for further checks."""
    ref = per_sample_grads(model, lf, x, y)
    extend(model)
    lf = extend(lf)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenericRuleWarning)
        with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
            lf(model(x), y).backward()
    assert_first_order(model, ref, rtol=1e-9, atol=1e-12)
    return model


@pytest.mark.parametrize("name", ["tokens", "convnext-like", "group-norm"])
def test_first_order_without_fallback(name: str) -> None:
    """Every parameter's first-order quantities against ``∇(ℓₙ/N)``; no module or operation
    announces the generic fallback."""
    model = _first_order_without_fallback(*_setup(name))
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)


def test_keyword_and_frozen_parameters_first_order() -> None:
    """``F.layer_norm(..., weight=, bias=)``, ``F.rms_norm(..., weight=)``,
    ``F.linear(h, weight=, bias=)`` and a frozen bias: the closed forms (no fallback)."""
    model = _first_order_without_fallback(*_setup("keyword-norms"))
    assert model.frozen.grad is None and not hasattr(model.frozen, "grad_batch")


@pytest.mark.parametrize("name", list(MODELS))
def test_diag_ggn_exact(name: str) -> None:
    model, x, y, lf = _setup(name)
    ref = diag_ggn(model, lf, x, y)
    extend(model)
    lf = extend(lf)
    with collect(DiagGGNExact()):
        lf(model(x), y).backward()
    for k, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.diag_ggn_exact, ref[k], rtol=1e-9, atol=1e-12)


class ShiftScale(nn.Module):
    """A container whose own parameters enter linearly after the last nonlinearity:
    ``head(tanh(lin(x)) * a + b + 2·c)`` — the exact Hessian diagonal is built from columns."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.a = nn.Parameter(torch.rand(4) + 0.5)
        self.b = nn.Parameter(torch.randn(4))
        self.c = nn.Parameter(torch.randn(1, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lin(x)) * self.a + self.b + 2 * self.c)


def test_diag_hessian_through_released_linear_uses() -> None:
    torch.manual_seed(3)
    model = ShiftScale().to(DT)
    x, y = torch.randn(N, 3, dtype=DT), torch.randint(0, 3, (N,))
    lf = nn.CrossEntropyLoss()
    ref = split(torch.diagonal(loss_hessian(model, lf, x, y)), model)
    extend(model)
    lf = extend(lf)
    with collect(DiagHessian()):
        lf(model(x), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], rtol=1e-9, atol=1e-12)


def test_kronecker_factors_of_released_uses() -> None:
    """KFLR on the ConvNeXt-like net: Kronecker pairs for every Conv/Linear weight (one per
    group for the depthwise one), the single diagonal factor for the norm's and the layer
    scale's parameters — equal to the exact GGN diagonal."""
    model, x, y, lf = _setup("convnext-like")
    ref = diag_ggn(model, lf, x, y)
    extend(model)
    lf = extend(lf)
    with collect(KFLR()):
        lf(model(x), y).backward()
    params = dict(model.named_parameters())
    assert [f.shape for f in params["block.dw.weight"].kflr] == [(4, 1, 1), (4, 9, 9)]
    assert [f.shape for f in params["stem.weight"].kflr] == [(4, 4), (8, 8)]
    assert [f.shape for f in params["head.weight"].kflr] == [(3, 3), (4, 4)]
    for k in ("block.norm.weight", "block.norm.bias", "block.gamma"):
        (d,) = params[k].kflr
        torch.testing.assert_close(d, torch.diag(ref[k].reshape(-1)), rtol=1e-9, atol=1e-12)


def test_released_forwards_keep_the_mode_outside_collect() -> None:
    """A container whose parameters are released needs the forward mode: its later forwards
    outside ``collect`` (BackPACK's ``loss = ...; with backpack(...): loss.backward()``)
    attribute the same way as the first (train-mode dropout after the use included)."""

    class Dropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3))
            self.drop = nn.Dropout(0.5)
            self.head = nn.Linear(3, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.drop(x @ self.w))

    torch.manual_seed(4)
    model, lf = extend(Dropped().to(DT)), extend(nn.CrossEntropyLoss())
    x, y = torch.randn(N, 3, dtype=DT), torch.randint(0, 2, (N,))
    for _ in range(3):
        model.zero_grad()
        loss = lf(model(x), y)
        with collect(BatchGrad()):
            loss.backward()
        torch.testing.assert_close(model.w.grad_batch.sum(0), model.w.grad)


class InPlaceUses(nn.Module):
    """A container's own parameters entering in place: ``h.mul_(self.g)``, ``h += self.b``
    (timm's ``LayerScale(inplace=True)`` pattern): attributed with the value before the
    operation (run out of place and copied back)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.g = nn.Parameter(torch.rand(4) + 0.5)
        self.b = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h.mul_(self.g)
        h += self.b
        return self.head(torch.tanh(h))


def test_in_place_uses() -> None:
    torch.manual_seed(6)
    model = InPlaceUses().to(DT)
    x, y = torch.randn(N, 3, dtype=DT), torch.randint(0, 3, (N,))
    _check_first_order_and_diag_ggn(model, x, y)


class MetParameters(nn.Module):
    """Own parameters that meet each other before any per-sample tensor (``g · v/‖v‖``, a
    relative-position bias table indexed by a buffer): the release is undone and the
    container's own call claims them (the generic rule), for this and later forwards."""

    def __init__(self, t: int = 3, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.g = nn.Parameter(torch.rand(d) + 0.5)
        self.v = nn.Parameter(torch.randn(d))
        self.table = nn.Parameter(torch.randn(2 * t - 1) * 0.1)
        idx = torch.arange(t)
        self.register_buffer("index", (idx[:, None] - idx[None, :] + t - 1).reshape(-1))
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x) * (self.g * self.v / self.v.norm())  # [N, T, d]
        t = h.shape[1]
        scores = h @ h.transpose(1, 2) + self.table[self.index].reshape(t, t)
        h = torch.softmax(scores, -1) @ h
        return self.head(h.mean(1))


def test_release_undone_where_parameters_meet_first() -> None:
    torch.manual_seed(7)
    model = MetParameters().to(DT)
    x, y = torch.randn(N, 3, 4, dtype=DT), torch.randint(0, 3, (N,))
    lf = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lf, x, y)
    extend(model)
    lf = extend(lf)
    for _ in range(2):  # the first forward undoes the release, the second keeps from the start
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GenericRuleWarning)
            with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
                lf(model(x), y).backward()
        assert_first_order(model, ref, rtol=1e-9, atol=1e-12)
    assert get_rule(model)._release(MetParameters) is False  # kept from the second forward


def test_relative_position_table_indexed_by_a_buffer() -> None:
    """``self.table[self.index]`` (a buffer index): a value of the parameter alone, rebuilt
    where it meets the samples — no undo."""

    class Biased(MetParameters):
        def forward(self, x: Tensor) -> Tensor:
            h = self.lin(x)
            t = h.shape[1]
            scores = h @ h.transpose(1, 2) + self.table[self.index].reshape(t, t)
            return self.head((torch.softmax(scores, -1) @ h).mean(1))

    torch.manual_seed(8)
    model = Biased().to(DT)
    model.g.requires_grad_(False)
    model.v.requires_grad_(False)
    x, y = torch.randn(N, 3, 4, dtype=DT), torch.randint(0, 3, (N,))
    _first_order_without_fallback(model, x, y, nn.CrossEntropyLoss())
    assert get_rule(model)._release(Biased) is None


class Positions(nn.Module):
    """nanoGPT's ``tok_emb + wpe(arange(T))`` (``[N, T, d] + [T, d]``) and its functional form
    ``self.pos[arange(T)]``: the positions' axis is not the batch, also where ``T = N``."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.wte = nn.Embedding(7, 4)
        self.wpe = nn.Embedding(8, 4)
        self.pos = nn.Parameter(torch.randn(8, 4))
        self.head = nn.Linear(4, 3)
        (self.wpe.weight if functional else self.pos).requires_grad_(False)

    def forward(self, idx: Tensor) -> Tensor:
        ids = torch.arange(idx.shape[1])
        p = self.pos[ids] if self.functional else self.wpe(ids)
        return self.head(torch.tanh(self.wte(idx) + p).mean(1))


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
@pytest.mark.parametrize("t", [N, N + 1])
def test_position_embeddings_broadcast_over_the_batch(functional: bool, t: int) -> None:
    torch.manual_seed(9)
    model = Positions(functional).to(DT)
    x, y = torch.randint(0, 7, (N, t)), torch.randint(0, 3, (N,))
    _check_first_order_and_diag_ggn(model, x, y)


class Uses(nn.Module):
    """Container-parameter uses the forward cannot split where they enter, or splits with a
    new leading axis: each against the reference (undone releases included)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(3, N)  # out_features = N: a [N, 3] mask has the batch's size
        self.w = nn.Parameter(torch.randn(N, N) * 0.5)
        self.g = nn.Parameter(torch.rand(N) + 0.5)
        self.mask = torch.tril(torch.ones(N, N))  # a plain attribute, not a buffer
        self.head = nn.Linear(N, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        if self.how == "setitem":  # an in-place change of a value rebuilt from w
            w = self.w.clone()
            w[0, 1] = 0.0
            h = F.linear(h, w)
        elif self.how == "mask":
            h = F.linear(h, self.w * self.mask)
        elif self.how == "expand":
            h = h * self.g.expand(x.shape[0], N)
        elif self.how == "bmm":
            h = torch.bmm(h[:, None], self.w.expand(x.shape[0], N, N))[:, 0]
        elif self.how == "cat":
            h = torch.cat([h, self.g.expand(x.shape[0], N)], 0)[: x.shape[0]] + h
        return self.head(torch.tanh(h))


def _fresh_type(cls: type) -> type:
    """A subclass of its own for one test case: an undone release makes the module's type keep
    its parameters for the rest of the process (``GenericRule.keep``), which would send the
    later cases of a parametrized test down the undone path whatever they do."""
    return type(cls.__name__, (cls,), {})


def _check_first_order_and_diag_ggn(
    model: nn.Module, x: Tensor | None = None, y: Tensor | None = None
) -> None:
    """First-order results and the GGN diagonal of ``model`` against the references (default
    data: inputs ``[N, 3]``, two classes)."""
    if x is None or y is None:
        x, y = torch.randn(N, 3, dtype=DT), torch.randint(0, 2, (N,))
    lf = nn.CrossEntropyLoss()
    ref, ggn = per_sample_grads(model, lf, x, y), diag_ggn(model, lf, x, y)
    extend(model)
    lf = extend(lf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericRuleWarning)
        with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact()):
            lf(model(x), y).backward()
    assert_first_order(model, ref, rtol=1e-9, atol=1e-12)
    for k, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:  # unused in this forward: no result, as no gradient (or zeros)
            assert not hasattr(p, "diag_ggn_exact") or not p.diag_ggn_exact.any(), k
            assert not ggn[k].any(), k
            continue
        torch.testing.assert_close(p.diag_ggn_exact, ggn[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("how", ["setitem", "mask", "expand", "bmm", "cat"])
def test_uses_split_or_undone(how: str) -> None:
    torch.manual_seed(10)
    model = _fresh_type(Uses)(how).to(DT)
    model.mask = model.mask.to(DT)
    _check_first_order_and_diag_ggn(model)


class Transposed(nn.Module):
    """A container parameter multiplying transposed activations, ``(W @ h.T).T``, with the
    hidden width equal to the batch size: ``h.T`` has the batch's size on axis 0 too."""

    def __init__(self, how: str, d: int) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(3, d)
        self.w = nn.Parameter(torch.randn(5, d))
        self.g = nn.Parameter(torch.rand(d) + 0.5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if self.how == "T":
            out = (self.w @ h.T).T
        elif self.how == "transpose":
            out = (self.w @ (h.transpose(0, 1) * self.g[:, None])).mT
        else:  # permute, then back: the activation's batch is on axis 0 again
            out = F.linear(h.permute(1, 0).permute(1, 0), self.w)
        return self.head(out)


@pytest.mark.parametrize("how", ["T", "transpose", "permute_back"])
@pytest.mark.parametrize("d", [N, N + 1])
def test_transposed_activations(how: str, d: int) -> None:
    torch.manual_seed(12)
    model = _fresh_type(Transposed)(how, d).to(DT)
    _check_first_order_and_diag_ggn(model)


def test_permuted_parameter_views() -> None:
    """``h @ w.permute(0, 1)`` (the identity) and ``h @ w.permute(1, 0)`` (a transpose): only
    the latter is the ``x @ Wᵀ`` form of a Linear (a class of its own: an undone release would
    make a type keep its parameters for the rest of the process)."""

    class Permuted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 4)
            self.w = nn.Parameter(torch.randn(4, 4))
            self.v = nn.Parameter(torch.randn(4, 4))
            self.head = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.lin(x))
            return self.head(h @ self.w.permute(0, 1) + h @ self.v.permute(1, 0))

    torch.manual_seed(13)
    _check_first_order_and_diag_ggn(Permuted().to(DT))


@pytest.mark.parametrize("where", ["user_hook", "rule"])
def test_a_failed_pass_leaves_no_results(where: str, monkeypatch) -> None:
    """An error during the backward pass (a user's hook on an activation, or a rule failing
    inside the pass) after some results were stored and autograd had written the head's
    ``.grad``: the pass removes what it stored, and parameters that had no ``.grad`` before
    have none after (they kept a partial gradient)."""
    from backprism.rules.linear import LinearRule

    if where == "rule":
        calls = []
        real = LinearRule.per_sample

        def failing(self, call, g):  # (the second Linear call: the head's already written)
            calls.append(call)
            if len(calls) > 1:
                raise ValueError("a rule's hook failed")
            return real(self, call, g)

        monkeypatch.setattr(LinearRule, "per_sample", failing)
    torch.manual_seed(11)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT))
    lf = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(N, 3, dtype=DT), torch.randint(0, 2, (N,))

    def fail(_: Tensor) -> None:
        raise ValueError("a user's hook failed")

    h = model[1](model[0](x))
    if where == "user_hook":
        h.register_hook(fail)
    with pytest.raises(ValueError, match="hook failed"), collect(BatchGrad(), DiagGGNExact()):
        lf(model[2](h), y).backward()
    for p in model.parameters():
        assert not hasattr(p, "grad_batch") and not hasattr(p, "diag_ggn_exact")
        assert p.grad is None


class JoinedQKV(nn.Module):
    """timm's BEiT/EVA/Swin V2 attention: query and value biases of its own joined with a
    constant key bias as the bias of its ``qkv`` layer's weight (``F.linear(x,
    self.qkv.weight, torch.cat((q_bias, k_bias, v_bias)))``: ``qkv`` never runs), a relative
    position table indexed by a view of its index buffer, added to the scores or passed as
    the fused attention's mask. ``how``: ``"positional"``/``"keyword"`` ways of passing the
    bias; ``"reused"`` uses the joined vector a second time, ``"unused"`` not at all (both
    undo the release: the generic rule takes the module)."""

    def __init__(self, how: str, fused: bool, d: int = 4, t: int = 3) -> None:
        super().__init__()
        self.how, self.fused, self.t = how, fused, t
        self.embed = nn.Linear(3, d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.q_bias = nn.Parameter(torch.randn(d) * 0.5)
        self.v_bias = nn.Parameter(torch.randn(d) * 0.5)
        self.register_buffer("k_bias", torch.zeros(d), persistent=False)
        self.table = nn.Parameter(torch.randn(2 * t - 1, 2) * 0.5)
        idx = torch.arange(t)
        self.register_buffer("index", idx[:, None] - idx[None, :] + t - 1)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        h = torch.tanh(self.embed(x))
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        if self.how == "keyword":
            qkv = F.linear(h, weight=self.qkv.weight, bias=bias)
        elif self.how == "unused":
            qkv = F.linear(h, self.qkv.weight) + 0.0 * torch.cat((self.q_bias, self.v_bias)).sum()
        else:
            qkv = F.linear(h, self.qkv.weight, bias)
        if self.how == "reused":
            qkv = qkv * bias.sum()
        q, k, v = qkv.reshape(n, t, 3, 2, -1).permute(2, 0, 3, 1, 4)
        rel = self.table[self.index.view(-1)].view(t, t, 2).permute(2, 0, 1).unsqueeze(0)
        if self.fused:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=rel)
        else:
            o = torch.softmax(q @ k.transpose(-2, -1) / 2**0.5 + rel, -1) @ v
        return self.head(self.proj(o.transpose(1, 2).reshape(n, t, -1)).mean(1))


def _joined(how: str, fused: bool, n: int = N) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(11)
    model = _fresh_type(JoinedQKV)(how, fused).to(DT)
    return model, torch.randn(n, 3, 3, dtype=DT), torch.randint(0, 3, (n,))


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_joined_bias_first_order_without_fallback(how: str, fused: bool) -> None:
    """The joined bias is attributed where it enters (each part's per-sample gradient is its
    slice of ``Σₜ gₙₜ``), ``qkv``'s weight, used without its module running, by the Linear
    closed form, the table where it meets the scores or, fused, as the mask expanded over
    the samples: no generic fallback; first order against the loop-free reference, the GGN
    diagonal too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, x, y = _joined(how, fused)
    lf = nn.CrossEntropyLoss()
    with sdpa_kernel(SDPBackend.MATH):  # (torch.func's vmap: no mask gradient in the kernels)
        ggn = diag_ggn(model, lf, x, y)
    with sdpa_kernel(SDPBackend.MATH):
        _first_order_without_fallback(model, x, y, lf)
    model.zero_grad()
    with collect(DiagGGNExact()):
        extend(lf)(model(x), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ggn[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("how", ["reused", "unused"])
def test_joined_bias_used_otherwise_undoes_the_release(how: str) -> None:
    """A joined vector used other than as a linear layer's bias, or not used at all: the
    module claims its parameters after all (the generic rule), with the same numbers."""
    model, x, y = _joined(how, False)
    _check_first_order_and_diag_ggn(model, x, y)
    assert get_rule(model)._release(type(model)) is False


def test_joined_bias_kronecker_factors() -> None:
    """KFLR: ``qkv``'s weight has its Kronecker pair (``A`` from the input it is applied to),
    the joined biases and the table the single factor of their exact GGN diagonal."""
    model, x, y = _joined("positional", False)
    lf = nn.CrossEntropyLoss()
    ggn = diag_ggn(model, lf, x, y)
    extend(model)
    with collect(KFLR()):
        extend(lf)(model(x), y).backward()
    assert [tuple(f.shape) for f in model.qkv.weight.kflr] == [(12, 12), (4, 4)]
    for k in ("q_bias", "v_bias", "table"):
        (d,) = getattr(model, k).kflr
        torch.testing.assert_close(d, torch.diag(ggn[k].reshape(-1)), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n", [1, N])
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_joined_bias_diag_hessian(fused: bool, n: int) -> None:
    """DiagHessian through the joined bias, the table (fused: a mask that needs gradients,
    expanded over the samples — for one sample too) and the attention, against the dense
    Hessian."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, x, y = _joined("positional", fused, n)
    lf = nn.CrossEntropyLoss()
    with sdpa_kernel(SDPBackend.MATH):
        ref = split(torch.diagonal(loss_hessian(model, lf, x, y)), model)
    extend(model)
    with collect(DiagHessian()):
        extend(lf)(model(x), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], rtol=1e-9, atol=1e-12, msg=k)


class EscapingJoin(nn.Module):
    """A joined bias returned by its module and used again after the module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        self.register_buffer("k_bias", torch.zeros(4))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        return F.linear(x, self.qkv.weight, bias), bias


class UsesEscapedJoin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = EscapingJoin(), nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        h, bias = self.attn(x)
        return self.head(torch.tanh(h) + bias)


def test_joined_bias_used_after_its_module_is_refused() -> None:
    """The joined vector used after its module's forward (returned): that use cannot be
    attributed any more (the module's calls are settled), so the pass is refused before
    anything is written, naming the module (it was silently wrong: the biases' per-sample
    gradients missed that use)."""
    torch.manual_seed(12)
    model = extend(UsesEscapedJoin().to(DT))
    lf = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))
    refused = pytest.raises(RuntimeError, match="EscapingJoin joined from its own parameters")
    with refused, collect(BatchGrad()):
        lf(model(x), y).backward()
    assert all(p.grad is None and not hasattr(p, "grad_batch") for p in model.parameters())
