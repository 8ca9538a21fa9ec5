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
* custom quantities may implement Cockpit's ``_compute(global_step, params, batch_loss)``.

``cockpit.instruments.*_gauge`` raise an error pointing to :class:`CockpitPlotter` /
:class:`backprism.plot.Dashboard`, which draw all instruments at once.
"""

from __future__ import annotations

import glob
import inspect
import math
import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from backprism.compat._modules import alias_module
from backprism.monitor import quantities as _q
from backprism.monitor import schedules
from backprism.monitor.configuration import (
    quantities_cls_for_configuration as _monitor_classes,
)
from backprism.monitor.monitor import Monitor
from backprism.monitor.quantities import base as _base
from backprism.monitor.quantities import bin_adaptation as _bins
from backprism.monitor.quantities.base import Quantity, Schedule, StepData

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


def _cockpit_compute(cls: type) -> bool:
    """Whether ``cls._compute`` has Cockpit's signature ``(global_step, params, batch_loss)``."""
    fn = getattr(cls, "_compute", None)
    if fn is None:
        return False
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names[1:] == ["global_step", "params", "batch_loss"]


class SingleStepQuantity(_base.SingleStepQuantity):
    """Cockpit's base class of single-step quantities. Subclasses may implement either
    backprism's ``_compute(global_step, data)`` or Cockpit's
    ``_compute(global_step, params, batch_loss)``."""

    def compute(self, global_step: int, data: StepData) -> tuple[int, Any]:
        if _cockpit_compute(type(self)):
            loss = data.info.get("loss")
            return global_step, self._compute(global_step, data.params, loss)  # type: ignore[call-arg]
        return super().compute(global_step, data)


class ByproductQuantity(SingleStepQuantity):
    """Cockpit's base class of quantities that need no extension."""


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


class Cockpit(Monitor):
    """Cockpit's class: ``Cockpit(params, quantities=None)``; use as
    ``with cockpit(global_step, *exts, info={...}): loss.backward(create_graph=...)``."""

    #: Cockpit's switch for BackPACK's memory-saving convolution Jacobians; no effect here
    #: (backprism bounds memory with ``collect(memory_budget=...)``)
    BACKPACK_CONV_SAVE_MEMORY = True

    def __init__(self, params: Iterable[Tensor], quantities: Iterable[Quantity] | None = None):
        super().__init__(params, quantities)
        self.output: dict[int, dict[str, Any]] = defaultdict(dict)

    def __call__(  # type: ignore[override]
        self, global_step: int, *exts: Any, info: dict[str, Any] | None = None, debug: bool = False
    ) -> Any:
        if debug:
            print(f"[DEBUG, step {global_step}] quantities: {self.quantities}")
        return super().__call__(global_step, *exts, info=info)

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
        if not os.path.exists(path) and os.path.exists(path + ".json"):
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
    BinAdaptation=_bins.BinAdaptation,
    NoAdaptation=_bins.NoAdaptation,
    GradAbsMax=_bins.GradAbsMax,
    ParamAbsMax=_bins.ParamAbsMax,
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
