"""Adaptive clipping (issue 29, part 2; Andrew et al. 2021).

The quantile update tracks a known quantile of synthetic norms; through ``make_private`` C
follows the median of the model's own per-example norms (the float64 loop's); the epsilon of a
run equals dp_accounting's composition of the two releases of each step (gradient and count)
within 1e-6; the gradient gets noise of std sigma_grad * C_t; a resumed mechanism continues
with the saved C, bit for bit; and the CLI and plan refuse what the accounting does not cover.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from torch import nn

import dpscale
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy.clipping.adaptive import AdaptiveClipping, next_clip, noisy_unclipped_fraction
from dpscale.privacy.clipping.reference import float64_reference
from dpscale.rng import DPRandom
from dpscale.train.plan_config import dp_numbers

RECIPE = {"dataset_size": 2000, "batch_size": 200, "delta": 1e-5, "clipping": "adaptive", "seed": 3}


@pytest.mark.parametrize("quantile", [0.5, 0.9])
def test_the_update_tracks_the_quantile_of_synthetic_norms(quantile):
    rng, generator = np.random.default_rng(0), DPRandom(1)
    adaptive = AdaptiveClipping(quantile=quantile, learning_rate=0.2, count_noise=10.0)
    clip, batch = 20.0, 200
    for _ in range(400):
        norms = rng.lognormal(0.0, 1.0, size=rng.poisson(batch))
        share = noisy_unclipped_fraction(
            float((norms <= clip).sum()),
            len(norms),
            expected_batch_size=batch,
            count_noise=10.0,
            generator=generator,
        )
        clip = next_clip(clip, share, adaptive)
    true = math.exp(float(torch.distributions.Normal(0, 1).icdf(torch.tensor(quantile))))
    assert abs(clip / true - 1) < 0.15, (clip, true)


def test_the_count_release_has_std_sigma_b_around_the_centred_count():
    generator = DPRandom(7)
    shares = [
        noisy_unclipped_fraction(
            30.0, 50.0, expected_batch_size=40.0, count_noise=3.0, generator=generator
        )
        for _ in range(4000)
    ]
    released = (np.array(shares) - 0.5) * 40.0  # sum_i (b_i - 1/2) + noise
    assert abs(released.mean() - (30.0 - 25.0)) < 5 * 3.0 / math.sqrt(4000)
    assert abs(released.std() / 3.0 - 1) < 5 / math.sqrt(2 * 4000)


def _linear_run(**options):
    torch.manual_seed(0)
    model = nn.Linear(10, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mechanism = dpscale.make_private(
        model, optimizer, **{"max_grad_norm": 10.0, **RECIPE, **options}
    )
    return model, optimizer, mechanism


def _data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2000, 10, generator=generator), torch.randint(
        0, 3, (2000,), generator=generator
    )


def test_through_make_private_c_follows_the_median_of_the_models_own_norms():
    x, y = _data()
    model, _, mechanism = _linear_run(noise_multiplier=1.0, steps=80)
    assert mechanism.clip == 10.0
    for indices in mechanism.batches():
        mechanism.step(x[indices], y[indices])
    median = float(float64_reference(model, (x[:400], y[:400]), None).norms.median())
    assert abs(mechanism.clip / median - 1) < 0.2, (mechanism.clip, median)


@pytest.mark.parametrize("sigma, count_noise", [(1.0, 10.0), (2.0, 2.0)])
def test_epsilon_equals_dp_accountings_composition_of_both_releases(sigma, count_noise):
    x, y = _data()
    _, _, mechanism = _linear_run(
        noise_multiplier=sigma, clip_count_noise=count_noise, steps=12, accountant="rdp"
    )
    for indices in mechanism.batches():
        mechanism.step(x[indices], y[indices])
    # what each release gets, written out
    gradient_sigma = (sigma**-2 - (2 * count_noise) ** -2) ** -0.5
    assert mechanism.plan.gradient_noise_multiplier == pytest.approx(gradient_sigma, rel=1e-12)
    step = dp_accounting.PoissonSampledDpEvent(
        0.1,
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(gradient_sigma),
                dp_accounting.GaussianDpEvent(2 * count_noise),
            ]
        ),
    )
    independent = dp_accounting.rdp.RdpAccountant()
    independent.compose(dp_accounting.SelfComposedDpEvent(step, 12))
    assert abs(mechanism.epsilon() - independent.get_epsilon(1e-5)) < 1e-6


def test_a_calibrated_run_spends_its_target_with_the_count_included():
    _, _, mechanism = _linear_run(
        target_epsilon=2.0, steps=50, accountant="rdp", clip_count_noise=1.0
    )
    plan = mechanism.plan
    step = dp_accounting.PoissonSampledDpEvent(
        plan.sample_rate,
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(plan.gradient_noise_multiplier),
                dp_accounting.GaussianDpEvent(2.0),
            ]
        ),
    )
    independent = dp_accounting.rdp.RdpAccountant()
    independent.compose(dp_accounting.SelfComposedDpEvent(step, 50))
    assert 1.99 < independent.get_epsilon(1e-5) <= 2.0 + 1e-9
    # the count's cost is visible
    assert plan.gradient_noise_multiplier > plan.noise_multiplier * 1.01


def test_the_gradient_noise_has_std_sigma_grad_times_the_current_c():
    """Zero inputs give the weights a zero gradient: the release is noise alone, std sigma_grad C_t / B;
    the optimizer takes it in C_0's units (times C_0 / C_t), so the update's std is sigma_grad C_0 / B."""
    torch.manual_seed(0)
    model = nn.Linear(4000, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    mechanism = dpscale.make_private(
        model,
        optimizer,
        max_grad_norm=0.5,
        noise_multiplier=2.0,
        clip_count_noise=2.0,
        steps=2,
        **RECIPE,
    )
    released = []
    mechanism.observer = lambda gradient: released.append(gradient["weight"].detach().clone())
    tolerance = 5 / math.sqrt(2 * 4000)
    for _ in range(2):  # the second step runs at the C the first one's count moved to
        clip, before = mechanism.clip, model.weight.detach().clone()
        indices = mechanism.sample()
        mechanism.step(torch.zeros(len(indices), 4000), torch.zeros(len(indices), dtype=torch.long))
        # sigma_grad 2.309
        assert abs(float(released[-1].std()) * 200 / clip / (1 / 0.1875) ** 0.5 - 1) < tolerance
        update = before - model.weight.detach()
        torch.testing.assert_close(update, released[-1] * 0.5 / clip, rtol=1e-5, atol=1e-9)
        assert abs(float(update.std()) * 200 / 0.5 / (1 / 0.1875) ** 0.5 - 1) < tolerance
    assert mechanism.clip != 0.5


@pytest.mark.parametrize("engine", ["vmap", "bk", "ghost"])
def test_each_step_clips_at_its_own_c_as_the_float64_loop_does(engine):
    """Without gradient noise (sigma 0), the released gradient is the clipped sum / B: at every
    step it must equal the float64 loop's at that step's C_t, whichever engine runs."""
    import copy

    x, y = _data()
    model, _, mechanism = _linear_run(
        noise_multiplier=0.0, steps=6, engine=engine, max_physical_batch_size=64
    )
    seen = []

    def observe(gradient):
        reference = float64_reference(copy.deepcopy(model), batch, mechanism.clip)
        for name, value in reference.clipped_sum.items():
            torch.testing.assert_close(gradient[name].double(), value / 200, rtol=1e-4, atol=1e-7)
        seen.append(mechanism.clip)

    mechanism.observer = observe
    for indices in mechanism.batches():
        batch = (x[indices], y[indices])
        mechanism.step(*batch)
    assert len(seen) == 6 and len(set(seen)) == 6  # C moved at every step


def test_resume_restores_c_and_continues_bit_for_bit():
    x, y = _data()
    model, optimizer, mechanism = _linear_run(noise_multiplier=1.0, steps=10)
    for taken, indices in enumerate(mechanism.batches()):
        mechanism.step(x[indices], y[indices])
        if taken == 4:
            saved = (
                {k: v.clone() for k, v in model.state_dict().items()},
                optimizer.state_dict(),
                mechanism.state_dict(),
            )
    assert saved[2]["clip_norm"] != 10.0
    resumed_model, resumed_optimizer, resumed = _linear_run(noise_multiplier=1.0, steps=10)
    resumed_model.load_state_dict(saved[0])
    resumed_optimizer.load_state_dict(saved[1])
    resumed.load_state_dict(saved[2])
    assert resumed.clip == saved[2]["clip_norm"]
    for indices in resumed.batches():
        resumed.step(x[indices], y[indices])
    assert resumed.clip == mechanism.clip
    assert all(torch.equal(resumed_model.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dp.clip_quantile=1.5"], r"clip_quantile must be in \(0, 1\)"),
        (["dp.clipping=sometimes"], r"dp.clipping must be fixed, adaptive or automatic"),
        (
            ["dp.clip_count_noise=0.5", "dp.noise_multiplier=2", "dp.epsilon=null"],
            r"count noise sigma_b=0.5 is too small",
        ),
        (['dp.max_grad_norm={"*": 1.0}'], "not with per-layer dp.max_grad_norm"),
        (["dp.mechanism=bandmf"], "not with dp.mechanism=bandmf"),
        (["dp.simulated_batch_size=16"], r"not with a TAN simulation"),
    ],
)
def test_what_the_accounting_does_not_cover_is_refused(tmp_path, overrides, message):
    from dpscale.train.loop import Trainer

    with pytest.raises(ConfigError, match=message):
        config = load_config(
            None,
            [
                "dp.clipping=adaptive",
                "model.name=linear",
                "dp.batch_size=32",
                "train.steps=2",
                f"run.out_dir={tmp_path}",
                *overrides,
            ],
        )
        dp_numbers(config.dp)
        Trainer.create(config, progress=False)


def test_dpscale_train_logs_the_adaptive_c_and_its_plan(tmp_path):
    from dpscale.train.loop import Trainer

    config = load_config(
        None,
        [
            "dp.clipping=adaptive",
            "model.name=linear",
            "dp.batch_size=32",
            "train.steps=6",
            "dp.max_grad_norm=5",
            f"run.out_dir={tmp_path}",
        ],
    )
    trainer = Trainer.create(config, progress=False)
    summary = trainer.run()
    assert trainer.plan.adaptive is not None and "adaptive clipping" in trainer.plan.describe()
    assert summary["clip_norm"] != 5.0 and summary["clipping"] == "adaptive"
