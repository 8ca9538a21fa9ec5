"""Capture overhead: what an extended model costs when no ``collect`` context is active.

``backprism.extend(model)`` registers forward hooks (and parameter hooks) that stay in place
for good; a user who extends a model once and collects quantities only on some steps pays for
those hooks on every other step. This script measures that price: a plain training step
(``zero_grad``, forward, loss, ``backward``) on a model that was never extended, against the
same step on a deep copy of it after ``backprism.extend(model)`` and
``backprism.extend(lossfunc)``, with NO ``collect`` around it. A second pair of figures times
an evaluation step (forward and loss under ``torch.no_grad()``, no backward), the other place
where the hooks run without anything to collect.

Target: the extended training step at most 5 % slower than the plain one (ratio ≤ 1.05x) on
``mnist_mlp`` and ``transformer`` (N=128, CPU, 2 threads); rows over it are flagged.

Usage::

    PYTHONPATH=src python benchmarks/bench_capture.py                 # mnist_mlp, transformer
    PYTHONPATH=src python benchmarks/bench_capture.py --problems mnist_mlp cifar10_3c3d \\
        resnet18 --repeats 15
    PYTHONPATH=src python benchmarks/bench_capture.py --markdown
    PYTHONPATH=src python benchmarks/bench_capture.py --device cuda
    PYTHONPATH=src python benchmarks/bench_capture.py --control     # A/A: the noise floor
    PYTHONPATH=src python benchmarks/bench_capture.py --problems hf_gpt2 hf_bert hf_llama \
        --n 16 --threads 1                 # Hugging Face models (transformers installed)
    PYTHONPATH=src python benchmarks/bench_capture.py --problems timm_convnext timm_swin \
        timm_vit --n 32 --threads 1        # timm models (timm installed)

Timing: ``torch.set_num_threads(2)`` on the CPU (``--threads``), both variants built from the
same seed (the extended one a ``copy.deepcopy`` of the plain model and loss, so weights and
data are identical); one check step each (the gradients must agree, and no per-sample field
may appear on the extended parameters), ``--warmup`` rounds, then ``--repeats`` rounds in which
every (mode, variant) runs one step in turn, in alternating order from round to round so that
drifting machine load and ordering effects hit both variants alike. Reported: the median
per-step time of each, the ratio of the medians (extended / plain), the median and quartiles
of the per-round paired ratios (each round's two steps ran back to back, under the same load;
the quartiles show the noise), and the ratio of the fastest steps (``min``:
load from other processes only ever adds time, so on a busy machine it is the steadier
figure). The load average is printed before and after each problem. On CUDA the clock starts
and stops after ``torch.cuda.synchronize()``. ``--control`` replaces the extended model by an
unextended deep copy (an A/A run whose ratios show how far from 1.00x noise alone moves them).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from measure import markdown_header
from problems import PROBLEMS, build, describe, sync

import backprism

DEFAULT_PROBLEMS = ["mnist_mlp", "transformer"]
TARGET = {"mnist_mlp": 1.05, "transformer": 1.05}
MODES = ("step", "no_grad")
VARIANTS = ("plain", "extended")
# per-sample / curvature fields an extension would leave on a parameter: none may appear
# outside ``collect``
FIELDS = (
    "grad_batch",
    "batch_l2",
    "sum_grad_squared",
    "variance",
    "batch_dot",
    "diag_ggn_mc",
    "diag_ggn_exact",
    "kfac",
    "kflr",
    "diag_h",
)


def make_steps(problem: str, n: int, device: str = "cpu", control: bool = False) -> dict:
    """``{(mode, variant): closure}``: one training step (``mode="step"``) or one forward and
    loss under ``torch.no_grad()`` (``mode="no_grad"``) on the plain or the extended model.
    With ``control``, the "extended" variant is a deep copy left unextended (an A/A run: its
    ratio shows the noise floor)."""
    torch.manual_seed(0)
    model, lossfunc, X, y = build(problem, n, device)
    ext_model, ext_loss = copy.deepcopy(model), copy.deepcopy(lossfunc)
    if not control:
        backprism.extend(ext_model)
        backprism.extend(ext_loss)

    def train(m, lf):
        def run():
            m.zero_grad(set_to_none=True)
            lf(m(X), y).backward()

        return run

    def evaluate(m, lf):
        def run():
            with torch.no_grad():
                lf(m(X), y)

        return run

    steps = {}
    for variant, (m, lf) in (("plain", (model, lossfunc)), ("extended", (ext_model, ext_loss))):
        steps[("step", variant)] = train(m, lf)
        steps[("no_grad", variant)] = evaluate(m, lf)
    steps["check"] = lambda: _check(model, ext_model, steps)
    return steps


def _check(model, ext_model, steps) -> None:
    """One training step of each variant: same gradients, no collected fields."""
    steps[("step", "plain")]()
    steps[("step", "extended")]()
    for (name, p), q in zip(model.named_parameters(), ext_model.parameters()):
        if p.grad is None or q.grad is None or not torch.allclose(p.grad, q.grad, 1e-4, 1e-6):
            raise AssertionError(f"gradients of {name} differ between plain and extended")
        left = [f for f in FIELDS if hasattr(q, f)]
        if left:
            raise AssertionError(f"{name} got {left} outside collect")


def time_problem(
    problem: str, n: int, repeats: int, warmup: int, device: str = "cpu", control: bool = False
) -> dict:
    """Per-step times (seconds) of every (mode, variant), measured rounds only."""
    steps = make_steps(problem, n, device, control)
    steps.pop("check")()
    keys = [(mode, variant) for mode in MODES for variant in VARIANTS]
    times: dict = {k: [] for k in keys}
    for rnd in range(warmup + repeats):
        order = keys if rnd % 2 == 0 else [(m, v) for m in MODES for v in reversed(VARIANTS)]
        for key in order:
            gc.collect()
            sync(device)
            t0 = time.perf_counter()
            steps[key]()
            sync(device)
            dt = time.perf_counter() - t0
            if rnd >= warmup:
                times[key].append(dt)
    return times


def summarize(times: dict, mode: str) -> dict:
    plain, ext = times[(mode, "plain")], times[(mode, "extended")]
    paired = sorted(e / p for p, e in zip(plain, ext))
    q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
    return {
        "plain": statistics.median(plain),
        "extended": statistics.median(ext),
        "ratio": statistics.median(ext) / statistics.median(plain),
        "min_ratio": min(ext) / min(plain),
        "q1": q[0],
        "q2": q[1],
        "q3": q[2],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--problems",
        nargs="+",
        default=DEFAULT_PROBLEMS,
        choices=list(PROBLEMS),
        help="default: mnist_mlp transformer",
    )
    ap.add_argument("--batch-size", "--n", dest="n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=40, help="measured rounds (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured rounds (default 3)")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: 2 on the CPU)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument(
        "--control",
        action="store_true",
        help="A/A run: the second variant is an unextended deep copy (shows the noise floor)",
    )
    args = ap.parse_args(argv)
    if args.threads is not None or torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads or 2)

    settings = (
        f"N={args.n}, repeats={args.repeats}, warmup={args.warmup}"
        + (", CONTROL (A/A: second variant not extended)" if args.control else "")
    )
    if args.markdown:
        print(markdown_header(settings, args.device))
        print()
        print(
            "| problem | plain step ms | extended step ms | ratio | min ratio | paired (IQR) "
            "| plain no_grad ms | extended no_grad ms | ratio | min ratio | paired (IQR) | load |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    else:
        print(f"capture overhead outside collect: {settings}, {describe(args.device)}")
    for problem in args.problems:
        load0 = _load()
        times = time_problem(problem, args.n, args.repeats, args.warmup, args.device, args.control)
        load = f"{load0}→{_load()}"
        rows = {mode: summarize(times, mode) for mode in MODES}
        target = TARGET.get(problem)
        if args.markdown:
            cells = [problem]
            for mode in MODES:
                r = rows[mode]
                flag = (
                    " ⚠"
                    if mode == "step" and target and r["ratio"] > target and not args.control
                    else ""
                )
                cells += [
                    f"{r['plain'] * 1e3:.1f}",
                    f"{r['extended'] * 1e3:.1f}",
                    f"{r['ratio']:.3f}x{flag}",
                    f"{r['min_ratio']:.3f}x",
                    f"{r['q2']:.2f} ({r['q1']:.2f}–{r['q3']:.2f})",
                ]
            print("| " + " | ".join([*cells, load]) + " |", flush=True)
            continue
        for mode in MODES:
            r = rows[mode]
            note = ""
            if mode == "step" and target and not args.control:
                note = f"  target ≤ {target:.2f}x: " + ("ok" if r["ratio"] <= target else "OVER")
            print(
                f"{problem:<12} {mode:<7} plain {r['plain'] * 1e3:7.2f} ms   "
                f"extended {r['extended'] * 1e3:7.2f} ms   ratio {r['ratio']:.3f}x   "
                f"min ratio {r['min_ratio']:.3f}x   "
                f"(paired {r['q2']:.3f}, IQR {r['q1']:.3f}–{r['q3']:.3f}){note}",
                flush=True,
            )
        print(f"{problem:<12} load average {load}", flush=True)
    if args.markdown:
        print()
        print(
            "- ratio: extended / plain median step time; min ratio: fastest over fastest; "
            "paired: median (quartiles) of the per-round ratios; load: 1-minute load average "
            "before → after"
        )
        if not args.control:
            targets = ", ".join(f"{p} ≤ {t:.2f}x" for p, t in TARGET.items())
            print(f"- ⚠: training step over its target ({targets})")


def _load() -> str:
    """The 1-minute load average (other processes on the machine), or ``?``."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
