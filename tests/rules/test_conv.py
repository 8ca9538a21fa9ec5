"""Convolution and transpose-convolution rules against per-sample VJPs from ``torch.func``.

References (float64): ``V[m, n] = vjp(θ ↦ module(xₙ; θ))(g[m, n])`` with ``vmap`` over samples
and columns; ``A`` from the per-sample Jacobian of the output w.r.t. one output channel's
weights (which *is* the unfolded input), ``B`` from the reference bias gradients.

The convolution family: ``backprism.rules.conv``, ``backprism.rules.convtranspose`` and their
shared machinery ``backprism.rules.unfold``. End to end, second order: ``DiagGGNExact``,
``BatchDiagGGNExact`` and ``SqrtGGNExact`` on ``conv → tanh → Linear`` for random
convolutions and transpose convolutions (1d/2d/3d, groups, stride, dilation, padding modes),
whole and chunked, against ``tests/reference.py::ggn_blocks``.
"""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vjp, vmap

import backprism
from backprism.engine.rule import Call
from backprism.extensions import (
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from backprism.rules import get_rule
from tests.common import CHUNKING, SETTINGS, Head, labels, run_family
from tests.reference import ggn_blocks, per_sample_grads

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


# -- references ----------------------------------------------------------------------------
def ref_per_sample(module: nn.Module, x: Tensor, g: Tensor, kwargs: dict) -> dict[str, Tensor]:
    """``{name: [M, N, *p]}``: per-sample, per-column VJPs w.r.t. the parameters."""
    params = {k: v.detach() for k, v in module.named_parameters()}

    def one(xn: Tensor, gn: Tensor) -> dict[str, Tensor]:
        def f(p: dict[str, Tensor]) -> Tensor:
            return functional_call(module, p, (xn.unsqueeze(0),), kwargs).squeeze(0)

        _, pull = vjp(f, params)
        return vmap(pull)(gn)[0]

    out = vmap(one, in_dims=(0, 1))(x, g)
    return {k: v.transpose(0, 1) for k, v in out.items()}


def ref_unfolded(
    module: nn.Module, x: Tensor, kwargs: dict, transpose: bool, channel: int = 0
) -> Tensor:
    """``[N, I, L]``: ∂out[n, c, l] / ∂(weight of output channel c), i.e. the unfolded input
    of the group that output channel ``c`` belongs to."""
    w = module.weight.detach()
    c = channel

    def out0(wc: Tensor, xn: Tensor) -> Tensor:
        if transpose:
            full = torch.cat([w[:, :c], wc.unsqueeze(1), w[:, c + 1 :]], 1)
        else:
            full = torch.cat([w[:c], wc.unsqueeze(0), w[c + 1 :]], 0)
        p = {"weight": full}
        if module.bias is not None:
            p["bias"] = module.bias.detach()
        return functional_call(module, p, (xn.unsqueeze(0),), kwargs)[0, c].flatten()

    wc = w[:, c] if transpose else w[c]
    jac = vmap(jacrev(out0), in_dims=(None, 0))(wc, x)  # [N, L, *wc.shape]
    return jac.flatten(2).transpose(1, 2)


# -- configurations ------------------------------------------------------------------------
@st.composite
def conv_case(draw: st.DrawFn, transpose: bool, depthwise: bool = False) -> dict:
    """A random (transpose) convolution and input; ``depthwise``: one input channel per
    group (``C_in = groups``, ``C_out`` a multiple)."""
    dim = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.sampled_from([1, 2, 3] if depthwise else [1, 1, 2]))
    cin = groups * (1 if depthwise else draw(st.integers(1, 2)))
    cout = groups * draw(st.integers(1, 2 if dim == 3 else 3))
    kmax = 2 if dim == 3 else 3
    k = tuple(draw(st.integers(1, kmax)) for _ in range(dim))
    s = tuple(draw(st.integers(1, 2)) for _ in range(dim))
    d = tuple(draw(st.integers(1, 2)) for _ in range(dim))
    n = draw(st.integers(1, 3))
    m = draw(st.integers(1, 3))
    bias = draw(st.booleans())
    kwargs: dict = {}
    if transpose:
        pad = tuple(draw(st.integers(0, 1)) for _ in range(dim))
        size = tuple(draw(st.integers(1, 3 if dim == 3 else 4)) for _ in range(dim))
        opad = tuple(draw(st.integers(0, max(si, di) - 1)) for si, di in zip(s, d))
        full = [
            (si_ - 1) * st_ - 2 * p + dl * (kk - 1) + 1
            for si_, st_, p, dl, kk in zip(size, s, pad, d, k)
        ]
        # fix the padding so that every output axis is non-empty
        pad = tuple(0 if f <= 0 else p for f, p in zip(full, pad))
        use_output_size = draw(st.booleans())
        module = CONVT[dim](cin, cout, k, s, pad, 0 if use_output_size else opad, groups, bias,
                            d)
        if use_output_size:  # forward's output_size allows up to stride - 1 extra elements
            kwargs["output_size"] = [
                (si_ - 1) * st_ - 2 * p + dl * (kk - 1) + 1 + min(op, st_ - 1)
                for si_, st_, p, dl, kk, op in zip(size, s, pad, d, k, opad)
            ]
    else:
        mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
        padding_kind = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
        if padding_kind == "same":
            s = (1,) * dim
            pad: object = "same"
        elif padding_kind == "valid":
            pad = "valid"
        elif padding_kind == "int":
            pad = draw(st.integers(0, 2))
        else:
            pad = tuple(draw(st.integers(0, 2)) for _ in range(dim))
        span = [dl * (kk - 1) + 1 for dl, kk in zip(d, k)]
        extra = 1 if dim == 3 else 3
        size = tuple(sp + draw(st.integers(0, extra)) for sp in span)
        if mode in ("reflect", "circular"):  # padding must be smaller than the input
            size = tuple(max(si_, 5) for si_ in size)
        module = CONV[dim](cin, cout, k, s, pad, d, groups, bias, padding_mode=mode)
    module = module.double()
    x = torch.randn(n, cin, *size, dtype=torch.float64)
    return {"module": module, "x": x, "m": m, "kwargs": kwargs, "transpose": transpose}


def _call(module: nn.Module, x: Tensor, kwargs: dict) -> tuple[Call, Tensor]:
    out = module(x, **kwargs)
    call = Call(module=module, args=(x,), kwargs=kwargs, out_shapes=[out.shape],
                batch_size=x.shape[0], training=True, params=dict(module.named_parameters()))
    return call, out


def _check_case(case: dict) -> None:
    module, x, m, kwargs = case["module"], case["x"], case["m"], case["kwargs"]
    rule = get_rule(module)
    assert type(rule).__module__.startswith("backprism.rules.conv")
    call, out = _call(module, x, kwargs)
    n = x.shape[0]
    g = torch.randn(m, *out.shape, dtype=torch.float64)
    w = torch.randn(m, n, dtype=torch.float64)
    ref = ref_per_sample(module, x, g, kwargs)
    names = set(ref)

    def expected(name: str, which: str) -> Tensor:
        v = ref[name]
        wv = w.reshape(m, n, *([1] * (v.dim() - 2)))
        return {
            "summed": v.sum(1),
            "sum_squared": v.square().sum((0, 1)),
            "sum_squared_w": (wv * v.square()).sum((0, 1)),
            "batch_sum_squared": v.square().sum(0),
            "batch_sum_squared_w": (wv * v.square()).sum(0),
            "batch_l2": v.flatten(2).square().sum((0, 2)),
            "batch_dot": torch.einsum("mnp,mkp->nk", v.flatten(2), v.flatten(2)),
        }[which]

    def compute(which: str) -> dict[str, Tensor]:
        if which.endswith("_w"):
            return getattr(rule, which[:-2])(call, g, w)
        return getattr(rule, which)(call, g)

    # "summed" twice: PyTorch's weight gradient, then the sum left by sum_squared (M = 1)
    stats = ["summed", "sum_squared", "summed", "sum_squared_w", "batch_sum_squared",
             "batch_sum_squared_w", "batch_l2", "batch_dot"]
    # first without, then with the per-sample gradients cached for this columns tensor
    for phase in ("direct", "cached"):
        if phase == "cached":
            ps = rule.per_sample(call, g)
            assert set(ps) == names
            for k in names:
                assert ps[k].shape == ref[k].shape
                torch.testing.assert_close(ps[k], ref[k])
        for which in stats:
            res = compute(which)
            assert set(res) == names, which
            for k in names:
                torch.testing.assert_close(res[k], expected(k, which), msg=f"{which} {k}")

    # projections onto given directions: Σₘ ⟨V[m, n], v⟩
    vectors = {k: torch.randn(p.shape, dtype=torch.float64) for k, p in module.named_parameters()}
    proj = rule.batch_dot_with(call, g, vectors)
    assert set(proj) == names
    for k in names:
        torch.testing.assert_close(proj[k], ref[k].sum(0).flatten(1) @ vectors[k].flatten())

    # Kronecker factors: per group (a leading group axis) for grouped convolutions
    gb = g.flatten(3).sum(-1)  # Σ_l g: the bias gradients' definition
    if module.bias is not None:
        torch.testing.assert_close(gb, ref["bias"])
    b_full = torch.einsum("mni,mnj->ij", gb, gb)
    if case["transpose"] and module.groups != 1:
        with pytest.raises(NotImplementedError, match="groups=2"):
            rule.kronecker_factors(call, g)
    else:
        kf = rule.kronecker_factors(call, g)
        groups = module.groups
        o = module.out_channels // groups
        # the unfolded input of each group, from the output channel that starts the group
        xs = [ref_unfolded(module, x, kwargs, case["transpose"], h * o) for h in range(groups)]
        a_refs = [torch.einsum("nil,njl->ij", xu, xu) / n for xu in xs]
        if groups == 1:
            a_ref, b_ref = a_refs[0], b_full
        else:
            a_ref = torch.stack(a_refs)
            b_ref = torch.stack([b_full[h * o : (h + 1) * o, h * o : (h + 1) * o]
                                 for h in range(groups)])
        torch.testing.assert_close(kf["weight"][1], a_ref)
        torch.testing.assert_close(kf["weight"][0], b_ref)
        if module.bias is not None:
            assert len(kf["bias"]) == 1
            torch.testing.assert_close(kf["bias"][0], b_full)


@settings(max_examples=25, deadline=None)
@given(case=conv_case(transpose=False))
def test_conv_rule_methods(case: dict) -> None:
    _check_case(case)


@pytest.mark.parametrize("grouped", [True, False])
@settings(max_examples=15, deadline=None)
@given(case=conv_case(transpose=False))
def test_conv_per_sample_paths(grouped: bool, case: dict) -> None:
    """Both ways of building ``V`` — the weight gradient with the samples as groups, and the
    unfolded input — on every configuration (the choice between them is a speed heuristic)."""
    from backprism.rules.conv import _ConvRule

    with (
        mock.patch.object(_ConvRule, "_depthwise", lambda self, call: False),
        mock.patch.object(_ConvRule, "_grouped", lambda self, call: grouped),
    ):
        _check_case(case)
        with mock.patch("backprism.rules.unfold.CHUNK_ELEMENTS", 20):  # in sample chunks
            _check_case(case)


@settings(max_examples=30, deadline=None)
@given(case=conv_case(transpose=False, depthwise=True))
def test_depthwise_per_sample_path(case: dict) -> None:
    """``V`` of a depthwise convolution (one input channel per group, channel multipliers,
    strides, dilations, padding modes, one output position) as a convolution of the input
    with the columns as kernels — taken on every device here, whole and in sample chunks."""
    from backprism.rules.conv import _ConvRule

    with (
        mock.patch.object(_ConvRule, "_depthwise", lambda self, call: True),
        mock.patch.object(
            _ConvRule, "_depthwise_samples", autospec=True,
            side_effect=_ConvRule._depthwise_samples,
        ) as used,
    ):
        _check_case(case)
        with mock.patch("backprism.rules.unfold.CHUNK_ELEMENTS", 20):
            _check_case(case)
    assert used.called


@pytest.mark.parametrize("pairs", [True, False])
@settings(max_examples=15, deadline=None)
@given(case=st.one_of(conv_case(transpose=False), conv_case(transpose=True)))
def test_sum_squared_paths(pairs: bool, case: dict) -> None:
    """``Σ V²`` by pairs of output positions and by materialising ``V`` (the choice between
    them is a speed heuristic, :func:`~backprism.rules.unfold.pair_form_cheaper`), also in
    sample chunks."""
    with mock.patch("backprism.rules.unfold.pair_form_cheaper", lambda m, length: pairs):
        _check_case(case)
        with mock.patch("backprism.rules.unfold.CHUNK_ELEMENTS", 20):
            _check_case(case)


@pytest.mark.parametrize("gram", [True, False])
@settings(max_examples=20, deadline=None)
@given(case=conv_case(transpose=False))
def test_positions_first_unfold(gram: bool, case: dict) -> None:
    """``batch_l2`` from the input unfolded positions-first (features in the
    order ``(κ, c)``, a speed heuristic: :meth:`~backprism.rules.conv._ConvRule.
    positions_first`), in the Gram form and by materialising ``V``, whole and in sample
    chunks, against the per-sample gradients from the definition."""
    from backprism.rules.conv import _ConvRule

    module, x, m = case["module"], case["x"], case["m"]
    if module.groups != 1:
        return
    out = module(x, **case["kwargs"])
    g = torch.randn(m, *out.shape, dtype=torch.float64)
    v = ref_per_sample(module, x, g, case["kwargs"])["weight"]  # [M, N, *weight.shape]
    rule = get_rule(module)
    with (
        mock.patch.object(_ConvRule, "positions_first", lambda self, call: True),
        mock.patch("backprism.rules.unfold.gram_form_cheaper", lambda *a: gram),
        mock.patch.object(
            _ConvRule, "unfold_positions", autospec=True,
            side_effect=_ConvRule.unfold_positions,
        ) as used,
    ):
        for chunk in (None, 20):
            with mock.patch("backprism.rules.unfold.CHUNK_ELEMENTS", chunk or 2**22):
                # a fresh call each: nothing cached from another statistic
                l2 = rule.batch_l2(_call(module, x, case["kwargs"])[0], g)["weight"]
                torch.testing.assert_close(l2, v.flatten(2).square().sum((0, 2)))
    assert used.called


@settings(max_examples=25, deadline=None)
@given(case=conv_case(transpose=True))
def test_conv_transpose_rule_methods(case: dict) -> None:
    _check_case(case)


def test_large_batch_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sample chunking (tiny chunk budget) and the Gram form of ``batch_l2`` agree too."""
    from backprism.rules import unfold

    monkeypatch.setattr(unfold, "CHUNK_ELEMENTS", 50)
    for module in (
        nn.Conv2d(2, 3, 2, padding=1, groups=1).double(),  # L large: materialise
        nn.Conv2d(4, 2, 3, groups=2).double(),  # L = 1: Gram form
        nn.ConvTranspose1d(2, 4, 3, stride=2, groups=2).double(),
    ):
        x = torch.randn(5, module.in_channels, *([3] * (module.weight.dim() - 2)),
                        dtype=torch.float64)
        _check_case({"module": module, "x": x, "m": 2, "kwargs": {}, "transpose": False}
                    if isinstance(module, nn.Conv2d) else
                    {"module": module, "x": x, "m": 2, "kwargs": {}, "transpose": True})


def test_frozen_parameters() -> None:
    conv = nn.Conv2d(2, 3, 3).double()
    conv.weight.requires_grad_(False)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    call, out = _call(conv, x, {})
    call.params = {k: p for k, p in conv.named_parameters() if p.requires_grad}
    g = torch.randn(1, *out.shape, dtype=torch.float64)
    rule = get_rule(conv)
    assert set(rule.per_sample(call, g)) == {"bias"}
    assert set(rule.batch_l2(call, g)) == {"bias"}


def test_unbatched_input_is_refused() -> None:
    conv = nn.Conv2d(2, 3, 3)
    x = torch.randn(2, 5, 5)
    out = conv(x)
    call = Call(module=conv, args=(x,), kwargs={}, out_shapes=[out.shape], batch_size=2,
                training=True, params=dict(conv.named_parameters()))
    with pytest.raises(ValueError, match="batch axis"):
        get_rule(conv).per_sample(call, out.unsqueeze(0))


# -- end to end ----------------------------------------------------------------------------
class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, padding_mode="reflect")
        self.conv2 = nn.Conv2d(c, c, 3, padding="same", groups=c, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(torch.relu(self.conv1(x)))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=1, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        Residual(4),
        nn.ConvTranspose2d(4, 3, 2, stride=2, output_padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 9 * 9, 5),
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_end_to_end_first_order(reduction: str) -> None:
    torch.manual_seed(0)
    model = _cnn().double()
    n = 4
    x = torch.randn(n, 2, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 5, (n,))
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    ref = per_sample_grads(model, lossfunc, x, y)
    backprism.extend(model)
    backprism.extend(lossfunc)
    with backprism.collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(),
                           BatchDotGrad()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        r = ref[name]
        f = r.flatten(1)
        torch.testing.assert_close(p.grad_batch, r, msg=name)
        torch.testing.assert_close(p.batch_l2, f.square().sum(1), msg=name)
        torch.testing.assert_close(p.sum_grad_squared, r.square().sum(0), msg=name)
        torch.testing.assert_close(
            p.variance, r.square().mean(0) - r.mean(0).square(), msg=name
        )
        torch.testing.assert_close(p.batch_dot, f @ f.t(), msg=name)
        torch.testing.assert_close(p.grad, r.sum(0), msg=name)


@pytest.mark.parametrize("order", ["l2_first", "grad_first"])
def test_end_to_end_conv_pool(order: str) -> None:
    """Conv2d → ReLU → MaxPool → Flatten → Linear; extension order exercises the cache."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, dilation=1, padding=1, padding_mode="circular"),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 2 * 2, 3),
    ).double()
    x = torch.randn(3, 3, 9, 9, dtype=torch.float64)
    y = torch.randint(0, 3, (3,))
    lossfunc = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lossfunc, x, y)
    backprism.extend(model)
    backprism.extend(lossfunc)
    exts = [BatchL2Grad(), SumGradSquared(), BatchGrad()]
    if order == "grad_first":
        exts.reverse()
    with backprism.collect(*exts):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        r = ref[name]
        torch.testing.assert_close(p.grad_batch, r, msg=name)
        torch.testing.assert_close(p.batch_l2, r.flatten(1).square().sum(1), msg=name)
        torch.testing.assert_close(p.sum_grad_squared, r.square().sum(0), msg=name)


def test_unfold_shapes_3d_float32() -> None:
    """float32 path: no upcast, shape of the per-sample gradients."""
    conv = nn.Conv3d(2, 4, (1, 2, 3), stride=(1, 2, 1), groups=2)
    x = torch.randn(3, 2, 3, 4, 5)
    call, out = _call(conv, x, {})
    g = torch.randn(2, *out.shape)
    ps = get_rule(conv).per_sample(call, g)
    assert ps["weight"].dtype == torch.float32
    assert ps["weight"].shape == (2, 3, *conv.weight.shape)
    assert math.prod(ps["bias"].shape) == 2 * 3 * 4


def test_end_to_end_second_order() -> None:
    """GGN diagonals and square roots (M = C columns, per-column squares) through the engine."""
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 2, padding=1, padding_mode="replicate"), nn.ReLU(),
        nn.ConvTranspose2d(2, 2, 2, stride=2, groups=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(2 * 8 * 8, 3),
    ).double()
    n = 2
    x = torch.randn(n, 1, 3, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    lossfunc = nn.CrossEntropyLoss()
    G, names, sizes = ggn_blocks(model, lossfunc, x, y)
    backprism.extend(model)
    backprism.extend(lossfunc)
    with backprism.collect(DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact()):
        lossfunc(model(x), y).backward()
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    params = dict(model.named_parameters())
    for name, a, b in zip(names, offsets[:-1], offsets[1:]):
        p = params[name]
        block = G[:, :, a:b, a:b]  # [N, N, P, P]
        per_sample_diag = torch.stack([torch.diagonal(block[i, i]) for i in range(n)])
        torch.testing.assert_close(p.diag_ggn_exact_batch.flatten(1), per_sample_diag,
                                   msg=name)
        torch.testing.assert_close(p.diag_ggn_exact.flatten(), per_sample_diag.sum(0),
                                   msg=name)
        v = p.sqrt_ggn_exact.flatten(2)  # [K, N, P]
        for i in range(n):  # Σₖ V[k, n] V[k, n]ᵀ is sample n's GGN block
            torch.testing.assert_close(v[:, i].t() @ v[:, i], block[i, i], msg=name)


DT = torch.float64
N = 2  # batch of the second-order family tests


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


@pytest.mark.parametrize(
    ("d", "kernel", "stride", "dilation", "padding", "mode"),
    [
        (1, (3,), (2,), (1,), [(1, 1)], "zeros"),
        (2, (3, 2), (1, 2), (2, 1), [(2, 1), (0, 1)], "reflect"),
        (2, (1, 1), (1, 1), (1, 1), [(0, 0), (0, 0)], "zeros"),
        (3, (2, 2, 2), (1, 1, 2), (1, 1, 1), [(1, 1), (0, 0), (1, 0)], "circular"),
    ],
)
def test_unfold_rows_is_the_unfold_with_features_first(
    d: int, kernel: tuple, stride: tuple, dilation: tuple, padding: list, mode: str
) -> None:
    """The features-first unfold (the Kronecker input factor's operand) against the definition
    ``X[c·K + κ, (n, l)] = x̃[n, c, s·l + d·κ]``, here through the ``[N, C, K, L]`` unfold,
    itself checked against the layers' outputs by the other tests: columns sample-major
    (``n·L + l``) where the last output axis is long, else position-major (``l·N + n``)."""
    from backprism.rules.unfold import unfold_conv, unfold_conv_rows

    torch.manual_seed(0)
    for size in (7, 20):
        x = torch.randn(3, 2, *([size] * d), dtype=torch.float64)
        full = unfold_conv(x, kernel, stride, dilation, padding, mode)  # [N, C, K, L]
        rows = unfold_conv_rows(x, kernel, stride, dilation, padding, mode)
        n, c, k, length = full.shape
        last = (size + sum(padding[-1]) - dilation[-1] * (kernel[-1] - 1) - 1) // stride[-1] + 1
        if last < 16 and length > 1:
            assert torch.equal(rows, full.permute(1, 2, 3, 0).reshape(c * k, length * n))
        else:
            assert torch.equal(rows, full.permute(1, 2, 0, 3).reshape(c * k, n * length))


@pytest.mark.parametrize(
    ("d", "kernel", "dilation", "padding", "mode", "size"),
    [
        (1, 7, 1, 3, "zeros", 40),
        (1, 5, 2, 3, "zeros", 40),
        (2, 3, 1, 1, "zeros", 9),
        (2, 3, (1, 2), "same", "zeros", 12),
        (2, 3, 2, 2, "zeros", 20),
        (2, (3, 5), 1, (0, 1), "zeros", 12),
        (2, 3, 1, 1, "reflect", 8),
        (2, 3, 1, 1, "circular", 8),
        (3, (1, 3, 3), 1, (0, 1, 1), "zeros", 10),
    ],
)
def test_input_factor_by_shifts_against_the_definition(
    d: int, kernel: Any, dilation: Any, padding: Any, mode: str, size: int
) -> None:
    """KFLR's input factor of stride-1 convolutions large enough for the shifted products
    (``rules.conv_factor``): ``A = (1/N) Σ_{n,l} X_{nl} X_{nl}ᵀ`` with the patches
    ``X[n, :, l] = ∂ out[n, 0, l] / ∂ W[0]`` from ``torch.func.jacrev`` of the layer."""
    from backprism.extensions import KFLR
    from backprism.rules.conv_factor import shifts_cheaper

    torch.manual_seed(3)
    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1]
    conv = cls(3, 2, kernel, dilation=dilation, padding=padding, padding_mode=mode, bias=False)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten()).to(DT)
    X = torch.randn(2, 3, *[size] * d, dtype=DT)
    out = conv(X)
    assert shifts_cheaper(X.shape[2:], conv.kernel_size, conv.dilation, out.shape[2:])
    head = nn.Linear(out[0].numel(), 3).to(DT)
    model.append(head)
    jac = jacrev(lambda w: functional_call(conv, {"weight": w}, (X,)))(conv.weight.detach())
    patches = jac[:, 0].flatten(1, d)[:, :, 0].flatten(2)  # [N, L, C·K]
    ref = torch.einsum("nli,nlj->ij", patches, patches) / X.shape[0]
    backprism.extend(model)
    lf = backprism.extend(nn.CrossEntropyLoss())
    with backprism.collect(KFLR()):
        lf(model(X), torch.tensor([0, 2])).backward()
    torch.testing.assert_close(conv.weight.kflr[1], ref, rtol=1e-10, atol=1e-12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    d=st.integers(1, 3),
    kernel=st.integers(1, 4),
    dilation=st.integers(1, 2),
    pad=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    size=st.integers(1, 7),
    n=st.integers(1, 3),
    c=st.integers(1, 3),
)
def test_input_factor_by_shifts_fuzzed(
    d: int, kernel: int, dilation: int, pad: tuple[int, int], size: int, n: int, c: int
) -> None:
    """``input_factor_by_shifts`` on any stride-1 geometry (asymmetric padding, kernels as
    large as the input, dilations) against ``Σ_{n,l} X_{nl} X_{nl}ᵀ`` with the patches from
    ``jacrev`` of the convolution over the explicitly padded input."""
    from backprism.rules.conv_factor import input_factor_by_shifts

    out = size + sum(pad) - dilation * (kernel - 1)
    if out < 1:
        return
    torch.manual_seed(n * 100 + c * 10 + size)
    x = torch.randn(n, c, *[size] * d, dtype=DT)
    padded = F.pad(x, [pad[0], pad[1]] * d)
    conv = (F.conv1d, F.conv2d, F.conv3d)[d - 1]
    w = torch.zeros(1, c, *[kernel] * d, dtype=DT)
    jac = jacrev(lambda v: conv(padded, v, dilation=dilation))(w)  # [N, 1, *L, 1, C, *k]
    patches = jac[:, 0].flatten(1, d)[:, :, 0].flatten(2)  # [N, L, C·K]
    ref = torch.einsum("nli,nlj->ij", patches, patches)
    got = input_factor_by_shifts(x, [kernel] * d, [dilation] * d, [pad[0]] * d, [out] * d)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
