"""Hugging Face models built from small random-init configs, called as their documentation
shows (``model(input_ids).logits``, ``model(pixel_values).logits``): per-sample results against
dense float64 ``torch.func`` references. Skipped where ``transformers`` is not installed.

Every extension that applies, on GPT-2 (tied head, ``Conv1D``), BERT, ViT and Llama (RMSNorm,
rotary embeddings, grouped-query attention): first order, ``DiagGGNExact`` and its per-sample
``BatchDiagGGNExact``, ``SqrtGGNExact`` (``Σₖ Vₖ² = diag(G)``), ``GGNMP`` against the dense
GGN, ``BatchDotGrad``, ``KFLR`` (Kronecker pairs for every Linear-like and embedding weight,
the exact GGN diagonal as the single factor of the rest), ``DiagGGNMC`` within its standard
error, and ``DiagHessian``/``BatchDiagHessian`` against the dense Hessian, with the fused and
the eager attention (refused for GPT-2's tied head)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from backprism import collect, extend
from backprism.engine.residual import NonlinearityError
from backprism.extensions import (
    GGNMP,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagHessian,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)

transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import SequenceClassifierOutput  # noqa: E402

from tests.common import assert_first_order  # noqa: E402
from tests.reference import (  # noqa: E402
    diag_ggn,
    ggn,
    loss_hessian,
    per_sample_grads,
    per_sample_grads_rows,
)

DT = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-10}
#: Llama's RMSNorm normalises in float32 (``hidden_states.to(torch.float32)``) also in a
#: float64 model: curvature (squares of those rounded values) agrees to float32's precision
LOOSE = {"rtol": 1e-5, "atol": 1e-7}
N = 3


class Logits(nn.Module):
    """``model(x).logits`` as a module (for the references' ``functional_call``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x).logits


def _quiet(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import logging

        logging.getLogger("transformers").setLevel(logging.ERROR)
        return make()


def gpt2():
    cfg = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=11, n_positions=8, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    x = torch.randint(0, 11, (N, 4))
    return model, x, torch.randint(0, 11, (N, 4)), "lm"


def bert():
    cfg = transformers.BertConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=16,
        vocab_size=13, max_position_embeddings=8, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(cfg)
    # no padding token (id 0): torch.func's vmapped embedding backward, used by the
    # reference, ignores padding_idx, while nn.Embedding (and backprism) give its row 0
    x = torch.randint(1, 13, (N, 5))
    return model, x, torch.randint(0, 3, (N,)), "cls"


def vit():
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.ViTForImageClassification(cfg)
    x = torch.randn(N, 3, 8, 8, dtype=DT)
    return model, x, torch.randint(0, 3, (N,)), "cls"


def llama():
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=8,
        intermediate_size=16, vocab_size=11, max_position_embeddings=8, bos_token_id=1,
        eos_token_id=2, pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 11, (N, 4))
    return model, x, torch.randint(0, 11, (N, 4)), "lm"


MODELS = {"gpt2": gpt2, "bert": bert, "vit": vit, "llama": llama}


def _loss(kind: str):
    if kind == "lm":  # logits [N, T, V] → CrossEntropyLoss's [N, V, T] layout
        ce = nn.CrossEntropyLoss()
        return lambda out, y: ce(out.transpose(1, 2), y)
    return nn.CrossEntropyLoss()


def _setup(name: str):
    torch.manual_seed(0)
    model, x, y, kind = _quiet(MODELS[name])
    model = model.to(DT).eval()
    return model, x, y, kind


@pytest.mark.parametrize("name", list(MODELS))
def test_first_order(name: str):
    model, x, y, kind = _setup(name)
    lossfunc = _loss(kind)
    ref = per_sample_grads(Logits(model), lossfunc, x, y)
    ce = extend(nn.CrossEntropyLoss())
    extend(model)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        logits = model(x).logits  # as documented
        (ce(logits.transpose(1, 2), y) if kind == "lm" else ce(logits, y)).backward()
    assert_first_order(Logits(model), ref, **TOL)


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "vit"])
def test_forwards_without_the_mode(name: str):
    """After one recorded forward, these models' forwards outside ``collect`` run without the
    forward mode: all it did was record the GELU/SiLU/RMSNorm internals, which only the
    DiagHessian family uses and refuses here anyway (softmax), widen the position
    embeddings of ``position_ids`` ``[1, T]`` added to the tokens', which the backward pass
    widens at the addition instead, and attribute ViT's ``cls_token`` and
    ``position_embeddings`` in its embeddings module's own forward, which a mode entered for
    that forward's body alone does. A backward through such a forward gives the same first
    order and GGN diagonal."""
    from backprism.engine.state import MODE_FREE

    model, x, y, kind = _setup(name)
    ref = per_sample_grads(Logits(model), _loss(kind), x, y)
    diag = diag_ggn(Logits(model), _loss(kind), x, y)
    ce = extend(nn.CrossEntropyLoss())
    extend(model)

    def loss() -> Tensor:
        logits = model(x).logits
        return ce(logits.transpose(1, 2), y) if kind == "lm" else ce(logits, y)

    loss().backward()  # recorded, outside collect
    assert MODE_FREE[model][model.training] is not None
    model.zero_grad()
    value = loss()  # without the mode
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact()):
        value.backward()
    assert_first_order(Logits(model), ref, **TOL)
    tol = LOOSE if name == "llama" else TOL
    for k, p in _trainable(model):
        torch.testing.assert_close(p.diag_ggn_exact, diag[k], **tol)


def _backward(model: nn.Module, x: Tensor, y: Tensor, kind: str, *exts) -> None:
    ce = extend(nn.CrossEntropyLoss())
    extend(model)
    with collect(*exts):
        logits = model(x).logits
        (ce(logits.transpose(1, 2), y) if kind == "lm" else ce(logits, y)).backward()


def _trainable(model: nn.Module):
    return [(k, p) for k, p in Logits(model).named_parameters() if p.requires_grad]


@pytest.mark.parametrize("name", list(MODELS))
def test_diag_ggn_exact_and_square_root(name: str):
    """``diag_ggn_exact``, ``Σₙ diag_ggn_exact_batch`` and ``Σₖ sqrt_ggn_exact²`` all equal the
    diagonal of the dense GGN."""
    model, x, y, kind = _setup(name)
    ref = diag_ggn(Logits(model), _loss(kind), x, y)
    _backward(model, x, y, kind, DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact())
    tol = LOOSE if name == "llama" else TOL
    for k, p in _trainable(model):
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], **tol)
        torch.testing.assert_close(p.diag_ggn_exact_batch.sum(0), ref[k], **tol)
        torch.testing.assert_close(p.sqrt_ggn_exact.square().sum((0, 1)), ref[k], **tol)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_ggn_vector_products_and_batch_dot(name: str):
    """``GGNMP`` applied to random vectors against the dense GGN's blocks; ``BatchDotGrad``
    against the per-sample gradients' Gram matrix."""
    model, x, y, kind = _setup(name)
    G = ggn(Logits(model), _loss(kind), x, y)
    grads = per_sample_grads(Logits(model), _loss(kind), x, y)
    _backward(model, x, y, kind, GGNMP(), BatchDotGrad())
    tol = LOOSE if name == "llama" else TOL
    offset = 0
    for k, p in _trainable(model):
        size = p.numel()
        block = G[offset : offset + size, offset : offset + size]
        offset += size
        v = torch.randn(2, *p.shape, dtype=DT, generator=torch.Generator().manual_seed(offset))
        got = p.ggnmp(v)
        want = (block @ v.reshape(2, -1).T).T.reshape(v.shape)
        torch.testing.assert_close(got, want, **tol)
        flat = grads[k].flatten(1)
        torch.testing.assert_close(p.batch_dot, flat @ flat.T, **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_kflr_factors(name: str):
    """Every Linear-like weight (``nn.Linear``, GPT-2's ``Conv1D``) and embedding gets a
    Kronecker pair; every other parameter (norm scales and shifts, biases aside) one factor,
    the exact GGN diagonal — nothing is refused."""
    model, x, y, kind = _setup(name)
    ref = diag_ggn(Logits(model), _loss(kind), x, y)
    _backward(model, x, y, kind, KFLR())
    tol = LOOSE if name == "llama" else TOL
    modules = dict(Logits(model).named_modules())
    for k, p in _trainable(model):
        owner = modules[k.rsplit(".", 1)[0]]
        factors = p.kflr
        kronecker = type(owner).__name__ in ("Linear", "Conv1D", "Conv2d", "Embedding") and (
            p.dim() >= 2
        )
        if kronecker:
            assert len(factors) == 2, k
            assert factors[0].shape[0] * factors[1].shape[0] == p.numel(), k
        elif p.dim() == 1 and k.endswith("bias") and type(owner).__name__ != "LayerNorm":
            (b,) = factors  # a Linear-like bias: its exact GGN block
            torch.testing.assert_close(torch.diagonal(b), ref[k], **tol)
        else:
            (d,) = factors
            torch.testing.assert_close(d, torch.diag(ref[k].reshape(-1)), **tol)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_diag_ggn_mc_within_its_standard_error(name: str):
    """``DiagGGNMC`` with many samples within six standard errors of the exact diagonal."""
    model, x, y, kind = _setup(name)
    ref = diag_ggn(Logits(model), _loss(kind), x, y)
    torch.manual_seed(1)
    draws = []
    for _ in range(8):
        model.zero_grad()
        _backward(model, x, y, kind, DiagGGNMC(mc_samples=64))
        draws.append(torch.cat([p.diag_ggn_mc.flatten() for _, p in _trainable(model)]))
    d = torch.stack(draws)
    want = torch.cat([ref[k].flatten() for k, _ in _trainable(model)])
    se = d.std(0) / 8**0.5
    assert ((d.mean(0) - want).abs() <= 6 * se + 1e-9).all()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_diag_hessian(name: str, attention: str):
    """``DiagHessian`` and ``BatchDiagHessian`` (per sample, and summed) against the diagonal
    of the dense Hessian of ``torch.func`` (the math attention kernel), through the models'
    norms, GELU/SwiGLU, rotary embeddings and attention — the fused SDPA kernel, or the eager
    matmuls and softmax. GPT-2 with its head untied (tied:
    :func:`test_diag_hessian_tied_head`). Llama computes its RMSNorm and eager
    softmax in float32 (also in a float64 model): its curvature agrees to float32's precision,
    relative to the diagonal's largest entry."""

    model, x, y, kind = _setup(name)
    if name == "gpt2":
        model.config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    model.set_attn_implementation(attention)
    _check_diag_hessian(model, x, y, kind, 1e-4 if name == "llama" else 1e-10)


def _check_diag_hessian(model: nn.Module, x: Tensor, y: Tensor, kind: str, rel: float) -> None:
    """DiagHessian and BatchDiagHessian (per sample, and summed) of ``model`` against the
    dense Hessian (the math attention kernel), to ``rel`` of the diagonal's largest entry."""
    from tests.extensions.test_hessian import per_sample_hessian_diags

    lossfunc = _loss(kind)
    with sdpa_kernel(SDPBackend.MATH):
        diag = torch.diagonal(loss_hessian(Logits(model), lossfunc, x, y))
        per_sample = per_sample_hessian_diags(Logits(model), lossfunc, x, y)
    _backward(model, x, y, kind, DiagHessian(), BatchDiagHessian())
    got = torch.cat([p.diag_h.flatten() for _, p in _trainable(model)])
    got_n = torch.cat([p.diag_h_batch.flatten(1) for _, p in _trainable(model)], 1)
    scale = float(diag.abs().max())
    torch.testing.assert_close(got, diag, rtol=rel, atol=rel * scale)
    torch.testing.assert_close(got_n, per_sample, rtol=rel, atol=rel * scale)
    torch.testing.assert_close(got_n.sum(0), got, rtol=1e-10, atol=1e-12 * scale)


def test_diag_hessian_tied_head():
    """GPT-2's tied head uses the token embedding's weight in the first and the last call: the
    Hessian term of that product of uses (``2⟨G, dh dWᵀ⟩`` at the head) is built from the
    SVD of each sample's logit gradient (``residual.NestedSite``). DiagHessian and
    BatchDiagHessian against the dense Hessian."""
    model, x, y, kind = _setup("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    _check_diag_hessian(model, x, y, kind, 1e-10)


class _EncoderLogits(nn.Module):
    """A T5 encoder with a mean-pooled linear head, its output as ``.logits``."""

    def __init__(self, encoder: nn.Module, width: int, classes: int) -> None:
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Any:
        h = self.encoder(input_ids=x).last_hidden_state
        return SequenceClassifierOutput(logits=self.head(h.mean(1)))


def _relative_bias_model(name: str) -> nn.Module:
    if name == "t5":
        cfg = transformers.T5Config(
            num_layers=1, num_heads=2, d_model=8, d_kv=4, d_ff=8, vocab_size=11,
            dropout_rate=0.0, attn_implementation="sdpa",
        )
        return _EncoderLogits(transformers.T5EncoderModel(cfg), 8, 3)
    if name == "beit":
        cfg = transformers.BeitConfig(
            image_size=16, patch_size=8, hidden_size=8, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=8, num_labels=3,
            use_relative_position_bias=True, attn_implementation="sdpa",
        )
        return transformers.BeitForImageClassification(cfg)
    cfg = transformers.SwinConfig(
        image_size=8, patch_size=2, embed_dim=4, depths=[2], num_heads=[2], window_size=2,
        num_labels=3, attn_implementation="sdpa",
    )
    return transformers.SwinForImageClassification(cfg)


@pytest.mark.parametrize("name", ["t5", "beit", "swin"])
def test_diag_hessian_relative_position_bias_under_sdpa(name: str):
    """T5, BEiT and Swin pass their relative position bias to SDPA as the additive mask (Swin's
    combined with the shifted windows' mask, on the samples folded with windows): the fused
    attention's columns enter the mask too, so DiagHessian and BatchDiagHessian match the
    dense Hessian (before: refused). T5 normalises in float32, hence float32's precision."""
    torch.manual_seed(0)
    model = _quiet(lambda: _relative_bias_model(name)).to(DT).eval()
    with torch.no_grad():  # (tables initialised to zero: perturbed, so their terms count)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    if name == "t5":
        x, y, rel = torch.randint(0, 11, (N, 4)), torch.randint(0, 3, (N,)), 1e-5
    else:
        size = 16 if name == "beit" else 8
        x, y, rel = torch.randn(N, 3, size, size, dtype=DT), torch.randint(0, 3, (N,)), 1e-10
    with torch.no_grad():
        model(x)  # (BEiT caches its position index: made here, not inside the references' vmap)
    _check_diag_hessian(model, x, y, "cls", rel)


class _ShiftedLoss:
    """The loss Hugging Face's causal LMs compute for ``labels=``: position ``t`` predicts
    token ``t + 1``, mean over the ``N·(T − 1)`` predicted tokens."""

    def __call__(self, logits: Tensor, y: Tensor) -> Tensor:
        v = logits.shape[-1]
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, v), y[:, 1:].reshape(-1)
        )


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_models_own_loss_with_labels(name: str):
    """``model(x, labels=x).loss.backward()``, the loss computed inside the model with
    ``F.cross_entropy`` (no extended loss module): first order and the exact GGN diagonal
    against the references of that loss. The models compute it in float32
    (``logits.float()``), hence float32's precision."""
    model, x, _, _ = _setup(name)
    ref_grads = per_sample_grads(Logits(model), _ShiftedLoss(), x, x)
    ref = diag_ggn(Logits(model), _ShiftedLoss(), x, x)
    extend(model)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact()):
        model(x, labels=x).loss.backward()
    assert_first_order(Logits(model), ref_grads, **LOOSE)
    for k, p in _trainable(model):
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], **LOOSE)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_swin_windows_and_its_shared_bias_tables(attention: str):
    """Hugging Face's Swin: window attention on the batch folded with the windows
    (``[N·windows, ws², C]``) gets the samples' first-order results and GGN diagonal, its
    relative position bias tables too: they come from a module whose forward takes no input
    (shared by all samples), combined with the shifted windows' constant mask and broadcast
    over the windows' rows, whose grouping into samples is read from the scores (eager) or
    queries (SDPA) they meet."""
    torch.manual_seed(0)
    cfg = transformers.SwinConfig(
        image_size=16, patch_size=2, embed_dim=4, depths=[2, 1], num_heads=[1, 2],
        window_size=4, num_labels=3, attn_implementation=attention,
    )
    model = Logits(_quiet(lambda: transformers.SwinForImageClassification(cfg))).to(DT).eval()
    x, y = torch.randn(N, 3, 16, 16, dtype=DT), torch.randint(0, 3, (N,))
    _against_loops(extend(model), nn.CrossEntropyLoss(), x, y, TOL)


@pytest.mark.parametrize("depths", [[1], [2, 1]])
def test_swin_forwards_outside_collect(depths: list[int]):
    """Swin forwards outside ``collect``, then a collecting backward, against loop references.
    The model keeps the forward mode in both: without shifted windows (``depths=[1]``) its
    bias table, a call without inputs added to the scores ``[N·windows, …]``, is widened by
    the mode to one copy per sample, repeated over the sample's windows (the backward pass
    could widen it at the addition, but over the windows' rows: the extensions' results would
    depend on whether the mode ran, Kronecker factors' counts of the call's inputs).
    With shifted windows the bias first meets the constant window mask, whose rows only the
    mode follows (before, it ran without it and the collecting backward refused the folded
    rows)."""
    from backprism.engine.state import MODE_FREE

    torch.manual_seed(0)
    cfg = transformers.SwinConfig(
        image_size=16, patch_size=2, embed_dim=4, depths=depths, num_heads=[1, 2][: len(depths)],
        window_size=4, num_labels=3, attn_implementation="eager",
    )
    model = Logits(_quiet(lambda: transformers.SwinForImageClassification(cfg))).to(DT).eval()
    x, y = torch.randn(N, 3, 16, 16, dtype=DT), torch.randint(0, 3, (N,))
    lossfunc = extend(nn.CrossEntropyLoss())
    extend(model)
    lossfunc(model(x), y).backward()  # recorded, outside collect
    assert MODE_FREE[model][False] is None
    model.zero_grad()
    _against_loops(model, lossfunc, x, y, TOL)


class _Seq2SeqLogits(nn.Module):
    """T5 on one tensor ``[N, S + T]``: encoder ids (id 0 is padding, masked) then decoder
    ids; ``.logits`` ``[N, T, V]``."""

    def __init__(self, model: nn.Module, s: int) -> None:
        super().__init__()
        self.model, self.s = model, s

    def forward(self, x: Tensor) -> Tensor:
        ids, dec = x[:, : self.s], x[:, self.s :]
        mask = (ids != 0).long()
        return self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_t5_and_its_relative_position_bias(attention: str):
    """Hugging Face's T5: the relative position bias, an ``Embedding`` of ``[T, T]`` bucket
    indices shared by all samples (and by all layers of a stack), is split per sample where it
    meets them (the scores, or SDPA's mask with the padding mask): first order and the exact
    GGN diagonal of every parameter against loop references, with a padded encoder sample.
    T5's layer norm computes its variance in float32, hence float32's precision."""
    from tests.reference import batch_diag_ggn_loop, per_sample_grads_loop

    torch.manual_seed(0)
    cfg = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, num_heads=2, d_model=8, d_kv=4, d_ff=16,
        vocab_size=11, decoder_start_token_id=0, dropout_rate=0.0,
        attn_implementation=attention,
    )
    model = _quiet(lambda: transformers.T5ForConditionalGeneration(cfg)).to(DT).eval()
    model = _Seq2SeqLogits(model, 5)
    x = torch.randint(1, 11, (N, 9))
    x[1, 3:5] = 0  # padding in the second sample's encoder input
    y = torch.randint(0, 11, (N, 4))
    lossfunc = _loss("lm")
    ref = per_sample_grads_loop(model, lossfunc, x, y)
    diag = batch_diag_ggn_loop(model, lossfunc, x, y)
    ce = extend(nn.CrossEntropyLoss())
    extend(model)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        ce(model(x).transpose(1, 2), y).backward()
    assert_first_order(model, ref, **LOOSE)
    model.zero_grad()
    with collect(DiagGGNExact()):
        ce(model(x).transpose(1, 2), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diag[k].sum(0), **LOOSE, msg=k)


@pytest.mark.parametrize("shared", [False, True])
def test_beit_and_its_relative_position_bias(shared: bool):
    """Hugging Face's BEiT: the relative position bias tables come from a module called without
    tensor inputs (one per layer, or one shared by all layers), added to every sample's
    attention scores: widened over the batch there, first order and the exact GGN diagonal of
    every parameter against loop references (refused for every extension before)."""

    torch.manual_seed(0)
    cfg = transformers.BeitConfig(
        image_size=16, patch_size=8, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, num_labels=3, use_relative_position_bias=not shared,
        use_shared_relative_position_bias=shared,
    )
    model = Logits(_quiet(lambda: transformers.BeitForImageClassification(cfg))).to(DT).eval()
    x, y = torch.randn(N, 3, 16, 16, dtype=DT), torch.randint(0, 3, (N,))
    _against_loops(extend(model), nn.CrossEntropyLoss(), x, y, TOL)


@pytest.mark.parametrize("version", ["v2", "v2_unnormed", "v1"])
def test_deberta_and_its_relative_embeddings(version: str):
    """Hugging Face's DeBERTa (v2, the code of DeBERTa-v3; and v1): disentangled attention
    projects relative embeddings (an ``Embedding``'s weight through a LayerNorm, then every
    layer's key and query projections, shared by all samples) and meets the samples in batched
    matrix products with the per-sample queries and keys (v2 repeats them over the batch folded
    with the heads; v1 scales them in place): each projection is run again on every sample's
    copy, first order and the exact GGN diagonal of every parameter against loop references
    (refused before). ``v2_unnormed``: the embedding's weight goes to both projections itself
    (``norm_rel_ebd="none"``), a parameter of two calls without Kronecker form, whose KFLR
    factor was the sum of the calls' diagonals. v1's LayerNorm normalises in float32, hence
    float32's precision."""
    torch.manual_seed(0)
    common = dict(
        num_hidden_layers=2, num_attention_heads=2, hidden_size=8, intermediate_size=16,
        vocab_size=13, max_position_embeddings=16, num_labels=3, relative_attention=True,
        pos_att_type=["c2p", "p2c"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    if version.startswith("v2"):
        unnormed = version == "v2_unnormed"  # (its own position projections, too)
        cfg = transformers.DebertaV2Config(
            **common, share_att_key=not unnormed, norm_rel_ebd="none" if unnormed else
            "layer_norm", position_buckets=4,
        )
        make = transformers.DebertaV2ForSequenceClassification
    else:
        cfg = transformers.DebertaConfig(**common)
        make = transformers.DebertaForSequenceClassification
    model = Logits(_quiet(lambda: make(cfg))).to(DT).eval()
    if version == "v2_unnormed":  # (the initial embeddings' curvature is below TOL's atol)
        model = _perturbed(model)
    x, y = torch.randint(3, 13, (N, 6)), torch.randint(0, 3, (N,))
    tol = LOOSE if version == "v1" else TOL
    _against_loops(extend(model), nn.CrossEntropyLoss(), x, y, tol)


@pytest.mark.parametrize("norm", ["none", "layer_norm"])
def test_deberta_v2_diag_hessian(norm: str):
    """DeBERTa-v2's relative embeddings, shared by all samples, are projected by every layer's
    key and query projections, which take each sample's copy: DiagHessian and
    BatchDiagHessian against the dense Hessian. Normalised first (``norm_rel_ebd=
    "layer_norm"``), the LayerNorm of the shared embeddings is copied over the samples by the
    engine's own autograd Function, whose per-sample pull-backs do not build that LayerNorm's
    Hessian term: refused before anything is written (it was silently wrong when such copies
    were let through, 100 % off on the embeddings' diagonal)."""
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=8,
        vocab_size=13, max_position_embeddings=16, num_labels=3, relative_attention=True,
        pos_att_type=["c2p", "p2c"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        position_buckets=4, norm_rel_ebd=norm,
    )
    model = _quiet(lambda: transformers.DebertaV2ForSequenceClassification(cfg)).to(DT).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x, y = torch.randint(3, 13, (N, 5)), torch.randint(0, 3, (N,))
    if norm == "none":
        _check_diag_hessian(model, x, y, "cls", 1e-10)
        return
    with pytest.raises(NonlinearityError, match="a value all samples share lies between"):
        _backward(model, x, y, "cls", DiagHessian())
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())


def test_deberta_v1_diag_hessian():
    """DeBERTa (v1)'s LayerNorm divides by ``sqrt(var + ε)`` of its centred input (refused
    before: a division by a parameter-dependent value): its quotient's terms (the product's
    with gradient ``−G/y²``, the reciprocal's on the denominator) are built
    (``residual.DivisionSite``). DiagHessian and BatchDiagHessian against the dense Hessian; the
    LayerNorm normalises in float32 (in the reference too), hence float32's precision."""
    torch.manual_seed(0)
    cfg = transformers.DebertaConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=8,
        vocab_size=13, max_position_embeddings=16, num_labels=3, relative_attention=True,
        pos_att_type=["c2p", "p2c"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = _quiet(lambda: transformers.DebertaForSequenceClassification(cfg)).to(DT).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x, y = torch.randint(3, 13, (N, 5)), torch.randint(0, 3, (N,))
    _check_diag_hessian(model, x, y, "cls", 2e-6)


def _against_loops(model: nn.Module, lossfunc: Any, x: Tensor, y: Tensor, tol: dict) -> None:
    """First order, the exact GGN diagonal and KFLR's single factors of the extended ``model``'s
    trainable parameters against loop references (per-sample ``functional_call``s, dense
    Jacobians and Hessians)."""
    from tests.reference import batch_diag_ggn_loop, per_sample_grads_loop

    ref = per_sample_grads_loop(model, lossfunc, x, y)
    diag = batch_diag_ggn_loop(model, lossfunc, x, y)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(model(x), y).backward()
    assert_first_order(model, ref, **tol)
    model.zero_grad()
    with collect(DiagGGNExact()):
        lossfunc(model(x), y).backward()
    for k, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.diag_ggn_exact, diag[k].sum(0), **tol, msg=k)
    # KFLR: a single factor (a bias's block, [D] without Kronecker structure) has the exact GGN
    # diagonal on its diagonal, also for parameters used by several calls
    model.zero_grad()
    with collect(KFLR()):
        lossfunc(model(x), y).backward()
    for k, p in model.named_parameters():
        if p.requires_grad and len(p.kflr) == 1:
            got = torch.diagonal(p.kflr[0]).reshape(p.shape)
            torch.testing.assert_close(got, diag[k].sum(0), **tol, msg=k)


class _LastToken(nn.Module):
    """A causal LM's logits at the last position, ``[N, V]``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x, use_cache=False).logits[:, -1]


def _perturbed(model: nn.Module) -> nn.Module:
    """Parameters and running statistics moved off their initial values (zeros and ones hide
    errors), in eval mode."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.normal_()
            elif name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
    return model.eval()


def test_mixtral_router_outputs_computed_from_each_other():
    """Hugging Face's Mixtral: the top-k router returns its logits and the routing weights
    computed from them; its per-sample gradients were counted twice (the routing weights'
    gradient reaches the logits' node too) until the router hands the model an alias of the
    logits. First order and the exact GGN diagonal against loop references."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, vocab_size=11,
        max_position_embeddings=16, experts_implementation="eager",  # (grouped: float32 only)
    )
    model = _LastToken(_quiet(lambda: transformers.MixtralForCausalLM(cfg))).to(DT)
    x, y = torch.randint(0, 11, (N, 5)), torch.randint(0, 11, (N,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its RMSNorm normalises in float32, as Llama's)
        _against_loops(extend(_perturbed(model)), nn.CrossEntropyLoss(), x, y, LOOSE)


def test_levit_batch_norm_on_rows_folding_the_samples():
    """Hugging Face's LeViT: BatchNorm1d (eval) on ``[N·T, C]`` rows after its Linear layers;
    ``variance`` of the norms' parameters is over the ``N`` samples (it was over the rows)."""
    cfg = transformers.LevitConfig(
        image_size=32, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2],
        depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=3,
        down_ops=[["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]],
    )
    model = Logits(_quiet(lambda: transformers.LevitForImageClassification(cfg))).to(DT)
    model = _perturbed(model)
    torch.manual_seed(0)
    x, y = torch.randn(N, 3, 32, 32, dtype=DT), torch.randint(0, 3, (N,))
    # (the reference from the rows of one batch: run on one sample alone, its first layer's
    # gradient differs, in plain PyTorch, from that sample's row in the batch)
    ref = per_sample_grads_rows(model, x, y)
    for m in model.modules():  # (in eval mode its attention caches its bias tables, graph
        if hasattr(m, "attention_bias_cache"):  # included, across forwards)
            m.attention_bias_cache = {}
    lossfunc = nn.CrossEntropyLoss()
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(extend(model)(x), y).backward()
    assert_first_order(model, ref, **TOL)


def test_funnel_class_mask_as_long_as_the_batch():
    """Hugging Face's Funnel Transformer: after pooling, the attention takes a ``[T', T']`` class
    mask (the same for every sample) with ``T' = 1 + (T − 1)//2 = N``: not split over the
    samples (it was, silently)."""
    cfg = transformers.FunnelConfig(
        vocab_size=13, d_model=8, n_head=2, d_head=4, d_inner=16, block_sizes=[1, 1],
        num_labels=3,
    )
    model = Logits(_quiet(lambda: transformers.FunnelForSequenceClassification(cfg))).to(DT)
    torch.manual_seed(0)
    x, y = torch.randint(1, 13, (N, 2 * N)), torch.randint(0, 3, (N,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (the GGN diagonal through its attention: round-off up to 1e-10 against 1e-2 values)
        tol = {"rtol": 1e-6, "atol": 1e-9}
        _against_loops(extend(_perturbed(model)), nn.CrossEntropyLoss(), x, y, tol)


def test_siglip_attention_pooling_head_kronecker_factors():
    """Hugging Face's SigLIP vision tower with its attention-pooling head: a learned probe
    attends to the patch tokens through ``nn.MultiheadAttention`` (query ≠ key/value), whose
    packed ``in_proj_weight`` gets block-diagonal factors ``[3, E, E]`` (it refused the whole
    model before). KFLR: the bias's ``B`` is its exact GGN block (diagonal against the dense
    reference) with the weight's ``B_g`` as its diagonal blocks; ``A_g``: the probe's and the
    tokens' second moments; every other parameter as in :func:`test_kflr_factors`."""
    torch.manual_seed(0)
    cfg = transformers.SiglipVisionConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        image_size=8, patch_size=4, num_channels=3,
    )

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tower = transformers.SiglipVisionModel(cfg)
            self.head = nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.tower(pixel_values=x).pooler_output)

    model = _perturbed(_quiet(Pooled).to(DT))
    x, y = torch.randn(N, 3, 8, 8, dtype=DT), torch.randint(0, 3, (N,))
    ref = diag_ggn(model, nn.CrossEntropyLoss(), x, y)
    pool = next(m for m in model.modules() if type(m).__name__.endswith("PoolingHead"))
    names = {id(p): k for k, p in model.named_parameters()}
    seen: list[Tensor] = []
    hook = pool.attention.register_forward_pre_hook(
        lambda m, a: seen.append(a[1].detach()), with_kwargs=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the head's probe: the generic rule, announced)
        with collect(KFLR()):
            extend(nn.CrossEntropyLoss())(extend(model)(x), y).backward()
    hook.remove()
    attn, e = pool.attention, 8
    B, A = attn.in_proj_weight.kflr
    (Bb,) = attn.in_proj_bias.kflr
    torch.testing.assert_close(torch.diagonal(Bb), ref[names[id(attn.in_proj_bias)]], **TOL)
    tokens = seen[0].reshape(-1, e)
    probe = pool.probe.detach().reshape(1, e)  # the same query for every sample
    inputs = (probe.t() @ probe, tokens.t() @ tokens / N, tokens.t() @ tokens / N)
    for i, second_moment in enumerate(inputs):
        rows = slice(i * e, (i + 1) * e)
        torch.testing.assert_close(B[i], Bb[rows, rows], **TOL)
        torch.testing.assert_close(A[i], second_moment, **TOL)
    for k, p in model.named_parameters():  # nothing refused; one-dimensional ones: diagonals
        assert hasattr(p, "kflr"), k
        if p.dim() == 1:
            torch.testing.assert_close(torch.diagonal(p.kflr[0]), ref[k], **TOL, msg=k)
