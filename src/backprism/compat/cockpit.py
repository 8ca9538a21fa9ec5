"""Cockpit-compatible names and module paths on top of :mod:`backprism.monitor`.

A Cockpit script runs after changing only its imports::

    from backprism.compat.cockpit import Cockpit, quantities
    from backprism.compat.cockpit.utils import schedules
    from backprism.compat.cockpit.utils.configuration import configuration

(``cockpit.quantities.*``, ``cockpit.utils.schedules``, ``cockpit.utils.configuration`` map to
the monitor's modules). As with Cockpit + BackPACK, the model and loss function must be extended
(``backprism.extend``). Differences from :class:`~backprism.monitor.Monitor` that keep Cockpit's
behaviour: :meth:`Cockpit.get_output` is ``{step: {quantity_name: value}}`` (Cockpit's
layout; the Monitor's is ``{quantity_name: {step: value}}``), :meth:`Cockpit.log` takes
Cockpit's positional arguments and :meth:`Cockpit.write` appends ``".json"`` to the path.
"""

from __future__ import annotations

import os
import sys
import types
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from backprism.monitor import configuration as _configuration_fn
from backprism.monitor import quantities, schedules
from backprism.monitor.monitor import Monitor
from backprism.monitor.quantities.base import Quantity

__all__ = ["Cockpit", "CockpitPlotter", "quantities", "utils"]

__path__: list[str] = []  # lets ``import backprism.compat.cockpit.utils.schedules`` resolve


class Cockpit(Monitor):
    """Cockpit's class: ``Cockpit(params, quantities=None)``; use as
    ``with cockpit(global_step, *exts, info={...}): loss.backward(create_graph=...)``."""

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
        """``{step: {quantity_name: value, ...}}`` (Cockpit's layout), log fields included."""
        for q in self.quantities:
            for step, value in q.get_output().items():
                self.output[step][q.key] = value
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
    ``Cockpit.write`` (``{step: {name: value}}``) or ``Monitor`` (JSONL or JSON).
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
        ``save_plot``; show it with ``show_plot``. ``discard`` drops the first steps."""
        from backprism.plot import Dashboard

        data = _monitor_layout(source)
        if discard and isinstance(data, dict):
            data = {
                k: {s: v for s, v in d.items() if int(s) >= discard} if isinstance(d, dict) else d
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


def _module(name: str, doc: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


_configuration_module = _module(
    f"{__name__}.utils.configuration",
    "Cockpit's ``cockpit.utils.configuration``.",
    configuration=_configuration_fn,
    quantities_cls_for_configuration=sys.modules[
        "backprism.monitor.configuration"
    ].quantities_cls_for_configuration,
)
utils = _module(
    f"{__name__}.utils",
    "Cockpit's ``cockpit.utils``: ``schedules`` and ``configuration``.",
    schedules=schedules,
    configuration=_configuration_module,
    __path__=[],
)
sys.modules[f"{__name__}.utils.schedules"] = schedules
sys.modules[f"{__name__}.quantities"] = quantities
