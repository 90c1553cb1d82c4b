"""The ghost engines' batched pass (issue 63): with one bound C, the small cached gradients' squares
and the instantiated weights' block norms of every layer are summed in one float64 pass
(``ghost_model.add_deferred_norms``) and the small gradients released in one product
(``ghost_model.released_all``). Per-layer bounds keep each tensor's own norm and release: the
same model under ``{"*": C}`` (one group, the same clipping) is the independent reference here,
and both are checked against the float64 per-example loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpscale.models import build_model
from dpscale.privacy.clipping.ghost.engine import GhostEngine
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.reference import per_example_reference


def _cases() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    return {
        "papernot-cnn": (build_model("papernot-cnn", 10, (1, 28, 28)), (1, 28, 28)),
        "norm layers": (
            nn.Sequential(
                nn.Conv2d(3, 4, 3),
                nn.GroupNorm(2, 4),
                nn.Tanh(),
                nn.Flatten(),
                nn.LayerNorm(64),
                nn.Linear(64, 5),
            ),
            (3, 6, 6),
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_the_batched_pass_gives_each_layers_norm_and_sum_as_per_tensor_records_do(case, mode):
    model, shape = _cases()[case]
    model = model.double()
    x, y = torch.randn(6, *shape, dtype=torch.float64), torch.randint(0, 5, (6,))
    params = trainable_params(model)
    batched = GhostEngine(0.05, mode=mode)
    grouped = GhostEngine({"*": 0.05}, mode=mode)  # per-layer bounds: nothing deferred
    got, got_norms, _, got_layers = batched.clip_with_layer_norms(model, params, (x, y))
    want, want_norms, _, want_layers = grouped.clip_with_layer_norms(model, params, (x, y))
    assert set(got_layers) == set(want_layers)
    for name in want_layers:
        torch.testing.assert_close(got_layers[name], want_layers[name], rtol=1e-12, atol=0)
    torch.testing.assert_close(got_norms, want_norms, rtol=1e-12, atol=0)
    reference = per_example_reference(model, (x, y), 0.05)
    torch.testing.assert_close(got_norms, reference.norms, rtol=1e-7, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(got[name], reference.clipped_sum[name], rtol=1e-7, atol=1e-10)


def test_a_non_finite_example_adds_nothing_through_the_batched_release():
    """Its rows of the small cached gradients are zeroed after the norms are read, before the one
    product that releases them (0 * inf would be NaN in every bias)."""
    model, shape = _cases()["norm layers"]
    x, y = torch.randn(5, *shape), torch.randint(0, 5, (5,))
    x[2] = torch.inf
    params = trainable_params(model)
    got, norms, _ = GhostEngine(0.05).clipped_sum_and_losses(model, params, (x, y))
    assert not torch.isfinite(norms[2]) and bool(torch.isfinite(norms[[0, 1, 3, 4]]).all())
    keep = torch.tensor([0, 1, 3, 4])
    want, _, _ = GhostEngine(0.05).clipped_sum_and_losses(model, params, (x[keep], y[keep]))
    for name in want:
        assert bool(torch.isfinite(got[name]).all())
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


class _ReusingEngine:
    """The vmap engine's sums copied into one buffer per parameter, reused every call (as an engine
    replaying a CUDA graph into fixed outputs would); its other attributes the vmap engine's."""

    def __init__(self) -> None:
        from dpscale.privacy.clipping.per_example import VmapEngine

        self.inner, self.buffers = VmapEngine(0.1), {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def clipped_sum_and_losses(self, model, params, batch):
        sums, norms, losses = self.inner.clipped_sum_and_losses(model, params, batch)
        for k, v in sums.items():
            self.buffers.setdefault(k, torch.empty_like(v)).copy_(v)
        return dict(self.buffers), norms, losses


@pytest.mark.parametrize("noise_std", [0.0, 0.3])
def test_the_step_never_writes_an_engines_tensors(noise_std):
    """noisy_clipped_mean adds chunks, noise and the division out of place (issue 63's review: taking
    the first chunk's sums as the total and adding in place counted a buffer-reusing engine's second
    chunk twice, 2.4 C over in one step)."""
    from dpscale.privacy.clipping.per_example import VmapEngine
    from dpscale.rng import DPRandom
    from dpscale.train import noisy_clipped_mean

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    chunks = [(x[:3], y[:3]), (x[3:], y[3:])]
    options = {"noise_std": noise_std, "expected_batch_size": 6.0}
    want, _ = noisy_clipped_mean(
        VmapEngine(0.1), model, chunks, noise_generator=DPRandom(0), **options
    )
    engine = _ReusingEngine()
    got, _ = noisy_clipped_mean(engine, model, chunks, noise_generator=DPRandom(0), **options)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    last, _, _ = VmapEngine(0.1).clipped_sum_and_losses(model, trainable_params(model), chunks[1])
    # the engine's buffers as it left them
    assert all(torch.equal(engine.buffers[k], last[k]) for k in last)
