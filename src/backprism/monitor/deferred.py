r"""Values that stay on the device until the log line is written.

A quantity computes its value with tensor operations on the parameters' device and hands the
monitor a :class:`Pending` value: the tensors it still needs and a ``build`` function that turns
their host copies into the stored value (floats, lists, histograms; host-only work such as
α's quadratic fit runs there too). After a tracked step the monitor moves the tensors of all its
pending values to the host **in one transfer** (:class:`Transfer`: flattened to float64,
concatenated, one copy per device) and builds them; on CUDA the copy is started asynchronously
into pinned memory at the end of the step and read one step later (``Monitor(write_lag=1)``,
the default there), so it overlaps the next step's compute. Nothing inside a tracked step reads
a value on the host (see :mod:`backprism.monitor.syncs`).

Some algorithms that read values on the host are the fastest choice on a CPU, where reading a
value costs nothing: the rank-one histogram counts of Linear weights (``nonzero``, data-dependent
shapes), ``bincount``, and Lanczos with a convergence test after every product.
:func:`host_fast_paths` says whether a tensor may take them (it lives on the CPU);
``with accelerator_paths():`` makes the CPU take the code paths an accelerator takes instead,
which is how the synchronisation tests run on machines without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["Pending", "Transfer", "accelerator_paths", "host_fast_paths", "to_host"]

_FORCED: list[bool] = []


@contextlib.contextmanager
def accelerator_paths(enabled: bool = True) -> Iterator[None]:
    """Within the block, tensors on the CPU take the code paths of accelerators (no host reads
    inside a step) if ``enabled``, or the CPU's host-reading fast paths if not."""
    _FORCED.append(bool(enabled))
    try:
        yield
    finally:
        _FORCED.pop()


def host_fast_paths(ref: Tensor | torch.device | None) -> bool:
    """Whether work on ``ref``'s device may use algorithms that read values on the host (the
    CPU, unless :func:`accelerator_paths` is active)."""
    if _FORCED:
        return not _FORCED[-1]
    if ref is None:
        return True
    device = ref if isinstance(ref, torch.device) else ref.device
    return device.type == "cpu"


class Pending:
    """A value whose tensors are still on the device.

    Args:
        tensors: the device tensors the value is built from.
        build: ``build(arrays) -> value`` with ``arrays`` the host copies of ``tensors``
            (float64 numpy arrays of the same shapes). A value of ``None`` is not stored.
    """

    __slots__ = ("build", "tensors")

    def __init__(self, tensors: Sequence[Tensor], build: Callable[[list[np.ndarray]], Any]):
        self.tensors = [t.detach() for t in tensors]
        self.build = build

    @classmethod
    def ready(cls, value: Any) -> Pending:
        """A value already on the host."""
        return cls([], lambda arrays: value)

    @classmethod
    def scalar(cls, t: Tensor) -> Pending:
        """A 0-dim tensor, stored as a float."""
        return cls([t], lambda a: float(a[0]))

    @classmethod
    def floats(cls, t: Tensor) -> Pending:
        """A 1-dim tensor, stored as a list of floats."""
        return cls([t], lambda a: [float(x) for x in a[0].reshape(-1)])

    def materialize(self) -> Any:
        """Build the value now (its own transfer; the monitor batches them instead)."""
        return self.build(to_host(self.tensors))


def _device_key(t: Tensor) -> torch.device:
    return t.device


def _wide_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64: float32 is exact for counts below 2**24 and values of float32 models
    return torch.float32 if device.type == "mps" else torch.float64


class Transfer:
    """One host transfer of many device tensors: flattened to float64 and concatenated per
    device, copied once (asynchronously into pinned memory on CUDA), split on the host.

    ``Transfer(tensors)`` starts the copies; :meth:`result` waits for them (on CUDA an event
    recorded after the copy, so the wait covers only the work queued before it) and returns the
    host arrays in the order of ``tensors``.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.shapes = [tuple(t.shape) for t in tensors]
        self.groups: list[tuple[list[int], Any, Any]] = []
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(_device_key(t), []).append(i)
        for device, idx in by_device.items():
            dtype = _wide_dtype(device)
            parts = [tensors[i].detach().reshape(-1).to(dtype) for i in idx]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            event = None
            if device.type == "cuda":
                host = torch.empty(flat.shape, dtype=dtype, device="cpu", pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
            elif device.type == "cpu":  # no copy needed, but never a view of a live tensor
                src = tensors[idx[0]]
                shared = flat.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
                host = flat.clone() if len(idx) == 1 and shared else flat
            else:
                host = flat.to("cpu")
            self.groups.append((idx, host, event))

    def result(self) -> list[np.ndarray]:
        out: list[Any] = [None] * len(self.shapes)
        for idx, host, event in self.groups:
            if event is not None:
                event.synchronize()
            flat = host.numpy().astype(np.float64, copy=False)
            pos = 0
            for i in idx:
                size = int(np.prod(self.shapes[i], dtype=np.int64))
                out[i] = flat[pos : pos + size].reshape(self.shapes[i])
                pos += size
        return out


def to_host(tensors: Sequence[Tensor]) -> list[np.ndarray]:
    """Host copies (float64 arrays) of ``tensors`` in one transfer per device."""
    if not tensors:
        return []
    return Transfer(tensors).result()
