"""Bridges to other tools; each module imports its optional dependency lazily.

* :mod:`backprism.integrations.tensorboard` — :class:`TensorBoardWriter` (``pip install
  tensorboard``): monitor quantities as TensorBoard scalars, histograms and images;
* :mod:`backprism.integrations.lightning` — :class:`MonitorCallback` (``pip install lightning``):
  the monitor inside a PyTorch Lightning ``Trainer``.
"""

__all__: list[str] = []
