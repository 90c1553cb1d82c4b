"""Augmentation multiplicity (TAN eq. 5): each example's gradient is the mean of its K views'
gradients, clipped once. Checked against a float64 per-example loop for every engine."""

import pytest
import torch
from torch import nn

from dpscale.models import build_model, default_input_shape
from dpscale.privacy.clipping.engines import make_engine, supported_engines
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.reference import float64_reference
from zoo import (
    assert_matches_float64,
    SMALL_INPUT,
    build_zoo_model,
    engines_besides_auto,
    zoo_cases,
)


# Engines compute in float32 and are compared with a float64 reference. A float32 gradient entry
# carries the rounding of every product summed into it (units of 6e-8 relative to the largest of
# them, grown with depth), so its error is judged relative to the scale of the per-example
# gradients of that tensor: never absolutely on a clipped sum whose examples cancel, which depends
# on the CPU's summation order. The bound is the engines' own float32 tolerance (the self-check's):
# measured errors on the zoo are <= 1e-5 of that scale; a missed route, a view summed instead of
# averaged or a wrong clip factor errs by > 1e-2 of it.


def float64_augmult_reference(model, x, y, max_grad_norm):
    """sum_i clip(mean_k grad loss(model(x[i, k]), y[i])), one example (its K views) at a time, on
    a float64 copy of the model and inputs (``float64_reference``).

    Args:
        model: the model (left untouched); x: (B, K, ...) views; y: (B,) labels.
        max_grad_norm: clipping norm C.
    """
    return float64_reference(model, (x, y), max_grad_norm, views=x.shape[1])


# Small inputs keep the loop fast; every registered family is covered (conv, linear, GroupNorm,
# LayerNorm, class-token/position embeddings, weight-standardised convs); the heavy models only in
# the slow suite (test_engines.HEAVY_MODELS: their layers are those of smaller ones). wrn16-4 (~6 s) too:
# its residual GroupNorm convs are resnet18-gn's, which stays in the default suite.
@pytest.mark.parametrize(
    "name", [pytest.param(c, marks=pytest.mark.slow) if c == "wrn16-4" else c for c in zoo_cases()]
)
def test_every_engine_clips_the_mean_of_the_views_gradients(name):
    torch.manual_seed(0)
    model, shape = build_zoo_model(name)
    n, views = 2, 3  # three distinct views: a mean taken over the first and last alone would show
    x = torch.randn(n, views, *shape)
    y = torch.randint(0, 10, (n,))
    reference = float64_augmult_reference(model, x, y, 0.5)
    params = trainable_params(model)
    assert "auto" in supported_engines(model)
    # auto: the engine it builds, checked
    for engine_name in engines_besides_auto(model, 0.5, views=views):
        engine, _ = make_engine(engine_name, 0.5, model, views=views)
        grad_sum, norms = engine.per_example_clipped_sum(model, params, (x, y))
        assert_matches_float64(grad_sum, norms, reference, engine_name)


# wrn16-4 and vit-tiny only in the slow suite: with identical views the mean of the views'
# gradients is the plain gradient, so their AugMult path is already checked, by every engine against
# the same float64 reference, in test_every_engine_clips_the_mean_of_the_views_gradients[wrn16-4 /
# vit-tiny] (3 distinct views), and their plain path in test_engines (every engine, every model).
@pytest.mark.parametrize(
    "name",
    [
        "papernot-cnn",
        "tramer-cifar-cnn-small",
        pytest.param("wrn16-4", marks=pytest.mark.slow),
        pytest.param("vit-tiny", marks=pytest.mark.slow),
        "linear",
    ],
)
def test_identical_views_equal_plain_dp_sgd_for_every_engine(name):
    torch.manual_seed(1)
    shape = SMALL_INPUT.get(name, default_input_shape(name))
    model = build_model(name, 10, shape)
    x = torch.randn(5, *shape)
    y = torch.randint(0, 10, (5,))
    params = trainable_params(model)
    reference = float64_reference(model, (x, y), 1.0)  # plain DP-SGD: one view each
    engine_names = engines_besides_auto(model, 1.0, views=4)  # auto: the engine it builds, checked
    assert engine_names == engines_besides_auto(model, 1.0)
    for engine_name in engine_names:
        plain, _ = make_engine(engine_name, 1.0, model)
        augmult, _ = make_engine(engine_name, 1.0, model, views=4)
        # both against float64, not against each other: 5 and 20 rows may take different float32 kernels
        for engine, batch in (
            (plain, (x, y)),
            (augmult, (x.unsqueeze(1).expand(-1, 4, *shape), y)),
        ):
            grad_sum, norms = engine.per_example_clipped_sum(model, params, batch)
            assert_matches_float64(
                grad_sum, norms, reference, f"{engine_name} views={engine.views}"
            )


def test_wrong_number_of_views_is_a_clear_error():
    model = build_model("linear", 10, (1, 4, 4))
    engine, _ = make_engine("bk", 1.0, model, views=3)
    with pytest.raises(ValueError, match="expected 3 views"):
        engine.per_example_clipped_sum(
            model,
            trainable_params(model),
            (torch.randn(2, 2, 1, 4, 4), torch.zeros(2, dtype=torch.long)),
        )


@pytest.mark.parametrize(
    "conv, size",
    [
        (nn.Conv2d(64, 128, 3, padding=1), 2),  # few positions, wide layer: Gram ("ghost") norms
        (nn.Conv2d(1, 4, 3), 10),  # thin input: im2col + bmm per-example gradients
        (nn.Conv2d(16, 24, 3, stride=2, padding=1, groups=2), 12),  # grouped convolution path
        (nn.Conv1d(8, 6, 3, dilation=2), 20),
    ],
)
def test_every_conv_path_with_views(conv, size):
    torch.manual_seed(2)
    two_d = isinstance(conv, nn.Conv2d)
    shape = (conv.in_channels, size, size) if two_d else (conv.in_channels, size)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(5))
    model(torch.zeros(1, *shape))  # materialise the lazy layer
    x, y = torch.randn(4, 3, *shape), torch.randint(0, 5, (4,))
    reference = float64_augmult_reference(model, x, y, 0.7)
    for engine_name in ("vmap", "ghost", "bk"):
        engine, _ = make_engine(engine_name, 0.7, model, views=3)
        grad_sum, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
        assert_matches_float64(grad_sum, norms, reference, engine_name)
