"""Forward recording: what the hooks that :func:`~backprism.engine.extend.extend` registers
capture during a forward pass.

Only modules that *own* parameters (and loss modules, and BatchNorm for its train-mode check)
are hooked; everything between them — residual additions, attention, functional code — is left
to autograd. For each call of a hooked module under ``torch.enable_grad()`` the hook

* builds a :class:`~backprism.engine.state.Call` (detached inputs, their gradient edges, the
  parameters the call is responsible for) and stores it in the metadata of the autograd node
  that produced each output, together with the output's index (:func:`capture`);
* registers nothing else for a single-output call: a backward pass that collects registers a
  pre-hook on the output's node when it starts, which hands ``∂L/∂out`` to it; a forward whose
  backward collects nothing pays for no hook. Calls with several outputs get a multi-grad hook
  on their outputs at forward time (their gradients must arrive together).

The loss hook stores a :class:`~backprism.engine.state.LossRecord` on the loss output's node; the
root hooks store a :class:`~backprism.engine.state.RootRecord` on the outputs of every top-level
forward of an extended model and run the :data:`~backprism.engine.state.FORWARD_LISTENERS`
around it (the mode that records nonlinearities and functional parameter uses).

Reference structure: a node holds the records of the calls that produced its outputs; a call
holds only what is upstream of that node. Records are freed with the graph.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

from backprism.engine.parametrized import originals
from backprism.engine.rule import (
    batch_first_args,
    get_rule,
    move_batch_axis,
    moves_batch_axis,
)
from backprism.engine.state import (
    AXIS,
    BASES,
    CALLS,
    FORWARD,
    FORWARD_LISTENERS,
    FREE,
    LOSS,
    NO_INPUT,
    ROOT,
    SHARED,
    Call,
    Kept,
    LossRecord,
    RootRecord,
    forget_mode_free,
    sequence_first,
)

__all__ = [
    "call_params",
    "capture",
    "detached",
    "keep_linear",
    "loss_forward_hook",
    "module_forward_hook",
    "module_pre_hook",
    "module_pre_hook_inside",
    "pause_body",
    "resume_body",
]


#: hooks run inside the forward mode of an extended model; their own tensor operations
#: (``detach``, ``grad_fn``, ``requires_grad``, …) must not go through it
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction


def detached(x: Any) -> Any:
    """``x.detach()`` for a tensor, anything else as it is."""
    return x.detach() if isinstance(x, Tensor) else x


def _flat(a: Any) -> bool:
    """``a`` is a tensor or a scalar leaf (no container to walk)."""
    return a is None or isinstance(a, (Tensor, bool, int, float, str))


def root_pre_hook(module: nn.Module, args: Any, kwargs: Any = None) -> None:
    if FORWARD.suspended:
        return
    FORWARD.root_stack.append(module)
    if len(FORWARD.root_stack) > 1:  # nested root: belongs to the outer one
        return
    FORWARD.call_stack.clear()
    FORWARD.layouts = False
    FORWARD.root_batch = _leading_size(args, kwargs)
    for enter, _ in FORWARD_LISTENERS:
        enter(module)


def _leading_size(args: tuple, kwargs: dict | None) -> int | None:
    """Axis 0's size of the first tensor of a top-level forward's inputs (its batch, for
    :mod:`engine.broadcast`, which must tell a batch of one sample from a table shared by all
    samples), or ``None``."""
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, Tensor) and a.dim() > 0:
            return int(a.shape[0])
    return None


def root_post_hook(module: nn.Module, args: Any, output: Any) -> None:
    if FORWARD.suspended or not FORWARD.root_stack:
        return
    FORWARD.root_stack.pop()
    if FORWARD.root_stack:
        return
    recorded = FORWARD.recording > 0  # the mode recorded this forward's nonlinearities
    modeless = FORWARD.free_ops
    if modeless is not None:
        exit_local_modes()
    for _, exit_ in reversed(FORWARD_LISTENERS):
        exit_(module, output)
    if torch.is_grad_enabled():
        with _NO_TORCH_FUNCTION():
            _record_root(module, args, output, recorded, modeless)


def _record_root(
    module: nn.Module, args: Any, output: Any, recorded: bool, modeless: frozenset[str] | None
) -> None:
    outs = [output] if isinstance(output, Tensor) else tree_flatten(output)[0]
    record = None
    for o in outs:
        if isinstance(o, Tensor) and o.grad_fn is not None:
            if record is None:
                flat = all(_flat(a) for a in args)
                inputs = tuple(detached(a) if flat else tree_map(detached, a) for a in args)
                leaves = args if flat else tree_flatten(args)[0]
                stops = tuple(
                    a.grad_fn for a in leaves if isinstance(a, Tensor) and a.grad_fn is not None
                )
                record = RootRecord(module, inputs, recorded, stops, modeless, FORWARD.root_batch)
            o.grad_fn.metadata[ROOT] = record


_NONE: frozenset[int] = frozenset()
_PARAMETRIZATIONS = (torch.nn.utils.parametrize.ParametrizationList,)


def _new_frame(module: nn.Module) -> list[Any]:
    """A :data:`~backprism.engine.state.FORWARD` call-stack frame (see its docstring)."""
    return [
        module, set(), _NONE, None, None, None, not module._modules, None, None, None, False, None
    ]


#: ``[factory(functions)]`` of the light mode entered for one releasing module's forward inside
#: a top-level forward without the forward mode (set by ``engine.functional``, which builds on
#: this module)
LOCAL_MODE: list[Any] = [None]


def _exit_local(frame: list[Any]) -> None:
    """Leave the local forward mode ``frame`` entered (:func:`module_pre_hook_inside`)."""
    mode = frame[7]
    if mode is not None:
        frame[7] = None
        paused = frame[11]
        frame[11] = None
        if paused is not None and paused[1]:
            return  # left already when the body's sub-module call paused it
        _leave(mode)


def _enter_mode(mode: Any) -> None:
    """Enter a local forward mode (innermost in ``FORWARD.modes`` and on torch's stack)."""
    mode.__enter__()
    FORWARD.modes.append(mode)


def _leave(mode: Any) -> None:
    """Leave a local forward mode :func:`_enter_mode` entered."""
    if FORWARD.modes and FORWARD.modes[-1] is mode:
        FORWARD.modes.pop()
    mode.__exit__(None, None, None)


def _on_top(mode: Any) -> bool:
    """Whether ``mode`` is the innermost ``__torch_function__`` mode entered."""
    n = torch._C._len_torch_function_stack()
    return n > 0 and torch._C._get_function_stack_at(n - 1) is mode


def pause_body(module: nn.Module, *_: Any) -> None:
    """``module`` is called while the innermost frame is the forward of a module that released
    its parameters without replacement functions (a container's own ``pos_embed`` or layer
    scale, a norm subclass's ``F.layer_norm``): its operations are not that forward's *body*
    (``frame[11]`` says so until :func:`resume_body`), whose parameter uses alone the forward
    mode attributes there. In a forward without the mode, the body's local mode is left for the
    call, so that the sub-module's operations pay for no dispatch; a recorded forward counts a
    released parameter's use as needing the mode unless it lies in the body
    (:func:`~backprism.engine.functional.attribute`), so both kinds of forward agree."""
    stack = FORWARD.call_stack
    if not stack:
        return
    top = stack[-1]
    if not top[2] or top[5] is not None or top[11] is not None:
        return
    mode = top[7]
    left = mode is not None and _on_top(mode)
    if left:
        _leave(mode)
    top[11] = (id(module), left)


def resume_body(module: nn.Module, *_: Any) -> None:
    """The call :func:`pause_body` paused the innermost frame's body for has returned (or
    raised): the body goes on, with its local mode entered again where it was left."""
    stack = FORWARD.call_stack
    if not stack:
        return
    top = stack[-1]
    paused = top[11]
    if paused is None or paused[0] != id(module):
        return
    top[11] = None
    if paused[1] and top[7] is not None:
        _enter_mode(top[7])


def exit_local_modes() -> None:
    """Leave every local forward mode still entered (a module's forward raised before its
    forward hook ran); called at the end of the top-level forward. Innermost first: each is
    left from the top of the mode stack."""
    for frame in reversed(FORWARD.call_stack):
        _exit_local(frame)


def module_pre_hook(module: nn.Module, args: Any) -> None:
    stack = FORWARD.call_stack
    if stack and stack[-1][2]:
        pause_body(module)
    stack.append(_new_frame(module))


def module_pre_hook_inside(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """The pre-hook of modules whose rule overrides :meth:`~backprism.engine.rule.Rule.inside`:
    the frame carries the parameters the call releases and the ``F.linear`` uses it keeps."""
    stack = FORWARD.call_stack
    if stack and stack[-1][2]:
        pause_body(module)
    frame = _new_frame(module)
    stack.append(frame)
    if FORWARD.suspended or not torch.is_grad_enabled():
        return
    mode_on = bool(FORWARD.modes) and FORWARD.modes[-1] is not None
    # in a top-level forward without the mode (engine.functional) a light mode is entered for
    # this module's forward alone, which runs the rule's replacement functions (so the module
    # releases its parameters all the same) and passes every other operation through; or, for
    # a release without replacement functions, a forward mode for the forward's body alone
    # (pause_body)
    local = not mode_on and FORWARD.free_ops is not None and LOCAL_MODE[0] is not None
    # released uses are attributed by the forward mode (none without one: a sub-module called
    # on its own keeps its parameters)
    if not mode_on and not local:
        return
    with _NO_TORCH_FUNCTION():
        inside = get_rule(module).inside(module, args, kwargs)
        if not inside.release and not inside.keep:
            return
        if local and not inside.functions and not inside.release:
            return  # nothing the light mode can do (it keeps F.linear's operands)
        release = [(n, _parameter(module, n)) for n in inside.release]
        frame[2] = frozenset(id(p) for _, p in release if p is not None)
        if frame[2] and not inside.functions:
            # a release without replacement functions (the generic rule's): its calls are
            # recorded so that it can be undone (undo_release)
            frame[8] = []
            first = next((a for a in args if isinstance(a, Tensor) and a.dim() > 0), None)
            if first is not None:
                axis = getattr(first, AXIS, None)
                frame[9] = (
                    first.shape[axis if axis is not None and axis >= 0 else 0],
                    frozenset(id(a) for a in args if isinstance(a, Tensor)),
                )
        if inside.keep:
            keep = [(n, _parameter(module, n)) for n in inside.keep]
            frame[3] = {id(p): n for n, p in keep if p is not None}
            frame[4] = Kept()
        frame[5] = inside.functions
        first = next((a for a in args if isinstance(a, Tensor)), None)
        if (
            frame[2] and sequence_first(module) and first is not None and first.dim() == 3
            and getattr(first, AXIS, None) is None
        ):
            # the released parameters' calls inside see the batch on axis 1 of this input;
            # mark it (and move the call that produced it) before they are captured
            _batch_on_axis_one(first)
    if local:
        mode = LOCAL_MODE[0](inside.functions)
        _enter_mode(mode)
        frame[7] = mode


def _parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    """``module``'s parameter by dotted ``name`` (``"out_proj.weight"``), or ``None``: a few
    dictionary lookups instead of walking ``named_parameters()``."""
    *path, leaf = name.split(".")
    for step in path:
        module = module._modules.get(step)  # type: ignore[assignment]
        if module is None:
            return None
    return module._parameters.get(leaf)


def _data_ptr(t: Tensor) -> int | None:
    """``t.data_ptr()``, or ``None`` for a tensor without storage (inside a ``torch.func``
    transform, e.g. ``jacrev`` over ``functional_call``)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def keep_linear(p: Tensor, x: Any, out: Any) -> None:
    """Called by the forward mode for ``F.linear(x, p, ...)`` with ``p`` claimed by a module in
    its forward: kept if the innermost frame asked for it (:attr:`Inside.keep`)."""
    frame = FORWARD.call_stack[-1] if FORWARD.call_stack else None
    if frame is None or frame[3] is None or not isinstance(out, Tensor):
        return
    name = frame[3].get(id(p))
    if name is None or not isinstance(x, Tensor):
        return
    kept: Kept = frame[4]
    with _NO_TORCH_FUNCTION():
        # a second use of the parameter makes the record ambiguous: the rule recomputes
        kept.linear[name] = (
            None
            if name in kept.linear or (ptr := _data_ptr(out)) is None
            else (x.detach(), ptr, out.shape)
        )


def call_params(
    module: nn.Module, ran: AbstractSet[int], released: frozenset[int] = _NONE
) -> dict[str, nn.Parameter]:
    """Parameters a call of ``module`` is responsible for: its own, plus those of descendants
    whose forward did not run during the call (e.g. ``MultiheadAttention.out_proj``, used
    functionally), which therefore have no call of their own — less those ``released`` (ids)
    to functional attribution (:attr:`Inside.release`)."""
    params: dict[str, nn.Parameter] = {}
    seen: set[int] = set(released)
    for n, p in module._parameters.items():  # named_parameters(recurse=False), cheaper
        if p is not None and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params[n] = p
    if not module._modules:  # a leaf (Linear, Conv, ...): nothing else to look at
        return params
    _descendant_params(module, "", ran, released, params, {id(module)})
    return params


def _descendant_params(
    module: nn.Module, prefix: str, ran: AbstractSet[int], released: frozenset[int],
    params: dict[str, nn.Parameter], seen: set[int],
) -> None:
    """``named_modules()`` order (each module once) over ``module``'s descendants: the
    parameters of those not in ``ran``, less ``released`` — dictionary walks, without the
    generators of ``named_modules``/``named_parameters``."""
    for name, sub in module._modules.items():
        if sub is None or id(sub) in seen:
            continue
        seen.add(id(sub))
        path = prefix + name
        if id(sub) not in ran:
            own: set[int] = set()  # a parameter under two names of one module: the first
            for n, p in sub._parameters.items():
                if p is not None and id(p) not in own:
                    own.add(id(p))
                    if p.requires_grad and id(p) not in released:
                        params[f"{path}.{n}"] = p
        if sub._modules:
            _descendant_params(sub, path + ".", ran, released, params, seen)


def module_forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    with _NO_TORCH_FUNCTION():
        return _module_forward(module, args, kwargs, output)


#: nodes a walk of one call's own graph visits at most (:func:`_inner_outputs`)
_MAX_INNER_WALK = 100_000


def _inner_outputs(outs: list[Tensor], inputs: list[Tensor]) -> set[int]:
    """Indices of the outputs that another output was computed from inside the call (a
    router's ``(logits, logits.softmax(-1))``): a walk of the call's own graph from the
    outputs' nodes, stopping at the inputs' edges."""
    stop = {(id(a.grad_fn), a.output_nr) for a in inputs if a.grad_fn is not None}
    targets = {(id(o.grad_fn), o.output_nr): i for i, o in enumerate(outs) if o.grad_fn}
    targets = {key: i for key, i in targets.items() if key not in stop}  # (inputs returned)
    if not targets:
        return set()
    found: set[int] = set()
    stack = list({id(o.grad_fn): o.grad_fn for o in outs if o.grad_fn is not None}.values())
    seen = {id(f) for f in stack}
    while stack and len(seen) < _MAX_INNER_WALK:
        for f, k in stack.pop().next_functions:
            if f is None:
                continue
            key = (id(f), k)
            if key in targets:
                found.add(targets[key])
            if key not in stop and id(f) not in seen:
                seen.add(id(f))
                stack.append(f)
    return found


def _module_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    arg_tensors: list[Tensor]
    call_args: tuple
    call_kwargs: dict[str, Any]
    stack = FORWARD.call_stack
    frame = stack.pop() if stack else _new_frame(module)
    if frame[7] is not None:
        _exit_local(frame)
    ran = frame[1]
    if stack:
        if stack[-1][11] is not None:
            resume_body(module)
        # the module's whole subtree is accounted for — by the calls of descendants that ran,
        # or by this call (those that did not, e.g. MultiheadAttention.out_proj): an enclosing
        # call must not claim any of it
        parent = stack[-1][1]
        parent.add(id(module))
        parent.update(ran)
        if module._modules:
            parent.update(id(m) for m in module.modules())
    if not torch.is_grad_enabled() or FORWARD.suspended:
        return
    if (
        not module._modules and not kwargs and len(args) == 1 and isinstance(output, Tensor)
        and frame[2] is _NONE and frame[4] is None and not frame[10]
    ):
        x = args[0]
        if isinstance(x, Tensor) and _plain_leaf_call(module, x, stack):
            if output.requires_grad:
                _capture_leaf(module, x, args, output)
            return
    if isinstance(output, Tensor):  # the common case, without pytree traversals
        if not output.requires_grad:
            return
        outs = [output]
    else:
        flat = isinstance(output, tuple) and all(_flat(o) for o in output)  # (out, weights)
        outs = [o for o in (output if flat else tree_flatten(output)[0]) if isinstance(o, Tensor)]
        if not any(o.requires_grad for o in outs):
            return
    if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):  # Linear, Conv, norms
        arg_tensors = [args[0]]
        call_args = (args[0].detach(),)
        call_kwargs = {}
    elif all(_flat(a) for a in args) and all(_flat(v) for v in kwargs.values()):
        # tensors and scalars only (``attn_mask=None, need_weights=False``): no pytree walks
        arg_tensors = [a for a in args if isinstance(a, Tensor)]
        arg_tensors += [v for v in kwargs.values() if isinstance(v, Tensor)]
        call_args = tuple(detached(a) for a in args)
        call_kwargs = {k: detached(v) for k, v in kwargs.items()}
    else:
        arg_tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        call_args = tuple(tree_map(detached, a) for a in args)
        call_kwargs = {k: tree_map(detached, v) for k, v in kwargs.items()}
    if FORWARD.joined:
        settle_joined(frame)
    released = frame[2]
    if frame[10]:
        undo_release(frame)
        released = _NONE
    params = call_params(module, ran, released)
    if arg_tensors:  # a layer's parametrized weight: its originals (engine.parametrized)
        params.update((k, p) for k, p in originals(module).items() if id(p) not in released)
    if not arg_tensors and (not params or isinstance(module, _PARAMETRIZATIONS)):
        return  # (a parametrization's originals are refused by name, engine.backward)
    replaced = None
    if len(outs) > 1 and params:
        inner = _inner_outputs(outs, arg_tensors)
        if inner:
            # an output computed from another inside the call: the gradient at the latter
            # would carry the former's back through the module too, counted again by the
            # rule's vector-Jacobian product of the whole call; the model gets it through an
            # alias, whose gradient is only what reaches it from outside
            aliases = {id(outs[i]): outs[i].view_as(outs[i]) for i in inner}
            outs = [aliases.get(id(o), o) for o in outs]
            replaced = tree_map(
                lambda t: aliases.get(id(t), t) if isinstance(t, Tensor) else t, output
            )
    # (a call without tensor inputs, a relative position bias table's module in Hugging Face's
    # BEiT: its output is the same for every sample, widened where it meets them)
    kept: Kept | None = frame[4]
    if kept is not None:
        ptrs = [_data_ptr(o) for o in outs]
        # (no storage: a torch.func transform's tensors; the rule then recomputes)
        kept.outs = [] if None in ptrs else [(p, o.stride()) for p, o in zip(ptrs, outs)]
    first = arg_tensors[0] if arg_tensors else outs[0]
    if arg_tensors and sequence_first(module) and first.dim() == 3:
        # [T, N, features]: the batch on axis 1, in the outputs too (RNN: output, h_n, c_n;
        # attention: the output — its averaged weights [N, L, S] keep it on axis 0)
        if getattr(first, AXIS, None) is None:
            _batch_on_axis_one(first)
        # its rule (generic) takes the batch from axis 1 itself
        capture(
            module, call_args, call_kwargs, arg_tensors, outs, params,
            batch_size=first.shape[1], live=(args, kwargs), layout_ok=True, inner=kept,
        )
        for i, o in enumerate(outs):
            setattr(o, AXIS, 0 if isinstance(module, nn.MultiheadAttention) and i else 1)
        FORWARD.layouts = True
        if FORWARD.free_ops is not None and FORWARD.root_stack:
            # the mode follows such a batch axis through operations; without it the backward's
            # layout checks refuse what they cannot tell apart, and later forwards are recorded
            forget_mode_free(FORWARD.root_stack[0])
        return replaced
    capture(
        module, call_args, call_kwargs, arg_tensors, outs, params, live=(args, kwargs),
        inner=kept,
    )
    return replaced


def _plain_leaf_call(module: nn.Module, x: Tensor, stack: list[list[Any]]) -> bool:
    """Whether a call of the leaf ``module`` on the one tensor ``x`` takes the common path of
    :func:`capture` (:func:`_capture_leaf`): its input holds the batch on axis 0 as far as
    anything knows and is not the same for every sample, the module takes no batch from axis
    1, and no module in its forward released one of its parameters (a block releasing its
    own layer scale leaves its children's alone)."""
    if (
        getattr(x, AXIS, None) is not None
        or getattr(x, FREE, None) is not None
        or isinstance(module, nn.RNNBase)
    ):
        return False
    for f in stack:
        if f[2] and any(id(p) in f[2] for p in module._parameters.values()):
            return False
    return True


def _capture_leaf(module: nn.Module, x: Tensor, args: tuple, out: Tensor) -> None:
    """:func:`capture` for :func:`_plain_leaf_call`'s calls (a Linear, Conv or norm layer on
    one activation, nearly every call of a model): the same :class:`Call`, built without the
    checks that cannot apply, as it runs for every such call of every extended forward."""
    fn = out.grad_fn
    if fn is None:
        return
    params = call_params(module, _NONE)  # (a leaf: no descendants ran or not)
    call = Call(
        module=module,
        args=(x.detach(),),
        kwargs={},
        out_shapes=[out.shape],
        batch_size=x.shape[0] if x.dim() > 0 else 1,
        training=module.training,
        versions=[(x, x._version)],
        params=params,
        input_edges=[_edge(x)] if x.requires_grad else [],
        dtype=_autocast_dtype(x),
        unrecorded=FORWARD.unrecorded > 0,
        live=(args, {}),
    )
    fn.metadata.setdefault(CALLS, []).append((call, 0, out.output_nr))
    _note_base(call, out)
    if params and not call.input_edges:
        # on an input that needs no gradient: its output may be shared by all samples
        # (engine.broadcast widens it where it meets them)
        setattr(out, SHARED, (call, None, None))


def capture(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    arg_tensors: list[Tensor],
    outs: list[Tensor],
    params: dict[str, nn.Parameter],
    batch_size: int | None = None,
    live: tuple[tuple, dict] | None = None,
    layout_ok: bool = False,
    inner: Kept | None = None,
) -> Call | None:
    """Record one call (of a module, or a functional use of parameters with a stand-in
    ``module``) whose outputs ``outs`` were computed from ``arg_tensors``; ``args``/``kwargs``
    detached, ``live`` the same as passed (not detached)."""
    first = arg_tensors[0] if arg_tensors else outs[0]
    axis = getattr(first, AXIS, None) if arg_tensors else None
    moved = 0
    if axis and axis > 0 and not layout_ok and moves_batch_axis(module, first, axis):
        # the batch on another axis of the first input (Linear after a batch_first=False RNN):
        # the call keeps that input with the batch on axis 0
        moved, layout_ok = axis, True
        args = batch_first_args(args, axis)
        if live is not None:
            live = (batch_first_args(live[0], axis), live[1])
        batch_size = first.shape[axis]
    # a call on inputs that need no gradient, its batch on axis 0: its output may be shared by
    # all samples (engine.broadcast widens it where it meets them)
    shareable = batch_size is None and not moved and len(outs) == 1 and bool(params)
    sources = [getattr(a, FREE, None) for a in arg_tensors]
    # (also a call without tensor inputs; not a parameter expanded over the batch, whose call
    # is given its batch size)
    free = batch_size is None and None not in sources
    no_input = not arg_tensors and batch_size is None
    if batch_size is None:
        batch_size = first.shape[0] if first.dim() > 0 else 1
    call = Call(
        module=module,
        args=args,
        kwargs=kwargs,
        out_shapes=[o.shape for o in outs],
        batch_size=batch_size,
        training=module.training,
        versions=[(a, a._version) for a in arg_tensors],
        params=params,
        input_edges=[_edge(a) for a in arg_tensors if a.requires_grad],
        dtype=_autocast_dtype(first),
        unrecorded=FORWARD.unrecorded > 0,
        live=live,
        layout_error=None if layout_ok else _layout_error(module, arg_tensors),
        batch_axis=moved,
        assumed_axis=axis is None and not layout_ok,
        inner=inner,
        owner=_releaser(params),
        shared_inputs=frozenset(i for i, src in enumerate(sources) if src is not None),
    )
    if shareable and not free and call.layout_error is None:
        call.layout_error = _no_batch_in_outputs(call)
        shareable = call.layout_error is None  # (refused: not widened where it meets samples)
    if not attach(call, outs):
        return None
    if call.shared_inputs and getattr(get_rule(module), "folds_rows", False) and any(
        arg_tensors[i].dim() and arg_tensors[i].shape[0] == batch_size
        for i in call.shared_inputs
    ):
        # the generic rule splits inputs whose axis 0 has the batch's size, but for these
        # (the same for every sample): only the forward mode tells them, so the model keeps it
        FORWARD.acted += 1
    if shareable and call.owner is None and (free or not call.input_edges):
        # (a functional use of a released parameter is not: its release may be undone)
        setattr(outs[0], SHARED, (call, None, None))
    if no_input:
        # computed without any tensor input: per-sample only where widened over the samples
        # (engine.broadcast); a call left as it is is refused by the backward pass
        call.unsplit = NO_INPUT
    if free:
        # the same for every sample: computed by this call and those its inputs came from
        upstream = {id(c): c for src in sources for c in src}
        for o in outs:
            setattr(o, FREE, (call, *upstream.values()))
        if params and batch_size != 1:
            # (a model with such a call keeps the forward mode, which widens; one of batch size
            # 1 cannot be taken for the samples, and its widening counts where it happens)
            FORWARD.acted += 1
    frame = releasing_frame(params.values()) if call.owner is not None else None
    if frame is not None and frame[8] is not None:
        frame[8].append((call, [o.grad_fn for o in outs if o.grad_fn is not None]))
    return call


def _releaser(params: dict[str, nn.Parameter]) -> nn.Module | None:
    """The module in its forward that released one of ``params`` (:attr:`Inside.release`)."""
    frame = releasing_frame(params.values())
    return None if frame is None else frame[0]


def releasing_frame(params: Any) -> list[Any] | None:
    """The innermost frame of a module in its forward that released one of ``params``."""
    for frame in reversed(FORWARD.call_stack):
        if frame[2] and any(id(p) in frame[2] for p in params):
            return frame
    return None


def settle_joined(frame: list[Any]) -> None:
    """A module ends its forward: a vector joined from its released parameters
    (``engine.functional._joined``) that was not used as a linear layer's bias undoes the
    release; the others are marked ended (a later use, outside the forward, is refused by
    the graph check: ``engine.functional._joined_uses``)."""
    for entry in FORWARD.joined.values():
        if entry[0] is frame and not entry[2]:
            entry[2] = True
            if not entry[1]:
                frame[10] = True


def undo_release(frame: list[Any]) -> None:
    """Undo a module's release of its parameters (the generic rule's, see
    :meth:`~backprism.rules.generic.GenericRule.inside`) after one of their uses could not be
    attributed where it enters (two parameters met before any per-sample tensor, an operand
    that is not per-sample): the calls captured for them leave the graph's records, the
    module's own call claims the parameters (a ``vmap`` of its whole forward), and later
    calls of its type keep them from the start."""
    released = frame[2]
    for call, nodes in frame[8] or ():
        for node in nodes:
            entries = node.metadata.get(CALLS)
            if entries:
                entries[:] = [e for e in entries if e[0] is not call]
        call.params = {k: p for k, p in call.params.items() if id(p) not in released}
    frame[8] = None
    keep = getattr(get_rule(frame[0]), "keep", None)
    if keep is not None:
        keep(type(frame[0]))


def _edge(a: Tensor) -> GradientEdge:
    """``get_gradient_edge(a)`` without its Python overhead for the common case (an output of a
    built-in autograd node; leaves and custom ``autograd.Function`` outputs take the full path,
    which keeps the graph alive for the latter)."""
    fn = a.grad_fn
    if fn is not None and not isinstance(fn, torch._C._FunctionBase):
        return GradientEdge(fn, a.output_nr)
    return get_gradient_edge(a)


def _batch_on_axis_one(x: Tensor) -> None:
    """``x`` feeds a ``batch_first=False`` RNN, so its batch is on axis 1: the call that
    produced it (``Embedding``/``Linear`` directly before the RNN), which took axis 0 for the
    batch, is moved to axis 1; one whose rule cannot move it is marked for refusal."""
    fn = x.grad_fn
    if fn is None:
        return
    for call, _, nr in fn.metadata.get(CALLS, ()):
        if nr != x.output_nr or call.batch_axis or not call.assumed_axis or not call.args:
            continue
        if not move_batch_axis(call, 1):
            call.layout_error = _layout_message(call.module, 1)
    setattr(x, AXIS, 1)


def _no_batch_in_outputs(call: Call) -> str | None:
    """Why a call on ``N > 1`` samples (its first input's axis 0) whose outputs have no axis of
    size ``N`` cannot be split into samples, or ``None``. Such a module's output is not per
    sample: it reads the samples' values not at all (Hugging Face's BART positional embedding
    takes the input ids for their shape only and returns ``[1, T, d]``) or combines them."""
    n = call.batch_size
    if n <= 1 or any(n in shape for shape in call.out_shapes):
        return None
    shapes = ", ".join(str(tuple(s)) for s in call.out_shapes)
    names = ", ".join(f"'{k}'" for k in call.params)
    return (
        f"backprism: {call.name} was called on {n} samples (its first input's axis 0) but "
        f"returned {shapes}, without an axis of {n}: its output is not per sample (the module "
        "does not read the samples' values, as a positional embedding that takes the input "
        "ids for their shape only, e.g. Hugging Face's BART; or it combines them), so its "
        f"parameters ({names}) have no per-sample gradients. Call it on inputs without the "
        "batch (position ids of shape [1, T]: its output is then shared by all samples and "
        "split where it meets them), or freeze its parameters (requires_grad_(False))"
    )


def _layout_error(module: nn.Module, tensors: list[Tensor]) -> str | None:
    """Why ``module``'s input has no batch on axis 0 (see :data:`AXIS`), or ``None``."""
    for t in tensors:
        axis = getattr(t, AXIS, 0)
        if axis:
            return _layout_message(module, axis)
    return None


def _layout_message(module: nn.Module, axis: int) -> str:
    """The refusal for a call of ``module`` whose input has the batch on ``axis`` (``-1``:
    lost)."""
    name = getattr(module, "_backprism_name", None) or type(module).__name__
    where = f"on axis {axis}" if axis > 0 else "on an axis backprism lost track of"
    return (
        f"backprism: the input of {name} comes from a batch_first=False RNN and has the batch "
        f"{where}, but per-sample quantities and curvature of {name} take the batch on axis "
        "0. Move it there before the module (e.g. out.transpose(0, 1), or take out[-1] / "
        "h_n[-1]), or construct the RNN with batch_first=True"
    )


def attach(call: Call, outs: list[Tensor]) -> bool:
    """Store ``call`` in the metadata of its outputs' nodes; ``False`` if no output requires
    grad.

    The hand-over of ``∂L/∂out`` to a backward pass is registered by that pass, on the output's
    node, when it starts (:meth:`~backprism.engine.backward.BackwardPass.start`): a forward whose
    backward collects nothing pays for no hook. Calls with several outputs are the exception:
    their gradients must arrive together, which only a multi-grad hook on the output tensors can
    arrange, so it is registered here.
    """
    grad_outs = []
    for i, o in enumerate(outs):
        if o.requires_grad and o.grad_fn is not None:
            o.grad_fn.metadata.setdefault(CALLS, []).append((call, i, o.output_nr))
            grad_outs.append((i, o))
    if not grad_outs:
        return False
    if len(outs) == 1:
        _note_base(call, outs[0])
        return True
    # the hook holds the call, never the outputs (that would be a cycle through the node)
    index = [i for i, _ in grad_outs]
    n_out = len(outs)

    def multi_hook(grads: Any) -> None:
        bp = call.pass_
        if bp is None or bp.in_columns:
            return
        full: list[Tensor | None] = [None] * n_out
        for i, gr in zip(index, grads):
            full[i] = gr
        bp.on_output_grad(call, tuple(full))

    torch.autograd.graph.register_multi_grad_hook([o for _, o in grad_outs], multi_hook)
    return True


def _note_base(call: Call, out: Tensor) -> None:
    """Where ``out`` is a reshaping view of a tensor computed in the graph (a Linear's 3-d
    output of its 2-d product), note the call on that tensor's node too (:data:`BASES`): an
    in-place operation through a view of it replaces ``out``'s node, and the graph walk then
    reads the call there."""
    base = out._base
    if (
        base is not None and base.grad_fn is not None and base.numel() == out.numel()
        and base.is_contiguous() and out.is_contiguous()
    ):
        base.grad_fn.metadata.setdefault(BASES, []).append((call, base.output_nr))


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The autocast dtype of ``x``'s device if autocast is on there (results are then computed
    in the parameters' dtype)."""
    if not torch._C._is_any_autocast_enabled():
        return None
    dev = x.device.type
    with contextlib.suppress(Exception):
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    return None


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _signature(module: nn.Module) -> inspect.Signature:
    """``inspect.signature(module.forward)``, cached per forward function."""
    fwd = module.forward
    key = getattr(fwd, "__func__", fwd)
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = _SIGNATURES[key] = inspect.signature(fwd)
    return sig


def loss_forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    with _NO_TORCH_FUNCTION():
        _loss_forward(module, args, kwargs, output)


def _loss_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    if (
        not torch.is_grad_enabled()
        or FORWARD.suspended
        or not isinstance(output, Tensor)
        or output.grad_fn is None
    ):
        return
    try:  # the loss's inputs in the order of its forward's parameters
        if kwargs:
            sig = _signature(module)
            inputs = list(sig.bind(*args, **kwargs).arguments.values())
        else:
            inputs = list(args)
    except TypeError:
        inputs = list(args) + list(kwargs.values())
    record = LossRecord(
        module=module,
        inputs=[a if isinstance(a, Tensor) and a.requires_grad else detached(a) for a in inputs],
        output_nr=output.output_nr,
    )
    record.layout_error = _layout_error(
        module, [a for a in inputs[:1] if isinstance(a, Tensor)]
    )
    output.grad_fn.metadata[LOSS] = record
