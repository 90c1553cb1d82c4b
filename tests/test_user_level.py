"""User-level DP through ``make_private`` (issue 43): removing ALL of one user's images moves the
released clipped sum by at most C on every engine, with AugMult, per-layer clipping and BandMF;
the same images as separate units (the example unit) move it by more (the test has teeth). Two
mechanisms of one seed take the same first step: their noise is the same draw and cancels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import dpscale
from dpscale.privacy.sampling.units import user_groups

C, U = 1.0, 8
SIZES = [3, 1, 4, 2, 4, 3, 1, 2]  # images per user, all <= k: every drawn user contributes them all
K_MAX = 4
ENGINES = ("auto", "bk", "ghost", "vmap")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))


def user_data(views: int = 1):
    """Users' images, large enough that one image's gradient exceeds C (each is clipped)."""
    g = torch.Generator().manual_seed(1)
    n = sum(SIZES)
    shape = (n, views, 1, 3, 4) if views > 1 else (n, 1, 3, 4)
    ids = np.repeat([f"user{u}" for u in range(U)], SIZES)
    return torch.randn(*shape, generator=g) * 3, torch.randint(0, 3, (n,), generator=g), ids


def released_first_step(x, y, ids, **options) -> dict[str, torch.Tensor]:
    """The first step's released gradient (noisy clipped sum / B) through the public API."""
    model = mlp()
    recipe = dict(
        dataset_size=len(y), max_grad_norm=C, noise_multiplier=1.0, delta=1e-5, steps=2, seed=3
    )
    users = len(set(ids.tolist())) if ids is not None else len(y)
    # q = 1 (p = b q = 1 for BandMF)
    batch = users if options.get("noise_mechanism") != "bandmf" else users / 2
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batch_size=batch,
        user_ids=ids,
        max_examples_per_user=K_MAX if ids is not None else None,
        **{**recipe, **options},
    )
    out: dict[str, torch.Tensor] = {}
    mechanism.observer = lambda gradient: out.update(
        {k: v.double() * batch for k, v in gradient.items()}
    )
    indices = mechanism.sample()
    mechanism.step(x[indices], y[indices], indices=indices)
    return out


def change(a: dict, b: dict) -> float:
    return float(sum((a[k] - b[k]).square().sum() for k in a).sqrt()) / C


def without_user(x, y, ids, user: str):
    keep = torch.from_numpy(ids != user)
    return x[keep], y[keep], ids[ids != user]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "options",
    [{}, {"augment_multiplicity": 2}, {"max_grad_norm": {"0.*": 0.6, "*": 0.8}}],
    ids=["plain", "augmult", "per-layer"],
)
def test_removing_all_of_one_users_images_moves_the_release_by_at_most_c(engine, options):
    views = options.get("augment_multiplicity", 1)
    x, y, ids = user_data(views)
    if "max_grad_norm" in options:
        # sqrt(0.6^2 + 0.8^2) = 1 = C
        options = {**options, "max_grad_norm": {"1.*": 0.6, "*": 0.8}}
    full = released_first_step(x, y, ids, engine=engine, **options)
    for user in ("user2", "user4"):  # 4 images each
        assert (
            change(
                full, released_first_step(*without_user(x, y, ids, user), engine=engine, **options)
            )
            <= 1.0 + 1e-5
        )
        outliers = x.clone()
        # replaced by outliers: at most 2C (replace-one)
        outliers[torch.from_numpy(ids == user)] *= 1e3
        assert (
            change(full, released_first_step(outliers, y, ids, engine=engine, **options))
            <= 2.0 + 1e-5
        )


@pytest.mark.parametrize("engine", ("bk", "vmap"))
def test_the_same_images_as_separate_units_move_the_release_by_more_than_c(engine):
    x, y, ids = user_data()
    full = released_first_step(x, y, None, engine=engine)
    keep = torch.from_numpy(ids != "user4")
    # 4 images, each clipped to C
    assert change(full, released_first_step(x[keep], y[keep], None, engine=engine)) > 1.5


def test_bandmf_groups_users_by_a_keyed_hash_and_bounds_a_users_change():
    x, y, ids = user_data()
    options = dict(engine="bk", noise_mechanism="bandmf", bands=2)
    full = released_first_step(x, y, ids, **options)
    seed = dpscale.train.seeds.run_seeds(3)["partition"]
    group = dict(
        zip(sorted(set(ids.tolist())), user_groups(np.array(sorted(set(ids.tolist()))), 2, seed))
    )
    first_step_users = [u for u in ("user2", "user4", "user0") if group[u] == 0]
    assert first_step_users, "no probed user in the first step's group (pick another seed)"
    for user in first_step_users:
        assert (
            change(full, released_first_step(*without_user(x, y, ids, user), **options))
            <= 1.0 + 1e-5
        )
    # the groups depend on each user's own id: removing one moves nobody else
    rest = np.array([u for u in sorted(group) if u != "user4"])
    assert user_groups(rest, 2, seed).tolist() == [group[u] for u in rest]


# ------------------------------------------------------------------ accounting and plan
def _dp_accounting_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    return accountant.get_epsilon(delta)


def test_the_user_level_epsilon_is_dp_accountings_at_users_per_step_over_users():
    """N counts users: 20 users of 1..4 images, 5 users per step -> q = 1/4, whatever the images."""
    ids = np.repeat(np.arange(20), np.arange(20) % 4 + 1)
    model = mlp()
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=len(ids),
        batch_size=5,
        max_grad_norm=C,
        noise_multiplier=1.5,
        delta=1e-3,
        steps=30,
        user_ids=ids,
        max_examples_per_user=2,
    )
    plan = mechanism.plan
    assert (plan.dataset_size, plan.sample_rate, plan.privacy_unit, plan.max_examples_per_user) == (
        20,
        0.25,
        "user",
        2,
    )
    # golden: dp_accounting 0.6.0's PLD of 30 Poisson(q=0.25) Gaussians (sigma 1.5) at delta 1e-3
    assert plan.epsilon == pytest.approx(_dp_accounting_epsilon(0.25, 1.5, 30, 1e-3), rel=1e-3)
    assert "N=20 users" in plan.describe() and "any one person's training images" in plan.meaning()
    assert "per user" in plan.status(plan.epsilon)


def test_the_example_unit_plan_is_unchanged():
    model = mlp()
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=100,
        batch_size=10,
        max_grad_norm=C,
        noise_multiplier=1.5,
        delta=1e-3,
        steps=30,
    )
    assert mechanism.plan.privacy_unit == "example" and "N=100," in mechanism.plan.describe()
    assert "any one training image" in mechanism.plan.meaning()


# ------------------------------------------------------------------ sampling through make_private
def test_each_user_joins_at_rate_q_with_at_most_k_images():
    sizes = np.array([1, 2, 6, 10] * 5)
    ids = np.repeat(np.arange(len(sizes)), sizes)
    model = mlp()
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=len(ids),
        batch_size=5,
        max_grad_norm=C,
        noise_multiplier=1.0,
        delta=1e-3,
        steps=4000,
        user_ids=ids,
        max_examples_per_user=3,
        seed=5,
    )
    joined, picked, draws = np.zeros(len(sizes)), np.zeros(len(ids)), 2000
    for _ in range(draws):
        indices = mechanism.sample()
        users = ids[indices.numpy()]
        counts = np.bincount(users, minlength=len(sizes))
        assert (counts <= 3).all() and (
            counts[counts > 0] == np.minimum(sizes, 3)[counts > 0]
        ).all()
        joined += counts > 0
        picked[indices.numpy()] += 1
        # a test's shortcut: draw again without a step
        mechanism._drawn = mechanism._drawn_offsets = None
    rate = joined / draws  # q = 5/20 = 0.25 per user, whatever its size
    assert np.abs(rate - 0.25).max() < 5 * np.sqrt(0.25 * 0.75 / draws)
    # a user of 10 images contributes each with probability 3/10 when drawn
    big = np.repeat(sizes == 10, sizes)
    share = picked[big] / np.repeat(joined, sizes)[big]
    assert np.abs(share - 0.3).max() < 5 * np.sqrt(0.3 * 0.7 / (draws * 0.25))


# ------------------------------------------------------------------ bad input
def _mechanism(**options):
    x, y, ids = user_data()
    model = mlp()
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=len(y),
        batch_size=U,
        max_grad_norm=C,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=3,
        seed=0,
        user_ids=ids,
        max_examples_per_user=K_MAX,
        **options,
    )
    return mechanism, x, y, model


def test_chunks_that_split_a_user_are_refused_before_anything_is_released():
    mechanism, x, y, model = _mechanism()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    indices = mechanism.sample()
    # user0 has 3 images
    chunks = [(x[indices[:2]], y[indices[:2]]), (x[indices[2:]], y[indices[2:]])]
    with pytest.raises(ValueError, match="splits a user") as refused:
        mechanism.step(chunks, indices=indices)
    assert "\n" not in str(refused.value) and mechanism.steps_taken == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="the chunks hold 3 examples but the drawn users hold"):
        mechanism.step([(x[indices[:3]], y[indices[:3]])], indices=indices)
    with pytest.raises(ValueError, match="other indices than the drawn ones in the drawn order"):
        mechanism.step(chunks, indices=indices.flip(0))
    with pytest.raises(ValueError, match="needs indices=") as refused:
        mechanism.step(x[indices], y[indices])
    assert "\n" not in str(refused.value) and mechanism.steps_taken == 0
    mechanism.step(x[indices], y[indices], indices=indices)  # the drawn batch itself goes through
    assert mechanism.steps_taken == 1


def test_examples_gathered_in_another_order_are_regrouped_by_user():
    """A loop that sorts or shuffles the drawn indices (harmless at the example unit) gets the
    same release: the step puts each user's examples back together (review finding: without
    indices= the step clipped mixed pseudo-users, 1.8C for one user's removal)."""
    released = []
    for order in (lambda i: i, lambda i: i.sort().values, lambda i: i.flip(0)):
        mechanism, x, y, _ = _mechanism()
        mechanism.observer = lambda gradient: released.append(gradient)
        indices = order(mechanism.sample())
        mechanism.step(x[indices], y[indices], indices=indices)
    for other in released[1:]:
        assert all(torch.equal(released[0][k], other[k]) for k in released[0])
    mechanism, x, y, _ = _mechanism()
    indices = mechanism.sample()
    with pytest.raises(ValueError, match="other indices than the drawn ones"):
        other = torch.cat([indices[:-1], indices[:1]])  # one example twice, another missing
        mechanism.step(x[other], y[other], indices=other)


def test_the_data_loader_cuts_chunks_at_users():
    mechanism, x, y, _ = _mechanism(max_physical_batch_size=5)
    dataset = torch.utils.data.TensorDataset(x, y)
    for chunks in mechanism.data_loader(dataset):
        assert all(len(c[1]) <= 5 for c in chunks)
        mechanism.step(chunks)  # the loader's chunks carry their indices
    assert mechanism.steps_taken == 3


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(user_ids=np.arange(5)), "user_ids need max_examples_per_user"),
        (dict(max_examples_per_user=2), "give user_ids"),
        (
            dict(user_ids=np.arange(5), max_examples_per_user=2),
            "user_ids holds 5 ids but dataset_size=24",
        ),
        (
            dict(
                user_ids=np.repeat(np.arange(12), 2),
                max_examples_per_user=4,
                max_physical_batch_size=3,
            ),
            "smaller than max_examples_per_user=4",
        ),
        (dict(user_ids=[None] * 24, max_examples_per_user=2), "has no user id"),
    ],
)
def test_bad_user_options_are_refused_in_one_line(options, message):
    model = mlp()
    with pytest.raises(ValueError, match=message) as refused:
        dpscale.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset_size=24,
            batch_size=2,
            max_grad_norm=C,
            noise_multiplier=1.0,
            delta=1e-5,
            steps=3,
            **options,
        )
    assert "\n" not in str(refused.value)


def test_a_user_level_mechanism_resumes_bit_identically_and_refuses_an_example_level_state():
    def run(steps_before_save: int | None):
        mechanism, x, y, model = _mechanism()
        if steps_before_save is not None:
            for _ in range(steps_before_save):
                i = mechanism.sample()
                mechanism.step(x[i], y[i], indices=i)
            state, weights = (
                mechanism.state_dict(),
                {k: v.clone() for k, v in model.state_dict().items()},
            )
            mechanism, x, y, model = _mechanism()
            model.load_state_dict(weights)
            mechanism.load_state_dict(state)
        drawn = []
        for indices in mechanism.batches():
            drawn.append(indices.tolist())
            mechanism.step(x[indices], y[indices], indices=indices)
        return drawn, model.state_dict()

    straight, resumed = run(None), run(1)
    assert straight[0][1:] == resumed[0]
    assert all(torch.equal(straight[1][k], resumed[1][k]) for k in straight[1])
    mechanism, *_ = _mechanism()
    with pytest.raises(ValueError, match="samples examples, not users"):
        mechanism.sampler.load_state_dict({"generator": mechanism.sampler.generator.state_dict()})


def test_adaptive_clipping_counts_users():
    mechanism, x, y, _ = _mechanism(clipping="adaptive", clip_count_noise=1.0)
    indices = mechanism.sample()
    stats = mechanism.step(x[indices], y[indices], indices=indices)
    assert stats.examples == U  # one norm per user, q = 1


# ------------------------------------------------------------------ Data Normalization and centring per user
@pytest.mark.parametrize("release", ["channel_mean", "feature_mean"])
def test_per_user_feature_statistics_move_by_at_most_the_clip_when_a_user_leaves(release):
    from dpscale.data.user_ids import UserIndex
    from dpscale.features.normalize import private_channel_mean, private_feature_mean
    from dpscale.rng import DPRandom

    g = torch.Generator().manual_seed(0)
    sizes = [5, 1, 8, 3, 6]
    ids = np.repeat(np.arange(5), sizes)
    # far beyond the clip
    x = torch.randn(len(ids), 3, 2, 2, generator=g, dtype=torch.float64) * 10 + 5
    x[ids == 3] = float("inf")  # a user with a non-finite image contributes zero, not NaN
    clip = 1.0

    def released_sum(keep: np.ndarray, users: bool) -> torch.Tensor:
        index = UserIndex.from_ids(ids[keep]) if users else None
        units = index.num_users if users else int(keep.sum())
        fn = private_channel_mean if release == "channel_mean" else private_feature_mean
        return (
            fn(
                x[torch.from_numpy(keep)], clip, 0.0, DPRandom(0), batch_size=4, users=index
            ).reshape(-1)
            * units
        )

    full = released_sum(np.ones(len(ids), bool), True)
    assert torch.isfinite(full).all()
    # an independent reference: each user's mean (float64 loop), clipped, summed
    per_row = (
        (lambda v: v.reshape(len(v), 3, -1).mean(2))
        if release == "channel_mean"
        else (lambda v: v.reshape(len(v), -1))
    )
    want = torch.zeros_like(full)
    for user in range(5):
        row = per_row(x[torch.from_numpy(ids == user)]).mean(0)
        if torch.isfinite(row).all():
            want += row * min(1.0, clip / float(row.norm()))
    assert torch.allclose(full, want, rtol=1e-9, atol=1e-9)
    worst_user = max(float((full - released_sum(ids != u, True)).norm()) for u in range(5))
    assert worst_user <= clip * (1 + 1e-9)
    example_level = float(
        (released_sum(np.ones(len(ids), bool), False) - released_sum(ids != 2, False)).norm()
    )
    assert example_level > 2 * clip  # 8 images, each clipped to the clip on its own


# ------------------------------------------------------------------ zoo models, LoRA, AugMult: per-user vs float64 loop
@pytest.mark.parametrize("engine", ["bk", "ghost", "vmap"])
@pytest.mark.parametrize(
    "name, shape, peft",
    [
        ("papernot-cnn", (1, 16, 16), "none"),
        ("tramer-cifar-cnn-small", (3, 8, 8), "none"),
        pytest.param("vit-tiny", (3, 8, 8), "none", marks=pytest.mark.slow),
        ("papernot-cnn", (1, 16, 16), "lora"),
    ],
)
def test_zoo_models_clip_per_user_as_the_float64_per_user_loop(engine, name, shape, peft):
    """Users of 1..3 images with K = 2 AugMult views each, through user_rows and the user-unit
    engine options, against the float64 reference summing each user's per-image gradients."""
    from dpscale.models import build_model
    from dpscale.models.peft import apply_peft
    from dpscale.privacy import make_engine
    from dpscale.privacy.clipping.per_example import (
        trainable_params,
        user_engine_options,
        user_rows,
    )
    from dpscale.privacy.clipping.reference import per_example_reference

    torch.manual_seed(0)
    model = build_model(name, 4, shape).double()
    apply_peft(model, peft, rank=2)
    sizes, k, views = [3, 1, 2], 3, 2
    offsets = torch.tensor([0, *np.cumsum(sizes).tolist()])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), views, *shape, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, 4, (sum(sizes),), generator=g)
    clip = {"*": 0.3} if peft == "lora" else 0.3
    want = per_example_reference(model, (x, y), clip, views=views, unit_offsets=offsets)
    engine_views, loss = user_engine_options(k, views, None)
    try:
        chosen, _ = make_engine(engine, clip, model, views=engine_views, loss_fn=loss)
    # an engine that does not support a layer refuses it (auto takes vmap)
    except ValueError as err:
        pytest.skip(f"{engine}: {err}")
    got, norms = chosen.per_example_clipped_sum(
        model, trainable_params(model), user_rows((x, y, offsets), k, views)
    )
    torch.testing.assert_close(norms, want.norms, rtol=1e-8, atol=1e-12)
    for param, ref in want.clipped_sum.items():
        torch.testing.assert_close(got[param], ref, rtol=1e-8, atol=1e-12)


def test_engine_ghost_at_the_user_unit_warns_of_its_k_squared_cost():
    x, y, ids = user_data()
    model = mlp()
    with pytest.warns(UserWarning, match=r"engine ghost at the user unit \(k=4\).*grow as k\^2"):
        dpscale.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset_size=len(y),
            batch_size=2,
            max_grad_norm=C,
            noise_multiplier=1.0,
            delta=1e-5,
            steps=2,
            engine="ghost",
            user_ids=ids,
            max_examples_per_user=K_MAX,
        )


def test_a_state_is_refused_by_a_mechanism_with_other_user_ids():
    """Another grouping of the same examples into people (review finding): each part of the run
    would protect another person, so the state is refused before anything is loaded."""
    mechanism, x, y, _ = _mechanism()
    indices = mechanism.sample()
    mechanism.step(x[indices], y[indices], indices=indices)
    state = mechanism.state_dict()
    _, _, ids = user_data()
    model = mlp()
    other = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=len(y),
        batch_size=U,
        max_grad_norm=C,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=3,
        seed=0,
        user_ids=np.roll(ids, 1),
        max_examples_per_user=K_MAX,
    )
    other.model.load_state_dict(mechanism.model.state_dict())
    with pytest.raises(ValueError, match="another grouping of the examples into users"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="user ids are not the ones this run was sampled with"):
        other.sampler.load_state_dict(state["sampler"])


def test_at_the_example_unit_indices_are_optional_and_checked_when_given():
    model = mlp()
    x, y, _ = user_data()
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=len(y),
        batch_size=len(y),
        max_grad_norm=C,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=3,
        seed=0,
    )
    indices = mechanism.sample()
    with pytest.raises(ValueError, match="other indices than the drawn ones"):
        mechanism.step(x[indices], y[indices], indices=torch.cat([indices[:-1], indices[:1]]))
    # any order of the drawn ones
    mechanism.step(x[indices.flip(0)], y[indices.flip(0)], indices=indices.flip(0))
    indices = mechanism.sample()
    mechanism.step(x[indices], y[indices])  # without indices: as before
    assert mechanism.steps_taken == 2


# ------------------------------------------------------------------ the adversarial doors at the user unit
class _CentreInTraining(nn.Module):
    """Centres its input over the batch (rows of every user) in training mode: mixes examples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True) if self.training else x


def test_the_adversarial_cases_through_make_private_at_the_user_unit():
    x, y, ids = user_data()
    # a layer that mixes examples: refused at the first step, nothing released
    torch.manual_seed(0)
    mixing = nn.Sequential(
        nn.Flatten(), nn.Linear(12, 8), _CentreInTraining(), nn.Tanh(), nn.Linear(8, 3)
    )
    mechanism = dpscale.make_private(
        mixing,
        torch.optim.SGD(mixing.parameters(), lr=0.1),
        dataset_size=len(y),
        batch_size=U,
        max_grad_norm=C,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=3,
        seed=0,
        user_ids=ids,
        max_examples_per_user=K_MAX,
        engine="bk",
    )
    indices = mechanism.sample()
    with pytest.raises(ValueError, match="mixes examples"):
        mechanism.step(x[indices], y[indices], indices=indices)
    assert mechanism.steps_taken == 0
    # a step the mechanism did not start, and a state loaded twice
    mechanism, x, y, _ = _mechanism()
    with pytest.raises(RuntimeError, match="none was drawn"):
        mechanism.step(x, y, indices=torch.arange(len(y)))
    indices = mechanism.sample()
    mechanism.step(x[indices], y[indices], indices=indices)
    with pytest.raises(RuntimeError, match="has taken 1 step"):
        mechanism.load_state_dict(mechanism.state_dict())
    # an image that overflows: its user contributes zero, so the release stays finite and within C
    # of the clean data's
    bad = x.clone()
    bad[int(np.flatnonzero(ids == "user4")[0])] = float("inf")
    released = [
        released_first_step(bad, y, ids, engine="bk"),
        released_first_step(x, y, ids, engine="bk"),
    ]
    assert all(torch.isfinite(v).all() for v in released[0].values())
    assert 0.0 < change(released[0], released[1]) <= 1.0 + 1e-5
