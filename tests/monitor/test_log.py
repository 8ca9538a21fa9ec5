"""Streamed monitor log: schema, round trip, truncation tolerance, crash safety (SIGKILL)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import backprism
from backprism.monitor import Monitor, configuration, read_log, schedules
from backprism.monitor.log import LogWriter, TruncatedLogWarning
from backprism.plot.logdata import read_log as read_runlog

TRAIN = textwrap.dedent(
    """
    import sys, warnings, torch
    from torch import nn
    import backprism
    from backprism.monitor import Monitor, configuration, schedules
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = backprism.extend(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    lossf = backprism.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model.parameters(), configuration("economy"), log_path=sys.argv[1])
    step = 0
    while True:
        X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        out = model(X)
        loss = lossf(out, y)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
        with monitor(step, info=info):
            loss.backward()
        opt.step(); opt.zero_grad()
        if step % 5 == 0:
            monitor.log(step, step // 5, train_loss=float(loss))
        step += 1
    """
)


def train(path, steps: int = 4):
    torch.manual_seed(0)
    model = backprism.extend(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    lossf = backprism.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    qs = configuration("full", schedules.linear(1))
    monitor = Monitor(model.parameters(), qs, log_path=path)
    for step in range(steps):
        X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        out = model(X)
        loss = lossf(out, y)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with monitor(step, info=info):
                loss.backward(create_graph=monitor.create_graph(step))
        opt.step()
        opt.zero_grad()
    monitor.log(steps - 1, 0, train_loss=1.5, valid_accuracy=float("nan"), learning_rate=0.1)
    monitor.close()
    return monitor


def _same(a, b) -> bool:
    if isinstance(b, dict):
        return all(_same(a[k], v) for k, v in b.items())
    if isinstance(b, (list, tuple)) and any(isinstance(x, (list, tuple, np.ndarray)) for x in b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, (list, tuple, np.ndarray)):
        b = np.asarray(b, dtype=float)
        a = np.asarray(a, dtype=float)
        return a.shape == b.shape and np.allclose(a, b, rtol=1e-12, equal_nan=True)
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return a is None or (isinstance(a, float) and math.isnan(a))
    return a == pytest.approx(b, rel=1e-12)


def test_schema_and_round_trip(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    monitor = train(path)
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    assert lines[0] == {"kind": "meta", "version": 1, "quantities": monitor.keys()}
    kinds = {rec["kind"] for rec in lines}
    assert kinds == {"meta", "step", "log"}
    log = next(r for r in lines if r["kind"] == "log")
    assert log == {
        "kind": "log",
        "step": 3,
        "epoch": 0,
        "train_loss": 1.5,
        "valid_accuracy": None,
        "learning_rate": 0.1,
    }
    h2 = next(r["values"]["GradHist2d"] for r in lines if "GradHist2d" in r.get("values", {}))
    assert np.asarray(h2["hist"]).shape == (40, 50) and len(h2["edges"]) == 2
    data = read_log(path, as_frame=False)
    merged = {e["step"]: e["values"] for e in data["steps"]}
    keys = monitor.keys()
    for key, per_step in monitor.get_output().items():
        if key not in keys:
            continue
        for step, value in per_step.items():
            assert _same(merged[step][key], value), (key, step)
    fit = merged[0]["Alpha/fit"]
    assert set(fit) == {"t", "f", "df", "var_f", "var_df", "mu", "alpha"}
    assert fit["alpha"] == pytest.approx(merged[0]["Alpha"])
    frame = read_log(path)
    assert list(frame["step"]) == [0, 1, 2, 3]
    assert {"Loss", "Alpha", "HessMaxEV", "train_loss", "epoch"} <= set(frame.columns)
    assert frame.loc[3, "train_loss"] == 1.5
    np.testing.assert_allclose(
        frame["Loss"].to_numpy(dtype=float), [monitor.get_output()["Loss"][s] for s in range(4)]
    )
    out = tmp_path / "out.json"
    monitor.write(out)
    written = json.loads(out.read_text())
    assert written["Loss"]["0"] == pytest.approx(monitor.get_output()["Loss"][0])


def test_read_log_errors_and_truncation(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        read_log(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_log(empty)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match="not a backprism monitor log"):
        read_log(foreign)
    path = tmp_path / "run.jsonl"
    train(path)
    text = path.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[: len(text) - 40])  # last line truncated mid-record
    with pytest.warns(TruncatedLogWarning, match=re.escape(str(cut))):
        frame = read_log(cut)
    assert len(frame) >= 3


def test_crash_safety_sigkill(tmp_path) -> None:
    path = tmp_path / "crash.jsonl"
    # the child imports backprism from where this process does
    paths = [str(Path(backprism.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(path)], env=env)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            if path.exists() and path.read_text().count('"kind":"step"') >= 8:
                break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedLogWarning)  # killed mid-line or not
        frame = read_log(path)
    assert len(frame) >= 5
    steps = list(frame["step"])
    assert steps == list(range(len(steps)))
    done = frame.dropna(subset=["Loss"])
    assert len(done) >= 5 and np.isfinite(done["Loss"].to_numpy(dtype=float)).all()


# ---------------------------------------------------------------- cut-off lines, append repair
QUANTITIES = ["Loss", "GradNorm"]


def write_steps(path, steps, mode: str = "w", quantities=QUANTITIES) -> None:
    """A small log through :class:`LogWriter`: one step line per step, a log line every
    second step (none at odd steps, so that the last line of ``range(0, 6)`` is a step line)."""
    writer = LogWriter(path, quantities, mode=mode)
    for s in steps:
        writer.step(s, {"Loss": 1.0 / (s + 1), "GradNorm": [0.1 * s, 0.2]})
        if s % 2 == 0:
            writer.write({"kind": "log", "step": s, "epoch": 0, "train_loss": 0.5 + s})
        writer.step(s, {"Alpha": -0.5})  # a second line for the same step, merged on reading
    writer.close()


def read_both(path, n_warnings: int = 0):
    """Read ``path`` with both readers; assert each emits ``n_warnings`` warnings, all
    :class:`TruncatedLogWarning` naming the file."""
    out = []
    for reader in (lambda p: read_log(p, as_frame=False), read_runlog):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out.append(reader(path))
        assert len(caught) == n_warnings, [str(w.message) for w in caught]
        for w in caught:
            assert issubclass(w.category, TruncatedLogWarning)
            assert issubclass(w.category, UserWarning) and str(path) in str(w.message)
    return out


def same_records(path, reference) -> None:
    """``path`` and ``reference`` hold the same records for both readers."""
    (data, log), (ref_data, ref_log) = read_both(path), read_both(reference)
    assert data == ref_data
    assert (log.quantities, log.steps, log.records) == (
        ref_log.quantities, ref_log.steps, ref_log.records)


def cut_last_line(path, keep: int) -> int:
    """Cut the last line of ``path`` after ``keep`` of its characters; returns the number of
    characters of the fragment left in the file."""
    text = path.read_text()
    start = text.rstrip("\n").rfind("\n") + 1
    assert 0 < keep < len(text) - start - 1
    path.write_text(text[: start + keep])
    return keep


@pytest.mark.parametrize("keep", [1, 20, -2])
def test_cut_off_last_line_same_records_and_warning_in_both_readers(tmp_path, keep) -> None:
    path, reference = tmp_path / "cut.jsonl", tmp_path / "ref.jsonl"
    write_steps(path, range(6))
    last = path.read_text().splitlines()[-1]
    cut_last_line(path, keep % len(last))
    # the reference: the same log without its last line (the second line of step 5)
    text = path.read_text()
    reference.write_text(text[: text.rfind("\n") + 1])
    (data, log) = read_both(path, n_warnings=1)
    (ref_data, ref_log) = read_both(reference)
    assert data == ref_data
    assert (log.quantities, log.steps, log.records) == (
        ref_log.quantities, ref_log.steps, ref_log.records)
    assert log.truncated and not ref_log.truncated
    with pytest.warns(TruncatedLogWarning, match=re.escape(str(path))):
        frame = read_log(path)
    assert list(frame["step"]) == list(range(6))
    assert frame["Alpha"].isna().tolist() == [False] * 5 + [True]


def test_complete_last_line_without_newline_is_kept(tmp_path) -> None:
    path, reference = tmp_path / "run.jsonl", tmp_path / "ref.jsonl"
    write_steps(reference, range(4))
    path.write_text(reference.read_text().rstrip("\n"))
    same_records(path, reference)
    write_steps(path, range(4, 6), mode="a")  # only the newline is added: no warning
    write_steps(reference, range(4, 6), mode="a")
    assert path.read_text() == reference.read_text()


def test_corrupt_middle_line_raises_with_file_and_line(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    write_steps(path, range(4))
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = lines[2][:15] + "\n"  # line 3 cut off, more lines follow
    path.write_text("".join(lines))
    message = rf"{re.escape(str(path))}: line 3 is not valid JSON"
    with pytest.raises(ValueError, match=message) as info:
        read_log(path)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        read_runlog(path)
    lines[2] = "[1, 2]\n"  # valid JSON, but not a record
    path.write_text("".join(lines))
    for reader in (read_log, read_runlog):
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: line 3 is not a JSON"):
            reader(path)
    lines[2] = '{"kind": "step", "values": {}}\n'  # a step line without its step
    path.write_text("".join(lines))
    for reader in (read_log, read_runlog):
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: line 3 is not a valid"):
            reader(path)


def test_append_after_crash_drops_the_fragment(tmp_path) -> None:
    path, reference = tmp_path / "crashed.jsonl", tmp_path / "ref.jsonl"
    write_steps(path, range(6))
    # the crash cut the second line of step 5 ({"kind":"step","step":5,"values":{"Alpha":..}})
    dropped = cut_last_line(path, 25)
    message = rf"{re.escape(str(path))}.* {dropped} bytes"
    with pytest.warns(TruncatedLogWarning, match=message) as caught:
        write_steps(path, range(6, 9), mode="a")
    assert len(caught) == 1
    # the complete earlier records plus the new ones, as if the run had stopped cleanly
    # before the record that was cut off
    write_steps(reference, range(6))
    lines = reference.read_text().splitlines(keepends=True)
    reference.write_text("".join(lines[:-1]))
    write_steps(reference, range(6, 9), mode="a")
    assert path.read_text() == reference.read_text()
    for line in path.read_text().splitlines():
        json.loads(line)
    same_records(path, reference)
    frame = read_log(path)
    assert list(frame["step"]) == list(range(9))
    assert math.isnan(frame.loc[5, "Alpha"]) and frame.loc[6, "Alpha"] == -0.5
    assert frame.loc[8, "train_loss"] == 8.5


def test_append_after_crash_with_corrupt_last_line_and_newline(tmp_path) -> None:
    """Garbage with a newline (power loss without fsync): the readers skip it as a cut-off
    last line, so appending drops it too instead of burying it mid-file."""
    path = tmp_path / "run.jsonl"
    write_steps(path, range(3))
    with open(path, "ab") as f:
        f.write(b"\x00\x00\x00\n")
    read_both(path, n_warnings=1)
    with pytest.warns(TruncatedLogWarning, match="4 bytes"):
        write_steps(path, range(3, 5), mode="a")
    data, log = read_both(path)
    assert [e["step"] for e in data["steps"]] == list(range(5)) and not log.truncated


def test_append_to_a_complete_log_does_not_warn(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    write_steps(path, range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_steps(path, range(3, 5), mode="a", quantities=[*QUANTITIES, "Alpha"])
        data, log = read_both(path)
    assert [e["step"] for e in data["steps"]] == list(range(5))
    assert data["meta"]["quantities"] == log.quantities == [*QUANTITIES, "Alpha"]
    assert sum('"kind":"meta"' in line for line in path.read_text().splitlines()) == 2


@pytest.mark.parametrize("header", ['{"kind":"meta","vers', "{"])
def test_file_ending_inside_its_header(tmp_path, header) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text(header)
    for reader in (read_log, read_runlog):
        with pytest.raises(ValueError, match="truncated inside its header") as info:
            reader(path)
        assert str(path) in str(info.value)
    message = rf"{re.escape(str(path))} ends inside its header.* {len(header)} bytes.*afresh"
    with pytest.warns(TruncatedLogWarning, match=message):
        write_steps(path, range(2), mode="a")
    reference = tmp_path / "ref.jsonl"
    write_steps(reference, range(2))
    assert path.read_text() == reference.read_text()
    same_records(path, reference)
