"""``collect(*extensions)``: the context that turns a backward pass into extra quantities.

Inside the context, every backward pass started on this thread (``loss.backward()``,
``torch.autograd.backward``, ``torch.autograd.grad``) is seen before the autograd engine runs
(a :class:`~torch.overrides.TorchFunctionMode` that intercepts exactly those three entry points
and passes every other operation through). For each one the context

1. reads the graph the pass will run through (:func:`backprism.engine.graph.analyse`): the
   calls, losses and roots captured by *this* graph's forwards, whatever thread or model they
   came from, and nothing else;
2. checks it (:meth:`BackwardPass.check`) and refuses what cannot be computed correctly,
   before any result or ``.grad`` is written;
3. runs the backward pass with the extensions attached (:class:`BackwardPass`), then finishes.

Results are stored as parameter attributes (``param.grad_batch``, ``param.diag_ggn_exact``, …);
``.grad`` is never touched. The active context is per thread and per ``contextvars`` context,
so threads never see each other's contexts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from backprism.engine.backward import BackwardPass
from backprism.engine.distributed import announce_refusal, check_process_group
from backprism.engine.extension import Extension, FirstOrderExtension, SecondOrderExtension
from backprism.engine.graph import analyse
from backprism.engine.state import active, reset_active, set_active

__all__ = ["collect"]

_BACKWARD_NAMES = frozenset({"backward", "grad"})
#: the backward entry points' leading parameters in order (``Tensor.backward`` counts ``self``)
_PARAMETERS: dict[Any, tuple[str, ...]] = {
    Tensor.backward: ("self", "gradient", "retain_graph", "create_graph"),
    torch.autograd.backward: ("tensors", "grad_tensors", "retain_graph", "create_graph"),
    torch.autograd.grad: ("outputs", "inputs", "grad_outputs", "retain_graph", "create_graph"),
}
#: the parameter holding the initial gradient ("seed"), one name per entry point
_SEEDS = frozenset({"gradient", "grad_tensors", "grad_outputs"})


def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The argument of the backward entry point ``func`` for its parameter ``name``
    (``None`` when not given)."""
    i = _PARAMETERS[func].index(name)
    return args[i] if len(args) > i else kwargs.get(name)


def _roots(func: Any, args: tuple, kwargs: dict) -> list[Tensor] | None:
    """The tensors a backward entry point starts from, or ``None`` for any other function."""
    if getattr(func, "__name__", None) not in _BACKWARD_NAMES or func not in _PARAMETERS:
        return None
    tensors = _argument(func, args, kwargs, _PARAMETERS[func][0])
    if isinstance(tensors, Tensor):
        return [tensors]
    return [t for t in tensors if isinstance(t, Tensor)]


def _implicit_seed(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the backward entry point starts from the implicit gradient (``1`` for a scalar
    root): no ``gradient``/``grad_tensors``/``grad_outputs`` given."""
    name = next(n for n in _PARAMETERS[func] if n in _SEEDS)
    seed = _argument(func, args, kwargs, name)
    if isinstance(seed, (tuple, list)):
        return all(g is None for g in seed)
    return seed is None


def _creates_graph(func: Any, args: tuple, kwargs: dict) -> bool:
    """The ``create_graph`` argument of a backward entry point."""
    return bool(_argument(func, args, kwargs, "create_graph"))


class _BackwardMode(TorchFunctionMode):
    """Sees the backward entry points called inside a :class:`collect` (module docstring)."""

    def __init__(self, ctx: collect) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        roots = _roots(func, args, kwargs)
        if roots is None:
            return func(*args, **kwargs)
        return self.ctx._run_backward(roots, func, args, kwargs)


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
        process_group: distributed data parallelism (:mod:`backprism.engine.distributed`).
            ``"auto"`` (default): when ``torch.distributed`` is initialised and the pass runs
            through a model wrapped by ``DistributedDataParallel`` that synchronises gradients
            in this pass, results are those of one process on the global batch (per-sample
            tensors: this rank's rows of it); inside ``ddp.no_sync()`` they stay local. A
            process group: reduce over it in every pass. ``None``: local values. In a
            distributed pass ``extension_hook`` runs at the end of the pass, after the
            reduction.
        differentiable: under ``backward(create_graph=True)`` (or ``autograd.grad(...,
            create_graph=True)``), first-order results (``grad_batch``, ``batch_l2``,
            ``sum_grad_squared``, ``variance``, …) are part of the graph, so a function of them
            can be differentiated w.r.t. the parameters (default ``True``). Rules that cannot
            compute differentiably (the generic ``torch.func`` rule, attention, RNNs) are then
            refused before anything is written. ``False``: results are always detached (e.g.
            when the graph is created only for Hessian-vector products). Second-order results
            are never part of the graph.

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
        process_group: Any = "auto",
        differentiable: bool = True,
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
            key=lambda e: not e.provides,
        )
        self.second = [e for e in extensions if isinstance(e, SecondOrderExtension)]
        self.extension_hook = extension_hook
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget
        # -- distributed (engine.distributed) --
        self.process_group = check_process_group(process_group, "collect")
        self.differentiable = differentiable
        #: what the last distributed backward pass communicated (a
        #: :class:`~backprism.engine.distributed.Communication`), ``None`` before one ran
        self.communication: Any = None
        self._mode: _BackwardMode | None = None
        self._token: Any = None
        self._saw_calls = False
        self._running: BackwardPass | None = None

    # -- context protocol -------------------------------------------------------------------
    def __enter__(self) -> collect:
        if active() is not None:
            raise RuntimeError("backprism.collect contexts cannot be nested")
        self._token = set_active(self)
        self._saw_calls = False
        self._mode = _BackwardMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(exc_type, exc, tb)
        finally:
            self._mode = None
            reset_active(self._token)
        if exc_type is None and self.extensions and not self._saw_calls:
            raise RuntimeError(
                "backprism.collect saw no extended module during the backward pass: call "
                "backprism.extend(model) (and extend(lossfunc)) before the forward pass, and "
                "call loss.backward() (or torch.autograd.grad) inside the context"
            )

    # -- a backward pass ---------------------------------------------------------------------
    def _run_backward(self, roots: list[Tensor], func: Any, args: tuple, kwargs: dict) -> Any:
        if self._running is not None:  # a backward started by our own code: plain
            return func(*args, **kwargs)
        bp = BackwardPass(self, analyse(roots))
        if len(roots) == 1 and roots[0].dim() == 0 and _implicit_seed(func, args, kwargs):
            bp.unit_root = roots[0]
        bp.create_graph = self.differentiable and _creates_graph(func, args, kwargs)
        if bp.calls:
            self._saw_calls = True
        try:
            bp.check()
        except BaseException:
            if announce_refusal(bp):
                # the other ranks run their backward: DDP's gradient all-reduce needs ours
                func(*args, **kwargs)
            raise
        bp.start()
        self._running = bp
        ok = False
        # (a failure inside the pass — no refusal, which comes before: an error in a rule —
        # must not leave gradients autograd had written by then: parameters without .grad
        # before get none back)
        fresh = [p for p, _ in bp.view.params.values() if p.grad is None]
        try:
            out = func(*args, **kwargs)
            ok = True
        except BaseException:
            for p in fresh:
                p.grad = None
            raise
        finally:
            self._running = None
            bp.end(ok)
        return out

    @property
    def current(self) -> BackwardPass | None:
        """The backward pass running inside this context, if any."""
        return self._running
