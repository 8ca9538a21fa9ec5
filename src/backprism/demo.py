"""Demo: a small CNN on scikit-learn's bundled 8×8 digits, trained with the monitor.

``backprism demo`` (or :func:`run_demo`) trains for ``steps`` mini-batch steps of plain SGD
(CABS needs zero momentum), tracks a monitor configuration (``economy``, ``business`` or
``full``; ``full`` adds ``MeanGSNR``, ``CABS``, ``EarlyStopping`` and ``Time`` so every panel
has data), logs train and validation loss/accuracy ten times per run, and writes

* ``monitor.jsonl`` — the streamed monitor log,
* ``dashboard.png`` — the matplotlib instrument panel,
* ``report.html`` — the interactive HTML report.

The data ship with scikit-learn (``sklearn.datasets.load_digits``): nothing is downloaded.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

__all__ = ["CONFIGS", "make_model", "run_demo"]

CONFIGS = ("economy", "business", "full")


def make_model() -> nn.Sequential:
    """Conv(1→8, 3×3) ReLU MaxPool(2) Conv(8→16, 3×3) ReLU MaxPool(2) Flatten Linear(64→32)
    ReLU Linear(32→10) for ``[N, 1, 8, 8]`` inputs (6,474 parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def _load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            "the demo needs scikit-learn for its bundled digits: pip install scikit-learn"
        ) from None
    data = load_digits()
    X = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    X = (X - X.mean()) / X.std()
    y = torch.tensor(data.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=gen)
    n_valid = len(y) // 5
    valid, train = perm[:n_valid], perm[n_valid:]
    return X[train], y[train], X[valid], y[valid]


def _quantities(config: str) -> list[Any]:
    from backprism.monitor import configuration, quantities, schedules

    qs = configuration(config)
    if config == "full":
        every = schedules.linear(1)
        qs += [quantities.MeanGSNR(every), quantities.CABS(every),
               quantities.EarlyStopping(every), quantities.Time(every)]
    return qs


class _Progress:
    """Training progress on ``stream``: a tqdm bar on a terminal; elsewhere (a pipe, a CI log)
    nothing while training and one summary line at the end."""

    def __init__(self, total: int, stream: IO[str]) -> None:
        self.total = total
        self.stream = stream
        self.start = time.monotonic()
        self.bar: Any = None
        if hasattr(stream, "isatty") and stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # the demo extra brings tqdm; without it, only the summary
                return
            self.bar = tqdm(total=total, file=stream, unit="step", desc="training",
                            dynamic_ncols=True, leave=True)

    def update(self, loss: float, acc: float) -> None:
        self.loss, self.acc = loss, acc
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}", refresh=False)
            self.bar.update(1)

    def close(self, done: int) -> None:
        if self.bar is not None:
            self.bar.close()
            return
        elapsed = max(time.monotonic() - self.start, 1e-9)
        last = f"  loss {self.loss:.3f}  acc {self.acc:.2f}" if done else ""
        self.stream.write(f"trained {done}/{self.total} steps in {elapsed:.1f} s "
                          f"({done / elapsed:.1f} step/s){last}\n")
        self.stream.flush()


def _evaluate(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(X)
        loss = float(nn.functional.cross_entropy(out, y))
        acc = float((out.argmax(1) == y).float().mean())
    return loss, acc


def run_demo(
    config: str = "full",
    steps: int = 200,
    out: str | Path = "backprism-demo",
    batch_size: int = 64,
    lr: float = 0.2,
    seed: int = 0,
    progress: IO[str] | None = sys.stderr,
    report: bool = True,
    dashboard: bool = True,
    threads: int | None = 1,
) -> dict[str, Path]:
    """Train the demo CNN with the monitor and write log, dashboard and report to ``out``.

    ``progress``: stream of the progress display (a tqdm bar on a terminal, one summary line
    at the end otherwise; ``None``: silent). ``threads``: torch intra-op threads while training
    (the model is tiny: one thread is fastest and does not fight other processes for cores);
    ``None`` keeps torch's setting.

    Returns ``{"log": ..., "dashboard": ..., "report": ...}`` (only the files written).
    """
    import backprism
    from backprism.monitor import Monitor

    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; choose one of {list(CONFIGS)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if report:  # fail before training, not after it
        from backprism.report.figures import require_plotly

        require_plotly()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    Xtr, ytr, Xva, yva = _load_digits(seed)
    model = backprism.extend(make_model())
    lossfunc = backprism.extend(nn.CrossEntropyLoss())
    individual = nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    log_path = out / "monitor.jsonl"
    monitor = Monitor(model.parameters(), _quantities(config), log_path=log_path)
    bar = _Progress(steps, progress) if progress is not None else None
    n = len(ytr)
    per_epoch = math.ceil(n / batch_size)
    eval_every = max(1, steps // 10)
    gen = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(n, generator=gen)
    done = 0
    try:
        for step in range(steps):
            k = step % per_epoch
            if k == 0 and step > 0:
                order = torch.randperm(n, generator=gen)
            idx = order[k * batch_size : (k + 1) * batch_size]
            X, y = Xtr[idx], ytr[idx]
            opt.zero_grad()
            outputs = model(X)
            loss = lossfunc(outputs, y)
            losses = individual(outputs, y)
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(y),
                    "optimizer": opt}
            with warnings.catch_warnings():
                # NaN steps are reported in the log; create_graph's reference-cycle notice is
                # expected for the HessMaxEV steps
                warnings.simplefilter("ignore", RuntimeWarning)
                warnings.filterwarnings("ignore", message=".*create_graph=True.*")
                with monitor(step, info=info):
                    loss.backward(create_graph=monitor.create_graph(step))
            opt.step()
            acc = float((outputs.detach().argmax(1) == y).float().mean())
            if (step + 1) % eval_every == 0 or step == steps - 1:
                tl, ta = _evaluate(model, Xtr, ytr)
                vl, va = _evaluate(model, Xva, yva)
                monitor.log(step, epoch=step // per_epoch, train_loss=tl, valid_loss=vl,
                            train_accuracy=ta, valid_accuracy=va,
                            learning_rate=opt.param_groups[0]["lr"])
            if bar is not None:
                bar.update(float(loss.detach()), acc)
            done = step + 1
    finally:
        monitor.close()
        if bar is not None:
            bar.close(done)
        torch.set_num_threads(old_threads)
    files = {"log": log_path}
    if dashboard:
        from backprism.plot import Dashboard

        dash = Dashboard(title=f"demo: CNN on 8×8 digits ({config})")
        dash.draw(log_path)
        files["dashboard"] = dash.save(out / "dashboard.png")
        dash.close()
    if report:
        from backprism.report import write_report

        files["report"] = write_report(log_path, out / "report.html",
                                       title=f"demo: CNN on 8×8 digits ({config})")
    return files
