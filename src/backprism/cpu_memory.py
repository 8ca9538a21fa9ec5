"""Opt-in: let the C allocator keep freed memory for reuse (Linux/glibc, CPU tensors).

Per-sample tensors are large (``BatchGrad`` on ``mnist_mlp`` at N = 128 writes 684 MB per step)
and short-lived. glibc serves allocations above its mmap threshold with fresh pages from the
kernel and returns them on ``free``, so every step pays one page fault per 4 KiB touched — on
the CPU machines we benchmark on this cost more than the arithmetic: ``BatchGrad`` took 2.3× a
plain step on ``cifar10_3c3d`` and 30× on ``mnist_mlp``, and 1.5× / 5.4× with freed memory
kept. :func:`retain_freed_memory` makes glibc serve every allocation from its heap and never
trim it, which is what PyTorch's CUDA caching allocator does on GPUs: the resident size stays
at its high-water mark instead of shrinking between steps. It is process-wide (every library's
allocations), which is why backprism never does it on its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["retain_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def retain_freed_memory() -> bool:
    """Keep freed memory in the process for reuse instead of returning it to the kernel.

    Sets glibc's ``M_MMAP_MAX = 0`` (no allocation served by ``mmap``) and
    ``M_TRIM_THRESHOLD`` to its maximum (the heap is never trimmed). Call it once, early (before
    the large allocations you want to reuse). Returns ``True`` when applied, ``False`` where the
    C library is not glibc (macOS, Windows, musl), in which case nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
