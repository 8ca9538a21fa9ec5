r"""The streamed monitor log (JSON Lines) and its reader.

File format (version 1), one JSON object per line, each line flushed as soon as it is written,
so the file is readable during training and intact up to the last completed step after a crash:

* first line (and again after every re-opening in append mode)::

    {"kind": "meta", "version": 1, "quantities": ["Loss", "GradNorm", "Alpha", ...]}

  ``quantities`` lists the output keys of the tracked quantities (see
  :class:`~backprism.monitor.Monitor` for the key scheme of duplicates).

* per tracked step::

    {"kind": "step", "step": 12, "values": {"Loss": 0.7, "GradNorm": [0.1, 0.02], ...}}

  A value is

  - a float (``Loss``, ``Alpha``, ``NormTest``, ``HessMaxEV``, ``TICDiag``, ...);
  - a list of floats, one per parameter (``GradNorm``, ``Distance``, ``UpdateSize``,
    ``HessTrace``); ``Parameters`` is a list of nested lists (the parameter values);
  - for histograms ``{"hist": [...], "edges": [...]}`` (``GradHist1d``: counts ``[bins]`` and
    ``bins + 1`` edges) or ``{"hist": [[...]], "edges": [xedges, yedges]}`` (``GradHist2d``:
    counts ``[xbins, ybins]``, x = individual gradient elements, y = parameter values; with
    ``keep_individual=True`` also ``"param_groups": P`` and ``"param_<i>"`` histograms);
  - ``CABS``: ``{"cabs": float}`` as in Cockpit;
  - ``null`` for NaN or ±inf anywhere.

  Two-step quantities (``Alpha``, ``UpdateSize``) finish one step later and are stored under the
  *start* step, as in Cockpit; their values then arrive in a later line for the same ``step``.
  **Readers merge all ``step`` lines with the same step** (later keys win).

  ``Alpha`` additionally writes ``"Alpha/fit"`` (``"<key>/fit"``), everything needed to draw
  the noise-aware quadratic fit along the update direction ``d = θ_end − θ_start``, with the
  coordinate ``x ∈ [0, t]`` the distance travelled along ``d`` (``t = ‖d‖``)::

      {"t": t, "f": [f0, ft], "df": [df0, dft], "var_f": [..2], "var_df": [..2],
       "mu": [c0, c1, c2] or null, "alpha": α}

  ``f`` are the mini-batch losses at start/end, ``df`` the projected gradients ``gᵀd/‖d‖``,
  ``var_*`` their sample variances over the batch, and the fitted parabola is
  ``q(x) = c0 + c1 x + c2 x²``. ``α = 2t/(−c1/c2) − 1``: ``−1`` = stayed at the start,
  ``0`` = stepped to the minimum of ``q``, ``1`` = stepped to the opposite point of equal
  height (``α = −1`` is also recorded for a concave fit, ``null`` if no fit exists).

* per :meth:`Monitor.log` call::

    {"kind": "log", "step": 12, "epoch": 0, "train_loss": 0.5, "valid_loss": 0.6,
     "train_accuracy": 0.8, "valid_accuracy": 0.7, "learning_rate": 0.01}

  absent values are omitted (``epoch`` is ``null`` when not given).

:func:`read_log` turns a file back into a :class:`pandas.DataFrame` (one row per step, a
``step`` column, a column per key, the ``log`` fields merged into the same row) or a dict.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import IO, Any

import numpy as np
import torch

__all__ = ["LOG_VERSION", "LogWriter", "read_log", "to_jsonable"]

LOG_VERSION = 1


def to_jsonable(value: Any) -> Any:
    """Convert tensors/arrays/numbers to plain JSON types; NaN and ±inf become ``None``."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "fc":
            obj = value.astype(np.float64).tolist()
            return to_jsonable(obj)
        return value.tolist()
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"cannot write a value of type {type(value).__name__} to the monitor log")


def _dumps(obj: Mapping[str, Any]) -> str:
    return json.dumps(to_jsonable(obj), allow_nan=False, separators=(",", ":"))


class LogWriter:
    """Appends JSON lines to ``path`` and flushes after every line.

    Args:
        path: file to write.
        quantities: output keys for the meta line.
        mode: ``"w"`` starts a new file (default), ``"a"`` appends (a new meta line is written).
        fsync: also ``os.fsync`` after every line (survives power loss, not only a crash).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        quantities: Iterable[str],
        mode: str = "w",
        fsync: bool = False,
    ) -> None:
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        self.path = os.fspath(path)
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self._fsync = fsync
        self._file: IO[str] | None = open(self.path, mode, encoding="utf-8")  # noqa: SIM115
        self.write({"kind": "meta", "version": LOG_VERSION, "quantities": list(quantities)})

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record as a line and flush it."""
        if self._file is None:
            raise ValueError(f"the monitor log {self.path} is closed")
        self._file.write(_dumps(record) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def step(self, step: int, values: Mapping[str, Any]) -> None:
        self.write({"kind": "step", "step": int(step), "values": dict(values)})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown
        with contextlib.suppress(Exception):
            self.close()


def _parse(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise ValueError(f"read_log: no such file: {path}")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    # a complete file ends with "\n": the last element is then empty
    complete, last = lines[:-1], lines[-1]
    if not any(line.strip() for line in lines):
        raise ValueError(f"read_log: {path} is empty")
    records = []
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(complete) - 1 and not last.strip():
                break  # truncated last line followed by nothing: tolerate
            raise ValueError(
                f"read_log: {path} line {i + 1} is not valid JSON; not a backprism monitor log"
            ) from None
    if last.strip():  # last line without newline: written partially when the run died
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(last))
    if not records or not isinstance(records[0], dict) or records[0].get("kind") != "meta":
        raise ValueError(f"read_log: {path} is not a backprism monitor log (no meta line first)")
    meta = dict(records[0])
    if meta.get("version") != LOG_VERSION:
        raise ValueError(
            f"read_log: {path} has log version {meta.get('version')!r}, expected {LOG_VERSION}"
        )
    keys = list(meta.get("quantities", []))
    steps: dict[int, dict[str, Any]] = {}
    logs = []
    for rec in records[1:]:
        if not isinstance(rec, dict):
            continue
        kind = rec.get("kind")
        if kind == "meta":
            keys += [k for k in rec.get("quantities", []) if k not in keys]
        elif kind == "step":
            steps.setdefault(int(rec["step"]), {}).update(rec.get("values", {}))
        elif kind == "log":
            logs.append(rec)
    meta["quantities"] = keys
    return {
        "meta": meta,
        "steps": [{"step": s, "values": steps[s]} for s in sorted(steps)],
        "logs": logs,
    }


def read_log(path: str | os.PathLike, as_frame: bool = True) -> Any:
    """Read a monitor log written by :class:`LogWriter` (tolerates a truncated last line).

    Args:
        path: the ``.jsonl`` file.
        as_frame: return a :class:`pandas.DataFrame` with one row per step (sorted), a ``step``
            column, one column per quantity key (missing values ``NaN``/``None``) and the
            ``Monitor.log`` fields (``epoch``, ``train_loss``, ...) merged by step. Otherwise
            return ``{"meta": {...}, "steps": [{"step": s, "values": {...}}, ...],
            "logs": [...]}`` with the ``step`` lines of one step merged.

    Raises:
        ValueError: the file is missing, empty or not a backprism monitor log.
    """
    data = _parse(os.fspath(path))
    if not as_frame:
        return data
    import pandas as pd

    rows: dict[int, dict[str, Any]] = {}
    for entry in data["steps"]:
        rows.setdefault(entry["step"], {}).update(entry["values"])
    for rec in data["logs"]:
        fields = {k: v for k, v in rec.items() if k not in ("kind", "step")}
        rows.setdefault(int(rec["step"]), {}).update(fields)
    columns = ["step", *data["meta"]["quantities"]]
    records = [{"step": s, **rows[s]} for s in sorted(rows)]
    frame = pd.DataFrame.from_records(records)
    if frame.empty:
        return pd.DataFrame(columns=columns)
    extra = [c for c in frame.columns if c not in columns]
    for c in columns:
        if c not in frame.columns:
            frame[c] = None
    return frame[columns + extra].reset_index(drop=True)
