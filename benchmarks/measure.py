"""What the benchmark scripts share for measuring and reporting: peak memory, the header line of
their ``--markdown`` output and markdown tables.

Every script that reports memory measures it with :func:`peak_memory`, so that the MiB columns
of all of them mean the same thing on every device (see its docstring for the definition).
Scripts import this module the way they import ``problems``
(``sys.path.insert(0, os.path.dirname(__file__))``, then ``from measure import ...``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import platform
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

__all__ = [
    "machine",
    "markdown_header",
    "markdown_table",
    "mib",
    "mib_cell",
    "peak_memory",
    "print_markdown",
]

#: name of the profiler range around the measured call (CPU)
_MARK = "benchmarks.measure.peak_memory"


def peak_memory(
    run: Callable[[], object],
    device: str | torch.device = "cpu",
    clear: Callable[[], object] | None = None,
    warmup: int = 1,
) -> int:
    """Peak memory of one call of ``run``, in bytes above its starting point.

    Definition (the same on every device): the largest number of bytes held by tensors at any
    moment during the call, minus the number held when the call started. "Held by tensors"
    means allocated through PyTorch's allocator for ``device`` (tensor storage, including the
    temporaries of every operator and of autograd), not the process's resident size: pages
    the C library keeps, touches lazily or returns to the kernel do not count, so the figure
    does not depend on glibc settings (``backprism.retain_freed_memory()``) or on what ran
    earlier in the process.

    Procedure: ``warmup`` calls first (one-time allocations, caches and lazy initialisation
    left out), each preceded by ``clear()``; then ``clear()`` (which should free the previous
    call's results, e.g. ``.grad`` and per-sample fields), ``gc.collect()``, and the measured
    call.

    * CUDA: ``torch.cuda.reset_peak_memory_stats`` before the measured call, then
      ``torch.cuda.max_memory_allocated`` minus ``torch.cuda.memory_allocated`` before it
      (after ``torch.cuda.synchronize``).
    * CPU: PyTorch has no peak counter for its CPU allocator, so the calls (warm-up included)
      run under ``torch.profiler.profile(profile_memory=True)``, which records every allocation
      and free of the CPU allocator with its size; the peak is the running sum of these
      events over the measured call (marked by a ``record_function`` range) minus its value
      when the call started. One difference from CUDA: a block allocated *before* the profiler
      started and freed during the measured call is not subtracted (the profiler does not know
      its size); blocks allocated by the warm-up calls are, which is why ``warmup`` runs inside
      the profiler. The profiler's own stderr lines are filtered out.

    ``backprism.cpu_memory`` is not used: it only changes how glibc keeps freed memory
    (:func:`backprism.retain_freed_memory`) and measures nothing. Nor is the resident
    high-water mark (``VmHWM``) that the scripts used before: it counts pages touched rather
    than bytes allocated, depends on glibc's mmap threshold and on the memory that earlier
    steps left in the heap (``BatchGrad`` on ``cifar10_3c3d`` at N = 128: 315 MiB resident
    against 561 MiB allocated), so it cannot be compared with the CUDA figure.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_peak(run, device, clear, warmup)
    if device.type == "cpu":
        return _cpu_peak(run, clear, warmup)
    raise ValueError(f"peak_memory: no allocator statistics for device {device}")


def mib(nbytes: float | None) -> float | None:
    """Bytes in MiB (``None`` stays ``None``)."""
    return None if nbytes is None else nbytes / 2**20


def mib_cell(value: float | None, suffix: str = "") -> str | None:
    """A MiB figure for a table: whole MiB, ``0`` rather than ``-0``, ``None`` stays ``None``."""
    if value is None:
        return None
    return f"{round(value)}{suffix}"


def _warm_then_clear(run, clear, warmup: int) -> None:
    """``warmup`` unmeasured calls (each after ``clear``), then ``clear`` and a collection."""
    for _ in range(warmup):
        if clear is not None:
            clear()
        run()
    if clear is not None:
        clear()
    gc.collect()


def _cuda_peak(run, device: torch.device, clear, warmup: int) -> int:
    _warm_then_clear(run, clear, warmup)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _cpu_peak(run, clear, warmup: int) -> int:
    from torch.profiler import ProfilerActivity, profile, record_function

    with (
        _profiler_stderr_filtered(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        _warm_then_clear(run, clear, warmup)
        with record_function(_MARK):
            run()
    events = prof.profiler.kineto_results.events()
    mark = [e for e in events if e.name() == _MARK]
    if len(mark) != 1:
        raise RuntimeError(f"peak_memory: {len(mark)} profiler ranges {_MARK!r}, expected one")
    start, end = mark[0].start_ns(), mark[0].end_ns()
    cpu = torch._C._autograd.DeviceType.CPU
    allocations = sorted(
        (e.start_ns(), i, e.nbytes())
        for i, e in enumerate(events)
        if e.name() == "[memory]" and e.device_type() == cpu
    )
    held = 0  # bytes held by blocks allocated since the profiler started
    at_start = peak = None
    for t, _, nbytes in allocations:
        if t > end:
            break
        if t >= start and at_start is None:
            at_start = peak = held
        held += nbytes
        if at_start is not None:
            peak = max(peak, held)
    return 0 if at_start is None else peak - at_start


#: lines the profiler writes to stderr by itself (start/stop, frees of blocks it never saw)
_NOISE = re.compile(
    r"^(USDT|STAGE):|Memory block of unknown size|ActivityProfilerController|"
    r"SyncActivityProfilerHandler|CPUAllocator\.cpp"
)


@contextlib.contextmanager
def _profiler_stderr_filtered() -> Iterator[None]:
    """Capture file descriptor 2 and write back every line except the profiler's own."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to redirect
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [
                line
                for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                if not _NOISE.search(line)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


# -- reporting -----------------------------------------------------------------------------------


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine(device: str | torch.device = "cpu", threads: int | None = None) -> str:
    """``AMD EPYC (2 cores), 2 threads`` or ``NVIDIA H100 80GB HBM3 (host: AMD EPYC, ...)``,
    with ``OMP_WAIT_POLICY`` where the environment sets it."""
    device = torch.device(device)
    threads = torch.get_num_threads() if threads is None else threads
    host = f"{_cpu_name()} ({os.cpu_count()} cores), {threads} thread{'s' * (threads != 1)}"
    if os.environ.get("OMP_WAIT_POLICY"):
        host += f", OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (host: {host})"
    return host


def markdown_header(
    settings: str = "", device: str | torch.device = "cpu", threads: int | None = None
) -> str:
    """The line above a ``--markdown`` table: machine, threads, torch, date and the settings."""
    parts = [
        machine(device, threads),
        f"torch {torch.__version__}",
        datetime.date.today().isoformat(),
    ]
    if settings:
        parts.append(settings)
    return "_" + " · ".join(parts) + "_"


def markdown_table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None
) -> str:
    """A GitHub markdown table; ``align`` has one letter per column, ``l`` or ``r`` (default:
    the first column left, the others right). ``None`` cells print as ``-``."""
    align = align or "l" + "r" * (len(headers) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(rule) + "|"]
    for row in rows:
        cells = ["-" if c is None else str(c).replace("|", "\\|") for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_markdown(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    settings: str = "",
    device: str | torch.device = "cpu",
    threads: int | None = None,
    align: str | None = None,
    notes: Sequence[str] = (),
) -> None:
    """Print the header line, a blank line, the table and (if any) notes as a list below it."""
    print(markdown_header(settings, device, threads))
    print()
    print(markdown_table(headers, rows, align))
    if notes:
        print()
        for note in notes:
            print(f"- {note}")
    sys.stdout.flush()
