"""Automatic clipping (issue 45, item 4; Bu et al. 2023): each per-example gradient scaled by
C / (||g|| + gamma), so its norm is below C, the sensitivity.

Every engine against the float64 per-example loop (which writes the factor out on its own), per
layer too; the leave-one-out change of the released sum <= C through ``make_private`` (every
engine) and ``dpscale train``; the plan and config say it and refuse what it cannot be.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dpscale
from dpscale.clip_norms import MIN_CLIP_GAMMA
from dpscale.errors import ConfigError
from dpscale.privacy.clipping.engines import make_engine
from dpscale.privacy.clipping.reference import float64_reference
from helpers import one_line_error, plan_of

ENGINES = ["vmap", "bk", "ghost"]
GAMMA = 0.01


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    ).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(9, 1, 8, 8, dtype=torch.float64)
    x[3] *= 1e4  # an outlier
    x[5] *= 1e-6  # a tiny gradient: scaled up towards C, not left alone as clipping would
    return x, torch.randint(0, 3, (9,))


def _engine_sum(name: str, model: nn.Module, clip, batch, gamma=GAMMA):
    engine, _ = make_engine(name, clip, model, clip_gamma=gamma)
    params = {n: p.detach() for n, p in model.named_parameters()}
    grad_sum, norms, _ = engine.clipped_sum_and_losses(model, params, batch)
    return grad_sum, norms


@pytest.mark.parametrize("clip", [0.5, {"0.*": 0.05, "*": 0.1}], ids=["one-C", "per-layer"])
@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_equals_the_float64_per_example_loop(engine, clip):
    model, batch = _net(), _batch()
    reference = float64_reference(model, batch, clip, clip_gamma=GAMMA)
    grad_sum, norms = _engine_sum(engine, model, clip, batch)
    torch.testing.assert_close(norms, reference.norms, rtol=1e-9, atol=1e-12)
    for name, value in reference.clipped_sum.items():
        torch.testing.assert_close(grad_sum[name], value, rtol=1e-9, atol=1e-12)
    clipped = float64_reference(model, batch, clip)  # plain clipping releases another sum
    assert max(float((grad_sum[n] - clipped.clipped_sum[n]).abs().max()) for n in grad_sum) > 1e-6


def test_the_loop_scales_every_example_to_just_below_c():
    """The reference's own arithmetic: one example's released norm is C ||g|| / (||g|| + gamma)."""
    model, (x, y) = _net(), _batch()
    for i in (3, 5, 0):
        alone = float64_reference(model, (x[i : i + 1], y[i : i + 1]), 0.5, clip_gamma=GAMMA)
        released = math.sqrt(sum(float(v.square().sum()) for v in alone.clipped_sum.values()))
        norm = float(alone.norms[0])
        assert released == pytest.approx(0.5 * norm / (norm + GAMMA), rel=1e-9) and released < 0.5


@pytest.mark.parametrize("engine", ENGINES)
def test_removing_one_example_through_make_private_moves_the_release_by_at_most_c(engine):
    """Two mechanisms of one seed take the same noisy step, one without example j: the released
    sums differ by at most C (the outlier's removal comes within gamma of it)."""
    torch.manual_seed(2)
    x, y = torch.randn(12, 6) * 3, torch.randint(0, 3, (12,))
    x[4] *= 1e3
    c, batch = 0.7, 12

    def released(keep: torch.Tensor) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        mechanism = dpscale.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset_size=100,
            batch_size=batch,
            max_grad_norm=c,
            noise_multiplier=1.0,
            delta=1e-5,
            steps=2,
            seed=3,
            engine=engine,
            clipping="automatic",
            clip_gamma=GAMMA,
        )
        out = []
        mechanism.observer = lambda gradient: out.append(
            {k: v.double() * batch for k, v in gradient.items()}
        )
        mechanism.step_drawn_chunks([(x[keep], y[keep])])
        return out[0]

    full = released(torch.arange(12))
    changes = []
    for j in range(12):
        rest = released(torch.tensor([i for i in range(12) if i != j]))
        changes.append(math.sqrt(sum(float((full[k] - rest[k]).square().sum()) for k in full)))
    assert max(changes) <= c * (1 + 1e-5) and changes[4] > 0.99 * c


def test_dpscale_train_runs_it_and_says_so(tmp_path, capsys):
    from dpscale.train.loop import Trainer
    from helpers import tiny_config

    config = tiny_config(
        tmp_path / "run", "train.steps=2", "dp.clipping=automatic", "dp.clip_gamma=0.05"
    )
    trainer = Trainer.create(config, progress=False, report=True)
    trainer.run()
    header = capsys.readouterr().err
    assert trainer.plan.clip_gamma == 0.05 and trainer.built.engine.clip_gamma == 0.05
    assert "automatic clipping (Bu et al. 2023)" in header and "norm < C, the sensitivity" in header
    assert trainer.plan.noise_std == trainer.plan.noise_multiplier * 1.0  # the sensitivity stays C


@pytest.mark.parametrize(
    "settings, pattern",
    [
        ({"clip_gamma": 0.0}, "gamma must be a positive number"),
        ({"clip_gamma": -1.0}, "gamma must be a positive number"),
        ({"clip_gamma": 1e-40}, "at least 1e-12"),
        ({"clip_gamma": MIN_CLIP_GAMMA / 2}, "at least 1e-12"),
        ({"clip_gamma": math.nan}, "gamma must be a positive number"),
        (
            {"clip_gamma": 0.01, "max_grad_norm": None, "noise_multiplier": 0.0},
            "needs dp.max_grad_norm",
        ),
    ],
)
def test_bad_settings_are_refused(settings, pattern):
    numbers = {
        "dataset_size": 1000,
        "batch_size": 50,
        "steps": 10,
        "max_grad_norm": 1.0,
        "delta": 1e-5,
        "noise_multiplier": 1.0,
    } | settings
    with pytest.raises(ConfigError, match=pattern):
        plan_of(**numbers)


def test_the_adversarial_doors_hold_with_automatic_clipping_and_fixed_size_batches():
    """Through make_private with clipping="automatic" and sampling="fixed" (a private run: the checks are
    its): a loss that mixes the
    batch is refused before anything is released; a batch the mechanism did not draw is refused; an
    example that overflows float32 contributes exactly zero (its factor C / (inf + gamma) is not used)."""
    import torch.nn.functional as F

    def mechanism_for(loss_fn=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        options = {"loss_fn": loss_fn} if loss_fn else {}
        mech = dpscale.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset_size=40,
            batch_size=8,
            max_grad_norm=0.5,
            noise_multiplier=1.0,
            delta=1e-5,
            steps=3,
            seed=1,
            clipping="automatic",
            sampling="fixed",
            **options,
        )
        return model, mech

    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))

    def mixing(logits, t):  # InfoNCE over the batch: each example's loss depends on every other one
        return F.cross_entropy(logits @ logits.T, torch.arange(len(t)), reduction="none")

    model, mech = mechanism_for(mixing)
    indices = mech.sample()
    with pytest.raises(ValueError, match="mixes examples"):
        mech.step(x[indices], y[indices])
    assert mech.steps_taken == 0 and mech.accountant.steps == 0
    model, mech = mechanism_for()
    indices = mech.sample()
    others = torch.tensor([i for i in range(40) if i not in set(indices.tolist())][: len(indices)])
    with pytest.raises(ValueError, match="drawn"):
        mech.step(x[others], y[others], indices=others)
    assert mech.steps_taken == 0
    released = []
    mech.observer = lambda gradient: released.append({k: v.clone() for k, v in gradient.items()})
    bad = x.clone()
    bad[indices[0]] = 3e38
    stats = mech.step(bad[indices], y[indices], indices=indices)
    _, clean = mechanism_for()
    clean.sample()
    clean.observer = lambda gradient: released.append({k: v.clone() for k, v in gradient.items()})
    keep = indices[1:]
    clean.step_drawn_chunks([(x[keep], y[keep])])
    assert stats.nonfinite_examples == 1 and len(indices) == 8
    for name in released[0]:
        torch.testing.assert_close(released[0][name], released[1][name], rtol=1e-6, atol=1e-7)


# ------------------------------------------------ issue 62, item 4: tiny gammas and zero gradients
#
# gamma = 1e-40 released NaN (C / gamma is inf in float32, times a zero gradient) and gamma = 1e-30
# released 1.5e6 C for an example whose gradient entries (1e-24) square to 0 in float32.


def _bias_free_net() -> nn.Module:
    """float32, no bias: an input of zeros has an exactly zero gradient."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, bias=False), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 6 * 6, 3, bias=False)
    )


def _zero_and_tiny_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A zero input, inputs whose gradients square to subnormals or 0 in float32, and ordinary ones."""
    torch.manual_seed(1)
    x = torch.randn(8, 1, 8, 8)
    x[0] = 0.0
    for i, scale in ((1, 1e-20), (2, 1e-24), (3, 1e-40), (4, 1e3)):
        x[i] *= scale
    return x, torch.randint(0, 3, (8,))


def _released_norm(grad_sum: dict) -> float:
    return math.sqrt(sum(float(v.double().square().sum()) for v in grad_sum.values()))


@pytest.mark.parametrize("clip", [0.5, {"0.*": 0.3, "*": 0.4}], ids=["one-C", "per-layer"])
@pytest.mark.parametrize("engine", ENGINES)
def test_zero_and_tiny_gradients_at_the_smallest_gamma_release_no_nan_and_at_most_c(engine, clip):
    """At gamma = MIN_CLIP_GAMMA each engine's float32 release equals the float64 loop's (whose
    norms do not underflow), and each example alone releases at most its sensitivity."""
    model, batch = _bias_free_net(), _zero_and_tiny_batch()
    grad_sum, _ = _engine_sum(engine, model, clip, batch, gamma=MIN_CLIP_GAMMA)
    x64 = (batch[0].double(), batch[1])
    reference = float64_reference(
        _bias_free_net().double(), x64, clip, release_dtype=torch.float32, clip_gamma=MIN_CLIP_GAMMA
    )
    for name, value in reference.clipped_sum.items():
        assert torch.isfinite(grad_sum[name]).all()
        torch.testing.assert_close(grad_sum[name].double(), value, rtol=1e-4, atol=1e-6)
    sensitivity = 0.5 if clip == 0.5 else math.hypot(0.3, 0.4)
    for i in range(len(batch[0])):
        alone, _ = _engine_sum(
            engine, model, clip, (batch[0][i : i + 1], batch[1][i : i + 1]), gamma=MIN_CLIP_GAMMA
        )
        assert _released_norm(alone) <= sensitivity, i


@pytest.mark.parametrize("engine", ENGINES)
def test_a_factor_past_float32_is_capped_so_a_zero_gradient_releases_no_nan(engine):
    """C / gamma = 1e42 is inf in float32: through make_private a drawn zero-gradient example
    released NaN; capped at float32's largest value it contributes 0, the engine's sum equals the
    float64 loop's, and the noisy step stays finite."""
    c = 1e30
    model, (x, y) = _bias_free_net(), _zero_and_tiny_batch()
    batch = (x[[0, 5, 6, 7]], y[[0, 5, 6, 7]])
    grad_sum, _ = _engine_sum(engine, model, c, batch, gamma=MIN_CLIP_GAMMA)
    reference = float64_reference(
        _bias_free_net().double(),
        (batch[0].double(), batch[1]),
        c,
        release_dtype=torch.float32,
        clip_gamma=MIN_CLIP_GAMMA,
    )
    for name, value in reference.clipped_sum.items():
        torch.testing.assert_close(grad_sum[name].double(), value, rtol=1e-4, atol=0.0)
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-30),
        dataset_size=100,
        batch_size=4,
        max_grad_norm=c,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=2,
        seed=3,
        engine=engine,
        clipping="automatic",
        clip_gamma=MIN_CLIP_GAMMA,
    )
    released = []
    mechanism.observer = lambda gradient: released.append(gradient)
    mechanism.step_drawn_chunks([batch])
    assert all(torch.isfinite(v).all() for v in released[0].values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_gamma_below_the_floor_is_refused_at_every_door(tmp_path, capsys):
    """make_private, ``dpscale train`` (whose run at 1e-40 trained NaN weights from a zero image) and an
    engine made without a plan refuse it before anything is released."""
    model = _bias_free_net()
    with pytest.raises(ConfigError, match="at least 1e-12"):
        dpscale.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset_size=100,
            batch_size=4,
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            delta=1e-5,
            steps=2,
            clipping="automatic",
            clip_gamma=1e-40,
        )
    argv = [
        "train",
        "--set",
        f"run.out_dir={tmp_path / 'r'}",
        "--set",
        "model.name=linear",
        "--set",
        "dp.clipping=automatic",
        "--set",
        "dp.clip_gamma=1e-40",
        "--quiet",
    ]
    one_line_error(capsys, argv, "dp.clip_gamma", "at least 1e-12", "1e-40")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="at least 1e-12"):
        _engine_sum("vmap", model, 1.0, _zero_and_tiny_batch(), gamma=1e-40)


def _tiny_input_large_backprop_net(scale: float) -> nn.Module:
    """Two bias-free linear layers, the second's weights times ``scale`` (1e15): an input of 1e-24 has
    ||a||^2 ~ 1e-48 (0 in float32) while its gradient ||g|| ||a|| ~ 1e-9 is an ordinary number."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4, bias=False), nn.Linear(4, 3, bias=False))
    with torch.no_grad():
        model[1].weight.mul_(scale)
    return model


@pytest.mark.parametrize(
    ("clip", "gamma", "scale"),
    [(1.0, MIN_CLIP_GAMMA, 1e15), (1e-8, None, 1e18)],
    ids=["automatic", "fixed"],
)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_factor_below_float32s_range_does_not_zero_the_norm(engine, clip, gamma, scale):
    """Issue 62's review: bk and ghost rounded each factor's sum of squares to float32 before
    multiplying, read the norm as 0 and released 1287 C (automatic, gamma 1e-12) or 1.28 C (fixed,
    C = 1e-8) for one example; the float64 loop releases 0.999 C and 0.56 C."""
    torch.manual_seed(1)
    batch = (torch.randn(1, 16) * 1e-24, torch.tensor([0]))
    grad_sum, _ = _engine_sum(
        engine, _tiny_input_large_backprop_net(scale), clip, batch, gamma=gamma
    )
    reference = float64_reference(
        _tiny_input_large_backprop_net(scale).double(),
        (batch[0].double(), batch[1]),
        clip,
        release_dtype=torch.float32,
        clip_gamma=gamma,
    )
    assert _released_norm(grad_sum) <= clip
    assert _released_norm(grad_sum) == pytest.approx(
        _released_norm(reference.clipped_sum), rel=1e-3
    )
