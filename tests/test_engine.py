"""Engine behaviour: first-order extensions on Linear models, errors, hooks, memory."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import backprism
from backprism import collect, extend
from backprism.extensions import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance
from common import first_order_expected

from reference import per_sample_grads

FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad)


def _check_first_order(model, lossfunc, X, y, rtol=1e-7, atol=1e-10):
    ref = per_sample_grads(model, lossfunc, X, y)
    model.zero_grad()
    with collect(*(e() for e in FIRST_ORDER)):
        lossfunc(model(X), y).backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        for field, value in first_order_expected(ref[name]).items():
            torch.testing.assert_close(
                getattr(p, field), value, rtol=rtol, atol=atol, msg=f"{name}.{field}"
            )
        torch.testing.assert_close(p.grad, ref[name].sum(0), rtol=rtol, atol=atol)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 5),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    d_in=st.integers(1, 4),
    d_out=st.integers(1, 4),
    bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_linear_leading_axes(n, lead, d_in, d_out, bias, reduction):
    torch.manual_seed(n + 10 * d_in + 100 * d_out)
    model = extend(
        nn.Sequential(nn.Linear(d_in, 3, bias=bias), nn.Tanh(), nn.Linear(3, d_out, bias=bias))
    ).double()
    lossfunc = extend(nn.MSELoss(reduction=reduction))
    X = torch.randn(n, *lead, d_in, dtype=torch.double)
    y = torch.randn(n, *lead, d_out, dtype=torch.double)
    _check_first_order(model, lossfunc, X, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_dtypes(dtype):
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))).to(dtype)
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(8, 6, dtype=dtype), torch.randint(0, 4, (8,))
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else {}
    _check_first_order(model, lossfunc, X, y, **tol)


def test_subsampling_and_autograd_grad():
    torch.manual_seed(1)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 2))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(6, 3, dtype=torch.double), torch.randint(0, 2, (6,))
    ref = per_sample_grads(model, lossfunc, X, y)
    with collect(BatchGrad(subsampling=[4, 0, 2])):
        torch.autograd.grad(lossfunc(model(X), y), list(model.parameters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[name][[4, 0, 2]])
        assert p.grad is None  # autograd.grad leaves .grad alone


def test_weight_shared_across_calls():
    torch.manual_seed(2)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.out = nn.Linear(3, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))

    model = extend(Twice()).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=torch.double), torch.randint(0, 2, (5,))
    _check_first_order(model, lossfunc, X, y)


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
    # second order with a functional loss
    from backprism.extensions import DiagGGNExact

    with pytest.raises(RuntimeError, match="loss module"), collect(DiagGGNExact()):
        nn.functional.cross_entropy(model(X), y).backward()
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


def test_in_place_input_modification_detected():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            h = x * 1.0
            out = self.lin(h)
            h.mul_(2.0)
            return out

    model = extend(Bad())
    X = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="in place"), collect(BatchGrad()):
        model(X).square().mean().backward()


def _live_tensor_elements() -> int:
    gc.collect()
    return sum(o.numel() for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter))


def test_memory_flat_over_many_steps():
    torch.manual_seed(4)
    model = extend(nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5)))
    lossfunc = extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    counts = []
    for step in range(200):
        opt.zero_grad()
        loss = lossfunc(model(X), y)
        if step % 3 == 0:  # forward (and loss) without backward
            del loss
        elif step % 3 == 1:
            with collect(BatchGrad(), SumGradSquared()):
                loss.backward()
        else:
            loss.backward()
        opt.step()
        if step in (20, 199):
            counts.append(_live_tensor_elements())
    assert counts[1] <= counts[0]


def test_broadcast_position_embedding_is_refused():
    class Pos(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(4, 3)
            self.lin = nn.Linear(3, 2)

        def forward(self, x):  # x [N, T, 3]
            return self.lin(x + self.pos(torch.arange(x.shape[1]))).mean(1)

    model = extend(Pos())
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 4, 3), torch.randint(0, 2, (5,))
    with pytest.raises(RuntimeError, match="batch sizes 4 and 5"), collect(BatchGrad()):
        lossfunc(model(X), y).backward()


def test_variance_without_parameter_gradients_and_hook_order():
    """Variance takes the mean gradient from the parameter's gradient of the pass; when the
    parameters get none (``autograd.grad`` w.r.t. the input) it computes it itself, and the
    extension hook always sees the finished value."""
    torch.manual_seed(5)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(6, 3, dtype=torch.double), torch.randint(0, 2, (6,))
    ref = per_sample_grads(model, lossfunc, X, y)
    seen = {}

    def hook(module):
        for p in module.parameters():
            seen[p] = p.variance.clone()

    Xg = X.clone().requires_grad_(True)
    with collect(Variance(), extension_hook=hook):
        torch.autograd.grad(lossfunc(model(Xg), y), [Xg])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.variance, ref[name].var(0, unbiased=False))
        torch.testing.assert_close(seen[p], p.variance)
        assert p.grad is None
    seen.clear()
    with collect(Variance(), extension_hook=hook):
        lossfunc(model(X), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(seen[p], ref[name].var(0, unbiased=False))


def test_evaluation_forward_between_forward_and_loss_keeps_second_order():
    from backprism.extensions import DiagGGNExact

    from reference import ggn, split

    torch.manual_seed(6)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=torch.double), torch.randint(0, 2, (5,))
    out = model(X)
    with torch.no_grad():
        model(torch.randn(7, 3, dtype=torch.double))  # e.g. a validation batch
    with collect(DiagGGNExact()):
        lossfunc(out, y).backward()
    diag = split(torch.diagonal(ggn(model, lossfunc, X, y)), model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diag[name])
