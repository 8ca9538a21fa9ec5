"""``collect(*extensions)`` (``backprism.engine.collect``): the context itself, its arguments
and errors, the extension hook, what a failing pass leaves behind, and the backward entry points
it intercepts (``loss.backward``, ``torch.autograd.backward``, ``torch.autograd.grad``, with an
explicit seed).

References are dense float64 from ``tests/reference.py`` (``torch.func``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import backprism
from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact
from tests.common import check_diag_attr, seeded_labels, small_mlp
from tests.reference import diag_ggn

DT = torch.float64


def test_errors():
    model = extend(nn.Sequential(nn.Linear(3, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(TypeError, match=r"BatchGrad\(\)"):
        collect(BatchGrad)
    with pytest.raises(TypeError, match="extension"):
        collect("BatchGrad")
    with pytest.raises(ValueError, match="same attribute"):
        collect(BatchGrad(), BatchGrad())
    # never extended
    plain = nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match="extend"), collect(BatchGrad()):
        nn.functional.cross_entropy(plain(X), y).backward()
    # reduction="none"
    bad = extend(nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(ValueError, match="reduction"), collect(BatchL2Grad()):
        bad(model(X), y).sum().backward()
    # second order with a functional loss it does not recognise (tests/engine/test_loss_nodes)
    from backprism.extensions import DiagGGNExact

    with pytest.raises(RuntimeError, match="loss module"), collect(DiagGGNExact()):
        nn.functional.cross_entropy(model(X), y, label_smoothing=0.1).backward()
    # nested contexts
    with pytest.raises(RuntimeError, match="nested"), collect(BatchGrad()), collect(BatchGrad()):
        pass
    # BatchNorm in train mode mixes samples
    bn = extend(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    with pytest.raises(RuntimeError, match=r"eval\(\)"), collect(BatchGrad()):
        lossfunc(bn(X), y).backward()
    # the model stays usable after any of those
    with collect(BatchL2Grad()):
        lossfunc(model(X), y).backward()
    assert model[0].weight.batch_l2.shape == (4,)
    bn.eval()
    with collect(BatchL2Grad()):
        lossfunc(bn(X), y).backward()
    assert bn[0].weight.batch_l2.shape == (4,)


def test_exception_inside_context_leaves_model_usable():
    model = extend(nn.Sequential(nn.Linear(3, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))

    def boom(module):
        raise KeyError("user hook failed")

    with pytest.raises(KeyError), collect(BatchGrad(), extension_hook=boom):
        lossfunc(model(X), y).backward()
    with collect(BatchGrad()):
        lossfunc(model(X), y).backward()
    assert model[0].weight.grad_batch.shape == (4, 2, 3)
    assert backprism.engine.state.active() is None


def test_grad_unchanged_and_extension_hook_frees():
    torch.manual_seed(3)
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    lossfunc(model(X), y).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    seen, norms = [], {}

    def hook(module):
        seen.append(module)
        for p in module.parameters():
            norms[p] = p.grad_batch.flatten(1).norm(dim=1)
            del p.grad_batch

    with collect(BatchGrad(), extension_hook=hook):
        lossfunc(model(X), y).backward()
    assert seen == [model[2], model[0]]
    for p, g in zip(model.parameters(), plain):
        torch.testing.assert_close(p.grad, g)
        assert not hasattr(p, "grad_batch")
        assert norms[p].shape == (7,)


@pytest.mark.parametrize("entry", ["backward", "autograd_backward", "autograd_grad"])
def test_explicit_seed_scales_curvature(entry: str) -> None:
    """``loss.backward(gradient=c)`` (and the autograd entry points with a seed) makes the loss
    enter the objective with factor ``c``: the GGN diagonal is ``c`` times the reference. (The
    implicit seed is known to be 1 without reading it; an explicit one is read.)"""
    torch.manual_seed(5)
    model, lf = extend(small_mlp().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(6, 4, dtype=DT), seeded_labels((6,), 3, 6)
    ref = {k: 2.5 * v for k, v in diag_ggn(model, lf, X, y).items()}
    seed = torch.tensor(2.5, dtype=DT)
    with collect(DiagGGNExact()):
        loss = lf(model(X), y)
        if entry == "backward":
            loss.backward(seed)
        elif entry == "autograd_backward":
            torch.autograd.backward(loss, grad_tensors=seed)
        else:
            torch.autograd.grad(loss, list(model.parameters()), grad_outputs=seed)
    check_diag_attr(model, "diag_ggn_exact", ref)


def test_a_scaled_loss_scales_every_result_as_it_scales_grad():
    """``torch.amp.GradScaler``'s ``scaler.scale(loss).backward()`` backpropagates ``S·L``:
    every result is that objective's, as ``.grad`` is before ``scaler.unscale_`` — per-sample
    gradients and the GGN diagonal ``S``-fold, squares ``S²``-fold —, consistent with
    ``.grad`` (documented: divide by ``scaler.get_scale()``)."""
    from backprism.extensions import SumGradSquared, Variance

    torch.manual_seed(3)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    exts = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, DiagGGNExact)
    fields = ("grad_batch", "batch_l2", "sum_grad_squared", "variance", "diag_ggn_exact")
    powers = (1, 2, 2, 2, 1)
    results = []
    for scale in (1.0, 1024.0):
        model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
        model.load_state_dict(small_state(model))
        lf = extend(nn.CrossEntropyLoss())
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        with collect(*(e() for e in exts)):
            scaler.scale(lf(model(x), y)).backward()
        results.append({f: [getattr(p, f) for p in model.parameters()] for f in fields})
        results[-1]["grad"] = [p.grad for p in model.parameters()]
    for f, k in (*zip(fields, powers), ("grad", 1)):
        for a, b in zip(results[0][f], results[1][f]):
            torch.testing.assert_close(b, a * 1024.0**k, rtol=1e-10, atol=0)


def small_state(model: nn.Module) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in
            model.state_dict().items()}
