"""The flows of ViViT 1.0's documentation examples through ``backprism.compat.vivit`` and
``backprism.compat.backpack`` (imports changed), against dense float64 GGN references.

Also: ViViT's module paths name ``backprism.spectral``'s classes.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.nn.utils.convert_parameters import parameters_to_vector

from backprism.compat.backpack import backpack, extend
from backprism.compat.backpack.utils.examples import _autograd_ggn_exact_columns
from backprism.compat.vivit.extensions.secondorder.vivit import ViViTGGNExact, ViViTGGNMC
from backprism.compat.vivit.linalg.eigh import EighComputation
from backprism.compat.vivit.linalg.eigvalsh import EigvalshComputation
from backprism.compat.vivit.optim.directional_damped_newton import (
    DirectionalDampedNewtonComputation,
)
from backprism.compat.vivit.optim.directional_derivatives import DirectionalDerivativesComputation
from tests.reference import ggn, ggn_blocks, per_sample_grads

N, D_in, D_hidden, D_out = 4, 7, 5, 3
DT = torch.double


def setup():
    torch.manual_seed(0)
    X = torch.rand(N, D_in, dtype=DT)
    y = torch.rand(N, D_out, dtype=DT)
    model = nn.Sequential(
        nn.Linear(D_in, D_hidden), nn.ReLU(), nn.Linear(D_hidden, D_hidden), nn.ReLU(),
        nn.Linear(D_hidden, D_out),
    ).to(DT)
    loss_function = nn.MSELoss(reduction="mean")
    return extend(model), extend(loss_function), X, y


def select_top_k(evals, k=4):
    return [evals.numel() - k + idx for idx in range(k)]


def test_public_names():
    vivit = importlib.import_module("backprism.compat.vivit")
    for name in ("EigvalshComputation", "EighComputation", "DirectionalDerivativesComputation",
                 "DirectionalDampedNewtonComputation", "extensions", "linalg", "optim"):
        assert hasattr(vivit, name)


def test_example_eigvalsh():
    model, loss_function, X, y = setup()
    loss = loss_function(model(X), y)
    computation = EigvalshComputation()
    group = {"params": [p for p in model.parameters() if p.requires_grad]}
    with backpack(computation.get_extension(),
                  extension_hook=computation.get_extension_hook([group])):
        loss.backward()
    evals = computation.get_result(group)
    G = ggn(model, loss_function, X, y)
    cols = torch.stack([c for _, c in _autograd_ggn_exact_columns(X, y, model, loss_function)])
    torch.testing.assert_close(cols, G)
    ggn_evals = torch.linalg.eigvalsh(G)[-evals.numel():]
    torch.testing.assert_close(evals, ggn_evals, rtol=1e-6, atol=1e-10)


def test_example_eigh():
    model, loss_function, X, y = setup()
    loss = loss_function(model(X), y)
    computation = EighComputation()
    group = {"params": [p for p in model.parameters() if p.requires_grad],
             "criterion": select_top_k}
    with backpack(computation.get_extension(),
                  extension_hook=computation.get_extension_hook([group])):
        loss.backward()
    evals, evecs = computation.get_result(group)
    assert [e.shape[1:] for e in evecs] == [p.shape for p in group["params"]]
    evecs_flat = torch.cat([e.flatten(start_dim=1) for e in evecs], dim=1)
    G = ggn(model, loss_function, X, y)
    for e, v in zip(evals, evecs_flat):
        torch.testing.assert_close(G @ v, e * v)


def test_example_directional_derivatives():
    model, loss_function, X, y = setup()
    loss = loss_function(model(X), y)
    computation = DirectionalDerivativesComputation()
    group = {"params": [p for p in model.parameters() if p.requires_grad],
             "criterion": select_top_k}
    with backpack(*computation.get_extensions(),
                  extension_hook=computation.get_extension_hook([group])):
        loss.backward()
    gammas, lambdas = computation.get_result(group)
    Gb, _, _ = ggn_blocks(model, loss_function, X, y)
    G = Gb.sum((0, 1))
    evals, evecs = torch.linalg.eigh(G)
    keep = select_top_k(evals)
    evals, evecs = evals[keep], evecs[:, keep]
    # per-sample gradients of ℓₙ (ViViT: the gradient of the loss on sample n alone)
    gb = per_sample_grads(model, loss_function, X, y)
    grads = torch.cat([g.flatten(1) for g in gb.values()], 1) * N
    torch.testing.assert_close(gammas.abs(), (grads @ evecs).abs())
    per_sample_ggn = torch.stack([Gb[n, n] for n in range(N)]) * N
    ref = torch.einsum("ik,nij,jk->nk", evecs, per_sample_ggn, evecs)
    torch.testing.assert_close(lambdas, ref)
    torch.testing.assert_close(lambdas.mean(0), evals)


def test_example_directional_damped_newton():
    model, loss_function, X, y = setup()
    loss = loss_function(model(X), y)
    computation = DirectionalDampedNewtonComputation()
    damping = 1.0

    def constant_damping(evals, evecs, gammas, lambdas):
        return damping * torch.ones_like(evals)

    group = {"params": [p for p in model.parameters() if p.requires_grad],
             "criterion": select_top_k, "damping": constant_damping}
    with backpack(*computation.get_extensions(),
                  extension_hook=computation.get_extension_hook([group])):
        loss.backward()
    newton_step = computation.get_result(group)
    assert [s.shape for s in newton_step] == [p.shape for p in group["params"]]
    gradient = parameters_to_vector(
        torch.autograd.grad(loss_function(model(X), y), group["params"])
    )
    G = ggn(model, loss_function, X, y)
    evals, evecs = torch.linalg.eigh(G)
    keep = select_top_k(evals)
    evals, evecs = evals[keep], evecs[:, keep]
    ref = sum((-(gradient @ evecs[:, k]) / (evals[k] + damping)) * evecs[:, k] for k in range(4))
    torch.testing.assert_close(parameters_to_vector(newton_step), ref)


@pytest.mark.parametrize("subsampling", [None, [3, 0]])
def test_example_ntk_with_vivit_ggn_exact(subsampling):
    """Empirical NTK from ``ViViTGGNExact``'s Gram matrix (ViViT's NTK example), against the
    Jacobians from ``torch.func`` (the example's functorch reference, smaller CNN)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(),
                        nn.Linear(4 * 4 * 4, 10)).to(DT)
    x1, x2 = torch.randn(5, 3, 8, 8, dtype=DT), torch.randn(3, 3, 8, 8, dtype=DT)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def f_single(p, x):
        return functional_call(net, p, (x.unsqueeze(0),)).squeeze(0)

    def jac(x):
        j = vmap(jacrev(f_single), (None, 0))(params, x)
        return torch.cat([t.flatten(2) for t in j.values()], 2)

    ntk = torch.einsum("naf,mbf->nmab", jac(x1), jac(x2))

    class AccumulateGram:
        def __init__(self):
            self.gram = None

        def __call__(self, module):
            for p in module.parameters():
                g = p.vivit_ggn_exact["gram_mat"]()
                self.gram = g if self.gram is None else self.gram + g
                del p.vivit_ggn_exact

    X = torch.cat([x1, x2])
    net = extend(net)
    loss_func = extend(nn.MSELoss(reduction="sum"))
    hook = AccumulateGram()
    with backpack(ViViTGGNExact(subsampling=subsampling), extension_hook=hook):
        output = net(X)
        loss_func(output, torch.zeros_like(output)).backward()
    gram = torch.einsum("cndm->nmcd", hook.gram) * 0.5
    if subsampling is None:
        torch.testing.assert_close(gram[:5, 5:], ntk)
    else:
        full = torch.einsum("naf,mbf->nmab", jac(X[subsampling]), jac(X[subsampling]))
        torch.testing.assert_close(gram, full)


def test_vivit_ggn_functions():
    model, loss_function, X, y = setup()
    loss = loss_function(model(X), y)
    torch.manual_seed(0)
    with backpack(ViViTGGNExact(), ViViTGGNMC(mc_samples=2)):
        loss.backward()
    Gb, _, _ = ggn_blocks(model, loss_function, X, y)
    offset = 0
    for p in model.parameters():
        fns = p.vivit_ggn_exact
        assert set(fns) == {"V_mat_prod", "V_t_mat_prod", "gram_mat"}
        k = p.numel()
        block = Gb.sum((0, 1))[offset : offset + k, offset : offset + k]
        offset += k
        v = torch.randn(2, *p.shape, dtype=DT)
        VtV = fns["V_mat_prod"](fns["V_t_mat_prod"](v))  # V Vᵀ v = GGN block v
        torch.testing.assert_close(VtV.flatten(1), v.flatten(1) @ block)
        gram = fns["gram_mat"]()
        assert gram.shape == (D_out, N, D_out, N)
        assert p.vivit_ggn_mc["gram_mat"]().shape == (2, N, 2, N)


def test_vivit_compat_paths():
    from backprism import spectral
    from backprism.compat import vivit
    from backprism.compat.vivit.linalg.eigh import EighComputation as E2
    from backprism.compat.vivit.linalg.eigvalsh import EigvalshComputation as E1
    from backprism.compat.vivit.optim.directional_damped_newton import (
        DirectionalDampedNewtonComputation as E4,
    )
    from backprism.compat.vivit.optim.directional_derivatives import (
        DirectionalDerivativesComputation as E3,
    )

    assert (
        spectral.EigvalshComputation, spectral.EighComputation,
        spectral.DirectionalDerivativesComputation, spectral.DirectionalDampedNewtonComputation,
    ) == (E1, E2, E3, E4)
    assert vivit.EighComputation is spectral.EighComputation
