"""The layer configurations of Opacus' grad-sample tests, through dpscale's engines (issue 24).

Linear, Conv1d/Conv2d (groups, stride, padding, dilation), Embedding, GroupNorm, LayerNorm,
InstanceNorm and MultiheadAttention, with sequence layouts batch-first and time-major (T == B
included): each engine, after the start-up checks (``checked_engine``: batch independence in
train mode, then the self-check), must give the clipped sum and per-example norms of a float64
loop of batch-of-one backward passes, or refuse. Never silently differ.

Time-major layers are used as a user adapting an Opacus ``batch_first=False`` model would: the
examples arrive along dim 0 (dpscale draws them so) and the model hands the layer (T, B, ...);
or wrongly, the layer fed (B, T, ...) directly, which makes it attend across the examples.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.reference import per_example_reference
from dpscale.privacy.clipping.self_check import checked_engine

B, C = 4, 0.7


class Probe(nn.Module):
    """``layer`` on the input (transposed to time-major around it if asked), then a linear head."""

    def __init__(self, layer: nn.Module, features: int, time_major: str = "no") -> None:
        super().__init__()
        self.layer, self.head, self.time_major = layer, nn.Linear(features, 3), time_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(0, 1) if self.time_major == "adapted" else x
        out = (
            self.layer(h, h, h)[0]
            if isinstance(self.layer, nn.MultiheadAttention)
            else self.layer(h)
        )
        out = out.transpose(0, 1) if self.time_major == "adapted" else out
        return self.head(out.reshape(x.shape[0], -1))


def _configs() -> list:
    t, d = B, 6  # T == B
    configs = [
        ("linear-2d", lambda: nn.Linear(5, 4), (5,), 4, "no"),
        ("linear-seq", lambda: nn.Linear(d, 4), (t, d), t * 4, "no"),
        ("linear-seq-T!=B", lambda: nn.Linear(d, 4), (3, d), 3 * 4, "no"),
        ("linear-time-major", lambda: nn.Linear(d, 4), (t, d), t * 4, "adapted"),
        ("conv1d", lambda: nn.Conv1d(2, 4, 3, stride=2, padding=1), (2, 9), 4 * 5, "no"),
        ("conv2d-groups", lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1), (4, 5, 5), 6 * 25, "no"),
        (
            "conv2d-dilation",
            lambda: nn.Conv2d(2, 3, 3, dilation=2, stride=(1, 2)),
            (2, 7, 8),
            3 * 3 * 2,
            "no",
        ),
        ("groupnorm", lambda: nn.GroupNorm(2, 4), (4, 3, 3), 36, "no"),
        ("layernorm", lambda: nn.LayerNorm((3, 3)), (4, 3, 3), 36, "no"),
        ("instancenorm-affine", lambda: nn.InstanceNorm2d(4, affine=True), (4, 3, 3), 36, "no"),
        (
            "instancenorm-running",
            lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
            (4, 3, 3),
            36,
            "no",
        ),
        (
            "mha-batch-first",
            lambda: nn.MultiheadAttention(d, 2, batch_first=True),
            (t, d),
            t * d,
            "no",
        ),
        ("mha-time-major", lambda: nn.MultiheadAttention(d, 2), (t, d), t * d, "adapted"),
        ("mha-time-major-T!=B", lambda: nn.MultiheadAttention(d, 2), (5, d), 5 * d, "adapted"),
        ("mha-fed-examples-as-time", lambda: nn.MultiheadAttention(d, 2), (t, d), t * d, "no"),
    ]
    return configs


class EmbeddingProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(11, 4), nn.Linear(3 * 4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).reshape(tokens.shape[0], -1))


def _model_and_batch(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (B,), generator=g)
    if name == "embedding":
        return EmbeddingProbe().double(), (torch.randint(0, 11, (B, 3), generator=g), y)
    _, make, shape, features, time_major = next(c for c in _configs() if c[0] == name)
    return Probe(make(), features, time_major).double(), (
        torch.randn(B, *shape, generator=g, dtype=torch.float64),
        y,
    )


NAMES = [c[0] for c in _configs()] + ["embedding"]


@pytest.mark.parametrize("engine", ["auto", "bk", "ghost", "vmap"])
@pytest.mark.parametrize("name", NAMES)
def test_every_engine_equals_a_float64_per_example_loop_or_refuses(name, engine):
    model, batch = _model_and_batch(name)
    try:
        chosen, _, _ = checked_engine(engine, C, model, batch)
    except ValueError as refusal:
        assert "\n" not in str(refusal) and len(str(refusal)) < 1000
        return
    model.train()
    params = trainable_params(model)
    got, norms, _ = chosen.clipped_sum_and_losses(model, params, batch)
    # already float64
    want = per_example_reference(model, batch, C, loss_fn=chosen.loss_fn, names=list(params))
    assert torch.allclose(norms.double(), want.norms, rtol=1e-8, atol=1e-12), (name, chosen.name)
    for param, ref in want.clipped_sum.items():
        assert torch.allclose(got[param].double(), ref, rtol=1e-8, atol=1e-12), (
            name,
            chosen.name,
            param,
        )


@pytest.mark.parametrize(
    "name,refused_by",
    [("instancenorm-running", "every engine"), ("mha-fed-examples-as-time", "every engine")],
)
def test_the_mixing_configurations_are_refused_by_every_engine(name, refused_by):
    for engine in ("auto", "bk", "ghost", "vmap"):
        model, batch = _model_and_batch(name)
        with pytest.raises(ValueError):
            checked_engine(engine, C, model, batch)


def test_auto_trains_every_configuration_that_does_not_mix_examples():
    mixing = {"instancenorm-running", "mha-fed-examples-as-time"}
    for name in NAMES:
        if name in mixing:
            continue
        model, batch = _model_and_batch(name)
        engine, _, result = checked_engine("auto", C, model, batch)
        assert result.ok and result.independence.ok, name
