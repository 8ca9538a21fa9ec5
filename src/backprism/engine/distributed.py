r"""Distributed data parallelism: the results of a backward pass describe the global batch.

**The rule.** Under ``DDP(extend(model))`` every result equals that of one process on the
*global batch*, the concatenation of all ranks' local batches in rank order (``N = Σ_r N_r``),
with the loss convention of that one process: for a mean-reduced loss ``L = (c/N) Σₙ ℓₙ``, for
a sum-reduced loss ``L = c Σₙ ℓₙ`` (``c`` a factor common to all ranks, e.g. ``1/accumulation
steps``).

* Global quantities (``sum_grad_squared``, ``variance``, ``diag_ggn_*``, ``diag_h*``, Kronecker
  factors, ``hmp``/``ggnmp``/``pchmp`` blocks, histograms, ``batch_dot`` with
  ``BatchDotGrad(across_ranks=True)``) are the one-process values, the same on every rank.
* Per-sample tensors (``grad_batch``, ``batch_l2``, ``diag_*_batch``, ``sqrt_ggn_*``,
  ``batch_dot_with``, ``batch_proj_grad``) are this rank's rows of the one-process result:
  rows ``offset … offset + N_r`` of the global batch (:class:`GlobalBatch`). Without
  ``across_ranks`` ``batch_dot`` is this rank's diagonal block ``[N_r, N_r]`` of the global
  matrix.

Each rank's own pass weights its samples ``c/N_r``; the global batch weights them ``c/N``. A
result homogeneous of degree ``d`` in the per-sample weights is therefore rescaled by
``ρ^d``, ``ρ = N_r/N`` (mean; ``1`` for sum): per-sample gradients ``d = 1``, their squares
``d = 2``, GGN and Hessian terms ``d = 1``, GGN square roots ``d = 1/2``; Kronecker input factors
``A = (1/N_r) Σ xxᵀ`` are batch averages and take ``α = N_r/N``. Summed quantities are rescaled
by each rank and summed over the ranks.

**DDP's ``.grad``.** DDP averages the local gradients: ``.grad = (1/R) Σ_r ∇L_r``. With equal
local batch sizes and a mean loss this *is* the gradient of the global mean loss, and
``Σ`` over all ranks' ``grad_batch`` rows equals ``.grad``. With unequal sizes it is not (it
weights rank ``r``'s samples by ``1/(R N_r)`` instead of ``1/N``); backprism's results still
follow the rule above (they are the one-process values), and ``variance`` / ``batch_proj_grad``
use the global gradient ``Σ_r ρ_r ∇L_r`` of the pass, which backprism then reduces itself. (For
a sum loss, ``.grad`` is ``1/R`` of the one-process gradient.) Do not rescale the loss per rank:
``ρ`` assumes every rank's loss is its local mean (or sum) times a common factor.

**When.** ``collect(..., process_group="auto")`` (the default) reduces when the default process
group is initialised with more than one rank and the pass's graph contains the forward of an
extended model run inside ``DistributedDataParallel`` (``DDP(extend(model))`` or
``extend(DDP(model))``) with gradient synchronisation on. Inside ``ddp.no_sync()`` DDP does not
communicate, and neither does backprism: results are local (this rank's batch, local
convention), as without DDP. ``process_group=<group>`` (e.g. ``dist.group.WORLD``) reduces over
that group in every pass, also inside ``no_sync()`` and without DDP; ``process_group=None`` always
gives local values.

**Communication.** Per pass: one small all-reduce of the local batch sizes and a fingerprint of
what each rank will compute, launched when the pass starts so that it completes during the
backward (ranks that compute different things get a clear error instead of a hang). The parts
of all extensions are packed into buckets of DDP's bucket size (25 MiB by default), one
all-reduce each. In first-order passes on backends whose collectives run beside the computation
(:data:`STREAM_BACKENDS`: NCCL) a parameter's parts join the buckets as soon as its results are
final (in the model's parameter order reversed, as the backward reaches them), and a full bucket
is launched at once, so communication overlaps the rest of the backward, as DDP's own does
(on Gloo everything is sent at the end: its reductions run on the cores the backward needs).
Second-order results are final once the loss hook has pushed the columns (the start of the
real backward) and are sent from there, except DiagHessian's (residual terms are added during
the backward) and KFRA's and Hutchinson's (they communicate while they compute). Whatever is
not final during the backward (whole-batch results, partials waiting for the global gradient)
is packed at the end. A small check that every rank sent the
same items in the same order goes with the last buckets (a mismatch is refused before any
result is written). Per-sample tensors are scaled for the global batch while they are
computed (the rules receive output gradients times ``ρ``, columns times ``√ρ``) and never
sent (except ``BatchDotGrad(across_ranks=True)``, which needs the cross-rank products). For
``variance`` / ``batch_proj_grad`` the global gradient is read from DDP's ``.grad`` when that is
exact (equal local sizes, DDP synchronised this pass, no comm hook, ``.grad`` was ``None`` at the
start of the pass) and reduced with the statistics otherwise. ``collect.communication`` reports
the bytes per extension of the last distributed pass next to DDP's own gradient bytes.

**Extension hooks** (``collect(..., extension_hook=f)``) run after the reduction in a
distributed pass (so they see global values), i.e. at the end of the pass rather than while it
runs.

**Not supported**: extensions that declare no reduction (the spectral computations' factor
extension; see ``docs/distributed.md``) are refused in distributed passes, FSDP
(``fully_shard``) is refused everywhere, and passes whose extended losses mix ``"mean"`` and
``"sum"`` are refused.
"""

from __future__ import annotations

import sys
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from backprism.engine.extension import CatPart, Extension, GlobalBatch, SumPart
from backprism.engine.loss_nodes import saved_reduction
from backprism.engine.state import FORWARD_LISTENERS

__all__ = [
    "Communication",
    "DistributedPass",
    "GlobalBatch",
    "check_process_group",
    "describe",
    "initialized",
    "setup",
]

try:  # torch built without distributed support
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as _DDP

    _AVAILABLE = dist.is_available()
except ImportError:  # pragma: no cover
    dist = None  # type: ignore[assignment]
    _DDP = None  # type: ignore[assignment,misc]
    _AVAILABLE = False

#: DDP's default bucket size (``bucket_cap_mb=25``)
DEFAULT_BUCKET_BYTES = 25 * 2**20
#: the first bucket's size in a pass that streams, as DDP's (its first bucket is small so that
#: communication starts early in the backward)
FIRST_BUCKET_BYTES = 2**20
#: backends whose collectives run beside the computation (NCCL: on the GPU's own engines), on
#: which finished results are sent during the backward. Gloo on the CPU computes the
#: reductions on the cores the backward needs: measured on 2 cores, sending during the
#: backward made a SumGradSquared step 10-25 % slower than sending at the end
STREAM_BACKENDS = frozenset({"nccl"})
#: largest parameter (elements) whose dense curvature block HMP/GGNMP/PCHMP reduce
MAX_BLOCK_NUMEL = 2**13


# -- which forwards ran under DDP -------------------------------------------------------------
#: extended root model -> (weak DDP wrapper, whether DDP set up gradient sync for that forward)
_DDP_OF: weakref.WeakKeyDictionary[nn.Module, tuple[Any, bool]] = weakref.WeakKeyDictionary()


def _active_ddp(module: nn.Module) -> Any:
    if _DDP is None:
        return None
    if isinstance(module, _DDP):  # extend(DDP(model))
        return module
    return getattr(_DDP, "_active_ddp_module", None)  # DDP(extend(model)): inside its forward


def _enter(module: nn.Module) -> None:
    """Forward listener: remember whether this top-level forward of an extended model runs
    inside a DDP forward (and whether DDP will synchronise its gradients). A forward without
    grad cannot be backpropagated and changes nothing."""
    if not torch.is_grad_enabled():
        return
    ddp = _active_ddp(module)
    if ddp is None:
        if module in _DDP_OF:
            del _DDP_OF[module]
        return
    _DDP_OF[module] = (weakref.ref(ddp), bool(ddp.require_backward_grad_sync))


def _exit(module: nn.Module, output: Any) -> None:
    return None


if _AVAILABLE and (_enter, _exit) not in FORWARD_LISTENERS:
    FORWARD_LISTENERS.append((_enter, _exit))


# -- the decision, before anything is written -------------------------------------------------
def initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default process group initialised."""
    return bool(_AVAILABLE and dist.is_initialized())


def check_process_group(group: Any, owner: str) -> Any:
    """``group`` if it is ``"auto"``, ``None`` or a process group; ``ValueError`` naming
    ``owner`` (``"collect"``, ``"Monitor"``) for any other string."""
    if isinstance(group, str) and group != "auto":
        raise ValueError(
            f"{owner}(process_group=...) takes 'auto', None or a process group, got {group!r}"
        )
    return group


def _unique_roots(bp: Any) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for r in bp.roots:
        seen.setdefault(id(r.module), r.module)
    return list(seen.values())


def _refuse_fsdp(roots: list[nn.Module]) -> None:
    """Refuse FSDP-sharded models. Only modules already imported are consulted: a model cannot
    be sharded without them (importing ``torch.distributed.fsdp`` takes seconds)."""
    classes: list[type] = []
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for name in ("FSDPModule", "FullyShardedDataParallel"):  # FSDP2 (torch >= 2.6), FSDP1
        cls = getattr(fsdp, name, None)
        if isinstance(cls, type):
            classes.append(cls)
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if not classes and dtensor is None:
        return
    for root in roots:
        for m in root.modules():
            sharded = bool(classes) and isinstance(m, tuple(classes))
            if not sharded and dtensor is not None:
                sharded = any(isinstance(p, dtensor) for p in m.parameters(recurse=False))
            if sharded:
                raise RuntimeError(
                    f"backprism: {type(m).__name__} is sharded with FSDP (fully_shard / "
                    "FullyShardedDataParallel); backprism does not support sharded parameters "
                    "yet (per-sample quantities need the unsharded weights and their "
                    "gradients). Wrap the model with DistributedDataParallel instead, or see "
                    "docs/distributed.md for the FSDP design"
                )


#: backward nodes that end a loss reduced over its elements by ``.mean()`` / ``.sum()``
_ROOT_REDUCTIONS = {
    "MeanBackward0": "mean", "MeanBackward1": "mean", "SumBackward0": "sum", "SumBackward1": "sum"
}
#: roots whose reduction could not be read were warned about once
_WARNED_UNKNOWN = [False]


def _root_reduction(node: Any) -> str | None:
    """The reduction a loss's own last node shows: a loss operation's saved ``reduction``
    (``F.smooth_l1_loss``, ``F.huber_loss``, …) or ``.mean()`` / ``.sum()``; ``None`` if the
    node shows none (a sum of terms, a scaled loss)."""
    return saved_reduction(node) or _ROOT_REDUCTIONS.get(type(node).__name__)


def _loss_reduction(bp: Any) -> str:
    """The loss convention of the pass: its losses' reduction (extended or recognised
    functional losses); without one, what the pass's start nodes show (``.mean()``,
    ``.sum()``, a loss operation's own ``reduction``); otherwise ``"mean"``, with a warning
    once, since a sum would need other per-sample weights."""
    reductions = {getattr(rec.module, "reduction", "mean") for rec in bp.loss_records}
    if not reductions:
        shown = {_root_reduction(node) for node in bp.view.starts}
        if len(shown) == 1 and None not in shown:
            return shown.pop()
        if not _WARNED_UNKNOWN[0]:
            _WARNED_UNKNOWN[0] = True
            warnings.warn(
                "backprism: this distributed backward pass ends in a loss whose reduction over "
                "the samples backprism cannot see (no extended or recognised functional loss, "
                "and the pass does not start from .mean() or .sum()); its results take it as a "
                "mean over the samples. For a sum, use an extended loss module "
                "(extend(nn.MSELoss(reduction='sum'))) or end the loss in .sum()",
                stacklevel=3,
            )
    if len(reductions) > 1:
        raise RuntimeError(
            "backprism: this distributed backward pass combines extended losses with "
            f"reductions {sorted(reductions)}; the per-sample weights of the global batch "
            "(1/N or 1) are then not one factor. Use one reduction for all losses, or "
            "collect(..., process_group=None) for this rank's values"
        )
    return reductions.pop() if reductions else "mean"


def _refuse_extensions(bp: Any, params: list[nn.Parameter], group_name: str) -> None:
    for ext in bp.extensions:
        reason = ext.distributed_unsupported(params)
        if reason is None:
            continue
        hint = (
            "Run it with collect(..., process_group=None) for this rank's samples only, or on "
            "one process over the whole batch"
        )
        if type(ext).__module__.startswith("backprism.spectral"):
            hint = (
                "GGN eigenvalues of the global batch need the Gram matrix of all ranks' "
                "columns, which is not reduced across ranks yet (docs/distributed.md). Compute "
                "them on one process over the whole batch (e.g. rank 0 with the unwrapped "
                "model and the gathered batch), or pass process_group=None to collect for this "
                "rank's samples"
            )
        raise RuntimeError(
            f"backprism: {reason}; its results cannot be combined over the ranks of this "
            f"distributed backward pass ({group_name}), and this rank's alone are not the "
            f"global batch's. {hint}"
        )


def setup(bp: Any) -> DistributedPass | None:
    """The distributed state of backward pass ``bp`` (:class:`DistributedPass`), or ``None``
    for a local pass; refuses what a distributed pass cannot compute (called at the end of
    :meth:`BackwardPass.check`, so before anything is written)."""
    ctx = bp.ctx
    mode = getattr(ctx, "process_group", "auto")
    if not initialized():
        if mode is None or isinstance(mode, str):
            return None
        raise RuntimeError(
            "backprism.collect(process_group=...): torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first, or leave process_group='auto'"
        )
    roots = _unique_roots(bp)
    _refuse_fsdp(roots)
    found = _group(bp, roots)
    if found is None:
        return None
    group, name, ddps = found
    params = [p for p, _ in bp.view.params.values()]
    _refuse_extensions(bp, params, name)
    reduction = _loss_reduction(bp)
    synced = [d for d, sync in ddps if sync and d.process_group is group]
    return DistributedPass(bp, group, reduction, synced)


def _group(bp: Any, roots: list[nn.Module]) -> tuple[Any, str, list[tuple[Any, bool]]] | None:
    """The process group a distributed pass of ``bp`` reduces over, what chose it (for
    messages) and the DDP wrappers of its forwards; ``None`` for a local pass."""
    mode = getattr(bp.ctx, "process_group", "auto")
    if mode is None or not initialized():
        return None
    ddps: list[tuple[Any, bool]] = []
    for root in roots:
        entry = _DDP_OF.get(root)
        ddp = entry[0]() if entry is not None else None
        if ddp is not None:
            ddps.append((ddp, entry[1]))
    if isinstance(check_process_group(mode, "collect"), str):  # "auto"
        if not ddps or not all(sync for _, sync in ddps):
            return None
        groups = {id(d.process_group): d.process_group for d, _ in ddps}
        if len(groups) > 1:
            raise RuntimeError(
                "backprism: this backward pass runs through models wrapped by "
                "DistributedDataParallel over different process groups; pass the group to "
                "reduce over as collect(..., process_group=group)"
            )
        group = next(iter(groups.values()))
        name = "DistributedDataParallel"
    else:
        group = mode
        name = "process_group"
    if dist.get_world_size(group) <= 1:
        return None
    return group, name, ddps


def announce_refusal(bp: Any) -> bool:
    """This rank refuses backward pass ``bp`` (:meth:`BackwardPass.check` raised). Where the
    pass would be distributed, tell the other ranks through the header they exchange when
    their pass starts (:meth:`DistributedPass._send_header`; this rank's fingerprint ``-1``),
    so that they raise at the end of theirs, naming this rank, instead of waiting for it.
    Returns whether some other rank did not refuse: it is running its backward, and DDP's
    gradient all-reduce needs this rank's, so the caller runs the plain backward before
    raising (``.grad`` then holds DDP's gradient of the step; no rank writes results). Ranks
    that all refuse run nothing."""
    try:
        found = _group(bp, _unique_roots(bp))
    except Exception:  # (the refusal the caller raises says enough)
        return False
    if found is None:
        return False
    group = found[0]
    world = dist.get_world_size(group)
    # (batch size 1: one the others' scaling can divide by; never used)
    header = _header(world, dist.get_rank(group), _collective_device(group, bp), 1, REFUSED, False)
    dist.all_reduce(header, group=group)
    return any(c != REFUSED for c in header[world : 2 * world].tolist())


#: the fingerprint of a rank that refused the pass (crc32 fingerprints are non-negative)
REFUSED = -1


def _collective_device(group: Any, bp: Any) -> torch.device:
    """Where pass ``bp``'s collectives over ``group`` run: its parameters' device (the current
    CUDA device for NCCL)."""
    device = torch.device("cpu")
    for p, _ in bp.view.params.values():
        device = p.device
    if str(dist.get_backend(group)) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _header(world: int, rank: int, device: torch.device, n: int, crc: int, ok: bool) -> Tensor:
    """A pass's header (:meth:`DistributedPass._send_header`) before its all-reduce: this rank's
    batch size ``n``, fingerprint ``crc`` and whether DDP's ``.grad`` serves it (``ok``) in its
    slots of ``[sizes | fingerprints | flags]``, zeros in the other ranks'."""
    header = torch.zeros(3 * world, dtype=torch.int64, device=device)
    header[rank] = n
    header[world + rank] = crc
    header[2 * world + rank] = int(ok)
    return header


# -- the reduction -----------------------------------------------------------------------------
@dataclass
class Communication:
    """What a distributed backward pass communicated (``collect.communication``).

    Attributes:
        bytes: payload bytes this rank all-reduced per extension (class name); ``"(sizes)"``
            is the per-pass exchange of batch sizes and fingerprints.
        collectives: collective calls of the pass.
        gradient_bytes: DDP's own gradient all-reduce payload for the same models (the
            gradients of their parameters that require grad), ``0`` without DDP.
        buckets: bytes of each bucket all-reduced.
        streamed: how many of those buckets were launched during the backward (overlapping
            it; :data:`STREAM_BACKENDS`), the others at its end.
        seconds: wall time of the reduction after the local pass (exchange, buckets,
            results).
        group: the process group the pass reduced over.
        batch: the pass's :class:`GlobalBatch` (this rank, every rank's local batch size, the
            loss reduction), ``None`` if the pass failed before the size exchange. The monitor
            combines its own statistics over ``group`` with it
            (:mod:`backprism.monitor.distributed`).
    """

    bytes: dict[str, int] = field(default_factory=dict)
    collectives: int = 0
    gradient_bytes: int = 0
    buckets: list[int] = field(default_factory=list)
    streamed: int = 0
    seconds: float = 0.0
    group: Any = None
    batch: GlobalBatch | None = None

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


class _Item:
    """One parameter's result of one extension awaiting the reduction."""

    __slots__ = ("ext", "grad", "key", "param", "partial", "parts", "value")

    def __init__(
        self,
        key: tuple,
        param: nn.Parameter,
        ext: Extension,
        value: Any,
        partial: bool,
        grad: Tensor | None = None,
    ) -> None:
        self.key = key
        self.param = param
        self.ext = ext
        self.value = value
        self.partial = partial
        self.grad = grad
        self.parts: list[SumPart | CatPart] = []


class DistributedPass:
    """The distributed part of one backward pass (module docstring): remembers what the pass
    stored, then reduces it over ``group`` in :meth:`reduce`."""

    def __init__(self, bp: Any, group: Any, reduction: str, ddps: list[Any]) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reduction = reduction
        self.ddps = ddps
        self.n_local = int(bp.n_samples)
        #: (id(param), savefield) -> (param, extension), in storing order
        self.stored: dict[tuple[int, str], tuple[nn.Parameter, Extension]] = {}
        #: (param, extension, partial, local gradient of the pass) of needs_param_grad exts
        self.pending: list[tuple[nn.Parameter, Extension, Any, Tensor]] = []
        self.grad_none: set[int] = set()
        self.ddp_params: set[int] = set()
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.device = torch.device("cpu")
        self.comm = Communication(group=group)
        # -- streaming (ready): finished parameters' results are sent during the backward --
        #: whether this pass streams: no whole-batch results, no second-order results that
        #: change after the loss hook (DiagHessian's residual terms) or that communicate
        #: while they are computed (KFRA, Hutchinson: ``handles_loss``)
        self.streams = (
            not any(e.needs_residual or e.handles_loss for e in bp.second)
            and not bp.whole_batch
            and not bp.create_graph
            and str(dist.get_backend(group)) in STREAM_BACKENDS
        )
        self._order: list[int] = []  # parameter ids in sending order (the model's, reversed)
        self._pos = 0
        self._ready: set[int] = set()
        self._by_param: dict[int, list[tuple[nn.Parameter, Extension]]] = {}
        self._streamed: set[tuple[int, str]] = set()
        self._sender: _Sender | None = None
        self._key: Any = None
        self._global: tuple[GlobalBatch, bool, bool] | None = None
        self._refused: list[int] = []  # ranks that refused the pass (:func:`announce_refusal`)

    # -- during the pass -----------------------------------------------------------------------
    def start(self, bp: Any) -> None:
        """Before the engine runs: which parameters' ``.grad`` is empty (DDP's averaged
        ``.grad`` is then exactly this pass's gradient) and which ones DDP reduces."""
        for p, _ in bp.view.params.values():
            if p.grad is None:
                self.grad_none.add(id(p))
        for ddp in self.ddps:
            ignored = getattr(ddp, "parameters_to_ignore", set())
            for name, p in ddp.module.named_parameters():
                if p.requires_grad and name not in ignored:
                    self.ddp_params.add(id(p))
                    self.comm.gradient_bytes += p.numel() * p.element_size()
            cap = getattr(ddp, "bucket_bytes_cap", None)
            if cap:
                self.bucket_bytes = int(cap)
        self.device = _collective_device(self.group, bp)
        order = self._param_order(bp)
        self._send_header(bp, order)
        self._key = _item_key(order, {id(e): i for i, e in enumerate(bp.extensions)})
        reached = [pid for pid in bp.view.params if pid in order]
        self._order = sorted(reached, key=lambda pid: order[pid], reverse=True)

    def _send_header(self, bp: Any, order: dict[int, tuple]) -> None:
        """Launch the pass's header all-reduce (every rank's batch size, a fingerprint of what
        it will compute, whether DDP's ``.grad`` can serve its pending partials) when the pass
        starts: it completes while the backward runs, and the reduction at the end waits for
        it instead of starting with a round trip (``order``: :meth:`_param_order`)."""
        keys = sorted(
            (*order.get(pid, (len(order), 0, "")), tuple(p.shape))
            for pid, (p, _) in bp.view.params.items()
        )
        exts = [f"{type(e).__name__}:{e.savefield}" for e in bp.extensions]
        text = f"{keys};{exts};{self.reduction};{bool(bp.whole_batch)}"
        ok = bool(self.ddps) and all(
            not getattr(d, "_comm_hooks", None)
            and not getattr(d, "_delay_all_reduce_all_params", False)
            and not getattr(d, "_use_python_reducer", False)
            for d in self.ddps
        )
        if any(e.needs_param_grad for e in bp.extensions):
            ok = ok and all(
                pid in self.grad_none and pid in self.ddp_params for pid in bp.view.params
            )
        header = _header(
            self.world, self.rank, self.device, self.n_local, zlib.crc32(text.encode()), ok
        )
        self.comm.collectives += 1
        self.comm.bytes["(sizes)"] = header.numel() * header.element_size()
        self._header = (header, dist.all_reduce(header, group=self.group, async_op=True))

    def stored_result(self, param: nn.Parameter, ext: Extension) -> None:
        key = (id(param), ext.savefield)
        if key not in self.stored:
            self.stored[key] = (param, ext)
            self._by_param.setdefault(id(param), []).append((param, ext))

    def ready(self, param: nn.Parameter) -> None:
        """``param``'s results of this pass are final (all its calls fired, nothing pending):
        send the results of every parameter ready in sending order so far (the model's
        parameters reversed, as the backward reaches them), packed into buckets launched when
        full, so that the communication overlaps the rest of the backward. Every rank sends
        the same parts in the same order (the header's fingerprint; checked again at the end)."""
        if not self.streams:
            return
        self._ready.add(id(param))
        try:
            self._send_ready()
        except BaseException:
            self._drop_stored()
            raise

    def _drop_stored(self) -> None:
        """Remove this pass's local results (a failed reduction leaves none behind)."""
        for param, ext in self.stored.values():
            if ext.savefield in param.__dict__:
                delattr(param, ext.savefield)

    def _send_ready(self) -> None:
        while self._pos < len(self._order) and self._order[self._pos] in self._ready:
            pid = self._order[self._pos]
            entries = self._by_param.get(pid, [])
            if entries:
                batch, _, same = self._header_read()
                if not same:  # (refused at the end of the pass)
                    self.streams = False
                    return
                items = []
                for p, e in entries:
                    it = _Item(self._key(p, e), p, e, getattr(p, e.savefield), False)
                    it.parts = list(e.distributed_parts(it.value, batch))
                    if any(isinstance(x, CatPart) and x.rows is None for x in it.parts):
                        self.streams = False  # lengths to exchange first: sent at the end
                        return
                    items.append(it)
                if self._sender is None:
                    self._sender = _Sender(self)
                for it in items:
                    self._sender.add(it)
                    self._streamed.add((id(it.param), it.ext.savefield))
            self._pos += 1

    def global_batch(self) -> GlobalBatch:
        """The global batch of the pass, for results scaled while they are computed
        (:attr:`~backprism.engine.extension.Extension.scaled_in_pass`); the first call waits
        for the header launched at the start of the pass."""
        return self._header_read()[0]

    def defer(self, param: nn.Parameter, ext: Extension, partial: Any, grad: Tensor) -> None:
        """A ``needs_param_grad`` partial with this rank's gradient of the pass: finished after
        the reduction with the global gradient (``grad`` is copied: DDP may overwrite it)."""
        self.pending.append((param, ext, partial, grad.detach().clone()))

    # -- collectives used during the pass (KFRA's recursion) ------------------------------------
    def loss_average(self, t: Tensor) -> Tensor:
        """``Σ_r ρ_r t_r`` for a loss-weighted local quantity ``t`` (mean: ``Σ N_r t_r / N``;
        sum: ``Σ t_r``); one collective call."""
        if self.reduction == "sum":
            return self._all_reduce_now(t)
        return self.batch_average(t)

    def batch_average(self, t: Tensor) -> Tensor:
        """``Σ_r N_r t_r / N`` for a local batch average ``t``; one collective call."""
        buf = torch.cat([t.reshape(-1) * self.n_local, t.new_full((1,), float(self.n_local))])
        buf = self._all_reduce_now(buf)
        return (buf[:-1] / buf[-1]).reshape(t.shape)

    def _all_reduce_now(self, t: Tensor) -> Tensor:
        t = t.contiguous().clone()
        self.comm.collectives += 1
        self.comm.bytes["KFRA"] = self.comm.bytes.get("KFRA", 0) + t.numel() * t.element_size()
        dist.all_reduce(t, group=self.group)
        return t

    # -- after the pass ------------------------------------------------------------------------
    def reduce(self, bp: Any) -> None:
        """Replace this pass's local results by the global batch's (module docstring)."""
        t0 = time.perf_counter()
        try:
            self._reduce(bp)
        except BaseException:
            self._drop_stored()
            raise
        finally:
            self.comm.seconds = time.perf_counter() - t0
            bp.ctx.communication = self.comm

    def _reduce(self, bp: Any) -> None:
        sender = self._sender or _Sender(self)
        sender.finishing = True  # (buckets launched from here on are not streamed)
        rest = [
            it
            for it in self._items(bp)
            if it.partial or (id(it.param), it.ext.savefield) not in self._streamed
        ]
        batch, ddp_grad = self._exchange(rest)
        # the global gradient of the pass, Σ_r ρ_r ∇L_r, for the pending partials: one part per
        # parameter (on its first pending item) unless DDP's averaged .grad is exact
        grad_part: dict[int, tuple[int, int]] = {}
        base = len(sender.items)
        for i, it in enumerate(rest):
            it.parts = list(it.ext.distributed_parts(it.value, batch))
            if it.partial and not ddp_grad and id(it.param) not in grad_part:
                grad_part[id(it.param)] = (base + i, len(it.parts))
                it.parts.append(SumPart(it.grad * batch.loss_weight))
        self._exchange_rows(rest)
        for it in rest:
            sender.add(it)
        reduced = sender.finish()
        items = sender.items
        _own_storage(items)
        grads: dict[int, Tensor] = {}
        for pid, (i, j) in grad_part.items():
            grads[pid] = reduced[i].pop(j)
        finished: set[tuple[int, str]] = set()
        for it, red in zip(items, reduced):
            value = it.ext.distributed_result(it.value, red, batch)
            if it.partial:
                g = grads.get(id(it.param))
                if g is None:  # DDP's average (1/R) Σ_r ∇L_r, all ρ_r equal
                    g = it.param.grad.detach() * (batch.loss_weight * batch.world_size)
                value = it.ext.finish(value, g.reshape(it.param.shape).to(it.param.dtype))
                key = (id(it.param), it.ext.savefield)
                if key in finished:  # several calls' partials (shared parameter)
                    value = it.ext.accumulate(getattr(it.param, it.ext.savefield), value)
                finished.add(key)
                self.stored_result(it.param, it.ext)
            setattr(it.param, it.ext.savefield, value)

    def _param_order(self, bp: Any) -> dict[int, tuple]:
        order: dict[int, tuple] = {}
        for i, root in enumerate(_unique_roots(bp)):
            for j, (name, p) in enumerate(root.named_parameters()):
                order.setdefault(id(p), (i, j, name))
        return order

    def _items(self, bp: Any) -> list[_Item]:
        key = self._key
        items = [
            _Item(key(p, e), p, e, getattr(p, e.savefield), False)
            for p, e in self.stored.values()
            if e.savefield in p.__dict__
        ]
        items += [_Item(key(p, e), p, e, partial, True, g) for p, e, partial, g in self.pending]
        items.sort(key=lambda it: it.key)
        return items

    def _exchange(self, items: list[_Item]) -> tuple[GlobalBatch, bool]:
        """The header launched at the start of the pass (:meth:`_send_header`): the global
        batch, and whether DDP's ``.grad`` is exact for the pending partials."""
        batch, ddp_grad = self._global_batch()
        if ddp_grad and any(it.partial and it.param.grad is None for it in items):
            raise RuntimeError(  # pragma: no cover - DDP writes .grad of every parameter
                "backprism: DistributedDataParallel left no .grad on a parameter it reduces; "
                "cannot finish Variance/BatchProjGrad with the global gradient"
            )
        return batch, ddp_grad

    def _global_batch(self) -> tuple[GlobalBatch, bool]:
        """Wait for the header (:meth:`_send_header`, once): the global batch, and whether
        every rank's DDP ``.grad`` is exact for its pending partials. Ranks that will compute
        different things are refused here (at the end of the pass: :meth:`_header_read`)."""
        batch, ddp_grad, same = self._header_read()
        if self._refused:
            raise RuntimeError(
                f"backprism: rank(s) {self._refused} of this distributed backward pass refused "
                "it before it ran (see the error raised there; the same model and data on one "
                "process gives it too); no results were written on any rank, and .grad holds "
                "DistributedDataParallel's gradient of the step"
            )
        if not same:
            raise RuntimeError(_DIFFERENT)
        return batch, ddp_grad

    def _header_read(self) -> tuple[GlobalBatch, bool, bool]:
        """The header's global batch, whether DDP's ``.grad`` is exact for the pending partials
        and whether all ranks' fingerprints agree. Also read during the backward (scaling,
        streaming), where a disagreement is not raised: an error in the middle of the backward
        would leave DDP's own gradient all-reduce waiting on the other ranks, so the refusal
        waits for the end of the pass, when every rank's backward is done."""
        if self._global is None:
            world = self.world
            header, work = self._header
            work.wait()
            h = header.tolist()
            sizes, crcs, oks = h[:world], h[world : 2 * world], h[2 * world :]
            batch = GlobalBatch(
                rank=self.rank, sizes=tuple(int(s) for s in sizes), reduction=self.reduction
            )
            self.comm.batch = batch
            self._global = (batch, all(oks) and len(set(sizes)) == 1, len(set(crcs)) == 1)
            self._refused = [r for r, c in enumerate(crcs) if c == REFUSED]
        return self._global

    def _items_check(self, items: list[_Item]) -> tuple[Tensor, Any]:
        """Launch the check that every rank reduces the same items in the same order: the
        maximum of ``[c, -c]`` over the ranks for a fingerprint ``c`` of this rank's items
        (all equal iff ``max c = -max(-c)``); sent together with the buckets."""
        text = ";".join(
            f"{it.key}:{type(it.ext).__name__}:{tuple(it.param.shape)}:{it.partial}:"
            f"{[type(p).__name__ for p in it.parts]}"
            for it in items
        )
        c = zlib.crc32(text.encode())
        check = torch.tensor([c, -c], dtype=torch.int64, device=self.device)
        self.comm.collectives += 1
        self.comm.bytes["(sizes)"] += check.numel() * check.element_size()
        return check, dist.all_reduce(check, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def _exchange_rows(self, items: list[_Item]) -> None:
        """First-axis lengths of concatenated parts that not every rank knows (one more small
        all-reduce, only in passes that have such parts)."""
        unknown = [p for it in items for p in it.parts if isinstance(p, CatPart) and p.rows is None]
        if not unknown:
            return
        world = self.world
        buf = torch.zeros(len(unknown) * world, dtype=torch.int64, device=self.device)
        for i, p in enumerate(unknown):
            buf[i * world + self.rank] = p.tensor.shape[0]
        self.comm.collectives += 1
        self.comm.bytes["(sizes)"] += buf.numel() * buf.element_size()
        dist.all_reduce(buf, group=self.group)
        rows = buf.tolist()
        for i, p in enumerate(unknown):
            p.rows = tuple(int(r) for r in rows[i * world : (i + 1) * world])


def _item_key(order: dict[int, tuple], ext_index: dict[int, int]) -> Any:
    """The sorting key of an item: the parameter's place in the root models, then the
    extension's in ``collect``; parameters of no root model in the order first asked for."""
    extra: dict[int, tuple] = {}

    def key(p: nn.Parameter, ext: Extension) -> tuple:
        k = order.get(id(p))
        if k is None:
            k = extra.setdefault(id(p), (len(order), len(extra), tuple(p.shape)))
        return (*k, ext_index.get(id(ext), -1))

    return key


class _Sender:
    """Packs the parts of items, in the order they are added, into per-dtype buckets of
    ``bucket_bytes`` (in a pass that streams the first of :data:`FIRST_BUCKET_BYTES`) and
    launches each bucket's all-reduce as soon as it is full (so the same
    buckets in the same order on every rank); :meth:`finish` launches the rest, waits and
    returns the reduced parts per item. A tensor that several sum parts share with the same
    scale is sent once."""

    def __init__(self, dp: DistributedPass) -> None:
        self.dp = dp
        self.items: list[_Item] = []
        self.flat: list[tuple[int, int, Tensor, torch.Size]] = []  # (item, part, 1-d, shape)
        self.same: dict[tuple, tuple[int, int]] = {}  # source -> (item, part) carrying it
        self.alias: list[tuple[int, int, int, int]] = []
        self.open: dict[torch.dtype, tuple[list[int], int]] = {}
        self.launched: list[tuple[Tensor, list[int], Any]] = []
        self.finishing = False

    def add(self, it: _Item) -> None:
        dp = self.dp
        i = len(self.items)
        self.items.append(it)
        name = type(it.ext).__name__
        for j, part in enumerate(it.parts):
            t = part.tensor.detach()
            if isinstance(part, SumPart):
                key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), part.scale)
                if t.numel() and key in self.same:
                    self.alias.append((i, j, *self.same[key]))
                    continue
                self.same[key] = (i, j)
                if part.scale != 1.0:
                    t = t * part.scale
            elif isinstance(part, CatPart):
                rows = part.rows
                assert rows is not None
                full = t.new_zeros((sum(rows), *t.shape[1:]))
                start = sum(rows[: dp.rank])
                full[start : start + rows[dp.rank]] = t
                t = full
            shape = t.shape
            t = t.to(dp.device).reshape(-1)
            nbytes = t.numel() * t.element_size()
            dp.comm.bytes[name] = dp.comm.bytes.get(name, 0) + nbytes
            self.flat.append((i, j, t, shape))
            members, size = self.open.get(t.dtype, ([], 0))
            cap = dp.bucket_bytes
            if dp.streams and not self.launched:
                cap = min(FIRST_BUCKET_BYTES, cap)
            if members and size + nbytes > cap:
                self._launch(members)
                members, size = [], 0
            members.append(len(self.flat) - 1)
            self.open[t.dtype] = (members, size + nbytes)

    def _launch(self, members: list[int]) -> None:
        dp = self.dp
        buf = _pack([self.flat[m][2] for m in members])
        dp.comm.collectives += 1
        dp.comm.buckets.append(buf.numel() * buf.element_size())
        work = dist.all_reduce(buf, group=dp.group, async_op=True)
        self.launched.append((buf, members, work))
        dp.comm.streamed += int(not self.finishing)

    def finish(self) -> list[list[Tensor]]:
        dp = self.dp
        self.finishing = True
        for dtype in sorted(self.open, key=str):
            members, _ = self.open[dtype]
            if members:
                self._launch(members)
        self.open.clear()
        if self.flat:  # (no parts, nothing combined: the header's fingerprint suffices)
            check, check_work = dp._items_check(self.items)
            check_work.wait()
            for _, _, w in self.launched:
                w.wait()
            c_max, minus_c_min = check.tolist()
            if c_max != -minus_c_min:
                raise RuntimeError(_DIFFERENT)
        out: list[list[Any]] = [[None] * len(it.parts) for it in self.items]
        for buf, members, _ in self.launched:
            pos = 0
            for k in members:
                i, j, t, shape = self.flat[k]
                r = buf[pos : pos + t.numel()].view(shape)
                pos += t.numel()
                dev = self.items[i].param.device
                out[i][j] = r if r.device == dev else r.to(dev)
        for i, j, k, m in self.alias:
            out[i][j] = out[k][m]
        return out


_DIFFERENT = (
    "backprism: the ranks of this distributed backward pass computed different results "
    "(different parameters got results, e.g. data-dependent branches, or different extensions "
    "were passed to collect), so they cannot be combined. Run the same extensions on the same "
    "model on every rank, or pass process_group=None for this rank's values"
)


def _own_storage(items: list[_Item]) -> None:
    """Give every tensor result that may be rescaled in place its own storage (results of one
    pass may share it, e.g. through the per-call memo), so that
    :meth:`Extension.distributed_result` may rescale it in place. Results scaled during the
    pass (:attr:`Extension.scaled_in_pass`, large per-sample rows) are not rescaled and keep
    theirs: the first other result seen on a storage is copied instead."""
    seen: set[int] = set()
    for it in sorted(items, key=lambda it: not it.ext.scaled_in_pass):
        v = it.value
        if isinstance(v, Tensor) and v.numel():
            ptr = v.untyped_storage().data_ptr()
            if ptr in seen and not it.ext.scaled_in_pass:
                it.value = v.clone()
            else:
                seen.add(ptr)


def _pack(tensors: list[Tensor]) -> Tensor:
    return tensors[0].clone() if len(tensors) == 1 else torch.cat(tensors)


def describe(comm: Communication | None) -> str:
    """One line per extension: bytes added per step, relative to DDP's gradient bytes."""
    if comm is None:
        return "no distributed backward pass"
    lines = []
    for name, b in comm.bytes.items():
        rel = f" ({b / comm.gradient_bytes:.2f}x DDP's gradients)" if comm.gradient_bytes else ""
        lines.append(f"{name}: {b} B{rel}")
    lines.append(f"collectives: {comm.collectives}, buckets: {comm.buckets}")
    return "\n".join(lines)
