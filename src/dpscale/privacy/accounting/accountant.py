"""Privacy accounting for DP-SGD on top of Google's ``dp-accounting`` library.

DP-SGD with Poisson sampling is the repeated Poisson-subsampled Gaussian mechanism.
We never write RDP/PLD maths ourselves: every epsilon comes from ``dp_accounting`` (one routine
of it, the Gaussian's inverse privacy loss, runs vectorised in ``pld_gaussian``, bit-identical).
What we own is the *history* of (sample_rate q, noise_multiplier sigma, steps) that
actually ran, so epsilon can be recomputed for any delta, checkpointed and resumed
without ever counting a step twice.

The history's vocabulary (segments, releases) is ``segments``; turning it into epsilon is
``pld_history`` (PLD, the default) or ``rdp_history``. This module keeps the accountant itself,
the one-call ``compute_epsilon`` and the cost of capping Poisson batches (truncated Poisson).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from dpscale.choices import ACCOUNTANT_KINDS
from dpscale.privacy.accounting.batch_sampling import POISSON, BatchSampling
from dpscale.privacy.accounting.pld_epsilon import pld_epsilons
from dpscale.privacy.accounting.pld_history import (
    PLD_COARSE_DISCRETIZATION,
    PLD_MIN_DELTA,
    PLD_TAIL_MASS_TRUNCATION,
    PLD_VALUE_DISCRETIZATION,
    composed_pld,
    pld_epsilon_of,
    pld_profile,
)
from dpscale.privacy.accounting.rdp_history import rdp_accountant, rdp_profile
from dpscale.privacy.accounting.segments import (
    DP_SGD,
    AccountingSegment,
    adjacency_of,
    check_mechanism,
    releases_under,
)


def _check_delta(delta: float, kind: str = "rdp") -> None:
    """Refuse a delta outside (0, 1), or one the PLD accountant cannot resolve (see PLD_MIN_DELTA)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if kind == "pld" and delta < PLD_MIN_DELTA:
        raise ValueError(
            f"delta={delta:g} is below {PLD_MIN_DELTA:g}, the smallest delta the PLD accountant resolves (it "
            f"truncates {PLD_TAIL_MASS_TRUNCATION:g} of probability mass into an infinite-loss bucket, so epsilon "
            f"would be inflated or infinite); use a delta below 1/N (N the training-set size) but >= "
            f"{PLD_MIN_DELTA:g}, e.g. 1e-5 to 1e-10, or the rdp accountant for a smaller delta"
        )


def _check_kind(kind: str) -> None:
    if kind not in ACCOUNTANT_KINDS:
        raise ValueError(
            f"unknown accountant {kind!r}; choose one of {', '.join(ACCOUNTANT_KINDS)}"
        )


def compute_epsilon(
    *,
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    kind: str = "pld",
    pld_discretization: float = PLD_VALUE_DISCRETIZATION,
    releases: tuple[AccountingSegment, ...] = (),
    batches: BatchSampling = POISSON,
) -> float:
    """Epsilon of ``steps`` DP-SGD steps (Poisson sampling, add/remove adjacency, unless
    ``batches`` says otherwise), composed with any one-off ``releases`` made before training.

    Every argument is keyword-only: q, sigma, steps and delta are all numbers, so a call that
    swaps two of them by position would return a plausible but wrong epsilon.

    Args:
        sample_rate: q = B / N.
        noise_multiplier: sigma (noise std / clipping norm).
        steps: number of noisy steps.
        delta: target delta, in (0, 1).
        kind: "pld" (tightest, default) or "rdp" (what the papers report).
        pld_discretization: PLD grid (smaller is tighter and slower).
        releases: other mechanisms on the same data (see ``gaussian_release``).
        batches: the batch sampler (``dpscale.privacy.accounting.batch_sampling``); fixed-size and shuffled
            batches are accounted under replace-one adjacency, releases included.

    Returns:
        epsilon (float, >= 0); 0.0 for zero steps and no releases.
    """
    return history_accountant(
        sample_rate=sample_rate,
        noise_multiplier=noise_multiplier,
        steps=steps,
        kind=kind,
        releases=releases,
        pld_discretization=pld_discretization,
        batches=batches,
    ).epsilon(delta)


def history_accountant(
    *,
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    kind: str = "pld",
    releases: Sequence[AccountingSegment] = (),
    pld_discretization: float = PLD_VALUE_DISCRETIZATION,
    batches: BatchSampling = POISSON,
) -> "PrivacyAccountant":
    """An accountant holding ``releases`` then ``steps`` DP-SGD steps (q, sigma, drawn by
    ``batches``): a planned run's history, for its epsilon, its group bound or its attacker's odds."""
    accountant = PrivacyAccountant(kind, pld_discretization)
    for release in releases_under(releases, batches):
        accountant.record(release)
    accountant.step(
        sample_rate=sample_rate, noise_multiplier=noise_multiplier, num_steps=steps, batches=batches
    )
    return accountant


@functools.lru_cache(maxsize=256)
def _cached_epsilon(
    kind: str, discretization: float, segments: tuple[AccountingSegment, ...], delta: float
) -> float:
    """Epsilon of a history (a pure function of its arguments, so safe to memoise)."""
    if kind == "pld":
        return pld_epsilon_of(list(segments), delta, discretization)
    return float(rdp_accountant(list(segments)).get_epsilon(delta))


class PrivacyAccountant:
    """Keeps the history of DP-SGD steps that ran and turns it into epsilon.

    Consecutive steps with the same (q, sigma) are merged into one segment so the
    history stays short over millions of steps.

    Args:
        kind: "pld" (default, tightest) or "rdp".
        pld_discretization: PLD grid; keep the default for reported values.
    """

    def __init__(
        self, kind: str = "pld", pld_discretization: float = PLD_VALUE_DISCRETIZATION
    ) -> None:
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
    def adjacency(self) -> str:
        """ "add/remove" or "replace-one": the neighbouring datasets the history's epsilon is about."""
        return adjacency_of(self._segments)

    @property
    def releases(self) -> tuple[AccountingSegment, ...]:
        """The one-off releases recorded (everything that is not a DP-SGD step)."""
        return tuple(s for s in self._segments if s.label != DP_SGD)

    def step(
        self,
        *,
        sample_rate: float,
        noise_multiplier: float,
        num_steps: int = 1,
        batches: BatchSampling = POISSON,
    ) -> None:
        """Record ``num_steps`` steps run with sampling rate q and noise multiplier sigma.

        Args:
            sample_rate: sampling rate q = B / N, in (0, 1].
            noise_multiplier: sigma (noise std / clipping norm), > 0.
            num_steps: how many such steps ran, >= 0.
            batches: the sampler that drew the batches (Poisson by default).
        """
        self.record(
            AccountingSegment(
                float(sample_rate), float(noise_multiplier), int(num_steps), batches=batches
            )
        )

    def record(self, segment: AccountingSegment) -> None:
        """Record a segment of steps or a release (merged with the previous one when identical).

        Raises:
            ValueError: an invalid mechanism, or one whose adjacency differs from the history's.
        """
        check_mechanism(segment.sample_rate, segment.noise_multiplier, segment.steps)
        if segment.steps == 0:
            return
        adjacency_of([*self._segments, segment])
        last = self._segments[-1] if self._segments else None
        if last and replace(last, steps=segment.steps) == segment:
            self._segments[-1] = replace(last, steps=last.steps + segment.steps)
        else:
            self._segments.append(segment)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at the given delta (0.0 before the first step). Cached per
        (history, delta): a run asks at every evaluation, the summary and the progress bar."""
        _check_delta(delta, self.kind)
        if not self._segments:
            return 0.0
        return _cached_epsilon(
            self.kind, self.pld_discretization, tuple(self._segments), float(delta)
        )

    def epsilons(self, deltas: Sequence[float]) -> list[float]:
        """Epsilon at each of ``deltas`` (an epsilon-delta curve), the history composed once.

        Returns:
            one epsilon per delta (0.0 each before the first step); the same numbers as ``epsilon``.
        """
        for delta in deltas:
            _check_delta(delta, self.kind)
        if not self._segments:
            return [0.0 for _ in deltas]
        if self.kind == "rdp":
            accountant = rdp_accountant(self._segments)
            return [float(accountant.get_epsilon(d)) for d in deltas]
        return pld_epsilons(composed_pld(self._segments, self.pld_discretization), deltas)

    def delta(self, epsilon: float) -> float:
        """Smallest delta achieved at the given epsilon."""
        if not self._segments:
            return 0.0
        if self.kind == "rdp":
            return float(rdp_accountant(self._segments).get_delta(epsilon))
        return float(
            composed_pld(self._segments, self.pld_discretization).get_delta_for_epsilon(epsilon)
        )

    def privacy_profile(self) -> Callable[[np.ndarray], np.ndarray]:
        """delta(epsilon) for an array of epsilons (nats), the history composed once: PLD's tight
        profile, or RDP's conversion of each epsilon (a valid, looser delta). Zeros before any step."""
        if not self._segments:
            return lambda eps: np.zeros_like(np.asarray(eps, dtype=np.float64))
        if self.kind == "rdp":
            return rdp_profile(tuple(self._segments))
        return pld_profile(composed_pld(self._segments, self.pld_discretization))

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
        return {"kind": self.kind, "history": [_history_entry(s) for s in self._segments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace (never add to) the history, so a resume cannot double-count steps."""
        if state.get("kind") != self.kind:
            raise ValueError(
                f"checkpoint accountant is {state.get('kind')!r}, this run uses {self.kind!r}"
            )
        self._segments = []
        # [q, sigma, steps], [..., label] or [..., label, mode, N, cap]
        for entry in state["history"]:
            batches = (
                BatchSampling(entry[4], int(entry[5]), int(entry[6])) if len(entry) > 4 else POISSON
            )
            # [q, sigma, steps]: the oldest form, DP-SGD steps
            label = entry[3] if len(entry) > 3 else DP_SGD
            self.record(
                AccountingSegment(
                    float(entry[0]), float(entry[1]), int(entry[2]), label, batches=batches
                )
            )

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "PrivacyAccountant":
        accountant = cls(state["kind"])
        accountant.load_state_dict(state)
        return accountant


def _history_entry(seg: AccountingSegment) -> list[Any]:
    """A segment as a checkpoint stores it: [q, sigma, steps, label], plus [mode, N, cap] when its
    batches were not Poisson (so older checkpoints read back unchanged)."""
    entry = [seg.sample_rate, seg.noise_multiplier, seg.steps, seg.label]
    if seg.batches != POISSON:
        entry += [seg.batches.mode, seg.batches.dataset_size, seg.batches.max_batch_size]
    return entry


@dataclass(frozen=True)
class TruncatedPoissonResult:
    """What capping Poisson batches at ``max_batch_size`` costs (add/remove adjacency, PLD)."""

    max_batch_size: int
    epsilon: float
    poisson_epsilon: float
    profile: Callable[[np.ndarray], np.ndarray]


def truncated_poisson_epsilon(
    *,
    dataset_size: int,
    batch_size: float,
    max_batch_size: int,
    noise_multiplier: float,
    steps: int,
    delta: float,
    releases: Sequence[AccountingSegment] = (),
    discretization: float = PLD_VALUE_DISCRETIZATION,
) -> TruncatedPoissonResult:
    """Epsilon of ``steps`` DP-SGD steps whose Poisson batches (rate B/N) are cut to at most
    ``max_batch_size`` examples (a uniformly random subset of a larger draw), composed with the
    one-off Gaussian ``releases``: dp_accounting's ``TruncatedSubsampledGaussianDpEvent`` (PLD,
    add/remove adjacency, pessimistic), beside the uncapped Poisson epsilon of the same steps.

    A cap near B costs much (N = 60000, B = 256, sigma = 1.1, 2000 steps: 0.847 uncapped and capped
    at 400, 2.08 capped at 300); ``smallest_free_cap`` finds the smallest that costs < 1%.

    Raises:
        ValueError: a cap below 1 or a delta the PLD accountant cannot resolve.
    """
    check_mechanism(batch_size / dataset_size, noise_multiplier, steps)
    _check_delta(delta, "pld")
    if int(max_batch_size) != max_batch_size or max_batch_size < 1:
        raise ValueError(f"the batch cap must be a positive integer, got {max_batch_size}")
    return _truncated_poisson(
        int(dataset_size),
        float(batch_size),
        int(max_batch_size),
        float(noise_multiplier),
        int(steps),
        float(delta),
        tuple(releases),
        float(discretization),
    )


@functools.lru_cache(maxsize=64)  # a cap search and its report share them
def _truncated_poisson(
    dataset_size: int,
    batch_size: float,
    max_batch_size: int,
    noise_multiplier: float,
    steps: int,
    delta: float,
    releases: tuple[AccountingSegment, ...],
    discretization: float,
) -> TruncatedPoissonResult:
    run = functools.partial(
        history_accountant,
        sample_rate=batch_size / dataset_size,
        noise_multiplier=noise_multiplier,
        steps=steps,
        kind="pld",
        releases=releases,
        pld_discretization=discretization,
    )
    capped = run(batches=BatchSampling("truncated", dataset_size, max_batch_size))
    poisson = run().epsilon(delta)
    return TruncatedPoissonResult(
        max_batch_size, capped.epsilon(delta), poisson, capped.privacy_profile()
    )


FREE_CAP_TOLERANCE = 0.01  # ``smallest_free_cap``: epsilon within 1% of uncapped Poisson's


def smallest_free_cap(**plan: Any) -> TruncatedPoissonResult:
    """The smallest batch cap of at least B whose truncated-Poisson epsilon is within ``FREE_CAP_TOLERANCE``
    of the uncapped one (``truncated_poisson_epsilon``'s arguments but the cap). Caps below the expected
    batch size B are not searched: they cut most batches (a smaller-batch training, whose epsilon can
    be lower, not a free cap). Caps grown by 1.25x from B until one is free, then bisected above B
    (epsilon falls as the cap grows there), ~10 PLD evaluations on the
    coarse grid (~10x cheaper); the cap found is then confirmed on the requested grid (grown by 5%
    steps in the rare case it is not free there).

    Returns:
        that cap's result on the requested grid (the cap N, no truncation at all, if no smaller one is free).
    """
    size, batch = int(plan["dataset_size"]), float(plan["batch_size"])
    fine = plan.pop("discretization", PLD_VALUE_DISCRETIZATION)

    def at(cap: int, grid: float = max(fine, PLD_COARSE_DISCRETIZATION)) -> TruncatedPoissonResult:
        return truncated_poisson_epsilon(**plan, max_batch_size=cap, discretization=grid)

    def free(result: TruncatedPoissonResult) -> bool:
        return result.epsilon <= (1 + FREE_CAP_TOLERANCE) * result.poisson_epsilon

    cap = max(1, math.ceil(batch))
    low = cap - 1  # the largest cap known not to be free, or not searched
    result = at(cap)
    while not free(result) and cap < size:
        low, cap = cap, min(size, math.ceil(cap * 1.25))
        result = at(cap)
    while cap - low > 1:
        middle = (low + cap) // 2
        low, cap = (low, middle) if free(at(middle)) else (middle, cap)
    result = at(cap, fine)
    while not free(result) and cap < size:
        cap = min(size, math.ceil(cap * 1.05))
        result = at(cap, fine)
    return result
