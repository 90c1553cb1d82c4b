"""A DP plan compares by its privacy numbers only; its labels (how the run was made) are one
list, and every plan a config makes gets all of them from one place."""

from dataclasses import asdict, replace

import pytest

from dpscale.config import load_config, plan_labels
from dpscale.features.source_run import _source_caveats
from dpscale.privacy.plan.dp_plan import PLAN_LABELS
from dpscale.privacy.plan.caveat_texts import (
    ENGINE_UNCHECKED_CAVEAT,
    SEEDED_CAVEAT,
    SEEDED_SECURE_NOISE_CAVEAT,
)
from helpers import plan_of


def _plan(**overrides):
    numbers = dict(
        dataset_size=1000,
        batch_size=50,
        steps=40,
        max_grad_norm=1.0,
        delta=1e-5,
        noise_multiplier=1.1,
    )
    return plan_of(**{**numbers, **overrides})


def test_equal_plans_are_the_same_mechanism_whatever_their_labels():
    plan = _plan()
    labelled = replace(plan, seeded=True, engine_unchecked=True, secure_noise=True)
    assert labelled == plan and hash(labelled) == hash(plan)
    assert labelled.caveats() != plan.caveats()  # the labels still say what the guarantee lacks
    assert (
        _plan(noise_multiplier=1.2) != plan
        and _plan(steps=41) != plan
        and _plan(delta=2e-5) != plan
    )


def test_the_labels_are_one_list_and_a_config_sets_all_but_the_source_runs():
    assert set(PLAN_LABELS) == {
        "seeded",
        "extractor",
        "init_run",
        "engine_unchecked",
        "secure_noise",
    }
    config = load_config(None, ["run.seed=0", "train.self_check=false", "dp.secure_noise=true"])
    labels = plan_labels(config)
    assert set(labels) | {"extractor", "init_run"} == set(PLAN_LABELS)
    assert labels == {"seeded": True, "engine_unchecked": True, "secure_noise": True}


@pytest.mark.parametrize("secure", [False, True])
def test_a_source_runs_caveats_take_every_label_from_its_config(secure):
    """A source run with a fixed seed and secure noise replays its sampling only: its caveat
    says so (the source's caveats once left secure_noise out and claimed its noise replayable)."""
    config = load_config(
        None, ["run.seed=0", "train.self_check=false", f"dp.secure_noise={str(secure).lower()}"]
    )
    caveats = _source_caveats(asdict(_plan()), config)  # as a checkpoint holds it
    assert (SEEDED_SECURE_NOISE_CAVEAT if secure else SEEDED_CAVEAT) in caveats
    assert (SEEDED_CAVEAT if secure else SEEDED_SECURE_NOISE_CAVEAT) not in caveats
    assert ENGINE_UNCHECKED_CAVEAT in caveats


def test_the_privacy_numbers_are_one_frozen_keyword_only_vocabulary_the_plan_shares():
    """Issue 46: make_private, the config's dp section and a saved plan's check hand make_dp_plan one
    PrivacyNumbers, under the plan's own names (the config's dp.epsilon is its target_epsilon)."""
    import dataclasses

    from dpscale.privacy.plan.numbers import PrivacyNumbers
    from dpscale.privacy.plan.dp_plan import DPPlan
    from dpscale.train.plan_config import dp_numbers

    with pytest.raises(TypeError):
        PrivacyNumbers(50, 1.0, 1e-5)  # keyword-only: no number is passed by position
    numbers = PrivacyNumbers(batch_size=50, max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        numbers.delta = 1e-6  # type: ignore[misc]
    plan_fields = {f.name for f in dataclasses.fields(DPPlan)}
    # a simulation's plan holds it as .simulation
    shared = {f.name for f in dataclasses.fields(PrivacyNumbers)} - {"simulated_batch_size"}
    assert shared <= plan_fields
    config = load_config(None, ["dp.epsilon=2.5", "dp.batch_size=64", "dp.sampling=fixed"])
    from_config = dp_numbers(config.dp)
    assert (from_config.target_epsilon, from_config.batch_size, from_config.sampling) == (
        2.5,
        64,
        "fixed",
    )
    plan = plan_of(
        dataset_size=1000,
        batch_size=50,
        steps=40,
        max_grad_norm=1.0,
        delta=1e-5,
        noise_multiplier=1.1,
    )
    assert all(
        getattr(plan, name) == getattr(numbers, name)
        for name in shared - {"accountant", "max_batch_size"}
    )
