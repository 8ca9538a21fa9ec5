"""Engine benchmark: each extension's time as a ratio to a plain forward+backward, and peak memory.

Usage::

    python benchmarks/bench_engine.py                       # first- and second-order, all problems
    python benchmarks/bench_engine.py --problems cifar10_3c3d mnist_mlp --order 1 --repeats 7
    python benchmarks/bench_engine.py --quick               # small N, few repeats (smoke test)
    PYTHONPATH=src python benchmarks/bench_engine.py --device cuda --problems cifar10_3c3d
    python benchmarks/bench_engine.py --markdown --problems mnist_mlp --n 32
    python benchmarks/bench_engine.py --problems hf_bert_small --n 8 --no-memory \
        --methods DiagGGNMC DiagGGNExact HutchinsonDiagHessian DiagHessian  # exact vs estimate

Timing: ``torch.set_num_threads(2)`` (``--threads``, CPU), one warm-up round, then ``--repeats``
rounds in which all configurations run in turn (alternating, so drifting machine load hits all
alike); the median of each is divided by the median of the plain forward+backward measured in
the same rounds.
On CUDA (``--device cuda``) the clock starts and stops after ``torch.cuda.synchronize()``.
When ``backpack-for-pytorch`` is installed, its extensions run side by side on the problems it
supports (chains of known layers).

Memory (``measure.peak_memory``, the same definition on every device and in every benchmark
script): in this process, with fresh runners and one warm-up step each, the peak bytes held by
tensors during one step above what they held when it started (CPU: from the profiler's
allocation events; CUDA: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``). Reported is the configuration's step peak minus the plain step's,
in MiB; the plain row gives the plain step's own peak.

``--markdown`` prints one GitHub markdown table (header line: machine, threads, torch, date and
the settings); messages about configurations that fail go to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from measure import mib, mib_cell, peak_memory, print_markdown
from problems import PROBLEMS, build, describe, sync

FIRST = ["BatchL2Grad", "SumGradSquared", "Variance", "BatchGrad", "BatchGrad+hook", "BatchDotGrad"]
SECOND = ["DiagGGNMC", "KFAC", "DiagGGNExact", "KFLR", "DiagHessian"]
BACKPACK_OK = {"mnist_mlp", "cifar10_3c3d", "mnist_2c2d", "cifar100_allcnnc"}


def _have_backpack() -> bool:
    try:
        import backpack  # noqa: F401
    except Exception:
        return False
    return True


def make_runner(problem: str, method: str, tool: str, n: int, device: str = "cpu"):
    """Return a closure running one forward+backward with ``method`` under ``tool``."""
    torch.manual_seed(0)
    model, lossfunc, X, y = build(problem, n, device)
    if tool == "plain":

        def run():
            model.zero_grad(set_to_none=True)
            lossfunc(model(X), y).backward()

        run.clear = lambda: model.zero_grad(set_to_none=True)
        return run
    if tool == "backprism":
        import backprism
        from backprism import extensions as E

        hook = None
        if method == "BatchGrad+hook":
            # the extension-hook use case: reduce per-sample gradients to their norms and free
            # them during the backward pass
            norms: dict = {}

            def hook(module):
                for p in module.parameters(recurse=False):
                    if hasattr(p, "grad_batch"):
                        norms[p] = p.grad_batch.flatten(1).norm(dim=1)
                        del p.grad_batch

        ext_cls = getattr(E, method.split("+")[0], None)
        if ext_cls is None:
            return None
        backprism.extend(model)
        lossfunc = backprism.extend(lossfunc)
        ctx = lambda: backprism.collect(ext_cls(), extension_hook=hook)  # noqa: E731
    else:
        import backpack
        from backpack import extensions as BE

        if problem not in BACKPACK_OK or not hasattr(BE, method):
            return None
        if method == "BatchDotGrad":
            return None
        model = backpack.extend(model)
        lossfunc = backpack.extend(lossfunc)
        ctx = lambda: backpack.backpack(getattr(BE, method)())  # noqa: E731

    params = list(model.parameters())
    fields = {
        "BatchL2Grad": "batch_l2",
        "SumGradSquared": "sum_grad_squared",
        "Variance": "variance",
        "BatchGrad": "grad_batch",
        "BatchGrad+hook": "grad_batch",
        "BatchDotGrad": "batch_dot",
        "DiagGGNMC": "diag_ggn_mc",
        "DiagGGNExact": "diag_ggn_exact",
        "KFAC": "kfac",
        "KFLR": "kflr",
        "DiagHessian": "diag_h",
        "HutchinsonDiagHessian": "diag_h_hutchinson",
    }

    def clear():
        model.zero_grad(set_to_none=True)
        for p in params:  # free last round's results before measuring this one
            if hasattr(p, fields[method]):
                delattr(p, fields[method])

    def run():
        clear()
        with ctx():
            lossfunc(model(X), y).backward()

    run.clear = clear
    return run


def time_problem(
    problem: str, methods: list[str], n: int, repeats: int, backpack: bool, device: str = "cpu"
):
    configs = {("plain", "plain"): make_runner(problem, "plain", "plain", n, device)}
    for m in methods:
        r = make_runner(problem, m, "backprism", n, device)
        if r is not None:
            configs[("backprism", m)] = r
        if backpack:
            r = make_runner(problem, m, "backpack", n, device)
            if r is not None:
                configs[("backpack", m)] = r
    times: dict = {k: [] for k in configs}
    for rnd in range(repeats + 1):
        for key, run in list(configs.items()):
            gc.collect()
            sync(device)
            t0 = time.perf_counter()
            try:
                run()
                sync(device)
            except Exception as err:  # unsupported here (e.g. exact DiagHessian + attention)
                print(
                    f"  {key[0]} {key[1]} on {problem}: {type(err).__name__}: "
                    f"{str(err).splitlines()[0][:120]}",
                    file=sys.stderr,
                )
                del configs[key], times[key]
                continue
            dt = time.perf_counter() - t0
            if rnd > 0:
                times[key].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return med


def step_peak(problem: str, method: str, tool: str, n: int, device: str = "cpu") -> int | None:
    """Peak memory (bytes) of one step of a fresh runner above its starting point
    (``measure.peak_memory``, one warm-up step); ``None`` where the tool lacks the method or
    the step fails."""
    run = make_runner(problem, method, tool, n, device)
    if run is None:
        return None
    try:
        return peak_memory(run, device, run.clear)
    except Exception:
        return None
    finally:
        del run
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", nargs="+", default=list(PROBLEMS)[:5])
    ap.add_argument("--order", choices=["1", "2", "both"], default="both")
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: 2 on the CPU, else torch's)",
    )
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-backpack", action="store_true")
    ap.add_argument("--quick", action="store_true", help="N=16, 2 repeats, no memory")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    ap.add_argument(
        "--retain-freed-memory",
        action="store_true",
        help="call backprism.retain_freed_memory() first (glibc keeps freed memory: no page "
        "faults on fresh memory; applies to every tool in the run)",
    )
    args = ap.parse_args(argv)
    if args.retain_freed_memory:
        import backprism

        backprism.retain_freed_memory()
    if args.quick:
        args.n, args.repeats, args.no_memory = 16, 2, True
    on_cpu = torch.device(args.device).type == "cpu"
    if args.threads is not None or on_cpu:
        torch.set_num_threads(args.threads or 2)
    methods = args.methods or (
        FIRST if args.order == "1" else SECOND if args.order == "2" else FIRST + SECOND
    )
    bp = _have_backpack() and not args.no_backpack
    memory = not args.no_memory
    results = []
    settings = (
        f"N={args.n}, repeats={args.repeats}, backpack={bp}, "
        f"retain_freed_memory={args.retain_freed_memory}"
    )
    if not args.markdown:
        print(f"{settings}, {describe(args.device)}")
        header = f"{'problem':<16} {'extension':<16} {'backprism':>10} {'backpack':>10}"
        if memory:
            header += f" {'+MiB':>9} {'bp +MiB':>9}"
        print(header)
    for problem in args.problems:
        med = time_problem(problem, methods, args.n, args.repeats, bp, args.device)
        plain = med[("plain", "plain")]
        base = step_peak(problem, "plain", "plain", args.n, args.device) if memory else None
        results.append(
            {
                "problem": problem,
                "device": args.device,
                "extension": "plain",
                "plain_s": plain,
                "peak_mib": mib(base),
            }
        )
        if not args.markdown:
            line = f"{problem:<16} {'(plain, s)':<16} {plain:>10.3f}"
            if base is not None:
                line += f" {'(peak MiB)':>10} {mib(base):>9.0f}"
            print(line, flush=True)
        for m in methods:
            ours = med.get(("backprism", m))
            theirs = med.get(("backpack", m))
            row = {
                "problem": problem,
                "device": args.device,
                "extension": m,
                "plain_s": plain,
                "backprism": ours and ours / plain,
                "backpack": theirs and theirs / plain,
            }
            if memory and base is not None:
                for key, tool, ok in (("mem", "backprism", ours), ("mem_bp", "backpack", theirs)):
                    peak = step_peak(problem, m, tool, args.n, args.device) if ok else None
                    row[key] = mib(peak - base) if peak is not None else None
            results.append(row)
            if args.markdown:
                continue
            line = (
                f"{problem:<16} {m:<16} "
                + (f"{ours / plain:>9.2f}x" if ours else f"{'-':>10}")
                + (f" {theirs / plain:>9.2f}x" if theirs else f" {'-':>10}")
            )
            if memory:
                line += "".join(
                    f" {v:>9.0f}" if v is not None else f" {'-':>9}"
                    for v in (row.get("mem"), row.get("mem_bp"))
                )
            print(line, flush=True)
    if args.markdown:
        _print_markdown(results, memory, settings, args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _print_markdown(results: list[dict], memory: bool, settings: str, device: str) -> None:
    headers = ["problem", "extension", "backprism", "BackPACK"]
    if memory:
        headers += ["backprism +MiB", "BackPACK +MiB"]
    rows = []
    for r in results:
        if r["extension"] == "plain":
            cells = [r["problem"], "*plain step*", f"{r['plain_s']:.3f} s", ""]
            if memory:
                peak = r["peak_mib"]
                cells += [mib_cell(peak, " peak"), ""]
        else:
            cells = [r["problem"], r["extension"]] + [
                f"{r[k]:.2f}x" if r[k] else None for k in ("backprism", "backpack")
            ]
            if memory:
                cells += [mib_cell(r.get("mem")), mib_cell(r.get("mem_bp"))]
        rows.append(cells)
    notes = [
        "ratios: median step time over the plain step's median in the same rounds",
    ]
    if memory:
        notes.append(
            "+MiB: the step's peak memory above its starting point minus the plain step's "
            "(`measure.peak_memory`); the plain row gives its own peak in MiB"
        )
    print_markdown(headers, rows, settings, device, align="llrrrr", notes=notes)


if __name__ == "__main__":
    main()
