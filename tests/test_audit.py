"""The one-run privacy audit (Steinke, Nasr & Jagielski 2023): the bound against the paper's
algorithm and an exactly epsilon-DP simulation; the canaries; honest runs never refuted and
deliberately broken runs caught."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from dpscale.audit.canaries import DIRAC_SCALE, CanaryAudit, CanaryEngine
from dpscale.audit.run import AuditFault, run_audit, verdict_for
from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy.accounting.audit_bound import (
    audit_ceiling,
    audit_p_value,
    best_guesses,
    default_guess_rules,
    epsilon_lower_bound,
    score_guesses,
)
from dpscale.privacy.clipping.per_example import VmapEngine, trainable_params

# Values from the paper's Appendix D algorithm (p_value_DP_audit / get_eps_audit, run as
# published with scipy 1.17 at p = 0.05): (m, r, v) -> (epsilon at delta 0, at delta 1e-5).
PAPER_ALGORITHM = {
    (1000, 100, 100): (3.4930, 3.4654),
    (1000, 100, 90): (1.6308, 1.6261),
    (1000, 200, 180): (1.7989, 1.7963),
    (1000, 1000, 1000): (5.8091, 5.7823),
    (5000, 1000, 900): (2.0212, 2.0183),
    (10000, 1000, 1000): (5.8091, 5.5293),
}


@pytest.mark.parametrize("counts", sorted(PAPER_ALGORITHM))
def test_lower_bound_matches_the_papers_algorithm(counts):
    m, r, v = counts
    for delta, expected in zip((0.0, 1e-5), PAPER_ALGORITHM[counts]):
        got = epsilon_lower_bound(canaries=m, guesses=r, correct=v, delta=delta, confidence=0.95)
        assert got == pytest.approx(expected, abs=2e-4)


def test_all_right_without_delta_has_a_closed_form():
    # p^r = alpha at the bound: epsilon = logit(alpha^(1/r))
    for r in (10, 50, 400):
        p = 0.05 ** (1 / r)
        assert epsilon_lower_bound(
            canaries=r, guesses=r, correct=r, delta=0, confidence=0.95
        ) == pytest.approx(math.log(p / (1 - p)), rel=1e-6)


def test_delta_term_by_hand():
    # r = v = 2, m = 2: tail p^2; spread max(P[Bin=1], (P[Bin=1] + P[Bin=0]) / 2)
    eps, delta = 0.7, 0.01
    p = 1 / (1 + math.exp(-eps))
    one, zero = 2 * p * (1 - p), (1 - p) ** 2
    expected = p**2 + 2 * 2 * delta * max(one, (one + zero) / 2)
    assert audit_p_value(
        canaries=2, guesses=2, correct=2, epsilon=eps, delta=delta
    ) == pytest.approx(expected, rel=1e-12)


def test_bound_holds_for_an_exactly_dp_mechanism():
    # Randomised response at epsilon0 is exactly epsilon0-DP per canary: each guess is right with
    # probability e^eps0 / (1 + e^eps0). The 95% bound may exceed eps0 in at most ~5% of trials.
    rng = np.random.default_rng(0)
    eps0, m, trials = 1.0, 300, 300
    p = 1 / (1 + math.exp(-eps0))
    bounds = np.array(
        [
            epsilon_lower_bound(
                canaries=m, guesses=m, correct=int(rng.binomial(m, p)), delta=0, confidence=0.95
            )
            for _ in range(trials)
        ]
    )
    assert (bounds > eps0).mean() <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert np.median(bounds) > 0.5 * eps0  # and it is not vacuous


def test_guess_counting_and_union_bound():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    truth = np.array([True, True, False, True, False, False])
    assert score_guesses(scores, truth, 2, 0) == (2, 2)
    assert score_guesses(scores, truth, 3, 2) == (5, 4)  # 2 of top 3 in; both bottom 2 out
    with pytest.raises(ValueError, match="k\\+"):
        score_guesses(scores, truth, 4, 3)
    rng = np.random.default_rng(1)
    truth = rng.random(400) < 0.5
    scores = truth + rng.normal(0, 0.5, 400)
    rules = default_guess_rules(400)
    best = best_guesses(scores, truth, delta=1e-5, confidence=0.95)
    r, v = score_guesses(scores, truth, best.guess_in, best.guess_out)
    # each rule is evaluated at confidence 1 - 0.05 / len(rules)
    assert best.eps_lower_bound == pytest.approx(
        epsilon_lower_bound(
            canaries=400, guesses=r, correct=v, delta=1e-5, confidence=1 - 0.05 / len(rules)
        )
    )
    assert best.eps_lower_bound < epsilon_lower_bound(
        canaries=400, guesses=r, correct=v, delta=1e-5, confidence=0.95
    )


def test_canary_engine_adds_exactly_c_for_included_and_nothing_for_excluded():
    from dpscale.privacy.clipping.bounds import clip_margin

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    params = trainable_params(model)
    inner = VmapEngine(0.5, views=1)
    included = np.array([True, True, False])
    engine = CanaryEngine(
        inner, included, [("1.weight", 5), ("1.bias", 2), ("1.bias", 0)], DIRAC_SCALE * 0.5
    )
    x = torch.randn(5, 1, 2, 2)
    # rows 1 and 3: canary 1 (included, bias 2) and canary 2 (excluded, bias 0)
    y = torch.tensor([0, -2, 1, -3, 2])
    got, norms, losses = engine.clipped_sum_and_losses(model, params, (x, y))
    keep = y >= 0
    expected, _, _ = inner.clipped_sum_and_losses(model, params, (x[keep], y[keep]))
    assert torch.allclose(got["1.weight"], expected["1.weight"])
    delta = got["1.bias"] - expected["1.bias"]
    # float32 clips 1.2e-4 below C (its rounding margin)
    aim = 0.5 * (1 - clip_margin(torch.float32))
    assert delta[2].item() == pytest.approx(aim, rel=1e-5) and delta[[0, 1]].abs().max() == 0
    assert len(norms) == 5 and len(losses) == 5
    assert engine.data_sum[1].item() == pytest.approx(expected["1.bias"][2].item(), rel=1e-6)
    # input canaries: placeholders (the excluded ones) drop out, the rest is the inner engine's
    plain = CanaryEngine(inner, included)
    got, norms, _ = plain.clipped_sum_and_losses(model, params, (x, y))
    assert all(torch.allclose(got[k], expected[k]) for k in got) and len(norms) == 3


def _loose_clipping(monkeypatch, scale):
    """A clipping bug inside the engines: their clip rule (patched where vmap, bk and ghost call it:
    ``per_example.clip_units``) lets ``scale`` * C through, while every engine still reports C."""
    from dpscale.privacy.clipping import per_example

    exact = per_example.clip_factors

    def loose(bounds, max_grad_norm, **options):
        return exact(bounds, None if max_grad_norm is None else max_grad_norm * scale, **options)

    monkeypatch.setattr(per_example, "clip_factors", loose)


@pytest.mark.parametrize("views", [1, 2])
@pytest.mark.parametrize("name", ["vmap", "bk", "ghost"])
@pytest.mark.parametrize("scale", [1.0, 10.0], ids=["honest", "leaks-10C"])
def test_gradient_canaries_are_clipped_by_the_engine_itself(monkeypatch, name, views, scale):
    # A canary's released contribution is whatever the engine's own norm, clip and sum make of it:
    # C from an honest engine, 10 C from one whose clipping lets 10 C through.
    from dpscale.privacy.clipping.bounds import clip_margin
    from dpscale.privacy.clipping.engines import make_engine

    if scale != 1:
        _loose_clipping(monkeypatch, scale)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(27, 4)
    )
    params = trainable_params(model)
    clip = 0.5
    inner, _ = make_engine(name, clip, model, views=views)
    coordinates = [("0.weight", 7), ("0.bias", 1), ("3.weight", 20), ("3.bias", 2), ("3.weight", 0)]
    included = np.array([True, True, True, True, False])
    engine = CanaryEngine(inner, included, coordinates, DIRAC_SCALE * clip)
    x = torch.randn(8, *([views] if views > 1 else []), 2, 6, 6)
    y = torch.tensor([0, -1, 3, -2, -3, 1, -4, -5])  # rows 1, 3, 4, 6, 7: canaries 0-4 (4 excluded)
    got, norms, _ = engine.clipped_sum_and_losses(model, params, (x, y))
    released = (engine.at_coordinates(got) - engine.data_sum) / clip  # in units of C
    # float32 clips 1.2e-4 below C (its rounding margin)
    aim = scale * (1 - clip_margin(torch.float32))
    assert released[:4].tolist() == pytest.approx([aim] * 4, rel=1e-5) and released[4] == 0
    # the engine measured the canaries' norms; nothing else moved
    assert (
        norms[-5:-1].tolist() == pytest.approx([DIRAC_SCALE * clip] * 4, rel=1e-5)
        and norms[-1] == 0
    )
    keep = y >= 0
    expected, _, _ = inner.clipped_sum_and_losses(model, params, (x[keep], y[keep]))
    for canary, (pname, flat) in enumerate(coordinates):
        if included[canary]:
            expected[pname].view(-1)[flat] = got[pname].view(-1)[flat]
    assert all(torch.equal(got[k], expected[k]) for k in got)
    # a chunk whose only canary is on the conv bias: the probe calls that layer alone
    engine.data_sum.zero_()  # (the observer does this after each step)
    got, _, _ = engine.clipped_sum_and_losses(model, params, (x[[0, 3]], y[[0, 3]]))
    assert ((engine.at_coordinates(got) - engine.data_sum)[1] / clip).item() == pytest.approx(
        aim, rel=1e-5
    )


def test_first_chunk_checks_see_only_the_real_examples():
    # a check of how the model treats a batch (the mechanism's first-chunk check) gets the real
    # rows and the inner engine; the engine it chooses stays wrapped
    audit = CanaryAudit("gradient", 4, seed=0)
    inner, chosen = VmapEngine(0.5), VmapEngine(0.5, name="chosen")
    engine = CanaryEngine(
        inner, audit.included, [("1.bias", 0), ("1.bias", 1), ("1.bias", 2), ("1.weight", 0)], 500.0
    )
    seen = []

    def check(e, model, chunk):
        seen.append((e, chunk[1].tolist()))
        return chosen

    x, y = torch.randn(4, 1, 2, 2), torch.tensor([2, -1, 0, -4])
    assert audit.on_real_examples(check)(engine, None, (x, y)) is engine
    assert seen == [(inner, [2, 0])] and engine.inner is chosen and engine.name == "chosen"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["vmap", "bk"])
def test_gradient_canaries_stay_finite_in_16_bits(name, precision):
    # fp16 with loss scale S: the canary's norm is lowered so that S M stays finite (an overflowing
    # canary would contribute zero, as if absent); it still gets exactly C
    from dpscale.audit.canaries import dirac_norm
    from dpscale.privacy.clipping.engines import make_engine
    from dpscale.privacy.clipping.precision import make_precision

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(27, 4)
    )
    params = trainable_params(model)
    inner, _ = make_engine(name, 1.0, model, precision=make_precision(precision))
    norm = dirac_norm(inner, 1.0)
    assert norm == (32.0 if precision == "fp16" else DIRAC_SCALE)
    coordinates = [("0.weight", 7), ("0.bias", 1), ("3.weight", 20), ("3.bias", 2)]
    engine = CanaryEngine(inner, np.ones(4, dtype=bool), coordinates, norm)
    x, y = torch.randn(6, 2, 6, 6), torch.tensor([0, -1, -2, 2, -3, -4])
    got, norms, _ = engine.clipped_sum_and_losses(model, params, (x, y))
    assert (engine.at_coordinates(got) - engine.data_sum).tolist() == pytest.approx(
        [1.0] * 4, rel=1e-3
    )
    assert norms[-4:].tolist() == pytest.approx([norm] * 4, rel=1e-3)
    with pytest.raises(ConfigError, match="fp16_loss_scale=65536"):
        dirac_norm(make_engine(name, 1.0, model, precision=make_precision("fp16", 65536.0))[0], 1.0)


@pytest.mark.parametrize(
    "layer",
    [
        nn.Linear(5, 4),
        nn.Linear(5, 4, bias=False),
        nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2),
        nn.Conv2d(2, 3, (3, 2), stride=(1, 3), padding=(0, 1)),
        nn.Conv1d(3, 4, 5, stride=3, padding=4),
    ],
    ids=["linear", "linear-no-bias", "conv2d-dilated-grouped", "conv2d-rect", "conv1d"],
)
def test_dirac_probe_gives_each_canary_exactly_its_coordinate(layer):
    from dpscale.audit.dirac import DiracProbe, host_sizes

    model = nn.Sequential(nn.Identity(), layer).double()
    params = trainable_params(model)
    coordinates = [(name, i) for name, size in host_sizes(model, params) for i in range(size)]
    probe = DiracProbe(model, coordinates, magnitude=3.0)
    x, y = probe.batch(torch.arange(len(coordinates)), 1, params["1.weight"])
    live = dict(model.named_parameters())
    for i, (name, flat) in enumerate(coordinates):
        loss = nn.functional.cross_entropy(probe(x[i : i + 1]), y[i : i + 1])
        grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
        assert grads[name].view(-1)[flat].item() == pytest.approx(3.0, rel=1e-12)
        grads[name].view(-1)[flat] = 0
        assert all(not g.any() for g in grads.values()), (name, flat)


def _config(tmp_path, name, *overrides):
    return load_config(
        None,
        [
            f"run.out_dir={tmp_path / name}",
            "train.steps=30",
            "train.checkpoint_every_minutes=null",
            *overrides,
        ],
    )


def test_canaries_are_counted_in_n_whatever_their_membership(tmp_path):
    from dpscale.train.loop import Trainer

    plain = Trainer.create(_config(tmp_path, "plain", "run.seed=0"), progress=False)
    n = plain.plan.dataset_size
    # input canaries are taken from the data
    for kind, expected in (("gradient", n + 100), ("input", n)):
        plans = []
        for seed in (3, 4):  # different memberships, the same N, q, sigma and steps
            audit = CanaryAudit(kind, 100, seed=seed)
            trainer = Trainer.create(
                _config(tmp_path, f"{kind}{seed}", "run.seed=0"),
                progress=False,
                hooks=audit.hooks(),
            )
            assert trainer.plan.dataset_size == expected
            assert trainer.plan.sample_rate == pytest.approx(256 / expected)
            plans.append((trainer.plan.noise_multiplier, trainer.plan.steps))
        assert plans[0] == plans[1] and audit.included.sum() not in (0, 100)


@pytest.mark.parametrize(
    "epsilon",
    [pytest.param(1.0, marks=pytest.mark.slow), 3.0, pytest.param(8.0, marks=pytest.mark.slow)],
)
def test_honest_runs_are_never_refuted(tmp_path, epsilon):
    for seed in range(3):
        config = _config(
            tmp_path, f"e{epsilon}-{seed}", f"dp.epsilon={epsilon}", f"run.seed={seed}"
        )
        result = run_audit(config, canaries=500, progress=False, plot=False)
        assert result.epsilon == pytest.approx(epsilon, rel=1e-3)
        assert result.eps_lower_bound <= result.epsilon and result.passed, result


@pytest.mark.parametrize(
    "fault", [AuditFault(noise_scale=0.05), AuditFault(clip_scale=10.0)], ids=["noise", "clip"]
)
def test_broken_runs_are_caught(tmp_path, fault):
    config = _config(tmp_path, "broken", "dp.epsilon=1", "run.seed=0")
    result = run_audit(config, canaries=500, progress=False, plot=False, fault=fault)
    assert result.epsilon == pytest.approx(1.0, rel=1e-3)  # it still claims epsilon 1
    assert result.eps_lower_bound > result.epsilon and not result.passed
    assert result.verdict.startswith("FAIL")


def test_input_canaries_run_and_pass(tmp_path):
    result = run_audit(
        _config(tmp_path, "input", "run.seed=0"),
        kind="input",
        canaries=200,
        progress=False,
        plot=False,
    )
    assert (
        result.kind == "input" and result.passed and 0 <= result.eps_lower_bound <= result.epsilon
    )


def test_cli_json_is_the_last_line(tmp_path, capsys):
    code = main(
        [
            "audit",
            "--canaries",
            "200",
            "--json",
            "--quiet",
            "--set",
            f"run.out_dir={tmp_path / 'cli'}",
            "--set",
            "train.steps=20",
            "--set",
            "run.seed=0",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("eps_lower_bound", "epsilon", "confidence", "guesses", "correct", "verdict"):
        assert key in result
    assert (tmp_path / "cli" / "audit.json").exists() and (
        tmp_path / "cli" / "audit_scores.png"
    ).stat().st_size > 1000
    # its training set holds canaries its config does not describe: resume and eval refuse it
    assert main(["train", "--resume", str(tmp_path / "cli")]) == 2
    assert main(["eval", str(tmp_path / "cli")]) == 2
    assert "dpscale audit` run" in capsys.readouterr().err


def test_refusals(tmp_path, capsys):
    with pytest.raises(ConfigError, match="non-private run"):
        run_audit(
            _config(tmp_path, "np", "dp.epsilon=null", "dp.noise_multiplier=0"),
            canaries=10,
            progress=False,
        )
    assert not (tmp_path / "np").exists()  # refused before anything was claimed or trained
    with pytest.raises(ConfigError, match="--guesses 300,0"):
        run_audit(_config(tmp_path, "g3"), canaries=200, rules=[(300, 0)], progress=False)
    with pytest.raises(ConfigError, match="got 1.5"):
        run_audit(_config(tmp_path, "c"), canaries=200, confidence=1.5, progress=False)
    with pytest.raises(ConfigError, match="stream"):
        run_audit(_config(tmp_path, "st", "data.loader=stream"), canaries=10, progress=False)
    with pytest.raises(ConfigError, match="at most"):
        run_audit(
            _config(tmp_path, "many", "run.seed=0"), kind="input", canaries=100000, progress=False
        )
    assert main(["audit", "--guesses", "x", "--set", f"run.out_dir={tmp_path / 'g'}"]) == 2
    assert "K_IN,K_OUT" in capsys.readouterr().err


def test_verdict_lines():
    assert verdict_for(0.5, 1.0, 0.95)[0] and not verdict_for(1.5, 1.0, 0.95)[0]
    assert "cannot refute 8" in verdict_for(2.0, 8.0, 0.95, ceiling=5.2)[1]


def test_ceiling_is_every_guess_right_and_capped_by_delta():
    rules = default_guess_rules(1000)
    each = 1 - 0.05 / len(rules)
    expected = max(
        epsilon_lower_bound(
            canaries=1000, guesses=a + b, correct=a + b, delta=1e-5, confidence=each
        )
        for a, b in rules
    )
    assert audit_ceiling(1000, delta=1e-5) == pytest.approx(expected)
    # the 2 m delta term: 20x the canaries barely moves it at delta 1e-5, but does at delta 0
    assert audit_ceiling(20000, delta=1e-5) < 6 < 8 < audit_ceiling(20000, delta=0)


@pytest.mark.parametrize("kind", ["input", "gradient"])
def test_the_canary_engine_takes_a_fixed_shape_chunk_as_the_unpadded_one(kind):
    """train.fixed_shapes pads each chunk (issue 63): the canary engine's filtered data rows are padded
    again, so the padding neither trains nor counts (the review found 52-60 examples counted where
    3-58 were real)."""
    from dpscale.privacy import make_engine
    from dpscale.privacy.clipping.per_example import pad_chunk

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3)).double()
    inner = make_engine("bk", 1.0, model)[0]
    included = np.array([False, True])
    if kind == "gradient":  # canary 1 included (a Dirac gradient on 1.bias[2]), canary 0 excluded
        engine = CanaryEngine(inner, included, [("1.bias", 0), ("1.bias", 2)], DIRAC_SCALE * 1.0)
    else:  # input canaries: the excluded one's placeholder drops out
        engine = CanaryEngine(inner, included)
    # 2 examples + 2 canaries
    x, y = (torch.randn(4, 1, 2, 2, dtype=torch.float64), torch.tensor([0, 2, -1, -2]))
    params = trainable_params(model)
    want, want_norms, want_losses = engine.clipped_sum_and_losses(model, params, (x, y))
    got, got_norms, got_losses = engine.clipped_sum_and_losses(model, params, pad_chunk((x, y), 9))
    assert got_norms.shape == want_norms.shape and got_losses.shape == want_losses.shape
    torch.testing.assert_close(got_norms, want_norms, rtol=1e-12, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-15)
