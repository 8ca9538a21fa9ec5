"""The demo (``backprism.demo``): a progress bar on a terminal, one summary line elsewhere.
(The demo end to end through the command line: ``tests/test_cli.py``.)
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_demo_progress_bar_only_on_a_terminal(tmp_path: Path, tty: bool) -> None:
    pytest.importorskip("sklearn", reason="the demo needs scikit-learn")
    pytest.importorskip("tqdm", reason="the demo's progress bar needs tqdm")
    from backprism.demo import run_demo

    stream = _Terminal() if tty else io.StringIO()
    files = run_demo(config="economy", steps=4, out=tmp_path, progress=stream, report=False,
                     dashboard=False)
    assert list(files) == ["log"]
    text = stream.getvalue()
    if tty:  # tqdm redraws the bar in place
        assert "training" in text and "4/4" in text and "step/s" in text and "\r" in text
        assert "loss=" in text
    else:  # one summary line, no bar
        assert text.count("\n") == 1 and "\r" not in text
        assert re.fullmatch(r"trained 4/4 steps in [0-9.]+ s \([0-9.]+ step/s\)  loss [0-9.]+"
                            r"  acc [0-9.]+\n", text)
