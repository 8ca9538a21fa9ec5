"""Hugging Face models built from small random-init configs, called as their documentation
shows (``model(input_ids).logits``, ``model(pixel_values).logits``): per-sample results against
dense float64 ``torch.func`` references. Skipped where ``transformers`` is not installed."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, SumGradSquared, Variance

transformers = pytest.importorskip("transformers")

from tests.common import assert_first_order  # noqa: E402
from tests.reference import diag_ggn, per_sample_grads  # noqa: E402

DT = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-10}
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


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_diag_ggn_exact(name: str):
    model, x, y, _ = _setup(name)
    ref = diag_ggn(Logits(model), nn.CrossEntropyLoss(), x, y)
    ce = extend(nn.CrossEntropyLoss())
    extend(model)
    with collect(DiagGGNExact()):
        ce(model(x).logits, y).backward()
    for k, p in Logits(model).named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], **TOL)
