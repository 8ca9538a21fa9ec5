"""Batches folded with another axis, read from the autograd graph.

Models often fold the batch with another axis before a layer: Swin's window partition turns
``[N, H, W, C]`` into ``[N·windows, ws², C]`` for its attention, hand-written code flattens
``[N, T, d]`` to ``[N·T, d]`` before a Linear layer. Such a call has batch size ``g·N``. If the
fold is *sample-major* — rows ``n·g … n·g + g − 1`` all belong to sample ``n`` — the call's
per-sample quantities are exact sums over groups of ``g`` rows; if it is not (a time-major
``[T·N, d]``), no split into samples exists and the pass is refused.

:class:`FoldAnalysis` decides this from the graph alone. It follows the *batch status* of a
tensor — ``(axis, g)``: the batch is on ``axis``, whose size is ``g·N`` in sample-major groups
of ``g`` — from the outputs of calls of batch size ``N`` (status ``(0, 1)``; ``(1, 1)`` for
the outputs that hold the samples on axis 1, ``h_n`` of an RNN say) through the
operations between them and the folded call's input, by the shapes autograd keeps for every
edge (``Node._input_metadata``) and the arguments it saves:

* **reshapes** (``view``, ``reshape``, ``flatten``, ``unsqueeze``, ``squeeze``) of the axes from
  the batch axis on: row-major, so merging ``k`` rows into one keeps samples apart when ``k``
  divides ``g`` (the status becomes ``g/k``), splitting each row in ``k`` gives ``g·k``;
* **moves** (``permute``, ``transpose``, ``unbind``, ``select``, ``split``, ``slice``,
  ``roll``, ``pad``, ``cat``, ``stack``) move the batch axis or leave it alone; touching it (a
  roll over it, a partial slice of it) is unknown;
* **row-wise operations** (elementwise arithmetic and activations, softmax and norms over
  other axes, ``mm``/``addmm`` whose other operand is a parameter, ``bmm``, attention
  kernels): every operand that reaches the batch axis must have the same status; operands of
  size 1 there are broadcast; pooling and interpolation keep it if it is before their
  spatial axes.

A custom ``autograd.Function`` (also a ``torch.compile`` region) is probed through its backward
(:mod:`backprism.engine.probe`) unless declared with :func:`keeps_samples_apart`. Anything
else — an operation it does not know, a batch axis it cannot follow — is *unknown*, and the
call keeps today's refusal (calls of different batch sizes).

Operations that *mix* the samples are reported (:attr:`FoldAnalysis.mixing`, read by
:func:`sample_mixing`): a product of two per-sample operands over the samples, a reduction,
softmax, cumulative operation, sort or top-k over the batch axis, a roll or flip of it, an
index along it that reorders or repeats the samples (``h[perm]``; ``arange`` keeps the status,
an ordered subset is unknown), a reduction over every axis, and a value computed from the
samples broadcast over them (:meth:`FoldAnalysis.reaches_samples`) — the catch-all for batch
statistics computed by operations the analysis does not know.
"""

from __future__ import annotations

import math
import re
import weakref
from typing import Any

import torch

from backprism.engine.probe import UNKNOWN, probe_batch_axis, probeable
from backprism.engine.state import CALLS

__all__ = [
    "FoldAnalysis",
    "UncheckedOperationWarning",
    "fold_sizes",
    "keeps_samples_apart",
    "output_shape",
    "sample_mixing",
    "saved_dim",
    "saved_int",
]

Status = tuple[int, int]  # (batch axis, fold factor g)

#: batch normalisation (``F.batch_norm``); the node saves whether it used the batch's statistics
_BATCH_NORMS = frozenset(
    {"NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0"}
)

#: backward nodes of functions that return their inputs unchanged: DDP's ``_DDPSink`` on the
#: model's outputs (``find_unused_parameters=True``, static graphs)
_IDENTITIES = frozenset({"_DDPSinkBackward"})
#: the node of a shared call's output copied over the samples (``engine.broadcast._Spread``;
#: its inputs: the spread, the value, the copies of the call's inputs)
_SPREAD = "_SpreadFunctionBackward"

#: backward node classes of the custom ``autograd.Function`` s declared sample-wise
_SAMPLE_WISE_FUNCTIONS: weakref.WeakSet[type] = weakref.WeakSet()


class UncheckedOperationWarning(UserWarning):
    """Per-sample results pass through an operation whose treatment of the batch axis the
    analysis cannot read (an in-place operation on a view, ``scatter``, a custom
    ``autograd.Function`` the probe of :mod:`backprism.engine.probe` cannot call); they assume
    it keeps samples apart."""


def keeps_samples_apart(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Declare that the custom ``autograd.Function`` ``function`` treats the samples of a batch
    independently, row by row like an elementwise operation: every operand that carries the
    samples has them on the same axis, and the other operands are broadcast over them (or
    computed from parameters alone). The batch-axis analysis then follows the samples through
    it — finding a mixing behind it, or a fold of the batch — instead of stopping there with an
    :class:`UncheckedOperationWarning`. Usable as a class decorator; returns ``function``."""
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError(
            "backprism.keeps_samples_apart: expected a subclass of torch.autograd.Function, got "
            f"{function!r}"
        )
    _SAMPLE_WISE_FUNCTIONS.add(function._backward_cls)
    return function


def _describe(node: Any) -> str:
    forward = getattr(type(node), "_forward_cls", None)
    if forward is not None:
        return f"the autograd.Function {forward.__qualname__}"
    return re.sub(r"Backwards?\d*$", "", type(node).__name__)

#: reshapes: the output is the input in another row-major shape
_RESHAPES = frozenset(
    {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "UnsqueezeBackward0",
     "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "_ReshapeAliasBackward0"}
)
#: operations whose output rows are the input rows, computed row by row (one or more operands
#: of the output's shape, or broadcast against it)
_ROW_WISE = frozenset(
    {"CloneBackward0", "ToCopyBackward0", "AliasBackward0", "NativeDropoutBackward0",
     "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "MulBackward0",
     "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0", "ExpBackward0",
     "LogBackward0", "PowBackward0", "PowBackward1", "SqrtBackward0", "RsqrtBackward0",
     "TanhBackward0", "SigmoidBackward0", "GeluBackward0", "SiluBackward0", "ReluBackward0",
     "ThresholdBackward0", "HardswishBackward0", "HardsigmoidBackward0", "EluBackward0",
     "LeakyReluBackward0", "SoftplusBackward0", "MishBackward0", "WhereBackward0",
     "MaskedFillBackward0", "ClampBackward1", "ClampMinBackward0", "ClampMaxBackward0",
     "ExpandBackward0", "AbsBackward0", "ErfBackward0", "SinBackward0",
     "CosBackward0", "ReciprocalBackward0", "ScaledDotProductFlashAttentionForCpuBackward0",
     "ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductFlashAttentionBackward0",
     "ScaledDotProductCudnnAttentionBackward0", "MaximumBackward0", "MinimumBackward0",
     "LogSigmoidBackward0", "PowBackward2", "HardtanhBackward0", "Log1PBackward0",
     "Expm1Backward0", "Exp2Backward0", "Log2Backward0", "Log10Backward0", "AtanBackward0",
     "Atan2Backward0", "TanBackward0", "SinhBackward0", "CoshBackward0", "AsinBackward0",
     "AcosBackward0", "ErfcBackward0", "ErfinvBackward0", "LogitBackward0", "SignBackward0",
     "SgnBackward0", "SoftshrinkBackward0", "HardshrinkBackward0", "CeluBackward0",
     "RreluWithNoiseBackward0", "LerpBackward0", "LerpBackward1", "AddcmulBackward0",
     "AddcdivBackward0", "XlogyBackward0", "ClampBackward0", "RsubBackward0", "RsubBackward1",
     "DivBackward2", "NanToNumBackward0", "SincBackward0", "HypotBackward0", "FmaxBackward0",
     "FminBackward0", "CopysignBackward0", "LogaddexpBackward0", "FmodBackward0",
     "RemainderBackward0", "RoundBackward0", "FloorBackward0", "CeilBackward0",
     "TruncBackward0", "FracBackward0", "TrilBackward0", "TriuBackward0",
     "PreluKernelBackward0"}
)
#: operations over one axis (``_saved_dim``) of their input, row by row elsewhere
_OVER_AXIS = frozenset(
    {"SoftmaxBackward0", "LogSoftmaxBackward0", "SafeSoftmaxBackward0", "GluBackward0"}
)
#: pooling and interpolation over the trailing ``k`` (spatial) axes: ``kind → k``
_SPATIAL_RE = re.compile(r"^(Upsample\w+|\w*Pool)([123])D(WithIndices)?Backward0$")
#: reductions over ``_saved_dim`` (one axis, a list, or ``None``: all; with
#: ``_saved_keepdim``)
_REDUCTIONS = frozenset(
    {"SumBackward1", "MeanBackward1", "LinalgVectorNormBackward0", "MaxBackward0",
     "MinBackward0", "KthvalueBackward0", "MedianBackward1", "ModeBackward0", "AmaxBackward0",
     "AminBackward0", "ProdBackward1", "StdBackward0", "VarBackward0", "VarMeanBackward0",
     "LogsumexpBackward0", "NansumBackward0"}
)
#: reductions over every axis
_FULL_REDUCTIONS = frozenset(
    {"SumBackward0", "MeanBackward0", "MaxBackward1", "MinBackward1", "ProdBackward0",
     "TraceBackward0", "PdistBackward0"}
)
#: operations along one axis (``_saved_dim``), row by row along the others: along the batch
#: axis they combine or reorder the samples
_ALONG_AXIS = frozenset(
    {"CumsumBackward0", "CumprodBackward0", "LogcumsumexpBackward0", "CummaxBackward0",
     "CumminBackward0", "SortBackward0", "TopkBackward0"}
)
#: nodes of parameter-only computations (a weight transposed for ``mm``)
_PARAM_SHAPE_OPS = frozenset(
    {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
     "UnsafeViewBackward0", "ExpandBackward0", "UnsqueezeBackward0", "ToCopyBackward0",
     "CloneBackward0"}
)


def output_shape(node: Any, nr: int) -> tuple[int, ...] | None:
    """The shape of output ``nr`` of autograd node ``node`` (of the gradient it receives)."""
    try:
        return tuple(node._input_metadata[nr].shape)
    except (AttributeError, IndexError, RuntimeError):
        return None


def saved_int(v: Any) -> int:
    """An integer autograd saved for a backward node, signed (it saves negative ones as
    unsigned 64-bit integers: ``-1`` as ``2**64 - 1``)."""
    v = int(v)
    return v - 2**64 if v >= 2**63 else v


def saved_dim(d: Any, ndim: int) -> int:
    """A saved dimension as an index in ``[0, ndim)``."""
    return saved_int(d) % ndim


def _reshape(status: Status, inp: tuple[int, ...], out: tuple[int, ...]) -> Status | None:
    """The status of ``out`` (a row-major reshape of ``inp``, whose batch is ``status``): the
    axes before the batch axis may be regrouped (size-1 axes added or dropped, as
    ``unsqueeze``/``squeeze`` do: ``nn.MultiheadAttention``'s split of its packed projection),
    as long as they hold the same number of elements — the batch axis then starts at the same
    place of the row-major order."""
    axis, g = status
    lead = math.prod(inp[:axis])
    j, acc = 0, 1
    while j < len(out) and acc < lead:
        acc *= out[j]
        j += 1
    while j < len(out) and out[j] == 1 and inp[axis] != 1:  # (an axis of 1 put before it)
        j += 1
    if lead == 0 or acc != lead or j >= len(out):
        return None
    size, new = inp[axis], out[j]
    axis = j
    if new == size:  # rows of the same length: the same rows
        return (axis, g)
    n = size // g
    if new > size:  # each row split in k rows
        if new % size:
            return None
        return (axis, g * (new // size))
    if size % new:  # k rows merged into one
        return None
    k = size // new
    if g % k:
        return None
    return (axis, g // k) if new >= n else None


def _param_only(node: Any, depth: int = 0) -> bool:
    """``node`` computes from parameters alone (a leaf, reached through reshapes)."""
    if node is None or depth > 8:
        return False
    if getattr(node, "variable", None) is not None:
        return True
    if type(node).__name__ not in _PARAM_SHAPE_OPS:
        return False
    return all(_param_only(f, depth + 1) for f, _ in node.next_functions if f is not None) and all(
        f is not None for f, _ in node.next_functions
    )


def _is_parameter_leaf(node: Any) -> bool:
    return isinstance(getattr(node, "variable", None), torch.nn.Parameter)


class FoldAnalysis:
    """Batch statuses of the edges of one graph (module docstring).

    Args:
        n: the batch size ``N`` of the samples.
        anchors: ``(id(node), output_nr)`` of outputs of calls of batch size ``N``, each with
            its status ``(axis, 1)``: the axis that holds the samples there (axis 0 but for
            RNNs, and calls that took their batch from another axis).
    """

    def __init__(self, n: int, anchors: dict[tuple[int, int], Status]) -> None:
        self.n = n
        self.anchors = anchors
        self._memo: dict[tuple[int, int], Status | None] = {}
        #: the first product of two per-sample tensors found that mixes samples (a
        #: contrastive loss's ``z1 @ z2.T``), described; ``None`` if none was met
        self.mixing: str | None = None
        #: operations the analysis does not know whose input carries the samples, described
        #: in the order met: whether they keep samples apart is not checked
        self.unchecked: dict[str, None] = {}
        self._held: list[Any] = []  # nodes of memoised ids, held so that ids stay unique
        self._free: dict[tuple[str, int], bool] = {}

    def fold(self, edges: list[Any], batch_size: int) -> int | None:
        """The fold factor ``g`` of a call whose input edges are ``edges`` (gradient edges)
        and whose first input has batch size ``batch_size``, if its first differentiable
        input is a sample-major fold with the batch on axis 0; else ``None``."""
        for edge in edges:
            node, nr = edge.node, edge.output_nr
            if node is None:
                continue
            status = self.status(node, nr)
            if status is not None and status[0] == 0 and status[1] * self.n == batch_size:
                return status[1]
            return None
        return None

    def status(self, node: Any, nr: int, depth: int = 0) -> Status | None:
        key = (id(node), nr)
        if key in self.anchors:
            return self.anchors[key]
        if key in self._memo:
            return self._memo[key]
        if depth > 400:
            return None
        self._memo[key] = None  # (a cycle cannot occur; this also bounds re-entry)
        self._held.append(node)
        try:
            result = self._transfer(node, nr, depth)
        except (AttributeError, IndexError, RuntimeError, TypeError, ValueError):
            result = None
        if result is not None:
            shape = output_shape(node, nr)
            if shape is None or result[0] >= len(shape) or shape[result[0]] % self.n:
                result = None
        self._memo[key] = result
        return result

    # -- transfer functions --------------------------------------------------------------------
    def _inputs(self, node: Any) -> list[tuple[Any, int]]:
        return [(f, k) for f, k in node.next_functions]

    def _in(self, node: Any, i: int, depth: int) -> tuple[Status | None, tuple[int, ...] | None]:
        f, k = node.next_functions[i]
        if f is None:
            return None, None
        return self.status(f, k, depth + 1), output_shape(f, k)

    def _transfer(self, node: Any, nr: int, depth: int) -> Status | None:
        kind = type(node).__name__
        out = output_shape(node, nr)
        if out is None or getattr(node, "variable", None) is not None:
            return None
        if kind in _RESHAPES:
            status, inp = self._in(node, 0, depth)
            return None if status is None or inp is None else _reshape(status, inp, out)
        if kind == "PermuteBackward0":
            status, _ = self._in(node, 0, depth)
            if status is None:
                return None
            dims = [saved_dim(d, len(out)) for d in node._saved_dims]
            return (dims.index(status[0]), status[1])
        if kind == "TransposeBackward0":
            status, _ = self._in(node, 0, depth)
            if status is None:
                return None
            d0, d1 = saved_dim(node._saved_dim0, len(out)), saved_dim(node._saved_dim1, len(out))
            axis = {d0: d1, d1: d0}.get(status[0], status[0])
            return (axis, status[1])
        if kind == "TBackward0":  # (``.t()`` of at most two axes)
            status, _ = self._in(node, 0, depth)
            if status is None or len(out) < 2:
                return status
            return (1 - status[0], status[1])
        if kind == "RepeatBackward0":
            return self._repeat(node, out, depth)
        if kind in ("AsStridedBackward0", "AsStridedBackward1"):
            # (a tensor re-strided in place, or a view replayed from its base): followed only
            # where it reads the input's elements in their row-major order, unchanged
            status, inp = self._in(node, 0, depth)
            if status is None or inp != out or node._saved_storage_offset not in (None, 0):
                return None
            want = [math.prod(out[k + 1 :]) for k in range(len(out))]
            strides = [saved_int(v) for v in node._saved_stride]
            same = all(a == b or n == 1 for a, b, n in zip(strides, want, out, strict=True))
            return status if same else None
        if kind == "UnfoldBackward0":  # ``x.unfold(dim, size, step)``: windows along dim
            return self._along(node, node._saved_dimension, "unfold windows", depth)
        if kind == "Im2ColBackward0":  # ``F.unfold``: [N, C, *S] → [N, C·K, L]
            status, _ = self._in(node, 0, depth)
            return status if status is not None and status[0] == 0 else None
        if kind == "CopyBackwards":  # ``x.copy_(src)``: the rows are src's, broadcast to x
            status, inp = self._in(node, 1, depth)
            if status is None or inp is None:
                return None
            axis = status[0] + len(out) - len(inp)
            return (axis, status[1]) if out[axis] == inp[status[0]] else None
        if kind in ("UnbindBackward0", "SelectBackward0"):
            status, inp = self._in(node, 0, depth)
            if status is None or inp is None:
                return None
            dim = saved_dim(node._saved_dim, len(inp))
            if dim == status[0]:
                return None
            return (status[0] - (dim < status[0]), status[1])
        if kind in ("SplitBackward0", "SplitWithSizesBackward0", "SliceBackward0"):
            status, inp = self._in(node, 0, depth)
            if status is None or inp is None:
                return None
            dim = saved_dim(node._saved_dim, len(inp))
            if dim == status[0] and out[dim] != inp[dim]:
                return None
            return status
        if kind in ("RollBackward0", "FlipBackward0"):
            status, _ = self._in(node, 0, depth)
            dims = [saved_dim(d, len(out)) for d in node._saved_dims]
            if status is None or not dims:
                return None
            if status[0] in dims:
                what = "roll" if kind == "RollBackward0" else "flip"
                self.mixing = f"a {what} over the samples (dim {status[0]})"
                return None
            return status
        if kind in _ALONG_AXIS:
            return self._along(node, node._saved_dim, f"a {kind[:-9].lower()}", depth)
        if kind in ("IndexSelectBackward0", "GatherBackward0"):
            status, inp = self._in(node, 0, depth)
            if status is None or inp is None:
                return None
            if saved_dim(node._saved_dim, len(inp)) != status[0]:
                return status if out[status[0]] == inp[status[0]] else None
            return self._sample_index(node._saved_index, status, kind)
        if kind == "IndexBackward0":
            return self._index(node, out, depth)
        if kind in _FULL_REDUCTIONS:
            status, _ = self._in(node, 0, depth)
            if status is not None:
                self.mixing = f"a reduction over every axis, the samples' too ({kind[:-9]})"
            return None
        if kind == "CdistBackward0":
            return self._cdist(node, depth)
        if kind == "ConstantPadNdBackward0":
            status, _ = self._in(node, 0, depth)
            if status is None:
                return None
            pad = list(node._saved_pad)
            padded = {len(out) - 1 - i // 2 for i, p in enumerate(pad) if p}
            return None if status[0] in padded else status
        if kind in ("CatBackward0", "StackBackward0"):
            return self._cat(node, out, depth, stack=kind == "StackBackward0")
        if kind in ("MmBackward0", "AddmmBackward0"):
            return self._mm(node, 0 if kind == "MmBackward0" else 1, depth)
        if kind == "BaddbmmBackward0":  # β·input + α·(batch1 @ batch2) (Bloom's ALiBi scores)
            return self._baddbmm(node, depth)
        if kind == "BmmBackward0":
            first, a = self._in(node, 0, depth)
            second, b = self._in(node, 1, depth)
            if first is not None and first == second and first[0] == 0:
                return first  # a batched product, sample by sample
            if first is not None and second is not None:
                self.mixing = f"a batched matrix product (bmm) of shapes {a} and {b}"
            return None
        if kind in _REDUCTIONS:
            status, inp = self._in(node, 0, depth)
            if status is None or inp is None:
                return None
            dims = node._saved_dim
            if dims is None or (isinstance(dims, (list, tuple)) and not dims and kind in (
                "SumBackward1", "MeanBackward1", "LinalgVectorNormBackward0"
            )):
                dims = range(len(inp))  # (dim=[] reduces over every axis for these)
            elif isinstance(dims, int):
                dims = [dims]
            dims = [saved_dim(d, len(inp)) for d in dims]
            if status[0] in dims:
                self.mixing = f"a reduction over the samples ({kind[:-9]} over dim {status[0]})"
                return None
            if not dims:
                return None
            if node._saved_keepdim:
                return status
            return (status[0] - sum(d < status[0] for d in dims), status[1])
        if kind in _BATCH_NORMS and isinstance(getattr(node, "_saved_training", None), bool):
            # normalised over every axis but the channels' (1): with running statistics a
            # per-channel scale and shift, row by row; with the batch's, a mixing
            status, _ = self._in(node, 0, depth)
            if status is None or nr != 0 or status[0] == 1:
                return None
            if node._saved_training:
                self.mixing = "a batch normalisation with the batch's statistics"
                return None
            return status
        if kind == "NativeLayerNormBackward0":
            status, inp = self._in(node, 0, depth)
            if status is None or inp is None or nr != 0:
                return None
            if status[0] >= len(inp) - len(node._saved_normalized_shape):
                return None
            return status
        if kind in _OVER_AXIS:
            status, _ = self._in(node, 0, depth)
            if status is None:
                return None
            if saved_dim(node._saved_dim, len(out)) == status[0]:
                self.mixing = f"a {kind[:-9].lower()} over the samples"
                return None
            return status
        if kind in _ROW_WISE:
            return self._row_wise(node, out, depth)
        spatial = _SPATIAL_RE.match(kind)
        if spatial is not None:  # (MobileViT's patches interpolated to the patch size)
            status, inp = self._in(node, 0, depth)
            if status is None or inp is None or len(inp) != len(out):
                return None
            if status[0] >= len(out) - int(spatial.group(2)) or out[status[0]] != inp[status[0]]:
                return None
            return status
        if kind in _IDENTITIES:
            return self._identity(node, nr, out, depth)
        if type(node) in _SAMPLE_WISE_FUNCTIONS:
            return self._row_wise(node, out, depth)
        carried = [
            (i, status)
            for i, (f, k) in enumerate(node.next_functions)
            if f is not None and (status := self.status(f, k, depth + 1)) is not None
        ]
        if not carried:
            return None
        statistic = self._batch_statistic_into(node, {i for i, _ in carried})
        if statistic is not None:
            self.mixing = self.mixing or statistic
            return None
        if probeable(node) and all(g == 1 for _, (_, g) in carried):
            axis = probe_batch_axis(node, nr, [(i, a) for i, (a, _) in carried], self.n)
            if axis is None:
                self.mixing = self.mixing or (
                    f"{_describe(node)} (probed through its backward: the gradient of one "
                    "sample's output reaches other samples' inputs)"
                )
                return None
            if axis is not UNKNOWN:
                return (axis, 1)
        self.unchecked.setdefault(_describe(node), None)
        return None

    def _batch_statistic_into(self, node: Any, carried: set[int]) -> str | None:
        """An input of custom function ``node`` (not one of the ``carried`` inputs, whose
        samples the analysis follows) computed from the samples but without an axis that could
        hold them (a mean over the batch from another compiled region, say): a statistic of
        the batch entering the function, described; else ``None``."""
        if self.n <= 1:
            return None
        for i, (f, k) in enumerate(node.next_functions):
            if f is None or i in carried or _param_only(f) or self.sample_free(f):
                continue
            shape = output_shape(f, k)
            if shape is not None and all(s % self.n for s in shape) and self.reaches_samples(f):
                return (
                    f"a value computed from the samples (shape {shape}) and passed to "
                    f"{_describe(node)}"
                )
        return None

    def _identity(self, node: Any, nr: int, out: tuple[int, ...], depth: int) -> Status | None:
        """A function that returns its inputs (output ``nr`` is its ``j``-th tensor input,
        ``j ≤ nr``: non-tensor inputs count among the outputs, not the graph's inputs, and
        their slots look like scalars): the status of the inputs of that shape, if they agree."""
        found = {
            self._in(node, j, depth)[0]
            for j in range(min(nr + 1, len(node.next_functions)))
            if node.next_functions[j][0] is not None
            and output_shape(*node.next_functions[j]) == out
        }
        return found.pop() if len(found) == 1 else None

    def _baddbmm(self, node: Any, depth: int) -> Status | None:
        """``baddbmm(input, b1, b2)``: the batched product as ``bmm`` (sample by sample when
        both carry the samples on axis 0), plus ``input`` with the same status or broadcast
        (absent from the graph, computed from parameters alone, or free of the samples)."""
        first, a = self._in(node, 1, depth)
        second, b = self._in(node, 2, depth)
        if first is None or second is None:
            return None
        if first != second or first[0] != 0:
            self.mixing = f"a batched matrix product (baddbmm) of shapes {a} and {b}"
            return None
        f = node.next_functions[0][0]
        if f is None or _param_only(f) or self.sample_free(f):
            return first
        added, _ = self._in(node, 0, depth)
        return first if added == first else None

    def _along(self, node: Any, dim: Any, what: str, depth: int) -> Status | None:
        """An operation along axis ``dim`` of its input, row by row along the others: along
        the batch axis it is ``what`` over the samples, which mixes them."""
        status, inp = self._in(node, 0, depth)
        if status is None or inp is None:
            return None
        if saved_dim(dim, len(inp)) == status[0]:
            self.mixing = f"{what} over the samples (dim {status[0]})"
            return None
        return status

    def _repeat(self, node: Any, out: tuple[int, ...], depth: int) -> Status | None:
        """``x.repeat(*r)``: new leading axes shift the batch axis; repeating along it
        repeats every sample (as ``h[idx]`` with repeated indices does), which mixes them."""
        status, inp = self._in(node, 0, depth)
        if status is None or inp is None:
            return None
        repeats = [saved_int(r) for r in node._saved_repeats]
        axis = status[0] + len(repeats) - len(inp)
        if repeats[axis] != 1:
            self.mixing = f"a repeat of the samples (repeat {repeats[axis]}x along dim {axis})"
            return None
        return (axis, status[1])

    def _sample_index(self, index: Any, status: Status, kind: str) -> Status | None:
        """An index along the batch axis (``index_select``, ``gather``, ``x[idx]``): every
        sample in its place (``arange``) keeps the status; a subset in order is left unknown
        (the batch sizes then differ, refused elsewhere); anything else reorders or repeats
        the samples, which mixes them."""
        if not isinstance(index, torch.Tensor) or status[1] != 1:
            return None
        if index.dtype == torch.bool:
            return status if index.dim() == 1 and bool(index.all()) else None
        if index.dim() == 0 or index.numel() == 0:
            return None
        rows = index.reshape(index.shape[0], -1)
        first = rows[:, 0]  # the sample each output row takes, if it takes one
        if bool((rows == first[:, None]).all()):
            if first.numel() == self.n and bool(
                (first == torch.arange(self.n, device=first.device)).all()
            ):
                return status  # every sample in its place
            if first.numel() < self.n and bool((first[1:] > first[:-1]).all()):
                return None  # an ordered subset
        self.mixing = f"an indexing that reorders or repeats the samples ({kind[:-9]})"
        return None

    def _index(self, node: Any, out: tuple[int, ...], depth: int) -> Status | None:
        """``x[...]`` with index tensors: indices on axes after the batch axis keep it where it
        is; an index on the batch axis, alone or with others that broadcast to its length (GPT-2's
        ``logits[arange(N), last]``), is read by :meth:`_sample_index`."""
        status, inp = self._in(node, 0, depth)
        if status is None or inp is None:
            return None
        indices = list(node._saved_indices)
        axis = status[0]
        at = indices[axis] if axis < len(indices) else None
        if at is None:
            if any(i is not None for i in indices[:axis]):
                return None
            return status if axis < len(out) and out[axis] == inp[axis] else None
        adv = [k for k, i in enumerate(indices) if i is not None]
        if adv != list(range(adv[0], adv[-1] + 1)) or adv[0] != axis:
            return None  # (advanced indices apart: their axes go first)
        found = self._sample_index(at, status, "IndexBackward0")
        if found is None:
            return None
        others = [indices[k] for k in adv if k != axis]
        if at.dim() != 1 or any(o.dim() > 1 or o.shape[0] not in (1, self.n) for o in others):
            return None
        return status

    def _cdist(self, node: Any, depth: int) -> Status | None:
        """``cdist(x1, x2)`` ``[.., P, R]``: samples on ``x1``'s rows with ``x2`` free of them
        pass to the rows; samples on both are pairwise distances between samples."""
        sa, _ = self._in(node, 0, depth)
        f = node.next_functions[1][0]
        if f is None or _param_only(f) or self.sample_free(f):
            return sa if sa is not None and sa[0] == 0 else None
        if sa is not None and self.reaches_samples(f):
            self.mixing = "pairwise distances between samples (cdist)"
        return None

    def reaches_samples(self, node: Any) -> bool:
        """``node``'s graph reaches the output of a call on the samples (an anchor, or a call
        whose batch is a fold of the samples): its value depends on them."""
        key = ("reach", id(node))
        if key in self._free:
            return self._free[key]
        stack, seen, found = [node], set(), False
        while stack and not found:
            f = stack.pop()
            if f is None or id(f) in seen:
                continue
            seen.add(id(f))
            self._held.append(f)
            known = self._free.get(("reach", id(f)))
            if known is not None:
                found = known
                continue
            if any((id(f), k) in self.anchors for k in range(len(f._input_metadata))) or any(
                c.widened_from is None and c.batch_size % self.n == 0 and c.batch_size > self.n
                for c, _, _ in f.metadata.get(CALLS, ())
            ):
                found = True
                continue
            stack.extend(g for g, _ in f.next_functions)
        self._free[key] = found
        return found

    def _mm(self, node: Any, i: int, depth: int) -> Status | None:
        """``A @ B`` (2-D): samples on ``A``'s rows or ``B``'s columns pass to the product's;
        samples on the contracted axis, or on both operands, mix (row ``r`` of the product
        depends on other samples)."""
        a_node, b_node = node.next_functions[i][0], node.next_functions[i + 1][0]
        # a parameter, or an operand outside the graph (a frozen weight): the same matrix for
        # every row of the other operand
        a_const = a_node is None or _param_only(a_node)
        b_const = b_node is None or _param_only(b_node)
        sa, a = (None, None) if a_const else self._in(node, i, depth)
        sb, b = (None, None) if b_const else self._in(node, i + 1, depth)
        if sa is not None and sb is None and b_const:
            if sa[0] == 0:
                return sa
        elif sb is not None and sa is None and a_const:
            if sb[0] == 1:
                return sb
        elif sa is None or sb is None:
            return None
        self.mixing = f"a matrix product of shapes {a} and {b}"
        return None

    def sample_free(self, node: Any, depth: int = 0) -> bool:
        """``node`` computes from parameters and constants alone: its graph reaches no output
        of a layer's call on the samples and no leaf other than a parameter (a bias table
        indexed and added to a constant mask, a shared call's output copied over the rows).
        Such an operand carries no sample's rows."""
        key = ("free", id(node))
        if key in self._free:
            return self._free[key]
        self._free[key] = False
        if depth > 64:
            return False
        if getattr(node, "variable", None) is not None:
            result = _is_parameter_leaf(node)
        elif any(
            not (c.superseded or c.widened_from is not None)
            for c, _, _ in node.metadata.get(CALLS, ())
        ) or any(
            (id(node), k) in self.anchors for k in range(len(node._input_metadata))
        ):  # the output of a layer's call: per-sample rows, whatever its inputs (not a
            # shared call's, or its copies over the rows: the same in every row)
            result = False
        else:
            inputs = node.next_functions
            if type(node).__name__ == _SPREAD:
                # a shared call's output copied over the samples (engine.broadcast's _Spread):
                # its value is computed from detached leaves of the inputs the same for every
                # sample; what carries rows are the copies of those inputs (after the value)
                inputs = inputs[2:]
            result = all(f is None or self.sample_free(f, depth + 1) for f, _ in inputs)
        self._free[key] = result
        self._held.append(node)
        return result

    def _row_wise(self, node: Any, out: tuple[int, ...], depth: int) -> Status | None:
        """All operands that reach the batch axis share one status; the others are broadcast
        there (absent or of size 1) or computed from parameters alone."""
        operands = []
        found: Status | None = None
        for f, k in node.next_functions:
            if f is None:  # a constant operand (not in the graph)
                continue
            inp = output_shape(f, k)
            if inp is None:
                return None
            shift = len(out) - len(inp)
            status = self.status(f, k, depth + 1)
            if status is not None:
                status = (status[0] + shift, status[1])
                if found is None:
                    found = status
                elif found != status:
                    return None
            else:
                operands.append((f, inp, shift))
        if found is None:
            return None
        axis = found[0]
        for f, inp, shift in operands:
            if _param_only(f) or self.sample_free(f):
                continue
            if axis >= shift and inp[axis - shift] != 1:
                return None
            if self.n > 1 and self.reaches_samples(f):
                # broadcast over the samples, yet computed from them: a statistic of the batch
                self.mixing = self.mixing or (
                    f"a value computed from the samples ({type(f).__name__[:-9]}, shape "
                    f"{inp}) and broadcast over all of them"
                )
                return None
        return found

    def _cat(self, node: Any, out: tuple[int, ...], depth: int, stack: bool) -> Status | None:
        dim = saved_dim(node._saved_dim, len(out))
        found: Status | None = None
        for f, k in node.next_functions:
            if f is None:  # a constant (an empty key cache), placed along the same axes
                continue
            status = self.status(f, k, depth + 1)
            if status is None:
                return None
            if found is None:
                found = status
            elif found != status:
                return None
        if found is None:
            return None
        axis = found[0] + (stack and dim <= found[0])
        if not stack and dim == axis:
            return None
        return (axis, found[1])


def fold_sizes(sizes: list[int]) -> list[int]:
    """Candidate sample counts ``N`` for calls of batch sizes ``sizes``: the sizes that divide
    every size, smallest first (not 1: a batch-1 call is a broadcast, not a sample)."""
    g = math.gcd(*sizes)
    return [s for s in sorted(set(sizes)) if g % s == 0 and s > 1]


def sample_mixing(analysis: FoldAnalysis, edges: list[tuple[Any, int]]) -> str | None:
    """Whether the computation of the tensors at ``edges`` (``(node, output_nr)``: loss
    inputs, layers' inputs) from the calls of batch ``N`` mixes samples — a product of two
    per-sample tensors (the logits ``z1 @ z2.T`` of a contrastive loss), a sum, mean or
    softmax over the samples: the operation, described, or ``None`` (none found; operations
    the analysis does not know are not looked through)."""
    for node, nr in edges:
        if node is not None:
            analysis.status(node, nr)
            if analysis.mixing is not None:
                return analysis.mixing
    return None
