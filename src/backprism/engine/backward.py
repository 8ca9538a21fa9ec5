"""One backward pass inside :func:`~backprism.engine.collect.collect`: checks, then results.

A :class:`BackwardPass` is created by ``collect`` right before the autograd engine runs, from
the :class:`~backprism.engine.graph.GraphView` of the graph it is about to run through:

1. :meth:`BackwardPass.check` refuses, with a clear error, everything the extensions cannot
   compute correctly — before any result or ``.grad`` is written;
2. :meth:`BackwardPass.start` deletes the extensions' attributes left by earlier passes on the
   parameters of the models involved (a parameter that gets no result keeps no stale one) and
   marks the records of this graph, so that their hooks (which may run on autograd's device
   threads) reach this pass and no other;
3. during the pass, the extended loss's output hook fires first (:meth:`on_loss_grad`): if
   second-order extensions are active it builds the loss-Hessian square-root columns and
   pushes them, in chunks, to every captured call output upstream of that loss with one batched
   vector-Jacobian product (:mod:`backprism.engine.columns`); each call's rule reduces them;
   then every call output's hook receives ``∂L/∂out`` (:meth:`on_output_grad`) and its rule
   computes the first-order statistics; once a module is done, ``extension_hook(module)`` runs;
4. :meth:`end` finishes parameters used by several calls, runs the hooks still due and
   unmarks the records.

**Distributed data parallelism** (:mod:`backprism.engine.distributed`): when :meth:`check`
finds the pass distributed (DDP, or ``collect(process_group=...)``), :meth:`end` replaces the
local results by the global batch's before the hooks run; ``extension_hook`` is then deferred
to the end of the pass, and ``needs_param_grad`` partials are finished with the global gradient.

**Several forwards, one backward.** The pass covers every call its graph contains, whatever
forward produced it. A sample index ``n`` that appears in several forwards is one sample: its
contributions add (``grad_batch[n] = ∇(Σ_f ℓ_{f,n})/N``) and statistics are taken of the sum. A
parameter used by several calls of the pass (tied weights too) gets quadratic statistics of the
sum of its calls' contributions: from the calls' own statistics and their cross terms where
every call's rule has outer factors (:mod:`backprism.engine.tied`), else from dense per-sample
gradients summed over the calls before squaring. Forwards with different batch sizes are
refused for per-sample extensions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backprism.engine import distributed as _distributed
from backprism.engine.columns import Columns, backprop_columns
from backprism.engine.extension import Extension, GlobalBatch, SecondOrderExtension
from backprism.engine.fold import (
    FoldAnalysis,
    UncheckedOperationWarning,
    fold_sizes,
    output_shape,
    sample_mixing,
)
from backprism.engine.graph import GraphView
from backprism.engine.loss_hessian import check_supported, loss_hessian_sqrt
from backprism.engine.parametrized import Parametrized, parametrized
from backprism.engine.rule import Rule, get_rule, move_batch_axis
from backprism.engine.state import (
    NO_INPUT,
    UNATTRIBUTED,
    Call,
    LossRecord,
    expand_rows,
    forget_mode_free,
    sequence_first,
)
from backprism.engine.tied import Use, Uses

__all__ = ["BackwardPass", "current_pass"]


class _Current(threading.local):
    def __init__(self) -> None:
        self.pass_: BackwardPass | None = None


_CURRENT = _Current()


class ParameterHookWarning(UserWarning):
    """A parameter carries a gradient hook of the user's, which its results do not include."""


#: parameter attribute: warned about (:class:`ParameterHookWarning`, once per parameter)
_WARNED_HOOK = "_backprism_hook_warned"


def current_pass() -> BackwardPass | None:
    """The backward pass whose engine code runs on this thread right now (inside rules,
    extensions and ``extension_hook`` callbacks), else ``None``."""
    return _CURRENT.pass_


class _Memo:
    """Caches rule results within one call's processing (e.g. SumGradSquared and Variance).

    Entries keep their arguments alive, so an id can't be reused by another tensor while the
    memo exists (extensions may call the rule on temporary sample chunks)."""

    def __init__(self, rule: Any) -> None:
        self._rule = rule
        self._cache: dict[tuple, tuple[tuple, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._rule, name)
        if not callable(fn):
            return fn

        def cached(call: Call, *args: Any, **kwargs: Any) -> Any:
            held = (call, *args, *kwargs.values())
            key = _Memo._key(name, tuple(kwargs), held)
            hit = self._cache.get(key)
            if hit is None or any(a is not b for a, b in zip(hit[0], held)):
                hit = (held, fn(call, *args, **kwargs))
                self._cache[key] = hit
            return hit[1]

        cached.__wrapped__ = fn  # type: ignore[attr-defined]  (its signature: rule.with_approx)
        return cached

    def provide(self, name: str, call: Call, *args: Any, value: Any) -> None:
        """Record ``value`` as the result of ``rule.<name>(call, *args)`` (an extension that
        derived it on the way, e.g. GradHist's per-sample chunks giving ``batch_l2``)."""
        held = (call, *args)
        self._cache.setdefault(_Memo._key(name, (), held), (held, value))

    @staticmethod
    def _key(name: str, kwnames: tuple, held: tuple) -> tuple:
        return (name, kwnames, *(id(a) for a in held))


class _Running:
    """Context making ``bp`` the current pass of this thread (re-entrant)."""

    __slots__ = ("bp", "prev")

    def __init__(self, bp: BackwardPass) -> None:
        self.bp = bp

    def __enter__(self) -> None:
        self.prev = _CURRENT.pass_
        _CURRENT.pass_ = self.bp

    def __exit__(self, *exc: Any) -> None:
        _CURRENT.pass_ = self.prev


def _names(exts: list[Extension]) -> str:
    return ", ".join(sorted({type(e).__name__ for e in exts}))


class BackwardPass:
    """State and processing of one backward pass (see the module docstring)."""

    def __init__(self, ctx: Any, view: GraphView) -> None:
        self.ctx = ctx
        self.view = view
        self.extensions: list[Extension] = ctx.extensions
        self.first: list[Extension] = ctx.first
        self.second: list[SecondOrderExtension] = ctx.second
        self.calls: dict[Call, list[Any]] = view.calls
        self.loss_records: list[LossRecord] = [rec for rec, _ in view.losses]
        self.roots = view.roots
        self.param_count: Counter[int] = Counter()
        self.module_count: Counter[int] = Counter()
        #: parameters of all calls of a module (the ``extension_hook`` waits for all of them)
        self.module_params: dict[int, list[nn.Parameter]] = {}
        for call in self.calls:
            for p in call.params.values():
                self.param_count[id(p)] += 1
            self.module_count[id(call.hook_module)] += 1
            self.module_params.setdefault(id(call.hook_module), []).extend(call.params.values())
        self.n_samples = 0
        self.fired: Counter[int] = Counter()
        self.module_fired: Counter[int] = Counter()
        #: param id -> (param, its uses so far) of parameters used by several calls
        self.tied: dict[int, tuple[nn.Parameter, Uses]] = {}
        #: ids of the parameters used by several calls of the second-order pass, all of which
        #: give them Kronecker factors (:meth:`_kronecker_uses`)
        self._kronecker_tied: frozenset[int] = frozenset()
        #: (param id, savefield) → (param, extension) of every result this pass stored
        self.stored: dict[tuple[int, str], tuple[nn.Parameter, Extension]] = {}
        self.touched: dict[int, nn.Module] = {}
        self.hooked: set[int] = set()
        # param id -> [(extension, partial result, module, fallback)] awaiting the parameter's
        # gradient of this pass
        self.partials: dict[int, list[tuple[Extension, Any, nn.Module, Callable[[], Tensor]]]] = {}
        self.module_call: dict[int, Call] = {}
        #: caches extensions keep for the length of this pass (e.g. unfolded inputs shared by
        #: the column chunks of a call), dropped with it
        self.scratch: dict[Hashable, Any] = {}
        #: > 0 while columns are pushed through the graph (hooks ignore that inner pass)
        self.in_columns = 0
        self._handles: list[Any] = []
        #: the single scalar root of the pass when it starts from the implicit gradient ``1``
        #: (``loss.backward()``): an extended loss that is this root enters with factor 1,
        #: known without reading the gradient (a host synchronisation on accelerators)
        self.unit_root: Tensor | None = None
        #: the pass runs with ``create_graph=True``: first-order results stay differentiable
        #: (rules see the calls' live inputs and undetached output gradients)
        self.create_graph = False
        self._detached_args: list[tuple[Call, tuple, dict]] = []
        #: BatchNorm in train mode mixes the samples of this pass's batch: every extension is
        #: a whole-batch one (``Extension.whole_batch``), columns are split per loss row
        #: (:meth:`Columns.split_rows`) and rules see the batch as one sample
        self.whole_batch = False
        #: whole batch: the loss rows per loss-Hessian column
        self._rows: int | None = None
        self._marked: list[Any] = []
        #: the distributed part of the pass (set by :meth:`check`), ``None`` for a local pass
        self.distributed: _distributed.DistributedPass | None = None
        #: extended losses whose hook has not run yet: second-order results are final once
        #: every one has (their columns are pushed from there)
        self.losses_left = len(self.loss_records)
        self._samples_analysis: FoldAnalysis | None = None
        #: products whose operands share parameters, their Hessian terms pushed from
        #: pre-hooks on their nodes (``(site, node)``, set by the DiagHessian family's check)
        self.bilinear_sites: list[tuple[Any, Any]] = []
        #: ids of the parameters whose nested uses' product terms the pass builds
        #: (:class:`~backprism.engine.residual.NestedSite`)
        self.nested_params: frozenset[int] = frozenset()
        #: call number → whether the DiagHessian family takes a module without a rule through
        #: the recorded operations of its body (``residual._nonlinear_in_params``)
        self.body_verdicts: dict[int, bool] = {}

    # -- before the engine runs --------------------------------------------------------------
    def check(self) -> None:
        """Refuse what cannot be computed, before anything is written (module docstring).

        A refused pass through forwards that ran without the forward mode
        (:data:`~backprism.engine.state.MODE_FREE`) has the models of those forwards recorded
        again from their next forward on: the refusal may come from a path the mode would have
        attributed (a functional parameter use, a functional nonlinearity)."""
        try:
            self._check()
        except BaseException:
            for root, _ in self.view.root_nodes:
                if root.modeless is not None:
                    forget_mode_free(root.module)
            raise

    def _check(self) -> None:
        view, exts = self.view, self.extensions
        if view.reentrant and exts:
            raise RuntimeError(
                "backprism: this backward pass runs through torch.utils.checkpoint with "
                "use_reentrant=True (the default of checkpoint() and checkpoint_sequential() "
                "in this PyTorch when use_reentrant is not passed): the checkpointed forward is "
                "recomputed inside the backward, hidden from the graph, so its parameters would "
                "get .grad but no per-sample results or curvature. Pass use_reentrant=False "
                "(Hugging Face: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False})), which backprism supports"
            )
        if not self.calls:
            if any(not rec.functional for rec, _ in view.losses):
                raise RuntimeError(
                    "backprism.collect: the backward pass reaches an extended loss but no "
                    "extended module: call backprism.extend(model) before the forward pass "
                    "(extend(lossfunc) alone captures nothing of the model)"
                )
            return
        for rec, _ in view.losses:
            if self.second:  # which losses have a Hessian first (before advice on reduction)
                check_supported(rec.module)
            reduction = getattr(rec.module, "reduction", "mean")
            if reduction not in ("mean", "sum"):
                raise ValueError(
                    f"backprism: {type(rec.module).__name__}(reduction={reduction!r}) gives no "
                    "per-sample scaling; use reduction='mean' or 'sum'"
                )
        self._widen_batch_one()
        if self.create_graph and self.first:
            self._check_differentiable()
        per_sample = [e for e in exts if e.per_sample]
        if per_sample or self.second:  # a batch read off axis 0 (batch_first=False RNNs)
            for call in self.calls:
                if call.layout_error is not None and call.params:
                    raise RuntimeError(call.layout_error)
            self._check_assumed_axes()
        if view.unsplit and exts:
            call = view.unsplit[0]
            names = ", ".join(f"'{n}'" for n in call.params)
            met = (
                "where backprism splits it (a broadcasting elementwise operation or matrix "
                "product, expand or repeat over the batch, an attention mask)"
            )
            if call.unsplit == NO_INPUT:
                where = (
                    "is computed without any tensor input, so it is the same for every sample, "
                    f"and it does not meet the samples {met}"
                )
            elif call.unsplit is not None:
                where = call.unsplit
            else:
                where = (
                    "is split per sample where it is broadcast over the samples, but it is also "
                    "used elsewhere, where its gradient has no per-sample split"
                )
            raise RuntimeError(
                f"backprism: the output of {call.name} (called on an input without the "
                f"samples, its output shared by all of them, like a relative position bias) "
                f"{where}; {_names(exts)} cannot attribute its parameters ({names}). Let it "
                "meet the samples only through broadcasting elementwise operations, an explicit "
                "expand over the batch or attention masks, or freeze its parameters "
                "(requires_grad_(False)) to analyse the rest"
            )
        sizes = sorted({c.batch_size for c in self.calls if c.params})
        if 0 in sizes:
            raise ValueError(
                "backprism: the batch is empty (N = 0); per-sample quantities and curvature of "
                "an empty batch are undefined. Skip empty batches before the forward pass"
            )
        if sizes and exts:
            self._check_layouts(exts)  # (may move calls to the samples' axis)
            sizes = sorted({c.batch_size for c in self.calls if c.params})
        if sizes:
            counts = Counter(c.batch_size for c in self.calls if c.params)
            self.n_samples = counts.most_common(1)[0][0]
        if len(sizes) > 1 and exts:
            sizes = self._fold_calls(sizes)
        if per_sample and len(sizes) > 1:
            self._check_batch_sizes(sizes, per_sample)
        if exts:
            self._check_repeats(exts)
        if exts and sizes:
            for call in self.calls:
                if not call.params:
                    continue
                reason = get_rule(call.module).refusal(call, self.n_samples)
                if reason is not None:
                    raise RuntimeError(reason)
        mixing: str | None = None
        way_out = (
            "Call model.eval() for the backward pass, or replace BatchNorm by GroupNorm/LayerNorm"
        )
        folded = next((c for c in self.calls if c.fold > 1), None)
        for call in self.calls:
            call.check_unmodified()
            module = call.module
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
                call.training or module.running_mean is None
            ):  # normalised with the batch's statistics
                mixing = f"{call.name} in train mode"
        if mixing is None and per_sample and not self._one_sample():  # (one: nothing to mix)
            mixing = self._mixing(per_sample)
            way_out = (
                "Per-sample quantities of a computation that combines samples (a loss that "
                "compares them, InfoNCE or CLIP; a statistic over the batch) do not exist; use "
                ".grad, or the whole batch's curvature"
            )
        if mixing is not None and folded is not None:
            raise RuntimeError(
                f"backprism: {mixing} mixes the samples of a batch and {folded.name} runs on a "
                "batch folded with another axis; whole-batch curvature of such a pass is not "
                f"supported. {way_out}"
            )
        if mixing is not None and per_sample:
            undefined = [e for e in per_sample if not e.whole_batch]
            if undefined:
                raise RuntimeError(
                    f"backprism: {mixing} mixes the samples of a batch, so per-sample "
                    f"quantities ({_names(undefined)}) are undefined (the whole batch's "
                    f"DiagGGNExact/DiagGGNMC/SqrtGGNExact/SqrtGGNMC are). {way_out}"
                )
            self.whole_batch = True
        if view.escaped and exts:
            node, owner = view.escaped[0]
            raise RuntimeError(
                f"backprism: a vector {owner} joined from its own parameters (torch.cat of "
                "them, attributed where it is a linear layer's bias) is used by "
                f"{_node_name(node)} after {owner}'s forward; {_names(exts)} would miss that "
                "use. Use the parameters themselves there, or freeze them "
                "(requires_grad_(False)) to analyse the rest"
            )
        if view.unattributed:
            p, node = view.unattributed[0]
            self._refuse_parametrized([p], exts)
            name = self._param_name(p)
            inside = node.metadata.get(UNATTRIBUTED) if node is not None else None
            if inside is not None:
                raise RuntimeError(
                    f"backprism: the parameter {name} meets {inside} inside the model's forward "
                    "before any per-sample tensor, so its value cannot be rebuilt from one "
                    f"parameter where it meets the samples; {_names(exts)} cannot split that "
                    "use over the samples. Let each parameter meet the per-sample tensors on "
                    "its own (e.g. (x * a) * b instead of x * (a * b)), or freeze the "
                    "parameter (requires_grad_(False)) to analyse the rest"
                )
            if node is not None and id(node) in view.written:
                raise RuntimeError(
                    f"backprism: the parameter {name} is used by {_node_name(node)} whose "
                    "result was then modified in place through a view of it (e.g. `h /= s` "
                    "on a Linear's 3-d output, which is a view: Hugging Face's Longformer "
                    "scales its global queries so). Autograd then replaces the node where "
                    f"backprism recorded the call, so {_names(exts)} cannot attribute the use. "
                    "Use an out-of-place operation there (h = h / s), or freeze the parameter "
                    "(requires_grad_(False)) to analyse the rest"
                )
            raise RuntimeError(
                f"backprism: the parameter {name} is used by "
                f"{_node_name(node)} outside the forward of every extended module that owns it "
                "(for example in code after the model's forward, or in a term added to the loss)"
                f"; {_names(exts)} would miss that use. Move the use into the forward of the "
                "extended model (functional uses there are attributed), or compute it in a "
                f"separate backward pass{modeless_note(view)}"
            )
        self._check_views_written(exts)
        if self.second:
            self._check_second_order(view)
        # -- distributed (engine.distributed): refusals, then the reduction in end() --------
        self.distributed = _distributed.setup(self)

    def _check_views_written(self, exts: list[Extension]) -> None:
        """A call whose output is a view of a tensor that was then modified in place through
        another view of it (``h /= s`` after a use of ``h``): gradients reach that tensor past
        the call's output node, which the call's hook would miss. A reshaping view (a Linear's
        3-d output of its 2-d product) is read at that tensor instead (``Call.rebased``, by the
        graph walk); any other such view is refused before anything is written."""
        written = self.view.written
        if not exts or not written:
            return
        for call, edges in self.calls.items():
            for e in edges:
                if e is None or type(e[0]).__name__ not in _VIEW_NODES:
                    continue
                if any(id(g) in written for g, _ in e[0].next_functions[:1] if g is not None):
                    raise RuntimeError(
                        f"backprism: the output of {call.name} is a view of another tensor, "
                        "and that tensor was modified in place through a view after the output "
                        f"was used (e.g. `h /= s` after `a = h.sum(1)`): part "
                        f"of its gradient bypasses the output, so {_names(exts)} would miss "
                        "it. Use an out-of-place operation there (h = h / s)"
                    )

    def _widen_batch_one(self) -> None:
        """Calls of batch size 1 on inputs without a gradient (position embeddings of
        ``position_ids`` ``[1, T]``, in a forward without the forward mode, which would have
        widened them where they meet the samples, or with ``position_ids`` passed in) whose one
        output meets the samples only in an addition that broadcasts it over them (``tok +
        pos``, ``h += pos``): widened here to the addition's ``N`` rows, with the addition's
        output as their output — its gradient's row ``n`` is sample ``n``'s gradient at its
        copy of the call's output, and the call's inputs are the same for every sample. The
        addition's other operand is what it met (:attr:`Call.meets`): rows that fold the
        samples with another axis (Swin's windows) are read from it."""
        ones = {
            (id(edges[0][0]), edges[0][1]): call
            for call, edges in self.calls.items()
            if call.batch_size == 1 and call.params and not call.input_edges
            and not call.batch_axis and len(edges) == 1 and edges[0] is not None
        }
        if not ones or all(c.batch_size == 1 for c in self.calls if c.params):
            return
        users: dict[tuple[int, int], list[Any]] = {}
        for fn in self.view.nodes.values():
            for f, nr in fn.next_functions:
                if f is not None and (id(f), nr) in ones:
                    users.setdefault((id(f), nr), []).append(fn)
        for key, call in ones.items():
            found = users.get(key, [])
            if len(found) != 1 or type(found[0]).__name__ != "AddBackward0":
                continue
            add = found[0]
            out, shape = output_shape(add, 0), tuple(call.out_shapes[0])
            if out is None or len(out) != len(shape) or out[0] <= 1 or out[1:] != shape[1:]:
                continue
            if float(getattr(add, "_saved_alpha", 1)) != 1.0:
                continue  # (x + α·pos: the gradient at pos is α times the sum's)
            n = out[0]
            met = tuple(
                GradientEdge(f, nr) for f, nr in add.next_functions
                if f is not None and (id(f), nr) != key
            )
            wide = dataclasses.replace(
                call,
                args=tuple(expand_rows(a, n) for a in call.args),
                kwargs={k: expand_rows(v, n) for k, v in call.kwargs.items()},
                out_shapes=[torch.Size(out)], batch_size=n, live=None, widened_from=call,
                unsplit=None if call.unsplit == NO_INPUT else call.unsplit, meets=met,
            )
            del self.calls[call]
            self.calls[wide] = [(add, 0)]
            if call in self.view.unsplit and wide.unsplit is None:
                self.view.unsplit.remove(call)

    def _batch_off_axis_0(self) -> bool:
        """Whether a call of this pass has its batch off axis 0 (a ``batch_first=False`` RNN,
        or a module fed by one)."""
        return any(
            (c.batch_axis and c.owner is None) or sequence_first(c.module) for c in self.calls
        )

    def _check_assumed_axes(self) -> None:
        """With a ``batch_first=False`` RNN in the pass, a call whose batch axis 0 was only
        assumed (its input's layout unknown, e.g. Embedding → Dropout → RNN on ``[T, N]``
        tokens) may hold the time axis there. If another of its input's non-feature axes has
        the size of axis 0, nothing tells them apart (silently wrong when ``T == N``): refused.
        Otherwise a wrong guess shows as a batch size that differs from the other calls', which
        the batch-size check refuses."""
        # (a call inside a module that released its parameters has its batch axis from that
        # module's own layout, e.g. attention's [T, N, E] projection: no RNN)
        if not self._batch_off_axis_0():
            return
        for call in self.calls:
            if call.params and call.assumed_axis and _ambiguous_batch_axis(call):
                raise RuntimeError(
                    f"backprism: this backward pass runs through a batch_first=False RNN (batch "
                    f"on axis 1), and the batch axis of {call.name}'s input is not known (it is "
                    "not computed from the RNN's outputs, and not directly the RNN's input), so "
                    "axis 0 may be time, not samples. Feed the RNN directly with the module's "
                    "output, or construct the RNN with batch_first=True and batch-first inputs"
                )

    def _fold_calls(self, sizes: list[int]) -> list[int]:
        """Calls whose batch is a sample-major fold of the samples with another axis
        (:mod:`backprism.engine.fold`): with ``N`` the smallest batch size that explains every
        call so, the calls get ``Call.fold`` and the pass has one batch size ``N``; otherwise
        the sizes stay (and the batch-size check refuses them)."""
        for call in self.calls:
            call.fold = 1
        if self._batch_off_axis_0():  # a batch_first=False RNN: axis 0 is not the batch there
            return sizes
        if 1 in sizes and self._one_sample():
            # a batch of one sample (a rank's last batch under DDP): every row of every call
            # is that sample's, so the other sizes are folds of it (windows, positions) in any
            # order, and a call of batch size 1 is no broadcast here
            folded = [c for c in self.calls if c.params and c.batch_size != 1]
            for call in folded:
                call.fold = call.batch_size
            self.n_samples = 1
            self._check_folds(folded)
            return [1]
        for n in fold_sizes(sizes):
            analysis = self._fold_analysis(n)
            folds: dict[Call, int] = {}
            for call in self.calls:
                if not call.params or call.batch_size == n:
                    continue
                g = None
                if not call.batch_axis:
                    g = analysis.fold(call.input_edges, call.batch_size)
                    if g is None and not call.input_edges:  # the model's input, reshaped
                        g = _input_fold(call, self.roots, n)
                    if g is None and call.meets:  # widened against folded rows (Swin's)
                        g = analysis.fold(call.meets, call.batch_size)
                if g is None:
                    break
                folds[call] = g
            else:
                for call, g in folds.items():
                    call.fold = g
                self.n_samples = n
                self._check_folds(list(folds))
                return [n]
        return sizes

    def _check_repeats(self, exts: list[Extension]) -> None:
        """A shared call's copies per sample repeated over ``g`` rows each where they met a
        per-sample tensor (:attr:`Call.repeats`, Swin V2's position-bias MLP met by the
        windows' rows) are split right only if that tensor's axis 0 folds the samples
        sample-major with ``g`` rows each, as the graph must show; refused otherwise."""
        for call in self.calls:
            for g, edges in call.repeats:
                if edges and all(self.sample_fold(e.node, e.output_nr) == g for e in edges):
                    continue
                raise RuntimeError(
                    f"backprism: the output of {call.name} is shared by all samples and meets "
                    f"a tensor of {g * call.batch_size} rows, {g} for each of the "
                    f"{call.batch_size} samples, but the graph does not show those rows as the "
                    f"samples' in sample-major groups of {g} (rows n·{g} … n·{g} + {g - 1} "
                    "of sample n, as Swin's window partition gives), so "
                    f"{_names(exts)} cannot split its gradient per sample. Fold the samples "
                    "sample-major ([N, windows, ...] → [N·windows, ...]) before it meets them"
                )

    def _one_sample(self) -> bool:
        """Every forward of the pass ran on one sample (its first input's axis 0 of size 1)."""
        return bool(self.roots) and all(root.batch == 1 for root in self.roots)

    def samples_on_axis_0(self, node: Any, nr: int) -> bool:
        """Whether axis 0 of output ``nr`` of ``node`` (a tensor of this pass's graph) holds
        the pass's samples, one per row, as the graph shows (:class:`FoldAnalysis` anchored at
        the calls' outputs); ``False`` where it holds something else or cannot be told (a
        transposed activation whose first axis merely has the batch's size)."""
        return self.sample_fold(node, nr) == 1

    def sample_fold(self, node: Any, nr: int) -> int | None:
        """``g`` where axis 0 of output ``nr`` of ``node`` holds the pass's samples folded
        sample-major with ``g`` rows each (``N·g`` rows; ``1``: one per row), as the graph shows
        (:meth:`samples_on_axis_0`); ``None`` otherwise."""
        if node is None or not self.n_samples:
            return None
        status = self._samples().status(node, nr)
        return status[1] if status is not None and status[0] == 0 else None

    def _samples(self) -> FoldAnalysis:
        """The :class:`FoldAnalysis` of this pass's samples (its calls' folds settled), built
        once: the statuses it finds serve every later question (the mixing check, the
        repeated copies' check, the DiagHessian family's layouts)."""
        if self._samples_analysis is None:
            self._samples_analysis = self._fold_analysis(self.n_samples)
        return self._samples_analysis

    def _fold_analysis(self, n: int) -> FoldAnalysis:
        """A :class:`FoldAnalysis` of this pass's graph anchored at the calls of batch ``n``."""
        anchors: dict[tuple[int, int], tuple[int, int]] = {}
        for call in self.calls:
            anchors.update(self._anchors(call, n))
        return FoldAnalysis(n, anchors)

    def _anchors(self, call: Call, n: int) -> dict[tuple[int, int], tuple[int, int]]:
        """The statuses ``call``'s output edges anchor in a :class:`FoldAnalysis` of batch
        ``n``: each output on its own axis (:meth:`Call.output_axes`); none for a call of
        another batch size, on a folded batch, or read at the tensor its output views. A
        shared call widened against rows that fold the samples (Swin's bias table met by the
        windows) anchors its output with that fold: its copies are those rows'."""
        fold = call.fold if call.meets and call.batch_size == n * call.fold else 1
        if call.batch_size != n * fold or call.rebased:
            return {}
        return {
            (id(e[0]), e[1]): (axis, fold)
            for e, axis in zip(self.calls[call], call.output_axes(), strict=True)
            if e is not None
        }

    def _check_layouts(self, exts: list[Extension]) -> None:
        """Read from the graph which axis of each call's first input holds the samples: the
        statuses of :class:`FoldAnalysis`, anchored at the outputs of the calls before it
        (every call is recorded after those it computes from, ``Call.seq``), each output on
        its own axis (an RNN's ``h_n`` ``[layers, N, H]`` on axis 1). A call that took them
        from another axis — a Linear on ``h_n``, on ``h.transpose(0, 1)`` — takes them from the
        right one where its rule acts on trailing feature axes only
        (:func:`~backprism.engine.rule.move_batch_axis`), and is refused otherwise; its
        outputs anchor the calls after it on the axes it then has. A call whose input's axis
        is not known stays as recorded (:meth:`_check_assumed_axes`)."""
        # the samples' number: that of the calls on the model's inputs, else the most common
        roots = Counter(
            c.batch_size for c in self.calls
            if c.params and c.versions and not c.versions[0][0].requires_grad
        )
        n = (roots or Counter(c.batch_size for c in self.calls if c.params)).most_common(1)[0][0]
        if n < 2:
            return
        analysis = FoldAnalysis(n, {})
        for call in sorted(self.calls, key=lambda c: c.seq):
            first = call.versions[0][0] if call.versions else None
            if (
                first is not None and first.requires_grad and call.params
                and call.owner is None and call.widened_from is None and not call.superseded
            ):
                edge = call.input_edges[0]
                status = analysis.status(edge.node, edge.output_nr)
                want = call.input_axis
                movable = not want and not sequence_first(call.module)
                if status is not None and status[0] != want and not (
                    movable and move_batch_axis(call, status[0])
                ):
                    raise RuntimeError(
                        f"backprism: the samples reach the input of {call.name} on axis "
                        f"{status[0]} (followed through the graph from the layers before "
                        "it: an RNN's h_n/c_n [layers, N, H] hold them on axis 1 whatever "
                        "batch_first says, a transpose moves them), but "
                        f"{call.name} takes them from axis {want}, so {_names(exts)} "
                        "would take another axis for the samples. Move the samples to "
                        f"axis {want} before {call.name} (h_n[-1], x.transpose(0, 1))"
                    )
            analysis.anchors.update(self._anchors(call, n))

    def _mixing(self, per_sample: list[Any]) -> str | None:
        """An operation that mixes the samples between the calls of this pass, or between
        them and a loss (:func:`~backprism.engine.fold.sample_mixing`: the logits
        ``z1 @ z2.T`` of a contrastive loss, ``h - h.mean(0)``), described, or ``None``; where
        none is found but the samples pass through operations the analysis does not know, an
        :class:`~backprism.engine.fold.UncheckedOperationWarning` names them."""
        if not self.n_samples:
            return None
        analysis = self._samples()
        losses = [
            (x.grad_fn, x.output_nr)
            for rec in self.loss_records
            for x in rec.inputs
            if isinstance(x, Tensor) and x.grad_fn is not None
        ]
        found = sample_mixing(analysis, losses)
        if found is not None:
            return f"{found} between the model's outputs and the loss"
        for call in self.calls:
            if call.params and call.input_edges:
                edge = call.input_edges[0]
                found = sample_mixing(analysis, [(edge.node, edge.output_nr)])
                if found is not None:
                    return f"{found} before {call.name}"
        if analysis.unchecked:
            ops = ", ".join(analysis.unchecked)
            warnings.warn(
                f"backprism: the samples pass through {ops}, whose treatment of the batch axis "
                f"backprism cannot read; the results of {_names(per_sample)} assume that it keeps "
                "the samples apart (Σₙ grad_batch = .grad holds either way). If it mixes them (a "
                "statistic of the batch), these are not per-sample quantities. Declare a custom "
                "autograd.Function that keeps them apart with @backprism.keeps_samples_apart, "
                "or filter backprism.engine.UncheckedOperationWarning",
                UncheckedOperationWarning,
                stacklevel=2,
            )
        return None

    def _check_folds(self, folded: list[Call]) -> None:
        """Refuse what folded calls cannot give (before anything is written)."""
        if not folded:
            return
        call = folded[0]
        where = (
            f"{call.name} runs on a folded batch ({call.batch_size} = {call.fold}·"
            f"{self.n_samples} rows, sample-major, e.g. Swin's windows)"
        )
        unsupported = [e for e in self.extensions if not e.supports_folded]
        if unsupported:
            raise RuntimeError(
                f"backprism {_names(unsupported)}: {where}; these extensions do not support "
                "such calls yet. DiagGGNExact/DiagGGNMC, DiagHessian, HutchinsonDiagHessian, "
                "KFAC/KFLR and the first-order extensions do"
            )
        if self.create_graph and self.first:
            raise RuntimeError(
                f"backprism: {where}; differentiable first-order results "
                "(backward(create_graph=True)) are not available for such calls"
            )

    def _refuse_parametrized(self, params: list[nn.Parameter], exts: list[Extension]) -> None:
        """Refuse the originals of a parametrization among ``params`` (an error path only:
        names are looked up parameter by parameter) that no layer's call claims: their
        parametrized weight is used outside the layer (a layer's own parametrized weights are
        attributed, engine.parametrized), so the refusal names the parametrization."""
        for p in params:
            name = self._param_name(p)
            if ".parametrizations." in name or "'parametrizations." in name:
                raise RuntimeError(
                    f"backprism: the parameter {name} is the original of a parametrization "
                    "(torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal, ...). "
                    "The layer uses the parametrized weight, which is computed from it outside "
                    f"every rule's closed form, so {_names(exts)} cannot be computed for it. "
                    "Remove the parametrization for the analysis "
                    "(torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')), "
                    "or freeze its originals (requires_grad_(False)) to analyse the rest"
                )

    def _check_batch_sizes(self, sizes: list[int], exts: list[Extension]) -> None:
        shown = " and ".join(str(s) for s in sizes)
        by_size: dict[int, list[str]] = {}
        for c in self.calls:
            if c.params:
                by_size.setdefault(c.batch_size, []).append(c.name)
        detail = "; ".join(f"N = {s}: {', '.join(sorted(set(v)))}" for s, v in by_size.items())
        n = self.n_samples
        folded = [s for s in sizes if s > n and s % n == 0]
        hints = ""
        if folded:
            hints += (
                f" Calls with batch size {folded[0]} = {folded[0] // n}·{n} fold another axis "
                "into the batch, and backprism could not follow that fold to groups of rows "
                "per sample (it follows reshapes, transposes, rolls, pads and row-wise "
                "operations from the samples, as in Swin's window partition or "
                "h.reshape(-1, d); a time-major [T·N, …] fold or an unknown operation on the "
                "way has no such split)."
            )
        widened = sorted(
            {c.name for c in self.calls if c.widened_from is not None and c.batch_size != n}
        )
        if widened:
            hints += (
                f" The output of {', '.join(widened)}, shared by all samples, was widened over "
                "the rows of a tensor it was broadcast against, and backprism could not follow "
                "those rows to groups per sample from what it met (a batch folded with windows "
                "sample-major, as in Swin, is followed; a window-major fold or a meeting with "
                "constants only is not): freeze its parameters (requires_grad_(False)) to "
                "analyse the rest."
            )
        hints += (
            " A module called on an input without the batch axis, its output shared by all "
            "samples (a relative position bias, an Embedding of [T, T] bucket indices), is "
            "split per sample where that output, or views of it, meet the samples in a "
            "broadcasting elementwise operation or matrix product, an expand or repeat over "
            "the batch, or as an attention mask, if its rule is Linear, Embedding, a norm or "
            "the generic one; met otherwise (after operations backprism does not follow) it "
            "has no per-sample split: freeze it (requires_grad_(False)) to analyse the rest."
        )
        raise RuntimeError(
            f"backprism: the backward pass combines calls with batch sizes {shown} ({detail}), "
            f"so the samples of {_names(exts)} do not match one to one. A sample index that "
            "appears in several forwards is one sample; run forwards of equal batch size, "
            "concatenate the inputs into one forward, or use separate backward passes. (A "
            "module called on a batch of 1 and broadcast over the samples, e.g. position "
            "embeddings of shape [1, T], is split per sample where it is added to them as it "
            "is, or, in a forward with backprism's forward mode, where it meets them in the "
            "ways listed below; otherwise expand its input to [N, T].)"
            f"{hints}{modeless_note(self.view)}"
        )

    def _check_second_order(self, view: GraphView) -> None:
        names = _names(list(self.second))
        for rec, _ in view.losses:
            if rec.layout_error is not None:
                raise RuntimeError(rec.layout_error)
            if rec.functional and self._batch_off_axis_0():
                raise RuntimeError(
                    f"backprism {names}: this backward pass runs through a batch_first=False "
                    f"RNN and ends in a functional {type(rec.module).__name__[:-4]} loss, "
                    "whose input's batch axis backprism cannot see. Compute the loss with an "
                    f"extended module, lossfunc = backprism.extend(nn.{type(rec.module).__name__}"
                    "()), or construct the RNN with batch_first=True"
                )
        if view.outside_losses:
            raise RuntimeError(
                f"backprism {names}: the objective of this backward pass has terms that no "
                f"extended loss accounts for (they reach {view.outside_losses[0]} without "
                "passing through an extended loss, e.g. a penalty on the model outputs), so its "
                "curvature is not the GGN of the extended losses. Add such terms as an extended "
                "loss module, or compute them in a separate backward pass (functional "
                "F.cross_entropy without label smoothing, F.nll_loss after log_softmax, "
                "F.mse_loss and F.binary_cross_entropy_with_logits count as losses; a label-"
                "smoothed cross-entropy needs extend(nn.CrossEntropyLoss(label_smoothing=...)))"
            )
        if not view.losses:
            raise RuntimeError(
                f"backprism: {names} need a loss whose Hessian backprism knows: an extended "
                "loss module, lossfunc = backprism.extend(nn.CrossEntropyLoss()) (or MSELoss, "
                "...), or one of the functional losses it recognises (F.cross_entropy without "
                "label smoothing, F.nll_loss after log_softmax, F.mse_loss, "
                "F.binary_cross_entropy_with_logits)"
            )
        residual = [e for e in self.second if e.needs_residual]
        if residual:
            RESIDUAL_CHECK[0](self, residual)
        for call in self.calls:
            if call.params:
                for ext in self.second:
                    ext.check_call(
                        call, lambda c=call: self._kronecker_form(c), self._param_name
                    )

    def _param_name(self, p: nn.Parameter) -> str:
        for root in self.roots:
            for name, q in root.module.named_parameters(remove_duplicate=False):
                if q is p:
                    return f"'{name}' of {type(root.module).__name__}"
        for call in self.calls:
            for name, q in call.params.items():
                if q is p:
                    return f"'{name}' of {call.name}"
        return f"of shape {tuple(p.shape)}"

    def start(self) -> None:
        """Drop earlier passes' results and mark this graph's records (after :meth:`check`)."""
        fields = [e.savefield for e in self.extensions]
        params: dict[int, nn.Parameter] = {}
        for root in self.roots:
            for p in root.module.parameters():
                params[id(p)] = p
        for call in self.calls:
            for p in call.params.values():
                params[id(p)] = p
        for p in params.values():
            for f in fields:
                if f in p.__dict__:
                    delattr(p, f)
            if p._backward_hooks and not p.__dict__.get(_WARNED_HOOK):  # the user's (ours: below)
                p.__dict__[_WARNED_HOOK] = True
                warnings.warn(
                    f"backprism: a parameter of shape {tuple(p.shape)} has a gradient hook "
                    "(Tensor.register_hook): its .grad includes what the hook does, per-sample "
                    "results and curvature do not (they are computed from the model's "
                    "gradients before that hook). Hooks on activations and modules are "
                    "included.",
                    ParameterHookWarning,
                    stacklevel=2,
                )
        if self.whole_batch:
            for call in self.calls:
                call.whole_batch = True
        if self.create_graph and self.first:  # rules see live inputs (differentiable results)
            for call in self.calls:
                if call.params and call.live is not None:
                    self._detached_args.append((call, call.args, call.kwargs))
                    call.args, call.kwargs = call.live
        for call in self.calls:
            if call.dtype is not None:  # ran under autocast: rules work in the parameter dtype
                dt = _param_dtype(call)
                if dt is not None:
                    call.args = tuple(
                        a.to(dt) if isinstance(a, Tensor) and a.is_floating_point() else a
                        for a in call.args
                    )
        for record in list(self.calls) + self.loss_records + self.view.sites:
            other = record.pass_
            if other is not None and other is not self:
                raise RuntimeError(
                    "backprism: two backward passes run through the same captured forward at "
                    "once (the same model's graph backpropagated from two threads); run them "
                    "one after the other"
                )
            record.pass_ = self
            self._marked.append(record)
        # gradients reach the pass through pre-hooks on the output nodes, registered only now
        # (forwards whose backward collects nothing carry no hook); calls with several outputs
        # got a multi-grad hook at forward time
        for call, edges in self.calls.items():
            if len(edges) == 1 and edges[0] is not None:
                node, nr = edges[0]
                self._handles.append(node.register_prehook(self._output_hook(call, nr)))
        for record, node in self.view.losses:
            self._handles.append(node.register_prehook(self._loss_hook(record)))
        for site, node in [*self.view.site_nodes, *self.bilinear_sites]:
            hook = site.node_hook(self, node)
            if hook is not None:
                self._handles.append(node.register_prehook(hook))
        if any(e.needs_param_grad for e in self.first):
            for pid, (p, _) in self.view.params.items():
                if self.param_count[pid]:
                    self._handles.append(p.register_hook(self._param_hook(p)))
        if self.distributed is not None:  # distributed: which .grad are empty before the pass
            self.distributed.start(self)

    def _output_hook(self, call: Call, nr: int) -> Callable[[tuple], None]:
        def hook(grad_outputs: tuple) -> None:
            grad = grad_outputs[nr]
            if grad is not None and not self.in_columns and call.pass_ is self:
                if call.rebased:  # (the gradient at the tensor the output views)
                    grad = grad.reshape(call.out_shapes[0])
                self.on_output_grad(call, (grad,))

        return hook

    def _loss_hook(self, record: LossRecord) -> Callable[[tuple], None]:
        def hook(grad_outputs: tuple) -> None:
            grad = grad_outputs[record.output_nr]
            if grad is not None and not self.in_columns and record.pass_ is self:
                self.on_loss_grad(record, grad)

        return hook

    def _param_hook(self, p: nn.Parameter) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not self.in_columns:
                self.on_param_grad(p, grad)

        return hook

    def end(self, ok: bool) -> None:
        """Finish (when the engine succeeded) and unmark; always called."""
        try:
            if ok:
                with _Running(self):
                    self._finish()
            else:
                self._discard()
        except BaseException:
            self._discard()
            raise
        finally:
            for h in self._handles:
                h.remove()
            for record in self._marked:
                if record.pass_ is self:
                    record.pass_ = None
            for call, args, kwargs in self._detached_args:
                call.args, call.kwargs = args, kwargs
            self._detached_args.clear()
            if self.whole_batch:
                for call in self.calls:
                    call.whole_batch = False
            self._handles.clear()
            self._marked.clear()

    def _discard(self) -> None:
        """The pass failed (an error in a rule, an extension or a user's hook during the
        backward): the results it stored leave the parameters, so that no parameter carries a
        mix of this pass's values and none (``.grad`` is autograd's, as in any failed
        backward)."""
        for param, ext in self.stored.values():
            with contextlib.suppress(AttributeError):
                delattr(param, ext.savefield)
        self.stored.clear()

    def _finish(self) -> None:
        if self.whole_batch and self._rows is not None:
            for param, ext in self.stored.values():
                value = getattr(param, ext.savefield)
                setattr(param, ext.savefield, ext.whole_batch_result(value, self._rows))
        for key in list(self.tied):  # (a use that got no output gradient)
            self._finish_tied(*self.tied.pop(key))
        for pid in list(self.partials):  # the parameter got no gradient (autograd.grad w.r.t. x)
            for ext, partial, module, fallback in self.partials.pop(pid):
                p = next(q for q in module.parameters() if id(q) == pid)
                if self.distributed is not None:
                    self.distributed.defer(p, ext, partial, fallback())
                else:
                    self.store(p, ext, ext.finish(partial, fallback()))
        if self.distributed is not None:  # distributed: local results -> the global batch's
            self.distributed.reduce(self)
        hook = self.ctx.extension_hook
        if hook is not None:
            for mid, module in self.touched.items():
                if mid not in self.hooked:
                    self.hooked.add(mid)
                    hook(module)

    # -- storing -----------------------------------------------------------------------------
    def store(self, param: nn.Parameter, ext: Extension, value: Any) -> None:
        """Set ``param.<ext.savefield>``; a second contribution within this pass is combined
        with ``ext.accumulate``. A parameter frozen since the forward
        (``requires_grad_(False)``) gets no ``.grad`` from autograd, and no results either."""
        if not param.requires_grad:
            return
        key = (id(param), ext.savefield)
        if key in self.stored:
            setattr(param, ext.savefield, ext.accumulate(getattr(param, ext.savefield), value))
        else:
            self.stored[key] = (param, ext)
            setattr(param, ext.savefield, value)
            if self.distributed is not None:  # distributed: reduced in end()
                self.distributed.stored_result(param, ext)

    def global_batch(self) -> GlobalBatch | None:
        """The global batch of a distributed pass (``None`` otherwise), for extensions that
        are :attr:`~Extension.scaled_in_pass` (the first call waits for the batch sizes
        exchanged at the start of the pass)."""
        return None if self.distributed is None else self.distributed.global_batch()

    def _factor(self, exts: list[Any], order: int) -> float:
        """What a distributed pass multiplies the output gradients (``order`` 1: ``ρ``) or
        columns (``order`` 2: ``√ρ``) by for the extensions among ``exts`` that are
        :attr:`~Extension.scaled_in_pass`; ``1`` where there are none (no wait for the batch
        sizes then)."""
        if self.distributed is None or not any(e.scaled_in_pass for e in exts):
            return 1.0
        return self.distributed.global_batch().loss_weight ** (1.0 / order)

    def _for_ext(self, ext: Extension, g: Any, scaled: dict[str, Any], order: int) -> Any:
        """``g`` as ``ext``'s :meth:`~Extension.from_rule` receives it: scaled by
        :meth:`_factor` if ``ext`` is :attr:`~Extension.scaled_in_pass`, the copy made once per
        call in ``scaled`` and shared by all such extensions (the rule memo keys on it)."""
        if not ext.scaled_in_pass or self.distributed is None:
            return g
        if "g" not in scaled:
            scaled["g"] = _scaled(g, self._factor([ext], order))
        return scaled["g"]

    def _tied_results(
        self,
        p: nn.Parameter,
        uses: Uses,
        exts: list[Any],
        weights: Tensor | None,
        order: int = 1,
    ) -> list[tuple[Any, Any, bool]]:
        """The non-additive extensions' results for ``p`` from all its ``uses`` (see
        :mod:`backprism.engine.tied`), each with whether it came from the statistic: from the
        rules' statistics and cross terms where every use has outer factors and the extension
        says which statistic it takes, else from the dense per-sample gradients summed over the
        uses. In a distributed pass an extension that is :attr:`~Extension.scaled_in_pass`
        gets them computed from scaled output gradients (``order`` 1: ``ρ``) or columns
        (``order`` 2: ``√ρ``), like its :meth:`~Extension.from_rule`: the uses hold unscaled
        ones, so the dense gradients are scaled by that factor and the (quadratic) statistics
        by its square."""
        call = uses.items[0].call
        f = self._factor(exts, order)
        stats: dict[tuple[str, bool], Tensor] = {}
        denses: dict[bool, Tensor] = {}
        out = []
        for ext in exts:
            if _additive(ext, p, self._kronecker_tied):
                continue
            kind = ext.tied_statistic
            scaled = ext.scaled_in_pass and f != 1.0
            if kind is not None and uses.factored:
                if (kind, scaled) not in stats:
                    if (kind, False) not in stats:
                        stat = uses.statistic(kind, p.shape, weights)
                        stats[kind, False] = _to_param_dtype(stat, p)
                    if scaled:
                        stats[kind, True] = stats[kind, False] * f**2
                out.append((ext, ext.from_statistic(stats[kind, scaled], call), True))
            else:
                if scaled not in denses:
                    if False not in denses:
                        denses[False] = _to_param_dtype(uses.dense(), p)
                    if scaled:
                        denses[True] = denses[False] * f
                out.append((ext, ext.from_dense(denses[scaled], call, weights), False))
        return out

    def _finish_tied(self, p: nn.Parameter, uses: Uses) -> None:
        """First order: store the results of ``p``, used by several calls, all of which fired
        (or the pass ended); a ``needs_param_grad`` result from the statistic waits for the
        parameter's gradient like a single call's."""
        for ext, value, from_statistic in self._tied_results(p, uses, self.first, None):
            if ext.needs_param_grad and from_statistic:
                last = uses.items[-1]
                item = (ext, value, last.call.hook_module, _tied_fallback(uses))
                self.partials.setdefault(id(p), []).append(item)
            else:
                self.store(p, ext, value)

    # -- first order -------------------------------------------------------------------------
    def on_output_grad(self, call: Call, grads: tuple[Tensor | None, ...]) -> None:
        with _Running(self):
            self._on_output_grad(call, grads)

    def _check_differentiable(self) -> None:
        """``create_graph=True`` with first-order extensions: every call's rule must compute
        differentiably from the call's live inputs (refused before anything is written)."""
        for call in self.calls:
            if not call.params:
                continue
            rule = get_rule(call.module)
            if not rule.differentiable or call.live is None or parametrized(call):
                names = _names(self.first)
                raise RuntimeError(
                    f"backprism {names}: backward(create_graph=True) asks for results that are "
                    f"differentiable, but the rule of {call.name} ({type(rule).__name__}) does "
                    "not compute them differentiably, so their derivatives would be wrong. "
                    "Differentiable first-order results are available for Linear, Embedding, "
                    "Conv and norm layers; run this backward without create_graph=True (or "
                    "compute the quantity with torch.func for this model)."
                )

    def _on_output_grad(self, call: Call, grads: tuple[Tensor | None, ...]) -> None:
        module = call.hook_module
        params = call.params
        if self.first and params and any(g is not None for g in grads):
            g = _with_column_axis(grads, call, self.create_graph)
            rcall, base, g = self._rule_for(call, get_rule(call.module), g)
            rule = _Memo(base)
            single, multi = {}, {}
            for name, p in params.items():
                self.fired[id(p)] += 1
                (single if self.param_count[id(p)] <= 1 else multi)[name] = p
            scaled: dict[str, Any] = {}
            for ext in self.first:
                names = params if ext.additive else single
                if not names:
                    continue
                out = ext.from_rule(rule, rcall, self._for_ext(ext, g, scaled, 1), None)
                for name in names:
                    value = _to_param_dtype(out[name], params[name])
                    if ext.needs_param_grad:
                        fallback = _summed_fallback(rule, rcall, g, name)
                        item = (ext, value, module, fallback)
                        self.partials.setdefault(id(params[name]), []).append(item)
                    else:
                        self.store(params[name], ext, value)
            if multi and any(not e.additive for e in self.first):
                self._add_uses(self.tied, rule, rcall, g, multi, self.first)
                for p in multi.values():
                    if self.fired[id(p)] >= self.param_count[id(p)]:
                        self._finish_tied(*self.tied.pop(id(p)))
            self.touched[id(module)] = module
            if self.distributed is not None:  # distributed: send finished results now
                self._send_finished(params.values())
        self.module_fired[id(module)] += 1
        self.module_call[id(module)] = call
        self._maybe_run_hook(call)

    def _send_finished(self, params: Any) -> None:
        """Hand the parameters whose results of this pass are final to the distributed
        reduction, which sends them while the backward goes on."""
        for p in params:
            pid = id(p)
            if (
                (not self.first or self.fired[pid] >= self.param_count[pid])
                and (not self.second or not self.losses_left)
                and pid not in self.partials
                and pid not in self.tied
            ):
                self.distributed.ready(p)  # type: ignore[union-attr]

    def _maybe_run_hook(self, call: Call) -> None:
        """Run ``extension_hook`` once the module's last call in this pass is done."""
        module = call.hook_module
        hook = self.ctx.extension_hook
        if hook is None or id(module) not in self.touched or id(module) in self.hooked:
            return
        if self.distributed is not None:  # distributed: after the reduction, in end()
            return
        if self.module_fired[id(module)] < self.module_count[id(module)]:
            return
        # a parameter shared with another call (tied weights) is done only when all fired
        if any(
            self.fired[id(p)] < self.param_count[id(p)]
            or id(p) in self.partials
            or id(p) in self.tied
            for p in self.module_params.get(id(module), ())
        ):
            return
        self.hooked.add(id(module))
        hook(module)

    def on_param_grad(self, param: nn.Parameter, grad: Tensor) -> None:
        """The parameter's gradient of this backward pass arrived (leaf tensor hook)."""
        items = self.partials.pop(id(param), None)
        if not items:
            return
        if self.distributed is not None:  # distributed: finished with the global gradient
            for ext, partial, _, _ in items:
                self.distributed.defer(param, ext, partial, grad.to(param.dtype))
            self._send_finished([param])
            return
        with _Running(self):
            for ext, partial, _, _ in items:
                if not self.create_graph:
                    grad = grad.detach()
                self.store(param, ext, ext.finish(partial, grad.to(param.dtype)))
            for module in {id(m): m for _, _, m, _ in items}.values():
                call = self.module_call.get(id(module))
                if call is not None:
                    self._maybe_run_hook(call)

    def _rule_for(self, call: Call, base: Rule, g: Any) -> tuple[Call, Rule, Any]:
        """The call, rule and columns the extensions compute with. For a call on a folded
        batch (``Call.fold = k``, rows ``[k·N]`` sample-major): a rule that acts on the trailing
        feature axes only (``moves_batch_axis``: Linear, Embedding, LayerNorm, RMSNorm) sees the
        call regrouped to ``[N, k, …]`` — the ``k`` rows of a sample become positions of it,
        closed forms and Kronecker factors unchanged; a rule that ``folds_rows`` (the generic
        rule) gets the call with ``batch_size = N`` and ``fold = k`` and runs the module on a
        sample's ``k`` rows at once; any other rule computes per row, and :class:`_Folded`
        sums the rows of each sample (statistics from those sums)."""
        rule = self._computing_rule(call, base)
        if call.fold <= 1:
            return call, rule, g
        n, k = self.n_samples, call.fold
        key = ("fold", id(call))
        view = self.scratch.get(key)
        if view is None:
            # (extensions see N samples, e.g. Variance's 1/N; _Folded computes on the k·N rows)
            view = _regrouped(call, n, k) if rule.moves_batch_axis else (
                dataclasses.replace(call, batch_size=n, live=None)
            )
            self.scratch[key] = view
        return view, rule, (_regroup_columns(g, n, k) if rule.moves_batch_axis else g)

    def _computing_rule(self, call: Call, base: Rule) -> Rule:
        """The rule the extensions compute ``call`` with (:meth:`_rule_for`): ``base`` seen
        through the call's parametrizations, and on a folded batch per row (:class:`_Folded`)
        unless it moves the batch axis or folds rows itself."""
        tensors = parametrized(call)
        if tensors:  # a parametrized weight: the originals' gradients pulled back from it
            base = Parametrized(base, tensors)
        if call.fold > 1 and not (base.moves_batch_axis or base.folds_rows):
            return _Folded(base, self.n_samples, call.fold, call)
        return base

    # -- second order ------------------------------------------------------------------------
    def loss_calls(self, record: LossRecord | None = None) -> list[tuple[Call, list[Any]]]:
        """Calls with parameters upstream of ``record`` (of any extended loss of this pass if
        ``None``), with their output edges."""
        if record is None:
            seen: dict[Call, list[Any]] = {}
            for rec in self.loss_records:
                for call, edges in self.loss_calls(rec):
                    seen.setdefault(call, edges)
            return list(seen.items())
        key = ("loss_calls", id(record))
        hit = self.scratch.get(key)
        if hit is None:
            hit = [(c, e) for c, e in self.view.loss_calls(record) if c.params]
            self.scratch[key] = hit
        return hit

    def on_loss_grad(self, record: LossRecord, grad: Tensor) -> None:
        # second-order results are never part of a graph (under create_graph=True the hooks run
        # with grad mode on; the columns are pushed with autograd.grad, which needs none)
        with _Running(self), torch.no_grad():
            self._on_loss_grad(record, grad)
            self.losses_left -= 1
            if self.second and not self.losses_left and self.distributed is not None:
                # distributed: second-order results are final, sent while the backward goes on
                self._send_finished(p for p, _ in self.view.params.values())

    def _on_loss_grad(self, record: LossRecord, grad: Tensor) -> None:
        module = record.module
        if grad.numel() != 1:
            raise ValueError(
                "backprism: the backward pass must start from a scalar loss; got a gradient of "
                f"shape {tuple(grad.shape)} at the output of {type(module).__name__}"
            )
        if not self.second:
            return
        scale = self._loss_scale(record, grad)
        if scale < 0:
            raise ValueError(
                f"backprism: the loss of {type(module).__name__} enters the objective with a "
                f"negative factor ({scale}); its GGN is not positive semi-definite"
            )
        calls = self.loss_calls(record)
        if not calls:
            return
        n_samples = self.n_samples
        for ext in self.second:
            if ext.handles_loss:
                ext.handle_loss(self, record, calls, n_samples, scale)
        column_exts = [e for e in self.second if not e.handles_loss]
        keys = list(dict.fromkeys(e.column_key() for e in column_exts))
        for key in keys:
            exts = [e for e in column_exts if e.column_key() == key]
            origins, cols = self.loss_columns(record, key, scale)
            self.process_columns(calls, origins, cols, exts, None)

    def loss_columns(
        self, record: LossRecord, key: Hashable, scale: float
    ) -> tuple[list[Tensor], Columns]:
        """The loss inputs and the square-root columns of the loss Hessian (``key``: exact or
        MC) of ``record``'s loss entering the objective with factor ``scale``, as the pass
        pushes them back: split per loss row in a whole-batch pass."""
        cols = loss_hessian_sqrt(record.module, record.inputs, key, self.n_samples)
        origins = [record.inputs[i] for i in cols.inputs]
        if scale != 1.0:
            cols = cols.scaled(scale**0.5)
        if self.whole_batch:
            rows = origins[0].shape[0] if origins[0].dim() else 1
            if self._rows not in (None, rows):
                raise RuntimeError(
                    "backprism: whole-batch curvature (BatchNorm in train mode) with losses "
                    f"of different numbers of rows ({self._rows} and {rows}) is not "
                    "supported; use one loss, or model.eval() for the backward pass"
                )
            self._rows = rows
            cols = cols.split_rows(rows)
        return origins, cols

    def _loss_scale(self, record: LossRecord, grad: Tensor) -> float:
        """The factor ``∂(objective)/∂(loss output)`` the loss enters the backward with: ``1``
        when the pass starts from the implicit gradient at this loss's output itself (no host
        read), else the gradient's value (one synchronisation)."""
        root = self.unit_root
        if root is not None and root.grad_fn is not None:
            for rec, node in self.view.losses:
                if rec is record and node is root.grad_fn and root.output_nr == rec.output_nr:
                    return 1.0
        return float(grad.detach().reshape(()))

    def process_columns(
        self,
        calls: list[tuple[Call, list[Any]]],
        origins: list[Tensor],
        cols: Columns,
        exts: list[SecondOrderExtension],
        weights: Tensor | None,
        direct: Callable[[int, int], list[Any]] | None = None,
        paired: bool = False,
    ) -> None:
        """Push columns ``cols`` (``[K, *origin.shape]`` each, generated lazily in chunks) from
        ``origins`` to the outputs of ``calls`` and reduce them with ``exts``.
        ``weights`` (``[K, N]``) multiply each column's squared contributions (signs).
        ``direct(start, stop)``: the columns' parts in a parameter's own space, ``(call, name,
        [k, N, *p])``, a use of the parameter added to the pushed parts' (tied path).
        ``paired``: columns ``2j`` and ``2j + 1`` are a product's pair ``(a, ±b)`` of opposite
        weights (:func:`backprism.engine.bilinear.signed_columns`); a call where they arrive
        equal or opposite (only one operand's part reaches it) takes neither
        (:func:`_unmirrored`)."""
        with _Running(self):
            self._process_columns(calls, origins, cols, exts, weights, direct, paired)

    def _process_columns(
        self,
        calls: list[tuple[Call, list[Any]]],
        origins: list[Tensor],
        cols: Columns,
        exts: list[SecondOrderExtension],
        weights: Tensor | None,
        direct: Callable[[int, int], list[Any]] | None = None,
        paired: bool = False,
    ) -> None:
        outputs = [GradientEdge(*e) for _, edges in calls for e in edges if e is not None]
        count = Counter(id(p) for c, _ in calls for p in c.params.values())
        self._kronecker_tied = self._kronecker_uses(calls, count)
        per_col = _column_bytes(calls, count, exts, self._kronecker_tied, direct is not None)
        chunk = self.ctx.chunk_size or max(1, self.ctx.memory_budget // per_col)
        paired = paired and weights is not None
        if paired:  # (a pair never split over two chunks)
            chunk = max(2, chunk - chunk % 2)
        chunks = backprop_columns(origins, cols, outputs, chunk)
        while True:
            self.in_columns += 1
            try:
                item = next(chunks, None)
            finally:
                self.in_columns -= 1
            if item is None:
                break
            start, flat = item
            w = None if weights is None else weights[start : start + _chunk_width(flat)]
            tied: dict[int, tuple[nn.Parameter, Uses]] = {}
            i = 0
            for call, edges in calls:
                gs = []
                for e in edges:
                    if e is None:
                        gs.append(None)
                    else:
                        col = flat[i]
                        if call.rebased:  # (columns at the tensor the output views)
                            col = col.reshape(col.shape[0], *call.out_shapes[0])
                        gs.append(col)
                        i += 1
                if all(x is None for x in gs):
                    continue
                g = (
                    _rule_layout(gs[0], call)
                    if len(gs) == 1
                    else tuple(
                        _rule_layout(
                            x if x is not None else _zeros_like_batched(gs, call, j), call
                        )
                        for j, x in enumerate(gs)
                    )
                )
                rcall, base, g = self._rule_for(call, get_rule(call.module), g)
                rule = _Memo(_WholeBatch(base) if self.whole_batch else base)
                params = call.params
                kt = self._kronecker_tied
                scaled: dict[str, Any] = {}
                # (the weights of this call's own statistics: a use shared with other calls
                # adds its per-sample gradients to theirs first, and takes ``w`` as it is)
                w_call = _unmirrored(w, gs) if paired else w
                for ext in exts:
                    names = [
                        n for n, p in params.items() if count[id(p)] <= 1 or _additive(ext, p, kt)
                    ]
                    if not names:
                        continue
                    w_ext = w_call if ext.any_decomposition else w
                    out = ext.from_rule(rule, rcall, self._for_ext(ext, g, scaled, 2), w_ext)
                    for name in names:
                        self.store(params[name], ext, out[name])
                multi = {n: p for n, p in params.items() if count[id(p)] > 1}
                if multi and any(not _additive(e, p, kt) for e in exts for p in multi.values()):
                    self._add_uses(tied, rule, rcall, g, multi, exts)
                self.touched[id(call.hook_module)] = call.hook_module
            if direct is not None:
                for call, name, part in direct(start, start + _chunk_width(flat)):
                    p = call.params[name]
                    entry = tied.setdefault(id(p), (p, Uses()))
                    entry[1].items.append(Use(_Direct(name, part), call, None, name, None))
            for p, uses in tied.values():
                for ext, value, _ in self._tied_results(p, uses, exts, w, order=2):
                    self.store(p, ext, value)

    def _kronecker_uses(
        self, calls: list[tuple[Call, list[Any]]], count: Counter[int]
    ) -> frozenset[int]:
        """Ids of the parameters used by several ``calls`` whose every call gives them Kronecker
        factors (:meth:`Rule.kronecker_form` of the rule the extensions compute with): their
        factors add over the calls. A parameter of which one call has no Kronecker form gets
        the single diagonal factor from all its uses at once (its exact/MC GGN diagonal,
        :meth:`Extension.additive_over_calls`)."""
        kronecker: dict[int, bool] = {}
        for call, _ in calls:
            shared = [p for p in call.params.values() if count[id(p)] > 1]
            if not shared:
                continue
            form = self._kronecker_form(call)
            for p in shared:
                kronecker[id(p)] = kronecker.get(id(p), True) and form
        return frozenset(k for k, v in kronecker.items() if v)

    def _kronecker_form(self, call: Call) -> bool:
        """:meth:`Rule.kronecker_form` of the rule the extensions compute ``call`` with (a
        parametrized weight or a folded batch computed per row: none)."""
        return self._computing_rule(call, get_rule(call.module)).kronecker_form(call)

    @staticmethod
    def _add_uses(
        tied: dict[int, tuple[nn.Parameter, Uses]],
        rule: Any,
        call: Call,
        g: Any,
        multi: dict[str, nn.Parameter],
        exts: list[Any],
    ) -> None:
        """Record one call's use of each of the parameters ``multi`` (used by several calls),
        with the rule's outer factors where an extension can take its statistic from them."""
        wanted = any(
            not e.additive_over_calls(False) and e.tied_statistic is not None for e in exts
        )
        outer = rule.outer_factors(call, g) if wanted else {}
        for name, p in multi.items():
            entry = tied.get(id(p))
            if entry is None:
                entry = tied[id(p)] = (p, Uses())
            entry[1].items.append(Use(rule, call, g, name, outer.get(name)))


class _Direct(Rule):
    """A parameter's per-sample, per-column gradients given as they are (the parts of columns
    that lie in its own space), as a use of the tied path."""

    def __init__(self, name: str, part: Tensor) -> None:
        self.name = name
        self.part = part

    def per_sample(self, call: Call, g: Any) -> dict[str, Tensor]:
        return {self.name: self.part}


class _WholeBatch(Rule):
    """A rule seen through whole-batch columns: the batch is one sample, so the per-sample,
    per-column gradients are the rule's sums over the samples, ``[M, 1, *p]``, and every
    statistic follows from them (``Σₘ (Σₙ Vₘₙ)²`` for the diagonal)."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule

    def per_sample(self, call: Call, g: Any) -> dict[str, Tensor]:
        return {k: v.unsqueeze(1) for k, v in self.rule.summed(call, g).items()}

    def summed(self, call: Call, g: Any) -> dict[str, Tensor]:
        return self.rule.summed(call, g)


class _Folded(Rule):
    """A rule seen through a call on a folded batch (``k·N`` rows, sample-major): per-sample,
    per-column gradients are the rule's per-row ones summed over each sample's ``k`` rows,
    ``[M, N, *p]``, and every statistic follows from them (Kronecker-factored extensions get
    the exact diagonal factor, :meth:`Rule.kronecker_diagonal`)."""

    def __init__(self, rule: Rule, n: int, k: int, rows: Call) -> None:
        self.rule, self.n, self.k = rule, n, k
        #: the call on its ``k·N`` rows, which the rule computes with (the extensions see a
        #: copy with ``batch_size = N``)
        self.rows = rows
        self.linear_in_params = rule.linear_in_params

    def is_linear_in_params(self, call: Call) -> bool:
        return self.rule.is_linear_in_params(self.rows)

    def per_sample(self, call: Call, g: Any) -> dict[str, Tensor]:
        return {
            name: v.reshape(v.shape[0], self.n, self.k, *v.shape[2:]).sum(2)
            for name, v in self.rule.per_sample(self.rows, g).items()
        }

    def summed(self, call: Call, g: Any) -> dict[str, Tensor]:
        return self.rule.summed(self.rows, g)

    def kronecker_form(self, call: Call) -> bool:
        return False


def _input_fold(call: Call, roots: list[Any], n: int) -> int | None:
    """The fold ``k`` of a call whose first input is a model input of ``n`` samples viewed as
    ``k·n`` rows (``self.fc(x.view(-1, d))``): the same memory, both contiguous, so the rows
    split the samples in order (sample-major). ``None`` otherwise."""
    x = next((a for a in call.args if isinstance(a, Tensor)), None)
    if x is None or not x.dim() or x.shape[0] % n or not x.is_contiguous():
        return None
    for root in roots:
        for a in root.args:
            if (
                isinstance(a, Tensor)
                and a.dim()
                and a.shape[0] == n
                and a.numel() == x.numel()
                and a.dtype == x.dtype
                and a.is_contiguous()
                and a.data_ptr() == x.data_ptr()
            ):
                return x.shape[0] // n
    return None


def _split_rows(x: Any, n: int, k: int, lead: int = 0) -> Any:
    """``x`` with its axis ``lead`` of size ``k·n`` split into ``[n, k]``."""
    if isinstance(x, Tensor) and x.dim() > lead and x.shape[lead] == n * k:
        return x.reshape(*x.shape[:lead], n, k, *x.shape[lead + 1 :])
    return x


def _regrouped(call: Call, n: int, k: int) -> Call:
    """``call`` with its ``k·n`` rows regrouped to ``[n, k, …]`` (inputs and output shapes)."""
    return dataclasses.replace(
        call,
        args=tuple(_split_rows(a, n, k) for a in call.args),
        kwargs={key: _split_rows(v, n, k) for key, v in call.kwargs.items()},
        out_shapes=[torch.Size((n, k, *s[1:])) for s in call.out_shapes],
        batch_size=n,
        fold=1,
        live=None,
    )


def _regroup_columns(g: Any, n: int, k: int) -> Any:
    """Columns ``[M, k·n, …]`` regrouped to ``[M, n, k, …]``."""
    if isinstance(g, tuple):
        return tuple(_split_rows(x, n, k, lead=1) for x in g)
    return _split_rows(g, n, k, lead=1)


def _no_residual_check(bp: BackwardPass, exts: list[Any]) -> None:
    raise RuntimeError(
        f"backprism {_names(exts)}: the Hessian residual machinery is not installed"
    )


#: set by :mod:`backprism.engine.residual` (a plug-in above the core)
RESIDUAL_CHECK: list[Callable[[BackwardPass, list[Any]], None]] = [_no_residual_check]


def modeless_note(view: GraphView) -> str:
    """The sentence a refusal adds when the pass runs through forwards without the forward
    mode (their models are recorded again from the next forward on, :meth:`check`)."""
    if not any(root.modeless is not None for root, _ in view.root_nodes):
        return ""
    return (
        ". (This forward ran without backprism's forward mode, which the model's first forward "
        "did not need — a model records the nonlinearities of its forwards outside collect() "
        "once a DiagHessian-family extension has been used with it, or a monitor plans one; "
        "its next forwards are recorded again: repeat the forward and backward pass if the "
        "use above lies inside the model)"
    )


#: backward nodes of views (their output shares its input's memory)
_VIEW_NODES = frozenset(
    {"ViewBackward0", "UnsafeViewBackward0", "AsStridedBackward0", "AliasBackward0",
     "ReshapeAliasBackward0", "ExpandBackward0", "TransposeBackward0", "PermuteBackward0",
     "SliceBackward0", "SelectBackward0", "TBackward0"}
)


def _node_name(node: Any) -> str:
    name = type(node).__name__
    for suffix in ("Backward0", "Backward1", "Backward"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return f"an operation '{name}'"


def _additive(ext: Any, p: nn.Parameter, kronecker: frozenset[int]) -> bool:
    """Whether ``ext`` combines ``p``'s results over its calls by adding them
    (:meth:`Extension.additive_over_calls`; ``kronecker``: the parameters whose every call
    gives them Kronecker factors)."""
    return ext.additive_over_calls(id(p) in kronecker)


def _column_bytes(
    calls: list[tuple[Call, list[Any]]], count: Counter[int], exts: list[Any],
    kronecker: frozenset[int] = frozenset(), direct: bool = False,
) -> int:
    """Bytes one backpropagated column costs at its peak: the column at every captured output,
    plus the per-sample gradients ``[N, *p]`` an extension may build from it (the largest
    parameter of a call for which one says so, :meth:`Extension.builds_per_sample`) and, for
    extensions that square summed per-sample gradients (not ``additive``), those of every
    parameter shared by several calls (held until its last call).

    Without the last two terms a 2048-token decoder with tied embeddings overran a 512 MiB
    budget 23-fold: each column carried an ``[N, V, d]`` gradient of the tied matrix. A shared
    parameter whose calls all have outer factors, for extensions that take their statistic from
    them, costs the cross terms' ``[N, T, T']`` instead (:mod:`backprism.engine.tied`).
    ``direct``: the columns also carry parts in the shared parameters' own space
    (:class:`~backprism.engine.residual.NestedSite`), another ``[N, *p]`` each."""
    elem = 4
    total = 0
    for call, edges in calls:
        p = next(iter(call.params.values()), None)
        if p is not None:
            elem = p.element_size()
        for shape, e in zip(call.out_shapes, edges):
            if e is not None:
                total += shape.numel() * elem
    n = max((c.batch_size for c, _ in calls), default=1)
    squared = [e for e in exts if not e.additive_over_calls(False)]
    factored = all(e.tied_statistic is not None for e in squared)
    built = 0
    uses: dict[int, tuple[nn.Parameter, list[Call]]] = {}
    for call, _ in calls:
        rule = get_rule(call.module)
        builds = any(e.builds_per_sample(rule, call) for e in exts)
        for p in call.params.values():
            if builds:
                built = max(built, p.numel())
            if count[id(p)] > 1 and any(not _additive(e, p, kronecker) for e in squared):
                uses.setdefault(id(p), (p, []))[1].append(call)
    shared = 0
    for p, users in uses.values():
        if factored and all(_has_outer_factors(c) for c in users):
            # the cross terms' row products [N, T, T'] (engine.tied), not [N, *p]
            t = max(c.out_shapes[0].numel() // max(1, n * c.out_shapes[0][-1]) for c in users)
            shared += t * t
        else:
            shared += p.numel() * (2 if direct else 1)
    return max(1, total + n * elem * (built + shared))


def _has_outer_factors(call: Call) -> bool:
    """Whether the rule of ``call`` gives its parameters outer factors (:mod:`engine.tied`)."""
    return type(get_rule(call.module)).outer_factors is not Rule.outer_factors


def _summed_fallback(rule: Any, call: Call, g: Any, name: str) -> Callable[[], Tensor]:
    return lambda: rule.summed(call, g)[name][0]


def _tied_fallback(uses: Uses) -> Callable[[], Tensor]:
    """The gradient of a parameter used by several calls, summed over its uses (a pass whose
    parameter got no gradient, e.g. ``autograd.grad`` with respect to the inputs)."""

    def summed() -> Tensor:
        parts = [u.rule.summed(u.call, u.g)[u.name][0] for u in uses.items]
        return torch.stack(parts).sum(0) if len(parts) > 1 else parts[0]

    return summed


def _unmirrored(w: Tensor, gs: list[Tensor | None]) -> Tensor:
    r"""Weights ``w`` (``[c, N]``) of paired columns (``2j``: weight ``+1``, ``2j + 1``:
    ``−1``, the product's ``(a, b)`` and ``(a, −b)``) with both columns of a pair zeroed where
    they arrive at a call's outputs ``gs`` (``[c, …]`` each) equal or opposite in every entry.
    The pair's contribution there is ``V₊² − V₋² = 0`` exactly (one operand's part reaches the
    call, a gate or up projection of SwiGLU, a query or key projection), but summing the two
    large squares among all columns in floating point leaves ``ε · V²``: in float32 more than
    the curvature of such a weight itself. Comparing costs one pass over the columns."""
    c = w.shape[0]
    mirrored = w.new_ones(c // 2, dtype=torch.bool)
    for x in gs:
        if x is None:
            continue
        a, b = x[0::2].reshape(c // 2, -1), x[1::2].reshape(c // 2, -1)
        mirrored &= (a == b).all(1) | (a == -b).all(1)
    if not bool(mirrored.any()):
        return w
    return w.masked_fill(mirrored.repeat_interleave(2)[:, None], 0)


def _chunk_width(grads: tuple[Tensor | None, ...]) -> int:
    for g in grads:
        if g is not None:
            return g.shape[0] if isinstance(g, Tensor) else g[0].shape[0]
    return 0


def _zeros_like_batched(gs: list, call: Call, j: int) -> Tensor:
    ref = next(x for x in gs if x is not None)
    return ref.new_zeros((ref.shape[0], *call.out_shapes[j]))


def _param_dtype(call: Call) -> torch.dtype | None:
    p = next(iter(call.params.values()), None)
    return None if p is None else p.dtype


def _to_param_dtype(value: Any, p: nn.Parameter) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != p.dtype:
        return value.to(p.dtype)
    return value


def _ambiguous_batch_axis(call: Call) -> bool:
    """Whether an axis other than 0 of the call's first input (not its trailing feature axis,
    for floating-point inputs) has the size of axis 0."""
    x = next((a for a in call.args if isinstance(a, Tensor)), None)
    if x is None or x.dim() < 2:
        return False
    last = x.dim() - 1 if x.is_floating_point() else x.dim()
    return any(x.shape[k] == x.shape[0] for k in range(1, last))


def _rule_layout(g: Tensor, call: Call) -> Tensor:
    """Columns ``[M, *out.shape]`` as the call's rule reads them: in the parameters' dtype for
    a call that ran under autocast, and with the call's batch axis moved to axis 1 (calls
    whose input had the batch elsewhere keep that input batch-first, ``Call.batch_axis``)."""
    if call.dtype is not None:  # ran under autocast
        dt = _param_dtype(call)
        if dt is not None and g.dtype != dt:
            g = g.to(dt)
    return g.movedim(call.batch_axis + 1, 1) if call.batch_axis else g


def _scaled(g: Any, f: float) -> Any:
    """Output gradients or columns (a tensor or a tuple, one per output) times ``f``."""
    if f == 1.0:
        return g
    if isinstance(g, tuple):
        return tuple(None if x is None else x * f for x in g)
    return g * f


def _with_column_axis(
    grads: tuple[Tensor | None, ...], call: Call, keep_graph: bool = False
) -> Any:
    """The output gradients with a leading column axis of size 1 (first order), detached
    unless ``keep_graph`` (a ``create_graph=True`` pass)."""

    def prep(g: Tensor) -> Tensor:
        return g if keep_graph else g.detach()

    if len(grads) == 1:
        return _rule_layout(prep(grads[0]).unsqueeze(0), call)
    ref = next(g for g in grads if g is not None)
    return tuple(
        _rule_layout(
            (prep(g) if g is not None else ref.new_zeros(call.out_shapes[j])).unsqueeze(0), call
        )
        for j, g in enumerate(grads)
    )
