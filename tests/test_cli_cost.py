"""``backprism cost``: the monitor's cost estimate from the command line, in-process and as a
real subprocess. Timings vary with the machine's load: only the structure of the output is
checked, and that every ratio is a positive finite number."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backprism.cli import main
from backprism.monitor import Monitor, configuration
from backprism.monitor.configuration import DEFAULT_INTERVALS

#: a user model file for ``FILE.py:CALLABLE`` and ``MODULE:CALLABLE``
TINY = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    return model, nn.CrossEntropyLoss(), torch.randn(6, 4), torch.randint(0, 3, (6,))


def needs_args(n):
    return make()


def not_a_problem():
    return "model"
'''

ROW = re.compile(r"^(\w+)\s+(\S+)×\s+(\d+)/(\d+)\s+(\S+)×$")
FAST = ["--steps", "9", "--repeats", "1"]


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def table_rows(text: str) -> dict[str, tuple[float, int, int, float]]:
    """``key → (per step, active steps, horizon, amortised)`` of the printed table."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            key, per, n, horizon, amortised = m.groups()
            rows[key] = (float(per), int(n), int(horizon), float(amortised))
    return rows


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_model.py"
    path.write_text(TINY)
    return path


def test_table_of_the_demo_model(capsys) -> None:
    code = main(["cost", "--quantities", "Loss,gradnorm,HessTrace@3", "--batch-size", "8",
                 *FAST])
    assert code == 0
    out, err = capsys.readouterr()
    assert out.startswith("demo: 3,658 parameters, batch 8, cpu; 3 quantities")
    rows = table_rows(out)
    assert list(rows) == ["Loss", "GradNorm", "HessTrace"]
    assert {k: (n, h) for k, (_, n, h, _) in rows.items()} == {
        "Loss": (9, 9), "GradNorm": (9, 9), "HessTrace": (3, 9)}
    for per, _, _, amortised in rows.values():
        assert math.isfinite(per) and per > 0 and math.isfinite(amortised) and amortised > 0
    assert re.search(r"^plain step: \d+\.\d ms$", out, re.M)
    total = re.search(r"^all at every step\s+(\S+)×$", out, re.M)
    assert total and float(total.group(1)) > 0
    last = re.search(r"^amortised over steps 0\.\.8 with the schedules: (\S+)× the plain step$",
                     out, re.M)
    assert last and math.isfinite(float(last.group(1))) and float(last.group(1)) > 0
    # not a terminal: no progress bar, one line saying what is timed
    assert err.count("\n") == 1 and "\r" not in err and err.startswith("timing the monitor")


def test_json_of_a_configuration_on_a_user_file(tiny: Path, capsys) -> None:
    code = main(["cost", f"{tiny}:make", "--config", "economy", "--steps", "11",
                 "--repeats", "1", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"] == {
        "model": f"{tiny}:make", "parameters": 43, "batch_size": 6, "device": "cpu",
        "configuration": "economy", "every_step": False, "curvature": None, "steps": 11,
        "repeats": 1, "clock": "wall"}
    assert positive(data["plain_s"]) and data["horizon"] == 11
    keys = [q.key for q in configuration("economy")]
    assert [row["key"] for row in data["quantities"]] == keys
    for row in data["quantities"]:
        assert positive(row["per_step"]) and positive(row["amortised"])
        expected = len(range(0, 11, DEFAULT_INTERVALS[row["key"]]))
        if row["key"] == "Alpha":  # two-step: starts at multiples of k, ends one step later
            expected = 2 * expected - 1
        assert row["active_steps"] == expected
    assert positive(data["together"]) and positive(data["amortised"])
    assert sum(p["steps"] for p in data["patterns"]) == 11
    for p in data["patterns"]:
        assert positive(p["ratio"]) and set(p["quantities"]) <= set(keys)


def test_json_amortised_only_of_a_module(tiny: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tiny.parent)  # MODULE:CALLABLE is looked up from the current directory
    code = main(["cost", "tiny_model:make", "--quantities", "Loss,NormTest@4",
                 "--no-per-quantity", "--clock", "process", "--steps", "8", "--repeats", "1",
                 "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["configuration"] is None and data["setup"]["clock"] == "process"
    assert data["quantities"] == [
        {"key": "Loss", "per_step": None, "active_steps": 8, "amortised": None},
        {"key": "NormTest", "per_step": None, "active_steps": 2, "amortised": None},
    ]
    assert data["together"] is None and positive(data["amortised"])
    assert sum(p["steps"] for p in data["patterns"]) == 8
    assert str(tiny.parent) not in sys.path  # the lookup did not leave the folder behind


def test_progress_bar_only_on_a_terminal(monkeypatch, capsys) -> None:
    pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["cost", "--quantities", "Loss,GradNorm", "--batch-size", "4", *FAST]) == 0
    err = term.getvalue()
    assert "timing" in err and "variant" in err and "\r" in err
    # 2 quantities alone, both together, 2 step patterns (step 0; a step after an active one)
    assert "5/5" in err
    assert "GradNorm" in table_rows(capsys.readouterr().out)


def test_progress_callback_of_cost_estimate() -> None:
    import backprism

    torch.manual_seed(0)
    model = backprism.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    qs = configuration("economy")
    calls = []
    report = Monitor(model.parameters(), qs).cost_estimate(
        model, torch.randn(4, 3), torch.randint(0, 2, (4,)), steps=3, repeats=1,
        verbose=False, progress=lambda *a: calls.append(a))
    timed_patterns = sum(1 for _, keys, _ in report.patterns if keys)
    total = len(qs) + 1 + timed_patterns
    assert [c[:2] for c in calls] == [(i, total) for i in range(total + 1)]
    assert [c[2] for c in calls[: len(qs) + 1]] == [*report.quantity_keys(), "all at every step"]
    assert calls[-1][2] == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nowhere"], "MODULE:CALLABLE"),
        (["no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
        (["missing.py:make"], "not found"),
        (["{tiny}:nothing"], "has no callable 'nothing'"),
        (["{tiny}:needs_args"], "callable without arguments"),
        (["{tiny}:not_a_problem"], "must return (model, lossfunc, X, y)"),
        (["{tiny}:make", "--batch-size", "4"], "--batch-size"),
        (["--quantities", "TICDiag", "--curvature", "diag_ggn_exact", "--device", "nodevice"],
         "--device"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, tiny: Path, capsys) -> None:
    argv = [a.replace("{tiny}", str(tiny)) for a in argv]
    assert main(["cost", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("backprism: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [["--quantities", "Frobnicate"], ["--config", "full", "--quantities", "Loss"],
     ["--quantities", "Loss@0"], ["--steps", "0"], ["--config", "deluxe"]],
)
def test_usage_errors(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["cost", *argv])
    assert info.value.code == 2
    assert "usage: backprism cost" in capsys.readouterr().err


def test_subprocess_json(tiny: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "backprism", "cost", "tiny_model:make", "--quantities",
         "Loss,GradNorm", *FAST, "--json"],
        cwd=tiny.parent, env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [row["key"] for row in data["quantities"]] == ["Loss", "GradNorm"]
    assert all(positive(row["per_step"]) for row in data["quantities"])
    assert positive(data["amortised"]) and data["setup"]["parameters"] == 43
    assert res.stderr.count("\n") == 1 and "\r" not in res.stderr  # piped: no progress bar
