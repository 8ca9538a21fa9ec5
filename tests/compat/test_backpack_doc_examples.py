"""The flows of BackPACK 1.7's documentation examples through ``backprism.compat.backpack``:
imports changed, MNIST replaced by random tensors of the same per-sample shape (smaller batches
where the example's batch only makes it slower), numbers against float64 autograd references.

The custom-module example is in ``test_backpack_custom_modules.py``.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy, relu

from backprism.compat.backpack import backpack, extend, extensions
from backprism.compat.backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backprism.compat.backpack.custom_module.graph_utils import BackpackTracer
from backprism.compat.backpack.custom_module.permute import Permute
from backprism.compat.backpack.custom_module.reduce_tuple import ReduceTuple
from backprism.compat.backpack.custom_module.slicing import Slicing
from backprism.compat.backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from backprism.compat.backpack.hessianfree.hvp import hessian_vector_product
from backprism.compat.backpack.utils.examples import autograd_diag_ggn_exact
from tests.compat.compat_refs import ggn_columns, hessian_block_product, trainable_params
from tests.reference import per_sample_grads, per_sample_grads_loop

DT = torch.double


def mnist_like(n: int, seed: int = 0, flat: bool = False):
    torch.manual_seed(seed)
    X = torch.randn(n, 1, 28, 28, dtype=DT)
    return (X.flatten(1) if flat else X), torch.randint(0, 10, (n,))


def linear_ce_ggn_diag(model, X, y):
    """GGN (= Hessian) diagonal of ``CrossEntropyLoss(mean)(Linear(flatten(X)), y)`` from its
    definition: ``J`` w.r.t. ``W[c, i]`` is ``x_i e_c``, ``∇²ℓ = diag p − p pᵀ``."""
    lin = model[1]
    x = X.flatten(1)
    p = torch.softmax(lin(x), 1).detach()
    d = p - p.square()
    return {"1.weight": (d.T @ x.square()) / len(X), "1.bias": d.mean(0)}


# -- basic usage: all extensions ----------------------------------------------------------------
def test_example_all_in_one():
    X, y = mnist_like(32)
    model = extend(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)).to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    gb = per_sample_grads(model, lossfunc, X, y)
    diag = linear_ce_ggn_diag(model, X, y)

    def step(*exts):
        loss = lossfunc(model(X), y)
        with backpack(*exts):
            loss.backward()
        return dict(model.named_parameters())

    ps = step(BatchGrad(), Variance(), SumGradSquared(), BatchL2Grad())
    for name, p in ps.items():
        torch.testing.assert_close(p.grad_batch, gb[name])
        torch.testing.assert_close(p.variance, gb[name].var(0, unbiased=False))
        torch.testing.assert_close(p.sum_grad_squared, gb[name].square().sum(0))
        torch.testing.assert_close(p.batch_l2, gb[name].flatten(1).square().sum(1))
    ps = step(DiagGGNExact(), DiagGGNMC(mc_samples=1))
    for name, p in ps.items():
        torch.testing.assert_close(p.diag_ggn_exact, diag[name])
        assert p.diag_ggn_mc.shape == p.shape
    ps = step(BatchDiagGGNExact(), BatchDiagGGNMC(mc_samples=1))
    for name, p in ps.items():
        torch.testing.assert_close(p.diag_ggn_exact_batch.sum(0), diag[name])
        assert p.diag_ggn_mc_batch.shape == (32, *p.shape)
    ps = step(KFAC(mc_samples=1), KFLR(), KFRA())
    for p in ps.values():
        shapes = [(s, s) for s in p.shape]
        for field in ("kfac", "kflr", "kfra"):
            assert [tuple(f.shape) for f in getattr(p, field)] == shapes
    ps = step(DiagHessian(), BatchDiagHessian())
    for name, p in ps.items():
        torch.testing.assert_close(p.diag_h, diag[name])
        torch.testing.assert_close(p.diag_h_batch.sum(0), diag[name])
    ps = step(SqrtGGNExact(), SqrtGGNMC(mc_samples=1))
    for p in ps.values():
        assert p.sqrt_ggn_exact.shape == (10, 32, *p.shape)
        assert p.sqrt_ggn_mc.shape == (1, 32, *p.shape)
    ps = step(HMP(), GGNMP(), PCHMP(savefield="pchmp_clip", modify="clip"),
              PCHMP(savefield="pchmp_abs", modify="abs"))
    loss = lossfunc(model(X), y)
    for V in (1, 3):
        for p in ps.values():
            vec = torch.rand(V, *p.shape, dtype=DT)
            ref = hessian_block_product(loss, p, vec)
            for field in ("hmp", "ggnmp", "pchmp_clip", "pchmp_abs"):  # linear model: all equal
                torch.testing.assert_close(getattr(p, field)(vec), ref)


# -- use cases ----------------------------------------------------------------------------------
def test_example_batched_jacobians():
    N, D_in, D_hidden, C = 15, 10, 7, 5

    def setup():
        X = torch.rand(N, D_in, dtype=DT)
        return nn.Sequential(nn.Linear(D_in, D_hidden), nn.ReLU(), nn.Linear(D_hidden, C)).to(DT), X

    torch.manual_seed(0)
    model, X = setup()
    fs = model(X)
    autograd_jacobians = [torch.zeros(fs.shape + p.shape, dtype=DT) for p in model.parameters()]
    for n in range(N):
        for c in range(C):
            grads = torch.autograd.grad(fs[n, c], model.parameters(), retain_graph=True)
            for i, g in enumerate(grads):
                autograd_jacobians[i][n, c] = g

    torch.manual_seed(0)
    model, X = setup()
    model = extend(model)
    fs = model(X)
    first = [torch.zeros(fs.shape + p.shape, dtype=DT) for p in model.parameters()]
    for c in range(C):
        with backpack(extensions.BatchGrad(), retain_graph=True):
            f = fs[:, c].sum()
            f.backward(retain_graph=True)
        for i, p in enumerate(model.parameters()):
            first[i][:, c] = p.grad_batch
    for a, b in zip(autograd_jacobians, first):
        torch.testing.assert_close(a, b)

    torch.manual_seed(0)
    model, X = setup()
    model = extend(model)
    loss_func = extend(nn.MSELoss(reduction="sum"))
    fs = model(X)
    loss = loss_func(fs, torch.zeros_like(fs))
    with backpack(extensions.SqrtGGNExact()):
        loss.backward()
    second = [p.sqrt_ggn_exact.transpose(0, 1) / math.sqrt(2) for p in model.parameters()]
    for a, b in zip(autograd_jacobians, second):
        torch.testing.assert_close(a, b)


def cg(A, b, maxiter=20, tol=0.1, atol=1e-6):
    """Conjugate gradients for ``A x = b`` (``A`` a matrix-vector product)."""
    x = torch.zeros_like(b)
    r = b - A(x)
    p = r.clone()
    rs = (r * r).sum()
    bound = max(tol * b.norm().item(), atol)
    for _ in range(min(maxiter, b.numel())):
        Ap = A(p)
        alpha = rs / (p * Ap).sum()
        x += alpha * p
        r -= alpha * Ap
        rs_new = (r * r).sum()
        if rs_new.sqrt() < bound:
            break
        p = r + (rs_new / rs) * p
        rs = rs_new
    return x


@pytest.mark.parametrize(
    "make",
    [GGNMP, HMP, lambda: PCHMP(modify="abs"), lambda: PCHMP(modify="clip")],
    ids=["GGNMP", "HMP", "PCHMP-abs", "PCHMP-clip"],
)
def test_example_cg_newton(make):
    torch.manual_seed(0)
    model = extend(nn.Sequential(
        nn.Conv2d(1, 10, 5, 1), nn.Sigmoid(), nn.MaxPool2d(2, 2),
        nn.Conv2d(10, 20, 5, 1), nn.Sigmoid(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(4 * 4 * 20, 50), nn.Sigmoid(), nn.Linear(50, 10),
    ).to(DT))
    loss_function = extend(nn.CrossEntropyLoss())
    bp_extension = make()
    X, y = mnist_like(2)  # the example: 64; Hessian residual columns make HMP/PCHMP costly
    for _ in range(2):
        model.zero_grad()
        outputs = model(X)
        loss = loss_function(outputs, y)
        with backpack(bp_extension):
            loss.backward()
        # the last bias's block is the mean loss Hessian (diag p − p pᵀ)/N for every curvature
        p = torch.softmax(outputs.detach(), 1)
        block = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).mean(0)
        bias = model[9].bias
        v = torch.randn(2, 10, dtype=DT)
        torch.testing.assert_close(getattr(bias, bp_extension.savefield)(v), v @ block)
        for param in model.parameters():
            curv = getattr(param, bp_extension.savefield)

            def matvec(v, curv=curv):
                return (1e-2 * v[None] + curv(v[None]))[0]

            param.data.add_(cg(matvec, -param.grad), alpha=0.1)
    assert torch.isfinite(loss_function(model(X), y))


def test_example_diag_ggn_optimizer():
    torch.manual_seed(0)
    model = extend(nn.Sequential(
        nn.Conv2d(1, 20, 5, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(20, 50, 5, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(4 * 4 * 50, 500), nn.ReLU(), nn.Linear(500, 10),
    ))
    loss_function = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    for _ in range(3):
        model.zero_grad()
        loss = loss_function(model(X), y)
        with backpack(DiagGGNMC()):
            loss.backward()
        for p in model.parameters():
            assert p.diag_ggn_mc.shape == p.shape and bool((p.diag_ggn_mc >= 0).all())
            p.data.add_(p.grad / (p.diag_ggn_mc + 1.0), alpha=-0.05)
    assert torch.isfinite(loss)


def test_example_differential_privacy():
    torch.manual_seed(0)
    model = extend(nn.Sequential(
        nn.ZeroPad2d((3, 4, 3, 4)), nn.Conv2d(1, 16, 8, stride=2, padding=0), nn.ReLU(),
        nn.MaxPool2d(2, stride=1), nn.Conv2d(16, 32, 4, stride=2, padding=0), nn.ReLU(),
        nn.MaxPool2d(2, stride=1), nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.ReLU(),
        nn.Linear(32, 10),
    ).to(DT))
    loss_function = nn.CrossEntropyLoss()  # not extended: first order needs only the model
    X, y = mnist_like(8)
    loss = loss_function(model(X), y)
    with backpack(BatchL2Grad(), BatchGrad()):
        loss.backward()
    gb = per_sample_grads(model, loss_function, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, gb[name])
        torch.testing.assert_close(p.batch_l2, gb[name].flatten(1).square().sum(1))
    norms = torch.stack([p.batch_l2 for p in model.parameters()]).sum(0).sqrt()
    scale = torch.clamp_max(norms / 0.01, 1.0)
    for p in model.parameters():
        clipped = (p.grad_batch * scale.reshape(-1, *[1] * (p.dim()))).sum(0)
        p.data.add_(-0.1 * (clipped + torch.randn_like(clipped) * 0.02))
    assert torch.isfinite(loss_function(model(X), y))


def test_example_extension_hook():
    X, y = mnist_like(32)
    model = extend(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)).to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(X), y)
    with backpack(DiagHessian()):
        loss.backward()
    tr_after_backward = sum(p.diag_h.sum() for p in model.parameters())
    for p in model.parameters():
        del p.diag_h

    class TraceHook:
        def __init__(self):
            self.value = 0.0

        def sum_diag_h(self, module):
            for param in module.parameters():
                if hasattr(param, "diag_h"):
                    self.value += param.diag_h.sum()
                    delattr(param, "diag_h")

    hook = TraceHook()
    loss = lossfunc(model(X), y)
    with backpack(DiagHessian(), extension_hook=hook.sum_diag_h):
        loss.backward()
    ref = sum(d.sum() for d in linear_ce_ggn_diag(model, X, y).values())
    torch.testing.assert_close(tr_after_backward, ref)
    torch.testing.assert_close(hook.value, ref)
    assert not any(hasattr(p, "diag_h") for p in model.parameters())


class MyFirstResNet(nn.Module):
    def __init__(self, C_in=1, C_hid=5, input_dim=(28, 28), output_dim=10):
        super().__init__()
        self.conv1 = nn.Conv2d(C_in, C_hid, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv2d(C_hid, C_hid, kernel_size=3, stride=1, padding=1)
        self.linear1 = nn.Linear(input_dim[0] * input_dim[1] * C_hid, output_dim)
        self.shortcut = (
            nn.Identity() if C_in == C_hid else nn.Conv2d(C_in, C_hid, kernel_size=1, stride=1)
        )

    def forward(self, x):
        residual = self.shortcut(x)
        x = self.conv2(relu(self.conv1(x)))
        x = x + residual
        return self.linear1(x.flatten(start_dim=1))


def test_example_resnet_first_order_functional_loss():
    x, y = mnist_like(8)
    model = extend(MyFirstResNet().to(DT))
    loss = cross_entropy(model(x), y, reduction="sum")
    with backpack(BatchGrad()):
        loss.backward()
    for sample in (1, 6):
        model.zero_grad()
        cross_entropy(model(x[[sample]]), y[[sample]]).backward()
        for p in model.parameters():
            torch.testing.assert_close(p.grad_batch[sample], p.grad)


class SmallResNet(nn.Module):
    """Stands in for torchvision's resnet18 of the example (not installed here): a basic block
    with BatchNorm in eval mode, a projection shortcut and in-place ReLUs."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.down = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4))
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.down(x)
        out = self.relu(out)
        return self.fc(torch.flatten(self.pool(out), 1))


def test_example_resnet_second_order_with_converter():
    torch.manual_seed(0)
    model = SmallResNet().to(DT)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    model = extend(model.eval(), use_converter=True)
    graph = BackpackTracer().trace(model)
    assert any(n.op == "call_module" and n.target == "fc" for n in graph.nodes)
    if importlib.util.find_spec("tabulate") is not None:
        graph.print_tabular()
    loss_function = extend(nn.MSELoss())
    x = torch.rand(4, 3, 7, 7, dtype=DT)
    output = model(x)
    y = torch.rand_like(output)
    with backpack(DiagGGNExact()):
        loss_function(output, y).backward()
    diag = torch.cat([p.diag_ggn_exact.flatten() for p in model.parameters()])
    idx = torch.linspace(0, diag.numel() - 1, 10, dtype=torch.int32)
    ref = ggn_columns(model, loss_function, x, y, idx.tolist())
    torch.testing.assert_close(diag[idx.long()], ref[range(10), idx.long()])
    torch.testing.assert_close(
        autograd_diag_ggn_exact(x, y, model, loss_function, idx=idx), diag[idx.long()]
    )


def test_example_retain_graph_chunks():
    torch.manual_seed(0)
    X = torch.rand(5, 3, 16, 16, dtype=DT)  # the example: 32 x 32 (4x the columns)
    model = extend(nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 10, 3), nn.Sigmoid()),
        nn.Sequential(nn.ConvTranspose2d(10, 3, 3), nn.Flatten()),
    ).to(DT))
    loss_func = extend(nn.MSELoss())
    error = loss_func(model(X), X.flatten(start_dim=1))
    with backpack(DiagGGNExact()):
        error.backward()
    one_pass = [p.diag_ggn_exact.clone() for p in model.parameters()]
    reconstruction = model(X)
    num_chunks = 4
    chunk = reconstruction.shape[1] // num_chunks
    acc = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(num_chunks):
        slicing = (slice(None), slice(i * chunk, (i + 1) * chunk))
        chunk_module = extend(Slicing(slicing))
        slice_error = loss_func(chunk_module(reconstruction), X.flatten(start_dim=1)[slicing])
        with backpack(DiagGGNExact(), retain_graph=True):
            slice_error.backward(retain_graph=True)
        for a, p in zip(acc, model.parameters()):
            a += p.diag_ggn_exact
    for a, b in zip(one_pass, acc):
        torch.testing.assert_close(a, b / num_chunks)
    idx = [0, 100, 279, 280, 552]
    diag = torch.cat([d.flatten() for d in one_pass])
    ref = ggn_columns(model, loss_func, X, X.flatten(start_dim=1), idx)
    torch.testing.assert_close(diag[idx], ref[range(len(idx)), idx])


def test_example_rnn():
    torch.manual_seed(1)
    vocab, hidden, batch, seq = 25, 16, 4, 6  # the example: 25, 64, 8, 15

    def char_rnn_custom():
        return nn.Sequential(
            nn.Embedding(vocab, hidden), nn.Dropout(p=0.2),
            nn.LSTM(hidden, hidden, batch_first=True), ReduceTuple(index=0), nn.Dropout(p=0.36),
            nn.LSTM(hidden, hidden, batch_first=True), ReduceTuple(index=0), nn.Dropout(p=0.2),
            nn.Linear(hidden, vocab), Permute(0, 2, 1),
        ).to(DT).eval()

    model = char_rnn_custom()
    for name, p in model.named_parameters():
        if "bias_ih_l" in name:  # deactivate the redundant bias
            p.data = torch.zeros_like(p.data)
            p.requires_grad = False
    x = torch.randint(0, vocab, (batch, seq))
    y = torch.cat([torch.randint(0, vocab, (batch, 1)), x[:, :-1]], dim=1)
    loss_function = extend(nn.CrossEntropyLoss())
    model = extend(model)
    with backpack(BatchGrad(), DiagGGNExact()):
        loss_function(model(x), y).backward()
    gb = per_sample_grads_loop(model, loss_function, x, y)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for name, p in trainable:
        torch.testing.assert_close(p.grad_batch, gb[name])
    diag = torch.cat([p.diag_ggn_exact.flatten() for _, p in trainable])
    idx = torch.linspace(0, diag.numel() - 1, 6, dtype=torch.int32).tolist()
    ref = ggn_columns(model, loss_function, x, y, idx)
    torch.testing.assert_close(diag[idx], ref[range(len(idx)), idx])
    # the multi-layer LSTM of the example's TolstoiCharRNN, "converted"
    lstm_model = extend(nn.Sequential(
        nn.Embedding(vocab, hidden), nn.LSTM(hidden, hidden, num_layers=2, dropout=0.36,
                                             batch_first=True),
        ReduceTuple(index=0), nn.Linear(hidden, vocab), Permute(0, 2, 1),
    ).to(DT).eval(), use_converter=True)
    with backpack(DiagGGNExact()):
        loss_function(lstm_model(x), y).backward()
    diag = torch.cat([p.diag_ggn_exact.flatten() for p in lstm_model.parameters()])
    idx = torch.linspace(0, diag.numel() - 1, 6, dtype=torch.int32).tolist()
    ref = ggn_columns(lstm_model, loss_function, x, y, idx)
    torch.testing.assert_close(diag[idx], ref[range(len(idx)), idx])
    assert trainable_params(lstm_model)


def test_example_rnn_sequence_first():
    """The recurrent layout with PyTorch's default ``batch_first=False``: tokens ``[T, N]`` →
    Embedding → RNN → ReduceTuple → Linear on ``[T, N, h]`` → ``Permute(1, 2, 0)`` →
    cross-entropy over ``[N, C, T]``; per-sample gradients one sample (column) at a time."""
    torch.manual_seed(2)
    vocab, hidden, batch, seq = 11, 5, 4, 4  # T == N: axis 0 taken for the batch would be wrong
    model = extend(nn.Sequential(
        nn.Embedding(vocab, hidden), nn.RNN(hidden, hidden), ReduceTuple(index=0),
        nn.Linear(hidden, vocab), Permute(1, 2, 0),
    ).to(DT))
    loss_function = extend(nn.CrossEntropyLoss())
    x = torch.randint(0, vocab, (seq, batch))
    y = torch.randint(0, vocab, (batch, seq))
    with backpack(BatchGrad(), DiagGGNExact()):
        loss_function(model(x), y).backward()
    names = [n for n, _ in model.named_parameters()]
    rows = {n: [] for n in names}
    for i in range(batch):
        loss = cross_entropy(model(x[:, i : i + 1]), y[i : i + 1]) / batch
        for n, g in zip(names, torch.autograd.grad(loss, list(model.parameters()))):
            rows[n].append(g)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, torch.stack(rows[name]))
    diag = torch.cat([p.diag_ggn_exact.flatten() for p in model.parameters()])
    idx = torch.linspace(0, diag.numel() - 1, 6, dtype=torch.int32).tolist()
    ref = ggn_columns(model, loss_function, x, y, idx)
    torch.testing.assert_close(diag[idx], ref[range(len(idx)), idx])


def test_example_save_memory_convolutions():
    def compute(seed=0):
        torch.manual_seed(seed)
        X, y = torch.randn(4, 1, 28, 28, dtype=DT), torch.randint(0, 10, (4,))
        model = extend(nn.Sequential(
            nn.Conv2d(1, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2),
            nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, padding=1, stride=2),
            nn.Conv2d(256, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2),
            nn.Conv2d(64, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2),
            nn.Flatten(), nn.Linear(32, 10),
        ).to(DT))
        lossfunc = extend(nn.CrossEntropyLoss())
        loss = lossfunc(model(X), y)
        with backpack(extensions.BatchGrad()):
            loss.backward()
        return model, lossfunc, X, y

    with weight_jac_t_save_memory(save_memory=True):
        model, lossfunc, X, y = compute()
        saved = {n: p.grad_batch for n, p in model.named_parameters()}
    with weight_jac_t_save_memory(save_memory=False):
        model, *_ = compute()
    ref = per_sample_grads(model, lossfunc, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(saved[name], p.grad_batch)
        torch.testing.assert_close(p.grad_batch, ref[name])


def test_example_subsampling():
    X, y = mnist_like(128)
    model = extend(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)).to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    subsampling = [0, 1, 13, 42]
    loss = lossfunc(model(X), y)
    with backpack(BatchGrad()):
        loss.backward()
    naive = [p.grad_batch[subsampling] for p in model.parameters()]
    loss = lossfunc(model(X), y)
    with backpack(BatchGrad(subsampling=subsampling)):
        loss.backward()
    for a, p in zip(naive, model.parameters()):
        torch.testing.assert_close(a, p.grad_batch)


def test_example_trace_estimation():
    torch.manual_seed(0)
    model = extend(nn.Sequential(
        nn.Flatten(), nn.Linear(784, 20, bias=False), nn.Sigmoid(), nn.Linear(20, 10, bias=False),
    ).to(DT))
    loss_function = extend(nn.CrossEntropyLoss())
    x, y = mnist_like(64)
    loss = loss_function(model(x), y)
    with backpack(DiagHessian(), HMP()):
        loss.backward(retain_graph=True)
    torch.manual_seed(1)
    for p in model.parameters():
        v = (torch.rand(3, *p.shape) < 0.5).to(DT) * 2 - 1  # Rademacher
        torch.testing.assert_close(p.hmp(v), hessian_block_product(loss, p, v))
        (hv,) = hessian_vector_product(loss, [p], [v[0]])
        torch.testing.assert_close(hv, p.hmp(v[:1])[0])
        # a few exact diagonal entries
        for flat in (0, p.numel() // 3, p.numel() - 1):
            e = torch.zeros(p.numel(), dtype=DT)
            e[flat] = 1.0
            col = hessian_block_product(loss, p, e.reshape(1, *p.shape))[0]
            torch.testing.assert_close(p.diag_h.reshape(-1)[flat], col.reshape(-1)[flat])


def test_example_gradient_of_variance():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 1, bias=False)).to(DT))
    lossfunc = extend(nn.MSELoss())
    X, y = torch.randn(6, 5, dtype=DT), torch.randn(6, 1, dtype=DT)
    loss = lossfunc(model(X), y)
    with backpack(Variance()):
        loss.backward(retain_graph=True, create_graph=True)
    total_var = sum(p.variance.sum() for p in model.parameters())
    (grad_var,) = torch.autograd.grad(total_var, list(model.parameters()))
    w = model[0].weight
    gb = per_sample_grads(model, lossfunc, X, y)["0.weight"]
    assert gb.shape[0] == 6 and grad_var.shape == w.shape
