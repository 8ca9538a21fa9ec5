"""Shared pytest configuration: the ``device`` and ``float64_default`` fixtures and the CPU
thread count.

``device`` parametrises a test over ``cpu`` and, where ``torch.cuda.is_available()``, ``cuda``
(the ids read ``test_x[cpu-...]`` / ``test_x[cuda-...]``). ``BACKPRISM_TEST_DEVICES`` (a comma
separated list, e.g. ``cuda:1`` or ``cpu,mps``) replaces that list; a listed device that is not
available is skipped.

At import it also makes ``torchvision`` importable where the installed wheel does not match the
CPU ``torch`` (:func:`_importable_torchvision`), so that ``transformers`` and ``timm`` load.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

torch.set_num_threads(int(os.environ.get("BACKPRISM_TEST_THREADS", "1")))


def _importable_torchvision() -> None:
    """Make ``import torchvision`` work beside a CPU ``torch`` wheel.

    ``scripts/setup.sh`` pins the CPU wheel of torch; pip then resolves ``torchvision`` (pulled in
    by ``timm``) to the PyPI wheel of the matching version, which is a CUDA build. Its C extension
    cannot load beside the CPU torch, so the detection operators (``torchvision::nms`` & co.) are
    never registered, and ``torchvision/_meta_registrations.py`` then fails at import with
    ``RuntimeError: operator torchvision::nms does not exist`` while registering fake kernels for
    them. ``transformers`` imports torchvision whenever it is installed, so that error breaks it
    too. No model in the tests uses those operators: after such a failure, drop the partially
    imported ``torchvision*`` modules, put an empty stand-in for ``torchvision._meta_registrations``
    in ``sys.modules`` and import again. Any further failure is left alone (tests that need
    torchvision, timm or transformers then skip at ``pytest.importorskip``)."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        importlib.import_module("torchvision")
    except RuntimeError:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType(
            "torchvision._meta_registrations"
        )
        with contextlib.suppress(Exception):
            importlib.import_module("torchvision")
    except Exception:
        pass


_importable_torchvision()


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
