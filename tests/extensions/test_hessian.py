"""DiagHessian, BatchDiagHessian and HutchinsonDiagHessian against dense float64 references.

References: ``reference.loss_hessian`` (``torch.func.hessian`` of the mini-batch loss) and, for
the per-sample terms, the Hessian of ``θ ↦ L(outputs where only sample n depends on θ)``, i.e. of
``ℓₙ/N`` with the loss's own scaling, built here with ``torch.func`` from the definition.

On every device (the ``device`` fixture): ``DiagHessian``/``BatchDiagHessian`` on the models it
supports (MLPs, a CNN) and ``HutchinsonDiagHessian`` within 6 standard deviations on seven
models, every stored tensor on the device. The nonlinearity recording and the refusals of
``backprism.engine.residual`` are tested in ``tests/engine/test_residual.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, hessian
from torch.nn.attention import SDPBackend, sdpa_kernel

from backprism import collect, extend
from backprism.engine.residual import NonlinearityError
from backprism.extensions.hessian import BatchDiagHessian, DiagHessian, HutchinsonDiagHessian
from backprism.extensions.secondorder import DiagGGNExact
from tests.common import (
    DEVICE_MODELS,
    DEVICE_N,
    DEVICE_TOL,
    LayerNormBetween,
    Siamese,
    SoftmaxAttention,
    build_on_device,
    check_stored,
    fresh_backward,
    gather,
)
from tests.reference import loss_hessian, split, trainable

DT = torch.float64

pytestmark = pytest.mark.usefixtures("float64_default")


def per_sample_hessian_diags(model: nn.Module, loss_fn, X: Tensor, y: Tensor) -> Tensor:
    """``[N, P]``: diagonal of the Hessian of the loss when only sample ``n``'s output depends
    on the parameters (the other outputs frozen at their values), i.e. of ``ℓₙ/N``."""
    params = trainable(model)
    names = list(params)
    sizes = [params[k].numel() for k in names]
    shapes = [params[k].shape for k in names]
    flat = torch.cat([params[k].reshape(-1) for k in names])
    with torch.no_grad():
        out0 = model(X)
    rows = []
    for n in range(X.shape[0]):
        mask = torch.zeros(X.shape[0], dtype=torch.bool)
        mask[n] = True

        def L(theta: Tensor, mask: Tensor = mask) -> Tensor:
            p = {k: t.reshape(s) for k, t, s in zip(names, torch.split(theta, sizes), shapes)}
            out = functional_call(model, p, (X,))
            m = mask.reshape(-1, *([1] * (out.dim() - 1)))
            return loss_fn(torch.where(m, out, out0), y)

        rows.append(torch.diagonal(hessian(L)(flat)))
    return torch.stack(rows)


def run(model: nn.Module, loss_fn: nn.Module, X: Tensor, y: Tensor, *exts) -> None:
    extend(model)
    extend(loss_fn)
    with collect(*exts):
        loss_fn(model(X), y).backward()


def check_diag(model: nn.Module, loss_fn: nn.Module, X: Tensor, y: Tensor, batch: bool = True):
    ref = copy.deepcopy(model)
    H = loss_hessian(ref, loss_fn, X, y)
    exts = [DiagHessian(), BatchDiagHessian()] if batch else [DiagHessian()]
    run(model, copy.deepcopy(loss_fn), X, y, *exts)
    expected = split(torch.diagonal(H), ref)
    per_sample = split(per_sample_hessian_diags(ref, loss_fn, X, y), ref, lead=1) if batch else {}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, expected[name], rtol=1e-8, atol=1e-10)
        if batch:
            assert p.diag_h_batch.shape == (X.shape[0], *p.shape)
            torch.testing.assert_close(p.diag_h_batch, per_sample[name], rtol=1e-8, atol=1e-10)
            torch.testing.assert_close(p.diag_h_batch.sum(0), p.diag_h, rtol=1e-8, atol=1e-10)


def data(n: int, d: int, c: int, loss: str):
    X = torch.randn(n, d)
    if loss == "ce":
        return X, torch.randint(0, c, (n,)), nn.CrossEntropyLoss()
    return X, torch.randn(n, c), nn.MSELoss()


ACTS = [
    nn.Tanh(),
    nn.Sigmoid(),
    nn.GELU(),
    nn.GELU(approximate="tanh"),
    nn.SiLU(),
    nn.Softplus(beta=2.0),
    nn.ELU(alpha=0.7),
    nn.LeakyReLU(0.1),
    nn.ReLU(),
]


@pytest.mark.parametrize("act", ACTS, ids=lambda a: repr(a))
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_activation_modules(act: nn.Module, loss: str):
    torch.manual_seed(0)
    X, y, lf = data(4, 3, 3, loss)
    model = nn.Sequential(
        nn.Linear(3, 4), copy.deepcopy(act), nn.Linear(4, 3), copy.deepcopy(act), nn.Linear(3, 3)
    )
    check_diag(model, lf, X, y)


def test_residual_is_nonzero_for_smooth_activations():
    """DiagHessian differs from the GGN diagonal (the residual term matters here)."""
    torch.manual_seed(1)
    X, y, lf = data(4, 3, 2, "ce")
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    run(model, lf, X, y, DiagHessian(), DiagGGNExact())
    w = model[0].weight
    assert (w.diag_h - w.diag_ggn_exact).abs().max() > 1e-4


class Functional(nn.Module):
    """Functional nonlinearities inside a custom (parameter-free) module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(3, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        h = torch.cat(
            [
                torch.tanh(h[:, :1]),
                F.gelu(h[:, 1:2]),
                h[:, 2:3].sigmoid(),
                F.silu(h[:, 3:4]),
                F.softplus(h[:, 4:5], beta=1.5),
                F.elu(h[:, 5:]),
            ],
            1,
        )
        h = self.l2(h)
        h = F.leaky_relu(h, 0.2) + torch.relu(h) + h.tanh() + torch.exp(0.1 * h) + h**2
        return self.l3(h)


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_functional_nonlinearities(loss: str):
    torch.manual_seed(2)
    X, y, lf = data(3, 3, 2, loss)
    check_diag(Functional(), lf, X, y)


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.block = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = h + torch.tanh(self.block(h))
        return self.out(nn.functional.dropout(h, 0.5, training=False))


def test_residual_mlp_mse():
    torch.manual_seed(3)
    X, y, lf = data(4, 3, 2, "mse")
    check_diag(ResidualMLP(), lf, X, y)


@pytest.mark.parametrize("act", [nn.Sigmoid(), nn.ReLU()], ids=repr)
def test_maxpool_cnn(act: nn.Module):
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        copy.deepcopy(act),
        nn.MaxPool2d(2),
        nn.Conv2d(2, 2, 2),
        nn.Tanh(),
        nn.AvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2, 3),
    )
    X, y = torch.randn(3, 1, 4, 4), torch.randint(0, 3, (3,))
    check_diag(model, nn.CrossEntropyLoss(), X, y)


def test_log_softmax_nll_is_part_of_the_loss():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3), nn.LogSoftmax(dim=1))
    X, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    check_diag(model, nn.NLLLoss(), X, y)


def test_sum_reduction_and_scaled_backward():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 3), nn.Sigmoid(), nn.Linear(3, 2))
    X, y = torch.randn(4, 3), torch.randn(4, 2)
    lf = nn.MSELoss(reduction="sum")
    check_diag(model, lf, X, y, batch=False)
    # (3 L).backward(): the Hessian of 3 L
    ref = copy.deepcopy(model)
    H = 3 * loss_hessian(ref, lf, X, y)
    lf = extend(lf)
    with collect(DiagHessian()):
        (3 * lf(model(X), y)).backward()
    expected = split(torch.diagonal(H), ref)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, expected[name], rtol=1e-8, atol=1e-10)


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 4),
    d=st.integers(1, 3),
    h=st.integers(1, 4),
    c=st.integers(2, 3),
    loss=st.sampled_from(["ce", "mse"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes(n: int, d: int, h: int, c: int, loss: str, seed: int):
    torch.manual_seed(seed)
    X, y, lf = data(n, d, c, loss)
    model = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, c, bias=seed % 2 == 0))
    check_diag(model, lf, X, y)


class Transposed(nn.Module):
    """The nonlinearity acts on a tensor whose first axis is not the batch axis."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x).t()).t())


def test_nonlinearity_without_leading_batch_axis():
    torch.manual_seed(14)
    X, y, lf = data(3, 3, 2, "ce")
    check_diag(Transposed(), lf, X, y)


def test_chunked_residual_columns():
    """A tiny memory budget forces one column per chunk; results are unchanged."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    X, y = torch.randn(3, 3), torch.randint(0, 2, (3,))
    ref = copy.deepcopy(model)
    H = loss_hessian(ref, nn.CrossEntropyLoss(), X, y)
    lf = extend(nn.CrossEntropyLoss())
    extend(model)
    with collect(DiagHessian(), memory_budget=1):
        lf(model(X), y).backward()
    expected = split(torch.diagonal(H), ref)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, expected[name], rtol=1e-8, atol=1e-10)


def test_batchnorm_eval_and_layernorm_on_data_are_fine():
    """Eval-mode BatchNorm is affine in its input; LayerNorm of the data (no parameter before it)
    is linear in its own parameters: both are exact."""
    torch.manual_seed(11)
    model = nn.Sequential(
        nn.LayerNorm(3), nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sigmoid(), nn.Linear(4, 2)
    )
    with torch.no_grad():
        model[2].running_mean.uniform_(-1, 1)
        model[2].running_var.uniform_(0.5, 2)
    model.eval()
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    check_diag(model, nn.CrossEntropyLoss(), X, y)


class MoreFunctional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(2, 3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        h = torch.sin(h) + 2**h + torch.sqrt(h.square() + 1) + F.logsigmoid(h) + F.mish(h)
        return self.l2(F.max_pool1d(h[:, None], 1)[:, 0].clamp(-5, 5).abs() + h.sigmoid())


def test_more_elementwise_ops():
    torch.manual_seed(12)
    X, y, lf = data(3, 2, 2, "mse")
    check_diag(MoreFunctional(), lf, X, y)


def test_parallel_shared_parameter():
    torch.manual_seed(13)
    X, y, lf = data(3, 6, 2, "ce")
    check_diag(Siamese(), lf, X, y)


# -- row-wise nonlinearities (layer_norm, rms_norm, softmax, softmin) --------------------------
class RowWise(nn.Module):
    """``Linear → row-wise nonlinearity → Linear`` on ``[N, *T, 3]``; the nonlinearity over
    the last axis, a middle axis (softmax over positions) or two trailing axes (a LayerNorm of
    a ``[2, 3]`` block), between smooth activations."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 3)
        self.norm = {
            "layer_norm": nn.LayerNorm(6), "layer_norm_2d": nn.LayerNorm((2, 3)),
            "rms_norm": nn.RMSNorm(6),
            "layer_norm_plain": nn.LayerNorm(6, elementwise_affine=False),
            "group_norm": nn.GroupNorm(2, 6),
        }.get(kind)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        if self.kind == "softmax":
            h = torch.softmax(h, dim=-1)
        elif self.kind == "softmin":
            h = F.softmin(h, dim=-1)
        elif self.kind == "softmax_positions":  # over the middle axis T
            h = h.softmax(1)
        elif self.kind == "normalize":  # (cosine attention's, XCiT's F.normalize)
            h = F.normalize(h, dim=-1)
        elif self.kind == "normalize_positions":  # over T, with p = 3
            h = F.normalize(h, p=3.0, dim=1)
        elif self.kind == "layer_norm_2d":
            h = self.norm(h.unflatten(-1, (2, 3))).flatten(-2)
        else:
            h = self.norm(h)
        out = self.b(torch.sigmoid(h))
        return out.mean(1) if out.dim() == 3 else out


ROW_KINDS = ["layer_norm", "layer_norm_plain", "layer_norm_2d", "rms_norm", "group_norm",
             "softmax", "softmin", "softmax_positions", "normalize", "normalize_positions"]


@pytest.mark.parametrize("kind", ROW_KINDS)
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_row_wise_nonlinearities(kind: str, loss: str):
    """Norms, ``F.normalize`` and softmaxes between parameters: their Hessian term is
    block-diagonal over the rows they act on; DiagHessian and BatchDiagHessian against the
    dense Hessian."""
    torch.manual_seed(21)
    model = RowWise(kind)
    for p in model.parameters():  # away from the initialisation (norm weights 1, biases 0)
        with torch.no_grad():
            p.add_(0.5 * torch.randn_like(p))
    shape = (4, 5, 3) if kind.endswith("_positions") else (4, 3)
    X = torch.randn(*shape)
    y = torch.randint(0, 3, (4,)) if loss == "ce" else torch.randn(4, 3)
    check_diag(model, nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss(), X, y)


def test_attention_on_the_data():
    """``softmax(q kᵀ) v`` of projections of the input: the products' operands depend on
    different parameters (their terms lie off the parameters' blocks) and the softmax is
    row-wise, so DiagHessian is exact (attention on hidden features:
    ``tests/extensions/test_bilinear.py``)."""
    torch.manual_seed(22)
    X, y = torch.randn(4, 3, 3), torch.randint(0, 3, (4,))
    check_diag(SoftmaxAttention(), nn.CrossEntropyLoss(), X, y)


class TransposedBatchSized(nn.Module):
    """Nonlinearities on a transposed activation ``[features, N]`` whose first axis has the
    batch's size: the samples are on axis 1, which the graph shows (the size alone does not)."""

    def __init__(self, row: bool) -> None:
        super().__init__()
        self.row = row
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x).t()  # [4, N] with N = 4
        h = torch.softmax(h, dim=0) if self.row else torch.tanh(h)
        return self.l2(h.t())


@pytest.mark.parametrize("row", [False, True], ids=["tanh", "softmax"])
def test_nonlinearity_on_a_transposed_batch_sized_axis(row: bool):
    """(Before, a first axis of the batch's size was taken for the samples: DiagHessian was
    wrong for the elementwise case, by up to 3.5× relative, with no error.)"""
    torch.manual_seed(23)
    X, y, lf = data(4, 3, 2, "ce")
    check_diag(TransposedBatchSized(row), lf, X, y)


# -- Hutchinson ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make", [LayerNormBetween, SoftmaxAttention], ids=["layernorm", "attention"]
)
def test_hutchinson_unbiased(make):
    """E[v ⊙ Hv] = diag H; with S samples Var = (1/S) Σ_{j≠i} H_ij², checked to 5 std."""
    torch.manual_seed(9)
    model = make()
    shape = (3, 2, 3) if make is SoftmaxAttention else (3, 3)
    X, y = torch.randn(*shape), torch.randint(0, 3, (3,))
    ref = copy.deepcopy(model)
    H = loss_hessian(ref, nn.CrossEntropyLoss(), X, y)
    S = 300
    run(model, nn.CrossEntropyLoss(), X, y, HutchinsonDiagHessian(samples=S))
    diag = torch.diagonal(H)
    std = ((H.square().sum(1) - diag.square()) / S).sqrt()
    est = torch.cat([p.diag_h_hutchinson.reshape(-1) for p in model.parameters()])
    assert (est - diag).abs().le(5 * std + 1e-10).all()
    # and it is not trivially exact: the estimate differs from the diagonal somewhere
    assert (est - diag).abs().max() > 0


def test_hutchinson_exact_for_diagonal_hessian():
    """A single parameter vector: Hv ⊙ v = diag H exactly (no off-diagonal terms)."""
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(3, 1, bias=False))
    ref = copy.deepcopy(model)
    X = torch.diag(torch.tensor([1.0, 2.0, 3.0]))  # H = (2/N) XᵀX is diagonal
    y = torch.randn(3, 1)
    H = loss_hessian(ref, nn.MSELoss(), X, y)
    run(model, nn.MSELoss(), X, y, HutchinsonDiagHessian())
    torch.testing.assert_close(model[0].weight.diag_h_hutchinson.reshape(-1), torch.diagonal(H))
    # (2 L).backward() estimates the Hessian of 2 L
    lf = extend(nn.MSELoss())
    with collect(HutchinsonDiagHessian(samples=2)):
        (2 * lf(model(X), y)).backward()
    torch.testing.assert_close(
        model[0].weight.diag_h_hutchinson.reshape(-1), 2 * torch.diagonal(H)
    )


def test_hutchinson_bad_samples():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="samples"):
            HutchinsonDiagHessian(samples=bad)


def test_hutchinson_fused_attention_names_the_way_out():
    """The CPU fused attention kernel has no second derivative: a forward outside the collect
    gets a clear error with the fix; a forward inside it runs attention with the math kernel
    by itself, as does one under the user's own ``sdpa_kernel(MATH)``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.head = attn, nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    model, lossfunc = extend(Model()), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 5, 8), torch.randint(0, 3, (4,))
    fix = r"HutchinsonDiagHessian.*SDPBackend\.MATH"
    loss = lossfunc(model(X), y)  # outside the collect: the fused kernel
    with pytest.raises(RuntimeError, match=fix), collect(HutchinsonDiagHessian()):
        loss.backward()
    with collect(HutchinsonDiagHessian()):
        lossfunc(model(X), y).backward()
    assert torch.isfinite(model.head.weight.diag_h_hutchinson).all()
    del model.head.weight.diag_h_hutchinson
    with sdpa_kernel(SDPBackend.MATH):
        loss = lossfunc(model(X), y)
    with collect(HutchinsonDiagHessian()):
        loss.backward()
    assert torch.isfinite(model.head.weight.diag_h_hutchinson).all()


# -------------------------------------------------------------------------------------- on a device
@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", ["mlp", "mlp_mse", "cnn"])
def test_diag_hessian_on_device(name, device):
    model, lossfunc, X, y, ref_loss = build_on_device(name, device, seed=3)
    H = loss_hessian(model, ref_loss, X, y)
    extend(model), extend(lossfunc)
    fresh_backward(model, lossfunc, X, y, DiagHessian(), BatchDiagHessian())
    check_stored(model, device, "diag_h", "diag_h_batch")
    torch.testing.assert_close(gather(model, "diag_h", 0), torch.diagonal(H), **DEVICE_TOL)
    batch = gather(model, "diag_h_batch", 1)
    assert batch.shape[0] == DEVICE_N
    torch.testing.assert_close(batch.sum(0), torch.diagonal(H), **DEVICE_TOL)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", DEVICE_MODELS)
def test_hutchinson_on_device(name, device):
    """Unbiased with ``Var[d̂ᵢ] = (1/S) Σ_{j≠i} H_ij²``: within 6 standard deviations.

    Attention runs on SDPA's math backend: the fused CPU kernel has neither the forward-mode
    derivative ``torch.func.hessian`` needs nor a double backward (HVPs); on CUDA, float64 gets
    the math backend anyway."""
    samples = 32
    model, lossfunc, X, y, ref_loss = build_on_device(name, device, seed=4)
    with sdpa_kernel(SDPBackend.MATH):
        H = loss_hessian(model, ref_loss, X, y)
        extend(model), extend(lossfunc)
        torch.manual_seed(0)
        fresh_backward(model, lossfunc, X, y, HutchinsonDiagHessian(samples))
    check_stored(model, device, "diag_h_hutchinson")
    est = gather(model, "diag_h_hutchinson", 0)
    off = H - torch.diag(torch.diagonal(H))
    sd = (off.square().sum(1) / samples).sqrt()
    err = (est - torch.diagonal(H)).abs()
    bad = err > 6 * sd + 1e-10
    assert not bad.any(), f"off by {err[bad]} (sd {sd[bad]})"


def test_row_wise_nonlinearity_in_bfloat16():
    """A LayerNorm in bfloat16: the row blocks are eigen-decomposed in float32 (there is none
    in half precision), the results keep the parameters' dtype and follow float64's to
    bfloat16's precision."""
    torch.manual_seed(25)
    model = RowWise("layer_norm")
    X, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    ref = copy.deepcopy(model)
    run(ref, nn.CrossEntropyLoss(), X, y, DiagHessian())
    low = copy.deepcopy(model).to(torch.bfloat16)
    run(low, nn.CrossEntropyLoss(), X.to(torch.bfloat16), y, DiagHessian())
    for (name, p), q in zip(low.named_parameters(), ref.parameters()):
        assert p.diag_h.dtype == torch.bfloat16
        scale = q.diag_h.abs().max()
        torch.testing.assert_close(p.diag_h.double(), q.diag_h, atol=0.1 * scale, rtol=0,
                                   msg=name)


class Scale(nn.Module):
    """A leaf module with parameters of its own (the generic rule): ``x ⊙ γ`` (timm's
    ``LayerScale``), ``β + α ⊙ x`` (ResMLP's ``Affine``), ``tanh(x) ⊙ γ``, a hand-written
    RMSNorm ``x · rsqrt(mean(x²) + ε) ⊙ γ``, ``F.layer_norm(x, (d,), γ, β)``, a normalised
    ``x / ‖x‖ ⊙ γ``; or ``i0(x) ⊙ γ`` (an operation of unknown kind), ``x ⊙ exp(γ)``
    (nonlinear in its parameter), ``x ⊙ γ / (1 + ‖γ‖²)``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.beta = nn.Parameter(torch.randn(4)) if kind in ("affine", "layer_norm") else None

    def forward(self, x: Tensor) -> Tensor:
        g = self.gamma
        if self.kind == "affine":
            return self.beta + g * x
        if self.kind == "tanh":
            return torch.tanh(x) * g
        if self.kind == "rms_norm":
            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * g
        if self.kind == "layer_norm":
            return F.layer_norm(x, (4,), g, self.beta)
        if self.kind == "normalize":
            return x / x.norm(dim=-1, keepdim=True) * g
        if self.kind == "divided_rms":
            return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * g
        if self.kind == "i0":
            return torch.special.i0(x) * g
        if self.kind == "exp":
            return x * g.exp()
        return x * g


@pytest.mark.parametrize(
    "kind",
    ["scale", "affine", "tanh", "rms_norm", "divided_rms", "layer_norm", "normalize", "i0", "exp"],
)
def test_generic_module_affine_in_parameters(kind: str):
    """A module without a rule is taken by the DiagHessian family when its output is affine in
    each parameter (probed) and, in its inputs, affine too or made of operations whose terms
    the forward mode records (elementwise and row-wise nonlinearities, products, divisions):
    exact against the dense Hessian, per sample too (``normalize``: a division by its input's
    norm, ``x / x.norm(dim=-1, keepdim=True)``, refused before reductions and divisions had
    their terms). Refused before anything is written: an operation of unknown kind in its body
    (``i0``: its term would be missing), a parameter entering nonlinearly (``exp(γ)``: its own
    term)."""
    torch.manual_seed(25)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Scale(kind), nn.Linear(4, 3))
    X, y, lf = data(4, 3, 3, "ce")
    if kind in ("i0", "exp"):
        extend(model)
        match = "affine in each"
        with pytest.raises(NonlinearityError, match=match), collect(DiagHessian()):
            extend(lf)(model(X), y).backward()
        assert all(p.grad is None for p in model.parameters())
        return
    check_diag(model, lf, X, y)
    if kind in ("rms_norm", "divided_rms", "layer_norm", "normalize"):
        from tests.extensions.test_matprod import check_hmp

        torch.manual_seed(25)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Scale(kind), nn.Linear(4, 3))
        check_hmp(model, lf, X, y)


@pytest.mark.parametrize("kind", ["rms_norm", "divided_rms", "layer_norm", "exp"])
def test_generic_module_affine_in_parameters_in_bfloat16(kind: str):
    """The affinity probe of a module without a rule runs in float64 for half-precision
    parameters (bfloat16's rounding of the midpoint exceeded its tolerance, so every such
    module was refused as nonlinear in its parameters): DiagHessian of the bfloat16 model
    follows float64's to bfloat16's precision; ``exp(γ)`` stays refused."""
    torch.manual_seed(25)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Scale(kind), nn.Linear(4, 3))
    X, y, lf = data(4, 3, 3, "ce")
    low = copy.deepcopy(model).to(torch.bfloat16)
    if kind == "exp":
        extend(low)
        with pytest.raises(NonlinearityError, match="affine in each"), collect(DiagHessian()):
            extend(lf)(low(X.to(torch.bfloat16)), y).backward()
        return
    run(model, copy.deepcopy(lf), X, y, DiagHessian())
    run(low, lf, X.to(torch.bfloat16), y, DiagHessian())
    scale = max(float(q.diag_h.abs().max()) for q in model.parameters())
    for (name, p), q in zip(low.named_parameters(), model.parameters(), strict=True):
        assert p.diag_h.dtype == torch.bfloat16
        torch.testing.assert_close(p.diag_h.double(), q.diag_h, atol=0.1 * scale, rtol=0,
                                   msg=name)


class ConvNorm(nn.Module):
    """Conv → a norm on feature maps → tanh → Linear."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(2, 4, 3, padding=1), norm
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize(
    "kind", ["group", "instance", "instance_plain", "instance_running", "instance_functional"]
)
def test_norms_on_feature_maps(kind: str):
    """Norms between parameters, their rows known: GroupNorm's groups of channels with their
    positions (two groups of two channels, rows of ``2 · H · W`` entries), InstanceNorm's
    channels of a sample (with and without affine parameters, as ``F.instance_norm``); with
    running statistics in eval mode InstanceNorm is affine. DiagHessian and BatchDiagHessian
    against the dense Hessian."""
    torch.manual_seed(26)
    norm: nn.Module = {
        "group": lambda: nn.GroupNorm(2, 4),
        "instance": lambda: nn.InstanceNorm2d(4, affine=True),
        "instance_plain": lambda: nn.InstanceNorm2d(4),
        "instance_running": lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        "instance_functional": lambda: _FunctionalInstanceNorm(4),
    }[kind]()
    model = ConvNorm(norm)
    with torch.no_grad():
        for name, p in norm.named_parameters():
            p.uniform_(0.5, 1.5) if name == "weight" else p.uniform_(-0.5, 0.5)
        if kind == "instance_running":
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
            model.eval()
    X, y = torch.randn(3, 2, 3, 3), torch.randint(0, 3, (3,))
    check_diag(model, nn.CrossEntropyLoss(), X, y)


class _FunctionalInstanceNorm(nn.Module):
    """``F.instance_norm`` with a container's parameters passed by keyword."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.inner = nn.Identity()  # (a container: its parameters are attributed where used)

    def forward(self, x: Tensor) -> Tensor:
        return F.instance_norm(self.inner(x), weight=self.weight, bias=self.bias, eps=1e-3)


class NestedLinear(nn.Module):
    """A Linear weight that also feeds the layer's input: an embedding reused as the output
    layer (``h @ E.weight.T``, or a Linear head whose weight is the embedding's), a cell
    unrolled over three steps, a layer applied to its own output."""

    def __init__(self, kind: str, v: int = 6, d: int = 3) -> None:
        super().__init__()
        self.kind = kind
        if kind in ("functional_head", "module_head"):
            self.emb, self.mid = nn.Embedding(v, d), nn.Linear(d, d)
            if kind == "module_head":
                self.head = nn.Linear(d, v, bias=False)
                self.head.weight = self.emb.weight
        else:
            self.cell, self.out = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind in ("functional_head", "module_head"):
            h = torch.tanh(self.mid(self.emb(x)))
            logits = h @ self.emb.weight.T if self.kind == "functional_head" else self.head(h)
            return logits.transpose(1, 2)  # [N, V, T]: cross-entropy over the positions
        h = x
        for _ in range(3 if self.kind == "unrolled" else 2):
            h = torch.tanh(self.cell(h)) if self.kind == "unrolled" else self.cell(h)
        return self.out(torch.sigmoid(h))


@pytest.mark.parametrize("kind", ["functional_head", "module_head", "unrolled", "twice"])
def test_nested_linear_uses(kind: str):
    """The product of a Linear weight's uses, where the weight also feeds the layer's input:
    ``2⟨G, dx dWᵀ⟩`` in ``W``'s block, from columns ``√(σ/2)(u ⊗ eₖ, ±v ⊗ eₖ)`` (SVD of each
    sample's output gradient), the first part pushed into the input, the second added to the
    weight's per-sample gradients of the column before squaring. DiagHessian and
    BatchDiagHessian against the dense Hessian (float64)."""
    torch.manual_seed(31)
    model = NestedLinear(kind).double()
    if kind.endswith("head"):
        X, y = torch.randint(0, 6, (3, 4)), torch.randint(0, 6, (3, 4))
    else:
        X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    check_diag(model, nn.CrossEntropyLoss(), X, y)


def test_nested_linear_uses_refused_where_the_term_is_not_built():
    """HMP's blocks would need the product's term as a matrix: a pass with it is refused
    before anything is written, naming the extension."""
    from backprism.extensions import HMP

    torch.manual_seed(31)
    model = extend(NestedLinear("unrolled").double())
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.raises(NonlinearityError, match="HMP does not build"), collect(
        DiagHessian(), HMP()
    ):
        lf(model(X), y).backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())


def test_nested_linear_uses_in_column_chunks():
    """The direct parts follow the pushed columns chunk by chunk: chunks of 2 and 7 columns
    give the dense Hessian's diagonal too."""
    torch.manual_seed(32)
    base = NestedLinear("module_head").double()
    X, y = torch.randint(0, 6, (3, 4)), torch.randint(0, 6, (3, 4))
    lf = nn.CrossEntropyLoss()
    expected = split(torch.diagonal(loss_hessian(copy.deepcopy(base), lf, X, y)), base)
    for chunk in (2, 7):
        model = extend(copy.deepcopy(base))
        with collect(DiagHessian(), chunk_size=chunk):
            extend(copy.deepcopy(lf))(model(X), y).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.diag_h, expected[name], rtol=1e-8, atol=1e-10)


class RelativeBias(nn.Module):
    """A relative position bias table read without inputs (Hugging Face's BEiT and Swin
    bias modules): its output, shared by all samples, is added to the attention scores."""

    def __init__(self, t: int, heads: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * t - 1, heads))
        idx = torch.arange(t)[None] - torch.arange(t)[:, None] + t - 1
        self.register_buffer("idx", idx)

    def forward(self) -> Tensor:
        return self.table[self.idx].permute(2, 0, 1)[None]  # [1, H, T, T]


class LearnedPositions(nn.Module):
    """Positions looked up from integer ids and a keyword offset (OPT's learned positional
    embedding): no floating input to probe."""

    def __init__(self, t: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(t + 2, d))

    def forward(self, ids: Tensor, offset: Tensor | None = None) -> Tensor:
        return self.weight[ids + (0 if offset is None else offset)]


class BiasedAttention(nn.Module):
    """Eager attention with a relative position bias and learned positions of their own
    modules, which take the generic rule."""

    def __init__(self, t: int = 4, d: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.t, self.heads = t, heads
        self.embed, self.qkv, self.head = nn.Linear(3, d), nn.Linear(d, 3 * d), nn.Linear(d, 3)
        self.bias, self.pos = RelativeBias(t, heads), LearnedPositions(t, d)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        ids = torch.arange(t).expand(n, t)
        h = torch.tanh(self.embed(x)) + self.pos(ids, offset=torch.ones_like(ids))
        q, k, v = (
            z.view(n, t, self.heads, -1).transpose(1, 2) for z in self.qkv(h).chunk(3, -1)
        )
        p = torch.softmax(q @ k.transpose(-1, -2) + self.bias(), -1)
        return self.head((p @ v).transpose(1, 2).reshape(n, t, -1)).mean(1)


def test_generic_modules_without_floating_inputs():
    """Modules without a rule whose inputs are none (a bias table) or integers and keyword
    tensors (learned positions): probed affine in their parameters on their own arguments,
    their bodies linear — DiagHessian and BatchDiagHessian against the dense Hessian. (Before:
    refused, 'enter nonlinearly'; Hugging Face's BEiT, Swin, OPT and CLIP so refused.)"""
    torch.manual_seed(33)
    X, y = torch.randn(3, 4, 3), torch.randint(0, 3, (3,))
    check_diag(BiasedAttention(), nn.CrossEntropyLoss(), X, y)
