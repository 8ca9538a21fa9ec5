"""``backpack.core.derivatives`` of the BackPACK shim on the layers whose forward is not a pure
per-sample function of ``input0`` (BatchNorm in train mode, RNN/LSTM/GRU, Dropout), on loss
modules (``reduction='none'`` on one element, ``sum_hessian`` shapes, ``_make_distribution``,
``use_autograd``, sub-sampled MC draws) and on ``hessian_is_zero``.

References are dense ``torch.func``/autograd computations from each quantity's definition
(float64); where the original BackPACK package is installed, the same calls are also compared
with it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jvp, vjp

from backprism.compat.backpack import core
from backprism.compat.backpack.core.derivatives.batchnorm_nd import BatchNormNdDerivatives
from backprism.compat.backpack.core.derivatives.bcewithlogitsloss import (
    BCELossWithLogitsDerivatives,
)
from backprism.compat.backpack.core.derivatives.crossentropyloss import (
    CrossEntropyLossDerivatives,
)
from backprism.compat.backpack.core.derivatives.dropout import DropoutDerivatives
from backprism.compat.backpack.core.derivatives.embedding import EmbeddingDerivatives
from backprism.compat.backpack.core.derivatives.lstm import LSTMDerivatives
from backprism.compat.backpack.core.derivatives.mseloss import MSELossDerivatives
from backprism.compat.backpack.core.derivatives.nll_base import NLLLossDerivatives
from backprism.compat.backpack.core.derivatives.rnn import RNNDerivatives
from backprism.compat.backpack.custom_module import Pad, Permute, ScaleModule, Slicing

DT = torch.float64
V = 3

# RNN parameter Jacobians take backprism's generic torch.func rule, which says so once per type
pytestmark = pytest.mark.filterwarnings("ignore::backprism.rules.generic.GenericRuleWarning")


def with_io(module: nn.Module, *inputs: Any) -> Any:
    """One forward pass storing ``input0, input1, …`` and ``output`` as BackPACK does."""
    out = module(*inputs)
    for i, x in enumerate(inputs):
        object.__setattr__(module, f"input{i}", x)
    object.__setattr__(module, "output", out)
    return out


def close(a: Tensor, b: Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# -- BatchNorm in train mode: derivatives of the whole-batch map ----------------------------------
def _bn_reference(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    """``γ (x − μ_B)/√(σ²_B + ε) + β`` with the biased batch statistics over all axes but 1."""
    axes = [a for a in range(x.dim()) if a != 1]
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean = x.mean(axes, keepdim=True)
    var = (x - mean).square().mean(axes, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w.view(shape) + b.view(shape)


def _bn_problem(shape: tuple[int, ...]) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    bn = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[
        len(shape)
    ](shape[1]).to(DT)
    with torch.no_grad():
        bn.weight.normal_()
        bn.bias.normal_()
    x = torch.randn(*shape, dtype=DT)
    with_io(bn, x)
    return bn, x


BN_SHAPES = [(5, 4), (4, 3, 6), (3, 2, 3, 4)]


@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
def test_batch_norm_train_input_jacobians_are_those_of_the_whole_batch(shape):
    bn, x = _bn_problem(shape)
    w, b = bn.weight.detach(), bn.bias.detach()
    d = BatchNormNdDerivatives()
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())

    def f(z: Tensor) -> Tensor:
        return _bn_reference(z, w, b, bn.eps)

    mat = torch.randn(V, *shape, dtype=DT)
    _, pull = vjp(f, x)
    close(d.jac_t_mat_prod(bn, None, None, mat), torch.stack([pull(m)[0] for m in mat]))
    vin = torch.randn(V, *shape, dtype=DT)
    close(d.jac_mat_prod(bn, None, None, vin), torch.stack([jvp(f, (x,), (v,))[1] for v in vin]))
    close(d.jac_t_mat_prod(bn, None, None, mat[0]), pull(mat[0])[0])  # a single vector
    with pytest.raises(NotImplementedError, match="mixes the samples"):
        d.jac_t_mat_prod(bn, None, None, mat[:, :2], subsampling=[0, 1])
    with pytest.raises(NotImplementedError):
        d.ea_jac_t_mat_jac_prod(bn, None, None, torch.eye(math.prod(shape[1:]), dtype=DT))
    # nothing was written to the running statistics
    for before, after in zip(stats, (bn.running_mean, bn.running_var, bn.num_batches_tracked)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("subsampling", [None, [2, 0, 2]], ids=str)
@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
def test_batch_norm_train_parameter_jacobians(shape, subsampling):
    """Per-sample ``(∂yₙ/∂θ)ᵀ mat[v, n]`` with the whole batch's statistics (then subsampled),
    and ``(∂y/∂θ) mat`` of the whole batch."""
    bn, x = _bn_problem(shape)
    params = {"weight": bn.weight.detach(), "bias": bn.bias.detach()}
    d = BatchNormNdDerivatives()
    rows = list(range(shape[0])) if subsampling is None else subsampling
    mat = torch.randn(V, len(rows), *shape[1:], dtype=DT)
    for name in params:

        def f(p: Tensor, name: str = name) -> Tensor:
            q = {**params, name: p}
            return _bn_reference(x, q["weight"], q["bias"], bn.eps)

        _, pull = vjp(f, params[name])
        ref = torch.stack(
            [
                torch.stack(
                    [pull(_embed_row(mat[v, i], n, shape))[0] for i, n in enumerate(rows)]
                )
                for v in range(V)
            ]
        )  # [V, N_sub, C]
        res = d.param_mjp(name, bn, None, None, mat, sum_batch=False, subsampling=subsampling)
        close(res, ref)
        close(d.param_mjp(name, bn, None, None, mat, subsampling=subsampling), ref.sum(1))
        vin = torch.randn(V, *params[name].shape, dtype=DT)
        ref_j = torch.stack([jvp(f, (params[name],), (v,))[1] for v in vin])
        close(d._param_jac_mat_prod(name, bn, vin), ref_j)
    close(
        d.weight_jac_mat_prod(bn, None, None, vin),
        d._param_jac_mat_prod("weight", bn, vin),
    )


def _embed_row(row: Tensor, n: int, shape: tuple[int, ...]) -> Tensor:
    """A cotangent of the full output that is ``row`` at sample ``n`` and zero elsewhere."""
    out = torch.zeros(shape, dtype=row.dtype)
    out[n] = row
    return out


def test_batch_norm_eval_mode_is_affine_and_subsamples():
    bn, x = _bn_problem((5, 4, 3))
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 2.0)
    bn.eval()
    with_io(bn, x)
    d = BatchNormNdDerivatives()
    scale = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
    mat = torch.randn(V, 2, 4, 3, dtype=DT)
    close(d.jac_t_mat_prod(bn, None, None, mat, subsampling=[4, 1]), mat * scale.view(1, 1, -1, 1))
    x_hat = (x - bn.running_mean.view(1, -1, 1)) / torch.sqrt(bn.running_var + bn.eps).view(
        1, -1, 1
    )
    close(
        d.param_mjp("weight", bn, None, None, mat, sum_batch=False, subsampling=[4, 1]),
        (mat * x_hat[[4, 1]]).sum(-1),
    )
    assert d.hessian_is_zero(bn)
    bn.train()
    assert not d.hessian_is_zero(bn)


# -- RNN, LSTM, GRU -------------------------------------------------------------------------------
RNNS = {
    "rnn": lambda bf: nn.RNN(4, 3, batch_first=bf),
    "lstm": lambda bf: nn.LSTM(4, 3, batch_first=bf),
    "gru": lambda bf: nn.GRU(4, 3, batch_first=bf),
}


def _rnn_problem(kind: str, batch_first: bool, hx: bool) -> tuple[nn.Module, Tensor, Any]:
    torch.manual_seed(1)
    rnn = RNNS[kind](batch_first).to(DT)
    n, t = 3, 5
    x = torch.randn(n, t, 4, dtype=DT) if batch_first else torch.randn(t, n, 4, dtype=DT)
    h0: Any = None
    if hx:
        h0 = torch.randn(1, n, 3, dtype=DT)
        if kind == "lstm":
            h0 = (h0, torch.randn(1, n, 3, dtype=DT))
        with_io(rnn, x, h0)
    else:
        with_io(rnn, x)
    return rnn, x, h0


def _rnn_fn(rnn: nn.Module, h0: Any) -> Callable[..., Tensor]:
    """The first output as a function of the input (and parameters), ``h0`` held fixed."""

    def f(z: Tensor, params: dict[str, Tensor] | None = None) -> Tensor:
        args = (z,) if h0 is None else (z, h0)
        p = {k: v.detach() for k, v in rnn.named_parameters()} if params is None else params
        return functional_call(rnn, p, args)[0]

    return f


def _take(t: Any, idx: list[int], axis: int) -> Any:
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_take(s, idx, axis) for s in t)
    return t.index_select(axis, torch.tensor(idx))


@pytest.mark.parametrize("hx", [False, True], ids=["h0=0", "h0"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "time_first"])
@pytest.mark.parametrize("kind", list(RNNS))
def test_rnn_derivatives(kind, batch_first, hx):
    rnn, x, h0 = _rnn_problem(kind, batch_first, hx)
    d = LSTMDerivatives() if kind == "lstm" else RNNDerivatives()
    f = _rnn_fn(rnn, h0)
    ax = 0 if batch_first else 1
    out = f(x)
    # jac_t_mat_prod: the full batch
    mat = torch.randn(V, *out.shape, dtype=DT)
    _, pull = vjp(f, x)
    close(d.jac_t_mat_prod(rnn, None, None, mat), torch.stack([pull(m)[0] for m in mat]))
    # with sub-sampling: rows of the requested samples (samples are independent)
    sub = [2, 0, 2]
    mat_s = torch.randn(V, *_take(out, sub, ax).shape, dtype=DT)
    ref = []
    for m in mat_s:
        rows = []
        for i, n in enumerate(sub):
            cot = torch.zeros_like(out)
            cot.select(ax, n).copy_(m.select(ax, i))
            rows.append(pull(cot)[0].select(ax, n))
        ref.append(torch.stack(rows, ax))
    close(d.jac_t_mat_prod(rnn, None, None, mat_s, subsampling=sub), torch.stack(ref))
    # jac_mat_prod
    vin = torch.randn(V, *x.shape, dtype=DT)
    close(d.jac_mat_prod(rnn, None, None, vin), torch.stack([jvp(f, (x,), (v,))[1] for v in vin]))
    # per-sample parameter VJPs, each sample run alone
    params = {k: v.detach() for k, v in rnn.named_parameters()}
    for name in params:
        res = d.param_mjp(name, rnn, None, None, mat_s, sum_batch=False, subsampling=sub)
        ref_p = torch.zeros(V, len(sub), *params[name].shape, dtype=DT)
        for i, n in enumerate(sub):
            xn = _take(x, [n], ax)
            fn = _rnn_fn(rnn, _take(h0, [n], 1))

            def g(p: Tensor, fn: Callable[..., Tensor] = fn, xn: Tensor = xn) -> Tensor:
                return fn(xn, {**params, name: p})  # noqa: B023

            _, pull_p = vjp(g, params[name])
            for v in range(V):
                ref_p[v, i] = pull_p(mat_s[v].select(ax, i).unsqueeze(ax))[0]
        close(res, ref_p)
        close(d.param_mjp(name, rnn, None, None, mat_s, subsampling=sub), ref_p.sum(1))
        # parameter JVP of the whole batch
        vp = torch.randn(V, *params[name].shape, dtype=DT)

        def h(p: Tensor) -> Tensor:
            return f(x, {**params, name: p})  # noqa: B023

        close(
            d._param_jac_mat_prod(name, rnn, vp),
            torch.stack([jvp(h, (params[name],), (v,))[1] for v in vp]),
        )
    assert not d.hessian_is_zero(rnn)
    assert torch.backends.mkldnn.enabled and torch.backends.cudnn.enabled  # restored


def test_rnn_reads_backpack_style_tensor_output():
    """BackPACK stores ``output[0]`` of an RNN; the derivatives read either form."""
    rnn, _, _ = _rnn_problem("lstm", True, False)
    mat = torch.randn(V, 3, 5, 3, dtype=DT)
    d = LSTMDerivatives()
    ref = d.param_mjp("weight_hh_l0", rnn, None, None, mat, sum_batch=False)
    object.__setattr__(rnn, "output", rnn.output[0])
    close(d.param_mjp("weight_hh_l0", rnn, None, None, mat, sum_batch=False), ref)
    assert d.reshape_like_output(mat.flatten(), rnn).shape == mat.shape


# -- Dropout: the stored mask, no fresh draw ------------------------------------------------------
def test_dropout_train_mode_uses_the_stored_mask():
    torch.manual_seed(2)
    drop = nn.Dropout(p=0.4)
    x = torch.randn(6, 5, dtype=DT)
    out = with_io(drop, x)
    jac = (out != 0).to(DT) / 0.6
    d = DropoutDerivatives()
    mat = torch.randn(V, 6, 5, dtype=DT)
    for _ in range(2):  # no new mask per call
        close(d.jac_t_mat_prod(drop, None, None, mat), mat * jac)
    close(d.jac_t_mat_prod(drop, None, None, mat[:, [3, 3]], subsampling=[3, 3]),
          mat[:, [3, 3]] * jac[[3, 3]])
    close(d.jac_mat_prod(drop, None, None, mat), mat * jac)
    close(d.df(drop, None, None), jac)
    drop.eval()
    close(d.jac_t_mat_prod(drop, None, None, mat), mat)


# -- Embedding: integer input, float parameters ---------------------------------------------------
def test_embedding_param_mjp_keeps_the_parameter_dtype():
    torch.manual_seed(3)
    emb = nn.Embedding(5, 4).to(DT)
    idx = torch.randint(0, 5, (6, 2))
    with_io(emb, idx)
    mat = torch.randn(V, 6, 2, 4, dtype=DT)
    d = EmbeddingDerivatives()
    res = d.param_mjp("weight", emb, None, None, mat, sum_batch=False)
    w = emb.weight.detach()
    ref = torch.zeros(V, 6, *w.shape, dtype=DT)
    for n in range(6):
        _, pull = vjp(lambda p: nn.functional.embedding(idx[n], p), w)  # noqa: B023
        for v in range(V):
            ref[v, n] = pull(mat[v, n])[0]
    close(res, ref)
    with pytest.raises(NotImplementedError, match="no derivative"):
        d.jac_t_mat_prod(emb, None, None, mat)


# -- hessian_is_zero ------------------------------------------------------------------------------
def _bn_train() -> nn.Module:
    return nn.BatchNorm1d(3)


def _bn_eval() -> nn.Module:
    bn = nn.BatchNorm1d(3)
    bn.running_var.fill_(2.0)
    return bn.eval()


HESSIAN_IS_ZERO = [
    ("slicing", lambda: Slicing((slice(None), 1)), (4, 3, 2), True),
    ("pad", lambda: Pad((1, 2), value=1.0), (4, 3, 2), True),
    ("pad-reflect", lambda: Pad((1, 1), mode="reflect"), (4, 3, 2), True),
    ("permute", lambda: Permute(0, 2, 1), (4, 3, 2), True),
    ("scale", lambda: ScaleModule(2.5), (4, 3), True),
    ("leakyrelu", lambda: nn.LeakyReLU(0.1), (4, 3), True),
    ("batchnorm-eval", _bn_eval, (4, 3), True),
    ("batchnorm-train", _bn_train, (4, 3), False),
    ("rnn", lambda: nn.RNN(3, 2, batch_first=True), (2, 3, 3), False),
    ("lstm", lambda: nn.LSTM(3, 2, batch_first=True), (2, 3, 3), False),
    ("tanh", nn.Tanh, (4, 3), False),
]


@pytest.mark.parametrize(
    "make, shape, zero", [c[1:] for c in HESSIAN_IS_ZERO], ids=[c[0] for c in HESSIAN_IS_ZERO]
)
def test_hessian_is_zero_matches_the_second_derivative(make, shape, zero):
    """The answer agrees with ``∂²⟨c, out(x)⟩/∂x²`` at a random point (zero or not)."""
    torch.manual_seed(4)
    module = make().to(DT)
    x = torch.randn(*shape, dtype=DT)
    out = with_io(module, x)
    first = out[0] if isinstance(out, tuple) else out
    c = torch.randn_like(first)

    def scalar(z: Tensor) -> Tensor:
        o = module(z)
        return ((o[0] if isinstance(o, tuple) else o) * c).sum()

    h = torch.autograd.functional.hessian(scalar, x)  # (BatchNorm updates its running stats)
    assert core.BaseDerivatives().hessian_is_zero(module) is zero
    assert bool(h.abs().max() < 1e-12) is zero


# -- losses ---------------------------------------------------------------------------------------
def _loss_hessian(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Per-sample blocks ``[N, *f, *f]`` of the Hessian of the (scalar) loss."""
    h = hessian(lambda z: module(z, y).sum())(x)
    n = x.shape[0]
    f = x.shape[1:]
    d = math.prod(f)
    blocks = h.reshape(n, d, n, d)
    return torch.stack([blocks[i, :, i] for i in range(n)]).reshape(n, *f, *f)


LOSSES = {
    "ce": lambda red: (nn.CrossEntropyLoss(reduction=red), CrossEntropyLossDerivatives()),
    "mse": lambda red: (nn.MSELoss(reduction=red), MSELossDerivatives()),
    "bce": lambda red: (nn.BCEWithLogitsLoss(reduction=red), BCELossWithLogitsDerivatives()),
}


def _loss_data(kind: str, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    x = torch.randn(*shape, dtype=DT)
    if kind == "ce":
        return x, torch.randint(0, shape[1], (shape[0], *shape[2:]))
    if kind == "mse":
        return x, torch.randn(*shape, dtype=DT)
    return x, torch.randint(0, 2, shape).to(DT)


@pytest.mark.parametrize("kind", list(LOSSES))
def test_reduction_none_on_one_element_is_sum(kind):
    torch.manual_seed(5)
    module, d = LOSSES[kind]("none")
    x, y = _loss_data(kind, (1, 3) if kind == "ce" else (1, 1))  # one loss element
    with_io(module, x, y)
    hs = _loss_hessian(module, x, y)
    s = d.sqrt_hessian(module, None, None)
    close(torch.einsum("kni,knj->nij", s, s), hs)
    if kind != "bce":
        close(d.sum_hessian(module, None, None), hs.sum(0))
        mat = torch.randn(V, *x.shape, dtype=DT)
        close(
            d.make_hessian_mat_prod(module, None, None)(mat),
            torch.einsum("nij,vnj->vni", hs, mat),
        )
    # more than one element: not a scalar loss
    x2, y2 = _loss_data(kind, (4, 3) if kind != "bce" else (4, 1))
    with_io(module, x2, y2)
    with pytest.raises(ValueError, match="scalar"):
        d.sqrt_hessian(module, None, None)
    with pytest.raises(ValueError, match="scalar"):
        d.sqrt_hessian_sampled(module, None, None, mc_samples=2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_with_spatial_axes(reduction):
    """``sum_hessian`` is ``[C, d…, C, d…]``; ``make_hessian_mat_prod`` takes a vector too."""
    torch.manual_seed(6)
    module, d = LOSSES["ce"](reduction)
    x, y = _loss_data("ce", (3, 4, 2, 2))
    with_io(module, x, y)
    hs = _loss_hessian(module, x, y)
    close(d.sum_hessian(module, None, None), hs.sum(0))
    vec = torch.randn(*x.shape, dtype=DT)
    ref = torch.einsum("nabcdef,ndef->nabc", hs, vec)
    close(d.make_hessian_mat_prod(module, None, None)(vec), ref)
    s = d.sqrt_hessian(module, None, None, subsampling=[2, 0])
    close(torch.einsum("knabc,kndef->nabcdef", s, s), hs[[2, 0]])


def test_make_distribution_is_the_likelihood_of_the_loss():
    """``−log p(y | f)`` summed is the ``'sum'`` loss (up to a constant for MSE, checked through
    its gradient), and samples have the target's shape."""
    torch.manual_seed(7)
    x, y = _loss_data("ce", (3, 4, 2))
    dist = CrossEntropyLossDerivatives()._make_distribution(x)
    assert isinstance(dist, torch.distributions.Categorical)
    assert dist.sample().shape == y.shape
    close(-dist.log_prob(y).sum(), nn.functional.cross_entropy(x, y, reduction="sum"))

    x, y = _loss_data("mse", (3, 2))
    x.requires_grad_(True)
    dist = MSELossDerivatives()._make_distribution(x)
    assert isinstance(dist, torch.distributions.Normal)
    assert dist.sample().shape == y.shape
    assert torch.equal(dist.stddev, torch.tensor(math.sqrt(0.5)).expand(x.shape))
    (g1,) = torch.autograd.grad(-dist.log_prob(y).sum(), x)
    (g2,) = torch.autograd.grad(nn.functional.mse_loss(x, y, reduction="sum"), x)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-7)  # σ² = ½ in float32

    x, y = _loss_data("bce", (5, 1))
    dist = BCELossWithLogitsDerivatives()._make_distribution(x)
    assert isinstance(dist, torch.distributions.Binomial)
    assert dist.sample().shape == y.shape
    close(
        -dist.log_prob(y).sum(),
        nn.functional.binary_cross_entropy_with_logits(x, y, reduction="sum"),
    )


def _ce_draw(x: Tensor, m: int, z: float, per_call: bool) -> Tensor:
    """BackPACK's cross-entropy columns from the definition: labels ``y ~ Cat(softmax(x))``
    (``M`` calls of one draw each, or one call of ``M``), columns ``(p − e_y)/√(M Z)``."""
    p = torch.softmax(x, 1)
    dist = torch.distributions.Categorical(probs=p)
    y = torch.stack([dist.sample() for _ in range(m)]) if per_call else dist.sample((m,))
    onehot = nn.functional.one_hot(y, x.shape[1]).to(DT)
    return (p - onehot) / math.sqrt(m * z)


@pytest.mark.parametrize("use_autograd", [False, True])
@pytest.mark.parametrize("subsampling", [None, [3, 1, 3]], ids=str)
def test_sampled_cross_entropy_draws_as_backpack(use_autograd, subsampling):
    """Seeded, the MC factor is BackPACK's draw for the (subsampled) rows, with the mean's
    ``1/√N`` of the whole batch; ``use_autograd`` takes one ``sample()`` call per column."""
    torch.manual_seed(8)
    module, _ = LOSSES["ce"]("mean")
    d = CrossEntropyLossDerivatives(use_autograd=use_autograd)
    assert isinstance(d, NLLLossDerivatives)
    x, y = _loss_data("ce", (5, 4))
    with_io(module, x, y)
    xs = x if subsampling is None else x[subsampling]
    torch.manual_seed(9)
    res = d.sqrt_hessian_sampled(module, None, None, mc_samples=6, subsampling=subsampling)
    after = torch.rand(1)
    torch.manual_seed(9)
    ref = _ce_draw(xs, 6, 5.0, per_call=use_autograd)
    close(res, ref)
    assert torch.equal(after, torch.rand(1))  # the same calls on the global RNG


@pytest.mark.parametrize("kind", list(LOSSES))
def test_autograd_sampled_factor_approximates_the_hessian(kind):
    torch.manual_seed(10)
    module, d = LOSSES[kind]("mean")
    d.use_autograd = True
    x, y = _loss_data(kind, (2, 3) if kind != "bce" else (3, 1))
    with_io(module, x, y)
    s = d.sqrt_hessian_sampled(module, None, None, mc_samples=40000)
    est = torch.einsum("kni,knj->nij", s, s)
    ref = _loss_hessian(module, x, y)
    # MC error ≈ |H|/√M per entry: 0.5 % of the largest entry at M = 40000
    torch.testing.assert_close(est, ref, rtol=0.05, atol=0.025 * float(ref.abs().max()))


def test_autograd_sampling_refuses_other_likelihoods():
    torch.manual_seed(11)
    module = nn.CrossEntropyLoss(weight=torch.rand(3, dtype=DT))
    x, y = _loss_data("ce", (4, 3))
    with_io(module, x, y)
    with pytest.raises(NotImplementedError, match="use_autograd=False"):
        CrossEntropyLossDerivatives(use_autograd=True).sqrt_hessian_sampled(module, None, None)
    # the default path supports class weights: exact in expectation, checked via the exact factor
    s = CrossEntropyLossDerivatives().sqrt_hessian(module, None, None)
    close(torch.einsum("kni,knj->nij", s, s), _loss_hessian(module, x, y))


# -- against the original BackPACK package, where installed ----------------------------------------
def _original(path: str, name: str) -> Any:
    try:
        mod = importlib.import_module(path)
    except ImportError:
        pytest.skip("the original BackPACK package is not installed")
    if "backprism" in str(getattr(mod, "__file__", "") or "") or mod.__name__ != path:
        pytest.skip("`backpack` resolves to the backprism shim")
    return getattr(mod, name)


def test_layers_match_original_backpack():
    obn = _original("backpack.core.derivatives.batchnorm_nd", "BatchNormNdDerivatives")
    olstm = _original("backpack.core.derivatives.lstm", "LSTMDerivatives")
    bn, _ = _bn_problem((4, 3, 5))
    mat = torch.randn(V, 4, 3, 5, dtype=DT)
    close(BatchNormNdDerivatives().jac_t_mat_prod(bn, None, None, mat),
          obn().jac_t_mat_prod(bn, None, None, mat))
    close(BatchNormNdDerivatives().param_mjp("weight", bn, None, None, mat[:, :2], False, [3, 1]),
          obn().param_mjp("weight", bn, None, None, mat[:, :2], False, [3, 1]))
    rnn, _, _ = _rnn_problem("lstm", True, False)
    object.__setattr__(rnn, "output", rnn.output[0])  # as BackPACK stores it
    mat = torch.randn(V, 2, 5, 3, dtype=DT)
    for name, _ in rnn.named_parameters():
        close(LSTMDerivatives().param_mjp(name, rnn, None, None, mat, False, [2, 0]),
              olstm().param_mjp(name, rnn, None, None, mat, False, [2, 0]))


@pytest.mark.parametrize("use_autograd", [False, True])
@pytest.mark.parametrize("subsampling", [None, [2, 0, 2]], ids=str)
@pytest.mark.parametrize("kind", list(LOSSES))
def test_sampled_losses_match_original_backpack(kind, subsampling, use_autograd):
    files = {"ce": "crossentropyloss", "mse": "mseloss", "bce": "bcewithlogitsloss"}
    ours_cls = type(LOSSES[kind]("mean")[1])
    original = _original(f"backpack.core.derivatives.{files[kind]}", ours_cls.__name__)
    torch.manual_seed(12)
    module, _ = LOSSES[kind]("mean")
    x, y = _loss_data(kind, (4, 3, 2) if kind == "ce" else ((4, 3) if kind == "mse" else (4, 1)))
    results = []
    for cls in (ours_cls, original):
        with_io(module, x.clone(), y)  # BackPACK's autograd path flags input0 requires_grad
        torch.manual_seed(13)
        results.append(
            cls(use_autograd=use_autograd).sqrt_hessian_sampled(
                module, None, None, mc_samples=5, subsampling=subsampling
            )
        )
    close(results[0], results[1])
