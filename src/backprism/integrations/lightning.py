"""The monitor inside a PyTorch Lightning ``Trainer`` (``pip install backprism[lightning]``).

>>> trainer = lightning.Trainer(callbacks=[MonitorCallback("economy", log_path="monitor.jsonl")])
>>> trainer.fit(module)

What the callback does:

* ``on_fit_start``: ``backprism.extend`` the LightningModule (its layers and loss modules held as
  attributes) and build a :class:`~backprism.monitor.Monitor` over its trainable parameters,
  streaming to ``log_path``;
* ``on_before_backward`` / ``on_after_backward``: run the backward pass of every training step
  inside ``monitor(global_step, info=...)`` with ``info = {"loss", "batch_size",
  "optimizer"}`` plus whatever the module put in ``self.backprism_info`` during
  ``training_step`` (quantities such as ``Alpha`` need ``individual_losses``: set
  ``self.backprism_info = {"individual_losses": lossfunc_none(out, y)}``);
* at the end of each training and validation epoch: ``monitor.log`` with the learning rate and
  the logged metrics found in ``trainer.callback_metrics`` (``train_loss``, ``val_loss`` /
  ``valid_loss``, ``train_acc`` / ``train_accuracy``, ``val_acc`` / ``valid_accuracy``);
* ``on_fit_end``: close the log and, if asked, write the dashboard PNG and the HTML report.

Lightning calls ``loss.backward()`` itself; quantities that need ``create_graph=True``
(``HessMaxEV``) therefore need the module to override
``backward(self, loss)`` as ``loss.backward(create_graph=callback.create_graph(step))``; the
callback raises a clear error at fit start otherwise. The loss must be mean-reduced and computed
by an ``nn.Module`` loss held by the LightningModule (e.g. ``self.lossfunc =
nn.CrossEntropyLoss()``), so that ``extend`` sees it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError:
        raise ImportError(
            "backprism.integrations.lightning needs PyTorch Lightning: "
            "pip install 'backprism[lightning]' (or pip install lightning)"
        ) from None

__all__ = ["MonitorCallback"]

_METRICS = {
    "train_loss": ("train_loss", "train/loss", "loss"),
    "valid_loss": ("val_loss", "valid_loss", "val/loss"),
    "train_accuracy": ("train_acc", "train_accuracy", "train/acc"),
    "valid_accuracy": ("val_acc", "valid_accuracy", "val_accuracy", "val/acc"),
}


class MonitorCallback(Callback):
    """Lightning callback tracking backprism monitor quantities during ``Trainer.fit``.

    Args:
        quantities: a configuration name (``"economy"``, ``"business"``, ``"full"``) or a list
            of :class:`~backprism.monitor.quantities.Quantity` instances.
        log_path: JSONL log to stream to.
        dashboard: if given, a dashboard image (PNG/PDF/SVG) written at the end of ``fit``.
        report: if given, an HTML report written at the end of ``fit``.
        allow_create_graph: set ``True`` when the module's ``backward`` passes
            ``create_graph=callback.create_graph(step)`` (needed for ``HessMaxEV``).
    """

    def __init__(
        self,
        quantities: str | list[Any] = "economy",
        log_path: str | os.PathLike[str] = "monitor.jsonl",
        dashboard: str | os.PathLike[str] | None = None,
        report: str | os.PathLike[str] | None = None,
        allow_create_graph: bool = False,
    ) -> None:
        super().__init__()
        self.quantities = quantities
        self.log_path = Path(log_path)
        self.dashboard = dashboard
        self.report = report
        self.allow_create_graph = allow_create_graph
        self.monitor: Any = None
        self._ctx: Any = None
        self._batch_size: int | None = None

    # ------------------------------------------------------------------ set-up
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Extend the module and start the monitor."""
        import backprism
        from backprism.monitor import Monitor, configuration

        if isinstance(self.quantities, str):
            qs = configuration(self.quantities)
        else:
            qs = list(self.quantities)
        backprism.extend(pl_module)
        params = [p for p in pl_module.parameters() if p.requires_grad]
        self.monitor = Monitor(params, qs, log_path=self.log_path)
        if not self.allow_create_graph:
            horizon = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else 1000
            steps = range(min(horizon, 1000))
            needs = sorted({type(q).__name__ for q in qs
                            if any(q.create_graph(s) for s in steps)})
            if needs:
                raise ValueError(
                    f"{', '.join(needs)} need loss.backward(create_graph=True): "
                    "override your LightningModule.backward to pass "
                    "create_graph=callback.create_graph(step) and construct "
                    "MonitorCallback(..., allow_create_graph=True), or drop these quantities"
                )

    def create_graph(self, global_step: int) -> bool:
        """Whether the backward pass of ``global_step`` needs ``create_graph=True``."""
        return self.monitor is not None and self.monitor.create_graph(global_step)

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        """Remember the batch size of the step."""
        self._batch_size = _batch_size(batch)
        if hasattr(pl_module, "backprism_info"):
            pl_module.backprism_info = {}

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Enter the monitor's step context around the backward pass."""
        info: dict[str, Any] = {"loss": loss, "optimizer": trainer.optimizers[0]}
        if self._batch_size is not None:
            info["batch_size"] = self._batch_size
        info.update(getattr(pl_module, "backprism_info", None) or {})
        self._ctx = self.monitor(trainer.global_step, info=info)
        self._ctx.__enter__()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """Leave the step context: the monitor tracks its quantities."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    # ------------------------------------------------------------------ epochs
    def _log_metrics(self, trainer: Any) -> None:
        metrics = trainer.callback_metrics
        values: dict[str, float] = {}
        for field, names in _METRICS.items():
            for name in names:
                if name in metrics:
                    values[field] = float(metrics[name])
                    break
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
        step = max(trainer.global_step - 1, 0)
        self.monitor.log(step, epoch=trainer.current_epoch, learning_rate=lr, **values)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Log the epoch's metrics and learning rate."""
        if self.monitor is not None:
            self._log_metrics(trainer)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Log validation metrics (skipped during the sanity check)."""
        if self.monitor is not None and not trainer.sanity_checking:
            self._log_metrics(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Leave a pending step context and close the log."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(type(exception), exception, None)
        if self.monitor is not None:
            self.monitor.close()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the log; write the dashboard and report if asked."""
        if self.monitor is None:
            return
        self.monitor.close()
        if not self.monitor.writes_log:  # under DDP only rank 0 has the log
            return
        if self.dashboard is not None:
            from backprism.plot import Dashboard

            dash = Dashboard()
            dash.draw(self.log_path)
            dash.save(self.dashboard)
            dash.close()
        if self.report is not None:
            from backprism.report import write_report

            write_report(self.log_path, self.report)


def _batch_size(batch: Any) -> int | None:
    """Leading dimension of the first tensor in ``batch``."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, (list, tuple)):
        for b in batch:
            n = _batch_size(b)
            if n is not None:
                return n
    if isinstance(batch, dict):
        for b in batch.values():
            n = _batch_size(b)
            if n is not None:
                return n
    return None
