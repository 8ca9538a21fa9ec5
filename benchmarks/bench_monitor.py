"""Monitor overhead: time per training step with the monitor, as a ratio to the plain step.

For each problem (``cifar10_3c3d``, ``mnist_mlp``; N = 128, CPU, ``torch.set_num_threads(2)``)
a training step is forward + backward + SGD step. We time the plain step (extended model, no
monitor), the three configurations tracked at every step and every quantity alone (with
Cockpit's defaults), interleaving the variants round by round after a warm-up, and print the
median time of each variant divided by the median plain step of the same run. With
``--device cuda`` model and data live on the GPU (``torch.cuda.synchronize()`` before the clock
starts and stops; CPU threads left at torch's default). A variant that raises is reported and
left out.

    python benchmarks/bench_monitor.py            # all variants, 7 rounds
    python benchmarks/bench_monitor.py --quick    # configurations only, 3 rounds, mnist_mlp
    python benchmarks/bench_monitor.py --isolate  # each variant in its own fresh process
    PYTHONPATH=src python benchmarks/bench_monitor.py --device cuda --isolate
"""

from __future__ import annotations

import argparse
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
from problems import describe, sync

import backprism
from backprism.monitor import Monitor, configuration, quantities, schedules

SINGLE = [
    "Loss",
    "GradNorm",
    "Distance",
    "UpdateSize",
    "Alpha",
    "NormTest",
    "InnerTest",
    "OrthoTest",
    "GradHist1d",
    "GradHist2d",
    "MeanGSNR",
    "CABS",
    "EarlyStopping",
    "TICDiag",
    "TICTrace",
    "HessTrace",
    "HessMaxEV",
]


def variants(quick: bool) -> dict[str, object]:
    out: dict[str, object] = {"plain": None}
    for label in ("economy", "business", "full"):
        out[label] = lambda label=label: configuration(label, schedules.linear(1))
    if not quick:
        for name in SINGLE:
            out[name] = lambda name=name: [getattr(quantities, name)(schedules.linear(1))]
    return out


def bench(
    name: str, rounds: int, quick: bool, only: str | None = None, device: str = "cpu"
) -> dict[str, float]:
    torch.manual_seed(0)
    model, lossf, X, y = problems.build(name, 128, device)
    backprism.extend(model)
    backprism.extend(lossf)
    indiv = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitors = {
        k: None if make is None else Monitor(model.parameters(), make())  # type: ignore[operator]
        for k, make in variants(quick).items()
        if only is None or k in ("plain", only)
    }
    steps = dict.fromkeys(monitors, 0)

    def one(key: str) -> float:
        monitor = monitors[key]
        sync(device)
        t0 = time.perf_counter()
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
        return time.perf_counter() - t0

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


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:160] if lines else ''}"


def main() -> None:
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
    args = parser.parse_args()
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
    print(
        f"# monitor benchmark: N=128, {describe(args.device)}, "
        f"retain_freed_memory={args.retain_freed_memory}",
        flush=True,
    )
    for name in names:
        if args.isolate:
            res = {"plain_s": 0.0}
            for key in [k for k in variants(args.quick) if k != "plain"]:
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
            res = bench(name, rounds, args.quick, device=args.device)
        print(
            f"{name}: plain step {res.pop('plain_s') * 1e3:.1f} ms (median of {rounds})",
            flush=True,
        )
        for k, v in res.items():
            target = {"economy": 1.3, "business": 1.6, "full": 4.0}.get(k)
            note = f"  (target ≤ {target}×)" if target else ""
            print(f"  {k:14s} {v:6.2f}×{note}", flush=True)


if __name__ == "__main__":
    main()
