r"""What the monitor costs on your model: per step and amortised over the schedules.

:func:`cost_estimate` (also :meth:`Monitor.cost_estimate <backprism.monitor.Monitor.cost_estimate>`)
times, on the user's model and one mini-batch,

1. a plain training step (forward, backward, optimizer step; no monitor);
2. every configured quantity alone, tracked at every step (its **per-step** overhead);
3. all of them together at every step;
4. every distinct step pattern within the first ``steps`` steps — the set of quantities the
   schedules make active at a step together with the set active at the step before it —
   each at a step where the schedules produce it, right after that step before (so that
   two-step quantities such as Alpha and UpdateSize end exactly as in training, and the memory
   the step before leaves behind is the same). Weighted by how often each pattern occurs,
   this is the **amortised** cost per step over that horizon.

Ratios are medians of ``repeats`` timed steps after a warm-up, each divided by the median of
the plain steps interleaved with it (so a change of the machine's load between variants does
not bias them). Clocks are read
after ``torch.cuda.synchronize()`` on CUDA. The model's parameters, gradients and buffers are
restored afterwards; the optimizer used for timing is a fresh ``torch.optim.SGD`` (``lr``)
unless ``optimizer`` builds another one from the parameters.

From a terminal: ``backprism cost [MODULE:CALLABLE] --config full [--json]`` (:mod:`backprism.cli`;
:meth:`CostReport.to_dict` is its JSON).
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from backprism.monitor import schedules

__all__ = ["CostReport", "cost_estimate"]


@dataclass
class CostReport:
    """Result of :func:`cost_estimate` (ratios to the plain step; ``str()`` is the table)."""

    plain_s: float
    """Median plain step in seconds."""
    per_quantity: dict[str, float]
    """Quantity key → step time with it tracked at every step, over the plain step."""
    together: float
    """All quantities tracked at every step, over the plain step (NaN if not timed)."""
    amortised: float
    """Mean step time over the first ``horizon`` steps with the schedules, over the plain
    step."""
    horizon: int
    patterns: list[tuple[int, list[str], float]] = field(default_factory=list)
    """``(number of steps, active quantity keys, ratio)`` of every distinct step pattern (a
    set of active quantities can appear several times, after different steps before it)."""
    tracked: dict[str, int] = field(default_factory=dict)
    """Quantity key → number of steps within the horizon at which it does work."""

    def quantity_keys(self) -> list[str]:
        """The monitor's quantity keys (those timed alone first)."""
        return list({**self.per_quantity, **self.tracked})

    def amortised_of(self, key: str) -> float:
        """The step with quantity ``key`` alone on its schedule, over the plain step, averaged
        over the horizon: ``1 + (per step − 1)·(active steps)/horizon`` (NaN if it was not
        timed alone). Quantities that share work cost less together than these add up to."""
        ratio = self.per_quantity.get(key, float("nan"))
        return 1.0 + (ratio - 1.0) * self.tracked.get(key, 0) / max(1, self.horizon)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data: the table's rows under ``"quantities"`` (``None``
        where a ratio was not timed, i.e. NaN)."""

        def num(x: float) -> float | None:
            return None if x != x else x

        return {
            "plain_s": self.plain_s,
            "horizon": self.horizon,
            "quantities": [
                {
                    "key": key,
                    "per_step": num(self.per_quantity.get(key, float("nan"))),
                    "active_steps": self.tracked.get(key, 0),
                    "amortised": num(self.amortised_of(key)),
                }
                for key in self.quantity_keys()
            ],
            "together": num(self.together),
            "amortised": self.amortised,
            "patterns": [
                {"steps": n, "quantities": list(keys), "ratio": ratio}
                for n, keys, ratio in self.patterns
            ],
        }

    def __str__(self) -> str:
        lines = [
            f"plain step: {self.plain_s * 1e3:.1f} ms",
            f"{'quantity':24s} {'per step':>9s} {'active steps':>13s} {'amortised':>10s}",
        ]
        for key in self.quantity_keys():
            n = self.tracked.get(key, 0)
            if key in self.per_quantity:
                ratio, amortised = self.per_quantity[key], self.amortised_of(key)
                lines.append(
                    f"{key:24s} {ratio:8.2f}× {n:6d}/{self.horizon:<6d} {amortised:9.3f}×"
                )
            else:  # not timed alone (per_quantity=False)
                lines.append(f"{key:24s} {'—':>9s} {n:6d}/{self.horizon:<6d} {'—':>10s}")
        if self.together == self.together:  # not NaN
            lines.append(f"{'all at every step':24s} {self.together:8.2f}×")
        lines.append(
            f"amortised over steps 0..{self.horizon - 1} with the schedules: "
            f"{self.amortised:.3f}× the plain step"
        )
        return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """Runs training steps on the model with or without a monitor, restoring nothing (the
    caller restores the model's state at the end)."""

    def __init__(
        self,
        model: nn.Module,
        params: list[Tensor],
        X: Any,
        y: Any,
        lossfunc: nn.Module,
        individual: Callable[[Tensor, Any], Tensor] | None,
        make_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.model, self.params, self.X, self.y = model, params, X, y
        self.lossfunc = lossfunc
        self.individual = individual
        self.opt = make_optimizer(params)
        self.device = params[0].device
        self.batch = int(X.shape[0]) if isinstance(X, Tensor) else len(X)

    def step(self, monitor: Any = None, step: int = 0) -> float:
        _sync(self.device)
        t0 = self.clock()
        self.opt.zero_grad(set_to_none=True)
        out = self.model(self.X)
        loss = self.lossfunc(out, self.y)
        if monitor is None:
            loss.backward()
        else:
            info: dict[str, Any] = {"loss": loss, "batch_size": self.batch, "optimizer": self.opt}
            if self.individual is not None:
                info["individual_losses"] = self.individual(out.detach(), self.y)
            with monitor(step, info=info):
                loss.backward(create_graph=monitor.create_graph(step))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        return self.clock() - t0


def _individual_loss(lossfunc: nn.Module) -> Callable[[Tensor, Any], Tensor] | None:
    """``ℓₙ`` for ``info['individual_losses']``: the loss class with ``reduction='none'``
    (not extended), if it can be built."""
    try:
        fresh = type(lossfunc)(reduction="none")
    except TypeError:
        return None
    for name in ("weight", "pos_weight", "label_smoothing", "ignore_index"):
        if hasattr(lossfunc, name):
            setattr(fresh, name, getattr(lossfunc, name))
    return fresh


def _pattern(quantities: list[Any], step: int) -> frozenset[int]:
    return frozenset(i for i, q in enumerate(quantities) if q.should_compute(step))


def cost_estimate(
    monitor: Any,
    model: nn.Module,
    X: Any,
    y: Any,
    lossfunc: nn.Module | None = None,
    individual_lossfunc: Callable[[Tensor, Any], Tensor] | None = None,
    optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
    lr: float = 1e-3,
    steps: int = 1000,
    repeats: int = 3,
    verbose: bool = True,
    per_quantity: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, int, str], None] | None = None,
) -> CostReport:
    """Time a plain step and ``monitor``'s quantities on ``model`` (module doc).

    Args:
        monitor: the :class:`~backprism.monitor.Monitor` whose quantities (and schedules) are
            timed; it is left untouched (copies of its quantities are timed).
        model: the ``backprism.extend``-ed model whose parameters the monitor tracks.
        X, y: one mini-batch (inputs and targets) on the model's device.
        lossfunc: the extended, mean-reduced loss module (default: an extended
            ``nn.CrossEntropyLoss()``).
        individual_lossfunc: ``ℓₙ`` for ``info['individual_losses']`` (default: the loss class
            with ``reduction='none'``).
        optimizer: ``params -> optimizer`` for the timed steps (default ``SGD(lr)``; Alpha's
            fast path needs plain SGD).
        lr: learning rate of the default optimizer.
        steps: horizon of the amortised estimate (steps ``0 … steps − 1``).
        repeats: timed steps per variant (medians).
        verbose: print the table.
        per_quantity: also time every quantity alone and all together at every step (items 2
            and 3 of the module doc; ``False``: only the amortised estimate).
        clock: the clock (default ``time.perf_counter``, wall time; ``time.process_time``
            counts this process's CPU time, steadier on a CPU shared with other work).
        progress: called as ``progress(done, total, label)`` before every timed variant
            (``done`` of ``total`` timed so far, ``label`` names the next one) and once at the
            end (``done == total``, ``label == ""``); e.g. for a progress bar.
    """
    import backprism
    from backprism.monitor.monitor import Monitor

    monitor.flush()
    if lossfunc is None:
        lossfunc = backprism.extend(nn.CrossEntropyLoss())
    individual = individual_lossfunc or _individual_loss(lossfunc)
    params = list(monitor.params)
    make = optimizer or (lambda ps: torch.optim.SGD(ps, lr=lr))
    saved_params = [p.detach().clone() for p in params]
    saved_grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    saved_state = copy.deepcopy(model.state_dict())
    runner = _Runner(model, params, X, y, lossfunc, individual, make, clock)
    plain: list[float] = []

    def timed(mon: Monitor, step_list: list[int], timed_step: int) -> float:
        """Median of the timed step over the median of the plain steps run next to it (the
        machine's load may change between variants). A plain step is timed after another
        plain step, as in training without the monitor: the memory a step touches first
        costs page faults on the CPU, and the step before decides how much that is."""
        times, near = [], []
        for r in range(repeats + 1):
            for s in step_list:
                t = runner.step(mon, s)
                if s == timed_step and r > 0:
                    times.append(t)
            runner.step()
            t = runner.step()
            plain.append(t)
            if r > 0:
                near.append(t)
        mon.close()
        return statistics.median(times) / statistics.median(near)

    def fresh(qs: list[Any], every: bool) -> list[Any]:
        out = []
        for q in qs:
            c = copy.deepcopy(q)
            if every:
                c._track_schedule = schedules.linear(1)
            out.append(c)
        return out

    qs = monitor.quantities
    # steps grouped by (pattern of the step before, pattern of the step): the step before
    # decides which caches exist and how much fresh memory the step touches
    counts: dict[tuple[frozenset[int], frozenset[int]], list[int]] = {}
    before: frozenset[int] = frozenset()
    for s in range(steps):
        now = _pattern(qs, s)
        counts.setdefault((before, now), []).append(s)
        before = now
    labels = [*(q.key for q in qs), "all at every step"] if per_quantity else []
    n_patterns = sum(1 for _, pat in counts if pat)
    labels += [f"schedule pattern {i + 1}/{n_patterns}" for i in range(n_patterns)]
    done = 0

    def tell() -> None:
        if progress is not None:
            progress(done, len(labels), labels[done] if done < len(labels) else "")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                runner.step()
            per_q: dict[str, float] = {}
            together = float("nan")
            if per_quantity:
                for q in qs:
                    tell()
                    mon = Monitor(params, fresh([q], every=True), process_group=None)
                    per_q[q.key] = timed(mon, [0, 1], 1)
                    done += 1
                tell()
                mon = Monitor(params, fresh(qs, every=True), process_group=None)
                together = timed(mon, [0, 1], 1)
                done += 1
            patterns: list[tuple[int, list[str], float]] = []
            for (_, pat), members in counts.items():
                s = members[0]
                if not pat:
                    patterns.append((len(members), [], 1.0))
                    continue
                tell()
                mon = Monitor(params, fresh(qs, every=False), process_group=None)
                seq = [s - 1, s] if s > 0 else [s]
                keys = [qs[i].key for i in sorted(pat)]
                patterns.append((len(members), keys, timed(mon, seq, s)))
                done += 1
            tell()
    finally:
        with torch.no_grad():
            for p, v, g in zip(params, saved_params, saved_grads):
                p.copy_(v)
                p.grad = g
        model.load_state_dict(saved_state)
    base = statistics.median(plain)
    amortised = sum(n * r for n, _, r in patterns) / steps
    tracked = {
        q.key: sum(1 for s in range(steps) if q.should_compute(s)) for q in monitor.quantities
    }
    report = CostReport(
        plain_s=base,
        per_quantity=per_q,
        together=together,
        amortised=amortised,
        horizon=steps,
        patterns=patterns,
        tracked=tracked,
    )
    if verbose:
        print(report)
    return report
