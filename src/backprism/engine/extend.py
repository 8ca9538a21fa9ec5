"""``extend()``: register the forward hooks of :mod:`backprism.engine.forward` on a model or a
loss module."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from backprism.engine import functional  # noqa: F401 (importing it registers the forward mode)
from backprism.engine.forward import (
    loss_forward_hook,
    module_forward_hook,
    module_pre_hook,
    module_pre_hook_inside,
    pause_body,
    resume_body,
    root_post_hook,
    root_pre_hook,
)
from backprism.engine.residual import ACTIVATION_TYPES, activation_forward_hook
from backprism.engine.rule import Rule, get_rule
from backprism.engine.state import FREE, MODE_FREE, PARAM_IDS

__all__ = ["extend"]

_LOSS_TYPES = (nn.modules.loss._Loss,)
_EXTENDED_ATTR = "_backprism_handles"


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as registered: never traced by ``torch.compile``. A compiled model's forward
    would otherwise inline the hooks and bake what they read at tracing time (the active
    ``collect``, whether nonlinearities are recorded) into the compiled code; marked disabled,
    each hook is a graph break and runs in Python on every call, as without compilation.
    (``torch.compiler.disable`` imports ``torch._dynamo``, about a second: it is applied on
    the first call after something else imported it, which any compilation does first.)"""
    disabled: list[Callable[..., Any]] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        if sys.modules.get("torch._dynamo") is None:
            return hook(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(hook))
        return disabled[0](*args, **kwargs)

    run._torchdynamo_disable = True  # type: ignore[attr-defined]  (not inlined when traced)
    run.__name__ = run.__qualname__ = getattr(hook, "__name__", "hook")
    return run


_LOSS_HOOK = _eager(loss_forward_hook)
_MODULE_HOOK = _eager(module_forward_hook)
_PRE_HOOK = _eager(module_pre_hook)
_PRE_HOOK_INSIDE = _eager(module_pre_hook_inside)
_PAUSE = _eager(pause_body)
_RESUME = _eager(resume_body)
_ROOT_PRE = _eager(root_pre_hook)
_ROOT_POST = _eager(root_post_hook)
_ACTIVATION_HOOK = _eager(activation_forward_hook)


def _is_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def _owns_params(module: nn.Module) -> bool:
    """Parameters of its own, or a parametrized weight (its originals live in a child)."""
    return any(True for _ in module.parameters(recurse=False)) or parametrize.is_parametrized(
        module
    )


def _pause_in_children(module: nn.Module) -> None:
    """Hooks marking the calls of ``module``'s direct children that no other hook of ours
    frames (containers such as a ``blocks`` ``Sequential``, parameter-free layers) as outside
    its forward's body (:func:`~backprism.engine.forward.pause_body`); children framed by their
    own hooks pause it from there, and activation modules are left in it (one operation)."""
    for child in module.children():
        if (
            getattr(child, "_backprism_pauses", False)
            or isinstance(child, (*_LOSS_TYPES, *ACTIVATION_TYPES))
            or _owns_params(child)
            or _is_batchnorm(child)
        ):
            continue
        child.register_forward_pre_hook(_PAUSE)
        child.register_forward_hook(_RESUME, always_call=True)
        object.__setattr__(child, "_backprism_pauses", True)


def _decides_inside(module: nn.Module) -> bool:
    """Whether ``module``'s rule overrides :meth:`Rule.inside` (its pre-hook then asks it)."""
    try:
        rule = get_rule(module)
    except NotImplementedError:  # a bare engine without the generic rule
        return False
    return type(rule).inside is not Rule.inside


def extend(module: nn.Module) -> nn.Module:
    """Prepare ``module`` (a model or a loss module) for :func:`backprism.collect`.

    Registers forward hooks on every sub-module that owns parameters, on loss modules and on
    BatchNorm layers, and marks the trainable parameters as extended. Idempotent; returns
    ``module`` itself. What the hooks capture lives in the autograd graph and is freed with it.

    Example:
        >>> model = extend(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
        >>> lossfunc = extend(nn.CrossEntropyLoss())
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"extend() takes an nn.Module, got {type(module).__name__}")
    handles: list = getattr(module, _EXTENDED_ATTR, None) or []
    if isinstance(module, _LOSS_TYPES):
        if not handles:
            handles.append(module.register_forward_hook(_LOSS_HOOK, with_kwargs=True))
            object.__setattr__(module, _EXTENDED_ATTR, handles)
        return module
    MODE_FREE.pop(module, None)  # (sub-modules added since: its next forward is recorded)
    if not handles:
        handles.append(module.register_forward_pre_hook(_ROOT_PRE, with_kwargs=True))
        handles.append(module.register_forward_hook(_ROOT_POST, always_call=True))
        object.__setattr__(module, _EXTENDED_ATTR, handles)
    for sub in module.modules():
        if getattr(sub, "_backprism_hooked", False):
            continue
        if isinstance(sub, _LOSS_TYPES):
            extend(sub)
        elif _owns_params(sub) or _is_batchnorm(sub):
            if _decides_inside(sub):
                sub.register_forward_pre_hook(_PRE_HOOK_INSIDE, with_kwargs=True)
                _pause_in_children(sub)
            else:
                sub.register_forward_pre_hook(_PRE_HOOK)
            sub.register_forward_hook(_MODULE_HOOK, with_kwargs=True)
        elif isinstance(sub, ACTIVATION_TYPES):
            sub.register_forward_hook(_ACTIVATION_HOOK)
        else:
            continue
        object.__setattr__(sub, "_backprism_hooked", True)
    for p in module.parameters():
        if p.requires_grad:
            p._backprism_hooked = True  # type: ignore[attr-defined]
            PARAM_IDS.add(id(p))
        setattr(p, FREE, ())  # the same for every sample (engine.broadcast)
    for b in module.buffers():
        setattr(b, FREE, ())
    return module
