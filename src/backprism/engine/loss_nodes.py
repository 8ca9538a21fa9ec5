"""Functional losses recognised in the autograd graph.

Training scripts rarely call an extended loss module: they write
``F.cross_entropy(model(x), y)``, use a plain ``nn.CrossEntropyLoss()``, or let the model
compute its loss (Hugging Face's ``model(ids, labels=ids).loss``, nanoGPT's
``model(idx, targets)``), all of which end in the same ATen operations. :func:`loss_record`
reads such a loss back from the backward node that computed it, with the arguments autograd
saved for its own backward, and returns the :class:`~backprism.engine.state.LossRecord` an
extended loss module of the same configuration would have left:

=====================================================  ============================================
graph (top → bottom)                                    record
=====================================================  ============================================
``NllLoss[2D]Backward0`` → (views) → ``LogSoftmax``     ``NLLLoss`` of the ``log_softmax`` output
(``cross_entropy`` without label smoothing, or          over the class axis (``dim=1``); its
``nll_loss(log_softmax(z, 1), y)``)                     Hessian is cross-entropy's in the logits
``MseLossBackward0``                                    ``MSELoss``
``BinaryCrossEntropyWithLogitsBackward0``               ``BCEWithLogitsLoss`` (``weight``,
                                                        ``pos_weight``)
=====================================================  ============================================

Reductions ``mean`` and ``sum`` only; ``weight`` and ``ignore_index`` as saved. Anything else
(label smoothing, which autograd records as a sum of two terms; a ``log_softmax`` over another
axis; ``reduction='none'`` followed by a custom reduction) is not recognised, and a pass that
needs the loss's Hessian refuses it as before, naming the extended loss modules to use.

The record's tensors are the ones autograd saved, unpacked: they carry the ``grad_fn`` of the
original inputs (upstream of the loss node), but not the batch-axis marks the forward mode
sets on tensors, so a pass whose batch axis is off axis 0 refuses these records
(:meth:`~backprism.engine.backward.BackwardPass.check`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from backprism.engine.fold import saved_dim, saved_int
from backprism.engine.state import CALLS, LossRecord

__all__ = ["loss_record", "saved_reduction"]

#: ``at::Reduction``: 0 none, 1 mean, 2 sum
_REDUCTIONS = {1: "mean", 2: "sum"}
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
#: nodes between ``log_softmax`` and ``nll_loss2d`` in ``cross_entropy`` of a ``[N, C, d…]``
#: input (it views the input as 4-D); they change no value
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "UnsqueezeBackward0"})


def loss_record(node: Any) -> LossRecord | None:
    """The :class:`LossRecord` of the functional loss whose backward node is ``node``, or
    ``None`` if ``node`` is not one of the recognised losses (module docstring)."""
    kind = type(node).__name__
    try:
        if kind in _NLL:
            return _nll(node)
        if kind == "MseLossBackward0":
            return _elementwise(node, nn.MSELoss)
        if kind == "BinaryCrossEntropyWithLogitsBackward0":
            return _elementwise(node, nn.BCEWithLogitsLoss)
    except RuntimeError:  # a saved tensor already freed (a backward ran without retain_graph)
        return None
    return None


def saved_reduction(node: Any) -> str | None:
    """The ``reduction`` a loss operation's backward node saved, ``"mean"`` or ``"sum"``;
    ``None`` for ``"none"`` or a node without one."""
    saved = getattr(node, "_saved_reduction", None)
    return None if saved is None else _REDUCTIONS.get(int(saved))


def _record(module: nn.Module, inputs: list[Any]) -> LossRecord:
    record = LossRecord(module, inputs)
    record.functional = True
    return record


def _nll(node: Any) -> LossRecord | None:
    reduction = saved_reduction(node)
    if reduction is None:
        return None
    fn = node.next_functions[0][0]
    while fn is not None and type(fn).__name__ in _VIEWS:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "LogSoftmaxBackward0" or CALLS in fn.metadata:
        # not a cross-entropy, or the log_softmax is the output of a module's call (the
        # columns would enter before that call's output)
        return None
    lp: Tensor = fn._saved_result
    if lp.dim() < 2 or saved_dim(fn._saved_dim, lp.dim()) != 1:
        return None
    target: Tensor = node._saved_target
    if target.numel() != lp.numel() // lp.shape[1]:
        return None
    target = target.reshape(lp.shape[0], *lp.shape[2:])
    ignore = saved_int(node._saved_ignore_index)
    weight = node._saved_weight
    module = nn.NLLLoss(weight=weight, ignore_index=ignore, reduction=reduction)
    return _record(module, [lp, target])


def _elementwise(node: Any, loss: type[nn.Module]) -> LossRecord | None:
    reduction = saved_reduction(node)
    if reduction is None:
        return None
    x: Tensor = node._saved_self
    if x.grad_fn is None:
        return None
    kwargs: dict[str, Any] = {"reduction": reduction}
    if loss is nn.BCEWithLogitsLoss:
        kwargs["weight"] = node._saved_weight
        kwargs["pos_weight"] = node._saved_pos_weight
    return _record(loss(**kwargs), [x, node._saved_target])
