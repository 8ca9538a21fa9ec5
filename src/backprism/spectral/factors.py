r"""Compact GGN square-root factors and the extension that stores them.

With the loss-Hessian square root ``∇²ℓₙ = Sₙ Sₙᵀ`` pushed back to a parameter ``θ`` the GGN
square root is ``V[k, n] = Jₙᵀ Sₙ[:, k] / √N`` (``[K, N, *θ.shape]``, ``GGN = V Vᵀ`` for a mean
loss). The spectral computations only need three contractions of ``V`` — with itself (Gram
matrix ``G = VᵀV``, ``[KN, KN]``), with coefficient vectors (``V u``) and with dense tensors
(``Vᵀ w``) — so a factor object that provides them is stored instead of ``V`` where that is
cheaper:

* :class:`DenseFactor` holds ``V`` itself (any layer, via the rule's ``per_sample``);
* :class:`KernelFactor` holds the layer input ``x`` (``[N, T, I]``, unfolded for convolutions)
  and the backpropagated columns ``g`` (``[K, N, T, O]``) of a layer whose weight gradient is
  ``Vₖₙ = Σₜ gₖₙₜ xₙₜᵀ`` (Linear, Conv1d/2d). The Gram block is

  .. math:: G_{(k,n),(k',n')} = \sum_{t,s} \langle g_{knt}, g_{k'n's}\rangle
            \langle x_{nt}, x_{n's}\rangle

  (the *kernel form*, ``(X Xᵀ) ⊙ (S Sᵀ)`` summed over positions, evaluated one sample row at
  a time by contracting ``X Xᵀ`` with ``g`` first so that the ``[KNT, KNT]`` matrix ``g gᵀ`` is
  never formed; cheap when ``T`` is small against ``O`` and ``I``), or, when that costs more
  (see ``KernelFactor._gram_method``), the Gram matrix of ``V`` materialised a block of output
  channels at a time, upper block triangle only. The ``[K, N, O, I]`` factor is never stored.

Row index of every ``[KN, ·]`` matrix: ``i = k·N' + n`` (column-major in ``k``), ``N'`` the
number of samples kept by the sub-sampling.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism.engine.backward import current_pass
from backprism.engine.rule import Call, Rule
from backprism.extensions.base import SecondOrderExtension, check_subsampling, subsample_index
from backprism.extensions.firstorder import _subset_call, subset_columns

__all__ = ["DenseFactor", "GramFactor", "KernelFactor", "SpectralFactorExtension"]

#: elements allowed for one temporary block in Gram/contraction computations (4 Mi: 16 MiB in
#: float32, below glibc's largest mmap threshold, so freed blocks are reused without page faults)
BLOCK_ELEMENTS = 2**22
#: relative cost per multiply-add (against a large matrix product) of the kernel form's batched
#: product with inner dimension ``T``, of its final memory-bound contraction and of building ``V``
#: (see ``KernelFactor._gram_method``)
KERNEL_BMM_WEIGHT, KERNEL_FINAL_WEIGHT, BUILD_WEIGHT = 1.6, 3.3, 1.5
#: fewest output channels per block for building ``V`` column by column (see
#: ``KernelFactor._v_blocks``)
MIN_BLOCK_CHANNELS = 32


def _syrk_upper_(out: Tensor, v: Tensor, min_rows: int = 64) -> Tensor:
    """``out += v vᵀ`` for ``v`` of shape ``[R, D]`` on and above the diagonal blocks of a
    ``b × b`` block partition of the rows (``b ≤ 8`` blocks of at least ``min_rows`` rows), one
    matrix product per block row: ``(b + 1) / (2b)`` of the multiply-adds of ``v @ vᵀ``. Entries
    below the diagonal blocks are left as they are; :func:`_mirror_upper` completes the
    symmetric result."""
    r = v.shape[0]
    b = max(1, min(8, r // max(1, min_rows)))
    edges = [r * j // b for j in range(b + 1)]
    for a in range(b):
        lo, hi = edges[a], edges[a + 1]
        out[lo:hi, lo:].addmm_(v[lo:hi], v[lo:].t())
    return out


def _mirror_upper(out: Tensor) -> Tensor:
    """The symmetric matrix whose upper triangle is ``out``'s."""
    return torch.triu(out).add_(torch.triu(out, 1).t())


class GramFactor:
    """Interface of a stored GGN square-root factor ``V`` (``[K, N', *p]``, never required
    to exist as a tensor).

    Attributes:
        num_cols: ``K``.
        num_samples: ``N'`` (samples kept).
        batch_size: ``N``, the full mini-batch size (the ``1/√N`` scaling of ``V``).
        shape: the parameter's shape ``p``.
    """

    num_cols: int
    num_samples: int
    batch_size: int
    shape: torch.Size

    def gram(self) -> Tensor:
        """``VᵀV``: ``[KN', KN']``."""
        raise NotImplementedError

    def matmul(self, u: Tensor) -> Tensor:
        """``V u`` for ``u`` of shape ``[KN', D]``: ``[D, *p]``."""
        raise NotImplementedError

    def tmatmul(self, w: Tensor) -> Tensor:
        """``Vᵀ w`` for ``w`` of shape ``[M, *p]``: ``[KN', M]``."""
        raise NotImplementedError

    def dense(self) -> Tensor:
        """``V`` as a ``[K, N', *p]`` tensor."""
        raise NotImplementedError

    def gram_tmatmul(self, w: Tensor) -> tuple[Tensor, Tensor]:
        """``(VᵀV, Vᵀ w)`` together (implementations share the work where they can)."""
        return self.gram(), self.tmatmul(w)

    def cat(self, other: GramFactor) -> GramFactor:
        """``[V, V']`` stacked along the column axis ``K`` (chunks, several losses)."""
        return DenseFactor(torch.cat([self.dense(), other.dense()], 0), self.batch_size)


class DenseFactor(GramFactor):
    """``V`` held as a ``[K, N', *p]`` tensor."""

    def __init__(self, v: Tensor, batch_size: int) -> None:
        self.v = v
        self.num_cols, self.num_samples = v.shape[0], v.shape[1]
        self.batch_size = batch_size
        self.shape = v.shape[2:]

    def _flat(self) -> Tensor:
        return self.v.reshape(self.num_cols * self.num_samples, -1)

    def gram(self) -> Tensor:
        f = self._flat()
        return f @ f.t()

    def matmul(self, u: Tensor) -> Tensor:
        return (u.t() @ self._flat()).reshape(u.shape[1], *self.shape)

    def tmatmul(self, w: Tensor) -> Tensor:
        return self._flat() @ w.reshape(w.shape[0], -1).t()

    def dense(self) -> Tensor:
        return self.v


class KernelFactor(GramFactor):
    r"""Weight factor ``Vₖₙ = Σₜ gₖₙₜ xₙₜᵀ`` kept as ``x`` (``[N', T, I]``) and ``g``
    (``[K, N', T, O]``, or a list of chunks of it along ``K``, as the columns arrive); ``shape``
    is the weight's shape (``O·I`` elements).

    Chunks are concatenated at most once, and only by the computations that need ``g`` in one
    piece; building ``V`` column by column and the kernel form read them as they are."""

    def __init__(
        self,
        x: Tensor,
        g: Tensor | Sequence[Tensor],
        shape: Sequence[int],
        batch_size: int,
        source: Any = None,
    ) -> None:
        self.x = x
        self._chunks = [g] if isinstance(g, Tensor) else list(g)
        first = self._chunks[0]
        self.num_cols = sum(c.shape[0] for c in self._chunks)
        self.num_samples = first.shape[1]
        self._dims = (self.num_cols, *first.shape[1:])  # (K, N', T, O)
        self.batch_size = batch_size
        self.shape = torch.Size(shape)
        self.source = source  # the call the factor came from (to concatenate chunks)

    @property
    def g(self) -> Tensor:
        """The columns ``[K, N', T, O]`` in one tensor."""
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks, 0)]
        return self._chunks[0]

    # -- costs ---------------------------------------------------------------------------
    def _gram_method(self) -> str:
        """``"kernel"`` or ``"materialise"``, whichever costs less (multiply-adds weighted by how
        fast each product runs on a CPU, measured on the convolutions of ``cifar10_3c3d``):

        * kernel (one row of samples ``n`` at a time, ``n' ≥ n`` only): ``(NT)²·I/2`` for
          ``X Xᵀ``, ``N²/2·K·O·T²`` to contract it with ``g`` (inner dimension ``T``, weight
          :data:`KERNEL_BMM_WEIGHT`) and ``N²/2·K²·O·T`` for the final contraction, which
          streams an ``[N', K, O, T]`` intermediate per row (weight :data:`KERNEL_FINAL_WEIGHT`);
        * materialise: ``KN·T·O·I`` to build ``V`` (weight :data:`BUILD_WEIGHT`) and
          ``(9/16)·(KN)²·O·I`` for the block-triangular ``V Vᵀ`` (:func:`_syrk_upper_`).

        The kernel form wins where ``T`` is small against ``O`` and ``I`` (deep convolutions on
        small feature maps), the materialised one for large feature maps.
        """
        k, n, t, o = self._dims
        i = self.x.shape[-1]
        if t == 1:
            return "kernel"
        kernel = n * n / 2 * (
            t * t * i + KERNEL_BMM_WEIGHT * k * o * t * t + KERNEL_FINAL_WEIGHT * k * k * o * t
        )
        materialise = BUILD_WEIGHT * k * n * t * o * i + 9 / 16 * (k * n) ** 2 * o * i
        return "kernel" if kernel < materialise else "materialise"

    def gram_tmatmul(self, w: Tensor) -> tuple[Tensor, Tensor]:
        """``(VᵀV, Vᵀ w)``; when ``V`` is materialised for the Gram matrix, ``Vᵀw`` is taken from
        the same blocks (``KN'·M·O·I`` multiply-adds instead of ``N'·M·T·O·I``)."""
        if self._dims[2] == 1 or self._gram_method() == "kernel":
            return self.gram(), self.tmatmul(w)
        vtw: list[Tensor] = []
        gram = self._gram_materialised(w, vtw)
        return gram, vtw[0]

    def gram(self, method: str | None = None) -> Tensor:
        """``VᵀV`` by the kernel form (:meth:`_gram_kernel`) or by materialising ``V`` a block
        of output channels at a time (:meth:`_gram_materialised`); ``method`` defaults to the
        cheaper (:meth:`_gram_method`)."""
        method = method or self._gram_method()
        k, n, t, o = self._dims
        if t == 1:
            gg = self.g[:, :, 0].reshape(k * n, o)
            xx = self.x[:, 0] @ self.x[:, 0].t()
            return (gg @ gg.t()) * xx.repeat(k, k)
        if method == "kernel":
            return self._gram_kernel()
        return self._gram_materialised()

    def _gram_kernel(self) -> Tensor:
        r"""Kernel form, one sample ``n`` (a row of the Gram matrix's sample blocks) at a time,
        blocks ``n' ≥ n`` only (mirrored):

        .. math:: Y_{n' l o t} = \sum_s g_{l n' s o}\,\langle x_{n's}, x_{nt}\rangle,\qquad
                  G_{(k,n),(l,n')} = \sum_{o,t} g_{knto}\, Y_{n' l o t}

        ``⟨x_{n's}, x_{nt}⟩`` comes from ``X Xᵀ`` computed a block of rows at a time
        (:data:`BLOCK_ELEMENTS`); ``Y`` (``[N', K, O, T]``) is one batched product over ``n'``
        and the row of ``G`` one matrix product with it. Neither ``V`` nor ``g gᵀ``
        (``[KNT, KNT]``) is formed.
        """
        k, n, t, o = self._dims
        xf = self.x.reshape(n * t, -1)
        gp = torch.cat([c.permute(1, 0, 3, 2) for c in self._chunks], 1).contiguous()  # [N',K,O,T]
        out = gp.new_empty(n, k, n, k)  # (n, k, n', l)
        # about eight row blocks: X Xᵀ restricted to n' ≥ the block's first row costs ~9/16 of
        # the full product
        rows = max(1, min(BLOCK_ELEMENTS // max(1, n * t * t), -(-n // 8)))
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            # xx[a, t, p, s] = <x_{start+a, t}, x_{start+p, s}>
            xx = (xf[start * t : stop * t] @ xf[start * t :].t()).view(stop - start, t, -1, t)
            for r in range(start, stop):
                rest = n - r
                xr = xx[r - start, :, r - start :].permute(1, 2, 0)  # [n' ≥ r, s, t]
                y = torch.bmm(gp[r:].view(rest, k * o, t), xr)  # [n', (l, o), t]
                blk = (gp[r].view(k, o * t) @ y.view(rest * k, o * t).t()).view(k, rest, k)
                out[r, :, r:] = blk
                out[r + 1 :, :, r] = blk[:, 1:].permute(1, 2, 0)
        return out.permute(1, 0, 3, 2).reshape(k * n, k * n)

    def _block_layout(self) -> tuple[int, bool]:
        """Output channels per block of ``V`` (:data:`BLOCK_ELEMENTS`) and whether the blocks
        are built column by column (rows ``k·N' + n``, *k-major*; see :meth:`_v_blocks`)."""
        k, n, _, o = self._dims
        step = max(1, BLOCK_ELEMENTS // max(1, k * n * self.x.shape[-1]))
        return step, step >= min(o, MIN_BLOCK_CHANNELS)

    def _v_blocks(self) -> Iterator[tuple[slice, Tensor]]:
        """``V`` a block of ``c`` output channels at a time, as ``(channels, v)`` with ``v`` of
        shape ``[K·N', c·I]``.

        A block is built with one batched product (over samples) per column ``k``, reading
        ``g``'s ``[K, N', O, T]`` memory in place (rows ``k·N' + n``), when it holds at least
        :data:`MIN_BLOCK_CHANNELS` channels; otherwise (large ``I``) with one batched product of
        ``K·c`` channel rows per sample, rows in sample-major order (``n·K + k``), which needs a
        copy of ``g``'s block (:meth:`_block_layout` says which)."""
        k, n, t, o = self._dims
        x, chunks = self.x, self._chunks
        i = x.shape[-1]
        step, per_column = self._block_layout()
        for start in range(0, o, step):
            stop = min(o, start + step)
            if per_column:
                v = x.new_empty(k, n, stop - start, i)
                row = 0
                for chunk in chunks:
                    for gc in chunk.transpose(2, 3)[:, :, start:stop]:  # [N', c, T] per column
                        torch.bmm(gc, x, out=v[row])
                        row += 1
            else:  # [N', K, c, T] copied to one batched product's rows
                gs = torch.cat([ch.permute(1, 0, 3, 2)[:, :, start:stop] for ch in chunks], 1)
                v = torch.bmm(gs.reshape(n, k * (stop - start), t), x)
            yield slice(start, stop), v.reshape(k * n, -1)

    def _gram_materialised(self, w: Tensor | None = None, vtw: list | None = None) -> Tensor:
        """Gram matrix from ``V`` materialised a block of output channels at a time
        (:meth:`_v_blocks`); only the upper block triangle of the symmetric ``V Vᵀ`` is computed
        (:func:`_syrk_upper_`). With ``w`` (``[M, O, I]``), ``Vᵀ w`` (``[KN', M]``) is appended
        to ``vtw``."""
        k, n, _, o = self._dims
        i = self.x.shape[-1]
        out = self.x.new_zeros(k * n, k * n)
        prod = None
        if w is not None:
            w = w.reshape(w.shape[0], o, i).to(self.x.dtype)
            prod = self.x.new_zeros(k * n, w.shape[0])
        for channels, v in self._v_blocks():
            _syrk_upper_(out, v)
            if prod is not None and w is not None:
                prod.addmm_(v, w[:, channels].reshape(w.shape[0], -1).t())
        out = _mirror_upper(out)
        if not self._block_layout()[1]:  # sample-major rows
            out = out.reshape(n, k, n, k).permute(1, 0, 3, 2).reshape(k * n, k * n)
            if prod is not None:
                prod = prod.reshape(n, k, -1).transpose(0, 1).reshape(k * n, -1)
        if prod is not None and vtw is not None:
            vtw.append(prod)
        return out

    def matmul(self, u: Tensor, method: str | None = None) -> Tensor:
        """``V u``, by ``method`` or (default) whichever needs fewer multiply-adds per sample
        and channel:

        * ``"contract"``: ``w = Σₖ uₖₙ gₖₙ`` (``[N', T, D, O]``, ``K·D·T``), then ``wᵀ X``
          (``D·T·I``);
        * ``"materialise"``: ``V``'s blocks (:meth:`_v_blocks`, ``K·T·I``), then ``uᵀ V``
          (``K·D·I``); it avoids the ``D·N'·T·O`` intermediate for large feature maps.
        """
        k, n, t, o = self._dims
        i = self.x.shape[-1]
        d = u.shape[1]
        if method is None:
            method = "materialise" if t > 1 and k * i * (t + d) < d * t * (k + i) else "contract"
        if method == "materialise":
            out = u.new_empty(d, o, i)
            if not self._block_layout()[1]:  # sample-major rows
                u = u.reshape(k, n, d).transpose(0, 1).reshape(n * k, d)
            for channels, v in self._v_blocks():
                out[:, channels] = (u.t() @ v).view(d, -1, i)
            return out.reshape(d, *self.shape)
        w = torch.einsum("knd,knto->ntdo", u.reshape(k, n, d), self.g)
        return (w.reshape(n * t, d * o).t() @ self.x.reshape(n * t, i)).reshape(d, *self.shape)

    def tmatmul(self, w: Tensor) -> Tensor:
        k, n, t, o = self.g.shape
        i = self.x.shape[-1]
        m = w.shape[0]
        w = w.reshape(m, o, i)
        step = max(1, BLOCK_ELEMENTS // max(1, n * t * o))
        parts = []
        for start in range(0, m, step):
            wx = torch.einsum("moi,nti->mnto", w[start : start + step], self.x)
            parts.append(torch.einsum("knto,mnto->knm", self.g, wx))
        return torch.cat(parts, -1).reshape(k * n, m)

    def dense(self) -> Tensor:
        v = torch.einsum("knto,nti->knoi", self.g, self.x)
        return v.reshape(self.num_cols, self.num_samples, *self.shape)

    def cat(self, other: GramFactor) -> GramFactor:
        if (
            isinstance(other, KernelFactor)
            and self.source is not None
            and other.source is self.source
        ):
            chunks = self._chunks + other._chunks
            return KernelFactor(self.x, chunks, self.shape, self.batch_size, self.source)
        return super().cat(other)


# -- building factors from a call ----------------------------------------------------------


def _kernel_form_applies(module: nn.Module) -> bool:
    """Whether :func:`factors_from_call` keeps ``module``'s weight as a :class:`KernelFactor`
    (Linear; Conv1d/Conv2d with ``groups = 1``, zero padding and numeric padding)."""
    if type(module) is nn.Linear:
        return True
    return (
        type(module) in (nn.Conv1d, nn.Conv2d)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def _conv_unfold(
    module: nn.Module, x: Tensor, g: Tensor, xu: Tensor | None = None
) -> tuple[Tensor, Tensor] | None:
    """``x`` unfolded to ``[N, T, I·k]`` (or ``xu``, unfolded before) and ``g`` as
    ``[K, N, T, O]`` for Conv1d/Conv2d with ``groups = 1``, zero padding and numeric padding;
    ``None`` when not applicable."""
    if not _kernel_form_applies(module):
        return None
    if isinstance(module, nn.Conv1d):
        if x.dim() != 3:
            return None
        x = x.unsqueeze(2)
        kernel, dil = (1, *module.kernel_size), (1, *module.dilation)
        pad, stride = (0, *module.padding), (1, *module.stride)
    elif isinstance(module, nn.Conv2d):
        if x.dim() != 4:
            return None
        kernel, dil = module.kernel_size, module.dilation
        pad, stride = module.padding, module.stride
    else:
        return None
    if xu is None:
        xu = F.unfold(x, kernel, dilation=dil, padding=pad, stride=stride).transpose(1, 2)
    k, n = g.shape[0], g.shape[1]
    gt = g.reshape(k, n, g.shape[2], -1)  # [K, N, O, T]
    if gt.shape[-1] != xu.shape[1]:
        return None
    return xu, gt.transpose(2, 3)


def factors_from_call(
    rule: Rule,
    call: Call,
    g: Any,
    index: Tensor | None,
    inputs: MutableMapping[Call, Tensor] | None = None,
) -> dict[str, GramFactor]:
    """Factors for the parameters of ``call`` from its backpropagated columns ``g``
    (``[K, N, *out.shape]``), restricted to the samples ``index`` (all if ``None``).

    ``inputs`` caches the unfolded convolution inputs by call, so that the column chunks of
    one call unfold them once."""
    module = call.module
    n = call.batch_size
    names = set(call.params)
    kernel: tuple[Tensor, Tensor] | None = None
    if isinstance(g, Tensor) and type(module) in (nn.Linear, nn.Conv1d, nn.Conv2d):
        x = call.input
        gs = g
        if index is not None:
            x, gs = x.index_select(0, index.to(x.device)), g.index_select(1, index.to(g.device))
        if type(module) is nn.Linear:
            kernel = (
                x.reshape(x.shape[0], -1, x.shape[-1]),
                gs.reshape(gs.shape[0], gs.shape[1], -1, gs.shape[-1]),
            )
        else:
            kernel = _conv_unfold(module, x, gs, None if inputs is None else inputs.get(call))
            if kernel is not None and inputs is not None:
                inputs[call] = kernel[0]
    if kernel is not None:
        xk, gk = kernel
        out: dict[str, GramFactor] = {}
        if "weight" in names:
            out["weight"] = KernelFactor(xk, gk, module.weight.shape, n, source=call)
        if "bias" in names and module.bias is not None:
            out["bias"] = DenseFactor(gk.sum(2), n)
        return out
    if index is not None:
        call, g = _subset_call(call, index), subset_columns(g, index, n)
    return {name: DenseFactor(v, n) for name, v in rule.per_sample(call, g).items()}


class SpectralFactorExtension(SecondOrderExtension):
    """Stores a :class:`GramFactor` of the (sub-sampled, exact or MC) GGN square root per
    parameter under ``spectral_factor_exact`` / ``spectral_factor_mc``.

    ``V`` has the scaling of ``sqrt_ggn_*``: ``V Vᵀ = GGN`` (in expectation for MC) for the full
    mini-batch; sub-sampling keeps the kept samples' columns and does *not* rescale (the
    spectral computations apply ``N/N'``).

    Args:
        subsampling: indices of the samples whose columns are kept (default: all); distinct,
            as ViViT's computations require (``check_subsampling_unique``; for
            ``SqrtGGNExact``-style repeated columns see :mod:`backprism.extensions.secondorder`).
        mc_samples: ``0`` for the exact loss-Hessian square root, ``M ≥ 1`` for ``M`` MC columns.
    """

    def __init__(self, subsampling: Sequence[int] | None = None, mc_samples: int = 0) -> None:
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
            raise ValueError(f"mc_samples must be a non-negative integer, got {mc_samples!r}")
        self.subsampling = check_subsampling(subsampling)
        self.mc_samples = mc_samples
        self.savefield = "spectral_factor_mc" if mc_samples else "spectral_factor_exact"

    def column_key(self) -> Hashable:
        return ("mc", self.mc_samples) if self.mc_samples else ("exact",)

    def _index(self, n: int) -> Tensor | None:
        return subsample_index(self.subsampling, n, "spectral GGN sub-sampling")

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        bp = current_pass()  # unfolded inputs are shared by a call's column chunks
        key = ("unfolded", id(self))
        inputs = None if bp is None else bp.scratch.setdefault(key, {})
        return factors_from_call(rule, call, g, self._index(call.batch_size), inputs)

    def builds_per_sample(self, rule: Rule, call: Call) -> bool:
        return not _kernel_form_applies(call.module) and rule.builds_per_sample(call)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> GramFactor:
        idx = self._index(call.batch_size)
        v = dense if idx is None else dense.index_select(1, idx.to(dense.device))
        return DenseFactor(v, call.batch_size)

    def accumulate(self, old: GramFactor, new: GramFactor) -> GramFactor:
        return old.cat(new)
