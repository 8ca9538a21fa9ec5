"""What one backward pass will run through, read from the autograd graph before it starts.

:func:`analyse` walks the graph upstream from the tensors a backward pass starts from (found by
:class:`~backprism.engine.collect.collect`, which sees ``loss.backward()`` and
``torch.autograd.grad``) and gathers the records the forward left in node metadata
(:mod:`backprism.engine.state`): the calls, losses, roots and Hessian-residual sites of *this*
graph and no other. It also answers the questions that decide whether the pass can be computed
at all, so that every refusal happens before anything — a result or ``.grad`` — is written:

* **attribution**: every use of a hooked parameter (an edge into its ``AccumulateGrad`` node)
  lies inside the part of the graph of a call that claims the parameter — the nodes upstream of
  the call's outputs and downstream of its inputs. A use outside every such region (a parameter
  used by code the forward recording did not see, e.g. a weight-decay term added to the loss,
  or a model output multiplied by a weight outside the model) is reported with the parameter
  and the node that uses it;
* **extra terms**: a call output or parameter reached from the start of the pass without going
  through an extended loss means the objective has terms that no extended loss accounts for
  (a penalty on the outputs); curvature is then undefined for the engine. A functional loss
  the engine recognises (:mod:`backprism.engine.loss_nodes`) counts as an extended loss: its
  record is put on its node when this walk first reaches it.

Identity across the walk is by node object, held for the length of the walk (torch may free a
node's Python wrapper between forward and backward and reuse its ``id``; within one walk every
wrapper is held, so ids are stable).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from backprism.engine.loss_nodes import loss_record
from backprism.engine.state import (
    BASES,
    CALLS,
    ESCAPED,
    LOSS,
    ROOT,
    SITES,
    Call,
    LossRecord,
    RootRecord,
)

__all__ = ["GraphView", "analyse"]


@dataclass
class GraphView:
    """The records and structure of one backward pass's graph (see :func:`analyse`)."""

    #: reached calls in discovery order, each with its output edges ``[(node, output_nr)]``
    #: (``None`` for an output no node of this graph produced)
    calls: dict[Call, list[Any]] = field(default_factory=dict)
    #: reached extended losses with the node of their output
    losses: list[tuple[LossRecord, Any]] = field(default_factory=list)
    roots: list[RootRecord] = field(default_factory=list)
    #: the reached roots with the node that holds each record (an output of its forward)
    root_nodes: list[tuple[RootRecord, Any]] = field(default_factory=list)
    sites: list[Any] = field(default_factory=list)
    #: sites that want a hook on the node holding them, with that node
    site_nodes: list[tuple[Any, Any]] = field(default_factory=list)
    #: hooked parameters that receive a gradient, by id, with their AccumulateGrad node
    params: dict[int, tuple[nn.Parameter, Any]] = field(default_factory=dict)
    #: (parameter, consumer node) for parameter uses no claiming call's region contains
    unattributed: list[tuple[nn.Parameter, Any]] = field(default_factory=list)
    #: nodes of operations on a vector joined from a module's released parameters after that
    #: module's forward (``engine.functional._joined_uses``), with the module's type name
    escaped: list[tuple[Any, str]] = field(default_factory=list)
    #: calls whose output all samples share (:mod:`backprism.engine.broadcast`) that meet
    #: the samples where they were not widened to the batch (``Call.unsplit``), or whose
    #: superseded output is also used elsewhere: part of their gradient has no per-sample
    #: split
    unsplit: list[Call] = field(default_factory=list)
    #: calls or parameters reached from the start without passing an extended loss
    outside_losses: list[str] = field(default_factory=list)
    #: reached nodes of ``torch.utils.checkpoint(..., use_reentrant=True)``: their region's
    #: parameters are not in this graph (the forward is recomputed inside their backward)
    reentrant: list[Any] = field(default_factory=list)
    #: the nodes the pass starts from (the roots' ``grad_fn``)
    starts: list[Any] = field(default_factory=list)
    #: every node reached (held, so ids stay unique while the view lives)
    nodes: dict[int, Any] = field(default_factory=dict)
    #: ids of the nodes of tensors modified in place through a view (a ``CopySlices`` node's
    #: base)
    written: set[int] = field(default_factory=set)

    def loss_calls(self, record: LossRecord) -> list[tuple[Call, list[Any]]]:
        """The calls upstream of ``record``'s inputs, with their output edges."""
        starts = [
            x.grad_fn for x in record.inputs if isinstance(x, Tensor) and x.grad_fn is not None
        ]
        reached = _upstream(starts, stop=set())
        out = []
        for call, edges in self.calls.items():
            if any(e is not None and id(e[0]) in reached for e in edges):
                out.append((call, edges))
        return out


def _is_hooked(p: Any) -> bool:
    return isinstance(p, nn.Parameter) and getattr(p, "_backprism_hooked", False)


def _upstream(starts: list[Any], stop: set[int]) -> dict[int, Any]:
    """Nodes reachable from ``starts`` (inclusive) without entering nodes whose id is in
    ``stop``."""
    seen: dict[int, Any] = {}
    stack = [s for s in starts if s is not None and id(s) not in stop]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for f, _ in fn.next_functions:
            if f is not None and id(f) not in seen and id(f) not in stop:
                stack.append(f)
    return seen


#: the backward node of ``torch.utils.checkpoint``'s reentrant variant (an autograd.Function)
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


def analyse(roots: list[Tensor]) -> GraphView:
    """Walk the graph of a backward pass that starts from ``roots`` (see module docstring)."""
    view = GraphView()
    starts = [r.grad_fn for r in roots if isinstance(r, Tensor) and r.grad_fn is not None]
    view.starts = starts
    # phase 1: from the start down to the extended losses (not into them)
    outside: dict[int, Any] = {}
    frontier: list[Any] = []
    stack = list(starts)
    while stack:
        fn = stack.pop()
        if id(fn) in outside:
            continue
        outside[id(fn)] = fn
        md = fn.metadata
        if LOSS not in md:  # a functional loss (F.cross_entropy, a plain loss module)
            rec = loss_record(fn)
            if rec is not None:
                md[LOSS] = rec
        if LOSS in md:
            frontier.append(fn)
            continue
        live = [c for c, _, _ in md.get(CALLS, ()) if not c.superseded]
        if live:
            view.outside_losses.append(live[0].name)
        for f, _ in fn.next_functions:
            if f is None or id(f) in outside:
                continue
            var = getattr(f, "variable", None)
            if var is not None:
                if _is_hooked(var):
                    view.outside_losses.append(f"a parameter of shape {tuple(var.shape)}")
                continue
            stack.append(f)
    # phase 2: the whole graph, records and parameter uses
    nodes = view.nodes
    consumers: dict[int, list[Any]] = {}
    stack = list(starts)
    calls: dict[Call, list[Any]] = {}
    shared: dict[tuple[int, int], Call] = {}  # (node id, output_nr) → superseded call
    bases: list[tuple[Call, Any, int]] = []  # (call, node of the tensor its output views, nr)
    written = view.written
    while stack:
        fn = stack.pop()
        if id(fn) in nodes:
            continue
        nodes[id(fn)] = fn
        if type(fn).__name__ == "CopySlices" and fn.next_functions:
            base = fn.next_functions[0][0]
            if base is not None:
                written.add(id(base))
        md = fn.metadata
        if md:
            bases.extend((call, fn, nr) for call, nr in md.get(BASES, ()))
            for call, index, nr in md.get(CALLS, ()):
                if call.superseded:
                    shared[(id(fn), nr)] = call
                    continue
                edges = calls.setdefault(call, [None] * len(call.out_shapes))
                edges[index] = (fn, nr)
            rec = md.get(LOSS)
            if rec is not None:
                view.losses.append((rec, fn))
            root = md.get(ROOT)
            if root is not None:
                view.roots.append(root)
                view.root_nodes.append((root, fn))
            if ESCAPED in md:
                view.escaped.append((fn, md[ESCAPED]))
            sites = md.get(SITES)
            if sites:
                view.sites.extend(sites)
                view.site_nodes.extend((s, fn) for s in sites if hasattr(s, "node_hook"))
        if type(fn).__name__ == _REENTRANT_CHECKPOINT:
            view.reentrant.append(fn)
        for f, _ in fn.next_functions:
            if f is None:
                continue
            var = getattr(f, "variable", None)
            if var is not None and _is_hooked(var):
                view.params.setdefault(id(var), (var, f))
                consumers.setdefault(id(var), []).append(fn)
            if id(f) not in nodes:
                stack.append(f)
    for call in calls:
        call.rebased = False
    for call, fn, nr in bases:
        if id(fn) in written and not call.superseded:
            # the tensor the call's output views was modified in place through a view: its
            # output's node is gone or bypassed; the gradient at that tensor is the output's
            calls[call] = [(fn, nr)]
            call.rebased = True
    view.calls = calls
    view.unsplit = [c for c in calls if c.unsplit is not None]
    if shared:
        view.unsplit += _unsplit(nodes, calls, shared)
    if consumers:
        attributed: set[tuple[int, int]] = set()
        for call, edges in calls.items():
            claimed = {id(p) for p in call.params.values()}
            if not claimed:
                continue
            stop = {id(e.node) for e in call.input_edges if e.node is not None}
            region = _upstream([e[0] for e in edges if e is not None], stop)
            for pid in claimed:
                for node in consumers.get(pid, ()):
                    if id(node) in region:
                        attributed.add((pid, id(node)))
        for pid, users in consumers.items():
            for node in users:
                if (pid, id(node)) not in attributed:
                    view.unattributed.append((view.params[pid][0], node))
    return view


def _unsplit(
    nodes: dict[int, Any], calls: dict[Call, list[Any]], shared: dict[tuple[int, int], Call]
) -> list[Call]:
    """The superseded calls in ``shared`` whose output has more consumers in the graph than
    widenings of it (each widening consumes the output once; see
    :mod:`backprism.engine.broadcast`): the extra consumers' gradient reaches the call's
    parameters without a per-sample split."""
    uses = dict.fromkeys(shared, 0)
    for fn in nodes.values():
        for f, nr in fn.next_functions:
            if f is not None and (id(f), nr) in uses:
                uses[(id(f), nr)] += 1
    widenings: dict[int, int] = {}
    for call in calls:
        if call.widened_from is not None:
            widenings[id(call.widened_from)] = widenings.get(id(call.widened_from), 0) + 1
    return [
        call for key, call in shared.items() if uses[key] > widenings.get(id(call), 0)
    ]

