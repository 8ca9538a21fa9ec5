"""The ``backprism`` command line, in-process and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from backprism.cli import main
from tests.synthetic_log import write_synthetic_log


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "backprism", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_demo_end_to_end(tmp_path: Path, capsys) -> None:
    pytest.importorskip("sklearn", reason="the demo needs scikit-learn")
    res = _run("demo", "--steps", "20", "--out", "out", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    for name in ("monitor.jsonl", "dashboard.png", "report.html"):
        assert (out / name).stat().st_size > 0
        assert str(Path("out") / name) in res.stdout
    assert "20/20" in res.stderr and "step/s" in res.stderr and "loss" in res.stderr
    lines = (out / "monitor.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "meta"
    steps = {json.loads(x)["step"] for x in lines[1:] if json.loads(x)["kind"] == "step"}
    assert steps == set(range(20))
    import matplotlib.image

    assert matplotlib.image.imread(out / "dashboard.png").shape[:2] == (1300, 1800)

    assert main(["inspect", str(out / "monitor.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "tracked steps: 20" in text and "HessMaxEV" in text


def test_plot_report_inspect(tmp_path: Path, capsys) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=30, overshoot=True)
    assert main(["plot", str(log), "-o", str(tmp_path / "d.svg")]) == 0
    assert (tmp_path / "d.svg").read_text().lstrip().startswith("<?xml")
    assert main(["plot", str(log)]) == 0
    assert (tmp_path / "run.png").exists()
    assert main(["report", str(log), "-o", str(tmp_path / "r.html")]) == 0
    assert "backprism-data" in (tmp_path / "r.html").read_text()
    capsys.readouterr()
    assert main(["inspect", str(log)]) == 0
    out = capsys.readouterr().out
    assert "α > 1 for the last 20% of steps" in out and "learning rate likely too large" in out
    assert "gradient tests fail" in out and "batch too small" in out


def test_plot_watch_with_timeout(tmp_path: Path, capsys) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=5, quantities=["Loss"])
    code = main(["plot", str(log), "--watch", "--interval", "0.05", "--timeout", "0.3",
                 "-o", str(tmp_path / "live.png")])
    assert code == 0 and (tmp_path / "live.png").exists()
    assert "1 redraws" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "not found"),
        ("", "empty"),
        ("id,loss\n1,0.5\n", "not a backprism monitor log"),
        ('{"kind": "meta", "version": 1, "quan', "truncated"),
    ],
)
def test_bad_logs_exit_2_with_one_line(tmp_path: Path, capsys, content, message) -> None:
    p = tmp_path / "bad.jsonl"
    if content is not None:
        p.write_text(content)
    for cmd in ("plot", "report", "inspect"):
        assert main([cmd, str(p)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("backprism: error: ") and message in err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_truncated_last_line_warns_and_works(tmp_path: Path, capsys) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=10, quantities=["Loss"])
    log.write_text(log.read_text()[:-20])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["inspect", str(log)]) == 0
    assert not caught  # the reader's TruncatedLogWarning is replaced by the CLI's own line
    err = capsys.readouterr().err
    assert err.startswith("backprism: warning: ") and err.count("\n") == 1 and "cut off" in err


def test_subprocess_bad_log_has_no_traceback(tmp_path: Path) -> None:
    res = _run("inspect", "missing.jsonl", cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "not found" in res.stderr


@pytest.mark.parametrize(
    "argv",
    [["plot", "--frobnicate", "x"], [], ["demo", "--config", "deluxe"], ["demo", "--steps", "0"],
     ["plot", "x.jsonl", "--smoothing", "1.5"]],
)
def test_usage_errors(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: backprism" in capsys.readouterr().err


def test_unsupported_image_format(tmp_path: Path, capsys) -> None:
    log = write_synthetic_log(tmp_path / "run.jsonl", steps=4, quantities=["Loss"])
    assert main(["plot", str(log), "-o", str(tmp_path / "x.gif")]) == 2
    assert "unsupported image format" in capsys.readouterr().err
