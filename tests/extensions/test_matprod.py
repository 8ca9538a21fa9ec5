"""HMP, GGNMP and PCHMP block products against dense float64 references.

References: ``reference.loss_hessian`` / ``reference.ggn`` (``torch.func``) for the Hessian and
GGN; the positive-curvature Hessian is built here from its definition,
``PCH = GGN + J_zᵀ diag(m(r)) J_z`` with ``r = ∂L/∂a ⊙ σ''(z)`` for the one nonlinearity
``a = σ(z)`` of the test network and ``m`` = clip (``max(r, 0)``) or abs; its construction is
validated by checking that ``m = identity`` reproduces the diagonal blocks of ``loss_hessian``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from backprism import collect, extend
from backprism.engine.residual import NonlinearityError
from backprism.extensions.hessian import DiagHessian
from backprism.extensions.matprod import GGNMP, HMP, PCHMP
from tests.common import Siamese
from tests.reference import ggn, loss_hessian, trainable

DT = torch.float64

pytestmark = pytest.mark.usefixtures("float64_default")


def blocks(M: Tensor, model: nn.Module) -> dict[str, Tensor]:
    """Diagonal blocks ``{name: [P, P]}`` of a dense ``[P_total, P_total]`` matrix."""
    out, i = {}, 0
    for k, v in trainable(model).items():
        out[k] = M[i : i + v.numel(), i : i + v.numel()]
        i += v.numel()
    return out


def pch_reference(model: nn.Sequential, loss_fn, X: Tensor, y: Tensor, modify) -> Tensor:
    """``GGN + J_zᵀ diag(modify(r)) J_z`` for ``model = [Linear, σ, *rest]`` (one nonlinearity)."""
    params = trainable(model)
    names = list(params)
    sizes = [params[k].numel() for k in names]
    shapes = [params[k].shape for k in names]
    flat = torch.cat([params[k].reshape(-1) for k in names])
    first, act, rest = model[0], model[1], model[2:]

    def z_of(theta: Tensor) -> Tensor:
        p = {k: t.reshape(s) for k, t, s in zip(names, torch.split(theta, sizes), shapes)}
        p0 = {k[2:]: v for k, v in p.items() if k.startswith("0.")}
        return functional_call(first, p0, (X,))

    z = z_of(flat).detach()
    Jz = jacrev(z_of)(flat).reshape(z.numel(), flat.numel())
    a = act(z).requires_grad_(True)
    (dL_da,) = torch.autograd.grad(loss_fn(rest(a), y), a)
    d2 = vmap(grad(grad(lambda t: act(t))))(z.reshape(-1)).reshape(z.shape)
    r = (dL_da * d2).reshape(-1)
    return ggn(model, loss_fn, X, y) + Jz.t() @ (modify(r)[:, None] * Jz)


def mlp(act: nn.Module, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 6), act, nn.Linear(6, out))


@pytest.mark.parametrize("act", [nn.Tanh(), nn.Sigmoid(), nn.Softplus()], ids=repr)
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_block_products(act: nn.Module, loss: str):
    torch.manual_seed(0)
    n, c = 4, 2
    X = torch.randn(n, 8)
    y = torch.randint(0, c, (n,)) if loss == "ce" else torch.randn(n, c)
    lf = nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss()
    model = mlp(act, c)
    ref = copy.deepcopy(model)
    expected = {
        "hmp": blocks(loss_hessian(ref, lf, X, y), ref),
        "ggnmp": blocks(ggn(ref, lf, X, y), ref),
        "pchmp_clip": blocks(pch_reference(ref, lf, X, y, lambda r: r.clamp_min(0)), ref),
        "pchmp_abs": blocks(pch_reference(ref, lf, X, y, torch.abs), ref),
    }
    # the PCH construction reproduces the Hessian's diagonal blocks without modification
    unmodified = blocks(pch_reference(ref, lf, X, y, lambda r: r), ref)
    for name, block in expected["hmp"].items():
        torch.testing.assert_close(unmodified[name], block)
    results = {}
    for modify in ("clip", "abs"):
        m = copy.deepcopy(model)
        extend(m)
        lfe = extend(copy.deepcopy(lf))
        exts = [HMP(), GGNMP(), PCHMP(modify=modify)] if modify == "clip" else [PCHMP(modify)]
        with collect(*exts):
            lfe(m(X), y).backward()
        for name, p in m.named_parameters():
            for attr in ("hmp", "ggnmp", "pchmp"):
                if hasattr(p, attr):
                    key = f"pchmp_{modify}" if attr == "pchmp" else attr
                    results[(key, name)] = (getattr(p, attr), p.shape)
    for (key, name), (fn, shape) in results.items():
        mat = torch.randn(3, *shape)
        P = mat[0].numel()
        want = (mat.reshape(3, P) @ expected[key][name]).reshape(3, *shape)
        got = fn(mat)
        assert got.shape == mat.shape
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10, msg=f"{key} {name}")
    # the positive-curvature blocks are PSD
    for (key, _), (fn, shape) in results.items():
        if key.startswith("pchmp"):
            P = torch.Size(shape).numel()
            dense = fn(torch.eye(P).reshape(P, *shape)).reshape(P, P)
            assert torch.linalg.eigvalsh((dense + dense.t()) / 2).min() > -1e-10


def test_cnn_maxpool():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.Sigmoid(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    X, y = torch.randn(3, 1, 4, 4), torch.randint(0, 3, (3,))
    lf = nn.CrossEntropyLoss()
    ref = copy.deepcopy(model)
    H, G = blocks(loss_hessian(ref, lf, X, y), ref), blocks(ggn(ref, lf, X, y), ref)
    extend(model)
    with collect(HMP(), GGNMP()):
        extend(lf)(model(X), y).backward()
    for name, p in model.named_parameters():
        mat = torch.randn(2, *p.shape)
        flat = mat.reshape(2, -1)
        torch.testing.assert_close(p.hmp(mat).reshape(2, -1), flat @ H[name])
        torch.testing.assert_close(p.ggnmp(mat).reshape(2, -1), flat @ G[name])


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def test_ggnmp_shared_parameter_and_hmp_refusal():
    """GGN blocks of a parameter used twice sum the per-sample Jacobians before squaring; the
    Hessian block has a term from the product of the two uses, which HMP refuses."""
    torch.manual_seed(2)
    model = Shared()
    X, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    lf = nn.CrossEntropyLoss()
    G = blocks(ggn(copy.deepcopy(model), lf, X, y), model)
    extend(model)
    lfe = extend(copy.deepcopy(lf))
    with collect(GGNMP()):
        lfe(model(X), y).backward()
    for name, p in model.named_parameters():
        mat = torch.randn(2, *p.shape)
        torch.testing.assert_close(
            p.ggnmp(mat).reshape(2, -1), mat.reshape(2, -1) @ G[f"{name}"]
        )
    for ext in (HMP(), PCHMP()):
        with pytest.raises(NonlinearityError, match="several calls"), collect(ext):
            lfe(model(X), y).backward()


def test_hmp_parallel_shared_parameter():
    """A parameter used by two parallel branches: per-sample gradients are summed over the
    calls before the outer products, matching the Hessian block."""
    torch.manual_seed(4)
    model = Siamese(F.gelu)
    X, y = torch.randn(3, 6), torch.randint(0, 2, (3,))
    lf = nn.CrossEntropyLoss()
    H = blocks(loss_hessian(copy.deepcopy(model), lf, X, y), model)
    extend(model)
    with collect(HMP()):
        extend(lf)(model(X), y).backward()
    for name, p in model.named_parameters():
        mat = torch.randn(2, *p.shape)
        torch.testing.assert_close(p.hmp(mat).reshape(2, -1), mat.reshape(2, -1) @ H[name])


def test_errors():
    with pytest.raises(ValueError, match="modify"):
        PCHMP(modify="none")
    torch.manual_seed(3)
    model = extend(mlp(nn.Tanh(), 2))
    lf = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(3, 8), torch.randint(0, 2, (3,))
    with collect(HMP(), DiagHessian()):
        lf(model(X), y).backward()
    w = model[0].weight
    with pytest.raises(ValueError, match=r"\[V, 6, 8\]"):
        w.hmp(torch.randn(6, 8))
    with pytest.raises(TypeError):
        w.hmp([[1.0]])
    # the block's diagonal is the Hessian diagonal
    P = w.numel()
    dense = w.hmp(torch.eye(P).reshape(P, *w.shape)).reshape(P, P)
    torch.testing.assert_close(torch.diagonal(dense).reshape(w.shape), w.diag_h)


@pytest.mark.parametrize("kind", ["layer_norm", "softmax_positions"])
def test_hmp_through_row_wise_nonlinearities(kind: str):
    """HMP's blocks through a LayerNorm / a softmax over positions (their Hessian terms
    block-diagonal over rows, eigen-decomposed into signed columns) against the dense Hessian;
    PCHMP's blocks (negative eigenvalues of those terms clipped or flipped) are PSD."""
    from tests.extensions.test_hessian import RowWise

    torch.manual_seed(24)
    model = RowWise(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    X = torch.randn(4, 5, 3) if kind == "softmax_positions" else torch.randn(4, 3)
    check_hmp(model, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (4,)))


def check_hmp(model: nn.Module, lf: nn.Module, X: Tensor, y: Tensor, pchmp: bool = True) -> None:
    """HMP's parameter blocks of one pass against the dense Hessian's (attention on the math
    kernel there: the fused one has no forward-mode derivative) and, with ``pchmp``,
    PCHMP("clip")'s blocks positive semi-definite."""
    with sdpa_kernel(SDPBackend.MATH):
        expected = blocks(loss_hessian(copy.deepcopy(model), lf, X, y), model)
    extend(model)
    with collect(HMP(), *([PCHMP("clip")] if pchmp else [])):
        extend(lf)(model(X), y).backward()
    for name, p in model.named_parameters():
        P = p.numel()
        eye = torch.eye(P).reshape(P, *p.shape)
        torch.testing.assert_close(p.hmp(eye).reshape(P, P), expected[name], rtol=1e-8,
                                   atol=1e-10, msg=name)
        if pchmp:
            pch = p.pchmp(eye).reshape(P, P)
            assert torch.linalg.eigvalsh((pch + pch.t()) / 2).min() > -1e-10, name
