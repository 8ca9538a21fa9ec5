"""BackPACK-compatible entry points: ``backpack`` (the context), ``extend``, ``disable`` and the
sub-packages ``extensions``, ``custom_module``, ``hessianfree``, ``utils``, ``core``, and
``convert_module_to_backpack`` (BackPACK exports it at the top level too).

A script written for BackPACK 1.7 runs after changing only its imports::

    from backprism.compat.backpack import backpack, extend
    from backprism.compat.backpack.extensions import BatchGrad, DiagGGNExact

Differences that need no change in a script:

* ``backpack(..., retain_graph=True)`` is accepted and unnecessary: backprism keeps what it
  captured in the autograd graph, so every backward pass through a retained graph finds it;
  ``retain_graph=False`` does not free anything early either (the graph frees it).
* ``extend(model, use_converter=True)`` returns the model itself: backprism handles residual
  connections, functional code and in-place operations through autograd, so no graph
  conversion is needed (``custom_module.graph_utils.convert_module_to_backpack`` likewise).
* ``disable()`` turns off capturing in forward passes, as BackPACK's turns off storing
  inputs and outputs; a backward pass inside ``backpack(...)`` through such a forward then
  raises (BackPACK fails too).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType
from typing import Any

import torch
from torch import nn

from backprism.compat.backpack import extensions
from backprism.compat.backpack.custom_module import convert_module_to_backpack
from backprism.engine.collect import collect
from backprism.engine.extend import extend as _extend
from backprism.engine.extension import Extension
from backprism.engine.state import suspended

__all__ = ["backpack", "convert_module_to_backpack", "disable", "extend", "extensions"]


class InvalidExtensionError(ValueError, TypeError):
    """An argument of ``backpack(...)`` is not an extension instance (BackPACK raises
    ``ValueError``; backprism's ``collect`` ``TypeError``: both ``except`` clauses catch it)."""


def extend(module: nn.Module, debug: bool = False, use_converter: bool = False) -> nn.Module:
    """BackPACK's ``extend``: make ``module`` (a model or a loss) ready for ``backpack(...)``.

    As BackPACK's, every forward pass with gradients enabled (outside :class:`disable`) then
    stores each sub-module's positional inputs and output as ``module.input0``, ``input1``, …
    and ``module.output`` (what ``backpack.core.derivatives`` and hand-written extensions read);
    a backward pass inside ``backpack(...)`` deletes them again (BackPACK's memory clean-up).
    ``use_converter=True`` returns the module unchanged (no conversion is needed, see the
    module docstring); ``debug`` prints what is extended."""
    if use_converter:
        module = convert_module_to_backpack(module, debug)
    if debug:
        print(f"[DEBUG] Extending {type(module).__name__}")
    module = _extend(module)
    for sub in module.modules():
        if _STORE_IO not in sub.__dict__:
            object.__setattr__(sub, _STORE_IO, sub.register_forward_hook(_store_io))
    return module


#: attribute of a module extended through this shim: the handle of its input/output hook
_STORE_IO = "_backprism_store_io"
#: modules holding stored inputs/outputs (deleted by a backward pass inside ``backpack``)
_STORED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _store_io(module: nn.Module, args: tuple, output: Any) -> None:
    """BackPACK's forward hook: ``module.input{i}`` (the positional inputs) and
    ``module.output``, when gradients are on and storing is not disabled."""
    if not disable.should_store_io() or not torch.is_grad_enabled():
        return
    for i, a in enumerate(args):
        object.__setattr__(module, f"input{i}", a)
    # RNN, LSTM, GRU return (output, state): BackPACK keeps the output
    object.__setattr__(module, "output", output[0] if isinstance(output, tuple) else output)
    _STORED.add(module)


def _clean_up_io() -> None:
    """Delete the stored inputs and outputs (BackPACK's ``memory_cleanup`` after a backward
    pass with extensions)."""
    for module in list(_STORED):
        for key in [k for k in module.__dict__ if k == "output" or _is_input_key(k)]:
            del module.__dict__[key]
    _STORED.clear()


def _is_input_key(key: str) -> bool:
    return key.startswith("input") and key[5:].isdigit()


class backpack(collect):
    """BackPACK's context manager: ``with backpack(*exts, extension_hook=None, debug=False,
    retain_graph=False): loss.backward()``.

    Args:
        *exts: extension instances (``backprism.compat.backpack.extensions`` or backprism's).
        extension_hook: called as ``extension_hook(module)`` on each module that owns
            parameters once its extensions ran (BackPACK also calls it on parameter-free
            modules, where there is nothing to read).
        debug: print the active extensions and each backward pass.
        retain_graph: accepted for compatibility; nothing to keep (see the module docstring).
        chunk_size, memory_budget: backprism's column chunking (see
            :class:`backprism.collect`); not BackPACK arguments.

    Raises:
        ValueError: an argument is not an extension instance (an extension class, for
            example); the error is also a ``TypeError``.
    """

    def __init__(
        self,
        *exts: Extension,
        extension_hook: Callable[[nn.Module], None] | None = None,
        debug: bool = False,
        retain_graph: bool = False,
        chunk_size: int | None = None,
        memory_budget: int = 2**30,
    ) -> None:
        for ext in exts:
            if not isinstance(ext, Extension):
                if inspect.isclass(ext) and issubclass(ext, Extension):
                    raise InvalidExtensionError(
                        "backpack(...) takes instances of BackPACK extensions, but received a "
                        f"class instead [{ext}]: pass {ext.__name__}()"
                    )
                raise InvalidExtensionError(
                    f"backpack(...) takes instances of BackPACK extensions, got {ext!r}"
                )
        self.debug = debug
        self.retain_graph = retain_graph
        self.exts = tuple(exts)
        super().__init__(
            *exts,
            extension_hook=extension_hook,
            chunk_size=chunk_size,
            memory_budget=memory_budget,
        )

    def __enter__(self) -> backpack:
        if self.debug:
            print(f"[DEBUG] backpack: active extensions {list(self.exts)}")
        super().__enter__()
        return self

    def _run_backward(self, roots: list, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.debug and self._running is None:
            print(f"[DEBUG] backpack: backward pass with {[type(e).__name__ for e in self.exts]}")
        outermost = self._running is None
        try:
            return super()._run_backward(roots, func, args, kwargs)
        finally:
            if outermost:  # BackPACK's clean-up after the pass
                _clean_up_io()


class disable:
    """Turn off capturing during forward passes (BackPACK's ``disable``: no input/output is
    stored). Useful to run an extended model without overhead when only ``.grad`` is needed."""

    store_io: bool = True

    def __enter__(self) -> disable:
        self.old_store_io = disable.store_io
        disable.store_io = False
        self._stack = ExitStack()
        self._stack.enter_context(suspended())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()
        disable.store_io = self.old_store_io

    @staticmethod
    def should_store_io() -> bool:
        """Whether forward passes are captured (``False`` inside ``with disable()``)."""
        return disable.store_io


def _load_subpackages() -> None:
    # imported for their side effect: registering BackPACK's module paths
    from backprism.compat.backpack import core, custom_module, hessianfree, utils  # noqa: F401


_load_subpackages()
