"""Fuzzed forwards with and without the forward mode: random operations between Linear layers
(linear glue, functional and module nonlinearities, products, quotients, normalisations).
Uses of the root's own parameters in its forward's body or in a child it calls are drawn too.
Property: on the recorded first forward and on a later forward (without the mode where the model
was learned mode-free), ``DiagHessian`` either refuses with a clear error before writing
anything, or equals the dense Hessian diagonal; first-order statistics equal ``torch.func``'s
per-sample gradients."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine.residual import NonlinearityError
from backprism.extensions import BatchGrad, BatchL2Grad
from backprism.extensions.hessian import DiagHessian
from tests.reference import loss_hessian, per_sample_grads

pytestmark = pytest.mark.usefixtures("float64_default")

D = 3

#: functional glue: operation name -> function of the activation and a constant
OPS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "add_const": lambda h, c: h + c,
    "mul_const": lambda h, c: 2.0 * h - c,
    "div_const": lambda h, c: h / 3.0,
    "relu": lambda h, c: torch.relu(h),
    "leaky": lambda h, c: nn.functional.leaky_relu(h, 0.1),
    "flip_cat": lambda h, c: torch.cat([h, h.flip(1)], 1)[:, :D],
    "transpose": lambda h, c: h.t().contiguous().t(),
    "pad_slice": lambda h, c: nn.functional.pad(h, (1, 1))[:, 1:-1],
    "tanh": lambda h, c: torch.tanh(h),
    "sigmoid": lambda h, c: h.sigmoid(),
    "square": lambda h, c: h * h,
    "div_by": lambda h, c: h / (h.abs() + 1.0),
    "softmax": lambda h, c: h.softmax(1),
    "normalize": lambda h, c: nn.functional.normalize(h, dim=1),
    "exp": lambda h, c: torch.exp(0.1 * h),
}
MODULES: dict[str, Callable[[], nn.Module]] = {
    "Tanh": nn.Tanh,
    "GELU": nn.GELU,
    "ReLU": nn.ReLU,
    "Dropout_eval": lambda: nn.Dropout(0.0),
}


class Scale(nn.Module):
    """A parameter-free module multiplying by a scale its caller passes in."""

    def forward(self, h: Tensor, scale: Tensor) -> Tensor:
        return h * scale


#: glue using a parameter of the model's root: in its forward's body (``h * γ + β``, attributed
#: by the mode entered for that body alone in a forward without the mode), or passed to a
#: parameter-free child (only the mode sees that use: the model keeps it)
PARAM_GLUE = ("body_scale", "child_scale")


class Glued(nn.Module):
    """Linear → glue → Linear → glue → Linear; each glue one operation or activation module, or
    a use of the root's own parameters (:data:`PARAM_GLUE`)."""

    def __init__(self, glue: list[str]) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(len(glue) + 1))
        self.glue = glue
        self.mods = nn.ModuleDict(
            {f"m{i}": MODULES[g]() for i, g in enumerate(glue) if g in MODULES}
        )
        self.register_buffer("c", torch.linspace(-0.5, 0.5, D))
        if set(glue) & set(PARAM_GLUE):
            self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, D))
            self.beta = nn.Parameter(torch.linspace(-0.2, 0.2, D))
            self.scale = Scale()

    def forward(self, x: Tensor) -> Tensor:
        h = self.lins[0](x)
        for i, g in enumerate(self.glue):
            if g in MODULES:
                h = self.mods[f"m{i}"](h)
            elif g == "body_scale":
                h = h * self.gamma + self.beta
            elif g == "child_scale":
                h = self.scale(h, self.gamma) - self.beta
            else:
                h = OPS[g](h, self.c)  # type: ignore[call-arg]
            h = self.lins[i + 1](h)
        return h


def _diag_h_or_refused(model: nn.Module, lf: nn.Module, X: Tensor, y: Tensor) -> bool:
    """Whether DiagHessian ran (exact) or was refused, nothing written (an earlier pass's
    ``diag_h`` left as it was)."""
    loss = lf(model(X), y)
    before = [getattr(p, "diag_h", None) for p in model.parameters()]
    try:
        with collect(DiagHessian()):
            loss.backward()
    except (NonlinearityError, RuntimeError) as err:
        assert "backprism" in str(err)
        assert all(p.grad is None for p in model.parameters())
        assert all(
            getattr(p, "diag_h", None) is b for p, b in zip(model.parameters(), before, strict=True)
        )
        return False
    ours = torch.cat([p.diag_h.flatten() for p in model.parameters()])
    torch.testing.assert_close(ours, torch.diagonal(loss_hessian(model, lf, X, y)))
    return True


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    glue=st.lists(
        st.sampled_from(sorted(OPS) + sorted(MODULES) + list(PARAM_GLUE)), min_size=1, max_size=2
    ),
    n=st.integers(2, 4),
)
def test_fuzzed_glue(glue: list[str], n: int) -> None:
    torch.manual_seed(len(glue) * 7 + n)
    model, lf = extend(Glued(glue)), extend(nn.MSELoss())
    X, y = torch.randn(n, D), torch.randn(n, D)
    ran = []
    # the recorded first forward, then (where learned) ones without the mode: a model that ran
    # DiagHessian keeps running it (it was refused every other step where a product it builds
    # made it learn that the mode was not needed)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        ran.append(_diag_h_or_refused(model, lf, X, y))
        model.zero_grad(set_to_none=True)
        ref = per_sample_grads(model, lf, X, y)
        loss = lf(model(X), y)
        with collect(BatchGrad(), BatchL2Grad()):
            loss.backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad_batch, ref[name])
    assert not ran[0] or all(ran), ran
