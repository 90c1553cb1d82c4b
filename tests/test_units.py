"""Privacy units (issue 43), first pieces: users' examples grouped, users Poisson-sampled with at
most k examples each, and the per-user form of the float64 reference loop."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpscale.data.user_ids import UserIndex

from dpscale.privacy.sampling.units import UserPoissonSampler
from dpscale.privacy.clipping.bounds import clip_margin
from dpscale.privacy.clipping.reference import per_example_reference
from dpscale.rng import DPRandom


def test_examples_are_grouped_by_user_and_a_missing_id_is_refused():
    users = UserIndex.from_ids(["b", "a", "b", "c", "a", "b"])
    assert users.ids.tolist() == ["a", "b", "c"] and users.sizes.tolist() == [2, 3, 1]
    groups = [users.examples[users.offsets[u] : users.offsets[u + 1]].tolist() for u in range(3)]
    assert groups == [[1, 4], [0, 2, 5], [3]]
    for bad, where in (
        ([1.0, float("nan")], "example 1 has no user id"),
        (["a", None], "example 1"),
        (["a", ""], "empty"),
    ):
        with pytest.raises(ValueError, match=where):
            UserIndex.from_ids(np.array(bad, dtype=object if None in bad else None))


def _sizes_index(sizes: list[int]) -> UserIndex:
    return UserIndex.from_ids(np.repeat(np.arange(len(sizes)), sizes))


def test_each_user_joins_a_step_with_probability_q_whatever_its_size():
    sizes = [1, 2, 5, 20] * 25  # 100 users
    users, q, steps = _sizes_index(sizes), 0.1, 3000
    sampler = UserPoissonSampler(users, q, 4, DPRandom(7))
    joined = np.zeros(users.num_users)
    user_of = np.repeat(np.arange(users.num_users), sizes)
    for step in range(steps):
        batch = sampler.sample_units()
        first = batch.indices[batch.offsets[:-1]].numpy()  # one example names each drawn user
        joined[user_of[first]] += 1
        if step < 50:  # each unit: min(size, k) distinct examples of one user, ascending
            for a, b in zip(batch.offsets[:-1].tolist(), batch.offsets[1:].tolist()):
                unit = batch.indices[a:b].numpy()
                owner = user_of[unit[0]]
                assert (user_of[unit] == owner).all() and len(unit) == min(sizes[owner], 4)
                assert (np.diff(unit) > 0).all()
    sd = math.sqrt(steps * q * (1 - q))
    assert np.abs(joined - steps * q).max() < 5 * sd  # every user, 5 standard deviations
    by_size = [joined[np.array(sizes) == s].mean() for s in (1, 2, 5, 20)]
    assert max(by_size) - min(by_size) < 5 * sd / math.sqrt(25)  # no size is favoured


def test_a_drawn_user_contributes_min_size_k_of_its_own_examples_chosen_uniformly():
    users, k = _sizes_index([10, 3, 1]), 3
    sampler = UserPoissonSampler(users, 1.0, k, DPRandom(3))
    picked = np.zeros(10)
    for _ in range(4000):
        batch = sampler.sample_units()
        assert batch.offsets.tolist() == [0, 3, 6, 7]  # min(size, k) each, users consecutive
        units = [batch.indices[a:b].tolist() for a, b in zip(batch.offsets[:-1], batch.offsets[1:])]
        assert set(units[0]) <= set(range(10)) and len(set(units[0])) == 3
        assert units[1] == [10, 11, 12] and units[2] == [13]
        picked[units[0]] += 1
    sd = math.sqrt(4000 * 0.3 * 0.7)
    # each of the 10 examples in 3/10 of the draws
    assert np.abs(picked - 4000 * 0.3).max() < 5 * sd


def test_the_sampler_resumes_where_it_stood():
    users = _sizes_index([4, 1, 7, 2, 9])
    a = UserPoissonSampler(users, 0.5, 2, DPRandom(11))
    for _ in range(5):
        a.sample()
    b = UserPoissonSampler(users, 0.5, 2, DPRandom(99))
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert torch.equal(a.sample(), b.sample())


@pytest.mark.parametrize("bad", [0, 1.5, True, -2])
def test_a_bad_k_or_q_is_refused(bad):
    users = _sizes_index([2, 2])
    with pytest.raises(ValueError, match="max_examples_per_user"):
        UserPoissonSampler(users, 0.5, bad, DPRandom(0))
    with pytest.raises(ValueError, match="sample_rate"):
        UserPoissonSampler(users, 0.0, 2, DPRandom(0))


def _user_loop(model, x, y, offsets, clip):
    """Independent float64 per-user clipped sum: one backward pass over each user's summed loss
    (which is the sum of its examples' gradients), clipped as one vector to C (1 - m)."""
    params = list(model.parameters())
    total, norms = [torch.zeros_like(p) for p in params], []
    for a, b in zip(offsets[:-1], offsets[1:]):
        loss = nn.functional.cross_entropy(model(x[a:b]), y[a:b], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        factor = min(1.0, clip * (1 - clip_margin(torch.float64)) / (norm + 1e-6))
        for t, g in zip(total, grads):
            t += factor * g
        norms.append(norm)
    return total, norms


def test_the_reference_clips_each_users_summed_gradient_as_one_vector():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(9, 6, dtype=torch.float64) * 3, torch.randint(0, 3, (9,))
    offsets = [0, 4, 5, 9]  # users of 4, 1 and 4 examples
    want, want_norms = _user_loop(model, x, y, offsets, clip=1.0)
    got = per_example_reference(model, (x, y), 1.0, unit_offsets=offsets)
    assert got.norms.tolist() == pytest.approx(want_norms, rel=1e-12)
    for (name, _), w in zip(model.named_parameters(), want):
        torch.testing.assert_close(got.clipped_sum[name], w, rtol=1e-12, atol=1e-15)
    # per example (the default unit) is a different mechanism on the same data: the test has teeth
    per_example = per_example_reference(model, (x, y), 1.0)
    assert len(per_example.norms) == 9
    assert not torch.allclose(per_example.clipped_sum["0.weight"], got.clipped_sum["0.weight"])


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    ).double()


def _user_batch(sizes: list[int], scale: float = 1.0):
    g = torch.Generator().manual_seed(2)
    n = sum(sizes)
    x = torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64) * scale
    offsets = torch.tensor([0, *np.cumsum(sizes).tolist()])
    return x, torch.randint(0, 3, (n,), generator=g), offsets


@pytest.mark.parametrize("name", ["vmap", "bk", "ghost"])
def test_every_engine_refuses_an_unpadded_chunk_of_users_in_one_line(name):
    from dpscale.privacy import make_engine
    from dpscale.privacy.clipping.per_example import trainable_params

    model = _conv_net()
    x, y, offsets = _user_batch([2, 2])
    engine, _ = make_engine(name, 1.0, model)
    with pytest.raises(ValueError, match=f"engine {name} takes a chunk of users as padded_units"):
        engine.per_example_clipped_sum(model, trainable_params(model), (x, y, offsets))


class _UnitNorm(nn.Module):
    """Divides each row by its norm: a zero padding row would make it NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.flatten(1).norm(dim=1).view(-1, *([1] * (x.dim() - 1)))


def _grouped_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        _UnitNorm(),
        nn.Conv2d(1, 3, 3),
        nn.GroupNorm(1, 3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 3),
    ).double()


@pytest.mark.parametrize("name", ["vmap", "bk", "ghost"])
@pytest.mark.parametrize("clip", [0.5, {"1.*": 0.2, "*": 0.4}])
def test_every_engine_clips_users_padded_to_k_rows_as_the_float64_per_user_loop(name, clip):
    """A user's examples as the rows of one AugMult example (views=k), padding rows labelled to
    add nothing: the engines' own rules give per-user norms and clipped sums."""
    from dpscale.privacy import make_engine
    from dpscale.privacy.clipping.per_example import padded_units, trainable_params, user_sum_loss

    model = _grouped_net()
    x, y, offsets = _user_batch([3, 1, 4, 2], scale=3.0)
    want = per_example_reference(model, (x, y), clip, unit_offsets=offsets)
    engine, _ = make_engine(name, clip, model, views=4, loss_fn=user_sum_loss(4))
    got, norms = engine.per_example_clipped_sum(
        model, trainable_params(model), padded_units((x, y, offsets), 4)
    )
    # padding copies the user's own first example, never zeros
    assert bool(torch.isfinite(norms).all())
    torch.testing.assert_close(norms, want.norms, rtol=1e-9, atol=0)
    for param, ref in want.clipped_sum.items():
        torch.testing.assert_close(got[param], ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["vmap", "bk", "ghost"])
def test_leave_one_user_out_moves_a_padded_release_by_at_most_c(name):
    """All of one user's images removed (four copies of one outlier): at most C, no tolerance; the
    same images as separate units move the release by 4C (the test has teeth)."""
    from dpscale.privacy import make_engine
    from dpscale.privacy.clipping.per_example import padded_units, trainable_params, user_sum_loss

    model, clip = _conv_net(), 0.5
    x, y, offsets = _user_batch([4, 2, 3])
    x[:4], y[:4] = 1e3 * x[0], y[0]  # user 0: four copies of one outlier
    engine, _ = make_engine(name, clip, model, views=4, loss_fn=user_sum_loss(4))
    params = trainable_params(model)
    full = engine.per_example_clipped_sum(model, params, padded_units((x, y, offsets), 4))[0]
    rest = engine.per_example_clipped_sum(
        model, params, padded_units((x[4:], y[4:], offsets[1:] - 4), 4)
    )[0]
    assert math.sqrt(sum(float((full[k] - rest[k]).square().sum()) for k in full)) <= clip
    per_image, _ = make_engine(name, clip, model)
    images = per_image.per_example_clipped_sum(model, params, (x, y))[0]
    rest_images = per_image.per_example_clipped_sum(model, params, (x[4:], y[4:]))[0]
    assert (
        math.sqrt(sum(float((images[k] - rest_images[k]).square().sum()) for k in full))
        > 3.9 * clip
    )
    with pytest.raises(ValueError, match="every user needs 1 to 3 examples"):
        padded_units((x, y, offsets), 3)


def test_a_held_out_split_by_users_never_puts_one_user_on_both_sides():
    from dpscale.data.splits import hashed_holdout

    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(300), rng.integers(1, 12, 300))  # users of 1 to 11 images
    rng.shuffle(ids)
    train, test = hashed_holdout(ids, 1 / 6, "ids")
    assert not set(ids[train]) & set(ids[test])  # no user on both sides
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(len(ids)))
    assert abs(len(np.unique(ids[test])) - 50) < 20  # about a sixth of the users (binomial sd 6.5)
    # each user decides alone: order does not matter
    again, _ = hashed_holdout(ids[::-1], 1 / 6, "ids")
    assert np.array_equal(np.unique(ids[train]), np.unique(ids[::-1][again]))
    with pytest.raises(ValueError, match="fraction"):
        hashed_holdout(ids, 1.0, "ids")


def test_users_of_one_example_are_the_chunk_as_it_is():
    from dpscale.privacy.clipping.per_example import padded_units

    x, y, _ = _user_batch([1, 1, 1])
    xs, ys = padded_units((x, y, torch.arange(4)), 1)
    assert xs is x and ys is y
    with pytest.raises(ValueError, match="rise from 0 to the chunk's 3 rows"):
        padded_units((x, y, torch.tensor([0, 1, 2])), 1)
