"""Cockpit-compatible names and module paths on top of :mod:`backprism.monitor`.

A Cockpit 1.0 script runs after changing only its imports::

    from backprism.compat.cockpit import Cockpit, CockpitPlotter, quantities
    from backprism.compat.cockpit.utils import schedules
    from backprism.compat.cockpit.utils.configuration import configuration

(``cockpit.quantities`` with its per-quantity modules, ``cockpit.quantities.quantity``,
``cockpit.quantities.bin_adaptation``, ``cockpit.utils.schedules``,
``cockpit.utils.configuration`` and ``cockpit.instruments`` all resolve). As with Cockpit +
BackPACK, the model and loss function must be extended (``backprism.extend`` or
``backprism.compat.backpack.extend``); extra extensions passed to ``cockpit(step, *exts)`` may
be BackPACK-compat or backprism extensions.

What differs from :class:`~backprism.monitor.Monitor` to keep Cockpit's behaviour:

* :meth:`Cockpit.get_output` is ``{step: {quantity_name: value}}`` (Cockpit's layout; the
  Monitor's is ``{quantity_name: {step: value}}``) with Cockpit's value types: ``CABS`` is a
  float (the Monitor keeps ``{"cabs": value}``), the histograms' ``"hist"``/``"edges"`` are
  tensors;
* :meth:`Cockpit.log` takes Cockpit's positional arguments and :meth:`Cockpit.write` appends
  ``".json"`` to the path;
* ``quantities.HessMaxEV`` takes Cockpit's ``use_power`` (both choices compute the largest
  Hessian eigenvalue; backprism uses Lanczos iterations to a relative accuracy of 1e-3);
* custom quantities may implement Cockpit's ``_compute(global_step, params, batch_loss)``;
* as in Cockpit, during a step's backward pass every parameter gets the dict
  ``param.grad_batch_transforms`` with the statistics of the per-sample gradients
  ``grad_batch[n] = ∇ℓₙ/N`` that Cockpit's built-in quantities keep there, deleted after the
  step (:class:`_CockpitPass`).

``cockpit.instruments.*_gauge`` raise an error pointing to :class:`CockpitPlotter` /
:class:`backprism.plot.Dashboard`, which draw all instruments at once.
"""

from __future__ import annotations

import glob
import inspect
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from backprism.compat import _cockpit_quantities as _cq
from backprism.compat._modules import alias_module
from backprism.extensions import BatchDotGrad, BatchL2Grad, SumGradSquared
from backprism.extensions.base import Extension
from backprism.monitor import quantities as _q
from backprism.monitor import schedules
from backprism.monitor.configuration import (
    quantities_cls_for_configuration as _monitor_classes,
)
from backprism.monitor.histograms import device_edges
from backprism.monitor.monitor import Monitor, _StepContext
from backprism.monitor.quantities import base as _base
from backprism.monitor.quantities.base import Quantity, Schedule, StepData, extension_key
from backprism.monitor.quantities.optim import is_sgd_default_kwargs as _is_sgd_default
from backprism.monitor.quantities.optim import single_lr as _single_lr

__all__ = ["Cockpit", "CockpitPlotter", "quantities", "utils"]

__path__: list[str] = []  # lets ``import backprism.compat.cockpit.utils.schedules`` resolve


# -- quantities with Cockpit's signatures and output types -------------------------------------
class CABS(_q.CABS):
    """CABS batch-size suggestion for zero-momentum SGD, a float (Cockpit's output):
    ``lr · Σ_i (N²·sum_grad_squared_i − N g_i²) / (N · L)``."""

    def _compute(self, global_step: int, data: StepData) -> Any:  # type: ignore[override]
        return _map_value(super()._compute(global_step, data), _cabs_float)

    def nan_value(self) -> Any:
        return math.nan

    @staticmethod
    def get_lr(optimizer: Any) -> float:
        """The learning rate shared by all parameter groups (``ValueError`` if they differ)."""
        return _single_lr(optimizer)


def _cabs_float(value: Any) -> Any:
    return float(value["cabs"]) if isinstance(value, dict) else value


def _map_value(value: Any, fn: Any) -> Any:
    """``fn(value)``, also for a value the monitor builds later on the host (a ``Pending``:
    device tensors plus a ``build`` function)."""
    build, tensors = getattr(value, "build", None), getattr(value, "tensors", None)
    if callable(build) and isinstance(tensors, list):
        return type(value)(tensors, lambda arrays: fn(build(arrays)))
    return fn(value)


class HessMaxEV(_q.HessMaxEV):
    """Largest Hessian eigenvalue (float). ``use_power`` (Cockpit: power iteration or
    ``scipy.sparse.linalg.eigsh``) is accepted; both give the largest eigenvalue, computed here
    by Lanczos iterations to a relative accuracy of 1e-3."""

    def __init__(
        self, track_schedule: Schedule, verbose: bool = False, use_power: bool = True
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._use_power = use_power


_COCKPIT_ARGS = ["global_step", "params", "batch_loss"]


def _cockpit_signature(cls: type, name: str) -> bool:
    """Whether ``cls.<name>`` has Cockpit's signature ``(global_step, params, batch_loss)``."""
    fn = getattr(cls, name, None)
    if fn is None:
        return False
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names[1:] == _COCKPIT_ARGS


def _overrides(cls: type) -> set[str]:
    """Names a user's class (and its non-backprism bases) defines."""
    names: set[str] = set()
    for c in cls.__mro__:
        if c is not object and not c.__module__.startswith("backprism."):
            names.update(vars(c))
    return names


def _save_format(value: Any) -> Any:
    """Cockpit's storage format: tensors become (detached, CPU) numpy arrays, recursively in
    dicts, lists and tuples."""
    if isinstance(value, Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _save_format(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_save_format(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_save_format(v) for v in value)
    return value


def _adapt_cockpit_methods(q: Quantity) -> None:
    """Let ``q`` (a Cockpit-style quantity) run under the monitor: methods written with
    Cockpit's signatures are called with ``(global_step, params, batch_loss)`` where the monitor
    passes ``(global_step, data)``; a quantity overriding ``extension_hooks(step)`` does its
    per-sample work there (the monitor runs the hooks per module during the backward, as
    Cockpit does), so backprism's per-sample transforms are off for it; a ``Quantity``
    subclass that overrides ``track`` and no ``should_compute`` counts as active every step."""
    cls = type(q)

    def loss_of(data: StepData) -> Any:
        return data.info.get("loss")

    for name in ("_compute", "_compute_start", "_compute_end"):
        if _cockpit_signature(cls, name):
            method = getattr(q, name)

            def adapted(global_step: int, data: StepData, _m: Any = method) -> Any:
                return _save_format(_m(global_step, data.params, loss_of(data)))

            setattr(q, name, adapted)
    if _cockpit_signature(cls, "track"):
        track = q.track
        if cls.should_compute is _base.Quantity.should_compute:
            q.should_compute = lambda global_step: True  # type: ignore[method-assign]

        def adapted_track(global_step: int, data: StepData, _t: Any = track) -> None:
            _t(global_step, data.params, loss_of(data))

        q.track = adapted_track  # type: ignore[method-assign]
    if "extension_hooks" in _overrides(cls):
        # Cockpit's quantities do their per-sample work in their extension hooks (which the
        # monitor runs per module, Quantity.extension_hooks), not in backprism's transforms
        q.transforms = lambda global_step, data: {}  # type: ignore[method-assign]


#: Cockpit's base classes are backprism's (``isinstance`` checks against them hold for every
#: built-in quantity); a subclass may implement Cockpit's ``_compute(global_step, params,
#: batch_loss)`` (adapted by :class:`Cockpit`) or backprism's ``_compute(global_step, data)``.
SingleStepQuantity = _base.SingleStepQuantity
ByproductQuantity = _base.ByproductQuantity
TwoStepQuantity = _base.TwoStepQuantity

_REPLACED: dict[type, type] = {_q.CABS: CABS, _q.HessMaxEV: HessMaxEV}


def quantities_cls_for_configuration(label: str) -> list[type[Quantity]]:
    """Quantity classes of Cockpit's configuration ``label`` (``"economy"``, ``"business"``,
    ``"full"``)."""
    return [_REPLACED.get(c, c) for c in _monitor_classes(label)]


def configuration(
    label: str, track_schedule: Schedule | None = None, verbose: bool = False
) -> list[Quantity]:
    """Cockpit's ``configuration``: the quantities of ``label`` on ``track_schedule`` (default
    every step)."""
    if track_schedule is None:
        track_schedule = schedules.linear(interval=1, offset=0)
    return [
        cls(track_schedule=track_schedule, verbose=verbose)
        for cls in quantities_cls_for_configuration(label)
    ]


_QUANTITY_NAMES = [n for n in _q.__all__ if n[0].isupper()]
_quantities_attrs: dict[str, Any] = {n: getattr(_q, n) for n in _QUANTITY_NAMES}
_quantities_attrs.update(
    CABS=CABS,
    HessMaxEV=HessMaxEV,
    SingleStepQuantity=SingleStepQuantity,
    ByproductQuantity=ByproductQuantity,
)
quantities = alias_module(
    f"{__name__}.quantities", "Cockpit's ``cockpit.quantities``.", **_quantities_attrs
)
#: the quantity classes as shipped (their instances never read ``grad_batch_transforms``)
_BUILT_IN = frozenset(v for v in _quantities_attrs.values() if isinstance(v, type))


# -- the Cockpit ----------------------------------------------------------------------------------
def _cockpit_value(q: Quantity, value: Any) -> Any:
    """A quantity's value in Cockpit's types (histogram arrays become tensors)."""
    if isinstance(q, (_q.GradHist1d, _q.GradHist2d)) and isinstance(value, dict):
        return {k: _to_tensor(v) for k, v in value.items()}
    if isinstance(q, _q.CABS) and isinstance(value, dict) and set(value) == {"cabs"}:
        return value["cabs"]
    return value


def _to_tensor(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v)
    if isinstance(v, tuple):
        return tuple(_to_tensor(x) for x in v)
    if isinstance(v, dict):
        return {k: _to_tensor(x) for k, x in v.items()}
    return v


class CockpitCTX:
    """Cockpit's store of the ``info`` handed to ``cockpit(global_step, info=...)``, which
    custom quantities query through :func:`get_batch_size`, :func:`get_individual_losses`,
    :func:`get_optimizer` and :func:`get_loss` while the step is tracked."""

    INFO: ClassVar[dict[int, dict[str, Any]]] = {}

    @staticmethod
    def set(info: dict[str, Any], global_step: int) -> None:
        """Store ``info`` for ``global_step``."""
        CockpitCTX.INFO[global_step] = info

    @staticmethod
    def get(name: str, global_step: int) -> Any:
        """``info[name]`` of ``global_step`` (``KeyError`` saying how to pass it)."""
        try:
            return CockpitCTX.INFO[global_step][name]
        except KeyError as e:
            raise KeyError(f"Please hand in '{name}' via cockpit(info=...).") from e

    @staticmethod
    def erase() -> None:
        """Forget all stored information."""
        CockpitCTX.INFO = {}


def get_individual_losses(global_step: int) -> Any:
    """``info["individual_losses"]`` of the current step."""
    return CockpitCTX.get("individual_losses", global_step)


def get_batch_size(global_step: int) -> Any:
    """``info["batch_size"]`` of the current step."""
    return CockpitCTX.get("batch_size", global_step)


def get_optimizer(global_step: int) -> Any:
    """``info["optimizer"]`` of the current step."""
    return CockpitCTX.get("optimizer", global_step)


def get_loss(global_step: int) -> Any:
    """``info["loss"]`` of the current step (a warning if it is not finite)."""
    loss = CockpitCTX.get("loss", global_step)
    if isinstance(loss, Tensor) and not bool(torch.isfinite(loss).all()):
        import warnings

        warnings.warn(f"[Step {global_step}] Encountered invalid loss: {loss}", stacklevel=2)
    return loss


#: reads one ``grad_batch_transforms`` entry from a parameter (``None``: it has none)
_Reader = Callable[[Tensor], Any]
#: makes a :data:`_Reader` once the step's extensions are placed (``None``: no entry this step)
_Resolver = Callable[[StepData], "_Reader | None"]


def _field_reader(ext: Extension) -> _Resolver:
    """The engine's result of ``ext`` on the parameter (its own tensor, not a copy)."""

    def resolve(data: StepData) -> _Reader | None:
        field = data.fields.get(extension_key(ext))
        if field is None:
            return None
        return lambda p: getattr(p, field, None)

    return resolve


def _hist_reader(ext: Extension, entry: str | None, edges: Callable[[], Any]) -> _Resolver:
    """A parameter's entry of the monitor's gradient histogram ``ext``: ``(counts, edges)``
    (``entry`` ``"hist"``/``"hist2d"``) or, for ``entry=None``, ``maxₙᵢ |∇ℓₙ|`` (0-dim)."""

    def resolve(data: StepData) -> _Reader | None:
        field = data.fields.get(extension_key(ext))
        if field is None:
            return None
        shared = edges() if entry is not None else None  # once per step, for all parameters

        def read(p: Tensor) -> Any:
            result = getattr(p, field, None)
            if not isinstance(result, dict):
                return None
            if entry is None:
                return result.get("abs_max")
            return None if entry not in result else (result[entry], shared)

        return read

    return resolve


def _linspace(static: tuple[float, float], dynamic: Any, bins: int, device: Any) -> Tensor:
    """Bin edges of a histogram range: static floats, or 0-dim device tensors moved by a bin
    adaptation (then computed on the device, not read on the host)."""
    if dynamic is not None:
        return device_edges(dynamic[0], dynamic[1], bins)
    return torch.linspace(static[0], static[1], bins + 1, device=device)


def _edges(axes: list[tuple[Any, Any, int]], device: Any) -> Callable[[], Any]:
    """The edges of a histogram with ``axes`` ``[(static range, device range, bins)]``, taken
    now (before the step's adaptation): one tensor for one axis, else a tuple."""
    axes = list(axes)

    def make() -> Any:
        edges = tuple(_linspace(r0, rt, b, device) for r0, rt, b in axes)
        return edges[0] if len(edges) == 1 else edges

    return make


def _constant(value: Callable[[], Any]) -> _Resolver:
    return lambda data: lambda p: value()


def _transforms_plan(
    quantities: list[Quantity],
    step: int,
    info: dict[str, Any],
    device: Any,
    on_top: bool | None = None,
) -> tuple[dict[str, _Resolver], list[Extension]]:
    """Cockpit 1.0's ``grad_batch_transforms`` entries of the built-in quantities active at
    ``step`` (``{name: resolver}``), and the extensions to request on top for those the
    quantities' own requests do not give: for every such quantity (``on_top=True``), none
    (``False``), or (``None``) for subclasses only — a built-in quantity never reads the dict,
    a user's subclass may. Without them such an entry is there only where the pass computes it
    anyway (e.g. for an extension passed by the user). Cockpit
    computes them from ``grad_batch``; here they are the engine's results of the same pass:

    * ``"sum_grad_squared"`` (``Σₙ grad_batch[n]²``; TICDiag, TICTrace, CABS, EarlyStopping,
      MeanGSNR): ``SumGradSquared`` (on top for TICTrace, which uses ``batch_l2``);
    * ``"batch_l2"`` (``‖grad_batch[n]‖²``, ``[N]``; NormTest): ``BatchL2Grad``;
    * ``"batch_dot"`` (``⟨grad_batch[n], grad_batch[m]⟩``, ``[N, N]``; InnerTest, OrthoTest):
      ``BatchDotGrad``, on top (the tests use its row sums, ``BatchProjGrad``);
    * ``"hist_1d"``/``"hist_2d"`` (GradHist1d/2d): the parameter's counts (int64) and the edges
      ``(edges)``/``(xedges, yedges)`` of its gradient histogram;
    * ``"grad_batch_abs_max"`` (a ``GradAbsMax`` adaptation): ``maxₙᵢ |∇ℓₙ|`` of the parameter,
      a 0-dim tensor (Cockpit: a float, read on the host);
    * ``"_first_order_projections_start"``/``"_end"`` (Alpha with zero-momentum SGD): ``{}``,
      as in Cockpit, whose hook works by side effect.
    """
    plan: dict[str, _Resolver] = {}
    extra: list[Extension] = []
    sgs = (_q.TICDiag, _q.TICTrace, _q.CABS, _q.EarlyStopping, _q.MeanGSNR)
    for q in quantities:
        top = on_top if on_top is not None else type(q) not in _BUILT_IN
        if isinstance(q, sgs) and q.should_compute(step):
            plan.setdefault("sum_grad_squared", _field_reader(SumGradSquared()))
            if top and isinstance(q, _q.TICTrace):
                extra.append(SumGradSquared())
        elif isinstance(q, _q.NormTest) and q.should_compute(step):
            plan.setdefault("batch_l2", _field_reader(BatchL2Grad()))
        elif isinstance(q, (_q.InnerTest, _q.OrthoTest)) and q.should_compute(step):
            plan.setdefault("batch_dot", _field_reader(BatchDotGrad()))
            if top:
                extra.append(BatchDotGrad())
        elif isinstance(q, _q.GradHist1d):
            ext = q._ext(step)
            if ext is None:
                continue
            if q.should_compute(step):
                edges = _edges([(q._range0, q._range_t, q._bins)], device)
                plan.setdefault("hist_1d", _hist_reader(ext, "hist", edges))
            if ext.abs_max:
                plan.setdefault("grad_batch_abs_max", _hist_reader(ext, None, lambda: None))
        elif isinstance(q, _q.GradHist2d):
            ext = q._ext(step)
            if ext is None:
                continue
            if q.should_compute(step):
                edges = _edges(list(zip(q._range0, q._range_t, q._bins)), device)
                plan.setdefault("hist_2d", _hist_reader(ext, "hist2d", edges))
            if ext.abs_max:
                plan.setdefault("grad_batch_abs_max", _hist_reader(ext, None, lambda: None))
        elif isinstance(q, _q.Alpha) and _is_sgd_default(info.get("optimizer")):
            if q.is_start(step):
                plan.setdefault("_first_order_projections_start", _constant(dict))
            if q.is_end(step):
                plan.setdefault("_first_order_projections_end", _constant(dict))
    return plan, extra


class _CockpitPass(_StepContext):
    """The monitor's step with Cockpit's ``param.grad_batch_transforms``: the quantities'
    ``BatchGradTransformsHook``s run as one (as in Cockpit), which also puts the built-in
    quantities' entries into the dict (:func:`_transforms_plan`) right after each module's
    extensions ran; the dict is deleted with the step's own buffers, before the quantities that
    run after the clean-up (HessMaxEV), as Cockpit does."""

    def __init__(
        self, monitor: Monitor, step: int, exts: list[Extension], info: dict[str, Any]
    ) -> None:
        super().__init__(monitor, step, exts, info)
        self._plan: dict[str, _Resolver] = {}

    def _merge(self, requests: list[Extension]) -> list[Extension]:
        on_top = getattr(self.monitor, "TRANSFORMS_ON_TOP", None)
        plan, extra = _transforms_plan(
            self.monitor.quantities, self.step, self.info, self.data.device, on_top
        )
        self._plan = plan
        return super()._merge([*requests, *extra])

    def __enter__(self) -> _CockpitPass:
        super().__enter__()
        readers: dict[str, _Reader] = {}
        for key, resolve in self._plan.items():
            reader = resolve(self.data)
            if reader is not None:
                readers[key] = reader
        merging = [h for h in self.hooks if isinstance(h, _cq.BatchGradTransformsHook)]
        if readers or len(merging) > 1:
            rest = [h for h in self.hooks if not isinstance(h, _cq.BatchGradTransformsHook)]
            merged = _cq.BatchGradTransformsHook.merge(merging)
            hook = _cq.EngineTransformsHook(merged._transforms, readers, self.param_ids)
            self.hooks = [hook, *rest]
        return self

    def _free(self) -> None:
        super()._free()
        for p in self.monitor.params:  # as Cockpit, also where a quantity's hook filled it
            if hasattr(p, _cq.GRAD_BATCH_TRANSFORMS):
                delattr(p, _cq.GRAD_BATCH_TRANSFORMS)


class _CockpitStep:
    """The monitor's step context (a :class:`_CockpitPass`) with the step's ``info`` in
    :class:`CockpitCTX`."""

    def __init__(self, inner: Any, global_step: int, info: dict[str, Any] | None) -> None:
        self._inner, self._step, self._info = inner, global_step, dict(info or {})

    def __enter__(self) -> Any:
        CockpitCTX.set(self._info, self._step)
        try:
            return self._inner.__enter__()
        except BaseException:
            CockpitCTX.erase()
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        try:
            return bool(self._inner.__exit__(exc_type, exc, tb))
        finally:
            CockpitCTX.erase()


class ComputeStep:
    """Cockpit's ``cockpit.utils.optim.ComputeStep``: the update step of zero-momentum SGD from
    the per-sample gradients (``param.grad_batch``, e.g. from ``extensions.BatchGrad``)."""

    @staticmethod
    def compute_update_step(optimizer: Any, parameter_ids: list[int]) -> dict[int, Tensor]:
        """``{id(param): update}`` of ``optimizer`` for the parameters ``parameter_ids``
        (``NotImplementedError`` for other optimizers than default zero-momentum SGD)."""
        if ComputeStep.is_sgd_default_kwargs(optimizer):
            return ComputeStep.update_sgd_default_kwargs(optimizer, parameter_ids)
        raise NotImplementedError

    @staticmethod
    def is_sgd_default_kwargs(optimizer: Any) -> bool:
        """Whether ``optimizer`` is ``torch.optim.SGD`` without momentum, dampening, weight
        decay and Nesterov."""
        return bool(_is_sgd_default(optimizer))

    @staticmethod
    def update_sgd_default_kwargs(optimizer: Any, parameter_ids: list[int]) -> dict[int, Tensor]:
        """``-lr · Σ_n grad_batch[n]`` per parameter id (the SGD step of a sum over the
        per-sample gradients ``param.grad_batch``)."""
        wanted = set(parameter_ids)
        updates: dict[int, Tensor] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in wanted:
                    updates[id(p)] = -group["lr"] * p.grad_batch.sum(0).detach()
        if len(updates) != len(wanted):
            raise ValueError("Could not compute step for all specified parameters")
        return updates


class Cockpit(Monitor):
    """Cockpit's class: ``Cockpit(params, quantities=None)``; use as
    ``with cockpit(global_step, *exts, info={...}): loss.backward(create_graph=...)``."""

    #: Cockpit's switch for BackPACK's memory-saving convolution Jacobians; no effect here
    #: (backprism bounds memory with ``collect(memory_budget=...)``)
    BACKPACK_CONV_SAVE_MEMORY = True

    #: compute the ``param.grad_batch_transforms`` entries of Cockpit's quantities that their
    #: own computation does not give (``"batch_dot"`` of InnerTest/OrthoTest: an extra
    #: ``BatchDotGrad``, +30–60 % on those quantities' steps; ``"sum_grad_squared"`` of
    #: TICTrace: an extra ``SumGradSquared``): ``None`` (default) for subclasses of them only
    #: (backprism's built-in quantities never read the dict; a Cockpit-style subclass may),
    #: ``True`` for every one (e.g. to read them in the training loop), ``False`` for none
    TRANSFORMS_ON_TOP: bool | None = None

    def __init__(self, params: Iterable[Tensor], quantities: Iterable[Quantity] | None = None):
        super().__init__(params, quantities)
        self.output: dict[int, dict[str, Any]] = defaultdict(dict)

    @staticmethod
    def _merge_batch_grad_transform_hooks(
        hooks: list[_cq.BatchGradTransformsHook],
    ) -> _cq.BatchGradTransformsHook:
        """Cockpit's merge of several quantities' ``BatchGradTransformsHook``s into one."""
        return _cq.BatchGradTransformsHook.merge(hooks)

    def add(self, quantity: Quantity) -> None:
        """Track one more quantity; Cockpit-style methods (``_compute(global_step, params,
        batch_loss)``, ``track(global_step, params, batch_loss)``, ``extension_hooks``) are
        adapted to the monitor."""
        if isinstance(quantity, Quantity):
            _adapt_cockpit_methods(quantity)
        super().add(quantity)

    def __call__(  # type: ignore[override]
        self, global_step: int, *exts: Any, info: dict[str, Any] | None = None, debug: bool = False
    ) -> Any:
        """Context for the backward pass of ``global_step``; while it is open (and while the
        quantities compute on leaving it) ``cockpit.context.get_batch_size(global_step)`` & co.
        return the entries of ``info``."""
        if debug:
            print(f"[DEBUG, step {global_step}] quantities: {self.quantities}")
        base = super().__call__(global_step, *exts, info=info)  # the monitor's checks
        inner = _CockpitPass(self, base.step, base.user_exts, base.info)
        return _CockpitStep(inner, global_step, info)

    def log(  # type: ignore[override]
        self,
        global_step: int,
        epoch_count: int,
        train_loss: float,
        valid_loss: float,
        test_loss: float,
        train_accuracy: float,
        valid_accuracy: float,
        test_accuracy: float,
        learning_rate: float,
    ) -> None:
        """Cockpit's epoch-level log (stored under ``output[global_step]``)."""
        metrics = {
            "train_loss": train_loss,
            "valid_loss": valid_loss,
            "test_loss": test_loss,
            "train_accuracy": train_accuracy,
            "valid_accuracy": valid_accuracy,
            "test_accuracy": test_accuracy,
            "learning_rate": learning_rate,
        }
        super().log(global_step, epoch=epoch_count, **metrics)
        entry = self.output[global_step]
        entry["epoch_count"] = epoch_count
        entry.update(metrics)

    def get_output(self) -> dict[int, dict[str, Any]]:  # type: ignore[override]
        """``{step: {quantity_name: value, ...}}`` (Cockpit's layout and value types), log
        fields included."""
        flush = getattr(self, "flush", None)
        if callable(flush):  # values still in flight (deferred host transfers)
            flush()
        for q in self.quantities:
            for step, value in q.get_output().items():
                self.output[step][q.key] = _cockpit_value(q, value)
        return self.output

    def write(self, logpath: str | os.PathLike) -> None:
        """Write :meth:`get_output` to ``logpath + ".json"`` (Cockpit's convention)."""
        import json

        from backprism.monitor.log import to_jsonable

        path = os.fspath(logpath) + ".json"
        print(f"[cockpit] writing output to {path}")
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        data = to_jsonable({str(s): v for s, v in self.get_output().items()})
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=4, sort_keys=True, allow_nan=False)


class CockpitPlotter:
    """Cockpit's ``CockpitPlotter`` drawing with :class:`backprism.plot.Dashboard`.

    ``plot(source)`` takes a :class:`Cockpit`/:class:`Monitor`, the path of a log written by
    ``Cockpit.write`` (with or without the ``.json`` suffix) or a ``Monitor`` log (JSONL/JSON).
    """

    def __init__(self, secondary_screen: bool = False) -> None:
        self.secondary_screen = secondary_screen
        self._dashboard: Any = None

    def plot(
        self,
        source: Any,
        show_plot: bool = True,
        block: bool = False,
        save_plot: bool = False,
        savedir: str | os.PathLike | None = None,
        savename: str = "cockpit",
        savename_append: str | None = None,
        savefig_kwargs: dict | None = None,
        show_log_iter: bool = False,
        discard: int | None = None,
        plot_title: str | None = None,
        debug: bool = False,
    ) -> Any:
        """Draw the instrument panel; save it as ``savedir/savename[savename_append].png`` with
        ``save_plot``; show it with ``show_plot``. ``discard``: drop the information of steps
        after this global step."""
        from backprism.plot import Dashboard

        data = _monitor_layout(source)
        if discard is not None and isinstance(data, dict):
            data = {
                k: {s: v for s, v in d.items() if int(s) <= discard} if isinstance(d, dict) else d
                for k, d in data.items()
            }
        if self._dashboard is None:
            self._dashboard = Dashboard(title=plot_title)
        fig = self._dashboard.draw(data)
        if save_plot:
            folder = (
                savedir
                if savedir is not None
                else (
                    os.path.dirname(os.fspath(source))
                    if isinstance(source, (str, os.PathLike))
                    else "."
                )
            )
            name = savename + (savename_append or "") + ".png"
            fig.savefig(os.path.join(folder or ".", name), **(savefig_kwargs or {}))
        if show_plot:
            import matplotlib.pyplot as plt

            plt.show(block=block)
        return fig

    def build_animation(self, logpath: str, duration: int = 200, loop: int = 0) -> None:
        """Combine the frames saved as ``<logpath>__primary__epoch__*.png`` (e.g. with
        ``plot(..., save_plot=True, savename_append="__primary__epoch__0001")``) into
        ``<logpath>__primary.gif`` (Cockpit's convention)."""
        from PIL import Image

        screens = ["primary"] + (["secondary"] if self.secondary_screen else [])
        stem = os.path.splitext(os.fspath(logpath))[0]
        for screen in screens:
            paths = sorted(glob.glob(f"{stem}__{screen}__epoch__*.png"))
            if not paths:
                raise FileNotFoundError(f"no frames {stem}__{screen}__epoch__*.png to animate")
            frame, *frames = [Image.open(p) for p in paths]
            out = f"{stem}__{screen}.gif"
            print(f"[cockpit|animate] Saving GIF in {out}")
            frame.save(
                fp=out, format="GIF", append_images=frames, save_all=True, duration=duration,
                loop=loop,
            )


def _monitor_layout(source: Any) -> Any:
    """``{name: {step: value}}`` from a Cockpit/Monitor or a written log."""
    if isinstance(source, Monitor):
        return Monitor.get_output(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path) and os.path.isfile(path + ".json"):  # Cockpit.write's
            path += ".json"
        if path.endswith(".json"):
            import json

            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            if raw and all(str(k).lstrip("-").isdigit() for k in raw):  # Cockpit's layout
                out: dict[str, dict[Any, Any]] = defaultdict(dict)
                for step, values in raw.items():
                    for name, value in values.items():
                        out[name][int(step)] = value
                return dict(out)
            return raw
        return path  # a streamed JSONL log: the dashboard reads it directly
    return source


# -- module paths ------------------------------------------------------------------------------
def _gauge(name: str) -> Any:
    def gauge(self: Any, fig: Any, gridspec: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"backprism.compat.cockpit: the instrument {name} draws into Cockpit's own figure "
            "layout, which backprism does not reproduce. Use CockpitPlotter().plot(cockpit) or "
            "backprism.plot.Dashboard().draw(...), which draw every instrument (panels in "
            "backprism.plot.panels)"
        )

    gauge.__name__ = name
    return gauge


_GAUGES = [
    "alpha_gauge",
    "cabs_gauge",
    "distance_gauge",
    "early_stopping_gauge",
    "grad_norm_gauge",
    "gradient_tests_gauge",
    "histogram_1d_gauge",
    "histogram_2d_gauge",
    "hyperparameter_gauge",
    "max_ev_gauge",
    "mean_gsnr_gauge",
    "performance_gauge",
    "tic_gauge",
    "trace_gauge",
]
instruments = alias_module(
    f"{__name__}.instruments",
    "Cockpit's ``cockpit.instruments`` (see CockpitPlotter).",
    **{g: _gauge(g) for g in _GAUGES},
)
_Q = f"{__name__}.quantities"
alias_module(
    f"{_Q}.quantity",
    "Cockpit's quantity base classes.",
    Quantity=Quantity,
    SingleStepQuantity=SingleStepQuantity,
    TwoStepQuantity=_base.TwoStepQuantity,
    ByproductQuantity=ByproductQuantity,
)
alias_module(
    f"{_Q}.bin_adaptation",
    "Cockpit's bin adaptation policies.",
    BinAdaptation=_cq.BinAdaptation,
    NoAdaptation=_cq.NoAdaptation,
    GradAbsMax=_cq.GradAbsMax,
    ParamAbsMax=_cq.ParamAbsMax,
)
alias_module(
    f"{_Q}.alpha",
    "Cockpit's helpers of the α computation.",
    **{n: getattr(_cq, n) for n in _cq.__all__ if n.startswith("_")},
)
for _file, _names in {
    "alpha": ["Alpha"],
    "cabs": ["CABS"],
    "distance": ["Distance"],
    "early_stopping": ["EarlyStopping"],
    "grad_hist": ["GradHist1d", "GradHist2d"],
    "grad_norm": ["GradNorm"],
    "hess_max_ev": ["HessMaxEV"],
    "hess_trace": ["HessTrace"],
    "inner_test": ["InnerTest"],
    "loss": ["Loss"],
    "mean_gsnr": ["MeanGSNR"],
    "norm_test": ["NormTest"],
    "ortho_test": ["OrthoTest"],
    "parameters": ["Parameters"],
    "tic": ["TICDiag", "TICTrace"],
    "time": ["Time"],
    "update_size": ["UpdateSize"],
}.items():
    alias_module(f"{_Q}.{_file}", f"Cockpit's quantities.{_file}.",
                 **{n: _quantities_attrs[n] for n in _names})

_configuration_module = alias_module(
    f"{__name__}.utils.configuration",
    "Cockpit's ``cockpit.utils.configuration``.",
    configuration=configuration,
    quantities_cls_for_configuration=quantities_cls_for_configuration,
)
utils = alias_module(
    f"{__name__}.utils",
    "Cockpit's ``cockpit.utils``: ``schedules`` and ``configuration``.",
    schedules=schedules,
    configuration=_configuration_module,
)
alias_module(
    f"{__name__}.utils.schedules",
    "Cockpit's schedules.",
    linear=schedules.linear,
    logarithmic=schedules.logarithmic,
)
alias_module(
    f"{__name__}.utils.optim",
    "Cockpit's ``cockpit.utils.optim``.",
    ComputeStep=ComputeStep,
)
alias_module(
    f"{__name__}.context",
    "Cockpit's ``cockpit.context``: the step's ``info`` for custom quantities.",
    CockpitCTX=CockpitCTX,
    get_individual_losses=get_individual_losses,
    get_batch_size=get_batch_size,
    get_optimizer=get_optimizer,
    get_loss=get_loss,
)
alias_module(
    f"{_Q}.hooks",
    "Cockpit's extension hooks (run per module by the monitor, Quantity.extension_hooks).",
)
alias_module(
    f"{_Q}.hooks.base",
    "Cockpit's base classes of extension hooks.",
    ModuleExtensionHook=_cq.ModuleExtensionHook,
    ParameterExtensionHook=_cq.ParameterExtensionHook,
)
alias_module(
    f"{_Q}.utils_transforms",
    "Cockpit's per-sample gradient transforms as an extension hook.",
    BatchGradTransformsHook=_cq.BatchGradTransformsHook,
    BatchGradTransformsHook_BatchL2Grad=_cq.BatchGradTransformsHook_BatchL2Grad,
    BatchGradTransformsHook_BatchDotGrad=_cq.BatchGradTransformsHook_BatchDotGrad,
    BatchGradTransformsHook_SumGradSquared=_cq.BatchGradTransformsHook_SumGradSquared,
    batch_l2_transform=_cq.batch_l2_transform,
    batch_dot_transform=_cq.batch_dot_transform,
    sum_grad_squared_transform=_cq.sum_grad_squared_transform,
    get_first_n_alphabet=_cq.get_first_n_alphabet,
)
alias_module(f"{__name__}.cockpit", "Cockpit's ``cockpit.cockpit``.", Cockpit=Cockpit)
alias_module(f"{__name__}.plotter", "Cockpit's ``cockpit.plotter``.", CockpitPlotter=CockpitPlotter)
