r"""Rules for Hugging Face ``transformers`` layers: GPT-2's ``Conv1D`` and the RMSNorm variants.

Nothing here imports ``transformers``: the rules are registered for its classes as soon as the
modules defining them are imported (right away for those already imported, and through an
import hook for later imports), so ``import backprism`` stays cheap and works without
``transformers``.

**Conv1D** (``transformers.pytorch_utils.Conv1D``, GPT-2 / GPT / DistilGPT-2 projections):
``y = x W + b`` with ``W`` of shape ``[in, out]`` — a Linear layer with the weight transposed.
All statistics are :class:`~backprism.rules.linear.LinearRule`'s closed forms on ``Wᵀ``
(``‖Vₘₙ‖² = ‖gₘₙ‖²‖xₙ‖²`` without positions, the Gram form
``Σₜₛ ⟨gₘₙₜ, gₘₙₛ⟩⟨xₙₜ, xₙₛ⟩`` with them), transposed back to ``[in, out]``. Kronecker factors
come in the weight's axis order, ``[A, B]`` (input side first; Linear's ``[B, A]`` for its
``[out, in]`` weight), so the block is ``≈ A ⊗ B``; the bias gets ``[B]``.

**RMSNorm variants** (``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ``T5LayerNorm``,
``GemmaRMSNorm`` with ``(1 + w)``, the gated ``*RMSNormGated``, … — every class whose name
contains ``RMSNorm``, and ``T5LayerNorm``, in ``transformers.models``) compute
``y = B(x) + A(x) ⊙ w`` for their single weight ``w`` (``B = 0``, ``A = x̂ = x/√(E[x²] + eps)``
for Llama; ``B = A = x̂`` for Gemma), so

    ``Vₘₙ(w) = Σ_r gₘₙᵣ ⊙ Aₙᵣ``   (``r`` over the positions ``w`` is broadcast over).

``A`` is taken from the module's own forward, ``A = y(w = 1) − y(w = 0)``, so it carries
exactly the module's arithmetic (Llama normalises in float32 whatever the input dtype). Once per
class the rule checks that structure on the first two samples of a real call (``y`` affine and
elementwise in ``w``, samples independent); a class that fails the check, or a call with other
trainable parameters, takes the generic ``torch.func`` rule. Statistics are the
:class:`~backprism.engine.rule.Rule` defaults on the ``[M, N, *w.shape]`` gradients (``w`` is
small); KFAC / KFLR / KFRA give ``w`` the single diagonal factor ``[diag(Σₘ Σₙ Vₘₙ²)]`` (MC or
exact GGN diagonal, :meth:`~backprism.engine.rule.Rule.kronecker_diagonal`).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
import weakref
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from backprism.engine.fold import keeps_samples_apart
from backprism.engine.rule import Call, Outer, Rule, register_rule
from backprism.engine.state import suspended
from backprism.rules.generic import GenericRule
from backprism.rules.linear import LinearRule, linear_shell

__all__ = ["Conv1DRule", "ScaledNormRule", "register_transformers_rules"]

_LINEAR = LinearRule()


# -- Conv1D ----------------------------------------------------------------------------------
class Conv1DRule(Rule):
    """``y = x W + b``, ``W`` ``[in, out]``: the Linear rule on ``Wᵀ`` (module docstring)."""

    def _sub(self, call: Call) -> Call:
        module = call.module
        w = module.weight.detach().t()
        b = module.bias.detach() if module.bias is not None and "bias" in call.params else None
        return Call(
            module=linear_shell(w, b), args=(call.input,), kwargs={},
            out_shapes=call.out_shapes, batch_size=call.batch_size, training=False,
            params={"weight": w} | ({} if b is None else {"bias": b}),
        )

    @staticmethod
    def _back(call: Call, res: dict[str, Tensor], transpose: bool = True) -> dict[str, Tensor]:
        out = {}
        for k, v in res.items():
            if k not in call.params:
                continue
            out[k] = v.transpose(-1, -2) if transpose and k == "weight" else v
        return out

    def builds_per_sample(self, call: Call) -> bool:
        return _LINEAR.builds_per_sample(call)

    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        return self._back(call, _LINEAR.per_sample(self._sub(call), g))

    def summed(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        return self._back(call, _LINEAR.summed(self._sub(call), g))

    def sum_squared(
        self, call: Call, g: Tensor, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        return self._back(call, _LINEAR.sum_squared(self._sub(call), g, weights))

    def batch_sum_squared(
        self, call: Call, g: Tensor, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        return self._back(call, _LINEAR.batch_sum_squared(self._sub(call), g, weights))

    def batch_l2(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        return self._back(call, _LINEAR.batch_l2(self._sub(call), g), transpose=False)

    def batch_dot(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        return self._back(call, _LINEAR.batch_dot(self._sub(call), g), transpose=False)

    def batch_dot_with(
        self, call: Call, g: Tensor, vectors: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        vec = {k: (v.t() if k == "weight" else v) for k, v in vectors.items()}
        return self._back(
            call, _LINEAR.batch_dot_with(self._sub(call), g, vec), transpose=False
        )

    def outer_factors(self, call: Call, g: Tensor) -> dict[str, Outer]:
        """The Linear rule's factors of ``Wᵀ``, rows and columns swapped for ``W``
        ``[in, out]``: ``Vₘₙ = Σₜ xₙₜ gₘₙₜᵀ``."""
        res = _LINEAR.outer_factors(self._sub(call), g)
        out = {}
        for k, o in res.items():
            if k in call.params:
                out[k] = Outer(o.cols, o.rows, o.cols.shape[-1]) if k == "weight" else o
        return out

    def kronecker_form(self, call: Call) -> bool:
        return True

    def kronecker_factors(
        self, call: Call, g: Tensor, approx: str | None = None
    ) -> dict[str, list[Tensor]]:
        """``[A, B]`` for the ``[in, out]`` weight (its axis order), ``[B]`` for the bias."""
        res = _LINEAR.kronecker_factors(self._sub(call), g, approx)
        out = {}
        for k, fs in res.items():
            if k in call.params:
                out[k] = list(reversed(fs)) if k == "weight" else list(fs)
        return out

    def kronecker_grad_side(self, call: Call, name: str, n_factors: int) -> list[bool]:
        return [False, True] if name == "weight" and n_factors == 2 else [True] * n_factors


# -- RMSNorm variants ------------------------------------------------------------------------
_GENERIC = GenericRule()
#: per class: "scale" (y = A ⊙ w), "affine" (y = B + A ⊙ w) or None (not of that form)
_KINDS: dict[type, str | None] = {}
#: (weakref to call, input versions, A) of the most recent call
_LAST: tuple[weakref.ref, tuple[int, ...], Tensor] | None = None


def _clear_cache() -> None:
    global _LAST
    _LAST = None


def _run(call: Call, weight: Tensor, sl: slice | None = None) -> Any:
    """The module's forward on the call's inputs (samples ``sl`` only) with ``weight``."""
    n = call.batch_size

    def take(x: Any) -> Any:
        if sl is not None and isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == n:
            return x[sl]
        return x

    args = tuple(take(a) for a in call.args)
    kwargs = {k: take(v) for k, v in call.kwargs.items()}
    with torch.no_grad(), suspended():
        return functional_call(call.module, {"weight": weight}, args, kwargs)


class ScaledNormRule(Rule):
    """``y = B(x) + A(x) ⊙ w`` with ``A = y(w = 1) − y(w = 0)`` (module docstring)."""

    def _shape_ok(self, call: Call) -> bool:
        module = call.module
        own = [k for k, p in module.named_parameters() if p.requires_grad]
        if own != ["weight"] or set(call.params) != {"weight"} or len(call.out_shapes) != 1:
            return False
        w = call.params["weight"]
        out = call.out_shapes[0]
        return (
            w.dim() >= 1 and len(out) > w.dim() and tuple(out[-w.dim():]) == tuple(w.shape)
        )

    def _kind(self, call: Call) -> str | None:
        cls = type(call.module)
        if cls in _KINDS:
            return _KINDS[cls]
        if not self._shape_ok(call):
            return None
        kind = self._probe(call)
        if call.batch_size >= 2:  # sample independence was checked too
            _KINDS[cls] = kind
        return kind

    @staticmethod
    def _probe(call: Call) -> str | None:
        w = call.params["weight"].detach()
        k = min(2, call.batch_size)
        sl = slice(0, k)
        gen = torch.Generator(device=w.device).manual_seed(0)
        wr = 0.5 + torch.rand(w.shape, generator=gen, device=w.device, dtype=w.dtype)
        try:
            y0, y1, yw = (_run(call, t, sl) for t in (torch.zeros_like(w), torch.ones_like(w), wr))
            if not all(isinstance(y, Tensor) and y.is_floating_point() for y in (y0, y1, yw)):
                return None
            pred = y0 + (y1 - y0) * wr
            big = float(yw.abs().max()) if yw.numel() else 0.0
            tol = 1e-4 * big + 1e-12
            if not bool(((yw - pred).abs() <= tol).all()):
                return None
            if k == 2:  # sample 0 alone gives what it gives in the batch
                alone = _run(call, wr, slice(0, 1))
                if not bool(((alone - yw[:1]).abs() <= tol).all()):
                    return None
        except Exception:
            return None
        return "scale" if bool((y0 == 0).all()) else "affine"

    def _scale(self, call: Call, kind: str) -> Tensor:
        """``A = y(w = 1) − y(w = 0)`` on the whole batch (cached for the call)."""
        global _LAST
        versions = tuple(t._version for t, _ in call.versions)
        last = _LAST
        if last is not None and last[0]() is call and last[1] == versions:
            return last[2]
        w = call.params["weight"].detach()
        a = _run(call, torch.ones_like(w))
        if kind == "affine":
            a = a - _run(call, torch.zeros_like(w))
        _LAST = (weakref.ref(call), versions, a)
        with contextlib.suppress(RuntimeError):
            torch.autograd.Variable._execution_engine.queue_callback(_clear_cache)
        return a

    def _layout(self, call: Call, t: Tensor, lead: int) -> Tensor:
        """``[*lead, N, *R, *w.shape]`` → ``[*lead, N, R, P]``."""
        w = call.params["weight"]
        return t.reshape(*t.shape[: lead + 1], -1, w.numel())

    def builds_per_sample(self, call: Call) -> bool:
        return True

    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        r"""``Vₘₙ(w) = Σ_r gₘₙᵣ ⊙ Aₙᵣ``: ``[M, N, *w.shape]``."""
        kind = self._kind(call)
        if kind is None:
            return _GENERIC.per_sample(call, g)
        a = self._layout(call, self._scale(call, kind).to(g.dtype), 0)
        gl = self._layout(call, g, 1)
        v = torch.einsum("mnrp,nrp->mnp", gl, a)
        return {"weight": v.reshape(*v.shape[:2], *call.params["weight"].shape)}

    def summed(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        kind = self._kind(call)
        if kind is None:
            return _GENERIC.summed(call, g)
        a = self._layout(call, self._scale(call, kind).to(g.dtype), 0)
        v = torch.einsum("mnrp,nrp->mp", self._layout(call, g, 1), a)
        return {"weight": v.reshape(v.shape[0], *call.params["weight"].shape)}


# -- registration ----------------------------------------------------------------------------
def _is_norm_class(name: str, obj: Any, module_name: str) -> bool:
    return (
        isinstance(obj, type)
        and issubclass(obj, nn.Module)
        and getattr(obj, "__module__", None) == module_name
        and ("RMSNorm" in name or name == "T5LayerNorm")
    )


def _register_module(mod: ModuleType) -> None:
    """Register the rules for the classes ``mod`` (a ``transformers`` module) defines."""
    name = getattr(mod, "__name__", "")
    if name == "transformers.pytorch_utils":
        conv = getattr(mod, "Conv1D", None)
        if isinstance(conv, type) and issubclass(conv, nn.Module):
            register_rule(conv)(Conv1DRule)
        return
    if name.startswith("transformers.models.") and ".modeling_" in name:
        norms = [obj for k, obj in vars(mod).items() if _is_norm_class(k, obj, name)]
        if norms:
            register_rule(*norms)(ScaledNormRule)
        for fname in _SAMPLE_WISE_FUNCTIONS.get(name, ()):
            fn = getattr(mod, fname, None)
            if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
                keeps_samples_apart(fn)


#: custom ``autograd.Function`` s of ``transformers`` that work element by element, declared
#: to the batch analysis (:func:`~backprism.engine.fold.keeps_samples_apart`)
_SAMPLE_WISE_FUNCTIONS = {"transformers.models.bloom.modeling_bloom": ("GeLUFunction",)}


def _wanted(fullname: str) -> bool:
    return fullname == "transformers.pytorch_utils" or (
        fullname.startswith("transformers.models.") and ".modeling_" in fullname
    )


class _ImportHook(importlib.abc.MetaPathFinder):
    """Registers the rules right after a ``transformers`` module defining such classes has
    been executed; finds nothing itself (the other finders locate the module)."""

    _busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not _wanted(fullname) or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.on = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            with contextlib.suppress(Exception):  # never break the user's import
                _register_module(module)

        with contextlib.suppress(Exception):
            loader.exec_module = exec_module
        return spec


def register_transformers_rules() -> None:
    """Register the rules for the ``transformers`` modules imported so far, and install the
    import hook that registers them for modules imported later (idempotent)."""
    for name, mod in list(sys.modules.items()):
        if mod is not None and _wanted(name):
            with contextlib.suppress(Exception):
                _register_module(mod)
    if not any(type(f).__name__ == "_ImportHook" and type(f).__module__ == __name__
               for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())


register_transformers_rules()
