"""TAN math: eps_TAN, simulation at constant eta_step, privacy-parameter search at constant eta,
the privacy wall, data size, and the batch scaling-law regression."""

import math

import numpy as np
import pytest
from scipy import stats

from dpscale.config import DPConfig
from dpscale.errors import ConfigError
from dpscale.privacy import compute_epsilon
from dpscale.train.plan_config import plan_from_config
from dpscale.privacy.accounting.tan import (
    eps_tan,
    eps_tan_from_eta,
    eta_for_eps_tan,
    eta_step,
    privacy_search_pairs,
    privacy_wall_warning,
    simulated_noise_multiplier,
    tan_eta,
)
from dpscale.tune.scaling import fit_log_batch_law
from dpscale.tune.tables import data_size_table, privacy_search_table, wall_table


# ------------------------------------------------------------------ eps_TAN
def test_eps_tan_matches_the_closed_form_by_hand():
    # q = 0.01, sigma = 2, S = 10000, delta = 1e-5:
    # eta = 0.01 * 100 / (sqrt(2) * 2) = 0.35355339..., log(1/delta) = 11.512925...
    eta = 0.01 * 100 / (math.sqrt(2) * 2)
    assert tan_eta(0.01, 2.0, 10_000) == pytest.approx(0.3535533905932738, rel=1e-15)
    expected = eta**2 + 2 * eta * math.sqrt(11.512925464970229)
    assert eps_tan(0.01, 2.0, 10_000, 1e-5) == pytest.approx(expected, rel=1e-14)
    assert expected == pytest.approx(2.524263, rel=1e-6)  # the number itself, independently


def test_eta_for_eps_tan_inverts_the_closed_form():
    for epsilon in (0.1, 1.0, 3.0, 8.0, 50.0):
        for delta in (1e-5, 8e-7):
            assert eps_tan_from_eta(eta_for_eps_tan(epsilon, delta), delta) == pytest.approx(
                epsilon, rel=1e-12
            )


def test_eps_tan_approximates_rdp_above_the_wall_only():
    # TAN Figure 2: at constant eta, epsilon ~ eps_TAN for sigma >= 2 and surges below.
    rows = wall_table(eta_for_eps_tan(3.0, 1e-5), (10_000,), 1e-5, "rdp", (0.5, 1.0, 2.0, 4.0))
    ratio = {r.noise_multiplier: r.ratio for r in rows}
    assert 0.85 < ratio[2.0] < 1.05 and 0.85 < ratio[4.0] < 1.05
    assert ratio[0.5] > 3 and ratio[1.0] > 1.1
    for r in rows:  # every point is on the constant-eta curve
        assert tan_eta(r.sample_rate, r.noise_multiplier, r.steps) == pytest.approx(
            eta_for_eps_tan(3.0, 1e-5), rel=1e-12
        )


# ---------------------------------------------------------------- simulation
def _dp(**kw):
    base = dict(epsilon=3.0, delta=1e-5, batch_size=4096, accountant="rdp")
    base.update(kw)
    return DPConfig(**base)


@pytest.mark.parametrize("simulated", [64, 256, 512, 1000.5])
def test_simulated_plan_keeps_steps_and_q_over_sigma(simulated):
    n, steps = 50_000, 600
    reference = plan_from_config(_dp(), n, steps)
    sim = plan_from_config(_dp(simulated_batch_size=simulated), n, steps)
    assert sim.steps == reference.steps == steps
    assert sim.batch_size == simulated and sim.sample_rate == simulated / n
    assert sim.sample_rate / sim.noise_multiplier == pytest.approx(
        reference.sample_rate / reference.noise_multiplier, rel=1e-13
    )
    # the std of the noise on the averaged update is the reference's: sigma C / B
    assert sim.noise_std / sim.batch_size == pytest.approx(
        reference.noise_std / reference.batch_size, rel=1e-13
    )
    assert eta_step(sim.sample_rate, sim.noise_multiplier) == pytest.approx(
        eta_step(reference.sample_rate, reference.noise_multiplier), rel=1e-13
    )
    assert sim.eps_tan == pytest.approx(reference.eps_tan, rel=1e-12)
    # the simulation stands for the reference run's epsilon, and spends far more itself
    assert sim.simulation.epsilon == reference.epsilon
    assert sim.simulation.noise_multiplier == reference.noise_multiplier
    assert sim.simulation.batch_size == 4096
    assert sim.epsilon == pytest.approx(
        compute_epsilon(
            sample_rate=sim.sample_rate,
            noise_multiplier=sim.noise_multiplier,
            steps=steps,
            delta=1e-5,
            kind="rdp",
        )
    )
    assert sim.epsilon > 2 * reference.epsilon
    assert sim.reference_epsilon(steps) == pytest.approx(reference.epsilon, rel=1e-9)
    notes = " ".join(sim.caveats())
    assert (
        "TAN SIMULATION, NO PRIVACY GUARANTEE" in notes
        and f"epsilon={reference.epsilon:.4g}" in notes
    )


def test_simulation_from_a_given_sigma_and_errors():
    n, steps = 50_000, 100
    sim = plan_from_config(
        _dp(epsilon=None, noise_multiplier=3.0, simulated_batch_size=512), n, steps
    )
    assert sim.noise_multiplier == pytest.approx(3.0 * 512 / 4096, rel=1e-15)
    assert simulated_noise_multiplier(3.0, 4096, 512) == 0.375
    with pytest.raises(ConfigError, match="simulated_batch_size"):
        plan_from_config(_dp(simulated_batch_size=60_000), n, steps)
    # the reference budget is still enforced on the reference run
    with pytest.raises(ConfigError, match="spends epsilon"):
        plan_from_config(_dp(epsilon=0.5, noise_multiplier=1.0, simulated_batch_size=512), n, steps)


# ----------------------------------------------------------- privacy search
@pytest.mark.parametrize("steps", [72_000, 2_500, 999])
def test_privacy_search_pairs_keep_eta_exactly(steps):
    n, b, sigma = 1_281_167, 16_384, 2.5
    eta = tan_eta(b / n, sigma, steps)
    pairs = privacy_search_pairs(n, b, sigma, steps, (0.25, 0.5, 1.0, 2.0, 4.0))
    assert len(pairs) == 5
    for pair in pairs:
        assert pair.noise_multiplier == sigma
        assert tan_eta(pair.batch_size / n, sigma, pair.steps) == pytest.approx(eta, rel=1e-13)
        assert pair.eta == pytest.approx(eta, rel=1e-13)
        assert pair.lr_scale == pytest.approx(steps / pair.steps, rel=1e-15)
        assert pair.steps == max(1, round(pair.steps_factor * steps))
    by_factor = {round(p.steps_factor * steps): p for p in pairs}
    if steps % 4 == 0:  # S/4 and 4S pairs have integer batch sizes 2B and B/2
        assert by_factor[steps // 4].batch_size == pytest.approx(2 * b, rel=1e-15)
        assert by_factor[4 * steps].batch_size == pytest.approx(b / 2, rel=1e-15)


def test_privacy_search_matches_tan_table_4():
    # TAN Table 4 (ImageNet, sigma = 2.5, delta = 8e-7, RDP): (16384, 72K) -> 7.97, (32768, 18K) -> 8.00.
    rows = privacy_search_table(1_281_167, 16_384, 2.5, 72_000, 8e-7, "rdp", (0.25, 1.0))
    eps = {r.steps: r.epsilon for r in rows}
    assert eps[72_000] == pytest.approx(7.97, abs=0.03)
    assert eps[18_000] == pytest.approx(8.00, abs=0.03)
    assert all(r.eps_tan == pytest.approx(rows[0].eps_tan, rel=1e-12) for r in rows)


def test_privacy_search_leaves_out_pairs_larger_than_the_dataset():
    pairs = privacy_search_pairs(10_000, 8_000, 3.0, 400, (0.25, 1.0, 4.0))
    assert [p.steps for p in pairs] == [400, 1600]


# ------------------------------------------------------------------ the wall
def test_wall_warning_fires_at_sigma_1_not_at_sigma_4_for_the_same_eta():
    n, steps, delta = 50_000, 1_000, 1e-5
    eta = eta_for_eps_tan(3.0, delta)
    plans = {}
    for sigma in (1.0, 4.0):
        q = math.sqrt(2) * sigma * eta / math.sqrt(steps)
        batch = q * n
        plans[sigma] = plan_from_config(
            _dp(epsilon=None, noise_multiplier=sigma, batch_size=batch), n, steps
        )
        assert tan_eta(plans[sigma].sample_rate, sigma, steps) == pytest.approx(eta, rel=1e-12)
    assert plans[1.0].wall_warning() is not None and "privacy wall" in plans[1.0].wall_warning()
    assert plans[4.0].wall_warning() is None
    assert plans[1.0].epsilon > 1.1 * plans[1.0].eps_tan  # the condition itself, independently


def test_wall_warning_rule():
    assert privacy_wall_warning(3.4, 1.5, 3.0) is not None  # 13% over, sigma < 2
    assert privacy_wall_warning(3.2, 1.5, 3.0) is None  # within 10%
    assert privacy_wall_warning(30.0, 2.0, 3.0) is None  # sigma >= 2: eps_TAN is trusted
    assert privacy_wall_warning(30.0, 0.0, 3.0) is None  # not private


# ----------------------------------------------------------------- data size
def test_data_size_table_matches_tan_table_5_and_keeps_n_eta():
    # TAN Table 5 (CIFAR-10, B = 4096, sigma = 3, S = 2500): N = 50K -> epsilon 7.1 at delta 1e-5.
    rows = data_size_table(5_000, 4_096, 3.0, 2_500, 1e-4, (1.0, 5.0, 10.0), "rdp")
    assert [r.dataset_size for r in rows] == [5_000, 25_000, 50_000]
    assert rows[-1].delta == pytest.approx(1e-5)
    assert rows[-1].epsilon == pytest.approx(7.1, abs=0.05)
    assert all(r.global_snr == pytest.approx(rows[0].global_snr, rel=1e-12) for r in rows)
    assert [r.epsilon for r in rows] == sorted((r.epsilon for r in rows), reverse=True)
    kept = data_size_table(5_000, 4_096, 3.0, 2_500, 1e-4, (10.0,), "rdp", scale_delta=False)
    assert kept[0].delta == 1e-4 and kept[0].epsilon < rows[-1].epsilon


# ------------------------------------------------------------ scaling law fit
def test_regression_recovers_an_exact_line():
    batch = [64, 128, 256, 512, 64, 128]
    values = [0.5 + 0.03 * math.log2(b) for b in batch]
    fit = fit_log_batch_law(batch, values)
    assert fit.slope == pytest.approx(0.03, abs=1e-12)
    assert fit.intercept == pytest.approx(0.5, abs=1e-12)
    assert fit.residual_std == pytest.approx(0.0, abs=1e-9)
    assert fit.predict(4096).value == pytest.approx(0.5 + 0.03 * 12, abs=1e-12)


def test_regression_matches_scipy_linregress_and_intervals_cover():
    rng = np.random.default_rng(0)
    batch = np.repeat([32, 64, 128, 256, 512], 3)
    covered = 0
    trials = 200
    for _ in range(trials):
        values = 0.7 - 0.02 * np.log2(batch) + rng.normal(0, 0.01, batch.size)
        fit = fit_log_batch_law(batch.tolist(), values.tolist(), confidence=0.9)
        ref = stats.linregress(np.log2(batch), values)  # independent reference
        assert fit.slope == pytest.approx(ref.slope, rel=1e-10)
        assert fit.intercept == pytest.approx(ref.intercept, rel=1e-10)
        assert fit.slope_stderr == pytest.approx(ref.stderr, rel=1e-10)
        assert fit.intercept_stderr == pytest.approx(ref.intercept_stderr, rel=1e-10)
        lo, hi = fit.slope_interval
        covered += lo <= -0.02 <= hi
    # a 90% interval covers the true slope in about 90% of trials (binomial 3-sigma band)
    assert abs(covered / trials - 0.9) < 3 * math.sqrt(0.09 / trials)


def test_regression_needs_two_batch_sizes():
    with pytest.raises(ValueError, match="2 distinct"):
        fit_log_batch_law([64, 64, 64], [0.1, 0.2, 0.3])
    two = fit_log_batch_law([64, 128], [0.1, 0.2])  # a line, no interval
    assert two.slope == pytest.approx(0.1) and math.isnan(two.residual_std)


def test_simulating_at_the_reference_batch_size_is_the_reference_run():
    reference = plan_from_config(_dp(), 50_000, 300)
    same = plan_from_config(_dp(simulated_batch_size=4096), 50_000, 300)
    assert (
        same == reference
        and same.simulation is None
        and "TAN SIMULATION" not in " ".join(same.caveats())
    )
