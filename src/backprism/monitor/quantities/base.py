"""Quantity base classes and the per-step data handed to quantities.

A quantity declares, per step, what it needs from the backward pass and then computes its value
after it. The life cycle of one step under ``with monitor(step, info=...)``:

1. ``should_compute(step)``/``is_start``/``is_end`` decide whether the quantity is active;
2. ``info_keys(step)`` names the ``info`` entries it needs (missing → ``KeyError``);
3. ``extensions(step)`` lists engine extension *instances* (merged across quantities, see
   :class:`~backprism.monitor.Monitor`), ``transforms(step, data)`` functions
   ``fn(param, grad_batch)`` applied to each parameter's per-sample gradients as soon as its
   module is done in the backward pass (so ``grad_batch`` can be freed module by module);
4. after the backward pass ``track(step, data)`` computes and stores the value.

Values are computed on the parameters' device: ``_compute`` may return a
:class:`~backprism.monitor.deferred.Pending` (device tensors and a host-side ``build``), which
the monitor moves to the host together with every other value of the step, in one transfer,
when it writes the log line (:mod:`backprism.monitor.deferred`). Reading :attr:`Quantity.output`
builds what is still pending. A step whose loss or gradients are not finite is detected on the
device too: the value of a quantity with ``needs_finite`` is replaced by :meth:`nan_value`
when it reaches the host.

Single-step quantities store their value under the step at which it was computed; two-step
quantities (:class:`TwoStepQuantity`) cache information at a *start* step and finish at an *end*
step, storing under ``end − SAVE_SHIFT`` — Cockpit's semantics.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from backprism.extensions.base import Extension
from backprism.monitor.deferred import Pending, to_host

__all__ = [
    "ByproductQuantity",
    "Pending",
    "Quantity",
    "SingleStepQuantity",
    "StepData",
    "TwoStepQuantity",
    "extension_key",
]

Schedule = Callable[[int], bool]
Transform = Callable[[Tensor, Tensor], Any]


def extension_key(ext: Extension) -> Hashable:
    """Identity of an extension request: its type and hyperparameters (``vars``)."""
    items = []
    for k, v in sorted(vars(ext).items()):
        if k.startswith("_") or k == "savefield":
            continue
        items.append((k, tuple(v) if isinstance(v, list) else v))
    return (type(ext), tuple(items))


class StepData:
    """What a quantity can read during one step.

    Attributes:
        step: the global step.
        params: the monitored parameters (list, in the order given to the monitor).
        info: the ``info`` dict of the step.
        fields: ``extension_key(ext) -> attribute name`` the engine stores the result under
            (duplicates of one extension type with different hyperparameters get distinct
            names, see :class:`~backprism.monitor.Monitor`).
        transformed: ``quantity key -> transform name -> id(param) -> value``.
        cache: values several quantities derive alike in one step (e.g. ``‖g‖²``).
        finite_t: 0-dim boolean device tensor, whether the loss and all gradients of the step
            are finite (set by the monitor after the backward pass; never read on the host
            during the step).
        dist: the :class:`~backprism.monitor.distributed.GlobalStep` of a global step (the
            backward pass was distributed, :mod:`backprism.monitor.distributed`), else
            ``None``. Quantities read the global batch's values through :attr:`grads`,
            :meth:`rows`, :meth:`loss_of`, :meth:`individual_losses_of` and
            :meth:`batch_size_of`, which give this process's values in a local step.
    """

    def __init__(self, step: int, params: list[Tensor], info: dict[str, Any]) -> None:
        self.step = step
        self.params = params
        self.info = info
        self.fields: dict[Hashable, str] = {}
        self.transformed: dict[str, dict[str, dict[int, Any]]] = {}
        self.cache: dict[str, Any] = {}
        self.finite_t: Tensor | None = None
        self.dist: Any = None
        #: global step: the global batch's gradient per parameter (``None``: use ``.grad``)
        self.pass_grads: list[Tensor | None] | None = None
        #: global step: ``L = Σ_r ρ_r L_r`` (float64, 0-dim) if ``info`` has a loss
        self.global_loss: Tensor | None = None
        #: global step: ``info['individual_losses']`` of all ranks, ``[N, …]`` float64
        self.global_losses: Tensor | None = None
        #: global step: savefield -> per-parameter ``[N]`` rows of all ranks (float64)
        self.global_rows: dict[str, list[Tensor]] = {}
        #: under torch.distributed: the gradient of this rank's loss with its graph, taken
        #: before the backward pass (DDP refuses ``create_graph=True``), for HessMaxEV
        self.graph_grads: list[Tensor | None] | None = None

    @property
    def finite(self) -> bool:
        """Host copy of :attr:`finite_t` (a host read: not for use inside a step)."""
        return True if self.finite_t is None else bool(self.finite_t)

    @property
    def device(self) -> torch.device:
        """The device of the first monitored parameter (where step values are computed)."""
        return self.params[0].device

    def get(self, key: str, quantity: Quantity) -> Any:
        """``info[key]``, or a ``KeyError`` naming the key and the quantity."""
        try:
            return self.info[key]
        except KeyError:
            raise KeyError(missing_info_message(key, quantity, self.step)) from None

    @property
    def loss(self) -> Tensor:
        return self.info["loss"]

    # -- values of the global batch in a global step, this process's otherwise --------------
    @property
    def grads(self) -> list[Tensor | None]:
        """The gradient per monitored parameter (``None`` without one): ``p.grad``, or in a
        global step the global batch's gradient of the pass."""
        out: list[Tensor | None] = []
        for i, p in enumerate(self.params):
            g = None if self.pass_grads is None else self.pass_grads[i]
            if g is None and p.grad is not None:
                g = p.grad.detach()
            out.append(g)
        return out

    def rows(self, ext: Extension) -> list[Tensor]:
        """Per-sample rows ``[N]`` per parameter of a row extension (``BatchL2Grad``,
        ``BatchProjGrad``, ``BatchDotWith``) in float64 on :attr:`device`: this process's, or
        in a global step the global batch's (all ranks' rows, in rank order)."""
        field = self.fields[extension_key(ext)]
        got = self.global_rows.get(field)
        if got is not None:
            return got
        return [t.to(self.device, torch.float64) for t in self.fetch(ext)]

    def loss_of(self, quantity: Quantity) -> Any:
        """``info['loss']`` (``KeyError`` naming ``quantity`` if missing), or in a global step
        the global batch's loss ``Σ_r ρ_r L_r`` (a float64 0-dim tensor)."""
        loss = self.get("loss", quantity)
        return loss if self.global_loss is None else self.global_loss

    def individual_losses_of(self, quantity: Quantity) -> Any:
        """``info['individual_losses']``, or in a global step all ranks' (``[N, …]``)."""
        losses = self.get("individual_losses", quantity)
        return losses if self.global_losses is None else self.global_losses

    def batch_size_of(self, quantity: Quantity) -> int:
        """``int(info['batch_size'])``, or in a global step the global batch size
        ``N = Σ_r N_r`` (each rank passes its own ``N_r``)."""
        n = int(self.get("batch_size", quantity))
        return n if self.dist is None else int(self.dist.n)

    def fetch(self, ext: Extension, params: list[Tensor] | None = None) -> list[Tensor]:
        """The engine results of ``ext`` for ``params`` (default: all monitored parameters)."""
        field = self.fields[extension_key(ext)]
        out = []
        for p in self.params if params is None else params:
            try:
                out.append(getattr(p, field))
            except AttributeError:
                raise RuntimeError(
                    f"backprism.monitor: a parameter of shape {tuple(p.shape)} received no "
                    f"'{field}' ({type(ext).__name__}) in the backward pass. Monitored "
                    "parameters must belong to a model passed to backprism.extend(), be used "
                    "in the forward pass, and the loss module must be extended too"
                ) from None
        return out

    def transform_results(self, quantity: Quantity, name: str) -> list[Any]:
        """Per-parameter results of ``quantity``'s transform ``name``, in parameter order."""
        got = self.transformed.get(quantity.key, {}).get(name, {})
        missing = [p for p in self.params if id(p) not in got]
        if missing:
            raise RuntimeError(
                f"backprism.monitor: {quantity.key} got no per-sample gradients for "
                f"{len(missing)} parameter(s) (first of shape {tuple(missing[0].shape)}); are "
                "all monitored parameters in the extended model and used in the forward pass?"
            )
        return [got[id(p)] for p in self.params]


def missing_info_message(key: str, quantity: Quantity | str, step: int) -> str:
    name = quantity if isinstance(quantity, str) else quantity.key
    return (
        f"{name} needs info['{key}'] at step {step}: pass it as "
        f"monitor({step}, info={{'{key}': ...}})"
    )


class Quantity:
    """Base class of a tracked quantity.

    Args:
        track_schedule: ``step -> bool``, the steps at which the quantity is computed.
        verbose: print what is computed.
    """

    #: needs per-sample information (refused with BatchNorm in train mode)
    per_sample: bool = False
    #: computed after the engine's buffers were freed (HessMaxEV: Hessian-vector products)
    after_cleanup: bool = False
    #: a step with NaN/inf loss or gradients records NaN (``nan_value``) instead of its value
    needs_finite: bool = True
    #: per-step values are large (histograms, parameters): when the monitor streams the log,
    #: only the first and the latest stay in :attr:`output` (what the dashboard draws)
    large_values: bool = False

    def __init__(self, track_schedule: Schedule, verbose: bool = False) -> None:
        if not callable(track_schedule):
            raise TypeError(
                f"{type(self).__name__}: track_schedule must be a callable step -> bool, got "
                f"{track_schedule!r} (use backprism.monitor.schedules.linear(1))"
            )
        self._track_schedule = track_schedule
        self._verbose = verbose
        self._output: dict[int, Any] = {}
        self._pending: list[PendingEntry] = []
        self._fresh: list[int] = []
        #: set by the monitor before ``track``: the monitor step and its finiteness flags
        self._at: int | None = None
        self._flags: list[Tensor] = []
        self.key: str = type(self).__name__

    @property
    def schedule(self) -> Schedule:
        """The tracking schedule ``step -> bool``."""
        return self._track_schedule

    # -- stored values -----------------------------------------------------------------------
    @property
    def output(self) -> dict[int, Any]:
        """``{step: value}`` of the values stored so far (pending ones are built first)."""
        if self._pending:
            finish_entries(list(self._pending))
        return self._output

    @output.setter
    def output(self, value: dict[int, Any]) -> None:
        self._output = value

    # -- hyperparameters (for the output key of duplicates) ----------------------------------
    def hyperparameters(self) -> dict[str, Any]:
        """Constructor arguments other than the schedule (used to name duplicates)."""
        return {}

    # -- what the step needs -----------------------------------------------------------------
    def begin_step(self, global_step: int, data: StepData) -> None:
        """Called first on every step the monitor sees (before ``extensions``)."""

    def should_compute(self, global_step: int) -> bool:
        raise NotImplementedError

    @property
    def needs_residual(self) -> bool:
        """Whether some step needs a DiagHessian-family extension (exact Hessian terms): the
        monitor then has the models of its parameters record their forwards' nonlinearities
        (:func:`backprism.engine.residual.want_residuals`)."""
        return False

    def create_graph(self, global_step: int) -> bool:
        """Whether the backward pass must keep its graph (``create_graph=True``)."""
        return False

    def extensions(self, global_step: int) -> list[Extension]:
        """Engine extensions needed at ``global_step``."""
        return []

    def transforms(self, global_step: int, data: StepData) -> dict[str, Transform]:
        """Functions ``fn(param, grad_batch)`` to apply per parameter during the backward."""
        return {}

    def extension_hooks(self, global_step: int) -> list[Callable[[torch.nn.Module], None]]:
        """Functions ``hook(module)`` run once per module during the backward at
        ``global_step``, right after the module's extensions (``collect``'s
        ``extension_hook``), while their results — per-sample gradients included — are on the
        module's parameters; they run before the monitor frees per-sample buffers it owns. In a
        distributed step they run at the end of the pass, on the global batch's results."""
        return []

    def info_keys(self, global_step: int) -> set[str]:
        """Names of ``info`` entries needed at ``global_step``."""
        return set()

    # -- computing ---------------------------------------------------------------------------
    def track(self, global_step: int, data: StepData) -> None:
        """Compute (if scheduled) and store the result."""
        if not self.should_compute(global_step):
            return
        step, value = self.compute(global_step, data)
        if value is not None:
            self._save(step, value)

    def compute(self, global_step: int, data: StepData) -> tuple[int, Any]:
        raise NotImplementedError

    def nan_value(self) -> Any:
        """What is recorded when the step's loss or gradients are not finite."""
        return math.nan

    def track_nonfinite(self, global_step: int, data: StepData) -> None:
        """Record NaN for a step whose loss/gradients are NaN/inf (the caller warns)."""
        if self.should_compute(global_step):
            self._save(global_step, self.nan_value())

    def _save(self, step: int, value: Any, flags: list[Tensor] | None = None) -> None:
        """Store ``value`` (a :class:`Pending` is built when the monitor writes the step).
        ``flags``: finiteness flags of the steps the value depends on (default: the current
        step's); any of them false makes a ``needs_finite`` quantity record ``nan_value()``."""
        if not isinstance(value, Pending):
            value = Pending.ready(value)
        if flags is None:
            flags = self._flags
        entry = PendingEntry(self, step, value, self._at, list(flags) if self.needs_finite else [])
        self._pending.append(entry)
        if self._verbose:
            finish_entries([entry])
            print(f"[Step {step} | {self.key}] Store value {self._output.get(step)}")

    def _store(self, step: int, value: Any) -> None:
        """Put a built value into :attr:`output` (``None``: nothing is stored)."""
        if value is None:
            return
        self._output[step] = value
        self._fresh.append(step)

    def take_fresh(self) -> list[tuple[str, int, Any]]:
        """``(key suffix, step, value)`` of values stored since the last call (for the log)."""
        out = []
        for step in dict.fromkeys(self._fresh):
            if step in self._output:
                out.append(("", step, self._output[step]))
        self._fresh.clear()
        return out

    def trim_history(self) -> None:
        """Drop streamed values the dashboard does not draw (``large_values``: all but the
        first and the latest)."""
        if not self.large_values or len(self._output) <= 2:
            return
        steps = list(self._output)
        for step in steps[1:-1]:
            del self._output[step]

    def get_output(self) -> dict[int, Any]:
        """``{step: value}``."""
        return self.output

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({hp})"


class SingleStepQuantity(Quantity):
    """A quantity computed from the information of one step (Cockpit's ``SingleStepQuantity``)."""

    def should_compute(self, global_step: int) -> bool:
        return bool(self._track_schedule(global_step))

    def compute(self, global_step: int, data: StepData) -> tuple[int, Any]:
        return global_step, self._compute(global_step, data)

    def _compute(self, global_step: int, data: StepData) -> Any:
        raise NotImplementedError


class ByproductQuantity(SingleStepQuantity):
    """A single-step quantity that needs no extension (loss, time, ...)."""


class TwoStepQuantity(Quantity):
    """A quantity combining a *start* and an *end* step (Cockpit's ``TwoStepQuantity``).

    The value computed at the end step ``e`` is stored under ``e − SAVE_SHIFT``. Cached entries
    carry a ``block_fn(step) -> bool`` and are freed once no longer blocked.
    """

    SAVE_SHIFT = 0

    def __init__(self, track_schedule: Schedule, verbose: bool = False) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._cache: dict[int, dict[str, tuple[Any, Callable[[int], bool]]]] = {}

    def is_start(self, global_step: int) -> bool:
        raise NotImplementedError

    def is_end(self, global_step: int) -> bool:
        raise NotImplementedError

    def should_compute(self, global_step: int) -> bool:
        return self.is_start(global_step) or self.is_end(global_step)

    def compute(self, global_step: int, data: StepData) -> tuple[int, Any]:
        result = None
        if self.is_start(global_step):
            self._compute_start(global_step, data)
        if self.is_end(global_step):
            result = self._compute_end(global_step, data)
        self.free_cache(global_step + 1)
        return global_step - self.SAVE_SHIFT, result

    def track_nonfinite(self, global_step: int, data: StepData) -> None:
        # no start information from a broken step; an end step records NaN
        if self.is_end(global_step):
            self._save(global_step - self.SAVE_SHIFT, self.nan_value())
        self.free_cache(global_step + 1)
        self._cache.pop(global_step, None)

    def _compute_start(self, global_step: int, data: StepData) -> None:
        raise NotImplementedError

    def _compute_end(self, global_step: int, data: StepData) -> Any:
        raise NotImplementedError

    # -- cache -------------------------------------------------------------------------------
    def save_to_cache(
        self, global_step: int, key: str, value: Any, block_fn: Callable[[int], bool]
    ) -> None:
        self._cache.setdefault(global_step, {})[key] = (value, block_fn)

    def load_from_cache(self, global_step: int, key: str) -> Any:
        return self._cache[global_step][key][0]

    def in_cache(self, global_step: int, key: str) -> bool:
        return key in self._cache.get(global_step, {})

    def free_cache(self, virtual_step: int) -> None:
        """Drop entries not blocked at ``virtual_step`` and empty steps."""
        for step in list(self._cache):
            entries = self._cache[step]
            for key in [k for k, (_, block) in entries.items() if not block(virtual_step)]:
                del entries[key]
            if not entries:
                del self._cache[step]


def grad_norms(data: StepData) -> list[Tensor | None]:
    """``‖∇_{θ_p} L‖₂`` per monitored parameter (``None`` without gradient; the global batch's
    gradient in a global step, :attr:`StepData.grads`), one fused reduction per step shared by
    the finiteness flag, GradNorm and the gradient tests."""
    if "grad_norms" not in data.cache:
        grads = data.grads
        present = [g for g in grads if g is not None]
        it = iter(torch._foreach_norm(present, 2) if present else [])
        data.cache["grad_norms"] = [None if g is None else next(it) for g in grads]
    return data.cache["grad_norms"]


class PendingEntry:
    """A value of ``quantity`` for ``step`` computed at monitor step ``at``, not yet built."""

    __slots__ = ("at", "done", "flags", "pending", "quantity", "step")

    def __init__(
        self, quantity: Quantity, step: int, pending: Pending, at: int | None, flags: list[Tensor]
    ) -> None:
        self.quantity = quantity
        self.step = step
        self.pending = pending
        self.at = at
        self.flags = flags
        self.done = False

    def tensors(self) -> list[Tensor]:
        return [*self.flags, *self.pending.tensors]

    def finish(self, arrays: list[Any]) -> str | None:
        """Build and store the value from the host copies of :meth:`tensors`; returns why NaN
        was recorded instead (``None`` if the value was built)."""
        if self.done:
            return None
        self.done = True
        q = self.quantity
        if self in q._pending:
            q._pending.remove(self)
        nf = len(self.flags)
        if not all(bool(a) for a in arrays[:nf]):
            q._store(self.step, q.nan_value())
            return "the loss or gradients are NaN/inf"
        try:
            value = self.pending.build(list(arrays[nf:]))
        except NUMERICAL_ERRORS as err:
            q._store(self.step, q.nan_value())
            return f"a numerical error ({type(err).__name__}: {err})"
        q._store(self.step, value)
        return None


def finish_entries(entries: list[PendingEntry], arrays: list[Any] | None = None) -> None:
    """Build ``entries`` (their tensors moved to the host in one transfer unless ``arrays``,
    the host copies of all their :meth:`PendingEntry.tensors` in order, are given); warns once
    per step for values recorded as NaN."""
    if arrays is None:
        entries = [e for e in entries if not e.done]
        if not entries:
            return
        arrays = to_host([t for e in entries for t in e.tensors()])
    pos = 0
    broken: dict[tuple[int | None, str], list[str]] = {}
    for e in entries:
        k = len(e.flags) + len(e.pending.tensors)
        why = e.finish(arrays[pos : pos + k])  # nothing for an entry already built
        pos += k
        if why is not None:
            kind = "the loss or gradients are NaN/inf" if why.startswith("the loss") else (
                "a numerical error"
            )
            name = e.quantity.key if why.startswith("the loss") else f"{e.quantity.key} ({why})"
            broken.setdefault((e.at, kind), []).append(name)
    for (at, kind), names in broken.items():
        warnings.warn(
            f"backprism.monitor step {at}: {kind}; recorded NaN for {', '.join(names)}",
            RuntimeWarning,
            stacklevel=3,
        )


NUMERICAL_ERRORS: tuple[type[BaseException], ...] = (
    FloatingPointError,
    np.linalg.LinAlgError,
    torch.linalg.LinAlgError,
    ZeroDivisionError,
)


def flat_cat(tensors: list[Tensor]) -> Tensor:
    """Concatenate flattened tensors."""
    return torch.cat([t.reshape(-1) for t in tensors])
