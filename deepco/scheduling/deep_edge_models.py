"""Deep-Edge's performance and interference models (Bhattacharjee et al., eqs. (5)-(8)), fitted to the
measurements `bench/deep_edge_profile.py` took on this machine (``data/deep_edge_profile.json``).

Node state X = (q, l): the server's CPU quota in cores (the emulated edge server's size) and its background
load l (fraction of one core a duty-cycle spinner asks for). Both models are least-squares regressions on
features that divide by the quota, because a CPU-bound step's time scales with 1/q under a cgroup quota:

- EstComputeTime (eq. 5): step time of one training step at batch b,
  t_step = (w0 + w1 b + w2 l + w3 b l) / q; per-sample compute time t^compute = t_step / b.
- EstExecTime (eq. 8, through the state of eq. 7): the co-located `deepco serve` head latency,
  L = (v0 + v1 l + v2 T + v3 T b) / q with T = 1 when a training job runs beside it (0 otherwise).
- EstUpdateTime (eq. 6) is not profiled: push + pull of the float32 parameters over the PS's link, which
  the |W| workers share: 2 x 4 bytes x params x |W| / bandwidth (the paper observes t^update growing with
  |W|; the PS's own update is inside the measured step).

Each fit reports its leave-one-out mean absolute percentage error (MAPE), the accuracy figure of the
paper's Table I. The paper used H2O AutoML on ~1600 points; we have ~20 per model, so a 4-term physical
regression is the honest choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from deepco.errors import UserError

DEFAULT_PROFILE = Path(__file__).resolve().parent / "data" / "deep_edge_profile.json"


def compute_features(quota: float, load: float, batch: float) -> np.ndarray:
    """Features of EstComputeTime."""
    return np.array([1.0, batch, load, batch * load]) / quota


def exec_features(quota: float, load: float, batch: float) -> np.ndarray:
    """Features of EstExecTime (batch 0: no training beside the inference)."""
    train = 1.0 if batch > 0 else 0.0
    return np.array([1.0, load, train, train * batch]) / quota


@dataclass
class Regression:
    """A least-squares fit with its leave-one-out MAPE (percent)."""

    coef: np.ndarray
    loo_mape: float
    train_mape: float
    points: int

    def __call__(self, x: np.ndarray) -> float:
        return float(x @ self.coef)


def fit(x: np.ndarray, y: np.ndarray) -> Regression:
    """Least squares with relative weights (errors matter in percent), and leave-one-out MAPE."""
    w = 1.0 / y
    coef = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
    errs = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        c = np.linalg.lstsq(x[keep] * w[keep, None], y[keep] * w[keep], rcond=None)[0]
        errs.append(abs(x[i] @ c - y[i]) / y[i])
    train = float(np.mean(np.abs(x @ coef - y) / y)) * 100
    return Regression(coef=coef, loo_mape=float(np.mean(errs)) * 100, train_mape=train, points=len(y))


@dataclass
class DeepEdgeModels:
    """The fitted models and what they were fitted on."""

    compute: Regression
    exec_time: Regression
    params: int  # parameters of the trained model (for EstUpdateTime)
    batches: tuple[int, ...]
    source: dict

    def step_time(self, quota: float, load: float, batch: int) -> float:
        """EstComputeTime x b: seconds of one training step."""
        return self.compute(compute_features(quota, load, batch))

    def compute_time(self, quota: float, load: float, batch: int) -> float:
        """t^compute (eq. 5): seconds per sample."""
        return self.step_time(quota, load, batch) / batch

    def update_time(self, link_mbps: float | None, workers: int = 1) -> float:
        """t^update (eq. 6): push + pull of the float32 parameters over a link the ``workers`` share
        (0 on the PS's own host)."""
        if not link_mbps:
            return 0.0
        return 2 * 4 * self.params * 8 * workers / (link_mbps * 1e6)

    def inference_ms(self, quota: float, load: float, batch: int) -> float:
        """EstExecTime (eq. 8): predicted head latency of the co-located server, ms (batch 0: no training)."""
        return self.exec_time(exec_features(quota, load, batch))

    def summary(self) -> dict:
        """Fit quality, for the bench report and the CLI."""
        return {"EstComputeTime": {"points": self.compute.points, "loo_mape_pct": round(self.compute.loo_mape, 2),
                                   "train_mape_pct": round(self.compute.train_mape, 2)},
                "EstExecTime": {"points": self.exec_time.points, "loo_mape_pct": round(self.exec_time.loo_mape, 2),
                                "train_mape_pct": round(self.exec_time.train_mape, 2)},
                "profiled": self.source.get("date"), "machine": self.source.get("machine")}


def fit_models(doc: dict) -> DeepEdgeModels:
    """Fit both regressions to a profile document (``bench/deep_edge_profile.py``'s JSON)."""
    rows = doc["rows"]
    tr = [r for r in rows if r["batch"] > 0]
    if len(tr) < 5 or len(rows) < 5:
        raise UserError("deep-edge profile: too few measurements to fit the models (need >= 5 of each)")
    xc = np.array([compute_features(r["quota"], r["load"], r["batch"]) for r in tr])
    yc = np.array([r["step_s_median"] for r in tr])
    xe = np.array([exec_features(r["quota"], r["load"], r["batch"]) for r in rows])
    ye = np.array([r["infer_ms_median"] for r in rows])
    return DeepEdgeModels(compute=fit(xc, yc), exec_time=fit(xe, ye), params=int(doc.get("params", 11689512)),
                          batches=tuple(b for b in doc["batches"] if b > 0), source=doc)


@lru_cache(maxsize=4)
def _load(path: str) -> DeepEdgeModels:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such profile (run bench/deep_edge_profile.py)") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read the deep-edge profile: {exc}") from None
    try:
        return fit_models(doc)
    except (KeyError, TypeError) as exc:
        raise UserError(f"{path}: not a deep-edge profile (missing {exc})") from None


def load_models(path: str | Path | None = None) -> DeepEdgeModels:
    """The models fitted to ``path`` (default: the committed profile of this machine)."""
    return _load(str(path or DEFAULT_PROFILE))
