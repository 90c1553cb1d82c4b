"""make_private's typed options (dpscale.privacy.options): each finding of issue 64's review reproduced
through the public door, then refused in one line naming the class and field (or the flat keyword);
the typed call and the deprecated flat call build the same mechanism."""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
import typing
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import dpscale
from dpscale import (
    Adaptive,
    Automatic,
    BandMF,
    FixedSize,
    Flat,
    NoiseMultiplier,
    PerformanceFlags,
    PerLayer,
    PerUser,
    Poisson,
    Shuffle,
    TargetEpsilon,
)
from dpscale.privacy.plan.numbers import PrivacyNumbers

FLAT = {
    "dataset_size": 1000,
    "batch_size": 10,
    "max_grad_norm": 1.0,
    "delta": 1e-5,
    "noise_multiplier": 1.0,
    "steps": 3,
}
TYPED = {
    "dataset_size": 1000,
    "sampling": Poisson(batch_size=10),
    "clipping": Flat(max_grad_norm=1.0),
    "budget": NoiseMultiplier(sigma=1.0, delta=1e-5),
    "steps": 3,
}


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _flat(**changes):
    model, optimizer = _model_and_optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return dpscale.make_private(model, optimizer, **{**FLAT, **changes})


def _refused(call, match: str) -> str:
    with pytest.raises((ValueError, TypeError), match=match) as err:
        call()
    message = str(err.value)
    # one line, in Python's words (not the YAML config's)
    assert "\n" not in message and "dp." not in message
    return message


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"clip_quantile": 5.0, "clip_learning_rate": -3},
            "clip_quantile=5.0 applies to Adaptive clipping only",
        ),
        ({"clip_gamma": -1.0}, "clip_gamma=-1.0 applies to Automatic clipping only"),
        ({"bands": 0, "max_bands": -2}, "BandMF.bands=0 applies to BandMF noise only"),
        ({"accountant": "prv"}, "accountant must be one of 'pld', 'rdp', got 'prv'"),
        ({"accountant": "rpd", "sampling": "fixed"}, "got 'rpd'"),
        (
            {"noise_mechanism": "bandmf", "bands": "many"},
            "BandMF.bands must be a positive integer or \"auto\", got 'many'",
        ),
        (
            {"sampling": "posson"},
            r"sampling must be 'poisson', 'fixed', 'shuffle' \(or dpscale.Poisson\(...\), .*got 'posson'",
        ),
        ({"engine": "gohst"}, "PerformanceFlags.engine must be one of"),
        (
            {"clipping": "adaptive", "clip_quantile": 5.0},
            r"Adaptive.quantile must be in \(0, 1\), got 5.0",
        ),
        ({"max_batch_size": 8, "sampling": "fixed"}, "max_batch_size caps Poisson batches"),
        (
            {"clipping": "adaptive", "max_grad_norm_per": "tensor"},
            "Adaptive clipping needs one starting norm C.* not with max_grad_norm_per='tensor'",
        ),
    ],
)
def test_each_finding_is_refused_through_the_flat_keywords(changes, match):
    _refused(lambda: _flat(**changes), match)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: Adaptive(max_grad_norm=1.0, quantile=5.0),
            r"Adaptive.quantile must be in \(0, 1\)",
        ),
        (
            lambda: Adaptive(max_grad_norm=1.0, learning_rate=-3),
            "Adaptive.learning_rate must be a finite number > 0",
        ),
        (lambda: Automatic(gamma=-1.0), "Automatic.gamma must be a finite number > 0"),
        (lambda: BandMF(bands=0), "BandMF.bands must be"),
        (lambda: BandMF(max_bands=-2), "BandMF.max_bands must be a positive integer"),
        (lambda: Poisson(batch_size=10, max_batch_size=0), "Poisson.max_batch_size must be"),
        (lambda: FixedSize(batch_size=2.5), "FixedSize.batch_size must be a positive integer"),
        (
            lambda: Flat(max_grad_norm=float("nan")),
            "Flat.max_grad_norm must be one positive number, got nan",
        ),
        (
            lambda: PerLayer(bounds=1.0),
            'PerLayer.bounds must be a mapping of name patterns with per="group"',
        ),
        (lambda: PerLayer(bounds={"fc*": -1.0}), "PerLayer.bounds must be a non-empty mapping"),
        (
            lambda: TargetEpsilon(epsilon=0.0, delta=1e-5),
            "TargetEpsilon.epsilon must be a finite number > 0",
        ),
        (
            lambda: NoiseMultiplier(sigma=1.0, delta=1.5),
            r"NoiseMultiplier.delta must be in \(0, 1\)",
        ),
        (
            lambda: PerUser(user_ids=[0, 1], max_examples_per_user=0),
            "PerUser.max_examples_per_user must be",
        ),
        (lambda: PerformanceFlags(precision="fp8"), "PerformanceFlags.precision must be one of"),
        (
            lambda: PerformanceFlags(max_physical_batch_size="big"),
            "PerformanceFlags.max_physical_batch_size must be",
        ),
    ],
)
def test_each_typed_option_checks_its_own_fields_naming_the_class_and_field(make, match):
    _refused(make, match)


def test_an_unknown_accountant_is_refused_at_every_door():
    model, optimizer = _model_and_optimizer()
    _refused(lambda: dpscale.make_private(model, optimizer, **TYPED, accountant="prv"), "got 'prv'")
    # the plan every door builds (the config's dp section, a saved plan's check): never planned with another
    _refused(
        lambda: PrivacyNumbers(batch_size=10, max_grad_norm=1.0, delta=1e-5, accountant="prv"),
        "got 'prv'",
    )
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpscale",
            "account",
            "--accountant",
            "prv",
            "--dataset-size",
            "1000",
            "--batch-size",
            "10",
            "--noise-multiplier",
            "1",
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 2 and "invalid choice: 'prv'" in cli.stderr


def test_the_flat_call_warns_with_the_typed_call_and_builds_the_same_mechanism():
    model, optimizer = _model_and_optimizer()
    with pytest.warns(DeprecationWarning, match="deprecated") as caught:
        flat = dpscale.make_private(
            model, optimizer, **{**FLAT, "target_epsilon": 2.0, "noise_multiplier": None}, seed=3
        )
    text = str(caught[0].message)
    assert "sampling=Poisson(batch_size=10" in text and "clipping=Flat(max_grad_norm=1.0)" in text
    assert "budget=TargetEpsilon(epsilon=2.0, delta=1e-05)" in text
    model2, optimizer2 = _model_and_optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the typed call warns nothing
        typed = dpscale.make_private(
            model2,
            optimizer2,
            **{**TYPED, "budget": TargetEpsilon(epsilon=2.0, delta=1e-5)},
            seed=3,
        )
    assert flat.plan == typed.plan
    x, y = (
        torch.randn(40, 4, generator=torch.Generator().manual_seed(0)),
        torch.randint(0, 2, (40,)),
    )
    before = [p.detach().clone() for p in model.parameters()]
    for mechanism in (flat, typed):
        indices = mechanism.sample()
        mechanism.step(x[indices % 40], y[indices % 40])
    # a step was taken
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the same seeded step
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_a_concern_given_both_ways_or_not_at_all_is_a_type_error():
    model, optimizer = _model_and_optimizer()
    _refused(
        lambda: dpscale.make_private(model, optimizer, **TYPED, batch_size=10),
        "sampling= and the flat keyword batch_size=",
    )
    no_budget = {k: v for k, v in TYPED.items() if k != "budget"}
    _refused(lambda: dpscale.make_private(model, optimizer, **no_budget), "needs budget=")
    _refused(
        lambda: dpscale.make_private(model, optimizer, **TYPED, clip_qunatile=0.3),
        "unexpected keyword argument 'clip_qunatile'",
    )


def test_the_signature_is_short_and_its_closed_sets_are_literal_types():
    assert len(inspect.signature(dpscale.make_private).parameters) <= 20
    hints = typing.get_type_hints(PerformanceFlags)
    assert typing.get_origin(hints["engine"]) is typing.Literal and "gohst" not in typing.get_args(
        hints["engine"]
    )
    assert typing.Literal in {
        typing.get_origin(a)
        for a in typing.get_args(typing.get_type_hints(Poisson)["max_batch_size"])
    }


def test_dir_lists_the_public_names_and_make_private_loads_fewer_modules():
    assert {"make_private", "Poisson", "Flat", "TargetEpsilon", "PerformanceFlags"} <= set(
        dir(dpscale)
    )
    assert not [name for name in dir(dpscale) if name.startswith("_") and name != "__version__"]
    code = "import sys, dpscale; dpscale.make_private; print(sum(m.startswith('dpscale') for m in sys.modules), 'torch' in sys.modules)"
    loaded, torch_loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    # 104 with torch at 4cf2d68 (the Trainer, the YAML loader and the engines loaded eagerly); 15 now, and no torch
    assert int(loaded) <= 40 and torch_loaded == "False", (loaded, torch_loaded)


def test_a_person_level_call_shows_the_count_of_ids_not_the_ids():
    ids = [f"patient{i // 3}" for i in range(1000)]
    assert (
        repr(PerUser(user_ids=ids, max_examples_per_user=2))
        == "PerUser(user_ids=<1000 ids>, max_examples_per_user=2)"
    )
    with pytest.warns(DeprecationWarning) as caught:
        _flat_warned(user_ids=ids, max_examples_per_user=2)
    assert "unit=PerUser(user_ids=<1000 ids>, max_examples_per_user=2)" in str(caught[0].message)
    assert "patient" not in str(caught[0].message)


def _flat_warned(**changes):
    model, optimizer = _model_and_optimizer()
    return dpscale.make_private(model, optimizer, **{**FLAT, **changes})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["dp.clipping=adaptive", "dp.clip_quantile=5"],
            r"^dp.clip_quantile must be in \(0, 1\), got 5.0$",
        ),
        (
            ["dp.clipping=automatic", "dp.clip_gamma=-1"],
            r"^dp.clip_gamma must be a finite number > 0, got -1.0$",
        ),
        (
            ["dp.mechanism=bandmf", "dp.max_noise_memory_mb=-1"],
            r"^dp.max_noise_memory_mb must be a finite number > 0",
        ),
    ],
)
def test_the_config_door_takes_the_same_translation_in_its_own_words(overrides, message):
    from dpscale.config import load_config
    from dpscale.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value) and "Adaptive." not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dp.clip_quantile=5"], r"dp.clip_quantile=5.0 applies to dp.clipping=adaptive only"),
        (["dp.clip_gamma=0.1"], r"dp.clip_gamma=0.1 applies to dp.clipping=automatic only"),
        (["dp.bands=4"], r"dp.bands=4 applies to dp.mechanism=bandmf only"),
    ],
)
def test_a_config_setting_of_a_strategy_not_chosen_is_warned_of_and_still_loads(overrides, message):
    # before: accepted and ignored in silence. Refusing it would break run directories of earlier releases
    # (eval, export, plot, resume read their config.yaml), so the config warns where make_private refuses
    from dpscale.config import load_config

    with pytest.warns(UserWarning, match=message):
        config = load_config(None, overrides)
    assert config.dp.clipping == "fixed" and config.dp.mechanism == "dpsgd"


def test_numpy_scalars_and_whole_floats_are_taken_as_the_old_keywords_took_them():
    # a review found np.int64 batch sizes, np.float32 budgets, bands=2.0 and compile=0 refused by the first typed version
    assert (
        FixedSize(batch_size=np.int64(16)).batch_size == 16
        and type(FixedSize(batch_size=64.0).batch_size) is int
    )
    assert type(TargetEpsilon(epsilon=np.float32(3.0), delta=np.float64(1e-5)).epsilon) is float
    assert (
        BandMF(bands=np.int64(2), max_bands=np.int64(4), max_noise_memory_mb=np.float32(10)).bands
        == 2
    )
    assert (
        BandMF(bands=2.0).bands == 2
        and Adaptive(max_grad_norm=1.0, quantile=np.float32(0.5)).quantile == 0.5
    )
    flags = PerformanceFlags(compile=0, fixed_shapes=1)
    assert flags.compile is False and flags.fixed_shapes is True
    for bad in (True, np.bool_(True), 2.5, float("nan"), "16"):
        with pytest.raises(ValueError, match="FixedSize.batch_size must be a positive integer"):
            FixedSize(batch_size=bad)
    mechanism = _flat(
        batch_size=np.int64(16), delta=np.float32(1e-5), noise_multiplier=np.float32(1.0)
    )
    assert type(mechanism.plan.batch_size) is int and mechanism.plan.batch_size == 16


def test_no_clipping_is_refused_for_a_private_budget_before_anything_is_released():
    # a review found Flat(max_grad_norm=None) with a private budget planned an epsilon, then failed at the first step
    model, optimizer = _model_and_optimizer()
    for budget in (TargetEpsilon(epsilon=3.0, delta=1e-5), NoiseMultiplier(sigma=1.0, delta=1e-5)):
        call = {**TYPED, "clipping": Flat(max_grad_norm=None), "budget": budget}
        _refused(
            lambda call=call: dpscale.make_private(model, optimizer, **call),
            "a private run needs clipping: Flat",
        )
    mechanism = dpscale.make_private(
        model,
        optimizer,
        **{
            **TYPED,
            "clipping": Flat(max_grad_norm=None),
            "budget": NoiseMultiplier(sigma=0.0, delta=1e-5),
        },
    )
    assert not mechanism.plan.is_private


def test_make_private_leaves_a_scheduler_alone_and_takes_its_rates_from_the_workload():
    # a review found deriving the rates from the user's scheduler unsafe (tensor rates, OneCycleLR's momentum,
    # custom schedulers, earlier checkpoints' plans): the rates are the user's to give, as BandMF.workload
    from dpscale import BandMF
    from dpscale.privacy.workload import Workload

    steps = 12
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=steps)
    before = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    plain = dpscale.make_private(
        model, optimizer, **{**TYPED, "steps": steps}, noise=BandMF(bands=3), scheduler=scheduler
    )
    assert [
        {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
    ] == before
    assert "a learning-rate schedule" not in plain.plan.correlated.workload
    rates = tuple(0.5 * (1 + math.cos(math.pi * t / steps)) for t in range(steps))
    model, optimizer = _model_and_optimizer()
    workload = Workload(steps=steps, lr_multipliers=rates)
    given = dpscale.make_private(
        model, optimizer, **{**TYPED, "steps": steps}, noise=BandMF(bands=3, workload=workload)
    )
    assert "a learning-rate schedule" in given.plan.correlated.workload
    assert given.plan.correlated.coefficients != pytest.approx(
        plain.plan.correlated.coefficients, rel=1e-6
    )


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"sampling": FixedSize(batch_size=10), "clipping": Adaptive(max_grad_norm=1.0)},
            "FixedSize sampling is accounted under replace-one adjacency, which Adaptive clipping is not written for",
        ),
        (
            {"sampling": Poisson(batch_size=10, max_batch_size=20), "noise": BandMF(bands=2)},
            "Poisson.max_batch_size caps Poisson batches .* not with BandMF noise",
        ),
        (
            {"sampling": Shuffle(batch_size=10), "noise": BandMF(bands=2)},
            "BandMF noise is accounted for cyclic Poisson sampling",
        ),
        (
            {"noise": BandMF(bands=2), "budget": NoiseMultiplier(sigma=0.0, delta=1e-5)},
            "NoiseMultiplier.sigma=0 adds none",
        ),
        ({"noise": BandMF()}, r"give a target epsilon instead \(TargetEpsilon.epsilon\)"),
        ({"noise": BandMF(bands=64)}, "BandMF.bands=64 is more than the run's 30 steps"),
        (
            {"clipping": Adaptive(max_grad_norm=1.0), "noise": BandMF(bands=2)},
            "Adaptive clipping needs one starting norm C and DP-SGD; not with BandMF noise",
        ),
        (
            {
                "sampling": FixedSize(batch_size=10),
                "unit": PerUser(user_ids=list(range(1000)), max_examples_per_user=1),
            },
            "PerUser samples users by Poisson sampling: use Poisson sampling",
        ),
    ],
)
def test_options_that_do_not_go_together_are_refused_in_pythons_words(changes, match):
    # the rules live once in the plan (every door); each door hands them its words (privacy/spelling.py)
    model, optimizer = _model_and_optimizer()
    message = _refused(
        lambda: dpscale.make_private(model, optimizer, **{**TYPED, "steps": 30, **changes}), match
    )
    assert message.startswith("make_private: ")


def test_the_rules_between_options_are_one_function_every_door_calls():
    from dpscale.privacy.plan.compatibility import check_compatible
    from dpscale.privacy.plan.options_flat import privacy_numbers
    from dpscale.privacy.spelling import CONFIG, PYTHON

    def numbers(sampling, clipping, accountant):
        return privacy_numbers(
            sampling,
            clipping,
            max_grad_norm=1.0,
            delta=1e-5,
            target_epsilon=None,
            noise_multiplier=1.0,
            accountant=accountant,
        )

    clash = numbers(FixedSize(batch_size=10), Adaptive(max_grad_norm=1.0), "rdp")
    with pytest.raises(ValueError, match="^make_private: FixedSize sampling .* Adaptive clipping"):
        check_compatible(clash, dataset_size=1000, spell=PYTHON)
    with pytest.raises(ValueError, match="^dp.sampling=fixed .* dp.clipping=adaptive"):
        check_compatible(clash, dataset_size=1000, spell=CONFIG)
    fine = numbers(Poisson(batch_size=10), Flat(max_grad_norm=1.0), "pld")
    check_compatible(fine, dataset_size=1000, spell=PYTHON)
