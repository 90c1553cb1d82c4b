"""Privacy tables from TAN (Sander et al. 2023): privacy-parameter search at fixed TAN, the privacy
wall, and the effect of more data. Each row gives the accountant's epsilon next to eps_TAN."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dpscale.privacy.accounting.accountant import compute_epsilon
from dpscale.privacy.accounting.tan import (
    eps_tan,
    eps_tan_from_eta,
    privacy_search_pairs,
    tan_eta,
    wall_curve_points,
)


@dataclass(frozen=True)
class PrivacySearchRow:
    """A (B, S) pair at fixed sigma and eta, with its accountant epsilon (TAN Tables 3-4)."""

    batch_size: float
    steps: int
    noise_multiplier: float
    epsilon: float
    eps_tan: float
    lr_scale: float
    steps_factor: float
    sample_rate: float
    eta: float

    def as_json(self) -> dict:
        return asdict(self)


def privacy_search_table(
    dataset_size: int,
    batch_size: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
    steps_factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0),
) -> list[PrivacySearchRow]:
    """``privacy_search_pairs`` with each pair's epsilon (accountant) and eps_TAN at ``delta``."""
    rows = []
    for pair in privacy_search_pairs(
        dataset_size, batch_size, noise_multiplier, steps, steps_factors
    ):
        rows.append(
            PrivacySearchRow(
                batch_size=pair.batch_size,
                steps=pair.steps,
                noise_multiplier=pair.noise_multiplier,
                epsilon=compute_epsilon(
                    sample_rate=pair.sample_rate,
                    noise_multiplier=pair.noise_multiplier,
                    steps=pair.steps,
                    delta=delta,
                    kind=accountant,
                ),
                eps_tan=eps_tan_from_eta(pair.eta, delta),
                lr_scale=pair.lr_scale,
                steps_factor=pair.steps_factor,
                sample_rate=pair.sample_rate,
                eta=pair.eta,
            )
        )
    return rows


DEFAULT_WALL_SIGMAS = (0.5, 0.6, 0.7, 0.8, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)


@dataclass(frozen=True)
class WallRow:
    """Epsilon at one sigma on a constant-eta curve (TAN Figure 2)."""

    noise_multiplier: float
    steps: int
    sample_rate: float
    epsilon: float
    eps_tan: float

    @property
    def ratio(self) -> float:
        return self.epsilon / self.eps_tan


def wall_table(
    eta: float,
    steps_list: tuple[int, ...],
    delta: float,
    accountant: str = "rdp",
    noise_multipliers: tuple[float, ...] = DEFAULT_WALL_SIGMAS,
) -> list[WallRow]:
    """Epsilon vs sigma at constant eta for each S in ``steps_list`` (q = sqrt(2) sigma eta / sqrt(S)).

    Returns:
        rows ordered by S then sigma; points where q would exceed 1 are left out.
    """
    rows = []
    target = eps_tan_from_eta(eta, delta)
    for steps in steps_list:
        for sigma, q in wall_curve_points(eta, steps, noise_multipliers):
            epsilon = compute_epsilon(
                sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, kind=accountant
            )
            rows.append(
                WallRow(
                    noise_multiplier=sigma,
                    steps=steps,
                    sample_rate=q,
                    epsilon=epsilon,
                    eps_tan=target,
                )
            )
    return rows


@dataclass(frozen=True)
class DataSizeRow:
    """Privacy after multiplying N by ``factor`` at fixed (B, sigma, S) (TAN Table 5)."""

    factor: float
    dataset_size: int
    sample_rate: float
    delta: float
    epsilon: float
    eps_tan: float
    eta: float
    global_snr: float  # N * eta: constant across rows (TAN Section 4.4)


def data_size_table(
    dataset_size: int,
    batch_size: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    factors: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 10.0),
    accountant: str = "rdp",
    scale_delta: bool = True,
) -> list[DataSizeRow]:
    """How epsilon changes when N grows by a factor beta at fixed (B, sigma, S).

    q and eta are divided by beta; with ``scale_delta`` delta is divided by beta too, as TAN does
    (keeping delta * N fixed). Rows where B would exceed N are left out.
    """
    rows = []
    for factor in factors:
        if not factor > 0:
            raise ValueError(f"factors must be > 0, got {factor}")
        n = round(dataset_size * factor)
        if n < batch_size:
            continue
        q = batch_size / n
        row_delta = delta / factor if scale_delta else delta
        if not 0 < row_delta < 1:
            raise ValueError(f"delta / {factor:g} = {row_delta:g} is not in (0, 1)")
        eta = tan_eta(q, noise_multiplier, steps)
        rows.append(
            DataSizeRow(
                factor=n / dataset_size,
                dataset_size=n,
                sample_rate=q,
                delta=row_delta,
                epsilon=compute_epsilon(
                    sample_rate=q,
                    noise_multiplier=noise_multiplier,
                    steps=steps,
                    delta=row_delta,
                    kind=accountant,
                ),
                eps_tan=eps_tan(q, noise_multiplier, steps, row_delta),
                eta=eta,
                global_snr=n * eta if math.isfinite(eta) else math.inf,
            )
        )
    return rows
