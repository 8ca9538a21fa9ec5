"""``backpack.hessianfree``, ``backpack.utils`` and ``backpack.core.derivatives`` through
``backprism.compat.backpack``, against dense float64 ``torch.func`` references."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from backprism.compat.backpack import extend
from backprism.compat.backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backprism.compat.backpack.core.derivatives.crossentropyloss import CrossEntropyLossDerivatives
from backprism.compat.backpack.core.derivatives.linear import LinearDerivatives
from backprism.compat.backpack.core.derivatives.mseloss import MSELossDerivatives
from backprism.compat.backpack.core.derivatives.sigmoid import SigmoidDerivatives
from backprism.compat.backpack.hessianfree.ggnvp import (
    ggn_vector_product,
    ggn_vector_product_from_plist,
)
from backprism.compat.backpack.hessianfree.hvp import hessian_vector_product
from backprism.compat.backpack.hessianfree.lop import L_op, transposed_jacobian_vector_product
from backprism.compat.backpack.hessianfree.rop import R_op, jacobian_vector_product
from backprism.compat.backpack.utils.convert_parameters import vector_to_parameter_list
from backprism.compat.backpack.utils.examples import (
    _autograd_ggn_exact_columns,
    autograd_diag_ggn_exact,
    load_one_batch_mnist,
)
from backprism.compat.backpack.utils.kroneckers import kfacs_to_mat
from tests.reference import ggn, loss_hessian

N = 4


def problem(extended: bool = True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    lossfunc = nn.CrossEntropyLoss()
    if extended:
        model, lossfunc = extend(model), extend(lossfunc)
    X, y = torch.randn(N, 3, dtype=torch.double), torch.randint(0, 2, (N,))
    return model, lossfunc, X, y


def flat_jacobian(model, X):
    """``∂ model(X) / ∂θ`` as ``[N·C, P]`` (torch.func)."""
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def f(*ps):
        return functional_call(model, dict(zip(names, ps)), (X,))

    jac = jacrev(f, argnums=tuple(range(len(names))))(*params.values())
    return torch.cat([j.reshape(j.shape[0] * j.shape[1], -1) for j in jac], 1)


@pytest.mark.parametrize("extended", [True, False])
def test_R_op_L_op_and_aliases(extended):
    model, _, X, _ = problem(extended)
    params = list(model.parameters())
    out = model(X)
    J = flat_jacobian(model, X)
    torch.manual_seed(1)
    v = [torch.randn_like(p) for p in params]
    vflat = torch.cat([t.reshape(-1) for t in v])
    for fn in (R_op, jacobian_vector_product):
        (Jv,) = fn(out, params, v)
        torch.testing.assert_close(Jv.reshape(-1), J @ vflat)
    w = torch.randn_like(out)
    for fn in (L_op, transposed_jacobian_vector_product):
        JTw = fn(out, params, w)
        torch.testing.assert_close(torch.cat([t.reshape(-1) for t in JTw]), J.T @ w.reshape(-1))
    assert not Jv.requires_grad
    (Jv_graph,) = R_op(out, params, v, detach=False)
    assert Jv_graph.requires_grad


def test_hessian_and_ggn_vector_products():
    model, lossfunc, X, y = problem()
    params = list(model.parameters())
    out = model(X)
    loss = lossfunc(out, y)
    H, G = loss_hessian(model, lossfunc, X, y), ggn(model, lossfunc, X, y)
    torch.manual_seed(2)
    for _ in range(2):  # repeated products on one graph
        v = [torch.randn_like(p) for p in params]
        vflat = torch.cat([t.reshape(-1) for t in v])
        Hv = hessian_vector_product(loss, params, v)
        torch.testing.assert_close(torch.cat([t.reshape(-1) for t in Hv]), H @ vflat)
        Gv = ggn_vector_product(loss, out, model, v)
        torch.testing.assert_close(torch.cat([t.reshape(-1) for t in Gv]), G @ vflat)
    # a block of the GGN, and gradients given up front
    Gv = ggn_vector_product_from_plist(loss, out, params[2:], v[2:])
    P2 = sum(p.numel() for p in params[:2])
    torch.testing.assert_close(
        torch.cat([t.reshape(-1) for t in Gv]), G[P2:, P2:] @ vflat[P2:]
    )
    # one parameter, its vector as a tensor (BackPACK's own tests pass it so)
    P3 = P2 + params[2].numel()
    (Gv,) = ggn_vector_product_from_plist(loss, out, [params[2]], v[2])
    torch.testing.assert_close(Gv.reshape(-1), G[P2:P3, P2:P3] @ vflat[P2:P3])
    grads = torch.autograd.grad(loss, params, create_graph=True)
    Hv = hessian_vector_product(loss, params, v, grad_params=grads)
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in Hv]), H @ vflat)


def test_convert_parameters_and_kroneckers():
    model, *_ = problem()
    params = list(model.parameters())
    vec = torch.arange(sum(p.numel() for p in params), dtype=torch.double)
    parts = vector_to_parameter_list(vec, params)
    assert [t.shape for t in parts] == [p.shape for p in params]
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in parts]), vec)
    with pytest.raises(TypeError):
        vector_to_parameter_list([1.0], params)  # type: ignore[arg-type]
    a, b = torch.randn(2, 2), torch.randn(3, 3)
    torch.testing.assert_close(kfacs_to_mat([a, b]), torch.kron(a, b))


def test_autograd_ggn_examples_helpers():
    model, lossfunc, X, y = problem()
    G = ggn(model, lossfunc, X, y)
    torch.testing.assert_close(autograd_diag_ggn_exact(X, y, model, lossfunc), torch.diagonal(G))
    idx = torch.tensor([0, 5, 17], dtype=torch.int32)
    torch.testing.assert_close(
        autograd_diag_ggn_exact(X, y, model, lossfunc, idx=idx), torch.diagonal(G)[idx.long()]
    )
    cols = dict(_autograd_ggn_exact_columns(X, y, model, lossfunc))
    torch.testing.assert_close(torch.stack([cols[d] for d in sorted(cols)]), G)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="has torchvision")
def test_mnist_loaders_say_what_they_need():
    with pytest.raises(ImportError, match="torchvision"):
        load_one_batch_mnist(batch_size=8)


def with_io(module, *inputs):
    out = module(*inputs)
    for i, x in enumerate(inputs):
        object.__setattr__(module, f"input{i}", x)
    object.__setattr__(module, "output", out)
    return out


def test_layer_derivatives():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).double()
    x = torch.randn(N, 3, dtype=torch.double)
    with_io(lin, x)
    d = LinearDerivatives()
    mat = torch.randn(5, N, 2, dtype=torch.double)
    torch.testing.assert_close(d.jac_t_mat_prod(lin, None, None, mat), mat @ lin.weight.detach())
    torch.testing.assert_close(
        d.jac_t_mat_prod(lin, None, None, mat[:, [1, 3]], subsampling=[1, 3]),
        mat[:, [1, 3]] @ lin.weight.detach(),
    )
    vin = torch.randn(5, N, 3, dtype=torch.double)
    torch.testing.assert_close(d.jac_mat_prod(lin, None, None, vin), vin @ lin.weight.detach().T)
    per_sample = torch.einsum("vno,ni->vnoi", mat, x)
    torch.testing.assert_close(
        d.param_mjp("weight", lin, None, None, mat, sum_batch=False), per_sample
    )
    torch.testing.assert_close(d.weight_jac_t_mat_prod(lin, None, None, mat), per_sample.sum(1))
    torch.testing.assert_close(d.bias_jac_t_mat_prod(lin, None, None, mat), mat.sum(1))
    W = torch.randn(5, 2, 3, dtype=torch.double)
    torch.testing.assert_close(
        d.weight_jac_mat_prod(lin, None, None, W), torch.einsum("voi,ni->vno", W, x)
    )
    assert d.hessian_is_zero(lin)
    sig = nn.Sigmoid()
    z = torch.randn(N, 3, dtype=torch.double)
    with_io(sig, z)
    s = torch.sigmoid(z)
    sd = SigmoidDerivatives()
    assert not sd.hessian_is_zero(sig) and sd.hessian_is_diagonal(sig)
    torch.testing.assert_close(sd.df(sig, None, None), s * (1 - s))
    torch.testing.assert_close(sd.d2f(sig, None, None), s * (1 - s) * (1 - 2 * s))
    D = 3
    M = torch.randn(D, D, dtype=torch.double)
    ref = sum(torch.diag(s[n] * (1 - s[n])) @ M @ torch.diag(s[n] * (1 - s[n])) for n in range(N))
    torch.testing.assert_close(sd.ea_jac_t_mat_jac_prod(sig, None, None, M), ref / N)
    with pytest.raises(AttributeError, match="input0"):
        d.jac_t_mat_prod(nn.Linear(3, 2), None, None, mat)


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_loss_derivatives(loss):
    torch.manual_seed(0)
    f = torch.randn(N, 3, dtype=torch.double)
    if loss == "ce":
        module, y = nn.CrossEntropyLoss(), torch.randint(0, 3, (N,))
        d = CrossEntropyLossDerivatives()
    else:
        module, y, d = nn.MSELoss(), torch.randn(N, 3, dtype=torch.double), MSELossDerivatives()
    with_io(module, f, y)
    H = hessian(lambda o: module(o, y))(f).reshape(N, 3, N, 3)
    S = d.sqrt_hessian(module, None, None)
    for n in range(N):
        torch.testing.assert_close(S[:, n].T @ S[:, n], H[n, :, n])
    torch.testing.assert_close(d.sum_hessian(module, None, None),
                               sum(H[n, :, n] for n in range(N)))
    mat = torch.randn(2, N, 3, dtype=torch.double)
    prod = d.make_hessian_mat_prod(module, None, None)(mat)
    torch.testing.assert_close(prod, torch.einsum("ncmd,vmd->vnc", H, mat))
    assert d.sqrt_hessian(module, None, None, subsampling=[2]).shape[1] == 1
    assert d.sqrt_hessian_sampled(module, None, None, mc_samples=5).shape == (5, N, 3)
    assert d.hessian_is_psd()


def test_weight_jac_t_save_memory_is_a_switch():
    assert not weight_jac_t_save_memory._SAVE_MEMORY
    with weight_jac_t_save_memory(save_memory=True):
        assert weight_jac_t_save_memory._SAVE_MEMORY
    assert not weight_jac_t_save_memory._SAVE_MEMORY


def test_extend_stores_io_as_backpack():
    """``extend`` stores every sub-module's inputs and output in a forward pass with gradients
    (not under ``disable()`` or ``no_grad``), the derivatives read them, and a backward pass
    inside ``backpack(...)`` deletes them (BackPACK's clean-up)."""
    from backprism.compat.backpack import backpack, disable
    from backprism.compat.backpack.extensions import BatchGrad

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    lossfunc = extend(nn.MSELoss())
    x = torch.randn(N, 3, dtype=torch.double)
    y = torch.randn(N, 2, dtype=torch.double)
    with torch.no_grad():
        model(x)
    assert "input0" not in model[0].__dict__
    with disable():
        model(x)
    assert "input0" not in model[0].__dict__
    out = model(x)
    loss = lossfunc(out, y)
    assert model[0].input0 is x and model[2].output is out
    assert lossfunc.input0 is out and lossfunc.input1 is y
    h = torch.tanh(model[0](x)).detach()
    mat = torch.randn(5, N, 2, dtype=torch.double)
    d = LinearDerivatives()
    torch.testing.assert_close(
        d.weight_jac_t_mat_prod(model[2], None, None, mat), torch.einsum("vno,ni->voi", mat, h)
    )
    with backpack(BatchGrad()):
        loss.backward()
    for m in [*model, lossfunc]:
        assert "output" not in m.__dict__ and "input0" not in m.__dict__
