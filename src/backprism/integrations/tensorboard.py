"""Monitor quantities in TensorBoard (``pip install backprism[tensorboard]``).

>>> with TensorBoardWriter("runs/demo") as tb:
...     tb.update("run/monitor.jsonl")        # or a Monitor, a RunLog, parsed output

Written through :class:`torch.utils.tensorboard.SummaryWriter` (real event files):

* every scalar quantity as ``backprism/<key>``; a per-parameter list also as its whole-model
  value ``backprism/<key>`` (root of the sum of squares for norms, sum otherwise) and, with
  ``per_parameter=True``, one ``backprism/<key>/param_<i>`` per parameter;
* ``GradHist1d`` as a TensorBoard histogram (``add_histogram_raw`` with the logged bins);
* ``GradHist2d`` as a grey-scale image of the log counts (rows: parameter value, top = largest;
  columns: gradient element);
* ``monitor.log`` metrics as ``metrics/<name>`` (``metrics/train_loss``, ...).

:meth:`TensorBoardWriter.update` remembers what it wrote, so it can be called repeatedly on a
growing log or a running Monitor and only adds the new steps.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from backprism.plot.logdata import RunLog, base_name, combine, is_auxiliary, load

__all__ = ["TensorBoardWriter"]


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "TensorBoardWriter needs tensorboard: pip install 'backprism[tensorboard]' "
            "(or pip install tensorboard)"
        ) from None
    return SummaryWriter


class TensorBoardWriter:
    """Write monitor output as TensorBoard event files in ``log_dir``.

    Args:
        log_dir: TensorBoard run directory.
        prefix: tag prefix of the quantities.
        per_parameter: also write one scalar per parameter for per-parameter lists.
        **kwargs: passed to :class:`torch.utils.tensorboard.SummaryWriter`.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        prefix: str = "backprism",
        per_parameter: bool = True,
        **kwargs: Any,
    ) -> None:
        self.writer = _summary_writer()(log_dir=os.fspath(log_dir), **kwargs)
        self.log_dir = os.fspath(log_dir)
        self.prefix = prefix
        self.per_parameter = per_parameter
        self._done: set[tuple[str, int]] = set()

    # ------------------------------------------------------------------ writing
    def add_values(self, step: int, values: Mapping[str, Any]) -> None:
        """Write one step's quantity values ``{key: value}`` (schema of the monitor log)."""
        for key, value in values.items():
            if is_auxiliary(key) or base_name(key) == "Parameters":
                continue  # auxiliary records (Alpha/fit) and raw parameter values
            tag = f"{self.prefix}/{key}"
            if isinstance(value, Mapping) and "hist" in value:
                self._add_hist(tag, step, value)
                continue
            scalar = combine(key, value)
            if math.isfinite(scalar):
                self.writer.add_scalar(tag, scalar, global_step=step)
            if self.per_parameter and isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        self.writer.add_scalar(f"{tag}/param_{i}", float(v), global_step=step)

    def add_record(self, record: Mapping[str, Any]) -> None:
        """Write one ``monitor.log`` record as ``metrics/<name>`` scalars."""
        step = int(record["step"])
        for name, value in record.items():
            if name in ("kind", "step", "epoch") or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(f"metrics/{name}", float(value), global_step=step)
        if isinstance(record.get("epoch"), int):
            self.writer.add_scalar("metrics/epoch", record["epoch"], global_step=step)

    def update(self, source: Any) -> int:
        """Write what ``source`` (a log path, a RunLog, parsed output or a Monitor) holds beyond
        what earlier calls wrote; returns the number of new (key, step) entries."""
        log: RunLog = load(source)
        new = 0
        steps: dict[int, dict[str, Any]] = {}
        for key in log.tracked:
            for step, value in log.series(key):
                if (key, step) not in self._done:
                    steps.setdefault(step, {})[key] = value
        for step in sorted(steps):
            self.add_values(step, steps[step])
            for key in steps[step]:
                self._done.add((key, step))
                new += 1
        for i, rec in enumerate(log.records):
            mark = ("__log__", i)
            if mark not in self._done:
                self.add_record(rec)
                self._done.add(mark)
                new += 1
        self.writer.flush()
        return new

    def _add_hist(self, tag: str, step: int, value: Mapping[str, Any]) -> None:
        hist = np.asarray(value["hist"], dtype=float)
        if hist.ndim == 1:
            edges = np.asarray(value["edges"], dtype=float)
            num = float(hist.sum())
            if num <= 0 or edges.size != hist.size + 1:
                return
            mids = (edges[:-1] + edges[1:]) / 2
            self.writer.add_histogram_raw(
                tag,
                min=float(edges[0]),
                max=float(edges[-1]),
                num=num,
                sum=float((hist * mids).sum()),
                sum_squares=float((hist * mids**2).sum()),
                bucket_limits=edges[1:].tolist(),
                bucket_counts=hist.tolist(),
                global_step=step,
            )
        elif hist.ndim == 2 and hist.size:
            img = np.log1p(np.clip(hist, 0, None)).T[::-1]  # y (parameter) up, x (gradient) right
            top = img.max()
            img = img / top if top > 0 else img
            self.writer.add_image(tag, img[None].astype(np.float32), global_step=step,
                                  dataformats="CHW")

    # ------------------------------------------------------------------ lifetime
    def flush(self) -> None:
        """Flush pending events to disk."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
