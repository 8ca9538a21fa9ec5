"""Engine state (``backprism.engine.state``): nothing survives a pass or leaks across models
and threads — extended models are freed when dropped, a stray forward of another extended model
does not disturb a pass, two threads collect concurrently next to a third that never extends,
and memory stays flat over many steps.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from tests.common import (
    assert_close_labelled,
    first_order_expected,
    seeded_labels,
    small_mlp,
    trainable,
)
from tests.reference import per_sample_grads

DT = torch.float64


class _FunctionalUses(nn.Module):
    """Parameters used functionally and across modules (the forward mode's ownership tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.g = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.lin(x)) * self.g + F.linear(x, self.lin.weight)
        return self.head(h)


@pytest.mark.parametrize(("make", "count"), [(small_mlp, 40), (_FunctionalUses, 5)],
                         ids=["mlp", "functional-uses"])
def test_dropped_models_are_freed(make: Callable[[], nn.Module], count: int) -> None:
    """Extended models and losses are freed when dropped, also those whose parameters the
    forward mode attributed where they enter (its per-module caches hold no module)."""
    models, losses = [], []
    for i in range(count):
        torch.manual_seed(i)
        model, lf = extend(make().to(DT)), extend(nn.CrossEntropyLoss())
        X, y = torch.randn(3, 4, dtype=DT), seeded_labels((3,), 3, i)
        with collect(BatchGrad()):
            lf(model(X), y).backward()
        models.append(weakref.ref(model))
        losses.append(weakref.ref(lf))
        del model, lf, X, y
    gc.collect()
    alive = sum(r() is not None for r in models)
    assert alive == 0, f"{alive} of {count} extended models still alive after gc.collect()"
    alive = sum(r() is not None for r in losses)
    assert alive == 0, f"{alive} of {count} extended loss modules still alive after gc.collect()"


def test_stray_forward_of_other_model() -> None:
    torch.manual_seed(5)
    a, b = extend(small_mlp().to(DT)), extend(small_mlp().to(DT))
    lf = extend(nn.CrossEntropyLoss())
    stray = a(torch.randn(7, 4, dtype=DT))  # grad enabled, never backpropagated, kept alive
    Xb, yb = torch.randn(5, 4, dtype=DT), seeded_labels((5,), 3)
    ref = per_sample_grads(b, lf, Xb, yb)
    with collect(BatchGrad(), BatchL2Grad()):
        lf(b(Xb), yb).backward()
    for name, p in trainable(b):
        expected = first_order_expected(ref[name])
        assert_close_labelled(p.grad_batch, expected["grad_batch"], name)
        assert_close_labelled(p.batch_l2, expected["batch_l2"], name)
    for p in a.parameters():
        assert getattr(p, "grad_batch", None) is None
    assert stray.shape == (7, 3)


def test_two_threads_concurrently() -> None:
    steps, errors = 20, []
    barrier = threading.Barrier(3)
    setups = []
    for seed, n in ((6, 4), (7, 6)):
        torch.manual_seed(seed)
        model, lf = extend(small_mlp().to(DT)), extend(nn.CrossEntropyLoss())
        data = [
            (torch.randn(n, 4, dtype=DT), seeded_labels((n,), 3, 100 * seed + s))
            for s in range(steps)
        ]
        refs = [per_sample_grads(model, lf, X, y) for X, y in data]
        setups.append((model, lf, data, refs))
    plain = nn.Sequential(nn.Linear(4, 3)).to(DT)  # third party: never extended
    Xp, yp = torch.randn(5, 4, dtype=DT), seeded_labels((5,), 3)

    def extended_worker(model: nn.Module, lf: nn.Module, data: list, refs: list) -> None:
        try:
            for (X, y), ref in zip(data, refs):
                barrier.wait(timeout=60)
                model.zero_grad(set_to_none=True)
                loss = lf(model(X), y)
                with collect(BatchGrad(), Variance()):
                    barrier.wait(timeout=60)  # both contexts open at the same time
                    loss.backward()
                for name, p in trainable(model):
                    assert_close_labelled(p.grad_batch, ref[name], name)
                    assert_close_labelled(p.variance, ref[name].var(0, unbiased=False), name)
        except BaseException as err:
            errors.append(err)
            barrier.abort()

    def plain_worker() -> None:
        try:
            for _ in range(steps):
                barrier.wait(timeout=60)
                plain.zero_grad(set_to_none=True)
                loss = F.cross_entropy(plain(Xp), yp)
                barrier.wait(timeout=60)  # backward while the others' contexts are open
                loss.backward()
        except BaseException as err:
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=extended_worker, args=s) for s in setups]
    threads.append(threading.Thread(target=plain_worker))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    assert not real and not errors, f"errors in threads: {real or errors!r}"
    for name, p in plain.named_parameters():
        assert not hasattr(p, "grad_batch"), f"third-party {name} got grad_batch"
        assert not hasattr(p, "variance"), f"third-party {name} got variance"


def _live_tensor_elements() -> int:
    gc.collect()
    return sum(o.numel() for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter))


def test_memory_flat_over_many_steps():
    torch.manual_seed(4)
    model = extend(nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5)))
    lossfunc = extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    counts = []
    for step in range(200):
        opt.zero_grad()
        loss = lossfunc(model(X), y)
        if step % 3 == 0:  # forward (and loss) without backward
            del loss
        elif step % 3 == 1:
            with collect(BatchGrad(), SumGradSquared()):
                loss.backward()
        else:
            loss.backward()
        opt.step()
        if step in (20, 199):
            counts.append(_live_tensor_elements())
    assert counts[1] <= counts[0]
