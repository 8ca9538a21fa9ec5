"""``python -m backprism``: the ``backprism`` command line (see :mod:`backprism.cli`)."""

import sys

from backprism.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
