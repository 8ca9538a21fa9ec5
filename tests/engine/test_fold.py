"""Calls on a batch folded with another axis (:mod:`backprism.engine.fold`).

A layer called on ``[k·N, …]`` rows that are a sample-major fold of the samples (a hand-written
``h.reshape(-1, d)`` before a Linear layer, Swin's window partition) gets the per-sample
quantities of the samples — first order and curvature against dense float64 references
(``torch.func``) — whether its rule regroups the rows (Linear, LayerNorm: closed forms) or runs
the module on a sample's rows together (the generic rule, whose module may regroup the rows
itself, as Swin's masked window attention does). A fold that is not sample-major (time-major,
rows rolled or flipped across the batch) is refused before anything is written. Hypothesis
draws the reshapes, transposes and rolls, and the sizes, including ``T = N``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import (
    BatchDiagGGNExact,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from backprism.rules.generic import GenericRuleWarning
from tests.common import assert_first_order, assert_nothing_written, gather
from tests.reference import diag_blocks, ggn_blocks, per_sample_grads, per_sample_grads_loop

DT = torch.float64
TOL = {"atol": 1e-10, "rtol": 1e-8}
D, C = 3, 3


class Folded(nn.Module):
    """``pre`` on ``[N, A, B, D]``; ``fold`` turns it into rows ``[R, D]`` for ``inner`` (a
    Linear layer and a LayerNorm), ``unfold`` back; a head on the mean over positions."""

    def __init__(
        self, fold: Callable[[Tensor], Tensor], unfold: Callable[[Tensor, tuple], Tensor]
    ) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.inner = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, C)
        self.fold, self.unfold = fold, unfold

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.pre(x))
        r = self.norm(torch.tanh(self.inner(self.fold(h))))
        return self.head(self.unfold(r, h.shape).flatten(1, -2).mean(1))


#: name → (fold, unfold, sample-major)
PATTERNS: dict[str, tuple[Callable, Callable, bool]] = {
    "flatten": (lambda h: h.reshape(-1, D), lambda r, s: r.reshape(s), True),
    "merge_a": (
        lambda h: h.reshape(-1, h.shape[2], D),
        lambda r, s: r.reshape(s),
        True,
    ),
    "transpose_then_flatten": (
        lambda h: h.transpose(1, 2).reshape(-1, D),
        lambda r, s: r.reshape(s[0], s[2], s[1], D).transpose(1, 2),
        True,
    ),
    "roll_positions_then_flatten": (
        lambda h: torch.roll(h, 1, 1).reshape(-1, D),
        lambda r, s: r.reshape(s),
        True,
    ),
    "time_major": (
        lambda h: h.transpose(0, 1).reshape(-1, D),
        lambda r, s: r.reshape(s[1], s[0], s[2], D).transpose(0, 1),
        False,
    ),
    "rolled_across_samples": (
        lambda h: torch.roll(h, 1, 0).reshape(-1, D),
        lambda r, s: r.reshape(s),
        False,
    ),
    "flipped_across_samples": (
        lambda h: h.flip(0).reshape(-1, D),
        lambda r, s: r.reshape(s),
        False,
    ),
}


def _setup(pattern: str, n: int, a: int, b: int, seed: int = 0):
    fold, unfold, sample_major = PATTERNS[pattern]
    torch.manual_seed(seed)
    model = Folded(fold, unfold).to(DT)
    x = torch.randn(n, a, b, D, dtype=DT)
    y = torch.randint(0, C, (n,))
    return model, x, y, sample_major


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    pattern=st.sampled_from(list(PATTERNS)),
    n=st.integers(2, 4),
    a=st.integers(1, 4),
    b=st.integers(1, 3),
)
def test_folds_are_computed_or_refused(pattern: str, n: int, a: int, b: int) -> None:
    """Sample-major folds give the definition's per-sample gradients; other folds are
    refused before anything is written (never silently wrong, also where ``A = N``). With
    ``A = B = 1`` nothing is folded: reordering whole samples (a roll or flip over the batch)
    is an operation that mixes samples, outside this test (``docs/guide_engine.md``)."""
    model, x, y, sample_major = _setup(pattern, n, a, b)
    if not sample_major and a * b == 1:
        return
    lossfunc = nn.CrossEntropyLoss()
    extend(model)
    loss = lossfunc(model(x), y)
    exts = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    if not sample_major:
        with pytest.raises(RuntimeError, match="batch sizes"), collect(*exts):
            loss.backward()
        assert_nothing_written(model, grad_too=True)
        return
    ref = per_sample_grads(model, lossfunc, x, y)
    with collect(*exts):
        loss.backward()
    assert_first_order(model, ref, **TOL)


@pytest.mark.parametrize("pattern", ["flatten", "transpose_then_flatten"])
def test_exact_ggn_through_a_folded_batch(pattern: str) -> None:
    model, x, y, _ = _setup(pattern, 3, 2, 2)
    lossfunc = nn.CrossEntropyLoss()
    G = ggn_blocks(model, lossfunc, x, y)[0]
    extend(model)
    with collect(DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact()):
        lossfunc(model(x), y).backward()
    want = torch.diagonal(G.sum((0, 1)))
    torch.testing.assert_close(gather(model, "diag_ggn_exact", 0), want, **TOL)
    torch.testing.assert_close(gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **TOL)
    V = gather(model, "sqrt_ggn_exact", 2)
    for i in range(x.shape[0]):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[i, i], **TOL)


class WindowScale(nn.Module):
    """No closed-form rule (the generic rule): a parameter per window, applied by regrouping
    its input rows ``[N·W, D]`` into ``[N, W, D]`` — rows of one call are not independent, so a
    sample's ``W`` rows must run together (Swin's masked window attention does the same)."""

    def __init__(self, windows: int) -> None:
        super().__init__()
        self.windows = windows
        self.scale = nn.Parameter(torch.rand(windows, D) + 0.5)

    def forward(self, rows: Tensor) -> Tensor:
        r = rows.view(-1, self.windows, D) * self.scale
        return r.view(-1, D)


class Windowed(nn.Module):
    def __init__(self, windows: int) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.win = WindowScale(windows)
        self.head = nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:  # x [N, W, D]
        n = x.shape[0]
        h = torch.tanh(self.pre(x)).reshape(-1, D)
        return self.head(torch.tanh(self.win(h)).reshape(n, -1, D).sum(1))


@pytest.mark.filterwarnings("ignore:backprism. no closed-form rule")
def test_generic_module_that_regroups_its_folded_rows() -> None:
    torch.manual_seed(0)
    model = Windowed(windows=3).to(DT)
    x = torch.randn(4, 3, D, dtype=DT)
    y = torch.randint(0, C, (4,))
    lossfunc = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lossfunc, x, y)
    G = ggn_blocks(model, lossfunc, x, y)[0]
    extend(model)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(model(x), y).backward()
    assert_first_order(model, ref, **TOL)
    model.zero_grad()
    with collect(DiagGGNExact(), BatchDiagGGNExact()):
        lossfunc(model(x), y).backward()
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **TOL
    )
    torch.testing.assert_close(gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **TOL)


@pytest.mark.parametrize("pattern", [k for k, v in PATTERNS.items() if v[2]])
def test_diag_hessian_through_a_folded_batch(pattern: str) -> None:
    """DiagHessian and BatchDiagHessian through a Linear, tanh and LayerNorm on rows that fold
    the samples with positions (sample-major): exact against the dense Hessian (refused
    before)."""
    from tests.extensions.test_hessian import check_diag

    model, x, y, _ = _setup(pattern, 3, 2, 2)
    check_diag(model, nn.CrossEntropyLoss(), x, y)


def test_hutchinson_through_a_folded_batch() -> None:
    """The Hutchinson estimate (Hessian-vector products, no rule) through folded calls is
    unbiased: within 5 standard deviations of the dense diagonal (refused before)."""
    from backprism.extensions import HutchinsonDiagHessian
    from tests.reference import loss_hessian

    model, x, y, _ = _setup("transpose_then_flatten", 3, 2, 2)
    H = loss_hessian(copy.deepcopy(model), nn.CrossEntropyLoss(), x, y)
    extend(model)
    samples = 300
    with collect(HutchinsonDiagHessian(samples=samples)):
        extend(nn.CrossEntropyLoss())(model(x), y).backward()
    est = torch.cat([p.diag_h_hutchinson.reshape(-1) for p in model.parameters()])
    diag = torch.diagonal(H)
    std = ((H.square().sum(1) - diag.square()) / samples).sqrt()
    assert ((est - diag).abs() <= 5 * std + 1e-10).all()


def test_folded_batch_refuses_kfra_clearly() -> None:
    from backprism.extensions import KFRA

    model, x, y, _ = _setup("flatten", 3, 2, 2)
    extend(model)
    loss = nn.CrossEntropyLoss()(model(x), y)
    with pytest.raises(RuntimeError, match="folded batch"), collect(KFRA()):
        loss.backward()
    assert_nothing_written(model, grad_too=True)


def test_model_input_viewed_as_rows() -> None:
    """``self.inner(x.view(-1, D))`` on the model's own input (no gradient edge to follow):
    the same memory as the ``[N, T, D]`` input, so the rows are sample-major."""

    class FirstLayerFolded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(D, D)
            self.head = nn.Linear(D, C)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.inner(x.view(-1, D))).view(x.shape)
            return self.head(h.mean(1))

    torch.manual_seed(0)
    model = FirstLayerFolded().to(DT)
    _first_order_exact(model, torch.randn(3, 4, D, dtype=DT), torch.randint(0, C, (3,)))


def test_batch_norm_on_rows_that_fold_the_samples() -> None:
    """A BatchNorm1d in eval mode on ``[N·T, C]`` (Hugging Face LeViT's MLP): its rule computes
    per row and the rows of each sample are summed; every statistic, ``variance``'s ``1/N``
    too, is of the ``N`` samples."""

    class RowsNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn, self.head = nn.Linear(D, 5), nn.BatchNorm1d(5), nn.Linear(5, C)

        def forward(self, x: Tensor) -> Tensor:
            h = self.lin(x)
            return self.head(self.bn(h.flatten(0, 1)).reshape_as(h).mean(1))

    torch.manual_seed(0)
    model = RowsNorm().to(DT).eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 1.5)
        model.bn.weight.normal_()
        model.bn.bias.normal_()
    _first_order_exact(model, torch.randn(3, 4, D, dtype=DT), torch.randint(0, C, (3,)))


def test_rnn_on_rows_that_fold_the_samples() -> None:
    """An LSTM over the rows of images, ``[N·H, W, C]`` (timm's Sequencer2d): the generic rule
    runs it on a sample's ``H`` rows at once; its ``h_n`` ``[layers, N·H, hidden]`` holds the
    rows on axis 1."""

    class RowLSTM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(D, 4, num_layers=2, batch_first=True)
            self.head = nn.Linear(4, C)

        def forward(self, x: Tensor) -> Tensor:
            n, h, w, _ = x.shape
            out, _ = self.rnn(x.reshape(n * h, w, D))
            return self.head(out.reshape(n, h, w, 4).mean((1, 2)))

    torch.manual_seed(0)
    model = RowLSTM().to(DT)
    x, y = torch.randn(3, 2, 5, D, dtype=DT), torch.randint(0, C, (3,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericRuleWarning)
        _first_order_exact(model, x, y, per_sample_grads_loop)  # (vmap cannot run an LSTM)


def _first_order_exact(
    model: nn.Module, x: Tensor, y: Tensor, reference: Callable = per_sample_grads
) -> None:
    """First-order statistics of the extended ``model`` under a cross-entropy loss against
    ``torch.func``'s per-sample gradients."""
    lossfunc = nn.CrossEntropyLoss()
    ref = reference(model, lossfunc, x, y)
    extend(model)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(model(x), y).backward()
    assert_first_order(model, ref, **TOL)


def _status(n: int, make: Callable[[Tensor], Tensor]):
    """The batch status :class:`FoldAnalysis` gives ``make(h)`` for ``h`` a per-sample
    ``[n, 4, 6]`` tensor (the output of a call of batch ``n``)."""
    from backprism.engine.fold import FoldAnalysis

    w = torch.randn(6, requires_grad=True)
    h = torch.randn(n, 4, 6) * w
    out = make(h)
    anchors = {(id(h.grad_fn), h.output_nr): (0, 1)}
    return FoldAnalysis(n, anchors).status(out.grad_fn, out.output_nr)


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (lambda h: h.reshape(-1, 6), (0, 4)),
        (lambda h: h.reshape(-1, 2, 6).reshape(-1, 12), (0, 2)),
        (lambda h: h.reshape(-1), (0, 24)),
        (lambda h: h.transpose(1, 2).reshape(-1, 4), (0, 6)),
        (lambda h: h.permute(1, 0, 2), (1, 1)),
        (lambda h: h.permute(1, 0, 2).reshape(-1, 6), None),  # time-major
        (lambda h: torch.cat([h, h], 0), None),  # samples repeated after one another
        # a constant placed along another axis (Hugging Face's key cache, empty or not)
        (lambda h: torch.cat([torch.zeros(3, 0, 6), h], 1), (0, 1)),
        (lambda h: torch.cat([torch.zeros(3, 2, 6), h, h], -2), (0, 1)),
        (lambda h: torch.cat([torch.zeros(1, 4, 6), h], 0), None),
        (lambda h: h.unsqueeze(0).expand(2, -1, -1, -1).reshape(-1, 4, 6), None),
        (lambda h: h.unsqueeze(1).expand(-1, 2, -1, -1).reshape(-1, 4, 6), (0, 2)),
        (lambda h: h[::2], None),  # a slice of the samples
        (lambda h: h[:, ::2].reshape(-1, 6), (0, 2)),
        (lambda h: torch.roll(h, 1, 0), None),
        (lambda h: h.flip(0), None),
        (lambda h: h.repeat(2, 1, 1), None),
        (lambda h: h.softmax(0), None),
        (lambda h: h.softmax(-1).sum(1), (0, 1)),
        (lambda h: h.sum(0), None),
        (lambda h: torch.nn.functional.pad(h, (1, 1)).reshape(-1, 8), (0, 4)),
        (lambda h: torch.nn.functional.pad(h.transpose(0, 2), (1, 1)), None),
        # pooling and interpolation over the trailing axes, not over the samples
        (lambda h: F.interpolate(h[..., None], size=(2, 2)).reshape(-1, 4), (0, 4)),
        (lambda h: F.interpolate(h[..., None], scale_factor=2.0, mode="bilinear"), (0, 1)),
        (lambda h: F.avg_pool1d(h, 2).reshape(-1, 3), (0, 4)),
        (lambda h: F.max_pool2d(h.reshape(3, 2, 2, 6), 2), (0, 1)),
        (lambda h: F.max_pool1d(h.transpose(0, 2), 3), None),  # over the samples' axis
        (lambda h: F.adaptive_avg_pool1d(h.transpose(0, 2), 1), None),
        # along other axes than the samples': row by row
        (lambda h: h.flip(2).cumsum(1), (0, 1)),
        (lambda h: h.sort(-1).values.topk(2, 1).values, (0, 1)),
        (lambda h: h.cummax(2).values.logcumsumexp(1), (0, 1)),
        (lambda h: h.amax(-1) - h.std(-1) + h.logsumexp(2) + h.max(-1).values, (0, 1)),
        (lambda h: h[:, torch.tensor([3, 0, 0])], (0, 1)),
        (lambda h: h[..., torch.tensor([1, 5])].reshape(-1, 2), (0, 4)),
        (lambda h: h.index_select(2, torch.tensor([5, 1])), (0, 1)),
        (lambda h: h.gather(1, torch.zeros(3, 2, 6, dtype=torch.long)), (0, 1)),
        (lambda h: h[torch.arange(3), torch.tensor([0, 3, 1])], (0, 1)),  # GPT-2's pooling
        (lambda h: h[torch.tensor([True, True, True])], (0, 1)),
        (lambda h: torch.cdist(h, torch.ones(2, 6)), (0, 1)),
        (lambda h: h.reshape(3, 24).t(), (1, 1)),
        (lambda h: h.reshape(-1).t(), (0, 24)),
        (lambda h: h.repeat(1, 2, 1), (0, 1)),
        (lambda h: h.repeat(2, 1, 1, 1), (1, 1)),
        (lambda h: F.logsigmoid(h) + 2**h - torch.lerp(h, h.exp(), 0.5), (0, 1)),
        (lambda h: F.hardtanh(h).log1p().clamp(min=h), (0, 1)),
        (lambda h: F.glu(h, -1), (0, 1)),
        (lambda h: F.glu(h.reshape(-1, 4, 6)[:2], 0), None),
        (lambda h: torch.empty(3, 4, 6).copy_(h * 2), (0, 1)),
        (lambda h: torch.empty(2, 3, 4, 6).copy_(h), (1, 1)),
        (lambda h: (h + 1).as_strided((3, 4, 6), (24, 6, 1)), (0, 1)),
        (lambda h: (h + 1).as_strided((3, 4, 6), (1, 3, 12)), None),  # samples interleaved
        (lambda h: torch.tril(h) + torch.triu(h, 1), (0, 1)),
        (lambda h: F.prelu(h.transpose(1, 2), torch.tensor([0.2])), (0, 1)),
        (lambda h: h.unfold(2, 2, 2).flatten(2), (0, 1)),
        (lambda h: h.unfold(0, 2, 1), None),  # windows over the samples
        (lambda h: F.unfold(h[:, None], (2, 2)), (0, 1)),
        (lambda h: torch.baddbmm(h[:, :, :4], h, h.transpose(1, 2)), (0, 1)),
        (lambda h: torch.baddbmm(torch.zeros(1, 4, 4), h, h.transpose(1, 2), alpha=0.5), (0, 1)),
        # batch normalisation: with running statistics row by row, with the batch's a mixing
        (lambda h: F.batch_norm(h, torch.zeros(4), torch.ones(4)).reshape(-1, 6), (0, 4)),
        (lambda h: F.batch_norm(h, None, None, training=True), None),
        (lambda h: F.batch_norm(h.transpose(0, 1), torch.zeros(3), torch.ones(3)), None),
    ],
)
def test_batch_status_of_operations(make: Callable[[Tensor], Tensor], want) -> None:
    """What the analysis follows, and what it must not take for a sample-major fold."""
    assert _status(3, make) == want


class Mixing(nn.Module):
    """``mix`` combines the samples between two Linear layers."""

    def __init__(self, mix: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, 4), nn.Linear(4, C)
        self.mix = mix

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.mix(self.l1(x))))


@pytest.mark.parametrize(
    "mix",
    [
        lambda h: h - h.mean(0, keepdim=True),  # centring over the batch
        lambda h: h * h.softmax(0),  # a softmax over the samples
        lambda h: torch.softmax(h @ h.T, -1) @ h,  # attention across the samples
        lambda h: h + 0.5 * h.flip(0),  # every sample with its mirror
        lambda h: h + torch.roll(h, 1, 0),
        lambda h: h.cumsum(0),
        lambda h: h.sort(0).values,
        lambda h: h.cummax(0).values,
        lambda h: h.topk(2, 0).values.sum(0) * h,
        lambda h: h - h.mean(),  # a mean over everything
        lambda h: h / h.norm(),
        lambda h: h / h.std(0),
        lambda h: h - h.amax(0),
        lambda h: h + h[torch.tensor([4, 0, 1, 2, 3])],  # mixup with a permutation
        lambda h: h.index_select(0, torch.tensor([0, 0, 1, 2, 3])),  # a sample repeated
        lambda h: h.gather(0, torch.tensor([[1, 0, 0, 0]] * 5)),
        lambda h: h * torch.cdist(h, h + 1.0).sum(1, keepdim=True),  # (no zero distance)
        lambda h: h.repeat(2, 1).reshape(5, 2, 4).sum(1),  # samples repeated, then paired
        lambda h: torch.cat([h.unfold(0, 2, 1).sum(-1), h[-1:]]),  # neighbours' windows
        lambda h: F.batch_norm(h, None, None, training=True),
    ],
    ids=[
        "centring", "softmax_over_samples", "attention_across_samples", "flip", "roll",
        "cumsum", "sort", "cummax", "topk", "mean_of_all", "norm_of_all", "std_over_samples",
        "amax_over_samples", "permutation", "repeat_by_index", "gather_over_samples", "cdist",
        "repeat", "unfold_over_samples", "functional_batch_norm_in_train_mode",
    ],
)
def test_mixing_inside_the_model(mix: Callable[[Tensor], Tensor]) -> None:
    """Per-sample quantities refused before anything is written; the whole batch's GGN
    diagonal (the definition: ``Jᵀ H J`` of the whole batch, ``torch.func``) computed."""
    from torch.func import hessian

    torch.manual_seed(0)
    model = Mixing(mix).to(DT)
    x, y = torch.randn(5, D, dtype=DT), torch.randint(0, C, (5,))
    lossfunc = nn.CrossEntropyLoss()
    extend(model)
    with pytest.raises(RuntimeError, match="mixes the samples"), collect(BatchGrad()):
        lossfunc(model(x), y).backward()
    assert_nothing_written(model, grad_too=True)
    # the Jacobian row by row with autograd (jacrev's vmap gets cdist's wrong, torch 2.13)
    out = model(x).flatten()
    rows = [torch.autograd.grad(o, list(model.parameters()), retain_graph=True) for o in out]
    H = hessian(lambda z: lossfunc(z, y))(model(x).detach()).reshape(5 * C, 5 * C)
    with collect(DiagGGNExact()):
        lossfunc(model(x), y).backward()
    for i, p in enumerate(model.parameters()):
        j = torch.stack([r[i].flatten() for r in rows])
        want = torch.einsum("oi,op,pi->i", j, H, j).reshape(p.shape)
        torch.testing.assert_close(p.diag_ggn_exact, want, **TOL)


@pytest.mark.parametrize(
    "keep",
    [
        lambda h: h.flip(1).cumsum(1).sort(1).values,
        lambda h: h - h.mean(-1, keepdim=True) + h.amax(1, keepdim=True) / h.norm(dim=1)[:, None],
        lambda h: h[:, torch.tensor([3, 1, 2, 0])] + h.index_select(1, torch.tensor([0, 0, 1, 2])),
        lambda h: h[torch.arange(h.shape[0])]
        * torch.cdist(h, torch.ones(2, 4, dtype=DT)).sum(1)[:, None],
    ],
    ids=["along_features", "statistics_per_sample", "index_features", "identity_index"],
)
def test_operations_along_other_axes_are_not_refused(keep: Callable[[Tensor], Tensor]) -> None:
    """The same operations along the features (or an index that keeps every sample in its
    place) do not mix the samples: per-sample gradients against ``torch.func``."""
    torch.manual_seed(0)
    model = Mixing(keep).to(DT)
    _first_order_exact(model, torch.randn(5, D, dtype=DT), torch.randint(0, C, (5,)))


class _Centre(torch.autograd.Function):
    """Subtracts the batch mean: mixes the samples behind a node the analysis cannot read."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        return h - h.mean(0, keepdim=True)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g - g.mean(0, keepdim=True)


class _Cube(torch.autograd.Function):
    """``h³`` sample by sample (``torch.func``-ready, for the reference)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h: Tensor) -> Tensor:
        return h**3

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        return 3 * h**2 * g


def test_custom_functions_are_probed_or_declared() -> None:
    """A custom ``autograd.Function`` on the samples' way is probed through its backward
    (:mod:`backprism.engine.probe`): a sample-wise one passes without a warning, a mixing one
    is refused before anything is written; once declared with ``keeps_samples_apart`` it is
    followed like an elementwise operation instead, which also finds a mixing behind it. (More
    in ``tests/engine/test_probe.py``.)"""
    from backprism import keeps_samples_apart
    from backprism.engine import UncheckedOperationWarning

    torch.manual_seed(0)
    x, y = torch.randn(5, D, dtype=DT), torch.randint(0, C, (5,))
    lossfunc = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedOperationWarning)
        _first_order_exact(Mixing(_Cube.apply).to(DT), x, y)
        model = extend(Mixing(_Centre.apply).to(DT))
        with pytest.raises(RuntimeError, match=r"_Centre \(probed"), collect(BatchGrad()):
            lossfunc(model(x), y).backward()
        assert_nothing_written(model, grad_too=True)
    with pytest.raises(TypeError, match=r"subclass of torch\.autograd\.Function"):
        keeps_samples_apart(lambda h: h)

    class Cube(_Cube):
        pass

    assert keeps_samples_apart(Cube) is Cube
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedOperationWarning)
        _first_order_exact(Mixing(Cube.apply).to(DT), x, y)
        model = extend(Mixing(lambda h: Cube.apply(h) - h.mean(0)).to(DT))
        with pytest.raises(RuntimeError, match="mixes the samples"), collect(BatchGrad()):
            lossfunc(model(x), y).backward()
        assert_nothing_written(model, grad_too=True)


def test_in_place_operation_on_a_view_is_named() -> None:
    """Autograd's node for an in-place operation on a view (``CopySlices``) does not say which
    operation ran: ``h[:, 0].cumsum_(0)`` mixes the samples where ``h[:, 0] = 0`` does not, so
    both are named rather than followed."""
    from backprism.engine import UncheckedOperationWarning

    def cumsum_in_view(h: Tensor) -> Tensor:
        h = h * 1
        h[:, 0].cumsum_(0)
        return h

    torch.manual_seed(0)
    model = extend(Mixing(cumsum_in_view).to(DT))
    x, y = torch.randn(5, D, dtype=DT), torch.randint(0, C, (5,))
    with pytest.warns(UncheckedOperationWarning, match="CopySlices"), collect(BatchGrad()):
        nn.CrossEntropyLoss()(model(x), y).backward()


@pytest.mark.parametrize("pattern", ["flatten", "merge_a"])
def test_a_frozen_weight_between_folded_calls(pattern: str) -> None:
    """A Linear layer on the folded rows whose weight is frozen (its bias trained): its
    product's other operand is outside the graph, the same matrix for every row, so the rows'
    status passes to the LayerNorm after it (a Swin block with a frozen ``qkv.weight`` was
    refused with calls of batch sizes ``N`` and ``windows·N``). First order and the exact GGN
    diagonal against ``torch.func``."""
    model, x, y, _ = _setup(pattern, 3, 2, 2)
    model.inner.weight.requires_grad_(False)
    lossfunc = nn.CrossEntropyLoss()
    G = ggn_blocks(model, lossfunc, x, y)[0]
    _first_order_exact(model, x, y)
    with collect(DiagGGNExact()):
        lossfunc(model(x), y).backward()
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **TOL
    )


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_one_sample_folded_with_another_axis(pattern: str) -> None:
    """One sample (a rank's last batch under DDP): the calls of other batch sizes are folds of
    it, whatever their order (there is nothing to mix); they were refused (calls of batch
    sizes 1 and k). First order against ``torch.func``."""
    model, x, y, _ = _setup(pattern, 1, 2, 2)
    _first_order_exact(model, x, y)
