r"""Generic rule for any parameter-owning module without a registered rule, via ``torch.func``.

For a call ``out = f(θ, x)`` of a module with parameters ``θ`` (its own, plus those of
descendants used functionally, see :attr:`~backprism.engine.rule.Call.params`) and columns ``g``
of shape ``[M, *out.shape]`` (one per tensor output for multi-output modules), the per-sample,
per-column gradients are the vector-Jacobian products of the module's *own* forward, run on one
sample at a time (with a batch axis of size 1 kept inside, so modules that need batched input
work):

.. math::

    V_{mn} = \Big(\frac{\partial f(θ, x_n)}{\partial θ}\Big)^{\!\top} g_{m,n}
    \qquad [M, N, *θ.shape],

with ``g[m, n]`` the slice of ``g[m]`` at sample ``n`` along each output's batch axis. The
scaling is that of ``g`` (first order: ``g[0] = ∂L/∂out`` already holds the ``1/N`` of a mean
loss, so ``Σₙ V₀ₙ = ∇L`` and ``V₀ₙ = ∇(ℓₙ/N)``). The recomputation is ``vmap``-ped over samples
and over columns (columns in chunks bounded by the active context's ``memory_budget``); if an
operator of the module has no batching rule (or uses data-dependent control flow), it falls back,
with a one-time warning, to plain autograd in a loop over samples — same numbers, slower. RNNs
(whose fused kernels have no batching rule) take the loop directly.

A batching rule may also be *wrong* without raising (``prelu``'s backward under the nested
``vmap`` in torch 2.13 returns ``[N, N, *θ]`` with the right values on the diagonal only), so
every ``vmap`` result is checked before it is used: each parameter's result must have the shape
``[M, N, *θ.shape]``, and the entries ``(m, n) = (0, N−1)`` and ``(M−1, 0)`` (off the diagonal)
must equal plain autograd on that sample within ``10·√eps`` of the largest per-entry norm (two
single-sample forwards and backwards). A failed check raises :class:`BrokenBatchingError`
internally: the call is recomputed by the loop (one warning per module type), and later calls
of the type go to the loop directly.

Parameters are passed to ``functional_call`` with ``tie_weights=False``, every name explicitly:
the names in ``call.params`` of one tensor share one primal (its gradient collects all their
uses, reported under the first name, zeros under the others), and every other name is a
constant — also one tied to a primal, since the call of the sub-module owning that name
accounts for its uses (Hugging Face's ``BertLMPredictionHead.bias`` is ``decoder.bias``; the
``decoder`` Linear's call takes the gradient through it), so that the sum over calls and names
is the gradient once.

All statistics (``summed``, ``sum_squared``, ``batch_l2``, ``batch_dot``, …) are the
:class:`~backprism.engine.rule.Rule` defaults built from the materialised ``V``; the result of one
``(call, g)`` is cached while ``g`` is alive, so several extensions share one recomputation.
The rule has no Kronecker form: KFAC / KFLR / KFRA store each parameter's GGN diagonal (MC or
exact) as the single factor ``[diag(Σₘ Σₙ vec(Vₘₙ)²)]``
(:meth:`~backprism.engine.rule.Rule.kronecker_diagonal`).

Which inputs are per-sample:

* a tensor whose axis 0 has size ``N`` (``N`` = the engine's batch size of the call);
* ``nn.RNNBase`` (LSTM, GRU, RNN): the input (batch axis 0 with ``batch_first=True``, 1 with
  ``batch_first=False``) and the initial state ``hx`` (batch axis 1, also each of LSTM's
  ``(h_0, c_0)``);
* ``nn.MultiheadAttention``: query, key and value (batch axis 0 with ``batch_first=True``, 1
  with ``batch_first=False``),
  ``key_padding_mask`` ``[N, S]``; a 3-d ``attn_mask`` ``[N·heads, L, S]`` is split per sample,
  a 2-d ``attn_mask`` ``[L, S]`` is shared even if ``L = N``;
* everything else (0-d tensors, masks, flags) is shared by all samples.

Each output's batch axis is found by comparing the real output shape with the one-sample
output's (e.g. ``h_n`` of an LSTM has it on axis 1).

Refused with a clear error: dropout in train mode (the recomputation would draw other masks than
the real forward — call ``model.eval()`` or use ``dropout=0``), BatchNorm descendants in train
mode (they mix samples), RNNs with unbatched / packed input.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from backprism.engine.backward import current_pass
from backprism.engine.columns import pull_back
from backprism.engine.rule import Call, Rule, get_rule, has_rule, set_generic_rule
from backprism.engine.state import Inside, suspended
from backprism.rules import elementwise

__all__ = ["BrokenBatchingError", "GenericRule", "GenericRuleWarning"]


class BrokenBatchingError(RuntimeError):
    """The ``vmap`` of a module's forward and vector-Jacobian product returned per-sample
    gradients of the wrong shape, or values that differ from plain autograd on one sample (a
    broken batching rule of one of its operators). The generic rule catches it and falls back
    to the loop over samples."""


class GenericRuleWarning(UserWarning):
    """A module takes the generic ``torch.func`` rule (a per-sample ``vmap`` of its forward)
    because no closed-form rule is registered for its type."""


#: names (module types, functional ops) the fallback warning was shown for, once per process
_ANNOUNCED: set[str] = set()
#: module types for which the vmap path failed once (the loop fallback warned already)
_WARNED: set[type] = set()
#: module types whose vmap gave wrong results once (:class:`BrokenBatchingError`): later calls
#: go straight to the loop over samples
_VMAP_BROKEN: set[type] = set()
#: ``(module type, M, N, input shapes and dtypes)`` whose vmap passed the spot check
#: (:meth:`_Samples.check`); bounded by the kinds of calls a program makes
_VMAP_VERIFIED: set[tuple] = set()
#: module types whose kernels have no batching rule: straight to the loop over samples
_LOOP_TYPES: tuple[type, ...] = (nn.RNNBase,)

# A per-sample input is described by how it is laid out:
#   ("axis", a): the batch is axis ``a`` of the tensor;
#   ("heads", h): axis 0 holds ``N * h`` rows, ``h`` consecutive rows per sample (MHA masks);
#   None: shared by all samples.
_Spec = tuple[str, int] | None


def _leaves(batched: Any) -> list[Tensor]:
    """The tensors among the per-sample inputs handed to ``vmap``."""
    return [t for t in tree_flatten(batched)[0] if isinstance(t, Tensor)]


def _name(module: nn.Module) -> str:
    return type(module).__name__


# -- checks ----------------------------------------------------------------------------------
def _check_randomness(module: nn.Module, training: bool) -> None:
    """Raise if ``module`` (or a descendant) would draw random numbers in its forward."""
    for name, sub in module.named_modules():
        train = sub.training or (sub is module and training)
        if not train:
            continue
        where = f"{_name(module)}" + (f" (sub-module {name!r}: {_name(sub)})" if name else "")
        p = None
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            p = sub.p
        elif isinstance(sub, nn.RNNBase):
            p = sub.dropout if sub.num_layers > 1 else 0.0
        elif isinstance(getattr(sub, "dropout", None), (int, float)) and not isinstance(
            getattr(sub, "dropout", None), bool
        ):
            p = float(sub.dropout)
        if p:
            raise RuntimeError(
                f"backprism: {where} applies dropout (p={p}) in train mode; the generic rule "
                "recomputes the forward per sample and would draw different dropout masks "
                "than the real forward, so per-sample quantities would be wrong. Call "
                "model.eval() for this pass, or construct the module with dropout=0"
            )
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub is not module:
            raise RuntimeError(
                f"backprism: {where} contains BatchNorm in train mode, which mixes the samples "
                "of a batch; per-sample quantities are undefined. Call model.eval() for this "
                "pass, or use GroupNorm/LayerNorm"
            )


def _check_inputs(module: nn.Module, named: list[tuple[str | None, Any]]) -> None:
    """Module-specific layout requirements (padded batched RNN input; attention with the batch
    on axis 0)."""
    values = dict(named)
    if isinstance(module, nn.RNNBase):
        x = values.get("input", named[0][1] if named else None)
        if not isinstance(x, Tensor):
            raise NotImplementedError(
                f"backprism: {_name(module)} was called with a {type(x).__name__} input; the "
                "generic rule supports padded tensor input only (not PackedSequence). Pad the "
                "sequences and pass a [N, T, features] tensor with batch_first=True"
            )
        if x.dim() != 3:
            raise ValueError(
                f"backprism: {_name(module)} got an unbatched {x.dim()}-d input; per-sample "
                "quantities need a batch: pass [N, T, features] with batch_first=True"
            )


def _leaf_spec(module: nn.Module, name: str | None, x: Any, n: int, fold: int = 1) -> _Spec:
    """How the tensor ``x`` (argument ``name`` of ``module``) is split over the ``n`` samples
    (on a folded batch, ``fold > 1``: the tensors of ``fold·n`` rows, ``fold`` per sample;
    every other tensor is shared)."""
    if not isinstance(x, Tensor) or x.dim() == 0:
        return None
    if fold > 1:
        return ("rows", fold) if x.shape[0] == n * fold else None
    if isinstance(module, nn.RNNBase) and name == "input" and not module.batch_first:
        return ("axis", 1)  # [T, N, features]: the batch on axis 1
    if (
        isinstance(module, nn.MultiheadAttention)
        and name in ("query", "key", "value")
        and not module.batch_first
        and x.dim() == 3
    ):
        return ("axis", 1)  # [L, N, E]: the batch on axis 1
    if isinstance(module, nn.RNNBase) and name == "hx":
        if x.dim() == 3 and x.shape[1] == n:
            return ("axis", 1)
        raise ValueError(
            f"backprism: {_name(module)} initial state hx of shape {tuple(x.shape)} does not have "
            f"the batch ({n}) on axis 1; pass hx as [layers*directions, N, hidden]"
        )
    if isinstance(module, nn.MultiheadAttention) and name == "attn_mask":
        if x.dim() == 2:
            return None
        heads = module.num_heads
        if x.dim() == 3 and x.shape[0] == n * heads:
            return ("heads", heads)
        raise ValueError(
            f"backprism: {_name(module)} attn_mask of shape {tuple(x.shape)} is neither [L, S] "
            f"nor [N*num_heads, L, S] = [{n * heads}, L, S]"
        )
    if x.shape[0] == n:
        return ("axis", 0)
    return None


def _one_sample_failed(call: Call, err: BaseException) -> str:
    """Why the generic rule's run of ``call``'s module on one sample failed, and what to do."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    plain = (Tensor, int, float, bool, str, type(None))
    objects = sorted(
        {type(v).__name__ for v in tree_flatten((call.args, call.kwargs))[0]
         if not isinstance(v, plain)}
    )
    hint = (
        f" Its arguments include objects that every sample's run gets unchanged "
        f"({', '.join(objects)}); one that holds state of the whole batch (a generation "
        "cache: pass use_cache=False to the model) cannot serve a run on one sample."
        if objects else ""
    )
    return (
        f"backprism: the generic rule runs {_name(call.module)} on one sample at a time, and "
        f"that run failed ({first}).{hint} Register a Rule for the module type, or freeze its "
        "parameters (requires_grad_(False)) to analyse the rest"
    )


def _rows_differ(x: Tensor) -> bool:
    """Whether the rows (along axis 0) of ``x`` are not all equal."""
    return x.dim() > 0 and x.shape[0] > 1 and not bool((x == x[:1]).all())


def _named_arguments(module: nn.Module, call: Call) -> list[tuple[str | None, Any]]:
    """``(name, value)`` for every positional then keyword argument of the call."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - builtin forward without signature
        params = []
    names: list[str | None] = []
    for i in range(len(call.args)):
        p = params[i] if i < len(params) else None
        ok = p is not None and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        names.append(p.name if ok else None)
    return list(zip(names, call.args)) + list(call.kwargs.items())


class _Inputs:
    """The call's arguments split into per-sample leaves (batch moved to axis 0) and shared ones.

    ``sample(slices)`` rebuilds ``(args, kwargs)`` for one sample from the per-sample slices
    (leaves without their batch axis), restoring a batch axis of size 1.
    """

    def __init__(self, call: Call) -> None:
        module, n = call.module, call.batch_size
        named = _named_arguments(module, call)
        _check_inputs(module, named)
        self.n_args = len(call.args)
        self.keys = list(call.kwargs)
        self.leaves, self.treedef = tree_flatten(([v for _, v in named],))
        self.specs: list[_Spec] = []
        tensors = 0
        for name, value in named:
            for leaf in tree_flatten(value)[0]:
                if isinstance(leaf, Tensor):
                    tensors += 1
                    if tensors - 1 in call.shared_inputs and _rows_differ(leaf):
                        # the same for every sample, yet its rows differ: axis 0 is not the
                        # samples' even where it has their number (Funnel's [T, T] class mask
                        # with T = N); shared. (A batch of equal rows, a mask of ones
                        # [N, T], is split: each sample gets its row, the same either way.)
                        self.specs.append(None)
                        continue
                self.specs.append(_leaf_spec(module, name, leaf, n, call.fold))
        if len(self.specs) != len(self.leaves):  # pragma: no cover - defensive
            raise RuntimeError(f"backprism: could not flatten the inputs of {_name(module)}")
        #: per-sample leaves with the batch on axis 0 (``[N, ...]``)
        self.batched: list[Tensor] = []
        for leaf, spec in zip(self.leaves, self.specs):
            if spec is None:
                continue
            kind, k = spec
            if kind == "axis":
                self.batched.append(leaf.movedim(k, 0))
            else:
                self.batched.append(leaf.reshape(n, k, *leaf.shape[1:]))

    def sample(self, slices: list[Tensor] | tuple[Tensor, ...]) -> tuple[tuple, dict]:
        it = iter(slices)
        leaves = []
        for leaf, spec in zip(self.leaves, self.specs):
            if spec is None:
                leaves.append(leaf)
                continue
            s = next(it)
            kind, k = spec
            leaves.append(s.unsqueeze(k) if kind == "axis" else s)
        (values,) = tree_unflatten(leaves, self.treedef)
        args = tuple(values[: self.n_args])
        kwargs = dict(zip(self.keys, values[self.n_args :]))
        return args, kwargs

    def index(self, i: int) -> list[Tensor]:
        return [b[i] for b in self.batched]


def _sample_columns(g: Tensor, axis: int, n: int) -> Tensor:
    """Columns ``[M, *out.shape]`` with the samples on axis 1: ``[M, N, *rest]``, or for the
    rows of a folded batch on axis ``a`` (:func:`_rows_on`) ``[M, N, *before, k, *after]``."""
    if axis < 0:
        a = -axis  # (the rows' axis in g, after M)
        return g.unflatten(a, (n, g.shape[a] // n)).movedim(a, 1)
    return g.movedim(axis + 1, 1)


def _only_sample(c: Tensor, axis: int, n: int, i: int | None) -> Tensor:
    """Column ``c`` (``[*out.shape]``, batch axis ``axis`` as in :func:`_sample_columns`) kept
    on sample ``i``'s rows and zero elsewhere (all of it for ``i = None``)."""
    if i is None:
        return c
    out_axis = axis if axis >= 0 else -axis - 1
    size = c.shape[out_axis]
    k = size // n
    keep = torch.zeros(size, dtype=c.dtype, device=c.device)
    keep[i * k : (i + 1) * k] = 1
    shape = [1] * c.dim()
    shape[out_axis] = size
    return c * keep.view(shape)


def _one_cotangent(c: Tensor, axis: int, lead: int) -> Tensor:
    """One sample's columns in the layout of a one-sample output: the batch axis of size 1
    restored (after ``lead`` leading axes), or a folded batch's ``k`` rows as they are."""
    return c if axis < 0 else c.unsqueeze(axis + lead)


def _tensor_outputs(out: Any) -> list[Tensor]:
    return [o for o in tree_flatten(out)[0] if isinstance(o, Tensor)]


def _rows_on(axis: int) -> int:
    """The batch axis of an output on a folded batch whose ``fold·N`` rows are on ``axis``:
    ``-1 - axis`` (``-1``: axis 0, most outputs; ``-2``: axis 1, an RNN's ``h_n``)."""
    return -(axis + 1)


def _batch_axis(
    module: nn.Module, i: int, real: torch.Size, one: torch.Size, n: int, fold: int = 1
) -> int:
    """The axis of output ``i`` holding the batch: ``real`` has ``n`` where ``one`` has 1 (on
    a folded batch: ``real`` has ``fold·n`` rows where ``one`` has ``fold``, on axis 0 for
    most outputs, on axis 1 for an RNN's ``h_n``: :func:`_rows_on`)."""
    if len(real) == len(one):
        for a in range(len(real)):
            if (
                real[a] == n * fold
                and one[a] == fold
                and real[:a] == one[:a]
                and real[a + 1 :] == one[a + 1 :]
            ):
                return _rows_on(a) if fold > 1 else a
    raise RuntimeError(
        f"backprism: cannot find the batch axis of output {i} of {_name(module)}: the batched "
        f"call gave shape {tuple(real)}, a one-sample call {tuple(one)}. The generic rule needs "
        f"every tensor output to carry the batch ({n}) on one axis"
    )


def _memory_budget() -> int:
    bp = current_pass()
    return bp.ctx.memory_budget if bp is not None else 2**30


_KEEP = Inside()
_BATCH_NORM = nn.modules.batchnorm._BatchNorm
#: layer types whose functional forms (``F.linear`` …) the forward mode attributes in closed
#: form; a subclass that overrides ``forward`` releases its parameters to them
_FUNCTIONAL_FORMS = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
    nn.RMSNorm,
)


def _releases(cls: type) -> bool | None:
    """Whether modules of type ``cls`` (taking the generic rule) release their own parameters
    (:meth:`GenericRule.inside`): ``True`` for overriding subclasses of the layers in
    :data:`_FUNCTIONAL_FORMS`, ``None`` for types whose containers release (decided per
    module), ``False`` for RNNs (fused kernels taking the weights in a list), BatchNorm and
    InstanceNorm (``F.batch_norm`` in train mode mixes the samples, which only the BatchNorm
    rule's checks see; :meth:`GenericRule.inside` releases a BatchNorm subclass in eval mode
    with running statistics all the same) and ``nn.MultiheadAttention`` subclasses
    (sequence-first layouts)."""
    keep = (nn.RNNBase, nn.modules.batchnorm._NormBase, nn.MultiheadAttention)
    if issubclass(cls, keep):
        return False
    if issubclass(cls, _FUNCTIONAL_FORMS):
        return True
    return None


def _functional(call: Call) -> tuple[
    dict[str, Tensor], Callable[[dict[str, Tensor], tuple, dict], list[Tensor]], dict[str, str]
]:
    """The module of ``call`` as a function of its trainable parameters: ``(primals, run,
    aliases)``, ``run(params, args, kwargs)`` its forward's tensor outputs with ``params``
    (named as ``primals``) in place of them, ``aliases`` the primal's name of each name of
    ``call.params``.

    One primal per tensor: a tensor shared under several names of ``call.params`` is one
    primal under its first name, fed to every name (its gradient collects all these uses). Every
    other name of the module's tensors is a constant, one detached tensor per tensor. A name
    not in ``call.params`` may be tied to a primal (BertLMPredictionHead's ``bias`` is
    ``decoder.bias``): the call of the sub-module that ran (``decoder``) accounts for the uses
    under that name, so here it stays a constant — untied, passed explicitly with
    ``tie_weights=False``, so that Σ over calls is the gradient once."""
    module = call.module
    names, seen = [], {}
    for name, p in call.params.items():
        if id(p) in seen:
            continue
        seen[id(p)] = name
        names.append(name)
    primals = {k: call.params[k].detach() for k in names}
    aliases = {name: seen[id(p)] for name, p in call.params.items()}
    memo: dict[int, Tensor] = {}
    fixed: dict[str, Tensor] = {}
    for k, v in module.named_parameters(remove_duplicate=False):
        if k in call.params:
            continue
        if id(v) not in memo:
            memo[id(v)] = v.detach()
        fixed[k] = memo[id(v)]
    for k, v in module.named_buffers(remove_duplicate=False):
        if id(v) not in memo:
            memo[id(v)] = v.detach().clone()
        fixed[k] = memo[id(v)]

    def run(params: dict[str, Tensor], args: tuple, kwargs: dict) -> list[Tensor]:
        values = dict(fixed)
        for name, first in aliases.items():
            values[name] = params[first]
        with suspended():
            out = functional_call(module, values, args, kwargs, tie_weights=False)
        return _tensor_outputs(out)

    return primals, run, aliases


class GenericRule(Rule):
    """Per-sample VJPs of the module's own forward with ``torch.func`` (see module docstring).

    ``linear_in_params`` is ``False``: the rule cannot know how the parameters enter, so a
    Hessian-based extension must not assume linearity.
    """

    linear_in_params = False
    #: a call on a folded batch runs the module on each sample's rows together
    folds_rows = True

    def __init__(self) -> None:
        self._cache: tuple[weakref.ref, Any, weakref.ref, dict[str, Tensor]] | None = None
        self._releases: dict[type, bool | None] = {}

    def inside(self, module: nn.Module, args: tuple, kwargs: dict) -> Inside:
        """Release the module's own parameters to functional attribution (each use becomes a
        call where the parameter enters: ``F.linear``/``F.conv*``/``F.embedding``/
        ``F.layer_norm``… take their closed forms, other operations a stand-in re-running that
        operation alone) when the module is a container (it has sub-modules: the whole forward
        need not be re-run per sample for, e.g., a ViT's ``pos_embed`` or a ConvNeXt block's
        layer scale ``gamma``), or a subclass of a layer with a closed-form rule whose forward
        was overridden (timm's ``LayerNorm2d``, ``Conv2dSame``; a BatchNorm subclass such as
        timm's ``BatchNormAct2d`` in eval mode only). Other modules keep their parameters: the
        vmap of their own forward is the natural unit."""
        cls = type(module)
        if isinstance(module, _BATCH_NORM) and not has_rule(cls):
            # a BatchNorm subclass with a forward of its own (timm's BatchNormAct2d: the norm,
            # then an activation): in eval mode with running statistics its F.batch_norm is
            # attributed in closed form; otherwise (the batch's statistics, which mix the
            # samples) the module keeps its parameters and the engine's BatchNorm checks see it
            if (
                module.training or module.running_mean is None or module.running_var is None
                or self._releases.get(cls) is False  # (a release undone before: keep)
            ):
                return _KEEP
            release: bool | None = True
        else:
            release = False if has_rule(cls) else self._release(cls)  # a rule registered later
        if release is False or (release is None and not module._modules):
            return _KEEP
        names = tuple(
            k for k, p in module._parameters.items() if p is not None and p.requires_grad
        )
        return Inside(release=names) if names else _KEEP

    def keep(self, cls: type) -> None:
        """Modules of type ``cls`` keep their parameters from now on (a use of one could not
        be attributed where it enters: :func:`~backprism.engine.forward.undo_release`)."""
        self._releases[cls] = False

    def _release(self, cls: type) -> bool | None:
        if cls not in self._releases:
            self._releases[cls] = _releases(cls)
        return self._releases[cls]

    def is_linear_in_params(self, call: Call) -> bool:
        """A stand-in of one functional operation knows whether its parameter operands enter
        linearly (:class:`~backprism.engine.functional.OpModule`); a module is probed for
        being affine in each parameter and in its inputs (:func:`elementwise.multi_affine`:
        timm's ``LayerScale``), which no other module is taken to be (see
        :meth:`is_affine_in_params` for the weaker promise)."""
        return self._probed_affine(call, inputs=True)

    def is_affine_in_params(self, call: Call) -> bool:
        """A module probed for being affine in each parameter only
        (:func:`elementwise.multi_affine` with ``inputs=False``: a hand-written RMSNorm, a
        module calling ``F.layer_norm`` on its own scale and shift)."""
        return self._probed_affine(call, inputs=False)

    @staticmethod
    def _probed_affine(call: Call, inputs: bool) -> bool:
        """A stand-in's own ``linear_in_params``, else :func:`elementwise.multi_affine` of the
        module's functional call."""
        if hasattr(call.module, "linear_in_params"):
            return bool(call.module.linear_in_params)
        primals, run, _ = _functional(call)
        return elementwise.multi_affine(call, primals, run, inputs=inputs)

    # -- caching one (call, g) -------------------------------------------------------------
    def _lookup(self, call: Call, g: Any) -> dict[str, Tensor] | None:
        c = self._cache
        if c is None:
            return None
        g_ref, g_key, call_ref, result = c
        first = g[0] if isinstance(g, tuple) else g
        if call_ref() is call and g_ref() is first and g_key == _g_key(g):
            return result
        return None

    def _store(self, call: Call, g: Any, result: dict[str, Tensor]) -> None:
        """Keep ``result`` until ``g`` is freed (the engine drops ``g`` after the call)."""
        first = g[0] if isinstance(g, tuple) else g
        self_ref = weakref.ref(self)

        def drop(ref: weakref.ref) -> None:
            rule = self_ref()
            if rule is not None and rule._cache is not None and rule._cache[0] is ref:
                rule._cache = None

        self._cache = (weakref.ref(first, drop), _g_key(g), weakref.ref(call), result)

    # -- the rule --------------------------------------------------------------------------
    def per_sample(self, call: Call, g: Any) -> dict[str, Tensor]:
        r"""``Vₘₙ = (∂f(θ, xₙ)/∂θ)ᵀ g[m, n]`` for every parameter in ``call.params``:
        ``{name: [M, N, *p.shape]}``."""
        hit = self._lookup(call, g)
        if hit is not None:
            return hit
        result = self._compute(call, g)
        self._store(call, g, result)
        return result

    def refusal(self, call: Call, n: int) -> str | None:
        """Every tensor output must carry the batch on one axis (:func:`_batch_axis`): an
        output with no axis of size ``n`` (WavLM's attention returns its position bias with
        the batch folded into the heads, ``[N·H, T, T]``) is refused before the pass."""
        if call.fold > 1 or call.batch_size != n:
            return None
        if any(isinstance(a, nn.utils.rnn.PackedSequence) for a in call.args):
            return None  # (refused by its own check, naming PackedSequence)
        for i, shape in enumerate(call.out_shapes):
            if len(shape) and n not in tuple(shape):
                return (
                    f"backprism: output {i} of {_name(call.module)} has shape {tuple(shape)}, "
                    f"with no axis of the batch's size {n} (the batch folded with another axis "
                    "inside the module); the generic rule runs the module per sample and cannot "
                    "split that output. Register a Rule for the module type, or freeze its "
                    "parameters (requires_grad_(False)) to analyse the rest"
                )
        return None

    def _compute(self, call: Call, g: Any) -> dict[str, Tensor]:
        module, n = call.module, call.batch_size
        _check_randomness(module, call.training)
        gs = list(g) if isinstance(g, tuple) else [g]
        if len(gs) != len(call.out_shapes):
            raise RuntimeError(
                f"backprism: {_name(module)} produced {len(call.out_shapes)} tensor outputs but "
                f"received {len(gs)} gradients"
            )
        m = gs[0].shape[0]
        if getattr(module, "op", None) in elementwise.BROADCASTING_OPS:
            closed = elementwise.per_sample(call, gs)  # (None: the vmap below)
            if closed is not None:
                return closed

        primals, run, aliases = _functional(call)
        if not isinstance(module, _LOOP_TYPES) and not getattr(module, "op", None):
            closed = elementwise.affine_per_sample(call, gs, primals, run)  # (None: below)
            if closed is not None:
                return closed
        _announce(call)  # (the costly path: once per module type)
        if not any(isinstance(t, Tensor) for t in tree_flatten((call.args, call.kwargs))[0]):
            out = _without_inputs(run, primals, call, gs, m, n)
            return {
                name: out[first] if first == name else torch.zeros_like(out[first])
                for name, first in aliases.items()
            }
        inputs = _Inputs(call)
        if not inputs.batched:
            raise RuntimeError(
                f"backprism: no input of {_name(module)} has the batch size {n} on its batch "
                "axis; the generic rule cannot tell the samples apart"
            )

        # output layout from a one-sample forward
        try:
            with torch.no_grad():
                one = run(primals, *inputs.sample(inputs.index(0)))
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            raise RuntimeError(_one_sample_failed(call, err)) from err
        if len(one) != len(gs):
            raise RuntimeError(
                f"backprism: {_name(module)} gave {len(one)} tensor outputs on one sample but "
                f"{len(gs)} on the batch; the generic rule needs the same output structure"
            )
        axes = [
            _batch_axis(module, i, call.out_shapes[i], o.shape, n, call.fold)
            for i, o in enumerate(one)
        ]
        diff = [i for i, o in enumerate(one) if o.is_floating_point() or o.is_complex()]
        # columns per output as [M, N, *rest] (sample axis 1; on a folded batch [M, N, k, …])
        cols = [_sample_columns(gs[i], axes[i], n) for i in diff]

        budget = _memory_budget()
        per_col = n * (
            sum(p.numel() for p in primals.values()) + sum(c[0].numel() for c in cols)
        ) * gs[0].element_size()
        chunk = max(1, budget // max(per_col, 1))

        def one_sample(slices: list[Tensor], g_n: list[Tensor]) -> dict[str, Tensor]:
            args, kwargs = inputs.sample(slices)
            cot = tuple(_one_cotangent(c, axes[i], 1) for c, i in zip(g_n, diff))

            def f(params: dict[str, Tensor]) -> tuple[Tensor, ...]:
                outs = run(params, args, kwargs)
                return tuple(outs[i] for i in diff)

            _, pullback = vjp(f, primals)
            return vmap(lambda c: pullback(c)[0], chunk_size=min(chunk, m))(cot)

        samples = _Samples(inputs, primals, run, cols, axes, diff, n, m, call, gs)
        if isinstance(module, _LOOP_TYPES) or type(module) in _VMAP_BROKEN:
            out = samples.loop()
        else:
            try:
                with warnings.catch_warnings():
                    # torch's slow-fallback notices for ops without batching rules (e.g. CPU
                    # attention kernels) concern our recomputation, not the user's code
                    warnings.filterwarnings("ignore", message="There is a performance drop")
                    out = vmap(one_sample, in_dims=(0, 1), out_dims=1, randomness="error")(
                        inputs.batched, cols
                    )
                verified = (
                    type(module), m, n,
                    tuple((tuple(t.shape), t.dtype) for t in _leaves(inputs.batched)),
                )
                samples.check(out, spot=verified not in _VMAP_VERIFIED)
                _VMAP_VERIFIED.add(verified)
            except (RuntimeError, NotImplementedError) as err:
                if isinstance(err, BrokenBatchingError):
                    _VMAP_BROKEN.add(type(module))
                elif "random" in str(err).lower():
                    raise RuntimeError(
                        f"backprism: {_name(module)} draws random numbers in its forward; the "
                        "generic rule recomputes the forward per sample and cannot reproduce "
                        "them. Call model.eval() for this pass or remove the randomness"
                    ) from err
                # no batching rule, data-dependent control flow, ...: plain autograd per
                # sample. A genuine error in the module raises again there.
                try:
                    out = samples.loop()
                except Exception as loop_err:
                    raise loop_err from err
                if type(module) not in _WARNED:
                    _WARNED.add(type(module))
                    first = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
                    warnings.warn(
                        f"backprism: the generic rule cannot vmap {_name(module)} ({first}); "
                        "using a slower loop over samples instead (same results)",
                        RuntimeWarning,
                        stacklevel=2,
                    )

        result: dict[str, Tensor] = {}
        for name, first in aliases.items():
            v = out[first]
            result[name] = v if first == name else torch.zeros_like(v)
        return result


def _without_inputs(
    run: Callable[[dict[str, Tensor], tuple, dict], list[Tensor]],
    primals: dict[str, Tensor],
    call: Call,
    gs: list[Tensor],
    m: int,
    n: int,
) -> dict[str, Tensor]:
    r"""``Vₘₙ`` of a call without tensor inputs (the module of a relative position bias table,
    Hugging Face's BEiT), widened over the batch where its output met the samples
    (:mod:`backprism.engine.broadcast`): every sample's output is the module's one output
    ``s(θ)``, so ``Vₘₙ = (∂s/∂θ)ᵀ gₘₙ``, one ``vmap``-ped pull-back over the ``M·N`` columns
    (their scaling is ``g``'s). Widened over a batch folded with another axis (``k·N`` rows,
    sample-major: Swin's windows), ``gₘₙ`` is the sum over the sample's ``k`` rows."""
    one = run(primals, call.args, call.kwargs)
    diff = [i for i, o in enumerate(one) if o.is_floating_point() or o.is_complex()]

    def f(params: dict[str, Tensor]) -> tuple[Tensor, ...]:
        outs = run(params, call.args, call.kwargs)
        return tuple(outs[i] for i in diff)

    def per_sample(g: Tensor, shape: torch.Size) -> Tensor:
        # (a batch folded with windows, Swin's: a sample's k rows all carry s(θ), summed)
        k = g.shape[1] // n
        return g.reshape(m, n, k, *g.shape[2:]).sum(2).reshape(m * n, *shape)

    cols = tuple(per_sample(gs[i], one[i].shape).to(one[i].dtype) for i in diff)
    (flat,) = pull_back(f, (primals,), cols)
    return {k: v.reshape(m, n, *v.shape[1:]) for k, v in flat.items()}


@dataclass
class _Samples:
    """One generic-rule call's per-sample problem: ``Vₘₙ`` of the parameters ``primals`` for
    the columns ``cols`` (``[M, N, *rest]`` per differentiable output ``diff``, batch axes
    ``axes``), with ``run(params, args, kwargs)`` the module's forward on ``inputs``' samples.
    Computed by plain autograd one sample at a time (:meth:`loop`), which also checks what a
    ``vmap`` of it gave (:meth:`check`)."""

    inputs: _Inputs
    primals: dict[str, Tensor]
    run: Callable[[dict[str, Tensor], tuple, dict], list[Tensor]]
    cols: list[Tensor]
    axes: list[int]
    diff: list[int]
    n: int
    m: int
    call: Call
    #: the columns in the call's output layout, ``[M, *out.shape]`` per output
    gs: list[Tensor]

    def batch_vjp(self, k: int, sample: int | None = None) -> list[Tensor]:
        """``Σₙ Vₖₙ`` from plain autograd on the whole batch (one forward and backward of the
        call with column ``k``): what the per-sample results of a module that keeps the
        samples apart sum to, computed without running it on one sample; with ``sample``,
        ``Vₖᵢ`` for ``i = sample``, the column kept on that sample's rows only (its gradient
        within the batch)."""
        keys = list(self.primals)
        with torch.enable_grad():
            params = {key: v.clone().requires_grad_(True) for key, v in self.primals.items()}
            outs = self.run(params, self.call.args, self.call.kwargs)
            used = [
                (outs[j], _only_sample(self.gs[j][k], axis, self.n, sample))
                for j, axis in zip(self.diff, self.axes)
                if outs[j].requires_grad
            ]
            grads = (
                torch.autograd.grad(
                    [o for o, _ in used],
                    list(params.values()),
                    [c.to(o.dtype) for o, c in used],
                    allow_unused=True,
                )
                if used
                else (None,) * len(keys)
            )
        return [torch.zeros_like(params[key]) if g is None else g for key, g in zip(keys, grads)]

    def _sum_error(self, out: dict[str, Tensor], k: int) -> tuple[str, float, float] | None:
        """The first parameter whose ``Σₙ out[k, n]`` differs from :meth:`batch_vjp` beyond
        ``10·√eps`` of the larger norm: ``(name, error, scale)``; ``None`` if all agree."""
        for key, want in zip(self.primals, self.batch_vjp(k)):
            got = out[key][k].sum(0)
            scale = max(
                float(torch.linalg.vector_norm(want)), float(torch.linalg.vector_norm(got))
            )
            err = float(torch.linalg.vector_norm((got - want.to(got.dtype)).reshape(-1)))
            if err > 10 * torch.finfo(got.dtype).eps ** 0.5 * max(scale, 1e-30):
                return key, err, scale
        return None

    def check_sum(self, out: dict[str, Tensor]) -> None:
        """Refuse a result of :meth:`loop` (which calls this) whose samples do not sum to the
        batch's gradient: the module computes differently on one sample than within the batch
        (a PyTorch kernel that is wrong at batch size 1, as eval-mode BatchNorm's backward on
        the CPU is for some memory layouts in torch 2.13), so its one-sample gradients cannot
        be trusted."""
        bad = self._sum_error(out, 0)
        if bad is not None:
            key, err, scale = bad
            raise RuntimeError(
                f"backprism: the generic rule's per-sample gradients of {_name(self.call.module)}"
                f" for {key!r}, computed one sample at a time, do not sum to the gradient of "
                f"the whole batch (error {err:.3g}, scale {scale:.3g}): the module computes "
                "differently on one sample than within the batch (a PyTorch kernel that is "
                "wrong at batch size 1, or samples that interact), so its per-sample results "
                "are refused. Register a closed-form Rule for the module type "
                "(backprism.rules.register_rule), or run it in a layout that avoids the kernel"
            )

    def check(self, out: Any, spot: bool = True) -> None:
        r"""Raise :class:`BrokenBatchingError` if the vmapped ``Vₘₙ`` cannot be right.

        A broken batching rule of an operator (``prelu``'s backward in torch 2.13 under nested
        ``vmap``) returns a result with the sample axis of the outer ``vmap`` leaked into the
        inner one: shape ``[N, N, *θ]`` for ``[M, N, *θ]`` with the right values on the
        diagonal only. Two checks, both cheap next to the ``vmap`` itself:

        * every parameter's result has the shape ``[M, N, *θ.shape]``;
        * spot check: the entries ``(m, n) = (0, N−1)`` and ``(M−1, 0)`` — off the diagonal
          ``m = n`` wherever ``N > 1`` — equal the vector-Jacobian product of plain autograd
          on the whole batch with the column kept on that sample's rows (one forward and one
          backward each; not on the sample alone: some kernels are wrong at batch size 1, as
          eval-mode BatchNorm's CPU backward in torch 2.13 for some memory layouts), up to
          ``10·√eps`` of the largest per-entry norm; once per module type, sizes and
          input shapes (``spot``: a batching rule is the same in every call of that kind).
        """
        m, n = self.m, self.n
        for key, p in self.primals.items():
            v = out.get(key) if isinstance(out, dict) else None
            want = (m, n, *p.shape)
            if not isinstance(v, Tensor) or tuple(v.shape) != want:
                got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise BrokenBatchingError(
                    f"its vmap gave per-sample gradients of shape {got} for {key!r} instead "
                    f"of {want}: an operator's batching rule is broken"
                )
        if not spot:
            return
        keys = list(self.primals)
        for i, k in sorted({(n - 1, 0), (0, m - 1)}):
            ref = self.batch_vjp(k, sample=i)
            for key, r in zip(keys, ref):
                v = out[key]
                got = v[k, i]
                scale = torch.linalg.vector_norm(v.reshape(m * n, -1), dim=1).amax()
                tol = 10 * torch.finfo(v.dtype).eps ** 0.5
                err = torch.linalg.vector_norm((got - r).reshape(-1))
                if bool(err > tol * scale):
                    raise BrokenBatchingError(
                        f"its vmap gave per-sample gradients for {key!r} that differ from "
                        f"plain autograd on the batch for sample {i}, column {k} (error "
                        f"{float(err):.3g}, "
                        f"scale {float(scale):.3g}): an operator's batching rule is broken"
                    )

    def sample_grads(self, i: int, columns: list[int]) -> list[list[Tensor]]:
        """``Vₖᵢ`` by plain autograd for sample ``i`` and each column ``k`` in ``columns``:
        ``[len(columns)][len(primals)]`` tensors of the parameters' shapes."""
        keys = list(self.primals)
        args, kwargs = self.inputs.sample(self.inputs.index(i))
        with torch.enable_grad():
            params = {k: v.clone().requires_grad_(True) for k, v in self.primals.items()}
            outs = self.run(params, args, kwargs)
            outs = [outs[j] for j in self.diff]
        per_k = []
        for k in columns:
            cot = [_one_cotangent(c[k, i], self.axes[j], 0) for c, j in zip(self.cols, self.diff)]
            used = [(o, c) for o, c in zip(outs, cot) if o.requires_grad]
            if used:
                grads = torch.autograd.grad(
                    [o for o, _ in used],
                    list(params.values()),
                    [c for _, c in used],
                    retain_graph=True,
                    allow_unused=True,
                )
            else:
                grads = (None,) * len(keys)
            per_k.append(
                [torch.zeros_like(params[key]) if gr is None else gr
                 for key, gr in zip(keys, grads)]
            )
        return per_k

    def loop(self) -> dict[str, Tensor]:
        """Plain autograd, one sample and one column at a time (for non-vmappable modules),
        refused unless the samples sum to the batch's gradient (:meth:`check_sum`)."""
        keys = list(self.primals)
        per_n: list[list[Tensor]] = []
        for i in range(self.n):
            per_m = self.sample_grads(i, list(range(self.m)))
            per_n.append([torch.stack([pm[j] for pm in per_m]) for j in range(len(keys))])
        out = {key: torch.stack([pn[j] for pn in per_n], 1) for j, key in enumerate(keys)}
        self.check_sum(out)
        return out


def _announce(call: Call) -> None:
    """Warn, once per module type (or functional op) and process, that ``call`` and the other
    calls of the current backward pass without a closed-form rule take the generic rule."""
    if call.name in _ANNOUNCED or getattr(call.module, "vmap_is_closed_form", False):
        return
    names = {call.name}
    bp = current_pass()
    if bp is not None:
        for other in bp.calls:
            if (
                other.params
                and other.name not in _ANNOUNCED
                and not getattr(other.module, "vmap_is_closed_form", False)
                and type(get_rule(other.module)) is GenericRule
            ):
                names.add(other.name)
    _ANNOUNCED.update(names)
    shown = ", ".join(sorted(names))
    warnings.warn(
        f"backprism: no closed-form rule for {shown}; the generic torch.func rule computes "
        "their per-sample quantities by a vmap of each module's forward and vector-Jacobian "
        "product over the samples (and the curvature columns), which costs far more time and "
        "memory than a closed form. Register a Rule for the module type with "
        "backprism.rules.register_rule to avoid it (shown once per module type)",
        GenericRuleWarning,
        stacklevel=2,
    )


def _g_key(g: Any) -> tuple:
    gs = g if isinstance(g, tuple) else (g,)
    return tuple((id(x), tuple(x.shape)) for x in gs)


set_generic_rule(GenericRule())
