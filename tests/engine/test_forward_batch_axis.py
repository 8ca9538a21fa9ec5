"""RNNs with the batch on axis 1 (``batch_first=False``, PyTorch's and BackPACK's default).

The RNN's call takes its batch from axis 1 (input ``[T, N, features]``, ``h_0``/``h_n``
``[layers, N, hidden]``); what is computed from its outputs carries that axis through
transposes, permutations, indexing, reductions, elementwise and feature-axis operations
(Linear, Embedding); Linear and Embedding calls on such inputs take the batch from that axis
(BackPACK's recurrent example: Embedding → RNN → Linear on ``[T, N, h]``); a module or loss
whose batch axis is lost or unknown is refused before anything is written (also when
``T == N``, where taking axis 0 would be silently wrong). References: one sample at a time
(``X[:, n : n + 1]``) with autograd / ``torch.func``, float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, Variance

DT = torch.float64


class SeqFirst(nn.Module):
    """``cell`` over ``[T, N, d]``; the head reads the last step, the time-mean of the
    batch-first transpose, or the final hidden state."""

    def __init__(self, cell: str = "lstm", read: str = "last", hx: bool = False) -> None:
        super().__init__()
        cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell]
        self.rnn = cls(3, 4, num_layers=2 if cell == "gru" else 1)
        self.head = nn.Linear(4, 2)
        self.read, self.hx, self.cell = read, hx, cell

    def forward(self, x: Tensor) -> Tensor:
        if self.hx:
            h0 = torch.ones(self.rnn.num_layers, x.shape[1], 4, dtype=x.dtype) * 0.1
            out, h = self.rnn(x, (h0, h0) if self.cell == "lstm" else h0)
        else:
            out, h = self.rnn(x)
        if self.read == "last":
            return self.head(torch.tanh(out[-1]))
        if self.read == "hidden":
            h = h[0] if self.cell == "lstm" else h
            return self.head(h[-1])
        return self.head(out.transpose(0, 1)).mean(1)  # [N, T, 4] -> [N, 2]


def _data(t: int = 5, n: int = 4) -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(t, n, 3, dtype=DT), torch.randint(0, 2, (n,))


def _per_sample(model: nn.Module, X: Tensor, y: Tensor) -> dict[str, Tensor]:
    n = X.shape[1]
    names = [k for k, _ in model.named_parameters()]
    rows: dict[str, list[Tensor]] = {k: [] for k in names}
    for i in range(n):
        loss = nn.functional.cross_entropy(model(X[:, i : i + 1]), y[i : i + 1]) / n
        for k, g in zip(names, torch.autograd.grad(loss, list(model.parameters()))):
            rows[k].append(g)
    return {k: torch.stack(v) for k, v in rows.items()}


def _diag_ggn(model: nn.Module, X: Tensor, y: Tensor) -> dict[str, Tensor]:
    n = X.shape[1]
    theta = {k: p.detach() for k, p in model.named_parameters()}
    total = {k: torch.zeros_like(v) for k, v in theta.items()}
    for i in range(n):
        def f(th: dict, i: int = i) -> Tensor:
            return functional_call(model, th, (X[:, i : i + 1],))[0]

        out = f(theta)
        jac = jacrev(f)(theta)
        H = hessian(lambda o, i=i: nn.functional.cross_entropy(o[None], y[i : i + 1]) / n)(out)
        for k in theta:
            J = jac[k].reshape(out.numel(), -1)
            total[k] += torch.einsum("ci,cd,di->i", J, H, J).reshape(theta[k].shape)
    return total


@pytest.mark.parametrize(
    ("cell", "read", "hx"),
    [("lstm", "last", False), ("gru", "transpose", True), ("rnn", "hidden", False),
     ("lstm", "hidden", True)],
)
def test_first_order_and_diag_ggn(cell: str, read: str, hx: bool) -> None:
    torch.manual_seed(0)
    model = SeqFirst(cell, read, hx).to(DT)
    X, y = _data()
    gb = _per_sample(model, X, y)
    ref_diag = _diag_ggn(model, X, y)
    extend(model)
    lf = extend(nn.CrossEntropyLoss())
    with collect(BatchGrad(), BatchL2Grad(), Variance(), DiagGGNExact()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, gb[k])
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
        torch.testing.assert_close(p.batch_l2, gb[k].flatten(1).square().sum(1))
        torch.testing.assert_close(p.variance, gb[k].var(0, unbiased=False))
        torch.testing.assert_close(p.diag_ggn_exact, ref_diag[k])


class _Head(nn.Module):
    """A head applied to an activation whose batch is still on axis 1."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4)
        self.head = nn.Linear(4, 2)
        self.how = how

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        if self.how == "direct":  # Linear on [T, N, 4] (batch moved to axis 0 for its call)
            return self.head(out).mean(0)
        if self.how == "elementwise":
            return self.head(torch.relu(out) * 2.0).mean(0)
        # a reshape merges time and batch: the batch axis is lost
        return self.head(out.reshape(-1, 4)).reshape(x.shape[0], x.shape[1], 2).mean(0)


@pytest.mark.parametrize("how", ["direct", "elementwise"])
@pytest.mark.parametrize("square", [False, True], ids=["T!=N", "T==N"])
def test_linear_on_batch_axis_one(how: str, square: bool) -> None:
    torch.manual_seed(0)
    model = _Head(how).to(DT)
    X, y = _data(t=4 if square else 5, n=4)
    gb = _per_sample(model, X, y)
    extend(model)
    lf = extend(nn.CrossEntropyLoss())
    with collect(BatchGrad(), BatchL2Grad()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, gb[k], msg=k)
        torch.testing.assert_close(p.batch_l2, gb[k].flatten(1).square().sum(1), msg=k)


@pytest.mark.parametrize("square", [False, True], ids=["T!=N", "T==N"])
def test_lost_batch_axis_is_refused_before_writing(square: bool) -> None:
    torch.manual_seed(0)
    model = extend(_Head("reshape").to(DT))
    lf = extend(nn.CrossEntropyLoss())
    X, y = _data(t=4 if square else 5, n=4)
    with pytest.raises(RuntimeError, match="batch_first=False"), collect(BatchGrad()):
        lf(model(X), y).backward()
    for p in model.parameters():
        assert p.grad is None and not hasattr(p, "grad_batch")
    # a plain backward (nothing collected) is unaffected
    model.zero_grad()
    lf(model(X), y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_loss_on_seq_first_output_first_order_ok_curvature_refused() -> None:
    """An MSE directly on ``[T, N, hidden]``: per-sample gradients are right (the RNN's rule
    takes the batch from axis 1); loss-Hessian columns would group axis 0, so curvature is
    refused before writing."""
    torch.manual_seed(0)
    rnn = nn.RNN(3, 4).to(DT)
    X, _ = _data()
    target = torch.randn(5, 4, 4, dtype=DT)
    n = X.shape[1]
    names = [k for k, _ in rnn.named_parameters()]
    rows: dict[str, list[Tensor]] = {k: [] for k in names}
    for i in range(n):
        out_i = rnn(X[:, i : i + 1])[0]
        loss = nn.functional.mse_loss(out_i, target[:, i : i + 1], reduction="sum")
        loss = loss / target.numel()  # the batch's mean reduction
        for k, g in zip(names, torch.autograd.grad(loss, list(rnn.parameters()))):
            rows[k].append(g)
    model = extend(nn.Sequential(rnn))
    lf = extend(nn.MSELoss())

    class First(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return model(x)[0]

    with collect(BatchGrad()):
        lf(First()(X), target).backward()
    for k, p in rnn.named_parameters():
        torch.testing.assert_close(p.grad_batch, torch.stack(rows[k]))
    with pytest.raises(RuntimeError, match="batch_first=False"), collect(DiagGGNExact()):
        lf(First()(X), target).backward()
    assert all(not hasattr(p, "diag_ggn_exact") for p in rnn.parameters())


class BackpackStyle(nn.Module):
    """BackPACK's recurrent example layout: tokens ``[T, N]`` → Embedding → RNN
    (``batch_first=False``) → its output (``ReduceTuple(index=0)``) → Linear on ``[T, N, h]`` →
    ``permute(1, 2, 0)`` → cross-entropy over ``[N, C, T]`` with targets ``[N, T]``."""

    def __init__(self, vocab: int = 7, d: int = 3, h: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.RNN(d, h)
        self.lin = nn.Linear(h, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        out = self.rnn(self.emb(tokens))[0]
        return self.lin(out).permute(1, 2, 0)


@pytest.mark.parametrize("t", [5, 4], ids=["T!=N", "T==N"])
def test_backpack_recurrent_example_layout(t: int) -> None:
    torch.manual_seed(0)
    n, vocab = 4, 7
    model = BackpackStyle(vocab).to(DT)
    X = torch.randint(0, vocab, (t, n))
    y = torch.randint(0, vocab, (n, t))
    rows = _per_sample(model, X, y)  # the cross-entropy's mean over N·T: per sample / N
    theta = {k: p.detach() for k, p in model.named_parameters()}
    ref_diag = {k: torch.zeros_like(v) for k, v in theta.items()}
    for i in range(n):
        def f(th: dict, i: int = i) -> Tensor:
            return functional_call(model, th, (X[:, i : i + 1],))

        out = f(theta)
        jac = jacrev(f)(theta)
        H = hessian(
            lambda o, i=i: nn.functional.cross_entropy(o, y[i : i + 1], reduction="sum")
            / (n * t)
        )(out).reshape(out.numel(), out.numel())
        for k in theta:
            J = jac[k].reshape(out.numel(), -1)
            ref_diag[k] += torch.einsum("ci,cd,di->i", J, H, J).reshape(theta[k].shape)
    extend(model)
    lf = extend(nn.CrossEntropyLoss())
    with collect(BatchGrad(), Variance(), DiagGGNExact()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        gb = rows[k]
        torch.testing.assert_close(p.grad_batch, gb, msg=k)
        torch.testing.assert_close(p.variance, gb.var(0, unbiased=False), msg=k)
        torch.testing.assert_close(p.diag_ggn_exact, ref_diag[k], msg=k)


class _Indirect(BackpackStyle):
    def forward(self, tokens: Tensor) -> Tensor:
        out = self.rnn(torch.tanh(self.emb(tokens)))[0]
        return self.lin(out).permute(1, 2, 0)


def test_unknown_batch_axis_upstream_of_the_rnn_is_refused() -> None:
    """Embedding → tanh → RNN on ``[T, N]`` tokens with ``T == N``: the Embedding's batch axis
    cannot be followed (its input is raw data, its output not directly the RNN's input), and
    its input's two axes have the same size."""
    torch.manual_seed(0)
    model = extend(_Indirect().to(DT))
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randint(0, 7, (4, 4)), torch.randint(0, 7, (4, 4))
    with pytest.raises(RuntimeError, match="batch axis of Embedding"), collect(BatchGrad()):
        lf(model(X), y).backward()
    assert all(p.grad is None for p in model.parameters())


class _BatchFirstTokens(BackpackStyle):
    """Tokens ``[N, T]`` (batch first) → Embedding → transpose → RNN (``batch_first=False``)."""

    def forward(self, tokens: Tensor) -> Tensor:
        out = self.rnn(self.emb(tokens).transpose(0, 1))[0]
        return self.lin(out).permute(1, 2, 0)


def test_batch_first_embedding_before_a_sequence_first_rnn() -> None:
    """An assumed batch axis 0 whose size no other axis shares is unambiguous (a wrong guess
    would show as a batch-size mismatch): the common batch-first embedding → transpose →
    sequence-first RNN works."""
    torch.manual_seed(0)
    n, t, vocab = 4, 5, 7
    model = _BatchFirstTokens(vocab).to(DT)
    X, y = torch.randint(0, vocab, (n, t)), torch.randint(0, vocab, (n, t))
    names = [k for k, _ in model.named_parameters()]
    rows: dict[str, list[Tensor]] = {k: [] for k in names}
    for i in range(n):
        loss = nn.functional.cross_entropy(model(X[i : i + 1]), y[i : i + 1]) / n
        for k, g in zip(names, torch.autograd.grad(loss, list(model.parameters()))):
            rows[k].append(g)
    extend(model)
    lf = extend(nn.CrossEntropyLoss())
    with collect(BatchGrad()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, torch.stack(rows[k]), msg=k)


class SeqFirstEncoder(nn.Module):
    """PyTorch's default layout: ``nn.TransformerEncoderLayer(batch_first=False)`` on
    ``[T, N, d]`` (attention with the batch on axis 1, Linear and LayerNorm on ``[T, N, d]``),
    then the mean over time and a head."""

    def __init__(self, d: int = 4, heads: int = 2, classes: int = 2) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=6, dropout=0.0)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).mean(0))


@pytest.mark.parametrize("t", [5, 3], ids=["T!=N", "T==N"])
def test_sequence_first_transformer_layer(t: int) -> None:
    torch.manual_seed(0)
    model = SeqFirstEncoder().to(DT)
    X = torch.randn(t, 3, 4, dtype=DT)
    y = torch.randint(0, 2, (3,))
    gb = _per_sample(model, X, y)
    ref_diag = _diag_ggn(model, X, y)
    extend(model)
    lf = extend(nn.CrossEntropyLoss())
    with collect(BatchGrad(), Variance(), DiagGGNExact()):
        lf(model(X), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, gb[k], msg=k)
        torch.testing.assert_close(p.variance, gb[k].var(0, unbiased=False), msg=k)
        torch.testing.assert_close(p.diag_ggn_exact, ref_diag[k], msg=k)
