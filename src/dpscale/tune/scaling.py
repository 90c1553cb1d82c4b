"""TAN's batch scaling law (Sander et al. 2023, Figure 4): at constant eta_step and S, test
accuracy is linear in log(B). Fit it on cheap simulated runs and predict the run at B_ref."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dpscale.config import flat_config


@dataclass(frozen=True)
class ScalingFit:
    """Least-squares line y = intercept + slope * log2(B).

    Attributes:
        slope: change of the metric per doubling of B.
        intercept: the metric at B = 1 (log2 B = 0).
        slope_stderr, intercept_stderr: standard errors (nan with fewer than 3 points).
        residual_std: s, the residual standard deviation (n - 2 degrees of freedom).
        confidence: level of the intervals below (e.g. 0.95).
        slope_interval: (low, high) confidence interval of the slope.
        points: number of (B, y) points.
        distinct_batch_sizes: number of distinct B.
        mean_log2_batch, sxx: the design's centre and spread (for predictions).
        t_quantile: Student-t quantile for ``confidence`` with n - 2 degrees of freedom.
    """

    slope: float
    intercept: float
    slope_stderr: float
    intercept_stderr: float
    residual_std: float
    confidence: float
    slope_interval: tuple[float, float]
    points: int
    distinct_batch_sizes: int
    mean_log2_batch: float
    sxx: float
    t_quantile: float

    def predict(self, batch_size: float) -> "ScalingPrediction":
        """The fitted metric at ``batch_size``, with a confidence interval for the mean and a
        prediction interval for a single new run."""
        x = math.log2(batch_size)
        mean = self.intercept + self.slope * x
        leverage = 1.0 / self.points + (x - self.mean_log2_batch) ** 2 / self.sxx
        half_mean = self.t_quantile * self.residual_std * math.sqrt(leverage)
        half_run = self.t_quantile * self.residual_std * math.sqrt(1.0 + leverage)
        return ScalingPrediction(
            batch_size=batch_size,
            value=mean,
            confidence_interval=(mean - half_mean, mean + half_mean),
            prediction_interval=(mean - half_run, mean + half_run),
        )

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ScalingPrediction:
    batch_size: float
    value: float
    confidence_interval: tuple[float, float]  # for the mean metric at this B
    prediction_interval: tuple[float, float]  # for one more run at this B


def fit_log_batch_law(
    batch_sizes: list[float], values: list[float], confidence: float = 0.95
) -> ScalingFit:
    """Ordinary least squares of ``values`` on log2(``batch_sizes``), with Student-t intervals.

    Repeated runs (seeds) at the same B are separate points.

    Raises:
        ValueError: fewer than two distinct batch sizes, mismatched lengths, or a bad level.
    """
    if len(batch_sizes) != len(values):
        raise ValueError(f"{len(batch_sizes)} batch sizes but {len(values)} values")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if any(not b > 0 for b in batch_sizes):
        raise ValueError("batch sizes must be > 0")
    x = np.log2(np.asarray(batch_sizes, dtype=np.float64))
    y = np.asarray(values, dtype=np.float64)
    distinct = len(set(np.round(x, 12)))
    if distinct < 2:
        raise ValueError(f"the scaling law needs runs at >= 2 distinct batch sizes, got {distinct}")
    n = len(x)
    x_mean, y_mean = x.mean(), y.mean()
    sxx = float(((x - x_mean) ** 2).sum())
    slope = float(((x - x_mean) * (y - y_mean)).sum() / sxx)
    intercept = float(y_mean - slope * x_mean)
    if n > 2:
        residuals = y - (intercept + slope * x)
        s = math.sqrt(float((residuals**2).sum()) / (n - 2))
        from scipy.stats import t as student_t  # scipy comes with kymatio

        t_q = float(student_t.ppf(0.5 + confidence / 2, n - 2))
    else:  # a line through two points: no residual degrees of freedom, no interval
        s, t_q = math.nan, math.nan
    slope_se = s / math.sqrt(sxx)
    intercept_se = s * math.sqrt(1.0 / n + x_mean**2 / sxx)
    return ScalingFit(
        slope=slope,
        intercept=intercept,
        slope_stderr=slope_se,
        intercept_stderr=intercept_se,
        residual_std=s,
        confidence=confidence,
        slope_interval=(slope - t_q * slope_se, slope + t_q * slope_se),
        points=n,
        distinct_batch_sizes=distinct,
        mean_log2_batch=float(x_mean),
        sxx=sxx,
        t_quantile=t_q,
    )


# --------------------------------------------------------------- fitting a sweep
BATCH_KEYS = ("dp.simulated_batch_size", "dp.batch_size")
REPEAT_KEYS = ("run.seed",)


@dataclass(frozen=True)
class LawPoint:
    """One finished run used by (or checked against) the law."""

    batch_size: float
    value: float
    run_dir: str
    simulated: bool


@dataclass(frozen=True)
class SweepFit:
    """The batch scaling law fitted on a sweep, its prediction at B_ref and (if measured) the error.

    Attributes:
        metric: the summary key fitted (e.g. test_accuracy).
        fit: the least-squares line on the simulated runs.
        reference_batch_size: B_ref.
        prediction: the law at B_ref.
        steps: S shared by every run.
        eta_step: q / sigma shared by every run.
        reference_noise_multiplier, reference_epsilon: the reference run's sigma and epsilon.
        points: the simulated runs the line was fitted on.
        reference_points: measured runs at B_ref (from the sweep or given), not used in the fit.
        error: mean measured metric at B_ref minus the prediction (None if none was measured).
    """

    metric: str
    fit: ScalingFit
    reference_batch_size: float
    prediction: ScalingPrediction
    steps: int
    eta_step: float
    reference_noise_multiplier: float | None
    reference_epsilon: float | None
    points: tuple[LawPoint, ...]
    reference_points: tuple[LawPoint, ...] = ()

    @property
    def measured_reference(self) -> float | None:
        if not self.reference_points:
            return None
        return sum(p.value for p in self.reference_points) / len(self.reference_points)

    @property
    def error(self) -> float | None:
        measured = self.measured_reference
        return None if measured is None else measured - self.prediction.value

    def as_json(self) -> dict:
        out = asdict(self)
        out["measured_reference"] = self.measured_reference
        out["error"] = self.error
        return out


def _law_point(summary: dict, run_dir: str, metric: str) -> tuple[LawPoint, dict]:
    if metric not in summary or not isinstance(summary[metric], (int, float)):
        raise ValueError(f"run {run_dir} has no numeric {metric!r} in its summary")
    if not (summary.get("noise_multiplier") or 0) > 0:
        raise ValueError(
            f"run {run_dir} is not private (sigma = 0): the TAN law is for DP-SGD runs"
        )
    sim = summary.get("simulation")
    info = {
        "steps": int(summary["steps"]),
        "eta_step": summary["sample_rate"] / summary["noise_multiplier"],
        "reference_batch_size": sim["batch_size"] if sim else summary["batch_size"],
        "reference_noise_multiplier": sim["noise_multiplier"]
        if sim
        else summary["noise_multiplier"],
        "reference_epsilon": sim["epsilon"] if sim else summary["epsilon"],
    }
    return LawPoint(float(summary["batch_size"]), float(summary[metric]), run_dir, bool(sim)), info


def _same(values: list[float], what: str, rel: float = 1e-9) -> float:
    first = values[0]
    if any(abs(v - first) > rel * max(abs(first), 1e-300) for v in values):
        shown = ", ".join(f"{v:.6g}" for v in sorted(set(values)))
        raise ValueError(
            f"the runs do not share one {what} ({shown}): the law holds at constant eta_step and S"
        )
    return first


def fit_sweep(
    records: list[dict],
    metric: str = "test_accuracy",
    confidence: float = 0.95,
    where: dict[str, Any] | None = None,
    reference_summaries: Sequence[tuple[str, dict]] = (),
    reference_batch_size: float | None = None,
) -> SweepFit:
    """Fit the law on a sweep's finished runs (``sweep.jsonl`` records) and predict B_ref.

    Runs that are TAN simulations are fitted; non-simulated runs at B_ref (in the sweep, or given as
    ``reference_summaries`` = [(run_dir, summary)]) are the measured reference, compared with the
    prediction. Every run must share S and eta_step = q / sigma, and the sweep may vary nothing
    else than the batch size and run.seed among the runs used (filter with ``where``).

    Raises:
        ValueError: mixed S or eta_step, other varying grid keys, or too few batch sizes.
    """
    where = where or {}
    chosen = [
        r
        for r in records
        if r["status"] == "done" and all(r["point"].get(k) == v for k, v in where.items())
    ]
    if not chosen and not reference_summaries:
        raise ValueError("no finished runs to fit" + (f" matching {where}" if where else ""))
    keys = {k for r in chosen for k in r["point"]} - set(BATCH_KEYS) - set(REPEAT_KEYS) - set(where)
    varying = sorted(k for k in keys if len({json_key(r["point"].get(k)) for r in chosen}) > 1)
    if varying:
        raise ValueError(
            f"the sweep also varies {', '.join(varying)}; fit one setting at a time with --where KEY=VALUE"
        )
    runs = [_law_point(r["summary"], r["run_dir"], metric) for r in chosen]
    runs += [_law_point(summary, run_dir, metric) for run_dir, summary in reference_summaries]
    infos = [info for _, info in runs]
    steps = int(_same([i["steps"] for i in infos], "number of steps S"))
    eta = _same([i["eta_step"] for i in infos], "eta_step = q / sigma")
    b_ref = reference_batch_size or _same(
        [i["reference_batch_size"] for i in infos], "reference batch size"
    )
    _check_one_setting([p.run_dir for p, _ in runs])
    # Runs at B_ref (a simulation there is the reference run itself) are the measurement to
    # predict; every other run is a point of the law.
    at_reference = lambda p: abs(p.batch_size - b_ref) <= 1e-9 * b_ref  # noqa: E731
    points = tuple(p for p, _ in runs if not at_reference(p))
    measured = tuple(p for p, _ in runs if at_reference(p))
    if not points:
        raise ValueError("no runs below the reference batch size to fit (only runs at B_ref)")
    fit = fit_log_batch_law([p.batch_size for p in points], [p.value for p in points], confidence)
    sigma_ref, epsilon_ref = _reference_noise(next((i for (p, i) in runs), {}), b_ref)
    return SweepFit(
        metric=metric,
        fit=fit,
        reference_batch_size=b_ref,
        prediction=fit.predict(b_ref),
        steps=steps,
        eta_step=eta,
        reference_noise_multiplier=sigma_ref,
        reference_epsilon=epsilon_ref,
        points=points,
        reference_points=measured,
    )


def _reference_noise(info: dict[str, Any], batch_size: float) -> tuple[float | None, float | None]:
    """(sigma, epsilon) of the reference run at ``batch_size``: the runs' own when it is their
    reference B; at another B (``--reference-batch-size``) the same eta_step = q / sigma puts sigma in
    proportion to B, and its epsilon is not accounted here (None)."""
    sigma, epsilon, runs_b = (
        info.get(k)
        for k in ("reference_noise_multiplier", "reference_epsilon", "reference_batch_size")
    )
    if sigma is None or runs_b is None or abs(batch_size - runs_b) <= 1e-9 * runs_b:
        return sigma, epsilon
    return sigma * batch_size / runs_b, None


# Settings that decide only when the model is scored, not how it trains: runs of one law may
# differ in them (a full-batch reference run scored every epoch, its simulations every ten).
SCORING_ONLY = (("train", "eval_every_epochs"),)


def _setting(run_dir: str) -> dict[str, Any] | None:
    """The run's config apart from what a law's runs may differ in (simulated B, the run section:
    seed, directory, threads, device; ``SCORING_ONLY``); None when the directory has no config.yaml."""
    from dpscale.runs import is_run_dir, read_run_config  # local: fitting a law needs no torch

    if not is_run_dir(run_dir):
        return None
    # one-line errors for a malformed file, defaults filled in
    values = read_run_config(run_dir).to_dict()
    values["dp"].pop("simulated_batch_size", None)
    values.pop("run", None)
    for section, key in SCORING_ONLY:
        values.get(section, {}).pop(key, None)
    return values


def _check_one_setting(run_dirs: list[str]) -> None:
    """Refuse a run counted twice, or runs whose configs differ beyond batch size and seed
    (e.g. two pooled sweeps with different --set values), naming the keys that differ."""
    resolved = [str(Path(d).resolve()) for d in run_dirs]
    if len(set(resolved)) != len(resolved):
        raise ValueError("a run is counted twice (the same sweep or --reference given twice?)")
    settings = [flat_config(s) for s in (_setting(d) for d in run_dirs) if s is not None]
    keys = sorted(
        {k for s in settings for k in s if len({json_key(x.get(k)) for x in settings}) > 1}
    )
    if keys:
        raise ValueError(
            f"the runs' configs differ in more than the batch size and seed: {', '.join(keys)} "
            "(compare their config.yaml); the law compares one setting at several batch sizes"
        )


def json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
