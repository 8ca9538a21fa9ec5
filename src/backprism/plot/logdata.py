"""Reading a monitor log (JSON lines) into a :class:`RunLog`.

The log written by :mod:`backprism.monitor` is one JSON object per line:

* first line ``{"kind": "meta", "version": 1, "quantities": [key, ...]}``;
* per tracked step ``{"kind": "step", "step": int, "values": {key: value}}`` where ``value`` is
  a float (``null`` for NaN), a list of floats (one per parameter), a histogram
  ``{"hist": [...] | [[...]], "edges": [...] | [xedges, yedges]}`` or a small dict such as
  CABS's ``{"cabs": float}``; several lines may carry the same step (two-step quantities such as
  ``Alpha`` arrive one step late): they are merged, later keys win;
* ``{"kind": "log", "step": int, "epoch": int | null, "train_loss": ..., ...}`` from
  ``monitor.log`` (absent values omitted).

The file is parsed by the same code as :func:`backprism.monitor.read_log`: a cut-off last line
(a crashed run loses only its last record) is skipped with a
:class:`~backprism.monitor.log.TruncatedLogWarning` (a :class:`UserWarning`) naming the file, and
:attr:`RunLog.truncated` is set; a one-line :class:`ValueError` is raised for missing, empty or
foreign files and for a corrupt line before the last (naming the file and the line number).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backprism.monitor.log import LOG_VERSION, _NotJSONLines, _read_records, to_jsonable

__all__ = [
    "LOG_METRICS",
    "SUPPORTED_VERSION",
    "RunLog",
    "base_name",
    "combine",
    "is_auxiliary",
    "load",
    "read_log",
]

SUPPORTED_VERSION = LOG_VERSION

#: Keys of ``{"kind": "log"}`` records, in display order.
LOG_METRICS = (
    "train_loss",
    "valid_loss",
    "test_loss",
    "train_accuracy",
    "valid_accuracy",
    "test_accuracy",
    "learning_rate",
)

# Per-parameter lists of these quantities are norms: the whole-model value is the root of the sum
# of squares. All other per-parameter lists (traces, TIC, ...) add up.
_NORM_QUANTITIES = ("GradNorm", "UpdateSize", "Distance")


# "<quantity key>/<record>", the quantity key being "Name", "Name(hp=...)" or "Name#i"
_AUX = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\([^/]*\))?(#\d+)?/\w+$")


def base_name(key: str) -> str:
    """Quantity class name of a log key: ``"HessTrace(curvature=diag_h)"``, ``"Loss#2"`` and
    ``"GradNorm_1"`` give ``"HessTrace"``, ``"Loss"``, ``"GradNorm"``; auxiliary keys such as
    ``"Alpha/fit"`` are returned unchanged."""
    if is_auxiliary(key):
        return key
    name = key.split("(", 1)[0].split("#", 1)[0]
    head, sep, tail = name.rpartition("_")
    return head if sep and tail.isdigit() else name


def is_auxiliary(key: str) -> bool:
    """Whether ``key`` is a quantity's auxiliary record such as ``"Alpha/fit"`` (not a
    quantity of its own)."""
    return _AUX.match(key) is not None


def combine(key: str, value: Any) -> float:
    """Whole-model scalar of one logged value.

    Floats pass through (``None`` → NaN). A per-parameter list ``[v_1, ..., v_P]`` becomes
    ``sqrt(Σ v_p²)`` for the norms (``GradNorm``, ``UpdateSize``, ``Distance``) and ``Σ v_p``
    otherwise (``HessTrace``, ``TICDiag``, ...). Histograms give NaN.
    """
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        arr = np.asarray([math.nan if v is None else v for v in _flatten(value)], dtype=float)
        if arr.size == 0:
            return math.nan
        if base_name(key) in _NORM_QUANTITIES:
            return float(np.sqrt(np.sum(arr**2)))
        return float(np.sum(arr))
    if isinstance(value, Mapping) and "hist" not in value:
        # small records such as CABS's {"cabs": 64.0}: the entry named like the quantity, else
        # the only number
        named = value.get(base_name(key).lower())
        if isinstance(named, (int, float)) or (named is None and base_name(key).lower() in value):
            return combine(key, named)
        nums = [v for v in value.values() if isinstance(v, (int, float))]
        return float(nums[0]) if len(nums) == 1 else math.nan
    return math.nan


def _flatten(value: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for v in value:
        if isinstance(v, (list, tuple)):
            out.extend(_flatten(v))
        else:
            out.append(v)
    return out


@dataclass
class RunLog:
    """A monitor log in memory.

    Attributes:
        quantities: quantity keys announced by the meta record (in order).
        steps: ``{key: {step: value}}`` raw logged values (:meth:`series` sorts them).
        records: the ``monitor.log`` records (dicts with ``step``, ``epoch`` and metrics).
        source: file the log came from, if any.
        truncated: whether a cut-off last line was skipped (see :func:`read_log`).
    """

    quantities: list[str] = field(default_factory=list)
    steps: dict[str, dict[int, Any]] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    source: str | None = None
    truncated: bool = False

    # ------------------------------------------------------------------ building
    def add(self, record: Mapping[str, Any]) -> None:
        """Add one record of the schema (``meta``, ``step`` or ``log``)."""
        kind = record.get("kind")
        if kind == "meta":
            for key in record.get("quantities", []):
                if key not in self.quantities:
                    self.quantities.append(str(key))
        elif kind == "step":
            step = int(record["step"])
            for key, value in (record.get("values") or {}).items():
                self.steps.setdefault(str(key), {})[step] = value
                if key not in self.quantities:
                    self.quantities.append(str(key))
        elif kind == "log":
            self.records.append({k: v for k, v in record.items() if k != "kind"})

    @classmethod
    def from_records(
        cls, records: Iterable[Mapping[str, Any]], source: str | None = None
    ) -> RunLog:
        """Build from parsed records of the schema."""
        log = cls(source=source)
        for rec in records:
            log.add(rec)
        return log

    # ------------------------------------------------------------------ access
    def series(self, key: str) -> list[tuple[int, Any]]:
        """``[(step, value), ...]`` of ``key`` sorted by step."""
        return sorted(self.steps.get(key, {}).items())

    @property
    def tracked(self) -> list[str]:
        """Keys with at least one logged value."""
        return [k for k in self.quantities if self.steps.get(k)]

    @property
    def num_steps(self) -> int:
        """Number of distinct steps with a quantity value."""
        return len({s for series in self.steps.values() for s in series})

    @property
    def last_step(self) -> int | None:
        """Largest step in the log (quantities or ``monitor.log`` records)."""
        cands = [s for series in self.steps.values() for s in series]
        cands += [int(r["step"]) for r in self.records if r.get("step") is not None]
        return max(cands) if cands else None

    def keys_of(self, name: str) -> list[str]:
        """Logged keys whose quantity class is ``name`` (``"GradNorm"``, ``"GradNorm#2"``, …)."""
        return [k for k in self.tracked if base_name(k) == name]

    def key(self, name: str) -> str | None:
        """First logged key of quantity class ``name``, or ``None``."""
        keys = self.keys_of(name)
        return keys[0] if keys else None

    def scalar(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of ``key`` reduced to whole-model floats (see :func:`combine`)."""
        series = self.series(key)
        x = np.asarray([s for s, _ in series], dtype=float)
        y = np.asarray([combine(key, v) for _, v in series], dtype=float)
        return x, y

    def per_param(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(steps, values[T, P])`` for a per-parameter list quantity, else ``None``."""
        series = [(s, v) for s, v in self.series(key) if isinstance(v, (list, tuple))]
        if not series:
            return None
        width = max(len(v) for _, v in series)
        vals = np.full((len(series), width), np.nan)
        for i, (_, v) in enumerate(series):
            flat = [math.nan if e is None else e for e in v]
            if all(isinstance(e, (int, float)) for e in flat):
                vals[i, : len(flat)] = flat
        return np.asarray([s for s, _ in series], dtype=float), vals

    def histograms(self, key: str) -> list[tuple[int, np.ndarray, list[np.ndarray]]]:
        """``[(step, hist, edges)]`` for a histogram quantity (edges: one array per axis)."""
        out = []
        for step, value in self.series(key):
            if not isinstance(value, Mapping) or "hist" not in value:
                continue
            hist = np.asarray(value["hist"], dtype=float)
            edges = value.get("edges", [])
            if hist.ndim == 1:
                edge_list = [np.asarray(edges, dtype=float)]
            else:
                edge_list = [np.asarray(e, dtype=float) for e in edges]
            out.append((step, hist, edge_list))
        return out

    def metric(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of a ``monitor.log`` metric such as ``"valid_accuracy"``."""
        pts = [
            (float(r["step"]), math.nan if r.get(name) is None else float(r[name]))
            for r in self.records
            if name in r and r.get("step") is not None
        ]
        if not pts:
            return np.zeros(0), np.zeros(0)
        arr = np.asarray(pts, dtype=float)
        return arr[:, 0], arr[:, 1]

    def metrics(self) -> list[str]:
        """``monitor.log`` metrics present in the log."""
        return [m for m in LOG_METRICS if any(m in r for r in self.records)]


def read_log(path: str | os.PathLike[str]) -> RunLog:
    """Read a monitor JSONL log (or the one-object JSON file of ``Monitor.write``).

    Parsing is shared with :func:`backprism.monitor.read_log`: a cut-off last line (the run is
    still writing, or crashed mid-line) is skipped with a
    :class:`~backprism.monitor.log.TruncatedLogWarning` naming the file, and the returned log
    has ``truncated=True``.

    Raises:
        ValueError: one-line message naming the file if it is missing, empty, not a monitor
            log, cut off inside its header, of an unsupported version, or if a line before
            the last is not a valid JSON record (the message gives the line number).
    """
    p = Path(path)
    try:
        parsed = _read_records(p)
    except _NotJSONLines as err:
        try:
            whole = _whole_json(err.data.decode("utf-8"))
        except UnicodeDecodeError:
            whole = None
        if whole is None:
            raise ValueError(str(err)) from None
        out = _from_output(whole)
        out.source = str(p)
        return out
    log = RunLog(source=str(p), truncated=parsed.truncated)
    log.add(parsed.meta)
    for n, rec in parsed.records:
        try:
            log.add(rec)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"corrupt log {p}: line {n} is not a valid record") from None
    return log


def _whole_json(text: str) -> dict[str, Any] | None:
    """The file as one JSON object written by ``Monitor.write`` (``{key: {step: value}}``)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not data:
        return None
    if not all(isinstance(v, dict) and all(str(s).lstrip("-").isdigit() for s in v)
               for v in data.values()):
        return None
    return data


def _from_output(output: Any) -> RunLog:
    """Normalise what ``Monitor.get_output()`` returns into a :class:`RunLog`.

    Accepts

    * a list of schema records;
    * ``Monitor.get_output()`` / ``Monitor.write``: ``{key: {step: value}}`` where the
      ``Monitor.log`` fields (``epoch``, ``train_loss``, ...) are keys too;
    * ``backprism.monitor.read_log(path, as_frame=False)``:
      ``{"meta": {...}, "steps": [{"step", "values"}], "logs": [...]}``;
    * ``{step: {key: value}}`` (optionally with ``"meta"`` and ``"log"`` entries).
    """
    if isinstance(output, RunLog):
        return output
    if isinstance(output, (list, tuple)):
        return RunLog.from_records(output)
    if isinstance(output, Mapping) and isinstance(output.get("steps"), list):
        log = RunLog()
        if isinstance(output.get("meta"), Mapping):
            log.add({**output["meta"], "kind": "meta"})
        for entry in output["steps"]:
            log.add({"kind": "step", "step": entry["step"], "values": entry.get("values", {})})
        for rec in output.get("logs", []) or []:
            log.add({**rec, "kind": "log"})
        return log
    if isinstance(output, Mapping) and output and all(
        isinstance(k, str) and not k.lstrip("-").isdigit() for k in output
    ) and all(isinstance(v, Mapping) for v in output.values()):
        log = RunLog()
        records: dict[int, dict[str, Any]] = {}
        for key, by_step in output.items():
            if key in LOG_METRICS or key == "epoch":
                for step, value in by_step.items():
                    records.setdefault(int(step), {"step": int(step)})[key] = value
                continue
            if key not in log.quantities:
                log.quantities.append(key)
            for step, value in by_step.items():
                log.steps.setdefault(key, {})[int(step)] = value
        for step in sorted(records):
            log.add({"kind": "log", **records[step]})
        return log
    if isinstance(output, Mapping):
        if "steps" in output and isinstance(output["steps"], Mapping):
            log = RunLog(quantities=list(output.get("quantities", [])))
            for key, series in output["steps"].items():
                items = series.items() if isinstance(series, Mapping) else series
                for step, value in items:
                    log.add({"kind": "step", "step": step, "values": {key: value}})
            for rec in output.get("records", output.get("log", [])) or []:
                log.add({"kind": "log", **rec})
            return log
        log = RunLog()
        if isinstance(output.get("meta"), Mapping):
            log.add({"kind": "meta", **output["meta"]})
        for step, values in output.items():
            if step in ("meta", "log", "records"):
                continue
            if isinstance(values, Mapping):
                log.add({"kind": "step", "step": int(step), "values": dict(values)})
        for rec in output.get("log", output.get("records", [])) or []:
            log.add({"kind": "log", **rec})
        return log
    raise ValueError(f"cannot read a monitor log from {type(output).__name__}")


def load(source: Any) -> RunLog:
    """Turn a path, a :class:`RunLog`, parsed output or a Monitor into a :class:`RunLog`.

    A Monitor (anything with ``get_output()``) is read through ``get_output()``.
    """
    if isinstance(source, RunLog):
        return source
    if isinstance(source, (str, os.PathLike)):
        return read_log(source)
    if hasattr(source, "get_output") and callable(source.get_output):
        # tensors / arrays / NaN → plain JSON values, as in the streamed log
        return _from_output(to_jsonable(source.get_output()))
    return _from_output(source)
