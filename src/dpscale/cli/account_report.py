"""The printed answer of ``dpscale account`` for DP-SGD: the plan, epsilon, eps_TAN, the odds and the group reading."""

from __future__ import annotations

import math
from typing import Any


def print_account(result: dict[str, Any], with_releases: bool) -> None:
    """Print ``dpscale account``'s answer for DP-SGD, as people read it (``--json`` prints ``result`` instead).

    Args:
        result: the account's fields (``cli/account.py``'s ``_account``, with a batch cap's fields).
        with_releases: epsilon composes private Data Normalization or centring (their line says so).
    """
    from dpscale.privacy.accounting.tan import PRIVACY_WALL_SIGMA
    from dpscale.privacy.accounting.tradeoff import format_odds

    sigma = result["noise_multiplier"]
    people = result["unit"] == "user"
    _print_plan(result, people)
    _print_epsilon(result, people, with_releases)
    # no eps_TAN reading of other samplers
    poisson_wall = sigma < PRIVACY_WALL_SIGMA and result["sampling"] == "poisson"
    wall = "  (sigma < 2: beyond the privacy wall, eps_TAN is optimistic)" if poisson_wall else ""
    alone = " (DP-SGD steps alone)" if with_releases else ""
    alone += (
        ""
        if result["sampling"] == "poisson"
        else " (of Poisson sampling: no estimate of this sampling)"
    )
    print(f"  eps_TAN = {result['eps_tan']:.4f}{alone}  [Sander et al. 2023, eq. 4]{wall}")
    if result["wall_warning"]:
        print(f"WARNING: {result['wall_warning']}")
    print(result["meaning"])
    if result["tpr_at_fpr"]:
        print(f"  {format_odds(result)} [from {result['odds_from']}]")
        print(f"  {result['odds']}")
    if people:
        cap = (
            f" and dp.max_batch_size={result['max_batch_size']}"
            if result.get("max_batch_size")
            else ""
        )
        print(
            "NOTE: this plan needs each step to sample people with probability q and to clip each person's summed "
            f"gradient: train it with data.privacy_unit=user and dp.max_examples_per_user{cap} (docs/privacy-units.md)"
        )
    if result["group_privacy"]:
        _print_group(result["group_privacy"], result["epsilon"], result["delta"])


def _print_plan(result: dict[str, Any], people: bool) -> None:
    """The plan's lines: the sampling, q, sigma and the length; the sampling's note; the person unit."""
    n, b, q, sigma, steps = (
        result[k]
        for k in ("dataset_size", "batch_size", "sample_rate", "noise_multiplier", "steps")
    )
    # a cap's own line follows
    mode = "truncated" if result.get("max_batch_size") else result["sampling"]
    print(
        f"DP-SGD with {SAMPLING_WORDS[mode]}{' of people' if people else ''} q = {b}/{n} = {q:.6g}, "
        f"noise multiplier sigma = {sigma:.6g}, {steps} steps ({steps * q:.4g} "
        f"{'passes over the people' if people else 'epochs'})"
    )
    if mode in SAMPLING_NOTES:
        print(f"  {SAMPLING_NOTES[mode]}")
    if people:
        k = f"{result['examples_per_user']} images each; " if result["examples_per_user"] else ""
        print(
            f"  privacy unit: one person ({k}each person's summed gradient is clipped to C, so epsilon does not "
            "depend on their number of images)"
        )


def _print_epsilon(result: dict[str, Any], people: bool, with_releases: bool) -> None:
    """Epsilon's line (the releases it composes), and a batch cap's line with its cost."""
    from dpscale.privacy.plan.sampling_plan import cap_cost_text

    parts = (
        [f"private Data Normalization (sigma_norm = {result['data_norm_noise']:g})"]
        if result["data_norm_noise"]
        else []
    )
    if result["feature_mean_noise"]:
        parts.append(f"private centring (sigma_center = {result['feature_mean_noise']:g})")
    norm = f", composed with {' and '.join(parts)}" if with_releases else ""
    print(
        f"  epsilon = {result['epsilon']:.4f} at delta = {result['delta']:g}  [{result['accountant']} accountant]{norm}"
    )
    if result.get("max_batch_size"):
        how = (
            "the smallest cap within 1% of uncapped Poisson"
            if result["max_batch_size_auto"]
            else "the cap given"
        )
        cost = cap_cost_text(result["epsilon"], result["poisson_epsilon"], percent=True)
        print(
            f"  batches capped at {result['max_batch_size']}{' people' if people else ''} ({how}; truncated Poisson, dp_accounting's "
            f"TruncatedSubsampledGaussianDpEvent): uncapped Poisson {result['poisson_epsilon']:.4f}, {cost}"
        )


def _print_group(group: dict[str, Any], epsilon: float, delta: float) -> None:
    """The group-privacy reading of the example-level guarantee for a person with k images."""
    k = group["group_size"]
    print(f"For a person with {k} images ({group['bound']}) [{group['source']}]:")
    direct_delta = math.inf if group["direct_delta"] is None else group["direct_delta"]
    vacuous = ": delta >= 1, no guarantee" if direct_delta >= 1 else ""
    print(
        f"  epsilon = {group['direct_epsilon']:.4f} at delta = {direct_delta:.3g}  "
        f"({k} x {epsilon:.4f}, from the run's epsilon at delta = {delta:g}{vacuous})"
    )
    if group["epsilon"] is None:
        print(
            f"  no guarantee at delta = {delta:g}: no delta' of the run's epsilon curve (down to "
            f"{group['min_delta']:g}, the smallest the accountant resolves) meets it"
        )
        return
    print(
        f"  epsilon = {group['epsilon']:.4f} at delta = {delta:g}  "
        f"({k} x {group['example_epsilon']:.4f}, the run's epsilon at delta' = {group['example_delta']:.3g})"
    )
    print("  " + group["meaning"])


SAMPLING_WORDS = {
    "poisson": "Poisson sampling",
    "fixed": "fixed-size batches (without replacement each step)",
    "shuffle": "shuffled fixed-size batches",
    "truncated": "capped Poisson sampling",
}
SAMPLING_NOTES = {
    "fixed": "replace-one adjacency (one image replaced by another): dp_accounting's SampledWithoutReplacementDpEvent, "
    "RDP, noise multiplier sigma/2 (the clipped sum moves by up to 2C)",
    "shuffle": "no amplification by sampling: each image in at most one step per epoch, the epochs' Gaussians (noise "
    "multiplier sigma/2, replace-one adjacency) composed; Chua et al. 2024 show the Poisson epsilon does "
    "not cover shuffling. --sampling fixed keeps fixed-size batches with amplification",
}
