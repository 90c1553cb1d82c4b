"""The run header's line about the people in training data that names them (issue 62, points 5
and 10): at the user unit how many have more than k images; at the example unit what the run's
epsilon promises a person by group privacy, and how to protect each person instead."""

from __future__ import annotations

import numpy as np

from dpscale.privacy.plan.dp_plan import DPPlan


def people_line(plan: DPPlan, user_ids: np.ndarray | None) -> str | None:
    """The run header's line about the people in data that names them (issue 62, points 5 and 10).

    At the user unit: the images that train, the people, and how many have more than k images (a
    random k of theirs join each step they are drawn in). At the example unit (the default, kept:
    changing it would change N and the guarantee of every existing config): the people, the most
    images of one person, what the run's epsilon promises that person by group privacy, and how to
    protect each person instead.

    Args:
        plan: the run's plan; user_ids: each training example's user id, or None (no line).

    Returns:
        The line, or None without ids, for a TAN simulation, or when each person has one image at
        the example unit (the guarantee then covers each person).
    """
    if user_ids is None or plan.simulation is not None or len(user_ids) == 0:
        return None
    _, counts = np.unique(user_ids, return_counts=True)
    people, most = len(counts), int(counts.max())
    if plan.user_level:
        k = plan.max_examples_per_user or most
        return (
            f"privacy unit user: {len(user_ids):,} training images of {people:,} people; "
            f"{int((counts > k).sum()):,} of {people:,} people have more than k = {k} images (a random {k} of "
            f"theirs train each step they are drawn in; the most: {most})"
        )
    if most == 1:
        return None
    # a starting k: 9 in 10 people contribute every image
    k = int(np.ceil(np.quantile(counts, 0.9)))
    return (
        f"the training set names {people:,} people (up to {most} images each) but the privacy unit is one image "
        f"(data.privacy_unit=example, the default): {_person_reading(plan, most)}; to protect each person, "
        f"--set data.privacy_unit=user --set dp.max_examples_per_user={k} (9 in 10 people have at most {k} images; "
        "docs/privacy-units.md)"
    )


def _person_reading(plan: DPPlan, k: int) -> str:
    """What the run's epsilon promises a person with ``k`` images: the group-privacy bound over
    the run's epsilon curve, as ``dpscale account --group-size`` finds it (and that command for a
    plain Poisson DP-SGD plan, whose flags reproduce it)."""
    from dpscale.privacy.accounting.accountant import history_accountant
    from dpscale.privacy.accounting.batch_sampling import REPLACE_ONE
    from dpscale.privacy.accounting.group_privacy import best_group_bound, search_floor

    if not plan.is_private:
        return "no guarantee for anyone"
    if plan.adjacency == REPLACE_ONE or plan.mechanism != "dpsgd":
        return f"its epsilon covers one image, and a person with {k} only through group privacy"
    accountant = history_accountant(  # the history the plan's epsilon composed (cached)
        sample_rate=plan.participation_rate,
        noise_multiplier=plan.noise_multiplier,
        steps=plan.compositions(plan.steps),
        kind=plan.accountant,
        releases=plan.releases,
        batches=plan.batch_sampling,
    )
    bound = best_group_bound(
        epsilons_at=accountant.epsilons,
        target_delta=plan.delta,
        group_size=k,
        min_delta=search_floor(plan.accountant),
        extra_deltas=(plan.delta,),
    )
    promise = f"epsilon {bound.epsilon:.3g}" if bound else "nothing"
    reading = f"group privacy promises the person with {k} images {promise} at delta={plan.delta:g}"
    if plan.releases or plan.sampling != "poisson":
        return reading
    cap = f" --max-batch-size {plan.max_batch_size}" if plan.max_batch_size else ""
    command = (
        f"dpscale account --dataset-size {plan.dataset_size} --batch-size {plan.batch_size:g} --steps "
        f"{plan.steps} --noise {plan.noise_multiplier!r} --delta {plan.delta!r} --accountant {plan.accountant}"
        f"{cap} --group-size {k}"
    )
    return f"{reading} (`{command}`)"
