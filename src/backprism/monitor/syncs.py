r"""Counting the operations that make the host wait for a CUDA device, on any device.

On a GPU the host queues kernels and runs ahead; an operation whose *result is needed on the
host* (a Python number, a data-dependent shape, a boolean for an ``if``) makes it wait until
everything queued before has run — a host synchronisation. :func:`count_syncs` records every
such operation while it is active, also on the CPU (where it costs nothing), so a test on a
machine without a GPU can check that a code path would run without synchronising on one.

Recorded (the operations that synchronise on CUDA):

* reading a value on the host: ``Tensor.item()``, ``float(t)``, ``int(t)``, ``bool(t)``,
  ``if t:`` (``aten::_local_scalar_dense``); ``Tensor.tolist()``, ``Tensor.numpy()`` and
  ``numpy.asarray(t)`` (on the CPU these are not operators, so they are counted by wrapping the
  methods while the counter is active);
* data-dependent output shapes: ``nonzero``, ``masked_select``, indexing with a boolean mask
  (``x[mask]``, ``x[mask] = v``), ``unique`` in every form, ``repeat_interleave`` with tensor
  repeats and no ``output_size``;
* ``bincount`` (the CUDA kernel reads the input's minimum and maximum on the host, with or
  without ``minlength``), ``histc`` with ``min == max`` (range read from the data);
* ``equal``, ``allclose`` (boolean results), and the linear-algebra functions whose CUDA
  implementations check their error codes on the host (``linalg.eigh``/``eigvalsh``,
  ``linalg.inv``, ``linalg.solve``, ``cholesky``, ``linalg.svd``; the ``*_ex`` variants do
  not synchronise).

Not recorded, because they read host tensors or checks that run on the CPU only:
``torch.nn.functional.one_hot`` (its range checks are skipped for CUDA tensors) and the
functions in :data:`HOST_ONLY` (reads of tensors created on the host whatever the device, e.g.
the engine's draw of a random seed).

Each event keeps the operator name and the innermost stack frames, so a test can say where a
synchronisation comes from and leave out the ones it allows (e.g. the monitor's log write)::

    with count_syncs() as counter:
        with monitor(step, info=info):
            loss.backward()
    assert not counter.events_outside("materialize")
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_ONLY", "SyncCounter", "SyncEvent", "count_syncs"]

#: ``(file suffix, function)`` whose host reads are of host tensors on every device
HOST_ONLY: set[tuple[str, str]] = {
    ("engine/loss_hessian.py", "_seed"),  # torch.randint(...) on the CPU generator
    ("extensions/projections.py", "_affine_cached"),  # a static bin range's (a, c), on the CPU
}

aten = torch.ops.aten

#: operators that always synchronise on CUDA
_ALWAYS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "bincount",
    "equal",
    "allclose",
    "is_nonzero",
    "_linalg_eigh",
    "linalg_eigh",
    "linalg_eigvalsh",
    "linalg_inv",
    "linalg_solve",
    "_linalg_solve_ex_out",
    "linalg_cholesky",
    "cholesky",
    "_linalg_svd",
    "linalg_svd",
    "inverse",
}


def _bool_index(indices: Any) -> bool:
    if isinstance(indices, (list, tuple)):
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    return False


def _reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    name = func.overloadpacket.__name__
    if name in _ALWAYS:
        if name == "_linalg_solve_ex_out":  # pragma: no cover - not dispatched in practice
            return None
        return name
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        if _bool_index(indices):
            return f"{name} with a boolean mask"
        return None
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        out_size = kwargs.get("output_size")
        if func is aten.repeat_interleave.Tensor:
            return "repeat_interleave without output_size" if out_size is None else None
        if isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and out_size is None:
            return "repeat_interleave without output_size"
        return None
    if name == "histc":
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return "histc with min == max" if lo == hi else None
    return None


@dataclass
class SyncEvent:
    """One synchronising operation: its name and the innermost frames that led to it."""

    op: str
    stack: list[traceback.FrameSummary] = field(repr=False)

    def functions(self) -> list[str]:
        """Names of the functions on the stack, outermost first."""
        return [f.name for f in self.stack]

    def where(self) -> str:
        """``file:line in function`` of the innermost frame outside torch (paths inside
        ``backprism`` shortened to the package)."""
        for f in reversed(self.stack):
            name = f.filename.replace("\\", "/")
            if "/torch/" in name or name.endswith("monitor/syncs.py"):
                continue
            if "/backprism/" in name:
                return f"{name.split('/backprism/')[-1]}:{f.lineno} in {f.name}"
            return f"{name}:{f.lineno} in {f.name}"
        f = self.stack[-1]
        return f"{f.filename}:{f.lineno} in {f.name}"

    def __str__(self) -> str:
        return f"{self.op} at {self.where()}"


class SyncCounter(TorchDispatchMode):
    """A dispatch mode that records the operations that synchronise on CUDA (module doc)."""

    def __init__(self, stack_limit: int = 40) -> None:
        super().__init__()
        self.events: list[SyncEvent] = []
        self.stack_limit = stack_limit
        self.paused = 0

    def record(self, op: str) -> None:
        if self.paused:
            return
        stack = traceback.extract_stack(limit=self.stack_limit)[:-2]
        for frame in stack[-6:]:
            fname = frame.filename.replace("\\", "/")
            if any(fname.endswith(f) and frame.name == fn for f, fn in HOST_ONLY):
                return
        self.events.append(SyncEvent(op, stack))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        why = _reason(func, args, kwargs)
        if why is not None:
            self.record(why)
        return func(*args, **kwargs)

    # -- reading the record --------------------------------------------------------------
    def events_outside(self, *functions: str) -> list[SyncEvent]:
        """Events none of whose stack frames is one of ``functions``."""
        return [e for e in self.events if not set(functions) & set(e.functions())]

    def events_inside(self, *functions: str) -> list[SyncEvent]:
        """Events with one of ``functions`` on their stack."""
        return [e for e in self.events if set(functions) & set(e.functions())]

    def clear(self) -> None:
        self.events.clear()

    def summary(self) -> str:
        return "\n".join(str(e) for e in self.events) or "(none)"


_WRAPPED = ("tolist", "numpy", "__array__")


@contextlib.contextmanager
def count_syncs(stack_limit: int = 40) -> Iterator[SyncCounter]:
    """Record synchronising operations (and host reads of tensor data) while active."""
    counter = SyncCounter(stack_limit)
    saved: dict[str, Any] = {}
    for name in _WRAPPED:
        saved[name] = torch.Tensor.__dict__.get(name)
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, __orig: Any = original, __name: str = name,
                    **kwargs: Any) -> Any:
            counter.record(f"Tensor.{__name}")
            counter.paused += 1  # what it does inside is the same transfer
            try:
                return __orig(self, *args, **kwargs)
            finally:
                counter.paused -= 1

        setattr(torch.Tensor, name, wrapper)
    one_hot = torch.nn.functional.one_hot

    def quiet_one_hot(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counter.paused += 1  # range checks that CUDA tensors skip
        try:
            return one_hot(t, *args, **kwargs)
        finally:
            counter.paused -= 1

    torch.nn.functional.one_hot = quiet_one_hot
    try:
        with counter:
            yield counter
    finally:
        torch.nn.functional.one_hot = one_hot
        for name, old in saved.items():
            if old is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)
