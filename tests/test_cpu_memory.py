"""``retain_freed_memory``: freed large blocks stay in the process (glibc), results unchanged."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = r"""
import torch, backprism

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

applied = backprism.retain_freed_memory() if {retain} else False
base = rss_kib()
t = torch.ones(64 * 2**20 // 4)   # 64 MiB, above any mmap threshold
del t
print(int(applied), rss_kib() - base)
"""


def _run(retain: bool) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", CODE.format(retain=retain)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    applied, kept = out.stdout.split()
    return int(applied), int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator only")
def test_freed_memory_is_kept_only_when_asked():
    applied, kept = _run(True)
    if not applied:
        pytest.skip("C library is not glibc")
    assert kept > 60 * 1024  # the 64 MiB block stayed resident for reuse
    assert _run(False)[1] < 8 * 1024  # default: returned to the kernel


def test_results_unchanged():
    import torch
    from torch import nn

    import backprism
    from backprism.extensions import BatchGrad

    code = (
        "import torch, backprism; from torch import nn; backprism.retain_freed_memory();"
        "torch.manual_seed(0); m = backprism.extend(nn.Linear(3, 2)); "
        "lf = backprism.extend(nn.MSELoss()); X = torch.randn(4, 3); y = torch.randn(4, 2);"
        "ctx = backprism.collect(backprism.extensions.BatchGrad())\n"
        "with ctx: lf(m(X), y).backward()\n"
        "print(m.weight.grad_batch.flatten().tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    torch.manual_seed(0)
    m, lf = backprism.extend(nn.Linear(3, 2)), backprism.extend(nn.MSELoss())
    X, y = torch.randn(4, 3), torch.randn(4, 2)
    with backprism.collect(BatchGrad()):
        lf(m(X), y).backward()
    got = torch.tensor([float(v) for v in out.stdout.strip()[1:-1].split(",")])
    torch.testing.assert_close(got, m.weight.grad_batch.flatten())
