"""``backprism.spectral.computations`` (eigenvalues, eigenvectors, directional
derivatives, damped Newton steps) against dense float64 GGNs from ``tests/reference.py``
(torch.func).

Reference quantities (mean loss, ``B = ggn_blocks`` with ``Σₙₘ B[n, m] = GGN``):
per-sample GGN ``GGNₙ = N·B[n, n]``; sub-sampled GGN ``(1/N')Σ_{n∈𝒮} GGNₙ``; per-sample gradient
``∇ℓₙ = N·per_sample_grads[n]``.

On every device (the ``device`` fixture): ``EigvalshComputation``/``EighComputation`` on an
MLP (whole and per-parameter groups, with and without sub-sampling), results on the device.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

import backprism
from backprism import collect, extend
from backprism.engine.state import suspended
from backprism.spectral import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
)
from tests.common import assert_on_device, build_on_device
from tests.reference import ggn, ggn_blocks, ggn_mean_over_samples, per_sample_grads

RTOL = 1e-4


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 3)
        self.block = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
        self.out = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.block(h))


class Seq(nn.Module):
    """Linear on a sequence (kernel form with T > 1), mean over positions, classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)).mean(1))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


def make(kind: str, n: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
        X = torch.randn(n, 4)
    elif kind == "conv":
        model = nn.Sequential(
            nn.Conv2d(2, 2, 2, padding=1, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3)
        )
        X = torch.randn(n, 2, 3, 3)
    elif kind == "conv1d":
        model = nn.Sequential(nn.Conv1d(2, 3, 2, dilation=2), nn.Tanh(), nn.Flatten(),
                              nn.Linear(9, 3))
        X = torch.randn(n, 2, 5)
    elif kind == "residual":
        model = Residual()
        X = torch.randn(n, 4)
    elif kind == "seq":
        model = Seq()
        X = torch.randn(n, 3, 3)
    elif kind == "transformer":
        model = Transformer().eval()
        X = torch.randn(n, 3, 4)
    else:
        raise ValueError(kind)
    model = model.double()
    y = torch.randint(0, 3, (n,))
    return backprism.extend(model), backprism.extend(nn.CrossEntropyLoss()), X.double(), y


def run(comp, groups, model, lossf, X, y):
    with backprism.collect(*comp.get_extensions(), extension_hook=comp.get_extension_hook(groups)):
        lossf(model(X), y).backward()


def ref_ggn(model, lossf, X, y, subsampling=None):
    """Sub-sampled GGN (mean over the kept samples), per-sample GGNs, per-sample gradients."""
    B, _, _ = ggn_blocks(model, lossf, X, y)
    n = B.shape[0]
    per_sample = torch.stack([n * B[i, i] for i in range(n)])
    idx = list(range(n)) if subsampling is None else subsampling
    G = per_sample[idx].mean(0)
    g = per_sample_grads(model, lossf, X, y)
    grads = torch.cat([v.flatten(1) for v in g.values()], 1) * n
    return G, per_sample, grads


def flat_index(model: nn.Module, params: list) -> torch.Tensor:
    """Indices of ``params`` in the flattened parameter vector (model order)."""
    sl, i = {}, 0
    for p in model.parameters():
        sl[id(p)] = (i, i + p.numel())
        i += p.numel()
    return torch.cat([torch.arange(*sl[id(p)]) for p in params])


def block(G: torch.Tensor, model: nn.Module, params: list) -> torch.Tensor:
    """Rows/columns of the flat GGN belonging to ``params``."""
    idx = flat_index(model, params)
    return G[..., idx[:, None], idx]


def groupings(model):
    params = list(model.parameters())
    return {"full": [{"params": params}], "blocks": [{"params": [p]} for p in params]}


def top(k):
    return lambda evals: list(range(evals.numel() - k, evals.numel()))


def flat(vecs):
    return torch.cat([v.flatten(1) for v in vecs], 1)


def compare_evals(ours: torch.Tensor, ref: torch.Tensor) -> None:
    m = min(ours.numel(), ref.numel())
    scale = float(ref.abs().max())
    torch.testing.assert_close(ours[-m:], ref[-m:], rtol=RTOL, atol=1e-9 * scale + 1e-12)
    for rest in (ours[:-m], ref[:-m]):  # the remaining ones are zero
        assert rest.numel() == 0 or float(rest.abs().max()) < 1e-9 * scale + 1e-12


MODELS = ["mlp", "conv", "conv1d", "residual", "seq", "transformer"]


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("grouping", ["full", "blocks"])
@pytest.mark.parametrize("subsampling", [None, [2, 0]])
def test_eigvalsh(kind, grouping, subsampling):
    model, lossf, X, y = make(kind)
    G, _, _ = ref_ggn(model, lossf, X, y, subsampling)
    comp = EigvalshComputation(subsampling=subsampling)
    groups = groupings(model)[grouping]
    run(comp, groups, model, lossf, X, y)
    for group in groups:
        ours = comp.get_result(group)
        assert ours.shape == (3 * (4 if subsampling is None else 2),)
        assert bool((ours[1:] >= ours[:-1]).all())
        compare_evals(ours, torch.linalg.eigvalsh(block(G, model, group["params"])))
    for p in model.parameters():
        assert not hasattr(p, "spectral_factor_exact")


@pytest.mark.parametrize("kind", ["mlp", "conv", "residual", "seq", "transformer"])
@pytest.mark.parametrize("grouping", ["full", "blocks"])
def test_eigh(kind, grouping):
    model, lossf, X, y = make(kind)
    subsampling = [3, 1, 2]
    G, _, _ = ref_ggn(model, lossf, X, y, subsampling)
    comp = EighComputation(subsampling=subsampling)
    groups = groupings(model)[grouping]
    for g in groups:
        g["criterion"] = top(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny blocks may have tiny eigenvalues
        run(comp, groups, model, lossf, X, y)
    for group in groups:
        evals, vecs = comp.get_result(group)
        assert [v.shape for v in vecs] == [(2, *p.shape) for p in group["params"]]
        Gb = block(G, model, group["params"])
        ref = torch.linalg.eigvalsh(Gb)
        torch.testing.assert_close(evals, ref[-2:], rtol=RTOL, atol=1e-10)
        E = flat(vecs)
        if float(evals.min()) > 1e-6:
            torch.testing.assert_close(Gb @ E.T, E.T * evals, rtol=RTOL, atol=1e-8)
            torch.testing.assert_close(E @ E.T, torch.eye(2, dtype=E.dtype), atol=1e-8, rtol=0)


@pytest.mark.parametrize("kind", ["conv", "conv1d", "seq"])
@pytest.mark.parametrize("chunk_size", [1, 2])
def test_column_chunks(kind, chunk_size):
    """Columns pushed back a chunk at a time (a small ``memory_budget``) reach the factors in
    pieces; eigenvalues and eigenvectors are those of the dense GGN."""
    model, lossf, X, y = make(kind)
    G, _, _ = ref_ggn(model, lossf, X, y)
    comp = EighComputation()
    group = {"params": list(model.parameters()), "criterion": top(3)}
    with backprism.collect(
        comp.get_extension(), extension_hook=comp.get_extension_hook([group]),
        chunk_size=chunk_size,
    ):
        lossf(model(X), y).backward()
    evals, vecs = comp.get_result(group)
    torch.testing.assert_close(evals, torch.linalg.eigvalsh(G)[-3:], rtol=RTOL, atol=1e-10)
    E = flat(vecs)
    torch.testing.assert_close(G @ E.T, E.T * evals, rtol=RTOL, atol=1e-8)


@pytest.mark.parametrize("kind", ["mlp", "conv", "residual", "transformer"])
@pytest.mark.parametrize(("sub_grad", "sub_ggn"), [(None, None), ([1, 3], [0, 2, 3])])
def test_directional_derivatives(kind, sub_grad, sub_ggn):
    model, lossf, X, y = make(kind)
    _, per_sample, grads = ref_ggn(model, lossf, X, y, sub_ggn)
    comp = DirectionalDerivativesComputation(subsampling_grad=sub_grad, subsampling_ggn=sub_ggn)
    eig = EighComputation(subsampling=sub_ggn)
    group = {"params": list(model.parameters()), "criterion": top(3)}
    run(comp, [group], model, lossf, X, y)
    run(eig, [group], model, lossf, X, y)
    gammas, lambdas = comp.get_result(group)
    evals, vecs = eig.get_result(group)
    E = flat(vecs)
    n_grad = 4 if sub_grad is None else len(sub_grad)
    n_ggn = 4 if sub_ggn is None else len(sub_ggn)
    assert gammas.shape == (n_grad, 3) and lambdas.shape == (n_ggn, 3)
    gsel = grads if sub_grad is None else grads[sub_grad]
    Gsel = per_sample if sub_ggn is None else per_sample[sub_ggn]
    # eigenvectors are defined up to sign: compare |γ|
    torch.testing.assert_close(gammas.abs(), (gsel @ E.T).abs(), rtol=RTOL, atol=1e-9)
    ref_lambdas = torch.einsum("dp,npq,dq->nd", E, Gsel, E)
    torch.testing.assert_close(lambdas, ref_lambdas, rtol=RTOL, atol=1e-9)
    torch.testing.assert_close(lambdas.mean(0), evals, rtol=RTOL, atol=1e-9)


@pytest.mark.parametrize("kind", ["mlp", "residual", "transformer"])
@pytest.mark.parametrize("grouping", ["full", "blocks"])
def test_damped_newton_step(kind, grouping):
    model, lossf, X, y = make(kind)
    sub_grad, sub_ggn = [0, 1, 3], [1, 2, 3]
    G, _, grads = ref_ggn(model, lossf, X, y, sub_ggn)
    comp = DirectionalDampedNewtonComputation(subsampling_grad=sub_grad, subsampling_ggn=sub_ggn)
    groups = groupings(model)[grouping]
    seen = []
    for g in groups:
        g["criterion"] = top(1)
        g["damping"] = lambda evals, evecs, gammas, lambdas: (
            seen.append((evals.shape, evecs.shape, gammas.shape, lambdas.shape))
            or 0.5 + 0.1 * evals
        )
    run(comp, groups, model, lossf, X, y)
    assert seen[0] == ((1,), (9, 1), (3, 1), (3, 1))
    for group in groups:
        step = comp.get_result(group)
        assert [s.shape for s in step] == [p.shape for p in group["params"]]
        Gb = block(G, model, group["params"])
        evals, evecs = torch.linalg.eigh(Gb)
        lam, e = evals[-1:], evecs[:, -1:]
        gbar = grads[sub_grad][:, flat_index(model, group["params"])].mean(0) @ e
        ref = (e * (-gbar / (lam + 0.5 + 0.1 * lam))).sum(1)
        torch.testing.assert_close(torch.cat([s.flatten() for s in step]), ref, rtol=RTOL,
                                   atol=1e-9)


def _jacobian_sqrt(model, X, cols):
    """``V[k, n] = Jₙᵀ cols[k, n]`` with ``Jₙ`` from ``torch.func.jacrev`` (reference)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, x):
        return functional_call(model, p, (x.unsqueeze(0),)).squeeze(0)

    vs = []
    for n in range(X.shape[0]):
        J = jacrev(f)(params, X[n])  # {name: [C, *p]}
        Jf = torch.cat([j.flatten(1) for j in J.values()], 1)  # [C, P]
        vs.append(cols[:, n] @ Jf)  # [K, P]
    return torch.stack(vs, 1)  # [K, N, P]


@pytest.mark.parametrize("mc", [1, 3])
def test_mc_eigenpairs_of_sampled_factor(mc):
    """With a fixed seed, the MC eigenpairs are those of ``Ṽ Ṽᵀ`` built from reference
    Jacobians and the same sampled loss columns."""
    from backprism.engine.loss_hessian import loss_hessian_sqrt

    model, lossf, X, y = make("mlp")
    sub = [0, 2, 3]
    comp = EighComputation(subsampling=sub, mc_samples=mc)
    group = {"params": list(model.parameters()), "criterion": top(2)}
    torch.manual_seed(7)
    run(comp, [group], model, lossf, X, y)
    evals, vecs = comp.get_result(group)
    with suspended():  # reference forwards must not be captured by the extended model
        logits = model(X).detach().requires_grad_(True)
        torch.manual_seed(7)
        cols = loss_hessian_sqrt(lossf, [logits, y], ("mc", mc), X.shape[0]).materialize()[0]
        V = _jacobian_sqrt(model, X, cols)[:, sub] * (4 / len(sub)) ** 0.5
    Vf = V.reshape(-1, V.shape[-1])
    G = Vf.T @ Vf
    ref = torch.linalg.eigvalsh(G)
    torch.testing.assert_close(evals, ref[-2:], rtol=RTOL, atol=1e-10)
    E = flat(vecs)
    torch.testing.assert_close(G @ E.T, E.T * evals, rtol=RTOL, atol=1e-8)


def test_mc_trace_in_expectation():
    """``Σ evals`` of the MC Gram matrix is an unbiased estimate of ``tr GGN``; the mean over
    ``R = 60`` draws must be within 4 standard errors."""
    model, lossf, X, y = make("mlp")
    G, _, _ = ref_ggn(model, lossf, X, y)
    comp = EigvalshComputation(mc_samples=2)
    group = {"params": list(model.parameters())}
    traces = []
    torch.manual_seed(3)
    for _ in range(60):  # the object is reused across steps
        run(comp, [group], model, lossf, X, y)
        traces.append(float(comp.get_result(group).sum()))
    t = torch.tensor(traces, dtype=torch.float64)
    err = float(t.std() / len(t) ** 0.5)
    assert abs(float(t.mean()) - float(G.trace())) < 4 * err + 1e-12


# -- errors and warnings ---------------------------------------------------------------------


def test_bad_input():
    model, lossf, X, y = make("mlp")
    params = list(model.parameters())
    with pytest.raises(ValueError, match="one group only"):
        EigvalshComputation().get_extension_hook([{"params": params}, {"params": params[:1]}])
    with pytest.raises(KeyError, match="criterion"):
        EighComputation().get_extension_hook([{"params": params}])
    with pytest.raises(KeyError, match="damping"):
        DirectionalDampedNewtonComputation().get_extension_hook(
            [{"params": params, "criterion": top(1)}]
        )
    with pytest.raises(TypeError, match="list"):
        EigvalshComputation().get_extension_hook([{"params": model.parameters()}])
    with pytest.raises(ValueError, match="unique"):
        EigvalshComputation(subsampling=[0, 0])
    with pytest.raises(ValueError, match="unique"):
        DirectionalDerivativesComputation(subsampling_grad=[1, 1])
    with pytest.raises(ValueError, match="mc_samples"):
        EighComputation(mc_samples=-1)
    comp = EigvalshComputation()
    with pytest.raises(KeyError, match="no result"):
        comp.get_result({"params": params})
    comp = EigvalshComputation(subsampling=[0, 9])
    with pytest.raises(IndexError, match="out of range"):
        run(comp, [{"params": params}], model, lossf, X, y)


def test_sum_reduction_refused():
    model, _, X, y = make("mlp")
    lossf = backprism.extend(nn.CrossEntropyLoss(reduction="sum"))
    comp = EigvalshComputation()
    with pytest.raises(ValueError, match="reduction='mean'"):
        run(comp, [{"params": list(model.parameters())}], model, lossf, X, y)


def test_small_eigenvalues_warn():
    model, lossf, X, y = make("mlp")
    comp = EighComputation()
    group = {"params": list(model.parameters()), "criterion": lambda e: list(range(e.numel()))}
    with pytest.warns(UserWarning, match="warn_small_eigvals"):
        run(comp, [group], model, lossf, X, y)
    evals, vecs = comp.get_result(group)
    assert evals.numel() == 12 and torch.isfinite(flat(vecs)).all()
    for comp in (DirectionalDerivativesComputation(), DirectionalDampedNewtonComputation()):
        group = {"params": list(model.parameters()), "criterion": lambda e: [0, e.numel() - 1],
                 "damping": lambda *args: 1.0}
        with pytest.warns(UserWarning, match="warn_small_eigvals"):
            run(comp, [group], model, lossf, X, y)
        assert all(torch.isfinite(t).all() for t in comp.get_result(group))


def test_reuse_and_partial_groups():
    """Reusable across steps; a group covering only some parameters; parameters outside every
    group are freed."""
    model, lossf, X, y = make("mlp")
    comp = EighComputation()
    group = {"params": [model[2].weight], "criterion": top(1)}
    run(comp, [group], model, lossf, X, y)
    first = comp.get_result(group)[0].clone()
    X2 = X + 1
    G, _, _ = ref_ggn(model, lossf, X2, y)
    run(comp, [group], model, lossf, X2, y)
    second = comp.get_result(group)[0]
    ref = torch.linalg.eigvalsh(block(G, model, [model[2].weight]))[-1:]
    torch.testing.assert_close(second, ref, rtol=RTOL, atol=1e-12)
    assert not torch.allclose(first, second)
    assert all(not hasattr(p, "spectral_factor_exact") for p in model.parameters())


@pytest.mark.parametrize("kind", ["mlp", "conv", "residual"])
def test_eigvalsh_two_forwards_one_backward(kind):
    """Two forwards summed into one objective: the GGN is the sum of the losses' GGNs, and its
    eigenvalues come from the Gram matrix of both losses' columns."""
    model, lossf, X1, y1 = make(kind, seed=0)
    _, _, X2, y2 = make(kind, seed=1)
    with torch.no_grad():  # make() rebuilt the model for seed 1: restore seed 0's weights
        model0, *_ = make(kind, seed=0)
        for p, q in zip(model.parameters(), model0.parameters()):
            p.copy_(q)
    G = ggn(model, lossf, X1, y1) + ggn(model, lossf, X2, y2)
    comp = EigvalshComputation()
    groups = groupings(model)["full"]
    with backprism.collect(*comp.get_extensions(), extension_hook=comp.get_extension_hook(groups)):
        (lossf(model(X1), y1) + lossf(model(X2), y2)).backward()
    ours = comp.get_result(groups[0])
    compare_evals(ours, torch.linalg.eigvalsh(G))


# -- on a device ----------------------------------------------------------------------------------
def _top(k: int):
    return lambda evals: list(range(evals.numel() - k, evals.numel()))


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


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("subsampling", [None, [2, 0]], ids=["all", "sub"])
@pytest.mark.parametrize("grouping", ["full", "blocks"])
def test_eigvalsh_on_device(grouping, subsampling, device):
    model, lossfunc, X, y, _ = build_on_device("mlp", device, seed=6)
    G = ggn_mean_over_samples(model, lossfunc, X, y, subsampling)
    extend(model), extend(lossfunc)
    comp = EigvalshComputation(subsampling=subsampling)
    groups = _groups(model, grouping)
    _run(comp, groups, model, lossfunc, X, y)
    for group in groups:
        ours = comp.get_result(group)
        assert_on_device(ours, device, "eigenvalues")
        ref = torch.linalg.eigvalsh(_block(G, model, group["params"]))
        m = min(ours.numel(), ref.numel())  # the rest are zero
        scale = float(ref.abs().max())
        torch.testing.assert_close(ours[-m:], ref[-m:], rtol=1e-6, atol=1e-9 * scale)
        for rest in (ours[:-m], ref[:-m]):
            assert rest.numel() == 0 or float(rest.abs().max()) < 1e-9 * scale


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("grouping", ["full", "blocks"])
def test_eigh_on_device(grouping, device):
    model, lossfunc, X, y, _ = build_on_device("mlp", device, seed=7)
    sub = [1, 2]
    G = ggn_mean_over_samples(model, lossfunc, X, y, sub)
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
        assert_on_device([evals, vecs], device, "eigenpairs")
        assert [v.shape for v in vecs] == [(2, *p.shape) for p in group["params"]]
        Gb = _block(G, model, group["params"])
        torch.testing.assert_close(evals, torch.linalg.eigvalsh(Gb)[-2:], rtol=1e-6, atol=1e-10)
        E = torch.cat([v.flatten(1) for v in vecs], 1)
        if float(evals.min()) > 1e-6:
            torch.testing.assert_close(Gb @ E.T, E.T * evals, rtol=1e-6, atol=1e-8)
            eye = torch.eye(2, dtype=E.dtype, device=E.device)
            torch.testing.assert_close(E @ E.T, eye, rtol=0, atol=1e-8)
