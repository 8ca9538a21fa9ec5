r"""The :class:`Monitor`: tracks quantities on schedules around the backward pass.

Usage (the model and the loss module must be ``backprism.extend``-ed)::

    monitor = Monitor(model.parameters(), configuration("economy"), log_path="run.jsonl")
    for step, (X, y) in enumerate(loader):
        optimizer.zero_grad()
        outputs = model(X)
        loss = lossfunc(outputs, y)                       # mean reduction
        losses = individual_lossfunc(outputs, y)          # reduction="none"
        with monitor(step, info={"batch_size": X.shape[0], "individual_losses": losses,
                                 "loss": loss, "optimizer": optimizer}):
            loss.backward(create_graph=monitor.create_graph(step))
        optimizer.step()

``info`` keys (Cockpit's): ``loss`` (mini-batch loss tensor), ``batch_size`` (int),
``individual_losses`` (``[N]`` tensor of ``ℓₙ``), ``optimizer``. A key needed at a step by an
active quantity but missing raises ``KeyError`` naming the key and the quantity.

**Extension requests are merged.** Quantities ask for engine extensions (``BatchL2Grad``,
``BatchDotGrad``, ``SumGradSquared``, ``BatchGrad``, curvature diagonals); equal requests (same
type and hyperparameters) are computed once; requests of one type with *different*
hyperparameters (e.g. ``DiagGGNMC(mc_samples=1)`` from a quantity and ``DiagGGNMC(mc_samples=4)``
passed by the user) are all computed in the same backward pass, the later ones under the
attribute ``"<savefield>_<i>"`` (``i = 1, 2, …``); extensions passed by the user keep their
standard attribute and are left on the parameters, the monitor's own are deleted after the step.
Gradient-element histograms of several quantities (``GradHist`` requests that differ only in
what they bin: GradHist1d's 1d counts, GradHist2d's 2d counts, bin adaptation's maxima) are
merged into one streaming ``GradHist`` pass, so per-sample gradients are built once per layer
and chunk of samples. No built-in quantity materialises ``grad_batch`` for a layer except α's
optimizer-agnostic fallback (non-SGD optimizers), which must keep the start step's gradients.
Quantities defining ``transforms`` still receive each parameter's ``grad_batch`` module by module
(then freed).

**Output keys.** A quantity's key is its class name. If several quantities of one class are
tracked, each key gets the hyperparameters in which they differ, e.g.
``"HessTrace(curvature=diag_h)"`` and ``"HessTrace(curvature=diag_ggn_exact)"``; if that still
does not separate them (only their schedules differ) ``"#<i>"`` (position among them, from 1)
is appended: ``"Loss#1"``, ``"Loss#2"``.

:meth:`Monitor.get_output` returns ``{key: {step: value}}`` (plus the :meth:`Monitor.log`
fields ``{field: {step: value}}``); :meth:`Monitor.write` saves it as JSON; the streamed log is
described in :mod:`backprism.monitor.log`.

**No host synchronisation inside a step.** Quantities compute on the parameters' device and
hand back :class:`~backprism.monitor.deferred.Pending` values; the monitor moves all values of a
tracked step to the host in one transfer when it writes the step's log line. With
``write_lag=1`` (the default on CUDA) that transfer is started asynchronously at the end of the
step and read at the end of the next tracked step, so it overlaps the next step's compute;
:meth:`Monitor.flush`, :meth:`Monitor.get_output`, :meth:`Monitor.write` and
:meth:`Monitor.close` write what is still in flight. Whether the step's loss and gradients are
finite is decided on the device too. See :mod:`backprism.monitor.syncs` to count what
synchronises.

**Memory.** While a log is streamed, quantities with large per-step values (``GradHist1d``,
``GradHist2d``, ``Parameters``) keep only their first and latest values in memory (what the
dashboard draws; ``keep_history=True`` keeps all); the log has every value.

**Cost.** :meth:`Monitor.cost_estimate` times a plain step and every quantity on the user's
model and prints the overhead per step and amortised over the schedules
(:mod:`backprism.monitor.cost`).

**Distributed data parallelism** (:mod:`backprism.monitor.distributed`). Under
``DistributedDataParallel`` a step whose backward pass DDP synchronises is *global*: every value
is the one-process value on the global batch (all ranks' samples), the same on every rank,
from each rank's local ``info``; only rank 0 writes the log. ``no_sync()`` steps stay local;
``process_group=`` chooses (``"auto"``, a group, ``None`` for local values).

**Bad input.** A step with NaN/inf loss or gradients makes every quantity that depends on them
record NaN, with one ``RuntimeWarning`` when the step's values are written; training
continues. Per-sample quantities need a mean-reduced loss (``ValueError`` otherwise; checked
once, on the first step that needs it) and refuse BatchNorm in train mode with a
``RuntimeError`` naming them (``Loss``, ``GradNorm``, ``Distance``, ``UpdateSize``, ``HessMaxEV``
work with it).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import math
import os
import warnings
import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from backprism.engine.backward import current_pass
from backprism.engine.collect import collect
from backprism.engine.distributed import check_process_group
from backprism.engine.residual import want_residuals
from backprism.extensions import BatchDotWith, BatchGrad, BatchL2Grad, BatchProjGrad, GradHist
from backprism.extensions.base import Extension
from backprism.monitor.deferred import Transfer, host_fast_paths
from backprism.monitor.distributed import (
    GlobalStep,
    PassGradient,
    RetainGraph,
    several_ranks,
    writes_log,
)
from backprism.monitor.log import LogWriter, to_jsonable
from backprism.monitor.quantities.base import (
    NUMERICAL_ERRORS,
    PendingEntry,
    Quantity,
    StepData,
    extension_key,
    finish_entries,
    grad_norms,
    missing_info_message,
)

__all__ = ["Monitor"]

_NUMERICAL_ERRORS = NUMERICAL_ERRORS
#: per-sample results whose ``[N_r]`` rows a global step gathers (``StepData.rows``)
_ROW_EXTENSIONS = (BatchL2Grad, BatchProjGrad, BatchDotWith)


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else repr(v)


def assign_keys(quantities: list[Quantity]) -> None:
    """Give every quantity a unique output key (see the module docstring)."""
    by_name: dict[str, list[Quantity]] = defaultdict(list)
    for q in quantities:
        by_name[type(q).__name__].append(q)
    for name, group in by_name.items():
        if len(group) == 1:
            group[0].key = name
            continue
        hps = [q.hyperparameters() for q in group]
        names = sorted({k for h in hps for k in h})
        differing = [k for k in names if len({repr(h.get(k)) for h in hps}) > 1]
        keys = []
        for h in hps:
            if differing:
                keys.append(
                    f"{name}(" + ", ".join(f"{k}={_fmt(h.get(k))}" for k in differing) + ")"
                )
            else:
                keys.append(name)
        counts = Counter(keys)
        seen: Counter[str] = Counter()
        for q, k in zip(group, keys):
            if counts[k] > 1:
                seen[k] += 1
                k = f"{k}#{seen[k]}"
            q.key = k


class Monitor:
    """Training instrument panel: tracks ``quantities`` of ``params`` on their schedules.

    Args:
        params: the parameters the quantities are computed for (all ``requires_grad``).
        quantities: :class:`~backprism.monitor.quantities.Quantity` instances (e.g. from
            :func:`~backprism.monitor.configuration`); default none.
        log_path: if given, stream the log to this file (see :meth:`stream`).
        write_lag: tracked steps the transfer and log write of a step's values may lag behind
            (``0``: written at the end of the step; ``1``: at the end of the next tracked step,
            overlapping its compute). Default: ``1`` for parameters on CUDA, else ``0``.
        keep_history: keep every per-step value in memory also while streaming a log
            (default: quantities with large values keep their first and latest only).
        process_group: distributed data parallelism (:mod:`backprism.monitor.distributed`).
            ``"auto"`` (default): a step whose backward pass runs through a model wrapped by
            ``DistributedDataParallel`` that synchronises gradients is *global*, every value
            that of one process on the global batch (all ranks' samples), the same on every
            rank; steps inside ``no_sync()`` keep this rank's values. A process group: every
            step is global over it (inside ``no_sync()`` too). ``None``: every rank monitors
            its own batch. Unless ``None``, only rank 0 (of the group; of the default group
            for ``"auto"``) writes the log (:meth:`stream`, :meth:`write`); construct the
            monitor after ``torch.distributed.init_process_group``.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        quantities: Iterable[Quantity] | None = None,
        log_path: str | os.PathLike | None = None,
        write_lag: int | None = None,
        keep_history: bool | None = None,
        process_group: Any = "auto",
    ) -> None:
        self.process_group = check_process_group(process_group, "Monitor")
        self.params = list(params)
        if not self.params:
            raise ValueError("Monitor needs at least one parameter")
        for p in self.params:
            if not isinstance(p, Tensor) or not p.requires_grad:
                raise ValueError(
                    "Got parameter with requires_grad=False "
                    f"(shape {tuple(getattr(p, 'shape', ()))})"
                )
        self.quantities: list[Quantity] = []
        for q in quantities or []:
            self.add(q)
        self._log_output: dict[str, dict[int, Any]] = defaultdict(dict)
        self._writer: LogWriter | None = None
        #: a log is streamed (by this process, or by rank 0 under torch.distributed)
        self._streaming = False
        if write_lag is not None and int(write_lag) < 0:
            raise ValueError(f"write_lag must be >= 0, got {write_lag!r}")
        self.write_lag = write_lag
        self.keep_history = keep_history
        self._inflight: deque[tuple[int, Transfer, list[PendingEntry], list[int]]] = deque()
        self._mean_checked = False
        #: tracked steps left on which the gradient reaching ``info['loss']`` is compared with 1
        #: (:meth:`_StepContext._check_loss_scale`; 0 once a warning was given)
        self._scale_checks = 10
        #: ``(step, gradient reaching info['loss'])`` not yet read on the host (accelerators:
        #: moved with the step's values, :meth:`_check_loss_scales`)
        self._loss_scales: list[tuple[int, Tensor]] = []
        if log_path is not None:
            self.stream(log_path)
        ref = weakref.ref(self)
        atexit.register(_flush_at_exit, ref)

    # -- set-up ------------------------------------------------------------------------------
    def add(self, quantity: Quantity) -> None:
        """Track one more quantity (output keys are re-assigned)."""
        if not isinstance(quantity, Quantity):
            raise ValueError(f"Added quantities must be instances of Quantity. Got {quantity!r}")
        if any(q is quantity for q in self.quantities):
            raise ValueError(f"{quantity!r} is already tracked by this monitor")
        self.quantities.append(quantity)
        assign_keys(self.quantities)
        if quantity.needs_residual:
            want_residuals(self.params)

    def keys(self) -> list[str]:
        """Output keys of the tracked quantities."""
        return [q.key for q in self.quantities]

    @property
    def writes_log(self) -> bool:
        """Whether this process writes the log: rank 0 under ``torch.distributed`` (unless
        ``process_group=None``), else always."""
        return writes_log(self.process_group)

    def stream(self, path: str | os.PathLike, mode: str = "w", fsync: bool = False) -> None:
        """Stream the log to ``path`` (JSON Lines, one flushed line per tracked step; schema in
        :mod:`backprism.monitor.log`). ``mode="a"`` appends to an existing log. Under
        ``torch.distributed`` only rank 0 writes (:attr:`writes_log`); the other ranks
        open no file."""
        self.close()
        self._streaming = True
        if self.writes_log:
            self._writer = LogWriter(path, self.keys(), mode=mode, fsync=fsync)

    def close(self) -> None:
        """Write the values still in flight and close the streamed log (if any)."""
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._streaming = False

    def flush(self) -> None:
        """Build the values still in flight (one transfer per step) and stream them."""
        while self._inflight:
            self._write_oldest()
        for q in self.quantities:
            if q._pending:
                finish_entries(list(q._pending))
        self._stream_new()

    @property
    def lag(self) -> int:
        """Tracked steps a step's transfer and log write lag behind (``write_lag``)."""
        if self.write_lag is not None:
            return int(self.write_lag)
        return 1 if self.params[0].device.type == "cuda" else 0

    def _after_step(self, step: int) -> None:
        """Start the transfer of the step's values; finish those more than ``lag`` behind."""
        entries = [e for q in self.quantities for e in q._pending if e.at == step and not e.done]
        scales, self._loss_scales = self._loss_scales, []
        if entries or scales:
            tensors = [t for e in entries for t in e.tensors()] + [g for _, g in scales]
            self._inflight.append((step, Transfer(tensors), entries, [k for k, _ in scales]))
        while len(self._inflight) > self.lag:
            self._write_oldest()
        self._stream_new()

    def _write_oldest(self) -> None:
        _, transfer, entries, scale_steps = self._inflight.popleft()
        arrays = transfer.result()
        k = len(arrays) - len(scale_steps)
        finish_entries(entries, arrays[:k])
        self._check_loss_scales([(t, float(a)) for t, a in zip(scale_steps, arrays[k:])])

    def _check_loss_scales(self, scales: list[tuple[int, float]]) -> None:
        """Warn (once) when a tracked step's backward pass started from a multiple ``s·L`` of
        ``info['loss']`` (``scales``: ``(step, s)``; ``torch.amp.GradScaler``'s
        ``scaler.scale(loss)``, ``loss / k`` for gradient accumulation): every result computed
        from gradients is then the scaled objective's, while the loss values are ``L``'s. On
        an accelerator ``s`` comes to the host with the step's values, in their transfer."""
        for step, s in scales:
            if self._scale_checks <= 0:
                return
            self._scale_checks -= 1
            if not math.isfinite(s) or abs(s - 1.0) <= 1e-6:
                continue
            self._scale_checks = 0
            warnings.warn(
                f"backprism.monitor: the backward pass of step {step} started from {s:.6g} × "
                "info['loss'] (a torch.amp.GradScaler's loss scale, or a loss divided for "
                "gradient accumulation). The tracked quantities computed from gradients are the "
                f"scaled objective's — gradients, per-sample gradients and histograms "
                f"{s:.6g}-fold, their squares, variances and the gradient tests' norms its "
                f"square, curvature (GGN, Hessian diagonal and trace) {s:.6g}-fold —, while "
                "loss values are info['loss']'s, so α and CABS mix the two. Call backward on "
                "info['loss'] itself on tracked steps (bfloat16 autocast needs no loss "
                "scaling), or read the values with that factor.",
                stacklevel=4,
            )

    # -- per step ----------------------------------------------------------------------------
    def create_graph(self, global_step: int) -> bool:
        """Whether ``loss.backward`` must be called with ``create_graph=True`` at this step.
        Always ``False`` under ``torch.distributed`` with several ranks: DDP refuses
        ``create_graph=True``; the monitor then differentiates ``info['loss']`` itself before
        the backward pass (:mod:`backprism.monitor.distributed`)."""
        if several_ranks(self.process_group):
            return False
        return any(q.create_graph(global_step) for q in self.quantities)

    def __call__(
        self, global_step: int, *exts: Extension, info: dict[str, Any] | None = None
    ) -> _StepContext:
        """Context for the backward pass of step ``global_step``; ``exts`` are extra engine
        extensions computed on top (their results stay on the parameters)."""
        for e in exts:
            if not isinstance(e, Extension):
                raise TypeError(f"*exts must be backprism extension instances. Got {e!r}")
        return _StepContext(self, int(global_step), list(exts), dict(info or {}))

    # -- epoch-level log ---------------------------------------------------------------------
    def log(
        self,
        global_step: int,
        epoch: int | None = None,
        train_loss: float | None = None,
        valid_loss: float | None = None,
        train_accuracy: float | None = None,
        valid_accuracy: float | None = None,
        learning_rate: float | None = None,
        test_loss: float | None = None,
        test_accuracy: float | None = None,
    ) -> None:
        """Record epoch-level metrics under ``global_step`` (streamed as a ``log`` line)."""
        values = {
            "train_loss": train_loss,
            "valid_loss": valid_loss,
            "test_loss": test_loss,
            "train_accuracy": train_accuracy,
            "valid_accuracy": valid_accuracy,
            "test_accuracy": test_accuracy,
            "learning_rate": learning_rate,
        }
        step = int(global_step)
        self._log_output["epoch"][step] = epoch
        record: dict[str, Any] = {"kind": "log", "step": step, "epoch": epoch}
        for k, v in values.items():
            if v is None:
                continue
            v = float(v.item() if isinstance(v, Tensor) else v)
            self._log_output[k][step] = v
            record[k] = v
        if self._writer is not None:
            self._writer.write(record)

    # -- output ------------------------------------------------------------------------------
    def get_output(self) -> dict[str, dict[int, Any]]:
        """``{key: {step: value}}`` for every quantity and every :meth:`log` field."""
        self.flush()
        out: dict[str, dict[int, Any]] = {q.key: dict(q.get_output()) for q in self.quantities}
        for k, v in self._log_output.items():
            out[k] = dict(v)
        return out

    def write(self, path: str | os.PathLike) -> None:
        """Write :meth:`get_output` to ``path`` as JSON (steps as string keys, NaN → null); on
        rank 0 only under ``torch.distributed`` (:attr:`writes_log`)."""
        if not self.writes_log:
            self.flush()
            return
        path = os.fspath(path)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        data = to_jsonable(
            {k: {str(s): v for s, v in d.items()} for k, d in self.get_output().items()}
        )
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True, allow_nan=False)

    def _stream_new(self) -> None:
        """Write the values built since the last call (one line per step) and drop the large
        ones the dashboard does not draw."""
        by_step: dict[int, dict[str, Any]] = defaultdict(dict)
        for q in self.quantities:
            for suffix, step, value in q.take_fresh():
                by_step[step][q.key + suffix] = value
        if not self._streaming:
            return
        if self._writer is not None:
            for step in sorted(by_step):
                self._writer.step(step, by_step[step])
        if not self.keep_history:
            for q in self.quantities:
                q.trim_history()

    def cost_estimate(self, model: torch.nn.Module, X: Any, y: Any, **kwargs: Any) -> Any:
        """Time a plain step and the configured quantities on ``model`` and print the overhead
        per step and amortised over the schedules; see
        :func:`backprism.monitor.cost.cost_estimate` for the arguments and the result."""
        from backprism.monitor.cost import cost_estimate

        return cost_estimate(self, model, X, y, **kwargs)


def _flush_at_exit(ref: weakref.ReferenceType[Monitor]) -> None:
    """Write what is still in flight when the interpreter exits (``write_lag > 0``)."""
    monitor = ref()
    if monitor is not None and monitor._inflight:
        with contextlib.suppress(Exception):  # best effort at shutdown
            monitor.close()


def _hists_compatible(a: GradHist, b: GradHist) -> bool:
    if (type(a), a.scale, a.chunk_elements) != (type(b), b.scale, b.chunk_elements):
        return False
    one = (a.bins, a.range, getattr(a, "range_id", 0))
    if a.bins is not None and b.bins is not None and one != (
        b.bins,
        b.range,
        getattr(b, "range_id", 0),
    ):
        return False
    two = (a.bins2d, a.range2d, getattr(a, "range2d_id", 0))
    return not (
        a.bins2d is not None
        and b.bins2d is not None
        and two != (b.bins2d, b.range2d, getattr(b, "range2d_id", 0))
    )


def _combine_hists(requests: list[Extension]) -> tuple[list[Extension], dict[Any, Extension]]:
    """Merge ``GradHist`` requests that can share one pass; returns the new request list and
    ``{original request key: merged extension}`` for the merged ones."""
    out: list[Extension] = []
    merged: list[tuple[GradHist, list[Extension]]] = []
    for e in requests:
        if not isinstance(e, GradHist):
            out.append(e)
            continue
        for m, members in merged:
            if _hists_compatible(m, e):
                if m.bins is None and e.bins is not None:
                    m.bins, m.range = e.bins, e.range
                    for attr in ("_range_dev", "range_id"):
                        if hasattr(e, attr):
                            setattr(m, attr, getattr(e, attr))
                if m.bins2d is None and e.bins2d is not None:
                    m.bins2d, m.range2d = e.bins2d, e.range2d
                    for attr in ("_range2d_dev", "range2d_id"):
                        if hasattr(e, attr):
                            setattr(m, attr, getattr(e, attr))
                m.abs_max = m.abs_max or e.abs_max
                members.append(e)
                break
        else:
            merged.append((copy.copy(e), [e]))
    aliases: dict[Any, Extension] = {}
    for m, members in merged:
        out.append(m)
        if len(members) > 1 or extension_key(members[0]) != extension_key(m):
            for e in members:
                aliases[extension_key(e)] = m
    return out, aliases


class _StepContext:
    """One step: requests extensions, runs transforms during the backward, then tracks."""

    def __init__(self, monitor: Monitor, step: int, exts: list[Extension], info: dict[str, Any]):
        self.monitor = monitor
        self.step = step
        self.user_exts = exts
        self.info = info
        self.data = StepData(step, monitor.params, info)
        self.ctx: collect | None = None
        self.owned_fields: set[str] = set()
        self.batch_field: str | None = None
        self.transforms: dict[str, dict[str, Any]] = {}
        #: the quantities' extension hooks of this step (Quantity.extension_hooks)
        self.hooks: list[Any] = []
        self.done: set[int] = set()
        self.param_ids = {id(p) for p in monitor.params}
        self.needs_mean = False
        self.checked_reduction = False
        self.exts: list[Extension] = []
        self.retain: RetainGraph | None = None
        #: the gradients reaching ``info['loss']`` in this step's backward passes, and the hook
        self.loss_grads: list[Tensor] = []
        self.loss_hook: Any = None

    # -- entering ----------------------------------------------------------------------------
    def __enter__(self) -> _StepContext:
        step, data, quants = self.step, self.data, self.monitor.quantities
        for q in quants:
            q.begin_step(step, data)
        active_q = [q for q in quants if q.should_compute(step)]
        for q in active_q:
            for key in sorted(q.info_keys(step)):
                if key not in self.info:
                    raise KeyError(missing_info_message(key, q, step))
        requests: list[Extension] = []
        for q in quants:
            requests += q.extensions(step)
            fns = q.transforms(step, data)
            if fns:
                self.transforms[q.key] = fns
            self.hooks += q.extension_hooks(step)
        loss = self.info.get("loss")
        if (
            active_q and self.monitor._scale_checks > 0 and isinstance(loss, Tensor)
            and loss.requires_grad and loss.numel() == 1
        ):
            self.loss_hook = loss.register_hook(self.loss_grads.append)
        per_sample = [q for q in active_q if q.per_sample]
        self.needs_mean = bool(per_sample) or bool(self.transforms)
        if self.needs_mean:
            self._check_mean_from_info(per_sample)
        if active_q and several_ranks(self.monitor.process_group):
            # the gradient of the pass: the global batch's in a global step, this rank's
            # (not DDP's average) with process_group=None
            requests.append(PassGradient())
        exts = self._merge(requests)
        self.exts = exts
        if self.transforms:
            self.batch_field = data.fields[extension_key(BatchGrad())]
            for p in self.monitor.params:  # no stale per-sample gradients from earlier steps
                if hasattr(p, self.batch_field):
                    delattr(p, self.batch_field)
        if several_ranks(self.monitor.process_group) and any(
            q.create_graph(step) for q in active_q
        ):
            self._graph_grads()
            self.retain = RetainGraph()
            self.retain.__enter__()
        if exts:
            # the graph is created for Hessian-vector products, never to differentiate results
            self.ctx = collect(
                *exts,
                extension_hook=self._hook,
                differentiable=False,
                process_group=self.monitor.process_group,
            )
            try:
                self.ctx.__enter__()
            except BaseException:
                if self.retain is not None:
                    self.retain.__exit__(None, None, None)
                    self.retain = None
                raise
        return self

    def _graph_grads(self) -> None:
        """Under torch.distributed: the gradient of this rank's ``info['loss']`` with its graph,
        before the backward pass, for Hessian-vector products (DDP refuses
        ``backward(create_graph=True)``; this keeps the graph for the backward pass)."""
        loss = self.info.get("loss")
        names = [q.key for q in self.monitor.quantities if q.create_graph(self.step)]
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            raise RuntimeError(
                f"backprism.monitor: {', '.join(names)} need info['loss'] as the tensor the "
                "backward pass starts from (with its graph)"
            )
        grads = torch.autograd.grad(
            loss, self.monitor.params, create_graph=True, allow_unused=True
        )
        self.data.graph_grads = list(grads)

    def _merge(self, requests: list[Extension]) -> list[Extension]:
        fields = self.data.fields
        exts = list(self.user_exts)
        used = set()
        for e in exts:
            fields.setdefault(extension_key(e), e.savefield)
            used.add(e.savefield)
        if self.transforms:
            requests = [*requests, BatchGrad()]
        # a trace is read from the diagonal of the same curvature when that is computed anyway
        present = {extension_key(e) for e in requests} | set(fields)
        twins: dict[Any, Any] = {}
        for e in requests:
            twin = getattr(e, "twin", None)
            if twin is not None and extension_key(twin()) in present:
                twins[extension_key(e)] = extension_key(twin())
        requests = [e for e in requests if extension_key(e) not in twins]
        requests, aliases = _combine_hists([e for e in requests if extension_key(e) not in fields])
        # streaming histograms last: their chunked per-sample work does not evict rule caches
        requests.sort(key=lambda e: isinstance(e, GradHist))
        for e in requests:
            key = extension_key(e)
            if key in fields:
                continue
            field = e.savefield
            i = 0
            while field in used:
                i += 1
                field = f"{e.savefield}_{i}"
            if field != e.savefield:
                e = copy.copy(e)
                e.savefield = field
            exts.append(e)
            fields[key] = field
            used.add(field)
            self.owned_fields.add(field)
        for key, target in aliases.items():
            fields.setdefault(key, fields[extension_key(target)])
        for key, twin_key in twins.items():
            fields.setdefault(key, fields[twin_key])
        return exts

    def _check_mean_from_info(self, per_sample: list[Quantity]) -> None:
        """Refuse a sum-reduced ``info['loss']`` (checked on the first step that needs it: one
        host read, then never again)."""
        if self.monitor._mean_checked:
            return
        loss, losses = self.info.get("loss"), self.info.get("individual_losses")
        if not isinstance(loss, Tensor) or not isinstance(losses, Tensor) or losses.numel() < 2:
            return
        self.monitor._mean_checked = True
        d = losses.detach().double()
        three = torch.stack([loss.detach().double().reshape(()).to(d.device), d.mean(), d.sum()])
        value, mean, total = (float(x) for x in three.cpu().tolist())
        if not (math.isfinite(value) and math.isfinite(mean)):
            return
        tol = 1e-4 * max(1.0, abs(mean))
        if abs(value - mean) > tol and abs(value - total) <= 1e-4 * max(1.0, abs(total)):
            names = ", ".join(q.key for q in per_sample) or "the histogram/α quantities"
            raise ValueError(
                f"backprism.monitor: {names} need a mean-reduced loss (L = (1/N) Σ ℓₙ), but "
                f"info['loss'] = {value:.6g} equals the sum of info['individual_losses']; use "
                "reduction='mean'"
            )

    # -- during the backward pass ------------------------------------------------------------
    def _check_reduction(self) -> None:
        if self.checked_reduction or not self.needs_mean:
            return
        self.checked_reduction = True
        bp = current_pass()
        if bp is None:
            return
        for record in bp.loss_records:
            reduction = getattr(record.module, "reduction", "mean")
            if reduction != "mean":
                names = ", ".join(
                    q.key
                    for q in self.monitor.quantities
                    if q.per_sample and q.should_compute(self.step)
                )
                raise ValueError(
                    f"backprism.monitor: {names} need a mean-reduced loss (L = (1/N) Σ ℓₙ), but "
                    f"{type(record.module).__name__}(reduction={reduction!r}) was used; use "
                    "reduction='mean'"
                )

    def _hook(self, module: torch.nn.Module) -> None:
        self._check_reduction()
        for hook in self.hooks:  # before owned per-sample buffers are freed
            hook(module)
        if self.batch_field is None:
            return
        for p in module.parameters():
            self._transform(p)

    def _transform(self, p: Tensor) -> None:
        if id(p) not in self.param_ids or id(p) in self.done:
            return
        field = self.batch_field
        assert field is not None
        grad_batch = getattr(p, field, None)
        if grad_batch is None:
            return
        self.done.add(id(p))
        store = self.data.transformed
        for qkey, fns in self.transforms.items():
            for name, fn in fns.items():
                store.setdefault(qkey, {}).setdefault(name, {})[id(p)] = fn(p, grad_batch)
        if field in self.owned_fields:
            delattr(p, field)

    # -- leaving -----------------------------------------------------------------------------
    def _free(self) -> None:
        for p in self.monitor.params:
            for field in self.owned_fields:
                if hasattr(p, field):
                    delattr(p, field)

    def _check_loss_scale(self) -> None:
        """Hand the gradient that reached ``info['loss']`` to the monitor's check
        (:meth:`Monitor._check_loss_scales`: at once on the CPU, with the step's values on an
        accelerator, which reads nothing on the host inside a step)."""
        if self.loss_hook is None:
            return
        self.loss_hook.remove()
        self.loss_hook = None
        if not self.loss_grads:
            return
        grad = self.loss_grads[-1].detach()
        if host_fast_paths(grad):
            self.monitor._check_loss_scales([(self.step, float(grad))])
        else:
            self.monitor._loss_scales.append((self.step, grad))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self.loss_hook is not None:
            if exc_type is None:
                self._check_loss_scale()
            else:
                self.loss_hook.remove()
                self.loss_hook = None
        try:
            try:
                if self.ctx is not None:
                    self.ctx.__exit__(exc_type, exc, tb)
            finally:
                if self.retain is not None:
                    self.retain.__exit__(None, None, None)
                    self.retain = None
        except BaseException:
            self._free()
            raise
        if exc_type is not None:
            self._free()
            if (
                isinstance(exc, RuntimeError)
                and "BatchNorm" in str(exc)
                and "train mode" in str(exc)
            ):
                names = [
                    q.key
                    for q in self.monitor.quantities
                    if q.per_sample and q.should_compute(self.step)
                ]
                raise RuntimeError(
                    f"backprism.monitor: the quantities {names} need per-sample gradients, which "
                    "BatchNorm in train mode makes undefined (it mixes the samples of a batch). "
                    "Track only Loss, GradNorm, Distance, UpdateSize, HessMaxEV, Time, "
                    "Parameters, HessTrace for this model, or call model.eval() for the backward "
                    f"pass. Engine message: {exc}"
                ) from exc
            return False
        try:
            self._track()
        finally:
            self._free()
            self.monitor._after_step(self.step)
        return False

    def _finite(self) -> Tensor:
        """Whether the loss and every gradient are finite, as a 0-dim device tensor, from the
        gradients' 2-norms (one fused reduction, shared with GradNorm and the gradient tests;
        NaN and ±inf propagate; a float32 gradient element above ~1e19 counts as infinite)."""
        ref = self.monitor.params[0]
        wide = torch.float32 if ref.device.type == "mps" else torch.float64
        parts: list[Tensor] = []
        loss = self.info.get("loss") if self.data.global_loss is None else self.data.global_loss
        if isinstance(loss, Tensor):
            parts.append(loss.detach().reshape(-1)[:1].to(ref.device, wide))
        norms = [n for n in grad_norms(self.data) if n is not None]
        parts += [n.reshape(1).to(ref.device, wide) for n in norms]
        if not parts:
            return torch.ones((), dtype=torch.bool, device=ref.device)
        return torch.isfinite(torch.cat(parts)).all()

    def _globalize(self) -> None:
        """A global step (the backward pass was distributed): the global batch's gradient,
        loss, individual losses and per-sample rows for the quantities, in one all-reduce
        (:mod:`backprism.monitor.distributed`)."""
        data, params = self.data, self.monitor.params
        field = data.fields.get(extension_key(PassGradient()))
        comm = getattr(self.ctx, "communication", None)
        if comm is None or comm.batch is None:
            if field is not None and self.monitor.process_group is None:
                data.pass_grads = [getattr(p, field, None) for p in params]
            return
        glob = GlobalStep(comm.group, comm.batch, data.device)
        data.dist = glob
        if field is not None:
            data.pass_grads = [getattr(p, field, None) for p in params]
        sums: list[Tensor] = []
        loss = self.info.get("loss")
        if loss is not None:
            loss_t = torch.as_tensor(loss).detach().to(data.device, torch.float64).reshape(())
            sums.append(loss_t * glob.loss_weight)
        rows: list[Tensor] = []
        fields: list[str] = []
        for e in self.exts:
            f = e.savefield
            present = all(hasattr(p, f) for p in params)
            if isinstance(e, _ROW_EXTENSIONS) and f not in fields and present:
                fields.append(f)
                rows += [getattr(p, f) for p in params]
        losses = self.info.get("individual_losses")
        active = [q for q in self.monitor.quantities if q.should_compute(self.step)]
        gather_losses = isinstance(losses, Tensor) and any(
            "individual_losses" in q.info_keys(self.step) for q in active
        )
        if gather_losses:
            rows.append(losses)  # type: ignore[arg-type]
        got_sums, got_rows = glob.reduce(sums, rows)
        if loss is not None:
            data.global_loss = got_sums[0]
        for i, f in enumerate(fields):
            data.global_rows[f] = got_rows[i * len(params) : (i + 1) * len(params)]
        if gather_losses:
            data.global_losses = got_rows[-1]

    def _track(self) -> None:
        step, data = self.step, self.data
        for p in self.monitor.params:  # parameters whose module hook did not run
            if self.batch_field is not None:
                self._transform(p)
        self._globalize()
        active = [q for q in self.monitor.quantities if q.should_compute(step)]
        data.finite_t = self._finite() if active else None
        flags = [] if data.finite_t is None else [data.finite_t]
        broken: list[str] = []
        before = [q for q in self.monitor.quantities if not q.after_cleanup]
        after = [q for q in self.monitor.quantities if q.after_cleanup]
        for group in (before, after):
            if group is after:
                self._free()
            for q in group:
                q._at, q._flags = step, flags
                try:
                    q.track(step, data)
                except _NUMERICAL_ERRORS as err:
                    broken.append(f"{q.key} ({type(err).__name__}: {err})")
                    q.track_nonfinite(step, data)
        if broken:
            warnings.warn(
                f"backprism.monitor step {step}: a numerical error; recorded NaN for "
                f"{', '.join(broken)}",
                RuntimeWarning,
                stacklevel=3,
            )
