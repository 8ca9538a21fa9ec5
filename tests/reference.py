"""Independent dense references built from the definitions with ``torch.func`` / autograd.

Never call backprism here. The trick used throughout: give every sample its own copy of the
parameters, ``θₙ = θ`` (a leaf of shape ``[N, *p]``), run the model per sample with ``vmap`` and
evaluate the *real* loss module on the stacked outputs. Then

* ``∂L/∂θₙ`` is the per-sample gradient ``∇(ℓₙ/N)`` with whatever scaling the loss applies;
* the Jacobian of the outputs w.r.t. ``θₙ`` and the loss Hessian w.r.t. the outputs give the
  GGN ``Jᵀ (∇²_f L) J`` whose ``(n, n)`` blocks are the per-sample GGNs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.autograd.functional import jacobian
from torch.func import functional_call, hessian, jacrev, vjp, vmap


def trainable(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}


def _per_sample_forward(model: nn.Module, X, batched_params: dict[str, Tensor]):
    """Outputs of ``model`` with sample ``n`` using ``batched_params[k][n]``."""
    buffers = dict(model.named_buffers())
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}

    def one(p, x):
        x1 = tuple(t.unsqueeze(0) for t in x) if isinstance(x, tuple) else x.unsqueeze(0)
        args = x1 if isinstance(x1, tuple) else (x1,)
        out = functional_call(model, {**p, **frozen, **buffers}, args)
        return out.squeeze(0)

    return vmap(one, in_dims=(0, 0), randomness="same")(batched_params, X)


def per_sample_grads(
    model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], X, y
) -> dict[str, Tensor]:
    """``{name: [N, *p]}`` with ``Σₙ = ∇L``, following the loss's own reduction."""
    n = (X[0] if isinstance(X, tuple) else X).shape[0]
    params = {
        k: v.unsqueeze(0).expand(n, *v.shape).clone().requires_grad_(True)
        for k, v in trainable(model).items()
    }
    out = _per_sample_forward(model, X, params)
    loss = loss_fn(out, y)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {
        k: (g if g is not None else torch.zeros_like(p)) for (k, p), g in zip(params.items(), grads)
    }


def _flat_batched(model: nn.Module, n: int):
    params = trainable(model)
    names = list(params)
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    flat = torch.cat([params[k].reshape(-1) for k in names])
    return names, shapes, sizes, flat


def ggn_blocks(model: nn.Module, loss_fn, X, y) -> tuple[Tensor, list[str], list[int]]:
    """Dense GGN over per-sample parameter copies: ``[N, N, P, P]`` blocks (``Σₙₘ`` = GGN(θ))."""
    n = (X[0] if isinstance(X, tuple) else X).shape[0]
    names, shapes, sizes, flat = _flat_batched(model, n)

    def outputs(theta_b: Tensor) -> Tensor:  # theta_b [N, P]
        parts = torch.split(theta_b, sizes, dim=1)
        bp = {k: t.reshape(n, *s) for k, t, s in zip(names, parts, shapes)}
        return _per_sample_forward(model, X, bp)

    theta_b = flat.unsqueeze(0).expand(n, -1).clone()
    out = outputs(theta_b)
    J = jacrev(outputs)(theta_b).reshape(out.numel(), n, flat.numel())  # [O, N, P]
    H = hessian(lambda o: loss_fn(o, y))(out.detach()).reshape(out.numel(), out.numel())
    G = torch.einsum("oap,oq,qbr->abpr", J, H, J)
    return G, names, sizes


def ggn(model: nn.Module, loss_fn, X, y) -> Tensor:
    """Dense GGN ``[P, P]`` of the mini-batch loss (parameters flattened in model order)."""
    G, _, _ = ggn_blocks(model, loss_fn, X, y)
    return G.sum((0, 1))


def loss_hessian(model: nn.Module, loss_fn, X, y) -> Tensor:
    """Dense Hessian ``[P, P]`` of the mini-batch loss w.r.t. all trainable parameters."""
    names, shapes, sizes, flat = _flat_batched(model, 1)
    buffers = dict(model.named_buffers())

    def L(theta: Tensor) -> Tensor:
        parts = torch.split(theta, sizes)
        p = {k: t.reshape(s) for k, t, s in zip(names, parts, shapes)}
        args = X if isinstance(X, tuple) else (X,)
        return loss_fn(functional_call(model, {**p, **buffers}, args), y)

    return hessian(L)(flat)


def split(vec: Tensor, model: nn.Module, lead: int = 0) -> dict[str, Tensor]:
    """Split a flat ``[..., P]`` tensor into ``{name: [..., *p.shape]}``."""
    params = trainable(model)
    out, i = {}, 0
    for k, v in params.items():
        out[k] = vec[..., i : i + v.numel()].reshape(*vec.shape[:-1], *v.shape)
        i += v.numel()
    return out


def diag_blocks(G: Tensor) -> Tensor:
    """Per-sample diagonals ``[N, P]`` from ``[N, N, P, P]`` blocks."""
    return torch.stack([torch.diagonal(G[i, i]) for i in range(G.shape[0])])


def hist1d_ref(G: np.ndarray, bins: int, lo: float, hi: float) -> np.ndarray:
    """``numpy.histogram`` of ``G`` over ``[lo, hi]``, values outside clipped to the edges."""
    return np.histogram(np.clip(G, lo, hi), bins=bins, range=(lo, hi))[0]


def hist2d_ref(G: np.ndarray, theta: np.ndarray, bins, rng) -> np.ndarray:
    """``numpy.histogram2d`` of (gradient element, parameter value), both clipped to the
    centres of their outermost bins (Cockpit's GradHist2d)."""
    (xlo, xhi), (ylo, yhi) = rng
    xw, yw = (xhi - xlo) / bins[0], (yhi - ylo) / bins[1]
    x = np.clip(G, xlo + xw / 2, xhi - xw / 2).reshape(-1)
    y = np.clip(np.broadcast_to(theta, G.shape), ylo + yw / 2, yhi - yw / 2).reshape(-1)
    return np.histogram2d(x, y, bins=bins, range=rng)[0]


def per_sample_grads_multi(
    model: nn.Module, loss_of_outputs: Callable[..., Tensor], inputs: list
) -> dict[str, Tensor]:
    """``{name: [N, *p]}`` for a loss of several forward passes of ``model`` on batches of the
    same size ``N``: sample ``n`` of every batch uses the same parameter copy ``θₙ`` (a sample
    index is one sample however often the model sees it), so the result is ``∂L/∂θₙ`` with
    ``L = loss_of_outputs(*outputs)``."""
    first = inputs[0]
    n = (first[0] if isinstance(first, tuple) else first).shape[0]
    params = {
        k: v.unsqueeze(0).expand(n, *v.shape).clone().requires_grad_(True)
        for k, v in trainable(model).items()
    }
    outs = [_per_sample_forward(model, X, params) for X in inputs]
    loss = loss_of_outputs(*outs)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {
        k: (g if g is not None else torch.zeros_like(p)) for (k, p), g in zip(params.items(), grads)
    }


def per_sample_grads_rows(model: nn.Module, X: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Per-sample gradients of the mean cross-entropy as the gradients of the rows of one batch
    forward's loss (``ℓₙ/N``), for models whose run on one sample alone differs, in plain
    PyTorch, from that sample's row in the batch (Hugging Face's and timm's LeViT)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows = nn.functional.cross_entropy(model(X), y, reduction="none") / len(y)
    grads = [torch.autograd.grad(r, list(params.values()), retain_graph=True) for r in rows]
    return {k: torch.stack([g[i] for g in grads]) for i, k in enumerate(params)}


def per_sample_grads_loop(
    model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], X, y
) -> dict[str, Tensor]:
    """Same definition as :func:`per_sample_grads` (``∂L/∂θₙ`` with one parameter copy per
    sample) evaluated by a Python loop over samples, for modules ``vmap`` cannot run (RNNs,
    EmbeddingBag). Inputs are sliced along axis 0; the outputs are concatenated along axis 0."""
    xs = X if isinstance(X, tuple) else (X,)
    n = xs[0].shape[0]
    params = trainable(model)
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    buffers = dict(model.named_buffers())
    copies = [{k: v.clone().requires_grad_(True) for k, v in params.items()} for _ in range(n)]
    outs = [
        functional_call(model, {**c, **frozen, **buffers}, tuple(x[i : i + 1] for x in xs))
        for i, c in enumerate(copies)
    ]
    loss = loss_fn(torch.cat(outs), y)
    leaves = [c[k] for c in copies for k in params]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]
    k = len(params)
    return {
        name: torch.stack([grads[i * k + j] for i in range(n)]) for j, name in enumerate(params)
    }


def diag_ggn(model: nn.Module, loss_fn, X, y) -> dict[str, Tensor]:
    """``{name: p-shaped}`` diagonal of the dense GGN :func:`ggn`."""
    return split(torch.diagonal(ggn(model, loss_fn, X, y)), model)


def param_blocks(model: nn.Module, M: Tensor) -> dict[str, Tensor]:
    """``{name: [p, p]}`` diagonal blocks of a dense ``[P, P]`` matrix (model order)."""
    out, i = {}, 0
    for k, v in trainable(model).items():
        out[k] = M[i : i + v.numel(), i : i + v.numel()]
        i += v.numel()
    return out


def ggn_blocks_loop(model: nn.Module, lossfunc: nn.Module, X: Any, y: Tensor) -> Tensor:
    """``[N, N, P, P]`` GGN blocks without ``vmap`` (``padding_idx`` breaks its batching rule):
    ``G[n, n] = Jₙᵀ (∂²L/∂fₙ²) Jₙ`` from a looped Jacobian of sample ``n``'s output and the
    Hessian of the *batch* loss w.r.t. that output (other outputs fixed); ``G[n, m≠n] = 0`` for
    the sample-separable losses used here."""
    names = [k for k in trainable(model)]
    shapes = [p.shape for p in trainable(model).values()]
    sizes = [p.numel() for p in trainable(model).values()]
    flat = torch.cat([p.detach().reshape(-1) for p in trainable(model).values()])
    xs = X if isinstance(X, tuple) else (X,)
    n = xs[0].shape[0]
    with torch.no_grad():
        out = model(*xs)
    G = flat.new_zeros(n, n, flat.numel(), flat.numel())
    for i in range(n):

        def f(theta: Tensor, i: int = i) -> Tensor:
            p = {k: t.reshape(s) for k, t, s in zip(names, torch.split(theta, sizes), shapes)}
            return functional_call(model, p, tuple(x[i : i + 1] for x in xs))[0]

        def loss_i(o: Tensor, i: int = i) -> Tensor:
            return lossfunc(torch.cat([out[:i], o[None], out[i + 1 :]]), y)

        J = jacobian(f, flat).reshape(-1, flat.numel())  # looped, no vmap
        H = hessian(loss_i)(out[i]).reshape(J.shape[0], J.shape[0])
        G[i, i] = J.T @ H @ J
    return G


def ggn_mean_over_samples(model, lossfunc, X, y, subsampling=None) -> Tensor:
    """GGN of the mean loss over the kept samples: ``(1/N') Σ_{n∈𝒮} N·B[n, n]``."""
    B = ggn_blocks(model, lossfunc, X, y)[0]
    n = B.shape[0]
    idx = list(range(n)) if subsampling is None else subsampling
    return torch.stack([n * B[i, i] for i in idx]).mean(0)


def vjp_per_sample(module: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    """``{name: [M, N, *p]}``: ``vjp`` of the module's forward on sample ``n`` with ``g[m, n]``."""
    params = {k: v.detach() for k, v in module.named_parameters()}

    def one(xn: Tensor, gn: Tensor) -> dict[str, Tensor]:
        def f(p: dict[str, Tensor]) -> Tensor:
            return functional_call(module, p, (xn.unsqueeze(0),)).squeeze(0)

        return vjp(f, params)[1](gn)[0]

    over_columns = vmap(one, in_dims=(None, 0))
    return vmap(over_columns, in_dims=(0, 1), out_dims=1)(x, g)


def _replace_sample(model: nn.Module, x: Tensor, n: int, params: dict[str, Tensor]) -> Tensor:
    """Model outputs of the batch, with sample ``n``'s output computed from ``params``."""
    with torch.no_grad():
        out = model(x)
    out_n = functional_call(model, params, (x[n : n + 1],))
    return torch.cat([out[:n], out_n, out[n + 1 :]])


def per_sample_grads_replacing(model: nn.Module, loss_fn: nn.Module, x: Tensor, y: Tensor):
    """``{name: [N, *p]}``: ``∂L/∂θ`` through sample ``n``'s output only, one sample at a time.

    ``reference.per_sample_grads`` vmaps over per-sample weights, and PyTorch's batching rule of
    ``embedding`` backward with a batched weight masks ``padding_idx`` for the first sample only
    (torch 2.13), so padded embeddings are checked against this loop instead."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    rows = []
    for n in range(x.shape[0]):
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = loss_fn(_replace_sample(model, x, n, p), y)
        rows.append(dict(zip(p, torch.autograd.grad(loss, list(p.values())))))
    return {k: torch.stack([r[k] for r in rows]) for k in params}


def batch_diag_ggn_loop(model: nn.Module, loss_fn: nn.Module, x: Tensor, y: Tensor):
    """``{name: [N, *p]}``: ``diag(Jₙᵀ (∂²L/∂fₙ²) Jₙ)`` from dense Jacobians and Hessians
    (outputs of any shape, flattened)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    rows = []
    with torch.no_grad():
        out = model(x)
    for n in range(x.shape[0]):
        xn, before, after = x[n : n + 1], out[:n], out[n + 1 :]

        def f_n(p: dict[str, Tensor], xn: Tensor = xn) -> Tensor:
            return functional_call(model, p, (xn,))[0]

        def loss_n(o: Tensor, before: Tensor = before, after: Tensor = after) -> Tensor:
            return loss_fn(torch.cat([before, o[None], after]), y)

        jac = jacrev(f_n)(params)
        o = out[n].numel()
        hess = hessian(loss_n)(out[n]).reshape(o, o)
        rows.append(
            {
                k: torch.einsum("c...,cd,d...->...", j.reshape(o, *p.shape), hess,
                                j.reshape(o, *p.shape))
                for (k, j), p in zip(jac.items(), params.values())
            }
        )
    return {k: torch.stack([r[k] for r in rows]) for k in params}
