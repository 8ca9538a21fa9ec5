"""Benchmark problems (DESIGN.md §7): DeepOBS architectures and modern blocks, random data.

Every builder returns ``(model, lossfunc, X, y)`` with ``N`` samples on the CPU; nothing is
extended here. ``build(name, n, device)`` builds one and moves it to ``device`` (built on the
CPU first, so every device gets the same weights and data for a seed). The device helpers
shared by the benchmark scripts (``sync``, ``describe``) live here too; peak memory and the
markdown output are in ``measure.py``.

Importing this module makes ``backprism`` importable from the checkout (``../src``) when it is
not installed (the same as running with ``PYTHONPATH=src``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
if importlib.util.find_spec("backprism") is None and os.path.isdir(_SRC):
    sys.path.insert(0, _SRC)


def mnist_mlp(n: int = 128):
    """Flatten, 784-1000-500-100-10 with ReLU (1,336,610 parameters)."""
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 1000),
        nn.ReLU(),
        nn.Linear(1000, 500),
        nn.ReLU(),
        nn.Linear(500, 100),
        nn.ReLU(),
        nn.Linear(100, 10),
    )
    return model, nn.CrossEntropyLoss(), torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))


def cifar10_3c3d(n: int = 128, classes: int = 10):
    """3 conv + 3 dense layers (895,210 parameters), input 3×32×32."""
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(64, 96, 3),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Flatten(),
        nn.Linear(1152, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, classes),
    )
    X, y = torch.randn(n, 3, 32, 32), torch.randint(0, classes, (n,))
    return model, nn.CrossEntropyLoss(), X, y


def mnist_2c2d(n: int = 128):
    """2 conv + 2 dense layers (3,274,634 parameters), input 1×28×28."""
    model = nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3136, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )
    return model, nn.CrossEntropyLoss(), torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))


def cifar100_allcnnc(n: int = 128):
    """All-CNN-C (DeepOBS), C = 100, input 3×32×32, dropout removed (per-sample work); the
    global average is DeepOBS's 6×6 ``AvgPool2d``, which BackPACK/ViViT support (unlike
    ``AdaptiveAvgPool2d``)."""
    model = nn.Sequential(
        nn.Conv2d(3, 96, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(96, 96, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(96, 96, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(96, 192, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(192, 192, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(192, 192, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(192, 192, 3),
        nn.ReLU(),
        nn.Conv2d(192, 192, 1),
        nn.ReLU(),
        nn.Conv2d(192, 100, 1),
        nn.ReLU(),
        nn.AvgPool2d(6),
        nn.Flatten(),
    )
    return model, nn.CrossEntropyLoss(), torch.randn(n, 3, 32, 32), torch.randint(0, 100, (n,))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


def resnet18(n: int = 128, width: int = 16):
    """ResNet-18-style CNN for 32×32 inputs (8 basic blocks; BatchNorm in eval mode, since
    per-sample quantities are undefined with batch statistics)."""
    w = width
    layers: list[nn.Module] = [nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
    cin = w
    for cout, stride in (
        (w, 1),
        (w, 1),
        (2 * w, 2),
        (2 * w, 1),
        (4 * w, 2),
        (4 * w, 1),
        (8 * w, 2),
        (8 * w, 1),
    ):
        layers.append(_BasicBlock(cin, cout, stride))
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    model = nn.Sequential(*layers).eval()
    return model, nn.CrossEntropyLoss(), torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))


class _TinyTransformer(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int, classes: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        n, t = tokens.shape
        # positions carry the batch axis, so per-sample quantities are defined for self.pos
        h = self.emb(tokens) + self.pos(torch.arange(t, device=tokens.device).expand(n, t))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))


def transformer(n: int = 128, seq: int = 32, vocab: int = 1000, d: int = 64):
    """Small transformer encoder classifier (2 layers, 4 heads, d = 64, T = 32)."""
    model = _TinyTransformer(vocab, d, 4, 2, seq, 10)
    return (
        model,
        nn.CrossEntropyLoss(),
        torch.randint(0, vocab, (n, seq)),
        torch.randint(0, 10, (n,)),
    )


class _Decoder(nn.Module):
    """GPT-style decoder: token + position embeddings, causal pre-norm blocks, tied head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.02)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        n, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).expand(n, t)
        h = self.emb(tokens) + self.pos(pos)
        for block in self.blocks:
            h = block(h, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h)).transpose(1, 2)  # [N, C, T] for CrossEntropyLoss


def gpt_decoder(n: int = 128, seq: int = 32, vocab: int = 2048, d: int = 64):
    """Small GPT-style decoder (2 layers, 4 heads, d = 64, T = 32) with a 2048-token vocabulary
    and tied input/output embeddings; next-token targets."""
    model = _Decoder(vocab, d, 4, 2, seq)
    return (
        model,
        nn.CrossEntropyLoss(),
        torch.randint(0, vocab, (n, seq)),
        torch.randint(0, vocab, (n, seq)),
    )


def importable_torchvision() -> None:
    """Make ``timm`` and ``transformers`` importable beside the CPU torch wheel: pip installs
    torchvision's CUDA build with them, whose ``_meta_registrations`` fails at import
    (``operator torchvision::nms does not exist``: the detection ops' C extension did not
    load). No model here uses those ops, so an empty stand-in replaces that module (as in
    ``tests/conftest.py``)."""
    import types

    try:
        import torchvision  # noqa: F401
    except RuntimeError:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        stub = "torchvision._meta_registrations"
        sys.modules[stub] = types.ModuleType(stub)
    except ImportError:
        pass


def import_transformers():
    """``import transformers`` (quiet, :func:`importable_torchvision` first)."""
    import logging

    importable_torchvision()
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


class _Logits(nn.Module):
    """A Hugging Face model's ``.logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(idx).logits


def _hf(kind: str, n: int, seq: int = 64, vocab: int = 1000, d: int = 128, layers: int = 4):
    """A Hugging Face sequence classifier from a small config with random weights (3 classes,
    ``layers`` layers, 4 heads, width ``d``, MLP ``2d``), dropout off, on ``[N, seq]`` tokens."""
    import warnings

    tf = import_transformers()
    common = {"vocab_size": vocab, "num_labels": 3}
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            n_layer=layers, n_head=4, n_embd=d, n_positions=seq, pad_token_id=0, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common,
        )
        make = tf.GPT2ForSequenceClassification
    elif kind == "bert":
        cfg = tf.BertConfig(
            num_hidden_layers=layers, num_attention_heads=4, hidden_size=d,
            intermediate_size=2 * d, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            **common,
        )
        make = tf.BertForSequenceClassification
    else:
        cfg = tf.LlamaConfig(
            num_hidden_layers=layers, num_attention_heads=4, hidden_size=d,
            intermediate_size=2 * d, pad_token_id=0, **common,
        )
        make = tf.LlamaForSequenceClassification
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _Logits(make(cfg)).train()
    X = torch.randint(1, vocab, (n, seq))
    return model, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (n,))


def import_timm():
    """``import timm`` (:func:`importable_torchvision` first)."""
    importable_torchvision()
    import timm

    return timm


#: timm problem name → (timm model name, extra ``create_model`` arguments), 3×32×32 inputs
TIMM = {
    "timm_resnet18": ("resnet18", {}),
    "timm_convnext": ("convnext_atto", {}),
    "timm_vit": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 4}),
    "timm_swin": (
        "swin_tiny_patch4_window7_224",
        {"img_size": 32, "patch_size": 2, "window_size": 4, "depths": (2, 2),
         "num_heads": (2, 4), "embed_dim": 32},
    ),
    # attention with query/value biases of its own joined into qkv's bias, a bias table (BEiT:
    # the fused attention's mask), rotary embeddings (EVA), a position-bias MLP (Swin V2)
    "timm_beit": (
        "beit_base_patch16_224",
        {"img_size": 32, "patch_size": 4, "embed_dim": 192, "depth": 4, "num_heads": 3},
    ),
    "timm_eva": (
        "eva02_tiny_patch14_224",
        {"img_size": 32, "patch_size": 4, "embed_dim": 192, "depth": 4, "num_heads": 3},
    ),
    "timm_swinv2": (
        "swinv2_tiny_window8_256",
        {"img_size": 32, "patch_size": 2, "window_size": 4, "depths": (2, 2),
         "num_heads": (2, 4), "embed_dim": 32},
    ),
}


def timm_problem(name: str, n: int):
    """A timm model from :data:`TIMM` with random weights, 10 classes, in eval mode (dropout
    and drop-path off, BatchNorm on its running statistics), on ``[n, 3, 32, 32]``."""
    arch, kwargs = TIMM[name]
    model = import_timm().create_model(arch, pretrained=False, num_classes=10, **kwargs).eval()
    return model, nn.CrossEntropyLoss(), torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))


PROBLEMS: dict[str, Callable] = {
    "mnist_mlp": mnist_mlp,
    "cifar10_3c3d": cifar10_3c3d,
    "mnist_2c2d": mnist_2c2d,
    "resnet18": resnet18,
    "transformer": transformer,
    "cifar100_allcnnc": cifar100_allcnnc,
    "gpt_decoder": gpt_decoder,
    # Hugging Face models (``transformers`` installed; not in any default list)
    "hf_gpt2": lambda n: _hf("gpt2", n),
    "hf_bert": lambda n: _hf("bert", n),
    # small enough for the exact Hessian diagonal (T 16, d 32, 2 layers: ~10⁴ columns a sample)
    "hf_bert_small": lambda n: _hf("bert", n, seq=16, d=32, layers=2),
    "hf_llama": lambda n: _hf("llama", n),
    # timm models (``timm`` installed; not in any default list)
    **{name: (lambda n, name=name: timm_problem(name, n)) for name in TIMM},
}


def build(name: str, n: int, device: str | torch.device = "cpu"):
    """``PROBLEMS[name](n)`` with model, loss, ``X`` and ``y`` moved to ``device``."""
    model, lossfunc, X, y = PROBLEMS[name](n)
    device = torch.device(device)
    if device.type == "cpu":
        return model, lossfunc, X, y
    return model.to(device), lossfunc.to(device), X.to(device), y.to(device)


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued kernels (CUDA; a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: str | torch.device) -> str:
    """``device=cuda (NVIDIA H100 ...), torch 2.x`` or ``device=cpu, threads=2, torch 2.x``."""
    device = torch.device(device)
    if device.type == "cuda":
        what = f"device={device} ({torch.cuda.get_device_name(device)})"
    else:
        what = f"device={device}, threads={torch.get_num_threads()}"
    return f"{what}, torch {torch.__version__}"
