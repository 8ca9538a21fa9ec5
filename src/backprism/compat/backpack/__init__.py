"""BackPACK-compatible entry points: ``backpack`` (the context), ``extend``, ``extensions``.

A script written for BackPACK runs after changing only its imports::

    from backprism.compat.backpack import backpack, extend
    from backprism.compat.backpack.extensions import BatchGrad, DiagGGNExact
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from backprism.compat.backpack import extensions
from backprism.engine.collect import collect
from backprism.engine.extend import extend as _extend
from backprism.extensions.base import Extension

__all__ = ["backpack", "extend", "extensions"]


def extend(module: nn.Module, debug: bool = False, use_converter: bool = False) -> nn.Module:
    """BackPACK's ``extend``. ``use_converter`` is accepted and unnecessary: backprism handles
    residual connections and functional code through autograd."""
    return _extend(module)


class backpack(collect):
    """BackPACK's context manager: ``with backpack(BatchGrad(), extension_hook=f): ...``."""

    def __init__(
        self,
        *exts: Extension,
        extension_hook: Callable[[nn.Module], None] | None = None,
        debug: bool = False,
    ) -> None:
        super().__init__(*exts, extension_hook=extension_hook)
