"""The checks of ``dpscale account``'s flags: a value out of range, or flags not accounted together, is refused in one line."""

from __future__ import annotations

import argparse
import math

from dpscale.errors import ConfigError


def check_account_flags(args: argparse.Namespace) -> None:
    """Refuse flags out of range or not accounted together; set ``args.accountant`` to the one that
    composes the sampling asked for (fixed-size batches or a batch cap).

    Args:
        args: ``dpscale account``'s parsed flags.

    Raises:
        ConfigError: the first flag refused, in one line.
    """
    _check_account_args(args)
    _check_unit_args(args)
    _check_cap_args(args)
    _check_sampling_args(args)


def feature_releases_of(data_norm_noise: float | None, feature_mean_noise: float | None) -> tuple:
    """The releases of ``--data-norm-noise`` (private Data Normalization) and
    ``--feature-mean-noise`` (private centring), in the order a run draws them (none without them).

    Args:
        data_norm_noise: sigma_norm, or None.
        feature_mean_noise: sigma_center, or None.

    Returns:
        The releases, as ``dpscale.privacy.accounting.segments.feature_releases`` gives them.

    Raises:
        ConfigError: a noise that is not > 0.
    """
    from dpscale.privacy.accounting.segments import feature_releases

    for flag, sigma in (
        ("--data-norm-noise", data_norm_noise),
        ("--feature-mean-noise", feature_mean_noise),
    ):
        if sigma is not None and not sigma > 0:
            raise ConfigError(f"{flag} must be > 0, got {sigma}")
    return feature_releases(data_norm_noise, feature_mean_noise)


def _check_account_args(args: argparse.Namespace) -> None:
    """Refuse flags out of range, and neither --noise nor --target-epsilon."""
    n, b = args.dataset_size, args.batch_size
    if n < 1 or not 1 <= b <= n:
        raise ConfigError(f"need 1 <= --batch-size <= --dataset-size, got {b} and {n}")
    if not 0 < args.delta < 1:
        raise ConfigError(f"--delta must be in (0, 1), got {args.delta}")
    if args.noise is None and args.target_epsilon is None:
        raise ConfigError(
            "give --noise (to compute epsilon) or --target-epsilon (to calibrate the noise)"
        )
    if args.epochs is not None and not (args.epochs > 0 and math.isfinite(args.epochs)):
        raise ConfigError(f"--epochs must be a positive number, got {args.epochs}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.target_epsilon is not None and not (
        args.target_epsilon > 0 and math.isfinite(args.target_epsilon)
    ):
        raise ConfigError(f"--target-epsilon must be a positive number, got {args.target_epsilon}")
    if args.noise is not None and args.noise <= 0:
        raise ConfigError(f"--noise must be > 0, got {args.noise}")


def _check_sampling_args(args: argparse.Namespace) -> None:
    """Refuse what fixed-size or shuffled batches are not accounted with here, and set the accountant
    that composes them (fixed: RDP, the only one dp_accounting has for sampling without replacement)."""
    if args.sampling == "poisson":
        return
    refused = [
        (args.mechanism == "bandmf", "--mechanism bandmf (cyclic Poisson sampling)"),
        (args.unit == "user", "--unit user (people are Poisson-sampled)"),
        (
            args.group_size is not None,
            "--group-size (the group reading is written for add/remove adjacency)",
        ),
        (args.max_batch_size is not None, "--max-batch-size (it caps Poisson batches)"),
        (args.batch_size != int(args.batch_size), f"a fractional --batch-size {args.batch_size}"),
    ]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"--sampling {args.sampling} is not accounted with {what}")
    from dpscale.privacy.plan.sampling_plan import accountant_for

    args.accountant = accountant_for(args.sampling, None, args.accountant)


def _check_cap_args(args: argparse.Namespace) -> None:
    """Refuse what a batch cap (truncated Poisson) cannot be accounted with here. With --unit user the
    cap counts people, as a user-level run's sampler does (``UserPoissonSampler``)."""
    cap = args.max_batch_size
    if cap is None:
        return
    if cap != "auto" and not (cap.isdigit() and int(cap) >= 1):
        raise ConfigError(f"--max-batch-size must be a positive integer or auto, got {cap!r}")
    refused = [
        (args.mechanism == "bandmf", "--mechanism bandmf"),
        (args.group_size is not None, "--group-size"),
        (
            args.target_epsilon is not None and args.noise is not None,
            "--target-epsilon and --noise (solving the length under a cap is not built: give --epochs or --steps)",
        ),
    ]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"--max-batch-size is not accounted with {what}")
    from dpscale.privacy.plan.sampling_plan import accountant_for

    # the run's rule (PLD: dp_accounting composes truncated Poisson with it alone), as train and make_private do
    args.accountant = accountant_for("poisson", cap, args.accountant)


def _check_unit_args(args: argparse.Namespace) -> None:
    """Refuse --examples-per-user without --unit user, --group-size with it, and what a user-level
    plan or the group reading cannot cover here (BandMF). (At the user unit Data Normalization and
    centring clip one row per person: the same releases, so --data-norm-noise composes as it is.)"""
    per_user, group = args.examples_per_user, args.group_size
    if per_user is not None and args.unit != "user":
        raise ConfigError(
            "--examples-per-user needs --unit user (for an example-level run, --group-size K says what "
            "it promises a person with K images)"
        )
    if group is not None and args.unit == "user":
        raise ConfigError(
            "--group-size is for example-level runs: a --unit user guarantee already covers all of a "
            "person's images"
        )
    for flag, k in (("--examples-per-user", per_user), ("--group-size", group)):
        if k is not None and k < 1:
            raise ConfigError(f"{flag} must be >= 1, got {k}")
    if args.mechanism == "bandmf" and (args.unit == "user" or group is not None):
        raise ConfigError("--unit user and --group-size account DP-SGD (--mechanism dpsgd) only")
