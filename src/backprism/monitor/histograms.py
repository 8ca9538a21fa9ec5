r"""Gradient-element histograms binned on the device, with ranges that may live there too.

:class:`MonitorGradHist` is the engine's :class:`~backprism.extensions.GradHist` (same
attribute, same counts, same chunking over samples) for the monitor's histogram quantities,
with two differences:

* **Device-side binning.** On accelerators (and on the CPU inside
  :func:`~backprism.monitor.deferred.accelerator_paths`) every element is binned with
  elementwise operations and counted with ``torch.histc`` over the bin indices, a chunk of at
  most ``2**24`` elements at a time (float counts are exact below ``2**24``). Nothing reads a
  value on the host: no ``bincount`` (its CUDA kernel reads the input's extremes), no
  ``nonzero`` or data-dependent shapes, no finiteness test — NaN elements are simply not
  counted (the monitor records NaN for such steps anyway). On the CPU the engine's algorithms
  are used instead (``bincount`` and, for Linear weights, the rank-one counts that avoid
  building per-sample gradients), since reading values costs nothing there.
* **Ranges on the device.** A range moved by a bin-adaptation policy is a pair of 0-dim device
  tensors (``range_dev``/``range2d_dev``), never read on the host during the step: the bin
  coordinate ``t = a·v + c`` takes ``a = s·bins/(hi − lo)`` and ``c = −lo·bins/(hi − lo)`` as
  tensors, ``c`` nudged so that exact zeros land in the bin ``numpy.histogram`` gives them (the
  edges are computed on the device with ``numpy.linspace``'s arithmetic, :func:`device_edges`):
  the engine's :func:`~backprism.extensions.projections.affine_tensors`, the one computation of
  ``(a, c)`` that static ranges use too.

Bin index of an element: ``⌊clamp(a·v + c, 0, bins − 1)⌋`` (clipping into the outermost bins;
GradHist2d's clipping to the outermost bin centres gives the same index), counted as
``histc(index, size, −½, size − ½)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from backprism.engine.rule import Call, Rule
from backprism.extensions import GradHist
from backprism.extensions.projections import (
    _affine,
    _first_tensor,
    _one_column,
    _raw,
    _slice_call,
    _slice_cols,
    affine_tensors,
    device_edges,
)
from backprism.monitor.deferred import host_fast_paths

__all__ = ["MonitorGradHist", "device_edges"]

#: elements counted by one ``histc`` call: float32 counts are exact below 2**24
_HISTC_ELEMENTS = 2**24

Range = tuple[Tensor, Tensor]


def _device_affine(v: Tensor, scale: float, rng: Range, bins: int) -> tuple[Tensor, Tensor]:
    """``(a, c)`` of the bin coordinate ``a·v + c`` for a device range (0-dim tensors in
    ``v``'s dtype), :func:`~backprism.extensions.projections.affine_tensors` as for a static
    range."""
    a, c = affine_tensors(scale, rng[0], rng[1], bins, v.dtype)
    return a.to(v.dtype), c


def _coordinate(
    v: Tensor, scale: float, static: tuple[float, float], dynamic: Range | None, bins: int
) -> Tensor:
    """Bin indices as a float tensor (NaN stays NaN): ``⌊clamp(a·v + c, 0, bins − 1)⌋``."""
    if v.dtype not in (torch.float32, torch.float64):
        v = v.to(torch.float32)
    if dynamic is None:
        a, c = _affine(v, scale, static[0], static[1], bins)
        return (v * a).add_(c).clamp_(0, bins - 1).floor_()
    a_t, c_t = _device_affine(v, scale, dynamic, bins)
    return (v * a_t).add_(c_t).clamp_(0, bins - 1).floor_()


def _count(t: Tensor, size: int) -> Tensor:
    """Counts (int64 ``[size]``) of the integer-valued float tensor ``t`` (NaN not counted).

    ``histc`` (shared-memory histograms on CUDA) unless deterministic algorithms are requested
    (``histc`` has no deterministic CUDA kernel): then an accumulating ``index_put_`` with NaN
    sent to an extra bin that is dropped."""
    flat = t.reshape(-1)
    if torch.are_deterministic_algorithms_enabled():
        idx = torch.nan_to_num(flat, nan=float(size)).long()
        out = torch.zeros(size + 1, dtype=torch.int64, device=t.device)
        out.index_put_((idx,), torch.ones_like(idx), accumulate=True)
        return out[:size]
    out = torch.zeros(size, dtype=torch.int64, device=t.device)
    for start in range(0, flat.numel(), _HISTC_ELEMENTS):
        part = flat[start : start + _HISTC_ELEMENTS]
        out += torch.histc(part, bins=size, min=-0.5, max=size - 0.5).to(torch.int64)
    return out


class MonitorGradHist(GradHist):
    """:class:`~backprism.extensions.GradHist` with device-side binning and device ranges
    (module doc). Arguments as ``GradHist``, plus

    Args:
        range_dev: ``(lo, hi)`` 0-dim tensors replacing ``range`` (adapted ranges), or ``None``.
        range2d_dev: ``((xa, xb), (ya, yb))`` tensors (``None`` entries keep ``range2d``'s).
        range_id: distinguishes requests whose device 1d ranges differ (request merging
            compares the extensions' public attributes); 0 for static ranges.
        range2d_id: the same for the 2d ranges.
    """

    def __init__(
        self,
        bins: int | None = 100,
        range: tuple[float, float] = (-2.0, 2.0),
        bins2d: tuple[int, int] | None = None,
        range2d: tuple[tuple[float, float], tuple[float, float]] = ((-1.0, 1.0), (-2.0, 2.0)),
        abs_max: bool = False,
        scale: float | None = None,
        chunk_elements: int = 2**20,
        range_dev: Range | None = None,
        range2d_dev: tuple[Range | None, Range | None] | None = None,
        range_id: int = 0,
        range2d_id: int = 0,
    ) -> None:
        super().__init__(bins, range, bins2d, range2d, abs_max, scale, chunk_elements)
        self._range_dev = range_dev
        self._range2d_dev = range2d_dev or (None, None)
        self.range_id = int(range_id)
        self.range2d_id = int(range2d_id)

    # -- the CPU: the engine's algorithms, with host copies of device ranges -----------------
    def _plain(self) -> GradHist:
        if self._range_dev is None and self._range2d_dev == (None, None):
            return self

        def host(r: Range | None, default: tuple[float, float]) -> tuple[float, float]:
            return default if r is None else (float(r[0]), float(r[1]))

        return GradHist(
            bins=self.bins,
            range=host(self._range_dev, self.range),
            bins2d=self.bins2d,
            range2d=(  # type: ignore[arg-type]
                host(self._range2d_dev[0], self.range2d[0]),
                host(self._range2d_dev[1], self.range2d[1]),
            ),
            abs_max=self.abs_max,
            scale=self.scale,
            chunk_elements=self.chunk_elements,
        )

    # -- device-side reduction -----------------------------------------------------------------
    def _y_coord(self, param: Tensor, like: Tensor) -> Tensor:
        """Parameter-value bin indices of the 2d histogram (float, in ``like``'s dtype)."""
        assert self.bins2d is not None
        p = param.detach().to(like.dtype if like.is_floating_point() else torch.float32)
        t = _coordinate(p, 1.0, self.range2d[1], self._range2d_dev[1], self.bins2d[1])
        return t.to(like.dtype if like.dtype in (torch.float32, torch.float64) else t.dtype)

    def _reduce_dev(
        self, acc: dict[str, Tensor], v: Tensor, scale: float, y: Tensor | None
    ) -> None:
        if self.abs_max:
            lo_, hi_ = torch.aminmax(v)
            m = torch.maximum(hi_, -lo_) * abs(scale)
            acc["abs_max"] = torch.maximum(acc["abs_max"], m.to(acc["abs_max"].dtype))
        if self.bins is not None:
            t = _coordinate(v, scale, self.range, self._range_dev, self.bins)
            acc["hist"] += _count(t, self.bins)
        if self.bins2d is not None:
            assert y is not None
            xbins, ybins = self.bins2d
            t = _coordinate(v, scale, self.range2d[0], self._range2d_dev[0], xbins)
            t = t.mul_(ybins).add_(y.to(t.dtype))
            acc["hist2d"] += _count(t, xbins * ybins)

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        ref = _first_tensor(g)
        if host_fast_paths(ref):
            plain = self._plain()
            cls = GradHist if plain is self else type(plain)
            return cls.from_rule(plain, rule, call, g, weights)
        n = call.batch_size
        scale = float(n if self.scale is None else self.scale)
        memo, raw = rule, _raw(rule)
        params = call.params
        accs = {name: self._empty(ref) for name in params}
        ys = (
            {name: self._y_coord(p, ref) for name, p in params.items()}
            if self.bins2d is not None
            else {}
        )
        per_sample = max(1, sum(p.numel() for p in params.values()))
        step = max(1, self.chunk_elements // per_sample)
        norms: dict[str, list[Tensor]] | None = (
            {name: [] for name in params} if hasattr(memo, "provide") and _one_column(g) else None
        )
        for start in range(0, n, step):
            stop = min(n, start + step)
            sub = call if (start, stop) == (0, n) else _slice_call(call, start, stop)
            ps = raw.per_sample(sub, _slice_cols(g, start, stop, n))
            for name, v in ps.items():
                if name not in accs:
                    continue
                v0 = v[0].detach()
                self._reduce_dev(accs[name], v0, scale, ys.get(name))
                if norms is not None:
                    norms[name].append(v0.reshape(v0.shape[0], -1).square().sum(1))
            del ps
        if norms is not None and all(norms.values()):
            memo.provide("batch_l2", call, g, value={k: torch.cat(v) for k, v in norms.items()})
        return {name: self._finish(acc) for name, acc in accs.items()}

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        if host_fast_paths(dense):
            plain = self._plain()
            cls = GradHist if plain is self else type(plain)
            return cls.from_dense(plain, dense, call, weights)
        d = dense[0]
        n = d.shape[0]
        scale = float(n if self.scale is None else self.scale)
        acc = self._empty(d)
        y = None
        if self.bins2d is not None:
            from backprism.extensions.projections import _dense_param

            y = self._y_coord(_dense_param(call, d), d)
        step = max(1, self.chunk_elements // max(1, d[0].numel()))
        for start in range(0, n, step):
            self._reduce_dev(acc, d[start : start + step].detach(), scale, y)
        return self._finish(acc)
