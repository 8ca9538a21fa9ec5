"""Precision of exact curvature in float32: ``DiagHessian`` (backprism) and autograd's double
backward, both run on the model in float32, against the Hessian diagonal of the same weights in
float64 (autograd's double backward, the math attention kernel).

    python benchmarks/bench_precision.py                  # eight HF decoders
    python benchmarks/bench_precision.py --models hf_gemma2 --show 8

Reported per model: the worst relative error ``max|d − d₆₄| / max|d₆₄|`` over the parameters
(each parameter against its own scale), for backprism and for autograd, and the parameters where
backprism is furthest off. Hugging Face models come from small random-init configs (hidden 16,
two layers, vocabulary 50, eager attention, ``N = 3`` sequences of 6 tokens); their own float32
round trips (RMSNorm, eager softmax) are left as shipped, in the float64 reference too (which
they leave about 1e-7 from exact). Not a test: a measurement to track.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(__file__))
from problems import importable_torchvision


class _Logits(nn.Module):
    """A Hugging Face classifier as ``ids → logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(input_ids=x).logits


#: model name → (config class, model class) in ``transformers``
MODELS = {
    "hf_gemma2": ("Gemma2Config", "Gemma2ForSequenceClassification"),
    "hf_qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification"),
    "hf_llama": ("LlamaConfig", "LlamaForSequenceClassification"),
    "hf_mistral": ("MistralConfig", "MistralForSequenceClassification"),
    "hf_phi3": ("Phi3Config", "Phi3ForSequenceClassification"),
    "hf_gemma": ("GemmaConfig", "GemmaForSequenceClassification"),
    "hf_qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification"),
    "hf_olmo2": ("Olmo2Config", "Olmo2ForSequenceClassification"),
}


def _hf(kind: str) -> tuple[nn.Module, Tensor, Tensor]:
    importable_torchvision()
    import transformers as tf

    common = dict(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_labels=3, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
        attn_implementation="eager",
    )
    config, model = (getattr(tf, c) for c in MODELS[kind])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = _Logits(model(config(**common))).eval()
    x = torch.randint(1, 50, (3, 6))
    return net, x, torch.randint(0, 3, (3,))


def _hessian_diagonal(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Autograd's Hessian diagonal of the mean cross-entropy, one batched double backward per
    parameter (identity cotangents), through the math attention kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    with sdpa_kernel(SDPBackend.MATH):
        loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [p for _, p in named], create_graph=True, allow_unused=True)
    out = {}
    for (k, p), g in zip(named, grads):
        if g is None:
            out[k] = torch.zeros_like(p)
            continue
        n = p.numel()
        eye = torch.eye(n, dtype=p.dtype).view(n, *p.shape)
        (h,) = torch.autograd.grad(g, p, eye, retain_graph=True, is_grads_batched=True)
        out[k] = h.reshape(n, n).diagonal().view_as(p)
    return out


def _relative(a: Tensor, b: Tensor) -> float:
    scale = float(b.abs().max())
    return float((a.double() - b).abs().max()) / scale if scale > 0 else float(a.abs().max())


def measure(name: str, show: int) -> None:
    from backprism import collect, extend
    from backprism.extensions import DiagHessian

    torch.manual_seed(0)
    model, x, y = _hf(name)
    truth = _hessian_diagonal(copy.deepcopy(model).double(), x, y)
    x32 = x
    auto = _hessian_diagonal(copy.deepcopy(model).float(), x32, y)
    ours = extend(copy.deepcopy(model).float())
    lossfunc = extend(nn.CrossEntropyLoss())
    for _ in range(2):  # (a first forward outside collect may be refused: see the guide)
        try:
            with collect(DiagHessian()):
                lossfunc(ours(x32), y).backward()
            break
        except RuntimeError as err:
            failure = err
    else:
        print(f"{name:14s} refused: {str(failure).splitlines()[0][:100]}")
        return
    found = {k: p.diag_h for k, p in ours.named_parameters() if p.requires_grad}
    errors = [(_relative(found[k], t), _relative(auto[k], t), k) for k, t in truth.items()]
    rows = sorted(errors, reverse=True)
    print(
        f"{name:14s} worst relative error: backprism {rows[0][0]:.1e}   autograd (float32) "
        f"{max(r[1] for r in rows):.1e}   ({len(rows)} parameters)"
    )
    for ours_err, auto_err, k in rows[:show]:
        print(f"    {k:60s} {ours_err:.1e}  {auto_err:.1e}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", nargs="+", choices=MODELS, default=list(MODELS)
    )
    ap.add_argument("--show", type=int, default=3, help="worst parameters listed per model")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    for name in args.models:
        measure(name, args.show)


if __name__ == "__main__":
    main()
