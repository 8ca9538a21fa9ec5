"""backprism: per-sample gradients, curvature and a training instrument panel from one backward.

>>> model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
>>> with collect(extensions.BatchGrad(), extensions.DiagGGNExact()):
...     lossfunc(model(X), y).backward()
"""

from backprism import extensions, rules  # noqa: F401  (registers the layer rules)
from backprism.context import collect
from backprism.extend import extend

__version__ = "0.1.0"

__all__ = ["__version__", "collect", "extend", "extensions"]
