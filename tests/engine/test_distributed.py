"""Distributed data parallelism on CPU with gloo (float64).

Every extension under ``DDP(extend(model))`` is compared with one process on the concatenated
global batch (rtol 1e-6): global quantities must equal the one-process values on every rank,
per-sample tensors this rank's rows of them (see :mod:`backprism.engine.distributed`). The
one-process values themselves are checked against dense references in the other test files;
``grad_batch`` is checked against ``tests/reference.py`` here too.

One process group per test (2 or 3 ranks, started from a preloaded forkserver, rendezvous
through a file in a temporary directory); each runs many checks. A failing rank raises, the
others are stopped by ``torch.multiprocessing`` (collectives time out after 60 s).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as tmp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from backprism import collect, extend  # noqa: E402
from backprism.engine import UncheckedOperationWarning  # noqa: E402
from backprism.extensions import (  # noqa: E402
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchDotGrad,
    BatchDotWith,
    BatchGrad,
    BatchL2Grad,
    BatchProjGrad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    GradHist,
    HutchinsonDiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from tests.common import TanhResidual, assert_nothing_written, init_gloo  # noqa: E402

RTOL, ATOL = 1e-6, 1e-12

#: per-sample results: rows along the first axis / along the second (``[K, N, *p]``)
ROWS = {
    "grad_batch",
    "batch_l2",
    "diag_ggn_exact_batch",
    "diag_ggn_mc_batch",
    "diag_h_batch",
    "batch_dot_with",
    "batch_proj_grad",
}
COLUMNS = {"sqrt_ggn_exact", "sqrt_ggn_mc"}


# -- process groups ---------------------------------------------------------------------------
def _spawn(fn, world: int, *args) -> None:
    ctx = multiprocessing.get_context("forkserver")
    # DDP imports torch._dynamo on construction (seconds): once, in the forkserver
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "backprism.extensions", __name__])
    with tempfile.TemporaryDirectory() as d:
        tmp.start_processes(
            fn,
            args=(world, os.path.join(d, "rendezvous"), *args),
            nprocs=world,
            join=True,
            start_method="forkserver",
        )



# -- models and data ----------------------------------------------------------------------------
class Shared(nn.Module):
    """One Linear layer used twice (the engine's dense path for shared parameters)."""

    def __init__(self, d: int = 5, c: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, 6)
        self.block = nn.Linear(6, 6)
        self.out = nn.Linear(6, c)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.block(h))
        return self.out(h + torch.tanh(self.block(h)))


def _shared():
    return Shared().double(), torch.randn(16, 5, dtype=torch.float64)


def _residual():
    return TanhResidual().double(), torch.randn(32, 5, dtype=torch.float64)


def _conv():
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    ).double()
    return model, torch.randn(16, 2, 6, 6, dtype=torch.float64)


def _chain():
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    return model, torch.randn(16, 5, dtype=torch.float64)


class Cross(nn.Module):
    """Tokens attend to a shorter memory (cross-attention: the packed projection's Kronecker
    factors are block-diagonal over query, key and value)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        mem = torch.tanh(x[:, 1:])
        return self.out(self.attn(x, mem, mem, need_weights=False)[0].mean(1))


def _cross():
    return Cross().double(), torch.randn(16, 3, 4, dtype=torch.float64)


class SharedNorm(nn.Module):
    """One LayerNorm called twice: its parameters' Kronecker factor is the single diagonal
    factor of all uses at once."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        h = torch.tanh(self.norm(self.inp(x)))
        return self.out(torch.tanh(self.norm(self.mid(h))))


def _shared_norm():
    torch.manual_seed(0)
    model = SharedNorm().double()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model, torch.randn(16, 5, dtype=torch.float64)


def _norms():
    """A LayerNorm and a softmax between parameters (row-wise Hessian terms, DiagHessian)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 4), nn.Softmax(-1),
        nn.Linear(4, 3),
    ).double()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    return model, torch.randn(16, 5, dtype=torch.float64)


class Attending(nn.Module):
    """Causal attention on hidden features through the fused kernel, and a gated product of
    two values of the same parameters (the attention and product Hessian terms, DiagHessian)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.qkv = nn.Linear(5, 4), nn.Linear(4, 12)
        self.gate, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):  # [N, T, 5]
        N, T, _ = x.shape
        h = torch.tanh(self.inp(x))
        q, k, v = (t.view(N, T, 2, 2).transpose(1, 2) for t in self.qkv(h).split(4, -1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out((o.transpose(1, 2).reshape(N, T, 4) * self.gate(h)).mean(1))


def _attention():
    torch.manual_seed(0)
    return Attending().double(), torch.randn(16, 3, 5, dtype=torch.float64)


class JoinedBiasAttention(nn.Module):
    """timm's BEiT attention: query and value biases joined with a constant key bias as the
    bias of ``qkv``'s weight (``qkv`` never runs), a relative position table indexed by a
    buffer as the fused attention's mask (expanded over each rank's samples)."""

    def __init__(self, t: int = 3) -> None:
        super().__init__()
        self.inp, self.qkv = nn.Linear(5, 4), nn.Linear(4, 12, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        self.register_buffer("k_bias", torch.zeros(4), persistent=False)
        self.table = nn.Parameter(torch.randn(2 * t - 1, 2) * 0.5)
        idx = torch.arange(t)
        self.register_buffer("index", idx[:, None] - idx[None, :] + t - 1, persistent=False)
        self.out = nn.Linear(4, 3)

    def forward(self, x):  # [N, T, 5]
        N, T, _ = x.shape
        h = torch.tanh(self.inp(x))
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        q, k, v = F.linear(h, self.qkv.weight, bias).view(N, T, 3, 2, 2).permute(2, 0, 3, 1, 4)
        rel = self.table[self.index.view(-1)].view(T, T, 2).permute(2, 0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=rel)
        return self.out(o.transpose(1, 2).reshape(N, T, 4).mean(1))


def _joined():
    torch.manual_seed(0)
    return JoinedBiasAttention().double(), torch.randn(16, 3, 5, dtype=torch.float64)


class WindowedMlpBias(nn.Module):
    """Swin V2's continuous position bias: an MLP with an in-place ReLU on a constant table,
    added to the scores of windows folded sample-major into the batch (``[N·W, H, T, T]``):
    widened to one copy per sample, repeated over the sample's windows, on each rank."""

    def __init__(self, w: int = 3, t: int = 2) -> None:
        super().__init__()
        self.w, self.t = w, t
        self.qk, self.out = nn.Linear(5, 8), nn.Linear(4, 3)
        self.register_buffer("coords", torch.randn(2 * t - 1, 2), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
        idx = torch.arange(t)
        self.register_buffer("index", idx[:, None] - idx[None, :] + t - 1, persistent=False)

    def forward(self, x):  # [N, W·T, 5]
        n, w, t = x.shape[0], self.w, self.t
        q, k = self.qk(x).reshape(n * w, t, 2, 2, 2).permute(2, 0, 3, 1, 4)  # [N·W, 2, T, 2]
        b = self.mlp(self.coords)[self.index.view(-1)].view(t, t, 2).permute(2, 0, 1)
        attn = (q @ k.transpose(-1, -2) + 16 * torch.sigmoid(b).unsqueeze(0)).softmax(-1)
        o = (attn @ k).transpose(1, 2).reshape(n, w * t, 4)
        return self.out(o.mean(1))


def _windowed():
    torch.manual_seed(0)
    return WindowedMlpBias().double(), torch.randn(16, 6, 5, dtype=torch.float64)


MODELS = {
    "residual": _residual, "conv": _conv, "chain": _chain, "shared": _shared, "cross": _cross,
    "shared_norm": _shared_norm, "norms": _norms, "attention": _attention, "joined": _joined,
    "windowed": _windowed,
}


def _problem(name: str, n: int):
    torch.manual_seed(0)
    model, X = MODELS[name]()
    return model, X[:n], torch.randint(0, 3, (n,))


def _slice(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


# -- running and comparing ----------------------------------------------------------------------
def _results(model: nn.Module, exts) -> dict:
    return {
        name: {e.savefield: getattr(p, e.savefield) for e in exts if hasattr(p, e.savefield)}
        for name, p in model.named_parameters()
    }


def _lossfunc(reduction: str, functional: bool | str):
    """An extended ``CrossEntropyLoss``, (``functional``) ``F.cross_entropy``, or
    (``"own"``) per-sample losses reduced by ``.sum()`` / ``.mean()`` (no loss backprism
    knows; the reduction is read off the start of the pass)."""
    if functional == "own":
        ce = nn.functional.cross_entropy
        return lambda out, y: getattr(ce(out, y, reduction="none"), reduction)()
    if functional:
        return lambda out, y: nn.functional.cross_entropy(out, y, reduction=reduction)
    return extend(nn.CrossEntropyLoss(reduction=reduction))


def _one_process(name, n, exts, reduction="mean", seed=1, functional=False, **kw):
    """One process on the global batch (no DDP, local values)."""
    model, X, y = _problem(name, n)
    model = extend(model)
    lossfunc = _lossfunc(reduction, functional)
    torch.manual_seed(seed)
    with collect(*exts, process_group=None, **kw):
        lossfunc(model(X), y).backward()
    return _results(model, exts), {k: p.grad for k, p in model.named_parameters()}


def _ddp(name, sizes, rank, exts, reduction="mean", seed=1, wrap="outside", functional=False, **kw):
    """``wrap``: ``"outside"`` DDP(extend(model)), ``"inside"`` extend(DDP(model)),
    ``"unused"`` DDP(..., find_unused_parameters=True) (DDP's autograd Function in the graph)."""
    model, X, y = _problem(name, sum(sizes))
    if wrap == "inside":
        ddp = extend(DDP(model))
    else:
        model = extend(model)
        ddp = DDP(model, find_unused_parameters=wrap == "unused")
    lossfunc = _lossfunc(reduction, functional)
    sl = _slice(sizes, rank)
    torch.manual_seed(seed)
    with collect(*exts, **kw) as ctx:
        lossfunc(ddp(X[sl]), y[sl]).backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    return _results(model, exts), grads, ctx


def _close(got, ref, what: str) -> None:
    if isinstance(ref, dict):
        assert set(got) == set(ref), what
        for k in ref:
            _close(got[k], ref[k], f"{what}[{k}]")
    elif isinstance(ref, list):
        assert len(got) == len(ref), what
        for i, (a, b) in enumerate(zip(got, ref)):
            _close(a, b, f"{what}[{i}]")
    elif hasattr(ref, "to_dense") and not isinstance(ref, torch.Tensor):
        _close(got.to_dense(), ref.to_dense(), what)
    else:
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _compare(got: dict, ref: dict, sl: slice, what: str, across: bool = False) -> None:
    assert got.keys() == ref.keys()
    for pname, fields in ref.items():
        assert set(got[pname]) == set(fields), (what, pname, set(got[pname]), set(fields))
        for field, value in fields.items():
            if field in ROWS:
                value = value[sl]
            elif field in COLUMNS:
                value = value[:, sl]
            elif field == "batch_dot" and not across:
                value = value[sl, sl]
            _close(got[pname][field], value, f"{what} {pname}.{field}")


FIRST = [
    [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad()],
    [BatchProjGrad(), GradHist(bins=20, range=(-0.5, 0.5), abs_max=True)],
    [BatchDotGrad(across_ranks=True)],
    # an explicit scale bins s·grad_batch of the global batch; BatchL2Grad reads the norms
    # GradHist hands to the per-call memo, both from the rows scaled during the pass
    [GradHist(bins=20, range=(-0.05, 0.05), scale=1.0, abs_max=True), BatchL2Grad()],
]
SECOND = [
    [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), KFLR()],
    [DiagHessian(), BatchDiagHessian(), HMP()],
    [GGNMP(), PCHMP()],
    [HutchinsonDiagHessian(samples=2)],  # all ranks draw the same Rademacher vectors
]


def _vectors(model: nn.Module) -> BatchDotWith:
    g = torch.Generator().manual_seed(3)
    return BatchDotWith(
        {p: torch.randn(p.shape, generator=g, dtype=p.dtype) for p in model.parameters()}
    )


def _check_all(
    rank: int, world: int, name: str, sizes: list[int], groups, wrap: str = "outside"
) -> None:
    n, sl = sum(sizes), _slice(sizes, rank)
    for exts in groups:
        across = any(getattr(e, "across_ranks", False) for e in exts)
        ref, ref_grad = _one_process(name, n, exts)
        got, grad, _ = _ddp(name, sizes, rank, exts, wrap=wrap)
        _compare(got, ref, sl, f"{name} {sizes} {exts}", across)
        if len(set(sizes)) == 1:  # DDP's averaged .grad is the global mean's gradient
            for k in ref_grad:
                _close(grad[k], ref_grad[k], f"{name} .grad {k}")


def _check_dot_with(rank: int, sizes: list[int]) -> None:
    """BatchDotWith's vectors are keyed by parameter: each run builds them on its own model."""
    n, sl = sum(sizes), _slice(sizes, rank)
    lossfunc = extend(nn.CrossEntropyLoss())
    model, X, y = _problem("residual", n)
    model = extend(model)
    exts = [_vectors(model)]
    with collect(*exts, process_group=None):
        lossfunc(model(X), y).backward()
    ref = _results(model, exts)
    model = extend(_problem("residual", n)[0])
    exts = [_vectors(model)]
    ddp = DDP(model)
    with collect(*exts):
        lossfunc(ddp(X[sl]), y[sl]).backward()
    _compare(_results(model, exts), ref, sl, "BatchDotWith")


def _check_rows_sum_to_grad(rank: int, sizes: list[int]) -> None:
    """Equal sizes: Σ over all ranks' grad_batch rows = DDP's .grad; rows = dense reference."""
    from tests.reference import per_sample_grads

    n, sl = sum(sizes), _slice(sizes, rank)
    got, grad, _ = _ddp("residual", sizes, rank, [BatchGrad()])
    model, X, y = _problem("residual", n)
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    for k, fields in got.items():
        rows = fields["grad_batch"]
        _close(rows, ref[k][sl], f"grad_batch {k} vs reference")
        total = rows.sum(0)
        dist.all_reduce(total)
        _close(total, grad[k], f"Σ rows {k} vs .grad")


def _check_mc(rank: int, sizes: list[int]) -> None:
    """MC columns are sampled per rank: the global value is the ranks' local values (same
    random state) rescaled and combined."""
    n, sl = sum(sizes), _slice(sizes, rank)
    rho = sizes[rank] / n
    exts = [DiagGGNMC(mc_samples=2), BatchDiagGGNMC(mc_samples=2), SqrtGGNMC(mc_samples=2)]
    for group in (exts, [KFAC(mc_samples=2)]):
        model, X, y = _problem("residual", n)
        model = extend(model)
        torch.manual_seed(5 + rank)
        with collect(*group, process_group=None):
            extend(nn.CrossEntropyLoss())(model(X[sl]), y[sl]).backward()
        local = _results(model, group)
        got, _, _ = _ddp("residual", sizes, rank, group, seed=5 + rank)
        for pname, fields in local.items():
            for field, value in fields.items():
                if field in ROWS:
                    expect = value * rho
                elif field in COLUMNS:
                    expect = value * rho**0.5
                elif field == "kfac":
                    expect = []
                    for f, w in zip(value, [rho, sizes[rank] / n]):
                        f = f * w
                        dist.all_reduce(f)
                        expect.append(f)
                else:
                    expect = value * rho
                    dist.all_reduce(expect)
                _close(got[pname][field], expect, f"MC {pname}.{field}")


def _check_sum_reduction(rank: int, sizes: list[int]) -> None:
    """``reduction="sum"``, of an extended loss, of a functional ``F.cross_entropy`` and of
    per-sample losses summed by ``.sum()`` (the reduction read off the graph, not assumed to
    be the mean)."""
    n, sl = sum(sizes), _slice(sizes, rank)
    exts = [BatchGrad(), Variance(), DiagGGNExact(), KFLR(), GradHist(bins=20, abs_max=True)]
    for functional in (False, True, "own"):
        if functional == "own":  # (curvature needs a loss whose Hessian backprism knows)
            exts = exts[:2]
        ref, _ = _one_process("residual", n, exts, reduction="sum", functional=functional)
        got, _, _ = _ddp("residual", sizes, rank, exts, reduction="sum", functional=functional)
        _compare(got, ref, sl, f"reduction='sum', functional={functional}")


def _check_hook_and_communication(rank: int, sizes: list[int]) -> None:
    """extension_hook runs after the reduction; bytes per extension and collectives."""
    ref, _ = _one_process("residual", sum(sizes), [SumGradSquared()])
    seen = {}

    def hook(module):
        for k, p in module.named_parameters(recurse=False):
            seen[(id(module), k)] = p.sum_grad_squared.clone()

    _, _, ctx = _ddp("residual", sizes, rank, [SumGradSquared()], extension_hook=hook)
    assert len(seen) == 6
    for fields in ref.values():
        r = fields["sum_grad_squared"]
        assert any(v.shape == r.shape and torch.allclose(v, r) for v in seen.values())
    comm = ctx.communication
    assert comm.bytes["SumGradSquared"] == comm.gradient_bytes == 99 * 8
    assert comm.collectives == 3  # sizes (at the start), one bucket, the items check
    # Variance: with equal sizes DDP's .grad is the global gradient, nothing more is sent
    _, _, ctx = _ddp("residual", sizes, rank, [Variance()])
    equal = len(set(sizes)) == 1
    assert ctx.communication.bytes["Variance"] == (1 if equal else 2) * 99 * 8
    # Σ gb² shared by SumGradSquared and Variance is sent once
    _, _, ctx = _ddp("residual", sizes, rank, [SumGradSquared(), Variance()])
    assert ctx.communication.bytes.get("Variance", 0) == (0 if equal else 99 * 8)
    # KFLR: A and B per layer, a bias's B (the weight's) not sent again
    _, _, ctx = _ddp("residual", sizes, rank, [KFLR()])
    assert ctx.communication.bytes["KFLR"] == (25 + 36 + 36 + 36 + 36 + 9) * 8


def _check_no_sync(rank: int, sizes: list[int]) -> None:
    """Inside no_sync() results are local (DDP does not communicate), the synchronising step
    gives the global values of its micro-batch, and .grad accumulates as with plain DDP."""
    n, sl = sum(sizes), _slice(sizes, rank)
    exts = [BatchGrad(), SumGradSquared(), Variance(), DiagGGNExact()]
    model, X, y = _problem("residual", 2 * n)
    X1, y1, X2, y2 = X[:n], y[:n], X[n:], y[n:]
    lossfunc = extend(nn.CrossEntropyLoss())
    ref_model = extend(_problem("residual", 1)[0])

    def reference(xb, yb):
        ref_model.zero_grad()
        with collect(*exts, process_group=None):
            lossfunc(ref_model(xb), yb).backward()
        grads = {k: p.grad.clone() for k, p in ref_model.named_parameters()}
        return _results(ref_model, exts), grads

    local_ref, local_grad = reference(X1[sl], y1[sl])
    global_ref, global_grad = reference(X2, y2)
    model = extend(_problem("residual", 1)[0])
    ddp = DDP(model)
    with ddp.no_sync(), collect(*exts):
        lossfunc(ddp(X1[sl]), y1[sl]).backward()
    _compare(_results(model, exts), local_ref, slice(None), "no_sync step (local)")
    for k, p in model.named_parameters():
        _close(p.grad, local_grad[k], f"no_sync .grad {k}")
    with collect(*exts):
        lossfunc(ddp(X2[sl]), y2[sl]).backward()
    _compare(_results(model, exts), global_ref, sl, "step after no_sync (global)")
    # .grad: DDP's average over ranks of both micro-batches' local gradients
    for k, p in model.named_parameters():
        expect = local_grad[k].clone()
        dist.all_reduce(expect)
        _close(p.grad, expect / dist.get_world_size() + global_grad[k], f"accumulated .grad {k}")
    # an explicit group reduces inside no_sync() too; None keeps local values under DDP
    model.zero_grad()
    with ddp.no_sync(), collect(*exts, process_group=dist.group.WORLD):
        lossfunc(ddp(X2[sl]), y2[sl]).backward()
    _compare(_results(model, exts), global_ref, sl, "no_sync with process_group")
    model.zero_grad()
    with collect(*exts, process_group=None):
        lossfunc(ddp(X1[sl]), y1[sl]).backward()
    _compare(_results(model, exts), local_ref, slice(None), "process_group=None")


def _check_refusals(rank: int, sizes: list[int]) -> None:
    from backprism.spectral import EighComputation

    n, sl = sum(sizes), _slice(sizes, rank)
    model, X, y = _problem("residual", n)
    model = extend(model)
    ddp = DDP(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    comp = EighComputation()
    group = {"params": list(model.parameters()), "criterion": lambda evals: [len(evals) - 1]}
    loss = lossfunc(ddp(X[sl]), y[sl])
    hook = comp.get_extension_hook([group])
    with pytest.raises(RuntimeError, match="process_group=None"):  # noqa: SIM117
        with collect(comp.get_extension(), extension_hook=hook):
            loss.backward()
    # ranks that computed different things get an error, not a hang
    exts = [SumGradSquared()] if rank == 0 else [SumGradSquared(), BatchL2Grad()]
    with pytest.raises(RuntimeError, match="computed different results"), collect(*exts):
        lossfunc(ddp(X[sl]), y[sl]).backward()
    assert not hasattr(model.out.weight, "sum_grad_squared")  # no local values left behind
    # a rank that refuses before its backward (here: a penalty on a weight outside the forward,
    # on rank 0 only) tells the others, which raise naming it, instead of waiting for it; it
    # runs the plain backward, so DDP's gradient all-reduce completes on every rank
    model.zero_grad()
    loss = lossfunc(ddp(X[sl]), y[sl])
    if rank == 0:
        loss = loss + 0.0 * model.out.weight.sum()
    refusal = "outside the forward" if rank == 0 else r"rank\(s\) \[0\] .* refused"
    with pytest.raises(RuntimeError, match=refusal), collect(BatchL2Grad(), DiagGGNExact()):
        loss.backward()
    assert_nothing_written(model)
    grads = [torch.zeros_like(model.out.weight.grad) for _ in range(2)]
    dist.all_gather(grads, model.out.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])  # DDP's averaged gradient on both ranks
    _check_all(rank, 2, "residual", sizes, [FIRST[0]])  # the group still works
    # FSDP2 is refused (where fully_shard runs on CPU)
    try:
        from torch.distributed.fsdp import fully_shard

        sharded = _problem("residual", n)[0]
        fully_shard(sharded)
    except Exception:
        return
    sharded = extend(sharded)
    with pytest.raises(RuntimeError, match="FSDP"), collect(BatchGrad()):
        lossfunc(sharded(X[sl]), y[sl]).backward()


# -- workers ------------------------------------------------------------------------------------
def _two_ranks(rank: int, world: int, path: str) -> None:
    init_gloo(rank, world, path)
    try:
        for sizes in ([4, 4], [3, 5]):
            _check_all(rank, world, "residual", sizes, FIRST + SECOND)
            _check_dot_with(rank, sizes)
            _check_hook_and_communication(rank, sizes)
        _check_all(rank, world, "conv", [4, 4], [FIRST[0], [DiagGGNExact(), KFLR()]])
        _check_all(rank, world, "chain", [3, 5], [[KFRA(), KFLR()]])
        _check_all(rank, world, "cross", [3, 5], [[KFLR(), DiagGGNExact()]])
        _check_all(rank, world, "shared_norm", [3, 5], [[KFLR(), DiagGGNExact()]])
        _check_all(rank, world, "norms", [3, 5], [SECOND[1]])
        _check_all(rank, world, "attention", [3, 5], [SECOND[1]])
        # (timm's BEiT attention: a joined bias, a released sub-module weight, a table mask)
        _check_all(rank, world, "joined", [3, 5], [FIRST[0], SECOND[0], SECOND[1]])
        # (Swin V2's position-bias MLP met by windows; one copy per sample on each rank, also
        # on a rank with one sample)
        for sizes in ([3, 5], [1, 5]):
            _check_all(rank, world, "windowed", sizes, [FIRST[0], SECOND[0]])
        _check_all(rank, world, "residual", [1, 5], [FIRST[0], SECOND[0]])  # one sample
        second = [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), KFLR()]
        shared = [FIRST[0], FIRST[1], FIRST[3], second]
        _check_all(rank, world, "shared", [3, 5], shared)
        # (a Linear applied to its own output: the product of its uses, residual.NestedSite)
        _check_all(rank, world, "shared", [3, 5], [[DiagHessian(), BatchDiagHessian()]])
        _check_all(rank, world, "residual", [3, 5], [FIRST[0], SECOND[0]], wrap="inside")
        with warnings.catch_warnings():  # (DDP's _DDPSink on the outputs is an identity)
            warnings.simplefilter("error", UncheckedOperationWarning)
            _check_all(rank, world, "residual", [4, 4], [FIRST[0], SECOND[0]], wrap="unused")
        _check_rows_sum_to_grad(rank, [4, 4])
        _check_mc(rank, [3, 5])
        _check_sum_reduction(rank, [3, 5])
        _check_no_sync(rank, [4, 4])
        _check_refusals(rank, [4, 4])
        _check_streaming(rank, world)
    finally:
        dist.destroy_process_group()


def _check_streaming(rank: int, world: int) -> None:
    """On backends that send finished results during the backward (NCCL; forced here on Gloo,
    with tiny buckets so that several are launched while the backward runs) every result is
    the one-process value as when everything is sent at the end."""
    from backprism.engine import distributed as D

    saved = D.STREAM_BACKENDS, D.FIRST_BUCKET_BYTES, D.DistributedPass.start

    def start(self, bp) -> None:
        saved[2](self, bp)
        self.bucket_bytes = 256

    D.STREAM_BACKENDS, D.FIRST_BUCKET_BYTES, D.DistributedPass.start = (
        frozenset({"gloo"}), 64, start
    )
    try:
        for sizes in ([4, 4], [3, 5]):
            _check_all(rank, world, "residual", sizes, FIRST)
        _check_all(rank, world, "shared", [3, 5], [FIRST[0], FIRST[3]])
        _, _, ctx = _ddp("residual", [3, 5], rank, [SumGradSquared(), Variance()])
        comm = ctx.communication
        assert comm.streamed >= 2 and len(comm.buckets) > comm.streamed
        # second order: final once the loss hook has pushed the columns, sent from there
        # (with first-order results as their parameters' calls finish); DiagHessian's
        # residual terms, KFRA and Hutchinson are sent at the end
        second = [SECOND[0], SECOND[2], [*FIRST[0], DiagGGNExact(), KFLR()], SECOND[1]]
        _check_all(rank, world, "residual", [3, 5], second)
        _check_all(rank, world, "shared", [3, 5], [[DiagGGNExact(), KFLR()]])
        _check_all(rank, world, "conv", [4, 4], [[DiagGGNExact(), KFLR()]])
        _check_mc(rank, [3, 5])
        _, _, ctx = _ddp("residual", [3, 5], rank, [DiagGGNExact(), KFLR()])
        assert ctx.communication.streamed >= 2
        _, _, ctx = _ddp("residual", [3, 5], rank, [DiagHessian()])
        assert ctx.communication.streamed == 0
    finally:
        D.STREAM_BACKENDS, D.FIRST_BUCKET_BYTES, D.DistributedPass.start = saved


def _three_ranks(rank: int, world: int, path: str) -> None:
    init_gloo(rank, world, path)
    try:
        sizes = [2, 3, 4]
        _check_all(rank, world, "residual", sizes, [FIRST[0], FIRST[1], SECOND[0], SECOND[1]])
        _check_all(rank, world, "conv", sizes, [[Variance(), BatchGrad(), KFLR()]])
        _check_all(rank, world, "chain", sizes, [[KFRA()]])
        _check_no_sync(rank, [3, 3, 3])
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_process():
    """Equal and unequal local batches, residual/conv/chain models, every extension, sum
    reduction, no_sync() accumulation, the switch, hooks, communication and refusals."""
    _spawn(_two_ranks, 2)


def test_three_ranks_unequal_batches():
    _spawn(_three_ranks, 3)


def test_reduction_read_off_the_start_of_a_pass() -> None:
    """Without a loss backprism knows, the convention is what the pass's start node shows:
    ``.mean()``, ``.sum()``, a loss operation's own ``reduction``; nothing for a sum of
    terms (taken as a mean, with a warning, by :func:`_loss_reduction`)."""
    from backprism.engine.distributed import _root_reduction

    x = torch.randn(4, 3, requires_grad=True)
    t = torch.randn(4, 3)
    assert _root_reduction((x * 2).mean().grad_fn) == "mean"
    assert _root_reduction((x * 2).sum().grad_fn) == "sum"
    assert _root_reduction(nn.functional.smooth_l1_loss(x, t, reduction="sum").grad_fn) == "sum"
    assert _root_reduction(nn.functional.huber_loss(x, t).grad_fn) == "mean"
    assert _root_reduction((x.mean() + x.sum()).grad_fn) is None
