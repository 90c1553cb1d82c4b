"""PNG plots for the TAN tools (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path

from dpscale.tune.scaling import SweepFit
from dpscale.tune.tables import WallRow


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display needed; PNG only
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    tmp.replace(path)  # atomic: never a half-written PNG
    return path


def plot_scaling_fit(result: SweepFit, path: str | Path) -> Path:
    """Runs, the fitted line with its confidence band (for the mean), extended to B_ref, the
    prediction there and the measured reference runs (TAN Figure 4)."""
    plt = _pyplot()
    fit = result.fit
    xs = [p.batch_size for p in result.points]
    lo, hi = min(xs + [result.reference_batch_size]), max(xs + [result.reference_batch_size])
    grid = [2 ** (math.log2(lo) + (math.log2(hi) - math.log2(lo)) * i / 100) for i in range(101)]
    preds = [fit.predict(b) for b in grid]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        grid,
        [p.value for p in preds],
        "--",
        color="C0",
        label="fit: %+.4f per doubling of B" % fit.slope,
    )
    if math.isfinite(fit.residual_std):
        ax.fill_between(
            grid,
            [p.confidence_interval[0] for p in preds],
            [p.confidence_interval[1] for p in preds],
            color="C0",
            alpha=0.2,
            label=f"{100 * fit.confidence:g}% confidence band",
        )
    ax.plot(
        xs, [p.value for p in result.points], "x", color="C0", markersize=8, label="simulated runs"
    )
    pred = result.prediction
    ax.plot(
        [pred.batch_size],
        [pred.value],
        "o",
        mfc="none",
        color="C1",
        markersize=9,
        label="prediction at B_ref",
    )
    if result.reference_points:
        ax.plot(
            [p.batch_size for p in result.reference_points],
            [p.value for p in result.reference_points],
            "*",
            color="C3",
            markersize=11,
            label="measured at B_ref",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (sigma scaled with B, same S and eta_step)")
    ax.set_ylabel(result.metric)
    ax.set_title(f"TAN batch scaling law (S={result.steps}, eta_step={result.eta_step:.3g})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_wall(rows: list[WallRow], path: str | Path) -> Path:
    """Epsilon vs sigma at constant eta, one curve per S, with eps_TAN (TAN Figure 2)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, steps in enumerate(sorted({r.steps for r in rows})):
        curve = [r for r in rows if r.steps == steps]
        ax.plot(
            [r.noise_multiplier for r in curve],
            [r.epsilon for r in curve],
            "o-",
            color=f"C{i}",
            label=f"S={steps}",
        )
    if rows:
        ax.axhline(rows[0].eps_tan, color="k", ls="--", label=f"eps_TAN = {rows[0].eps_tan:.3g}")
    ax.axvline(2.0, color="gray", ls=":", label="sigma = 2")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("noise multiplier sigma (q scaled to keep eta)")
    ax.set_ylabel("epsilon")
    ax.set_title("The privacy wall at constant eta")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    out = _save(fig, path)
    plt.close(fig)
    return out
