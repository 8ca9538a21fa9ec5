"""Functional losses read back from the graph (:mod:`backprism.engine.loss_nodes`).

``F.cross_entropy``, ``F.nll_loss(F.log_softmax(·, 1))``, a plain (not extended)
``nn.CrossEntropyLoss``, ``F.mse_loss`` and ``F.binary_cross_entropy_with_logits`` end a
backward pass as an extended loss module would: the GGN diagonal, its per-sample terms and its
square root equal the dense float64 GGN of the same functional loss (``torch.func``), in every
configuration autograd saves (``weight``, ``ignore_index``, ``pos_weight``, ``sum``/``mean``,
sequence layouts ``[N·T, C]`` and ``[N, C, T]``); ``DiagHessian`` equals the dense Hessian's
diagonal; Monte-Carlo columns are unbiased. What is not recognised (label smoothing) or cannot
be placed (a time-major RNN) is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import (
    BatchDiagGGNExact,
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
)
from tests.common import assert_mc_within, assert_nothing_written, gather
from tests.reference import diag_blocks, ggn_blocks, loss_hessian, split

DT = torch.float64
N, T, D, C = 4, 3, 5, 3
TOL = {"atol": 1e-10, "rtol": 1e-8}


class Seq(nn.Module):
    """Per-position MLP on ``[N, T, D]`` (or ``[N, D]``) inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D, 6)
        self.l2 = nn.Linear(6, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _labels(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    return torch.randint(0, C, shape, generator=torch.Generator().manual_seed(seed))


def _targets(shape: tuple[int, ...]) -> Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(1), dtype=DT)


_WEIGHT = torch.tensor([0.5, 2.0, 1.0], dtype=DT)
_IGNORED = _labels((N, T))
_IGNORED[0, 1] = _IGNORED[2, 0] = -100
_WITH_ONES = _labels((N,), seed=3)

#: name → (input shape, target, functional loss)
CASES: dict[str, tuple[tuple[int, ...], Tensor, Callable[[Tensor, Tensor], Tensor]]] = {
    "cross_entropy": ((N, D), _labels((N,)), lambda o, y: F.cross_entropy(o, y)),
    "cross_entropy_weight_ignore_sum": (
        (N, D),
        _WITH_ONES,
        lambda o, y: F.cross_entropy(o, y, weight=_WEIGHT, ignore_index=1, reduction="sum"),
    ),
    "cross_entropy_flattened_sequence": (  # Hugging Face's and nanoGPT's layout
        (N, T, D),
        _IGNORED,
        lambda o, y: F.cross_entropy(o.reshape(-1, C), y.reshape(-1), ignore_index=-100),
    ),
    "cross_entropy_class_axis_1": (
        (N, T, D),
        _labels((N, T)),
        lambda o, y: F.cross_entropy(o.transpose(1, 2), y),
    ),
    "nll_after_log_softmax": (
        (N, D),
        _labels((N,)),
        lambda o, y: F.nll_loss(F.log_softmax(o, dim=1), y),
    ),
    "plain_module": ((N, D), _labels((N,)), nn.CrossEntropyLoss()),
    "mse": ((N, D), _targets((N, C)), lambda o, y: F.mse_loss(o, y)),
    "mse_sum_sequence": (
        (N, T, D),
        _targets((N, T, C)),
        lambda o, y: F.mse_loss(o, y, reduction="sum"),
    ),
    "bce_with_logits": (
        (N, D),
        _targets((N, C)).round(),
        lambda o, y: F.binary_cross_entropy_with_logits(
            o, y, pos_weight=torch.tensor([1.0, 3.0, 0.5], dtype=DT)
        ),
    ),
}


def _setup(case: str) -> tuple[nn.Module, Tensor, Tensor, Callable]:
    shape, y, lossfunc = CASES[case]
    torch.manual_seed(0)
    model = Seq().to(DT)
    x = torch.randn(*shape, dtype=DT)
    return model, x, y, lossfunc


@pytest.mark.parametrize("case", list(CASES))
def test_exact_ggn_of_functional_losses(case: str) -> None:
    model, x, y, lossfunc = _setup(case)
    G = ggn_blocks(model, lossfunc, x, y)[0]
    extend(model)
    loss = lossfunc(model(x), y)
    with collect(DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), BatchGrad()):
        loss.backward()
    want = torch.diagonal(G.sum((0, 1)))
    torch.testing.assert_close(gather(model, "diag_ggn_exact", 0), want, **TOL)
    torch.testing.assert_close(gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **TOL)
    V = gather(model, "sqrt_ggn_exact", 2)
    for i in range(N):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[i, i], **TOL)
    for p in model.parameters():  # first order in the same pass
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, **TOL)


@pytest.mark.parametrize("case", ["cross_entropy_flattened_sequence", "mse"])
def test_diag_hessian_of_functional_losses(case: str) -> None:
    model, x, y, lossfunc = _setup(case)
    H = loss_hessian(model, lossfunc, x, y)
    extend(model)
    loss = lossfunc(model(x), y)
    with collect(DiagHessian()):
        loss.backward()
    want = split(torch.diagonal(H), model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, want[name], **TOL)


def test_monte_carlo_columns_of_a_functional_cross_entropy_are_unbiased() -> None:
    model, x, y, lossfunc = _setup("cross_entropy_flattened_sequence")
    G = ggn_blocks(model, lossfunc, x, y)[0]
    extend(model)
    draws = []
    for seed in range(300):
        torch.manual_seed(seed)
        loss = lossfunc(model(x), y)
        with collect(DiagGGNMC()):
            loss.backward()
        draws.append(gather(model, "diag_ggn_mc", 0))
    draws_t = torch.stack(draws)
    assert_mc_within(draws_t.mean(0), draws_t, torch.diagonal(G.sum((0, 1))))


def test_hugging_face_style_loss_scaled_by_a_token_count() -> None:
    """``F.cross_entropy(..., reduction="sum") / num_items`` (Hugging Face's loss with
    ``num_items_in_batch``): the factor between loss node and root is read off the gradient."""
    model, x, y, _ = _setup("cross_entropy_flattened_sequence")
    count = int((y != -100).sum())

    def lossfunc(o: Tensor, t: Tensor) -> Tensor:
        return F.cross_entropy(o.reshape(-1, C), t.reshape(-1), reduction="sum") / count

    G = ggn_blocks(model, lossfunc, x, y)[0]
    extend(model)
    with collect(DiagGGNExact()):
        lossfunc(model(x), y).backward()
    want = torch.diagonal(G.sum((0, 1)))
    torch.testing.assert_close(gather(model, "diag_ggn_exact", 0), want, **TOL)


def test_label_smoothing_is_refused_with_the_extended_module_named() -> None:
    model, x, y, _ = _setup("cross_entropy")
    extend(model)
    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
    with pytest.raises(RuntimeError, match="label_smoothing"), collect(DiagGGNExact()):
        loss.backward()
    assert_nothing_written(model, grad_too=True)


def test_functional_loss_after_a_time_major_rnn_is_refused() -> None:
    """The unpacked loss input carries no batch-axis mark: with a batch_first=False RNN in the
    pass the rows could be time-major, so curvature is refused (an extended module is not)."""
    torch.manual_seed(0)
    rnn, head = nn.RNN(D, 4).to(DT), nn.Linear(4, C).to(DT)
    model = extend(nn.ModuleDict({"rnn": rnn, "head": head}))
    x = torch.randn(T, N, D, dtype=DT)
    y = _labels((T, N))

    def forward(inp: Tensor) -> Tensor:
        return head(rnn(inp)[0])

    model.forward = forward  # type: ignore[method-assign]
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, C), y.reshape(-1))
    with pytest.raises(RuntimeError, match="functional NLL loss"), collect(DiagGGNExact()):
        loss.backward()
    assert_nothing_written(model, grad_too=True)


def test_a_regulariser_through_a_functional_loss_is_still_refused() -> None:
    """``F.mse_loss(weight, 0)`` is a term on a parameter, not a loss on model outputs: the
    parameter use lies outside every module call, refused as before."""
    model, x, y, lossfunc = _setup("cross_entropy")
    extend(model)
    w = model.l1.weight
    loss = lossfunc(model(x), y) + F.mse_loss(w, torch.zeros_like(w))
    with pytest.raises(RuntimeError, match="outside the forward"), collect(DiagGGNExact()):
        loss.backward()
    assert_nothing_written(model, grad_too=True)


class Contrastive(nn.Module):
    """Two views through one encoder, normalised; logits ``z1 @ z2.T / τ`` (InfoNCE)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, 4))

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        z1 = F.normalize(self.enc(x1), dim=1)
        z2 = F.normalize(self.enc(x2), dim=1)
        return z1 @ z2.T / 0.5


@pytest.mark.parametrize("extended_loss", [False, True])
def test_contrastive_logits_refuse_per_sample_and_give_whole_batch_curvature(
    extended_loss: bool,
) -> None:
    """InfoNCE's logits compare every sample with every other: per-sample quantities do not
    exist and are refused before anything is written; the whole batch's GGN diagonal (the
    definition, ``torch.func`` over the two views) is computed."""
    torch.manual_seed(0)
    model = Contrastive().to(DT)
    x1, x2 = torch.randn(N, D, dtype=DT), torch.randn(N, D, dtype=DT)
    labels = torch.arange(N)
    lossfunc = extend(nn.CrossEntropyLoss()) if extended_loss else F.cross_entropy
    extend(model)
    with pytest.raises(RuntimeError, match="compares them"), collect(BatchGrad()):
        lossfunc(model(x1, x2), labels).backward()
    assert_nothing_written(model, grad_too=True)

    from torch.func import functional_call, jacrev

    params = {k: p.detach() for k, p in model.named_parameters()}
    logits = model(x1, x2).detach()

    def out(p: dict) -> Tensor:
        return functional_call(model, p, (x1, x2))

    J = jacrev(out)(params)
    H = torch.func.hessian(lambda z: F.cross_entropy(z, labels))(logits).reshape(N * N, N * N)
    with collect(DiagGGNExact()):
        lossfunc(model(x1, x2), labels).backward()
    for k, p in model.named_parameters():
        j = J[k].reshape(N * N, -1)
        want = torch.einsum("oi,op,pi->i", j, H, j).reshape(p.shape)
        torch.testing.assert_close(p.diag_ggn_exact, want, **TOL)


def test_log_softmax_over_the_batch_axis_is_not_taken_for_the_class_axis() -> None:
    """``log_softmax(z, dim=-3)`` of ``[N, C, T]`` logits normalises over the samples; autograd
    saves ``dim`` as an unsigned integer (``2**64 − 3``), which ``% 3`` reads as 1, the class
    axis. Refused as not a cross-entropy (the saved dimension is read signed)."""
    model, x, y, _ = _setup("cross_entropy_class_axis_1")
    extend(model)
    nll = extend(nn.NLLLoss())
    loss = nll(F.log_softmax(model(x).transpose(1, 2), dim=-3), y)
    with pytest.raises(ValueError, match="log_softmax over the class axis"), collect(
        DiagGGNExact()
    ):
        loss.backward()
