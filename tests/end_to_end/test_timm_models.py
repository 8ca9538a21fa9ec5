"""timm models built from small random-init configs (no downloads), float64, ``N = 3``, called as
their documentation shows (``model(x)`` → logits): a ResNet (BatchNorm, residual 1×1-conv
downsampling, max-pool), a MobileNetV3 (depthwise convolutions, squeeze-and-excitation with
hard-sigmoid gates, hard-swish), a ConvNeXt (depthwise 7×7 convs, timm's ``LayerNorm2d`` and
channels-last ``LayerNorm``, the layer-scale ``gamma`` used directly in ``ConvNeXtBlock.forward``)
and ViTs (``cls_token`` and ``pos_embed`` used directly in ``VisionTransformer``'s forward; one
with ``LayerScale``, one without class token and with average pooling).

References are dense float64 ones from the definitions (``tests/reference.py``, torch.func /
autograd, never backprism): per-sample gradients (``per_sample_grads``), GGN diagonals
(``batch_diag_ggn_loop``: ``Jₙᵀ (∂²L/∂fₙ²) Jₙ`` per sample — ``diag_ggn`` builds the dense
``[N, N, P, P]`` GGN, 1.3 GB for the ConvNeXt), the exact Hessian diagonal (Hessian-vector
products with the basis vectors, :func:`hessian_diagonal`), the Kronecker input factors from the
layers' (unfolded) inputs, and the whole-batch GGN of the ResNet in train mode.

The ResNet uses timm's deep stem (``stem_type="deep", stem_width=2``): the default stem is a
64-channel 7×7 convolution whatever ``channels`` says (9408 of 15781 parameters), which makes the
dense Hessian diagonal take ~50 s. Norm scales, biases, layer scales, ``cls_token``,
``pos_embed`` and BatchNorm's running statistics are drawn away from their initial values (timm
zero-initialises the last BatchNorm of each ResNet block and sets ``gamma`` to 1e-6).

Skipped where timm cannot be imported (``tests/conftest.py`` repairs the usual torchvision
import failure of a CPU torch beside a CUDA torchvision build first).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from backprism import collect, extend
from backprism.engine.rule import get_rule
from backprism.extensions import (
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SumGradSquared,
    Variance,
)
from backprism.rules.generic import GenericRule

try:
    timm = pytest.importorskip("timm")
except RuntimeError as err:  # a torchvision import that conftest could not repair
    pytest.skip(f"timm cannot be imported: {err}", allow_module_level=True)

from timm.models.convnext import ConvNeXt
from timm.models.resnet import BasicBlock, ResNet
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer

from tests.common import assert_first_order
from tests.reference import (
    batch_diag_ggn_loop,
    per_sample_grads,
    per_sample_grads_loop,
    per_sample_grads_rows,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
    pytest.mark.filterwarnings("ignore:backprism. no closed-form rule"),
]

DT = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-10}
N = 3
C = 5


def resnet() -> tuple[nn.Module, tuple[int, ...]]:
    model = ResNet(
        BasicBlock, [1, 1, 1, 1], channels=(4, 8, 8, 8), num_classes=C, stem_type="deep",
        stem_width=2,
    )
    return model, (3, 16, 16)


def convnext() -> tuple[nn.Module, tuple[int, ...]]:
    return ConvNeXt(depths=(1, 1, 1, 1), dims=(4, 8, 8, 8), num_classes=C), (3, 32, 32)


def convnextv2() -> tuple[nn.Module, tuple[int, ...]]:
    """ConvNeXt V2: global response norm, ``x · (‖x‖ₛ / mean_c ‖x‖ₛ)`` with the norm over the
    two spatial axes of ``[N, H, W, C]``."""
    return ConvNeXt(
        depths=(1, 1, 1, 1), dims=(4, 8, 8, 8), num_classes=C, use_grn=True, ls_init_value=None
    ), (3, 32, 32)


def _vit(**kw: Any) -> tuple[nn.Module, tuple[int, ...]]:
    model = VisionTransformer(
        img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2, num_classes=C, **kw
    )
    return model, (3, 8, 8)


def mobilenet() -> tuple[nn.Module, tuple[int, ...]]:
    """MobileNetV3: depthwise convolutions, squeeze-and-excitation, hard-swish."""
    return timm.create_model("mobilenetv3_small_050", num_classes=C), (3, 32, 32)


def swin() -> tuple[nn.Module, tuple[int, ...]]:
    """Swin: attention in windows (the batch folded with the windows, ``[N·windows, ws², C]``),
    shifted windows with their attention mask, a relative position bias table, patch
    merging."""
    model = SwinTransformer(
        img_size=16, patch_size=2, window_size=4, embed_dim=4, depths=(2, 1), num_heads=(1, 2),
        num_classes=C,
    )
    return model, (3, 16, 16)


def swinv2() -> tuple[nn.Module, tuple[int, ...]]:
    """Swin V2: cosine attention with a learned logit scale, the relative position bias an MLP
    (``cpb_mlp``, in-place ReLU) on a constant coordinate table shared by all samples and
    widened over the windows where it meets their scores, query/value biases concatenated
    with a constant key bias."""
    model = timm.create_model(
        "swinv2_tiny_window8_256", img_size=16, patch_size=2, window_size=4, embed_dim=4,
        depths=(2, 1), num_heads=(1, 2), num_classes=C,
    )
    return model, (3, 16, 16)


def beit() -> tuple[nn.Module, tuple[int, ...]]:
    """BEiT: query and value biases joined with a constant key bias as the ``qkv`` layer's
    bias (``F.linear(x, self.qkv.weight, torch.cat(...))``), a relative position bias table
    indexed by a buffer (SDPA's mask in the fused attention), layer scale."""
    model = timm.create_model(
        "beit_base_patch16_224", img_size=32, patch_size=16, embed_dim=8, depth=1,
        num_heads=2, mlp_ratio=2.0, init_values=0.5, num_classes=C,
    )
    return model, (3, 32, 32)


def eva() -> tuple[nn.Module, tuple[int, ...]]:
    """EVA-02: joined query/value biases, rotary position embeddings, SwiGLU, layer scale."""
    model = timm.create_model(
        "eva02_tiny_patch14_224", img_size=28, patch_size=14, embed_dim=8, depth=1,
        num_heads=2, init_values=0.5, num_classes=C,
    )
    return model, (3, 28, 28)


MODELS = {
    "resnet": resnet,
    "swin": swin,
    "swinv2": swinv2,
    "beit": beit,
    "eva": eva,
    "mobilenet": mobilenet,
    "convnext": convnext,
    "convnextv2": convnextv2,
    "vit": _vit,
    "vit_layerscale": lambda: _vit(init_values=1e-1),
    "vit_avgpool": lambda: _vit(class_token=False, global_pool="avg"),
}
VITS = ["vit", "vit_layerscale", "vit_avgpool"]
#: models whose per-sample reference is a loop: Swin's masked window attention reshapes with
#: -1 over the windows, and BEiT's fused attention takes a mask that needs a gradient, which
#: torch.func's vmap cannot
LOOP_REFERENCE = {"swin", "swinv2", "beit"}


def _nontrivial(model: nn.Module) -> None:
    """Norm scales and layer scales in ``[0.5, 1.5]``, biases in ``[-0.5, 0.5]``, ``cls_token``
    and ``pos_embed`` ``~ N(0, 0.5²)``, BatchNorm running statistics away from ``(0, 1)``."""
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.running_mean.normal_(0.0, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim == 1 and leaf in ("weight", "gamma"):
                p.uniform_(0.5, 1.5)
            elif leaf == "bias":
                p.uniform_(-0.5, 0.5)
            elif leaf in ("cls_token", "pos_embed"):
                p.normal_(0.0, 0.5)


def setup(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    """``model`` (float64, eval mode), inputs ``x`` and labels ``y``."""
    torch.manual_seed(0)
    model, shape = MODELS[name]()
    model = model.to(DT).eval()
    _nontrivial(model)
    return model, torch.randn(N, *shape, dtype=DT), torch.randint(0, C, (N,))


def _run(model: nn.Module, x: Tensor, y: Tensor, *exts: Any) -> None:
    """``extend`` the model and a cross-entropy loss; one forward and backward in ``collect``."""
    lossfunc = extend(nn.CrossEntropyLoss())
    extend(model)
    with collect(*exts):
        lossfunc(model(x), y).backward()


# ------------------------------------------------------------------------------------ references
def diag_ggn_reference(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``{name: [N, *p]}`` per-sample GGN diagonals (their sum is the GGN diagonal)."""
    return batch_diag_ggn_loop(model, nn.CrossEntropyLoss(), x, y)


def hessian_diagonal(model: nn.Module, x: Tensor, y: Tensor, chunk: int = 512) -> dict[str, Tensor]:
    """``{name: p-shaped}`` diagonal of the exact Hessian of the mini-batch loss w.r.t. all
    parameters: ``Hᵢᵢ = eᵢᵀ H eᵢ`` from forward-over-reverse Hessian-vector products
    ``jvp(grad L, eᵢ)`` over the flattened parameters, ``vmap``-ped over chunks of basis
    vectors. Attention runs on SDPA's math kernel (the fused CPU kernel has no forward-mode
    derivative)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    names = list(params)
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    flat = torch.cat([params[k].reshape(-1) for k in names])
    buffers = dict(model.named_buffers())
    lossfunc = nn.CrossEntropyLoss()

    def loss(theta: Tensor) -> Tensor:
        p = {k: t.reshape(s) for k, t, s in zip(names, torch.split(theta, sizes), shapes)}
        return lossfunc(functional_call(model, {**p, **buffers}, (x,)), y)

    def hvp(v: Tensor) -> Tensor:
        return jvp(grad(loss), (flat,), (v,))[1]

    out = []
    with sdpa_kernel(SDPBackend.MATH):
        for start in range(0, flat.numel(), chunk):
            idx = torch.arange(start, min(start + chunk, flat.numel()))
            basis = torch.zeros(len(idx), flat.numel(), dtype=DT)
            basis[torch.arange(len(idx)), idx] = 1.0
            out.append(vmap(hvp)(basis)[torch.arange(len(idx)), idx])
    diag = torch.cat(out)
    return {k: t.reshape(s) for k, t, s in zip(names, torch.split(diag, sizes), shapes)}


def whole_batch_diag_ggn(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``{name: p-shaped}`` diagonal of ``Jᵀ (∇²_f L) J`` with ``J`` the Jacobian of the whole
    batch's outputs in train mode (BatchNorm with batch statistics; on a copy whose running
    statistics are removed so that nothing is updated)."""
    ref = copy.deepcopy(model).train()
    for m in ref.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    params = {k: p.detach() for k, p in ref.named_parameters()}

    def f(p: dict[str, Tensor]) -> Tensor:
        return functional_call(ref, p, (x,))

    out = f(params)
    H = torch.func.hessian(lambda o: nn.CrossEntropyLoss()(o, y))(out)
    H = H.reshape(out.numel(), out.numel())
    jac = jacrev(f)(params)
    result = {}
    for k, p in params.items():
        J = jac[k].reshape(out.numel(), -1)
        result[k] = torch.einsum("op,oq,qp->p", J, H, J).reshape(p.shape)
    return result


def kronecker_layout(model: nn.Module) -> dict[str, tuple[nn.Module, str, list[tuple[int, ...]]]]:
    """``{name: (module, kind, factor shapes)}``: ``kind`` is ``"weight"`` for Conv/Linear
    weights (``[B, A]``, with a leading group axis for grouped convolutions:
    ``[(G, O/G, O/G), (G, I/G·k, I/G·k)]``), ``"bias"`` for their biases (``[B]``, the exact
    GGN block for KFLR) and ``"diagonal"`` for every other parameter (the single factor
    ``[diag(GGN diagonal)]``, ``[P, P]``)."""
    out = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            key = f"{mod_name}.{pname}" if mod_name else pname
            layer = isinstance(mod, (nn.Linear, nn.Conv2d))
            if layer and pname == "weight":
                o, i, g = p.shape[0], p[0].numel(), getattr(mod, "groups", 1)
                shapes = [(o, o), (i, i)] if g == 1 else [(g, o // g, o // g), (g, i, i)]
                out[key] = (mod, "weight", shapes)
            else:
                kind = "bias" if layer else "diagonal"
                out[key] = (mod, kind, [(p.numel(), p.numel())])
    return out


def input_factors(model: nn.Module, x: Tensor) -> dict[nn.Module, Tensor]:
    """The Kronecker input factors ``A = (1/N) Σₙ Σₜ uₙₜ uₙₜᵀ`` of every Conv/Linear layer from
    its inputs in a plain forward (``u``: the unfolded patch of one output position of a
    group for a convolution, the feature vector of one position for a Linear layer). A layer
    on a table shared by all samples (input batch 1: Swin V2's position-bias MLP on its
    coordinate table) is used once per sample, however many rows of the batch (windows) the
    table then meets: its one input counts ``N`` times, ``A = Σₜ uₜ uₜᵀ``."""
    inputs: dict[nn.Module, Tensor] = {}

    def seen(m: nn.Module, args: tuple, out: Tensor) -> None:
        if args and isinstance(args[0], Tensor) and args[0].dim():
            inputs.setdefault(m, args[0].detach())

    hooks = [m.register_forward_hook(seen) for m in model.modules()]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    parent = {c: m for m in model.modules() for c in m.children()}
    for m in model.modules():
        if isinstance(m, nn.Linear) and m not in inputs:
            # (timm's attention runs F.linear(x, self.qkv.weight, bias) on its own input)
            inputs[m] = inputs[parent[m]]
    inputs = {m: t for m, t in inputs.items() if isinstance(m, (nn.Linear, nn.Conv2d))}
    out = {}
    for m, inp in inputs.items():
        uses = N if inp.shape[0] == 1 else 1  # (a shared table: one copy per sample)
        if isinstance(m, nn.Linear):
            u = inp.reshape(-1, inp.shape[-1])
            out[m] = uses * u.T @ u / N
        else:
            assert isinstance(m.padding, tuple) and m.padding_mode == "zeros"
            cols = F.unfold(inp, m.kernel_size, m.dilation, m.padding, m.stride)  # [N, I·k, T]
            cols = cols.reshape(N, m.groups, -1, cols.shape[-1])  # [N, G, I/G·k, T]
            A = torch.einsum("ngit,ngjt->gij", cols, cols) / N
            out[m] = A[0] if m.groups == 1 else A
    return out


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", list(MODELS))
def test_first_order(name: str) -> None:
    """BatchGrad, BatchL2Grad, SumGradSquared, Variance and ``Σₙ grad_batch = .grad``."""
    model, x, y = setup(name)
    reference = per_sample_grads_loop if name in LOOP_REFERENCE else per_sample_grads
    ref = reference(model, nn.CrossEntropyLoss(), x, y)
    _run(model, x, y, BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    assert_first_order(model, ref, **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_diag_ggn_exact(name: str) -> None:
    model, x, y = setup(name)
    ref = diag_ggn_reference(model, x, y)
    _run(model, x, y, DiagGGNExact(), BatchDiagGGNExact())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[k].sum(0), **TOL, msg=k)
        torch.testing.assert_close(p.diag_ggn_exact_batch, ref[k], **TOL, msg=k)


def maxvit() -> tuple[nn.Module, tuple[int, ...]]:
    """MaxViT: MBConv, then attention in blocks and in a dilated grid (the batch folded with
    both), relative position bias tables."""
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitConvCfg, MaxxVitTransformerCfg

    cfg = MaxxVitCfg(
        embed_dim=(8, 16), depths=(1, 1), block_type=("M", "M"), stem_width=8,
        conv_cfg=MaxxVitConvCfg(),
        transformer_cfg=MaxxVitTransformerCfg(dim_head=4, window_size=(4, 4), grid_size=(4, 4)),
    )
    return MaxxVit(cfg, img_size=32, num_classes=C), (3, 32, 32)


def mobilevit() -> tuple[nn.Module, tuple[int, ...]]:
    """MobileViT (``mobilevit_xxs``): transformers on the pixels of its patches (the batch
    folded with the pixel positions, ``[N·4, patches, C]``), the 1×1 map of the last stage
    interpolated to the patch size first."""
    return timm.create_model("mobilevit_xxs", num_classes=C), (3, 32, 32)


@pytest.mark.parametrize("make", [maxvit, mobilevit], ids=["maxvit", "mobilevit"])
def test_models_on_folded_patches(make: Any) -> None:
    """First order and the exact GGN diagonal (per sample too) against loop references."""
    torch.manual_seed(0)
    model, shape = make()
    model = model.to(DT).eval()
    _nontrivial(model)
    x, y = torch.randn(N, *shape, dtype=DT), torch.randint(0, C, (N,))
    ref = per_sample_grads_loop(model, nn.CrossEntropyLoss(), x, y)
    diag = diag_ggn_reference(model, x, y)
    _run(model, x, y, BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    assert_first_order(model, ref, **TOL)
    _run(model, x, y, DiagGGNExact(), BatchDiagGGNExact())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact_batch, diag[k], **TOL, msg=k)


def test_diag_hessian_resnet() -> None:
    model, x, y = setup("resnet")
    ref = hessian_diagonal(model, x, y)
    _run(model, x, y, DiagHessian())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], **TOL, msg=k)


def test_diag_hessian_convnext() -> None:
    """ConvNeXt: its LayerNorms (timm's ``LayerNorm2d`` too) act on rows of channels, so their
    Hessian terms are row blocks (``engine.residual.RowSite``); the layer scale's products
    have operands of different parameters. DiagHessian is exact, also through a later forward
    outside ``collect`` (the forward mode stays on to record the norms)."""
    from backprism.engine.state import MODE_FREE

    model, x, y = setup("convnext")
    ref = hessian_diagonal(model, x, y)
    _run(model, x, y, DiagHessian())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], **TOL, msg=k)
        del p.diag_h
    lossfunc = extend(nn.CrossEntropyLoss())
    lossfunc(model(x), y).backward()  # recorded, outside collect
    assert MODE_FREE[model][model.training] is None
    model.zero_grad()
    loss = lossfunc(model(x), y)
    with collect(DiagHessian()):
        loss.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], **TOL, msg=k)


def test_diag_hessian_convnextv2() -> None:
    """ConvNeXt V2's global response norm divides the spatial norms ``‖x‖ₛ`` (a reduction
    over two axes, ``residual.ReductionSite``) by their channel mean (``DivisionSite``) and
    multiplies ``x`` by the result (a product whose operands share parameters): refused before
    reductions and divisions had their terms; DiagHessian equals the exact diagonal."""
    model, x, y = setup("convnextv2")
    ref = hessian_diagonal(model, x, y)
    _run(model, x, y, DiagHessian())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], **TOL, msg=k)


@pytest.mark.parametrize(
    ("name", "fused"),
    [("swin", False), ("beit", True), ("beit", False), ("eva", True), ("eva", False)],
    ids=["swin-eager", "beit-fused", "beit-eager", "eva-fused", "eva-eager"],
)
def test_diag_hessian_attention_with_parameters_of_its_own(name: str, fused: bool) -> None:
    """timm attention modules that use parameters of their own beside their ``qkv`` and
    ``proj`` layers: Swin's bias table indexed by a view of its index buffer, BEiT's, EVA's and
    Swin V2's query and value biases joined with a constant key bias as ``qkv``'s bias
    (``F.linear(x, self.qkv.weight, torch.cat(...))``), BEiT's table as the fused attention's
    mask, EVA's rotary embeddings. Each use is attributed where it enters (they made the whole
    attention module take the generic rule, whose parameters the DiagHessian family refused):
    DiagHessian equals the exact Hessian diagonal, with the fused kernel or eager. (Swin V2:
    :func:`test_diag_hessian_swinv2_refused`.)"""
    model, x, y = setup(name)
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
    ref = hessian_diagonal(model, x, y)
    _run(model, x, y, DiagHessian())
    scale = max(float(t.abs().max()) for t in ref.values())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], rtol=1e-8, atol=1e-10 * scale, msg=k)


def test_diag_hessian_swinv2_refused() -> None:
    """Swin V2 scales its cosine attention by ``exp(clamp(logit_scale))``, a parameter entering
    nonlinearly where it meets the samples, whose own Hessian term the column construction
    does not build: refused before anything is written, naming the use."""
    from backprism.engine.residual import NonlinearityError

    model, x, y = setup("swinv2")
    with pytest.raises(NonlinearityError, match=r"'mul' .*enter its output nonlinearly"):
        _run(model, x, y, DiagHessian())
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("name", VITS)
def test_diag_hessian_vit(name: str, fused: bool) -> None:
    """A ViT's attention on hidden features, through the fused SDPA kernel
    (``engine.attention``) or timm's eager ``q @ kᵀ``, softmax, ``@ v``
    (``engine.bilinear``), its LayerNorms, GELU, layer scale, class token and position
    embedding: DiagHessian equals the exact Hessian diagonal."""
    model, x, y = setup(name)
    for block in model.blocks:
        block.attn.fused_attn = fused
    ref = hessian_diagonal(model, x, y)
    _run(model, x, y, DiagHessian())
    scale = max(float(t.abs().max()) for t in ref.values())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], rtol=1e-8, atol=1e-10 * scale, msg=k)


@pytest.mark.parametrize(
    "name", ["convnext", "vit", "vit_avgpool", "mobilenet", "swin", "swinv2", "beit", "eva"]
)
def test_no_generic_rule_for_convnext_and_vit(name: str, monkeypatch) -> None:
    """ConvNeXt's ``LayerNorm2d`` (an overriding ``nn.LayerNorm`` subclass), MobileNetV3's
    ``BatchNormAct2d`` (an overriding ``nn.BatchNorm2d`` subclass, in eval mode) and the
    parameters the ConvNeXt blocks, the ViT and Swin's window attention use directly
    (``gamma``, ``cls_token``, ``pos_embed``, the bias table indexed by a view of a buffer)
    are attributed where they enter, in closed form: no generic-rule warning (shown once per
    type and process, so the record of earlier warnings is emptied first)."""
    from backprism.rules import generic

    monkeypatch.setattr(generic, "_ANNOUNCED", set())
    GenericRuleWarning = generic.GenericRuleWarning
    model, x, y = setup(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenericRuleWarning)
        _run(model, x, y, BatchL2Grad())


@pytest.mark.parametrize("ext", [KFLR, KFAC])
@pytest.mark.parametrize("name", list(MODELS))
def test_kronecker(name: str, ext: type) -> None:
    """Every Conv/Linear weight has ``[B, A]`` (per-group factors with a leading group axis for
    the depthwise convolutions) with ``A`` from its inputs; biases and elementwise parameters
    (norm scales and shifts, ``gamma``, ``cls_token``, ``pos_embed``) the single-factor form.
    KFLR: ``diag B`` of a layer (of its weight and bias alike) is the GGN diagonal of its bias,
    and the single factor of a parameter without Kronecker structure is ``diag(GGN diagonal)``."""
    model, x, y = setup(name)
    ggn = {k: v.sum(0) for k, v in diag_ggn_reference(model, x, y).items()}
    inputs = input_factors(model, x)
    layout = kronecker_layout(model)
    torch.manual_seed(1)
    _run(model, x, y, ext())
    field = ext().savefield
    biases = {id(m): k for k, (m, kind, _) in layout.items() if kind == "bias"}
    for k, p in model.named_parameters():
        module, kind, shapes = layout[k]
        factors = getattr(p, field)
        assert [tuple(f.shape) for f in factors] == shapes, k
        if kind == "weight":
            torch.testing.assert_close(factors[1], inputs[module], **TOL, msg=k)
        if ext is not KFLR:
            continue
        if kind == "diagonal":
            torch.testing.assert_close(factors[0], torch.diag(ggn[k].reshape(-1)), **TOL, msg=k)
        elif id(module) in biases:  # the bias's [B] is its exact GGN block; a weight shares B
            diag_b = torch.diagonal(factors[0], dim1=-2, dim2=-1).reshape(-1)
            torch.testing.assert_close(diag_b, ggn[biases[id(module)]], **TOL, msg=k)


def test_resnet_train_mode_whole_batch() -> None:
    """BatchNorm with batch statistics: ``DiagGGNExact`` is the diagonal of the whole batch's
    GGN; per-sample quantities are refused with a clear error before anything is written."""
    model, x, y = setup("resnet")
    model.train()
    ref = whole_batch_diag_ggn(model, x, y)
    _run(model, x, y, DiagGGNExact())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], **TOL, msg=k)
    model.zero_grad(set_to_none=True)
    for ext in (BatchGrad, Variance, BatchDiagGGNExact):
        with pytest.raises(RuntimeError, match=r"train mode mixes the samples.*model\.eval\(\)"):
            _run(model, x, y, ext())
        for p in model.parameters():
            assert p.grad is None and not hasattr(p, ext().savefield)


def test_mobilenet_train_mode_refused_before_writing() -> None:
    """MobileNetV3's ``BatchNormAct2d`` in train mode normalises with the batch's statistics:
    per-sample quantities are refused before anything is written."""
    model, x, y = setup("mobilenet")
    model.train()
    with pytest.raises(RuntimeError, match=r"train mode mixes the samples.*model\.eval\(\)"):
        _run(model, x, y, BatchL2Grad())
    for p in model.parameters():
        assert p.grad is None and not hasattr(p, "batch_l2")


def test_resnet_uses_closed_form_rules_only() -> None:
    """Every layer of the ResNet (Conv2d, BatchNorm2d, Linear) has a closed-form rule: no
    warning about the generic ``torch.func`` rule."""
    model, x, y = setup("resnet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(model, x, y, BatchL2Grad())
    generic = [str(w.message) for w in caught if "generic torch.func rule" in str(w.message)]
    assert not generic, generic
    # the warning is shown once per module type and process: the rules themselves, too
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    assert not [type(m).__name__ for m in owners if type(get_rule(m)) is GenericRule]


@pytest.mark.parametrize("name", [m for m in MODELS if m != "swinv2"])
def test_forwards_without_the_mode(name: str) -> None:
    """After one recorded forward, every model here runs its forwards outside ``collect``
    without the forward mode (``engine.functional``), the ViTs included: their roots'
    ``cls_token``/``pos_embed``, the blocks' layer scale ``gamma`` and timm's norm subclasses
    are attributed by a mode entered for those modules' own forward bodies only. A backward
    through such a forward gives the references' first order and GGN diagonal. (A model that
    used the DiagHessian family keeps the mode to record its norms and attention:
    :func:`test_diag_hessian_convnext`; so does Swin V2, whose shared position-bias MLP is
    widened over the samples by the mode.)"""
    from backprism.engine.state import MODE_FREE

    model, x, y = setup(name)
    reference = per_sample_grads_loop if name in LOOP_REFERENCE else per_sample_grads
    ref = reference(model, nn.CrossEntropyLoss(), x, y)
    ggn = diag_ggn_reference(model, x, y)
    lossfunc = extend(nn.CrossEntropyLoss())
    extend(model)
    lossfunc(model(x), y).backward()  # recorded, outside collect
    assert MODE_FREE[model][model.training] is not None
    model.zero_grad()
    loss = lossfunc(model(x), y)  # without the mode
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact()):
        loss.backward()
    assert_first_order(model, ref, **TOL)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ggn[k].sum(0), **TOL, msg=k)


@pytest.mark.parametrize(
    "name",
    [
        # BatchNorm1d (eval) on the rows [N·T, C] of its Linear layers: variance over N
        "levit_128s",
        # an LSTM over image rows, [N·H, W, C]: its h_n holds the folded rows on axis 1
        "sequencer2d_s",
    ],
)
def test_models_on_rows_that_fold_the_samples(name: str) -> None:
    """First order of timm models whose layers run on the batch folded with another axis,
    against the gradients of the batch's rows (both failed before: LeViT's norms' variance was
    over the rows, Sequencer's LSTM stopped the generic rule)."""
    kw: dict[str, Any] = {
        "levit_128s": dict(
            img_size=32, embed_dim=(16, 24, 32), key_dim=8, num_heads=(2, 2, 2),
            depth=(1, 1, 1),
        ),
        "sequencer2d_s": dict(
            img_size=16, layers=(1, 1, 1, 1), patch_sizes=(4, 2, 1, 1),
            embed_dims=(8, 8, 8, 8), hidden_sizes=(4, 4, 4, 4),
        ),
    }[name]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=C, **kw).to(DT).eval()
    _nontrivial(model)
    size = kw["img_size"]
    x, y = torch.randn(N, 3, size, size, dtype=DT), torch.randint(0, C, (N,))
    ref = per_sample_grads_rows(model, x, y)
    for m in model.modules():  # (LeViT's attention caches its bias tables, graph included)
        if hasattr(m, "attention_bias_cache"):
            m.attention_bias_cache = {}
    _run(model, x, y, BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    assert_first_order(model, ref, **TOL)
