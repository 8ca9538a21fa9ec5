"""``backprism.monitor``: the training instrument panel (successor of Cockpit).

>>> from backprism.monitor import Monitor, configuration, schedules, read_log
>>> monitor = Monitor(model.parameters(), configuration("economy"), log_path="run.jsonl")
>>> with monitor(step, info={"loss": loss, "batch_size": N, "individual_losses": losses,
...                          "optimizer": opt}):
...     loss.backward(create_graph=monitor.create_graph(step))
>>> frame = read_log("run.jsonl")

See :mod:`backprism.monitor.monitor` (merging, output keys, bad input, host transfers),
:mod:`backprism.monitor.log` (the streamed log schema), :mod:`backprism.monitor.configuration`
(default schedules, curvature modes and their cost), :mod:`backprism.monitor.cost`
(``monitor.cost_estimate(model, X, y)``: the overhead on your model),
:mod:`backprism.monitor.distributed` (under DDP: values of the global batch, rank 0 writes the
log) and :mod:`backprism.monitor.syncs` (counting host synchronisations, also on a CPU).
"""

from backprism.monitor import quantities, schedules
from backprism.monitor.configuration import configuration
from backprism.monitor.cost import CostReport, cost_estimate
from backprism.monitor.deferred import accelerator_paths
from backprism.monitor.hessmaxev import lanczos_max_eig
from backprism.monitor.log import read_log
from backprism.monitor.monitor import Monitor
from backprism.monitor.syncs import count_syncs

__all__ = [
    "CostReport",
    "Monitor",
    "accelerator_paths",
    "configuration",
    "cost_estimate",
    "count_syncs",
    "lanczos_max_eig",
    "quantities",
    "read_log",
    "schedules",
]
