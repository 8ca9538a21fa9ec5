"""``collect(*extensions)``: the context that turns one backward pass into extra quantities.

During the backward pass inside the context:

1. the extended loss's output hook fires first; if second-order extensions are active it builds
   the loss-Hessian square-root columns ``S`` and pushes them, in chunks, to every captured module
   output with one batched vector-Jacobian product (:mod:`backprism.columns`); each module's
   rule reduces them to diagonals, square roots or Kronecker factors;
2. each captured module output's hook receives ``∂L/∂out`` and its rule computes the
   first-order statistics;
3. once a module is done, ``extension_hook(module)`` runs, so callers can reduce and free buffers
   while the backward pass continues; a callback at the end of the pass finishes parameters used
   by several calls and runs the hooks that are still due.

Results are stored as parameter attributes (``param.grad_batch``, ``param.diag_ggn_exact``, …);
``.grad`` is never touched.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn

from backprism.columns import Columns
from backprism.extend import CAPTURE, LossRecord
from backprism.extensions.base import Extension, FirstOrderExtension, SecondOrderExtension
from backprism.rules.base import Call, get_rule, params_of

__all__ = ["collect"]

_ACTIVE: collect | None = None


class _Memo:
    """Caches rule results within one call's processing (e.g. SumGradSquared and Variance).

    Entries keep their arguments alive, so an id can't be reused by another tensor while the
    memo exists (extensions may call the rule on temporary sample chunks)."""

    def __init__(self, rule: Any) -> None:
        self._rule = rule
        self._cache: dict[tuple, tuple[tuple, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._rule, name)
        if not callable(fn):
            return fn

        def cached(call: Call, *args: Any, **kwargs: Any) -> Any:
            held = (call, *args, *kwargs.values())
            key = _Memo._key(name, tuple(kwargs), held)
            hit = self._cache.get(key)
            if hit is None or any(a is not b for a, b in zip(hit[0], held)):
                hit = (held, fn(call, *args, **kwargs))
                self._cache[key] = hit
            return hit[1]

        return cached

    def provide(self, name: str, call: Call, *args: Any, value: Any) -> None:
        """Record ``value`` as the result of ``rule.<name>(call, *args)`` (an extension that
        derived it on the way, e.g. GradHist's per-sample chunks giving ``batch_l2``)."""
        held = (call, *args)
        self._cache.setdefault(_Memo._key(name, (), held), (held, value))

    @staticmethod
    def _key(name: str, kwnames: tuple, held: tuple) -> tuple:
        return (name, kwnames, *(id(a) for a in held))


class _BackwardState:
    """Book-keeping for one backward pass."""

    def __init__(self) -> None:
        self.fired: Counter[tuple[int, int]] = Counter()
        self.module_fired: Counter[tuple[int, int]] = Counter()
        # (group id, param id) -> [param, call, dense [1, N, *p]]
        self.dense: dict[tuple[int, int], list] = {}
        self.seen: set[tuple[int, str]] = set()
        self.touched: dict[int, nn.Module] = {}
        self.hooked: set[int] = set()
        self.loss_records: list[LossRecord] = []
        # param id -> [(extension, partial result, module, fallback)] awaiting the parameter's
        # gradient of this backward pass (Variance takes the mean gradient from it, saving a
        # second pass over inputs and output gradients)
        self.partials: dict[int, list[tuple[Extension, Any, nn.Module, Callable[[], Tensor]]]] = {}
        self.module_call: dict[int, Call] = {}
        #: caches extensions keep for the length of this pass (e.g. unfolded inputs shared by
        #: the column chunks of a call), dropped with it
        self.scratch: dict[Hashable, Any] = {}


class collect:
    """Context manager computing ``extensions`` during ``loss.backward()`` (or ``autograd.grad``).

    Args:
        *extensions: extension *instances*, e.g. ``BatchGrad()``, ``DiagGGNExact()``.
        extension_hook: called as ``extension_hook(module)`` once per module after its
            extensions ran, e.g. to reduce ``param.grad_batch`` to a statistic and delete it.
        chunk_size: number of loss-Hessian square-root columns pushed back at once (second
            order); default: as many as fit in ``memory_budget``.
        memory_budget: bytes allowed for one chunk of backpropagated columns, counting the
            columns at every captured output and the per-sample gradients rules build from
            them (default 1 GiB).

    Example:
        >>> with collect(BatchGrad(), DiagGGNExact()):
        ...     loss.backward()
        >>> model[0].weight.grad_batch.shape  # [N, out, in]
    """

    def __init__(
        self,
        *extensions: Extension,
        extension_hook: Callable[[nn.Module], None] | None = None,
        chunk_size: int | None = None,
        memory_budget: int = 2**30,
    ) -> None:
        for ext in extensions:
            if isinstance(ext, type) and issubclass(ext, Extension):
                raise TypeError(
                    f"collect() takes extension instances: pass {ext.__name__}() instead of "
                    f"the class {ext.__name__}"
                )
            if not isinstance(ext, Extension):
                raise TypeError(
                    f"collect() takes backprism extensions, got {type(ext).__name__}: {ext!r}"
                )
        fields = Counter(e.savefield for e in extensions)
        dup = [f for f, c in fields.items() if c > 1]
        if dup:
            raise ValueError(
                f"two extensions would write the same attribute {dup}; pass each extension once"
            )
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
        self.extensions = list(extensions)
        # extensions that provide rule results to the per-call memo run first (stable order)
        self.first = sorted(
            (e for e in extensions if isinstance(e, FirstOrderExtension)),
            key=lambda e: not getattr(e, "provides", ()),
        )
        self.second = [e for e in extensions if isinstance(e, SecondOrderExtension)]
        self.extension_hook = extension_hook
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget
        self._bs: _BackwardState | None = None
        self._saw_hook = False
        self._saw_loss = False

    # -- context protocol -------------------------------------------------------------------
    def __enter__(self) -> collect:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("backprism.collect contexts cannot be nested")
        _ACTIVE = self
        self._bs = None
        self._saw_hook = False
        self._saw_loss = False
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        global _ACTIVE
        try:
            if self._bs is not None and exc_type is None:
                self._finish()
        finally:
            _ACTIVE = None
            self._bs = None
            CAPTURE.in_column_backprop = 0
        if exc_type is None and self.extensions and not self._saw_hook:
            raise RuntimeError(
                "backprism.collect saw no extended module during the backward pass: call "
                "backprism.extend(model) (and extend(lossfunc)) before the forward pass"
            )
        if exc_type is None and self.second and self._saw_hook and not self._saw_loss:
            names = ", ".join(type(e).__name__ for e in self.second)
            raise RuntimeError(
                f"backprism: {names} need the loss module to be extended too: use "
                "lossfunc = backprism.extend(nn.CrossEntropyLoss()) (or MSELoss, ...) instead "
                "of a functional loss"
            )

    # -- per-backward state ------------------------------------------------------------------
    def _state(self) -> _BackwardState:
        if self._bs is None:
            self._bs = _BackwardState()
            # not inside a backward pass (e.g. called by hand): finished at context exit
            with contextlib.suppress(RuntimeError):
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._saw_hook = True
        return self._bs

    def _finish(self) -> None:
        bs = self._bs
        if bs is None:
            return
        for key in list(bs.dense):
            param, call, dense = bs.dense.pop(key)
            self._finalize_dense(bs, param, call, dense)
        for pid in list(bs.partials):  # the parameter got no gradient (autograd.grad w.r.t. x)
            for ext, partial, module, fallback in bs.partials.pop(pid):
                p = next(q for q in module.parameters() if id(q) == pid)
                self._store(bs, p, ext, ext.finish(partial, fallback()))
        if self.extension_hook is not None:
            for mid, module in bs.touched.items():
                if mid not in bs.hooked:
                    bs.hooked.add(mid)
                    self.extension_hook(module)
        self._bs = None

    # -- storing -----------------------------------------------------------------------------
    def _store(self, bs: _BackwardState, param: nn.Parameter, ext: Extension, value: Any) -> None:
        key = (id(param), ext.savefield)
        if key in bs.seen:
            setattr(param, ext.savefield, ext.accumulate(getattr(param, ext.savefield), value))
        else:
            bs.seen.add(key)
            setattr(param, ext.savefield, value)

    def _finalize_dense(
        self, bs: _BackwardState, param: nn.Parameter, call: Call, dense: Tensor
    ) -> None:
        for ext in self.first:
            if not ext.additive:
                self._store(bs, param, ext, ext.from_dense(dense, call, None))

    # -- first order -------------------------------------------------------------------------
    def on_output_grad(self, call: Call, grads: tuple[Tensor | None, ...]) -> None:
        bs = self._state()
        module = call.module
        _check_batchnorm(call, self.extensions)
        group = call.group  # type: ignore[attr-defined]
        _check_batch_axis(call, group.batch_sizes.most_common(1)[0][0], self.extensions)
        params = params_of(call)
        if self.first and params and any(g is not None for g in grads):
            call.check_unmodified()
            rule = _Memo(get_rule(module))
            g = _with_column_axis(grads, call)
            gid = call.group.id  # type: ignore[attr-defined]
            single, multi = {}, {}
            for name, p in params.items():
                bs.fired[(gid, id(p))] += 1
                count = call.group.param_count[id(p)]  # type: ignore[attr-defined]
                (single if count <= 1 else multi)[name] = p
            for ext in self.first:
                names = params if ext.additive else single
                if not names:
                    continue
                out = ext.from_rule(rule, call, g, None)
                for name in names:
                    if getattr(ext, "needs_param_grad", False):
                        fallback = _summed_fallback(rule, call, g, name)
                        item = (ext, out[name], module, fallback)
                        bs.partials.setdefault(id(params[name]), []).append(item)
                    else:
                        self._store(bs, params[name], ext, out[name])
            if multi and any(not e.additive for e in self.first):
                dense = rule.per_sample(call, g)
                for name, p in multi.items():
                    key = (gid, id(p))
                    if key in bs.dense:
                        bs.dense[key][2] = bs.dense[key][2] + dense[name]
                    else:
                        bs.dense[key] = [p, call, dense[name]]
                    if bs.fired[key] >= call.group.param_count[id(p)]:  # type: ignore[attr-defined]
                        p_, c_, d_ = bs.dense.pop(key)
                        self._finalize_dense(bs, p_, c_, d_)
            bs.touched[id(module)] = module
        bs.module_fired[(group.id, id(module))] += 1
        bs.module_call[id(module)] = call
        self._maybe_run_hook(bs, call)

    def _maybe_run_hook(self, bs: _BackwardState, call: Call) -> None:
        """Run ``extension_hook`` once the module's last call in its group is done."""
        module = call.module
        if self.extension_hook is None or id(module) not in bs.touched or id(module) in bs.hooked:
            return
        group, params = call.group, params_of(call)  # type: ignore[attr-defined]
        if bs.module_fired[(group.id, id(module))] < group.module_count[id(module)]:
            return
        # a parameter shared with another call (tied weights) is done only when all fired
        if any(
            bs.fired[(group.id, id(p))] < group.param_count[id(p)]
            or id(p) in bs.partials
            or any(k[1] == id(p) for k in bs.dense)
            for p in params.values()
        ):
            return
        bs.hooked.add(id(module))
        self.extension_hook(module)

    def on_param_grad(self, param: nn.Parameter, grad: Tensor) -> None:
        """The parameter's gradient of this backward pass arrived (leaf tensor hook)."""
        bs = self._bs
        if bs is None:
            return
        items = bs.partials.pop(id(param), None)
        if not items:
            return
        for ext, partial, _, _ in items:
            self._store(bs, param, ext, ext.finish(partial, grad.detach()))
        for module in {id(m): m for _, _, m, _ in items}.values():
            call = bs.module_call.get(id(module))
            if call is not None:
                self._maybe_run_hook(bs, call)

    # -- second order ------------------------------------------------------------------------
    def on_loss_grad(self, record: LossRecord, grad: Tensor) -> None:
        bs = self._state()
        self._saw_loss = True
        bs.loss_records.append(record)
        module = record.module
        reduction = getattr(module, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"backprism: {type(module).__name__}(reduction={reduction!r}) gives no "
                "per-sample scaling; use reduction='mean' or 'sum'"
            )
        if grad.numel() != 1:
            raise ValueError(
                "backprism: the backward pass must start from a scalar loss; got a gradient of "
                f"shape {tuple(grad.shape)} at the output of {type(module).__name__}"
            )
        if not self.second:
            return
        scale = float(grad.detach().reshape(()))
        if scale < 0:
            raise ValueError(
                f"backprism: the loss of {type(module).__name__} enters the objective with a "
                f"negative factor ({scale}); its GGN is not positive semi-definite"
            )
        from backprism.losses import loss_hessian_sqrt

        for c, _ in record.taken:
            _check_batchnorm(c, self.second)
        calls = [(c, outs) for c, outs in record.taken if params_of(c)]
        if not calls:
            return
        sizes = Counter(c.batch_size for c, _ in calls)
        n_samples = sizes.most_common(1)[0][0]
        for c, _ in calls:
            c.check_unmodified()
            _check_batch_axis(c, n_samples, self.second)
        # extensions that do their own work at the loss (KFRA's recursion, HVP estimators)
        for ext in self.second:
            if hasattr(ext, "handle_loss"):
                ext.handle_loss(self, bs, record, calls, n_samples, scale)
        column_exts = [e for e in self.second if not hasattr(e, "handle_loss")]
        keys = list(dict.fromkeys(e.column_key() for e in column_exts))
        for key in keys:
            exts = [e for e in column_exts if e.column_key() == key]
            cols = loss_hessian_sqrt(module, record.inputs, key, n_samples)
            origins = [record.inputs[i] for i in cols.inputs]
            if scale != 1.0:
                cols = cols.scaled(scale**0.5)
            self.process_columns(bs, calls, origins, cols, exts, None)

    def process_columns(
        self,
        bs: _BackwardState,
        calls: list[tuple[Call, list[Tensor]]],
        origins: list[Tensor],
        cols: Columns,
        exts: list[SecondOrderExtension],
        weights: Tensor | None,
    ) -> None:
        """Push columns ``cols`` (``[K, *origin.shape]`` each, generated lazily in chunks) from
        ``origins`` to the outputs of ``calls`` and reduce them with ``exts``.
        ``weights`` (``[K, N]``) multiply each column's squared contributions (signs)."""
        from backprism.columns import backprop_columns

        outputs = [o for _, outs in calls for o in outs]
        count = Counter(id(p) for c, _ in calls for p in params_of(c).values())
        per_col = _column_bytes(calls, outputs, count, exts)
        chunk = self.chunk_size or max(1, self.memory_budget // per_col)
        for start, grads in backprop_columns(origins, cols, outputs, chunk):
            w = None if weights is None else weights[start : start + _chunk_width(grads)]
            dense: dict[int, list] = {}
            i = 0
            for call, outs in calls:
                gs = tuple(grads[i : i + len(outs)])
                i += len(outs)
                if all(x is None for x in gs):
                    continue
                g = (
                    gs[0]
                    if len(gs) == 1
                    else tuple(
                        x if x is not None else _zeros_like_batched(gs, call, j)
                        for j, x in enumerate(gs)
                    )
                )
                rule = _Memo(get_rule(call.module))
                params = params_of(call)
                single = {n: p for n, p in params.items() if count[id(p)] <= 1}
                for ext in exts:
                    names = params if ext.additive else single
                    if not names:
                        continue
                    out = ext.from_rule(rule, call, g, w)
                    for name in names:
                        self._store(bs, params[name], ext, out[name])
                multi = {n: p for n, p in params.items() if count[id(p)] > 1}
                if multi and any(not e.additive for e in exts):
                    ps = rule.per_sample(call, g)
                    for name, p in multi.items():
                        if id(p) in dense:
                            dense[id(p)][2] = dense[id(p)][2] + ps[name]
                        else:
                            dense[id(p)] = [p, call, ps[name]]
                bs.touched[id(call.module)] = call.module
            for p, call, d in dense.values():
                for ext in exts:
                    if not ext.additive:
                        self._store(bs, p, ext, ext.from_dense(d, call, w))


def _column_bytes(
    calls: list[tuple[Call, list[Tensor]]],
    outputs: list[Tensor],
    count: Counter[int],
    exts: list[Any],
) -> int:
    """Bytes one backpropagated column costs at its peak: the column at every captured output,
    plus the per-sample gradients ``[N, *p]`` an extension may build from it (the largest
    parameter of a call for which one says so, :meth:`Extension.builds_per_sample`) and, for
    extensions that square summed per-sample gradients (not ``additive``), those of every
    parameter shared by several calls (held until its last call).

    Without the last two terms a 2048-token decoder with tied embeddings overran a 512 MiB
    budget 23-fold: each column carries an ``[N, V, d]`` gradient of the tied matrix."""
    elem = outputs[0].element_size() if outputs else 4
    total = sum(o.numel() * o.element_size() for o in outputs)
    n = max((c.batch_size for c, _ in calls), default=1)
    dense = any(not e.additive for e in exts)
    built, shared, seen = 0, 0, set()
    for call, _ in calls:
        rule = get_rule(call.module)
        builds = any(e.builds_per_sample(rule, call) for e in exts)
        for p in params_of(call).values():
            if builds:
                built = max(built, p.numel())
            if dense and count[id(p)] > 1 and id(p) not in seen:
                seen.add(id(p))
                shared += p.numel()
    return max(1, total + n * elem * (built + shared))


def _summed_fallback(rule: Any, call: Call, g: Any, name: str) -> Callable[[], Tensor]:
    return lambda: rule.summed(call, g)[name][0]


def _chunk_width(grads: list[Tensor | None]) -> int:
    for g in grads:
        if g is not None:
            return g.shape[0] if isinstance(g, Tensor) else g[0].shape[0]
    return 0


def _zeros_like_batched(gs: tuple, call: Call, j: int) -> Tensor:
    ref = next(x for x in gs if x is not None)
    return ref.new_zeros((ref.shape[0], *call.out_shapes[j]))


def _with_column_axis(grads: tuple[Tensor | None, ...], call: Call) -> Any:
    if len(grads) == 1:
        return grads[0].detach().unsqueeze(0)
    ref = next(g for g in grads if g is not None)
    return tuple(
        (g.detach() if g is not None else ref.new_zeros(call.out_shapes[j])).unsqueeze(0)
        for j, g in enumerate(grads)
    )


def _check_batch_axis(call: Call, n: int, extensions: list[Extension]) -> None:
    if call.batch_size != n and any(e.per_sample for e in extensions):
        raise RuntimeError(
            f"backprism: {type(call.module).__name__} was called with an input whose first axis "
            f"has size {call.batch_size}, but the batch has {n} samples. Per-sample quantities "
            "need every parameter-owning module to see the batch axis first; e.g. expand "
            "position indices to [N, T] (`pos.expand(N, -1)`) instead of broadcasting."
        )


def _check_batchnorm(call: Call, extensions: list[Extension]) -> None:
    if (
        call.training
        and isinstance(call.module, nn.modules.batchnorm._BatchNorm)
        and any(e.per_sample for e in extensions)
    ):
        names = ", ".join(type(e).__name__ for e in extensions if e.per_sample)
        raise RuntimeError(
            f"backprism: {type(call.module).__name__} in train mode mixes the samples of a "
            f"batch, so per-sample quantities ({names}) are undefined. Call model.eval() "
            "for the backward pass, or replace BatchNorm by GroupNorm/LayerNorm"
        )


def on_output_grad(call: Call, grads: tuple[Tensor | None, ...]) -> None:
    """Entry point for module output hooks (see :mod:`backprism.extend`)."""
    if _ACTIVE is None or CAPTURE.in_column_backprop:
        return
    _ACTIVE.on_output_grad(call, grads)


def on_param_grad(param: nn.Parameter, grad: Tensor) -> None:
    """Entry point for parameter (leaf) gradient hooks (see :mod:`backprism.extend`)."""
    if _ACTIVE is None or CAPTURE.in_column_backprop:
        return
    _ACTIVE.on_param_grad(param, grad)


def on_loss_grad(record: LossRecord, grad: Tensor) -> None:
    """Entry point for loss output hooks (see :mod:`backprism.extend`)."""
    if _ACTIVE is None or CAPTURE.in_column_backprop:
        return
    _ACTIVE.on_loss_grad(record, grad)


def active() -> collect | None:
    """The active :class:`collect` context, if any."""
    return _ACTIVE
