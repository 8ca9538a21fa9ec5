"""Forwards without the forward mode (``engine.functional``, ``MODE_FREE``): once a model's
recorded forward showed that the mode has nothing to do in it, its later forwards outside
``collect`` run without it. Every result of a backward through such a forward is checked here
against dense float64 references (``torch.func``), and every path the mode would have seen —
a functional nonlinearity, a functional parameter use — is refused, never missed, after which
the model is recorded again."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from backprism import collect, extend
from backprism.engine.functional import ForwardMode
from backprism.engine.residual import NonlinearityError
from backprism.engine.state import FORWARD, MODE_FREE
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, SumGradSquared, Variance
from backprism.extensions.hessian import DiagHessian
from backprism.rules.attention import MultiheadAttentionRule
from tests.common import assert_first_order
from tests.reference import diag_ggn, loss_hessian, per_sample_grads, per_sample_grads_loop

pytestmark = pytest.mark.usefixtures("float64_default")

FIRST = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)


class Switch(nn.Module):
    """An MLP with an activation module; with ``extra`` set, its forward also takes a path
    the mode would have recorded: a functional ``tanh`` or a functional use of a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)
        self.extra: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.a(x))
        if self.extra == "tanh":
            h = torch.tanh(h)
        out = self.b(h)
        if self.extra == "weight":
            out = out + h @ self.b.weight.T
        return out


def _mode_calls() -> mock._patch:
    """Patch counting the forward mode's dispatches."""
    return mock.patch.object(
        ForwardMode, "__torch_function__", autospec=True, side_effect=ForwardMode.__torch_function__
    )


def _data(n: int = 5) -> tuple[Tensor, Tensor]:
    torch.manual_seed(0)
    return torch.randn(n, 3), torch.randn(n, 2)


def _learn(model: nn.Module, lossfunc: nn.Module, X: Tensor, y: Tensor) -> None:
    model.zero_grad()
    lossfunc(model(X), y).backward()
    model.zero_grad()


def _refused_before_writing(
    model: nn.Module, lossfunc: nn.Module, X: Tensor, y: Tensor, match: str
) -> None:
    """A DiagHessian pass through a forward outside collect is refused (``match``) before
    anything is written."""
    loss = lossfunc(model(X), y)
    with pytest.raises(NonlinearityError, match=match), collect(DiagHessian()):
        loss.backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())


def _check_diag_h(model: nn.Module, lossfunc: nn.Module, X: Tensor, y: Tensor) -> None:
    """DiagHessian of a backward through a forward outside collect, against the dense
    Hessian's diagonal."""
    loss = lossfunc(model(X), y)
    with collect(DiagHessian()):
        loss.backward()
    h = torch.diagonal(loss_hessian(model, lossfunc, X, y))
    torch.testing.assert_close(torch.cat([p.diag_h.flatten() for p in model.parameters()]), h)


def test_learned_then_forwards_without_the_mode():
    model, lf = extend(Switch()), extend(nn.MSELoss())
    X, y = _data()
    with _mode_calls() as calls:
        _learn(model, lf, X, y)
        assert calls.call_count > 0  # the first forward is recorded
        assert MODE_FREE[model][True] is not None
        calls.reset_mock()
        lf(model(X), y).backward()
        assert calls.call_count == 0
    assert not FORWARD.modes and torch._C._len_torch_function_stack() == 0


def test_results_through_a_forward_without_the_mode():
    """First-order statistics, the GGN and the Hessian diagonal of a backward through a forward
    without the mode, against dense references (the activation module's hook records the
    residual site the mode would have)."""
    torch.manual_seed(1)
    model, lf = extend(Switch()), extend(nn.MSELoss())
    X, y = _data()
    _learn(model, lf, X, y)
    ref = per_sample_grads(model, lf, X, y)
    loss = lf(model(X), y)  # outside collect: no mode
    assert MODE_FREE[model][True] is not None
    with collect(*(e() for e in FIRST), DiagGGNExact(), DiagHessian()):
        loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)
    ggn = diag_ggn(model, lf, X, y)
    h = torch.diagonal(loss_hessian(model, lf, X, y))
    ours_h = torch.cat([p.diag_h.flatten() for p in model.parameters()])
    torch.testing.assert_close(ours_h, h)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ggn[name])


def test_a_functional_nonlinearity_keeps_the_mode_once_diag_hessian_is_used():
    """A functional tanh's residual record is read by the DiagHessian family alone: a model
    that has used none runs its later forwards outside collect without the mode; a DiagHessian
    backward through such a forward refuses before writing, saying why, and the model records
    its forwards from then on (DiagHessian through them exact)."""
    model, lf = extend(Switch()), extend(nn.MSELoss())
    model.extra = "tanh"
    X, y = _data()
    _learn(model, lf, X, y)
    assert MODE_FREE[model][True] is not None
    _refused_before_writing(model, lf, X, y, "DiagHessian-family extension has been used")
    _learn(model, lf, X, y)
    assert MODE_FREE[model][True] is None
    _check_diag_h(model, lf, X, y)


@pytest.mark.parametrize("planned", ["pass", "monitor", "marked"])
def test_diag_hessian_users_keep_the_mode(planned: str):
    """A model that ran a DiagHessian pass, whose parameters a monitor tracks with a quantity
    of the exact Hessian (``HessTrace``), or that the user marked (``want_residuals``) records
    its later forwards outside collect: DiagHessian through them is exact from the first."""
    from backprism.engine.residual import want_residuals
    from backprism.monitor import Monitor, quantities, schedules

    model, lf = extend(Switch()), extend(nn.MSELoss())
    model.extra = "tanh"
    X, y = _data()
    if planned == "pass":
        with collect(DiagHessian()):
            lf(model(X), y).backward()
    elif planned == "monitor":
        Monitor(model.parameters(), [quantities.HessTrace(schedules.linear(5))])
    else:
        want_residuals(model.parameters())
    _learn(model, lf, X, y)
    assert MODE_FREE[model][True] is None
    _check_diag_h(model, lf, X, y)


def _exact_without_the_mode(model: nn.Module, lf: nn.Module, X: Tensor, y: Tensor) -> None:
    """After one recorded forward, ``model``'s next forward outside collect makes no mode
    dispatch, and first order and the GGN diagonal through it equal the references."""
    ref = per_sample_grads(model, lf, X, y)
    _learn(model, lf, X, y)
    assert MODE_FREE[model][True] is not None
    with _mode_calls() as calls:
        loss = lf(model(X), y)
        assert calls.call_count == 0
    with collect(*(e() for e in FIRST), DiagGGNExact()):
        loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diag_ggn(model, lf, X, y)[name])
    model.zero_grad()


class Attending(Switch):
    """A functional ``tanh`` (a Hessian residual record) and a softmax (a row-wise one) of a
    product of two values that depend on the same parameters, as in a transformer's attention
    ``softmax(q kᵀ)`` and its GELU/SiLU internals."""

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.act(self.a(x)))
        return self.b(torch.softmax(h * h.flip(-1), -1))


def test_functional_nonlinearities_under_a_shared_product_free_the_mode():
    """Records only the DiagHessian family uses, in a model that has used none: later forwards
    outside collect run without the mode (a transformer's), first order and the GGN diagonal
    through them are exact, and DiagHessian is refused before anything is written (the
    softmax was not recorded)."""
    torch.manual_seed(1)
    model, lf = extend(Attending()), extend(nn.MSELoss())
    _exact_without_the_mode(model, lf, *_data())
    loss = lf(model(_data()[0]), _data()[1])
    with pytest.raises(NonlinearityError, match=r"softmax|product"), collect(DiagHessian()):
        loss.backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())


class AddedPositions(nn.Module):
    """Token embeddings plus position embeddings of ``arange(T)[None]`` (batch size 1), added
    as they are (GPT-2, BERT), or scaled by ``alpha``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(7, 4), nn.Embedding(5, 4), nn.Linear(4, 3)
        self.alpha = 1.0

    def forward(self, x: Tensor) -> Tensor:
        pos = self.pos(torch.arange(x.shape[1])[None])
        h = self.tok(x) + pos if self.alpha == 1.0 else torch.add(self.tok(x), pos, alpha=2.0)
        return self.head(h.mean(1))


def test_position_embeddings_widened_by_the_backward_pass():
    """The mode widens a batch-1 call added to the samples as it is; so does a backward pass
    through a forward without the mode, at the addition: the same first order and GGN
    diagonal. Scaled (``alpha = 2``) the addition's gradient is not the call's: refused before
    anything is written, and the model recorded again."""
    torch.manual_seed(0)
    model, lf = extend(AddedPositions()), extend(nn.CrossEntropyLoss())
    X, y = torch.randint(0, 7, (3, 5)), torch.randint(0, 3, (3,))
    _exact_without_the_mode(model, lf, X, y)
    model.alpha = 2.0
    loss = lf(model(X), y)
    with pytest.raises(RuntimeError, match="batch sizes 1 and 3"), collect(BatchGrad()):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert MODE_FREE[model][True] is None


def test_a_new_functional_nonlinearity_is_refused_then_recorded():
    """The learned forward had no functional tanh; a later one has: DiagHessian refuses (the
    residual site is missing) before writing, and the next forward is recorded and exact."""
    model, lf = extend(Switch()), extend(nn.MSELoss())
    X, y = _data()
    _learn(model, lf, X, y)
    model.extra = "tanh"
    loss = lf(model(X), y)
    with pytest.raises(NonlinearityError, match=r"'tanh'.*recorded again"), collect(DiagHessian()):
        loss.backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())
    assert MODE_FREE[model][True] is None
    _check_diag_h(model, lf, X, y)


def test_a_new_functional_parameter_use_is_refused_then_recorded():
    model, lf = extend(Switch()), extend(nn.MSELoss())
    X, y = _data()
    _learn(model, lf, X, y)
    model.extra = "weight"
    loss = lf(model(X), y)
    with pytest.raises(RuntimeError, match=r"'b\.weight'.*recorded again"), collect(BatchGrad()):
        loss.backward()
    assert all(p.grad is None and not hasattr(p, "grad_batch") for p in model.parameters())
    ref = per_sample_grads(model, lf, X, y)
    loss = lf(model(X), y)
    with collect(*(e() for e in FIRST)):
        loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)


def test_train_and_eval_are_learned_apart():
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)))
    X, _ = _data()
    model(X)
    assert set(MODE_FREE[model]) == {True}
    model.eval()
    with _mode_calls() as calls:
        model(X)
        assert calls.call_count > 0
    assert set(MODE_FREE[model]) == {True, False}


def test_functional_call_does_not_teach():
    """A forward through ``torch.func.functional_call`` sees stand-ins for the parameters, so
    it cannot show that the mode is not needed."""
    model = extend(Switch())
    model.extra = "weight"
    X, _ = _data()
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    torch.func.functional_call(model, params, (X,))
    assert model not in MODE_FREE or MODE_FREE[model].get(True, None) is None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_attention_releases_its_projection_without_the_mode():
    """Self-attention in a forward without the mode still takes the released path (the mode is
    entered for its forward alone): no recomputed forward, statistics against ``torch.func``,
    and the mode is left afterwards."""
    torch.manual_seed(2)
    model, lf = extend(Block()), extend(nn.MSELoss())
    X, y = torch.randn(3, 5, 4), torch.randn(3, 2)
    _learn(model, lf, X, y)
    assert MODE_FREE[model][True] is not None
    ref = per_sample_grads(model, lf, X, y)
    with mock.patch.object(
        MultiheadAttentionRule, "_compute_forward", side_effect=AssertionError("recomputed")
    ):
        loss = lf(model(X), y)
        assert not FORWARD.modes and torch._C._len_torch_function_stack() == 0
        with collect(*(e() for e in FIRST)):
            loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)


def test_attention_that_raises_leaves_no_mode_behind():
    torch.manual_seed(2)
    model, lf = extend(Block()), extend(nn.MSELoss())
    X, y = torch.randn(3, 5, 4), torch.randn(3, 2)
    _learn(model, lf, X, y)
    with pytest.raises(AssertionError, match="embedding dimension"):
        model(torch.randn(3, 5, 3))  # wrong feature size: the attention's forward raises
    assert not FORWARD.modes and torch._C._len_torch_function_stack() == 0
    lf(model(X), y).backward()  # and the next forward is fine


def test_layer_norm_is_refused_for_diag_hessian_as_with_the_mode():
    """A transformer encoder layer needs no mode for first-order statistics; its LayerNorm and
    attention have no residual decomposition, refused by the graph walk as by the mode."""
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=True)
    model, lf = extend(nn.Sequential(layer, nn.Flatten(), nn.Linear(20, 2))), extend(nn.MSELoss())
    X, y = torch.randn(3, 5, 4), torch.randn(3, 2)
    _learn(model, lf, X, y)
    assert MODE_FREE[model][True] is not None
    loss = lf(model(X), y)
    match = r"nonlinearly|layer_norm|attention"
    with pytest.raises(NonlinearityError, match=match), collect(DiagHessian()):
        loss.backward()


class Positions(nn.Module):
    """Token embeddings plus, with ``broadcast`` set, position embeddings of shape ``[1, T]``
    scaled and broadcast over the samples (the mode expands that call to the batch; the
    backward pass widens only a call added as it is, :class:`AddedPositions`)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(7, 3), nn.Embedding(4, 3), nn.Linear(3, 2)
        self.broadcast = False

    def forward(self, idx: Tensor) -> Tensor:
        h = self.tok(idx)
        if self.broadcast:
            h = h + 0.5 * self.pos(torch.arange(idx.shape[1])[None])
        return self.head(h.mean(1))


def test_a_new_broadcast_call_is_refused_then_recorded():
    torch.manual_seed(4)
    model, lf = extend(Positions()), extend(nn.MSELoss())
    X, y = torch.randint(0, 7, (5, 4)), torch.randn(5, 2)
    _learn(model, lf, X, y)
    model.broadcast = True
    loss = lf(model(X), y)
    match = r"batch sizes 1 and 5.*recorded again"
    with pytest.raises(RuntimeError, match=match), collect(BatchGrad()):
        loss.backward()
    ref = per_sample_grads(model, lf, X, y)
    loss = lf(model(X), y)
    with collect(*(e() for e in FIRST)):
        loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)


def test_extend_again_forgets_what_was_learned():
    model = extend(Switch())
    X, _ = _data()
    model(X)
    assert model in MODE_FREE
    extend(model)
    assert model not in MODE_FREE


class MaybeRecurrent(nn.Module):
    """A Linear, and with ``rnn`` set a ``batch_first=False`` RNN after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.rnn, self.head = nn.Linear(3, 3), nn.RNN(3, 3), nn.Linear(3, 2)
        self.use_rnn = False

    def forward(self, x: Tensor) -> Tensor:  # x: [N, T, 3]
        h = self.lin(x)
        if self.use_rnn:
            h = self.rnn(h.transpose(0, 1))[0].transpose(0, 1)
        return self.head(h.mean(1))


def test_a_sequence_first_layer_appearing_later_is_recorded_again():
    """The mode follows the batch axis of a ``batch_first=False`` RNN's outputs through
    operations; a forward without it forgets what was learned, and the next forward is
    recorded: its statistics match ``torch.func``."""
    torch.manual_seed(5)
    model, lf = extend(MaybeRecurrent()), extend(nn.MSELoss())
    X, y = torch.randn(4, 6, 3), torch.randn(4, 2)
    _learn(model, lf, X, y)
    assert MODE_FREE[model][True] is not None
    model.use_rnn = True
    model(X)  # without the mode: forgets
    assert MODE_FREE[model][True] is None
    ref = per_sample_grads_loop(model, lf, X, y)
    loss = lf(model(X), y)
    with collect(*(e() for e in FIRST)):
        loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["local_response_norm", "shared", "generic", "custom_function"])
def test_refusals_hold_without_the_mode(case: str):
    """Every DiagHessian refusal of a recorded forward (``test_residual``'s cases) holds for a
    forward without the mode, before anything is written, with a message naming the kind of
    operation. (Products of values that share parameters are built without the mode too:
    ``tests/extensions/test_bilinear.py``.)"""
    from tests.engine.test_residual import CASES

    torch.manual_seed(8)
    make, shape, _ = CASES[case]
    X, y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))
    model, lf = extend(make()), extend(nn.CrossEntropyLoss())
    _learn(model, lf, X, y)
    free = MODE_FREE[model][True] is not None
    loss = lf(model(X), y)
    # (local_response_norm, decomposed: its division's term is built, its pow is then the
    # elementwise nonlinearity no site recorded)
    expected = (
        r"product|matmul|softmax|_norm|division|nonlinearly|several calls|not known|custom"
        r"|'pow' between the parameters and the loss was not recorded"
    )
    with pytest.raises(NonlinearityError, match=expected), collect(DiagHessian()):
        loss.backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())
    # (no DiagHessian pass ran: every model here runs without the mode, "shared"'s functional
    # tanh included)
    assert free


class Mixer(nn.Module):
    """A parameter-free container of hooked layers (timm's ``Block``/``Sequential`` of blocks
    are such): its operations are not its parent's forward's body."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(d, d), nn.Tanh())

    def forward(self, h: Tensor, scale: Tensor | None = None) -> Tensor:
        h = h + torch.softmax(h @ h.transpose(1, 2), -1) @ self.inner(h)
        return h if scale is None else h * scale  # a parameter of the caller's, used here


class NormSubclass(nn.LayerNorm):
    """timm's ``LayerNorm2d``: a LayerNorm subclass overriding ``forward`` (it releases its
    parameters to the ``F.layer_norm`` inside)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.transpose(1, 2), self.normalized_shape, self.weight, self.bias)


class Tokens(nn.Module):
    """A ViT's root in miniature: its own ``cls`` token expanded and concatenated, ``pos``
    added, a layer scale ``gamma`` multiplied in its forward's body — with a parameter-free
    container of blocks and hooked layers called in between. With ``inside`` set, ``gamma`` is
    used inside that container instead (not in the body)."""

    def __init__(self, inside: bool = False) -> None:
        super().__init__()
        d, t = 4, 3
        self.embed = nn.Linear(3, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, t + 1, d))
        self.gamma = nn.Parameter(torch.rand(d) + 0.5)
        self.blocks = Mixer(d)
        self.norm = NormSubclass(t + 1)
        self.head = nn.Linear(d, 2)
        self.inside = inside

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos
        if self.inside:
            h = self.blocks(h, self.gamma)
        else:
            h = self.blocks(h) * self.gamma
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h[:, 0])


def _learned(model: nn.Module) -> tuple[nn.Module, nn.Module, Tensor, Tensor, dict]:
    """``model`` extended with a mean squared error, its data, its per-sample gradients
    (``torch.func``), after the recorded forward outside collect."""
    torch.manual_seed(5)
    X, y = torch.randn(4, 3, 3), torch.randn(4, 2)
    model, lf = extend(model), extend(nn.MSELoss())
    ref = per_sample_grads(model, lf, X, y)
    _learn(model, lf, X, y)
    return model, lf, X, y, ref


def test_parameters_used_in_a_forwards_body_without_the_mode():
    """Parameters a module uses in its own forward (a ViT's ``cls_token``/``pos_embed``, a
    ConvNeXt block's ``gamma``, a norm subclass's ``F.layer_norm``) no longer keep the mode: a
    forward outside collect runs the mode for those forwards' bodies only — never inside the
    sub-modules they call — and first order and the GGN diagonal through it are exact."""
    torch.manual_seed(6)
    model, lf, X, y, ref = _learned(Tokens())
    assert MODE_FREE[model][True] is not None
    names: list[str] = []
    original = ForwardMode.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        names.append(getattr(func, "__name__", ""))
        return original(self, func, types, args, kwargs)

    with mock.patch.object(ForwardMode, "__torch_function__", spy):
        loss = lf(model(X), y)
    assert names and not {"softmax", "tanh", "linear", "matmul"} & set(names)
    assert not FORWARD.modes and torch._C._len_torch_function_stack() == 0
    with collect(*(e() for e in FIRST), DiagGGNExact()):
        loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)
    ggn = diag_ggn(model, lf, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ggn[name], msg=name)


def test_a_parameter_used_inside_a_child_keeps_the_mode():
    """``gamma`` used inside the parameter-free container rather than in its owner's body: only
    the mode sees that use, so the model keeps it, and the results are exact."""
    torch.manual_seed(6)
    model, lf, X, y, ref = _learned(Tokens(inside=True))
    assert MODE_FREE[model][True] is None
    loss = lf(model(X), y)
    with collect(*(e() for e in FIRST)):
        loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)


class Raising(Mixer):
    def forward(self, h: Tensor) -> Tensor:
        raise ValueError("inside the blocks")


def test_a_child_that_raises_in_a_body_leaves_no_mode_behind():
    torch.manual_seed(6)
    model, lf, X, y, _ = _learned(Tokens())
    blocks = model.blocks
    model.blocks = Raising(4)
    extend(model)
    with pytest.raises(ValueError, match="inside the blocks"):
        model(X)
    assert not FORWARD.modes and torch._C._len_torch_function_stack() == 0
    model.blocks = blocks
    lf(model(X), y).backward()


class Own(TorchFunctionMode):
    """A user's mode entered inside a forward's body around a sub-module call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class WithOwnMode(Tokens):
    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x) + self.pos[:, 1:]
        with Own():
            h = self.blocks(h)
        return self.head((h * self.gamma).mean(1))


def test_a_users_mode_around_a_child_is_left_in_place():
    """A mode the user enters inside the body stays where it is: the body's own mode is not
    left from under it (it stays on for the call), and the results are exact."""
    torch.manual_seed(6)
    model, lf, X, y, ref = _learned(WithOwnMode())
    assert MODE_FREE[model][True] is not None
    loss = lf(model(X), y)
    assert not FORWARD.modes and torch._C._len_torch_function_stack() == 0
    with collect(*(e() for e in FIRST)):
        loss.backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ forwards inside collect()
def test_forwards_inside_collect_learn_and_run_without_the_mode():
    """Inside a ``collect()`` that records no nonlinearities (no DiagHessian) and needs no
    double backward, the model's first forward is recorded and its later ones run without the
    mode, exact; what they learned is kept apart from what forwards outside ``collect`` (which
    record nonlinearities) learn, and a DiagHessian ``collect`` keeps the mode."""
    torch.manual_seed(1)
    model, lf = extend(Switch()), extend(nn.MSELoss())
    X, y = _data()
    ref = per_sample_grads(model, lf, X, y)
    ggn = diag_ggn(model, lf, X, y)
    with _mode_calls() as calls:
        for step in range(2):
            model.zero_grad()
            with collect(*(e() for e in FIRST), DiagGGNExact()):
                lf(model(X), y).backward()
            assert (calls.call_count > 0) == (step == 0)
            calls.reset_mock()
            assert_first_order(model, ref, rtol=1e-10, atol=1e-12)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.diag_ggn_exact, ggn[name])
        assert set(MODE_FREE[model]) == {("unrecorded", True)}
        calls.reset_mock()
        model(X)  # outside collect: learns for itself
        assert calls.call_count > 0 and MODE_FREE[model][True] is not None
        calls.reset_mock()
        model.zero_grad()
        with collect(DiagHessian()):
            lf(model(X), y).backward()
        assert calls.call_count > 0
    _check_diag_h(model, lf, X, y)
    assert not FORWARD.modes and not FORWARD.unrecorded
    assert torch._C._len_torch_function_stack() == 0


def test_a_forward_without_the_mode_inside_collect_is_unrecorded():
    """Like a recorded forward inside a ``collect()`` without DiagHessian, one without the
    mode leaves its nonlinearities unrecorded: a DiagHessian backward of its graph refuses
    before writing."""
    model, lf = extend(Switch()), extend(nn.MSELoss())
    X, y = _data()
    for _ in range(2):
        with collect(BatchGrad()):
            loss = lf(model(X), y)
            loss.backward(retain_graph=True)
    assert MODE_FREE[model][("unrecorded", True)] is not None
    for p in model.parameters():
        p.grad = None
    with pytest.raises(RuntimeError, match="without a DiagHessian-family"), collect(DiagHessian()):
        loss.backward()
    assert all(p.grad is None and not hasattr(p, "diag_h") for p in model.parameters())
    assert not FORWARD.unrecorded


def test_a_new_functional_parameter_use_inside_collect_is_refused_then_recorded():
    model, lf = extend(Switch()), extend(nn.MSELoss())
    X, y = _data()
    with collect(BatchGrad()):
        lf(model(X), y).backward()
    model.extra = "weight"
    for p in model.parameters():
        p.grad = None
        del p.grad_batch
    with pytest.raises(RuntimeError, match=r"'b\.weight'.*recorded again"), collect(BatchGrad()):
        lf(model(X), y).backward()
    assert all(p.grad is None and not hasattr(p, "grad_batch") for p in model.parameters())
    ref = per_sample_grads(model, lf, X, y)
    with collect(*(e() for e in FIRST)):
        lf(model(X), y).backward()
    assert_first_order(model, ref, rtol=1e-10, atol=1e-12)


def test_a_generic_module_through_a_forward_without_the_mode():
    """A module without a rule taken by the DiagHessian family for its recorded body (a
    hand-written RMSNorm): through a forward without the mode its body carries no sites, so
    the first use is refused saying why (before anything is written); the model records from
    then on, and the next pass is exact."""
    from tests.extensions.test_hessian import Scale

    torch.manual_seed(6)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Scale("rms_norm"), nn.Linear(4, 2)))
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    for _ in range(2):
        _learn(model, lf, X, y)
    _refused_before_writing(model, lf, X, y, "ran without backprism's forward mode")
    _check_diag_h(model, lf, X, y)
