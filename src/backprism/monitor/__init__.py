"""``backprism.monitor``: the training instrument panel (successor of Cockpit).

>>> from backprism.monitor import Monitor, configuration, schedules, read_log
>>> monitor = Monitor(model.parameters(), configuration("economy"), log_path="run.jsonl")
>>> with monitor(step, info={"loss": loss, "batch_size": N, "individual_losses": losses,
...                          "optimizer": opt}):
...     loss.backward(create_graph=monitor.create_graph(step))
>>> frame = read_log("run.jsonl")

See :mod:`backprism.monitor.monitor` (merging, output keys, bad input) and
:mod:`backprism.monitor.log` (the streamed log schema).
"""

from backprism.monitor import quantities, schedules
from backprism.monitor.configuration import configuration
from backprism.monitor.hessmaxev import lanczos_max_eig
from backprism.monitor.log import read_log
from backprism.monitor.monitor import Monitor

__all__ = ["Monitor", "configuration", "lanczos_max_eig", "quantities", "read_log", "schedules"]
