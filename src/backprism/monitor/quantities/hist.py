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
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from backprism.extensions import GradHist
from backprism.extensions.base import Extension
from backprism.monitor.quantities.base import Schedule, SingleStepQuantity, StepData
from backprism.monitor.quantities.bin_adaptation import BinAdaptation, NoAdaptation

__all__ = ["GradHist1d", "GradHist2d"]


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
        self._range = (float(range[0]), float(range[1]))
        self._adapt = NoAdaptation(verbose=verbose) if adapt is None else adapt

    def hyperparameters(self) -> dict[str, Any]:
        return {"bins": self._bins, "range": self._range}

    def _needs_batch(self, step: int) -> bool:
        return self.should_compute(step) or (
            self._adapt.needs_grad_batch and self._adapt.should_compute(step)
        )

    def _ext(self, global_step: int) -> GradHist | None:
        hist = self.should_compute(global_step)
        absmax = self._adapt.needs_grad_batch and self._adapt.should_compute(global_step)
        if not (hist or absmax):
            return None
        return GradHist(
            bins=self._bins if hist else None,
            range=self._range,
            abs_max=absmax,
        )

    def extensions(self, global_step: int) -> list[Extension]:
        ext = self._ext(global_step)
        return [] if ext is None else [ext]

    def track(self, global_step: int, data: StepData) -> None:
        super().track(global_step, data)
        self._maybe_adapt(global_step, data)

    def track_nonfinite(self, global_step: int, data: StepData) -> None:
        super().track_nonfinite(global_step, data)

    def _maybe_adapt(self, global_step: int, data: StepData) -> None:
        if self._adapt.should_compute(global_step):
            m = None
            if self._adapt.needs_grad_batch:
                ext = self._ext(global_step)
                assert ext is not None
                m = max(float(r["abs_max"]) for r in data.fetch(ext))
            self._range = self._adapt.compute(global_step, data.params, m, self._range)

    def _compute(self, global_step: int, data: StepData) -> dict[str, Any]:
        ext = self._ext(global_step)
        assert ext is not None
        hist = sum(r["hist"] for r in data.fetch(ext)).to(torch.float64)
        edges = torch.linspace(
            self._range[0], self._range[1], self._bins + 1, dtype=torch.float64, device="cpu"
        )
        return {"hist": np.asarray(hist.cpu().numpy()), "edges": edges.numpy()}


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
        self._range = [(float(r[0]), float(r[1])) for r in range]
        self._adapt = [NoAdaptation(verbose=verbose) if a is None else a for a in adapt]
        self._keep_individual = keep_individual

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "bins": self._bins,
            "range": tuple(self._range),
            "keep_individual": self._keep_individual,
        }

    def _adapt_batch(self, step: int) -> bool:
        return any(a.needs_grad_batch and a.should_compute(step) for a in self._adapt)

    def _ext(self, global_step: int) -> GradHist | None:
        hist = self.should_compute(global_step)
        absmax = self._adapt_batch(global_step)
        if not (hist or absmax):
            return None
        return GradHist(
            bins=None,
            bins2d=self._bins if hist else None,
            range2d=(self._range[0], self._range[1]),
            abs_max=absmax,
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
                    m = max(float(r["abs_max"]) for r in data.fetch(ext))
                self._range[dim] = adapt.compute(global_step, data.params, m, self._range[dim])

    def _edges(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(  # type: ignore[return-value]
            torch.linspace(lo, hi, b + 1, dtype=torch.float64, device="cpu").numpy()
            for (lo, hi), b in zip(self._range, self._bins)
        )

    def _compute(self, global_step: int, data: StepData) -> dict[str, Any]:
        ext = self._ext(global_step)
        assert ext is not None
        hists = [r["hist2d"] for r in data.fetch(ext)]
        edges = self._edges()
        result: dict[str, Any] = {"hist": sum(hists).cpu().numpy(), "edges": edges}
        if self._keep_individual:
            result["param_groups"] = len(hists)
            for i, h in enumerate(hists):
                result[f"param_{i}"] = {"hist": h.cpu().numpy(), "edges": edges}
        return result
