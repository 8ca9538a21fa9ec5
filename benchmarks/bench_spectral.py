"""Spectral benchmark: GGN eigenvalues / eigenpairs / damped Newton steps (ViViT's computations)
against a plain forward+backward, ViViT itself and a power-iteration baseline.

Usage::

    python benchmarks/bench_spectral.py          # cifar10_3c3d N = 32/64/128,
                                                 # All-CNN-C (C = 100) N = 32/64, exact + MC-1
    python benchmarks/bench_spectral.py --quick          # N = 8/16, one repeat (smoke test)
    python benchmarks/bench_spectral.py --problems cifar10_3c3d --sizes 32 --mc 0 1
    PYTHONPATH=src python benchmarks/bench_spectral.py --device cuda --sizes 32 128
    python benchmarks/bench_spectral.py --markdown --quick   # one GitHub markdown table

Configurations, all on the full GGN (one parameter group, the same model, data, criterion and
damping for every implementation):

* ``plain``: forward + backward;
* ``eigvalsh``: all ``KN`` Gram eigenvalues; ``eigh_top1`` / ``eigh_top10``: the leading
  eigenpairs with eigenvectors in parameter space; ``newton``: a directionally damped Newton step
  along all eigenvectors whose eigenvalue is ≥ ``1e-4`` (constant damping ``δ = 1``);
* ``vivit_*``: the same with ViViT (when ``vivit`` is installed; ``torch.Tensor.symeig``, which
  ViViT needs, is re-added here in the benchmark process only);
* ``power_topK``: deflated power iteration for the top-``K`` GGN eigenpairs from GGN-vector
  products ``Jᵀ (∇²ℓ) J v`` (``J v`` by the double-vjp trick on a retained graph, one forward per
  call), each eigenvalue to ``1e-4`` relative change (``--power-k``).

``--mc M`` uses ``M`` MC columns instead of the exact square root (``K = M`` instead of ``K = C``).

Timing: ``torch.set_num_threads(2)`` (CPU), one warm-up, ``--repeats`` alternating rounds,
medians, reported in seconds and as ratios to ``plain``; configurations slower than ``--slow``
seconds are repeated at most twice. On CUDA (``--device cuda``) the clock starts and stops after
``torch.cuda.synchronize()``. Memory (``measure.peak_memory``, the same definition on every
device and in every benchmark script): in this process after the timings, one more warm-up step
and then the peak bytes held by tensors during one step above what they held when it started
(CPU: from the profiler's allocation events; CUDA: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``); reported is the configuration's minus the plain step's, in MiB.
Agreement: the maximum difference of our eigenvalues from ViViT's (and power iteration's),
relative to the largest eigenvalue.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from measure import mib, mib_cell, peak_memory, print_markdown
from problems import build, describe, sync

import backprism
from backprism.spectral import (
    DirectionalDampedNewtonComputation,
    EighComputation,
    EigvalshComputation,
)

HAVE_VIVIT = importlib.util.find_spec("vivit") is not None
OURS = ["eigvalsh", "eigh_top1", "eigh_top10", "newton"]
NEWTON_MIN_EVAL = 1e-4


def _top(k: int):
    """The top ``k`` eigenvalues (all of them where there are fewer, e.g. MC-1 at small N)."""
    return lambda evals: list(range(max(evals.numel() - k, 0), evals.numel()))


def _newton_criterion(evals: torch.Tensor) -> list[int]:
    return [i for i, e in enumerate(evals.tolist()) if e >= NEWTON_MIN_EVAL]


def _constant_damping(evals, evecs, gammas, lambdas):
    return torch.ones_like(evals)


def _group(model: torch.nn.Module, config: str) -> dict:
    group: dict = {"params": [p for p in model.parameters() if p.requires_grad]}
    if "eigh_top" in config:
        group["criterion"] = _top(int(config.rsplit("top", 1)[1]))
    elif config.endswith("newton"):
        group["criterion"] = _newton_criterion
        group["damping"] = _constant_damping
    return group


def _patch_symeig() -> None:
    """ViViT calls the removed ``torch.Tensor.symeig`` (benchmark process only)."""
    torch.Tensor.symeig = lambda self, eigenvectors=False, upper=True: torch.linalg.eigh(
        self, UPLO="U" if upper else "L"
    )


def make_runner(problem: str, config: str, n: int, mc: int, device: str = "cpu"):
    """A closure running one forward + backward with ``config``; it returns the eigenvalues
    (ascending, ``None`` where the configuration has none to compare). ``run.clear()`` frees the
    gradients of the previous call."""
    torch.manual_seed(0)
    model, lossf, X, y = build(problem, n, device)
    run = _make_run(model, lossf, X, y, config, mc)
    run.clear = lambda: model.zero_grad(set_to_none=True)
    return run


def _make_run(model, lossf, X, y, config: str, mc: int):
    if config.startswith("power_top"):
        return _power_runner(model, lossf, X, y, int(config.removeprefix("power_top")))
    if config.startswith("vivit_"):
        return _vivit_runner(model, lossf, X, y, config.removeprefix("vivit_"), mc)
    model, lossf = backprism.extend(model), backprism.extend(lossf)
    group = _group(model, config)
    if config == "plain":

        def run() -> None:
            model.zero_grad()
            lossf(model(X), y).backward()

        return run
    if config == "eigvalsh":
        comp = EigvalshComputation(mc_samples=mc)
    elif config == "newton":
        comp = DirectionalDampedNewtonComputation(mc_samples_ggn=mc, warn_small_eigvals=0.0)
    else:
        comp = EighComputation(mc_samples=mc, warn_small_eigvals=0.0)
    exts = comp.get_extensions() if hasattr(comp, "get_extensions") else [comp.get_extension()]

    return _step(model, lossf, X, y, comp, group, exts, config, backprism.collect)


def _vivit_runner(model, lossf, X, y, config: str, mc: int):
    import backpack
    import vivit
    from vivit.optim import DirectionalDampedNewtonComputation as VNewton

    _patch_symeig()
    model, lossf = backpack.extend(model), backpack.extend(lossf)
    group = _group(model, config)
    if config == "eigvalsh":
        comp = vivit.EigvalshComputation(mc_samples=mc)
        exts = [comp.get_extension()]
    elif config == "newton":
        comp = VNewton(mc_samples_ggn=mc, warn_small_eigvals=0.0)
        exts = comp.get_extensions()
    else:
        comp = vivit.EighComputation(mc_samples=mc, warn_small_eigvals=0.0)
        exts = [comp.get_extension()]

    return _step(model, lossf, X, y, comp, group, exts, config, backpack.backpack)


def _step(model, lossf, X, y, comp, group, exts, config: str, context):
    """One backward pass inside ``context(*exts, extension_hook=...)`` and the result."""

    def run():
        model.zero_grad()
        hook = comp.get_extension_hook([group])
        with context(*exts, extension_hook=hook):
            lossf(model(X), y).backward()
        res = comp.get_result(group)
        if config == "eigvalsh":
            return res
        if config.startswith("eigh"):
            return res[0]
        return None

    return run


# -- power iteration baseline ----------------------------------------------------------------


def _ggn_vp_factory(model, lossf, X, y):
    """Forward once, return ``v ↦ GGN v`` (list of tensors) from autograd: ``J v`` by the
    double-vjp trick, ``∇²ℓ (J v)`` by a Hessian-vector product of the loss w.r.t. the output
    (exact for the GGN since the loss is convex in the output), ``Jᵀ ·`` by a vjp."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(X)
    dummy = torch.zeros_like(out, requires_grad=True)
    vjp = torch.autograd.grad(out, params, dummy, create_graph=True)  # Jᵀ u, linear in u
    f = out.detach().requires_grad_(True)
    gradf = torch.autograd.grad(lossf(f, y), f, create_graph=True)[0]

    def ggn_vp(v: list[torch.Tensor]) -> list[torch.Tensor]:
        jv = torch.autograd.grad(vjp, dummy, v, retain_graph=True)[0]
        hjv = torch.autograd.grad(gradf, f, jv, retain_graph=True)[0]
        return list(torch.autograd.grad(out, params, hjv, retain_graph=True))

    return params, ggn_vp


def power_iteration(ggn_vp, params, k: int, tol: float = 1e-4, max_iter: int = 1000):
    """Top-``k`` eigenpairs by deflated power iteration; returns (evals descending, iterations)."""
    evals: list[float] = []
    evecs: list[torch.Tensor] = []
    iters = 0
    gen = torch.Generator().manual_seed(1)
    for _ in range(k):
        v = torch.randn(sum(p.numel() for p in params), generator=gen).to(params[0].device)
        v /= v.norm()
        lam = 0.0
        for _ in range(max_iter):
            iters += 1
            w = torch.cat([t.flatten() for t in ggn_vp(_split(v, params))])
            for lam_j, e_j in zip(evals, evecs):  # deflation
                w -= lam_j * e_j.dot(v) * e_j
            new = float(v.dot(w))
            v = w / w.norm()
            if abs(new - lam) <= tol * abs(new):
                lam = new
                break
            lam = new
        evals.append(lam)
        evecs.append(v)
    return evals, iters


def _split(v: torch.Tensor, params) -> list[torch.Tensor]:
    out, i = [], 0
    for p in params:
        out.append(v[i : i + p.numel()].view_as(p))
        i += p.numel()
    return out


def _power_runner(model, lossf, X, y, k: int):
    state = {}

    def run():
        params, ggn_vp = _ggn_vp_factory(model, lossf, X, y)
        evals, state["iters"] = power_iteration(ggn_vp, params, k)
        return torch.tensor(sorted(evals))

    run.state = state
    return run


# -- measuring -------------------------------------------------------------------------------


def _vivit_bytes(problem: str, n: int, mc: int) -> int:
    """Bytes of the ``[K, N, P]`` GGN square root ViViT materialises (float32)."""
    model, _, X, _ = build(problem, 1)
    with torch.no_grad():
        classes = model(X).shape[-1]
    params = sum(p.numel() for p in model.parameters())
    return 4 * (mc or classes) * n * params


def _memory_bytes(device: str) -> int:
    """Physical memory of the host (CPU) or the GPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (aligned at the largest eigenvalues)."""
    m = min(a.numel(), b.numel())
    a, b = a[-m:].double().cpu(), b[-m:].double().cpu()
    return float((a - b).abs().max() / b.abs().max())


def bench(problem: str, n: int, mc: int, args: argparse.Namespace) -> dict:
    device = args.device
    ours = args.configs or OURS
    configs = ["plain", *ours]
    if HAVE_VIVIT and not args.no_vivit:
        need, have = _vivit_bytes(problem, n, mc), _memory_bytes(device)
        if need < have / 2:
            configs += [f"vivit_{c}" for c in ours]
        else:
            print(
                f"# {problem} N={n}: ViViT skipped (its square-root factor V alone needs "
                f"{need / 2**30:.1f} GiB, this machine has {have / 2**30:.1f} GiB)",
                file=sys.stderr,
            )
    if mc == 0:
        configs += [f"power_top{k}" for k in args.power_k]
    runners = {}
    for c in configs:
        try:
            runners[c] = make_runner(problem, c, n, mc, device)
            if c.startswith("vivit_"):
                runners[c]()  # BackPACK fails at the first backward on modules it lacks
        except NotImplementedError as err:  # e.g. AdaptiveAvgPool2d in BackPACK's SqrtGGN
            print(f"# {problem} N={n}: {c} unsupported ({str(err)[:120]})", file=sys.stderr)
            runners.pop(c, None)
        except (RuntimeError, MemoryError) as err:
            if not c.startswith("vivit_") or "alloc" not in str(err):
                raise
            # BackPACK's convolution Jacobians repeat [K, N, ...] tensors far beyond V's size
            msg = str(err).split("\n")[0][-120:]
            print(f"# {problem} N={n}: {c} out of memory ({msg})", file=sys.stderr)
            runners.pop(c, None)
            gc.collect()
    configs = [c for c in configs if c in runners]
    times: dict[str, list[float]] = {c: [] for c in configs}
    results: dict[str, torch.Tensor | None] = {}
    for c in configs:  # warm-up (and the values to compare)
        sync(device)
        t0 = time.perf_counter()
        results[c] = runners[c]()
        sync(device)
        first = time.perf_counter() - t0
        if first > args.slow:
            times[c].append(first)  # too slow to waste a run on warming up
    for _ in range(args.repeats):
        for c in configs:
            if times[c] and times[c][0] > args.slow and len(times[c]) >= 2:
                continue
            sync(device)
            t0 = time.perf_counter()
            runners[c]()
            sync(device)
            times[c].append(time.perf_counter() - t0)
    med = {c: statistics.median(v) for c, v in times.items()}
    row: dict = {"problem": problem, "device": device, "N": n, "mc": mc}
    row["plain_s"] = round(med["plain"], 4)
    for c in configs[1:]:
        row[f"{c}_s"] = round(med[c], 3)
        row[f"{c}_x"] = round(med[c] / med["plain"], 1)
    for c in ours:
        if f"vivit_{c}" in med:
            row[f"{c}_vs_vivit"] = round(med[c] / med[f"vivit_{c}"], 3)
    for c in configs:
        if c.startswith("vivit_") and results[c] is not None:
            row[f"{c}_reldiff"] = float(
                f"{_rel_diff(results[c.removeprefix('vivit_')], results[c]):.2e}"
            )
        if c.startswith("power_top") and "eigvalsh" in results:
            k = int(c.removeprefix("power_top"))
            row[f"{c}_iters"] = runners[c].state["iters"]
            row[f"{c}_reldiff"] = float(f"{_rel_diff(results['eigvalsh'][-k:], results[c]):.2e}")
    if not args.no_memory:
        peaks = {c: peak_memory(runners[c], device, runners[c].clear) for c in configs}
        row["plain_peak_MiB"] = round(mib(peaks["plain"]), 1)
        for c in configs[1:]:
            row[f"{c}_MiB"] = round(mib(peaks[c] - peaks["plain"]), 1)
    del runners, results
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return row



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=["cifar10_3c3d", "cifar100_allcnnc"])
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=int,
        default=None,
        help="default: 32 64 128 (cifar10_3c3d), 32 64 (cifar100_allcnnc)",
    )
    parser.add_argument(
        "--mc",
        nargs="+",
        type=int,
        default=None,
        help="MC columns, 0 = exact (default: 0 for cifar10_3c3d, 0 1 otherwise)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--slow",
        type=float,
        default=5.0,
        help="configurations slower than this (s) are repeated at most twice",
    )
    parser.add_argument(
        "--power-k",
        nargs="*",
        type=int,
        default=[1, 2],
        help="power-iteration baselines (top-k), exact GGN only",
    )
    parser.add_argument(
        "--configs", nargs="+", choices=OURS, default=None, help=f"default: all of {OURS}"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-vivit", action="store_true")
    parser.add_argument("--quick", action="store_true", help="N = 8/16, one repeat")
    parser.add_argument(
        "--retain-freed-memory",
        action="store_true",
        help="call backprism.retain_freed_memory() first (changes the timings, not the memory "
        "figures, which count bytes allocated by tensors)",
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print one GitHub markdown table at the end"
    )
    args = parser.parse_args()
    if args.retain_freed_memory:
        backprism.retain_freed_memory()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(2)
    vivit = HAVE_VIVIT and not args.no_vivit
    if not args.markdown:
        print(f"# spectral benchmark: {describe(args.device)}, vivit={vivit}", flush=True)
    if args.quick:
        args.repeats = 1
    rows = []
    for problem in args.problems:
        default_sizes = [32, 64] if problem == "cifar100_allcnnc" else [32, 64, 128]
        sizes = [8, 16] if args.quick else (args.sizes or default_sizes)
        mcs = args.mc if args.mc is not None else ([0, 1] if problem == "cifar100_allcnnc" else [0])
        for mc in mcs:
            for n in sizes:
                row = bench(problem, n, mc, args)
                rows.append(row)
                if not args.markdown:
                    print(json.dumps(row), flush=True)
    if args.markdown:
        settings = (
            f"repeats={args.repeats}, vivit={vivit}, "
            f"retain_freed_memory={args.retain_freed_memory}"
        )
        _print_markdown(rows, settings, args.device)


def _print_markdown(rows: list[dict], settings: str, device: str) -> None:
    """One table row per (problem, N, GGN, configuration); the ÷ ViViT and rel. diff. columns
    only where some row has a value."""
    table = []
    for row in rows:
        ggn = "exact" if row["mc"] == 0 else f"MC-{row['mc']}"
        what = [row["problem"], row["N"], ggn]
        peak = row.get("plain_peak_MiB")
        table.append(
            [*what, "*plain step*", f"{row['plain_s']:.3f} s", "1.0x", mib_cell(peak, " peak"),
             None, None]
        )
        configs = [k.removesuffix("_s") for k in row if k.endswith("_s") and k != "plain_s"]
        for c in configs:
            label = c
            if f"{c}_iters" in row:
                label += f" ({row[f'{c}_iters']} iterations)"
            vs = row.get(f"{c}_vs_vivit")
            table.append(
                [*what, label, f"{row[f'{c}_s']:.3f} s", f"{row[f'{c}_x']:.1f}x",
                 mib_cell(row.get(f"{c}_MiB")),
                 f"{vs:.2f}" if vs is not None else None,
                 f"{row[f'{c}_reldiff']:.0e}" if f"{c}_reldiff" in row else None]
            )
    headers = ["problem", "N", "GGN", "configuration", "time", "× plain", "+MiB"]
    notes = [
        "× plain: median time over the plain forward+backward's median",
        "+MiB: the step's peak memory above its starting point minus the plain step's "
        "(`measure.peak_memory`); the plain row gives its own peak in MiB",
    ]
    keep = [True] * 7
    if any(r[7] is not None for r in table):
        headers.append("÷ ViViT")
        notes.append("÷ ViViT: our time over ViViT's for the same computation")
    keep.append(headers[-1] == "÷ ViViT")
    if any(r[8] is not None for r in table):
        headers.append("rel. diff.")
        notes.append(
            "rel. diff.: largest eigenvalue difference from ours (ViViT, power iteration), "
            "relative to the largest eigenvalue"
        )
    keep.append(headers[-1] == "rel. diff.")
    if not HAVE_VIVIT:
        notes.append("ViViT is not installed here: its side-by-side rows are left out")
    table = [[cell for cell, k in zip(r, keep) if k] for r in table]
    align = "lrll" + "r" * (len(headers) - 4)
    print_markdown(headers, table, settings, device, align=align, notes=notes)

if __name__ == "__main__":
    main()
