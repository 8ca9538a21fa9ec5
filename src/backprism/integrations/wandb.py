"""Monitor quantities in Weights & Biases (``pip install backprism[wandb]``).

>>> with WandbWriter(project="my-project") as wb:    # or WandbWriter(run=wandb.run)
...     wb.update("run/monitor.jsonl")              # or a Monitor, a RunLog, parsed output
...     wb.log_dashboard("run/monitor.jsonl")       # the matplotlib instrument panel as an image

Logged with the public ``wandb`` API (``run.log``, ``wandb.Histogram``, ``wandb.Image``):

* every scalar quantity as ``backprism/<key>``; a per-parameter list as its whole-model value
  (root of the sum of squares for norms, sum otherwise) and, with ``per_parameter=True``, also
  as ``backprism/<key>/param_<i>``;
* ``GradHist1d`` as a :class:`wandb.Histogram` of the logged bins (``np_histogram``);
* ``GradHist2d`` as a grey-scale :class:`wandb.Image` of the log counts (rows: parameter value,
  top = largest; columns: gradient element);
* ``monitor.log`` metrics as ``metrics/<name>``;
* :meth:`WandbWriter.log_dashboard`: the :class:`~backprism.plot.Dashboard` PNG as
  ``backprism/dashboard``.

The monitor's step is logged as ``backprism/step`` and declared with ``run.define_metric`` as the
x axis of ``backprism/*`` and ``metrics/*``. W&B's own ``step`` only ever grows, while a monitor
log can deliver a value late (``Alpha`` of step ``t`` is known after step ``t + 1``); with the
custom step metric such late values still land at the right step.

:meth:`WandbWriter.update` remembers what it wrote, so it can be called repeatedly on a growing
log or a running Monitor and only adds the new entries. Without network access, run W&B in
offline mode (``WANDB_MODE=offline``, later ``wandb sync``).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from backprism.plot.logdata import RunLog, base_name, combine, is_auxiliary, load

__all__ = ["WandbWriter"]


def _wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "WandbWriter needs wandb: pip install 'backprism[wandb]' (or pip install wandb)"
        ) from None
    return wandb


class WandbWriter:
    """Write monitor output to a Weights & Biases run.

    Args:
        run: an active run (``wandb.init(...)``'s result); if ``None``, the writer starts one
            with ``wandb.init(**init_kwargs)`` and finishes it in :meth:`close`.
        prefix: key prefix of the quantities.
        per_parameter: also log one scalar per parameter for per-parameter lists.
        step_metric: key of the monitor's step, the x axis of the logged keys.
        **init_kwargs: passed to ``wandb.init`` when ``run`` is ``None`` (``project=``,
            ``dir=``, ``mode="offline"``, ...).
    """

    def __init__(
        self,
        run: Any = None,
        prefix: str = "backprism",
        per_parameter: bool = False,
        step_metric: str = "backprism/step",
        **init_kwargs: Any,
    ) -> None:
        self.wandb = _wandb()
        if run is not None and init_kwargs:
            raise TypeError("pass either run= or wandb.init arguments, not both")
        self._owns_run = run is None
        self.run = run if run is not None else self.wandb.init(**init_kwargs)
        self.prefix = prefix
        self.per_parameter = per_parameter
        self.step_metric = step_metric
        self.run.define_metric(step_metric)
        for pattern in (f"{prefix}/*", "metrics/*"):
            self.run.define_metric(pattern, step_metric=step_metric)
        self._done: set[tuple[str, int]] = set()

    # ------------------------------------------------------------------ conversion
    def values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """W&B entries ``{key: scalar | Histogram | Image}`` of one step's quantity values
        ``{key: value}`` (schema of the monitor log)."""
        out: dict[str, Any] = {}
        for key, value in values.items():
            if is_auxiliary(key) or base_name(key) == "Parameters":
                continue  # auxiliary records (Alpha/fit) and raw parameter values
            tag = f"{self.prefix}/{key}"
            if isinstance(value, Mapping) and "hist" in value:
                media = self._hist(value)
                if media is not None:
                    out[tag] = media
                continue
            scalar = combine(key, value)
            if math.isfinite(scalar):
                out[tag] = scalar
            if self.per_parameter and isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        out[f"{tag}/param_{i}"] = float(v)
        return out

    @staticmethod
    def record(record: Mapping[str, Any]) -> dict[str, float]:
        """W&B entries ``{"metrics/<name>": value}`` of one ``monitor.log`` record."""
        out: dict[str, float] = {}
        for name, value in record.items():
            if name in ("kind", "step") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                out[f"metrics/{name}"] = float(value)
        return out

    def _hist(self, value: Mapping[str, Any]) -> Any:
        hist = np.asarray(value["hist"], dtype=float)
        if hist.ndim == 1:
            edges = np.asarray(value["edges"], dtype=float)
            if hist.sum() <= 0 or edges.size != hist.size + 1:
                return None
            return self.wandb.Histogram(np_histogram=(hist.tolist(), edges.tolist()))
        if hist.ndim == 2 and hist.size:
            img = np.log1p(np.clip(hist, 0, None)).T[::-1]  # y (parameter) up, x (gradient) right
            top = img.max()
            img = img / top if top > 0 else img
            scale = max(1, math.ceil(200 / max(img.shape)))  # W&B shows images at their size
            img = np.kron(img, np.ones((scale, scale)))
            return self.wandb.Image(
                (img * 255).round().astype(np.uint8),
                caption="log count; x: gradient element, y: parameter value",
            )
        return None

    # ------------------------------------------------------------------ writing
    def log(self, step: int, entries: Mapping[str, Any]) -> None:
        """``run.log`` of ``entries`` at the monitor step ``step``."""
        if entries:
            self.run.log({self.step_metric: int(step), **entries})

    def update(self, source: Any) -> int:
        """Log what ``source`` (a log path, a RunLog, parsed output or a Monitor) holds beyond
        what earlier calls logged; returns the number of new (key, step) entries."""
        log: RunLog = load(source)
        steps: dict[int, dict[str, Any]] = {}
        marks: dict[int, list[tuple[str, int]]] = {}
        for key in log.tracked:
            for step, value in log.series(key):
                if (key, step) not in self._done:
                    steps.setdefault(step, {})[key] = value
                    marks.setdefault(step, []).append((key, step))
        rows: dict[int, dict[str, Any]] = {s: self.values(v) for s, v in steps.items()}
        for i, rec in enumerate(log.records):
            mark = ("__log__", i)
            if mark not in self._done:
                step = int(rec["step"])
                rows.setdefault(step, {}).update(self.record(rec))
                marks.setdefault(step, []).append(mark)
        new = 0
        for step in sorted(rows):
            self.log(step, rows[step])
            self._done.update(marks.get(step, []))
            new += len(marks.get(step, []))
        return new

    def log_dashboard(
        self,
        source: Any,
        key: str | None = None,
        step: int | None = None,
        smoothing: float = 0.6,
        title: str | None = None,
    ) -> Any:
        """Draw the matplotlib :class:`~backprism.plot.Dashboard` of ``source`` and log it as a
        :class:`wandb.Image` under ``key`` (default ``<prefix>/dashboard``) at ``step`` (default:
        the log's last step). Returns the image."""
        from backprism.plot import Dashboard

        log = load(source)
        dash = Dashboard(smoothing=smoothing, title=title)
        dash.draw(log)
        with tempfile.TemporaryDirectory() as tmp:
            png = dash.save(Path(tmp) / "dashboard.png")
            dash.close()
            image = self.wandb.Image(os.fspath(png), caption=f"{log.num_steps} tracked steps")
            at = step if step is not None else (log.last_step or 0)
            self.log(at, {key or f"{self.prefix}/dashboard": image})
        return image

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Finish the run if this writer started it."""
        if self._owns_run:
            self.run.finish()

    def __enter__(self) -> WandbWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
