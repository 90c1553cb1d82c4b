"""Privacy accounting for DP-SGD on top of Google's ``dp-accounting`` library.

DP-SGD with Poisson sampling is the repeated Poisson-subsampled Gaussian mechanism.
We never write RDP/PLD maths ourselves: every epsilon comes from ``dp_accounting``.
What we own is the *history* of (sample_rate q, noise_multiplier sigma, steps) that
actually ran, so epsilon can be recomputed for any delta, checkpointed and resumed
without ever counting a step twice.

Besides DP-SGD steps the history holds one-off *releases* computed from the private data
before training, e.g. the two Gaussian sums of private Data Normalization (Tramer & Boneh,
Algorithm 2). They are Gaussian mechanisms on the whole dataset (q = 1), composed with the
DP-SGD steps by ``dp_accounting`` exactly like the steps themselves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import dp_accounting
from dp_accounting import pld, rdp
from dp_accounting.pld import privacy_loss_distribution

AccountantKind = Literal["pld", "rdp"]
DP_SGD = "dp-sgd"  # label of DP-SGD steps; any other label is a one-off release
ACCOUNTANT_KINDS: tuple[str, ...] = ("pld", "rdp")

# PLD discretisation: 1e-4 is dp_accounting's default. Results are pessimistic (upper
# bounds) at any grid; a coarser grid is ~10x faster and over-reports by < 0.5%, which
# calibration uses for its search before confirming on the fine grid.
PLD_VALUE_DISCRETIZATION = 1e-4
PLD_COARSE_DISCRETIZATION = 1e-3


@dataclass(frozen=True)
class AccountingSegment:
    """A run of ``steps`` identical Gaussian mechanisms on a Poisson sample of the data.

    Attributes:
        sample_rate: Poisson sampling probability q = B / N, in (0, 1] (1: the whole dataset).
        noise_multiplier: sigma; the noise std is sigma * C on a sum of terms clipped to norm C.
        steps: number of mechanisms (logical DP-SGD steps, or releases) with these parameters.
        label: "dp-sgd" for training steps; anything else names a one-off release
            (e.g. "data-norm"), which does not count as a training step.
    """

    sample_rate: float
    noise_multiplier: float
    steps: int
    label: str = DP_SGD


def _check_mechanism(sample_rate: float, noise_multiplier: float, steps: int) -> None:
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate q must be in (0, 1], got {sample_rate}")
    if not noise_multiplier > 0.0 or not math.isfinite(noise_multiplier):
        raise ValueError(
            f"noise_multiplier must be a positive finite number for a private run, got {noise_multiplier}"
        )
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps}")


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def dp_sgd_event(sample_rate: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """The ``dp_accounting`` event describing ``steps`` Poisson-sampled Gaussian steps."""
    _check_mechanism(sample_rate, noise_multiplier, steps)
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    step_event = gaussian if sample_rate == 1.0 else dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian)
    return dp_accounting.SelfComposedDpEvent(step_event, int(steps))


@functools.lru_cache(maxsize=32)
def _step_pld(
    sample_rate: float, noise_multiplier: float, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of one Poisson-subsampled Gaussian step (add/remove adjacency, pessimistic).

    Building it dominates PLD accounting (~0.3 s); composing it over many steps is an FFT.
    Caching it makes per-epoch epsilon logging cheap. The construction is exactly what
    ``dp_accounting.pld.PLDAccountant`` does for a ``PoissonSampledDpEvent(GaussianDpEvent)``
    (a test checks the two agree).
    """
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        sampling_prob=sample_rate,
        value_discretization_interval=discretization,
    )


@functools.lru_cache(maxsize=32)
def _full_batch_pld(
    noise_multiplier: float, steps: int, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of ``steps`` Gaussian mechanisms without subsampling: exactly one Gaussian with
    sigma / sqrt(steps) (cached: calibration evaluates the same releases many times)."""
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier / math.sqrt(steps),
        value_discretization_interval=discretization,
    )


def _pld_epsilon(segments: list[AccountingSegment], delta: float, discretization: float) -> float:
    total = None
    for seg in segments:
        if seg.sample_rate == 1.0:
            composed = _full_batch_pld(seg.noise_multiplier, seg.steps, discretization)
        else:
            composed = _step_pld(seg.sample_rate, seg.noise_multiplier, discretization).self_compose(seg.steps)
        total = composed if total is None else total.compose(composed)
    return float(total.get_epsilon_for_delta(delta))


class _DropOrderExclusionNotices(logging.Filter):
    """dp_accounting logs one warning per fractional RDP order whose series does not converge
    (small sigma, e.g. TAN simulations) and leaves that order out. epsilon is then the minimum
    over the remaining orders: still a valid bound, so the dozens of lines are noise to a user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def quiet_order_notices() -> Iterator[None]:
    """Composing into an RDP accountant without dp_accounting's per-order convergence notices."""
    quiet = _DropOrderExclusionNotices()
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)


def _rdp_accountant(segments: list[AccountingSegment]) -> rdp.RdpAccountant:
    accountant = rdp.RdpAccountant()
    with quiet_order_notices():
        for seg in segments:
            accountant.compose(dp_sgd_event(seg.sample_rate, seg.noise_multiplier, seg.steps))
    return accountant


def _check_kind(kind: str) -> None:
    if kind not in ACCOUNTANT_KINDS:
        raise ValueError(f"unknown accountant {kind!r}; choose one of {', '.join(ACCOUNTANT_KINDS)}")


def compute_epsilon(
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    kind: str = "pld",
    pld_discretization: float = PLD_VALUE_DISCRETIZATION,
    releases: tuple[AccountingSegment, ...] = (),
) -> float:
    """Epsilon of ``steps`` DP-SGD steps (Poisson sampling, add/remove adjacency), composed
    with any one-off ``releases`` made before training.

    Args:
        sample_rate: q = B / N.
        noise_multiplier: sigma (noise std / clipping norm).
        steps: number of noisy steps.
        delta: target delta, in (0, 1).
        kind: "pld" (tightest, default) or "rdp" (what the papers report).
        pld_discretization: PLD grid (smaller is tighter and slower).
        releases: other mechanisms on the same data (see ``gaussian_release``).

    Returns:
        epsilon (float, >= 0); 0.0 for zero steps and no releases.
    """
    accountant = PrivacyAccountant(kind, pld_discretization)
    for release in releases:
        accountant.record(release)
    accountant.step(sample_rate, noise_multiplier, steps)
    return accountant.epsilon(delta)


def gaussian_release(label: str, noise_multiplier: float, count: int = 1) -> AccountingSegment:
    """``count`` Gaussian mechanisms on the whole dataset, each a sum of per-example terms
    clipped to norm C plus N(0, (noise_multiplier * C)^2) noise (sensitivity C under add/remove).

    Args:
        label: what was released (e.g. "data-norm"); must not be "dp-sgd".
        noise_multiplier: sigma of each mechanism (noise std / clipping norm), > 0.
        count: number of such sums released.
    """
    if label == DP_SGD:
        raise ValueError(f"{DP_SGD!r} is reserved for training steps; name the release")
    _check_mechanism(1.0, noise_multiplier, count)
    return AccountingSegment(1.0, float(noise_multiplier), int(count), label)


@functools.lru_cache(maxsize=256)
def _cached_epsilon(kind: str, discretization: float, segments: tuple[AccountingSegment, ...], delta: float) -> float:
    """Epsilon of a history (a pure function of its arguments, so safe to memoise)."""
    if kind == "pld":
        return _pld_epsilon(list(segments), delta, discretization)
    return float(_rdp_accountant(list(segments)).get_epsilon(delta))


class PrivacyAccountant:
    """Keeps the history of DP-SGD steps that ran and turns it into epsilon.

    Consecutive steps with the same (q, sigma) are merged into one segment so the
    history stays short over millions of steps.

    Args:
        kind: "pld" (default, tightest) or "rdp".
        pld_discretization: PLD grid; keep the default for reported values.
    """

    def __init__(self, kind: str = "pld", pld_discretization: float = PLD_VALUE_DISCRETIZATION) -> None:
        _check_kind(kind)
        self.kind = kind
        self.pld_discretization = pld_discretization
        self._segments: list[AccountingSegment] = []

    @property
    def history(self) -> tuple[AccountingSegment, ...]:
        return tuple(self._segments)

    @property
    def steps(self) -> int:
        """Total number of accounted DP-SGD steps (releases are not steps)."""
        return sum(s.steps for s in self._segments if s.label == DP_SGD)

    @property
    def releases(self) -> tuple[AccountingSegment, ...]:
        """The one-off releases recorded (everything that is not a DP-SGD step)."""
        return tuple(s for s in self._segments if s.label != DP_SGD)

    def step(self, sample_rate: float, noise_multiplier: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` steps run with sampling rate q and noise multiplier sigma."""
        self.record(AccountingSegment(float(sample_rate), float(noise_multiplier), int(num_steps)))

    def record(self, segment: AccountingSegment) -> None:
        """Record a segment of steps or a release (merged with the previous one when identical)."""
        _check_mechanism(segment.sample_rate, segment.noise_multiplier, segment.steps)
        if segment.steps == 0:
            return
        last = self._segments[-1] if self._segments else None
        if last and (last.sample_rate, last.noise_multiplier, last.label) == (
            segment.sample_rate,
            segment.noise_multiplier,
            segment.label,
        ):
            self._segments[-1] = AccountingSegment(
                last.sample_rate, last.noise_multiplier, last.steps + segment.steps, last.label
            )
        else:
            self._segments.append(segment)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at the given delta (0.0 before the first step). Cached per
        (history, delta): a run asks at every evaluation, the summary and the progress bar."""
        _check_delta(delta)
        if not self._segments:
            return 0.0
        return _cached_epsilon(self.kind, self.pld_discretization, tuple(self._segments), float(delta))

    def delta(self, epsilon: float) -> float:
        """Smallest delta achieved at the given epsilon."""
        if not self._segments:
            return 0.0
        if self.kind == "rdp":
            return float(_rdp_accountant(self._segments).get_delta(epsilon))
        accountant = pld.PLDAccountant(value_discretization_interval=self.pld_discretization)
        for seg in self._segments:
            accountant.compose(dp_sgd_event(seg.sample_rate, seg.noise_multiplier, seg.steps))
        return float(accountant.get_delta(epsilon))

    def epsilon_by_label(self, delta: float) -> dict[str, float]:
        """Epsilon of each labelled part on its own (for reports; the parts compose to ``epsilon``)."""
        out = {}
        for label in dict.fromkeys(s.label for s in self._segments):
            part = PrivacyAccountant(self.kind, self.pld_discretization)
            for seg in self._segments:
                if seg.label == label:
                    part.record(seg)
            out[label] = part.epsilon(delta)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "history": [[s.sample_rate, s.noise_multiplier, s.steps, s.label] for s in self._segments],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace (never add to) the history, so a resume cannot double-count steps."""
        if state.get("kind") != self.kind:
            raise ValueError(f"checkpoint accountant is {state.get('kind')!r}, this run uses {self.kind!r}")
        self._segments = []
        for entry in state["history"]:  # [q, sigma, steps] (older checkpoints) or [q, sigma, steps, label]
            self.record(AccountingSegment(float(entry[0]), float(entry[1]), int(entry[2]), *entry[3:]))

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "PrivacyAccountant":
        accountant = cls(state["kind"])
        accountant.load_state_dict(state)
        return accountant
