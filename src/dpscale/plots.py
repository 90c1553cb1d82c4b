"""``dpscale plot``: PNG curves of one or more run directories, drawn headless (matplotlib's Agg).

- ``accuracy.png``: test accuracy (and the EMA / AugTest accuracies when logged) against steps;
- ``loss.png``: train loss (since the previous evaluation) and test loss against steps;
- ``epsilon.png``: epsilon spent (at the run's delta) against steps;
- ``epsilon_delta.png``: the final model's epsilon against delta, from the accountant history in
  its checkpoint (the run's own delta marked);
- ``tradeoff.png``: the guarantee as an attacker's odds: the largest true-positive rate of any
  membership test against its false-positive rate, from the same accountant's privacy profile
  (``dpscale.privacy.accounting.tradeoff``; runs whose accounting does not describe their sampling left out).

Several runs are overlaid, each labelled by its directory's name. Everything is read from the
run directory (metrics.jsonl, checkpoint.pt): a plot can be redrawn while a run goes on. The
PNGs are owner-only (0600, a folder created for them 0700), as every file of a run: the train
loss they show is not covered by the guarantee.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from dpscale._io import atomic_write_bytes, make_private_dir
from dpscale.errors import ConfigError
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.accounting.pld_history import PLD_MIN_DELTA
from dpscale.runs import read_metrics, read_run

# The epsilon-delta curve's deltas: 1e-12 (PLD_MIN_DELTA) to 1e-2, four per decade.
CURVE_DELTAS = tuple(10.0 ** (-12 + k / 4) for k in range(41))
PLOT_NAMES = ("accuracy.png", "loss.png", "epsilon.png", "epsilon_delta.png", "tradeoff.png")
# The trade-off curve's false-positive rates: 1e-4 to 1, log-spaced.
CURVE_FPRS = tuple(10.0 ** (-4 + k / 10) for k in range(41))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that hold a finite number for it."""
    pairs = [
        (r["step"], r[key])
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _save(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` as a PNG, owner-only and atomically (a redraw replaces it whole)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    _pyplot().close(fig)
    atomic_write_bytes(path, buffer.getbuffer())


def _curves(
    runs: dict[str, list[dict[str, Any]]],
    keys: dict[str, str],
    ylabel: str,
    path: Path,
    percent: bool,
) -> None:
    """One figure of ``keys`` (metrics key -> legend suffix) against steps for every run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = ["-", "--", ":", "-."]
    for color, (name, records) in enumerate(runs.items()):
        for style, (key, suffix) in zip(styles, keys.items()):
            steps, values = _series(records, key)
            if steps:
                scale = 100.0 if percent else 1.0
                ax.plot(
                    steps,
                    [scale * v for v in values],
                    style,
                    color=f"C{color % 10}",
                    marker=".",
                    label=f"{name}{suffix}",
                )
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)


def _final_accountant(
    run_dir: Path, guarantee_only: bool = False
) -> tuple[PrivacyAccountant, float] | None:
    """The accountant of the run's newest checkpoint and the run's delta (None for a non-private run;
    with ``guarantee_only``, also for a TAN simulation, whose accounting is of another run; the
    accountant of fixed-size, shuffled or capped batches is their own, its adjacency in its history)."""
    _, state = read_run(run_dir)
    mechanism = state.get("mechanism") or {}
    plan, accountant = mechanism.get("plan") or {}, mechanism.get("accountant")
    if not accountant or not float(plan.get("noise_multiplier") or 0) > 0:
        return None
    if guarantee_only and plan.get("simulation"):
        return None
    return PrivacyAccountant.from_state_dict(accountant), float(plan["delta"])


def _tradeoff(run_dirs: Sequence[Path], path: Path) -> None:
    """TPR against FPR of the best membership test each run allows, and random guessing."""
    from dpscale.privacy.accounting.tradeoff import tpr_at_fpr

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(CURVE_FPRS, CURVE_FPRS, ":", color="grey", label="random guessing")
    for color, run_dir in enumerate(run_dirs):
        final = _final_accountant(run_dir, guarantee_only=True)
        if final is None:
            continue
        accountant = final[0]
        tpr = tpr_at_fpr(accountant.privacy_profile(), CURVE_FPRS)
        ax.plot(
            list(tpr),
            list(tpr.values()),
            color=f"C{color % 10}",
            label=f"{run_dir.name} ({accountant.kind}, {accountant.steps} steps)",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false-positive rate of a membership test")
    ax.set_ylabel("largest possible true-positive rate")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)


def _epsilon_delta(run_dirs: Sequence[Path], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for color, run_dir in enumerate(run_dirs):
        final = _final_accountant(run_dir)
        if final is None:
            continue
        accountant, delta = final
        ax.plot(
            CURVE_DELTAS,
            accountant.epsilons(CURVE_DELTAS),
            color=f"C{color % 10}",
            label=f"{run_dir.name} ({accountant.kind}, {accountant.steps} steps)",
        )
        ax.plot([delta], accountant.epsilons([delta]), "o", color=f"C{color % 10}")
    ax.set_xscale("log")
    ax.set_xlabel(f"delta (the run's delta marked; PLD resolves delta >= {PLD_MIN_DELTA:g})")
    ax.set_ylabel("epsilon of the final model")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)


def plot_runs(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    on_written: Callable[[Path], None] | None = None,
) -> list[Path]:
    """Draw ``PLOT_NAMES`` for ``run_dirs`` (overlaid) into ``out_dir``, created owner-only if missing.

    Args:
        run_dirs: the run directories, each with at least one evaluation.
        out_dir: the folder for the PNGs.
        on_written: called with each PNG's path once it is written (progress).

    Returns:
        the paths written.

    Raises:
        ConfigError: a run directory with no evaluation yet (empty metrics.jsonl).
    """
    dirs = [Path(d) for d in run_dirs]
    runs: dict[str, list[dict[str, Any]]] = {}
    for run_dir in dirs:
        records = read_metrics(run_dir)
        if not records:
            raise ConfigError(f"{run_dir} has no evaluation in metrics.jsonl yet: nothing to plot")
        runs[_unique(run_dir.name, runs)] = records
    out = Path(out_dir)
    make_private_dir(out)
    accuracy_keys = {
        "test_accuracy": "",
        "test_accuracy_ema": " (EMA)",
        "test_accuracy_augtest": " (AugTest)",
    }
    drawings: list[Callable[[Path], None]] = [
        lambda path: _curves(runs, accuracy_keys, "test accuracy (%)", path, percent=True),
        lambda path: _curves(
            runs, {"train_loss": " train", "test_loss": " test"}, "loss", path, percent=False
        ),
        lambda path: _curves(
            runs, {"epsilon": ""}, "epsilon spent (at the run's delta)", path, percent=False
        ),
        lambda path: _epsilon_delta(dirs, path),
        lambda path: _tradeoff(dirs, path),
    ]
    paths = [out / name for name in PLOT_NAMES]
    for draw, path in zip(drawings, paths):
        draw(path)
        if on_written is not None:
            on_written(path)
    return paths


def _unique(name: str, taken: dict[str, Any]) -> str:
    """``name``, or ``name (2)``, ... when two run directories share a name."""
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name} ({n})"
    return candidate
