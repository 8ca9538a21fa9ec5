"""A script written for BackPACK runs after changing only its imports."""

import torch
from torch import nn

from backprism.compat.backpack import backpack, extend
from backprism.compat.backpack.extensions import BatchGrad, DiagGGNExact, SumGradSquared

from reference import ggn, per_sample_grads, split


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
