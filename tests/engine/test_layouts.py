"""The samples' axis of every call's input, read from the graph (``BackwardPass._check_layouts``).

An RNN's ``h_n``/``c_n`` ``[layers, N, H]`` hold the samples on axis 1 whatever ``batch_first``
says, and a transpose moves them off axis 0: a Linear on such a tensor takes the samples from
the axis the graph says (also when that axis has the size of axis 0, where taking axis 0 would
be silently wrong); a layer whose rule cannot move them is refused before anything is written.
Operations that mix the samples after an RNN — on either layout — are refused as elsewhere.
References: one sample at a time with autograd / ``torch.func``, float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, Variance

DT = torch.float64


class OnHidden(nn.Module):
    """A batch-first GRU whose head reads ``h_n`` ``[layers, N, H]`` (every layer's state, the
    last row kept) or the mean of ``h_n`` over its layers."""

    def __init__(self, layers: int, read: str) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4, num_layers=layers, batch_first=True)
        self.head = nn.Linear(4, 2)
        self.read = read

    def forward(self, x: Tensor) -> Tensor:
        _, h = self.rnn(x)
        if self.read == "head_of_h":
            return self.head(h)[-1]  # Linear on [layers, N, H]
        return self.head(h.mean(0))  # a mean over the layers, not the samples


class Transposed(nn.Module):
    """``[N, T, d]`` → Linear → ``transpose(0, 1)`` → Linear on ``[T, N, d]`` → mean over T."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)).transpose(0, 1)).mean(0)


def _references(model: nn.Module, X: Tensor, y: Tensor) -> tuple[dict, dict]:
    """Per-sample gradients and the GGN diagonal of the mean cross-entropy, one sample at a
    time."""
    n = X.shape[0]
    theta = {k: p.detach() for k, p in model.named_parameters()}
    grads: dict[str, list[Tensor]] = {k: [] for k in theta}
    ggn = {k: torch.zeros_like(v) for k, v in theta.items()}
    for i in range(n):
        def f(th: dict, i: int = i) -> Tensor:
            return functional_call(model, th, (X[i : i + 1],))[0]

        def loss(o: Tensor, i: int = i) -> Tensor:
            return nn.functional.cross_entropy(o[None], y[i : i + 1]) / n

        g = torch.func.grad(lambda th: loss(f(th)))(theta)
        for k in theta:
            grads[k].append(g[k])
        out = f(theta)
        jac, H = jacrev(f)(theta), hessian(loss)(out)
        for k in theta:
            J = jac[k].reshape(out.numel(), -1)
            ggn[k] += torch.einsum("ci,cd,di->i", J, H, J).reshape(theta[k].shape)
    return {k: torch.stack(v) for k, v in grads.items()}, ggn


def _check(model: nn.Module, X: Tensor, y: Tensor) -> None:
    gb_ref, ggn_ref = _references(model, X, y)
    model = extend(model)
    lf = extend(nn.CrossEntropyLoss())
    with collect(BatchGrad(), BatchL2Grad(), Variance(), DiagGGNExact()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        gb = gb_ref[k]
        torch.testing.assert_close(p.grad_batch, gb, msg=k)
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, msg=k)
        torch.testing.assert_close(p.batch_l2, (gb**2).flatten(1).sum(1), msg=k)
        torch.testing.assert_close(p.variance, gb.var(0, unbiased=False), msg=k)
        torch.testing.assert_close(p.diag_ggn_exact, ggn_ref[k], msg=k)


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("read", ["head_of_h", "mean_over_layers"])
def test_linear_on_the_hidden_state_of_a_batch_first_rnn(layers: int, read: str) -> None:
    """``h_n`` holds the samples on axis 1 although ``batch_first=True``: a Linear on it takes
    them from there (with 3 samples and 3 layers too, where axis 0 has the batch's size)."""
    torch.manual_seed(0)
    X, y = torch.randn(3, 5, 3, dtype=DT), torch.tensor([0, 1, 1])
    _check(OnHidden(layers, read).to(DT), X, y)


@pytest.mark.parametrize("t", [3, 4])
def test_linear_on_a_transposed_activation(t: int) -> None:
    """A Linear on ``h.transpose(0, 1)`` takes the samples from axis 1, and a mean over axis 0
    (time) after it is not a mixing of samples (``T == N`` too)."""
    torch.manual_seed(1)
    X, y = torch.randn(3, t, 3, dtype=DT), torch.tensor([1, 0, 1])
    for _ in range(2):  # (the second forward may run without the forward mode)
        _check(Transposed().to(DT), X, y)


class ConvOnTransposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv1d(2, 3, 2), nn.Conv1d(3, 2, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)  # [N, 3, L]
        h = h.transpose(0, 1).reshape(h.shape[1], h.shape[0], -1)  # [3, N, L]: channels first
        return self.b(h.transpose(0, 1)[:, :, :3].transpose(0, 1).contiguous()).sum((0, 2))


def test_layer_that_cannot_move_the_samples_is_refused_before_writing() -> None:
    """A convolution fed the samples on axis 1 (its channels on axis 0) is refused, naming the
    axis, and nothing is written."""
    torch.manual_seed(2)
    model = extend(ConvOnTransposed().to(DT))
    X = torch.randn(3, 2, 6, dtype=DT)
    model.b.weight.grad_batch = "kept"  # type: ignore[attr-defined]
    refused = pytest.raises(RuntimeError, match=r"samples reach the input of Conv1d on axis 1")
    with refused, collect(BatchGrad()):
        model(X).sum().backward()
    assert model.a.weight.grad is None and model.b.weight.grad is None
    assert model.b.weight.grad_batch == "kept"  # type: ignore[attr-defined]


class MixAfterRNN(nn.Module):
    """An LSTM (either layout) whose features are centred over the samples before the head."""

    def __init__(self, batch_first: bool, read: str) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=batch_first)
        self.head = nn.Linear(4, 2)
        self.batch_first, self.read = batch_first, read

    def forward(self, x: Tensor) -> Tensor:
        out, (h, _) = self.rnn(x)
        if self.read == "hidden":
            z = h[-1]
            z = z - z.mean(0)
        elif self.read == "last":
            z = out[:, -1] if self.batch_first else out[-1]
            z = z - z.mean(0)
        else:  # a softmax over the samples' axis of the whole output
            z = torch.softmax(out, dim=0 if self.batch_first else 1)
            z = z[:, -1] if self.batch_first else z[-1]
        return self.head(z)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("read", ["hidden", "last", "softmax"])
def test_mixing_after_an_rnn_is_refused(batch_first: bool, read: str) -> None:
    torch.manual_seed(3)
    model = extend(MixAfterRNN(batch_first, read).to(DT))
    X = torch.randn(4, 5, 3, dtype=DT)
    if not batch_first:
        X = X.transpose(0, 1).contiguous()
    lf = extend(nn.CrossEntropyLoss())
    with pytest.raises(RuntimeError, match="mixes the samples"), collect(BatchGrad()):
        lf(model(X), torch.tensor([0, 1, 0, 1])).backward()
    assert all(p.grad is None for p in model.parameters())
