r"""First-order extensions that reduce per-sample gradients on the fly.

With ``grad_batch[n] = ∇(ℓₙ/N)`` (mean reduction; ``∇ℓₙ`` for ``"sum"``):

=================  ===================  ==========================================================
extension          attribute            value
=================  ===================  ==========================================================
BatchDotWith(v)    ``batch_dot_with``   ``[N]``: ``⟨grad_batch[n], v_p⟩`` for a given vector
                                        ``v_p`` per parameter (``0`` where none is given)
BatchProjGrad      ``batch_proj_grad``  ``[N]``: ``⟨grad_batch[n], ∇L⟩ = Σₘ batch_dot[n, m]``
GradHist(...)      ``grad_hist``        ``dict``: histograms of the elements of the individual
                                        gradients ``gₙ = s·grad_batch[n]`` (``s = N`` by default)
=================  ===================  ==========================================================

Neither materialises ``grad_batch`` for a whole layer:

* ``BatchDotWith`` uses the rules' :meth:`~backprism.engine.rule.Rule.batch_dot_with`
  (Linear: ``δₙᵀ V xₙ``; convolutions: ``⟨δₙ, conv(xₙ, V)⟩``; other layers: from
  ``per_sample``). It is linear in the per-sample gradients, so calls of a shared parameter are
  summed directly.
* ``GradHist`` builds the per-sample gradients of a layer ``chunk_elements`` at a time (a few
  samples), bins them and frees them, so peak memory stays a few chunks. The cost is exact
  binning of all ``N·D`` elements per step.

**GradHist binning** (the same as ``numpy.histogram`` / ``numpy.histogram2d`` after clipping):

* 1d (``bins``, ``range=(a, b)``): every element is clipped to ``[a, b]`` and counted in ``bins``
  equal bins (last bin closed): index ``⌊(clip(g) − a)/w⌋`` clamped to ``[0, bins − 1]``,
  ``w = (b − a)/bins``;
* 2d (``bins2d=(X, Y)``, ``range2d=((xa, xb), (ya, yb))``): pairs ``(gₙᵢ, θᵢ)``, each coordinate
  clipped to the centres of its outermost bins, counted in ``[X, Y]`` bins;
* ``abs_max``: ``maxₙᵢ |gₙᵢ|``.

Under distributed data parallelism (:mod:`backprism.engine.distributed`, ``ρ = N_r/N`` for a
mean loss): ``batch_dot_with`` and ``batch_proj_grad`` are this rank's rows of the global batch's
(``ρ⟨grad_batch_r[n], v⟩``, and ``ρ⟨grad_batch_r[n], G⟩`` with the global gradient ``G`` of
the pass); ``grad_hist`` counts ``s·grad_batch`` of the global batch over all ranks (the engine
hands it rows already scaled for the global batch; the default ``scale=None`` takes ``s`` as the
global batch size ``N``) and ``abs_max`` is the maximum over the ranks.

The result per parameter is a dict with the requested entries ``"hist"`` (``[bins]``),
``"hist2d"`` (``[X, Y]``) (int64 counts) and ``"abs_max"`` (0-dim tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from backprism.engine.backward import current_pass
from backprism.engine.extension import CatPart, GlobalBatch, SumPart
from backprism.engine.rule import Call, Rule
from backprism.extensions.base import FirstOrderExtension, PerSampleRows
from backprism.rules.linear import LinearRule

__all__ = ["BatchDotWith", "BatchProjGrad", "GradHist"]


def _raw(rule: Any) -> Rule:
    """The rule behind the engine's per-call memo (which keys by argument ids: our temporary
    vector dicts and sample slices must not hit it)."""
    return getattr(rule, "_rule", rule)


def _one_column(g: Any) -> bool:
    """Whether the backpropagated quantity has a single column (first order: the gradient)."""
    return isinstance(g, Tensor) and g.shape[0] == 1


def _first_tensor(g: Any) -> Tensor:
    return g[0] if isinstance(g, tuple) else g


class BatchDotWith(PerSampleRows, FirstOrderExtension):
    """Projections ``batch_dot_with[n] = ⟨grad_batch[n], v_p⟩`` of shape ``[N]``.

    Args:
        vectors: ``{param: v_p}`` (or ``(param, v_p)`` pairs) with ``v_p`` of the parameter's
            shape; parameters without a vector get zeros.
    """

    savefield = "batch_dot_with"
    additive = True

    def __init__(self, vectors: Mapping[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]]):
        pairs = vectors.items() if isinstance(vectors, Mapping) else vectors
        self._vectors: dict[int, Tensor] = {}
        for p, v in pairs:
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(
                    f"BatchDotWith: vector of shape {tuple(v.shape)} for a parameter of shape "
                    f"{tuple(p.shape)}"
                )
            self._vectors[id(p)] = v.detach()
        #: distinguishes requests with different vectors (merging by hyperparameters)
        self.vectors_id = id(self._vectors)

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        wanted = {
            name: self._vectors[id(p)] for name, p in call.params.items() if id(p) in self._vectors
        }
        out = dict(_raw(rule).batch_dot_with(call, g, wanted)) if wanted else {}
        ref = _first_tensor(g)
        for name in call.params:
            if name not in out:
                out[name] = ref.new_zeros(call.batch_size)
        return out

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        raise NotImplementedError  # additive: never called


class BatchProjGrad(FirstOrderExtension):
    r"""Projections onto the parameter's own gradient of the pass,
    ``batch_proj_grad[n] = ⟨grad_batch[n], ∇L⟩ = Σₘ batch_dot[n, m]``, shape ``[N]``.

    Linear layers without middle axes take the row sums of their ``batch_dot``
    (``(δδᵀ ∘ xxᵀ)·1``, cost ``N²(O + I)``, shared with ``BatchDotGrad``); other layers wait for
    the parameter's gradient ``G`` of the same backward pass and use
    :meth:`~backprism.engine.rule.Rule.batch_dot_with` (convolutions: ``⟨δₙ, conv(xₙ, G)⟩``, the
    cost of a forward convolution, instead of ``[N, O, I]`` per-sample gradients and ``N²·D``).
    """

    savefield = "batch_proj_grad"
    additive = True
    needs_param_grad = True

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        raw = _raw(rule)
        x = call.args[0] if call.args and isinstance(call.args[0], Tensor) else None
        group = getattr(call, "group", None)
        single = group is not None and all(
            group.param_count[id(p)] <= 1 for p in call.params.values()
        )  # a shared parameter needs the total gradient, not this call's part
        bp = current_pass()
        if bp is not None and bp.distributed is not None:  # needs the global gradient
            single = False
        if single and isinstance(raw, LinearRule) and x is not None and x.dim() == 2:
            return {k: ("done", v.sum(1)) for k, v in rule.batch_dot(call, g).items()}
        return {name: ("wait", raw, call, g, name) for name in call.params}

    def finish(self, partial: tuple, grad: Tensor) -> Tensor:
        if partial[0] == "done":
            return partial[1]
        if partial[0] == "scaled":  # distributed: ρ⟨grad_batch_r[n], G⟩
            return self.finish(partial[2], grad) * partial[1]
        _, rule, call, g, name = partial
        return rule.batch_dot_with(call, g, {name: grad})[name]

    def distributed_unsupported(self, params: list) -> str | None:
        return None

    def distributed_result(self, value: tuple, reduced: list[Tensor], batch: GlobalBatch) -> Any:
        return ("scaled", batch.loss_weight, value)


def _slice_call(call: Call, start: int, stop: int) -> Call:
    """The call restricted to samples ``start:stop`` (views of tensors with the batch axis)."""
    n = call.batch_size

    def take(x: Any) -> Any:
        if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == n:
            return x[start:stop]
        return x

    new = replace(
        call,
        args=tuple(take(a) for a in call.args),
        kwargs={k: take(v) for k, v in call.kwargs.items()},
        batch_size=stop - start,
        versions=[],
    )
    new.group = getattr(call, "group", None)  # type: ignore[attr-defined]
    new.out_shapes = [
        s if len(s) == 0 or s[0] != n else torch.Size((stop - start, *s[1:]))
        for s in call.out_shapes
    ]
    return new


def _slice_cols(g: Any, start: int, stop: int, n: int) -> Any:
    if isinstance(g, tuple):
        return tuple(_slice_cols(x, start, stop, n) for x in g)
    if g.dim() > 1 and g.shape[1] == n:
        return g[:, start:stop]
    return g


def _index_dtype(size: int) -> torch.dtype:
    """Smallest integer type holding ``size`` bin indices (narrow types convert and count
    fastest; measured on CPU: uint8 < int16 < int32 < int64)."""
    if size <= 256:
        return torch.uint8
    if size <= 2**15:
        return torch.int16
    return torch.int32


def _affine(v: Tensor, scale: float, lo: float, hi: float, bins: int) -> tuple[float, float]:
    return _affine_cached(v.dtype == torch.float64, scale, lo, hi, bins)


@functools.lru_cache(maxsize=256)
def _affine_cached(
    double: bool, scale: float, lo: float, hi: float, bins: int
) -> tuple[float, float]:
    """``(a, c)`` with bin coordinate ``t = a·v + c = (scale·v − lo)·bins/(hi − lo)``: a static
    range's :func:`affine_tensors` as Python floats (computed on the CPU once per range)."""
    dtype = torch.float64 if double else torch.float32
    lo_t, hi_t = (torch.tensor(x, dtype=torch.float64, device="cpu") for x in (lo, hi))
    _, c = affine_tensors(scale, lo_t, hi_t, bins, dtype)
    return scale * bins / (hi - lo), float(c)


def device_edges(lo: Tensor, hi: Tensor, bins: int) -> Tensor:
    """``numpy.linspace(lo, hi, bins + 1)`` in float64 on ``lo``'s device (numpy's arithmetic:
    ``arange·step + lo`` with ``step = (hi − lo)/bins``, the last edge exactly ``hi``)."""
    lo, hi = lo.double(), hi.double()
    steps = torch.arange(bins + 1, dtype=torch.float64, device=lo.device)
    edges = steps * ((hi - lo) / bins) + lo
    return torch.cat([edges[:-1], hi.reshape(1)])


def affine_tensors(
    scale: float, lo: Tensor, hi: Tensor, bins: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(a, c)`` of the bin coordinate ``t = a·v + c = (scale·v − lo)·bins/(hi − lo)`` for
    ``bins`` equal bins over ``[lo, hi]`` (0-dim tensors, on ``lo``'s device, never read on the
    host): ``a`` in float64, ``c`` in ``dtype`` (``v``'s), nudged (by at most a unit in the
    last place) so that an exact zero — frequent (ReLU), and often a bin edge — lands in the
    bin ``numpy.histogram`` gives it (its edges are ``numpy.linspace(lo, hi, bins + 1)``,
    :func:`device_edges`). Serves static ranges (:func:`_affine`) and the monitor's ranges
    that live on the device (:mod:`backprism.monitor.histograms`)."""
    lo, hi = lo.double(), hi.double()
    width = hi - lo
    a = (scale * bins) / width
    c = (-lo * bins / width).to(dtype)
    edges = device_edges(lo, hi, bins)
    origin = torch.zeros(1, dtype=torch.float64, device=lo.device)
    zero = torch.searchsorted(edges, origin, right=True)[0] - 1
    zero = zero.clamp(0, bins - 1).to(dtype)
    c = torch.where((zero > 0) & (c < zero), zero, c)
    below = torch.nextafter(zero + 1, torch.full_like(zero, -float("inf")))
    c = torch.where((zero < bins - 1) & (c >= zero + 1), below, c)
    return a, c


def bin_index(v: Tensor, scale: float, lo: float, hi: float, bins: int) -> Tensor:
    """Bin indices of ``scale·v`` for ``bins`` equal bins over ``[lo, hi]`` with clipping:
    ``trunc(clamp(a·v + c, 0, bins − 1))`` with the bin coordinate ``a·v + c`` of
    :func:`_affine` — ``⌊(clip(scale·v, lo, hi) − lo)/w⌋`` clamped to the last bin, up to
    rounding of the bin coordinate (exact zeros binned as numpy does). Clipping to the centres
    of the outermost bins (GradHist2d) gives the same indices. Three passes over ``v`` and one
    conversion to ``_index_dtype(bins)``, computed in ``v``'s dtype (float32 stays float32)."""
    if v.dtype not in (torch.float32, torch.float64):
        v = v.to(torch.float32)
    a, c = _affine(v, scale, lo, hi, bins)
    return (v * a).add_(c).clamp_(0, bins - 1).to(_index_dtype(bins))


def _count(idx: Tensor, size: int) -> Tensor:
    """Counts of the indices ``idx`` (``[0, size)``) as int64 ``[size]``. Non-finite gradients
    (recorded as NaN by the monitor anyway) give arbitrary indices; invalid ones are dropped."""
    flat = idx.reshape(-1)
    try:
        return torch.bincount(flat, minlength=size)[:size]
    except RuntimeError:  # a NaN became a negative index
        flat = flat[(flat >= 0) & (flat < size)]
        return torch.bincount(flat, minlength=size)[:size]


class GradHist(FirstOrderExtension):
    """Histograms of individual gradient elements, streamed over sample chunks (module doc).

    Args:
        bins: number of 1d bins, ``None`` for no 1d histogram (default 100).
        range: ``(a, b)`` of the 1d histogram (default ``(-2, 2)``).
        bins2d: ``(X, Y)`` for the 2d histogram over (gradient element, parameter value), or
            ``None`` (default).
        range2d: ``((xa, xb), (ya, yb))`` (default ``((-1, 1), (-2, 2))``).
        abs_max: also return ``maxₙᵢ |gₙᵢ|`` (default ``False``).
        scale: ``s`` in ``gₙ = s·grad_batch[n]``; ``None`` (default) uses the batch size ``N``
            (individual gradients ``∇ℓₙ`` of a mean-reduced loss).
        chunk_elements: per-sample gradient elements built at once (default ``2**20``: on
            cifar10_3c3d the extension costs 1.67× a plain step against 1.80× with ``2**18``).
    """

    savefield = "grad_hist"
    #: (distributed passes: the rows come scaled for the global batch, see :meth:`_scale`)
    scaled_in_pass = True
    #: where it materialises every parameter's per-sample gradients of a call, it hands their
    #: squared norms to the engine's per-call memo, so ``BatchL2Grad`` in the same pass (the
    #: monitor's norm and orthogonality tests) does not build them again
    provides = ("batch_l2",)

    def __init__(
        self,
        bins: int | None = 100,
        range: tuple[float, float] = (-2.0, 2.0),
        bins2d: tuple[int, int] | None = None,
        range2d: tuple[tuple[float, float], tuple[float, float]] = ((-1.0, 1.0), (-2.0, 2.0)),
        abs_max: bool = False,
        scale: float | None = None,
        chunk_elements: int = 2**20,
    ) -> None:
        self.bins = None if bins is None else int(bins)
        self.range = (float(range[0]), float(range[1]))
        self.bins2d = None if bins2d is None else (int(bins2d[0]), int(bins2d[1]))
        self.range2d = tuple((float(r[0]), float(r[1])) for r in range2d)
        self.abs_max = bool(abs_max)
        self.scale = scale
        self.chunk_elements = int(chunk_elements)

    # -- reduction of one chunk ---------------------------------------------------------------
    def _empty(self, ref: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if self.bins is not None:
            out["hist"] = torch.zeros(self.bins, dtype=torch.int64, device=ref.device)
        if self.bins2d is not None:
            out["hist2d"] = torch.zeros(
                self.bins2d[0] * self.bins2d[1], dtype=torch.int64, device=ref.device
            )
        if self.abs_max:
            out["abs_max"] = torch.zeros((), dtype=ref.dtype, device=ref.device)
        return out

    def _y_index(self, param: Tensor) -> Tensor:
        """Bin indices of the parameter values in the 2d histogram's index type."""
        assert self.bins2d is not None
        (ya, yb), ybins = self.range2d[1], self.bins2d[1]
        size = self.bins2d[0] * ybins
        return bin_index(param.detach(), 1.0, ya, yb, ybins).to(_index_dtype(size))

    def _reduce(
        self,
        acc: dict[str, Tensor],
        v: Tensor,
        scale: float,
        y_idx: Tensor | None,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        """Add the chunk ``scale·v`` (``v``: ``[n, *p]``) to the accumulators (except the
        entries in ``skip``, computed otherwise)."""
        if self.abs_max and "abs_max" not in skip:
            lo_, hi_ = torch.aminmax(v)
            m = torch.maximum(hi_, -lo_) * abs(scale)
            acc["abs_max"] = torch.maximum(acc["abs_max"], m.to(acc["abs_max"].dtype))
        if self.bins is not None and "hist" not in skip:
            lo, hi = self.range
            acc["hist"] += _count(bin_index(v, scale, lo, hi, self.bins), self.bins)
        if self.bins2d is not None and "hist2d" not in skip:
            assert y_idx is not None
            (xa, xb), (xbins, ybins) = self.range2d[0], self.bins2d
            size = xbins * ybins
            idx = bin_index(v, scale, xa, xb, xbins).to(_index_dtype(size))
            acc["hist2d"] += _count(idx.mul_(ybins).add_(y_idx), size)

    def _finish(self, acc: dict[str, Tensor]) -> dict[str, Tensor]:
        if self.bins2d is not None:
            acc["hist2d"] = acc["hist2d"].reshape(self.bins2d)
        return acc

    # -- engine interface ---------------------------------------------------------------------
    def _scale(self, n: int) -> float:
        """``s``: the given scale, else the batch size ``n`` of the call; in a distributed pass
        (where the engine hands this extension gradients scaled for the global batch,
        :attr:`scaled_in_pass`) the global one, so that both give the one-process bins."""
        if self.scale is not None:
            return float(self.scale)
        bp = current_pass()
        batch = None if bp is None else bp.global_batch()
        return float(n if batch is None else n * batch.n / batch.local)

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        n = call.batch_size
        scale = self._scale(n)
        memo, rule = rule, _raw(rule)
        params = call.params
        ref = _first_tensor(g)
        accs = {name: self._empty(ref) for name in params}
        y_idx = (
            {name: self._y_index(p) for name, p in params.items()}
            if self.bins2d is not None
            else {}
        )
        # Linear weights (no middle axes): counts and maxima from the rank-one structure
        skip: dict[str, frozenset[str]] = {}
        wanted = self.bins is not None or self.bins2d is not None
        factors = (
            _rank1_factors(call, g)
            if wanted and isinstance(rule, LinearRule) and "weight" in accs
            else None
        )
        if factors is not None:
            d, x = factors
            acc = accs["weight"]
            if self.bins is not None:
                acc["hist"] += _linear_rank1(d, x, scale, self.range, self.bins)
            if self.bins2d is not None:
                acc["hist2d"] += _linear_rank1_2d(
                    d, x, scale, self.range2d[0], self.bins2d, y_idx["weight"]
                ).reshape(-1)
            if self.abs_max:  # maxₙᵢ |s δₙₒ xₙᵢ|
                amax = (d.abs().amax(1) * x.abs().amax(1)).max() * abs(scale)
                acc["abs_max"] = amax.to(acc["abs_max"].dtype)
            skip["weight"] = frozenset({"hist", "hist2d", "abs_max"})
        direct = [name for name in params if set(accs[name]) - skip.get(name, frozenset())]
        per_sample = sum(params[name].numel() for name in direct)
        if not per_sample:
            return {name: self._finish(acc) for name, acc in accs.items()}
        step = max(1, self.chunk_elements // per_sample)
        # all per-sample gradients pass through here: their squared norms are BatchL2Grad's
        norms: dict[str, list[Tensor]] | None = (
            {name: [] for name in params}
            if set(direct) == set(params) and hasattr(memo, "provide") and _one_column(g)
            else None
        )
        for start in range(0, n, step):
            stop = min(n, start + step)
            sub = call if (start, stop) == (0, n) else _slice_call(call, start, stop)
            gs = _slice_cols(g, start, stop, n)
            if isinstance(rule, LinearRule) and direct == ["bias"]:
                ps = {"bias": gs.reshape(gs.shape[0], stop - start, -1, gs.shape[-1]).sum(2)}
            else:
                ps = rule.per_sample(sub, gs)
            for name, v in ps.items():
                if name not in direct:
                    continue
                v0 = v[0].detach()
                self._reduce(accs[name], v0, scale, y_idx.get(name), skip.get(name, frozenset()))
                if norms is not None:
                    norms[name].append(v0.reshape(v0.shape[0], -1).square().sum(1))
            del ps
        if norms is not None and all(norms.values()):
            memo.provide("batch_l2", call, g, value={k: torch.cat(v) for k, v in norms.items()})
        return {name: self._finish(acc) for name, acc in accs.items()}

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        """Parameters used by several calls: the summed per-sample gradients ``[1, N, *p]``."""
        d = dense[0]
        n = d.shape[0]
        scale = self._scale(n)
        acc = self._empty(d)
        # the dense parameter is the one being finished; its values come with the call
        y_idx = None
        if self.bins2d is not None:
            y_idx = self._y_index(_dense_param(call, d))
        per_sample = max(1, d[0].numel())
        step = max(1, self.chunk_elements // per_sample)
        for start in range(0, n, step):
            self._reduce(acc, d[start : start + step].detach(), scale, y_idx)
        return self._finish(acc)

    def accumulate(self, old: Any, new: Any) -> Any:
        out = {}
        for k in old:
            out[k] = torch.maximum(old[k], new[k]) if k == "abs_max" else old[k] + new[k]
        return out

    # distributed: the rows are binned in the global batch's scaling (scaled_in_pass); counts
    # are summed, ``abs_max`` gathered and maximised
    def distributed_unsupported(self, params: list) -> str | None:
        return None

    def distributed_parts(self, value: dict, batch: GlobalBatch) -> list:
        return [
            CatPart(v.reshape(1), rows=(1,) * batch.world_size) if k == "abs_max" else SumPart(v)
            for k, v in sorted(value.items())
        ]

    def distributed_result(self, value: dict, reduced: list[Tensor], batch: GlobalBatch) -> dict:
        out = {}
        for (k, _), r in zip(sorted(value.items()), reduced):
            out[k] = r.max() if k == "abs_max" else r
        return out


def _dense_param(call: Call, d: Tensor) -> Tensor:
    """The parameter of ``call`` whose per-sample gradients ``d`` are (by shape; a shared
    parameter among several of the same shape has the same values only if it is the same)."""
    for p in call.params.values():
        if tuple(p.shape) == tuple(d.shape[1:]):
            return p
    raise RuntimeError("GradHist: could not match per-sample gradients to a parameter")


def _rank1_factors(call: Call, g: Any) -> tuple[Tensor, Tensor] | None:
    """``(δ, x)`` (``[N, O]``, ``[N, I]``, detached) of a Linear call without middle axes and a
    single finite float column, else ``None`` (the rank-one histogram paths do not apply)."""
    x = call.input
    if not isinstance(g, Tensor) or g.shape[0] != 1 or x.dim() != 2 or g.dim() != 3:
        return None
    d = g[0].detach()
    if d.dtype not in (torch.float32, torch.float64) or x.dtype != d.dtype:
        return None
    if not (bool(torch.isfinite(d).all()) and bool(torch.isfinite(x).all())):
        return None
    return d, x.detach()


def _linear_rank1_2d(
    d: Tensor,
    x: Tensor,
    scale: float,
    rng: tuple[float, float],
    bins2d: tuple[int, int],
    y_idx: Tensor,
    chunk_elements: int = 2**20,
) -> Tensor:
    r"""2d counts ``[X, Y]`` (gradient element × parameter value) of a Linear weight's
    individual gradients, from its factors ``δ``, ``x`` (:func:`_rank1_factors`) and the
    rank-one structure ``gₙ = s·δₙ xₙᵀ``: the bin
    coordinate of element ``(o, i)`` of sample ``n`` is ``uₙₒ xₙᵢ + c`` (``uₙₒ = a·δₙₒ``,
    :func:`_affine`), monotone in ``xₙᵢ``.

    * A row whose extremes fall in one gradient bin ``b`` puts all its elements there: it adds
      the fixed parameter-bin histogram ``Hₒ`` of weight row ``o`` to ``hist2d[b]`` (one
      ``[X, O] @ [O, Y]`` product for all such rows).
    * Samples with mostly spanning rows are binned whole, a block of samples at a time, from
      the outer product ``u xᵀ + c`` and the parameter bins broadcast (no gathers, narrow
      integer indices); the few spanning rows of other samples are built row by row.

    Exact zeros (``δₙₒ = 0`` or ``xₙᵢ = 0``) get coordinate ``c`` as in :func:`bin_index`;
    other elements agree with it up to rounding of the bin coordinate."""
    (lo, hi), (xbins, ybins) = rng, bins2d
    o, size = d.shape[1], x.shape[1]
    a, c = _affine(d, scale, lo, hi, xbins)
    u = d * a  # [N, O]
    xmin, xmax = torch.aminmax(x, dim=1)
    t1, t2 = u * xmin[:, None] + c, u * xmax[:, None] + c
    b0 = torch.minimum(t1, t2).clamp_(0, xbins - 1).trunc_().long()
    b1 = torch.maximum(t1, t2).clamp_(0, xbins - 1).trunc_().long()
    idt = _index_dtype(xbins * ybins)
    yl = y_idx.reshape(o, size).to(idt)  # parameter bins of the weight, [O, I]
    flat = torch.zeros(xbins * ybins, dtype=torch.int64, device=d.device)
    c_t = torch.full((), c, dtype=d.dtype, device=d.device)
    single = b0 == b1
    whole = (~single).float().mean(1) > 0.5  # samples binned whole
    # rows in one gradient bin (of the other samples): counts [X, O] @ row histograms [O, Y]
    short = single & ~whole[:, None]
    if bool(short.any()):
        rows_o = torch.arange(o, device=d.device)
        h = torch.bincount((rows_o[:, None] * ybins + yl.long()).reshape(-1), minlength=o * ybins)
        keys = (b0 * o + rows_o)[short]
        counts = torch.bincount(keys, minlength=xbins * o).reshape(xbins, o)
        pairs = counts.to(torch.float64) @ h.reshape(o, ybins).to(torch.float64)
        flat += pairs.round_().long().reshape(-1)  # exact: integers below 2**53
    # spanning rows of the other samples, built row by row
    spans = (~single & ~whole[:, None]).nonzero()
    step = max(1, chunk_elements // max(1, size))
    if spans.shape[0]:
        rn, ro = spans.unbind(1)
        for start in range(0, rn.shape[0], step):
            sn, so = rn[start : start + step], ro[start : start + step]
            t = torch.addcmul(c_t, u[sn, so][:, None], x[sn])
            idx = t.clamp_(0, xbins - 1).to(idt).mul_(ybins).add_(yl[so])
            flat += torch.bincount(idx.reshape(-1), minlength=xbins * ybins)
    # whole samples, a block at a time
    full = whole.nonzero().reshape(-1)
    block = max(1, chunk_elements // max(1, o * size))
    for start in range(0, full.shape[0], block):
        sn = full[start : start + block]
        t = torch.addcmul(c_t, u[sn][:, :, None], x[sn][:, None, :])
        idx = t.clamp_(0, xbins - 1).to(idt).mul_(ybins).add_(yl)
        flat += torch.bincount(idx.reshape(-1), minlength=xbins * ybins)
    return flat.reshape(xbins, ybins)


def _linear_rank1(
    d: Tensor, x: Tensor, scale: float, rng: tuple[float, float], bins: int
) -> Tensor:
    r"""1d counts of a Linear weight's individual gradients from its factors ``δ``, ``x``
    (:func:`_rank1_factors`), without building them: ``gₙ = s·δₙ xₙᵀ`` has, in row ``o``,
    the bin coordinates ``tₙₒᵢ = uₙₒ xₙᵢ + c`` with ``uₙₒ = a·s·δₙₒ`` (:func:`_affine`),
    monotone in ``xₙᵢ``. With ``xₙ`` sorted, a row whose extreme coordinates fall in one bin
    puts all ``I`` elements there; otherwise, for each threshold ``k`` it crosses,
    ``#{i: tₙₒᵢ ≥ k}`` is a binary search for ``(k − c)/uₙₒ`` in the sorted ``xₙ``. Cost
    ``O(N I log I + N O + Σ crossings · log I)`` instead of ``O(N O I)``; exact zeros
    (``δₙₒ = 0`` or ``xₙᵢ = 0``) get coordinate ``c`` as in :func:`bin_index`, other
    elements agree with it up to rounding of the bin coordinate."""
    lo, hi = rng
    n, size = x.shape
    a, c = _affine(d, scale, lo, hi, bins)
    u = d * a  # [N, O]
    xs = x.sort(dim=1).values  # [N, I]
    t1, t2 = u * xs[:, :1] + c, u * xs[:, -1:] + c
    b0 = torch.minimum(t1, t2).clamp_(0, bins - 1).trunc_().long()
    b1 = torch.maximum(t1, t2).clamp_(0, bins - 1).trunc_().long()
    hist = torch.bincount(b0.reshape(-1), minlength=bins)[:bins] * size
    rows = (b1 > b0).nonzero()
    if rows.shape[0]:
        rn, ro = rows.unbind(1)
        b0m, um = b0[rn, ro], u[rn, ro]
        spans = b1[rn, ro] - b0m
        total = int(spans.sum())
        rep = torch.repeat_interleave(torch.arange(len(spans), device=d.device), spans)
        first = torch.cumsum(spans, 0) - spans
        k = b0m[rep] + 1 + (torch.arange(total, device=d.device) - first[rep])
        ur, nr = um[rep], rn[rep]
        thr = (k.to(d.dtype) - c) / ur
        # batched binary search: queries padded per sample
        per_n = torch.bincount(nr, minlength=n)
        pos = torch.arange(total, device=d.device) - (torch.cumsum(per_n, 0) - per_n)[nr]
        q = d.new_full((n, int(per_n.max())), float("inf"))
        q[nr, pos] = thr
        left = torch.searchsorted(xs, q, side="left")[nr, pos]
        right = torch.searchsorted(xs, q, side="right")[nr, pos]
        ge = torch.where(ur > 0, size - left, right)  # #{i: t ≥ k}
        hist.index_add_(0, k, ge)
        hist.index_add_(0, k - 1, -ge)
    return hist
