r"""A convolution's Kronecker input factor from shifted products of its input, not its unfold.

For a convolution with stride 1 the factor ``Σ_{n,l} X_{nl} X_{nl}ᵀ`` (``[C·K, C·K]``, ``X``
the unfolded input) has a structure the unfolded product ignores. Its block of kernel offsets
``(κ, κ')`` is

.. math:: A_{κκ'} = \sum_n \sum_{u ∈ R_{κκ'}} x_{n,:,u}\, x_{n,:,u+δ}^{\mathsf T}
    \qquad [C, C], \qquad δ = d ⊙ (κ' − κ),

a correlation of the input with itself shifted by ``δ`` over a box ``R_{κκ'}`` of input
positions (``u = l + d⊙κ − p`` for the output positions ``l`` whose partner ``u + δ`` is inside
the input: the zero padding contributes nothing). Pairs with the same ``δ`` share the
correlation and differ only at the borders, and ``A_{κ'κ} = A_{κκ'}ᵀ``, so only the
``((2k−1)^d + 1)/2`` shifts with ``δ ≥ 0`` (lexicographically) are computed, 13 for a 3×3
kernel, instead of the ``K² = 81`` blocks of the unfolded product: about ``13/81`` of its
multiply-adds where the input is large next to the kernel, and no unfolded copy (9× the
input).

Per shift: the input is copied once, channels first, with a zero margin of ``d(k−1)`` after
it on every spatial axis, ``X = [C, N·Π(S + d(k−1))]`` (shared by the shifts). Its flat shift
by ``o = Σ_a δ_a·step_a`` gives ``F = X[:, :T−o] X[:, o:]ᵀ = Σ x_u x_{u+δ}ᵀ`` over every
position ``u`` whose partner ``u + δ`` is inside the input: a partner outside it falls into the
margin (zeros), never onto another position, so no flat partner is wrong. The positions are cut,
per axis, at every box boundary of the shift's pairs into cells; every cell but the largest one
inside the valid box (the interior) gets its own product from the windows of the cell and of
the cell shifted by ``δ`` (cells of one shape in one batched product), the interior's is ``F``
less the others, and each block ``A_{κκ'}`` is the sum of the cells in its box.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from backprism.engine.gram import gram

__all__ = ["input_factor_by_shifts", "shifts_cheaper"]


def shifts_cheaper(
    size: Sequence[int], kernel: Sequence[int], dilation: Sequence[int], out: Sequence[int]
) -> bool:
    """Whether the shifted products cost less than the unfolded Gram matrix: their
    multiply-adds ``≈ (K_δ/2)·Π(S + d(k−1))`` (``K_δ = Π(2k−1)`` shifts, each over the input
    with its zero margin) against ``≈ (K²/2)·ΠL`` (the block-symmetric Gram matrix of the
    unfold, ``ΠL`` output positions), the border cells' extra work and fixed costs weighed in
    by a factor 2. Measured on the CPU (2 threads, N = 128, 3×3 kernels): 67 → 19 ms at
    ``C = 16, S = 32²``, 30 → 20 ms at ``C = 64, S = 8²``; at ``S = 4²`` the unfold is kept.
    Large kernels are left to the unfold (``Π 2k > 64`` over the axes with ``k > 1``, as for
    7×7 or 3×3×3): the border cells grow as ``Π(2k)²`` per layer, each a few small operations
    (a 7×7 kernel on 8² inputs took 16× the unfold's time)."""
    k = math.prod(kernel)
    shifts = math.prod(2 * a - 1 for a in kernel)
    padded = math.prod(m + dl * (a - 1) for m, dl, a in zip(size, dilation, kernel))
    few_cells = math.prod(2 * a for a in kernel if a > 1) <= 64
    return k > 1 and few_cells and 2 * shifts * padded < k * k * math.prod(out)


def input_factor_by_shifts(
    x: Tensor,
    kernel: Sequence[int],
    dilation: Sequence[int],
    pad: Sequence[int],
    out: Sequence[int],
) -> Tensor:
    """``Σ_{n,l} X_{nl} X_{nl}ᵀ`` (``[C·K, C·K]``, rows ``c·K + κ`` as the unfold's) of a
    convolution with stride 1, zero padding ``pad`` on the left of each spatial axis (the
    right padding follows from the output size ``out``), from ``x`` ``[N, C, *S]``."""
    n, c, *size = x.shape
    d = len(size)
    margin = [dl * (k - 1) for dl, k in zip(dilation, kernel)]
    padded = [m + e for m, e in zip(size, margin)]
    # [C, N, *S] with zeros after the input on every spatial axis, as wide as the largest shift:
    # a partner u + δ outside the input falls into them, never onto another position
    xp = x.new_zeros(c, n, *padded)
    xp[(slice(None), slice(None), *(slice(0, m) for m in size))] = x.transpose(0, 1)
    steps = [math.prod(padded[a + 1 :]) for a in range(d)]
    total = n * math.prod(padded)
    flat = xp.reshape(c, total)
    kappas = list(itertools.product(*(range(k) for k in kernel)))
    k = len(kappas)
    by_shift: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for i, ka in enumerate(kappas):
        for j, kb in enumerate(kappas):
            delta = tuple(dl * (b - a) for dl, a, b in zip(dilation, ka, kb))
            if any(abs(s) >= m for s, m in zip(delta, size)):
                continue  # no pair of input positions that far apart: a zero block
            if delta > (0,) * d or i == j:  # δ ≥ 0 (lexicographically); the rest by symmetry
                by_shift.setdefault(delta, []).append((i, j))
    rows: list[int] = []
    cols: list[int] = []
    blocks: list[Tensor] = []
    for delta, pairs in by_shift.items():
        offset = sum(s * st for s, st in zip(delta, steps))  # > 0 unless δ = 0
        # F = Σ x_u x_{u+δ}ᵀ over every u whose partner is inside the input
        whole = gram(flat) if offset == 0 else flat[:, : total - offset] @ flat[:, offset:].T
        valid = [(max(0, -s), min(m, m - s)) for s, m in zip(delta, size)]
        boxes = []
        for i, _ in pairs:
            box = []
            for a in range(d):
                start = dilation[a] * kappas[i][a] - pad[a]
                lo = min(max(start, valid[a][0]), valid[a][1])
                box.append((lo, max(lo, min(start + out[a], valid[a][1]))))
            boxes.append(box)  # empty (lo = hi) where no output position reaches
        cuts = [
            sorted({0, size[a], *valid[a], *(b[a][0] for b in boxes), *(b[a][1] for b in boxes)})
            for a in range(d)
        ]
        segments = [list(itertools.pairwise(cut)) for cut in cuts]
        inside = [
            [lo >= va and hi <= vb for lo, hi in segs] for segs, (va, vb) in zip(segments, valid)
        ]
        inner = tuple(
            max(
                (t for t in range(len(segs)) if ok[t]),
                key=lambda t, segs=segs: segs[t][1] - segs[t][0],
            )
            for segs, ok in zip(segments, inside)
        )
        products = _cell_products(xp, segments, inside, inner, delta)
        # the interior cell: F less the other cells (those outside the partners' box add 0)
        cells = products.reshape(-1, c * c)
        at = sum(t * math.prod(len(s) for s in segments[a + 1 :]) for a, t in enumerate(inner))
        cells[at] = whole.reshape(-1) - cells.sum(0)
        # each block A_κκ' is the sum of the cells in its box: one product with their masks
        within = [
            [
                [lo >= b[0] and hi <= b[1] and b[0] < b[1] for lo, hi in segs]
                for segs, b in zip(segments, box)
            ]
            for box in boxes
        ]
        masks = torch.tensor(
            [[math.prod(m) for m in itertools.product(*w)] for w in within],
            dtype=x.dtype, device=x.device,
        )
        blocks.append(masks @ cells)
        rows += [i for i, _ in pairs]
        cols += [j for _, j in pairs]
    res = x.new_zeros(k, k, c, c)  # [κ, κ', C, C], permuted to the unfold's order at the end
    if blocks:
        found = torch.cat(blocks).reshape(-1, c, c)
        i_t = torch.tensor(rows, device=x.device)
        j_t = torch.tensor(cols, device=x.device)
        res[j_t, i_t] = found.transpose(1, 2)  # A_κ'κ = A_κκ'ᵀ (first: the diagonal's own wins)
        res[i_t, j_t] = found
    return res.permute(2, 0, 3, 1).reshape(c * k, c * k)


def _cell_products(
    xp: Tensor,
    segments: list[list[tuple[int, int]]],
    inside: list[list[bool]],
    inner: tuple[int, ...],
    delta: tuple[int, ...],
) -> Tensor:
    """``[*cells, C, C]``: per cell whose partners are inside the input (but ``inner``, left
    zero) ``Σ_n Σ_{u ∈ cell} x_u x_{u+δ}ᵀ`` from the windows of the cell and of the cell
    shifted by ``δ`` (cells of one shape in one batched product); zero for the others."""
    c = xp.shape[0]
    shape = [len(s) for s in segments]
    products = xp.new_zeros(*shape, c, c)
    by_shape: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for cell in itertools.product(*(range(m) for m in shape)):
        if cell == inner or not all(inside[a][t] for a, t in enumerate(cell)):
            continue
        dims = tuple(segments[a][t][1] - segments[a][t][0] for a, t in enumerate(cell))
        by_shape.setdefault(dims, []).append(cell)
    for group in by_shape.values():
        left, right = [], []
        for cell in group:
            lo = [segments[a][t][0] for a, t in enumerate(cell)]
            hi = [segments[a][t][1] for a, t in enumerate(cell)]
            left.append(xp[(slice(None), slice(None), *(slice(a, b) for a, b in zip(lo, hi)))])
            right.append(
                xp[
                    (
                        slice(None),
                        slice(None),
                        *(slice(a + s, b + s) for a, b, s in zip(lo, hi, delta)),
                    )
                ]
            )
        lhs = torch.stack(left).reshape(len(group), c, -1)  # [cells, C, N·|cell|]
        rhs = torch.stack(right).reshape(len(group), c, -1)
        flat = products.view(-1, c, c)
        at = [sum(t * math.prod(shape[a + 1 :]) for a, t in enumerate(cell)) for cell in group]
        flat[torch.tensor(at, device=xp.device)] = torch.bmm(lhs, rhs.transpose(1, 2))
    return products
