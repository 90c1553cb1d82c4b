"""``dpscale account``: epsilon for DP-SGD parameters, or the noise (or steps) for a target epsilon.

Its flags are checked in ``cli/account_checks.py``; its printed answer is ``cli/account_report.py``'s.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING, Any

from dpscale.choices import ACCOUNTANT_KINDS, DEFAULT_MAX_BANDS, MECHANISMS
from dpscale.privacy.sampling.modes import SAMPLING_MODES
from dpscale.cli.account_checks import check_account_flags, feature_releases_of
from dpscale.cli.account_report import print_account
from dpscale.cli.args import bands_arg, number_arg, positive_int, refusals_as_config_errors
from dpscale.errors import ConfigError
from dpscale.privacy.plan.numbers import PrivacyNumbers

if TYPE_CHECKING:
    from dpscale.privacy.plan.dp_plan import DPPlan


def _cmd_account(args: argparse.Namespace) -> int:
    check_account_flags(args)
    releases = feature_releases_of(args.data_norm_noise, args.feature_mean_noise)
    if args.mechanism == "bandmf":
        result = _account_bandmf(args, releases)
    else:
        solved, sigma, steps = _solve(args, releases)
        result = _account(args, solved, sigma, steps, releases)
        if args.max_batch_size is not None:
            result.update(_cap_fields(args, sigma, steps, releases, result))
    if args.json:
        print(json.dumps(result))
    elif args.mechanism == "bandmf":
        print(result["header"])
    else:
        print_account(result, with_releases=bool(releases))
    return 0


def _account_bandmf(args: argparse.Namespace, releases: tuple) -> dict[str, Any]:
    """BandMF's plan for the flags: b (fixed or auto), sigma (given or calibrated for that b) and
    the amplified accounting (ceil(S/b) compositions at p = b*q)."""
    from dpscale.privacy.plan.make_plan import steps_for

    if args.steps is None and args.epochs is None:
        raise ConfigError(
            "--mechanism bandmf needs --epochs or --steps (solving for the length is DP-SGD only)"
        )
    if args.noise is not None and args.target_epsilon is not None:
        raise ConfigError(
            "--mechanism bandmf: give --noise (epsilon is computed) or --target-epsilon, not both"
        )
    steps = steps_for(args.epochs, args.steps, args.dataset_size, args.batch_size)
    plan = _bandmf_plan(args, steps, releases)
    noise = plan.correlated
    # make_dp_plan plans the banded noise of every BandsRequest (choose_bands)
    assert noise is not None
    return {
        "mechanism": "bandmf",
        "bands": noise.bands,
        "reason": noise.reason,
        "candidates": noise.candidates,
        "coefficients": list(noise.coefficients),
        "relative_error": noise.relative_error,
        "workload": noise.workload,
        "epsilon": plan.epsilon,
        "delta": plan.delta,
        "noise_multiplier": plan.noise_multiplier,
        "steps": steps,
        "sample_rate": plan.sample_rate,
        "participation_rate": plan.participation_rate,
        "compositions": plan.compositions(steps),
        "accountant": plan.accountant,
        "eps_tan": plan.eps_tan,
        "dataset_size": args.dataset_size,
        "batch_size": args.batch_size,
        "target_epsilon": args.target_epsilon,
        "data_norm_noise": args.data_norm_noise,
        "feature_mean_noise": args.feature_mean_noise,
        "header": plan.describe(),
        "unit": "example",
    }


def _bandmf_plan(args: argparse.Namespace, steps: int, releases: tuple) -> DPPlan:
    """The DP plan of BandMF for the flags and ``steps`` (``_account_bandmf``'s)."""
    from dpscale.privacy.workload import Workload
    from dpscale.privacy.noise.correlated import BandsRequest
    from dpscale.privacy.plan.make_plan import make_dp_plan

    with refusals_as_config_errors():  # e.g. a momentum outside [0, 1)
        request = BandsRequest(
            bands=args.bands,
            workload=Workload(steps=steps, momentum=args.momentum),
            max_bands=args.max_bands,
        )
        return make_dp_plan(
            PrivacyNumbers(
                batch_size=args.batch_size,
                max_grad_norm=1.0,
                delta=args.delta,
                target_epsilon=args.target_epsilon,
                noise_multiplier=args.noise,
                accountant=args.accountant,
            ),
            dataset_size=args.dataset_size,
            steps=steps,
            releases=releases,
            correlated=request,
        )


def _batches(args: argparse.Namespace) -> Any:
    """The accountant's view of --sampling (``dpscale.privacy.accounting.batch_sampling``)."""
    from dpscale.privacy.accounting.batch_sampling import batch_sampling_for

    return batch_sampling_for(args.sampling, args.dataset_size)


def _cap_fields(
    args: argparse.Namespace, sigma: float, steps: int, releases: tuple, uncapped: dict[str, Any]
) -> dict[str, Any]:
    """A batch cap's accounting (``truncated_poisson_epsilon``; ``auto``: ``smallest_free_cap``):
    the capped epsilon replaces the Poisson one, which is kept beside it, and the odds follow it."""
    from dpscale.privacy.accounting.accountant import smallest_free_cap, truncated_poisson_epsilon
    from dpscale.privacy.accounting.group_privacy import meaning
    from dpscale.privacy.accounting.tradeoff import profile_odds

    plan = {
        "dataset_size": args.dataset_size,
        "batch_size": args.batch_size,
        "noise_multiplier": sigma,
        "steps": steps,
        "delta": args.delta,
        "releases": releases,
    }
    with refusals_as_config_errors():
        capped = (
            smallest_free_cap(**plan)
            if args.max_batch_size == "auto"
            else truncated_poisson_epsilon(**plan, max_batch_size=int(args.max_batch_size))
        )
    # cuts nothing: uncapped, as a run's plan resolves it
    if capped.max_batch_size >= args.dataset_size:
        return {"max_batch_size": None, "max_batch_size_auto": args.max_batch_size == "auto"}
    odds = profile_odds(capped.profile, "pld", _odds_unit(args))
    return {
        **odds,
        "epsilon": capped.epsilon,
        "poisson_epsilon": capped.poisson_epsilon,
        # the wall is read off the uncapped Poisson steps (eps_TAN estimates those); the cap's cost is its own line
        "wall_warning": f"of the uncapped Poisson steps: {uncapped['wall_warning']}"
        if uncapped["wall_warning"]
        else None,
        "max_batch_size": capped.max_batch_size,
        "max_batch_size_auto": args.max_batch_size == "auto",
        "sampling": f"poisson, truncated at {capped.max_batch_size}",
        "meaning": meaning(
            epsilon=capped.epsilon, delta=args.delta, unit_words=uncapped["unit_text"]
        ),
    }


def _capped_noise(args: argparse.Namespace, steps: int, releases: tuple) -> float:
    """sigma for --target-epsilon under --max-batch-size, from the plan a run would make (one rule for
    every door: ``make_dp_plan`` calibrates on the truncated event, or for "auto" at target / 1.01)."""
    from dpscale.privacy.plan.make_plan import make_dp_plan

    cap = args.max_batch_size if args.max_batch_size == "auto" else int(args.max_batch_size)
    numbers = PrivacyNumbers(
        batch_size=args.batch_size,
        max_grad_norm=1.0,
        delta=args.delta,
        target_epsilon=args.target_epsilon,
        max_batch_size=cap,
        accountant=args.accountant,
    )
    with refusals_as_config_errors():
        return make_dp_plan(
            numbers, dataset_size=args.dataset_size, steps=steps, releases=releases
        ).noise_multiplier


def _solve(args: argparse.Namespace, releases: tuple) -> tuple[str, float, int]:
    """The third of (noise, target epsilon, length) from the two given.

    Returns:
        (what was solved for: "steps", "epsilon" or "noise_multiplier", sigma, steps).
    """
    from dpscale.privacy import calibrate_noise_multiplier, calibrate_steps
    from dpscale.privacy.plan.make_plan import steps_for

    have_length = args.steps is not None or args.epochs is not None
    q = args.batch_size / args.dataset_size
    budget = {"target_epsilon": args.target_epsilon, "delta": args.delta, "sample_rate": q}
    if args.noise is not None and args.target_epsilon is not None:
        if have_length:
            raise ConfigError(
                "give two of --noise, --target-epsilon and --epochs/--steps: the third is computed from them"
            )
        with refusals_as_config_errors():  # e.g. a delta the PLD accountant cannot resolve
            steps = calibrate_steps(
                **budget,
                noise_multiplier=args.noise,
                kind=args.accountant,
                releases=releases,
                batches=_batches(args),
            )
        if steps == 0:
            raise ConfigError(
                f"not even one step fits in epsilon={args.target_epsilon} with noise {args.noise}"
            )
        return "steps", args.noise, steps
    if not have_length:
        raise ConfigError("give --epochs or --steps")
    steps = steps_for(args.epochs, args.steps, args.dataset_size, args.batch_size)
    if args.noise is not None:
        return "epsilon", args.noise, steps
    if args.max_batch_size is not None:
        return "noise_multiplier", _capped_noise(args, steps, releases), steps
    with refusals_as_config_errors():  # e.g. a budget that no noise reaches
        sigma = calibrate_noise_multiplier(
            **budget, steps=steps, kind=args.accountant, releases=releases, batches=_batches(args)
        )
    return "noise_multiplier", sigma, steps


def _account(
    args: argparse.Namespace, solved: str, sigma: float, steps: int, releases: tuple
) -> dict[str, Any]:
    """Epsilon, eps_TAN and the privacy-wall warning of the solved parameters, as printed with --json."""
    from dpscale.privacy import compute_epsilon
    from dpscale.privacy.accounting.tan import PRIVACY_WALL_SIGMA, eps_tan, privacy_wall_warning

    q = args.batch_size / args.dataset_size
    mechanism = {
        "sample_rate": q,
        "noise_multiplier": sigma,
        "steps": steps,
        "delta": args.delta,
        "kind": args.accountant,
    }
    with refusals_as_config_errors():  # e.g. a delta the PLD accountant cannot resolve
        epsilon = compute_epsilon(**mechanism, releases=releases, batches=_batches(args))
        alone = (
            compute_epsilon(**mechanism, batches=_batches(args))
            if releases and sigma < PRIVACY_WALL_SIGMA
            else epsilon
        )
    tan = eps_tan(q, sigma, steps, args.delta)
    # eps_TAN describes the DP-SGD steps alone: compare it with their epsilon below the wall
    # (for fixed-size or shuffled batches their replace-one epsilon is not eps_TAN's Poisson one: no wall reading)
    wall_warning = (
        privacy_wall_warning(alone, sigma, tan)
        if sigma < PRIVACY_WALL_SIGMA and args.sampling == "poisson"
        else None
    )
    return {
        "epsilon": epsilon,
        "delta": args.delta,
        "noise_multiplier": sigma,
        "steps": steps,
        "epochs": steps * q,
        "sample_rate": q,
        "dataset_size": args.dataset_size,
        "batch_size": args.batch_size,
        "accountant": args.accountant,
        "eps_tan": tan,
        "solved_for": solved,
        "target_epsilon": args.target_epsilon,
        "sampling": args.sampling,
        "adjacency": _batches(args).adjacency,
        "data_norm_noise": args.data_norm_noise,
        "feature_mean_noise": args.feature_mean_noise,
        "wall_warning": wall_warning,
        **_unit_fields(args, epsilon),
        "group_privacy": _group_fields(args, sigma, steps, releases, epsilon)
        if args.group_size
        else None,
        **_odds_fields(args, sigma, steps, releases),
    }


def _odds_fields(
    args: argparse.Namespace, sigma: float, steps: int, releases: tuple
) -> dict[str, Any]:
    """The guarantee as an attacker's odds (``dpscale.privacy.accounting.tradeoff.attacker_odds``) for the plan."""
    from dpscale.privacy.accounting.accountant import history_accountant
    from dpscale.privacy.accounting.tradeoff import attacker_odds

    accountant = history_accountant(
        sample_rate=args.batch_size / args.dataset_size,
        noise_multiplier=sigma,
        steps=steps,
        kind=args.accountant,
        releases=releases,
        batches=_batches(args),
    )
    with refusals_as_config_errors():
        return attacker_odds(accountant, _odds_unit(args))


def _odds_unit(args: argparse.Namespace) -> str:
    """Who the attacker's odds are about: "person" (--unit user) or "image"."""
    return "person" if args.unit == "user" else "image"


def _unit_fields(args: argparse.Namespace, epsilon: float) -> dict[str, Any]:
    """Who the guarantee protects: the unit ("example": one image; "user": one person, N and B
    counting people), its words, k images per person (recorded only) and what epsilon means."""
    from dpscale.privacy.accounting.group_privacy import meaning, unit_text

    words = unit_text(args.unit)
    return {
        "unit": args.unit,
        "unit_text": words,
        "examples_per_user": args.examples_per_user,
        "meaning": meaning(
            epsilon=epsilon,
            delta=args.delta,
            unit_words=words,
            replace_one=args.sampling != "poisson",
        ),
    }


def _group_fields(
    args: argparse.Namespace, sigma: float, steps: int, releases: tuple, epsilon: float
) -> dict[str, Any]:
    """What an example-level run promises a person with k = --group-size images (group privacy):
    (k eps, delta_k) straight from (eps, delta), and the smallest k eps(delta') whose delta_k is --delta."""
    from dpscale.privacy.accounting.accountant import history_accountant
    from dpscale.privacy.accounting.group_privacy import (
        GROUP_PRIVACY_LABEL,
        GROUP_PRIVACY_SOURCE,
        best_group_bound,
        direct_group_bound,
        meaning,
        search_floor,
        unit_text,
    )

    k = args.group_size
    accountant = history_accountant(
        sample_rate=args.batch_size / args.dataset_size,
        noise_multiplier=sigma,
        steps=steps,
        kind=args.accountant,
        releases=releases,
    )
    floor = search_floor(args.accountant)
    with refusals_as_config_errors():
        direct = direct_group_bound(epsilon=epsilon, delta=args.delta, group_size=k)
        best = best_group_bound(
            epsilons_at=accountant.epsilons,
            target_delta=args.delta,
            group_size=k,
            min_delta=floor,
            extra_deltas=(args.delta,),
        )
    words = unit_text("example", group_size=k)
    return {
        "group_size": k,
        "bound": GROUP_PRIVACY_LABEL,
        "source": GROUP_PRIVACY_SOURCE,
        "direct_epsilon": direct.epsilon,
        "direct_delta": direct.delta if math.isfinite(direct.delta) else None,
        "epsilon": best.epsilon if best else None,
        "delta": args.delta,
        "example_epsilon": best.example_epsilon if best else None,
        "example_delta": best.example_delta if best else None,
        "min_delta": floor,
        "unit_text": words,
        "meaning": meaning(epsilon=best.epsilon, delta=args.delta, unit_words=words)
        if best
        else None,
    }


def add_account_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``account``."""
    acc = sub.add_parser(
        "account", help="epsilon for DP-SGD parameters, or the noise for a target epsilon"
    )
    _add_plan_arguments(acc)
    _add_release_arguments(acc)
    _add_bandmf_arguments(acc)
    _add_unit_and_batch_arguments(acc)
    acc.add_argument("--json", action="store_true")
    acc.set_defaults(func=_cmd_account)


def _add_plan_arguments(acc: argparse.ArgumentParser) -> None:
    """DP-SGD's numbers: N, B, sigma, the length, delta, the accountant and the target epsilon."""
    acc.add_argument("--dataset-size", type=int, required=True, help="N")
    acc.add_argument(
        "--batch-size", type=number_arg, required=True, help="expected batch size B (q = B/N)"
    )
    acc.add_argument("--noise", type=float, help="noise multiplier sigma")
    length = acc.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float)
    length.add_argument("--steps", type=int)
    acc.add_argument("--delta", type=float, default=1e-5)
    acc.add_argument("--accountant", choices=ACCOUNTANT_KINDS, default="pld")
    acc.add_argument(
        "--target-epsilon", type=float, help="calibrate sigma (or steps, given --noise) to this"
    )


def _add_release_arguments(acc: argparse.ArgumentParser) -> None:
    """The feature releases composed with the steps: private Data Normalization and centring."""
    acc.add_argument(
        "--data-norm-noise",
        type=float,
        metavar="SIGMA_NORM",
        help="compose with private Data Normalization (two Gaussian sums, Tramer Algorithm 2) at this noise",
    )
    acc.add_argument(
        "--feature-mean-noise",
        type=float,
        metavar="SIGMA_CENTER",
        help="compose with private centring (one Gaussian sum: features.center) at this noise",
    )


def _add_bandmf_arguments(acc: argparse.ArgumentParser) -> None:
    """The mechanism, and BandMF's bands and workload."""
    acc.add_argument(
        "--mechanism",
        choices=MECHANISMS,
        default="dpsgd",
        help="dpsgd, or bandmf (banded matrix factorization, amplified: docs/correlated_noise.md)",
    )
    acc.add_argument(
        "--bands",
        type=bands_arg,
        default="auto",
        help="BandMF's b, or auto (least expected error x sigma)",
    )
    acc.add_argument(
        "--max-bands",
        type=positive_int,
        default=DEFAULT_MAX_BANDS,
        help="the largest b that auto tries",
    )
    acc.add_argument(
        "--momentum",
        type=float,
        default=0.0,
        help="SGD momentum of the workload BandMF optimises for",
    )


def _add_unit_and_batch_arguments(acc: argparse.ArgumentParser) -> None:
    """Who is protected (the unit, a group of images) and how batches are drawn (a cap, the sampling)."""
    acc.add_argument(
        "--unit",
        choices=("example", "user"),
        default="example",
        help="privacy unit: example (one image), or user (one person: --dataset-size and --batch-size count people)",
    )
    acc.add_argument(
        "--examples-per-user",
        type=int,
        metavar="K",
        help="--unit user: images per person (recorded)",
    )
    acc.add_argument(
        "--group-size",
        type=int,
        metavar="K",
        help="also print what this example-level guarantee promises a person with K images (group privacy)",
    )
    acc.add_argument(
        "--max-batch-size",
        default=None,
        metavar="M|auto",
        help="cap Poisson batches at M examples (people with --unit user; truncated Poisson, PLD); auto: the smallest cap >= B "
        "within 1%% of the uncapped epsilon",
    )
    acc.add_argument(
        "--sampling",
        choices=SAMPLING_MODES,
        default="poisson",
        help="poisson (default); fixed: B distinct examples each step (RDP, replace-one adjacency); "
        "shuffle: a permutation per epoch, accounted without amplification",
    )
