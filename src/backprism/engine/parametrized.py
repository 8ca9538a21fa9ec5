r"""Layers with parametrized weights (``torch.nn.utils.parametrize``: ``weight_norm``,
``spectral_norm``, ``orthogonal``).

A parametrized layer computes its weight ``W = P(θ₁, …, θₖ)`` from the parametrization's
originals (``weight_norm``: ``W = g · v / ‖v‖``) each time the layer reads it, and uses ``W``
as its rule's closed forms expect. The originals' per-sample, per-column gradients are the
parametrization's pull-back of the layer's ones,

.. math:: V_{mn}(θ_i) = \Big(\frac{∂P}{∂θ_i}\Big)^{\!\top} V_{mn}(W),

exact for first-order quantities and for the GGN's columns (``V`` carries the columns'
scaling), and every statistic follows from them (:class:`Parametrized`; Kronecker-factored
extensions get the exact diagonal factor). ``W`` is nonlinear in the originals, so the
DiagHessian family and differentiable results (``create_graph=True``) are refused. The
parametrization is replayed in eval mode (``spectral_norm``'s power iteration is not run again:
its vectors, constants for autograd too, stay as the forward left them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from backprism.engine.columns import pull_back
from backprism.engine.rule import Rule
from backprism.engine.state import Call, suspended

__all__ = ["Parametrized", "originals", "parametrized"]

_PREFIX = "parametrizations."


def originals(module: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable originals of ``module``'s parametrizations, by name relative to it
    (``"parametrizations.weight.original0"``), or ``{}`` (one dictionary lookup for the
    others: this runs for every module call of an extended forward)."""
    plists = module._modules.get("parametrizations")
    if not isinstance(plists, nn.ModuleDict):
        return {}
    found: dict[str, nn.Parameter] = {}
    for tensor, plist in plists.items():
        for k, p in plist._parameters.items():
            if p is not None and p.requires_grad:
                found[f"{_PREFIX}{tensor}.{k}"] = p
    return found


def parametrized(call: Call) -> dict[str, list[str]]:
    """Parametrized tensor name → the names of its originals in ``call.params``."""
    out: dict[str, list[str]] = {}
    for name in call.params:
        if name.startswith(_PREFIX):
            tensor = name[len(_PREFIX) :].rsplit(".", 1)[0]
            out.setdefault(tensor, []).append(name)
    return out


@contextlib.contextmanager
def _replaying(plists: nn.Module) -> Iterator[None]:
    """Run the parametrizations ``plists`` again: in eval mode (``spectral_norm``'s power
    iteration stays as the forward left it), without the forward hooks."""
    modes = [m.training for m in plists.modules()]
    plists.eval()
    try:
        with suspended():
            yield
    finally:
        for m, mode in zip(plists.modules(), modes):
            m.training = mode


class Parametrized(Rule):
    """``rule`` (the layer's) seen through its parametrizations: per-sample gradients of the
    originals pulled back from the layer's, statistics from them (see the module docstring)."""

    linear_in_params = False

    def __init__(self, rule: Rule, tensors: dict[str, list[str]]) -> None:
        self.rule, self.tensors = rule, tensors

    def is_linear_in_params(self, call: Call) -> bool:
        return False

    def kronecker_form(self, call: Call) -> bool:
        return False

    def per_sample(self, call: Call, g: Any) -> dict[str, Tensor]:
        module = call.module
        with _replaying(module.parametrizations), parametrize.cached(), torch.no_grad():
            # (each parametrized tensor read once)
            # the layer's call with its parametrized tensors in place of their originals (rules
            # read which parameters to compute from ``call.params``)
            params = {k: p for k, p in call.params.items() if not k.startswith(_PREFIX)}
            params.update((t, getattr(module, t)) for t in self.tensors)
            layer = self.rule.per_sample(dataclasses.replace(call, params=params), g)
        out = {k: layer[k] for k in call.params if not k.startswith(_PREFIX)}
        for tensor, names in self.tensors.items():
            if tensor not in layer:
                raise RuntimeError(
                    f"backprism: the rule of {call.name} gives no per-sample gradient of its "
                    f"parametrized '{tensor}'; remove the parametrization for the analysis "
                    "(torch.nn.utils.parametrize.remove_parametrizations) or freeze its "
                    "originals (requires_grad_(False))"
                )
            out.update(_pull_back(module, tensor, names, layer[tensor]))
        return out


def _pull_back(
    module: nn.Module, tensor: str, names: list[str], v: Tensor
) -> dict[str, Tensor]:
    """``Vₘₙ(θᵢ) = (∂P/∂θᵢ)ᵀ Vₘₙ(W)`` for the originals ``names`` of ``module``'s parametrized
    ``tensor``; ``v`` is ``[M, N, *W.shape]``."""
    plist = module.parametrizations[tensor]
    keys = [name.rsplit(".", 1)[1] for name in names]
    values = tuple(plist._parameters[k].detach() for k in keys)

    def weight(*vals: Tensor) -> tuple[Tensor]:
        return (functional_call(plist, dict(zip(keys, vals)), ()),)

    m, n = v.shape[:2]
    flat = v.reshape(m * n, *v.shape[2:]).to(values[0].dtype)
    with _replaying(plist):
        cols = pull_back(weight, values, (flat,))
    return {name: c.reshape(m, n, *c.shape[1:]) for name, c in zip(names, cols)}
