"""Registering the predecessors' module paths (``backpack.extensions.firstorder.base``, …).

The compatibility layers keep their code in a few real modules and expose the predecessors'
deeper import paths as light alias modules registered in :data:`sys.modules`, so that
``from backprism.compat.backpack.extensions.firstorder.base import FirstOrderModuleExtension``
resolves like the original import.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["alias_module"]


def alias_module(fullname: str, doc: str, **attrs: Any) -> types.ModuleType:
    """Register the module ``fullname`` holding ``attrs`` (and make it an attribute of its
    parent module, if that is imported). Alias modules are package-like (``__path__ = []``), so
    deeper aliases below them resolve too; a second registration of one name adds to it."""
    mod = sys.modules.get(fullname)
    if mod is None:
        mod = types.ModuleType(fullname, doc)
        mod.__path__ = []  # type: ignore[attr-defined]
        sys.modules[fullname] = mod
    mod.__dict__.update(attrs)
    public = [
        k
        for k, v in mod.__dict__.items()
        if not k.startswith("_") and not isinstance(v, types.ModuleType)
    ]
    mod.__all__ = sorted(public)  # type: ignore[attr-defined]
    parent, _, child = fullname.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod
