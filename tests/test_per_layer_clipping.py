"""Per-layer clipping (issue 29, part 1): ``max_grad_norm`` as a mapping pattern -> C_g.

Each engine's clipped sum and norms equal the float64 per-example loop's (which groups and clips
in its own code); one example's removal changes the released sum by at most the stated
sensitivity sqrt(sum_g C_g^2); the noise through ``make_private`` has std sigma * sqrt(sum_g C_g^2);
and the CLI takes the mapping from YAML / --set. bk and ghost clip a layer split between groups
(issue 42) tensor by tensor, exactly as vmap and the loop.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import dpscale
from dpscale.cli import main
from dpscale.errors import ConfigError
from dpscale.privacy.clipping.bounds import resolve_clip_groups
from dpscale.clip_norms import clip_sensitivity
from dpscale.privacy.clipping.engines import make_engine
from dpscale.privacy.plan.make_plan import check_plan_matches, make_dp_plan
from dpscale.privacy.clipping.reference import float64_reference
from dpscale.privacy.plan.numbers import PrivacyNumbers

PER_LAYER = {"0.*": 0.05, "3.weight": 0.02, "*": 0.1}  # conv, last weight, the rest (the last bias)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    ).double()


def _batch(scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(9, 1, 8, 8, dtype=torch.float64)
    x[3] *= 1e4 * scale  # an outlier: clipped in every group
    return x, torch.randint(0, 3, (9,))


def _engine_sum(name: str, model: nn.Module, clip, batch) -> tuple[dict, torch.Tensor]:
    engine, _ = make_engine(name, clip, model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    grad_sum, norms, _ = engine.clipped_sum_and_losses(model, params, batch)
    return grad_sum, norms


@pytest.mark.parametrize(
    "clip", [PER_LAYER, {"0.*": 0.05, "*": 0.1}], ids=["layer-3-split", "layers-whole"]
)
@pytest.mark.parametrize("engine", ["vmap", "bk", "ghost"])
def test_each_engine_equals_the_float64_per_example_loop(engine, clip):
    model, batch = _net(), _batch()
    reference = float64_reference(model, batch, clip)
    grad_sum, norms = _engine_sum(engine, model, clip, batch)
    torch.testing.assert_close(norms, reference.norms, rtol=1e-9, atol=1e-12)
    for name, value in reference.clipped_sum.items():
        torch.testing.assert_close(grad_sum[name], value, rtol=1e-9, atol=1e-12)
    # not the same as one C on the whole
    whole = float64_reference(model, batch, clip_sensitivity(clip))
    assert max(float((grad_sum[n] - whole.clipped_sum[n]).abs().max()) for n in grad_sum) > 1e-4


@pytest.mark.kernels  # also under capped CPU kernel families (test_kernel_families.py)
@pytest.mark.parametrize("engine", ["vmap", "bk"])
def test_removing_one_example_moves_the_sum_by_at_most_the_sensitivity(engine):
    model, (x, y) = _net(), _batch(scale=10.0)
    clip = {"0.*": 0.05, "*": 0.1}
    full, _ = _engine_sum(engine, model, clip, (x, y))
    bound = clip_sensitivity(clip)
    for i in range(len(y)):
        keep = torch.arange(len(y)) != i
        rest, _ = _engine_sum(engine, model, clip, (x[keep], y[keep]))
        by_group = [
            sum(float((full[n] - rest[n]).square().sum()) for n in full if n.startswith(p))
            for p in ("0.", "3.")
        ]
        assert math.sqrt(by_group[0]) <= 0.05 * (1 + 1e-9) and math.sqrt(by_group[1]) <= 0.1 * (
            1 + 1e-9
        )
        assert math.sqrt(sum(by_group)) <= bound * (1 + 1e-9)
    # the outlier's removal reaches it (it is clipped in both)
    assert math.sqrt(sum(by_group)) > 0.99 * bound


def test_a_layer_split_between_groups_is_no_reason_for_auto_to_leave_bk():
    """Once refused by bk/ghost (auto fell back to vmap); their per-tensor norms now clip it
    (test_each_engine_equals_the_float64_per_example_loop[layer-3-split])."""
    engine, notice = make_engine("auto", PER_LAYER, _net())
    assert engine.name == "bk" and notice is None


@pytest.mark.parametrize(
    "clip, message",
    [
        ({"0.*": 0.1}, r"no pattern of \['0.\*'\] matches trainable parameter '3.weight'"),
        (
            {"fc*": 0.1, "*": 1.0},
            r"pattern 'fc\*' matches no trainable parameter .*trainable parameters: \['0.weight'",
        ),
    ],
)
def test_patterns_must_cover_every_parameter_and_each_must_match_one(clip, message):
    with pytest.raises(ValueError, match=message):
        make_engine("vmap", clip, _net())


@pytest.mark.parametrize(
    "value, message",
    [
        (
            [0.5, 1.0],
            "a list is Opacus' clipping='per_layer' form: .* with max_grad_norm_per='tensor'",
        ),
        ({}, "maps parameter-name patterns"),
        ({"*": -1.0}, "bad entries"),
        ({"*": float("nan")}, "bad entries"),
    ],
)
def test_bad_per_layer_values_are_refused_by_the_plan(value, message):
    with pytest.raises(ConfigError, match=message):
        make_dp_plan(
            PrivacyNumbers(batch_size=10, max_grad_norm=value, delta=1e-5, noise_multiplier=1.0),
            dataset_size=100,
            steps=3,
        )


def test_first_matching_pattern_wins():
    groups = resolve_clip_groups(
        {"*.bias": 1.0, "0.*": 2.0, "*": 3.0}, ["0.weight", "0.bias", "3.weight"]
    )
    assert groups.group_of == {"0.weight": 1, "0.bias": 0, "3.weight": 2}


def test_the_plan_scales_the_noise_to_the_root_sum_of_squares_and_a_resume_must_match():
    clip = {"a*": 0.3, "*": 0.4}
    plan = make_dp_plan(
        PrivacyNumbers(batch_size=100, max_grad_norm=clip, delta=1e-5, noise_multiplier=2.0),
        dataset_size=1000,
        steps=5,
    )
    assert (
        plan.noise_std == pytest.approx(2.0 * 0.5)
        and "C per layer {a*: 0.3, *: 0.4} (sensitivity 0.5)" in plan.describe()
    )
    numbers = {"batch_size": 100, "delta": 1e-5, "noise_multiplier": 2.0}
    # read back from a file
    read_back = PrivacyNumbers(max_grad_norm=json.loads(json.dumps(clip)), **numbers)
    check_plan_matches(plan, read_back, dataset_size=1000, steps=5)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        check_plan_matches(
            plan,
            PrivacyNumbers(max_grad_norm={"a*": 0.3, "*": 0.5}, **numbers),
            dataset_size=1000,
            steps=5,
        )


def test_make_private_adds_noise_of_std_sigma_times_the_sensitivity():
    """Inputs of zero give the weights a zero gradient: their update is the noise alone, /B."""
    torch.manual_seed(0)
    model = nn.Linear(4000, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sigma, batch = 3.0, 20
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=200,
        batch_size=batch,
        max_grad_norm={"weight": 0.3, "bias": 0.4},
        noise_multiplier=sigma,
        delta=1e-5,
        steps=1,
        seed=5,
    )
    before = model.weight.detach().clone()
    indices = mechanism.sample()
    mechanism.step(torch.zeros(len(indices), 4000), torch.zeros(len(indices), dtype=torch.long))
    measured = float((model.weight.detach() - before).std()) * batch / sigma
    # 0.3 or 0.4 alone would be 20+ std errors off
    assert abs(measured - 0.5) < 5 * 0.5 / math.sqrt(2 * 4000)


def test_the_cli_takes_a_per_layer_mapping_and_records_it(tmp_path):
    out = tmp_path / "run"
    sets = [
        "model.name=linear",
        "dp.batch_size=16",
        "train.steps=2",
        f"run.out_dir={out}",
        'dp.max_grad_norm={"head.*.weight": 0.5, "*": 1.0}',
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["max_grad_norm"] == {"head.*.weight": 0.5, "*": 1.0}
    # head.0's weight and bias in different groups: bk clips them tensor by tensor (it once refused)
    assert (
        main(
            [
                "train",
                "--quiet",
                *(
                    a
                    for s in [
                        *sets[:-2],
                        f"run.out_dir={tmp_path / 'bk'}",
                        "train.engine=bk",
                        sets[-1],
                    ]
                    for a in ("--set", s)
                ),
            ]
        )
        == 0
    )
    bk = json.loads((tmp_path / "bk" / "summary.json").read_text())
    assert bk["engine"] == "bk" and bk["engine_self_check"]["passed"]


@pytest.mark.parametrize("engine", ["vmap", "bk"])
def test_an_overflowing_example_contributes_zero_in_every_group(engine):
    """The adversarial input: an example whose gradient is not finite adds nothing to any group's
    sum (not a NaN spread over the update), exactly as removing it would."""
    model, (x, y) = _net(), _batch()
    clip = {"0.*": 0.05, "*": 0.1}
    x_bad = x.clone()
    x_bad[4] = float("inf")
    with_bad, norms = _engine_sum(engine, model, clip, (x_bad, y))
    keep = torch.arange(len(y)) != 4
    without, _ = _engine_sum(engine, model, clip, (x[keep], y[keep]))
    assert not bool(torch.isfinite(norms[4]))
    for name in without:
        torch.testing.assert_close(with_bad[name], without[name], rtol=1e-12, atol=1e-15)
