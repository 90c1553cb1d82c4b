"""Grid sweeps through the normal trainer: sequential, resumable, one run directory per point.

``OUT/sweep.json`` records what the sweep is (config, overrides, grid); ``OUT/runs/NNN-.../`` are
ordinary run directories; ``OUT/sweep.jsonl`` (one record per finished or failed point) and
``OUT/sweep.md`` (a table sorted by the metric) are rewritten after every point. Running the same
sweep again skips finished points and resumes interrupted ones from their checkpoints.

With private tuning, all of that is the tuner's alone (it reveals K); what may be published is
``OUT/released/`` (``dpscale.tune.private_tuning``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from dpscale._io import atomic_write_text
from dpscale.config import Config, is_private_config, load_config
from dpscale.errors import ConfigError
from dpscale.runs import CONFIG_NAME, METRICS_NAME, holds_checkpoint, read_summary
from dpscale.train.loop import Trainer
from dpscale.train.metrics import json_safe
from dpscale.privacy.accounting.tuning import TuningDistribution
from dpscale.tune import TUNING_CAVEAT
from dpscale.tune.private_tuning import (
    RELEASE_NAME,
    RELEASED_DIR,
    TUNER_PRIVATE,
    check_tuning_metric,
    draw_trials,
    release_statement,
    tuning_from_text,
    tuning_release,
    write_release,
)

MANIFEST_NAME = "sweep.json"
RESULTS_NAME = "sweep.jsonl"
TABLE_NAME = "sweep.md"
TRIAL_FAILED_NAME = "trial_failed.json"  # private tuning: a trial that failed, for good


def split_values(text: str) -> list[str]:
    """Split ``v1,v2,...`` on commas outside brackets, braces and quotes ("[16, 16]" stays whole)."""
    values: list[str] = []
    current: list[str] = []  # the characters of the value being read
    depth, quote = 0, None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    values.append("".join(current).strip())
    if quote or depth:
        raise ConfigError(f"unbalanced brackets or quotes in grid values {text!r}")
    if any(v == "" for v in values):
        raise ConfigError(f"empty value in grid values {text!r}")
    return values


def parse_grid(text: str) -> tuple[str, tuple[str, ...]]:
    """``KEY=V1,V2,...`` -> (KEY, (V1, V2, ...)); values are parsed like ``--set`` values."""
    key, sep, rest = text.partition("=")
    key = key.strip()
    if not sep or not key or not rest.strip():
        raise ConfigError(f"--grid needs KEY=V1,V2,..., got {text!r}")
    values = tuple(split_values(rest))
    if len(set(values)) != len(values):
        raise ConfigError(f"--grid {key}: repeated value in {text!r}")
    return key, values


def display_value(raw: str) -> Any:
    """The YAML reading of a grid value, for tables and records."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep runs: every combination of the grid values on top of the config and overrides.

    Attributes:
        config: a YAML path, ``preset:NAME``, or None (defaults).
        overrides: ``KEY=VALUE`` texts applied to every point (before the grid values).
        grid: (KEY, raw values) pairs; points are their cartesian product, first key outermost.
        metric: summary key the table is sorted by.
        minimize: sort ascending (default: ascending only for metrics with "loss" in the name).
        private_tuning: ``poisson:MEAN`` etc.: run K random points instead of the grid and account
            for releasing the best (``dpscale.tune.private_tuning``); None: the whole grid.
    """

    config: str | None
    overrides: tuple[str, ...] = ()
    grid: tuple[tuple[str, tuple[str, ...]], ...] = ()
    metric: str = "test_accuracy"
    minimize: bool | None = None
    private_tuning: str | None = None

    @property
    def ascending(self) -> bool:
        return self.minimize if self.minimize is not None else "loss" in self.metric

    def points(self) -> list[dict[str, str]]:
        keys = [k for k, _ in self.grid]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"a --grid key is given twice: {keys}")
        return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in self.grid))]

    def manifest(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "overrides": list(self.overrides),
            "grid": {k: list(v) for k, v in self.grid},
            **({"private_tuning": self.private_tuning} if self.private_tuning else {}),
        }


def point_name(index: int, point: dict[str, str], trial: bool = False) -> str:
    """A directory name like ``003-dp.batch_size=256,run.seed=1`` (unsafe characters replaced;
    ``trial-003-...`` for the drawn trials of private tuning)."""
    text = ",".join(f"{k}={v}" for k, v in point.items()) or "base"
    text = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", text)[:120]
    return f"{'trial-' if trial else ''}{index:03d}-{text}"


@dataclass
class PointResult:
    index: int
    name: str
    point: dict[str, Any]
    run_dir: str
    status: str  # done | failed
    summary: dict[str, Any] | None = None
    error: str | None = None

    @property
    def summary_or_empty(self) -> dict[str, Any]:
        """``summary``, or {} for a point without one (a failed point; a finished point has its summary)."""
        return self.summary or {}

    def record(self) -> dict[str, Any]:
        return json_safe(
            {
                "index": self.index,
                "name": self.name,
                "point": self.point,
                "run_dir": self.run_dir,
                "status": self.status,
                "error": self.error,
                "summary": self.summary,
                "tuning_caveat": TUNING_CAVEAT,
            }
        )


def _run_dir(config: Config) -> Path:
    """A point's run directory: ``Sweep._point_config`` sets every point's run.out_dir."""
    if config.run.out_dir is None:
        raise ValueError("a sweep point's config has no run.out_dir")
    return Path(config.run.out_dir)


def _config_digest(config: Config) -> str:
    values = config.to_dict()
    values["run"].pop("out_dir", None)
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class Sweep:
    """A sweep in ``out_dir``. ``run()`` trains every unfinished point and returns the results.

    Args:
        out_dir: the sweep directory.
        spec: what to run.
        progress: show each run's progress bar and the per-point lines.
        on_point: called with each PointResult as it completes (for callers printing their own lines).
    """

    out_dir: Path
    spec: SweepSpec
    progress: bool = True
    on_point: Callable[[PointResult], None] | None = None
    _configs: list[Config] = field(default_factory=list, init=False)
    # the points run (a draw, with private tuning)
    drawn_points: list[dict[str, str]] = field(default_factory=list, init=False)
    tuning: TuningDistribution | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)

    def prepare(self) -> list[Config]:
        """Build and validate every point's config (bad values fail before anything trains) and
        claim or check the sweep directory. With private tuning, the points are the drawn trials."""
        path = self.out_dir / MANIFEST_NAME
        saved = json.loads(path.read_text()) if path.exists() else None
        if saved is not None and any(
            saved.get(key) != value for key, value in self.spec.manifest().items()
        ):
            raise ConfigError(self._different_sweep())
        grid_points = self.spec.points()
        self.drawn_points, trials = grid_points, None
        if self.spec.private_tuning:
            self.tuning = tuning_from_text(self.spec.private_tuning, [k for k, _ in self.spec.grid])
            check_tuning_metric(self.spec.metric)
            earlier = saved or {}
            trials = earlier.get("trials")
            if trials is None or earlier.get("private_tuning") != self.spec.private_tuning:
                trials = draw_trials(self.tuning, len(grid_points))
            self.drawn_points = [grid_points[i] for i in trials]
        configs = [
            self._point_config(index, point, trials is not None)
            for index, point in enumerate(self.drawn_points)
        ]
        if trials is not None and not all(is_private_config(c.dp) for c in configs):
            raise ConfigError(
                "--private-tuning accounts for private runs; this config trains without noise (no finite cost)"
            )
        grid_units = {
            self._point_config(i, p, False).data.privacy_unit for i, p in enumerate(grid_points)
        }
        # every grid point: K may draw none of them
        if trials is not None and grid_units != {"example"}:
            raise ConfigError(
                "--private-tuning does not follow data.privacy_unit=user yet (its release names no unit): "
                "tune at the example unit, or tune without --private-tuning"
            )
        manifest = {**self.spec.manifest(), "config_digests": [_config_digest(c) for c in configs]}
        if trials is not None:
            manifest["trials"] = trials
        if saved is not None:
            if saved != manifest:
                raise ConfigError(self._different_sweep())
        else:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(manifest, indent=2) + "\n")
        self._configs = configs
        return configs

    def _different_sweep(self) -> str:
        return (
            f"{self.out_dir} holds a different sweep (its config, --set, --grid or --private-tuning differ, or the "
            "config file changed since); choose another --out"
        )

    def _point_config(self, index: int, point: dict[str, str], trial: bool) -> Config:
        overrides = [*self.spec.overrides, *(f"{k}={v}" for k, v in point.items())]
        try:
            config = load_config(self.spec.config, overrides)
        except ConfigError as err:
            raise ConfigError(f"sweep point {point_name(index, point)}: {err}") from err
        run = replace(
            config.run, out_dir=str(self.out_dir / "runs" / point_name(index, point, trial))
        )
        if trial and run.seed is not None:  # each trial is a separate run with its own randomness
            run = replace(run, seed=run.seed + index)
        return replace(config, run=run)

    def run(self) -> list[PointResult]:
        configs = self._configs or self.prepare()
        points = self.drawn_points
        names = [point_name(i, p, bool(self.spec.private_tuning)) for i, p in enumerate(points)]
        shown = [{k: display_value(v) for k, v in p.items()} for p in points]
        # Points finished by an earlier invocation are results from the start, so an interrupted
        # rerun never drops them from sweep.jsonl.
        results = [
            self._earlier_result(i, names[i], shown[i], _run_dir(c)) for i, c in enumerate(configs)
        ]
        for index, (point, config) in enumerate(zip(points, configs)):
            if self.progress:
                label = " ".join(f"{k}={v}" for k, v in point.items()) or "(base config)"
                done = " (finished earlier)" if results[index] is not None else ""
                print(f"[sweep {index + 1}/{len(points)}] {label}{done}", file=sys.stderr)
            result = results[index]
            if result is None:
                result = results[index] = self._run_point(index, names[index], shown[index], config)
                self.write_results([r for r in results if r is not None])
            if self.on_point:
                self.on_point(result)
        final = [r for r in results if r is not None]
        self.write_results(final)
        return final

    def _earlier_result(
        self, index: int, name: str, point: dict[str, Any], run_dir: Path
    ) -> PointResult | None:
        """A point's result from an earlier invocation: finished, or (private tuning) failed for
        good: a trial is never run twice, or more than K runs would have been made."""
        summary = read_summary(run_dir)
        if summary is not None:
            return PointResult(index, name, point, str(run_dir), "done", summary)
        if self.tuning is not None and (run_dir / TRIAL_FAILED_NAME).exists():
            error = json.loads((run_dir / TRIAL_FAILED_NAME).read_text())["error"]
            return PointResult(index, name, point, str(run_dir), "failed", error=error)
        return None

    def _run_point(
        self, index: int, name: str, point: dict[str, Any], config: Config
    ) -> PointResult:
        run_dir = _run_dir(config)
        result = PointResult(index, name, point, str(run_dir), "done")
        try:
            result.summary = read_summary(run_dir)
            if result.summary is not None:
                return result
            # checkpoint.pt, or only the previous one kept: resume falls back on it
            if holds_checkpoint(run_dir):
                trainer = Trainer.resume(run_dir, progress=self.progress)
            else:
                # A run that died before its first checkpoint left only its config (and maybe a
                # metrics header): nothing trained, so start it again.
                for leftover in (CONFIG_NAME, METRICS_NAME):
                    (run_dir / leftover).unlink(missing_ok=True)
                trainer = Trainer.create(config, progress=self.progress)
            result.summary = trainer.run()
        except (ConfigError, ValueError, RuntimeError, OSError) as err:
            result.status, result.error = "failed", f"{type(err).__name__}: {err}"
            if self.tuning is not None:  # final: rerunning it would make more runs than the K drawn
                run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_text(
                    run_dir / TRIAL_FAILED_NAME, json.dumps({"error": result.error}) + "\n"
                )
        return result

    def write_results(self, results: list[PointResult]) -> None:
        lines = "".join(json.dumps(r.record()) + "\n" for r in results)
        atomic_write_text(self.out_dir / RESULTS_NAME, lines)
        release = (
            self.release(results)
            if self.tuning is not None and len(results) == len(self.drawn_points)
            else None
        )
        atomic_write_text(
            self.out_dir / TABLE_NAME,
            results_table(results, self.spec, len(self.drawn_points), release),
        )

    def release(self, results: list[PointResult]) -> dict[str, Any]:
        """Private tuning: the best run, its model copied to ``released/`` with its epsilon (the
        tuning composed) and no trace of K, decided once (a later invocation reads it back: one
        release per draw)."""
        path = self.out_dir / RELEASED_DIR / RELEASE_NAME
        if path.exists():
            return json.loads(path.read_text())
        if self.tuning is None:
            raise ValueError(
                "Sweep.release is for private tuning (SweepSpec.private_tuning), after prepare()"
            )
        done = sorted_done(results, self.spec.metric, self.spec.ascending)
        best = done[0] if done else None
        selection = {
            "metric": self.spec.metric,
            "value": best.summary_or_empty[self.spec.metric] if best else None,
            "hyperparameters": best.point if best else None,
            "guarantee_caveats": best.summary_or_empty.get("guarantee_caveats")
            if best
            else None,  # e.g. a fixed seed
        }
        best_dir = best.run_dir if best else None
        delta = best.summary_or_empty.get("delta") if best else None
        record = tuning_release(self.tuning, best_dir, [r.run_dir for r in done], delta, selection)
        write_release(path.parent, record, best_dir)
        return record


def read_results(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``sweep.jsonl`` in ``sweep_dir``."""
    path = Path(sweep_dir) / RESULTS_NAME
    if not path.is_file():
        raise ConfigError(
            f"{sweep_dir} is not a sweep directory (no {RESULTS_NAME}); run `dpscale sweep` first"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return "null" if value is None else str(value)


def sorted_done(results: list[PointResult], metric: str, ascending: bool) -> list[PointResult]:
    done = [
        r
        for r in results
        if r.status == "done" and isinstance(r.summary_or_empty.get(metric), (int, float))
    ]
    return sorted(done, key=lambda r: r.summary_or_empty[metric], reverse=not ascending)


def results_table(
    results: list[PointResult],
    spec: SweepSpec,
    total: int | None = None,
    release: dict[str, Any] | None = None,
) -> str:
    """Markdown: the finished points sorted by the metric, then failures, then the caveat (or,
    for private tuning, what may be released)."""
    keys = [k for k, _ in spec.grid]
    metric = spec.metric
    done = sorted_done(results, metric, spec.ascending)
    simulated = any((r.summary or {}).get("simulation") for r in done)
    extra = (
        ["test_accuracy", "epsilon"]
        + (["reference_epsilon"] if simulated else [])
        + ["steps", "wall_time_s"]
    )
    extra = [c for c in extra if c != metric]
    header = ["rank", *keys, metric, *extra, "run"]
    order = "ascending" if spec.ascending else "descending"
    lines = [f"**{TUNER_PRIVATE}.**", ""] if spec.private_tuning else []
    lines += [
        f"# Sweep: {len(done)} of {len(spec.points()) if total is None else total} {'trials' if spec.private_tuning else 'points'} done, sorted by {metric} ({order})",
        "",
        f"config: {spec.config or '(defaults)'}"
        + (f"; --set {' '.join(spec.overrides)}" if spec.overrides else ""),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for rank, r in enumerate(done, 1):
        cells = [str(rank), *(_fmt(r.point.get(k)) for k in keys), _fmt(r.summary_or_empty[metric])]
        cells += [_fmt(r.summary_or_empty.get(c)) for c in extra]
        cells.append(Path(r.run_dir).name)
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in results if r.status != "done"]
    if failed:
        lines += ["", "Failed points:", ""]
        lines += [f"- {r.name}: {r.error}" for r in failed]
    if simulated:
        lines += [
            "",
            "Runs with a reference_epsilon are TAN simulations: they carry NO privacy guarantee at that "
            "epsilon; it is what the reference run they stand for would spend.",
        ]
    notes = {
        n
        for r in done
        for n in (r.summary_or_empty.get("guarantee_caveats") or [])
        if not n.startswith("TAN SIMULATION")
    }
    lines += ["", tuning_text(spec, release)]
    lines += [f"\nWARNING: {n}" for n in sorted(notes)]
    return "\n".join(lines) + "\n"


def tuning_text(spec: SweepSpec, release: dict[str, Any] | None) -> str:
    """The sweep's statement about tuning: the caveat, or the private tuning's release."""
    if not spec.private_tuning:
        return f"**{TUNING_CAVEAT}.**"
    if release is None:
        return "**Private tuning in progress: nothing may be released before every drawn trial has finished.**"
    if not release["released"]:
        return f"**{release_statement(release)}**"
    return f"**{release_statement(release)} It is rank 1 above; the other rows are for the tuner alone: releasing them is not covered.**"
