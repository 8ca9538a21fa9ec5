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

The original call is marked ``superseded`` (ignored by the backward pass). Each widening
consumes the call's output exactly once in the autograd graph; the graph check
(:func:`backprism.engine.graph.analyse`) refuses a pass in which the output is also used
elsewhere, where its gradient would reach the parameters without being split per sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.func import vmap

from backprism.engine.forward import attach
from backprism.engine.rule import get_rule
from backprism.engine.state import FORWARD, FREE, SHARED, Call

__all__ = ["EXPANDS", "MEETS", "after_operation", "broadcast_calls"]

#: elementwise operations that broadcast their tensor operands against each other
_ELEMENTWISE = frozenset(
    {
        "add", "__add__", "__radd__", "__iadd__", "sub", "__sub__", "__rsub__", "__isub__",
        "mul", "__mul__", "__rmul__", "__imul__", "div", "__truediv__", "__rtruediv__",
        "__itruediv__", "true_divide", "where",
    }
)
_IN_PLACE = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__"})
_ATTENTION = frozenset({"scaled_dot_product_attention"})
#: operations where a shared tensor may meet the samples (:func:`broadcast_calls`)
MEETS = _ELEMENTWISE | _ATTENTION
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
        reps = args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
        return len(tuple(reps)) == out.dim() and all(r == 1 for r in tuple(reps)[1:])
    return True


#: factory functions: their results are the same for every sample
_FACTORIES = frozenset(
    {"arange", "range", "zeros", "ones", "full", "empty", "linspace", "logspace", "eye",
     "tensor", "as_tensor", "tril_indices", "triu_indices"}
)


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


def after_operation(name: str, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """What the forward mode does after each operation ``out = func(*args, **kwargs)``:
    follows shared calls' outputs through views and elementwise operations with constants
    (:func:`follow_shared`), widens one expanded over the batch, and marks a shared call whose
    output meets a tensor of higher rank, or of a larger axis 0, in any other way (its axis 0
    is then not the samples'); marks ``out`` if it is the same for every sample
    (:func:`mark_free`); returns ``out`` or its widened copies."""
    mark_free(name, args, kwargs, out)
    if name in FOLLOWS:
        if name in _OVER_BATCH and isinstance(out, Tensor) and out.dim() and out.shape[0] > 1:
            src = args[0] if args else None
            info = getattr(src, SHARED, None) if isinstance(src, Tensor) else None
            if info is not None and src.requires_grad and _over_batch(name, src, args, out):
                # shared.expand(N, ...), shared.repeat(N, 1, ...): over the samples explicitly
                wide = _widen_shared(src, out.dim(), out.shape[0])
                if wide is not None:
                    # (repeat copies: its result is contiguous, viewable as the caller expects)
                    wide = wide.expand(out.shape)
                    return wide.contiguous() if name == "repeat" else wide
                if info[0].unsplit is None:
                    info[0].unsplit = name
                    FORWARD.acted += 1
                return out
        follow_shared(name, func, args, kwargs, out)
    if len(args) > 1 and isinstance(out, Tensor) and out.dim() and out.shape[0] > 1:
        rank, n = out.dim(), out.shape[0]
        tensors = [a for a in args if isinstance(a, Tensor)]
        # another operand holds the output's axis 0 (the batch, where it is per-sample)
        if len(tensors) > 1 and any(b.dim() == rank and b.shape[0] == n for b in tensors):
            for a in tensors:
                if a.dim() < rank or a.shape[0] == 1:
                    info = getattr(a, SHARED, None)
                    if info is not None and a.requires_grad and info[0].unsplit is None:
                        info[0].unsplit = name
                        FORWARD.acted += 1
    return out


def follow_shared(name: str, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """After ``out = func(*args, **kwargs)`` in an extended forward: if the one operand that
    needs a gradient is (computed from) a shared call's output and ``out`` is a view of it or
    has its shape (constants broadcast into it, not it over anything), mark ``out`` with the
    call and the replay that rebuilds ``out`` from that output."""
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
    call, origin, before = info
    if origin is None:
        origin = src

    def replay(x: Tensor, before=before, func=func, args=args, kwargs=kwargs, pos=pos) -> Tensor:
        x = x if before is None else before(x)
        if isinstance(pos, int):
            return func(*args[:pos], x, *args[pos + 1 :], **kwargs)
        return func(*args, **(kwargs | {pos: x}))

    setattr(out, SHARED, (call, origin, replay))


def _expand_arg(a: Any, n: int) -> Any:
    if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == 1:
        return a.expand(n, *a.shape[1:])
    return a


def _widened(call: Call, widen: Callable[[Any], Any], wide: Tensor) -> Call:
    """The same call on its inputs widened to the batch by ``widen``, with output ``wide``."""
    live = call.live
    return dataclasses.replace(
        call,
        args=tuple(widen(x) for x in call.args),
        kwargs={k: widen(v) for k, v in call.kwargs.items()},
        out_shapes=[wide.shape],
        batch_size=wide.shape[0],
        pass_=None,
        superseded=False,
        unsplit=None,
        live=None
        if live is None
        else (tuple(widen(x) for x in live[0]), {k: widen(v) for k, v in live[1].items()}),
        widened_from=call,
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
    n = max(t.shape[0] for t in tensors if t.dim() == rank) if rank else 1
    if n <= 1:
        return args, kwargs
    new_args = list(args)
    for i, a in enumerate(args):
        if i == 0 and name in _IN_PLACE:
            continue  # written into: it keeps its shape
        if isinstance(a, Tensor) and a.requires_grad and (a.dim() < rank or a.shape[0] == 1):
            wide = _widen_shared(a, rank, n)
            if wide is not None:
                new_args[i] = wide
    return tuple(new_args), kwargs


def _attention_mask(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``scaled_dot_product_attention(q, k, v, attn_mask)`` with a shared mask (a relative
    position bias passed as the additive mask, Hugging Face's T5 with SDPA): widened against
    the scores ``[*q.shape[:-1], k.shape[-2]]``, whose axis 0 holds the batch."""
    q = args[0] if args else kwargs.get("query")
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if not isinstance(q, Tensor) or not isinstance(mask, Tensor) or not mask.requires_grad:
        return args, kwargs
    if q.dim() < 3 or mask.dim() > q.dim() or q.shape[0] <= 1:
        return args, kwargs
    wide = _widen_shared(mask, q.dim(), q.shape[0])
    if wide is None:
        return args, kwargs
    if len(args) > 3:
        return (*args[:3], wide, *args[4:]), kwargs
    return args, kwargs | {"attn_mask": wide}


def _widen_shared(t: Tensor, rank: int, n: int) -> Tensor | None:
    """``t``'s copies per sample ``[n, ...]``, aligned with the operands of rank ``rank`` it
    is broadcast against (whose axis 0 holds the batch), if ``t`` is computed from a shared
    call's output alone and broadcasting puts a new or size-1 axis of it against the batch."""
    info = getattr(t, SHARED, None)
    if info is None or t.dim() > rank:
        return None
    call, origin, replay = info
    aligned = (1,) * (rank - t.dim()) + tuple(t.shape)
    if aligned[0] != 1 or call.batch_axis:
        return None
    if origin is None:
        origin = t
    if call.batch_size == 1 and origin.dim() and origin.shape[0] == 1:
        # a call of batch size 1 (a convolution on a [1, C, H, W] grid): its inputs are
        # expanded along their axis 0, as for any batch, which every rule takes
        wide = origin.expand(n, *origin.shape[1:])
        expanded = _widened(call, lambda x, n=n: _expand_arg(x, n), wide)

        def per_sample(o: Tensor, replay: Any = replay) -> Tensor:
            return replay(o.unsqueeze(0))

    else:
        rule = get_rule(call.module)
        # rules that act on trailing feature axes, and the generic rule (which runs each
        # sample's call on its inputs as they are), take a call widened by a new leading axis
        if not (rule.moves_batch_axis or rule.folds_rows):
            return None

        def widen(x: Any, n: int = n) -> Any:
            return x.unsqueeze(0).expand(n, *x.shape) if isinstance(x, Tensor) else x

        wide = widen(origin)
        expanded = _widened(call, widen, wide)
        per_sample = replay
    if not attach(expanded, [wide]):
        return None
    call.superseded = True
    FORWARD.acted += 1
    live = call.live[0] if call.live is not None else call.args
    for a in live:
        # calls its inputs were computed by: their outputs reach the samples only through
        # this call, along axes that are not the samples' (a shared value of two modules)
        for upstream in getattr(a, FREE, None) or ():
            if upstream.unsplit is None:
                upstream.unsplit = f"the input of {call.name}"
    copies = wide if replay is None else vmap(per_sample)(wide)
    return copies.reshape(n, *aligned[1:])
