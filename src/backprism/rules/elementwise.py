r"""Closed form for a parameter in a broadcasting arithmetic operation with the samples.

A functional use such as ``x * self.gamma.reshape(1, -1, 1, 1)`` (ConvNeXt's layer scale),
``x + self.pos_embed`` or ``(x - self.mu) / self.sigma`` is captured as a call of an
:class:`~backprism.engine.functional.OpModule` stand-in: ``out = f(xₙ, q)`` for each sample,
with ``f`` one of ``+ − × ÷`` and ``q = r(θ)`` a parameter operand that broadcasts over the
batch axis (its axis aligned with the batch has size 1, or it has fewer axes). The per-sample,
per-column gradients are then

.. math::

    V_{mn} = J_r^{\top}\, \mathrm{sum\_to}_{q}\!\Big(g_{mn} \odot \frac{\partial f}{\partial q}
    (x_n, q)\Big) \qquad [M, N, *θ.shape],

with ``sum_to_q`` the sum over the axes along which ``q`` was broadcast and ``J_rᵀ`` the
transpose of the rebuild's Jacobian. Both are computed for all columns and samples at once,
without a per-sample recomputation: ``q`` is given an explicit ``[M, N]`` lead (one copy per
column and sample, the size of ``g``), the operation is run once on ``x`` with a leading axis
of 1 (elementwise operations broadcast it), and one ``autograd.grad`` with cotangent ``g``
gives ``∂/∂q`` per column and sample. Where ``r`` is a pure view of the parameter
(``reshape``, ``view``, ``[None]``, ``expand``, a transpose, a slice), an index map of its
elements, ``J_rᵀ`` adds each entry into the parameter's element it shows (``index_add``);
for a derived operand (``exp(θ)``, ``1 + θ``, a dtype conversion) it is the rebuild's own
vector-Jacobian product, batched over the ``M·N`` columns (``is_grads_batched``). The scaling
is that of ``g`` (first order: ``g[0] = ∂L/∂out``).

On a batch folded with another axis (``k·N`` rows sample-major, Swin V2's ``attn · exp(s)``
on its windows' rows) the columns are computed per row and each sample's ``k`` rows summed
before ``J_rᵀ``.

Anything else — a parameter operand with the batch's size on its batch axis, options other
than ``alpha``, a rebuild autograd cannot batch — is left to the generic
``torch.func`` rule (:func:`per_sample` returns ``None``), which gives the same numbers
through a ``vmap`` over the samples at several times the cost (about 2 ms of Python per call
on the CPU).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import Tensor

from backprism.engine.rule import Call

__all__ = ["BROADCASTING_OPS", "affine_per_sample", "per_sample"]

#: arithmetic operations of two operands that broadcast them elementwise (not in place)
BROADCASTING_OPS = frozenset(
    {"add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "mul", "__mul__", "__rmul__",
     "div", "__truediv__", "__rtruediv__", "true_divide", "multiply", "subtract", "divide"}
)
#: options the closed form passes through (``torch.add(x, p, alpha=2)``)
_OPTIONS = frozenset({"alpha"})


def per_sample(call: Call, gs: list[Tensor]) -> dict[str, Tensor] | None:
    r"""``{name: [M, N, *θ.shape]}`` for a call of a broadcasting stand-in (see the module
    docstring), or ``None`` where the closed form does not apply."""
    module = call.module
    if call.batch_axis or len(gs) != 1 or len(call.out_shapes) != 1:
        return None
    if len(call.args) != 1 or call.kwargs or not set(module._kwargs) <= _OPTIONS:
        return None
    # (on a folded batch, k·N rows sample-major: computed per row, each sample's rows summed)
    samples, k = call.batch_size, call.fold
    n, shape = samples * k, tuple(call.out_shapes[0])
    x, g = call.args[0], gs[0]
    if not shape or shape[0] != n or x.dim() != len(shape) or x.shape[0] != n:
        return None
    if g.dim() != len(shape) + 1 or tuple(g.shape[1:]) != shape:
        return None
    params = [module._parameters[f"p{i}"] for i in range(len(module._parameters))]
    slots: list[tuple[int, Tensor, Tensor, Any]] = []  # (parameter index, q, leaf, rebuild)
    m = g.shape[0]
    items: list[Any] = []
    with torch.no_grad():
        for item in module._template:
            if isinstance(item, tuple) and item and item[0] == "x":
                items.append(x.unsqueeze(0))
            elif isinstance(item, tuple) and item and item[0] == "p":
                q = item[2](params[item[1]].detach())
                if not isinstance(q, Tensor) or q.dim() > len(shape):
                    return None
                lead = len(shape) - q.dim()
                if lead == 0 and q.shape[0] != 1:
                    return None  # per-sample rows of the parameter: the generic rule
                aligned = q.reshape((1,) * lead + tuple(q.shape))
                leaf = aligned.unsqueeze(0).expand(m, n, *aligned.shape[1:]).clone()
                slots.append((item[1], q, leaf, item[2]))
                items.append(leaf)
            else:
                items.append(module._value(item, ()))
        if not slots:
            return None
        maps = [_index_map(params[i].detach(), q) for i, q, _, _ in slots]
    kwargs = {k: module._value(v, ()) for k, v in module._kwargs.items()}
    with torch.enable_grad():
        leaves = [leaf.requires_grad_() for _, _, leaf, _ in slots]
        out = module._func(*items, **kwargs)
        if not isinstance(out, Tensor) or tuple(out.shape) != (m, *shape) or out.dtype != g.dtype:
            return None
        grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    result: dict[str, Tensor] = {}
    for (i, q, leaf, rebuild), index, grad in zip(slots, maps, grads):
        p = params[i]
        cols = (torch.zeros_like(leaf) if grad is None else grad).reshape(m * n, -1)
        if k > 1:
            cols = cols.reshape(m * samples, k, -1).sum(1)
        if index is None:  # a derived operand: the rebuild's own vector-Jacobian product
            cols = _pull_back(p, rebuild, cols.reshape(m * samples, *q.shape))
            if cols is None:
                return None
        elif index is not _IN_ORDER:  # (a reshape of the parameter: its elements in order)
            cols = cols.new_zeros(m * samples, p.numel()).index_add_(1, index, cols)
        v = cols.reshape(m, samples, *p.shape)
        key = f"p{i}"
        result[key] = result[key] + v if key in result else v
    return {name: result[name] for name in call.params}


def _pull_back(p: Tensor, rebuild: Any, cols: Tensor) -> Tensor | None:
    """``J_rᵀ c`` for each column ``c`` of ``cols`` (``[K, *q.shape]``) through a rebuild
    ``q = r(θ)`` that is not a view (``exp(θ)``, ``1 + θ``, a dtype conversion): one
    vector-Jacobian product batched over the columns (``[K, *θ.shape]``), or ``None`` where
    autograd cannot batch it (the generic rule then takes the call)."""
    with torch.enable_grad():
        leaf = p.detach().requires_grad_()
        q = rebuild(leaf)
        if not isinstance(q, Tensor) or not q.requires_grad or q.shape != cols.shape[1:]:
            return None
        try:
            (v,) = torch.autograd.grad(q, leaf, cols.to(q.dtype), is_grads_batched=True)
        except (RuntimeError, NotImplementedError):
            return None
    return v


#: :func:`_index_map` of a view that shows the parameter's elements once each, in order
_IN_ORDER = torch.empty(0, dtype=torch.long)


def _index_map(p: Tensor, q: Tensor) -> Tensor | None:
    """For ``q`` a view of ``p`` (same storage and dtype, ``p`` contiguous): the index into
    ``p.flatten()`` of each element of ``q`` (flattened) — :data:`_IN_ORDER` for a reshape of
    the whole of ``p`` — else ``None``."""
    if q.dtype != p.dtype or not p.is_contiguous():
        return None
    if q.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
        return None
    offset = q.storage_offset() - p.storage_offset()
    if offset < 0:
        return None
    last = offset + sum((s - 1) * t for s, t in zip(q.shape, q.stride()) if s > 0)
    if q.numel() and last >= p.numel():
        return None
    if offset == 0 and q.numel() == p.numel() and q.is_contiguous():
        return _IN_ORDER
    flat = torch.arange(p.numel(), device=p.device)
    return flat.as_strided(q.shape, q.stride(), offset).reshape(-1)


# -- modules whose output is affine in each parameter, broadcast elementwise ------------------
#: classes (with their parameters' names and shapes) found not to be of that form
_NOT_AFFINE: set[tuple] = set()
#: at most this many parameters per module for the probe
_MAX_PARAMS = 4


def affine_per_sample(
    call: Call, gs: list[Tensor], primals: dict[str, Tensor], run: Any
) -> dict[str, Tensor] | None:
    r"""``{name: [M, N, *θ.shape]}`` for a module call whose output is, in each parameter
    ``θ`` (the others at their values), ``y = B(x) + A(x) ⊙ bcast(θ)`` with ``θ`` broadcast
    over the batch aligned with the trailing axes of ``y`` or with the axes after the batch
    (timm's ``LayerScale`` ``x * γ`` and ``LayerScale2d`` ``x * γ.view(1, -1, 1, 1)``,
    PoolFormer's ``Scale``, ResMLP's ``Affine`` ``β + α ⊙ x``): then
    ``Vₘₙ(θ) = Σ_r gₘₙᵣ ⊙ Aₙᵣ`` over the positions ``r`` ``θ`` is broadcast over, with
    ``A = y(θ = 1) − y(θ = 0)`` from two forwards of the module on the batch — no per-sample
    ``vmap``. Checked on every call on its first two samples (``y`` of those two alone at a
    random ``θ`` is the batch's ``y(0) + A ⊙ bcast(θ)`` in their rows for exactly one
    alignment, to ``10⁻⁴`` of ``max |y|``, and sample 0 alone gives its row); ``None`` (the
    generic rule's ``vmap``) where the call or the module is not of this form.
    ``run(params, args, kwargs)`` is the generic rule's functional call of the module."""
    module = call.module
    n, m = call.batch_size, gs[0].shape[0]
    shape = tuple(call.out_shapes[0]) if len(call.out_shapes) == 1 else ()
    if (
        call.fold != 1 or call.batch_axis or len(gs) != 1 or not shape or shape[0] != n
        or n < 2 or not primals or len(primals) > _MAX_PARAMS or len(primals) != len(call.params)
    ):
        return None
    key = (type(module), tuple((k, tuple(p.shape)) for k, p in primals.items()))
    if key in _NOT_AFFINE:
        return None
    tensors = [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, Tensor)]
    inner = math.prod(shape[1:])
    if (
        not tensors or any(t.dim() == 0 or t.shape[0] != n for t in tensors)
        or any(not p.is_floating_point() or p.numel() > inner for p in primals.values())
    ):
        return None

    def y(params: dict[str, Tensor], rows: slice) -> Tensor | None:
        args = tuple(a[rows] if isinstance(a, Tensor) else a for a in call.args)
        kwargs = {k: v[rows] if isinstance(v, Tensor) else v for k, v in call.kwargs.items()}
        out = run(params, args, kwargs)
        return out[0] if len(out) == 1 and out[0].is_floating_point() else None

    result: dict[str, Tensor] = {}
    gen = torch.Generator(device=gs[0].device).manual_seed(0)
    with torch.no_grad():
        for name, p in primals.items():

            def at(t: Tensor, rows: slice, name: str = name) -> Tensor | None:
                return y({**primals, name: t}, rows)  # (the others at their values)

            try:
                # on the batch: B = y(θ = 0) and A = y(θ = 1) − B; at a random θ, the first
                # two samples and sample 0 alone
                b0, a = at(torch.zeros_like(p), slice(None)), at(torch.ones_like(p), slice(None))
                r = 0.5 + torch.rand(p.shape, generator=gen, device=p.device, dtype=p.dtype)
                yr, alone = at(r, slice(0, 2)), at(r, slice(0, 1))
            except Exception:  # (a module that does not take such values: the generic rule)
                _NOT_AFFINE.add(key)
                return None
            if (
                b0 is None or a is None or yr is None or alone is None
                or b0.shape != shape or a.shape != shape or yr.shape[1:] != shape[1:]
            ):
                _NOT_AFFINE.add(key)
                return None
            a = a - b0
            tol = 1e-4 * float(yr.abs().max()) + 1e-12
            fits = [
                b for b in _alignments(p.shape, shape)
                if bool(((b0[:2] + a[:2] * r.reshape(b) - yr).abs() <= tol).all())
            ]
            if len(fits) != 1 or not bool(((alone - yr[:1]).abs() <= tol).all()):
                _NOT_AFFINE.add(key)
                return None
            a = a.to(gs[0].dtype)  # A = y(θ = 1) − y(θ = 0), [N, *out]
            bshape = fits[0]
            # Σ over the output axes θ is broadcast over (axis i of the output is i + 1 of g)
            dims = tuple(i + 1 for i in range(1, len(shape)) if bshape[i] == 1 and shape[i] != 1)
            v = gs[0] * a
            if dims:
                v = v.sum(dims, keepdim=True)
            result[name] = v.reshape(m, n, *p.shape)
    return {k: result[k] for k in call.params}


#: per module, ``(parameter shapes, input shapes after the batch) → bool``
#: (:func:`multi_affine`; per instance: a module's attributes may select its computation)
_MULTI_AFFINE: weakref.WeakKeyDictionary[Any, dict[tuple, bool]] = weakref.WeakKeyDictionary()


def multi_affine(
    call: Call, primals: dict[str, Tensor], run: Any, inputs: bool = True
) -> bool:
    r"""Whether ``call``'s module (at most :data:`_MAX_PARAMS` parameters) is affine in each of
    its parameters and (``inputs``) in its inputs, each with the rest held (timm's
    ``LayerScale`` ``x ⊙ γ``, ResMLP's ``Affine`` ``β + α ⊙ x``): its Hessian then has no term
    of its own in any parameter's block, and none through its inputs — the DiagHessian family
    takes it like a Linear layer. Probed by the outputs at the midpoint of two random values
    of one parameter (then of all inputs at once), which must be the mean of the outputs at
    the two, to ``10⁻⁶`` (``10⁻³`` in single precision; half precision is probed in float64)
    of the largest output; a nonlinear dependence fails that almost surely. With ``inputs``
    the module (without sub-modules, one floating input on the batch, one output) runs on the
    call's first two samples; without, on the call's own arguments, whatever they are (an
    embedding's indices, keyword tensors, sub-modules, several outputs). Cached per module,
    shapes and ``inputs``. ``primals`` and ``run(params, args, kwargs)``: the module's
    functional call, outputs listed (as for :func:`affine_per_sample`)."""
    module = call.module
    n = call.batch_size
    params = primals
    tensors = [a for a in call.args if isinstance(a, Tensor)]
    if not params or len(params) > _MAX_PARAMS:
        return False
    if inputs and (
        call.fold != 1 or call.batch_axis
        or module._modules or len(call.out_shapes) != 1 or not tensors
        or any(isinstance(v, Tensor) for v in call.kwargs.values())  # (inputs: positional)
        or any(t.dim() == 0 or t.shape[0] != n or not t.is_floating_point() for t in tensors)
    ):
        return False
    key = (
        tuple((k, tuple(p.shape)) for k, p in params.items()),
        tuple(tuple(t.shape[1:]) for t in tensors),
        tuple((k, tuple(v.shape)) for k, v in call.kwargs.items() if isinstance(v, Tensor)),
        inputs,
    )
    known = _MULTI_AFFINE.setdefault(module, {})
    if key in known:
        return known[key]
    rows = slice(0, min(2, n)) if inputs else slice(None)
    args = tuple(a[rows].detach() if isinstance(a, Tensor) else a for a in call.args)
    kwargs = call.kwargs
    if any(p.dtype in (torch.float16, torch.bfloat16) for p in params.values()):
        # (half precision rounds the midpoint by more than the tolerance: probed in float64,
        # where a module that cannot run so, a half-precision buffer, stays unknown)
        def wide(t: Any) -> Any:
            return t.double() if isinstance(t, Tensor) and t.is_floating_point() else t

        params = {k: wide(v) for k, v in params.items()}
        args = tuple(wide(a) for a in args)
        kwargs = {k: wide(v) for k, v in kwargs.items()}
    device = next(iter(params.values())).device
    gen = torch.Generator(device=device).manual_seed(0)

    def noise(t: Tensor) -> Tensor:
        return t + torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype)

    def midpoint_holds(y: Any) -> bool:
        for ya, yb, ym in zip(y(0), y(1), y(2), strict=True):
            if not ya.is_floating_point():
                continue
            tol = (1e-6 if ya.dtype == torch.float64 else 1e-3) * float(ya.abs().max()) + 1e-12
            if not bool(((ym - (ya + yb) / 2).abs() <= tol).all()):
                return False
        return True

    try:
        # (a module drawing random numbers, dropout, leaves the user's random state alone)
        with torch.no_grad(), torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], device_type=device.type
        ):
            ok = True
            for name, p in params.items():
                a, b = noise(p), noise(p)
                points = (a, b, (a + b) / 2)
                ok = ok and midpoint_holds(
                    lambda i, name=name, points=points: run(
                        {**params, name: points[i]}, args, kwargs
                    )
                )
            if inputs and ok:
                xa = [noise(t) if isinstance(t, Tensor) else t for t in args]
                xb = [noise(t) if isinstance(t, Tensor) else t for t in args]
                xm = [
                    (u + v) / 2 if isinstance(u, Tensor) else u
                    for u, v in zip(xa, xb, strict=True)
                ]
                ok = midpoint_holds(lambda i: run(params, tuple((xa, xb, xm)[i]), kwargs))
    except Exception:  # (a module that does not take such values: not known to be affine)
        ok = False
    known[key] = ok
    return ok


def _alignments(pshape: torch.Size, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The broadcast shapes of a parameter of shape ``pshape`` against an output ``shape``
    (batch on axis 0): aligned with the trailing axes, or with the axes after the batch (a
    channel axis), or as it is where it has the output's rank and an axis 0 of size 1; each
    only where broadcasting allows it."""
    d, k = len(shape), len(pshape)
    out: list[tuple[int, ...]] = []
    if k > d or (k == d and pshape[0] != 1):
        return out
    candidates = (
        [tuple(pshape)] if k == d  # (its own axis 0 of size 1 against the batch: ResMLP's α)
        else [(1,) * (d - k) + tuple(pshape), (1, *pshape) + (1,) * (d - 1 - k)]
    )
    for b in candidates:
        ok = all(s in (1, t) for s, t in zip(b, shape))
        if ok and b not in out:
            out.append(b)
    return out
