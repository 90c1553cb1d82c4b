"""Running an audit: train with canaries, score them, bound epsilon, write audit.json and the
score plot (see ``dpscale.audit``)."""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence, cast

import numpy as np
import torch
from torch import nn

from dpscale._io import PRIVATE_FILE_MODE, atomic_write_text
from dpscale.audit import DEFAULT_CANARIES, DEFAULT_CONFIDENCE, PLOT_NAME
from dpscale.audit.canaries import CanaryAudit
from dpscale.config import Config, is_private_config
from dpscale.errors import ConfigError
from dpscale.privacy.accounting.audit_bound import audit_ceiling, best_guesses, default_guess_rules
from dpscale.privacy.clipping.per_example import (
    ClippedSumMixin,
    PerExampleEngine,
    per_example_cross_entropy,
)
from dpscale.privacy.noise.gaussian import Params
from dpscale.rng import DPRandom
from dpscale.runs import AUDIT_NAME


@dataclass(frozen=True)
class AuditFault:
    """A deliberately broken mechanism, for showing that the audit catches bugs (tests and
    docs/audit.md only; no command offers it). The accountant is still told the configured sigma and C.

    Attributes:
        noise_scale: the noise is drawn at this multiple of sigma * C.
        clip_scale: the engine clips at clip_scale * C inside while it reports C (``max_grad_norm``)
            to everyone else: a clipping bug in the engine's own arithmetic.
    """

    noise_scale: float = 1.0
    clip_scale: float = 1.0

    def apply(self, engine: PerExampleEngine) -> PerExampleEngine:
        """``engine`` with this fault's clipping bug (itself when there is none)."""
        return engine if self.clip_scale == 1 else _LooseClipping(engine, self.clip_scale)


class _LooseClipping(ClippedSumMixin):
    """An engine that reports C but whose clipped sums are those of the same engine at
    ``scale`` * C (AuditFault.clip_scale): only what passes through its arithmetic shows the bug."""

    # wraps ``inner``, a dataclass engine
    def __init__(self, inner: PerExampleEngine, scale: float) -> None:
        self.loose = replace(inner, max_grad_norm=inner.max_grad_norm * scale)  # type: ignore[type-var,operator]
        self.name, self.max_grad_norm = inner.name, inner.max_grad_norm
        self.views, self.precision, self.clip_gamma = (
            getattr(inner, "views", 1),
            inner.precision,
            inner.clip_gamma,
        )
        self.loss_fn = getattr(inner, "loss_fn", per_example_cross_entropy)

    def clipped_sum_and_losses(
        self, model: nn.Module, params: Params, batch: Any
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        return self.loose.clipped_sum_and_losses(model, params, batch)


@dataclass(frozen=True)
class AuditResult:
    """What an audit measured (``as_json`` is what ``dpscale audit --json`` prints)."""

    kind: str
    canaries: int
    included: int
    eps_lower_bound: float
    epsilon: float
    delta: float
    confidence: float
    eps_ceiling: float  # the most these canaries and rules could show (every guess right)
    guesses: int
    correct: int
    guess_in: int
    guess_out: int
    rules_tried: int
    audit_seed: int
    verdict: str
    passed: bool
    run_dir: str
    plot: str | None
    test_accuracy: float
    canary_path: str  # what the canaries put through the run's engine, and what they do not test

    def as_json(self) -> dict[str, Any]:
        """The fields as plain JSON values (infinities and NaN as null)."""
        from dpscale.train.metrics import json_safe

        return json_safe(asdict(self))


def verdict_for(
    eps_lower_bound: float, epsilon: float, confidence: float, ceiling: float = math.inf
) -> tuple[bool, str]:
    """(passed, the verdict line) for a measured bound against the claimed epsilon (``ceiling``:
    the most this audit could have shown)."""
    if eps_lower_bound > epsilon:
        return False, (
            f"FAIL: the run leaks more than it claims: epsilon >= {eps_lower_bound:.3g} with {100 * confidence:g}% "
            f"confidence, but it claims epsilon = {epsilon:.3g} (a bug in clipping, noise or accounting)"
        )
    weak = (
        f"; this audit could show at most {ceiling:.3g} (its canaries and delta), so it cannot refute {epsilon:.3g}"
        if ceiling <= epsilon
        else ""
    )
    return True, (
        f"PASS: no violation found (epsilon >= {eps_lower_bound:.3g} at {100 * confidence:g}% confidence, claimed "
        f"{epsilon:.3g}){weak}; an audit can refute a claim, never prove it"
    )


def audit_config_problems(config: Config) -> list[str]:
    """What an audit cannot run with (the run set-ups the canaries are not built for)."""
    problems = []
    if config.data.loader == "stream":
        problems.append("data.loader=stream (canaries are added to the training set in memory)")
    if config.features.extractor is not None or config.features.normalize != "none":
        problems.append(
            "features.extractor / features.normalize (canaries would need to pass through them)"
        )
    if config.dp.sampling != "poisson":
        problems.append(
            f"dp.sampling={config.dp.sampling} (the accounting covers Poisson sampling only)"
        )
    if config.dp.simulated_batch_size is not None:
        problems.append("dp.simulated_batch_size (a TAN simulation claims no epsilon to test)")
    if config.dp.mechanism == "bandmf":
        problems.append(
            "dp.mechanism=bandmf (the audit scores each step's release as if its noise were independent of the other "
            "steps'; BandMF's noise is correlated across steps, so its scores would be wrong until the releases are "
            "decorrelated, which dpscale does not do yet: audit the run with dp.mechanism=dpsgd)"
        )
    if config.data.privacy_unit != "example":
        problems.append(
            "data.privacy_unit=user (its canaries would have to be users; audit at the example unit)"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        problems.append("torchrun (run the audit as one process)")
    return problems


def run_audit(
    config: Config,
    *,
    kind: str = "gradient",
    canaries: int = DEFAULT_CANARIES,
    confidence: float = DEFAULT_CONFIDENCE,
    rules: Sequence[tuple[int, int]] | None = None,
    audit_seed: int | None = None,
    progress: bool = True,
    plot: bool = True,
    fault: AuditFault | None = None,
) -> AuditResult:
    """Train the run ``config`` describes with canaries, then audit it.

    Args:
        config: the run (run.out_dir set); any ``dpscale train`` config that is private.
        kind: "gradient" (white-box Dirac canaries) or "input" (mislabelled images).
        canaries: m, each included with probability 1/2.
        confidence: of the lower bound (e.g. 0.95).
        rules: (k+, k-) guessing rules, union-bounded (default: ``default_guess_rules``).
        audit_seed: membership and canary draws (default: run.seed, else fresh entropy).
        progress: show training progress.
        plot: write the score histogram PNG.
        fault: a deliberately broken mechanism (tests only).

    Returns:
        the result, also written to ``<run_dir>/audit.json``.
    """
    check_audit_request(config, canaries=canaries, confidence=confidence, rules=rules)
    seed = (
        audit_seed
        if audit_seed is not None
        else config.run.seed
        if config.run.seed is not None
        else secrets.randbits(64)
    )
    audit = CanaryAudit(kind, canaries, seed)
    trainer = _start_run(config, audit, progress, fault)
    summary = trainer.run()
    scores = audit.scores(trainer.model)
    delta = trainer.plan.delta
    outcome = best_guesses(scores, audit.included, delta=delta, confidence=confidence, rules=rules)
    epsilon = trainer.epsilon()
    ceiling = audit_ceiling(audit.m, delta=delta, confidence=confidence, rules=rules)
    passed, verdict = verdict_for(outcome.eps_lower_bound, epsilon, confidence, ceiling)
    plot_path = (
        plot_scores(scores, audit.included, trainer.run_dir / PLOT_NAME, outcome, kind)
        if plot
        else None
    )
    result = AuditResult(
        kind=kind,
        canaries=audit.m,
        included=int(audit.included.sum()),
        eps_lower_bound=outcome.eps_lower_bound,
        epsilon=epsilon,
        delta=delta,
        confidence=confidence,
        eps_ceiling=ceiling,
        guesses=outcome.guesses,
        correct=outcome.correct,
        guess_in=outcome.guess_in,
        guess_out=outcome.guess_out,
        rules_tried=len(rules) if rules else len(default_guess_rules(audit.m)),
        audit_seed=seed,
        verdict=verdict,
        passed=passed,
        run_dir=str(trainer.run_dir),
        plot=str(plot_path) if plot_path else None,
        test_accuracy=float(summary["test_accuracy"]) if summary else math.nan,
        canary_path=audit.scope(),
    )
    atomic_write_text(trainer.run_dir / AUDIT_NAME, json.dumps(result.as_json(), indent=2) + "\n")
    return result


def check_audit_request(
    config: Config, *, canaries: int, confidence: float, rules: Sequence[tuple[int, int]] | None
) -> None:
    """Refuse, before anything trains, what an audit cannot do or measure."""
    problems = audit_config_problems(config)
    if not is_private_config(config.dp):
        problems.append("a non-private run (it claims no epsilon to test)")
    if problems:
        raise ConfigError("dpscale audit does not support " + "; ".join(problems))
    if not 0 < confidence < 1:
        raise ConfigError(f"--confidence must be in (0, 1), got {confidence}")
    for k_in, k_out in rules or ():
        if k_in < 0 or k_out < 0 or k_in + k_out > canaries or k_in + k_out == 0:
            raise ConfigError(
                f"--guesses {k_in},{k_out}: need k+, k- >= 0 with 0 < k+ + k- <= --canaries ({canaries})"
            )


def _start_run(config: Config, audit: CanaryAudit, progress: bool, fault: AuditFault | None) -> Any:
    """The Trainer with the canaries in, the directory marked as an audit's, and any fault."""
    from dpscale.train.loop import Trainer

    trainer = Trainer.create(config, progress=progress, hooks=audit.hooks(fault))
    audit.plan = trainer.plan  # the observer scores residuals with the run's q and sigma
    # the marker first: resume and eval refuse this directory (its N counts canaries its config lacks)
    atomic_write_text(
        trainer.run_dir / AUDIT_NAME, json.dumps({"status": "running", "canaries": audit.m}) + "\n"
    )
    if progress:
        print(
            f"audit: {audit.m} {audit.kind} canaries, {int(audit.included.sum())} included; N = {trainer.plan.dataset_size} "
            f"counts all of them (q = {trainer.plan.sample_rate:.4g}, claimed epsilon = {trainer.plan.epsilon:.4g})\n"
            f"audit: {audit.scope()}",
            file=sys.stderr,
        )
    if fault is not None and fault.noise_scale != 1:
        trainer.mechanism.noise_generator = _ScaledNoise(
            trainer.mechanism.noise_generator, fault.noise_scale
        )
    check = getattr(trainer.mechanism, "first_chunk_check", None)
    if check is not None:  # the training-mode check of the first chunk: on its real examples only
        trainer.mechanism.first_chunk_check = audit.on_real_examples(check)
    return trainer


class _ScaledNoise(DPRandom):
    """A noise generator that draws its normals at ``scale`` times their std (AuditFault)."""

    # wraps ``source``: no seed of its own
    def __init__(self, source: DPRandom, scale: float) -> None:
        self.source, self.scale = source, scale

    def normal(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.source.normal(*args, **kwargs) * self.scale

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()


def plot_scores(
    scores: np.ndarray, included: np.ndarray, path: Path, outcome: Any, kind: str
) -> Path:
    """A histogram of the included and the excluded canaries' scores, the guessing cut-offs marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    finite = np.isfinite(scores)
    # cast: matplotlib's annotation of bins leaves out the arrays it takes
    bins = (
        cast("Sequence[float]", np.histogram_bin_edges(scores[finite], bins=40))
        if finite.any()
        else 10
    )
    ax.hist(
        scores[included & finite], bins=bins, alpha=0.6, label=f"included ({int(included.sum())})"
    )
    ax.hist(
        scores[~included & finite],
        bins=bins,
        alpha=0.6,
        label=f"excluded ({int((~included).sum())})",
    )
    order = np.sort(scores)[::-1]
    if outcome.guess_in:
        ax.axvline(
            order[outcome.guess_in - 1],
            color="k",
            linestyle="--",
            label=f"top {outcome.guess_in} guessed in",
        )
    if outcome.guess_out:
        ax.axvline(
            order[-outcome.guess_out],
            color="k",
            linestyle=":",
            label=f"bottom {outcome.guess_out} guessed out",
        )
    ax.set_xlabel(
        "log-likelihood ratio over the steps"
        if kind == "gradient"
        else "loss decrease (initial - final)"
    )
    ax.set_ylabel("canaries")
    ax.set_title(
        f"{kind} canaries: {outcome.correct}/{outcome.guesses} guesses right, eps >= {outcome.eps_lower_bound:.3g}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    path.chmod(PRIVATE_FILE_MODE)  # in the run directory, private like every file there
    return path
