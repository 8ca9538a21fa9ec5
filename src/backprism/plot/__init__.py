"""What a person sees: the instrument panel for a monitor log.

* :class:`Dashboard` — matplotlib dashboard (``draw``, ``save``, live ``watch``);
* :func:`read_log` / :class:`RunLog` — the JSONL monitor log in memory;
* :func:`build_panels` — the panels as data, shared with the HTML report
  (:mod:`backprism.report`);
* :func:`inspect_log` — terminal summary with diagnostics.

Requires ``matplotlib`` for drawing (``pip install backprism[plot]``).
"""

from backprism.plot.dashboard import Dashboard
from backprism.plot.diagnose import diagnose, inspect_log
from backprism.plot.logdata import RunLog, load, read_log
from backprism.plot.panels import Panel, Series, Shape, build_panels

__all__ = [
    "Dashboard",
    "Panel",
    "RunLog",
    "Series",
    "Shape",
    "build_panels",
    "diagnose",
    "inspect_log",
    "load",
    "read_log",
]
