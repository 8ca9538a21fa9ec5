"""Weights & Biases writer in W&B's offline mode (no network, no account): the run file that
``wandb`` writes is read back record by record."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from backprism.plot import read_log
from tests.synthetic_log import synthetic_records, write_synthetic_log


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B offline, every file it writes under ``tmp_path``."""
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'backprism[wandb]')")
    root = tmp_path / "wandb-home"
    for var, sub in (("WANDB_DIR", "runs"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        (root / sub).mkdir(parents=True)
        monkeypatch.setenv(var, str(root / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return root / "runs"


def _records(run_file: Path) -> list:
    """The protobuf records of a ``run-<id>.wandb`` file: a ``:W&B`` header (7 bytes), then
    LevelDB log framing (32 KiB blocks; chunks with a 7-byte header: CRC, length, type
    FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, payloads, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and n == 0):  # block trailer / padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            payloads.append(pending + chunk)
    out = []
    for p in payloads:
        rec = pb.Record()
        rec.ParseFromString(p)
        out.append(rec)
    return out


def _run_records(run_dir: Path, timeout: float = 30.0) -> list:
    """The run's records once W&B's service has written the closing ``exit`` record (it may
    still be writing for a moment after ``run.finish()`` returns)."""
    deadline = time.monotonic() + timeout
    while True:
        (run_file,) = run_dir.glob("run-*.wandb")
        recs = _records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in recs):
            return recs
        if time.monotonic() > deadline:
            raise AssertionError(f"{run_file} has no exit record after {timeout} s")
        time.sleep(0.1)


def _history(run_dir: Path) -> list[dict]:
    rows = []
    for rec in _run_records(run_dir):
        if rec.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for it in rec.history.item:  # media are flattened to nested keys [key, field]
            *path, last = list(it.nested_key) or [it.key]
            d = row
            for k in path:
                d = d.setdefault(k, {})
            d[last] = json.loads(it.value_json)
        rows.append(row)
    return rows


def _metrics(run_dir: Path) -> dict[str, str]:
    return {(r.metric.name or r.metric.glob_name): r.metric.step_metric
            for r in _run_records(run_dir) if r.WhichOneof("record_type") == "metric"}


def test_wandb_offline_run(offline: Path, tmp_path: Path) -> None:
    from backprism.integrations.wandb import WandbWriter

    log_path = write_synthetic_log(tmp_path / "run.jsonl", steps=12)
    log = read_log(log_path)
    with WandbWriter(project="backprism-test", dir=str(offline), per_parameter=True) as wb:
        run_dir = Path(wb.run.dir).parent
        n = wb.update(log_path)
        assert n > 0 and wb.update(log_path) == 0  # nothing new the second time
        image = wb.log_dashboard(log_path)
        assert image is not None
    rows = _history(run_dir)
    assert _metrics(run_dir) == {"backprism/step": "", "backprism/*": "backprism/step",
                                 "metrics/*": "backprism/step"}

    def at(key: str) -> dict[int, object]:
        return {r["backprism/step"]: r[key] for r in rows if key in r}

    # scalars: one value per tracked step, whole-model and per parameter
    _x, gn = log.scalar("GradNorm")
    assert list(at("backprism/GradNorm")) == list(range(12))
    assert list(at("backprism/GradNorm").values()) == pytest.approx(gn.tolist(), rel=1e-6)
    raw = json.loads(log_path.read_text().splitlines()[1])["values"]
    assert at("backprism/GradNorm/param_3")[0] == pytest.approx(raw["GradNorm"][3])
    assert list(at("backprism/HessMaxEV")) == list(range(0, 12, 2))
    assert at("backprism/CABS")[0] == pytest.approx(32)
    assert 5 not in at("backprism/Alpha")  # null at step 5: skipped, not logged as NaN
    assert list(at("metrics/valid_accuracy")) == [9]
    # GradHist1d as wandb.Histogram with the logged bins
    hist = at("backprism/GradHist1d")
    assert len(hist) == 12
    assert hist[0]["_type"] == "histogram"
    assert hist[0]["values"] == pytest.approx(raw["GradHist1d"]["hist"])
    assert hist[0]["bins"] == pytest.approx(raw["GradHist1d"]["edges"])
    # GradHist2d and the dashboard as images, written into the run's media folder
    images = at("backprism/GradHist2d")
    assert len(images) == 6 and all(v["_type"] == "image-file" for v in images.values())
    (dash,) = at("backprism/dashboard").values()
    assert dash["_type"] == "image-file" and (dash["width"], dash["height"]) == (1800, 1300)
    assert (run_dir / "files" / dash["path"]).stat().st_size > 0
    assert list(at("backprism/dashboard")) == [11]


def test_wandb_update_follows_growing_log_and_late_values(offline: Path, tmp_path: Path) -> None:
    import wandb

    from backprism.integrations.wandb import WandbWriter

    recs = synthetic_records(steps=6, quantities=["Loss"])
    p = tmp_path / "run.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs[:4]))
    run = wandb.init(project="backprism-test", dir=str(offline))
    wb = WandbWriter(run=run)
    assert wb.update(p) == 3
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert wb.update(p) == 3
    # a value that arrives late (an earlier monitor step) is still logged at its own step
    wb.log(1, {"backprism/late": 7.0})
    wb.close()  # a run passed in is not finished by the writer
    run_dir = Path(run.dir).parent
    run.finish()
    rows = _history(run_dir)
    assert [r["backprism/step"] for r in rows if "backprism/Loss" in r] == list(range(6))
    assert [(r["backprism/step"], r["backprism/late"]) for r in rows
            if "backprism/late" in r] == [(1, 7.0)]


def test_wandb_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from backprism.integrations.wandb import WandbWriter

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"backprism\[wandb\]"):
        WandbWriter(project="x")
