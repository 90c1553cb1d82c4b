"""Kurakin et al. 2022, Section 3.3: tune the clipping norm, then the learning rate.

1. Take a good non-private learning rate alpha_pub (the config's ``optim.lr``).
2. At sigma = 0 and lr = alpha_pub, sweep the clipping norm C; pick the smallest C~ whose accuracy
   stays within ``tolerance`` of the unclipped run.
3. At the target sigma (the config's DP section) and C = C~, sweep the learning rate; pick the best.

Below C~, accuracy depends on lr x C (Kurakin: divide C by k, multiply lr by k), so the product
is reported too. Both stages are ordinary resumable sweeps (``OUT/clip``, ``OUT/lr``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from dpscale._io import atomic_write_text
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.train.metrics import json_safe
from dpscale.tune import TUNING_CAVEAT
from dpscale.tune.sweep import PointResult, Sweep, SweepSpec, display_value

DEFAULT_CLIP_NORMS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
DEFAULT_LR_FACTORS = (0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True)
class GridValue:
    """One swept value with the metric averaged over its seeds."""

    value: Any
    metric: float | None  # None when every run at this value failed
    runs: int


@dataclass(frozen=True)
class ClipLrResult:
    metric: str
    tolerance: float
    public_lr: float
    unclipped: float
    clip_norms: tuple[GridValue, ...]
    chosen_clip_norm: float
    learning_rates: tuple[GridValue, ...]
    chosen_lr: float
    best_metric: float
    # what the stage-3 runs' guarantees do not cover (e.g. the fixed run.seed of --seeds)
    guarantee_caveats: tuple[str, ...] = ()

    @property
    def lr_times_clip(self) -> float:
        return self.chosen_lr * self.chosen_clip_norm

    def as_json(self) -> dict:
        return json_safe(
            {**asdict(self), "lr_times_clip": self.lr_times_clip, "tuning_caveat": TUNING_CAVEAT}
        )


def _by_value(results: list[PointResult], key: str, metric: str) -> list[GridValue]:
    """Mean metric per value of ``key`` (over seeds), in grid order."""
    groups: dict[str, list[PointResult]] = {}
    for r in results:
        groups.setdefault(json.dumps(r.point[key]), []).append(r)
    out = []
    for runs in groups.values():
        summaries = [r.summary_or_empty for r in runs if r.status == "done"]
        values = [s[metric] for s in summaries if isinstance(s.get(metric), (int, float))]
        mean = sum(values) / len(values) if values else None
        out.append(GridValue(runs[0].point[key], mean, len(values)))
    return out


def choose_clip_norm(
    values: list[GridValue], tolerance: float, higher_is_better: bool = True
) -> tuple[float, float]:
    """(C~, unclipped metric): the smallest C within ``tolerance`` of the unclipped (None) value."""
    unclipped = next((v for v in values if v.value is None), None)
    if unclipped is None or unclipped.metric is None:
        raise ValueError(
            "the unclipped run (dp.max_grad_norm=null) did not finish; cannot choose a clipping norm"
        )
    sign = 1.0 if higher_is_better else -1.0
    ok = [
        v.value
        for v in values
        if v.value is not None
        and v.metric is not None
        and sign * (unclipped.metric - v.metric) <= tolerance
    ]
    if not ok:
        raise ValueError(
            f"no clipping norm came within {tolerance:g} of the unclipped {unclipped.metric:.4g}; "
            "try larger --clip-norms or a larger --tolerance"
        )
    return float(min(ok)), unclipped.metric


def run_clip_lr(
    config: str | None,
    overrides: list[str],
    out_dir: str | Path,
    clip_norms: tuple[float, ...] = DEFAULT_CLIP_NORMS,
    learning_rates: tuple[float, ...] | None = None,
    lr_factors: tuple[float, ...] = DEFAULT_LR_FACTORS,
    tolerance: float = 0.01,
    seeds: tuple[int, ...] = (),
    metric: str = "test_accuracy",
    progress: bool = True,
    on_point: Callable[[PointResult], None] | None = None,
) -> ClipLrResult:
    """Run both stages (resumably) in ``out_dir`` and write ``clip_lr.json`` and ``clip_lr.md``.

    Args:
        config, overrides: the run to tune (its optim.lr is alpha_pub; its DP section the target).
        clip_norms: C values for stage 2 (the unclipped run is added).
        learning_rates: explicit lr values for stage 3; default alpha_pub * ``lr_factors``.
        tolerance: how far below the unclipped metric C~ may be (absolute, e.g. 0.01 = 1 point).
        seeds: run.seed values; each grid value is averaged over them (default: the config's seed).
        metric: summary key to compare (higher is better unless it names a loss).
    """
    if not clip_norms or any(not c > 0 for c in clip_norms):
        raise ConfigError(f"--clip-norms must be positive numbers, got {clip_norms}")
    if not tolerance >= 0:
        raise ConfigError(f"--tolerance must be >= 0, got {tolerance}")
    base = load_config(config, overrides)
    public_lr = base.optim.lr
    if learning_rates is None:
        learning_rates = tuple(public_lr * f for f in lr_factors)
    if not learning_rates or any(not lr > 0 for lr in learning_rates):
        raise ConfigError(f"learning rates must be positive, got {learning_rates}")
    if base.dp.noise_multiplier == 0:
        raise ConfigError(
            "the config is not private (dp.noise_multiplier=0): stage 3 needs the target sigma"
        )
    seed_grid = (("run.seed", tuple(str(s) for s in seeds)),) if seeds else ()
    out_dir, higher = Path(out_dir), "loss" not in metric

    def sweep(stage: str, fixed: tuple[str, ...], grid: tuple) -> list:
        spec = SweepSpec(config, (*overrides, *fixed), (*grid, *seed_grid), metric)
        return Sweep(out_dir / stage, spec, progress, on_point).run()

    # stage 2: clipping norms of the non-private run, against the unclipped one
    clip_results = sweep(
        "clip",
        ("dp.epsilon=null", "dp.noise_multiplier=0", "dp.simulated_batch_size=null"),
        (("dp.max_grad_norm", ("null", *(repr(float(c)) for c in clip_norms))),),
    )
    clip_values = _by_value(clip_results, "dp.max_grad_norm", metric)
    chosen_clip, unclipped = choose_clip_norm(clip_values, tolerance, higher)
    # stage 3: learning rates of the private run at the chosen norm
    lr_results = sweep(
        "lr",
        (f"dp.max_grad_norm={chosen_clip!r}",),
        (("optim.lr", tuple(repr(float(lr)) for lr in learning_rates)),),
    )
    result = _result(
        metric,
        tolerance,
        public_lr,
        unclipped,
        clip_values,
        chosen_clip,
        lr_results,
        higher,
        out_dir,
    )
    atomic_write_text(out_dir / "clip_lr.json", json.dumps(result.as_json(), indent=2) + "\n")
    atomic_write_text(out_dir / "clip_lr.md", clip_lr_report(result))
    return result


def _result(
    metric: str,
    tolerance: float,
    public_lr: float,
    unclipped: float,
    clip_values: list[GridValue],
    chosen_clip: float,
    lr_results: list,
    higher: bool,
    out_dir: Path,
) -> ClipLrResult:
    """The tuning's result: the best learning rate of stage 3 (every caveat of its runs kept)."""
    learning_rates = _by_value(lr_results, "optim.lr", metric)
    finished = [(v, v.metric) for v in learning_rates if v.metric is not None]
    if not finished:
        raise ValueError(f"no learning-rate run finished; see {out_dir / 'lr' / 'sweep.md'}")
    best, best_metric = (max if higher else min)(finished, key=lambda pair: pair[1])
    caveats = {n for r in lr_results for n in ((r.summary or {}).get("guarantee_caveats") or [])}
    return ClipLrResult(
        metric=metric,
        tolerance=tolerance,
        public_lr=public_lr,
        unclipped=unclipped,
        clip_norms=tuple(clip_values),
        chosen_clip_norm=chosen_clip,
        learning_rates=tuple(learning_rates),
        chosen_lr=float(best.value),
        best_metric=best_metric,
        guarantee_caveats=tuple(sorted(caveats)),
    )


def _cell(value: float | None) -> str:
    return "failed" if value is None else f"{value:.4f}"


def _value_table(
    name: str, values: tuple[GridValue, ...], chosen: Any, metric: str, show: Callable[[Any], str]
) -> list[str]:
    """Markdown rows: one swept value per row, the chosen one marked."""
    rows = [f"| {name} | {metric} | runs |", "|---|---|---|"]
    for v in values:
        mark = " **chosen**" if v.value == chosen else ""
        rows.append(f"| {show(v.value)}{mark} | {_cell(v.metric)} | {v.runs} |")
    return rows


def clip_lr_report(result: ClipLrResult) -> str:
    """Markdown report of both stages and the chosen pair."""
    lines = [
        "# Clip-norm / learning-rate tuning (Kurakin et al. 2022, Section 3.3)",
        "",
        f"Stage 2: sigma = 0, lr = alpha_pub = {result.public_lr:g}; the smallest C within "
        f"{result.tolerance:g} of the unclipped {result.metric} ({result.unclipped:.4f}).",
        "",
    ]
    lines += _value_table(
        "C",
        result.clip_norms,
        result.chosen_clip_norm,
        result.metric,
        lambda v: "unclipped" if v is None else f"{v:g}",
    )
    lines += ["", f"Stage 3: the target sigma, C = {result.chosen_clip_norm:g}.", ""]
    lines += _value_table(
        "lr",
        result.learning_rates,
        result.chosen_lr,
        result.metric,
        lambda v: str(display_value(repr(v))),
    )
    lines += [
        "",
        f"Chosen: C = {result.chosen_clip_norm:g}, lr = {result.chosen_lr:g} ({result.metric} "
        f"{result.best_metric:.4f}); lr x C = {result.lr_times_clip:g}. Below C~, keep lr x C fixed "
        "when changing C.",
        "",
        f"**{TUNING_CAVEAT}.** Stage 2 runs at sigma = 0 are not private at all.",
        *(f"**Stage 3's guarantee does not cover:** {note}" for note in result.guarantee_caveats),
    ]
    return "\n".join(lines) + "\n"
