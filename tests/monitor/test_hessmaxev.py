"""Lanczos iteration (``backprism.monitor.hessmaxev``): the largest eigenvalue of a symmetric
matrix whose eigenvalue of largest magnitude is negative (a power iteration would return that
one).
"""

from __future__ import annotations

import pytest
import torch

from backprism.monitor import lanczos_max_eig


def test_lanczos_on_matrix_with_dominant_negative_eigenvalue() -> None:
    torch.manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(40, 40, dtype=torch.float64))
    evals = torch.linspace(-10, 3, 40, dtype=torch.float64)
    A = Q @ torch.diag(evals) @ Q.t()
    theta, vec, _ = lanczos_max_eig(lambda v: A @ v, torch.randn(40, dtype=torch.float64))
    assert theta == pytest.approx(3.0, rel=1e-3)
    assert abs(float(vec @ Q[:, -1])) == pytest.approx(1.0, abs=1e-2)
