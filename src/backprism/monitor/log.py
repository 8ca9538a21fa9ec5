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

A crashed run can leave its last line cut off (no trailing newline). Both readers,
:func:`read_log` here and :func:`backprism.plot.logdata.read_log`, skip such a last line with a
:class:`TruncatedLogWarning` (a :class:`UserWarning`); a line that is not valid JSON anywhere
else raises a :class:`ValueError` naming the file and the line number. :class:`LogWriter` in
append mode drops a cut-off last line before it writes (with a warning), so that the new lines
do not merge with the fragment.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import IO, Any, NamedTuple

import numpy as np
import torch

__all__ = ["LOG_VERSION", "LogWriter", "TruncatedLogWarning", "read_log", "to_jsonable"]

LOG_VERSION = 1


class TruncatedLogWarning(UserWarning):
    """A monitor log ends in a cut-off line (a run that is still writing or that crashed):
    the readers skipped it, or :class:`LogWriter` dropped it before appending."""


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
            Before appending, a last line left unfinished by a crashed run (one that is not
            valid JSON, typically without its trailing newline) is cut off the file, so that
            it cannot merge with the new meta line into one unreadable line; a
            :class:`TruncatedLogWarning` names the file and the number of bytes dropped. A file
            without a single complete line (it ends inside its header) is started afresh, also
            with a warning. A complete last record that only lacks its newline is kept.
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
        if mode == "a" and os.path.isfile(self.path):
            _repair_tail(self.path)
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


_BLANK = b" \t\r\n"


def _line_start(f: IO[bytes], end: int) -> int:
    """Offset just after the last newline before offset ``end`` of ``f`` (0 if there is none)."""
    pos = end
    while pos > 0:
        size = min(1 << 16, pos)
        f.seek(pos - size)
        i = f.read(size).rfind(b"\n")
        if i >= 0:
            return pos - size + i + 1
        pos -= size
    return 0


def _repair_tail(path: str) -> None:
    """Make ``path`` end in a complete line before :class:`LogWriter` appends to it.

    The last non-blank line is kept if it is valid JSON (a missing newline is added); otherwise
    it is what a crashed run left half-written, and the file is truncated to just before it
    (to empty if it is the only line: the file ended inside its header), with a
    :class:`TruncatedLogWarning` naming the file and the number of bytes dropped.
    """
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while True:  # the last non-blank line is f[start:end]
            start = _line_start(f, end)
            f.seek(start)
            line = f.read(end - start)
            if line.strip(_BLANK) or start == 0:
                break
            end = start - 1  # before that line's newline
        if not line.strip(_BLANK):
            return  # empty or blank file: nothing to repair
        try:
            json.loads(line.decode("utf-8"))
        except ValueError:  # JSONDecodeError, UnicodeDecodeError: a cut-off line
            f.truncate(start)
            if start == 0:
                msg = (
                    f"monitor log {path} ends inside its header (no complete first line): "
                    f"dropped its {size} bytes and started it afresh"
                )
            else:
                msg = (
                    f"monitor log {path} ends in a cut-off line (left by an interrupted run): "
                    f"dropped its last {size - start} bytes before appending"
                )
            warnings.warn(msg, TruncatedLogWarning, stacklevel=3)
            return
        f.seek(size - 1)
        if f.read(1) != b"\n":
            f.write(b"\n")  # a complete record that only lacks its newline


class _Records(NamedTuple):
    """A monitor log as parsed by :func:`_read_records`."""

    meta: dict[str, Any]
    """The first line (the ``meta`` record, version checked)."""
    records: list[tuple[int, dict[str, Any]]]
    """``(line number, record)`` of every later record, in file order."""
    truncated: bool
    """Whether a cut-off last line was skipped."""


class _NotJSONLines(ValueError):
    """The first line of a file is not JSON. ``data`` holds the file's bytes, so that a caller
    can try another format (:func:`backprism.plot.logdata.read_log` accepts the one-object
    JSON of ``Monitor.write``)."""

    def __init__(self, message: str, data: bytes) -> None:
        super().__init__(message)
        self.data = data


_META_START = '{"kind":"meta"'


def _header_error(path: str, line: bytes, alone: bool) -> str:
    """Message for a first line that is not JSON (``alone``: no other line follows)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return f"not a backprism monitor log (binary file): {path}"
    compact = re.sub(r"\s+", "", text[:200])
    if _META_START[1:] in compact or (alone and _META_START.startswith(compact)):
        return f"log file is truncated inside its header: {path}"
    return f"not a backprism monitor log (first line is not JSON): {path}"


def _valid(rec: Mapping[str, Any]) -> bool:
    """Whether a record has the fields its ``kind`` needs (unknown kinds are accepted)."""
    kind = rec.get("kind")
    try:
        if kind == "meta":
            return isinstance(rec.get("quantities", []), list)
        if kind == "step":
            int(rec["step"])
            return rec.get("values") is None or isinstance(rec["values"], dict)
        if kind == "log" and rec.get("step") is not None:
            int(rec["step"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


def _read_records(path: str | os.PathLike) -> _Records:
    """Parse a monitor log into its records; shared by both ``read_log`` functions.

    A last line that is not valid JSON (cut off by a run that is still writing or crashed) is
    skipped with a :class:`TruncatedLogWarning` naming the file.

    Raises:
        ValueError: one-line message naming the file if it is missing, a directory, empty, not
            a monitor log (:class:`_NotJSONLines` if its first line is not JSON), cut off inside
            its header, of an unsupported version, or if a line other than the last is not a
            valid JSON record (the message gives its line number).
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise ValueError(f"log file not found (no such file): {p}")
    if os.path.isdir(p):
        raise ValueError(f"log path is a directory, not a file: {p}")
    with open(p, "rb") as f:
        data = f.read()
    lines = [(n, line) for n, line in enumerate(data.split(b"\n"), 1) if line.strip(_BLANK)]
    if not lines:
        raise ValueError(f"log file is empty: {p}")
    last = lines[-1][0]
    meta: dict[str, Any] | None = None
    records: list[tuple[int, dict[str, Any]]] = []
    truncated = False
    for n, line in lines:
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            if meta is None:
                raise _NotJSONLines(_header_error(p, line, alone=n == last), data) from None
            if n == last:
                truncated = True
                break
            raise ValueError(f"corrupt log {p}: line {n} is not valid JSON") from None
        if meta is None:
            if not isinstance(rec, dict) or rec.get("kind") != "meta":
                raise ValueError(
                    f"not a backprism monitor log (first line is not a meta record): {p}"
                )
            version = rec.get("version")
            if version != LOG_VERSION:
                raise ValueError(
                    f"unsupported monitor log version {version!r} in {p} "
                    f"(this backprism reads version {LOG_VERSION})"
                )
            if not _valid(rec):
                raise ValueError(f"corrupt log {p}: line {n} is not a valid record")
            meta = rec
            continue
        if not isinstance(rec, dict):
            raise ValueError(f"corrupt log {p}: line {n} is not a JSON object")
        if not _valid(rec):
            raise ValueError(f"corrupt log {p}: line {n} is not a valid record")
        records.append((n, rec))
    assert meta is not None
    if truncated:
        warnings.warn(
            f"monitor log {p}: the last line is cut off (run still writing or crashed); "
            "it was skipped",
            TruncatedLogWarning,
            stacklevel=3,
        )
    return _Records(meta, records, truncated)


def read_log(path: str | os.PathLike, as_frame: bool = True) -> Any:
    """Read a monitor log written by :class:`LogWriter`.

    A cut-off last line (the run is still writing, or crashed mid-line) is skipped with a
    :class:`TruncatedLogWarning` naming the file, exactly as
    :func:`backprism.plot.logdata.read_log` does (both use the same parser).

    Args:
        path: the ``.jsonl`` file.
        as_frame: return a :class:`pandas.DataFrame` with one row per step (sorted), a ``step``
            column, one column per quantity key (missing values ``NaN``/``None``) and the
            ``Monitor.log`` fields (``epoch``, ``train_loss``, ...) merged by step. Otherwise
            return ``{"meta": {...}, "steps": [{"step": s, "values": {...}}, ...],
            "logs": [...]}`` with the ``step`` lines of one step merged.

    Raises:
        ValueError: one-line message naming the file if it is missing, empty, not a backprism
            monitor log, cut off inside its header, of an unsupported version, or if a line
            before the last is not a valid JSON record (the message gives the line number).
    """
    try:
        parsed = _read_records(path)
    except _NotJSONLines as err:
        raise ValueError(str(err)) from None
    keys = list(parsed.meta.get("quantities", []))
    steps: dict[int, dict[str, Any]] = {}
    logs = []
    for _, rec in parsed.records:
        kind = rec.get("kind")
        if kind == "meta":
            keys += [k for k in rec.get("quantities", []) if k not in keys]
        elif kind == "step":
            steps.setdefault(int(rec["step"]), {}).update(rec.get("values") or {})
        elif kind == "log":
            logs.append(rec)
    meta = dict(parsed.meta)
    meta["quantities"] = keys
    data = {
        "meta": meta,
        "steps": [{"step": s, "values": steps[s]} for s in sorted(steps)],
        "logs": logs,
    }
    if not as_frame:
        return data
    import pandas as pd

    rows: dict[int, dict[str, Any]] = {}
    for entry in data["steps"]:
        rows.setdefault(entry["step"], {}).update(entry["values"])
    for rec in data["logs"]:
        if rec.get("step") is None:
            continue  # a log record without a step has no row
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
