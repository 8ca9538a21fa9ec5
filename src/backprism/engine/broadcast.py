r"""Calls whose output is shared by all samples, widened over the batch where they meet it.

A module called on an input without the samples' batch axis computes something every sample
uses: position embeddings of ``position_ids`` ``[1, T]`` or ``torch.arange(T)``, T5's relative
position bias (an ``Embedding`` of ``[T, T]`` bucket indices, permuted to ``[1, H, T, T]``).
Its output meets the samples in an elementwise operation that broadcasts it over them
(``tok + pos``, ``scores + bias``). Sample ``n``'s gradient of the call's parameters is the
pull-back of ``∂Lₙ/∂s``, the gradient at that operand's ``n``-th broadcast copy — never the
call's own output gradient, which is the sum ``Σₙ ∂Lₙ/∂s`` of all samples'.

So the forward mode (:class:`~backprism.engine.functional.ForwardMode`) replaces the operand by
an explicit copy per sample and the call by the same call on its inputs widened to the batch,
whose output *is* that copy (:func:`broadcast_calls`):

* an operand of batch size 1 produced by a call of batch size 1 (``[1, T, d]``): the call's
  inputs are expanded along their axis 0;
* an operand of lower rank produced by a call (``[T, d]`` added to ``[N, T, d]``) or derived
  from the output of a call on inputs that need no gradient by view operations (permutes,
  reshapes, slices, ``unsqueeze``; T5's ``bias(buckets).permute(2, 0, 1).unsqueeze(0)``): the
  call's inputs get a new leading axis of size ``N``, its output ``o`` becomes
  ``o.unsqueeze(0).expand(N, ...)``, and the view operations are replayed per sample on it
  (``torch.func.vmap``) to give the operand's copies. The widened call's rule sees every
  sample's call on the inputs as they were, which rules that act on trailing feature axes
  (Linear, Embedding, LayerNorm, RMSNorm) and the generic ``torch.func`` rule compute exactly;
  other rules are not widened (the batch-size check then refuses the pass, naming the cause).

A matrix product broadcasts the batch axes of its operands (all but the last two) the same way
(``table @ x``, DeBERTa-v1's ``q @ pos_key.transpose(-1, -2)``), and ``repeat(N, 1, ...)`` of an
axis 0 of size ``H > 1`` copies the operand over a batch folded sample-major with that axis
(DeBERTa-v2's ``[N·H, 2S, d]``): both are widened like the elementwise case.

A call whose inputs need a gradient — they are computed by other shared calls (an MLP on
relative coordinates, position embeddings through a Linear layer) or are parameters used as
tensors (DeBERTa's relative embeddings through a LayerNorm) — cannot be widened by expanding
its output, since the gradient reaching its inputs would still be every sample's at once. It is
widened on its inputs' copies per sample (:func:`_recomputed`): each input computed by a shared
call is widened in turn (the same function, recursively), a parameter is copied over the batch
and recorded as a :class:`ParamBroadcast`, anything else is expanded. The call is not run once
per sample: its output on the copies is its output on the shared inputs, copied, and the
per-sample pull-back to the input copies happens in the backward pass (:class:`_Spread`).

Where the operand it meets has ``g·N`` rows (``N``: the top-level forward's batch), the samples
folded with windows (Swin's ``[N·windows, H, T, T]`` scores), the call is widened to ``N`` copies
and each is repeated over its sample's ``g`` rows (:func:`_rows_per_sample`): the widened
inputs, replayed operations and per-sample pull-backs cost ``N`` copies, not ``g·N``. That the
rows fold the samples sample-major is checked by the backward pass from the graph
(:attr:`~backprism.engine.state.Call.repeats`); other layouts are refused.

Every shared call is widened once per forward; later consumers reuse its copies (each layer of
T5 meeting the one relative position bias, DeBERTa's key and query projections meeting the one
LayerNorm of its relative embeddings), so it stays one call whose per-sample gradients autograd
sums over the consumers — exact for every statistic, where one call per consumer would make
curvature that is not additive over calls (KFLR's diagonal factor) a sum over them.

The original call is marked ``superseded`` (ignored by the backward pass). Each widening
consumes the call's output exactly once in the autograd graph; the graph check
(:func:`backprism.engine.graph.analyse`) refuses a pass in which the output is also used
elsewhere, where its gradient would reach the parameters without being split per sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from backprism.engine import residual
from backprism.engine.forward import attach, capture, detached
from backprism.engine.rule import get_rule
from backprism.engine.state import (
    CURVED,
    FORWARD,
    FREE,
    SHARED,
    Call,
    expand_rows,
    param_view,
    suspended,
)

__all__ = [
    "DROPOUT",
    "EXPANDS",
    "MEETS",
    "ParamBroadcast",
    "after_operation",
    "before_in_place",
    "broadcast_calls",
    "broadcast_param",
    "dropout_mask",
    "with_attn_mask",
]

class ParamBroadcast(nn.Module):
    """Stand-in for a parameter (or a view of one) of batch size 1 expanded over the samples
    (``self.cls_token.expand(N, -1, -1)``): every sample's slice is ``source(p)[0]``, so sample
    ``n``'s gradient is the pull-back of the output gradient's slice ``n`` through
    ``source``. Its rule is registered in :mod:`backprism.rules.broadcast`."""

    def __init__(self, p: nn.Parameter, source: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self._parameters["p0"] = p
        self.source = source
        self._backprism_name = "a parameter broadcast over the batch"


def broadcast_param(
    p: nn.Parameter, source: Callable[[Tensor], Tensor], wide: Tensor
) -> Call | None:
    """Capture ``wide`` (``[n, ...]``, every row ``source(p)[0]``) as a :class:`ParamBroadcast`
    call of batch size ``n`` (``None`` where it is not attached)."""
    return capture(
        ParamBroadcast(p, source), (), {}, [], [wide], {"p0": p}, batch_size=wide.shape[0],
        live=((), {}),
    )


#: in-place elementwise arithmetic: followed on a shared tensor (:func:`before_in_place`)
_IN_PLACE = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "add_", "sub_", "mul_", "div_"}
)
#: elementwise operations that broadcast their tensor operands against each other
_ELEMENTWISE = _IN_PLACE | frozenset(
    {
        "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "mul", "__mul__",
        "__rmul__", "div", "__truediv__", "__rtruediv__", "true_divide", "where",
    }
)
_ATTENTION = frozenset({"scaled_dot_product_attention"})
#: additions (``x + t``, ``x += t``)
_ADDS = frozenset({"add", "__add__", "__radd__", "__iadd__", "add_"})
#: matrix products, which broadcast the batch axes (all but the last two) of their operands
_MATMUL = frozenset({"matmul", "__matmul__", "__rmatmul__"})
#: operations where a shared tensor may meet the samples (:func:`broadcast_calls`)
MEETS = _ELEMENTWISE | _ATTENTION | _MATMUL
#: operations followed from a shared call's output (:func:`follow_shared`): views and copies
#: of one tensor, and elementwise operations with constants that do not broadcast it
FOLLOWS = _ELEMENTWISE | frozenset(
    {
        "relu", "gelu", "silu", "tanh", "sigmoid", "exp", "log", "neg", "abs", "sqrt", "rsqrt",
        "sin", "cos", "softplus", "leaky_relu", "elu", "clamp", "pow", "__pow__", "pad",
        "repeat", "tile",
        "t", "T", "mT", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze",
        "expand", "expand_as", "flatten", "unflatten", "view_as", "reshape_as", "__getitem__",
        "to", "type", "float", "double", "half", "bfloat16", "contiguous", "clone", "narrow",
        "select", "movedim", "moveaxis", "swapaxes", "swapdims",
    }
)


#: operations that copy size-1 or new axes of a tensor
EXPANDS = frozenset({"expand", "expand_as", "broadcast_to"})
_OVER_BATCH = EXPANDS | {"repeat"}


def _over_batch(name: str, src: Tensor, args: tuple, out: Tensor) -> bool:
    """Whether ``out = src.expand(...)`` / ``src.repeat(...)`` copies a new or size-1 axis 0
    of ``src`` ``out.shape[0]`` times (over the samples), its other axes as they were."""
    if src.dim() > out.dim() or (src.dim() == out.dim() and src.shape[0] != 1):
        return False
    if name == "repeat":
        reps = _repeats(args)
        return len(reps) == out.dim() and all(r == 1 for r in reps[1:])
    return True


def _repeats(args: tuple) -> tuple[int, ...]:
    """The repeat counts of ``src.repeat(*args[1:])`` (given as one sequence or one by one)."""
    return tuple(args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:])


def _unsplit(call: Call, where: str) -> None:
    """Mark ``call``, a shared call, as met by the samples where its output has no per-sample
    split (``where``: how, a phrase for the refusal of the backward pass), unless a more
    specific reason is already there."""
    if call.unsplit is None:
        call.unsplit = where
        FORWARD.acted += 1


def _meets(name: str) -> str:
    return (
        f"meets a tensor of higher rank or a larger axis 0 in '{name}', so its axis 0 is not "
        "the samples' and its gradient there has no per-sample split"
    )


def _folded_repeat(name: str, src: Any, args: tuple, out: Tensor, one: bool = False) -> int:
    """``r`` if ``out = src.repeat(r, 1, ...)`` repeats an axis 0 of size ``> 1`` (``r``
    copies of ``src`` in a row along it; ``r = 1`` counts where the forward runs on one
    sample, ``one``), else 0."""
    if name != "repeat" or not isinstance(src, Tensor) or src.dim() != out.dim():
        return 0
    if src.dim() == 0 or src.shape[0] <= 1:
        return 0
    reps = _repeats(args)
    if len(reps) != out.dim() or any(r != 1 for r in reps[1:]) or reps[0] < (1 if one else 2):
        return 0
    return int(reps[0])


#: factory functions: their results are the same for every sample
_FACTORIES = frozenset(
    {"arange", "range", "zeros", "ones", "full", "empty", "linspace", "logspace", "eye",
     "tensor", "as_tensor", "tril_indices", "triu_indices",
     # (x.new_ones(size): x gives the dtype and device only)
     "new_ones", "new_zeros", "new_full", "new_empty", "new_tensor"}
)


def _in_place(name: str) -> bool:
    """Whether the operation ``name`` writes into its first operand (``x.add_``, ``x[i] = v``,
    ``x += v``)."""
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or (
        name.startswith("__i") and name.endswith("__")
    )


def _unmark(t: Tensor) -> None:
    """``t`` (and the tensor it is a view of, whose memory it shares) now holds values of the
    samples: no longer :data:`~backprism.engine.state.FREE`."""
    for x in (t, t._base):
        if x is not None and hasattr(x, FREE):
            delattr(x, FREE)


def mark_free(name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """Mark ``out`` :data:`~backprism.engine.state.FREE` if it is the same for every sample:
    a factory function's result, or an operation's whose tensor operands all are (a copy of
    a size-1 axis 0 over the batch by ``expand``/``repeat`` makes it per-sample); it keeps the
    calls its operands were computed by."""
    calls: dict[int, Call] = {}
    if name not in _FACTORIES:
        tensors = 0
        for a in (*args, *kwargs.values()) if kwargs else args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, Tensor):
                    src = getattr(t, FREE, None)
                    if src is None:  # (the common case: a per-sample operand, at once)
                        if _in_place(name) and args and isinstance(args[0], Tensor):
                            _unmark(args[0])  # per-sample values written into it
                        return
                    tensors += 1
                    for c in src:
                        calls[id(c)] = c
        if not tensors:
            return
        if (
            name in _OVER_BATCH and isinstance(out, Tensor) and out.dim() and out.shape[0] > 1
            and _over_batch(name, args[0], args, out)
        ):
            return
    value = tuple(calls.values())
    for o in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(o, Tensor):
            setattr(o, FREE, value)


def after_operation(
    name: str, func: Any, args: tuple, kwargs: dict, out: Any, written: bool = False
) -> Any:
    """What the forward mode does after each operation ``out = func(*args, **kwargs)``:
    follows shared calls' outputs through views and elementwise operations with constants
    (:func:`follow_shared`), widens one expanded over the batch, and marks a shared call whose
    output meets a tensor of higher rank, or of a larger axis 0, in any other way (its axis 0
    is then not the samples'); marks ``out`` if it is the same for every sample
    (:func:`mark_free`); returns ``out`` or its widened copies."""
    mark_free(name, args, kwargs, out)
    if FORWARD.rows_pending:
        _follow_rows(name, args, out)
    if name in FOLLOWS:
        one = _one_sample()
        if (
            name in _OVER_BATCH and isinstance(out, Tensor) and out.dim()
            and (out.shape[0] > 1 or one)
        ):
            src = args[0] if args else None
            info = getattr(src, SHARED, None) if isinstance(src, Tensor) else None
            if (
                info is not None and src.requires_grad and _over_batch(name, src, args, out)
                and (out.shape[0] > 1 or _free(src))
            ):
                # shared.expand(N, ...), shared.repeat(N, 1, ...): over the samples explicitly
                wide = _widen_shared(src, out.dim(), out.shape[0])
                if wide is not None:
                    # (repeat copies: its result is contiguous, viewable as the caller expects)
                    wide = wide.expand(out.shape)
                    return wide.contiguous() if name == "repeat" else wide
                _unsplit(info[0], _meets(name))
                return out
            r = _folded_repeat(name, src, args, out, one)
            if info is not None and src.requires_grad and r and hasattr(src, FREE):
                # shared.repeat(N, 1, ...) of an axis 0 of size H > 1: N copies in a row, the
                # batch folded sample-major with that axis (DeBERTa's [N·heads, 2S, d]
                # relative position projections)
                wide = _widen_shared(src, src.dim() + 1, r)
                if wide is not None:
                    return wide.reshape(out.shape)
                _unsplit(info[0], _meets(name))
                return out
        follow_shared(name, func, args, kwargs, out, written)
    if len(args) > 1 and isinstance(out, Tensor) and out.dim() and out.shape[0] > 1:
        rank, n = out.dim(), out.shape[0]
        tensors = [a for a in args if isinstance(a, Tensor)]
        # another operand holds the output's axis 0 (the batch, where it is per-sample)
        if len(tensors) > 1 and any(b.dim() == rank and b.shape[0] == n for b in tensors):
            for a in tensors:
                if a.dim() < rank or a.shape[0] == 1:
                    info = getattr(a, SHARED, None)
                    if info is not None and a.requires_grad:
                        _unsplit(info[0], _meets(name))
    return out


#: tensor attribute on the copies of widened calls that were broadcast against constants only
#: (Swin's shifted-window mask ``[N·windows, 1, …]``) and on what views and elementwise
#: operations compute from them: those calls, whose rows the first per-sample tensor they meet
#: tells (:attr:`~backprism.engine.state.Call.meets`)
_ROWS = "_backprism_rows_of"


def _follow_rows(name: str, args: tuple, out: Any) -> None:
    """Follow widened copies of unknown rows (:data:`_ROWS`) through ``out = name(*args)``:
    where they meet a per-sample tensor of the same rows, record its edge with their calls."""
    src = next((a for a in args if isinstance(a, Tensor) and hasattr(a, _ROWS)), None)
    if src is None or not isinstance(out, Tensor) or not out.dim():
        return
    if out.dim() != src.dim() or out.shape[0] != src.shape[0]:
        return
    calls = getattr(src, _ROWS)
    others = [
        b for b in args
        if isinstance(b, Tensor) and b is not src and b.requires_grad and not hasattr(b, _ROWS)
        and b.dim() == out.dim() and b.shape[0] == out.shape[0]
    ]
    if others and name in MEETS:
        _rows_met(calls, others)
    elif name in FOLLOWS or name in MEETS:
        setattr(out, _ROWS, calls)


def _rows_met(calls: list[Call], tensors: list[Tensor]) -> None:
    """The widened ``calls`` of unknown rows (:data:`_ROWS`) met the per-sample ``tensors``,
    whose axis 0 holds their rows: recorded as :attr:`~backprism.engine.state.Call.meets`."""
    for call in calls:
        call.meets = (*call.meets, *(get_gradient_edge(b) for b in tensors))
    FORWARD.rows_pending -= 1


def before_in_place(name: str, t: Tensor, written: bool = False) -> None:
    """``t``, computed from a shared call's output, is about to be modified in place by
    ``name`` (DeBERTa's ``pos_query_layer /= scale``; with ``written``, a function told to
    write into it, ``F.relu(t, inplace=True)`` as ``nn.ReLU(inplace=True)`` calls it — Swin
    V2's position-bias MLP): if it is the same for every sample, its origin is kept as it is
    now (a copy in the graph), so that each sample's copy replays the operation on the value
    before it; an in-place operation that is not followed leaves ``t`` without a per-sample
    split (refused)."""
    info = getattr(t, SHARED, None)
    if info is None:
        return
    call, origin, before = info
    if getattr(t, FREE, None) is None:
        # the output of a call on inputs without a gradient, not known to be the same for
        # every sample (the model's first layer on the data): not followed further
        delattr(t, SHARED)
        return
    if name not in _IN_PLACE and not (written and name in FOLLOWS):
        delattr(t, SHARED)
        _unsplit(
            call,
            f"is modified in place by '{name}', which backprism does not replay on each "
            "sample's copy, so its gradient has no per-sample split",
        )
        return
    setattr(t, SHARED, (call, (t if origin is None else origin).clone(), before))


def follow_shared(
    name: str, func: Any, args: tuple, kwargs: dict, out: Any, written: bool = False
) -> None:
    """After ``out = func(*args, **kwargs)`` in an extended forward: if the one operand that
    needs a gradient is (computed from) a shared call's output and ``out`` is a view of it or
    has its shape (constants broadcast into it, not it over anything), mark ``out`` with the
    call and the replay that rebuilds ``out`` from that output. ``written``: the operation
    wrote into its first operand (by name, or by an ``inplace`` flag)."""
    if not isinstance(out, Tensor) or not out.requires_grad:
        return
    pos: int | str | None = None
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and a.requires_grad:
            if pos is not None:
                return
            pos = i
    for k, v in kwargs.items():
        if isinstance(v, Tensor) and v.requires_grad:
            if pos is not None:
                return
            pos = k
    if pos is None:
        return
    src = args[pos] if isinstance(pos, int) else kwargs[pos]
    info = getattr(src, SHARED, None)
    if info is None:
        return
    if name in _ELEMENTWISE and out.shape != src.shape:
        return  # it broadcasts the shared tensor: where it meets the samples, widened before
    if out is src and name not in _IN_PLACE and not written:
        return  # (the tensor itself: .to() of its own device and dtype, .contiguous())
    call, origin, before = info
    if origin is None:
        origin = src
    in_place = out is src  # (its value before: origin, see before_in_place)
    curved = getattr(src, CURVED, None) or (name if residual.nonlinear_in(name, pos) else None)
    if curved is not None:
        setattr(out, CURVED, curved)

    def replay(x: Tensor, before=before, func=func, args=args, kwargs=kwargs, pos=pos) -> Tensor:
        x = x if before is None else before(x)
        if in_place:
            x = x.clone()  # (each sample's copy, written into)
        if isinstance(pos, int):
            return func(*args[:pos], x, *args[pos + 1 :], **kwargs)
        return func(*args, **(kwargs | {pos: x}))

    setattr(out, SHARED, (call, origin, replay))


#: dropout on a shared tensor gets an explicit mask (:func:`dropout_mask`)
DROPOUT = frozenset({"dropout"})


def dropout_mask(args: tuple, kwargs: dict) -> Tensor | None:
    """For ``F.dropout(x, p, training)`` on a shared tensor ``x`` (DeBERTa's dropout of its
    relative embeddings, the same mask for every sample): the scaled mask ``m / (1 - p)``,
    ``m ~ Bernoulli(1 - p)``, that the forward mode multiplies ``x`` with instead, so that the
    product is followed like any elementwise operation with a constant and replayed on each
    sample's copy with the same mask; ``None`` otherwise (dropout runs as it is). The mask is
    drawn with ``torch.bernoulli``: the same distribution as the built-in kernel's, not the
    same numbers from the random state."""
    names = ("input", "p", "training", "inplace")
    bound = dict(zip(names, args)) | kwargs
    x = bound.get("input")
    p = float(bound.get("p", 0.5))
    if not isinstance(x, Tensor) or getattr(x, SHARED, None) is None or not x.requires_grad:
        return None
    if not bound.get("training", True) or bound.get("inplace", False) or not 0.0 < p < 1.0:
        return None
    keep = torch.full_like(x, 1.0 - p, requires_grad=False)
    mask = torch.bernoulli(keep).div_(1.0 - p)
    setattr(mask, FREE, ())  # the same for every sample
    return mask


def _widened(call: Call, wide: Tensor, against: tuple[Tensor, ...], **fields: Any) -> Call:
    """``call`` on its inputs widened to the batch (``fields``: ``args``, ``kwargs``, ``live``,
    …), whose output is ``wide`` ``[N, ...]``, broadcast against the tensors ``against``."""
    return dataclasses.replace(
        call, out_shapes=[wide.shape], batch_size=wide.shape[0], pass_=None, superseded=False,
        unsplit=None, widened_from=call,
        meets=tuple(get_gradient_edge(b) for b in against if b.requires_grad), **fields,
    )


def _expanded(
    call: Call, widen: Callable[[Any], Any], wide: Tensor, against: tuple[Tensor, ...]
) -> Call:
    """:func:`_widened` with every input of ``call`` widened by ``widen``."""
    live = call.live
    return _widened(
        call,
        wide,
        against,
        args=tuple(widen(x) for x in call.args),
        kwargs={k: widen(v) for k, v in call.kwargs.items()},
        live=None
        if live is None
        else (tuple(widen(x) for x in live[0]), {k: widen(v) for k, v in live[1].items()}),
    )


def broadcast_calls(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The operands of an operation in :data:`MEETS` with every shared call's output among them
    replaced by its explicit copies per sample (see the module docstring)."""
    if name in _ATTENTION:
        return _attention_mask(args, kwargs)
    tensors = [a for a in args if isinstance(a, Tensor)]
    if len(tensors) < 2:
        return args, kwargs
    rank = max(t.dim() for t in tensors)
    if name in _MATMUL and (rank < 3 or min(t.dim() for t in tensors) < 2):
        # (batch axes exist, and no vector operand, whose axes matmul would move)
        return args, kwargs
    n = max(t.shape[0] for t in tensors if t.dim() == rank) if rank else 1
    if n < 1 or (n == 1 and not _one_sample()):
        return args, kwargs
    new_args = list(args)
    against = tuple(
        t for t in tensors if t.dim() == rank and t.shape[0] == n and (n > 1 or not _free(t))
    )
    for i, a in enumerate(args):
        if i == 0 and name in _IN_PLACE:
            continue  # written into: it keeps its shape
        if (
            isinstance(a, Tensor) and a.requires_grad and (a.dim() < rank or a.shape[0] == 1)
            and (n > 1 or _free(a))
        ):
            # (added as it is, a call's output of batch size 1 could be widened by the
            # backward pass too, at the addition: no reason to keep the mode for it)
            plain = name in _ADDS and len(args) == 2 and not kwargs and a.dim() == rank
            wide = _widen_shared(a, rank, n, against, plain)
            if wide is not None:
                new_args[i] = wide
    return tuple(new_args), kwargs


def _free(t: Tensor) -> bool:
    """Where the forward runs on one sample: whether ``t``, a shared call's output (or what
    was computed from it), is widened to that sample. So is one the forward mode found the
    same for every sample (:data:`FREE`: computed from factories' results and parameters
    alone) whose call's axis 0 is not of size 1 (T5's ``[T, T]`` buckets) or that has no tensor
    input (HF Swin's bias tables): a call of batch size 1 on inputs already is the sample's, and
    a call on the sample itself (a token embedding of ``[1, T]`` ids, also marked shared as a
    call on inputs that need no gradient) is no table."""
    info = getattr(t, SHARED, None)
    return (
        info is not None and hasattr(t, FREE)
        and (info[0].batch_size != 1 or not info[0].versions)  # (or without tensor inputs)
    )


def _one_sample() -> bool:
    """The top-level forward runs on one sample: an operand of batch size 1 is that sample,
    and a shared table that meets it is widened to it (as to ``N`` samples), so that its call
    gets the batch size of the rest (a rank of a distributed run with a local batch of one)."""
    return FORWARD.root_batch == 1


def _attention_mask(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``scaled_dot_product_attention(q, k, v, attn_mask)`` with a shared mask (a relative
    position bias passed as the additive mask, Hugging Face's T5 with SDPA): widened against
    the scores ``[*q.shape[:-1], k.shape[-2]]``, whose axis 0 holds the batch."""
    q = args[0] if args else kwargs.get("query")
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if (
        isinstance(mask, Tensor) and hasattr(mask, _ROWS) and isinstance(q, Tensor)
        and q.requires_grad and q.dim() == mask.dim() and q.shape[0] == mask.shape[0]
    ):  # (a widened bias and a constant mask, combined: the queries tell its rows)
        _rows_met(getattr(mask, _ROWS), [q])
    if not isinstance(q, Tensor) or not isinstance(mask, Tensor) or not mask.requires_grad:
        return args, kwargs
    if q.dim() < 3 or mask.dim() > q.dim() or q.shape[0] < 1 or (
        q.shape[0] == 1 and not (_one_sample() and _free(mask))
    ):
        return args, kwargs
    wide = _widen_shared(mask, q.dim(), q.shape[0], (q,))
    if wide is None:
        return args, kwargs
    return with_attn_mask(args, kwargs, wide)


def with_attn_mask(args: tuple, kwargs: dict, mask: Tensor) -> tuple[tuple, dict]:
    """``scaled_dot_product_attention``'s arguments with ``attn_mask`` replaced by ``mask``,
    where it was passed (by position or keyword)."""
    if len(args) > 3:
        return (*args[:3], mask, *args[4:]), kwargs
    return args, kwargs | {"attn_mask": mask}


def _widen_shared(
    t: Tensor, rank: int, n: int, against: tuple[Tensor, ...] = (), added: bool = False
) -> Tensor | None:
    """``t``'s copies per sample ``[n, ...]``, aligned with the operands of rank ``rank`` it
    is broadcast against (whose axis 0 holds the batch), if ``t`` is computed from a shared
    call's output alone and broadcasting puts a new or size-1 axis of it against the batch.
    ``against``: those operands, where known (recorded as :attr:`Call.meets`); ``added``: ``t``
    is added to them as it is (``x + t``). The copies of a :data:`CURVED` value replay its
    nonlinear operations without the forward mode: they carry the DiagHessian family's
    refusal."""
    g = _rows_per_sample(n, against)
    copies = _copies(t, rank, n // g, against, added, g)
    curved = getattr(t, CURVED, None)
    if copies is not None and curved is not None:
        residual.add_error(
            copies, f"the nonlinear operation '{curved}' on a value all samples share (before "
            "it meets them)", why="its Hessian term on each sample's copy is not built",
        )
    if copies is not None and g > 1:
        copies = copies.unsqueeze(1).expand(n // g, g, *copies.shape[1:]).flatten(0, 1)
    return copies


def _rows_per_sample(n: int, against: tuple[Tensor, ...]) -> int:
    """``g`` where the ``n`` rows a shared value meets may fold the forward's ``N`` samples
    with another axis, sample-major (``n = g·N``, ``g > 1``: Swin's windows), and a per-sample
    tensor among ``against`` will tell whether they do; else 1.

    The value is then widened to ``N`` copies, each repeated over its sample's ``g`` rows:
    the shared call's widened inputs, its replayed operations and their backward cost ``N``
    copies, not ``g·N`` (Swin V2's position-bias MLP, ``[ws², 512]`` hidden activations, met
    by 16–64 windows a sample). The backward pass refuses the pass where those tensors' rows
    are not so folded (:attr:`~backprism.engine.state.Call.repeats`)."""
    root = FORWARD.root_batch
    if not root or n <= root or n % root:
        return 1
    return n // root if any(b.requires_grad for b in against) else 1


def _copies(
    t: Tensor, rank: int, n: int, against: tuple[Tensor, ...], added: bool, g: int = 1
) -> Tensor | None:
    """``t``'s copies per sample ``[n, ...]`` (:func:`_widen_shared`), to be repeated ``g``
    times each against ``against``."""
    info = getattr(t, SHARED, None)
    if info is None or t.dim() > rank:
        return None
    call, origin, replay = info
    aligned = (1,) * (rank - t.dim()) + tuple(t.shape)
    if aligned[0] != 1 or call.batch_axis:
        return None
    if origin is None:
        origin = t
    batch_one = call.batch_size == 1 and origin.dim() > 0 and origin.shape[0] == 1
    if not batch_one:
        rule = get_rule(call.module)
        # rules that act on trailing feature axes, and the generic rule (which runs each
        # sample's call on its inputs as they are), take a call widened by a new leading axis
        if not (rule.moves_batch_axis or rule.folds_rows):
            return None
    key = (id(call), n, batch_one)
    done = FORWARD.widened.get(key)
    if done is not None:
        # widened for an earlier consumer (every layer's use of T5's bias, the key and query
        # projections of DeBERTa's relative embeddings): its copies serve this one too, so the
        # call stays one call, its per-sample gradients summed over the consumers by autograd
        _repeated(done[2], g, against)
        return _replayed(done[1], replay, batch_one, n, aligned)
    live = call.live if call.live is not None else (call.args, call.kwargs)
    if any(
        isinstance(a, Tensor) and a.requires_grad for a in (*live[0], *live[1].values())
    ):
        # inputs computed by other calls (a shared value of two modules in a row): the call is
        # widened on its inputs' copies per sample, which widen those calls in turn
        widened = _recomputed(call, live, n, batch_one, against)
        if widened is None:
            where = (
                f"reaches the samples only as the input of {call.name}, which backprism "
                "cannot widen to each sample's copy of it (an operation on the way that "
                "it does not follow, or a layer whose rule takes no widened call), so its "
                "gradient has no per-sample split"
            )
            for a in (*live[0], *live[1].values()):
                for upstream in getattr(a, FREE, None) or ():
                    _unsplit(upstream, where)
            return None
        expanded, wide = widened
    elif batch_one:
        # a call of batch size 1 (a convolution on a [1, C, H, W] grid): its inputs are
        # expanded along their axis 0, as for any batch, which every rule takes
        wide = origin.expand(n, *origin.shape[1:])
        expanded = _expanded(call, lambda x, n=n: expand_rows(x, n), wide, against)
    else:

        def widen(x: Any, n: int = n) -> Any:
            return x.unsqueeze(0).expand(n, *x.shape) if isinstance(x, Tensor) else x

        wide = widen(origin)
        expanded = _expanded(call, widen, wide, against)
    if not attach(expanded, [wide]):
        return None
    call.superseded = True
    FORWARD.acted += 1
    if (
        added and batch_one and replay is None and not expanded.input_edges and expanded.meets
        and g == 1
    ):
        # (BackwardPass._widen_batch_one does the same, from the addition's other operand;
        # not where that operand is a constant, as Swin's shifted-window mask: the rows are
        # then read from what the sum meets next, which only the mode follows)
        FORWARD.deferred_acts += 1
    FORWARD.widened[key] = (call, wide, expanded)
    _repeated(expanded, g, against)
    copies = _replayed(wide, replay, batch_one, n, aligned)
    if against and not expanded.meets:  # met constants only: what it meets next tells its rows
        setattr(copies, _ROWS, [expanded])
        FORWARD.rows_pending += 1
    return copies


def _repeated(call: Call, g: int, against: tuple[Tensor, ...]) -> None:
    """Record that ``call``'s copies meet the tensors ``against`` repeated ``g`` times each."""
    if g > 1:
        edges = tuple(get_gradient_edge(b) for b in against if b.requires_grad)
        call.repeats = (*call.repeats, (g, edges))


def _replayed(
    wide: Tensor, replay: Any, batch_one: bool, n: int, aligned: tuple[int, ...]
) -> Tensor:
    """The copies per sample of the shared tensor that ``replay`` rebuilds from the call's
    output, given the call's output copies ``wide``."""
    if replay is None:
        copies = wide
    elif batch_one:
        copies = vmap(lambda o: replay(o.unsqueeze(0)))(wide)
    else:
        copies = vmap(replay)(wide)
    return copies.reshape(n, *aligned[1:])


def _recomputed(
    call: Call, live: tuple[tuple, dict], n: int, batch_one: bool, against: tuple[Tensor, ...]
) -> tuple[Call, Tensor] | None:
    """``call`` widened on its inputs' copies per sample (each input computed by shared calls
    widened by :func:`_widen_shared`, every other one expanded) through a :class:`_Spread`,
    and its output there, or ``None`` where an input cannot be widened. ``batch_one``: the
    copies are laid out along the call's axis 0 of size 1; otherwise they form a new leading
    axis."""
    tensors: list[Tensor] = []

    def copies(a: Any) -> Any:
        if not isinstance(a, Tensor):
            return a
        if batch_one and (a.dim() == 0 or a.shape[0] != 1):
            # (not along the batch: as it is)
            wide = None if getattr(a, FREE, None) or a.requires_grad else a
        elif getattr(a, FREE, None):
            wide = _widen_shared(a, a.dim() + 1, n, against)
        else:
            wide = a.unsqueeze(0).expand(n, *a.shape)
            if a.requires_grad:
                wide = _parameter_copies(a, wide)
        if wide is None:
            raise _NotWidened
        if batch_one and wide is not a:
            wide = wide.flatten(0, 1)
        tensors.append(wide)
        return wide

    try:
        args = tuple(copies(a) for a in live[0])
        kwargs = {k: copies(v) for k, v in live[1].items()}
    except _NotWidened:
        return None
    spread = _Spread.prepare(call.module, live, (args, kwargs), n, batch_one)
    if spread is None:
        return None
    out = spread.apply()
    widened = _widened(
        call,
        out,
        against,
        args=tuple(detached(a) for a in args),
        kwargs={k: detached(v) for k, v in kwargs.items()},
        live=(args, kwargs),
        versions=[(a, a._version) for a in tensors],
        input_edges=[get_gradient_edge(a) for a in tensors if a.requires_grad],
        inner=None,
    )
    spread.call = widened
    return widened, out


class _Spread:
    r"""A shared call's output over the batch without running the call once per sample.

    All samples' copies of a shared call's inputs hold the same value, so the call's output on
    them is its output ``y`` on the inputs as they are, copied over the samples: the forward
    costs one call, not ``N``. ``y`` is computed from detached leaves ``x̃`` of those inputs (and
    the parameters), so its graph reaches the parameters and ``x̃`` only. What differs per
    sample is the backward (:class:`_SpreadFunction`), given the output gradient
    ``G = [G₁, …, G_N]``:

    * the parameters get ``Jₚᵀ Σₙ Gₙ`` through ``y``'s graph (one pull-back, as in a plain
      backward, with their hooks run once);
    * the inputs' copies get ``Jₓᵀ Gₙ`` in row ``n`` (``J``: the call's Jacobian at the shared
      inputs), by one ``torch.autograd.grad`` from ``y`` to ``x̃`` batched over the samples,
      where a backward pass collects from this call (``call.pass_`` is set); where nothing
      collects, no per-sample split is needed upstream and ``Jₓᵀ Σₙ Gₙ`` goes to row 0, the
      other rows zero (the same sum upstream at the cost of one pull-back);
    * under ``create_graph=True`` (double backward, Hessian-vector products) the call is run
      on the copies per sample and both gradients come from that graph, so that they are
      differentiable in the inputs and parameters.

    A call that draws random numbers itself (a module that applies dropout in its own forward)
    draws the same ones in that last case: the generator states from before and after its
    forward call are kept, the re-run starts from the first under ``vmap``'s ``"same"``
    randomness (one draw for all samples, as in the forward) and must end at the second, or it
    is refused; the generators then go on where they were."""

    def __init__(self) -> None:
        self.call: Call | None = None  # the widened call, once built (which pass collects)

    @classmethod
    def prepare(
        cls, module: nn.Module, live: tuple[tuple, dict], copies: tuple[tuple, dict], n: int,
        batch_one: bool,
    ) -> _Spread | None:
        """The spread of ``module`` called on ``live`` (its inputs as passed) to ``copies``
        (the same structure, each input's copies per sample: ``[n, ...]``, or along axis 0 of
        size 1 for ``batch_one``); ``None`` if its output is not one tensor."""
        self = cls()
        flat_live, spec = tree_flatten(live)
        flat_copies, _ = tree_flatten(copies)
        self.diff = [
            i for i, c in enumerate(flat_copies) if isinstance(c, Tensor) and c.requires_grad
        ]
        leaves = [detached(a) for a in flat_live]
        self.leaves = [leaves[i].requires_grad_() for i in self.diff]
        for i, x in zip(self.diff, self.leaves):
            leaves[i] = x
        args, kwargs = tree_unflatten(leaves, spec)
        device = _device(flat_live, module)
        before = _rng_states(device)
        with suspended(), torch.enable_grad():
            y = module(*args, **kwargs)
        if not isinstance(y, Tensor) or not y.requires_grad:
            return None
        after = _rng_states(device)
        #: the generator states around the forward call if it drew random numbers (rerun)
        self.rng = None if _same_states(before, after) else (device, before, after)
        self.y, self.spec, self.module, self.n, self.batch_one = y, spec, module, n, batch_one
        self.others = [None if i in self.diff else c for i, c in enumerate(flat_copies)]
        self.copies = [flat_copies[i] for i in self.diff]
        named = [(k, p) for k, p in module.named_parameters() if p.requires_grad]
        self.names, self.params = [k for k, _ in named], [p for _, p in named]
        return self

    def apply(self) -> Tensor:
        """The output's copies per sample, ``[n, ...]`` (for ``batch_one``: ``y`` expanded
        along its axis 0), in the graph through :class:`_SpreadFunction`."""
        return _SpreadFunction.apply(self, self.y, *self.copies, *self.params)

    def pull_back(self, g: Tensor) -> tuple[Tensor | None, ...]:
        """The gradients of ``y`` and of the inputs' copies for the output gradient ``g``
        (``[n, ...]``), per sample where a backward pass collects (see the class docstring)."""
        total = g.sum(0, keepdim=self.batch_one)
        if not self.leaves:
            return (total,)
        if self.call is not None and self.call.pass_ is not None:
            cot = g.unsqueeze(1) if self.batch_one else g
            xs = torch.autograd.grad(
                self.y, self.leaves, cot, retain_graph=True, is_grads_batched=True,
                allow_unused=True,
            )
            per_sample = [
                None if x is None else x.flatten(0, 1) if self.batch_one else x for x in xs
            ]
            return (total, *per_sample)
        xs = torch.autograd.grad(self.y, self.leaves, total, retain_graph=True, allow_unused=True)
        rows = []
        for x in xs:  # nothing collects: the sum, as sample 0's
            if x is None:
                rows.append(None)
                continue
            first = x[0] if self.batch_one else x
            z = first.new_zeros(self.n, *first.shape)
            z[0] = first
            rows.append(z)
        return (total, *rows)

    def rerun(self, inputs: tuple[Tensor, ...], g: Tensor) -> tuple[Tensor | None, ...]:
        """The gradients of the inputs' copies and of the parameters for ``g`` as a
        differentiable function of them (``create_graph=True``): the call run on the copies per
        sample, on aliases of the parameters (so that their own hooks run once, when the
        returned gradients reach them)."""
        k = len(self.diff)
        copies, params = inputs[:k], inputs[k:]
        aliases = [p.view_as(p) for p in params]
        leaves = list(self.others)
        for i, x in zip(self.diff, copies):
            leaves[i] = x
        args, kwargs = tree_unflatten(leaves, self.spec)
        module, state = self.module, dict(zip(self.names, aliases))

        def run(a: tuple, kw: dict) -> Tensor:
            return functional_call(module, state, a, kw)

        with suspended(), torch.enable_grad():
            if self.rng is not None:
                out = self._redraw(run, args, kwargs)
            elif self.batch_one or get_rule(module).moves_batch_axis:
                out = run(args, kwargs)
            else:
                dims = tree_map(lambda x: 0 if isinstance(x, Tensor) else None, (args, kwargs))
                out = vmap(run, in_dims=dims)(args, kwargs)
            return torch.autograd.grad(
                out, (*copies, *aliases), g, create_graph=True, allow_unused=True
            )

    def _redraw(self, run: Callable[..., Tensor], args: tuple, kwargs: dict) -> Tensor:
        """``run`` over the samples' copies with the random numbers the forward call drew: one
        draw for all samples (``vmap``'s ``"same"`` randomness) from the generator states it
        started from, which must end where it ended; the generators are left as they were."""
        device, before, after = self.rng
        now = _rng_states(device)
        _set_rng_states(device, before)
        try:
            if self.batch_one:  # [n, ...] copies of a [1, ...] input: each sample's is [1, ...]
                args, kwargs = tree_map(
                    lambda x: x.unsqueeze(1) if isinstance(x, Tensor) else x, (args, kwargs)
                )
            dims = tree_map(lambda x: 0 if isinstance(x, Tensor) else None, (args, kwargs))
            out = vmap(run, in_dims=dims, randomness="same")(args, kwargs)
            drawn = _same_states(_rng_states(device), after)
        finally:
            _set_rng_states(device, now)
        if not drawn:
            name = getattr(self.module, "_backprism_name", None) or type(self.module).__name__
            raise RuntimeError(
                f"backprism: {name} draws random numbers in its forward (dropout) and its output "
                "is shared by all samples; running it again for this create_graph=True backward "
                "did not draw the same numbers as the forward. Run such passes with the model in "
                "eval mode (model.eval()) or without that randomness."
            )
        return out.flatten(0, 1) if self.batch_one else out


def _device(flat: list[Any], module: nn.Module) -> torch.device:
    """The device of a shared call: of its first tensor input, else of its first parameter."""
    for t in flat:
        if isinstance(t, Tensor):
            return t.device
    p = next(module.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def _rng_states(device: torch.device) -> tuple[Tensor, ...]:
    """The states of the generators a call on ``device`` draws from: the CPU's, and a CUDA
    device's own."""
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def _set_rng_states(device: torch.device, states: tuple[Tensor, ...]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def _same_states(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


class _SpreadFunction(torch.autograd.Function):
    """``y`` copied over the samples; the backward is :meth:`_Spread.pull_back` (or
    :meth:`_Spread.rerun`)."""

    @staticmethod
    def forward(ctx: Any, spread: _Spread, y: Tensor, *inputs: Tensor) -> Tensor:
        ctx.spread = spread
        ctx.save_for_backward(*inputs)
        y = y.detach()
        if spread.batch_one:
            return y.expand(spread.n, *y.shape[1:])
        return y.unsqueeze(0).expand(spread.n, *y.shape)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        spread = ctx.spread
        if torch.is_grad_enabled():  # create_graph=True
            return (None, None, *spread.rerun(ctx.saved_tensors, g))
        grads = spread.pull_back(g)
        return (None, *grads, *(None for _ in spread.params))


def _parameter_copies(a: Tensor, wide: Tensor) -> Tensor | None:
    """``wide``, the copies per sample of ``a`` (an input of a shared call that needs a
    gradient and comes from no call: an extended parameter, DeBERTa's relative embeddings
    through a LayerNorm, or a view of one), recorded as the parameter broadcast over the
    batch; ``None`` for any other such input."""
    view = param_view(a)
    if view is None:
        return None
    p, rebuild, _ = view

    def source(q: Tensor, rebuild: Any = rebuild) -> Tensor:
        return rebuild(q).unsqueeze(0)

    return None if broadcast_param(p, source, wide) is None else wide


class _NotWidened(Exception):
    """An input of a call to widen has no copies per sample."""
