r"""Rule for :class:`torch.nn.Embedding`.

Input indices ``i`` of shape ``[N, *T]``, output ``[N, *T, D]``, weight ``W`` of shape ``[V, D]``;
``T`` stands for the product of the position axes (1 when there are none). With ``g`` the output
columns ``[M, N, *T, D]`` and ``eᵥ`` the one-hot vector of token ``v``, the per-sample, per-column
weight gradient is

    ``Vₘₙ = Σₜ e_{iₙₜ} gₘₙₜᵀ``  (``[V, D]``),

where positions holding ``padding_idx`` are left out (PyTorch gives that row no gradient).
Row ``v`` of ``Vₘₙ`` is ``Gₘₙᵥ = Σ_{t: iₙₜ = v} gₘₙₜ``, the sum of the gradients of the positions of
sample ``n`` holding token ``v``. The statistics are computed from a compact table of these sums,
one row per distinct ``(sample, token)`` pair that occurs (at most ``N·T`` rows), never from the
``[M, N, V, D]`` tensor:

* ``‖Vₘₙ‖² = Σᵥ ‖Gₘₙᵥ‖²`` (``batch_l2``, summed over ``m``);
* ``Σₘₙ wₘₙ Vₘₙ²`` has row ``v`` equal to ``Σₘₙ wₘₙ Gₘₙᵥ²`` (``sum_squared``; ``batch_sum_squared``
  keeps ``n``);
* ``⟨Vₘₙ, Vₘₖ⟩ = Σᵥ ⟨Gₘₙᵥ, Gₘₖᵥ⟩`` over the tokens present in the batch (``batch_dot``);
* ``Σₙ Vₘₙ`` scatters every ``gₘₙₜ`` into row ``iₙₜ`` (``summed``);
* a weight tied to other calls (an output layer ``h Wᵀ``) combines with them through the outer
  factors ``e_{iₙₜ} gₘₙₜᵀ`` (:mod:`backprism.engine.tied`).

Kronecker factors, **in the weight's axis order** ``[V, D]`` (unlike BackPACK's ``[B, A]`` for
Linear, whose weight is ``[out, in]``)::

    weight ≈ A_tokens ⊗ B,
    A_tokens = (1/N) Σₙₜ e_{iₙₜ} e_{iₙₜ}ᵀ = diag(token counts) / N   ([V, V]),
    B        = Σₘₙₜ gₘₙₜ gₘₙₜᵀ                                       ([D, D]),

with padding positions left out of both sums (they do not touch the weight); the ``1/N`` of a
mean loss sits in ``g``, as for Linear. ``B`` sums outer products *per position* (each position
has its own one-hot input, so ``A_tokens`` counts positions too); for one sample with a single
position, ``A_tokens ⊗ B`` is the exact GGN block of the weight.

Unsupported options raise: ``max_norm`` (renormalises weight rows in place during the forward
pass) and ``scale_grad_by_freq`` (scales each gradient by the token's frequency in the whole
mini-batch, which mixes the samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from backprism.engine.gram import gram
from backprism.engine.rule import Call, Outer, Rule, register_rule

__all__ = ["EmbeddingRule"]


def _check_options(module: nn.Embedding) -> None:
    if module.max_norm is not None:
        raise NotImplementedError(
            f"backprism: nn.Embedding(max_norm={module.max_norm}) renormalises weight rows in "
            "place during the forward pass, which the Embedding rule does not support. Use "
            "max_norm=None and, if needed, renormalise the rows yourself under torch.no_grad() "
            "before the forward pass (e.g. with torch.embedding_renorm_)."
        )
    if module.scale_grad_by_freq:
        raise NotImplementedError(
            "backprism: nn.Embedding(scale_grad_by_freq=True) divides each gradient by the "
            "token's frequency in the whole mini-batch, so the gradient of one sample depends "
            "on the other samples and per-sample quantities are undefined. Use "
            "scale_grad_by_freq=False (e.g. weight the loss by inverse token frequency instead)."
        )


@dataclass
class _Tokens:
    """The non-padding positions of one call, flattened over samples and positions.

    ``sample[p]``/``token[p]`` are the sample and token of position ``p``, ``g[:, p]`` its
    gradient columns ``[M, P, D]``.
    """

    n: int
    vocab: int
    sample: Tensor
    token: Tensor
    g: Tensor

    @cached_property
    def table(self) -> tuple[Tensor, Tensor, Tensor]:
        """Compact ``(sample, token)`` table: ``(G [M, U, D], sample [U], token [U])`` with
        ``G[:, u]`` the sum of the gradients of the positions of that sample holding that token
        (rows in any order; the positions' own rows when no pair repeats)."""
        key = self.sample * self.vocab + self.token
        if key.numel() < 2 or bool((key[1:] > key[:-1]).all()):
            # strictly increasing keys (e.g. position indices): every pair occurs once, so the
            # table is the gradients themselves (no sort, no scatter)
            return self.g, self.sample, self.token
        uniq, inv = torch.unique(key, return_inverse=True)
        if uniq.numel() == key.numel():  # every pair once, in another order
            return self.g, self.sample, self.token
        m, _, d = self.g.shape
        table = self.g.new_zeros(m, uniq.numel(), d).index_add_(1, inv, self.g)
        return table, uniq // self.vocab, uniq % self.vocab


def _tokens(call: Call, g: Tensor) -> _Tokens:
    module = call.module
    _check_options(module)
    n = call.batch_size
    idx = call.input.reshape(n, -1).long()
    m, d = g.shape[0], g.shape[-1]
    g = g.reshape(m, n, -1, d)
    t = idx.shape[1]
    sample = torch.arange(n, device=idx.device).repeat_interleave(t)
    token = idx.reshape(-1)
    gflat = g.reshape(m, n * t, d)
    if module.padding_idx is not None:
        keep = torch.nonzero(token != module.padding_idx).squeeze(1)
        sample, token = sample[keep], token[keep]
        gflat = gflat.index_select(1, keep)
    return _Tokens(n, module.num_embeddings, sample, token, gflat)


def _weighted(sq: Tensor, weights: Tensor | None, sample: Tensor) -> Tensor:
    """``Σₘ wₘ,sample[u] sq[m, u]``: ``sq`` is ``[M, U, D]``, the result ``[U, D]``."""
    if weights is not None:
        sq = sq * weights[:, sample, None].to(sq.dtype)
    return sq.sum(0)


@register_rule(nn.Embedding)
class EmbeddingRule(Rule):
    """Per-sample quantities of ``nn.Embedding`` from token indices (see the module docstring)."""

    #: looks up each index: indices with the batch elsewhere are moved batch-first
    moves_batch_axis = True

    #: every statistic is a scatter of (squares of) the output gradient
    differentiable = True

    def builds_per_sample(self, call: Call) -> bool:
        return False  # statistics come from the compact (sample, token) table

    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        tk = _tokens(call, g)
        m, _, d = tk.g.shape
        out = tk.g.new_zeros(m, tk.n * tk.vocab, d)
        rows = tk.sample * tk.vocab + tk.token
        if m == 1:  # along the leading axis: the faster scatter kernel
            out[0].index_add_(0, rows, tk.g[0])
        else:
            out.index_add_(1, rows, tk.g)
        return {"weight": out.view(m, tk.n, tk.vocab, d)}

    def summed(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        tk = _tokens(call, g)
        m, _, d = tk.g.shape
        return {"weight": tk.g.new_zeros(m, tk.vocab, d).index_add_(1, tk.token, tk.g)}

    def sum_squared(
        self, call: Call, g: Tensor, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        tk = _tokens(call, g)
        table, sample, token = tk.table
        sq = _weighted(table.square(), weights, sample)
        return {"weight": sq.new_zeros(tk.vocab, sq.shape[-1]).index_add_(0, token, sq)}

    def batch_sum_squared(
        self, call: Call, g: Tensor, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        tk = _tokens(call, g)
        table, sample, token = tk.table
        sq = _weighted(table.square(), weights, sample)
        d = sq.shape[-1]
        out = sq.new_zeros(tk.n * tk.vocab, d).index_add_(0, sample * tk.vocab + token, sq)
        return {"weight": out.view(tk.n, tk.vocab, d)}

    def batch_l2(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        tk = _tokens(call, g)
        table, sample, _ = tk.table
        sq = table.square().sum((0, 2))
        return {"weight": sq.new_zeros(tk.n).index_add_(0, sample, sq)}

    def batch_dot(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        tk = _tokens(call, g)
        # per-sample gradients restricted to the rows of tokens present in the batch
        used, local = torch.unique(tk.token, return_inverse=True)
        m, _, d = tk.g.shape
        k = used.numel()
        dense = tk.g.new_zeros(m, tk.n * k, d).index_add_(1, tk.sample * k + local, tk.g)
        dense = dense.view(m, tk.n, k * d)
        return {"weight": torch.einsum("mni,mki->nk", dense, dense)}

    def outer_factors(self, call: Call, g: Tensor) -> dict[str, Outer]:
        """``Vₘₙ = Σₜ e_{iₙₜ} gₘₙₜᵀ``: one-hot rows (the indices), columns ``g`` (zero at
        padding positions)."""
        module = call.module
        _check_options(module)
        n = call.batch_size
        idx = call.input.reshape(n, -1).long()
        g = g.reshape(g.shape[0], n, idx.shape[1], g.shape[-1])
        if module.padding_idx is not None:
            g = g * (idx != module.padding_idx)[None, :, :, None].to(g.dtype)
        return {"weight": Outer(idx, g, module.num_embeddings)}

    def kfac_input(self, call: Call, approx: str | None = None) -> dict[str, Tensor]:
        """``A_tokens = diag(token counts) / N`` (``[V, V]``), padding positions left out;
        ``"expand"``: divided by the ``T`` positions; ``"reduce"``: ``(1/N) Σₙ c̄ₙ c̄ₙᵀ``
        with ``c̄ₙ`` sample ``n``'s token counts over ``T`` (the mean one-hot input)."""
        module = call.module
        _check_options(module)
        n, v = call.batch_size, module.num_embeddings
        idx = call.input.reshape(n, -1).long()
        t = idx.shape[1]
        dtype = module.weight.dtype
        keep = None if module.padding_idx is None else idx != module.padding_idx
        if approx == "reduce" and t > 1:
            rows = (torch.arange(n, device=idx.device)[:, None] * v + idx).reshape(-1)
            ones = torch.ones(rows.shape, dtype=dtype, device=idx.device)
            if keep is not None:
                ones = ones * keep.reshape(-1).to(dtype)
            counts = torch.zeros(n * v, dtype=dtype, device=idx.device).index_add_(0, rows, ones)
            mean = counts.view(n, v) / t
            return {"weight": gram(mean.t(), n)}
        token = idx.reshape(-1) if keep is None else idx[keep]
        counts = torch.bincount(token, minlength=v)
        scale = n * t if approx == "expand" else n
        return {"weight": torch.diag(counts.to(dtype) / scale)}

    def kfac_output(
        self, call: Call, g: Tensor, approx: str | None = None
    ) -> dict[str, Tensor]:
        """``B = Σₘₙₜ gₘₙₜ gₘₙₜᵀ`` (``[D, D]``) over the non-padding positions (also
        ``"expand"``); ``"reduce"``: ``Σₘₙ ḡₘₙ ḡₘₙᵀ`` of the sums ``ḡₘₙ = Σₜ gₘₙₜ``."""
        tk = _tokens(call, g)
        if approx == "reduce":
            m, _, d = tk.g.shape
            f = tk.g.new_zeros(m, tk.n, d).index_add_(1, tk.sample, tk.g).reshape(-1, d)
        else:
            f = tk.g.reshape(-1, tk.g.shape[-1])
        return {"weight": gram(f.t())}

    def kronecker_factors(
        self, call: Call, g: Tensor, approx: str | None = None
    ) -> dict[str, list[Tensor]]:
        """``{"weight": [A_tokens, B]}`` in the weight's axis order: ``weight ≈ A_tokens ⊗ B``."""
        return {
            "weight": [
                self.kfac_input(call, approx)["weight"],
                self.kfac_output(call, g, approx)["weight"],
            ]
        }

    def kronecker_grad_side(self, call: Call, name: str, n_factors: int) -> list[bool]:
        """``B`` (second) depends on the columns and is summed over column chunks; ``A_tokens``
        (first) depends on the indices only."""
        return [False, True]
