r"""BackPACK's ``backpack.core.derivatives``: Jacobian and loss-Hessian products of a layer.

BackPACK implements these by hand for every layer type. Here every derivatives class is the
same generic implementation through autograd on the module's own forward (so it is exact for
any module, including ones BackPACK does not know), and parameter Jacobians go through
backprism's layer rules (``param_mjp`` = the rule's ``per_sample``). The class names and
module paths of BackPACK exist (``backpack.core.derivatives.linear.LinearDerivatives``, …,
``crossentropyloss.CrossEntropyLossDerivatives``, ``mseloss.MSELossDerivatives``).

As in BackPACK the methods read the layer's stored input and output, ``module.input0``
(``input1`` for a loss's target) and ``module.output``: the shim's ``extend`` stores them in
every forward pass with gradients, as BackPACK's does (backprism's own ``extend`` does not), a
module extension sees those of its call (see :mod:`backprism.compat.backpack.extensions`), or
set them yourself before calling.

Shapes (``V`` stacked vectors; with ``subsampling`` the batch axis has
``len(subsampling)`` entries):

=================================================  ============================================
``jac_t_mat_prod(m, g_inp, g_out, mat, sub)``      ``[V, *out] → [V, *in]``: ``Jᵀ mat``
``jac_mat_prod(m, g_inp, g_out, mat)``             ``[V, *in] → [V, *out]``: ``J mat``
``param_mjp(name, m, g_inp, g_out, mat,``          ``[V, *out] → [V, N, *p]`` (or ``[V, *p]``
``sum_batch=True, subsampling=None)``              summed over samples)
``weight_jac_t_mat_prod``/``bias_jac_t_mat_prod``  ``param_mjp`` for ``weight``/``bias``
``weight_jac_mat_prod``/``bias_jac_mat_prod``      ``[V, *p] → [V, *out]``
``ea_jac_t_mat_jac_prod(m, g_inp, g_out, mat)``    ``(1/N) Σₙ Jₙᵀ mat Jₙ``, ``[D_in, D_in]``
``sqrt_hessian(m, g_inp, g_out, sub)``             loss: ``[K, N, *out]`` with
                                                   ``Σₖ S[k,n] S[k,n]ᵀ = ∇²ℓ`` (mean: ``1/N``)
``sqrt_hessian_sampled(…, mc_samples=1, sub)``     loss: ``[M, N, *out]`` MC factor
``sum_hessian(m, g_inp, g_out)``                   loss: ``Σₙ ∇²_{fₙ} L``, ``[*f, *f]`` (``f``
                                                   one sample's input shape)
``make_hessian_mat_prod(m, g_inp, g_out)``         loss: ``mat ↦ ∇²_{fₙ} L · mat[v, n]``
=================================================  ============================================

Matrix arguments also take a single vector (``mat`` without the ``V`` axis), as BackPACK's do.

Layers whose forward is not a pure function of ``input0`` are differentiated as BackPACK
differentiates them:

* BatchNorm in train mode (or without running statistics) normalises with the statistics of the
  current batch, ``y = γ (x − μ_B)/√(σ²_B + ε) + β``: the Jacobian products are those of the
  whole-batch map ``x ↦ y`` (they mix the samples; ``jac_mat_prod`` and ``jac_t_mat_prod`` of
  the full batch); a ``subsampling`` of its input Jacobian is refused (no per-sample meaning,
  BackPACK refuses it too). The parameter Jacobians are per sample, ``∂yₙ/∂γ = x̂ₙ`` and
  ``∂yₙ/∂β = 1`` with ``x̂`` normalised by the whole batch's statistics (then subsampled).
  Nothing is written to the running statistics.
* Dropout in train mode: ``J = diag(mask)/(1 − p)`` with the mask of the stored output
  (``output ≠ 0``, BackPACK's convention), not a fresh draw.
* RNN, LSTM, GRU: the derivatives of the first output (the hidden states of every step) with
  respect to the input, the initial state ``input1`` (if given) held fixed; the batch axis is
  1 for ``batch_first=False``. Fused kernels (oneDNN, cuDNN) are switched off while
  differentiating, as they lack forward-mode and double-backward support.

Loss modules need a scalar output: ``reduction="mean"`` or ``"sum"``, or ``"none"`` on a single
loss element (then it equals ``"sum"``); otherwise a ``ValueError``, as in BackPACK.

Monte-Carlo factors. By default (``use_autograd=False``, BackPACK's default for the cross-entropy,
MSE and BCE-with-logits classes) ``sqrt_hessian_sampled`` draws as BackPACK 1.7's manual path
does, with one call on torch's global RNG (the engine's BackPACK draw, see
:mod:`backprism.engine.loss_hessian`), for the subsampled rows only (so a seeded script gets
BackPACK's numbers, ``subsampling`` included; the mean's ``1/√Z`` is that of the whole batch).
Losses BackPACK does not sample (``NLLLoss``, ``GaussianNLLLoss``, weighted BCE) draw for the
whole batch and keep the requested rows. With ``use_autograd=True`` (:class:`NLLLossDerivatives`)
it is BackPACK's autograd path: ``M`` calls ``dist.sample()`` on ``_make_distribution`` of the
subsampled input and the gradients of ``−log p(yₘ | f)``, divided by ``√M`` (and by ``√Z`` for
a mean, ``Z`` = ``_get_mean_normalization(input0)``).

``weight_jac_t_save_memory`` (``derivatives.convnd``) is accepted as a no-op context: backprism
picks its convolution algorithms itself and bounds memory with ``collect(memory_budget=…)``.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Binomial, Categorical, Distribution, Normal
from torch.func import functional_call, jvp, vmap
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten, tree_map

from backprism.compat._modules import alias_module
from backprism.compat.backpack.custom_module import (
    Pad,
    Permute,
    ScaleModule,
    Slicing,
    SumModule,
)
from backprism.engine.loss_hessian import backpack_mc_key, loss_hessian_sqrt
from backprism.engine.rule import Call, get_rule
from backprism.engine.state import suspended

__all__ = [
    "BaseDerivatives",
    "BaseLossDerivatives",
    "BaseParameterDerivatives",
    "NLLLossDerivatives",
]

__path__: list[str] = []

_BatchNorm = nn.modules.batchnorm._BatchNorm
_DropoutNd = nn.modules.dropout._DropoutNd

#: modules whose output is linear (or piecewise linear) in the input: zero input Hessian
_LINEAR_OPS = (
    nn.Linear,
    nn.Bilinear,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    _DropoutNd,
    nn.ZeroPad2d,
    nn.Embedding,
    nn.ReLU,
    nn.LeakyReLU,
    nn.Hardtanh,
    nn.modules.conv._ConvNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.padding._ConstantPadNd,
    nn.modules.padding._ReflectionPadNd,
    nn.modules.padding._ReplicationPadNd,
    nn.modules.padding._CircularPadNd,
    Pad,
    Permute,
    ScaleModule,
    Slicing,
    SumModule,
)
#: elementwise activations ``σ`` with a nonzero ``σ''``
_ELEMENTWISE = (
    nn.Sigmoid,
    nn.Tanh,
    nn.ELU,
    nn.SELU,
    nn.LogSigmoid,
    nn.GELU,
    nn.SiLU,
    nn.Softplus,
)


def _stored(module: nn.Module, name: str) -> Any:
    value = module.__dict__.get(name)
    if value is None:
        raise AttributeError(
            f"backprism.compat derivatives: {type(module).__name__}.{name} is not set: run a "
            "forward pass with gradients through a module extended with "
            "backprism.compat.backpack.extend (outside disable()), or set module.input0 "
            "(input1 for a loss target) and module.output yourself"
        )
    return value


def _subsample(t: Tensor, subsampling: Sequence[int] | None, dim: int = 0) -> Tensor:
    if subsampling is None:
        return t
    idx = torch.as_tensor(list(subsampling), dtype=torch.long, device=t.device)
    return t.index_select(dim, idx)


def _batch_axis(module: nn.Module) -> int:
    """Axis of ``input0`` and ``output`` holding the batch (1 for ``batch_first=False`` RNNs)."""
    return 1 if isinstance(module, nn.RNNBase) and not module.batch_first else 0


def _mixes_samples(module: nn.Module) -> bool:
    """Whether the forward normalises with the current batch's statistics (BatchNorm in train
    mode, or without running statistics), so that every output depends on every sample."""
    return isinstance(module, _BatchNorm) and (
        module.training or (module.running_mean is None and module.running_var is None)
    )


def _output_tensor(module: nn.Module) -> Tensor:
    """The stored output, or its first tensor for modules returning tuples (RNN, LSTM)."""
    out = _stored(module, "output")
    if isinstance(out, Tensor):
        return out
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
    if not leaves:
        raise TypeError(f"backprism.compat derivatives: {type(module).__name__} has no output")
    return leaves[0]


def _input(module: nn.Module, subsampling: Sequence[int] | None = None) -> Tensor:
    """``input0`` (its ``subsampling`` rows along the batch axis), detached."""
    x = _stored(module, "input0")
    if not isinstance(x, Tensor):
        raise NotImplementedError(
            f"backprism.compat derivatives: {type(module).__name__}.input0 is a "
            f"{type(x).__name__}; only tensor inputs are supported (pad sequences instead of "
            "packing them)"
        )
    return _subsample(x, subsampling, _batch_axis(module)).detach()


def _diff_input(module: nn.Module, subsampling: Sequence[int] | None = None) -> Tensor:
    """:func:`_input` requiring grad (refused for integer inputs, e.g. Embedding's indices)."""
    x = _input(module, subsampling)
    if not (x.is_floating_point() or x.is_complex()):
        raise NotImplementedError(
            f"backprism.compat derivatives: {type(module).__name__}'s input has dtype {x.dtype}; "
            "there is no derivative with respect to it"
        )
    return x.requires_grad_(True)


def _own_params(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach() for n, p in module.named_parameters(recurse=False)}


@contextmanager
def _plain_rnn_kernels() -> Iterator[None]:
    """Switch off oneDNN and cuDNN RNN kernels (no forward-mode AD, no double backward)."""
    mkldnn, cudnn = torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled
    torch.backends.mkldnn.enabled = False
    torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = mkldnn
        torch.backends.cudnn.enabled = cudnn


ModuleFn = Callable[..., Tensor]


def _module_function(module: nn.Module, subsampling: Sequence[int] | None = None) -> ModuleFn:
    """``f(x, params=None)``: the module's output as a pure function of its input ``x``
    (``input0``, subsampled by ``subsampling``) and, optionally, replaced own parameters.

    No side effects and no fresh randomness: BatchNorm does not update its running statistics
    (``F.batch_norm`` with the batch's statistics in train mode, the running ones in eval
    mode), Dropout in train mode reuses the stored output's mask, RNNs give their first output
    (with the stored initial state ``input1``, if any, held fixed)."""
    name = type(module).__name__

    def merged(params: dict[str, Tensor] | None) -> dict[str, Tensor]:
        own = _own_params(module)
        return own if params is None else {**own, **params}

    if isinstance(module, _BatchNorm):
        batch_stats = _mixes_samples(module)

        def batch_norm(x: Tensor, params: dict[str, Tensor] | None = None) -> Tensor:
            p = merged(params)
            mean, var = (None, None) if batch_stats else (module.running_mean, module.running_var)
            return F.batch_norm(
                x, mean, var, p.get("weight"), p.get("bias"), batch_stats, 0.0, module.eps
            )

        return batch_norm

    if isinstance(module, _DropoutNd) and module.training and module.p > 0:
        if isinstance(module, (nn.AlphaDropout, nn.FeatureAlphaDropout)):
            raise NotImplementedError(
                f"backprism.compat derivatives: {name} in train mode: its mask cannot be read "
                "from the stored output; call module.eval()"
            )
        out = _subsample(_stored(module, "output"), subsampling).detach()
        scale = 0.0 if module.p >= 1 else 1.0 / (1.0 - module.p)
        mask = (out != 0).to(out.dtype) * scale

        def dropout(x: Tensor, params: dict[str, Tensor] | None = None) -> Tensor:
            return x * mask.to(x.dtype)

        return dropout

    if isinstance(module, nn.RReLU) and module.training:
        raise NotImplementedError(
            f"backprism.compat derivatives: {name} in train mode draws random slopes; call "
            "module.eval()"
        )

    if isinstance(module, nn.RNNBase):
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise NotImplementedError(
                f"backprism.compat derivatives: {name} applies dropout between its layers in "
                "train mode; call module.eval() or use dropout=0"
            )
        hx = module.__dict__.get("input1")
        extra: tuple[Any, ...] = ()
        if hx is not None:
            extra = (tree_map(lambda h: _subsample(h, subsampling, 1).detach(), hx),)

        def rnn(x: Tensor, params: dict[str, Tensor] | None = None) -> Tensor:
            with suspended(), _plain_rnn_kernels():
                out = functional_call(module, merged(params), (x, *extra))
            return out[0]

        return rnn

    def forward(x: Tensor, params: dict[str, Tensor] | None = None) -> Tensor:
        with suspended():
            out = module(x) if params is None else functional_call(module, merged(params), (x,))
        if not isinstance(out, Tensor):
            raise NotImplementedError(
                f"backprism.compat derivatives: {name} returns {type(out).__name__}; only "
                "single-tensor outputs are supported"
            )
        return out

    return forward


def _accept_vectors(mat: Tensor, like_dim: int) -> tuple[Tensor, bool]:
    """``mat`` with a leading ``V`` axis, and whether one was added (a single vector)."""
    if mat.dim() == like_dim:
        return mat.unsqueeze(0), True
    return mat, False


class BaseDerivatives:
    """Derivatives of ``module.output`` w.r.t. ``module.input0`` through autograd."""

    def jac_t_mat_prod(
        self,
        module: nn.Module,
        g_inp: Any,
        g_out: Any,
        mat: Tensor,
        subsampling: Sequence[int] | None = None,
    ) -> Tensor:
        """``res[v] = Jᵀ mat[v]``, ``[V, *out] → [V, *in]``; with ``subsampling`` the rows of
        those samples (``(∂outₙ/∂inₙ)ᵀ mat[v, n]`` per requested ``n``).

        Raises:
            NotImplementedError: ``subsampling`` for BatchNorm normalising with the batch's
                statistics (its samples are not independent).
        """
        if subsampling is not None and _mixes_samples(module):
            raise NotImplementedError(
                f"backprism.compat derivatives: {type(module).__name__} in train mode mixes the "
                "samples of a batch, so its input VJP has no per-sample sub-sampling"
            )
        x = _diff_input(module, subsampling)
        f = _module_function(module, subsampling)
        with torch.enable_grad():
            out = f(x)
            m, vector = _accept_vectors(mat, out.dim())
            res = None
            if out.requires_grad:
                (res,) = torch.autograd.grad(
                    out, x, grad_outputs=m.to(out.dtype), is_grads_batched=True,
                    allow_unused=True,
                )
        if res is None:
            res = torch.zeros(m.shape[0], *x.shape, dtype=x.dtype, device=x.device)
        return res[0] if vector else res

    def jac_mat_prod(self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor) -> Tensor:
        """``res[v] = J mat[v]``, ``[V, *in] → [V, *out]`` (of the whole batch)."""
        x = _diff_input(module).detach()
        f = _module_function(module)
        m, vector = _accept_vectors(mat, x.dim())

        def push(v: Tensor) -> Tensor:
            return jvp(lambda z: f(z), (x,), (v.to(x.dtype),))[1]

        res = vmap(push)(m)
        return res[0] if vector else res

    def ea_jac_t_mat_jac_prod(
        self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor
    ) -> Tensor:
        """``(1/N) Σₙ Jₙᵀ mat Jₙ`` with ``Jₙ = ∂outₙ/∂inₙ`` (flattened per sample),
        ``[D_out, D_out] → [D_in, D_in]`` (KFRA)."""
        if _mixes_samples(module) or _batch_axis(module) != 0:
            raise NotImplementedError(
                f"backprism.compat derivatives: ea_jac_t_mat_jac_prod needs per-sample "
                f"Jacobians on batch axis 0; {type(module).__name__} does not have them here"
            )
        x = _input(module)
        n = x.shape[0]
        d_in = x[0].numel()
        eye = torch.eye(d_in, dtype=x.dtype, device=x.device)
        # J_n columns: J mat for the unit vectors of one sample's input, all samples at once
        basis = eye.reshape(d_in, 1, *x.shape[1:]).expand(d_in, n, *x.shape[1:])
        jac = self.jac_mat_prod(module, g_inp, g_out, basis)  # [D_in, N, *out]
        jac = jac.reshape(d_in, n, -1)  # [i, n, k] = ∂out[n, k] / ∂in[n, i]
        return torch.einsum("ink,kl,jnl->ij", jac, mat.to(jac.dtype), jac) / n

    def hessian_is_zero(self, module: nn.Module) -> bool:
        """Whether ``∂²out[i]/∂in[j]∂in[k] = 0`` for all inputs (piecewise-linear layers count as
        linear, as in BackPACK). BatchNorm: only with fixed (running) statistics."""
        if isinstance(module, _BatchNorm):
            return not _mixes_samples(module)
        if isinstance(module, nn.RNNBase):
            return False
        if isinstance(module, _LINEAR_OPS):
            return True
        if isinstance(module, _ELEMENTWISE):
            return False
        raise NotImplementedError(
            f"backprism.compat derivatives: unknown whether {type(module).__name__} is linear"
        )

    def hessian_is_diagonal(self, module: nn.Module) -> bool:
        return isinstance(module, _ELEMENTWISE)

    def hessian_diagonal(self, module: nn.Module, g_in: Any, g_out: Any) -> Tensor:
        """``σ''(input) ⊙ g_out[0]`` for an elementwise ``σ`` (BackPACK's residual diagonal)."""
        if not self.hessian_is_diagonal(module):
            raise NotImplementedError(f"{type(module).__name__} has no diagonal Hessian")
        return self.d2f(module, g_in, g_out) * g_out[0]

    def df(self, module: nn.Module, g_inp: Any, g_out: Any, subsampling: Any = None) -> Tensor:
        """``σ'(input)`` of an elementwise module."""
        x = _diff_input(module, subsampling)
        f = _module_function(module, subsampling)
        with torch.enable_grad():
            (d,) = torch.autograd.grad(f(x).sum(), x)
        return d

    def d2f(self, module: nn.Module, g_inp: Any, g_out: Any) -> Tensor:
        """``σ''(input)`` of an elementwise module."""
        x = _diff_input(module)
        f = _module_function(module)
        with torch.enable_grad():
            (d,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
            if not d.requires_grad:
                return torch.zeros_like(x)
            (d2,) = torch.autograd.grad(d.sum(), x)
        return d2

    def hessian_is_psd(self) -> bool:
        raise NotImplementedError("only loss derivatives know whether their Hessian is PSD")

    @classmethod
    def reshape_like_input(
        cls, mat: Tensor, module: nn.Module, subsampling: Sequence[int] | None = None
    ) -> Tensor:
        x = _stored(module, "input0")
        shape = list(x.shape)
        if subsampling is not None:
            shape[_batch_axis(module)] = len(subsampling)
        return mat.reshape(-1, *shape)

    @classmethod
    def reshape_like_output(cls, mat: Tensor, module: nn.Module) -> Tensor:
        return mat.reshape(-1, *_output_tensor(module).shape)


class BaseParameterDerivatives(BaseDerivatives):
    """Adds Jacobians w.r.t. the module's parameters, through backprism's layer rules."""

    def param_mjp(
        self,
        param_str: str,
        module: nn.Module,
        g_inp: Any,
        g_out: Any,
        mat: Tensor,
        sum_batch: bool = True,
        subsampling: Sequence[int] | None = None,
    ) -> Tensor:
        """Per-sample ``Vₙ = (∂outₙ/∂θ)ᵀ mat[v, n]``: ``[V, *out] → [V, N, *θ]`` (``[V, *θ]``
        with ``sum_batch``), ``N`` the subsampled batch. The scaling is that of ``mat``."""
        params = _own_params(module)
        if param_str not in params:
            raise AttributeError(f"{type(module).__name__} has no parameter {param_str!r}")
        dtype = params[param_str].dtype
        g, vector = _accept_vectors(mat, _output_tensor(module).dim())
        g = g.to(dtype)
        if isinstance(module, _BatchNorm):
            res = _batch_norm_param_mjp(module, param_str, g, subsampling)
        else:
            res = _rule_param_mjp(module, param_str, g, subsampling)
        if sum_batch:
            res = res.sum(1)
        return res[0] if vector else res

    def weight_jac_t_mat_prod(
        self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor, sum_batch: bool = True,
        subsampling: Sequence[int] | None = None,
    ) -> Tensor:
        return self.param_mjp("weight", module, g_inp, g_out, mat, sum_batch, subsampling)

    def bias_jac_t_mat_prod(
        self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor, sum_batch: bool = True,
        subsampling: Sequence[int] | None = None,
    ) -> Tensor:
        return self.param_mjp("bias", module, g_inp, g_out, mat, sum_batch, subsampling)

    def _param_jac_mat_prod(self, name: str, module: nn.Module, mat: Tensor) -> Tensor:
        """``res[v] = (∂out/∂θ) mat[v]``, ``[V, *θ] → [V, *out]`` (of the whole batch)."""
        x = _input(module)
        params = _own_params(module)
        if name not in params:
            raise AttributeError(f"{type(module).__name__} has no parameter {name!r}")
        f = _module_function(module)
        m, vector = _accept_vectors(mat, params[name].dim())

        def push(v: Tensor) -> Tensor:
            return jvp(lambda p: f(x, {name: p}), (params[name],), (v.to(params[name].dtype),))[1]

        res = vmap(push)(m)
        return res[0] if vector else res

    def weight_jac_mat_prod(self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor) -> Tensor:
        return self._param_jac_mat_prod("weight", module, mat)

    def bias_jac_mat_prod(self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor) -> Tensor:
        return self._param_jac_mat_prod("bias", module, mat)


def _batch_norm_param_mjp(
    module: nn.Module, name: str, g: Tensor, subsampling: Sequence[int] | None
) -> Tensor:
    r"""BatchNorm's per-sample parameter VJPs, ``[V, N, C]``: ``y = γ x̂ + β`` per channel, so
    ``Σ_s g[v, n, c, s] x̂[n, c, s]`` (``γ``) and ``Σ_s g[v, n, c, s]`` (``β``), ``s`` the
    spatial positions. ``x̂`` is normalised with the statistics the forward used (the whole
    batch's in train mode, the running ones in eval mode), then subsampled."""
    spatial = tuple(range(3, g.dim()))
    if name == "bias":
        return g.sum(spatial) if spatial else g
    x = _input(module).to(g.dtype)
    batch_stats = _mixes_samples(module)
    mean, var = (None, None) if batch_stats else (module.running_mean, module.running_var)
    x_hat = F.batch_norm(x, mean, var, None, None, batch_stats, 0.0, module.eps)
    x_hat = _subsample(x_hat, subsampling)
    prod = g * x_hat
    return prod.sum(spatial) if spatial else prod


def _rule_param_mjp(
    module: nn.Module, name: str, g: Tensor, subsampling: Sequence[int] | None
) -> Tensor:
    """``[V, N, *θ]`` from backprism's layer rule (``per_sample``) on the subsampled input;
    extra outputs of multi-output modules (an RNN's final states) get zero columns."""
    x = _input(module, subsampling)
    args: tuple[Any, ...] = (x,)
    out_shapes = [torch.Size(g.shape[1:])]
    cols: Any = g
    if isinstance(module, nn.RNNBase):
        hx = module.__dict__.get("input1")
        if hx is not None:
            args = (x, tree_map(lambda h: _subsample(h, subsampling, 1).detach(), hx))
        with torch.no_grad(), suspended():
            out = module(*args)
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        out_shapes = [t.shape for t in leaves]
        cols = (g, *(g.new_zeros(g.shape[0], *t.shape) for t in leaves[1:]))
    call = Call(
        module=module,
        args=args,
        kwargs={},
        out_shapes=out_shapes,
        batch_size=x.shape[_batch_axis(module)],
        training=module.training,
        params=dict(module.named_parameters(recurse=False)),
    )
    return get_rule(module).per_sample(call, cols)[name]  # [V, N, *p]


class BaseLossDerivatives(BaseDerivatives):
    """Loss-Hessian factorisations (``module.input0`` the prediction, ``input1`` the target)
    from backprism's :func:`~backprism.engine.loss_hessian.loss_hessian_sqrt`."""

    def _check_2nd_order_make_sense(self, module: nn.Module, g_out: Any) -> None:
        """BackPACK's checks: a scalar loss (``ValueError`` otherwise), and a warning if the
        gradient reaching the loss output is not 1 (the loss was modified after the module)."""
        if getattr(module, "reduction", "mean") not in ("mean", "sum"):
            out = _stored(module, "output")
            if not isinstance(out, Tensor) or out.numel() != 1:
                shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(
                    f"Output must be scalar. Got {shape}: second-order quantities need "
                    "reduction='mean' or 'sum' (or 'none' on a single loss element)"
                )
        try:
            first = g_out[0] if isinstance(g_out, (tuple, list)) and len(g_out) else None
        except RuntimeError:  # gradients withheld from a second-order module extension
            first = None
        if isinstance(first, Tensor) and not bool((first == 1.0).all()):
            warnings.warn(
                f"The output of {module} seems to have been modified. Backpack might give wrong "
                "second-order information. Make sure you call backward() on the output of a "
                "loss function module from torch.nn",
                UserWarning,
                stacklevel=3,
            )

    def _columns(
        self,
        module: nn.Module,
        key: tuple,
        g_out: Any = None,
        subsampling: Sequence[int] | None = None,
    ) -> Tensor:
        """``[K, N, *f]`` loss-Hessian columns (``key`` as for
        :func:`~backprism.engine.loss_hessian.loss_hessian_sqrt`) of the whole batch, then the
        ``subsampling`` rows.

        BackPACK draws Monte-Carlo columns for the subsampled input only; for the losses it
        samples (cross-entropy, MSE, BCE-with-logits without ``pos_weight``) so does this, with
        the mean's denominator ``Z`` of the whole batch: columns of the ``'sum'`` loss on the
        subsampled rows divided by ``√Z``."""
        self._check_2nd_order_make_sense(module, g_out)
        f = _stored(module, "input0")
        rest: list[Any] = []
        while f"input{len(rest) + 1}" in module.__dict__:
            t = module.__dict__[f"input{len(rest) + 1}"]
            rest.append(t.detach() if isinstance(t, Tensor) else t)
        reduction = getattr(module, "reduction", "mean")
        scale = 1.0
        rows = rest[0] if rest and isinstance(rest[0], Tensor) and rest[0].dim() > 0 else None
        if key[0] == "mc" and subsampling is not None and rows is not None and (
            rows.shape[0] == f.shape[0]
        ):
            z = _mean_denominator(module, f, rows)
            if z is not None:
                f, rest[0] = (_subsample(t, subsampling) for t in (f, rest[0]))
                subsampling = None
                scale = 1.0 / math.sqrt(z) if reduction == "mean" and z > 0 else 1.0
                reduction = "sum"
        if reduction not in ("mean", "sum"):
            reduction = "sum"  # a single loss element: 'none' is 'sum'
        if reduction != getattr(module, "reduction", "mean"):
            module = copy.copy(module)
            module.reduction = reduction
        inputs = [f.detach().requires_grad_(f.is_floating_point()), *rest]
        cols = loss_hessian_sqrt(module, inputs, key, f.shape[0]).materialize()[0]
        cols = _subsample(cols, subsampling, dim=1)
        return cols * scale if scale != 1.0 else cols

    def sqrt_hessian(
        self, module: nn.Module, g_inp: Any, g_out: Any, subsampling: Sequence[int] | None = None
    ) -> Tensor:
        """``[K, N, *f]`` with ``Σₖ S[k, n] S[k, n]ᵀ = ∇²_{fₙ} L`` exactly (``L`` as reduced:
        a mean divides by its number of terms); cross-entropy with spatial axes ``[C, d…]``
        has ``K = C·d…`` columns, column ``c·D + d`` nonzero at position ``d`` only."""
        return self._columns(module, ("exact",), g_out, subsampling)

    def sqrt_hessian_sampled(
        self,
        module: nn.Module,
        g_inp: Any,
        g_out: Any,
        mc_samples: int = 1,
        subsampling: Sequence[int] | None = None,
    ) -> Tensor:
        """``[M, N, *f]``: ``M`` sampled gradients ``/√M`` drawn as BackPACK 1.7 draws them
        (one call on torch's global RNG for the (subsampled) mini-batch, see
        :mod:`backprism.engine.loss_hessian`), ``E[Σₘ S[m, n] S[m, n]ᵀ] = ∇²_{fₙ} L``."""
        return self._columns(module, backpack_mc_key(mc_samples), g_out, subsampling)

    def sum_hessian(self, module: nn.Module, g_inp: Any, g_out: Any) -> Tensor:
        """``Σₙ ∇²_{fₙ} L``, ``[*f, *f]`` with ``f`` one sample's input shape (``[C, C]`` for
        ``[N, C]``)."""
        s = self._columns(module, ("exact",), g_out)
        feature = s.shape[2:]
        s = s.reshape(s.shape[0], s.shape[1], -1)
        return torch.einsum("kni,knj->ij", s, s).reshape(*feature, *feature)

    def make_hessian_mat_prod(
        self, module: nn.Module, g_inp: Any, g_out: Any
    ) -> Callable[[Tensor], Tensor]:
        """``mat ↦ res`` with ``res[v, n] = ∇²_{fₙ} L · mat[v, n]``, ``[V, N, *f]`` (or one
        ``[N, *f]`` vector)."""
        s = self._columns(module, ("exact",), g_out)  # [K, N, *f]
        sf = s.reshape(s.shape[0], s.shape[1], -1)

        def hessian_mat_prod(mat: Tensor) -> Tensor:
            """``[V, N, *f] → [V, N, *f]``: the per-sample loss Hessian times ``mat``."""
            m, vector = _accept_vectors(mat, s.dim() - 1)
            mf = m.reshape(m.shape[0], m.shape[1], -1).to(sf.dtype)
            coef = torch.einsum("kni,vni->vkn", sf, mf)
            res = torch.einsum("vkn,kni->vni", coef, sf).reshape(m.shape)
            return res[0] if vector else res

        return hessian_mat_prod

    def hessian_is_psd(self) -> bool:
        return True


def _mean_denominator(module: nn.Module, f: Tensor, target: Any) -> float | None:
    """``Z`` of ``reduction='mean'`` (``L = Σ ℓ / Z``) over the whole batch, as PyTorch and
    :mod:`backprism.engine.loss_hessian` define it, for the losses BackPACK samples; ``None``
    for others. Cross-entropy: ``Σ w_y`` over the non-ignored class-index targets (their
    number without ``weight``), ``N·d…`` for probability targets; MSE: the broadcast number of
    entries; BCE-with-logits: the number of entries."""
    if not isinstance(target, Tensor):
        return None
    if isinstance(module, nn.CrossEntropyLoss) and f.dim() >= 2:
        if target.is_floating_point():
            return float(f.numel() // f.shape[1])
        keep = target != module.ignore_index
        if module.weight is None:
            return float(keep.sum())
        w = module.weight.to(f.dtype)[torch.where(keep, target, torch.zeros_like(target))]
        return float((w * keep).sum())
    if isinstance(module, nn.MSELoss):
        return float(math.prod(torch.broadcast_shapes(f.shape, target.shape)))
    if isinstance(module, nn.BCEWithLogitsLoss) and module.pos_weight is None and (
        module.weight is None
    ):
        return float(f.numel())
    return None


class NLLLossDerivatives(BaseLossDerivatives):
    r"""Losses that are a negative log-likelihood, ``ℓ(fₙ, yₙ) = −log p(yₙ | fₙ)`` (BackPACK's
    ``nll_base``).

    ``use_autograd=True`` makes :meth:`sqrt_hessian_sampled` take BackPACK's autograd path:
    ``M`` calls ``dist.sample()`` on ``dist = _make_distribution(f_sub)`` (``f_sub`` the
    subsampled input), column ``m`` = ``∇_f[−log p(yₘ | f)]/√M`` (``/√Z`` more for a mean,
    ``Z = _get_mean_normalization(input0)``), so ``E[Σₘ S Sᵀ] = E_y[∇ℓ ∇ℓᵀ]`` = the Fisher =
    the loss Hessian for these likelihoods. It needs the likelihood to be the loss itself
    (default ``weight``, ``pos_weight``, class-index targets none ignored), else
    ``NotImplementedError``. ``False`` uses the engine's BackPACK draw (module docstring)."""

    #: the loss module type whose likelihood :meth:`_make_distribution` builds
    _loss_type: type[nn.Module] | None = None

    def __init__(self, use_autograd: bool = True) -> None:
        self.use_autograd = use_autograd

    def sqrt_hessian_sampled(
        self,
        module: nn.Module,
        g_inp: Any,
        g_out: Any,
        mc_samples: int = 1,
        subsampling: Sequence[int] | None = None,
    ) -> Tensor:
        if not self.use_autograd:
            return super().sqrt_hessian_sampled(module, g_inp, g_out, mc_samples, subsampling)
        self._check_2nd_order_make_sense(module, g_out)
        self._verify_support(module)
        x_full = _input(module)
        x = _subsample(x_full, subsampling)
        dist = self._make_distribution(x)
        ys = torch.stack([dist.sample() for _ in range(mc_samples)])  # BackPACK's M calls
        # ∇_f −log p(yₘ | f) for all m at once: the likelihood factorises over the rows, so the
        # rows of the input repeated M times get one gradient each
        n = x.shape[0]
        with torch.enable_grad():
            xr = x.unsqueeze(0).expand(mc_samples, *x.shape).reshape(mc_samples * n, *x.shape[1:])
            xr = xr.clone().requires_grad_(True)
            nll = -self._make_distribution(xr).log_prob(ys.flatten(0, 1)).sum()
            (grads,) = torch.autograd.grad(nll, xr)
        cols = grads.reshape(mc_samples, *x.shape) / math.sqrt(mc_samples)
        if module.reduction == "mean":
            cols = cols / math.sqrt(self._get_mean_normalization(x_full))
        return cols

    def _verify_support(self, module: nn.Module) -> None:
        """Refuse modules whose loss is not ``−log p`` of :meth:`_make_distribution`."""
        if self._loss_type is None or not isinstance(module, self._loss_type):
            raise NotImplementedError(
                f"backprism.compat derivatives: {type(self).__name__} has no likelihood for "
                f"{type(module).__name__}; use use_autograd=False"
            )

    def _make_distribution(self, subsampled_input: Tensor) -> Distribution:
        """The likelihood ``p(· | f)`` whose negative log is the loss."""
        raise NotImplementedError(f"{type(self).__name__} defines no likelihood")

    @staticmethod
    def _get_mean_normalization(input: Tensor) -> int:
        """``Z`` in ``L = (1/Z) Σ ℓ`` for ``reduction='mean'``."""
        raise NotImplementedError


class CrossEntropyLossDerivatives(NLLLossDerivatives):
    """BackPACK's CrossEntropyLossDerivatives: ``ℓ = −log softmax(f)_y``, Categorical
    likelihood over the class axis 1."""

    _loss_type = nn.CrossEntropyLoss

    def __init__(self, use_autograd: bool = False) -> None:
        super().__init__(use_autograd=use_autograd)

    def _verify_support(self, module: nn.Module) -> None:
        super()._verify_support(module)
        target = _stored(module, "input1")
        if module.weight is not None or target.is_floating_point() or bool(
            (target == module.ignore_index).any()
        ):
            raise NotImplementedError(
                "backprism.compat derivatives: the Categorical likelihood needs weight=None and "
                "class-index targets none of which is ignore_index; use use_autograd=False"
            )

    def _make_distribution(self, subsampled_input: Tensor) -> Categorical:
        """``Categorical(softmax(f, 1))`` with the classes moved to the last axis (samples
        ``[N, d…]``, the target's shape)."""
        return Categorical(torch.softmax(subsampled_input, dim=1).movedim(1, -1))

    @staticmethod
    def _get_mean_normalization(input: Tensor) -> int:
        """``Z = N·d…`` (all entries but the class axis)."""
        return input.numel() // input.shape[1]


class MSELossDerivatives(NLLLossDerivatives):
    """BackPACK's MSELossDerivatives: ``Σ (f − y)²`` is ``−log N(y | f, ½ I)`` up to a
    constant."""

    _loss_type = nn.MSELoss

    def __init__(self, use_autograd: bool = False) -> None:
        super().__init__(use_autograd=use_autograd)

    def _verify_support(self, module: nn.Module) -> None:
        super()._verify_support(module)
        if _stored(module, "input1").shape != _stored(module, "input0").shape:
            raise NotImplementedError(
                "backprism.compat derivatives: the Normal likelihood needs the target to have "
                "the input's shape; use use_autograd=False"
            )

    def _make_distribution(self, subsampled_input: Tensor) -> Normal:
        """``Normal(f, σ)`` with ``σ = torch.tensor(√½)`` (torch's default dtype, as BackPACK
        builds it)."""
        sd = torch.tensor(math.sqrt(0.5), device=subsampled_input.device)
        return Normal(subsampled_input, sd)

    @staticmethod
    def _get_mean_normalization(input: Tensor) -> int:
        """``Z`` = the number of entries."""
        return input.numel()


class BCELossWithLogitsDerivatives(NLLLossDerivatives):
    """BackPACK's BCELossWithLogitsDerivatives: ``ℓ = −log Bernoulli(y | σ(f))``."""

    _loss_type = nn.BCEWithLogitsLoss

    def __init__(self, use_autograd: bool = False) -> None:
        super().__init__(use_autograd=use_autograd)

    def _verify_support(self, module: nn.Module) -> None:
        super()._verify_support(module)
        if module.weight is not None or module.pos_weight is not None:
            raise NotImplementedError(
                "backprism.compat derivatives: the Binomial likelihood needs weight=None and "
                "pos_weight=None; use use_autograd=False"
            )

    def _make_distribution(self, subsampled_input: Tensor) -> Binomial:
        """``Binomial(probs=σ(f))`` (one trial: Bernoulli labels)."""
        return Binomial(probs=subsampled_input.sigmoid())

    @staticmethod
    def _get_mean_normalization(input: Tensor) -> int:
        """``Z`` = the number of entries (``N`` for BackPACK's ``[N, 1]``)."""
        return input.numel()


class weight_jac_t_save_memory:
    """BackPACK's switch between convolution weight-Jacobian algorithms: accepted, no effect
    (backprism chooses the algorithm and bounds memory with ``collect(memory_budget=…)``)."""

    _SAVE_MEMORY = False

    def __init__(self, save_memory: bool = True) -> None:
        self._new_save_memory = save_memory

    def __enter__(self) -> weight_jac_t_save_memory:
        self._old_save_memory = weight_jac_t_save_memory._SAVE_MEMORY
        weight_jac_t_save_memory._SAVE_MEMORY = self._new_save_memory
        return self

    def __exit__(self, *exc: Any) -> None:
        weight_jac_t_save_memory._SAVE_MEMORY = self._old_save_memory


def _classes(base: type, *names: str) -> dict[str, type]:
    return {n: type(n, (base,), {"__doc__": f"BackPACK's {n} (generic, see module docs)."})
            for n in names}


_P, _D = BaseParameterDerivatives, BaseDerivatives
_FILES: dict[str, dict[str, type]] = {
    "basederivatives": {
        "BaseDerivatives": _D, "BaseParameterDerivatives": _P,
        "BaseLossDerivatives": BaseLossDerivatives,
    },
    "linear": _classes(_P, "LinearDerivatives"),
    "convnd": {**_classes(_P, "ConvNDDerivatives"),
               "weight_jac_t_save_memory": weight_jac_t_save_memory},
    "conv1d": _classes(_P, "Conv1DDerivatives"),
    "conv2d": _classes(_P, "Conv2DDerivatives"),
    "conv3d": _classes(_P, "Conv3DDerivatives"),
    "conv_transposend": _classes(_P, "ConvTransposeNDDerivatives"),
    "conv_transpose1d": _classes(_P, "ConvTranspose1DDerivatives"),
    "conv_transpose2d": _classes(_P, "ConvTranspose2DDerivatives"),
    "conv_transpose3d": _classes(_P, "ConvTranspose3DDerivatives"),
    "batchnorm_nd": _classes(_P, "BatchNormNdDerivatives"),
    "embedding": _classes(_P, "EmbeddingDerivatives"),
    "rnn": _classes(_P, "RNNDerivatives"),
    "lstm": _classes(_P, "LSTMDerivatives"),
    "elementwise": _classes(_D, "ElementwiseDerivatives"),
    "relu": _classes(_D, "ReLUDerivatives"),
    "sigmoid": _classes(_D, "SigmoidDerivatives"),
    "tanh": _classes(_D, "TanhDerivatives"),
    "elu": _classes(_D, "ELUDerivatives"),
    "selu": _classes(_D, "SELUDerivatives"),
    "leakyrelu": _classes(_D, "LeakyReLUDerivatives"),
    "logsigmoid": _classes(_D, "LogSigmoidDerivatives"),
    "dropout": _classes(_D, "DropoutDerivatives"),
    "flatten": _classes(_D, "FlattenDerivatives"),
    "zeropad2d": _classes(_D, "ZeroPad2dDerivatives"),
    "pad": _classes(_D, "PadDerivatives"),
    "permute": _classes(_D, "PermuteDerivatives"),
    "slicing": _classes(_D, "SlicingDerivatives"),
    "scale_module": _classes(_D, "ScaleModuleDerivatives"),
    "sum_module": _classes(_D, "SumModuleDerivatives"),
    "avgpoolnd": _classes(_D, "AvgPoolNDDerivatives"),
    "avgpool1d": _classes(_D, "AvgPool1DDerivatives"),
    "avgpool2d": _classes(_D, "AvgPool2DDerivatives"),
    "avgpool3d": _classes(_D, "AvgPool3DDerivatives"),
    "maxpoolnd": _classes(_D, "MaxPoolNDDerivatives"),
    "maxpool1d": _classes(_D, "MaxPool1DDerivatives"),
    "maxpool2d": _classes(_D, "MaxPool2DDerivatives"),
    "maxpool3d": _classes(_D, "MaxPool3DDerivatives"),
    "adaptive_avg_pool_nd": _classes(
        _D,
        "AdaptiveAvgPoolNDDerivatives",
        "AdaptiveAvgPool1dDerivatives",
        "AdaptiveAvgPool2dDerivatives",
        "AdaptiveAvgPool3dDerivatives",
    ),
    "crossentropyloss": {"CrossEntropyLossDerivatives": CrossEntropyLossDerivatives},
    "mseloss": {"MSELossDerivatives": MSELossDerivatives},
    "bcewithlogitsloss": {"BCELossWithLogitsDerivatives": BCELossWithLogitsDerivatives},
    "nll_base": {"NLLLossDerivatives": NLLLossDerivatives},
}

alias_module(f"{__name__}.derivatives", "BackPACK's core.derivatives (generic autograd).")
for _file, _names in _FILES.items():
    alias_module(f"{__name__}.derivatives.{_file}", f"BackPACK's derivatives.{_file}.", **_names)
    globals().update(_names)
