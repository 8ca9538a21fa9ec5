"""BackPACK's custom-module support (``ModuleExtension``, ``set_module_extension``) and
``backpack.custom_module`` through ``backprism.compat.backpack``; references from autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from backprism.compat.backpack import backpack, extend
from backprism.compat.backpack.custom_module.branching import Parallel, SumModule, _Branch
from backprism.compat.backpack.custom_module.graph_utils import (
    BackpackTracer,
    convert_module_to_backpack,
)
from backprism.compat.backpack.custom_module.pad import Pad
from backprism.compat.backpack.custom_module.permute import Permute
from backprism.compat.backpack.custom_module.reduce_tuple import ReduceTuple
from backprism.compat.backpack.custom_module.scale_module import ScaleModule
from backprism.compat.backpack.custom_module.slicing import Slicing
from backprism.compat.backpack.extensions import (
    KFLR,
    BatchGrad,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from backprism.compat.backpack.extensions.firstorder.base import FirstOrderModuleExtension
from backprism.compat.backpack.extensions.module_extension import ModuleExtension
from backprism.compat.backpack.extensions.secondorder.diag_ggn import DiagGGNExact
from tests.compat.compat_refs import ggn_columns
from tests.reference import per_sample_grads


class MyScale(nn.Module):
    """The custom module of BackPACK's custom-module example: ``input * weight``."""

    def __init__(self, weight: float = 2.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([weight], dtype=torch.double))

    def forward(self, input):
        return input * self.weight


class MyScaleBatchGrad(FirstOrderModuleExtension):
    def __init__(self):
        super().__init__(params=["weight"])
        self.seen = []

    def weight(self, ext, module, g_inp, g_out, bpQuantities):
        assert ext.get_subsampling() is None and bpQuantities is None
        self.seen.append((module.output.shape, module.input0.shape, g_out[0].shape))
        # g_inp is the gradient w.r.t. the input: g_out * weight
        torch.testing.assert_close(g_inp[0], g_out[0] * module.weight.detach())
        return torch.einsum("nd,nd->n", g_out[0], module.input0).unsqueeze(-1)


class MyScaleDiagGGN(ModuleExtension):
    def __init__(self):
        super().__init__(params=["weight"])

    def backpropagate(self, ext, module, grad_inp, grad_out, bpQuantities):
        return bpQuantities * module.weight

    def weight(self, ext, module, g_inp, g_out, bpQuantities):
        V_theta = torch.einsum("cnd,nd->cn", bpQuantities, module.input0)
        return torch.einsum("cn,cn->", V_theta, V_theta).unsqueeze(0)


def data(reduction: str = "sum"):
    torch.manual_seed(0)
    inputs = torch.randn(10, 4, dtype=torch.double)
    targets = torch.randint(0, 2, (10,))
    return inputs, targets, nn.CrossEntropyLoss(reduction=reduction)


def test_custom_module_example_first_order():
    inputs, targets, lossfunc = data()
    module = MyScale()
    ref = torch.stack([
        torch.autograd.grad(lossfunc(module(x), t), [module.weight])[0]
        for x, t in zip(inputs.split(1), targets.split(1))
    ])
    extension = BatchGrad()
    mext = MyScaleBatchGrad()
    extension.set_module_extension(MyScale, mext)
    module, lossfunc = extend(module), extend(lossfunc)
    with backpack(extension):
        lossfunc(module(inputs), targets).backward()
    torch.testing.assert_close(module.weight.grad_batch, ref)
    assert mext.seen == [((10, 4), (10, 4), (10, 4))]
    assert "output" not in module.__dict__ and "input0" not in module.__dict__


def test_custom_module_example_second_order():
    inputs, targets, lossfunc = data()
    module, lossfunc = extend(MyScale()), extend(lossfunc)
    ref = torch.diagonal(ggn_columns(module, lossfunc, inputs, targets, [0]))
    extension = DiagGGNExact()
    extension.set_module_extension(MyScale, MyScaleDiagGGN())
    with backpack(extension, chunk_size=1):  # chunks of columns are summed
        lossfunc(module(inputs), targets).backward()
    torch.testing.assert_close(module.weight.diag_ggn_exact, ref)


class Affine(nn.Module):
    """Two parameters; a module extension covers only ``weight``, ``bias`` falls back."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, dtype=torch.double))
        self.bias = nn.Parameter(torch.randn(4, dtype=torch.double))

    def forward(self, x):
        return x * self.weight + self.bias


class AffineWeight(ModuleExtension):
    """Module extension for the ``weight`` of :class:`Affine` for several extensions."""

    def __init__(self, kind: str, params: tuple[str, ...] = ("weight",)):
        super().__init__(params=list(params))
        self.kind = kind

    def bias(self, ext, module, g_inp, g_out, bp):
        v = bp.sum(1)  # d out / d bias = identity
        return [torch.einsum("ci,cj->ij", v, v)]

    def weight(self, ext, module, g_inp, g_out, bp):
        x = module.input0
        if self.kind == "sqrt":  # [C, N, 4]
            return bp * x
        if self.kind == "kflr":  # a diagonal-free B factor: [B] for a vector parameter
            v = (bp * x).sum(1)
            return [torch.einsum("ci,cj->ij", v, v)]
        gn = g_out[0] * x  # first order: per-sample gradients [N, 4]
        if self.kind == "variance":
            return (gn.square().mean(0) - gn.mean(0).square())
        return gn.square().sum(0)


def affine_problem():
    torch.manual_seed(1)
    model = extend(nn.Sequential(nn.Linear(3, 4), Affine(), nn.Tanh(), nn.Linear(4, 3))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=torch.double), torch.randint(0, 3, (5,))
    return model, lossfunc, X, y


def test_module_extensions_for_statistics_and_fallback():
    model, lossfunc, X, y = affine_problem()
    sgs, var = SumGradSquared(), Variance()
    sgs.set_module_extension(Affine, AffineWeight("sgs"))
    var.set_module_extension(Affine, AffineWeight("variance"))
    with backpack(sgs, var):
        lossfunc(model(X), y).backward()
    gb = per_sample_grads(model, lossfunc, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.sum_grad_squared, gb[name].square().sum(0))
        torch.testing.assert_close(p.variance, gb[name].var(0, unbiased=False))


def test_module_extensions_second_order_square_root_and_kronecker():
    model, lossfunc, X, y = affine_problem()
    sq, kf = SqrtGGNExact(), KFLR()
    sq.set_module_extension(Affine, AffineWeight("sqrt"))
    kf.set_module_extension(Affine, AffineWeight("kflr", ("weight", "bias")))
    with backpack(sq, kf, chunk_size=2):
        lossfunc(model(X), y).backward()
    (Bb,) = model[1].bias.kflr
    vb = model[1].bias.sqrt_ggn_exact.sum(1)
    torch.testing.assert_close(Bb, vb.T @ vb)
    params = [p for p in model.parameters()]
    offset = sum(p.numel() for p in params[:2])  # Affine.weight's entries
    G = ggn_columns(model, lossfunc, X, y, range(offset, offset + 4))[:, offset : offset + 4]
    V = model[1].weight.sqrt_ggn_exact.flatten(0, 1)  # [C·N, 4]
    torch.testing.assert_close(V.T @ V, G)
    (B,) = model[1].weight.kflr
    v = model[1].weight.sqrt_ggn_exact.sum(1)
    torch.testing.assert_close(B, v.T @ v)


def test_uncovered_parameter_gets_the_single_diagonal_factor():
    """A parameter the user's module extension leaves out (``bias``) gets KFLR's stated
    treatment of parameters without Kronecker factors: the exact GGN diagonal as one factor."""
    model, lossfunc, X, y = affine_problem()
    kf = KFLR()
    kf.set_module_extension(Affine, AffineWeight("kflr"))
    with backpack(kf):
        lossfunc(model(X), y).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    bias = model[1].bias
    start = sum(p.numel() for p in params[: [id(p) for p in params].index(id(bias))])
    idx = list(range(start, start + bias.numel()))
    G = ggn_columns(model, lossfunc, X, y, idx)[:, idx]
    assert len(bias.kflr) == 1
    torch.testing.assert_close(bias.kflr[0], torch.diag(torch.diagonal(G)))


def test_second_order_module_extension_has_no_output_gradient():
    class Peek(ModuleExtension):
        def __init__(self):
            super().__init__(params=["weight"])

        def weight(self, ext, module, g_inp, g_out, bp):
            return g_out[0]

    inputs, targets, lossfunc = data()
    module, lossfunc = extend(MyScale()), extend(lossfunc)
    e = DiagGGNExact()
    e.set_module_extension(MyScale, Peek())
    with pytest.raises(RuntimeError, match="g_out is not available"), backpack(e):
        lossfunc(module(inputs), targets).backward()


# -- backpack.custom_module ---------------------------------------------------------------------
def test_custom_module_layers_forward():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="float"):
        ScaleModule(2)
    torch.testing.assert_close(ScaleModule(0.5)(x), 0.5 * x)
    torch.testing.assert_close(SumModule()(x, 2 * x), 3 * x)
    with pytest.raises(AssertionError, match="Shapes"):
        SumModule()(x, x[0])
    lin = nn.Linear(4, 4)
    torch.testing.assert_close(Parallel(nn.Identity(), lin)(x), x + lin(x))
    par = Parallel(nn.Identity(), lin, merge_module=SumModule())
    torch.testing.assert_close(par(x), x + lin(x))
    assert len(_Branch(nn.Identity(), lin)(x)) == 2
    torch.testing.assert_close(Pad((1, 2), value=3.0)(x), nn.functional.pad(x, (1, 2), value=3.0))
    torch.testing.assert_close(Permute(0, 2, 1)(x), x.permute(0, 2, 1))
    torch.testing.assert_close(Permute(1, 2, init_transpose=True)(x), x.transpose(1, 2))
    torch.testing.assert_close(ReduceTuple(index=1)((x, 2 * x)), 2 * x)
    torch.testing.assert_close(Slicing((slice(None), 1))(x), x[:, 1])


def test_residual_network_with_parallel_and_tracer():
    """The Parallel/SumModule ResNet of BackPACK's ResNet example, GGN diagonal entries vs
    autograd, and BackpackTracer keeping the custom modules as leaves."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.ReLU(),
        Parallel(nn.Identity(), nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU()),
                 merge_module=SumModule()),
        nn.Flatten(),
        nn.Linear(2 * 6 * 6, 10),
    ).double()
    assert convert_module_to_backpack(model, False) is model
    graph = BackpackTracer().trace(model)
    targets = [n.target for n in graph.nodes if n.op == "call_module"]
    assert "2" in targets  # the Parallel block is one leaf
    model = extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(3, 1, 6, 6, dtype=torch.double), torch.randint(0, 10, (3,))
    with backpack(DiagGGNExact()):
        lossfunc(model(X), y).backward()
    diag = parameters_to_vector([p.diag_ggn_exact for p in model.parameters()])
    idx = torch.linspace(0, diag.numel() - 1, 10).long().tolist()
    ref = torch.stack([c[d] for c, d in zip(ggn_columns(model, lossfunc, X, y, idx), idx)])
    torch.testing.assert_close(diag[idx], ref)


class NoisyScale(nn.Module):
    """``dropout(input) * weight`` and a running mean of the input (a buffer): a module whose
    forward is random in train mode and updates state."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([2.0], dtype=torch.double))
        self.drop = nn.Dropout(0.5)
        self.register_buffer("running", torch.zeros(4, dtype=torch.double))

    def forward(self, input):
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * input.mean(0))
        return self.drop(input) * self.weight


class NoisyScaleBatchGrad(FirstOrderModuleExtension):
    """``∂ℓₙ/∂w = ⟨g_outₙ, output_n / w⟩``: reads the stored output, so it needs the mask of
    the forward."""

    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, bpQuantities):
        return torch.einsum("nd,nd->n", g_out[0], module.output / module.weight).unsqueeze(-1)


def test_module_extension_sees_the_forward_output_and_leaves_state_alone():
    """The module extension reads the output the forward computed (Dropout's mask), and the
    module's buffers are updated once, by the forward (not again by the extension)."""
    inputs, targets, lossfunc = data()
    module = NoisyScale().train()
    extension = BatchGrad()
    extension.set_module_extension(NoisyScale, NoisyScaleBatchGrad())
    module, lossfunc = extend(module), extend(lossfunc)
    torch.manual_seed(1)
    out = module(inputs)
    running = module.running.clone()
    masked = out.detach() / module.weight.detach()  # dropout(input) of this forward
    with backpack(extension):
        lossfunc(out, targets).backward()
    torch.testing.assert_close(module.running, running)
    ref = torch.stack([
        torch.autograd.grad(lossfunc(m * module.weight, t), [module.weight])[0]
        for m, t in zip(masked.split(1), targets.split(1))
    ])
    torch.testing.assert_close(module.weight.grad_batch, ref)
    torch.testing.assert_close(module.weight.grad_batch.sum(0), module.weight.grad)
