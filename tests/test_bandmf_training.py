"""BandMF through the public doors (issue 27): ``make_private(noise_mechanism="bandmf")``,
``dpscale train`` with ``dp.mechanism=bandmf`` and ``dpscale account --mechanism bandmf``.

Checked against independent references: the released noise against a dense float64 solve of
C_s^{-1} Z from the same generator, its covariance across steps against sigma^2 C^2 (C_s^T C_s)^{-1}
(a statistical test), the epsilon against dp_accounting's own events (golden values), b = 1
against DP-SGD bit for bit, and a resumed mechanism against an uninterrupted one.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting import pld, rdp
from torch import nn

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy import compute_epsilon
from dpscale.privacy.noise.bandmf_math import strategy_matrix
from dpscale.privacy.workload import Workload
from dpscale.privacy.noise.correlated import BandsRequest, choose_bands
from dpscale.privacy.noise.gaussian import draw_noise
from dpscale.privacy.plan.make_plan import make_dp_plan
from dpscale.rng import DPRandom
from dpscale.train.seeds import run_seeds
from dpscale.train.private import make_private
from dpscale.privacy.plan.numbers import PrivacyNumbers

SIGMA, CLIP, N, B, DELTA = 1.3, 0.5, 60, 10.0, 1e-5


def _model(inputs: int = 12, outputs: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, outputs))


def _mechanism(model: nn.Module, *, steps: int = 12, seed: int | None = 0, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return make_private(
        model,
        optimizer,
        dataset_size=N,
        batch_size=B,
        max_grad_norm=CLIP,
        noise_multiplier=SIGMA,
        delta=DELTA,
        steps=steps,
        seed=seed,
        **options,
    )


def _data(inputs: int = 12):
    g = torch.Generator().manual_seed(3)
    return torch.randn(N, inputs, generator=g), torch.randint(0, 3, (N,), generator=g)


def _train(mechanism, steps: int | None = None) -> list[torch.Tensor]:
    """Take ``steps`` (default: all remaining) steps on the mechanism's own batches; the drawn indices."""
    x, y = _data()
    drawn = []
    for indices in mechanism.batches():
        mechanism.step(x[indices], y[indices])
        drawn.append(indices)
        if steps is not None and len(drawn) == steps:
            break
    return drawn


def _noise_releases(mechanism, steps: int) -> torch.Tensor:
    """The released noise of ``steps`` steps on empty batches (the clipped sum is 0), as (steps, P) float64."""
    seen = []
    mechanism.observer = lambda gradient: seen.append(
        torch.cat([gradient[k].flatten() for k in sorted(gradient)])
    )
    for _ in range(steps):
        mechanism.step_drawn_chunks([])
    return torch.stack(seen).double() * mechanism.plan.batch_size


# ------------------------------------------------------------ b = 1 is DP-SGD
def test_bandmf_with_one_band_trains_dp_sgds_weights_bit_for_bit():
    dpsgd, bandmf = _model(), _model()
    a = _mechanism(dpsgd)
    b = _mechanism(bandmf, noise_mechanism="bandmf", bands=1)
    assert b.plan.mechanism == "bandmf" and b.plan.bands == 1
    drawn_a, drawn_b = _train(a), _train(b)
    assert all(torch.equal(i, j) for i, j in zip(drawn_a, drawn_b))
    for p, q in zip(dpsgd.parameters(), bandmf.parameters()):
        assert torch.equal(p, q)
    assert a.epsilon() == b.epsilon() == a.plan.epsilon


# ------------------------------------------------- the noise the mechanism adds
@pytest.mark.parametrize("bands", [3, 6])
def test_released_noise_is_sigma_c_times_the_dense_inverse_of_the_strategy_times_z(bands):
    steps = 16
    mechanism = _mechanism(_model(), steps=steps, noise_mechanism="bandmf", bands=bands, seed=5)
    released = _noise_releases(mechanism, steps)
    # the reference: the same standard normals, drawn in the same order, through a float64 solve
    like = {name: p for name, p in mechanism.model.named_parameters()}
    generator = DPRandom(run_seeds(5)["noise"])
    z = torch.stack(
        [
            torch.cat([v.flatten() for _, v in sorted(draw_noise(like, generator).items())])
            for _ in range(steps)
        ]
    )
    strategy = strategy_matrix(mechanism.plan.correlated.coefficients, steps)
    expected = torch.linalg.solve_triangular(strategy, z.double(), upper=False) * SIGMA * CLIP
    assert torch.allclose(released, expected, rtol=1e-5, atol=1e-5 * SIGMA * CLIP)
    # it is not DP-SGD's noise
    assert not torch.allclose(released, z.double() * SIGMA * CLIP, atol=1e-3)


@pytest.mark.parametrize("secure_noise", [False, True], ids=["seeded-noise", "secure-noise"])
def test_released_noise_has_the_strategys_covariance_across_steps(secure_noise):
    # P = 20040 coordinates, 6 steps: the empirical covariance (1/P) N N^T estimates
    # sigma^2 C^2 (C_s^T C_s)^{-1} entry by entry with std ~ sqrt(2/P) x scale.
    steps, bands = 6, 4
    mechanism = _mechanism(
        _model(500, 40),
        steps=steps,
        noise_mechanism="bandmf",
        bands=bands,
        seed=11,
        secure_noise=secure_noise,
    )
    noise = _noise_releases(mechanism, steps) / (SIGMA * CLIP)
    params = noise.shape[1]
    inverse = torch.linalg.inv(strategy_matrix(mechanism.plan.correlated.coefficients, steps))
    expected = inverse @ inverse.T
    empirical = noise @ noise.T / params
    scale = torch.sqrt(
        (expected.diagonal()[:, None] * expected.diagonal()[None, :] + expected**2) / params
    )
    z = (empirical - expected) / scale
    assert z.abs().max() < 5, z
    # the test can fail: independent noise (DP-SGD's identity covariance) is far from it
    assert ((torch.eye(steps, dtype=torch.float64) - expected) / scale).abs().max() > 20


# ------------------------------------------------------------------ accounting
def _dp_accounting_epsilon(
    p: float, sigma: float, compositions: int, delta: float, kind: str
) -> float:
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma)), compositions
    )
    accountant = pld.PLDAccountant() if kind == "pld" else rdp.RdpAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(delta)


# (N, B, S, sigma, b, accountant) -> epsilon, from dp_accounting 0.6.0's amplified event:
# ceil(S/b) Poisson-subsampled Gaussians at p = b*B/N (computed once, 2026-11-24).
GOLDEN = {
    (60000, 600, 1000, 1.0, 4, "pld"): 4.185153218441978,
    (60000, 600, 1000, 1.0, 4, "rdp"): 4.721157718122946,
    (50000, 1000, 500, 2.0, 8, "pld"): 3.082660884088776,
}


@pytest.mark.parametrize("case", list(GOLDEN))
def test_epsilon_is_dp_accountings_amplified_bandmf_event(case):
    n, batch, steps, sigma, bands, kind = case
    plan = make_dp_plan(
        PrivacyNumbers(
            batch_size=batch,
            max_grad_norm=1.0,
            delta=DELTA,
            noise_multiplier=sigma,
            accountant=kind,
        ),
        dataset_size=n,
        steps=steps,
        correlated=BandsRequest(bands=bands, workload=Workload(steps=steps)),
    )
    p, compositions = bands * batch / n, math.ceil(steps / bands)
    assert plan.participation_rate == pytest.approx(p) and plan.compositions(steps) == compositions
    reference = _dp_accounting_epsilon(p, sigma, compositions, DELTA, kind)
    assert plan.epsilon == pytest.approx(reference, rel=1e-9)
    # and neither moved since 2026-11-24
    assert plan.epsilon == pytest.approx(GOLDEN[case], rel=1e-6)


def test_epsilon_mid_run_counts_a_started_band_as_a_whole_composition():
    bands, steps = 3, 10
    mechanism = _mechanism(_model(), steps=steps, noise_mechanism="bandmf", bands=bands)
    x, y = _data()
    for t, indices in enumerate(mechanism.batches(), start=1):
        mechanism.step(x[indices], y[indices])
        expected = compute_epsilon(
            sample_rate=bands * B / N,
            noise_multiplier=SIGMA,
            steps=math.ceil(t / bands),
            delta=DELTA,
        )
        assert mechanism.epsilon() == pytest.approx(expected, rel=1e-12), t
    assert mechanism.epsilon() == pytest.approx(mechanism.plan.epsilon, rel=1e-12)


# -------------------------------------------------------------------- sampling
def test_each_example_joins_only_the_steps_of_its_group():
    bands, steps = 3, 30
    mechanism = _mechanism(_model(), steps=steps, noise_mechanism="bandmf", bands=bands)
    steps_of: dict[int, list[int]] = {}
    for t, indices in enumerate(_train(mechanism)):
        for i in indices.tolist():
            steps_of.setdefault(i, []).append(t)
    assert len(steps_of) > N / 2  # p = 0.5: most examples joined some step
    for i, taken in steps_of.items():
        assert len({t % bands for t in taken}) == 1, (i, taken)  # separation: multiples of b


# ---------------------------------------------------------------------- resume
def test_a_resumed_seeded_mechanism_continues_bit_identically():
    whole_model = _model()
    whole = _mechanism(whole_model, noise_mechanism="bandmf", bands=4)
    _train(whole)

    first_model = _model()
    first = _mechanism(first_model, noise_mechanism="bandmf", bands=4)
    _train(first, steps=5)
    saved = {
        "model": first_model.state_dict(),
        "optimizer": first.optimizer.state_dict(),
        "mechanism": first.state_dict(),
    }
    assert saved["mechanism"]["correlated_noise"] is not None  # seeded: the history is checkpointed
    second_model = _model()
    second_model.load_state_dict(saved["model"])
    # other fresh streams
    second = _mechanism(second_model, noise_mechanism="bandmf", bands=4, seed=123)
    second.optimizer.load_state_dict(saved["optimizer"])
    second.load_state_dict(saved["mechanism"])
    _train(second)
    for p, q in zip(whole_model.parameters(), second_model.parameters()):
        assert torch.equal(p, q)
    assert second.epsilon() == whole.epsilon()


def test_an_unseeded_mechanism_checkpoints_no_past_noise():
    mechanism = _mechanism(_model(), noise_mechanism="bandmf", bands=4, seed=None)
    _train(mechanism, steps=3)
    state = mechanism.state_dict()
    assert state["correlated_noise"] is None and state["noise_generator"] is None


# ------------------------------------------------------------ choosing b
def test_auto_picks_dp_sgd_when_no_banded_strategy_beats_it_after_its_sigma():
    request = BandsRequest(bands="auto", workload=Workload(steps=64))
    costly = lambda b: (float(b), True)  # noqa: E731  sigma grows as fast as b: banding never pays
    plan, sigma, _ = choose_bands(request, steps=64, sample_rate=0.01, sigma_for=costly)
    assert plan.bands == 1 and sigma == 1.0 and "no banded strategy beat DP-SGD" in plan.reason
    free = lambda b: (1.0, True)  # noqa: E731  same sigma for every b: the most bands win
    plan, _, _ = choose_bands(request, steps=64, sample_rate=0.01, sigma_for=free)
    assert plan.bands == 64 and plan.relative_error < 1
    assert "b=1 1.000" in plan.candidates and "b=64" in plan.candidates


def test_auto_plan_names_b_sigma_and_why_and_never_overspends():
    plan = make_dp_plan(
        PrivacyNumbers(
            batch_size=500, max_grad_norm=1.0, delta=DELTA, target_epsilon=3.0, accountant="rdp"
        ),
        dataset_size=60000,
        steps=600,
        correlated=BandsRequest(
            bands="auto", workload=Workload(steps=600, momentum=0.9), max_bands=16
        ),
    )
    assert plan.epsilon <= 3.0 and plan.calibrated
    assert f"b={plan.bands}" in plan.describe() and "dp.bands=auto" in plan.describe()
    assert f"BandMF b={plan.bands}" in plan.status(
        plan.epsilon
    ) and f"sigma={plan.noise_multiplier:.4g}" in plan.status(plan.epsilon)
    direct = compute_epsilon(
        sample_rate=plan.participation_rate,
        noise_multiplier=plan.noise_multiplier,
        steps=plan.compositions(600),
        delta=DELTA,
        kind="rdp",
    )
    assert plan.epsilon == pytest.approx(direct, rel=1e-12)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "settings,words",
    [
        (["dp.sampling=shuffle"], "cyclic Poisson"),
        (["dp.simulated_batch_size=64"], "TAN"),
        (["dp.noise_multiplier=1.0"], "bands=auto compares"),
        (["dp.bands=0"], "dp.bands must be"),
        (["dp.mechanism=banded"], "dp.mechanism must be"),
    ],
)
def test_config_refuses_what_bandmf_does_not_cover(settings, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["dp.mechanism=bandmf", *settings])


def test_plan_refuses_more_groups_than_the_batch_allows_and_too_much_noise_memory():
    with pytest.raises(ConfigError, match=r"b\*q"):
        make_dp_plan(
            PrivacyNumbers(batch_size=30, max_grad_norm=1.0, delta=DELTA, noise_multiplier=1.0),
            dataset_size=100,
            steps=20,
            correlated=BandsRequest(bands=4, workload=Workload(steps=20)),
        )
    with pytest.raises(ConfigError, match="max_noise_memory_mb"):
        make_dp_plan(
            PrivacyNumbers(batch_size=10, max_grad_norm=1.0, delta=DELTA, noise_multiplier=1.0),
            dataset_size=1000,
            steps=20,
            correlated=BandsRequest(
                bands=4, workload=Workload(steps=20), parameters=10**6, max_noise_memory_mb=5
            ),
        )
    plan = make_dp_plan(
        PrivacyNumbers(batch_size=10, max_grad_norm=1.0, delta=DELTA, noise_multiplier=1.0),
        dataset_size=1000,
        steps=20,
        correlated=BandsRequest(
            bands=4, workload=Workload(steps=20), parameters=10**6, max_noise_memory_mb=12
        ),
    )
    assert plan.correlated.noise_state_mb == pytest.approx(3 * 10**6 * 4 / 2**20)
    assert "noise history 11.4 MB" in plan.describe()


def test_make_private_refuses_an_unknown_mechanism():
    with pytest.raises(ValueError, match="noise_mechanism"):
        _mechanism(_model(), noise_mechanism="dp-ftrl")


# -------------------------------------------------------------------- account
def test_dpscale_account_bandmf_names_the_mechanism_b_sigma_and_why(capsys):
    argv = [
        "account",
        "--dataset-size",
        "60000",
        "--batch-size",
        "600",
        "--steps",
        "1000",
        "--noise",
        "1.0",
        "--mechanism",
        "bandmf",
        "--bands",
        "4",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert (
        result["mechanism"] == "bandmf"
        and result["bands"] == 4
        and result["reason"] == "dp.bands=4, fixed"
    )
    assert result["compositions"] == 250 and result["participation_rate"] == pytest.approx(0.04)
    assert result["epsilon"] == pytest.approx(
        _dp_accounting_epsilon(0.04, 1.0, 250, 1e-5, "pld"), rel=1e-9
    )


def test_bandmf_composes_with_data_normalization_releases():
    from dpscale.privacy.accounting.segments import data_norm_release

    releases = (data_norm_release(8.0),)
    plan = make_dp_plan(
        PrivacyNumbers(batch_size=1000, max_grad_norm=1.0, delta=DELTA, target_epsilon=3.0),
        dataset_size=50000,
        steps=300,
        releases=releases,
        correlated=BandsRequest(bands=4, workload=Workload(steps=300)),
    )
    direct = compute_epsilon(
        sample_rate=0.08,
        noise_multiplier=plan.noise_multiplier,
        steps=75,
        delta=DELTA,
        releases=releases,
    )
    assert plan.epsilon == pytest.approx(direct, rel=1e-12) and plan.epsilon <= 3.0
    alone = compute_epsilon(
        sample_rate=0.08, noise_multiplier=plan.noise_multiplier, steps=75, delta=DELTA
    )
    assert plan.epsilon > alone  # the release is counted


def test_an_unseeded_mechanism_resumes_with_a_fresh_recursion_and_the_same_accounting():
    first_model = _model()
    first = _mechanism(first_model, noise_mechanism="bandmf", bands=4, seed=None)
    _train(first, steps=6)
    saved = {
        "model": first_model.state_dict(),
        "optimizer": first.optimizer.state_dict(),
        "mechanism": first.state_dict(),
    }
    second_model = _model()
    second_model.load_state_dict(saved["model"])
    second = _mechanism(second_model, noise_mechanism="bandmf", bands=4, seed=None)
    second.optimizer.load_state_dict(saved["optimizer"])
    second.load_state_dict(saved["mechanism"])
    assert (
        second.sampler.partition_seed == first.sampler.partition_seed and second.sampler.step == 6
    )
    drawn = _train(second)
    assert len(drawn) == 6 and second.epsilon() == pytest.approx(second.plan.epsilon, rel=1e-12)
    assert second.accountant.steps == 3  # ceil(12 / 4): none counted twice


def test_secure_noise_is_not_replayed_by_the_seed():
    a = _mechanism(_model(), noise_mechanism="bandmf", bands=3, secure_noise=True)
    b = _mechanism(_model(), noise_mechanism="bandmf", bands=3, secure_noise=True)
    # same seed, OS-random noise
    assert not torch.allclose(_noise_releases(a, 4), _noise_releases(b, 4))


def test_dpscale_train_with_one_band_is_the_dp_sgd_run(tmp_path):
    from dpscale.train.loop import Trainer
    from helpers import tiny_config

    def run(name: str, *extra: str) -> Trainer:
        settings = [
            "run.seed=0",
            "dp.batch_size=128",
            "dp.noise_multiplier=1.2",
            "train.steps=6",
            "train.eval_every_epochs=1",
            "optim.momentum=0.9",
            *extra,
        ]
        trainer = Trainer.create(tiny_config(tmp_path / name, *settings), progress=False)
        trainer.run()
        return trainer

    dpsgd, bandmf = run("dpsgd"), run("bandmf", "dp.mechanism=bandmf", "dp.bands=1")
    for name, weight in dpsgd.model.state_dict().items():
        assert torch.equal(weight, bandmf.model.state_dict()[name]), name
    summary = json.loads((tmp_path / "bandmf" / "summary.json").read_text())
    assert (
        summary["mechanism"] == "bandmf"
        and summary["bandmf"]["bands"] == 1
        and summary["sampling"] == "poisson"
    )
    assert (
        summary["epsilon"]
        == json.loads((tmp_path / "dpsgd" / "summary.json").read_text())["epsilon"]
    )


def test_a_seeded_secure_noise_state_holds_no_past_noise():
    mechanism = _mechanism(_model(), noise_mechanism="bandmf", bands=3, secure_noise=True)
    _train(mechanism, steps=4)
    # the checkpoint cannot un-noise a release
    assert mechanism.state_dict()["correlated_noise"] is None


def test_loading_a_state_after_a_draw_is_refused():
    first = _mechanism(_model(), noise_mechanism="bandmf", bands=3)
    _train(first, steps=4)
    second = _mechanism(_model(), noise_mechanism="bandmf", bands=3, seed=7)
    second.model.load_state_dict(first.model.state_dict())
    second.sample()  # from second's own partition: not the saved run's group 1
    with pytest.raises(RuntimeError, match="drawn before loading"):
        second.load_state_dict(first.state_dict())


def test_a_refused_step_leaves_the_noise_recursion_untouched():
    x, y = _data()
    mechanism = _mechanism(_model(), noise_mechanism="bandmf", bands=3)
    batches = mechanism.batches()
    for _ in range(2):
        indices = next(batches)
        mechanism.step(x[indices], y[indices])
    indices = next(batches)
    before = mechanism.correlated_noise.snapshot()
    assert len(before) == 2
    # one example short, counted after the noise
    with pytest.raises(ValueError, match="nothing was released"):
        mechanism.step([(x[indices], y[indices]), (x[:1], y[:1])])
    after = mechanism.correlated_noise.snapshot()
    assert len(after) == 2 and all(a is b for a, b in zip(after, before))
    assert mechanism.steps_taken == 2 and mechanism.accountant.steps == 1


def test_a_state_with_the_old_partition_is_refused_before_the_mechanism_loads_anything():
    # issue 43: a state of the permutation partition is refused by the sampler; the mechanism must
    # not have taken the saved plan's caveats or partition seed by then (a half-loaded mechanism)
    model = _model()
    saved = _mechanism(model, noise_mechanism="bandmf", bands=2, seed=5)
    _train(saved, steps=2)
    state = saved.state_dict()
    del state["sampler"]["partition"]
    fresh = _mechanism(_model(), noise_mechanism="bandmf", bands=2, seed=None)
    fresh.model.load_state_dict(model.state_dict())
    plan, partition_seed = fresh.plan, fresh.partition_seed
    with pytest.raises(ValueError, match="start the run again"):
        fresh.load_state_dict(state)
    assert (
        fresh.plan == plan
        and fresh.plan.seeded == plan.seeded
        and fresh.partition_seed == partition_seed
    )
