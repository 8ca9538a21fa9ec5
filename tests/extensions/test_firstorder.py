"""First-order extensions (``backprism.extensions.firstorder``: ``BatchGrad``, ``BatchL2Grad``,
``SumGradSquared``, ``Variance``, ``BatchDotGrad``) against dense float64 per-sample gradients
(``tests/reference.py::per_sample_grads``, ``torch.func``).

On every device (the ``device`` fixture): all five together and ``BatchGrad`` with
sub-sampling on seven models (MLPs, a CNN, a residual block, a transformer encoder, a GPT-style
decoder with logits ``[N, V, T]`` and ``[N·T, V]``); every stored tensor on the device and
finite. Also: sub-sampling through ``torch.autograd.grad`` (``.grad`` untouched), ``Variance``
when the parameters get no gradient, and the extension hook seeing finished values.

The rules' own first-order tests live in ``tests/rules``; first-order invariants on every model
family in ``tests/end_to_end/test_invariants.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from backprism import collect, extend
from backprism.extensions import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance
from tests.common import (
    DEVICE_MODELS,
    DEVICE_TOL,
    assert_on_device,
    build_on_device,
    check_stored,
    first_order_expected,
    fresh_backward,
    trainable,
)
from tests.reference import per_sample_grads

FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", DEVICE_MODELS)
def test_first_order_on_device(name, device):
    model, lossfunc, X, y, ref_loss = build_on_device(name, device)
    ref = per_sample_grads(model, ref_loss, X, y)
    extend(model), extend(lossfunc)
    sub = [2, 0]
    fresh_backward(model, lossfunc, X, y, *(e() for e in FIRST_ORDER))
    check_stored(model, device, *(e.savefield for e in FIRST_ORDER))
    for key, p in trainable(model):
        assert_on_device(ref[key], device, "reference")
        for field, value in first_order_expected(ref[key]).items():
            torch.testing.assert_close(getattr(p, field), value, **DEVICE_TOL, msg=f"{key}.{field}")
        torch.testing.assert_close(p.grad, ref[key].sum(0), **DEVICE_TOL)
    fresh_backward(model, lossfunc, X, y, BatchGrad(subsampling=sub))
    check_stored(model, device, "grad_batch")
    for key, p in trainable(model):
        torch.testing.assert_close(p.grad_batch, ref[key][sub], **DEVICE_TOL)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("sub", [[2, 0, 2], [1, 2, 0], [0, 0, 1, 2, 2]])
@pytest.mark.parametrize("name", ["transformer", "gpt"])
def test_batch_grad_repeated_and_permuted_subsampling(name, sub):
    """``BatchGrad(subsampling)`` with repeated or permuted indices is ``grad_batch[sub]``, also
    for a sub-sample of as many rows as the batch (``N = 3``): what the forward kept inside an
    attention call holds the whole batch and is not reused for the restricted call."""
    model, lossfunc, X, y, ref_loss = build_on_device(name, torch.device("cpu"))
    ref = per_sample_grads(model, ref_loss, X, y)
    extend(model), extend(lossfunc)
    fresh_backward(model, lossfunc, X, y, BatchGrad(subsampling=sub))
    for key, p in trainable(model):
        torch.testing.assert_close(p.grad_batch, ref[key][sub], **DEVICE_TOL, msg=key)


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


class _Recurrent(nn.Module):
    """An LSTM (``batch_first`` either way, so the input or only the hidden states carry the
    batch on axis 1) read at its last state, and a head."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=batch_first)
        self.head = nn.Linear(4, 2)
        self.batch_first = batch_first

    def forward(self, x):
        seq = x if self.batch_first else x.transpose(0, 1)
        _, (h, _) = self.rnn(seq)
        return self.head(h[-1])


@pytest.mark.parametrize("batch_first", [True, False])
def test_subsampling_of_recurrent_layers(batch_first: bool):
    """Subsampling takes each tensor on its own batch axis: ``h_n``/``c_n`` carry it on axis 1
    even with ``batch_first=True`` (BackPACK's RNN/LSTM subsampling tests failed on this)."""
    torch.manual_seed(2)
    model = _Recurrent(batch_first).double()
    lossfunc = nn.CrossEntropyLoss()
    X, y = torch.randn(4, 5, 3, dtype=torch.double), torch.randint(0, 2, (4,))
    params = dict(trainable(model))
    # reference: one sample at a time, ∇(ℓₙ/N) (torch.func has no batching rule for LSTM)
    rows = [
        torch.autograd.grad(lossfunc(model(X[n : n + 1]), y[n : n + 1]) / len(y),
                            list(params.values()))
        for n in range(len(y))
    ]
    ref = {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(params)}
    extend(model), extend(lossfunc)
    for sub in ([0, 0], [2, 0], [3]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the generic rule of the LSTM announces itself
            fresh_backward(model, lossfunc, X, y, BatchGrad(subsampling=sub))
        for name, p in trainable(model):
            torch.testing.assert_close(p.grad_batch, ref[name][sub], msg=name)
