"""``extend()``: forward hooks that capture what the extensions will need during backward.

Only modules that *own* parameters (and loss modules, and BatchNorm for its train-mode check)
are hooked; everything between them — residual additions, attention, functional code — is left to
autograd. For each call of a hooked module under ``torch.enable_grad()`` the hook

* stores a :class:`~backprism.rules.base.Call` with the detached inputs, and registers a hook on
  the output tensor(s) that hands ``∂L/∂out`` to the active :func:`~backprism.collect` context;
* keeps the outputs themselves in a *pending* list until an extended loss module takes them for
  the second-order column backprop (or until their gradient arrives, or the same root model runs
  its next forward) — so nothing outlives one step.

Reference structure (no cycles through autograd nodes): an output's node holds the hook, which
holds the ``Call`` (inputs only, all upstream). The loss output's node holds the taken outputs,
which are all upstream of it. When the graph is freed, everything captured is freed with it.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from backprism.rules.base import Call

__all__ = ["extend", "suspended"]

_LOSS_TYPES = (nn.modules.loss._Loss,)
_EXTENDED_ATTR = "_backprism_handles"


class Group:
    """Calls made between two loss forwards; counts how often each parameter/module was used.

    Holds no tensors, so calls may refer to it from hooks living inside the autograd graph.
    """

    _ids = itertools.count()

    def __init__(self) -> None:
        self.id = next(Group._ids)
        self.param_count: Counter[int] = Counter()
        self.module_count: Counter[int] = Counter()
        self.batch_sizes: Counter[int] = Counter()


class _Capture:
    """Global capture state shared by all extended modules (hooks may run on autograd threads)."""

    def __init__(self) -> None:
        self.group = Group()
        # id(call) -> (call, outputs, root key)
        self.pending: dict[int, tuple[Call, list[Tensor], int]] = {}
        self.root_stack: list[int] = []
        self.in_column_backprop = 0
        self.suspended = 0
        # > 0 inside a top-level forward whose nonlinearities are deliberately not recorded
        # (it runs inside a collect() without a DiagHessian-family extension); its calls are
        # marked ``unrecorded`` so that such an extension in a later backward refuses them
        self.unrecorded = 0
        # one frame per hooked module currently in its forward: ids of hooked descendants run
        self.call_stack: list[set[int]] = []
        # latest top-level input of each extended root (detached), for chain-wise recursions
        # such as KFRA; one entry per root, overwritten by its next forward
        self.root_inputs: dict[int, tuple[nn.Module, tuple]] = {}

    def take_pending(self) -> list[tuple[Call, list[Tensor]]]:
        taken = [(c, outs) for c, outs, _ in self.pending.values()]
        self.pending.clear()
        self.group = Group()
        return taken


CAPTURE = _Capture()

#: ``(enter, exit)`` callables run around every top-level forward of an extended root model
#: (e.g. a ``TorchFunctionMode`` that records functional nonlinearities for DiagHessian).
FORWARD_LISTENERS: list[tuple[Callable[[nn.Module], None], Callable[[nn.Module], None]]] = []


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, Tensor) else x


def _is_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def _owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _root_pre_hook(module: nn.Module, args: Any) -> None:
    if CAPTURE.suspended:
        return
    key = id(module)
    if CAPTURE.root_stack:
        CAPTURE.root_stack.append(-1)  # nested root: belongs to the outer one
        return
    CAPTURE.call_stack.clear()
    CAPTURE.root_stack.append(key)
    for enter, _ in FORWARD_LISTENERS:
        enter(module)
    if not torch.is_grad_enabled():  # evaluation forwards leave the capture state alone
        return
    # a new top-level forward of this root: outputs it left pending in its previous forward
    # (never taken by a loss, never backpropagated) are dropped.
    stale = [k for k, (_, _, rk) in CAPTURE.pending.items() if rk == key]
    for k in stale:
        del CAPTURE.pending[k]
    if not CAPTURE.pending:  # nothing else awaits a loss: forget the stale calls' counts too
        CAPTURE.group = Group()
    CAPTURE.root_inputs[key] = (module, tuple(tree_map(_detach, a) for a in args))


def _root_post_hook(module: nn.Module, args: Any, output: Any) -> None:
    if CAPTURE.suspended:
        return
    if CAPTURE.root_stack:
        key = CAPTURE.root_stack.pop()
        if key != -1 and not CAPTURE.root_stack:
            for _, exit_ in reversed(FORWARD_LISTENERS):
                exit_(module)


@contextmanager
def suspended() -> Iterator[None]:
    """Forward passes inside this context are not captured (rules re-running a forward)."""
    CAPTURE.suspended += 1
    try:
        yield
    finally:
        CAPTURE.suspended -= 1


def _module_pre_hook(module: nn.Module, args: Any) -> None:
    CAPTURE.call_stack.append(set())


def _call_params(module: nn.Module, ran: set[int]) -> dict[str, nn.Parameter]:
    """Parameters a call of ``module`` is responsible for: its own, plus those of descendants
    whose forward did not run during the call (e.g. ``MultiheadAttention.out_proj``, used
    functionally), which therefore have no call of their own."""
    params: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for n, p in module._parameters.items():  # named_parameters(recurse=False), cheaper
        if p is not None and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params[n] = p
    if not module._modules:  # a leaf (Linear, Conv, ...): nothing else to look at
        return params
    for name, sub in module.named_modules():
        if sub is module or id(sub) in ran:
            continue
        for n, p in sub.named_parameters(recurse=False):
            if p.requires_grad:
                params[f"{name}.{n}"] = p
    return params


def _module_forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    ran = CAPTURE.call_stack.pop() if CAPTURE.call_stack else set()
    if CAPTURE.call_stack:
        CAPTURE.call_stack[-1].add(id(module))
        CAPTURE.call_stack[-1].update(ran)
    if not torch.is_grad_enabled() or CAPTURE.suspended:
        return
    if isinstance(output, Tensor):  # the common case, without pytree traversals
        if not output.requires_grad:
            return
        outs = [output]
    else:
        outs = [o for o in tree_flatten(output)[0] if isinstance(o, Tensor)]
        if not any(o.requires_grad for o in outs):
            return
    if not kwargs and all(isinstance(a, Tensor) for a in args):
        arg_tensors: list[Tensor] = list(args)
        first = arg_tensors[0] if arg_tensors else None
        if first is None:
            return
        call_args: tuple = tuple(a.detach() for a in args)
        call_kwargs: dict[str, Any] = {}
    else:
        arg_tensors = [a for a in tree_flatten(args)[0] if isinstance(a, Tensor)]
        first = next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)), None)
        if first is None:
            return
        call_args = tuple(tree_map(_detach, a) for a in args)
        call_kwargs = {k: tree_map(_detach, v) for k, v in kwargs.items()}
    params = _call_params(module, ran)
    call = Call(
        module=module,
        args=call_args,
        kwargs=call_kwargs,
        out_shapes=[o.shape for o in outs],
        batch_size=first.shape[0] if first.dim() > 0 else 1,
        training=module.training,
        versions=[(a, a._version) for a in arg_tensors],
        params=params,
    )
    group = CAPTURE.group
    call.group = group  # type: ignore[attr-defined]
    if CAPTURE.unrecorded:
        call.unrecorded = True  # type: ignore[attr-defined]
    for p in params.values():
        group.param_count[id(p)] += 1
    group.module_count[id(module)] += 1
    group.batch_sizes[call.batch_size] += 1

    root = CAPTURE.root_stack[0] if CAPTURE.root_stack else -1
    call_key = id(call)
    CAPTURE.pending[call_key] = (call, outs, root)
    # the hook must not hold `outs` (that would be a cycle through the autograd node)
    call_ref = call
    from backprism import context as _collect

    grad_outs = [o for o in outs if o.requires_grad]
    if len(outs) == 1:

        def hook(grad: Tensor) -> None:
            CAPTURE.pending.pop(call_key, None)
            _collect.on_output_grad(call_ref, (grad,))

        grad_outs[0].register_hook(hook)
    else:
        index = [i for i, o in enumerate(outs) if o.requires_grad]

        def multi_hook(grads: Any) -> None:
            CAPTURE.pending.pop(call_key, None)
            full: list[Tensor | None] = [None] * len(outs)
            for i, gr in zip(index, grads):
                full[i] = gr
            _collect.on_output_grad(call_ref, tuple(full))

        torch.autograd.graph.register_multi_grad_hook(grad_outs, multi_hook)


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _signature(module: nn.Module) -> inspect.Signature:
    """``inspect.signature(module.forward)``, cached per forward function."""
    fwd = module.forward
    key = getattr(fwd, "__func__", fwd)
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = _SIGNATURES[key] = inspect.signature(fwd)
    return sig


def _loss_forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    if (
        not torch.is_grad_enabled()
        or CAPTURE.suspended
        or not isinstance(output, Tensor)
        or not output.requires_grad
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
    taken = CAPTURE.take_pending()
    record = LossRecord(
        module=module,
        inputs=[a if isinstance(a, Tensor) and a.requires_grad else _detach(a) for a in inputs],
        taken=taken,
    )
    from backprism import context as _collect

    def hook(grad: Tensor) -> None:
        _collect.on_loss_grad(record, grad)

    output.register_hook(hook)


class LossRecord:
    """One call of an extended loss: the model outputs fed to it and the calls it took."""

    __slots__ = ("inputs", "module", "taken")

    def __init__(self, module: nn.Module, inputs: list[Any], taken: list) -> None:
        self.module = module
        self.inputs = inputs
        self.taken = taken


def _activation_types() -> tuple[type, ...]:
    try:
        from backprism.hessian_residual import ACTIVATION_TYPES
    except ImportError:  # pragma: no cover - optional component
        return ()
    return ACTIVATION_TYPES


def extend(module: nn.Module) -> nn.Module:
    """Prepare ``module`` (a model or a loss module) for :func:`backprism.collect`.

    Registers forward hooks on every sub-module that owns parameters, on loss modules and on
    BatchNorm layers. Idempotent; returns ``module`` itself. Outside a ``collect`` context the
    hooks only keep references that are released when the autograd graph is.

    Example:
        >>> model = extend(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
        >>> lossfunc = extend(nn.CrossEntropyLoss())
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"extend() takes an nn.Module, got {type(module).__name__}")
    handles: list = getattr(module, _EXTENDED_ATTR, None) or []
    if isinstance(module, _LOSS_TYPES):
        if not handles:
            handles.append(module.register_forward_hook(_loss_forward_hook, with_kwargs=True))
            object.__setattr__(module, _EXTENDED_ATTR, handles)
        return module
    if not handles:
        handles.append(module.register_forward_pre_hook(_root_pre_hook))
        handles.append(module.register_forward_hook(_root_post_hook, always_call=True))
        object.__setattr__(module, _EXTENDED_ATTR, handles)
    acts = _activation_types()
    for sub in module.modules():
        if getattr(sub, "_backprism_hooked", False):
            continue
        if isinstance(sub, _LOSS_TYPES):
            extend(sub)
        elif _owns_params(sub) or _is_batchnorm(sub):
            sub.register_forward_pre_hook(_module_pre_hook)
            sub.register_forward_hook(_module_forward_hook, with_kwargs=True)
            for p in sub.parameters():
                _hook_param(p)
        elif acts and isinstance(sub, acts):
            from backprism.hessian_residual import activation_forward_hook

            sub.register_forward_hook(activation_forward_hook)
        else:
            continue
        object.__setattr__(sub, "_backprism_hooked", True)
    return module


def _hook_param(p: nn.Parameter) -> None:
    """A leaf hook handing the parameter's gradient of each backward pass to the context
    (weakly referenced: the hook lives on the parameter itself)."""
    if getattr(p, "_backprism_hooked", False) or not p.requires_grad:
        return
    ref = weakref.ref(p)
    from backprism import context as _collect

    def hook(grad: Tensor) -> None:
        param = ref()
        if param is not None:
            _collect.on_param_grad(param, grad)

    p.register_hook(hook)
    p._backprism_hooked = True  # type: ignore[attr-defined]
