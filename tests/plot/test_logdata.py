"""Reading a monitor log (``backprism.plot.logdata``): round trip of a synthetic log, the rules
that combine per-parameter values, a truncated last line, bad logs (one-line ``ValueError``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from backprism.plot import read_log
from backprism.plot.logdata import combine
from tests.synthetic_log import ALL_QUANTITIES


def test_read_log_roundtrip(log_path: Path) -> None:
    log = read_log(log_path)
    assert log.quantities == ALL_QUANTITIES
    assert log.num_steps == 40
    x, y = log.scalar("Alpha")
    assert x.size == 40 and math.isnan(y[5])
    x, gn = log.scalar("GradNorm")
    raw = json.loads(log_path.read_text().splitlines()[1])["values"]["GradNorm"]
    assert gn[0] == pytest.approx(math.sqrt(sum(v * v for v in raw)))
    assert log.scalar("HessTrace")[0].size == 20
    assert log.metrics() == ["train_loss", "valid_loss", "train_accuracy", "valid_accuracy",
                             "learning_rate"]
    assert log.scalar("CABS")[1][0] == pytest.approx(32)
    (_step, hist, edges), *_ = log.histograms("GradHist2d")
    assert hist.shape == (20, 25) and [e.size for e in edges] == [21, 26]


def test_combine_rules() -> None:
    assert combine("GradNorm#2", [3.0, 4.0]) == pytest.approx(5.0)
    assert combine("Distance(x=1)", [3.0, 4.0]) == pytest.approx(5.0)
    assert combine("CABS", {"cabs": 8.0}) == 8.0
    assert combine("HessTrace", [1.0, 2.0]) == pytest.approx(3.0)
    assert math.isnan(combine("Loss", None))


def test_truncated_last_line_is_skipped(log_path: Path) -> None:
    text = log_path.read_text()
    log_path.write_text(text[: len(text) - 40])
    log = read_log(log_path)
    assert log.truncated and log.num_steps >= 38


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "not found"),
        ("", "empty"),
        ("\n\n", "empty"),
        ("step,loss\n1,2\n", "not a backprism monitor log"),
        ('{"foo": 1}\n', "not a backprism monitor log"),
        ('{"kind": "meta", "vers', "truncated"),
        ('{"kind": "meta", "version": 99, "quantities": []}\n', "unsupported"),
        ('{"kind": "meta", "version": 1, "quantities": []}\n{bad\n{"kind": "log", "step": 1}\n',
         "line 2"),
    ],
)
def test_bad_logs_raise_one_line_value_error(tmp_path: Path, content, message) -> None:
    p = tmp_path / "x.jsonl"
    if content is not None:
        p.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        read_log(p)
    assert "\n" not in str(info.value)
