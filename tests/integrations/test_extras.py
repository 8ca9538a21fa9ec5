"""The integrations and the report are optional extras of the package: a missing dependency
names its extra (``pip install 'backprism[...]'``), and ``pyproject.toml`` declares them.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def test_missing_integration_dependency_names_its_extra(monkeypatch) -> None:
    import importlib
    import sys

    from backprism.integrations.tensorboard import TensorBoardWriter

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'backprism\[tensorboard\]'"):
        TensorBoardWriter("unused")
    for mod in ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks",
                "pytorch_lightning", "pytorch_lightning.callbacks"):
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.delitem(sys.modules, "backprism.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'backprism\[lightning\]'"):
        importlib.import_module("backprism.integrations.lightning")
    monkeypatch.delitem(sys.modules, "backprism.integrations.lightning", raising=False)


def test_integrations_and_report_are_optional_extras() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    meta = tomllib.loads(pyproject.read_text())["project"]
    extras = meta["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        return {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}

    assert names(meta["dependencies"]) == {"torch", "numpy"}
    for extra, dist in (("tensorboard", "tensorboard"), ("lightning", "lightning"),
                        ("wandb", "wandb"), ("report", "plotly")):
        assert dist in names(extras[extra]), extra
        assert dist in names(extras["test"]), extra
    assert {"tensorboard", "lightning", "wandb"} <= names(extras["integrations"])
    assert {"plotly", "tqdm"} <= names(extras["demo"])
