"""Shared engine state and the records that travel with the autograd graph.

This module is the bottom of the engine: it imports nothing else of backprism. Two kinds of
state exist, and neither is global:

* **Forward-time state, per thread** (:data:`FORWARD`): the stack of hooked modules currently
  in their forward, the nesting of extended root models, ``suspended()`` and the "forward not
  recorded" marker. Forward passes run on the caller's thread, so a ``threading.local`` is the
  right owner; two threads running two models never see each other's stacks.
* **Records owned by the autograd graph.** What a forward captures — a :class:`Call` per call
  of a parameter-owning module or per functional use of a parameter, a :class:`LossRecord`
  per call of an extended loss, a :class:`RootRecord` per top-level forward of an extended
  model — is stored in the ``metadata`` dict of the autograd node that produced the call's
  output (:data:`CALLS`, :data:`LOSS`, :data:`ROOT`). The graph owns them, so they are freed
  with it: a dropped model, an abandoned forward or a finished backward leaves nothing behind.
  A backward pass finds exactly the records of its own graph by walking it from its roots
  (:mod:`backprism.engine.graph`).

Records never hold a tensor that is downstream of the node that owns them (that would be a
reference cycle through a C++ object, which Python's collector cannot break): a call keeps its
detached inputs and the gradient edges of its inputs, both upstream of its output.

The active :class:`~backprism.engine.collect.collect` is per thread and per context
(``contextvars``): it decides, at forward time, whether nonlinearities must be recorded, and is
the context a backward pass started on this thread reports to. Hooks that fire during a
backward pass (possibly on autograd's device threads) never look it up: they reach their pass
through the record they hold (``call.pass_``), which the pass sets when it starts and clears
when it ends.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = [
    "AXIS",
    "BASES",
    "CALLS",
    "ESCAPED",
    "FORWARD",
    "FORWARD_LISTENERS",
    "FREE",
    "LOSS",
    "MODE_FREE",
    "NO_INPUT",
    "PARAM_IDS",
    "ROOT",
    "SHARED",
    "SITES",
    "UNATTRIBUTED",
    "VIEW",
    "Call",
    "Inside",
    "Kept",
    "LossRecord",
    "RootRecord",
    "active",
    "expand_rows",
    "forget_mode_free",
    "param_view",
    "sequence_first",
    "set_active",
    "suspended",
]

#: node-metadata keys (values: lists of records produced by that node)
CALLS = "backprism.calls"  # [(Call, output index, output_nr)]
LOSS = "backprism.loss"  # LossRecord
ROOT = "backprism.root"  # RootRecord
SITES = "backprism.sites"  # [Site] (Hessian residual sites and refusals, see engine.residual)
#: on the node of the tensor a call's output is a reshaping view of (a Linear's 3-d output of
#: its 2-d product): ``[(Call, output_nr)]``, where the graph reads the call when that tensor
#: was modified in place through a view (engine.graph)
BASES = "backprism.bases"
#: an operation of the forward mode in which parameters met each other before any per-sample
#: tensor (``a * b`` of two parameters): what they met, for the graph check's refusal
UNATTRIBUTED = "backprism.unattributed"
#: an operation of the forward mode on a vector joined from released parameters after its
#: module's forward ended (``engine.functional._joined``): the parameters' names, for the
#: graph check's refusal (that use is not attributed)
ESCAPED = "backprism.escaped"
#: tensor attribute: the batch axis of an activation whose batch is not on axis 0 (the outputs
#: of a ``batch_first=False`` RNN, and what is computed from them), ``-1`` if unknown
AXIS = "_backprism_batch_axis"
#: tensor attribute: ``(call, origin, replay)`` for the output of a call on inputs that need no
#: gradient (``origin`` ``None``: the tensor itself) and what is computed from it alone by view
#: and elementwise operations with constants (``replay(origin) == tensor``), see
#: :mod:`backprism.engine.broadcast`
SHARED = "_backprism_shared"
#: tensor attribute on a tensor known to be the same for every sample — a parameter or buffer of
#: an extended model, the result of a factory function (``torch.arange``), of an operation of
#: the forward mode or a call whose tensor operands all are (a copy of a size-1 axis 0 over the
#: batch, ``expand``/``repeat``, makes it per-sample): the tuple of the calls it was computed
#: by, see :mod:`backprism.engine.broadcast`
FREE = "_backprism_free"
#: tensor attribute of a value shared by all samples (:data:`SHARED`) computed from a shared
#: call's output through a nonlinear operation (its name): its copies per sample replay that
#: operation without the forward mode, so their Hessian terms are not recorded
CURVED = "_backprism_curved"
#: tensor attribute on a view of an extended parameter that the forward mode follows (``p[0:k]``,
#: ``p.t()``): ``(parameter, rebuild, kind)`` with ``rebuild(p)`` the view, see
#: :mod:`backprism.engine.functional`
VIEW = "_backprism_view"
#: ``Call.unsplit`` of a call without tensor inputs until it is widened over the samples
NO_INPUT = "no tensor input"


#: ids of extended parameters (filled by ``extend``); a tensor whose id is neither here nor in
#: ``FORWARD.view_ids`` (views of them made in this thread's forward) is neither
PARAM_IDS: set[int] = set()


def param_view(a: Any) -> tuple[nn.Parameter, Callable[[Tensor], Tensor], str] | None:
    """``(parameter, rebuild, kind)`` if ``a`` is an extended parameter that needs a gradient
    or a view of one (:data:`VIEW`).

    Called on every operand of every operation of an extended forward: set lookups first,
    then plain attribute lookups (``isinstance(a, nn.Parameter)`` runs a Python-level
    metaclass check; an id may be reused by another tensor, so the attributes decide)."""
    i = id(a)
    if i not in PARAM_IDS and i not in FORWARD.view_ids:
        return None
    if not isinstance(a, Tensor):
        return None
    if getattr(a, "_backprism_hooked", False):
        return (a, _identity, "param") if a.requires_grad else None  # type: ignore[return-value]
    return getattr(a, VIEW, None)


def _identity(q: Tensor) -> Tensor:
    return q


def expand_rows(x: Any, n: int) -> Any:
    """``x`` with an axis 0 of size 1 expanded to ``n`` rows (an input of a call widened over
    the samples), anything else as it is."""
    if isinstance(x, Tensor) and x.dim() and x.shape[0] == 1:
        return x.expand(n, *x.shape[1:])
    return x


def sequence_first(module: nn.Module) -> bool:
    """A module that takes its batch from axis 1 of a 3-d input by construction: an RNN or
    ``nn.MultiheadAttention`` with ``batch_first=False``."""
    return isinstance(module, (nn.RNNBase, nn.MultiheadAttention)) and not module.batch_first


#: creation order of calls: a call is recorded after its forward returned, so every call whose
#: output another's input was computed from has a smaller number (a topological order)
_CALL_SEQ = itertools.count()


@dataclass(eq=False)
class Call:
    """What the engine keeps of one forward call of an extended module (or of one functional
    use of a parameter, whose ``module`` is then a stand-in built by
    :mod:`backprism.engine.functional`).

    Attributes:
        module: the module that was called.
        args: the positional arguments, tensors detached (they share storage with the originals).
        kwargs: the keyword arguments, tensors detached.
        out_shapes: shapes of the tensor outputs, flattened in ``tree_flatten`` order.
        batch_size: ``N``, the size of the batch axis of the first tensor input.
        training: ``module.training`` at call time.
        versions: ``(tensor, version)`` of the inputs at call time (in-place checks).
        params: parameters this call is responsible for, by name relative to ``module``
            (``"weight"``, or ``"out_proj.weight"`` for a descendant used functionally).
        input_edges: gradient edges of the inputs that require grad (where the call's part of
            the graph ends, for attributing parameter uses).
        dtype: the autocast dtype the call ran under, or ``None``.
        unrecorded: the forward ran without recording nonlinearities (DiagHessian refuses it).
        batch_axis: the axis of the first input (and of the outputs) that holds the batch, as
            the module saw it; ``args`` hold that input with the batch moved to axis 0, and the
            engine moves the output gradients' batch axis the same way (rules with
            ``moves_batch_axis`` only: Linear, Embedding, LayerNorm, RMSNorm).
        assumed_axis: the batch axis 0 was assumed (an input computed without any known
            layout), not followed from a ``batch_first=False`` RNN.
        layout_error: why the call's input has no batch on axis 0 (it comes from a
            ``batch_first=False`` RNN): per-sample quantities and curvature refuse the call.
        superseded: replaced by a call widened to the batch (a call whose output all samples
            share, broadcast over them, see :mod:`backprism.engine.broadcast`); ignored.
        widened_from: for such a widened call, the call it replaces.
        meets: for such a widened call, the gradient edges of the per-sample tensors it was
            broadcast against (their axis 0 holds its rows): where that axis folds the samples
            with another axis (Swin's windows), the backward pass reads the fold from them.
        repeats: for such a widened call, ``(g, edges)`` for each consumer that met its copies
            per sample repeated ``g`` times (``[N, ...]`` to ``[N·g, ...]``, sample-major) in
            the per-sample tensors whose gradient edges are ``edges`` (Swin V2's position-bias
            MLP met by the windows' rows): the backward pass checks that their axis 0 folds the
            samples so.
        unsplit: for a call on inputs that need no gradient, why its output has no
            per-sample split (a phrase for the refusal of the backward pass: where it met the
            samples other than by widening, an in-place operation, an input that could not be
            widened), or :data:`NO_INPUT`; the backward pass refuses it.
        whole_batch: set while a backward pass treats the batch as one sample (BatchNorm in
            train mode mixes the samples; only whole-batch curvature is defined): rules may
            then use batch statistics (see ``BackwardPass.whole_batch``).
        live: ``(args, kwargs)`` as passed, not detached (upstream of the call's output, so no
            reference cycle): what rules see in a ``create_graph=True`` pass, whose first-order
            results are differentiable.
        owner: for a functional use of a parameter that a module released
            (:attr:`Inside.release`), that module: ``extension_hook`` runs for it once all its
            calls are done.
        inner: what the forward kept from inside the call at its rule's request
            (:meth:`~backprism.engine.rule.Rule.inside`), or ``None``.
        fold: ``g > 1`` if the call's batch axis holds ``g·N`` rows in sample-major groups of
            ``g`` (a batch folded with another axis, :mod:`backprism.engine.fold`), set by the
            backward pass that found it.
        pass_: the backward pass processing this call right now (set and cleared by it).
        seq: the call's place in the order calls were recorded (:data:`_CALL_SEQ`); a call
            widened over the samples keeps the number of the call it replaces.
        shared_inputs: positions, among the call's tensor inputs (in ``tree_flatten`` order of
            ``(args, kwargs)``), of those the forward mode found the same for every sample
            (:data:`FREE`: a mask built with ``torch.ones``, indices from ``torch.arange``):
            not split over the samples even where their axis 0 has the batch's size.
        rebased: set by the graph walk of a pass where the call's one output is a reshaping
            view of a tensor that was modified in place through a view: its output edge is
            that tensor's node (:data:`BASES`), whose gradients the pass reshapes to the
            output's shape.
    """

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out_shapes: list[torch.Size]
    batch_size: int
    training: bool
    versions: list[tuple[Tensor, int]] = field(default_factory=list)
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    input_edges: list[Any] = field(default_factory=list)
    dtype: torch.dtype | None = None
    unrecorded: bool = False
    superseded: bool = False
    batch_axis: int = 0
    assumed_axis: bool = True
    layout_error: str | None = None
    live: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    whole_batch: bool = False
    inner: Kept | None = None
    owner: nn.Module | None = None
    fold: int = 1
    pass_: Any = None
    widened_from: Call | None = None
    meets: tuple[Any, ...] = ()
    repeats: tuple[tuple[int, tuple[Any, ...]], ...] = ()
    unsplit: str | None = None
    seq: int = field(default_factory=lambda: next(_CALL_SEQ))
    shared_inputs: frozenset[int] = frozenset()
    rebased: bool = False

    @property
    def hook_module(self) -> nn.Module:
        """The module ``extension_hook`` is called with for this call's results."""
        return self.module if self.owner is None else self.owner

    @property
    def input(self) -> Tensor:
        """The first positional tensor argument (the input of single-input layers)."""
        for a in self.args:
            if isinstance(a, Tensor):
                return a
        raise RuntimeError(f"{type(self.module).__name__} was called without a tensor input")

    @property
    def name(self) -> str:
        """The module's type name (or the functional op it stands for)."""
        return getattr(self.module, "_backprism_name", None) or type(self.module).__name__

    @property
    def input_axis(self) -> int:
        """The axis of the first input (as passed, before ``args`` moved it) that the call
        takes the samples from: 1 for a sequence-first module on a 3-d input, else
        :attr:`batch_axis`."""
        if sequence_first(self.module) and self.out_shapes and len(self.out_shapes[0]) == 3:
            return 1
        return self.batch_axis

    def output_axes(self) -> list[int]:
        """The axis that holds the samples in each output (``out_shapes`` order): an RNN's
        ``h_n``/``c_n`` ``[layers, N, H]`` hold them on axis 1 whatever ``batch_first``
        says, its output on axis 0 or 1; ``nn.MultiheadAttention(batch_first=False)``'s output
        on axis 1, its averaged weights ``[N, L, S]`` on axis 0; other calls on
        :attr:`batch_axis` in every output."""
        k = len(self.out_shapes)
        batched = bool(self.out_shapes) and len(self.out_shapes[0]) == 3
        if isinstance(self.module, nn.RNNBase) and batched:
            return [0 if self.module.batch_first else 1] + [1] * (k - 1)
        if sequence_first(self.module) and batched:  # (MultiheadAttention)
            return [1] + [0] * (k - 1)
        return [self.batch_axis] * k

    def check_unmodified(self) -> None:
        """Raise if an input was modified in place between forward and backward."""
        for t, v in self.versions:
            if t._version != v:
                raise RuntimeError(
                    f"backprism: an input of {self.name} was modified in place after the forward "
                    "pass; the quantities would be computed from the modified values. Avoid "
                    "in-place operations on tensors fed to extended modules (e.g. use "
                    "nn.ReLU(inplace=False) before them)."
                )


class Inside(NamedTuple):
    """What a rule asks of the forward of one call (:meth:`~backprism.engine.rule.Rule.inside`).

    Attributes:
        release: names of the module's parameters that the call does not claim: their uses
            inside the forward are attributed as functional uses (calls of their own, captured
            where the parameter enters, with the gradients of the real backward pass); where
            the batch is not on axis 0 there, the replacement function marks it (:data:`AXIS`).
        keep: names of parameters the call keeps claiming whose ``F.linear`` input and output
            the forward keeps (:class:`Kept`), so that the rule need not recompute them.
        functions: replacements, by name, for functions the module calls that dispatch
            ``__torch_function__`` for their whole body (``F.multi_head_attention_forward``):
            the forward mode sees such a function as one operation, so it runs the replacement
            instead — the same computation — called as ``replacement(mode, *args, **kwargs)``;
            it runs the operations where parameters enter (and any whose kernel the mode
            chooses, such as attention) inside ``with mode:``, so that the mode sees them, and
            the rest without the mode's per-operation cost. A replacement returns
            ``NotImplemented`` for arguments it does not cover (the function then runs as one
            operation).
    """

    release: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    functions: Mapping[str, Callable[..., Any]] | None = None


@dataclass(eq=False)
class Kept:
    """What the forward kept from inside one call (see :class:`Inside`).

    Attributes:
        linear: parameter name → ``(x, y_ptr, y_shape)`` of the one ``F.linear(x, p, ...)``
            that used it (``x`` detached; ``None`` if the parameter was used more than once).
        outs: ``(data_ptr(), stride())`` of the call's tensor outputs, to check how ``y``
            became them.
    """

    linear: dict[str, tuple[Tensor, int, torch.Size] | None] = field(default_factory=dict)
    outs: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


class LossRecord:
    """One call of an extended loss: its inputs (the differentiable ones not detached; they are
    upstream of the loss output whose node holds this record). ``functional``: read back from
    the graph of a loss computed without an extended module
    (:mod:`backprism.engine.loss_nodes`)."""

    __slots__ = ("functional", "inputs", "layout_error", "module", "output_nr", "pass_")

    def __init__(self, module: nn.Module, inputs: list[Any], output_nr: int = 0) -> None:
        self.module = module
        self.inputs = inputs
        #: why an input has no batch on axis 0 (curvature refuses the loss), or ``None``
        self.layout_error: str | None = None
        #: the loss output's index among its node's outputs
        self.output_nr = output_nr
        self.pass_: Any = None
        self.functional = False


class RootRecord:
    """One top-level forward of an extended model: the model and its detached inputs (for
    chain-wise recursions such as KFRA), whether the forward mode recorded its nonlinearities
    (``recorded``) and the nodes that produced its differentiable inputs (``stops``: the
    forward's region of the graph ends there)."""

    __slots__ = ("args", "batch", "modeless", "module", "recorded", "stops")

    def __init__(
        self,
        module: nn.Module,
        args: tuple,
        recorded: bool = False,
        stops: tuple = (),
        modeless: frozenset[str] | None = None,
        batch: int | None = None,
    ) -> None:
        self.module = module
        self.args = args
        self.recorded = recorded
        self.stops = stops
        #: axis 0's size of the forward's first input tensor, positional or keyword (its batch)
        self.batch = batch
        #: for a forward run without the forward mode (:data:`MODE_FREE`), the operations the
        #: model's recorded forward had without refusal; ``None`` otherwise
        self.modeless = modeless


class _ForwardState(threading.local):
    """Per-thread forward-time state (see the module docstring)."""

    def __init__(self) -> None:
        #: one frame per hooked module currently in its forward: [module, ids of hooked
        #: descendants that ran during it, ids of the parameters it releases to functional
        #: attribution (``Inside.release``), ``{parameter id: name}`` of the ``F.linear``
        #: uses it keeps (``Inside.keep``), the :class:`Kept` record being filled, the
        #: replacement functions (``Inside.functions``) or ``None``, whether the module is a
        #: leaf (no sub-modules), the forward mode entered for this module's forward alone or
        #: ``None``, the calls captured for its released parameters with their output nodes
        #: (``[(call, nodes)]``, or ``None``), the batch size of its first input and the ids of
        #: its tensor arguments (or ``None``),
        #: whether a use of a released parameter could not be attributed (the release is then
        #: undone: :func:`~backprism.engine.forward.undo_release`), and, while a sub-module
        #: called in the forward of a module releasing without replacement functions runs,
        #: ``(id of that sub-module, whether its local mode was left)``, else ``None``
        #: (:func:`~backprism.engine.forward.pause_body`)]
        self.call_stack: list[list[Any]] = []
        #: extended root models currently in their forward (outermost first)
        self.root_stack: list[nn.Module] = []
        #: axis 0's size of the top-level forward's first input tensor (its batch), or None
        self.root_batch: int | None = None
        self.suspended = 0
        #: > 0 inside a top-level forward whose nonlinearities are deliberately not recorded
        self.unrecorded = 0
        #: > 0 inside a top-level forward whose nonlinearities are recorded by the mode
        self.recording = 0
        #: the forward modes of the top-level forwards in progress (engine.functional)
        self.modes: list[Any] = []
        #: this forward produced activations with the batch off axis 0 (``AXIS``): the
        #: forward mode follows their batch axis through operations
        self.layouts = False
        #: ids of the views of extended parameters made during this thread's top-level
        #: forward (``engine.functional``)
        self.view_ids: set[int] = set()
        #: ``torch.cat`` results of released parameters and constants made in this top-level
        #: forward, in the forward of the module releasing their parameters
        #: (``engine.functional._joined``): ``id(tensor) → [that module's frame, whether it
        #: was used as a linear layer's bias, whether that forward has ended, the tensor]``
        self.joined: dict[int, list[Any]] = {}
        #: shared calls widened over the samples in this top-level forward
        #: (engine.broadcast): ``(id(call), N, batch_one) → (call, copies, widened call)``,
        #: reused by every later consumer of the same call, which so stays one call
        self.widened: dict[tuple[int, int, bool], tuple[Any, Tensor, Any]] = {}
        #: widened calls whose rows met only constants so far (engine.broadcast): their
        #: copies are followed to the first per-sample tensor they meet
        self.rows_pending = 0
        #: what the forward mode did in this top-level forward that module hooks alone would
        #: not (functional parameter uses, nonlinearity records outside activation modules,
        #: broadcast calls); ``0`` after a forward that did not need the mode
        self.acted = 0
        #: of :attr:`acted`, the Hessian residual records of elementwise nonlinearities (which
        #: only the DiagHessian family uses)
        self.residual_acts = 0
        #: of :attr:`acted`, widenings a backward pass can do as well (a call of batch size 1
        #: added to the samples as it is: ``tok + pos``, see ``BackwardPass._widen_batch_one``)
        self.deferred_acts = 0
        #: in a top-level forward run without the mode: :data:`MODE_FREE`'s entry for it
        self.free_ops: frozenset[str] | None = None
        #: a top-level forward without the mode inside a ``collect()`` that records no
        #: nonlinearities is in progress (it counts once in :attr:`unrecorded`)
        self.free_unrecorded = False


FORWARD = _ForwardState()

#: ``(enter, exit)`` callables run around every top-level forward of an extended root model
#: (e.g. the mode recording nonlinearities and functional parameter uses); ``exit`` also gets
#: the forward's output.
FORWARD_LISTENERS: list[
    tuple[Callable[[nn.Module], None], Callable[[nn.Module, Any], None]]
] = []

#: Extended root models whose forward does not need the forward mode, per ``training`` flag:
#: the names of the graph nodes (:func:`backprism.engine.residual.node_op`) its recorded
#: forward produced, or ``None`` where the mode is needed (``engine.functional``). Keys
#: ``("unrecorded", training)`` hold what forwards inside ``collect()`` that record no
#: nonlinearities learned, for such forwards alone.
MODE_FREE: weakref.WeakKeyDictionary[nn.Module, dict[Any, frozenset[str] | None]] = (
    weakref.WeakKeyDictionary()
)


def forget_mode_free(module: nn.Module) -> None:
    """Record every later forward of ``module`` with the forward mode."""
    MODE_FREE[module] = {True: None, False: None}


@contextmanager
def suspended() -> Iterator[None]:
    """Forward passes inside this context are not captured (rules re-running a forward)."""
    FORWARD.suspended += 1
    try:
        yield
    finally:
        FORWARD.suspended -= 1


_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("backprism_collect", default=None)


def active() -> Any:
    """The :class:`~backprism.engine.collect.collect` active in this thread/context, if any."""
    return _ACTIVE.get()


def set_active(ctx: Any) -> contextvars.Token:
    """Make ``ctx`` the active collect of this context; returns the token to reset it."""
    return _ACTIVE.set(ctx)


def reset_active(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)
