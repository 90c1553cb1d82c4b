"""Every exact method a tuner may pick (issue 44) equals the float64 per-example loop (norms never
below it, clipped sums within today's tolerance) on every layer kind it covers, on the zoo's models
and with an example at 3e38; a real tuning pass stays exact; the im2col the methods share equals
F.unfold bit for bit. The tuner's choice: test_autotune_choice.py; its cache: test_autotune_cache.py;
through make_private and `dpscale train`: test_autotune_runs.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpscale.privacy import make_engine
from dpscale.privacy.clipping import autotune
from dpscale.privacy.clipping.autotune import MethodTuner
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.reference import per_example_reference
from autotune_helpers import convs


class _Forced(MethodTuner):
    """Takes ``method`` wherever it is a candidate (the rule elsewhere), recording where."""

    def __init__(self, method: str) -> None:
        super().__init__(enabled=False)
        self.method, self.used = method, []

    def choose(self, layer, signature, device, rule, candidates, rows):
        if self.method in {c.name for c in candidates}:
            self.used.append(layer)
            return self.method
        return rule


class _Sequence(nn.Module):
    """A Linear over 5 positions (B, 5, 6) -> (B, 5, 4), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.mix, self.head = nn.Linear(6, 4), nn.Linear(20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(x.reshape(-1, 5, 6))).flatten(1))


def _conv1d() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(3, 5, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(5 * 4, 10)
    )


CASES = {  # name -> (model, input shape per example, views)
    "conv2d": (convs, (3, 9, 9), 1),
    "conv2d-views": (convs, (3, 9, 9), 2),
    "conv1d": (_conv1d, (3, 9), 1),
    "linear-sequence": (_Sequence, (30,), 1),
}


@pytest.mark.parametrize("method", ["pixel-gram", "gram", "bmm", "bmm-positions", "grouped"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_every_method_equals_the_float64_loop(case, method, mode):
    build, shape, views = CASES[case]
    torch.manual_seed(0)
    model = build().double()
    x = (
        torch.randn(5, views, *shape, dtype=torch.float64)
        if views > 1
        else torch.randn(5, *shape, dtype=torch.float64)
    )
    y = torch.randint(0, 10, (5,))
    want = per_example_reference(model, (x, y), 0.3, views=views)
    tuner = _Forced(method)
    engine, _ = make_engine(mode, 0.3, model, views=views, tuner=tuner)
    got, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    assert bool((norms >= want.norms * (1 - 1e-12)).all())  # Gram forms: an upper bound
    torch.testing.assert_close(norms, want.norms, rtol=1e-7, atol=0)
    for name, ref in want.clipped_sum.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-7, atol=1e-10)
    gram_only = method in ("pixel-gram", "gram")
    if mode == "bk" or gram_only:  # ghost never instantiates per-example gradients
        # with 2 views the head is a 2-position Linear too
        expected = {
            "conv2d": {"pixel-gram": 3, "gram": 4, "bmm": 4, "bmm-positions": 3, "grouped": 4},
            "conv2d-views": {
                "pixel-gram": 3,
                "gram": 5,
                "bmm": 5,
                "bmm-positions": 3,
                "grouped": 4,
            },
            "conv1d": {"gram": 1, "bmm": 1, "bmm-positions": 1, "grouped": 1},
            "linear-sequence": {"gram": 1, "bmm": 1},
        }
        expected = expected[case].get(method, 0)
        assert len(tuner.used) == expected, tuner.used


@pytest.mark.parametrize("case", list(CASES))
def test_a_real_tuning_pass_times_every_candidate_and_stays_exact(case, monkeypatch):
    """Every chunk large enough to time: the candidates run on scratch records (the views folded
    as the rule's would), and the step that timed them still equals the float64 loop."""
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    monkeypatch.setattr(autotune, "TUNE_SPREAD", float("inf"))
    build, shape, views = CASES[case]
    torch.manual_seed(0)
    model = build().double()
    x = (
        torch.randn(4, views, *shape, dtype=torch.float64)
        if views > 1
        else torch.randn(4, *shape, dtype=torch.float64)
    )
    y = torch.randint(0, 10, (4,))
    tuner = MethodTuner(cache_file=None)
    engine, _ = make_engine("bk", 0.3, model, views=views, tuner=tuner)
    got, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    want = per_example_reference(model, (x, y), 0.3, views=views)
    torch.testing.assert_close(norms, want.norms, rtol=1e-7, atol=0)
    for name, ref in want.clipped_sum.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-7, atol=1e-10)
    timed = [entry for entry in tuner.as_json()["layers"].values() if entry[1].startswith("timed")]
    assert timed and all(len(ms) >= 2 for _, _, ms in timed)


# resnet18-gn's layers are those of the others (3x3 stride 1 and 2, 1x1 shortcuts): the slow suite only
ZOO_METHODS = (
    [
        (name, method)
        for name in ("papernot-cnn", "tramer-cifar-cnn")
        for method in ("pixel-gram", "gram", "bmm", "bmm-positions", "grouped")
    ]
    + [("vit-tiny", "gram"), ("vit-tiny", "bmm")]
    + [
        pytest.param("resnet18-gn", method, marks=pytest.mark.slow)
        for method in ("pixel-gram", "gram", "bmm", "bmm-positions", "grouped")
    ]
)


@pytest.mark.parametrize("name, method", ZOO_METHODS)
def test_every_method_on_the_zoo_equals_the_float64_loop(name, method):
    """A zoo model with every layer its tuner could time forced onto ``method`` (bk): the norms and
    clipped sums within the engines' float32 tolerance of the float64 loop, whichever the machine
    picks (Gram forms where the tuner may offer them: up to ``TUNED_GRAM_MAX_POSITIONS``)."""
    from zoo import assert_matches_float64
    from zoo import build_zoo_model

    from dpscale.privacy.clipping.reference import float64_reference

    torch.manual_seed(0)
    model, shape = build_zoo_model(name)
    x, y = torch.randn(4, *shape), torch.randint(0, 10, (4,))
    reference = float64_reference(model, (x, y), 0.5)
    tuner = _Forced(method)
    engine, _ = make_engine("bk", 0.5, model, tuner=tuner)
    grad_sum, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    assert_matches_float64(grad_sum, norms, reference, f"bk-{method}")


@pytest.mark.parametrize("method", ["pixel-gram", "gram", "bmm", "bmm-positions", "grouped"])
def test_a_huge_example_stays_within_c_whatever_the_method(method):
    """One example's pixels at 3e38 (their squares overflow float32; the first layer's outputs
    overflow): under every method each example's norm and the clipped sum are the float64 loop's
    within the engines' float32 tolerance."""
    torch.manual_seed(0)
    model = convs()
    x, y = torch.randn(4, 3, 9, 9), torch.randint(0, 10, (4,))
    x[2] = 3e38
    tuner = _Forced(method)
    engine, _ = make_engine("bk", 0.3, model, tuner=tuner)
    got, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    from zoo import assert_matches_float64

    from dpscale.privacy.clipping.reference import float64_reference

    # the overflow stays in the forward pass (tanh saturates)
    assert tuner.used and bool(torch.isfinite(norms).all())
    assert_matches_float64(got, norms, float64_reference(model, (x, y), 0.3), f"bk-{method}")


@pytest.mark.parametrize("layout", ["unfold", "channels-last"])
def test_strided_patches_equal_f_unfold_bit_for_bit(layout):
    """The im2col that gram and bmm use (and bmm-positions, channels-last: positions first, the
    columns kernel-major): a gather, so equal to F.unfold exactly, on padded, strided, dilated and
    rectangular geometries and on non-contiguous and channels-last inputs."""
    import itertools

    import torch.nn.functional as F

    from dpscale.privacy.clipping.ghost.conv import channels_last_patches, unfold_patches

    torch.manual_seed(0)
    base = torch.randn(3, 5, 11, 9)
    inputs = (
        base,
        base.contiguous(memory_format=torch.channels_last),
        base[:, 1:4],
        base[..., 1:],
        base[:, :1],
    )
    geometries = itertools.product(
        [(1, 1), (3, 3), (4, 2)], [(1, 1), (2, 1)], [(0, 0), (1, 2)], [(1, 1), (2, 2), (2, 1)]
    )
    for (kernel, dilation, padding, stride), x in itertools.product(geometries, inputs):
        want = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        if layout == "unfold":
            got = unfold_patches(x, kernel, dilation=dilation, padding=padding, stride=stride)
        else:  # (B, L, kh * kw * C) -> F.unfold's (B, C * kh * kw, L)
            got = channels_last_patches(
                x, kernel, dilation=dilation, padding=padding, stride=stride
            )
            b, length, c = x.shape[0], got.shape[1], x.shape[1]
            got = got.reshape(b, length, *kernel, c).permute(0, 4, 2, 3, 1).reshape(b, -1, length)
        assert torch.equal(got, want), (kernel, dilation, padding, stride)
