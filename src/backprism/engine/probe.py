r"""Whether a custom ``autograd.Function`` keeps the samples apart, probed through its backward.

The batch-axis analysis (:mod:`backprism.engine.fold`) reads PyTorch's own operations from
their backward nodes; a custom ``autograd.Function`` — a user's fused kernel, or every region
``torch.compile`` turns into one (AOTAutograd's ``CompiledFunction``) — is opaque to it. Its
backward, however, can be called: ``node.apply(*grad_outputs)`` returns the vector-Jacobian
product ``Jᵀv`` without running hooks or releasing saved tensors. A function keeps the samples
apart exactly when ``J`` is block-diagonal over them: output sample ``i`` depends on input
sample ``i`` only, i.e. ``(Jᵀv)`` restricted to the input rows of samples outside a set ``S`` is
zero whenever ``v`` is zero outside the output rows of ``S``.

**Probes.** For the samples on output axis ``a`` (a candidate: an axis of size ``N``) and the
known axes of the inputs that carry samples, ``v`` is random on the rows of ``S`` and zero
elsewhere (the function's other outputs get zero gradients), for ``S`` running over the
``2⌈log₂ N⌉`` sets "bit ``b`` of the sample index is 1" and their complements: any two samples
``i ≠ j`` differ in some bit, so one of the sets holds ``i`` and not ``j``, and a dependence of
output ``i`` on input ``j`` shows as a non-zero gradient outside ``S`` (random ``v`` makes a
cancellation a null event). The first candidate axis that passes every probe is the output's
batch axis; if none passes, the function mixes the samples.

A function whose backward runs autograd itself (``torch.utils.checkpoint``'s reentrant
``CheckpointFunction``, which the engine refuses anyway) is never probed: calling it would
write ``.grad``.

**Cost.** ``2⌈log₂ N⌉`` calls of the function's backward (14 at ``N = 128``), once per
function class, output, the ranks of its outputs and the plain settings its forward kept on
``ctx`` (an axis, a flag), not per size (a fused attention on batches of varying length is
probed once): results are cached (a function whose treatment of the samples depends on
tensor values rather than on these would need a new probe each pass; none is known). The
random probe vectors come from a private generator, so the user's random state is untouched.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = ["UNKNOWN", "probe_batch_axis", "probeable"]

#: the probe could not run (the function raised, an output or input it cannot read)
UNKNOWN = object()

#: backward class -> {(output nr, input layouts, output ranks, ctx settings): output batch
#: axis, None (mixes) or UNKNOWN}; torch.compile builds one ``CompiledFunction`` class per
#: compiled graph. Sizes are left out: a function called on batches of varying length (dynamic
#: padding) is probed once, not in every pass
_CACHE: weakref.WeakKeyDictionary[type, dict[tuple, Any]] = weakref.WeakKeyDictionary()


#: custom functions whose backward runs autograd itself (a reentrant checkpoint recomputes its
#: forward and backpropagates through it, writing ``.grad``): never called by a probe
_NOT_PROBED = frozenset({"CheckpointFunctionBackward"})


def probeable(node: Any) -> bool:
    """Whether ``node`` is the backward of a custom ``autograd.Function`` (callable through
    ``apply``; PyTorch's own nodes are read, not probed) that a probe may call."""
    return (
        getattr(type(node), "_forward_cls", None) is not None
        and hasattr(node, "apply")
        and type(node).__name__ not in _NOT_PROBED
    )


def probe_batch_axis(node: Any, nr: int, inputs: list[tuple[int, int]], n: int) -> Any:
    """The batch axis of output ``nr`` of custom-function node ``node``, whose inputs
    ``next_functions[i]`` carry the ``n`` samples on axis ``axis`` for each ``(i, axis)`` of
    ``inputs`` (unfolded: the axis has size ``n``): an ``int``; ``None`` if the function mixes
    the samples; :data:`UNKNOWN` if it cannot be probed (module docstring)."""
    try:
        metas = node._input_metadata
        ranks = tuple(len(m.shape) for m in metas)
        key = (nr, tuple(inputs), ranks, _settings(node))
    except (AttributeError, RuntimeError):
        return UNKNOWN
    cache = _CACHE.setdefault(type(node), {})
    if key not in cache:
        try:
            cache[key] = _probe(node, nr, metas, inputs, n)
        except Exception:  # the function's backward cannot be called this way
            cache[key] = UNKNOWN
    return cache[key]


def _settings(node: Any) -> tuple:
    """The plain values the function's forward kept on its context (``ctx.dim = dim``): part
    of the cache key, so that one function called with different settings (an axis, a flag)
    is probed for each."""
    try:
        items = vars(node).items()
    except TypeError:
        return ()
    return tuple(
        sorted((k, v) for k, v in items if isinstance(v, (bool, int, float, str, type(None))))
    )


def _probe(node: Any, nr: int, metas: Any, inputs: list[tuple[int, int]], n: int) -> Any:
    m = metas[nr]
    out = tuple(m.shape)
    if not m.dtype.is_floating_point:
        return UNKNOWN
    positions = _grad_positions(node)
    if positions is None:
        return UNKNOWN
    candidates = [a for a, s in enumerate(out) if s == n]
    if not candidates:
        return UNKNOWN
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(out, generator=gen, dtype=torch.float32).to(dtype=m.dtype, device=m.device)
    zeros = [torch.zeros(tuple(x.shape), dtype=x.dtype, device=x.device) for x in metas]
    for axis in candidates:
        if all(_separate(node, nr, zeros, v, axis, rows, inputs, positions, n)
               for rows in _sample_sets(n)):
            return axis
    return None


def _sample_sets(n: int) -> list[list[int]]:
    """Sets ``S`` of samples such that every ordered pair ``i ≠ j`` has ``i ∈ S ∌ j`` in one
    of them: "bit ``b`` is 1" and "bit ``b`` is 0" for every bit of ``n − 1``."""
    sets = []
    for b in range(max(1, math.ceil(math.log2(n))) if n > 1 else 0):
        ones = [i for i in range(n) if i >> b & 1]
        zeros = [i for i in range(n) if not i >> b & 1]
        sets += [s for s in (ones, zeros) if s and len(s) < n]
    return sets


def _grad_positions(node: Any) -> list[int] | None:
    """For each graph input (``next_functions`` entry) that is not ``None``, the position of
    its gradient in what ``apply`` returns (one entry per argument of the forward, tensors or
    not): the forward's arguments that needed a gradient, in order."""
    live = [i for i, (f, _) in enumerate(node.next_functions) if f is not None]
    needs = getattr(node, "needs_input_grad", None)
    if needs is None:
        return None
    wanted = [j for j, w in enumerate(needs) if w]
    if len(wanted) != len(live):
        return None
    positions = [-1] * len(node.next_functions)
    for i, j in zip(live, wanted):
        positions[i] = j
    return positions


def _separate(
    node: Any,
    nr: int,
    zeros: list[Tensor],
    v: Tensor,
    axis: int,
    rows: list[int],
    inputs: list[tuple[int, int]],
    positions: list[int],
    n: int,
) -> bool:
    """One probe: the random ``v`` kept on output ``nr``'s rows ``rows`` along ``axis`` (the
    other outputs get copies of ``zeros``: a backward may write its arguments); whether the
    gradients of the sample-carrying inputs vanish outside those rows."""
    keep = torch.zeros(n, dtype=v.dtype, device=v.device)
    keep[rows] = 1.0
    view = [1] * v.dim()
    view[axis] = n
    grads = [v * keep.view(view) if j == nr else z.clone() for j, z in enumerate(zeros)]
    with torch.no_grad():
        result = node.apply(*grads)
    if isinstance(result, Tensor) or result is None:
        result = (result,)
    inside = set(rows)
    outside = torch.tensor([i for i in range(n) if i not in inside], dtype=torch.long)
    for i, in_axis in inputs:
        pos = positions[i]
        g = result[pos] if 0 <= pos < len(result) else None
        if g is None:
            continue
        if not isinstance(g, Tensor) or g.dim() <= in_axis or g.shape[in_axis] != n:
            raise ValueError("an input gradient without the samples")
        if bool(g.index_select(in_axis, outside.to(g.device)).ne(0).any()):
            return False
    return True
