r"""The monitor under distributed data parallelism: every value describes the global batch.

A tracked step is **global** when the monitor's backward pass is a distributed one
(:mod:`backprism.engine.distributed`): with ``Monitor(process_group="auto")`` (the default) when
the model runs inside ``DistributedDataParallel`` and DDP synchronises gradients in that pass;
with ``Monitor(process_group=group)`` in every pass; never with ``process_group=None``. Every
logged value of a global step is then the value one process would log on the *global batch*,
the concatenation of all ranks' local batches in rank order (``N = Σ_r N_r``), on every rank.

The engine has already made its results the global batch's: global quantities
(``sum_grad_squared``, curvature diagonals and traces, histogram counts and ``abs_max``) are the
one-process values on every rank; per-sample rows (``batch_l2``, ``batch_proj_grad``,
``batch_dot_with``, ``grad_batch``) are this rank's rows of the one-process result. The monitor
combines the rest:

==========================================  =================================================
what                                        combination over the ranks
==========================================  =================================================
gradient ``g`` (GradNorm, gradient tests,   ``G = Σ_r ρ_r ∇L_r`` of the pass, from the
GSNR, CABS, EarlyStopping, α's fast path,   engine (:class:`PassGradient`: DDP's ``.grad``
the finiteness flag)                        when that is exact, else reduced with the results)
``info['loss']`` (Loss, α, CABS)            ``L = Σ_r ρ_r L_r``
``info['individual_losses']`` (α)           rows concatenated: ``[N]`` on every rank
per-sample rows summed over parameters      rows concatenated: ``[N]`` per parameter on every
(``batch_l2``, ``batch_proj_grad``,         rank
``batch_dot_with``)
``info['batch_size']``                      ``N = Σ_r N_r`` (each rank passes its own ``N_r``)
α's fallback start projections              rows concatenated (one more all-reduce on its end
                                            steps)
Hessian-vector products (HessMaxEV)         ``Hv = Σ_r ρ_r H_r v`` (one all-reduce per
                                            product, start vector broadcast from rank 0)
==========================================  =================================================

with ``ρ_r = N_r/N`` for a mean-reduced loss (``1`` for a sum). The loss, the individual losses
and all row vectors of a step travel in **one all-reduce** (:meth:`GlobalStep.reduce`: a
zero-padded buffer in which every rank fills its own slots), launched after the backward pass
and read on the device: the monitor adds no host read to a step (the engine's size exchange is
one). The rows are gathered rather than summed so that every quantity computes exactly what one
process computes from them (sample variances included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from backprism.engine.backward import current_pass
from backprism.engine.distributed import dist, initialized
from backprism.engine.extension import FirstOrderExtension, GlobalBatch
from backprism.engine.rule import Call, Rule

__all__ = ["GlobalStep", "PassGradient", "RetainGraph", "several_ranks", "writes_log"]

def several_ranks(group: Any) -> bool:
    """Whether ``torch.distributed`` runs with more than one rank (in ``group``; the default
    group for ``"auto"`` and ``None``): the monitor then asks the engine for the gradient of the
    pass (:class:`PassGradient`), since DDP's ``.grad`` is neither the global batch's gradient
    (unequal local batch sizes, accumulation) nor this rank's (``process_group=None``)."""
    if not initialized():
        return False
    return dist.get_world_size(None if group is None or isinstance(group, str) else group) > 1


def writes_log(group: Any) -> bool:
    """Whether this process writes the monitor's log: rank 0 of ``group`` (of the default group
    for ``"auto"``), every process for ``None`` or without ``torch.distributed``."""
    if group is None or not initialized():
        return True
    return dist.get_rank(None if isinstance(group, str) else group) == 0


class PassGradient(FirstOrderExtension):
    """The parameter's gradient of this backward pass (``monitor_pass_grad``); in a distributed
    pass the global batch's ``G = Σ_r ρ_r ∇L_r`` (:mod:`backprism.engine.distributed` reads it
    from DDP's averaged ``.grad`` when that is exact, equal local batch sizes and ``.grad`` empty
    before the pass, and all-reduces the local gradients with its other results otherwise).

    The monitor asks for it only under ``torch.distributed`` with several ranks: with unequal
    local batch sizes DDP's ``.grad`` is not the global batch's gradient (it weights rank
    ``r``'s samples ``1/(R·N_r)`` instead of ``1/N``), after ``no_sync()`` accumulation it
    holds several micro-batches, and with ``Monitor(process_group=None)`` it is the average
    over the ranks, not this rank's gradient."""

    savefield = "monitor_pass_grad"
    additive = True
    per_sample = False
    needs_param_grad = True

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        return dict.fromkeys(call.params)

    def builds_per_sample(self, rule: Rule, call: Call) -> bool:
        return False

    def finish(self, partial: Any, grad: Tensor) -> Tensor:
        bp = current_pass()
        if bp is not None and bp.distributed is not None:  # the engine's own G
            return grad.detach()
        # a local pass: the gradient autograd accumulates into .grad, which DDP overwrites
        # with the average over the ranks
        return grad.detach().clone()

    def accumulate(self, old: Any, new: Any) -> Any:
        return new  # every call of a shared parameter finishes with the same gradient

    def distributed_unsupported(self, params: list) -> str | None:
        return None

    def distributed_result(self, value: Any, reduced: list[Tensor], batch: GlobalBatch) -> Any:
        return value


class RetainGraph(TorchFunctionMode):
    """Within the block, ``loss.backward()`` and ``torch.autograd.backward`` keep the graph
    (``retain_graph=True``): the Hessian-vector products of a step under ``torch.distributed``
    differentiate the gradient the monitor took before the backward pass, whose graph shares
    the forward's saved tensors (DDP refuses ``backward(create_graph=True)``, which would keep
    them)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = dict(kwargs or {})
        if func is Tensor.backward or func is torch.autograd.backward:
            if len(args) > 2:  # (self/tensors, gradient/grad_tensors, retain_graph, ...)
                args = (*args[:2], True, *args[3:])
            else:
                kwargs["retain_graph"] = True
        return func(*args, **kwargs)


class GlobalStep:
    """A global step as the monitor sees it: the process group, the pass's
    :class:`~backprism.engine.extension.GlobalBatch` and the collectives the quantities need.

    Args:
        group: the process group of the pass.
        batch: its global batch (this rank, every rank's local size, the loss reduction).
        device: where the step's values live (the monitored parameters' device).
    """

    def __init__(self, group: Any, batch: GlobalBatch, device: torch.device) -> None:
        self.group = group
        self.batch = batch
        self.device = device
        self.comm_device = device
        if str(dist.get_backend(group)) == "nccl" and device.type != "cuda":
            self.comm_device = torch.device("cuda", torch.cuda.current_device())
        #: collective calls the monitor made in this step
        self.collectives = 0

    @property
    def n(self) -> int:
        """``N``, the global batch size."""
        return self.batch.n

    @property
    def loss_weight(self) -> float:
        """``ρ = N_r/N`` (mean) or ``1`` (sum)."""
        return self.batch.loss_weight

    @property
    def same_sizes(self) -> bool:
        """Whether all ranks have the same local batch size."""
        return len(set(self.batch.sizes)) == 1

    def reduce(
        self, sums: Sequence[Tensor], rows: Sequence[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One all-reduce: ``sums`` (this rank's contributions, any shapes) summed over the
        ranks, and ``rows`` (``[N_r, …]``, this rank's samples) concatenated in rank order to
        ``[N, …]``; float64 results on :attr:`device`."""
        if not sums and not rows:
            return [], []
        b = self.batch
        parts: list[Tensor] = []
        for t in sums:
            flat = torch.as_tensor(t).detach().reshape(-1)
            parts.append(flat.to(self.comm_device, torch.float64))
        for r in rows:
            r = r.detach()
            if r.dim() == 0 or r.shape[0] != b.local:
                raise ValueError(
                    f"backprism.monitor: a per-sample tensor of shape {tuple(r.shape)} on rank "
                    f"{b.rank} does not have this rank's {b.local} samples (the local batch of "
                    "the backward pass) along its first axis"
                )
            width = r[0].numel()
            full = torch.zeros(b.n * width, dtype=torch.float64, device=self.comm_device)
            full[b.offset * width : (b.offset + b.local) * width] = r.reshape(-1).to(full)
            parts.append(full)
        buf = torch.cat(parts)
        self.collectives += 1
        dist.all_reduce(buf, group=self.group)
        buf = buf.to(self.device)
        out_sums, out_rows = [], []
        pos = 0
        for t in sums:
            size = torch.as_tensor(t).numel()
            out_sums.append(buf[pos : pos + size].reshape(torch.as_tensor(t).shape))
            pos += size
        for r in rows:
            size = b.n * r[0].numel()
            out_rows.append(buf[pos : pos + size].reshape(b.n, *r.shape[1:]))
            pos += size
        return out_sums, out_rows

    def loss_sum(self, t: Tensor) -> Tensor:
        """``Σ_r ρ_r t_r`` of a tensor that is linear in the loss (a Hessian-vector product of
        the local loss), in ``t``'s dtype; one all-reduce."""
        buf = (t.detach() * self.loss_weight).to(self.comm_device)
        self.collectives += 1
        dist.all_reduce(buf, group=self.group)
        return buf.to(t.device)

    def broadcast(self, t: Tensor) -> Tensor:
        """Rank 0's ``t`` on every rank (a random start vector); one collective."""
        buf = t.detach().clone().to(self.comm_device)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.collectives += 1
        dist.broadcast(buf, src=src, group=self.group)
        return buf.to(t.device)
