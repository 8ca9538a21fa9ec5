"""One backward pass (``backprism.engine.backward``): the checks that run before anything is
written (train-mode BatchNorm, empty batches, a loss that is not the extended one, terms between
the model and the loss, samples mixed across the batch), results that must not survive into the
next pass, and the column chunks a ``memory_budget`` implies (equal results; room left for the
per-sample gradients built from a chunk).

References are dense float64 from the definitions (``tests/reference.py``); a clear error is a
``RuntimeError``/``ValueError``/``NotImplementedError`` whose message names the problem, and
after it no parameter carries a (possibly partial) result.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

from backprism import collect, extend
from backprism.extensions import (
    BatchDiagGGNExact,
    BatchGrad,
    DiagGGNExact,
    DiagHessian,
)
from tests.common import (
    CLEAR_ERRORS,
    FAMILY_DT,
    FAMILY_TOL,
    assert_close_labelled,
    assert_nothing_written,
    backward,
    check_diag_attr,
    clear_error_or_raise,
    gather,
    labels,
    seeded_labels,
    small_mlp,
    trainable,
)
from tests.reference import diag_ggn, loss_hessian, per_sample_grads, split

DT = torch.float64


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 5)
        self.head1 = nn.Linear(5, 3)
        self.head2 = nn.Linear(5, 3)
        self.use_second = True

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head1(h) + self.head2(h) if self.use_second else self.head1(h)


@pytest.mark.parametrize("ext", [DiagGGNExact, BatchGrad], ids=["diag_ggn_exact", "grad_batch"])
def test_no_stale_results(ext: type) -> None:
    torch.manual_seed(4)
    model, lf = extend(TwoHeads().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 4, dtype=DT), seeded_labels((5,), 3)
    attr = "diag_ggn_exact" if ext is DiagGGNExact else "grad_batch"
    with collect(ext()):
        lf(model(X), y).backward()
    assert all(hasattr(p, attr) for p in model.parameters())
    model.zero_grad(set_to_none=True)
    model.use_second = False
    X2, y2 = torch.randn(3, 4, dtype=DT), seeded_labels((3,), 3, 1)
    if ext is DiagGGNExact:
        ref = diag_ggn(model, lf, X2, y2)
    else:
        ref = per_sample_grads(model, lf, X2, y2)
    with collect(ext()):
        lf(model(X2), y2).backward()
    for name, p in model.head2.named_parameters():
        assert getattr(p, attr, None) is None, f"stale head2.{name}.{attr} from the first pass"
    for name, p in trainable(model):
        if not name.startswith("head2"):
            assert_close_labelled(getattr(p, attr), ref[name], name)


@pytest.mark.parametrize("ext", [BatchGrad, DiagGGNExact], ids=["BatchGrad", "DiagGGNExact"])
def test_only_loss_extended(ext: type) -> None:
    torch.manual_seed(8)
    model, lf = small_mlp().to(DT), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 4, dtype=DT), seeded_labels((4,), 3)
    with pytest.raises((RuntimeError, ValueError), match="extend"), collect(ext()):
        lf(model(X), y).backward()
    assert_nothing_written(model)


def test_functional_penalty_on_outputs_second_order() -> None:
    torch.manual_seed(9)
    model, lf = extend(small_mlp().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 4, dtype=DT), seeded_labels((4,), 3)
    out = model(X)
    loss = lf(out, y) + 0.1 * out.pow(2).mean()
    with pytest.raises(CLEAR_ERRORS) as info, collect(DiagGGNExact()):
        loss.backward()
    clear_error_or_raise(info.value, r"term|loss")
    assert_nothing_written(model)


def test_nonlinearity_between_model_and_loss_diag_hessian() -> None:
    torch.manual_seed(10)
    model, lf = extend(small_mlp().to(DT)), extend(nn.MSELoss())
    X, y = torch.randn(4, 4, dtype=DT), torch.randn(4, 3, dtype=DT)
    ref = split(torch.diagonal(loss_hessian(model, lambda o, t: lf(torch.tanh(o), t), X, y)), model)
    try:
        with collect(DiagHessian()):
            lf(torch.tanh(model(X)), y).backward()
    except CLEAR_ERRORS as err:
        clear_error_or_raise(err, r"tanh|loss|between|extend|output")
        assert_nothing_written(model)
        return
    check_diag_attr(model, "diag_h", ref)


@pytest.mark.parametrize(
    "ext", [BatchGrad, BatchDiagGGNExact], ids=["BatchGrad", "BatchDiagGGNExact"]
)
def test_batchnorm_train_mode_writes_nothing(ext: type) -> None:
    """Per-sample quantities through train-mode BatchNorm are undefined (the whole batch's
    GGN is not: tests/engine/test_backward_whole_batch.py)."""
    torch.manual_seed(11)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(DT))
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=DT), seeded_labels((5,), 2)
    model.zero_grad(set_to_none=True)
    bn = r"(?i)eval\(\)|batchnorm"
    with pytest.raises((RuntimeError, ValueError), match=bn), collect(ext()):
        lf(model(X), y).backward()
    assert_nothing_written(model, grad_too=True)


@pytest.mark.parametrize("ext", [BatchGrad, DiagGGNExact], ids=["BatchGrad", "DiagGGNExact"])
def test_empty_batch(ext: type) -> None:
    torch.manual_seed(12)
    model, lf = extend(small_mlp().to(DT)), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(0, 4, dtype=DT), torch.zeros(0, dtype=torch.long)
    model.zero_grad(set_to_none=True)
    with pytest.raises((RuntimeError, ValueError)) as info, collect(ext()):
        lf(model(X), y).backward()
    clear_error_or_raise(info.value, r"empty|no samples|zero samples|\bN\s*=\s*0|batch size 0")
    assert_nothing_written(model, grad_too=True)


def test_broadcast_position_embedding():
    """``x + self.pos(arange(T))`` (``[N, T, 3] + [T, 3]``): broadcasting puts the positions'
    axis on the sequence axis, so the embedding's call is taken as broadcast over the batch
    (``tests/engine/test_release.py`` covers ``T = N`` and the functional form)."""

    class Pos(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(4, 3)
            self.lin = nn.Linear(3, 2)

        def forward(self, x):  # x [N, T, 3]
            return self.lin(x + self.pos(torch.arange(x.shape[1]))).mean(1)

    torch.manual_seed(13)
    model = Pos().to(DT)
    X, y = torch.randn(5, 4, 3, dtype=DT), torch.randint(0, 2, (5,))
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with collect(BatchGrad()):
        lossfunc(model(X), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[k])


# ------------------------------------------------------------------------------------ column chunks
def test_thousand_classes_many_chunks():
    """C = 1000 exact columns through a small ``memory_budget`` (≥ 20 chunks): equal to the
    unchunked result, and to the reference on a subset of entries (per-sample looped
    Jacobians restricted to those entries, Hessian of the loss w.r.t. the logits)."""
    torch.manual_seed(12)
    classes, n = 1000, 2
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, classes)).to(FAMILY_DT)
    lossfunc = nn.CrossEntropyLoss()
    X, y = torch.randn(n, 3, dtype=FAMILY_DT), labels(n, classes, seed=12)
    extend(model), extend(lossfunc)
    per_col = (4 + classes) * n * 8  # bytes of the captured outputs per column
    exts = (DiagGGNExact(), BatchDiagGGNExact())
    backward(model, lossfunc, X, y, *exts, memory_budget=per_col * 40)
    chunked = [gather(model, a, k) for a, k in (("diag_ggn_exact", 0), ("diag_ggn_exact_batch", 1))]
    backward(model, lossfunc, X, y, *exts)
    full = [gather(model, a, k) for a, k in (("diag_ggn_exact", 0), ("diag_ggn_exact_batch", 1))]
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-12)

    # reference on a subset: all first-layer entries, a few rows of the head, some biases
    sizes = [p.numel() for p in model.parameters()]
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    idx = torch.cat(
        [
            torch.arange(offsets[2]),  # first layer
            offsets[2] + torch.tensor([0, 1, 4 * int(y[0]), 4 * int(y[0]) + 3, 4 * 999 + 2]),
            offsets[3] + torch.tensor([0, int(y[1]), 500, 999]),
        ]
    )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    shapes = [p.shape for p in model.parameters()]
    names = [k for k, _ in model.named_parameters()]
    with torch.no_grad():
        logits = model(X)
    ref = []
    for i in range(n):

        def f(sub: Tensor, i: int = i) -> Tensor:
            theta = flat.index_put((idx,), sub)
            p = {k: t.reshape(s) for k, t, s in zip(names, torch.split(theta, sizes), shapes)}
            return functional_call(model, p, (X[i : i + 1],))[0]

        J = jacrev(f)(flat[idx])  # [C, |idx|]
        H = hessian(lambda o, i=i: lossfunc(torch.cat([logits[:i], o[None], logits[i + 1 :]]), y))(
            logits[i]
        )
        ref.append(torch.einsum("cp,cd,dp->p", J, H, J))
    ref_batch = torch.stack(ref)
    torch.testing.assert_close(full[1][:, idx], ref_batch, **FAMILY_TOL)
    torch.testing.assert_close(full[0][idx], ref_batch.sum(0), **FAMILY_TOL)


def _chunks_of(monkeypatch, model, lossfunc, X, y, ext, budget: int) -> list[int]:
    """The column chunks of a pass of ``ext`` under ``budget``; its results equal those of an
    unbounded pass."""
    from backprism.engine import backward as engine_backward

    backward(model, lossfunc, X, y, ext())
    full = gather(model, ext.savefield, 0)
    chunks: list[int] = []
    real = engine_backward.backprop_columns

    def spy(origins, cols, outputs, chunk):
        chunks.append(chunk)
        yield from real(origins, cols, outputs, chunk)

    monkeypatch.setattr(engine_backward, "backprop_columns", spy)
    backward(model, lossfunc, X, y, ext(), memory_budget=budget)
    torch.testing.assert_close(
        gather(model, ext.savefield, 0), full, atol=1e-13, rtol=1e-10
    )
    assert chunks
    return chunks


def _tied_gpt(vocab: int, d: int, t: int, n: int):
    from tests.common import TinyGPT

    torch.manual_seed(3)
    model = TinyGPT(vocab=vocab, d=d, t_max=t).to(FAMILY_DT)
    lossfunc = nn.CrossEntropyLoss()
    X = torch.randint(0, vocab, (n, t))
    y = torch.randint(0, vocab, (n, t))
    extend(model), extend(lossfunc)
    return model, lossfunc, X, y


def test_memory_budget_counts_per_sample_gradients(monkeypatch):
    """The column chunk leaves room for the per-sample gradients the rules build from it: with
    tied embeddings every column of ``BatchDiagGGNExact`` carries an ``[N, V, d]`` gradient of
    the shared matrix (a 2048-token decoder overran a 512 MiB budget 23-fold before). Chunked
    results are equal."""
    vocab, d, t, n = 40, 64, 1, 2  # the tied [V, d] matrix outweighs all outputs
    model, lossfunc, X, y = _tied_gpt(vocab, d, t, n)
    budget = 2**16
    chunks = _chunks_of(monkeypatch, model, lossfunc, X, y, BatchDiagGGNExact, budget)
    assert max(chunks) * n * vocab * d * 8 <= budget  # the tied matrix's share
    assert max(chunks) < vocab * t  # K = C·T columns per sample: several chunks


def test_memory_budget_without_per_sample_gradients_of_tied_weights(monkeypatch):
    """``DiagGGNExact`` combines the two uses of a tied matrix from their outer factors
    (``engine.tied``): its columns need no room for ``[N, V, d]`` gradients, so a budget that
    could not hold one per column still takes several columns at once."""
    vocab, d, t, n = 400, 64, 1, 2
    model, lossfunc, X, y = _tied_gpt(vocab, d, t, n)
    budget = 2**19
    chunks = _chunks_of(monkeypatch, model, lossfunc, X, y, DiagGGNExact, budget)
    assert n * vocab * d * 8 > budget // 2  # two columns' dense gradients would not fit
    assert max(chunks) > 2


class _Checkpointed(nn.Module):
    """A block run through ``torch.utils.checkpoint`` (reentrant or not), then a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_reentrant_refused_non_reentrant_right(reentrant: bool) -> None:
    """Reentrant checkpointing hides the block's parameters from the graph (they would get
    ``.grad`` and nothing else): refused before anything is written. The non-reentrant
    variant gives the per-sample gradients of the definition."""
    from backprism.extensions import BatchGrad
    from tests.reference import per_sample_grads

    torch.manual_seed(0)
    model = _Checkpointed(reentrant).double()
    lf = nn.CrossEntropyLoss()
    X = torch.randn(6, 4, dtype=torch.float64, requires_grad=reentrant)
    y = torch.randint(0, 3, (6,))
    plain = nn.Sequential(model.block, model.head)  # the same function, not checkpointed
    ref = {
        ("block." if k.startswith("0.") else "head.") + k[2:]: v
        for k, v in per_sample_grads(plain, lf, X.detach(), y).items()
    }
    extend(model), extend(lf)
    if reentrant:
        with pytest.raises(RuntimeError, match="use_reentrant=True"), collect(BatchGrad()):
            lf(model(X), y).backward()
        assert all(not hasattr(p, "grad_batch") for p in model.parameters())
        return
    with collect(BatchGrad()):
        lf(model(X), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[name])


def test_parameter_gradient_hook_warns_once() -> None:
    """A user's ``register_hook`` on a parameter changes ``.grad`` but not the per-sample
    results: a warning says so (once per parameter); our own hooks (Variance needs ``.grad``)
    never trigger it."""
    import warnings

    from backprism.engine.backward import ParameterHookWarning
    from backprism.extensions import BatchGrad, Variance

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double())
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParameterHookWarning)
        for _ in range(2):
            with collect(Variance(), BatchGrad()):
                lf(model(X), y).backward()
    model[2].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    with pytest.warns(ParameterHookWarning, match="gradient hook"), collect(BatchGrad()):
        lf(model(X), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParameterHookWarning)
        with collect(BatchGrad()):
            lf(model(X), y).backward()


def _first_order_and_diag_ggn(model: nn.Module, lf: nn.Module, X: Tensor, y: Tensor) -> None:
    """First order and the GGN diagonal of ``model`` (not yet extended) against ``torch.func``."""
    from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, SumGradSquared, Variance
    from tests.common import assert_first_order
    from tests.reference import diag_ggn, per_sample_grads

    ref, diag = per_sample_grads(model, lf, X, y), diag_ggn(model, lf, X, y)
    extend(model), extend(lf)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact()):
        lf(model(X), y).backward()
    assert_first_order(model, ref, rtol=1e-8, atol=1e-12)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, diag[k], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("n", [6, 5])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrized_layer(kind: str, n: int) -> None:
    """``weight_norm``, ``spectral_norm``, ``orthogonal`` (torch.nn.utils.parametrize): the
    originals' per-sample gradients are the parametrization's pull-back of the layer's, also
    where the weight's 5 rows equal N; first order and the GGN diagonal against ``torch.func``
    (``spectral_norm`` in eval mode, where the reference's forwards leave its power iteration
    alone); DiagHessian refuses the nonlinear parametrization before anything is written."""
    from torch.nn.utils import parametrizations

    from backprism.extensions import DiagHessian

    torch.manual_seed(0)
    layer = nn.Linear(4, 5, bias=kind != "orthogonal").double()
    model = nn.Sequential(getattr(parametrizations, kind)(layer), nn.Tanh(), nn.Linear(5, 3))
    model = model.double()
    if kind == "spectral_norm":
        model.eval()
    lf = nn.CrossEntropyLoss()
    X, y = torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))
    _first_order_and_diag_ggn(model, lf, X, y)
    model.zero_grad()
    with pytest.raises(RuntimeError, match="nonlinearly"), collect(DiagHessian()):
        lf(model(X), y).backward()
    assert all(p.grad is None for p in model.parameters())


def test_weight_normed_convolution() -> None:
    """Wav2Vec2's positional convolution: ``weight_norm`` over a grouped ``Conv1d``'s kernel
    axis (``dim=2``); first order and the GGN diagonal against ``torch.func``."""
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3, groups=2), dim=2)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(16, 3)).double()
    lf = nn.CrossEntropyLoss()
    X, y = torch.randn(3, 4, 6, dtype=torch.float64), torch.randint(0, 3, (3,))
    _first_order_and_diag_ggn(model, lf, X, y)


def test_parameter_frozen_between_forward_and_backward() -> None:
    """``requires_grad_(False)`` after the forward: autograd gives the parameter no ``.grad``,
    and backprism no results; the other parameters' results are those of the definition."""
    from backprism.extensions import BatchGrad, DiagGGNExact
    from tests.reference import diag_ggn, per_sample_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    lf = nn.CrossEntropyLoss()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    ref, ggn_ref = per_sample_grads(model, lf, X, y), diag_ggn(model, lf, X, y)
    extend(model), extend(lf)
    loss = lf(model(X), y)
    model[0].weight.requires_grad_(False)
    with collect(BatchGrad(), DiagGGNExact()):
        loss.backward()
    assert model[0].weight.grad is None
    assert not hasattr(model[0].weight, "grad_batch")
    assert not hasattr(model[0].weight, "diag_ggn_exact")
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad_batch, ref[name])
            torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
            torch.testing.assert_close(p.diag_ggn_exact, ggn_ref[name])


class _TimeMajor(nn.Module):
    """A time-major fold ``[N, T, d] → [T·N, d]`` around a Linear layer: no split into
    samples (``tests/engine/test_fold.py`` has the sample-major folds that work)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        h = self.pre(x).transpose(0, 1).reshape(t * n, d)
        return self.head(self.inner(h).reshape(t, n, d).transpose(0, 1)).mean(1)


def test_batch_size_refusal_names_folded_batches() -> None:
    """Calls of another batch size inside one forward: refused before anything is written,
    with the likely cause named (a batch folded with another axis; tables shared by all
    samples are split where they meet them, ``tests/engine/test_broadcast.py``)."""
    from backprism.extensions import BatchGrad

    torch.manual_seed(0)
    net = extend(_TimeMajor().double())
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (2,))
    loss = nn.functional.cross_entropy(net(x), y)
    with pytest.raises(RuntimeError, match="time-major"), collect(BatchGrad()):
        loss.backward()
    assert all(p.grad is None for p in net.parameters())
