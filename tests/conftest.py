"""Shared pytest configuration: the ``device`` and ``float64_default`` fixtures and the CPU
thread count.

``device`` parametrises a test over ``cpu`` and, where ``torch.cuda.is_available()``, ``cuda``
(the ids read ``test_x[cpu-...]`` / ``test_x[cuda-...]``). ``BACKPRISM_TEST_DEVICES`` (a comma
separated list, e.g. ``cuda:1`` or ``cpu,mps``) replaces that list; a listed device that is not
available is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("BACKPRISM_TEST_THREADS", "1")))


def _available(name: str) -> bool:
    kind = torch.device(name).type
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    backend = getattr(torch, kind, None)
    return bool(getattr(backend, "is_available", lambda: False)())


def _devices() -> list[str]:
    listed = os.environ.get("BACKPRISM_TEST_DEVICES", "")
    if listed.strip():
        return [d.strip() for d in listed.split(",") if d.strip()]
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=_devices())
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device a test runs on: models, inputs and references are moved there explicitly."""
    if not _available(request.param):
        pytest.skip(f"device {request.param} is not available")
    return torch.device(request.param)


@pytest.fixture
def float64_default():
    """float64 as torch's default dtype for the test (modules use it with
    ``pytestmark = pytest.mark.usefixtures("float64_default")``)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
