"""Time the convolution rules on DeepOBS ``cifar10_3c3d`` (N = 128, CrossEntropyLoss mean).

Prints, per extension, the median time of ``forward + backward`` inside ``collect(ext)``
divided by a plain ``forward + backward`` (configurations alternated, warm-up first).

    .venv/bin/python benchmarks/bench_conv_rules.py [--threads 2] [--reps 15] [--clock cpu]
    PYTHONPATH=src .venv/bin/python benchmarks/bench_conv_rules.py --markdown   # markdown table

``--clock cpu`` uses the process's CPU time instead of wall time (steadier on a shared
machine, where the process is descheduled; quote which one you used).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import backprism
from backprism.extensions import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import print_markdown
from problems import cifar10_3c3d, describe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    args = parser.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = backprism.extend(cifar10_3c3d(1)[0])
    lossfunc = backprism.extend(nn.CrossEntropyLoss())
    x = torch.randn(args.n, 3, 32, 32)
    y = torch.randint(0, 10, (args.n,))

    def plain() -> None:
        model.zero_grad()
        lossfunc(model(x), y).backward()

    def with_ext(ext_cls: type) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad()
            with backprism.collect(ext_cls()):
                lossfunc(model(x), y).backward()

        return run

    configs = {"plain": plain}
    for cls in (BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad):
        configs[cls.__name__] = with_ext(cls)
    times: dict[str, list[float]] = {k: [] for k in configs}
    for fn in configs.values():  # warm-up
        fn()
        fn()
    for _ in range(args.reps):
        for name, fn in configs.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    base = statistics.median(times["plain"])
    if args.markdown:
        rows = [["*plain step*", f"{base * 1e3:.1f} ms"]]
        rows += [
            [name, f"{statistics.median(times[name]) / base:.2f}x"]
            for name in configs
            if name != "plain"
        ]
        settings = f"cifar10_3c3d, N={args.n}, reps={args.reps}, clock={args.clock}"
        notes = ["ratio: median time inside `collect(extension)` over the plain step's median"]
        print_markdown(["extension", "ratio"], rows, settings, notes=notes)
        return
    print(describe("cpu"))
    print(f"plain forward+backward: {base * 1e3:.1f} ms {args.clock} (median of {args.reps})")
    for name in configs:
        if name != "plain":
            print(f"{name:16s} {statistics.median(times[name]) / base:5.2f}x")


if __name__ == "__main__":
    main()
