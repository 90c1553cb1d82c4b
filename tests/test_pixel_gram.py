"""The im2col-free Gram of convolutions (any stride and dilation) (issue 44): each example's squared weight-gradient
norm from the Gram of the padded input's pixels, k x k shifted blocks summed, against a float64
per-example loop; never below the exact value (the rounding bound holds); and bk's step on a
model whose small-output convolutions take it, against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpscale.privacy import make_engine

from dpscale.privacy.clipping.ghost import conv as ghost_conv
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.reference import per_example_reference


class _Record:
    def __init__(self, module: nn.Module, views: int) -> None:
        self.module, self.views = module, views


@pytest.mark.parametrize(
    "cin, cout, kernel, padding, size, views, stride, dilation",
    [
        (8, 16, 3, 1, 8, 1, 1, 1),
        (3, 5, 3, 0, 10, 2, 1, 1),
        (4, 6, 5, 2, 6, 1, 1, 1),
        (2, 3, 1, 0, 7, 3, 1, 1),
        (5, 4, (3, 1), (1, 0), 9, 1, 1, 1),
        (6, 8, 3, 1, 9, 1, 2, 1),
        (4, 5, 3, 1, 8, 2, (2, 1), 1),
        (3, 4, 1, 0, 8, 1, 2, 1),
        (3, 4, 3, 2, 9, 1, 1, 2),
        (3, 4, 3, 1, 11, 1, 3, 2),
    ],
)
def test_pixel_gram_norms_are_the_per_example_loops_and_never_below(
    cin, cout, kernel, padding, size, views, stride, dilation
):
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, kernel, padding=padding, stride=stride, dilation=dilation).double()
    batch = 4
    a = torch.randn(batch * views, cin, size, size, dtype=torch.float64) * 3
    g = torch.randn_like(conv(a))
    got, weight = ghost_conv._pixel_gram_sq_norms(_Record(conv, views), a, g)
    exact = torch.stack(
        [
            torch.nn.grad.conv2d_weight(
                a[i * views : (i + 1) * views],
                conv.weight.shape,
                g[i * views : (i + 1) * views],
                padding=conv.padding,
                stride=conv.stride,
                dilation=conv.dilation,
            )
            .square()
            .sum()
            for i in range(batch)
        ]
    )
    assert bool((got >= exact).all())  # an upper bound: a clipped contribution never exceeds C
    torch.testing.assert_close(got, exact, rtol=1e-8, atol=0)
    assert bool((weight > 0).all())


def test_only_plain_ungrouped_convolutions_take_it():
    assert ghost_conv._pixel_gram_eligible(nn.Conv2d(3, 4, 3, padding=1))
    assert ghost_conv._pixel_gram_eligible(nn.Conv2d(3, 4, 3, stride=2))
    assert ghost_conv._pixel_gram_eligible(nn.Conv2d(3, 4, 3, dilation=2))
    assert not ghost_conv._pixel_gram_eligible(nn.Conv2d(4, 4, 3, groups=2))
    assert not ghost_conv._pixel_gram_eligible(nn.Conv2d(3, 4, 3, padding_mode="reflect"))
    assert not ghost_conv._pixel_gram_eligible(nn.Conv2d(3, 4, 3, padding="same"))
    assert not ghost_conv._pixel_gram_eligible(nn.Conv1d(3, 4, 3))


@pytest.mark.parametrize("engine", ["bk", "ghost"])
def test_bk_on_small_output_convolutions_matches_the_float64_reference(engine, monkeypatch):
    """8x8 outputs with 64 channels: the pixel Gram is far cheaper than instantiating or unfolding."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    ).double()
    conv = model[2]
    length = 64
    # it is chosen
    assert (
        ghost_conv._pixel_gram_cost(conv, torch.zeros(1, 64, 8, 8), length, 1)
        < length * 64 * 9 * 64
    )
    calls = []
    real = ghost_conv._pixel_gram_sq_norms
    monkeypatch.setattr(
        ghost_conv, "_pixel_gram_sq_norms", lambda r, a, g: calls.append(r.module) or real(r, a, g)
    )
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (6,))
    want = per_example_reference(model, (x, y), 0.5)
    chosen, _ = make_engine(engine, 0.5, model)
    got, norms = chosen.per_example_clipped_sum(model, trainable_params(model), (x, y))
    torch.testing.assert_close(norms, want.norms, rtol=1e-7, atol=0)
    for name, ref in want.clipped_sum.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-7, atol=1e-10)
    assert conv in calls
