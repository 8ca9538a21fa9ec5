r"""Histograms of individual gradient elements (Cockpit's ``GradHist1d`` / ``GradHist2d``).

Individual gradients are ``gₙ = ∇ℓₙ = N·grad_batch[n]`` (mean reduction). The engine extension
:class:`~backprism.extensions.GradHist` bins them during the backward pass, layer by layer and a
few samples at a time (``grad_batch`` is never materialised for a whole layer); the
per-parameter counts are summed over parameters. Exact binning costs ``O(N·D)`` per tracked step.
GradHist1d and GradHist2d tracked together share one pass (the monitor merges the requests).

* **GradHist1d** (``bins=100``, ``range=(-2, 2)``): every element ``gₙᵢ`` is clipped to
  ``[start, end]`` and counted in ``bins`` equal bins (the last bin includes ``end``), i.e.
  ``numpy.histogram(clip(g, start, end), bins, (start, end))``. Value:
  ``{"hist": [bins], "edges": [bins + 1]}``. ``adapt`` (e.g. ``GradAbsMax``) moves the range
  for later steps.
* **GradHist2d** (``bins=(40, 50)``, ``range=((-1, 1), (-2, 2))``): pairs
  ``(gₙᵢ, θᵢ)`` (x = individual gradient element, y = parameter value), each coordinate clipped
  to the centers of its outermost bins, counted in ``[xbins, ybins]`` bins, i.e.
  ``numpy.histogram2d``. Value: ``{"hist": [xbins, ybins], "edges": (xedges, yedges)}``; with
  ``keep_individual=True`` also ``"param_groups": P`` and ``"param_<i>": {"hist", "edges"}``.

Binning runs on the device (:class:`~backprism.monitor.histograms.MonitorGradHist`), counts
and edges reach the host with the other values of the step. A range moved by ``adapt`` stays a
pair of device tensors (read ``quantity._range`` for host floats); the histogram of a step is
binned with the range in force before that step's adaptation. When the monitor streams its log,
only the first and the latest histogram stay in memory (the dashboard draws those).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from backprism.extensions.base import Extension
from backprism.monitor.histograms import MonitorGradHist, device_edges
from backprism.monitor.quantities.base import Pending, Schedule, SingleStepQuantity, StepData
from backprism.monitor.quantities.bin_adaptation import BinAdaptation, NoAdaptation

__all__ = ["GradHist1d", "GradHist2d"]

Range = tuple[Tensor, Tensor]


def _host_edges(rng: tuple[float, float], bins: int) -> np.ndarray:
    """``numpy.linspace(lo, hi, bins + 1)`` (static limits: computed on the host, no tensor)."""
    return np.linspace(rng[0], rng[1], bins + 1, dtype=np.float64)


def _host_range(rng: Range) -> tuple[float, float]:
    return float(rng[0]), float(rng[1])


def _adapted(
    new: Any, old_static: tuple[float, float], old: Range | None, data: StepData
) -> tuple[tuple[float, float], Range | None]:
    """The range after an adaptation: ``(static floats, device tensors or None)``; a device
    range keeps its old value on a step whose loss or gradients are not finite."""
    if not any(isinstance(x, Tensor) for x in new):
        return (float(new[0]), float(new[1])), None
    dev = data.device
    lo, hi = (torch.as_tensor(x, dtype=torch.float64).to(dev).reshape(()) for x in new)
    if old is None:
        old = (
            torch.tensor(old_static[0], dtype=torch.float64, device=dev),
            torch.tensor(old_static[1], dtype=torch.float64, device=dev),
        )
    flag = data.finite_t
    if flag is not None:
        lo, hi = torch.where(flag, lo, old[0]), torch.where(flag, hi, old[1])
    return old_static, (lo, hi)


def _abs_max(results: list[dict[str, Tensor]], data: StepData) -> Tensor:
    dev = data.device
    return torch.stack([r["abs_max"].to(dev, torch.float64) for r in results]).max()


class GradHist1d(SingleStepQuantity):
    """1d histogram of individual gradient elements.

    Args:
        track_schedule: steps at which it is computed.
        verbose: print values.
        bins: number of bins (default 100).
        range: ``(start, end)`` (default ``(-2, 2)``); values outside are clipped into the
            outermost bins.
        adapt: a :class:`~backprism.monitor.quantities.bin_adaptation.BinAdaptation` policy
            (default: none).
    """

    per_sample = True
    large_values = True

    def __init__(
        self,
        track_schedule: Schedule,
        verbose: bool = False,
        bins: int = 100,
        range: tuple[float, float] = (-2, 2),
        adapt: BinAdaptation | None = None,
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._bins = int(bins)
        self._range0 = (float(range[0]), float(range[1]))
        self._init_range = self._range0
        self._range_t: Range | None = None
        self._adapt = NoAdaptation(verbose=verbose) if adapt is None else adapt

    @property
    def _range(self) -> tuple[float, float]:
        """The current limits as host floats (reads a device range: not for use in a step)."""
        return self._range0 if self._range_t is None else _host_range(self._range_t)

    @_range.setter
    def _range(self, value: tuple[float, float]) -> None:
        self._range0, self._range_t = (float(value[0]), float(value[1])), None

    def hyperparameters(self) -> dict[str, Any]:
        return {"bins": self._bins, "range": self._init_range}

    def _needs_batch(self, step: int) -> bool:
        return self.should_compute(step) or (
            self._adapt.needs_grad_batch and self._adapt.should_compute(step)
        )

    def _ext(self, global_step: int) -> MonitorGradHist | None:
        hist = self.should_compute(global_step)
        absmax = self._adapt.needs_grad_batch and self._adapt.should_compute(global_step)
        if not (hist or absmax):
            return None
        return MonitorGradHist(
            bins=self._bins if hist else None,
            range=self._range0,
            abs_max=absmax,
            range_dev=self._range_t,
            range_id=0 if self._range_t is None else id(self),
        )

    def extensions(self, global_step: int) -> list[Extension]:
        ext = self._ext(global_step)
        return [] if ext is None else [ext]

    def track(self, global_step: int, data: StepData) -> None:
        super().track(global_step, data)
        self._maybe_adapt(global_step, data)

    def _maybe_adapt(self, global_step: int, data: StepData) -> None:
        if self._adapt.should_compute(global_step):
            m = None
            if self._adapt.needs_grad_batch:
                ext = self._ext(global_step)
                assert ext is not None
                m = _abs_max(data.fetch(ext), data)
            current = self._range0 if self._range_t is None else self._range_t
            new = self._adapt.compute(global_step, data.params, m, current)
            self._range0, self._range_t = _adapted(new, self._range0, self._range_t, data)

    def _compute(self, global_step: int, data: StepData) -> Pending:
        ext = self._ext(global_step)
        assert ext is not None
        dev = data.device
        hist = torch.stack([r["hist"].to(dev) for r in data.fetch(ext)]).sum(0)
        if self._range_t is None:
            edges = _host_edges(self._range0, self._bins)
            return Pending([hist], lambda a: {"hist": a[0], "edges": edges})
        edges_t = device_edges(self._range_t[0], self._range_t[1], self._bins)
        return Pending([hist, edges_t], lambda a: {"hist": a[0], "edges": a[1]})


class GradHist2d(SingleStepQuantity):
    """2d histogram of individual gradient elements (x) over parameter values (y).

    Args:
        track_schedule: steps at which it is computed.
        verbose: print values.
        bins: ``(xbins, ybins)`` (default ``(40, 50)``).
        range: ``((xmin, xmax), (ymin, ymax))`` (default ``((-1, 1), (-2, 2))``).
        adapt: ``(x policy, y policy)``, ``None`` for no adaptation (default).
        keep_individual: also keep each parameter's histogram (default ``False``).
    """

    per_sample = True
    large_values = True

    def __init__(
        self,
        track_schedule: Schedule,
        verbose: bool = False,
        bins: tuple[int, int] = (40, 50),
        range: tuple[tuple[float, float], tuple[float, float]] = ((-1, 1), (-2, 2)),
        adapt: tuple[BinAdaptation | None, BinAdaptation | None] = (None, None),
        keep_individual: bool = False,
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._bins = (int(bins[0]), int(bins[1]))
        self._range0 = [(float(r[0]), float(r[1])) for r in range]
        self._init_range = tuple(self._range0)
        self._range_t: list[Range | None] = [None, None]
        self._adapt = [NoAdaptation(verbose=verbose) if a is None else a for a in adapt]
        self._keep_individual = keep_individual

    @property
    def _range(self) -> list[tuple[float, float]]:
        """The current limits as host floats (reads device ranges: not for use in a step)."""
        return [
            r0 if rt is None else _host_range(rt) for r0, rt in zip(self._range0, self._range_t)
        ]

    @_range.setter
    def _range(self, value: Any) -> None:
        self._range0 = [(float(r[0]), float(r[1])) for r in value]
        self._range_t = [None, None]

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "bins": self._bins,
            "range": self._init_range,
            "keep_individual": self._keep_individual,
        }

    def _adapt_batch(self, step: int) -> bool:
        return any(a.needs_grad_batch and a.should_compute(step) for a in self._adapt)

    def _ext(self, global_step: int) -> MonitorGradHist | None:
        hist = self.should_compute(global_step)
        absmax = self._adapt_batch(global_step)
        if not (hist or absmax):
            return None
        dynamic = any(r is not None for r in self._range_t)
        return MonitorGradHist(
            bins=None,
            bins2d=self._bins if hist else None,
            range2d=(self._range0[0], self._range0[1]),
            abs_max=absmax,
            range2d_dev=(self._range_t[0], self._range_t[1]),
            range2d_id=id(self) if dynamic else 0,
        )

    def extensions(self, global_step: int) -> list[Extension]:
        ext = self._ext(global_step)
        return [] if ext is None else [ext]

    def track(self, global_step: int, data: StepData) -> None:
        ext = self._ext(global_step)
        super().track(global_step, data)
        for dim, adapt in enumerate(self._adapt):
            if adapt.should_compute(global_step):
                m = None
                if adapt.needs_grad_batch:
                    assert ext is not None
                    m = _abs_max(data.fetch(ext), data)
                rt = self._range_t[dim]
                current = self._range0[dim] if rt is None else rt
                new = adapt.compute(global_step, data.params, m, current)
                self._range0[dim], self._range_t[dim] = _adapted(new, self._range0[dim], rt, data)

    def _compute(self, global_step: int, data: StepData) -> Pending:
        ext = self._ext(global_step)
        assert ext is not None
        dev = data.device
        hists = [r["hist2d"].to(dev) for r in data.fetch(ext)]
        total = torch.stack(hists).sum(0)
        tensors = [total, *(hists if self._keep_individual else [])]
        static: list[np.ndarray | None] = []
        for (r0, rt), b in zip(zip(self._range0, self._range_t), self._bins):
            if rt is None:
                static.append(_host_edges(r0, b))
            else:
                static.append(None)
                tensors.append(device_edges(rt[0], rt[1], b))
        keep = self._keep_individual
        count = len(hists)

        def build(a: list[np.ndarray]) -> dict[str, Any]:
            pos = 1 + (count if keep else 0)
            edges = []
            for e in static:
                if e is None:
                    edges.append(a[pos])
                    pos += 1
                else:
                    edges.append(e)
            pair = (edges[0], edges[1])
            counts = [x.astype(np.int64) for x in a[: 1 + (count if keep else 0)]]
            result: dict[str, Any] = {"hist": counts[0], "edges": pair}
            if keep:
                result["param_groups"] = count
                for i in range(count):
                    result[f"param_{i}"] = {"hist": counts[1 + i], "edges": pair}
            return result

        return Pending(tensors, build)
