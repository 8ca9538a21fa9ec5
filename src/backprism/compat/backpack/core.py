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
``sum_hessian(m, g_inp, g_out)``                   loss: ``Σₙ ∇²_{fₙ} L``
``make_hessian_mat_prod(m, g_inp, g_out)``         loss: ``mat ↦ ∇²_{fₙ} L · mat[v, n]``
=================================================  ============================================

``weight_jac_t_save_memory`` (``derivatives.convnd``) is accepted as a no-op context: backprism
picks its convolution algorithms itself and bounds memory with ``collect(memory_budget=…)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jvp, vmap

from backprism.compat._modules import alias_module
from backprism.engine.loss_hessian import backpack_mc_key, loss_hessian_sqrt
from backprism.engine.rule import Call, get_rule
from backprism.engine.state import suspended

__all__ = ["BaseDerivatives", "BaseLossDerivatives", "BaseParameterDerivatives"]

__path__: list[str] = []

_LINEAR_OPS = (
    nn.Linear,
    nn.Bilinear,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    nn.Dropout,
    nn.ZeroPad2d,
    nn.Embedding,
    nn.modules.conv._ConvNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.padding._ConstantPadNd,
)
_ELEMENTWISE = (
    nn.ReLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.ELU,
    nn.SELU,
    nn.LeakyReLU,
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


def _forward(module: nn.Module, x: Tensor) -> Tensor:
    with suspended():
        out = module(x)
    if not isinstance(out, Tensor):
        raise NotImplementedError(
            f"backprism.compat derivatives: {type(module).__name__} returns "
            f"{type(out).__name__}; only single-tensor outputs are supported"
        )
    return out


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
        x = _subsample(_stored(module, "input0"), subsampling).detach().requires_grad_(True)
        with torch.enable_grad():
            out = _forward(module, x)
            (res,) = torch.autograd.grad(
                out, x, grad_outputs=mat.to(out.dtype), is_grads_batched=True, allow_unused=True
            )
        return torch.zeros(mat.shape[0], *x.shape, dtype=x.dtype, device=x.device) if (
            res is None
        ) else res

    def jac_mat_prod(
        self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor
    ) -> Tensor:
        x = _stored(module, "input0").detach()

        def push(v: Tensor) -> Tensor:
            return jvp(lambda z: _forward(module, z), (x,), (v.to(x.dtype),))[1]

        return vmap(push)(mat)

    def ea_jac_t_mat_jac_prod(
        self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor
    ) -> Tensor:
        x = _stored(module, "input0").detach()
        n = x.shape[0]
        d_in = x[0].numel()
        eye = torch.eye(d_in, dtype=x.dtype, device=x.device)
        # J_n columns: J mat for the unit vectors of one sample's input, all samples at once
        basis = eye.reshape(d_in, 1, *x.shape[1:]).expand(d_in, n, *x.shape[1:])
        jac = self.jac_mat_prod(module, g_inp, g_out, basis)  # [D_in, N, *out]
        jac = jac.reshape(d_in, n, -1)  # [i, n, k] = ∂out[n, k] / ∂in[n, i]
        return torch.einsum("ink,kl,jnl->ij", jac, mat.to(jac.dtype), jac) / n

    def hessian_is_zero(self, module: nn.Module) -> bool:
        if isinstance(module, (*_LINEAR_OPS, nn.ReLU)):
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
        x = _subsample(_stored(module, "input0"), subsampling).detach().requires_grad_(True)
        with torch.enable_grad():
            (d,) = torch.autograd.grad(_forward(module, x).sum(), x)
        return d

    def d2f(self, module: nn.Module, g_inp: Any, g_out: Any) -> Tensor:
        """``σ''(input)`` of an elementwise module."""
        x = _stored(module, "input0").detach().requires_grad_(True)
        with torch.enable_grad():
            (d,) = torch.autograd.grad(_forward(module, x).sum(), x, create_graph=True)
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
        n = x.shape[0] if subsampling is None else len(subsampling)
        return mat.reshape(-1, n, *x.shape[1:])

    @classmethod
    def reshape_like_output(cls, mat: Tensor, module: nn.Module) -> Tensor:
        return mat.reshape(-1, *_stored(module, "output").shape)


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
        x = _subsample(_stored(module, "input0"), subsampling).detach()
        vector = mat.dim() == _stored(module, "output").dim()
        g = mat.unsqueeze(0) if vector else mat
        params = {n: p for n, p in module.named_parameters(recurse=False)}
        if param_str not in params:
            raise AttributeError(f"{type(module).__name__} has no parameter {param_str!r}")
        call = Call(
            module=module,
            args=(x,),
            kwargs={},
            out_shapes=[torch.Size(g.shape[1:])],
            batch_size=x.shape[0],
            training=module.training,
            params=params,
        )
        res = get_rule(module).per_sample(call, g.to(x.dtype))[param_str]  # [V, N, *p]
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
        x = _stored(module, "input0").detach()
        params = {n: p.detach() for n, p in module.named_parameters(recurse=False)}

        def f(p: Tensor) -> Tensor:
            with suspended():
                return torch.func.functional_call(module, {**params, name: p}, (x,))

        return vmap(lambda v: jvp(f, (params[name],), (v.to(x.dtype),))[1])(mat)

    def weight_jac_mat_prod(self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor) -> Tensor:
        return self._param_jac_mat_prod("weight", module, mat)

    def bias_jac_mat_prod(self, module: nn.Module, g_inp: Any, g_out: Any, mat: Tensor) -> Tensor:
        return self._param_jac_mat_prod("bias", module, mat)


class BaseLossDerivatives(BaseDerivatives):
    """Loss-Hessian factorisations (``module.input0`` the prediction, ``input1`` the target)
    from backprism's :func:`~backprism.engine.loss_hessian.loss_hessian_sqrt`."""

    def _columns(self, module: nn.Module, key: tuple) -> Tensor:
        f, target = _stored(module, "input0"), _stored(module, "input1")
        inputs = [f.detach().requires_grad_(f.is_floating_point()), target]
        n = inputs[0].shape[0]
        cols = loss_hessian_sqrt(module, inputs, key, n).materialize()
        return cols[0]

    def sqrt_hessian(
        self, module: nn.Module, g_inp: Any, g_out: Any, subsampling: Sequence[int] | None = None
    ) -> Tensor:
        return _subsample(self._columns(module, ("exact",)), subsampling, dim=1)

    def sqrt_hessian_sampled(
        self,
        module: nn.Module,
        g_inp: Any,
        g_out: Any,
        mc_samples: int = 1,
        subsampling: Sequence[int] | None = None,
    ) -> Tensor:
        """``[M, N, *out]``: ``M`` sampled gradients ``/√M`` drawn as BackPACK 1.7 draws them
        (one call on torch's global RNG for the whole mini-batch, see
        :mod:`backprism.engine.loss_hessian`); ``subsampling`` keeps those samples' rows."""
        cols = self._columns(module, backpack_mc_key(mc_samples))
        return _subsample(cols, subsampling, dim=1)

    def sum_hessian(self, module: nn.Module, g_inp: Any, g_out: Any) -> Tensor:
        s = self._columns(module, ("exact",))
        s = s.reshape(s.shape[0], s.shape[1], -1)
        return torch.einsum("kni,knj->ij", s, s)

    def make_hessian_mat_prod(
        self, module: nn.Module, g_inp: Any, g_out: Any
    ) -> Callable[[Tensor], Tensor]:
        s = self._columns(module, ("exact",))  # [K, N, *out]

        def hessian_mat_prod(mat: Tensor) -> Tensor:
            """``[V, N, *out] → [V, N, *out]``: the per-sample loss Hessian times ``mat``."""
            sf = s.reshape(s.shape[0], s.shape[1], -1)
            mf = mat.reshape(mat.shape[0], mat.shape[1], -1).to(sf.dtype)
            coef = torch.einsum("kni,vni->vkn", sf, mf)
            return torch.einsum("vkn,kni->vni", coef, sf).reshape(mat.shape)

        return hessian_mat_prod

    def hessian_is_psd(self) -> bool:
        return True


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


_P, _D, _L = BaseParameterDerivatives, BaseDerivatives, BaseLossDerivatives
_FILES: dict[str, dict[str, type]] = {
    "basederivatives": {
        "BaseDerivatives": _D, "BaseParameterDerivatives": _P, "BaseLossDerivatives": _L
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
    "crossentropyloss": _classes(_L, "CrossEntropyLossDerivatives"),
    "mseloss": _classes(_L, "MSELossDerivatives"),
    "bcewithlogitsloss": _classes(_L, "BCELossWithLogitsDerivatives"),
    "nll_base": _classes(_L, "NLLLossDerivatives"),
}

alias_module(f"{__name__}.derivatives", "BackPACK's core.derivatives (generic autograd).")
for _file, _names in _FILES.items():
    alias_module(f"{__name__}.derivatives.{_file}", f"BackPACK's derivatives.{_file}.", **_names)
    globals().update(_names)
