"""Augmentation multiplicity (TAN eq. 5): each example's gradient is the mean of its K views'
gradients, clipped once. Checked against a naive per-example, per-view loop for every engine."""

import pytest
import torch
from torch import nn

from dpscale.models import build_model, default_input_shape, list_models
from dpscale.privacy.engines import make_engine, supported_engines
from dpscale.privacy.per_example import clip_factors, trainable_params

# Small inputs keep the loop fast; every registered family is covered (conv, linear, GroupNorm,
# LayerNorm, class-token/position embeddings).
SMALL_INPUT = {"resnet18-gn": (3, 32, 32), "resnet50-gn": (3, 32, 32), "nf-resnet50": (3, 32, 32),
               "vit-tiny": (3, 32, 32), "vit-small": (3, 32, 32)}
HEAVY = {"resnet50-gn", "nf-resnet50", "vit-small"}  # the naive loop over B*K views is slow for these


def naive_augmult_clipped_sum(model, x, y, max_grad_norm):
    """sum_i clip(mean_k grad loss(model(x[i, k]), y[i])), one view at a time."""
    params = trainable_params(model)
    live = dict(model.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i in range(x.shape[0]):
        mean = {n: torch.zeros_like(p) for n, p in params.items()}
        for k in range(x.shape[1]):
            loss = nn.functional.cross_entropy(model(x[i, k : k + 1]), y[i : i + 1])
            grads = torch.autograd.grad(loss, [live[n] for n in params])
            for n, g in zip(params, grads):
                mean[n] += g / x.shape[1]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in mean.values()))
        factor = clip_factors(norm.view(1), max_grad_norm)[0]
        for n in total:
            total[n] += factor * mean[n]
        norms.append(norm)
    return total, torch.stack(norms)


@pytest.mark.parametrize("name", [n for n in list_models() if n not in HEAVY])
def test_every_engine_clips_the_mean_of_the_views_gradients(name):
    torch.manual_seed(0)
    shape = SMALL_INPUT.get(name, default_input_shape(name))
    model = build_model(name, 10, shape)
    n, views = 3, 3
    x = torch.randn(n, views, *shape)
    y = torch.randint(0, 10, (n,))
    expected, expected_norms = naive_augmult_clipped_sum(model, x, y, 0.5)
    params = trainable_params(model)
    for engine_name in supported_engines(model):
        engine, _ = make_engine(engine_name, 0.5, model, views=views)
        grad_sum, norms = engine.per_example_clipped_sum(model, params, (x, y))
        torch.testing.assert_close(norms, expected_norms, rtol=1e-4, atol=1e-6, msg=f"{engine_name} norms")
        for p, ref in expected.items():
            torch.testing.assert_close(grad_sum[p], ref, rtol=1e-4, atol=1e-6, msg=f"{engine_name} {p}")


@pytest.mark.parametrize("name", ["papernot-cnn", "tramer-cifar-cnn-small", "wrn16-4", "vit-tiny", "linear"])
def test_identical_views_equal_plain_dp_sgd_for_every_engine(name):
    torch.manual_seed(1)
    shape = SMALL_INPUT.get(name, default_input_shape(name))
    model = build_model(name, 10, shape)
    x = torch.randn(5, *shape)
    y = torch.randint(0, 10, (5,))
    params = trainable_params(model)
    for engine_name in supported_engines(model):
        plain, _ = make_engine(engine_name, 1.0, model)
        augmult, _ = make_engine(engine_name, 1.0, model, views=4)
        ref_sum, ref_norms = plain.per_example_clipped_sum(model, params, (x, y))
        grad_sum, norms = augmult.per_example_clipped_sum(model, params, (x.unsqueeze(1).expand(-1, 4, *shape), y))
        torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-6)
        for p, ref in ref_sum.items():
            torch.testing.assert_close(grad_sum[p], ref, rtol=1e-5, atol=1e-6, msg=f"{engine_name} {p}")


def test_wrong_number_of_views_is_a_clear_error():
    model = build_model("linear", 10, (1, 4, 4))
    engine, _ = make_engine("bk", 1.0, model, views=3)
    with pytest.raises(ValueError, match="expected 3 views"):
        engine.per_example_clipped_sum(model, trainable_params(model), (torch.randn(2, 2, 1, 4, 4), torch.zeros(2, dtype=torch.long)))


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
    expected, expected_norms = naive_augmult_clipped_sum(model, x, y, 0.7)
    for engine_name in ("vmap", "ghost", "bk"):
        engine, _ = make_engine(engine_name, 0.7, model, views=3)
        grad_sum, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
        torch.testing.assert_close(norms, expected_norms, rtol=1e-4, atol=1e-6, msg=engine_name)
        for p, ref in expected.items():
            torch.testing.assert_close(grad_sum[p], ref, rtol=1e-4, atol=1e-6, msg=f"{engine_name} {p}")
