"""backprism: per-sample gradients, curvature and a training instrument panel from one backward.

>>> model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
>>> with collect(extensions.BatchGrad(), extensions.DiagGGNExact()):
...     lossfunc(model(X), y).backward()
"""

from backprism import extensions, rules  # noqa: F401  (registers the layer rules)
from backprism.cpu_memory import retain_freed_memory
from backprism.engine import collect, extend, keeps_samples_apart

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "collect",
    "extend",
    "extensions",
    "keeps_samples_apart",
    "monitor",
    "plot",
    "retain_freed_memory",
    "spectral",
]

_LAZY = ("monitor", "plot", "spectral", "report", "integrations", "compat")


def __getattr__(name: str):
    """``backprism.monitor``, ``.spectral``, ``.plot``: imported on first use (they bring
    optional dependencies such as matplotlib)."""
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"backprism.{name}")
    raise AttributeError(f"module 'backprism' has no attribute {name!r}")
