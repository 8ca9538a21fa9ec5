"""Rules for Hugging Face layers (``backprism.rules.transformers``): GPT-2's ``Conv1D`` and the
RMSNorm variants, against dense float64 ``torch.func`` references. Skipped without
``transformers``.

Covered: ``Conv1D`` with and without a sequence axis (every first-order statistic, exact GGN
diagonals, KFLR factors in the weight's ``[in, out]`` order, ``M > 1`` columns through every rule
method), ``LlamaRMSNorm`` (normalises in float32), ``GemmaRMSNorm`` (``1 + w``), a gated variant
with two inputs, whole GPT-2 and Llama models (no module left to the generic rule), a class
that only looks like an RMSNorm (falls back to the generic rule, with its warning), and the
import hook (rules registered whether ``transformers`` is imported before or after backprism).
"""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
import types
import warnings

import pytest
import torch
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine.rule import Call, get_rule
from backprism.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SumGradSquared,
    Variance,
)
from backprism.rules import generic
from backprism.rules import transformers as hf_rules
from tests.common import check_rule_statistics, first_order_expected

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from tests.reference import diag_blocks, ggn, ggn_blocks, param_blocks, per_sample_grads, split  # noqa: E402

DT = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-11}
FIRST = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad)


def _quiet_import(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        return importlib.import_module(name)


def _check_first_order(model: nn.Module, X: tuple, y: Tensor, loss=None, **tol) -> None:
    tol = tol or TOL
    loss = loss or nn.CrossEntropyLoss()
    ref = per_sample_grads(model, loss, X, y)
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", generic.GenericRuleWarning)  # no generic fallback
        with collect(*(e() for e in FIRST)):
            out = model(*X)
            (lossfunc(out.transpose(1, 2), y) if out.dim() == 3 else lossfunc(out, y)).backward()
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        for field, value in first_order_expected(ref[name]).items():
            torch.testing.assert_close(getattr(p, field), value, **tol, msg=f"{name}.{field}")


# -- Conv1D ----------------------------------------------------------------------------------
class Conv1DNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = Conv1D(5, 3)  # nf (out) = 5, nx (in) = 3
        self.c2 = Conv1D(3, 5)
        with torch.no_grad():
            self.c1.bias.normal_()

    def forward(self, x: Tensor) -> Tensor:
        h = self.c2(self.c1(x).tanh())
        return h.mean(1) if h.dim() == 3 else h


@pytest.mark.parametrize("seq", [False, True], ids=["flat", "sequence"])
def test_conv1d_first_order_and_ggn(seq: bool):
    torch.manual_seed(0)
    assert type(get_rule(Conv1D(2, 2))) is hf_rules.Conv1DRule
    model = Conv1DNet().to(DT)
    x = torch.randn(4, *((3,) if seq else ()), 3, dtype=DT)
    y = torch.randint(0, 3, (4,))
    _check_first_order(model, (x,), y)
    G, _, _ = ggn_blocks(model, nn.CrossEntropyLoss(), x, y)
    diag = split(torch.diagonal(G.sum((0, 1))), model)
    batch = split(diag_blocks(G), model, lead=1)
    lossfunc = extend(nn.CrossEntropyLoss())
    with collect(DiagGGNExact(), BatchDiagGGNExact(), KFLR()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diag[name], **TOL, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, batch[name], **TOL, msg=name)
    # KFLR in the weight's axis order [in, out]: [A, B]; B is the bias's exact GGN block
    blocks = param_blocks(model, ggn(model, nn.CrossEntropyLoss(), x, y))
    A, B = model.c1.weight.kflr
    xf = x.reshape(-1, 3)
    torch.testing.assert_close(A, xf.t() @ xf / 4, **TOL)
    torch.testing.assert_close(B, blocks["c1.bias"], **TOL)
    torch.testing.assert_close(model.c1.bias.kflr[0], blocks["c1.bias"], **TOL)


def _rule_columns(module: nn.Module, args: tuple, kwargs: dict, m: int = 3, **tol) -> None:
    """Every rule method of ``module``'s rule for ``M = m`` random columns against per-sample
    autograd (``Vₘₙ = Jₙᵀ g[m, n]``); the inputs carry the batch on axis 0."""
    tol = tol or TOL
    n = args[0].shape[0]
    with torch.no_grad():
        out = module(*args, **kwargs)
    g = torch.randn(m, *out.shape, dtype=out.dtype)
    params = {k: p for k, p in module.named_parameters() if p.requires_grad}
    call = Call(module=module, args=args, kwargs=kwargs, out_shapes=[out.shape], batch_size=n,
                training=module.training, params=params)
    ref = {k: torch.zeros(m, n, *p.shape, dtype=DT) for k, p in params.items()}
    for i in range(n):
        o = module(*(a[i : i + 1] for a in args), **kwargs)
        for k in range(m):
            grads = torch.autograd.grad(o, list(params.values()), g[k, i : i + 1],
                                        retain_graph=True)
            for name, gr in zip(params, grads):
                ref[name][k, i] = gr
    w = torch.rand(m, n, dtype=DT) - 0.3
    vec = {k: torch.randn_like(p) for k, p in params.items()}
    check_rule_statistics(get_rule(module), call, g, ref, w, vec, **tol)


@pytest.mark.parametrize("shape", [(4, 3), (4, 5, 3), (3, 2, 2, 3)])
def test_conv1d_rule_columns(shape):
    torch.manual_seed(1)
    module = Conv1D(6, 3).to(DT)
    with torch.no_grad():
        module.bias.normal_()
    _rule_columns(module, (torch.randn(*shape, dtype=DT),), {})


# -- RMSNorm variants ------------------------------------------------------------------------
class NormNet(nn.Module):
    def __init__(self, norm: nn.Module, d: int = 6, gated: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.norm = norm
        self.head = nn.Linear(d, 3)
        self.gated = gated
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = self.norm(h, gate=h.sin()) if self.gated else self.norm(h)
        return self.head(h.tanh()).mean(1)


def _norms() -> dict:
    llama = _quiet_import("transformers.models.llama.modeling_llama")
    gemma = _quiet_import("transformers.models.gemma.modeling_gemma")
    bamba = _quiet_import("transformers.models.bamba.modeling_bamba")
    return {
        "llama": (lambda: llama.LlamaRMSNorm(6, eps=1e-5), {}, TOL),
        # Gemma computes (x̂·(1 + w)) in float32 and casts the result back: the reference's
        # autograd rounds the incoming gradient to float32, the closed form does not
        "gemma": (lambda: gemma.GemmaRMSNorm(6, eps=1e-5), {}, {"rtol": 1e-5, "atol": 1e-8}),
        "bamba_gated": (lambda: bamba.BambaRMSNormGated(6, group_size=3), {"gated": True}, TOL),
    }


@pytest.mark.parametrize("kind", ["llama", "gemma", "bamba_gated"])
def test_rmsnorm_variants(kind: str):
    make, opts, tol = _norms()[kind]
    torch.manual_seed(2)
    norm = make().to(DT)
    assert type(get_rule(norm)) is hf_rules.ScaledNormRule
    model = NormNet(norm, **opts).to(DT)
    x = torch.randn(4, 3, 3, dtype=DT)
    y = torch.randint(0, 3, (4,))
    _check_first_order(model, (x,), y, **tol)
    G, _, _ = ggn_blocks(model, nn.CrossEntropyLoss(), x, y)
    diag = split(torch.diagonal(G.sum((0, 1))), model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with collect(DiagGGNExact()):
        lossfunc(model(x), y).backward()
    torch.testing.assert_close(norm.weight.diag_ggn_exact, diag["norm.weight"], **tol)


def test_rmsnorm_rule_columns():
    llama = _quiet_import("transformers.models.llama.modeling_llama")
    torch.manual_seed(3)
    norm = llama.LlamaRMSNorm(4).to(DT)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    _rule_columns(norm, (torch.randn(3, 2, 4, dtype=DT),), {})


def test_lookalike_falls_back_to_the_generic_rule():
    """A class named like an RMSNorm whose weight enters nonlinearly is recognised as not of
    the form ``B(x) + A(x) ⊙ w`` and takes the generic rule (with its warning): same numbers."""
    mod = types.ModuleType("transformers.models.fake.modeling_fake")

    class FakeRMSNorm(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x: Tensor) -> Tensor:
            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight.exp()

    FakeRMSNorm.__module__ = mod.__name__
    mod.FakeRMSNorm = FakeRMSNorm
    hf_rules._register_module(mod)
    assert type(get_rule(FakeRMSNorm(2))) is hf_rules.ScaledNormRule
    torch.manual_seed(4)
    model = NormNet(FakeRMSNorm(6)).to(DT)
    x, y = torch.randn(4, 3, 3, dtype=DT), torch.randint(0, 3, (4,))
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    generic._ANNOUNCED.discard("FakeRMSNorm")
    with pytest.warns(generic.GenericRuleWarning, match="FakeRMSNorm"), collect(BatchGrad()):
        lossfunc(model(x), y).backward()
    assert hf_rules._KINDS[FakeRMSNorm] is None
    torch.testing.assert_close(model.norm.weight.grad_batch, ref["norm.weight"], **TOL)


# -- whole models ----------------------------------------------------------------------------
def _gpt2():
    cfg = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=11, n_positions=8, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=8,
        intermediate_size=16, vocab_size=11, max_position_embeddings=8, bos_token_id=1,
        eos_token_id=2, pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg)


class Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x).logits


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_models_take_closed_forms(make):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        model = Logits(make()).to(DT).eval()
    own = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    assert not any(type(get_rule(m)) is generic.GenericRule for m in own)
    x, y = torch.randint(0, 11, (3, 4)), torch.randint(0, 11, (3, 4))
    ce = nn.CrossEntropyLoss()
    _check_first_order(model, (x,), y, loss=lambda out, t: ce(out.transpose(1, 2), t))


def test_gpt2_diag_ggn_exact():
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Logits(_gpt2()).to(DT).eval()
    x, y = torch.randint(0, 11, (2, 3)), torch.randint(0, 11, (2, 3))
    ce = nn.CrossEntropyLoss()
    ref = split(torch.diagonal(ggn(model, lambda o, t: ce(o.transpose(1, 2), t), x, y)), model)
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with collect(DiagGGNExact()):
        lossfunc(model(x).transpose(1, 2), y).backward()
    seen = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            torch.testing.assert_close(p.diag_ggn_exact, ref[name], **TOL, msg=name)


# -- registration ----------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["backprism_first", "transformers_first"])
def test_registration_in_either_import_order(order: str):
    imports = ["import backprism", "import transformers.pytorch_utils as pu"]
    if order == "transformers_first":
        imports.reverse()
    code = "; ".join(
        [*imports,
         "from backprism.engine.rule import get_rule",
         "print(type(get_rule(pu.Conv1D(2, 3))).__name__)"]
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "Conv1DRule"


def test_bloom_gelu_function_keeps_samples_apart():
    """Bloom's ``GeLUFunction`` (its GELU in train mode, an elementwise custom function) is
    declared to the batch analysis when its module is imported: a train-mode pass through it
    raises no ``UncheckedOperationWarning``, and per-sample gradients match a loop over the
    samples (``vmap`` cannot run a function without ``setup_context``)."""
    from transformers.models.bloom import modeling_bloom

    from backprism.engine import UncheckedOperationWarning
    from tests.reference import per_sample_grads_loop

    class Gelu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(modeling_bloom.GeLUFunction.apply(self.a(x)))

    torch.manual_seed(0)
    model = extend(Gelu().to(DT))
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    lossfunc = extend(nn.CrossEntropyLoss())
    ref = per_sample_grads_loop(model, lossfunc, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedOperationWarning)
        with collect(BatchGrad()):
            lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[name], **TOL, msg=name)
