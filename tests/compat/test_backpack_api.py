"""BackPACK 1.7's public names and keywords through ``backprism.compat.backpack``, checked
against dense float64 references (``tests/reference.py``, ``torch.func``).

Also: a script written for BackPACK runs after changing only its imports.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from backprism.compat.backpack import backpack, disable, extend
from backprism.compat.backpack import extensions as ext
from backprism.compat.backpack.extensions import BatchGrad, DiagGGNExact, SumGradSquared
from tests.reference import (
    diag_blocks,
    ggn,
    ggn_blocks,
    loss_hessian,
    param_blocks,
    per_sample_grads,
    split,
)

N = 6


def problem(seed: int = 0, act: type[nn.Module] = nn.Sigmoid, n: int = N):
    torch.manual_seed(seed)
    model = extend(nn.Sequential(nn.Linear(5, 4), act(), nn.Linear(4, 3))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X = torch.randn(n, 5, dtype=torch.double)
    y = torch.randint(0, 3, (n,))
    return model, lossfunc, X, y


def run(model, lossfunc, X, y, *exts, **kw):
    loss = lossfunc(model(X), y)
    with backpack(*exts, **kw):
        loss.backward()
    return loss


# -- public paths ------------------------------------------------------------------------------
PATHS = {
    "": ["backpack", "extend", "disable", "extensions"],
    ".extensions": [
        "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance", "DiagGGNExact", "DiagGGNMC",
        "BatchDiagGGNExact", "BatchDiagGGNMC", "DiagHessian", "BatchDiagHessian", "KFAC", "KFLR",
        "KFRA", "HBP", "SqrtGGNExact", "SqrtGGNMC", "HMP", "GGNMP", "PCHMP",
    ],
    ".extensions.firstorder": ["BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance"],
    ".extensions.firstorder.base": ["FirstOrderModuleExtension", "FirstOrderBackpropExtension"],
    ".extensions.firstorder.batch_grad": ["BatchGrad"],
    ".extensions.firstorder.batch_l2_grad": ["BatchL2Grad"],
    ".extensions.firstorder.sum_grad_squared": ["SumGradSquared"],
    ".extensions.firstorder.variance": ["Variance"],
    ".extensions.module_extension": ["ModuleExtension"],
    ".extensions.backprop_extension": ["BackpropExtension", "FAIL_ERROR", "FAIL_WARN"],
    ".extensions.mat_to_mat_jac_base": ["MatToJacMat"],
    ".extensions.curvature": ["Curvature", "ResidualModifications"],
    ".extensions.secondorder": ["DiagGGNExact", "KFAC", "HBP", "SqrtGGNMC", "DiagHessian"],
    ".extensions.secondorder.base": ["SecondOrderBackpropExtension"],
    ".extensions.secondorder.diag_ggn": ["DiagGGN", "BatchDiagGGN", "DiagGGNExact", "DiagGGNMC"],
    ".extensions.secondorder.diag_hessian": ["DiagHessian", "BatchDiagHessian"],
    ".extensions.secondorder.hbp": [
        "HBP", "KFAC", "KFLR", "KFRA", "LossHessianStrategy", "BackpropStrategy",
        "ExpectationApproximation",
    ],
    ".extensions.secondorder.hbp.hbp_options": ["LossHessianStrategy"],
    ".extensions.secondorder.sqrt_ggn": ["SqrtGGN", "SqrtGGNExact", "SqrtGGNMC"],
    ".extensions.curvmatprod": ["HMP", "GGNMP", "PCHMP"],
    ".extensions.curvmatprod.pchmp": ["PCHMP"],
    ".custom_module.branching": ["SumModule", "Parallel", "_Branch"],
    ".custom_module.graph_utils": ["BackpackTracer", "convert_module_to_backpack"],
    ".custom_module.scale_module": ["ScaleModule"],
    ".custom_module.pad": ["Pad"],
    ".custom_module.permute": ["Permute"],
    ".custom_module.reduce_tuple": ["ReduceTuple"],
    ".custom_module.slicing": ["Slicing"],
    ".hessianfree.hvp": ["hessian_vector_product"],
    ".hessianfree.ggnvp": ["ggn_vector_product", "ggn_vector_product_from_plist"],
    ".hessianfree.rop": ["R_op", "jacobian_vector_product"],
    ".hessianfree.lop": ["L_op", "transposed_jacobian_vector_product"],
    ".utils.convert_parameters": ["vector_to_parameter_list"],
    ".utils.examples": [
        "load_mnist_dataset", "get_mnist_dataloader", "load_one_batch_mnist",
        "autograd_diag_ggn_exact", "_autograd_ggn_exact_columns",
    ],
    ".utils.kroneckers": ["kfacs_to_mat"],
    ".core.derivatives.linear": ["LinearDerivatives"],
    ".core.derivatives.conv2d": ["Conv2DDerivatives"],
    ".core.derivatives.convnd": ["weight_jac_t_save_memory"],
    ".core.derivatives.crossentropyloss": ["CrossEntropyLossDerivatives"],
    ".core.derivatives.mseloss": ["MSELossDerivatives"],
    ".core.derivatives.basederivatives": ["BaseDerivatives", "BaseParameterDerivatives"],
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_public_paths_import(path):
    mod = importlib.import_module(f"backprism.compat.backpack{path}")
    for name in PATHS[path]:
        assert hasattr(mod, name), f"backpack{path}.{name}"


# -- numbers -----------------------------------------------------------------------------------
def test_first_order_extensions():
    model, lossfunc, X, y = problem()
    run(model, lossfunc, X, y, ext.BatchGrad(), ext.BatchL2Grad(), ext.SumGradSquared(),
        ext.Variance())
    gb = per_sample_grads(model, lossfunc, X, y)
    for name, p in model.named_parameters():
        g = gb[name]
        torch.testing.assert_close(p.grad_batch, g)
        torch.testing.assert_close(p.batch_l2, g.flatten(1).square().sum(1))
        torch.testing.assert_close(p.sum_grad_squared, g.square().sum(0))
        torch.testing.assert_close(p.variance, g.square().mean(0) - g.mean(0).square())


def test_second_order_diagonals_and_square_root():
    model, lossfunc, X, y = problem()
    run(model, lossfunc, X, y, ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.SqrtGGNExact(),
        ext.DiagHessian())
    G, _, _ = ggn_blocks(model, lossfunc, X, y)
    diag = split(torch.diagonal(G.sum((0, 1))), model)
    batch = split(diag_blocks(G), model, lead=1)
    hess = split(torch.diagonal(loss_hessian(model, lossfunc, X, y)), model)
    blocks = param_blocks(model, G.sum((0, 1)))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diag[name])
        torch.testing.assert_close(p.diag_ggn_exact_batch, batch[name])
        torch.testing.assert_close(p.diag_h, hess[name])
        V = p.sqrt_ggn_exact  # [C, N, *p]
        assert V.shape == (3, N, *p.shape)
        Vf = V.flatten(2).flatten(0, 1)
        torch.testing.assert_close(Vf.T @ Vf, blocks[name])


def test_batch_diag_hessian_per_sample():
    model, lossfunc, X, y = problem()
    run(model, lossfunc, X, y, ext.BatchDiagHessian())
    for n in range(N):
        h = loss_hessian(model, lambda o, t: lossfunc(o, t) / N, X[n : n + 1], y[n : n + 1])
        ref = split(torch.diagonal(h), model)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.diag_h_batch[n], ref[name])


@pytest.mark.parametrize("make", [ext.KFLR, ext.KFRA])
def test_kronecker_factors_single_sample_are_exact(make):
    model, lossfunc, X, y = problem(n=1)
    e = make()
    run(model, lossfunc, X, y, e)
    blocks = param_blocks(model, ggn_blocks(model, lossfunc, X, y)[0].sum((0, 1)))
    for name, p in model.named_parameters():
        factors = getattr(p, e.savefield)
        approx = torch.kron(factors[0], factors[1]) if len(factors) == 2 else factors[0]
        torch.testing.assert_close(approx, blocks[name])


def test_mc_extensions_shapes_and_counts():
    model, lossfunc, X, y = problem()
    exts = [ext.DiagGGNMC(mc_samples=3), ext.BatchDiagGGNMC(mc_samples=2), ext.KFAC(mc_samples=2),
            ext.SqrtGGNMC(mc_samples=4)]
    run(model, lossfunc, X, y, *exts)
    assert [e.get_num_mc_samples() for e in exts] == [3, 2, 2, 4]
    for p in model.parameters():
        assert p.diag_ggn_mc.shape == p.shape
        assert p.diag_ggn_mc_batch.shape == (N, *p.shape)
        assert p.sqrt_ggn_mc.shape == (4, N, *p.shape)
        assert [f.shape for f in p.kfac] == (
            [(p.shape[0], p.shape[0]), (p.shape[1], p.shape[1])] if p.dim() == 2
            else [(p.shape[0], p.shape[0])]
        )


def test_curvature_products_with_savefields():
    """All-in-one example: two PCHMP instances with their own savefields in one pass."""
    model, lossfunc, X, y = problem()
    run(model, lossfunc, X, y, ext.HMP(), ext.GGNMP(savefield="my_ggnmp"),
        ext.PCHMP(savefield="pchmp_clip", modify="clip"),
        ext.PCHMP(savefield="pchmp_abs", modify="abs"))
    H = param_blocks(model, loss_hessian(model, lossfunc, X, y))
    G = param_blocks(model, ggn_blocks(model, lossfunc, X, y)[0].sum((0, 1)))
    torch.manual_seed(1)
    for i, (name, p) in enumerate(model.named_parameters()):
        V = torch.randn(3, *p.shape, dtype=torch.double)
        flat = V.flatten(1)
        torch.testing.assert_close(p.hmp(V).flatten(1), flat @ H[name])
        torch.testing.assert_close(p.my_ggnmp(V).flatten(1), flat @ G[name])
        for field in ("pchmp_clip", "pchmp_abs"):
            dense = getattr(p, field).to_dense()
            assert torch.linalg.eigvalsh(dense).min() > -1e-10  # positive semi-definite
            if i >= 2:  # last layer: no nonlinearity after it, the block is the GGN's
                torch.testing.assert_close(dense, G[name])
    assert not hasattr(model[0].weight, "ggnmp")


def test_repeated_subsampling_indices_repeat_rows():
    model, lossfunc, X, y = problem()
    bg = ext.BatchGrad(subsampling=[2, 0, 2])
    sq = ext.SqrtGGNExact(subsampling=[1, 1, 3])
    run(model, lossfunc, X, y, bg, sq)
    assert bg.get_subsampling() == [2, 0, 2] and sq.get_subsampling() == [1, 1, 3]
    gb = per_sample_grads(model, lossfunc, X, y)
    keep = {n: p.sqrt_ggn_exact.clone() for n, p in model.named_parameters()}
    run(model, lossfunc, X, y, ext.SqrtGGNExact())
    for name, p in model.named_parameters():
        torch.testing.assert_close(keep[name], p.sqrt_ggn_exact[:, [1, 1, 3]])
    run(model, lossfunc, X, y, ext.BatchGrad(subsampling=[2, 0, 2]))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, gb[name][[2, 0, 2]])


def test_repeated_subsampling_mc_square_root():
    model, lossfunc, X, y = problem()
    torch.manual_seed(3)
    run(model, lossfunc, X, y, ext.SqrtGGNMC(mc_samples=2))
    full = {n: p.sqrt_ggn_mc.clone() for n, p in model.named_parameters()}
    torch.manual_seed(3)
    run(model, lossfunc, X, y, ext.SqrtGGNMC(mc_samples=2, subsampling=[4, 0, 4]))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.sqrt_ggn_mc, full[name][:, [4, 0, 4]])


# -- the context and its keywords -------------------------------------------------------------
def test_retain_graph_keyword_and_repeated_backward():
    model, lossfunc, X, y = problem()
    loss = lossfunc(model(X), y)
    with backpack(ext.DiagGGNExact(), retain_graph=True):
        loss.backward(retain_graph=True)
    first = [p.diag_ggn_exact.clone() for p in model.parameters()]
    with backpack(ext.DiagGGNExact(), retain_graph=False):
        loss.backward()
    for a, p in zip(first, model.parameters()):
        torch.testing.assert_close(a, p.diag_ggn_exact)


def test_debug_and_extension_hook(capsys):
    model, lossfunc, X, y = problem()
    seen = []
    run(model, lossfunc, X, y, ext.BatchGrad(), extension_hook=seen.append, debug=True)
    assert set(map(id, seen)) == {id(model[0]), id(model[2])}
    assert "BatchGrad" in capsys.readouterr().out


def test_invalid_extensions_are_refused():
    for bad in (ext.BatchGrad, "BatchGrad", 3):
        with pytest.raises(ValueError, match="instances"):
            backpack(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            backpack(bad)  # type: ignore[arg-type]


def test_disable_turns_off_capturing():
    model, lossfunc, X, y = problem()
    assert disable.should_store_io()
    with disable():
        assert not disable.should_store_io()
        loss = lossfunc(model(X), y)
    assert disable.should_store_io()
    with pytest.raises(RuntimeError, match="extend"), backpack(ext.BatchGrad()):
        loss.backward()
    run(model, lossfunc, X, y, ext.BatchGrad())  # captured again outside
    assert model[0].weight.grad_batch.shape == (N, 4, 5)


def test_extend_use_converter_returns_the_module(capsys):
    model = nn.Sequential(nn.Linear(2, 2))
    assert extend(model, use_converter=True, debug=True) is model
    assert "conversion" in capsys.readouterr().out


# -- base classes, factories, strategies ------------------------------------------------------
def test_strategy_base_classes_build_the_concrete_extensions():
    h = ext.HBP(ext.Curvature.GGN, ext.LossHessianStrategy.SAMPLING, ext.BackpropStrategy.SQRT,
                ext.ExpectationApproximation.BOTEV_MARTENS)
    assert isinstance(h, ext.KFAC) and isinstance(h, ext.HBP) and h.savefield == "hbp"
    assert isinstance(ext.KFLR(), ext.HBP) and isinstance(ext.KFRA(), ext.HBP)
    assert ext.KFRA().get_backprop_strategy() == ext.BackpropStrategy.BATCH_AVERAGE
    with pytest.raises(NotImplementedError, match="KFAC"):
        ext.HBP(ext.Curvature.HESSIAN, "exact", "sqrt", ext.ExpectationApproximation.BOTEV_MARTENS)
    with pytest.raises(AttributeError):
        ext.HBP(ext.Curvature.GGN, "nope", "sqrt", ext.ExpectationApproximation.BOTEV_MARTENS)
    d = importlib.import_module("backprism.compat.backpack.extensions.secondorder.diag_ggn").DiagGGN
    mine = d(ext.LossHessianStrategy.EXACT, "my_diag")
    assert isinstance(mine, ext.DiagGGNExact) and isinstance(mine, d)
    model, lossfunc, X, y = problem()
    run(model, lossfunc, X, y, mine, h)
    for p in model.parameters():
        assert p.my_diag.shape == p.shape and isinstance(p.hbp, list)


def test_backprop_extension_interface():
    from backprism.extensions import BatchGrad as NativeBatchGrad

    assert isinstance(NativeBatchGrad(), ext.BackpropExtension)
    assert isinstance(ext.DiagGGNExact(), ext.SecondOrderBackpropExtension)
    assert ext.DiagGGNExact().expects_backpropagation_quantities()
    assert not ext.Variance().expects_backpropagation_quantities()
    assert ext.BatchGrad().get_subsampling() is None

    class MyExtension(ext.BackpropExtension):
        def __init__(self):
            super().__init__(savefield="mine", module_exts={})

    with pytest.raises(NotImplementedError, match="set_module_extension"):
        MyExtension()


def test_set_module_extension_refusals():
    class Mine(nn.Module):
        pass

    class MineExt(ext.ModuleExtension):
        def __init__(self):
            super().__init__(params=["weight"])

        def weight(self, ext_, module, g_inp, g_out, bp):
            return None

    for e in (ext.DiagHessian(), ext.BatchDiagHessian(), ext.HMP(), ext.GGNMP(), ext.PCHMP(),
              ext.KFRA()):
        with pytest.raises(NotImplementedError, match="register_rule"):
            e.set_module_extension(Mine, MineExt())
    e = ext.BatchGrad()
    with pytest.raises(ValueError, match="overwrite"):
        e.set_module_extension(nn.Linear, MineExt())
    e.set_module_extension(nn.Linear, MineExt(), overwrite=True)
    e.set_module_extension(Mine, MineExt())
    with pytest.raises(ValueError, match="overwrite"):
        e.set_module_extension(Mine, MineExt())
    with pytest.raises(TypeError):
        e.set_module_extension(Mine(), MineExt())  # type: ignore[arg-type]

    class Incomplete(ext.ModuleExtension):
        def __init__(self):
            super().__init__(params=["bias"])

    with pytest.raises(NotImplementedError, match="bias"):
        Incomplete()


def test_backpack_style_script():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 4, dtype=torch.double), torch.randint(0, 2, (5,))
    loss = lossfunc(model(X), y)
    calls = []
    with backpack(BatchGrad(), SumGradSquared(), DiagGGNExact(), extension_hook=calls.append):
        loss.backward()
    gb = per_sample_grads(model, lossfunc, X, y)
    diag = split(torch.diagonal(ggn(model, lossfunc, X, y)), model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, gb[name])
        torch.testing.assert_close(p.sum_grad_squared, gb[name].square().sum(0))
        torch.testing.assert_close(p.diag_ggn_exact, diag[name])
    assert set(calls) == {model[0], model[2]}


def test_is_nll_names_backpacks_sampled_losses():
    """``utils.module_classification.is_nll``: the losses BackPACK treats as negative
    log-likelihoods (MSE, cross-entropy, BCE with logits), nothing else."""
    from backprism.compat.backpack.utils.module_classification import is_loss, is_nll

    for loss in (nn.MSELoss(), nn.CrossEntropyLoss(), nn.BCEWithLogitsLoss()):
        assert is_nll(loss) and is_loss(loss)
    for other in (nn.NLLLoss(), nn.L1Loss(), nn.GaussianNLLLoss(), nn.Linear(2, 2)):
        assert not is_nll(other)


@pytest.mark.parametrize("make", [ext.KFAC, ext.KFLR, ext.KFRA])
def test_kronecker_refuse_linear_with_middle_axes(make):
    """As BackPACK 1.7: KFAC/KFLR/KFRA take Linear inputs ``[N, I]`` only and raise
    ``NotImplementedError`` for ``[N, *T, I]`` (a trainable Linear); a 2d input still works."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 3), nn.Sigmoid(), nn.Linear(3, 2), nn.Flatten()))
    lossfunc = extend(nn.MSELoss())
    X, y = torch.randn(3, 4, 5), torch.randn(3, 8)
    with pytest.raises(NotImplementedError, match="Only 2d inputs"):
        run(model, lossfunc, X, y, make())
    model, lossfunc, X, y = problem(n=2)
    e = make()
    run(model, lossfunc, X, y, e)
    assert all(hasattr(p, e.savefield) for p in model.parameters())
