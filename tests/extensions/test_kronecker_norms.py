"""KFAC / KFLR / KFRA on models with normalisation layers and modules without Kronecker form.

Parameters without Kronecker structure (LayerNorm, BatchNorm in eval mode, GroupNorm, InstanceNorm,
``nn.RMSNorm``, a hand-written RMSNorm taking the generic ``torch.func`` rule, Hugging Face's
``LlamaRMSNorm``) get the single-factor form of a bias, ``[D]`` with ``D`` a ``[P, P]`` diagonal
matrix: the exact GGN diagonal for KFLR and KFRA, the MC GGN diagonal of KFAC's own
``mc_samples`` columns for KFAC.

References are dense float64 from the definitions (no backprism path): the GGN block of a
parameter ``θ`` is ``Jᵀ H J`` with ``J`` the Jacobian of the whole-batch model output w.r.t.
``θ`` (``torch.func.jacrev``) and ``H`` the Hessian of the real loss module w.r.t. that output
(``torch.func.hessian``, so the ``1/N`` of a mean loss is in ``H``). Checked:

1. KFLR / KFRA on norm parameters equal ``diag`` of the exact block's diagonal (also with
   columns in chunks);
2. KFAC's ``D`` is the mean of its i.i.d. MC draws: ``R`` passes with different seeds, the
   mean within 6 standard errors (+1e-10) of the exact diagonal; in one pass it equals
   ``diag(diag_ggn_mc)`` of ``DiagGGNMC`` with the same columns;
3. Linear / Conv factors next to the norms: ``B ⊗ A`` equals the exact weight block where KFLR
   is exact (one sample, no positions, KFRA too); otherwise ``B`` equals the exact GGN block of
   the layer's bias and ``A`` the mean (unfolded) input outer product from the definition; with
   a BatchNorm that is the identity, the factors equal those of the model without it;
4. nothing is refused (KFRA only refuses models that are not ``nn.Sequential`` chains, with its
   own message, not because of a norm).
"""

from __future__ import annotations

import importlib
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

from backprism import collect, extend
from backprism.engine import rule as rule_module
from backprism.extensions import KFAC, KFLR, KFRA, DiagGGNExact, DiagGGNMC
from tests.common import Encoder

pytestmark = [
    pytest.mark.filterwarnings("ignore::backprism.rules.generic.GenericRuleWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
]

DT = torch.float64
TOL = {"atol": 1e-10, "rtol": 1e-9}


# --------------------------------------------------------------------------- models
class HandRMSNorm(nn.Module):
    """``y = x / √(mean(x²) + eps) ⊙ w`` — no registered rule: the generic ``torch.func`` rule."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


class ResNet(nn.Module):
    """Conv-BN-ReLU-Conv-BN plus a 1×1 conv skip, ReLU, global average pool, linear head."""

    def __init__(self, cin: int = 2, c: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)
        self.skip = nn.Conv2d(cin, c, 1)
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        z = self.bn1(self.conv1(x)).relu()
        z = self.bn2(self.conv2(z)) + self.skip(x)
        return self.head(z.relu().mean((2, 3)))


def _randomize_norms(model: nn.Module) -> None:
    """Norm scales and shifts away from 1 / 0, BatchNorm running statistics non-trivial."""
    with torch.no_grad():
        for m in model.modules():
            w, b = getattr(m, "weight", None), getattr(m, "bias", None)
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                continue
            if isinstance(w, Tensor):
                w.uniform_(0.5, 1.5)
            if isinstance(b, Tensor):
                b.uniform_(-0.5, 0.5)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)


def _build(name: str, n: int, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    if name == "layernorm":
        model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
        X = torch.randn(n, 4)
    elif name == "rmsnorm":  # torch's nn.RMSNorm (rules/norm.py)
        model = nn.Sequential(nn.Linear(4, 5), nn.RMSNorm(5), nn.Sigmoid(), nn.Linear(5, 3))
        X = torch.randn(n, 4)
    elif name == "hand_rmsnorm":  # generic torch.func rule
        model = nn.Sequential(nn.Linear(4, 5), HandRMSNorm(5), nn.Tanh(), nn.Linear(5, 3))
        X = torch.randn(n, 4)
    elif name == "batchnorm":
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.BatchNorm2d(3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3 * 3 * 3, 3),
        )
        X = torch.randn(n, 2, 3, 3)
    elif name == "groupnorm":
        model = nn.Sequential(
            nn.Conv2d(2, 4, 2),
            nn.GroupNorm(2, 4),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(4 * 2 * 2, 3),
        )
        X = torch.randn(n, 2, 3, 3)
    elif name == "instancenorm":
        model = nn.Sequential(
            nn.Conv2d(2, 4, 2),
            nn.InstanceNorm2d(4, affine=True),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(4 * 2 * 2, 3),
        )
        X = torch.randn(n, 2, 3, 3)
    elif name == "encoder":
        model = Encoder()
        X = torch.randn(n, 3, 4)
    elif name == "resnet":
        model = ResNet()
        X = torch.randn(n, 2, 3, 3)
    else:  # pragma: no cover
        raise ValueError(name)
    _randomize_norms(model)
    model = model.to(DT)
    if name != "encoder":  # eval: BatchNorm with running statistics (the encoder has dropout=0)
        model.eval()
    y = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(seed))
    return model, X.to(DT), y


CHAINS = ["layernorm", "rmsnorm", "hand_rmsnorm", "batchnorm", "groupnorm", "instancenorm"]
NAMES = [*CHAINS, "encoder", "resnet"]
NORMS = (nn.LayerNorm, nn.RMSNorm, HandRMSNorm, nn.BatchNorm2d, nn.GroupNorm, nn.InstanceNorm2d)
LINEAR_LIKE = (nn.Linear, nn.Conv2d)


def _norm_params(model: nn.Module) -> list[str]:
    return [
        f"{mn}.{pn}"
        for mn, m in model.named_modules()
        if isinstance(m, NORMS)
        for pn, _ in m.named_parameters(recurse=False)
    ]


# --------------------------------------------------------------------------- reference
def ggn_blocks(model: nn.Module, lossfunc: nn.Module, X: Tensor, y: Tensor, names: list[str]):
    """``{name: Jᵀ H J}`` (``[P, P]``) from the definition: ``J`` the Jacobian of the whole-batch
    output w.r.t. the parameter, ``H`` the Hessian of the loss w.r.t. the output."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    chosen = {k: params[k] for k in names}

    def out(sel: dict[str, Tensor]) -> Tensor:
        return functional_call(model, {**params, **sel, **buffers}, (X,))

    o = out(chosen).detach()
    J = jacrev(out)(chosen)
    H = hessian(lambda z: lossfunc(z, y))(o).reshape(o.numel(), o.numel())
    blocks = {}
    for k in names:
        j = J[k].reshape(o.numel(), -1)
        blocks[k] = j.t() @ H @ j
    return blocks


def _bias_of(model: nn.Module, weight_name: str) -> str:
    for suffix in ("in_proj_weight", "weight"):
        if weight_name.endswith(suffix):
            return weight_name[: -len(suffix)] + suffix.replace("weight", "bias")
    raise ValueError(weight_name)  # pragma: no cover


def _inputs(model: nn.Module, X: Tensor, kinds: tuple[type, ...]) -> dict[str, Tensor]:
    """The inputs of the modules of the given types in one forward (forward pre-hooks)."""
    seen: dict[str, Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda _m, a, name=name: seen.setdefault(name, a[0].detach()))
        for name, m in model.named_modules()
        if isinstance(m, kinds)
    ]
    try:
        with torch.no_grad():
            model(X)
    finally:
        for h in handles:
            h.remove()
    return seen


def _input_factor(m: nn.Module | None, x: Tensor) -> Tensor:
    """``A = (1/N) Σₙₜ xₙₜ xₙₜᵀ`` over the (unfolded, for a convolution) input."""
    n = x.shape[0]
    if isinstance(m, nn.Conv2d):
        u = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)  # [N, I, L]
        u = u.transpose(1, 2).reshape(-1, u.shape[1])
    else:
        u = x.reshape(-1, x.shape[-1])
    return u.t() @ u / n


def _run(model, X, y, *exts, seed: int = 0, **kw) -> None:
    lossfunc = extend(nn.CrossEntropyLoss())
    extend(model)
    torch.manual_seed(seed)
    loss = lossfunc(model(X), y)
    with collect(*exts, **kw):
        loss.backward()


def _diag_factor(p: nn.Parameter, field: str) -> Tensor:
    factors = getattr(p, field)
    assert isinstance(factors, list) and len(factors) == 1, field
    (d,) = factors
    assert d.shape == (p.numel(), p.numel())
    torch.testing.assert_close(d, torch.diag(torch.diagonal(d)), atol=0, rtol=0)
    return torch.diagonal(d)


# --------------------------------------------------------------------------- (1) exact
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("name", NAMES)
def test_norm_parameters_get_exact_ggn_diagonal(name, chunk):
    model, X, y = _build(name, n=3)
    names = _norm_params(model)
    assert names
    ref = ggn_blocks(model, nn.CrossEntropyLoss(), X, y, names)
    exts = [KFLR()] + ([KFRA()] if name in CHAINS else [])
    _run(model, X, y, *exts, chunk_size=chunk)
    params = dict(model.named_parameters())
    for k in names:
        want = torch.diagonal(ref[k])
        assert want.abs().max() > 1e-6, k  # a non-trivial check
        torch.testing.assert_close(_diag_factor(params[k], "kflr"), want, **TOL, msg=k)
        if name in CHAINS:
            torch.testing.assert_close(_diag_factor(params[k], "kfra"), want, **TOL, msg=k)


def test_sum_loss_and_mse_scaling():
    """``reduction='sum'`` drops the ``1/N``; MSE's loss Hessian (``2/(N·C)`` for a mean)."""
    for lossfunc in (nn.CrossEntropyLoss(reduction="sum"), nn.MSELoss()):
        model, X, y = _build("layernorm", n=4, seed=5)
        if isinstance(lossfunc, nn.MSELoss):
            y = torch.randn(4, 3, dtype=DT)
        names = _norm_params(model)
        ref = ggn_blocks(model, lossfunc, X, y, names)
        extend(model)
        lf = extend(lossfunc)
        loss = lf(model(X), y)
        with collect(KFLR(), KFRA()):
            loss.backward()
        params = dict(model.named_parameters())
        for k in names:
            want = torch.diagonal(ref[k])
            torch.testing.assert_close(_diag_factor(params[k], "kflr"), want, **TOL)
            torch.testing.assert_close(_diag_factor(params[k], "kfra"), want, **TOL)


def test_llama_rmsnorm():
    """Hugging Face's ``LlamaRMSNorm`` (``rules/transformers.py``) gets the exact diagonal."""
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        llama = importlib.import_module("transformers.models.llama.modeling_llama")
    torch.manual_seed(6)
    norm = llama.LlamaRMSNorm(5, eps=1e-5)
    model = nn.Sequential(nn.Linear(4, 5), norm, nn.Tanh(), nn.Linear(5, 3)).to(DT)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    X, y = torch.randn(3, 4, dtype=DT), torch.tensor([0, 2, 1])
    ref = ggn_blocks(model, nn.CrossEntropyLoss(), X, y, ["1.weight"])
    _run(model, X, y, KFLR(), KFRA())
    want = torch.diagonal(ref["1.weight"])
    torch.testing.assert_close(_diag_factor(norm.weight, "kflr"), want, **TOL)
    torch.testing.assert_close(_diag_factor(norm.weight, "kfra"), want, **TOL)


# --------------------------------------------------------------------------- (2) MC
R = 40
MC = 25


@pytest.mark.parametrize("name", NAMES)
def test_kfac_diagonal_in_expectation(name):
    model, X, y = _build(name, n=2, seed=1)
    names = _norm_params(model)
    ref = ggn_blocks(model, nn.CrossEntropyLoss(), X, y, names)
    params = dict(model.named_parameters())
    draws: dict[str, list[Tensor]] = {k: [] for k in names}
    for r in range(R):  # R independent passes (seeds), each the mean of MC sampled labels
        _run(model, X, y, KFAC(mc_samples=MC), seed=100 + r)
        for k in names:
            draws[k].append(_diag_factor(params[k], "kfac"))
    for k in names:
        d = torch.stack(draws[k])
        mean, se = d.mean(0), d.std(0) / R**0.5
        err = (mean - torch.diagonal(ref[k])).abs()
        assert (err <= 6 * se + 1e-10).all(), (k, err, se)


@pytest.mark.parametrize("name", NAMES)
def test_kfac_diagonal_is_diag_ggn_mc_of_the_same_columns(name):
    model, X, y = _build(name, n=3, seed=2)
    _run(model, X, y, KFAC(mc_samples=3), DiagGGNMC(mc_samples=3), KFLR(), DiagGGNExact())
    params = dict(model.named_parameters())
    for k in _norm_params(model):
        p = params[k]
        torch.testing.assert_close(_diag_factor(p, "kfac"), p.diag_ggn_mc.reshape(-1), **TOL)
        torch.testing.assert_close(_diag_factor(p, "kflr"), p.diag_ggn_exact.reshape(-1), **TOL)


# --------------------------------------------------------------------------- (3) layer factors
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "hand_rmsnorm"])
def test_linear_factors_exact_for_one_sample(name):
    """One sample, no positions: ``B ⊗ A`` (KFLR and KFRA) is the exact GGN block of every
    Linear weight, ``[B]`` that of its bias, with norms between the layers."""
    model, X, y = _build(name, n=1, seed=3)
    names = [k for k, _ in model.named_parameters()]
    ref = ggn_blocks(model, nn.CrossEntropyLoss(), X, y, names)
    _run(model, X, y, KFLR(), KFRA())
    for mn, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        for field in ("kflr", "kfra"):
            B, A = getattr(m.weight, field)
            torch.testing.assert_close(torch.kron(B, A), ref[f"{mn}.weight"], **TOL)
            (b,) = getattr(m.bias, field)
            torch.testing.assert_close(b, ref[f"{mn}.bias"], **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_layer_factors_from_definition(name):
    """Batch (and positions): ``B`` of every Linear / Conv / attention weight is the exact GGN
    block of its bias, ``A`` the mean (unfolded) input outer product (KFLR)."""
    model, X, y = _build(name, n=3, seed=4)
    weights = [
        k for k, p in model.named_parameters()
        if k.endswith("weight") and p.dim() >= 2 and k not in _norm_params(model)
    ]
    ref = ggn_blocks(model, nn.CrossEntropyLoss(), X, y, [_bias_of(model, k) for k in weights])
    xs = _inputs(model, X, LINEAR_LIKE)
    _run(model, X, y, KFLR())
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for k in weights:
        B, A = params[k].kflr
        torch.testing.assert_close(B, ref[_bias_of(model, k)], **TOL, msg=k)
        mod_name = k.rsplit(".", 1)[0] if "." in k else ""
        if mod_name in xs:
            torch.testing.assert_close(A, _input_factor(modules[mod_name], xs[mod_name]), **TOL)
        elif k.endswith("in_proj_weight"):  # self-attention: the layer input
            torch.testing.assert_close(A, _input_factor(None, X), **TOL)


@pytest.mark.parametrize("name", ["batchnorm", "groupnorm"])
def test_kfra_conv_chain_single_sample_matches_kflr(name):
    """One sample: KFRA's recursion through the norm is exact, so its conv/linear factors equal
    KFLR's (BackPACK's convolution convention), and the norm diagonals agree."""
    model, X, y = _build(name, n=1, seed=7)
    _run(model, X, y, KFLR(), KFRA())
    for k, p in model.named_parameters():
        assert len(p.kfra) == len(p.kflr), k
        for a, b in zip(p.kfra, p.kflr):
            torch.testing.assert_close(a, b, **TOL, msg=k)


def test_identity_batchnorm_leaves_layer_factors_unchanged():
    """A BatchNorm that is the identity (running mean 0, variance 1 − eps, scale 1, shift 0)
    changes no factor of the conv and linear layers around it."""
    model, X, y = _build("batchnorm", n=4, seed=8)
    bn = model[1]
    with torch.no_grad():
        bn.running_mean.zero_()
        bn.running_var.fill_(1 - bn.eps)
        bn.weight.fill_(1.0)
        bn.bias.zero_()
    plain = nn.Sequential(*[m for i, m in enumerate(model) if i != 1])
    for exts in ((KFLR(), KFRA()), (KFAC(mc_samples=2),)):
        _run(model, X, y, *exts, seed=9)
        with_bn = {
            (k, e.savefield): [f.clone() for f in getattr(p, e.savefield)]
            for k, p in plain.named_parameters() for e in exts
        }
        _run(plain, X, y, *exts, seed=9)
        for (k, field), factors in with_bn.items():
            p = dict(plain.named_parameters())[k]
            for a, b in zip(factors, getattr(p, field)):
                torch.testing.assert_close(a, b, **TOL, msg=f"{k} {field}")


# --------------------------------------------------------------------------- (4) nothing refused
@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_gets_factors(name):
    model, X, y = _build(name, n=2, seed=10)
    exts = [KFAC(), KFLR()] + ([KFRA()] if name in CHAINS else [])
    _run(model, X, y, *exts)
    norm = set(_norm_params(model))
    for k, p in model.named_parameters():
        for e in exts:
            factors = getattr(p, e.savefield)
            if k in norm or p.dim() < 2:
                assert len(factors) == 1, (k, e)
                assert factors[0].shape == (p.numel(), p.numel())
            else:
                assert len(factors) == 2, (k, e)
            for f in factors:
                assert torch.isfinite(f).all()
                torch.testing.assert_close(f, f.T, **TOL)


@pytest.mark.parametrize("name", ["encoder", "resnet"])
def test_kfra_refuses_non_chains_for_the_architecture(name):
    """KFRA is a recursion over ``nn.Sequential`` chains; residual and attention models are
    refused for that reason (naming KFLR/KFAC), never because of their norms."""
    model, X, y = _build(name, n=2)
    with pytest.raises(NotImplementedError, match=r"nn\.Sequential chain"):
        _run(model, X, y, KFRA())


def test_compat_backpack_format():
    """``backprism.compat.backpack``: norm parameters get ``[D]`` like a bias gets ``[B]``, and
    ``kfacs_to_mat`` turns either into the curvature block."""
    from backprism.compat.backpack import backpack
    from backprism.compat.backpack import extend as bp_extend
    from backprism.compat.backpack import extensions as bp_ext
    from backprism.compat.backpack.utils.kroneckers import kfacs_to_mat

    model, X, y = _build("layernorm", n=3, seed=11)
    names = _norm_params(model)
    ref = ggn_blocks(model, nn.CrossEntropyLoss(), X, y, names)
    bp_extend(model)
    lossfunc = bp_extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(X), y)
    with backpack(bp_ext.KFLR(), bp_ext.KFAC()):
        loss.backward()
    params = dict(model.named_parameters())
    for k in names:
        torch.testing.assert_close(
            kfacs_to_mat(params[k].kflr), torch.diag(torch.diagonal(ref[k])), **TOL
        )
        assert len(params[k].kfac) == 1 and params[k].kfac[0].shape == ref[k].shape
    assert kfacs_to_mat(model[0].bias.kflr).shape == (5, 5)


class SharedNorm(nn.Module):
    """One LayerNorm called twice, and a Linear weight used by its layer and, through a view,
    by an elementwise product (no Kronecker form for that use)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.mid = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        h = torch.tanh(self.norm(self.mid(h))) * self.mid.weight[0]
        return self.head(h)


def test_parameters_of_several_calls_without_kronecker_form_get_the_ggn_diagonal():
    """A parameter used by several calls of which one has no Kronecker form — a LayerNorm
    called twice, a Linear weight also used elementwise — gets ``[D]`` with ``D`` its exact GGN
    diagonal (KFLR; cross terms between the calls included, as in ``diag_ggn_exact``); it was
    the sum of the calls' diagonals (DeBERTa's relative embeddings, fed to two projections,
    were off by up to 38 %). Parameters of one call keep their factors."""
    torch.manual_seed(0)
    model = SharedNorm()
    _randomize_norms(model)
    model = model.to(DT)
    X, y = torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,))
    names = ["norm.weight", "norm.bias", "mid.weight"]
    ref = ggn_blocks(model, nn.CrossEntropyLoss(), X, y, names)
    _run(model, X, y, KFLR(), chunk_size=2)
    params = dict(model.named_parameters())
    for k in names:
        torch.testing.assert_close(
            _diag_factor(params[k], "kflr"), torch.diagonal(ref[k]), **TOL, msg=k
        )
    assert [f.shape for f in model.inp.weight.kflr] == [(5, 5), (4, 4)]
    model.zero_grad()
    _run(model, X, y, KFAC(mc_samples=2), DiagGGNMC(mc_samples=2), seed=1)  # the same columns
    for k in names:
        p = params[k]
        torch.testing.assert_close(_diag_factor(p, "kfac"), p.diag_ggn_mc.reshape(-1), **TOL)


def test_oversized_generic_parameter_is_refused_with_a_way_out(monkeypatch):
    """A ``[P, P]`` diagonal factor above ``KRONECKER_DIAGONAL_MAX_BYTES`` is refused, naming
    the module and pointing to the diagonal extensions."""
    monkeypatch.setattr(rule_module, "KRONECKER_DIAGONAL_MAX_BYTES", 8 * 16)
    model, X, y = _build("hand_rmsnorm", n=2)
    with pytest.raises(NotImplementedError, match=r"HandRMSNorm.*DiagGGNExact"):
        _run(model, X, y, KFLR())
