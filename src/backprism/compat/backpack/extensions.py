"""BackPACK's ``backpack.extensions`` namespace, re-exporting backprism's extensions."""

from backprism.extensions import *  # noqa: F403
from backprism.extensions import __all__  # noqa: F401
