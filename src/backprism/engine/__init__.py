"""The engine: forward recording, the backward pass and ``collect``.

Modules import one way only, bottom to top:

1. :mod:`~backprism.engine.state` — per-thread forward state, the records that travel with the
   autograd graph (imports nothing of the engine);
2. :mod:`~backprism.engine.rule`, :mod:`~backprism.engine.extension` — the contracts of layer
   rules and extensions (every override point declared on the base class);
3. :mod:`~backprism.engine.columns`, :mod:`~backprism.engine.loss_hessian`,
   :mod:`~backprism.engine.double_backward`, :mod:`~backprism.engine.graph` — column backprop,
   loss-Hessian square roots, graph analysis;
4. :mod:`~backprism.engine.backward` — one backward pass;
5. :mod:`~backprism.engine.residual` — Hessian residual terms (DiagHessian family);
6. :mod:`~backprism.engine.collect` — the context;
7. :mod:`~backprism.engine.functional`, :mod:`~backprism.engine.forward` — forward recording;
8. :mod:`~backprism.engine.extend` — ``extend()``.

Layer rules (:mod:`backprism.rules`) and extensions (:mod:`backprism.extensions`) are plug-in
packages above it.
"""

from backprism.engine.collect import collect
from backprism.engine.extend import extend
from backprism.engine.fold import UncheckedOperationWarning, keeps_samples_apart
from backprism.engine.state import suspended

__all__ = [
    "UncheckedOperationWarning",
    "collect",
    "extend",
    "keeps_samples_apart",
    "suspended",
]
