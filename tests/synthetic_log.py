"""Synthetic monitor logs for the viewer tests (``tests/plot``, ``tests/report``,
``tests/integrations``, ``tests/test_cli.py``).

``write_synthetic_log`` simulates the quantities of a training run from plausible dynamics (a
noisy quadratic: loss decaying to a floor, α drifting with the learning rate, gradient tests
growing as the signal fades) in the monitor's JSONL schema.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

ALL_QUANTITIES = [
    "Loss", "Alpha", "Distance", "UpdateSize", "GradNorm", "NormTest", "InnerTest",
    "OrthoTest", "GradHist1d", "GradHist2d", "TICDiag", "TICTrace", "HessTrace", "HessMaxEV",
    "MeanGSNR", "CABS", "EarlyStopping", "Time",
]


def synthetic_records(
    steps: int = 60,
    quantities: list[str] | None = None,
    lr: float = 0.1,
    overshoot: bool = False,
    seed: int = 0,
    n_params: int = 4,
) -> list[dict]:
    """Records of a simulated run on a noisy quadratic with ``n_params`` parameter tensors.

    Loss ``L_t = L_* + (L_0 − L_*) e^{−t/τ}`` plus noise; the gradient norm is ``√(2 λ (L−L_*))``;
    α follows ``η λ − 1`` (with ``overshoot``, η λ grows beyond 2 late in training, α > 1).
    """
    rng = np.random.default_rng(seed)
    quantities = ALL_QUANTITIES if quantities is None else quantities
    recs: list[dict] = [{"kind": "meta", "version": 1, "quantities": list(quantities)}]
    theta = np.zeros(n_params)
    t0 = 0.0
    for t in range(steps):
        frac = t / max(1, steps - 1)
        lam = 2.0 + 0.5 * math.sin(t / 7) + rng.normal(0, 0.05)
        eta = lr * (3 + 2 * frac if overshoot else 1.0) * 10 / lam
        gap = 2.0 * math.exp(-t / (steps / 4)) + 0.05
        loss = 0.1 + gap + rng.normal(0, 0.03)
        gnorm = math.sqrt(2 * lam * gap) * (1 + rng.normal(0, 0.05))
        per = np.abs(rng.dirichlet(np.ones(n_params))) ** 0.5 * gnorm
        update = per * eta
        theta += update
        alpha = eta * lam / 2 - 1 + rng.normal(0, 0.15)
        noise = 0.3 + 3 * frac  # gradient becomes noise-dominated
        t0 += 0.02 + rng.uniform(0, 0.005)
        g = rng.normal(0, gnorm / 30, 2000)
        w = rng.normal(0, 0.3, 2000)
        h1, e1 = np.histogram(g, bins=30)
        h2, xe, ye = np.histogram2d(g, w, bins=(20, 25))
        values = {
            "Loss": loss,
            "Alpha": alpha,
            "Distance": [float(v) for v in np.abs(theta)],
            "UpdateSize": [float(v) for v in update],
            "GradNorm": [float(v) for v in per],
            "NormTest": noise * (1 + rng.normal(0, 0.1)),
            "InnerTest": 0.5 * noise * (1 + rng.normal(0, 0.1)),
            "OrthoTest": 0.7 * noise * (1 + rng.normal(0, 0.1)),
            "GradHist1d": {"hist": h1.tolist(), "edges": e1.tolist()},
            "GradHist2d": {"hist": h2.tolist(), "edges": [xe.tolist(), ye.tolist()]},
            "TICDiag": 5 + 3 * frac + rng.normal(0, 0.2),
            "TICTrace": 4 + 2 * frac + rng.normal(0, 0.2),
            "HessTrace": [float(v) for v in rng.uniform(0.5, 1.5, n_params) * lam],
            "HessMaxEV": lam * 3,
            "MeanGSNR": 2.0 / (1 + 5 * frac) + rng.normal(0, 0.02),
            "CABS": {"cabs": 32 * (1 + 3 * frac)},
            "EarlyStopping": -1.0 + 1.2 * frac,
            "Time": t0,
        }
        every_other = {"GradHist2d", "HessMaxEV", "HessTrace", "TICDiag", "TICTrace"}
        vals = {k: v for k, v in values.items() if k in quantities
                and (k not in every_other or t % 2 == 0)}
        if t == 5 and "Alpha" in vals:
            vals["Alpha"] = None  # a NaN is logged as null
        recs.append({"kind": "step", "step": t, "values": vals})
        if t % 10 == 9:
            recs.append({
                "kind": "log", "step": t, "epoch": t // 10, "train_loss": loss,
                "valid_loss": loss + 0.05 + 0.01 * frac, "train_accuracy": 1 - gap / 2.5,
                "valid_accuracy": 0.97 - gap / 2.5, "learning_rate": lr,
            })
    return recs


def write_synthetic_log(path: Path, **kwargs) -> Path:
    """Write :func:`synthetic_records` as a JSONL log at ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records(**kwargs)))
    return path
