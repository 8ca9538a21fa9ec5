r"""BackPACK's ``backpack.extensions``: the 19 extensions with BackPACK's constructors, custom
module support (``ModuleExtension``, ``set_module_extension``) and the deeper module paths.

Every class is a subclass of the backprism extension of the same name (same attribute, same
numbers) that adds BackPACK's constructor arguments and methods:

================================  ===============================================================
BackPACK                          here
================================  ===============================================================
``BatchGrad(subsampling=None)``   duplicate indices allowed (``[0, 0]``): rows are computed once
                                  per distinct sample and repeated, as BackPACK returns them
``SqrtGGNExact(subsampling)``,    same (``sqrt_ggn_*[:, i]`` for every requested index ``i``)
``SqrtGGNMC(mc_samples, …)``
``HMP/GGNMP(savefield=…)``,       results stored under ``savefield``, so several instances with
``PCHMP(savefield, modify)``      different settings can run in one backward pass
``ext.get_subsampling()``,        as in BackPACK
``ext.get_num_mc_samples()``,
``ext.expects_backpropagation_quantities()``
``ext.set_module_extension``      see *Custom modules* below
``KFAC``, ``KFLR``, ``KFRA``      refuse ``nn.Linear`` inputs other than ``[N, I]`` with
                                  ``NotImplementedError``, as BackPACK (backprism's own
                                  extensions compute them, positions summed)
``HBP(curv_type, …)``             builds the matching ``KFAC``/``KFLR``/``KFRA`` (GGN curvature,
                                  ``E[Jᵀ H J]`` expectation); other combinations raise
``DiagGGN(strategy, savefield)``  ``DiagGGNExact``/``DiagGGNMC`` (likewise ``BatchDiagGGN``,
                                  ``SqrtGGN``)
``DiagGGNMC``, ``KFAC``,          sample targets with BackPACK's calls on torch's global RNG,
``BatchDiagGGNMC``,               one draw per extension in the order given to ``backpack(...)``:
``SqrtGGNMC``                     same numbers as BackPACK after ``torch.manual_seed`` (see
                                  :mod:`backprism.engine.loss_hessian`)
================================  ===============================================================

**Custom modules.** backprism needs no module extension for layers it does not know: a generic
``torch.func`` rule differentiates any parameter-owning module through its own forward, and
autograd carries every quantity through parameter-free code. BackPACK's custom-module API still
works: ``ext.set_module_extension(MyModule, MyModuleExt())`` makes *this extension instance*
compute the parameters of ``MyModule`` with the module extension's methods named after the
parameters, called as in BackPACK with ``(ext, module, g_inp, g_out, bpQuantities)``. During the
call ``module.input0, input1, …`` and ``module.output`` hold the call's inputs and output (as
BackPACK stores them). First order: ``g_out = (∂L/∂out,)``, ``bpQuantities = None``, ``g_inp``
is computed on first access. Second order (``DiagGGN*``, ``BatchDiagGGN*``, ``SqrtGGN*``,
``KFAC``, ``KFLR``): ``bpQuantities`` is the backpropagated loss-Hessian square root
``[K, *output.shape]`` (``1/√N`` of a mean loss included, as in BackPACK), possibly a chunk of
its columns — the engine sums chunk results (``DiagGGN``, ``KFAC``'s ``B`` factor) or stacks
them (``SqrtGGN``), so a module extension written for BackPACK gives the same result.
Second-order module extensions get no ``g_out``/``g_inp`` (the columns reach the module before
the ordinary backward pass does) and their ``backpropagate`` is not called: autograd pushes the
columns through the module's own forward. For the Hessian family and the curvature-matrix
products BackPACK hands module extensions other objects (signed residual factors, functions);
``set_module_extension`` refuses those extensions with an error saying what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from backprism.compat._modules import alias_module
from backprism.engine.extension import Extension, SecondOrderExtension
from backprism.engine.loss_hessian import backpack_mc_key
from backprism.engine.rule import Call, Rule, has_rule
from backprism.engine.state import suspended
from backprism.extensions import firstorder as _fo
from backprism.extensions import hessian as _h
from backprism.extensions import kronecker as _k
from backprism.extensions import matprod as _mp
from backprism.extensions import secondorder as _so

__all__ = [
    "GGNMP",
    "HBP",
    "HMP",
    "KFAC",
    "KFLR",
    "KFRA",
    "PCHMP",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDiagHessian",
    "BatchGrad",
    "BatchL2Grad",
    "DiagGGNExact",
    "DiagGGNMC",
    "DiagHessian",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "SumGradSquared",
    "Variance",
]

__path__: list[str] = []  # the deeper BackPACK paths below are registered as alias modules

FAIL_ERROR = "ERROR"
FAIL_WARN = "WARNING"
FAIL_SILENT = "SILENT"


# -- module extensions ------------------------------------------------------------------------
class ModuleExtension:
    """BackPACK's base class of a per-layer computation (``backpack.extensions.module_extension``).

    Args:
        params: names of the module's parameters this extension computes; for each name ``p``
            the subclass defines ``p(ext, module, g_inp, g_out, bpQuantities)`` returning the
            extension's quantity for ``module.p``.
    """

    def __init__(self, params: list[str] | None = None) -> None:
        self._bp_params: list[str] = [] if params is None else list(params)
        for param in self._bp_params:
            if not hasattr(self, param):
                raise NotImplementedError(
                    f"The module extension {self} is missing an implementation of how to "
                    f"calculate the quantity for {param}. This should be realized in a "
                    f"function {param}(extension, module, g_inp, g_out, bpQuantities) -> Any."
                )

    def backpropagate(
        self, extension: Any, module: nn.Module, g_inp: Any, g_out: Any, bpQuantities: Any
    ) -> Any:
        """Not called by backprism: autograd pushes backpropagated quantities through the
        module's own forward (kept so that subclasses overriding it still import)."""
        return None

    def check_hyperparameters_module_extension(
        self, ext: Any, module: nn.Module, g_inp: Any, g_out: Any
    ) -> None:
        """Called before the parameter methods, as in BackPACK (no checks by default)."""


class FirstOrderModuleExtension(ModuleExtension):
    """BackPACK's base of first-order module extensions (``bpQuantities`` is ``None``)."""


class MatToJacMat(ModuleExtension):
    """BackPACK's module extension holding a ``derivatives`` object (``mat_to_mat_jac_base``)."""

    def __init__(self, derivatives: Any, params: list[str] | None = None) -> None:
        self.derivatives = derivatives
        super().__init__(params=params)


class _GradTuple(tuple):
    """A tuple of gradients computed on first access (``g_inp`` of a module extension), or
    refusing access with a message (second-order module extensions get no gradients)."""

    def __new__(cls, n: int, compute: Callable[[], tuple]) -> _GradTuple:
        obj = super().__new__(cls, (None,) * n)
        obj._compute = compute  # type: ignore[attr-defined]
        obj._values = None  # type: ignore[attr-defined]
        return obj

    def _get(self) -> tuple:
        if self._values is None:  # type: ignore[attr-defined]
            self._values = tuple(self._compute())  # type: ignore[attr-defined]
        return self._values  # type: ignore[attr-defined]

    def __getitem__(self, i: Any) -> Any:  # type: ignore[override]
        return self._get()[i]

    def __iter__(self) -> Any:
        return iter(self._get())

    def __repr__(self) -> str:
        return repr(self._get())


def _no_gradients(what: str) -> Callable[[], tuple]:
    def refuse() -> tuple:
        raise RuntimeError(
            f"backprism.compat: {what} is not available to second-order module extensions: "
            "backprism pushes the loss-Hessian square root to the module before the ordinary "
            "backward pass reaches it. Compute from module.input0, module.output and "
            "bpQuantities"
        )

    return refuse


class _ModuleIO:
    """Sets ``module.input0, input1, …`` and ``module.output`` (BackPACK's stored I/O) for the
    duration of a module extension's call, and restores what was there."""

    def __init__(self, module: nn.Module, call: Call) -> None:
        self.module = module
        self.call = call
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> _ModuleIO:
        tensors = [a for a in self.call.args if isinstance(a, Tensor)]
        output = self._stored_output()
        if output is None:
            output = self._rerun()
        values = {f"input{i}": t for i, t in enumerate(tensors)}
        values["output"] = output
        for k, v in values.items():
            if k in self.module.__dict__:
                self.saved[k] = self.module.__dict__[k]
            object.__setattr__(self.module, k, v)
        self.keys = list(values)
        self.output = output
        return self

    def _stored_output(self) -> Any:
        """The output the forward stored (the shim's ``extend``), if it is this call's: the
        stored ``input0`` is the call's own first input (so Dropout's mask and train-mode
        BatchNorm's batch statistics are those of the call)."""
        stored = self.module.__dict__.get("input0")
        live = self.call.live[0] if self.call.live is not None else ()
        first = next((a for a in live if isinstance(a, Tensor)), None)
        output = self.module.__dict__.get("output")
        if stored is None or output is None or stored is not first:
            return None
        return output.detach() if isinstance(output, Tensor) else output

    def _rerun(self) -> Any:
        """The call's output recomputed from its inputs; buffers (BatchNorm's running
        statistics) are restored afterwards. A stochastic layer in train mode cannot be re-run
        with the same randomness: refused."""
        module = self.module
        random = (nn.modules.dropout._DropoutNd, nn.RReLU)
        if any(m.training and isinstance(m, random) for m in module.modules()):
            raise NotImplementedError(
                f"backprism.compat: {type(module).__name__} in train mode draws new randomness "
                "in every forward, and this call's output is not stored (extend the model with "
                "backprism.compat.backpack.extend and run the forward outside disable()), so "
                "the module extension cannot see the mask the forward used"
            )
        saved = {k: b.clone() for k, b in module.named_buffers() if b is not None}
        try:
            with suspended(), torch.no_grad():
                return module(*self.call.args, **self.call.kwargs)
        finally:
            with torch.no_grad():
                for k, b in module.named_buffers():
                    if k in saved:
                        b.copy_(saved[k])

    def __exit__(self, *exc: Any) -> None:
        for k in self.keys:
            self.module.__dict__.pop(k, None)
        for k, v in self.saved.items():
            object.__setattr__(self.module, k, v)


def _input_grads(call: Call, g_out: tuple[Tensor, ...]) -> Callable[[], tuple]:
    """``∂L/∂input`` of each tensor input of ``call`` (``None`` where it does not depend)."""

    def compute() -> tuple:
        xs = [
            a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, Tensor) else a
            for a in call.args
        ]
        diff = [x for x in xs if isinstance(x, Tensor) and x.requires_grad]
        with torch.enable_grad(), suspended():
            out = call.module(*xs, **call.kwargs)
            outs = [out] if isinstance(out, Tensor) else [o for o in out if isinstance(o, Tensor)]
            pairs = [(o, g) for o, g in zip(outs, g_out) if g is not None and o.requires_grad]
            grads = (
                torch.autograd.grad(
                    [o for o, _ in pairs], diff, [g for _, g in pairs], allow_unused=True
                )
                if pairs and diff
                else [None] * len(diff)
            )
        it = iter(grads)
        return tuple(
            next(it) if isinstance(x, Tensor) and x.requires_grad else None
            for x in xs
            if isinstance(x, Tensor)
        )

    return compute


class _Done:
    """A finished result passed through ``Variance.finish`` unchanged (module extensions)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __add__(self, other: _Done) -> _Done:
        return _Done(self.value + other.value)


# -- the BackPACK extension interface ---------------------------------------------------------
class _BackpackMeta(type):
    """Metaclass giving BackPACK's base classes their ``isinstance`` meaning:
    ``BackpropExtension`` covers every backprism extension (also those ViViT-style computations
    hand out), ``HBP`` covers KFAC/KFLR/KFRA, ``DiagGGN`` covers DiagGGNExact/MC, …
    (``_virtual``); and lets the strategy-taking base classes build their concrete
    extension (``_factory``)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if cls.__dict__.get("_any_extension", False):
            return isinstance(obj, Extension)
        virtual = cls.__dict__.get("_virtual", ())
        if virtual and isinstance(obj, virtual):
            return True
        return super().__instancecheck__(obj)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        factory = cls.__dict__.get("_factory")
        if factory is not None:
            return factory(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _dedupe(subsampling: Sequence[int] | None) -> tuple[list[int] | None, Tensor | None]:
    """Distinct indices in first-occurrence order and, if some repeat, the rows to take."""
    if subsampling is None:
        return None, None
    idx = [int(i) for i in subsampling]
    unique = list(dict.fromkeys(idx))
    if len(unique) == len(idx):
        return idx, None
    pos = {i: k for k, i in enumerate(unique)}
    return unique, torch.tensor([pos[i] for i in idx], dtype=torch.long)


class BackpropExtension(Extension, metaclass=_BackpackMeta):
    """BackPACK's base class of extensions; ``isinstance(ext, BackpropExtension)`` holds for every
    backprism extension. The methods below are those BackPACK scripts call on an extension."""

    _any_extension = True
    #: module extensions can be used for this extension (see the module docstring)
    _custom_modules: bool = True
    #: axis of the per-sample rows that ``subsampling`` selects (BatchGrad 0, SqrtGGN 1)
    _row_axis: int = 0

    def __init__(
        self,
        savefield: str,
        module_exts: dict | None = None,
        fail_mode: str = FAIL_ERROR,
        subsampling: list[int] | None = None,
    ) -> None:
        raise NotImplementedError(
            "backprism.compat: writing a new BackPACK extension type (subclassing "
            "BackpropExtension with module_exts) is not supported, because backprism computes "
            "extensions from layer rules instead of per-module backpropagation. Add a "
            "ModuleExtension to an existing extension with ext.set_module_extension(...), or "
            "write a backprism extension: subclass backprism.extensions.FirstOrderExtension or "
            "SecondOrderExtension and implement from_rule (see docs/ARCHITECTURE.md)"
        )

    # -- set-up used by the concrete classes (they call their backprism parent's __init__) --
    def _bp_setup(
        self, savefield: str | None = None, subsampling: Sequence[int] | None = None
    ) -> list[int] | None:
        self._module_exts: dict[type[nn.Module], ModuleExtension] = {}
        if savefield is not None:
            if not isinstance(savefield, str) or not savefield.isidentifier():
                raise ValueError(f"savefield must be an attribute name, got {savefield!r}")
            self.savefield = savefield
        self._requested = None if subsampling is None else [int(i) for i in subsampling]
        unique, self._rows = _dedupe(subsampling)
        return unique

    # -- BackPACK's methods ---------------------------------------------------------------------
    def get_subsampling(self) -> list[int] | None:
        """Indices of the active samples as passed (``None``: the whole mini-batch)."""
        return getattr(self, "_requested", None)

    def expects_backpropagation_quantities(self) -> bool:
        """Whether the extension backpropagates quantities (second order)."""
        return isinstance(self, SecondOrderExtension)

    def set_module_extension(
        self, module: type[nn.Module], extension: ModuleExtension, overwrite: bool = False
    ) -> None:
        """Compute this extension's quantity for the parameters of ``module`` (a module class)
        with ``extension`` (see the module docstring).

        Raises:
            ValueError: the module type already has a computation (backprism's built-in layer
                rules count) and ``overwrite`` is ``False``.
        """
        if not self._custom_modules:
            raise NotImplementedError(
                f"backprism.compat: {type(self).__name__}.set_module_extension is not supported: "
                f"BackPACK hands {type(self).__name__}'s module extensions objects backprism does "
                "not build (signed residual factors, matrix-product functions). backprism "
                f"already computes {type(self).__name__} for {getattr(module, '__name__', module)}"
                " through autograd (generic torch.func rule), so drop the set_module_extension "
                "call; to give backprism a closed form for the module, register a rule: "
                "@backprism.engine.rule.register_rule(MyModule) on a Rule subclass "
                "implementing per_sample(call, g)"
            )
        if not (isinstance(module, type) and issubclass(module, nn.Module)):
            raise TypeError(f"set_module_extension takes a module class, got {module!r}")
        if not isinstance(extension, ModuleExtension):
            raise TypeError(
                "set_module_extension takes a backprism.compat.backpack.extensions."
                f"module_extension.ModuleExtension, got {type(extension).__name__}"
            )
        if not overwrite and (module in self._module_exts or has_rule(module)):
            raise ValueError(
                f"{module} maps to {self._module_exts.get(module, 'a built-in rule')}! "
                "Use overwrite = True to force replacement."
            )
        self._module_exts[module] = extension

    # -- engine entry points ---------------------------------------------------------------------
    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        exts = getattr(self, "_module_exts", None)
        mext = exts.get(type(call.module)) if exts else None
        if mext is not None:
            return self._from_module_extension(mext, rule, call, g, weights)
        out = super().from_rule(rule, call, g, weights)  # type: ignore[safe-super]
        rows = getattr(self, "_rows", None)
        if rows is not None:
            out = {k: v.index_select(self._row_axis, rows.to(v.device)) for k, v in out.items()}
        return out

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        out = super().from_dense(dense, call, weights)  # type: ignore[safe-super]
        rows = getattr(self, "_rows", None)
        if rows is not None and isinstance(out, Tensor):
            out = out.index_select(self._row_axis, rows.to(out.device))
        return out

    def _from_module_extension(
        self, mext: ModuleExtension, rule: Rule, call: Call, g: Any, weights: Tensor | None
    ) -> dict:
        module = call.module
        names = [n for n in call.params if n in mext._bp_params]
        n_in = sum(isinstance(a, Tensor) for a in call.args)
        if isinstance(self, SecondOrderExtension):
            g_out: Any = _GradTuple(1, _no_gradients("g_out"))
            g_inp: Any = _GradTuple(n_in, _no_gradients("g_inp"))
            bp: Any = g
        else:
            g_out = tuple(x[0] for x in g) if isinstance(g, tuple) else (g[0],)
            g_inp = _GradTuple(n_in, _input_grads(call, g_out))
            bp = None
        out: dict[str, Any] = {}
        with _ModuleIO(module, call):
            mext.check_hyperparameters_module_extension(self, module, g_inp, g_out)
            for name in names:
                value = getattr(mext, name)(self, module, g_inp, g_out, bp)
                out[name] = self._custom_value(call, value)
        missing = [n for n in call.params if n not in out]
        if missing:
            try:
                rest = super().from_rule(rule, call, g, weights)  # type: ignore[safe-super]
            except NotImplementedError as err:
                raise NotImplementedError(
                    f"backprism.compat: the module extension {type(mext).__name__} for "
                    f"{type(module).__name__} covers {names} but not {missing}, and backprism's "
                    f"rule cannot compute {type(self).__name__} for them ({err}). Add methods "
                    f"named {missing} to the module extension (and to its params list)"
                ) from err
            out.update({n: rest[n] for n in missing if n in rest})
        return out

    def _custom_value(self, call: Call, value: Any) -> Any:
        """A module extension's result in the form the engine accumulates."""
        return value


# -- first order ------------------------------------------------------------------------------
class FirstOrderBackpropExtension(BackpropExtension):
    """BackPACK's base class of first-order extensions."""


class BatchGrad(FirstOrderBackpropExtension, _fo.BatchGrad):
    """Individual gradients ``grad_batch`` ``[N, *p]``, ``∇(ℓₙ/N)`` for a mean loss.

    Args:
        subsampling: indices of the samples to keep, in the given order; repeated indices give
            repeated rows (BackPACK's behaviour).
    """

    def __init__(self, subsampling: list[int] | None = None) -> None:
        _fo.BatchGrad.__init__(self, subsampling=self._bp_setup(subsampling=subsampling))


class BatchL2Grad(FirstOrderBackpropExtension, _fo.BatchL2Grad):
    """Squared norms of the individual gradients, ``batch_l2`` ``[N]``."""

    def __init__(self) -> None:
        self._bp_setup()


class SumGradSquared(FirstOrderBackpropExtension, _fo.SumGradSquared):
    """Sum of squared individual gradients, ``sum_grad_squared`` ``[*p]``."""

    def __init__(self) -> None:
        self._bp_setup()


class Variance(FirstOrderBackpropExtension, _fo.Variance):
    """Biased variance of the individual gradients, ``variance`` ``[*p]``."""

    def __init__(self) -> None:
        self._bp_setup()

    def _custom_value(self, call: Call, value: Any) -> Any:
        return _Done(value)

    def finish(self, partial: Any, grad: Tensor) -> Any:
        if isinstance(partial, _Done):
            return partial.value
        return _fo.Variance.finish(self, partial, grad)


# -- second order -------------------------------------------------------------------------------
class SecondOrderBackpropExtension(BackpropExtension):
    """BackPACK's base class of second-order extensions."""

    def get_num_mc_samples(self) -> int:
        """Number of Monte-Carlo samples (MC extensions)."""
        mc = getattr(self, "mc_samples", None)
        if mc is None:
            raise AttributeError(f"{type(self).__name__} does not sample")
        return mc


class _BackpackDraw:
    """Monte-Carlo extensions of the shim draw their targets as BackPACK 1.7 does.

    BackPACK samples ``M`` targets from the loss's likelihood with one call on torch's global
    RNG per extension, when the backward pass reaches the loss, in the order the extensions were
    given to ``backpack(...)``. The column key :func:`~backprism.engine.loss_hessian.
    backpack_mc_key` asks the engine for that draw, and ``id(self)`` as its owner keeps the
    draws of two MC extensions apart (the engine builds columns once per distinct key), so a
    script seeded with ``torch.manual_seed`` gets BackPACK's numbers. With ``subsampling``
    (``SqrtGGNMC``) the targets are drawn for the whole mini-batch and the requested samples
    kept; BackPACK draws for the requested samples only, so those numbers differ (the
    distribution is the same)."""

    mc_samples: int

    def column_key(self) -> tuple:
        """``("mc", M, "backpack", id(self))``: BackPACK's draw, one per extension."""
        return backpack_mc_key(self.mc_samples, id(self))


class DiagGGNExact(SecondOrderBackpropExtension, _so.DiagGGNExact):
    """Diagonal of the GGN, ``diag_ggn_exact`` ``[*p]``."""

    def __init__(self) -> None:
        self._bp_setup()


class DiagGGNMC(_BackpackDraw, SecondOrderBackpropExtension, _so.DiagGGNMC):
    """Monte-Carlo GGN diagonal, ``diag_ggn_mc`` ``[*p]``."""

    def __init__(self, mc_samples: int = 1) -> None:
        _so.DiagGGNMC.__init__(self, mc_samples)
        self._bp_setup()


class BatchDiagGGNExact(SecondOrderBackpropExtension, _so.BatchDiagGGNExact):
    """Per-sample GGN diagonals, ``diag_ggn_exact_batch`` ``[N, *p]``."""

    def __init__(self) -> None:
        self._bp_setup()


class BatchDiagGGNMC(_BackpackDraw, SecondOrderBackpropExtension, _so.BatchDiagGGNMC):
    """Per-sample MC GGN diagonals, ``diag_ggn_mc_batch`` ``[N, *p]``."""

    def __init__(self, mc_samples: int = 1) -> None:
        _so.BatchDiagGGNMC.__init__(self, mc_samples)
        self._bp_setup()


class SqrtGGNExact(SecondOrderBackpropExtension, _so.SqrtGGNExact):
    """GGN square root, ``sqrt_ggn_exact`` ``[C, N, *p]``.

    Args:
        subsampling: active samples (repeated indices give repeated columns).
    """

    _row_axis = 1

    def __init__(self, subsampling: list[int] | None = None) -> None:
        _so.SqrtGGNExact.__init__(self, subsampling=self._bp_setup(subsampling=subsampling))


class SqrtGGNMC(_BackpackDraw, SecondOrderBackpropExtension, _so.SqrtGGNMC):
    """MC GGN square root, ``sqrt_ggn_mc`` ``[M, N, *p]``.

    Args:
        mc_samples: number of sampled labels ``M``.
        subsampling: active samples (repeated indices give repeated columns).
    """

    _row_axis = 1

    def __init__(self, mc_samples: int = 1, subsampling: list[int] | None = None) -> None:
        unique = self._bp_setup(subsampling=subsampling)
        _so.SqrtGGNMC.__init__(self, mc_samples=mc_samples, subsampling=unique)


def _refuse_linear_middle_axes(ext: Extension, call: Call) -> None:
    """Refuse ``KFAC``/``KFLR``/``KFRA`` for an ``nn.Linear`` whose input is not ``[N, I]``, as
    BackPACK 1.7 does (``NotImplementedError``; its ``HBPLinear`` checks the input dimension).

    With middle axes ``[N, *T, I]`` the weight is shared over the ``T`` positions and a Kronecker
    approximation needs a convention for them, which BackPACK leaves undefined. backprism's own
    extensions (:mod:`backprism.extensions.kronecker`) pick one — ``A = (1/N) Σₙₜ xₙₜ xₙₜᵀ``,
    ``B`` from the position-summed output gradients, BackPACK's convolution convention — but a
    script ported from BackPACK gets BackPACK's answer, not numbers under a convention it never
    chose.

    Raises:
        NotImplementedError: ``call`` is a Linear call with an input of dimension other than 2.
    """
    if isinstance(call.module, nn.Linear) and call.input.dim() != 2:
        name = type(ext).__name__
        raise NotImplementedError(
            f"Only 2d inputs are supported by {name} (got {call.input.dim()}). "
            "backprism.compat.backpack follows BackPACK 1.7 here; backprism.extensions."
            f"{name} computes the factors of Linear layers with middle axes (positions summed, "
            "BackPACK's convolution convention)"
        )


class _KroneckerCustom:
    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        if type(call.module) not in getattr(self, "_module_exts", {}):
            _refuse_linear_middle_axes(self, call)  # type: ignore[arg-type]
        return super().from_rule(rule, call, g, weights)  # type: ignore[misc]

    def _custom_value(self, call: Call, value: Any) -> Any:
        factors = list(value) if isinstance(value, (list, tuple)) else [value]
        side = [True] + [False] * (len(factors) - 1)
        return _k.KroneckerFactors(factors, {id(call)}, side)


class KFAC(_BackpackDraw, _KroneckerCustom, SecondOrderBackpropExtension, _k.KFAC):
    """KFAC factors (MC ``B``), ``kfac``: ``[B, A]`` per weight, ``[B]`` per bias."""

    def __init__(self, mc_samples: int = 1) -> None:
        _k.KFAC.__init__(self, mc_samples=mc_samples)
        self._bp_setup()

    def get_loss_hessian_strategy(self) -> str:
        return LossHessianStrategy.SAMPLING

    def get_backprop_strategy(self) -> str:
        return BackpropStrategy.SQRT

    def get_ea_strategy(self) -> str:
        return ExpectationApproximation.BOTEV_MARTENS


class KFLR(_KroneckerCustom, SecondOrderBackpropExtension, _k.KFLR):
    """KFLR factors (exact ``B``), ``kflr``."""

    def __init__(self) -> None:
        self._bp_setup()

    def get_loss_hessian_strategy(self) -> str:
        return LossHessianStrategy.EXACT

    def get_backprop_strategy(self) -> str:
        return BackpropStrategy.SQRT

    def get_ea_strategy(self) -> str:
        return ExpectationApproximation.BOTEV_MARTENS


class KFRA(SecondOrderBackpropExtension, _k.KFRA):
    """KFRA factors (recursive batch-averaged Hessian), ``kfra``."""

    _custom_modules = False

    def __init__(self) -> None:
        self._bp_setup()

    def handle_loss(self, bp: Any, record: Any, calls: list, n: int, scale: float) -> None:
        for call, _ in calls:
            _refuse_linear_middle_axes(self, call)
        return super().handle_loss(bp, record, calls, n, scale)

    def get_loss_hessian_strategy(self) -> str:
        return LossHessianStrategy.SUM

    def get_backprop_strategy(self) -> str:
        return BackpropStrategy.BATCH_AVERAGE

    def get_ea_strategy(self) -> str:
        return ExpectationApproximation.BOTEV_MARTENS


class DiagHessian(SecondOrderBackpropExtension, _h.DiagHessian):
    """Exact Hessian diagonal, ``diag_h`` ``[*p]``."""

    _custom_modules = False

    def __init__(self) -> None:
        self._bp_setup()


class BatchDiagHessian(SecondOrderBackpropExtension, _h.BatchDiagHessian):
    """Per-sample Hessian diagonals, ``diag_h_batch`` ``[N, *p]``."""

    _custom_modules = False

    def __init__(self) -> None:
        self._bp_setup()


class HMP(SecondOrderBackpropExtension, _mp.HMP):
    """Block Hessian-matrix products, ``param.<savefield>(mat)`` (``[V, *p] → [V, *p]``)."""

    _custom_modules = False

    def __init__(self, savefield: str = "hmp") -> None:
        self._bp_setup(savefield=savefield)


class GGNMP(SecondOrderBackpropExtension, _mp.GGNMP):
    """Block GGN-matrix products, ``param.<savefield>(mat)``."""

    _custom_modules = False

    def __init__(self, savefield: str = "ggnmp") -> None:
        self._bp_setup(savefield=savefield)


class PCHMP(SecondOrderBackpropExtension, _mp.PCHMP):
    """Block positive-curvature Hessian products, ``param.<savefield>(mat)``.

    Args:
        savefield: attribute the product function is stored under.
        modify: ``"clip"`` or ``"abs"`` for negative residual curvature.
    """

    _custom_modules = False

    def __init__(self, savefield: str = "pchmp", modify: str = "clip") -> None:
        _mp.PCHMP.__init__(self, modify=modify)
        self._bp_setup(savefield=savefield)


# -- strategies and the strategy-taking base classes ------------------------------------------
class LossHessianStrategy:
    """BackPACK's choices for the loss Hessian (``hbp_options``)."""

    EXACT = "exact"
    SAMPLING = "sampling"
    SUM = "sum"
    CHOICES: ClassVar[list[str]] = [EXACT, SAMPLING, SUM]

    @classmethod
    def check_exists(cls, strategy: str) -> None:
        if strategy not in cls.CHOICES:
            raise AttributeError(
                f"Unknown loss Hessian strategy: {strategy}. Expecting one of {cls.CHOICES}"
            )


class BackpropStrategy:
    """BackPACK's choices for what HBP backpropagates."""

    SQRT = "sqrt"
    BATCH_AVERAGE = "average"
    CHOICES: ClassVar[list[str]] = [BATCH_AVERAGE, SQRT]

    @classmethod
    def check_exists(cls, strategy: str) -> None:
        if strategy not in cls.CHOICES:
            raise AttributeError(
                f"Unknown backpropagation strategy: {strategy}. Expect {cls.CHOICES}"
            )

    @classmethod
    def is_batch_average(cls, strategy: str) -> bool:
        cls.check_exists(strategy)
        return strategy == cls.BATCH_AVERAGE

    @classmethod
    def is_sqrt(cls, strategy: str) -> bool:
        cls.check_exists(strategy)
        return strategy == cls.SQRT


class ExpectationApproximation:
    """BackPACK's choices for the expectation approximation of HBP."""

    BOTEV_MARTENS = "E[J^T E(H) J]"
    CHEN = "E(J^T) E(H) E(J)"
    CHOICES: ClassVar[list[str]] = [BOTEV_MARTENS, CHEN]

    @classmethod
    def check_exists(cls, strategy: str) -> None:
        if strategy not in cls.CHOICES:
            raise AttributeError(f"Unknown EA strategy: {strategy}. Expect {cls.CHOICES}")

    @classmethod
    def should_average_param_jac(cls, strategy: str) -> bool:
        cls.check_exists(strategy)
        return strategy == cls.CHEN


class Curvature:
    """BackPACK's curvature types (``backpack.extensions.curvature``)."""

    HESSIAN = "hessian"
    GGN = "ggn"
    PCH_ABS = "pch-abs"
    PCH_CLIP = "pch-clip"
    CHOICES: ClassVar[list[str]] = [HESSIAN, GGN, PCH_CLIP, PCH_ABS]


class ResidualModifications:
    """BackPACK's residual modifications of the positive-curvature Hessian."""

    @staticmethod
    def nothing(res: Tensor) -> Tensor:
        return res

    @staticmethod
    def to_zero(res: Tensor) -> None:
        return None

    @staticmethod
    def remove_negative_values(res: Tensor) -> Tensor:
        return res.clamp(min=0)

    @staticmethod
    def to_abs(res: Tensor) -> Tensor:
        return res.abs()


def _with_savefield(ext: BackpropExtension, savefield: str | None) -> BackpropExtension:
    if savefield is not None:
        ext._bp_setup(savefield=savefield, subsampling=ext.get_subsampling())
    return ext


def _hbp(
    curv_type: str,
    loss_hessian_strategy: str,
    backprop_strategy: str,
    ea_strategy: str,
    savefield: str = "hbp",
) -> BackpropExtension:
    LossHessianStrategy.check_exists(loss_hessian_strategy)
    BackpropStrategy.check_exists(backprop_strategy)
    ExpectationApproximation.check_exists(ea_strategy)
    combos: dict[tuple[str, str], Callable[[], BackpropExtension]] = {
        (LossHessianStrategy.SAMPLING, BackpropStrategy.SQRT): KFAC,
        (LossHessianStrategy.EXACT, BackpropStrategy.SQRT): KFLR,
        (LossHessianStrategy.SUM, BackpropStrategy.BATCH_AVERAGE): KFRA,
    }
    make = combos.get((loss_hessian_strategy, backprop_strategy))
    if (
        curv_type != Curvature.GGN
        or ea_strategy != ExpectationApproximation.BOTEV_MARTENS
        or make is None
    ):
        raise NotImplementedError(
            "backprism.compat: HBP supports the GGN with the E[Jᵀ H J] expectation in the "
            "combinations of KFAC (sampling, sqrt), KFLR (exact, sqrt) and KFRA (sum, average); "
            f"got curv_type={curv_type!r}, loss_hessian_strategy={loss_hessian_strategy!r}, "
            f"backprop_strategy={backprop_strategy!r}, ea_strategy={ea_strategy!r}. Use "
            "KFAC(), KFLR() or KFRA(), or HMP()/PCHMP() for Hessian block products"
        )
    return _with_savefield(make(), savefield)


class HBP(SecondOrderBackpropExtension):
    """BackPACK's Hessian backpropagation base class: ``HBP(curv_type, loss_hessian_strategy,
    backprop_strategy, ea_strategy, savefield="hbp")`` returns the matching KFAC/KFLR/KFRA
    (storing under ``savefield``); ``isinstance(KFAC(), HBP)`` holds."""

    _factory = staticmethod(_hbp)


def _diag_ggn(
    loss_hessian_strategy: str, savefield: str, batch: bool = False
) -> BackpropExtension:
    if loss_hessian_strategy == LossHessianStrategy.EXACT:
        ext: BackpropExtension = BatchDiagGGNExact() if batch else DiagGGNExact()
    elif loss_hessian_strategy == LossHessianStrategy.SAMPLING:
        ext = BatchDiagGGNMC() if batch else DiagGGNMC()
    else:
        raise ValueError(f"Unknown hessian strategy: {loss_hessian_strategy}")
    return _with_savefield(ext, savefield)


class DiagGGN(SecondOrderBackpropExtension):
    """``DiagGGN(loss_hessian_strategy, savefield)``: DiagGGNExact or DiagGGNMC."""

    _factory = staticmethod(_diag_ggn)


class BatchDiagGGN(SecondOrderBackpropExtension):
    """``BatchDiagGGN(loss_hessian_strategy, savefield)``: BatchDiagGGNExact or …MC."""

    _factory = staticmethod(lambda strategy, savefield: _diag_ggn(strategy, savefield, True))


def _sqrt_ggn(
    loss_hessian_strategy: str, savefield: str, subsampling: list[int] | None
) -> BackpropExtension:
    if loss_hessian_strategy == LossHessianStrategy.EXACT:
        ext: BackpropExtension = SqrtGGNExact(subsampling=subsampling)
    elif loss_hessian_strategy == LossHessianStrategy.SAMPLING:
        ext = SqrtGGNMC(subsampling=subsampling)
    else:
        raise ValueError(f"Unknown hessian strategy: {loss_hessian_strategy}")
    return _with_savefield(ext, savefield)


class SqrtGGN(SecondOrderBackpropExtension):
    """``SqrtGGN(loss_hessian_strategy, savefield, subsampling)``: SqrtGGNExact or SqrtGGNMC."""

    _factory = staticmethod(_sqrt_ggn)


HBP._virtual = (KFAC, KFLR, KFRA)  # type: ignore[attr-defined]
DiagGGN._virtual = (DiagGGNExact, DiagGGNMC)  # type: ignore[attr-defined]
BatchDiagGGN._virtual = (BatchDiagGGNExact, BatchDiagGGNMC)  # type: ignore[attr-defined]
SqrtGGN._virtual = (SqrtGGNExact, SqrtGGNMC)  # type: ignore[attr-defined]


# -- BackPACK's deeper module paths ------------------------------------------------------------
def _register() -> None:
    p = __name__
    first = {
        "BatchGrad": BatchGrad,
        "BatchL2Grad": BatchL2Grad,
        "SumGradSquared": SumGradSquared,
        "Variance": Variance,
    }
    strategies = {
        "LossHessianStrategy": LossHessianStrategy,
        "BackpropStrategy": BackpropStrategy,
        "ExpectationApproximation": ExpectationApproximation,
    }
    alias_module(
        f"{p}.backprop_extension",
        "BackPACK's backprop_extension.",
        BackpropExtension=BackpropExtension,
        FAIL_ERROR=FAIL_ERROR,
        FAIL_WARN=FAIL_WARN,
        FAIL_SILENT=FAIL_SILENT,
    )
    alias_module(f"{p}.module_extension", "BackPACK's module_extension.",
                 ModuleExtension=ModuleExtension)
    alias_module(f"{p}.mat_to_mat_jac_base", "BackPACK's mat_to_mat_jac_base.",
                 MatToJacMat=MatToJacMat)
    alias_module(f"{p}.curvature", "BackPACK's curvature types.", Curvature=Curvature,
                 ResidualModifications=ResidualModifications)
    alias_module(f"{p}.firstorder", "First-order extensions.", **first)
    alias_module(
        f"{p}.firstorder.base",
        "First-order base classes.",
        FirstOrderModuleExtension=FirstOrderModuleExtension,
        FirstOrderBackpropExtension=FirstOrderBackpropExtension,
    )
    for mod, name in [
        ("batch_grad", "BatchGrad"),
        ("batch_l2_grad", "BatchL2Grad"),
        ("sum_grad_squared", "SumGradSquared"),
        ("variance", "Variance"),
    ]:
        alias_module(f"{p}.firstorder.{mod}", f"BackPACK's {name}.", **{name: first[name]})
    second = {
        "DiagGGNExact": DiagGGNExact,
        "BatchDiagGGNExact": BatchDiagGGNExact,
        "DiagGGNMC": DiagGGNMC,
        "BatchDiagGGNMC": BatchDiagGGNMC,
        "DiagHessian": DiagHessian,
        "BatchDiagHessian": BatchDiagHessian,
        "KFAC": KFAC,
        "KFLR": KFLR,
        "KFRA": KFRA,
        "HBP": HBP,
        "SqrtGGNExact": SqrtGGNExact,
        "SqrtGGNMC": SqrtGGNMC,
    }
    alias_module(f"{p}.secondorder", "Second-order extensions.", **second)
    alias_module(
        f"{p}.secondorder.base",
        "Second-order base class.",
        SecondOrderBackpropExtension=SecondOrderBackpropExtension,
    )
    alias_module(
        f"{p}.secondorder.diag_ggn",
        "GGN diagonals.",
        DiagGGN=DiagGGN,
        BatchDiagGGN=BatchDiagGGN,
        DiagGGNExact=DiagGGNExact,
        DiagGGNMC=DiagGGNMC,
        BatchDiagGGNExact=BatchDiagGGNExact,
        BatchDiagGGNMC=BatchDiagGGNMC,
        LossHessianStrategy=LossHessianStrategy,
    )
    alias_module(
        f"{p}.secondorder.diag_hessian",
        "Hessian diagonals.",
        DiagHessian=DiagHessian,
        BatchDiagHessian=BatchDiagHessian,
    )
    alias_module(
        f"{p}.secondorder.hbp",
        "Kronecker factorisations.",
        HBP=HBP,
        KFAC=KFAC,
        KFLR=KFLR,
        KFRA=KFRA,
        **strategies,
    )
    alias_module(f"{p}.secondorder.hbp.hbp_options", "HBP options.", **strategies)
    alias_module(
        f"{p}.secondorder.sqrt_ggn",
        "GGN square roots.",
        SqrtGGN=SqrtGGN,
        SqrtGGNExact=SqrtGGNExact,
        SqrtGGNMC=SqrtGGNMC,
    )
    alias_module(f"{p}.curvmatprod", "Block curvature-matrix products.", GGNMP=GGNMP, HMP=HMP,
                 PCHMP=PCHMP)
    alias_module(f"{p}.curvmatprod.ggnmp", "GGNMP.", GGNMP=GGNMP)
    alias_module(f"{p}.curvmatprod.hmp", "HMP.", HMP=HMP)
    alias_module(f"{p}.curvmatprod.pchmp", "PCHMP.", PCHMP=PCHMP)


_register()

