"""The library on an accelerator: every model, input and reference moved there explicitly.

Skipped unless the device is available. The device is ``cuda`` unless the environment variable
``BACKPRISM_DEVICE_TESTS`` names another one (``BACKPRISM_DEVICE_TESTS=cpu`` runs the same checks
on the CPU, to test the tests on a machine without a GPU). Models are built on the CPU and moved
with ``.to(DEVICE)`` — no ``torch.set_default_device`` — so library code that creates a tensor
without ``device=`` fails here (a CPU/accelerator mismatch) instead of passing silently.

References are dense float64 from ``tests/reference.py`` (``torch.func``), computed on the same
device, before the model is extended:

* first order (BatchGrad with and without sub-sampling, BatchL2Grad, SumGradSquared, Variance,
  BatchDotGrad, ``.grad``) against ``per_sample_grads``;
* DiagGGNExact, BatchDiagGGNExact, SqrtGGNExact (``Vₙᵀ Vₙ = GGNₙ``) against ``ggn_blocks``, with
  and without column chunking; DiagGGNMC/BatchDiagGGNMC/SqrtGGNMC in expectation (the stored
  value is the mean of the i.i.d. draws ``M·V[m]²`` and within 15 % of the reference in
  norm, M = 2000); DiagHessian against ``diag(loss_hessian)`` for the models it supports (MLP, CNN);
  HutchinsonDiagHessian within 6 standard deviations ``√((1/S) Σ_{j≠i} H_ij²)`` of the exact
  diagonal; KFLR/KFAC factors: shapes, symmetry, finiteness;
* ``EigvalshComputation``/``EighComputation`` against ``eigvalsh`` of the (sub-sampled) dense
  GGN, ``DampedNewton``'s step against ``Σ_d e_d (−ḡᵀe_d)/(λ_d + δ)`` over the top eigenpairs;
* the monitor: quantities computed at step 0 against brute force, all outputs finite, the
  streamed log and the JSON output written and read back.

Every tensor a computation stores or returns is checked to be on the device.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from backprism import collect, extend
from backprism.engine.state import suspended
from backprism.extensions import (
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    HutchinsonDiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from backprism.monitor import Monitor, configuration, quantities, read_log, schedules
from backprism.monitor.quantities.bin_adaptation import GradAbsMax
from backprism.spectral import DampedNewton, EighComputation, EigvalshComputation
from common import ResNetBlock, TinyGPT, first_order_expected, gather, trainable
from test_secondorder_architectures import (
    Encoder,
    _expected_shapes,
    _freeze_unsupported,
)

from reference import diag_blocks, ggn_blocks, loss_hessian, per_sample_grads

DEVICE = torch.device(os.environ.get("BACKPRISM_DEVICE_TESTS", "cuda"))


def _available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available()
    backend = getattr(torch, device.type, None)
    return bool(getattr(backend, "is_available", lambda: False)())


pytestmark = [
    pytest.mark.skipif(not _available(DEVICE), reason=f"device {DEVICE} is not available"),
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
]

DT = torch.float64
N = 3
M = 2000  # MC samples
VOCAB, T = 5, 3
TOL = {"rtol": 1e-8, "atol": 1e-10}
FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad)


# --------------------------------------------------------------------------- helpers
def _resolved() -> torch.device:
    """``DEVICE`` with its index (``cuda`` → ``cuda:0``), as tensors report it."""
    return torch.empty(0, device=DEVICE).device


def assert_on_device(value: Any, what: str) -> None:
    """Every tensor in ``value`` (nested lists/tuples/dicts) lives on ``DEVICE``."""
    if isinstance(value, Tensor):
        assert value.device == _resolved(), f"{what} is on {value.device}, not {_resolved()}"
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_on_device(v, f"{what}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            assert_on_device(v, f"{what}[{k!r}]")


def check_stored(model: nn.Module, *fields: str) -> None:
    """``param.<field>`` exists, lies on the device and is finite, for every trainable param;
    ``.grad`` too."""
    for name, p in trainable(model):
        assert_on_device(p.grad, f"{name}.grad")
        for field in fields:
            value = getattr(p, field)
            assert_on_device(value, f"{name}.{field}")
            for t in value if isinstance(value, (list, tuple)) else [value]:
                assert torch.isfinite(t).all(), f"{name}.{field}"


def _cpu_data(seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=DT, device="cpu")

    def labels(c: int, *shape: int) -> Tensor:
        return torch.randint(0, c, shape, generator=g, device="cpu")

    return randn, labels


NAMES = ["mlp", "mlp_mse", "cnn", "resnet", "transformer", "gpt", "gpt_flat"]


def build(name: str, seed: int = 0) -> tuple[nn.Module, nn.Module, Tensor, Tensor, Any]:
    """``model, lossfunc, X, y, ref_loss`` on ``DEVICE`` (``ref_loss`` acts on the outputs
    stacked per sample, as ``reference`` evaluates them). Built on the CPU, then moved."""
    with torch.device("cpu"):  # also under BACKPRISM_TEST_DEVICE (conftest's default device)
        torch.manual_seed(seed)
        randn, labels = _cpu_data(seed)
        lossfunc: nn.Module = nn.CrossEntropyLoss()
        ref_loss: Any = lossfunc
        if name in ("mlp", "mlp_mse"):
            model: nn.Module = nn.Sequential(
                nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3)
            )
            X = randn(N, 4)
            if name == "mlp_mse":
                lossfunc = ref_loss = nn.MSELoss()
                y = randn(N, 3)
            else:
                y = labels(3, N)
        elif name == "cnn":
            model = nn.Sequential(
                nn.Conv2d(2, 3, 3, padding=1),
                nn.Tanh(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(12, 3),
            )
            X, y = randn(N, 2, 4, 4), labels(3, N)
        elif name == "resnet":
            model = ResNetBlock(out_act="tanh").eval()
            X, y = randn(N, 2, 3, 3), labels(3, N)
        elif name == "transformer":
            model = Encoder()
            X, y = randn(N, 3, 4), labels(3, N)
        elif name in ("gpt", "gpt_flat"):
            model = TinyGPT(vocab=VOCAB, t_max=T, flat=name == "gpt_flat")
            X = labels(VOCAB, N, T)
            X[1, 2] = X[1, 0] = X[0, 1]  # repeated tokens within and across samples
            y = labels(VOCAB, N, T)
            if name == "gpt_flat":
                y = y.flatten()
                ce = lossfunc

                def ref_loss(o: Tensor, y: Tensor) -> Tensor:  # o: [N, T, V]
                    return ce(o.reshape(-1, VOCAB), y)

        else:
            raise ValueError(name)
    model = model.to(device=DEVICE, dtype=DT)
    return model, lossfunc, X.to(DEVICE), y.to(DEVICE), ref_loss


def backward(model: nn.Module, lossfunc: nn.Module, X: Tensor, y: Tensor, *exts, **kw) -> Tensor:
    model.zero_grad()
    loss = lossfunc(model(X), y)
    with collect(*exts, **kw):
        loss.backward()
    return loss


# --------------------------------------------------------------------------- first order
@pytest.mark.parametrize("name", NAMES)
def test_first_order(name):
    model, lossfunc, X, y, ref_loss = build(name)
    ref = per_sample_grads(model, ref_loss, X, y)
    extend(model), extend(lossfunc)
    sub = [2, 0]
    backward(model, lossfunc, X, y, *(e() for e in FIRST_ORDER))
    check_stored(model, *(e.savefield for e in FIRST_ORDER))
    for key, p in trainable(model):
        assert_on_device(ref[key], "reference")
        for field, value in first_order_expected(ref[key]).items():
            torch.testing.assert_close(getattr(p, field), value, **TOL, msg=f"{key}.{field}")
        torch.testing.assert_close(p.grad, ref[key].sum(0), **TOL)
    backward(model, lossfunc, X, y, BatchGrad(subsampling=sub))
    check_stored(model, "grad_batch")
    for key, p in trainable(model):
        torch.testing.assert_close(p.grad_batch, ref[key][sub], **TOL)


# --------------------------------------------------------------------------- second order
@pytest.mark.parametrize("chunking", [{}, {"chunk_size": 2}], ids=["whole", "chunked"])
@pytest.mark.parametrize("name", NAMES)
def test_ggn_exact(name, chunking):
    model, lossfunc, X, y, ref_loss = build(name, seed=1)
    G = ggn_blocks(model, ref_loss, X, y)[0]
    extend(model), extend(lossfunc)
    exts = (DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact())
    backward(model, lossfunc, X, y, *exts, **chunking)
    check_stored(model, *(e.savefield for e in exts))
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **TOL
    )
    torch.testing.assert_close(gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **TOL)
    V = gather(model, "sqrt_ggn_exact", 2)
    for n in range(N):
        torch.testing.assert_close(V[:, n].T @ V[:, n], G[n, n], **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_ggn_mc_in_expectation(name):
    model, lossfunc, X, y, ref_loss = build(name, seed=2)
    G = ggn_blocks(model, ref_loss, X, y)[0]
    extend(model), extend(lossfunc)
    torch.manual_seed(0)
    exts = (DiagGGNMC(M), BatchDiagGGNMC(M), SqrtGGNMC(M))
    backward(model, lossfunc, X, y, *exts)
    check_stored(model, *(e.savefield for e in exts))
    V = gather(model, "sqrt_ggn_mc", 2)
    assert V.shape[:2] == (M, N)
    per = V.square() * M
    assert_unbiased(gather(model, "diag_ggn_mc", 0), per.sum(1), torch.diagonal(G.sum((0, 1))))
    assert_unbiased(gather(model, "diag_ggn_mc_batch", 1), per, diag_blocks(G))


def assert_unbiased(value: Tensor, draws: Tensor, ref: Tensor, rtol: float = 0.15) -> None:
    """``value`` is the mean of the i.i.d. draws and within ``rtol`` of ``ref`` in norm.

    A norm criterion rather than per-entry standard errors: the device's RNG gives other draws
    than the CPU's, and some GPT entries are heavy-tailed (rare draws 60× the mean), where the
    sample standard error underestimates the spread at a few thousand draws."""
    torch.testing.assert_close(value, draws.mean(0), atol=1e-10, rtol=1e-8)
    rel = float((value - ref).norm() / ref.norm())
    assert rel < rtol, f"MC mean off by {rel:.3f} (relative, norm) from the exact value"


@pytest.mark.parametrize("name", ["mlp", "mlp_mse", "cnn"])
def test_diag_hessian(name):
    model, lossfunc, X, y, ref_loss = build(name, seed=3)
    H = loss_hessian(model, ref_loss, X, y)
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, DiagHessian(), BatchDiagHessian())
    check_stored(model, "diag_h", "diag_h_batch")
    torch.testing.assert_close(gather(model, "diag_h", 0), torch.diagonal(H), **TOL)
    batch = gather(model, "diag_h_batch", 1)
    assert batch.shape[0] == N
    torch.testing.assert_close(batch.sum(0), torch.diagonal(H), **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_hutchinson(name):
    """Unbiased with ``Var[d̂ᵢ] = (1/S) Σ_{j≠i} H_ij²``: within 6 standard deviations.

    Attention runs on SDPA's math backend: the fused CPU kernel has neither the forward-mode
    derivative ``torch.func.hessian`` needs nor a double backward (HVPs); on CUDA, float64 gets
    the math backend anyway."""
    samples = 32
    model, lossfunc, X, y, ref_loss = build(name, seed=4)
    with sdpa_kernel(SDPBackend.MATH):
        H = loss_hessian(model, ref_loss, X, y)
        extend(model), extend(lossfunc)
        torch.manual_seed(0)
        backward(model, lossfunc, X, y, HutchinsonDiagHessian(samples))
    check_stored(model, "diag_h_hutchinson")
    est = gather(model, "diag_h_hutchinson", 0)
    off = H - torch.diag(torch.diagonal(H))
    sd = (off.square().sum(1) / samples).sqrt()
    err = (est - torch.diagonal(H)).abs()
    bad = err > 6 * sd + 1e-10
    assert not bad.any(), f"off by {err[bad]} (sd {sd[bad]})"


@pytest.mark.parametrize("ext", [KFLR, KFAC])
@pytest.mark.parametrize("name", NAMES)
def test_kronecker(name, ext):
    model, lossfunc, X, y, _ = build(name, seed=5)
    _freeze_unsupported(model)
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, ext())
    check_stored(model, ext.savefield)
    expected = _expected_shapes(model)
    assert expected
    for key, p in trainable(model):
        factors = getattr(p, ext.savefield)
        assert [tuple(f.shape) for f in factors] == expected[key], key
        for f in factors:
            torch.testing.assert_close(f, f.T)


# --------------------------------------------------------------------------- spectral
def _top(k: int):
    return lambda evals: list(range(evals.numel() - k, evals.numel()))


def _ref_ggn(model, lossfunc, X, y, subsampling=None) -> Tensor:
    """GGN of the mean loss over the kept samples: ``(1/N') Σ_{n∈𝒮} N·B[n, n]``."""
    B = ggn_blocks(model, lossfunc, X, y)[0]
    n = B.shape[0]
    idx = list(range(n)) if subsampling is None else subsampling
    return torch.stack([n * B[i, i] for i in idx]).mean(0)


def _block(G: Tensor, model: nn.Module, params: list) -> Tensor:
    where, i = {}, 0
    for p in model.parameters():
        where[id(p)] = (i, i + p.numel())
        i += p.numel()
    idx = torch.cat([torch.arange(*where[id(p)], device=G.device) for p in params])
    return G[idx[:, None], idx]


def _groups(model: nn.Module, grouping: str) -> list[dict]:
    params = list(model.parameters())
    return [{"params": params}] if grouping == "full" else [{"params": [p]} for p in params]


def _run(comp, groups, model, lossfunc, X, y) -> None:
    with collect(*comp.get_extensions(), extension_hook=comp.get_extension_hook(groups)):
        lossfunc(model(X), y).backward()


@pytest.mark.parametrize("subsampling", [None, [2, 0]], ids=["all", "sub"])
@pytest.mark.parametrize("grouping", ["full", "blocks"])
def test_eigvalsh(grouping, subsampling):
    model, lossfunc, X, y, _ = build("mlp", seed=6)
    G = _ref_ggn(model, lossfunc, X, y, subsampling)
    extend(model), extend(lossfunc)
    comp = EigvalshComputation(subsampling=subsampling)
    groups = _groups(model, grouping)
    _run(comp, groups, model, lossfunc, X, y)
    for group in groups:
        ours = comp.get_result(group)
        assert_on_device(ours, "eigenvalues")
        ref = torch.linalg.eigvalsh(_block(G, model, group["params"]))
        m = min(ours.numel(), ref.numel())  # the rest are zero
        scale = float(ref.abs().max())
        torch.testing.assert_close(ours[-m:], ref[-m:], rtol=1e-6, atol=1e-9 * scale)
        for rest in (ours[:-m], ref[:-m]):
            assert rest.numel() == 0 or float(rest.abs().max()) < 1e-9 * scale


@pytest.mark.parametrize("grouping", ["full", "blocks"])
def test_eigh(grouping):
    model, lossfunc, X, y, _ = build("mlp", seed=7)
    sub = [1, 2]
    G = _ref_ggn(model, lossfunc, X, y, sub)
    extend(model), extend(lossfunc)
    comp = EighComputation(subsampling=sub)
    groups = _groups(model, grouping)
    for g in groups:
        g["criterion"] = _top(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny blocks may have tiny eigenvalues
        _run(comp, groups, model, lossfunc, X, y)
    for group in groups:
        evals, vecs = comp.get_result(group)
        assert_on_device([evals, vecs], "eigenpairs")
        assert [v.shape for v in vecs] == [(2, *p.shape) for p in group["params"]]
        Gb = _block(G, model, group["params"])
        torch.testing.assert_close(evals, torch.linalg.eigvalsh(Gb)[-2:], rtol=1e-6, atol=1e-10)
        E = torch.cat([v.flatten(1) for v in vecs], 1)
        if float(evals.min()) > 1e-6:
            torch.testing.assert_close(Gb @ E.T, E.T * evals, rtol=1e-6, atol=1e-8)
            eye = torch.eye(2, dtype=E.dtype, device=E.device)
            torch.testing.assert_close(E @ E.T, eye, rtol=0, atol=1e-8)


def test_damped_newton_step():
    """One closure step: ``θ ← θ + η Σ_d e_d (−ḡᵀe_d)/(λ_d + δ)`` over the top 3 eigenpairs of
    the GGN (``λ̄_d = λ_d`` without sub-sampling); then a backward-in-context step and an
    adaptive step run on the device."""
    lr, damping, k = 0.7, 0.5, 3
    model, lossfunc, X, y, _ = build("mlp", seed=8)
    G = _ref_ggn(model, lossfunc, X, y)
    g = torch.cat([v.sum(0).flatten() for v in per_sample_grads(model, lossfunc, X, y).values()])
    evals, evecs = torch.linalg.eigh(G)
    lam, e = evals[-k:], evecs[:, -k:]
    expected = lr * e @ (-(g @ e) / (lam + damping))
    extend(model), extend(lossfunc)
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    opt = DampedNewton(model.parameters(), lr=lr, damping=damping, criterion=_top(k))
    loss = opt.step(lambda: lossfunc(model(X), y))
    assert_on_device(loss, "closure loss")
    for p in model.parameters():
        assert_on_device(p, "parameter")
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(after - before, expected, rtol=1e-6, atol=1e-10)

    with opt.collect():
        lossfunc(model(X), y).backward()
    opt.step()
    adaptive = DampedNewton(model.parameters(), damping=1.0, adaptive=True)
    adaptive.step(lambda: lossfunc(model(X), y))
    assert math.isfinite(adaptive.last_rho)
    for p in model.parameters():
        assert p.device == _resolved() and torch.isfinite(p).all()


# --------------------------------------------------------------------------- monitor
def _finite(value: Any) -> bool:
    if isinstance(value, Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return bool(np.isfinite(value.astype(np.float64)).all())
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, (bool, int, np.integer)):
        return True
    if isinstance(value, (float, np.floating)):
        return math.isfinite(float(value))
    return False


def _quantities(schedule, hess_max_ev: bool = True) -> list[quantities.Quantity]:
    """The full configuration plus variants that take other code paths (without HessMaxEV if
    ``hess_max_ev`` is false)."""
    extra = [
        quantities.GradHist1d(schedule, bins=12, range=(-0.5, 0.5), adapt=GradAbsMax(schedule)),
        quantities.GradHist2d(schedule, bins=(5, 4), keep_individual=True),
        quantities.HessTrace(schedule, curvature="diag_ggn_exact"),
        quantities.HessTrace(schedule, curvature="diag_ggn_mc"),
        quantities.TICDiag(schedule, curvature="diag_ggn_exact"),
        quantities.TICTrace(schedule, curvature="diag_ggn_exact"),
        quantities.Parameters(schedule),
    ]
    qs = configuration("full", schedule) + extra
    return [q for q in qs if hess_max_ev or not isinstance(q, quantities.HessMaxEV)]


@pytest.mark.parametrize(
    ("name", "opt_name"), [("mlp", "sgd"), ("mlp", "adam"), ("cnn", "sgd"), ("resnet", "sgd")]
)
def test_monitor(name, opt_name, tmp_path):
    model, lossfunc, _, _, _ = build(name, seed=9)
    nb = 6
    with torch.device("cpu"):
        randn, labels = _cpu_data(10)
        shape = {"mlp": (4,), "cnn": (2, 4, 4), "resnet": (2, 3, 3)}[name]
        batches = [(randn(nb, *shape).to(DEVICE), labels(3, nb).to(DEVICE)) for _ in "ab"]
    individual = nn.CrossEntropyLoss(reduction="none")
    params = list(model.parameters())
    X0, y0 = batches[0]
    with suspended():  # brute force at step 0, before training
        ps = per_sample_grads(model, lossfunc, X0, y0)
        G = torch.cat([v.flatten(1) for v in ps.values()], 1) * nb  # [N, D]: ∇ℓₙ
        diag = torch.diagonal(ggn_blocks(model, lossfunc, X0, y0)[0].sum((0, 1)))
    extend(model), extend(lossfunc)
    if opt_name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.2)
    else:
        opt = torch.optim.Adam(params, lr=0.05)
    schedule = schedules.linear(1)
    qs = _quantities(schedule, hess_max_ev=False)  # tested alone below
    monitor = Monitor(params, qs, log_path=tmp_path / "run.jsonl")
    torch.manual_seed(0)
    losses = []
    for step, (X, y) in enumerate(batches):
        opt.zero_grad()
        out = model(X)
        loss = lossfunc(out, y)
        losses.append(float(loss.detach()))
        tracked_backward(monitor, step, loss, individual(out, y), nb, opt)
        opt.step()
        for p in params:
            assert p.device == _resolved()
            for attr in vars(p):
                assert not isinstance(getattr(p, attr), Tensor), f"{attr} left on the parameter"
    monitor.log(1, 0, train_loss=torch.tensor(losses[-1], device=DEVICE), learning_rate=0.1)
    monitor.close()
    monitor.write(tmp_path / "out.json")

    out = monitor.get_output()
    for q in qs:
        assert 0 in out[q.key], q.key  # Alpha, UpdateSize: stored under the start step
        for step, value in out[q.key].items():
            if q.key.startswith("Alpha") and value == -1.0:
                continue  # concave fit: recorded as −1
            assert _finite(value), (q.key, step, value)

    # brute force at step 0
    g = G.mean(0)
    g2 = float(g.square().sum())
    sizes = [p.numel() for p in params]
    assert out["Loss"][0] == pytest.approx(losses[0], rel=1e-12)
    np.testing.assert_allclose(out["GradNorm"][0], [float(v.norm()) for v in g.split(sizes)])
    norm_test = math.sqrt(float((G - g).square().sum()) / (nb - 1) / nb / g2)
    assert out["NormTest"][0] == pytest.approx(norm_test, rel=1e-8)
    inner = math.sqrt(float((G @ g).var()) / nb / g2**2)
    assert out["InnerTest"][0] == pytest.approx(inner, rel=1e-8)
    trace = [float(d.sum()) for d in diag.split(sizes)]
    np.testing.assert_allclose(out["HessTrace(curvature=diag_ggn_exact)"][0], trace, rtol=1e-8)
    tic = float((G.square().mean(0) / (diag + 1e-7)).sum())
    assert out["TICDiag(curvature=diag_ggn_exact)"][0] == pytest.approx(tic, rel=1e-8)
    hist = [v for k, v in out.items() if k.startswith("GradHist1d")]
    assert {int(np.asarray(h[0]["hist"]).sum()) for h in hist} == {nb * sum(sizes)}

    log = read_log(tmp_path / "run.jsonl", as_frame=False)
    assert set(log["meta"]["quantities"]) == {q.key for q in qs}
    assert [s["step"] for s in log["steps"]] == [0, 1]
    assert set(log["steps"][0]["values"]) >= {q.key for q in qs}
    assert log["logs"][0]["train_loss"] == pytest.approx(losses[-1])
    assert log["steps"][0]["values"]["Loss"] == pytest.approx(losses[0], rel=1e-12)
    with open(tmp_path / "out.json", encoding="utf-8") as f:
        written = json.load(f)
    assert written["Loss"]["0"] == pytest.approx(losses[0], rel=1e-12)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_monitor_hess_max_ev(name):
    """Lanczos on Hessian-vector products on the device, against ``eigvalsh`` of the dense
    Hessian, at two steps (the second warm-started)."""
    model, lossfunc, _, _, _ = build(name, seed=13)
    with torch.device("cpu"):
        randn, labels = _cpu_data(14)
        shape = {"mlp": (4,), "resnet": (2, 3, 3)}[name]
        X, y = randn(6, *shape).to(DEVICE), labels(3, 6).to(DEVICE)
    expected = float(torch.linalg.eigvalsh(loss_hessian(model, lossfunc, X, y))[-1])
    extend(model), extend(lossfunc)
    monitor = Monitor(model.parameters(), [quantities.HessMaxEV(schedules.linear(1))])
    for step in range(2):
        model.zero_grad()
        loss = lossfunc(model(X), y)
        with monitor(step, info={"loss": loss}):
            loss.backward(create_graph=monitor.create_graph(step))
        for p in model.parameters():
            p.grad = None  # drop the graph kept by create_graph
    for value in monitor.get_output()["HessMaxEV"].values():
        assert value == pytest.approx(expected, rel=1e-3)


def test_monitor_under_default_device():
    """A user who sets ``torch.set_default_device(DEVICE)`` (here scoped, ``with
    torch.device(DEVICE)``): tensors the library creates without ``device=`` land on the device
    and must still be usable (e.g. converted to NumPy for the output)."""
    model, lossfunc, _, _, _ = build("mlp", seed=11)
    with torch.device("cpu"):
        randn, labels = _cpu_data(12)
        X, y = randn(6, 4).to(DEVICE), labels(3, 6).to(DEVICE)
    extend(model), extend(lossfunc)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = schedules.linear(1)
    qs = _quantities(schedule)
    monitor = Monitor(model.parameters(), qs)
    with torch.device(DEVICE):
        for step in range(2):
            opt.zero_grad()
            out = model(X)
            loss = lossfunc(out, y)
            individual = nn.functional.cross_entropy(out, y, reduction="none")
            tracked_backward(monitor, step, loss, individual, 6, opt)
            opt.step()
    out = monitor.get_output()
    for q in qs:
        assert 0 in out[q.key], q.key
        assert all(
            _finite(v) or (q.key.startswith("Alpha") and v == -1.0) for v in out[q.key].values()
        ), q.key


def tracked_backward(
    monitor: Monitor, step: int, loss: Tensor, individual: Tensor, batch_size: int, opt: Any
) -> None:
    """``loss.backward`` inside ``monitor(step, info=...)`` (warnings silenced)."""
    info = {
        "loss": loss,
        "individual_losses": individual,
        "batch_size": batch_size,
        "optimizer": opt,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with monitor(step, info=info):
            loss.backward(create_graph=monitor.create_graph(step))
