"""Bridges to other tools; each module imports its optional dependency lazily, and each is an
optional extra of the package.

* :mod:`backprism.integrations.tensorboard` — :class:`TensorBoardWriter` (``pip install
  backprism[tensorboard]``): monitor quantities as TensorBoard scalars, histograms and images;
* :mod:`backprism.integrations.wandb` — :class:`WandbWriter` (``pip install backprism[wandb]``):
  monitor quantities as Weights & Biases scalars, ``wandb.Histogram`` histograms and images,
  plus the dashboard image;
* :mod:`backprism.integrations.lightning` — :class:`MonitorCallback` (``pip install
  backprism[lightning]``): the monitor inside a PyTorch Lightning ``Trainer``.

``pip install backprism[integrations]`` installs all three.
"""

__all__: list[str] = []
