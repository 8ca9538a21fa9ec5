"""Push batches of columns backwards through the autograd graph.

``backprop_columns(origins, columns, outputs, chunk)`` computes, for every column ``k`` of
``columns`` (each ``[K, *origin.shape]``), the vector-Jacobian products
``(∂origins/∂outputs)ᵀ columns[k]`` for all ``outputs`` at once, with
``torch.autograd.grad(..., is_grads_batched=True)`` (vmap over the backward graph), ``chunk``
columns at a time. ``outputs`` may be tensors or gradient edges
(``torch.autograd.graph.get_gradient_edge``): the engine passes the edges captured at forward
time, so an output modified in place afterwards (``ReLU(inplace=True)``) still gets the
gradient with respect to the value the module produced. The graph is retained, so the
surrounding backward pass continues unchanged; the caller makes its hooks ignore this inner
pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.func import vjp, vmap
from torch.utils._pytree import tree_map

__all__ = ["Columns", "backprop_columns", "pull_back"]


class Columns:
    """``num`` columns for each of several origin tensors, generated lazily in chunks.

    Args:
        num: total number of columns ``K``.
        make: ``make(start, stop)`` returns one ``[stop - start, *origin.shape]`` tensor per
            origin.
        inputs: for loss columns, the indices of the loss inputs the columns belong to.
    """

    def __init__(
        self, num: int, make: Callable[[int, int], list[Tensor]], inputs: Sequence[int] = (0,)
    ) -> None:
        self.num = num
        self._make = make
        self.inputs = list(inputs)

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], inputs: Sequence[int] = (0,)) -> Columns:
        tensors = list(tensors)
        return cls(tensors[0].shape[0], lambda a, b: [t[a:b] for t in tensors], inputs)

    def chunk(self, start: int, stop: int) -> list[Tensor]:
        return self._make(start, min(stop, self.num))

    def scaled(self, factor: float) -> Columns:
        make = self._make
        return Columns(self.num, lambda a, b: [t * factor for t in make(a, b)], self.inputs)

    def materialize(self) -> list[Tensor]:
        return self.chunk(0, self.num)

    def split_rows(self, rows: int) -> Columns:
        """Whole-batch columns: column ``k·R + r`` is column ``k`` restricted to row ``r`` of
        the origins' first axis (``R = rows``; zero in every other row).

        For a loss whose Hessian is block-diagonal over those rows (every supported loss: the
        samples' terms are summed), ``Σₖ cₖcₖᵀ = H`` implies ``Σₖᵣ cₖᵣcₖᵣᵀ = H``, and each
        ``cₖᵣ`` pushed back through a graph that mixes samples (BatchNorm in train mode) gives
        one exact column ``Jᵀcₖᵣ`` of the whole batch's GGN square root."""
        make = self._make

        def split(a: int, b: int) -> list[Tensor]:
            ka, kb = a // rows, (b - 1) // rows + 1
            out = []
            for t in make(ka, kb):  # [kb - ka, R, ...]
                eye = torch.eye(rows, dtype=t.dtype, device=t.device)
                mask = eye.reshape(1, rows, rows, *([1] * (t.dim() - 2)))
                full = (t.unsqueeze(1) * mask).reshape(-1, *t.shape[1:])
                out.append(full[a - ka * rows : b - ka * rows])
            return out

        return Columns(self.num * rows, split, self.inputs)


def _loop(
    origins: list[Tensor], outputs: list[Any], cols: list[Tensor]
) -> tuple[Tensor | None, ...]:
    """One ordinary backward per column, stacked (a single column, e.g. one MC sample: its
    gradients with a leading axis of size 1, no copy; rules never write into their columns,
    as in the first-order path, where they get the hook's gradients themselves)."""
    if cols[0].shape[0] == 1:
        grads = torch.autograd.grad(
            origins,
            outputs,
            grad_outputs=[c[0] for c in cols],
            retain_graph=True,
            allow_unused=True,
        )
        return tuple(None if t is None else t.unsqueeze(0) for t in grads)
    per_col = [
        torch.autograd.grad(
            origins,
            outputs,
            grad_outputs=[c[k] for c in cols],
            retain_graph=True,
            allow_unused=True,
        )
        for k in range(cols[0].shape[0])
    ]
    return tuple(
        None if per_col[0][i] is None else torch.stack([pc[i] for pc in per_col])
        for i in range(len(outputs))
    )


def _grad(
    origins: list[Tensor], outputs: list[Any], cols: list[Tensor]
) -> tuple[Tensor | None, ...]:
    if cols[0].shape[0] == 1:  # a single column (e.g. one MC sample): no vmap overhead
        return _loop(origins, outputs, cols)
    try:
        return torch.autograd.grad(
            origins,
            outputs,
            grad_outputs=cols,
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=True,
        )
    except (RuntimeError, NotImplementedError) as err:
        if "vmap" not in str(err) and "batch" not in str(err).lower():
            raise
    # an operation in the graph has no batching rule: one column at a time
    return _loop(origins, outputs, cols)


def backprop_columns(
    origins: list[Tensor], columns: Columns, outputs: list[Any], chunk: int
) -> Iterator[tuple[int, tuple[Tensor | None, ...]]]:
    """Yield ``(start, grads)`` per chunk; ``grads[i]`` is ``[k, *outputs[i].shape]`` or None."""
    for start in range(0, columns.num, chunk):
        cols = columns.chunk(start, start + chunk)
        yield start, _grad(origins, outputs, cols)


def pull_back(
    f: Callable[..., tuple[Tensor, ...]], primals: tuple[Any, ...], cols: tuple[Tensor, ...]
) -> tuple[Any, ...]:
    r"""``(∂f/∂θ)ᵀ c`` for the columns ``c`` of the outputs of ``f(*primals)`` (a tuple;
    ``cols[i]`` is ``[K, *outputᵢ.shape]``): one vector-Jacobian product of ``f`` at
    ``primals``, ``vmap``-ped over the ``K`` columns (one column at a time where an operation
    has no batching rule). One result per primal, its leaves with the leading ``K`` axis."""
    with warnings.catch_warnings():
        # (torch's notice that an operation falls back to a slow batching loop)
        warnings.filterwarnings("ignore", message="There is a performance drop")
        _, pull = vjp(f, *primals)
        try:
            return vmap(pull)(cols)
        except (RuntimeError, NotImplementedError) as err:
            if "vmap" not in str(err) and "batch" not in str(err).lower():
                raise
    rows = [pull(tuple(c[k] for c in cols)) for k in range(cols[0].shape[0])]
    return tree_map(lambda *leaves: torch.stack(leaves), *rows)
