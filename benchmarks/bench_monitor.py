"""Monitor overhead: time per training step with the monitor, as a ratio to the plain step.

For each problem (``cifar10_3c3d``, ``mnist_mlp``; N = 128, CPU, ``torch.set_num_threads(2)``)
a training step is forward + backward + SGD step. We time the plain step (extended model, no
monitor), the three configurations tracked at every step — with Cockpit's curvature
(``diag_h``) and with MC curvature (``diag_ggn_mc``, the ``-mc`` variants) — and every quantity
alone (Cockpit's defaults, plus the curvature modes ``Quantity[curvature]``), interleaving the
variants round by round after a warm-up, and print the median time of each variant divided by
the median plain step of the same run. A variant that raises is reported and left out.

``--amortised`` also measures the configurations with their default schedules
(:func:`backprism.monitor.configuration`) over the first 1000 steps with
:func:`backprism.monitor.cost.cost_estimate` (every distinct step pattern timed, weighted by
how often it occurs). ``--cockpit`` times Cockpit's configurations side by side (skipped when
``cockpit`` is not installed). ``--accelerator-paths`` runs the monitor's accelerator code paths
on the CPU (no host reads in the step; for comparison only).

With ``--device cuda`` model and data live on the GPU (``torch.cuda.synchronize()`` before the
clock starts and stops; CPU threads left at torch's default).

    python benchmarks/bench_monitor.py            # all variants, 7 rounds
    python benchmarks/bench_monitor.py --quick    # configurations only, 3 rounds, mnist_mlp
    python benchmarks/bench_monitor.py --isolate  # each variant in its own fresh process
    python benchmarks/bench_monitor.py --only-variants economy full-mc --amortised
    PYTHONPATH=src python benchmarks/bench_monitor.py --device cuda --isolate
    python benchmarks/bench_monitor.py --quick --markdown   # one GitHub markdown table

``--markdown`` prints one table at the end: a row per variant, a column per problem.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import problems
from measure import print_markdown
from problems import describe, sync

import backprism
from backprism.monitor import Monitor, configuration, quantities, schedules
from backprism.monitor.configuration import TRACKED
from backprism.monitor.cost import cost_estimate
from backprism.monitor.deferred import accelerator_paths

SINGLE = list(TRACKED)


CURVATURE_MODES = [
    ("HessTrace", "diag_ggn_exact"),
    ("HessTrace", "diag_ggn_mc"),
    ("HessTrace", "hutchinson"),
    ("TICDiag", "diag_ggn_mc"),
    ("TICTrace", "diag_ggn_mc"),
]

#: per-step targets (ratio to the plain step, CPU, cifar10_3c3d) from the issue
TARGETS = {"economy": 1.6, "business-mc": 2.0, "full-mc": 3.0}
AMORTISED_TARGET = 1.5


def variants(quick: bool) -> dict[str, object]:
    every = schedules.linear(1)
    out: dict[str, object] = {"plain": None}
    for label in ("economy", "business", "full"):
        out[label] = lambda label=label: configuration(label, every)
        if label != "economy":
            out[f"{label}-mc"] = lambda label=label: configuration(
                label, every, curvature="diag_ggn_mc"
            )
    if not quick:
        for name in SINGLE:
            out[name] = lambda name=name: [getattr(quantities, name)(every)]
        for name, curv in CURVATURE_MODES:
            out[f"{name}[{curv}]"] = lambda name=name, curv=curv: [
                getattr(quantities, name)(every, curvature=curv)
            ]
    return out


def bench(
    name: str,
    rounds: int,
    quick: bool,
    only: str | list[str] | None = None,
    device: str = "cpu",
) -> dict[str, float]:
    torch.manual_seed(0)
    model, lossf, X, y = problems.build(name, 128, device)
    backprism.extend(model)
    backprism.extend(lossf)
    indiv = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    wanted = None if only is None else ([only] if isinstance(only, str) else list(only))
    monitors = {
        k: None if make is None else Monitor(model.parameters(), make())  # type: ignore[operator]
        for k, make in variants(quick).items()
        if wanted is None or k == "plain" or k in wanted
    }
    steps = dict.fromkeys(monitors, 0)

    def one(key: str) -> float:
        monitor = monitors[key]
        sync(device)
        t0 = CLOCK()
        opt.zero_grad()
        out = model(X)
        loss = lossf(out, y)
        if monitor is None:
            loss.backward()
        else:
            step = steps[key]
            info = {
                "loss": loss,
                "individual_losses": indiv(out.detach(), y),
                "batch_size": X.shape[0],
                "optimizer": opt,
            }
            with monitor(step, info=info):
                loss.backward(create_graph=monitor.create_graph(step))
            steps[key] += 1
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return CLOCK() - t0

    times: dict[str, list[float]] = {k: [] for k in monitors}

    def attempt(key: str) -> float | None:
        try:
            return one(key)
        except Exception as err:  # e.g. a quantity that fails on this device: leave it out
            if key == "plain":
                raise
            print(f"# {name}: {key} failed: {_first_line(err)}", file=sys.stderr, flush=True)
            del monitors[key], times[key]
            return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in list(monitors):  # warm-up (also the first step of two-step quantities)
            attempt(k)
        for _ in range(rounds):
            for k in list(monitors):
                t = attempt(k)
                if t is not None:
                    times[k].append(t)
    plain = statistics.median(times["plain"])
    return {k: statistics.median(v) / plain for k, v in times.items()} | {"plain_s": plain}


CLOCK = time.perf_counter


def amortised(name: str, device: str, repeats: int) -> dict[str, float]:
    """Amortised ratio of each configuration with its default schedules over 1000 steps."""
    out = {}
    for label in ("economy", "business", "full"):
        torch.manual_seed(0)
        model, lossf, X, y = problems.build(name, 128, device)
        backprism.extend(model)
        backprism.extend(lossf)
        monitor = Monitor(model.parameters(), configuration(label))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = cost_estimate(
                monitor, model, X, y, lossfunc=lossf, steps=1000, repeats=repeats,
                verbose=False, per_quantity=False, clock=CLOCK,
            )
        out[f"{label} (default schedules)"] = report.amortised
    return out


def cockpit_bench(name: str, rounds: int, device: str) -> dict[str, float]:
    """Cockpit's configurations at every step, side by side (needs ``cockpit``)."""
    try:
        from backpack import extend as bp_extend
        from cockpit import Cockpit
        from cockpit.utils.configuration import configuration as cp_configuration
    except ImportError:
        return {}
    torch.manual_seed(0)
    model, lossf, X, y = problems.build(name, 128, device)
    model, lossf = bp_extend(model), bp_extend(lossf)
    indiv = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cps = {k: Cockpit(model.parameters(), quantities=cp_configuration(k))
           for k in ("economy", "business", "full")}
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in cps}}
    steps = dict.fromkeys(cps, 0)

    def one(key: str) -> float:
        sync(device)
        t0 = CLOCK()
        opt.zero_grad()
        out = model(X)
        loss = lossf(out, y)
        if key == "plain":
            loss.backward()
        else:
            cp = cps[key]
            info = {"loss": loss, "individual_losses": indiv(out, y), "batch_size": X.shape[0],
                    "optimizer": opt}
            with cp(steps[key], info=info):
                loss.backward(create_graph=cp.create_graph(steps[key]))
            steps[key] += 1
        opt.step()
        sync(device)
        return CLOCK() - t0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in times:
            one(k)
        for _ in range(rounds):
            for k in times:
                times[k].append(one(k))
    plain = statistics.median(times["plain"])
    return {f"Cockpit {k}": statistics.median(v) / plain for k, v in times.items() if k != "plain"}


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:160] if lines else ''}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="configurations only, few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--problems", nargs="*", default=None)
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="time each variant against the plain step in its own fresh process",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument(
        "--retain-freed-memory",
        action="store_true",
        help="call backprism.retain_freed_memory() first (no page faults on fresh memory)",
    )
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--only-variants", nargs="*", default=None,
                        help="time only these variants (names as printed)")
    parser.add_argument("--amortised", action="store_true",
                        help="also the configurations with their default schedules (amortised)")
    parser.add_argument("--cockpit", action="store_true",
                        help="also Cockpit's configurations (needs cockpit installed)")
    parser.add_argument("--accelerator-paths", action="store_true",
                        help="run the monitor's accelerator code paths on the CPU")
    parser.add_argument("--cpu-time", action="store_true",
                        help="clock this process's CPU time (steadier on a shared machine)")
    parser.add_argument("--markdown", action="store_true",
                        help="print one GitHub markdown table at the end")
    args = parser.parse_args(argv)
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    paths = accelerator_paths() if args.accelerator_paths else contextlib.nullcontext()
    with paths:
        _main(args)


def _main(args: argparse.Namespace) -> None:
    if args.retain_freed_memory:
        backprism.retain_freed_memory()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(2)
    rounds = args.rounds or (3 if args.quick else 7)
    names = args.problems or (["mnist_mlp"] if args.quick else ["cifar10_3c3d", "mnist_mlp"])
    if args.only:  # one variant in this process (used by --isolate)
        res = bench(names[0], rounds, args.quick, only=args.only, device=args.device)
        print(json.dumps(res))
        return
    keys = [k for k in variants(args.quick) if k != "plain"]
    if args.only_variants:
        keys = [k for k in keys if k in args.only_variants]
    settings = (
        f"N=128, rounds={rounds}, isolate={args.isolate}, "
        f"retain_freed_memory={args.retain_freed_memory}, "
        f"clock={'process CPU time' if args.cpu_time else 'wall'}"
        + (", accelerator paths" if args.accelerator_paths else "")
    )
    if not args.markdown:
        print(f"# monitor benchmark: {settings}, {describe(args.device)}", flush=True)
    table: dict[str, dict[str, float]] = {}  # problem -> {variant: ratio}
    for name in names:
        if args.isolate:
            res = {"plain_s": 0.0}
            for key in keys:
                cmd = [
                    sys.executable,
                    "-W",
                    "ignore",
                    __file__,
                    "--problems",
                    name,
                    "--rounds",
                    str(rounds),
                    "--only",
                    key,
                    "--device",
                    args.device,
                ]
                cmd += ["--quick"] if args.quick else []
                cmd += ["--retain-freed-memory"] if args.retain_freed_memory else []
                cmd += ["--accelerator-paths"] if args.accelerator_paths else []
                cmd += ["--cpu-time"] if args.cpu_time else []
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    print(f"# {name}: {key} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                if out.stderr.strip():  # the variant raised in its warm-up and was left out
                    print(out.stderr.strip(), file=sys.stderr, flush=True)
                one = json.loads(out.stdout.strip().splitlines()[-1])
                if key in one:
                    res[key] = one[key]
                res["plain_s"] = max(res["plain_s"], one["plain_s"])
        else:
            res = bench(
                name, rounds, args.quick, only=keys if args.only_variants else None,
                device=args.device,
            )
        if not args.markdown:
            print(
                f"{name}: plain step {res['plain_s'] * 1e3:.1f} ms (median of {rounds})",
                flush=True,
            )
            _print_ratios(res)
        table[name] = res
        more: dict[str, float] = {}
        if args.amortised:
            more |= amortised(name, args.device, max(1, rounds // 2))
        if args.cockpit:
            side = cockpit_bench(name, rounds, args.device)
            if not side and not args.markdown:
                print("  (Cockpit not installed: side-by-side skipped)", flush=True)
            more |= side
        res |= more
        if not args.markdown:
            _print_ratios(more)
    if args.markdown:
        _print_markdown(table, settings, args.device, cockpit=args.cockpit)


def _print_ratios(res: dict[str, float]) -> None:
    for k, v in res.items():
        if k != "plain_s":
            print(f"  {k:28s} {v:6.2f}×{_target(k)}", flush=True)


def _target(variant: str) -> str:
    if variant.endswith("(default schedules)"):
        return f"  (amortised target ≤ {AMORTISED_TARGET}×)"
    target = TARGETS.get(variant)
    return f"  (per-step target ≤ {target}×)" if target else ""


def _print_markdown(
    table: dict[str, dict[str, float]], settings: str, device: str, cockpit: bool
) -> None:
    names = list(table)
    variants: list[str] = []
    for res in table.values():
        variants += [k for k in res if k not in ("plain_s", "plain") and k not in variants]
    rows = [["*plain step*"] + [f"{table[n]['plain_s'] * 1e3:.1f} ms" for n in names] + [""]]
    for k in variants:
        ratios = [table[n].get(k) for n in names]
        target = _target(k).strip().removeprefix("(").removesuffix(")")
        rows.append([k] + [f"{v:.2f}x" if v is not None else None for v in ratios] + [target])
    notes = [
        "ratio: median time of a training step (forward, backward, SGD step) with the monitor "
        "over the plain step's median in the same run; targets for cifar10_3c3d on the CPU",
    ]
    if cockpit and not any(k.startswith("Cockpit") for k in variants):
        notes.append("Cockpit is not installed here: its side-by-side rows are left out")
    print_markdown(["variant", *names, "target"], rows, settings, device,
                   align="l" + "r" * len(names) + "l", notes=notes)

if __name__ == "__main__":
    main()
