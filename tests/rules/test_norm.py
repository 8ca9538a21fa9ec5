"""Rules for normalisation layers (``backprism.rules.norm``: LayerNorm, RMSNorm, GroupNorm,
InstanceNorm, BatchNorm in eval mode) against dense float64 references from ``torch.func``.

Rule level: every rule method against per-sample vector-Jacobian products of the module's own
forward (``tests.common.check_rule``), frozen parameters, errors. End to end: the first-order
extensions on conv → norm models and the Embedding → LayerNorm sequence model, exact GGN
diagonals (also per sample) against dense Jacobians and loss Hessians, the normalised input
computed once per call; and ``DiagGGNExact``/``BatchDiagGGNExact``/``SqrtGGNExact`` on
``norm → tanh → Linear`` for every norm layer and shape (``tests/reference.py::ggn_blocks``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import backprism
from backprism.engine.rule import get_rule
from backprism.extensions import BatchGrad
from tests.common import (
    NORMS,
    RULE_COLUMNS,
    RULE_SETTINGS,
    SequenceModel,
    check_first_order_e2e,
    check_rule,
    close,
    labels,
    make_call,
    norm_model,
    randomize,
    run_family,
)
from tests.reference import batch_diag_ggn_loop

N = 2  # batch of the second-order family tests


@st.composite
def trailing_norm_cases(draw):
    n = draw(st.integers(1, 3))
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    normalized = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    seed = draw(st.integers(0, 2**16))
    return n, lead, normalized, seed


@RULE_SETTINGS
@given(trailing_norm_cases(), st.floats(1e-6, 1e-1), st.booleans())
def test_layernorm_rule(case, eps, bias):
    n, lead, normalized, seed = case
    module = randomize(nn.LayerNorm(normalized, eps=eps, bias=bias).double(), seed)
    x = torch.randn(n, *lead, *normalized, generator=torch.Generator().manual_seed(seed)).double()
    check_rule(module, x, seed)


@RULE_SETTINGS
@given(trailing_norm_cases(), st.one_of(st.none(), st.floats(1e-6, 1e-1)))
def test_rmsnorm_rule(case, eps):
    n, lead, normalized, seed = case
    module = randomize(nn.RMSNorm(normalized, eps=eps).double(), seed)
    x = torch.randn(n, *lead, *normalized, generator=torch.Generator().manual_seed(seed)).double()
    if eps is None:  # tiny inputs make finfo.eps matter
        x = x * 1e-8
    check_rule(module, x, seed)


@RULE_SETTINGS
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 2),
    st.lists(st.integers(1, 3), max_size=2),
    st.floats(1e-6, 1e-1),
    st.integers(0, 2**16),
)
def test_groupnorm_rule(n, groups, per_group, spatial, eps, seed):
    channels = groups * per_group
    if per_group == 1 and all(s == 1 for s in spatial):
        spatial = [*spatial, 2]  # PyTorch refuses a single value per group
    module = randomize(nn.GroupNorm(groups, channels, eps=eps).double(), seed)
    x = torch.randn(n, channels, *spatial, generator=torch.Generator().manual_seed(seed)).double()
    check_rule(module, x, seed)


@RULE_SETTINGS
@given(
    st.sampled_from(
        [(nn.BatchNorm1d, 0), (nn.BatchNorm1d, 1), (nn.BatchNorm2d, 2), (nn.BatchNorm3d, 3)]
    ),
    st.integers(1, 3),
    st.integers(1, 3),
    st.floats(1e-6, 1e-1),
    st.integers(0, 2**16),
)
def test_batchnorm_eval_rule(kind, n, channels, eps, seed):
    cls, nspatial = kind
    gen = torch.Generator().manual_seed(seed)
    module = randomize(cls(channels, eps=eps).double(), seed)
    with torch.no_grad():
        module.running_mean.copy_(torch.randn(channels, generator=gen))
        module.running_var.copy_(torch.rand(channels, generator=gen) + 0.1)
    module.eval()
    spatial = [2, 3, 2][:nspatial]
    x = torch.randn(n, channels, *spatial, generator=gen).double()
    check_rule(module, x, seed)


@RULE_SETTINGS
@given(
    st.sampled_from([nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d]),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from(["input", "running, train", "running, eval"]),
    st.floats(1e-6, 1e-1),
    st.integers(0, 2**16),
)
def test_instancenorm_rule(cls, n, channels, stats, eps, seed):
    """Per sample and channel over the spatial axes (train mode, or no running statistics),
    or with the running statistics (eval mode, ``track_running_stats=True``)."""
    gen = torch.Generator().manual_seed(seed)
    module = randomize(
        cls(channels, eps=eps, affine=True, track_running_stats=stats != "input").double(), seed
    )
    if stats != "input":
        with torch.no_grad():
            module.running_mean.copy_(torch.randn(channels, generator=gen))
            module.running_var.copy_(torch.rand(channels, generator=gen) + 0.1)
    module.train(stats == "running, train")
    spatial = {nn.InstanceNorm1d: [3], nn.InstanceNorm2d: [2, 3], nn.InstanceNorm3d: [2, 1, 2]}
    x = torch.randn(n, channels, *spatial[cls], generator=gen).double()
    reference = None
    if stats == "running, train":  # the same output; vmap cannot update running statistics
        reference = copy.deepcopy(module)
        reference.track_running_stats = False
        reference.running_mean = reference.running_var = None
    check_rule(module, x, seed, reference)


def test_norm_frozen_parameter_is_skipped():
    module = randomize(nn.LayerNorm(3).double(), 0)
    module.bias.requires_grad_(False)
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    call, shape = make_call(module, x)
    call.params = {k: p for k, p in module.named_parameters() if p.requires_grad}
    g = torch.randn(RULE_COLUMNS, *shape, dtype=torch.float64)
    assert set(get_rule(module).per_sample(call, g)) == {"weight"}


def test_norm_errors():
    bn = nn.BatchNorm1d(3, track_running_stats=False).double().eval()
    call, shape = make_call(bn, torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="track_running_stats"):
        get_rule(bn).per_sample(call, torch.randn(1, *shape, dtype=torch.float64))
    bn = nn.BatchNorm1d(3).double()  # train mode (KFAC-like paths reach the rule directly)
    call, shape = make_call(bn, torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="eval"):
        get_rule(bn).summed(call, torch.randn(1, *shape, dtype=torch.float64))
    ln = nn.LayerNorm([2, 3]).double()
    call, shape = make_call(ln, torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="batch axis"):
        get_rule(ln).per_sample(call, torch.randn(1, *shape, dtype=torch.float64))
    inorm = nn.InstanceNorm1d(3, affine=True).double()
    call, shape = make_call(inorm, torch.randn(3, 4, dtype=torch.float64))  # [C, L]: unbatched
    with pytest.raises(ValueError, match="unbatched"):
        get_rule(inorm).per_sample(call, torch.randn(1, *shape, dtype=torch.float64))


def _conv_model(norm: nn.Module) -> nn.Sequential:
    conv = nn.Conv2d(2, 4, 3)
    conv.requires_grad_(False)  # the Conv2d rule is tested elsewhere; here only the norms count
    return nn.Sequential(conv, norm, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2, 3))


@pytest.mark.parametrize("kind", ["group", "batch"])
def test_conv_norm_model_end_to_end(kind):
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, 4) if kind == "group" else nn.BatchNorm2d(4)
    model = randomize(_conv_model(norm).double(), 2)
    if kind == "batch":
        with torch.no_grad():
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 1.5)
        model.eval()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    check_first_order_e2e(model, nn.CrossEntropyLoss(), x, torch.tensor([0, 2, 1]))


def test_batchnorm_train_mode_error():
    model = backprism.extend(_conv_model(nn.BatchNorm2d(4)).double())
    loss_fn = backprism.extend(nn.CrossEntropyLoss())
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="eval"), backprism.collect(BatchGrad()):
        loss_fn(model(x), torch.tensor([0, 2, 1])).backward()


def _diag_ggn_models() -> list[tuple[nn.Module, Tensor, Tensor]]:
    seq = randomize(SequenceModel(5, 3, 4, 0).double(), 3)
    seq_x, seq_y = torch.tensor([[0, 2, 2, 4], [1, 1, 0, 3]]), torch.tensor([0, 3])
    group = randomize(_conv_model(nn.GroupNorm(2, 4)).double(), 5)
    bn = nn.BatchNorm2d(4)
    batch = randomize(_conv_model(bn).double(), 6).eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 1.5)
    img = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    return [(seq, seq_x, seq_y), (group, img, torch.tensor([2, 0])), (batch, img, seq_y[:2] % 3)]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["embedding-layernorm", "groupnorm", "batchnorm"])
def test_diag_ggn_end_to_end(which):
    """Second order through the engine (loss square roots from
    ``backprism.engine.loss_hessian``)."""
    pytest.importorskip("backprism.engine.loss_hessian")
    from backprism.extensions import BatchDiagGGNExact, DiagGGNExact

    torch.manual_seed(which)
    model, x, y = _diag_ggn_models()[which]
    loss_fn = nn.CrossEntropyLoss()
    batch = batch_diag_ggn_loop(model, loss_fn, x, y)
    backprism.extend(model)
    backprism.extend(loss_fn)
    with backprism.collect(DiagGGNExact(), BatchDiagGGNExact(), chunk_size=3):
        loss_fn(model(x), y).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            close(p.diag_ggn_exact_batch, batch[name])
            close(p.diag_ggn_exact, batch[name].sum(0))


def test_norm_normalizes_once_per_call(monkeypatch):
    """``x̂`` is computed once per call although several statistics need it, and the cache is
    dropped at the end of the backward pass."""
    from backprism.rules import norm

    counts: dict[int, int] = {}
    original = norm.LayerNormRule.normalized

    def counting(self, call):
        counts[id(call)] = counts.get(id(call), 0) + 1
        return original(self, call)

    monkeypatch.setattr(norm.LayerNormRule, "normalized", counting)
    model = randomize(SequenceModel(5, 3, 4, None).double(), 7)
    x, y = torch.tensor([[0, 2], [1, 1]]), torch.tensor([0, 3])
    check_first_order_e2e(model, nn.CrossEntropyLoss(), x, y)
    assert list(counts.values()) == [1]
    assert norm._LAST is None


@pytest.mark.parametrize("kind", list(NORMS))
def test_norm(kind):
    model, X = norm_model(kind, seed=3)
    run_family(model, X, labels(N, seed=3), {"chunk_size": 2})


class BatchNormAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d`` in short: a BatchNorm2d subclass whose own forward calls
    ``F.batch_norm`` (running statistics in eval mode) and then an activation."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        use_batch = self.training or self.running_mean is None
        x = torch.nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, use_batch,
            0.1, self.eps,
        )
        return self.act(x)


class FunctionalBatchNorm(nn.Module):
    """``F.batch_norm`` with the container's own scale and shift (keywords) and running
    statistics as buffers."""

    def __init__(self, channels: int, training: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, channels, 3)
        self.gamma = nn.Parameter(torch.rand(channels) + 0.5)
        self.beta = nn.Parameter(torch.randn(channels))
        self.register_buffer("mean", torch.randn(channels) * 0.1)
        self.register_buffer("var", torch.rand(channels) + 0.5)
        self.head = nn.Linear(channels * 4, 3)
        self.batch_stats = training

    def forward(self, x: Tensor) -> Tensor:
        h = torch.nn.functional.batch_norm(
            self.conv(x), self.mean, self.var, weight=self.gamma, bias=self.beta,
            training=self.batch_stats, eps=1e-3,
        )
        return self.head(torch.tanh(h).flatten(1))


def _bn_act_model() -> nn.Module:
    torch.manual_seed(0)
    model = randomize(_conv_model(BatchNormAct(4)).double(), 7).eval()
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 1.5)
    return model


def _count_generic(monkeypatch) -> list:
    from backprism.rules import generic

    seen: list = []
    real = generic.GenericRule._compute
    monkeypatch.setattr(
        generic.GenericRule, "_compute",
        lambda self, call, g: seen.append(type(call.module).__name__) or real(self, call, g),
    )
    return seen


def test_batchnorm_subclass_with_its_own_forward(monkeypatch):
    """timm's ``BatchNormAct2d`` pattern in eval mode: its ``F.batch_norm`` is attributed in
    closed form (no generic rule), first order and GGN diagonals as the references."""
    from backprism.extensions import BatchDiagGGNExact, DiagGGNExact

    generic_calls = _count_generic(monkeypatch)
    model = _bn_act_model()
    x, y = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    check_first_order_e2e(model, nn.CrossEntropyLoss(), x, y)
    batch = batch_diag_ggn_loop(model, nn.CrossEntropyLoss(), x, y)
    loss_fn = backprism.extend(nn.CrossEntropyLoss())
    with backprism.collect(DiagGGNExact(), BatchDiagGGNExact()):
        loss_fn(model(x), y).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            close(p.diag_ggn_exact_batch, batch[name])
            close(p.diag_ggn_exact, batch[name].sum(0))
    assert generic_calls == []


def test_batchnorm_subclass_in_train_mode_is_refused_before_writing():
    """Batch statistics mix the samples: per-sample quantities are refused before any
    ``.grad`` or result is written, as for ``nn.BatchNorm2d``."""
    model = backprism.extend(_bn_act_model().train())
    loss_fn = backprism.extend(nn.CrossEntropyLoss())
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"train mode.*eval"), backprism.collect(BatchGrad()):
        loss_fn(model(x), torch.tensor([0, 2, 1])).backward()
    assert all(p.grad is None and not hasattr(p, "grad_batch") for p in model.parameters())


@pytest.mark.parametrize("batch_stats", [False, True])
def test_functional_batch_norm(batch_stats: bool, monkeypatch):
    """``F.batch_norm`` on a container's own parameters (passed by keyword): the BatchNorm
    closed form with the running statistics; with ``training=True`` (batch statistics)
    refused before writing."""
    generic_calls = _count_generic(monkeypatch)
    torch.manual_seed(0)
    model = FunctionalBatchNorm(4, batch_stats).double()
    x, y = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    if not batch_stats:
        check_first_order_e2e(model, nn.CrossEntropyLoss(), x, y)
        assert generic_calls == []
        return
    backprism.extend(model)
    loss_fn = backprism.extend(nn.CrossEntropyLoss())
    with pytest.raises(RuntimeError, match=r"train mode.*eval"), backprism.collect(BatchGrad()):
        loss_fn(model(x), y).backward()
    assert all(p.grad is None and not hasattr(p, "grad_batch") for p in model.parameters())


class FunctionalInstanceNorm(nn.Module):
    """``F.instance_norm`` with the container's own scale and shift (keywords): per-sample
    statistics, or the running ones (``use_input_stats=False``)."""

    def __init__(self, channels: int, running: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, channels, 3)
        self.gamma = nn.Parameter(torch.rand(channels) + 0.5)
        self.beta = nn.Parameter(torch.randn(channels))
        self.register_buffer("mean", torch.randn(channels) * 0.1 if running else None)
        self.register_buffer("var", torch.rand(channels) + 0.5 if running else None)
        self.head = nn.Linear(channels * 4, 3)
        self.running = running

    def forward(self, x: Tensor) -> Tensor:
        h = torch.nn.functional.instance_norm(
            self.conv(x), self.mean, self.var, weight=self.gamma, bias=self.beta,
            use_input_stats=not self.running, eps=1e-3,
        )
        return self.head(torch.tanh(h).flatten(1))


@pytest.mark.parametrize("running", [False, True])
def test_functional_instance_norm(running: bool, monkeypatch):
    """``F.instance_norm`` on a container's own parameters (passed by keyword): the
    InstanceNorm closed form (no generic rule), per-sample or running statistics."""
    generic_calls = _count_generic(monkeypatch)
    torch.manual_seed(0)
    model = FunctionalInstanceNorm(4, running).double()
    x, y = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    check_first_order_e2e(model, nn.CrossEntropyLoss(), x, y)
    assert generic_calls == []
