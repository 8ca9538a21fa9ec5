"""Spectral benchmark: GGN eigenvalues / eigenpairs (ViViT computations) vs plain fwd+bwd.

Usage::

    python benchmarks/bench_spectral.py                  # cifar10_3c3d + All-CNN-C, N = 32/64/128
    python benchmarks/bench_spectral.py --quick          # N = 8/16, one repeat (smoke test)
    python benchmarks/bench_spectral.py --problems cifar10_3c3d --sizes 32 --mc 1

Configurations: ``plain`` (forward + backward), ``eigvalsh`` (all Gram eigenvalues),
``eigh_top1`` / ``eigh_top10`` (leading eigenpairs, eigenvectors in parameter space), on the full
GGN (one group); ``--mc M`` uses ``M`` MC columns instead of the exact square root (``K = M``
instead of ``K = C``; needed for All-CNN-C's ``C = 100`` at large ``N``: the Gram matrix is
``KN × KN``).

Timing: ``torch.set_num_threads(2)``, one warm-up, ``--repeats`` alternating rounds, medians,
reported as ratios to ``plain``. Memory: each configuration runs once in a fresh subprocess;
we report its peak RSS (``VmHWM``) above the peak of a plain forward+backward in the same
process, in MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from problems import PROBLEMS

import backprism
from backprism.spectral import EighComputation, EigvalshComputation

CONFIGS = ["plain", "eigvalsh", "eigh_top1", "eigh_top10"]


def make_runner(problem: str, config: str, n: int, mc: int):
    """A closure running one forward + backward with ``config``."""
    torch.manual_seed(0)
    model, lossf, X, y = PROBLEMS[problem](n)
    model, lossf = backprism.extend(model), backprism.extend(lossf)
    group: dict = {"params": [p for p in model.parameters() if p.requires_grad]}
    if config == "plain":

        def run() -> None:
            model.zero_grad()
            lossf(model(X), y).backward()

        return run
    if config == "eigvalsh":
        comp = EigvalshComputation(mc_samples=mc)
    else:
        k = int(config.removeprefix("eigh_top"))
        comp = EighComputation(mc_samples=mc, warn_small_eigvals=0.0)
        group["criterion"] = lambda evals, k=k: list(range(evals.numel() - k, evals.numel()))

    def run() -> None:
        model.zero_grad()
        hook = comp.get_extension_hook([group])
        with backprism.collect(comp.get_extension(), extension_hook=hook):
            lossf(model(X), y).backward()
        comp.get_result(group)

    return run


def peak_rss_kib() -> int:
    """This process's peak resident set size (``VmHWM``) in KiB. Unlike ``ru_maxrss``, which
    Linux carries over from the parent across fork/exec (so a child of a large benchmark process
    reports the parent's peak), ``VmHWM`` belongs to the process's own address space."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("VmHWM not found in /proc/self/status (Linux only)")


def peak_memory(problem: str, config: str, n: int, mc: int) -> float:
    """Peak RSS of ``config`` above a plain fwd+bwd's, in MiB (fresh subprocess)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys, torch; sys.path.insert(0, {here!r}); import bench_spectral as b;"
        "torch.set_num_threads(2);"
        f"b.make_runner({problem!r}, 'plain', {n}, {mc})();"
        "base = b.peak_rss_kib();"
        f"b.make_runner({problem!r}, {config!r}, {n}, {mc})();"
        "print((b.peak_rss_kib() - base) / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"memory run of {config} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def bench(problem: str, n: int, mc: int, repeats: int, memory: bool) -> dict:
    runners = {c: make_runner(problem, c, n, mc) for c in CONFIGS}
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for c in CONFIGS:  # warm-up
        runners[c]()
    for _ in range(repeats):
        for c in CONFIGS:
            t0 = time.perf_counter()
            runners[c]()
            times[c].append(time.perf_counter() - t0)
    med = {c: statistics.median(v) for c, v in times.items()}
    row = {"problem": problem, "N": n, "mc": mc, "plain_s": round(med["plain"], 4)}
    for c in CONFIGS[1:]:
        row[f"{c}_x"] = round(med[c] / med["plain"], 2)
    if memory:
        for c in CONFIGS[1:]:
            row[f"{c}_MiB"] = round(peak_memory(problem, c, n, mc), 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=["cifar10_3c3d", "cifar100_allcnnc"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[32, 64, 128])
    parser.add_argument("--mc", type=int, default=0, help="MC columns (0: exact)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--quick", action="store_true", help="N = 8/16, one repeat")
    args = parser.parse_args()
    torch.set_num_threads(2)
    sizes, repeats = ([8, 16], 1) if args.quick else (args.sizes, args.repeats)
    for problem in args.problems:
        for n in sizes:
            row = bench(problem, n, args.mc, repeats, not args.no_memory)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
