"""Generate ``docs/benchmarks.md``: run every benchmark script with ``--markdown`` and collect
their tables into one page.

Usage::

    PYTHONPATH=src python benchmarks/make_page.py                # quick settings (minutes)
    PYTHONPATH=src python benchmarks/make_page.py --full         # each script's full settings
    PYTHONPATH=src python benchmarks/make_page.py --dry-run      # print the commands only
    PYTHONPATH=src python benchmarks/make_page.py --device cuda --out docs/benchmarks-cuda.md
    PYTHONPATH=src python benchmarks/make_page.py --only bench_engine --out /tmp/engine.md

Settings. The default (quick) settings are chosen so that the whole page regenerates in a few
minutes on a 2-core CPU (about 5 minutes on a shared one): N = 32 instead of 128 (DDP: 64; the
capture and monitor benchmarks keep 128), few repeats, the cheaper problems (engine: mnist_mlp
and cifar10_3c3d; peers: transformer and gpt2; spectral: cifar10_3c3d at N = 32, exact GGN, no
power-iteration baseline; monitor: the configurations on mnist_mlp); see
``SECTIONS`` for each script's arguments. At small N the fixed per-call costs weigh more than at
N = 128, and few repeats on a shared machine are noisy, so read the quick page for orders of
magnitude and memory, and regenerate with ``--full`` for figures to quote. ``--full`` runs every
script with its full settings (N = 128, its default problems and repeats; the monitor isolated
per variant, with amortised schedules and Cockpit where installed): hours on such a CPU.

``--device cuda`` passes ``--device cuda`` to the scripts that take it (engine, spectral, capture,
monitor) and leaves out the CPU-only ones (peers, convolution rules, DDP over gloo).

Each script runs in its own process (``sys.executable``, ``PYTHONPATH`` with ``src`` in front,
and ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it: on a machine shared with other
multi-threaded PyTorch processes, OpenMP threads that spin while they wait for a descheduled
peer made a 2-thread ``mnist_mlp`` step 20–30x slower, by different amounts for different
configurations, so the ratios were meaningless; passive waiting kept them within noise of an
idle machine's at the cost of a slightly slower step when the machine is idle);
its stdout (header line, table, notes) goes into the page, its stderr (progress, warnings)
to the console. A script that fails gets a section saying so, with the end of its stderr.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "src")
DEFAULT_OUT = os.path.join(ROOT, "docs", "benchmarks.md")


@dataclass
class Section:
    script: str
    title: str
    what: str
    quick: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)
    #: whether the script takes ``--device`` (else it runs on the CPU only)
    device: bool = False

    @property
    def name(self) -> str:
        return self.script.removesuffix(".py")


SECTIONS = [
    Section(
        "bench_engine.py",
        "Engine: every extension against a plain step, BackPACK side by side",
        "Time of one forward+backward inside `collect(extension)` as a ratio to a plain "
        "forward+backward in the same rounds, for the first-order extensions (per-sample "
        "gradients and their statistics) and the second-order ones (GGN/Hessian diagonals, "
        "Kronecker factors), with BackPACK's implementation of the same extension where it "
        "supports the problem; +MiB is the extra peak memory of the step over the plain step's.",
        quick=["--problems", "mnist_mlp", "cifar10_3c3d", "--n", "32", "--repeats", "5"],
        full=[],
        device=True,
    ),
    Section(
        "bench_peers.py",
        "Peers: Opacus, torch.func and curvlinops",
        "backprism's extensions next to the other tools that compute the same kind of "
        "quantity on a transformer, a ResNet-18 and a GPT-2-shaped decoder: Opacus' per-sample "
        "gradients and ghost clipping, `vmap(grad(...))`, curvlinops' KFAC and one GGN-vector "
        "product; ratios to a plain step, +MiB over the plain step's peak.",
        quick=["--problems", "transformer", "gpt2", "--n", "32", "--repeats", "5"],
        full=[],
    ),
    Section(
        "bench_spectral.py",
        "Spectral: GGN eigenvalues, eigenpairs and damped Newton steps",
        "One backward pass that returns the GGN's eigenvalues (`eigvalsh`), the leading "
        "eigenpairs (`eigh_top1`, `eigh_top10`) or a directionally damped Newton step "
        "(`newton`) through the Gram matrix of the GGN square root; ViViT side by side when "
        "installed, and (full settings) a deflated power-iteration baseline from GGN-vector "
        "products.",
        quick=["--problems", "cifar10_3c3d", "--sizes", "32", "--repeats", "3", "--power-k"],
        full=[],
        device=True,
    ),
    Section(
        "bench_capture.py",
        "Capture overhead outside `collect`",
        "What an extended model costs when no `collect` context is active: a plain training "
        "step and a `no_grad` evaluation step on a model never extended against the same steps "
        "on an extended deep copy (target ≤ 1.05x for the training step).",
        quick=["--repeats", "60", "--warmup", "3"],
        full=[],
        device=True,
    ),
    Section(
        "bench_conv_rules.py",
        "Convolution rules",
        "The first-order extensions on `cifar10_3c3d` (three convolutions, three dense layers) "
        "as ratios to a plain forward+backward.",
        quick=["--n", "32", "--reps", "10"],
        full=[],
    ),
    Section(
        "bench_monitor.py",
        "Monitor overhead",
        "A training step (forward, backward, SGD step) with the monitor's economy, business "
        "and full configurations tracked at every step, as a ratio to the plain step; the full "
        "settings add each quantity alone, the amortised cost of the default schedules and "
        "Cockpit's configurations where installed.",
        quick=["--quick", "--rounds", "3"],
        full=["--isolate", "--amortised", "--cockpit"],
        device=True,
    ),
    Section(
        "bench_ddp.py",
        "Distributed data parallelism",
        "Two gloo processes under `DistributedDataParallel`: each extension's ratio to a plain "
        "step in one process and under DDP, the time of backprism's reduction after the local "
        "pass, and the payload it all-reduces next to DDP's own gradients.",
        quick=[
            "--n",
            "64",
            "--repeats",
            "3",
            "--extensions",
            "BatchL2Grad",
            "Variance",
            "BatchGrad",
            "DiagGGNMC",
            "KFAC",
        ],
        full=[],
    ),
]

NOT_INSTALLED = {
    "vivit": "ViViT (bench_spectral side by side)",
    "cockpit": "Cockpit (bench_monitor side by side)",
    "timm": "timm",
    "torchvision": "torchvision",
}


def _missing() -> list[str]:
    """The optional tools that cannot be imported here (their rows are left out)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from problems import import_timm

    out = []
    for module, what in NOT_INSTALLED.items():
        try:
            import_timm() if module == "timm" else __import__(module)
        except Exception:
            out.append(what)
    return out


def command(section: Section, full: bool, device: str = "cpu") -> list[str]:
    args = section.full if full else section.quick
    on = ["--device", device] if device != "cpu" else []
    return ["python", f"benchmarks/{section.script}", "--markdown", *args, *on]


def child_env() -> dict[str, str]:
    """The environment of the benchmark processes: ``src`` on ``PYTHONPATH`` and OpenMP
    threads that sleep while they wait (unless ``OMP_WAIT_POLICY`` is set already)."""
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def shown(cmd: list[str]) -> str:
    """The command as a reader would type it from the repository root."""
    omp = child_env()["OMP_WAIT_POLICY"]
    return f"OMP_WAIT_POLICY={omp} PYTHONPATH=src " + " ".join(shlex.quote(c) for c in cmd)


def run(section: Section, full: bool, device: str = "cpu") -> tuple[str, float]:
    """Run the script; returns its markdown (or a failure note) and its wall time."""
    cmd = command(section, full, device)
    env = child_env()
    print(f"[make_page] {shown(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *cmd[1:]],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err: list[str] = []

    def tee() -> None:  # stderr to the console as it comes, and kept for a failure note
        for line in proc.stderr:
            err.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    reader = threading.Thread(target=tee, daemon=True)
    reader.start()
    out = proc.stdout.read()
    returncode = proc.wait()
    reader.join()
    seconds = time.perf_counter() - t0
    print(
        f"[make_page] {section.script}: {seconds:.0f} s, exit {returncode}",
        file=sys.stderr,
        flush=True,
    )
    if returncode != 0:
        tail = "".join(err[-15:]).rstrip()
        return (
            f"**Failed** (exit code {returncode}); the end of its stderr:\n\n```\n{tail}\n```"
        ), seconds
    return out.strip(), seconds


def _anchor(section: Section) -> str:
    return section.name.replace("_", "")


def page(
    sections: list[Section],
    outputs: dict[str, tuple[str, float]],
    full: bool,
    total: float,
    device: str = "cpu",
) -> str:
    mode = "full" if full else "quick"
    regenerate = "PYTHONPATH=src python benchmarks/make_page.py" + (" --full" if full else "")
    if device != "cpu":
        regenerate += f" --device {device}"
    missing = _missing()
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by benchmarks/make_page.py; edit that script, not this page. -->",
        "",
        f"Generated on {datetime.date.today().isoformat()} with `{regenerate}` ({mode} "
        f"settings, {total / 60:.1f} min). Each section below was produced by the command "
        "shown with it; the line above each table names the machine, the threads, the torch "
        "version, the date and the settings.",
        "",
        "**Times** are ratios to a plain forward+backward (or training step) of the same model "
        "measured in the same run, with the configurations alternating round by round, so "
        "that load from other processes hits all of them alike; absolute times on a shared "
        "machine are noise (on CUDA the clock starts and stops after "
        "`torch.cuda.synchronize()`). **Memory** (every MiB column) is one definition everywhere, "
        "`benchmarks/measure.py::peak_memory`: the largest number of bytes held by tensors "
        "during one step, minus the number held when the step started, after a warm-up step; "
        "on CUDA `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, on the CPU "
        "the same quantity from the profiler's allocation events "
        "(`torch.profiler.profile(profile_memory=True)`). `+MiB` is a configuration's peak "
        "minus the plain step's; the plain rows give the plain step's own peak. It counts "
        "tensor bytes, not the process's resident size, so it does not depend on glibc "
        "settings (`backprism.retain_freed_memory()`).",
        "",
    ]
    omp = child_env()["OMP_WAIT_POLICY"]
    lines += [
        f"**`OMP_WAIT_POLICY={omp}`** for every script"
        + (
            ": on a machine shared with other multi-threaded PyTorch processes, OpenMP "
            "threads that spin while waiting for a descheduled peer made a 2-thread step "
            "20–30x slower, by different amounts for different configurations; with passive "
            "waiting the ratios stay close to an idle machine's."
            if omp.upper() == "PASSIVE"
            else " (set by the environment)."
        ),
        "",
    ]
    if not full:
        lines += [
            "**Quick settings.** Small batches (N = 32; DDP 64; the capture and monitor "
            "benchmarks keep N = 128), few repeats and the cheaper problems, so that the page "
            "regenerates in a few minutes on a 2-core CPU. At small N fixed per-call costs "
            "weigh more than at N = 128 and few repeats on a shared machine are noisy: read "
            "these tables for orders of magnitude and memory, and regenerate with `--full` "
            "(each script's full settings, N = 128; hours on such a CPU) for figures to quote.",
            "",
        ]
    if device != "cpu":
        cpu_only = [s.script for s in SECTIONS if not s.device]
        lines += [f"**Device {device}.** Left out (CPU only): {', '.join(cpu_only)}.", ""]
    if missing:
        lines += [
            "**Not installed here:** " + ", ".join(missing) + "; the rows that need them are "
            "left out.",
            "",
        ]
    lines.append("Sections: " + ", ".join(f"[{s.script}](#{_anchor(s)})" for s in sections) + ".")
    for s in sections:
        body, seconds = outputs[s.name]
        lines += [
            "",
            f'<a id="{_anchor(s)}"></a>',
            "",
            f"## {s.title} (`{s.script}`)",
            "",
            s.what,
            "",
            f"Regenerate ({seconds:.0f} s here):",
            "",
            "```bash",
            shown(command(s, full, device)),
            "```",
            "",
            body,
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="each script's full settings (hours)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="default: docs/benchmarks.md")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=[s.name for s in SECTIONS],
        help="run only these scripts (the page then has only their sections)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or e.g. cuda: passed to the scripts that take --device, the "
        "CPU-only scripts are left out",
    )
    args = ap.parse_args(argv)
    sections = [s for s in SECTIONS if not args.only or s.name in args.only]
    if args.device != "cpu":
        sections = [s for s in sections if s.device]
    if args.dry_run:
        for s in sections:
            print(shown(command(s, args.full, args.device)))
        return
    t0 = time.perf_counter()
    outputs = {s.name: run(s, args.full, args.device) for s in sections}
    total = time.perf_counter() - t0
    text = page(sections, outputs, args.full, total, args.device)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"[make_page] wrote {args.out} in {total / 60:.1f} min", file=sys.stderr)


if __name__ == "__main__":
    main()
