"""ghost / bk engines against the vmap reference (itself checked against a naive loop in
test_dp_step.py): per-example norms and clipped sums, for every supported layer type with
random shapes (hypothesis), frozen parameters, and every registered model."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dpscale.models import count_parameters
from dpscale.privacy import GhostEngine, VmapEngine, make_engine, unsupported_modules
from dpscale.privacy.clipping.engines import supported_engines
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.reference import float64_reference
from dpscale.rng import DPRandom
from dpscale.train.step import noisy_clipped_mean, physical_chunks
from zoo import build_zoo_model, engines_besides_auto, zoo_cases

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_engines_agree(model, x, y, clip, freeze_mask=None):
    """bk and ghost against vmap, in float64: in float32 the engines' clip factors differ by their
    release slack (up to ~5e-4 relative on the zoo, docs/precision.md) and the values by the
    CPU's kernels; in float64 both are below 1e-9, so the rules themselves are compared."""
    if freeze_mask is not None:
        for p, frozen in zip(model.parameters(), freeze_mask):
            p.requires_grad_(not frozen)
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    params = trainable_params(model)
    if not params:
        return
    ref_sum, ref_norms = VmapEngine(clip).per_example_clipped_sum(model, params, (x, y))
    for mode in ("ghost", "bk"):
        grad_sum, norms = GhostEngine(clip, mode=mode).per_example_clipped_sum(
            model, params, (x, y)
        )
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=1e-12)
        assert set(grad_sum) == set(ref_sum)
        # Tolerance relative to the whole update: a parameter whose gradient is exactly zero in
        # exact arithmetic (e.g. a bias before a normalisation) is float noise in both engines.
        scale = max(float(ref.abs().max()) for ref in ref_sum.values()) + 1e-12
        for name, ref in ref_sum.items():
            torch.testing.assert_close(
                grad_sum[name], ref, rtol=1e-7, atol=1e-9 * scale, msg=f"{mode} {name}"
            )


def head(features: int, classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(features, classes))


def _labels(b, classes=3):
    return torch.randint(0, classes, (b,))


@SETTINGS
@given(
    b=st.integers(1, 5),
    t=st.integers(1, 6),
    d_in=st.integers(1, 9),
    d_out=st.integers(1, 9),
    bias=st.booleans(),
    seq=st.booleans(),
    clip=st.sampled_from([1e-3, 0.3, 1e3]),
    seed=st.integers(0, 999),
)
def test_linear(b, t, d_in, d_out, bias, seq, clip, seed):
    torch.manual_seed(seed)
    if seq:  # sequence input (B, T, d_in)
        model, x = (
            nn.Sequential(nn.Linear(d_in, d_out, bias=bias), nn.Tanh(), head(t * d_out)),
            torch.randn(b, t, d_in),
        )
    else:
        model, x = (
            nn.Sequential(nn.Linear(d_in, d_out, bias=bias), nn.Tanh(), head(d_out)),
            torch.randn(b, d_in),
        )
    assert_engines_agree(model, x, _labels(b), clip)


@SETTINGS
@given(
    b=st.integers(1, 4),
    groups=st.sampled_from([1, 2]),
    cin_per=st.integers(1, 3),
    cout_per=st.integers(1, 3),
    k=st.integers(1, 4),
    stride=st.integers(1, 3),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    size=st.integers(6, 16),
    bias=st.booleans(),
    one_d=st.booleans(),
    clip=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 999),
)
def test_conv(
    b, groups, cin_per, cout_per, k, stride, padding, dilation, size, bias, one_d, clip, seed
):
    torch.manual_seed(seed)
    cin, cout = groups * cin_per, groups * cout_per
    conv_cls = nn.Conv1d if one_d else nn.Conv2d
    conv = conv_cls(
        cin, cout, k, stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bias
    )
    x = torch.randn(b, cin, size) if one_d else torch.randn(b, cin, size, size)
    with torch.no_grad():
        features = conv(x)[0].numel()
    assert_engines_agree(nn.Sequential(conv, nn.Tanh(), head(features)), x, _labels(b), clip)


@pytest.mark.parametrize("size, cin, cout", [(20, 8, 4), (12, 40, 6), (10, 2, 3)])
def test_conv_each_per_example_path(size, cin, cout):
    """Shapes that exercise ghost, grouped-conv and im2col per-example paths of the mixed rule."""
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, 3, padding=1)
    x = torch.randn(3, cin, size, size)
    assert_engines_agree(
        nn.Sequential(conv, nn.Tanh(), head(cout * size * size)), x, _labels(3), 0.5
    )


@SETTINGS
@given(
    b=st.integers(1, 4),
    groups=st.sampled_from([1, 2, 4]),
    per=st.integers(1, 3),
    size=st.integers(2, 6),
    affine=st.booleans(),
    clip=st.sampled_from([1e-3, 1.0]),
    seed=st.integers(0, 999),
)
def test_group_norm(b, groups, per, size, affine, clip, seed):
    torch.manual_seed(seed)
    c = groups * per
    conv = nn.Conv2d(2, c, 3, padding=1)
    norm = nn.GroupNorm(groups, c, affine=affine)
    with torch.no_grad():  # non-trivial affine parameters
        for p in norm.parameters():
            p.normal_()
    model = nn.Sequential(conv, norm, nn.Tanh(), head(c * size * size))
    assert_engines_agree(model, torch.randn(b, 2, size, size), _labels(b), clip)


@SETTINGS
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 5),
    d=st.integers(3, 8),
    two_dims=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 999),
)
def test_layer_norm(b, t, d, two_dims, bias, seed):
    # d >= 3: normalising 2 values always gives +-1, so the gradient through the layer is pure
    # float noise (eps-sized) and no two correct implementations agree on it.
    torch.manual_seed(seed)
    shape = (t, d) if two_dims else (d,)
    norm = nn.LayerNorm(shape, bias=bias)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    model = nn.Sequential(nn.Linear(d, d), norm, nn.Tanh(), head(t * d))
    assert_engines_agree(model, torch.randn(b, t, d), _labels(b), 0.7)


@SETTINGS
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 7),
    vocab=st.integers(2, 6),
    d=st.integers(1, 5),
    padding_idx=st.sampled_from([None, 0]),
    seed=st.integers(0, 999),
)
def test_embedding(b, t, vocab, d, padding_idx, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(vocab, d, padding_idx=padding_idx), nn.Tanh(), head(t * d))
    x = torch.randint(0, vocab, (b, t))  # small vocab: repeated tokens within an example
    assert_engines_agree(model, x, _labels(b), 0.5)


@SETTINGS
@given(mask=st.lists(st.booleans(), min_size=6, max_size=6), seed=st.integers(0, 999))
def test_frozen_parameters(mask, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 36, 5),
        nn.Tanh(),
        nn.Linear(5, 3),
    )
    assert_engines_agree(model, torch.randn(4, 1, 8, 8), _labels(4), 0.5, freeze_mask=mask)


# ImageNet-size models are checked on 32x32 inputs (their CIFAR stem) to keep the suite fast.
@pytest.mark.parametrize("name", zoo_cases())  # the heavy models in the slow suite (HEAVY_MODELS)
def test_every_registered_model_gets_the_same_noisy_update_under_every_engine(name):
    # float64 (about 1.5x float32's time): see assert_engines_agree
    torch.manual_seed(0)
    model, shape = build_zoo_model(name)
    model = model.double()
    n = 9 if count_parameters(model) < 5_000_000 else 5
    x = torch.randn(n, *shape, dtype=torch.float64)
    y = torch.randint(0, 10, (n,))
    assert "auto" in supported_engines(model)
    updates = {}
    for engine_name in engines_besides_auto(model, 1.0):
        engine, _ = make_engine(engine_name, 1.0, model)
        updates[engine_name], _ = noisy_clipped_mean(
            engine,
            model,
            physical_chunks(x, y, torch.arange(n), 4),
            noise_std=1.3,
            expected_batch_size=8,
            noise_generator=DPRandom(42),
        )
    # re-parametrised layers (e.g. weight standardisation): exact vmap only
    if unsupported_modules(model):
        assert set(updates) == {"vmap"}
        assert isinstance(make_engine("auto", 1.0, model)[0], VmapEngine)
    else:
        assert {"vmap", "bk", "ghost"} <= set(updates)
    for engine_name, update in updates.items():
        for param, ref in updates["vmap"].items():
            torch.testing.assert_close(
                update[param], ref, rtol=1e-7, atol=1e-9, msg=f"{engine_name} {param}"
            )


def test_auto_falls_back_to_vmap_naming_the_unsupported_layer():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.gain

    model = nn.Sequential(nn.Linear(3, 4), Scale(), nn.Linear(4, 2))
    assert unsupported_modules(model) == ["1 (Scale: no rule for its parameter(s) 1.gain)"]
    engine, notice = make_engine("auto", 1.0, model)
    assert isinstance(engine, VmapEngine) and "Scale" in notice
    engine, notice = make_engine("auto", 1.0, nn.Sequential(nn.Linear(3, 2)))
    assert isinstance(engine, GhostEngine) and engine.mode == "bk" and notice is None
    with pytest.raises(ValueError, match="Scale"):
        make_engine("bk", 1.0, model)
    # Freezing the unsupported layer makes the model supported.
    model[1].gain.requires_grad_(False)
    assert unsupported_modules(model) == []


def test_weight_sharing_is_rejected():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 2))  # one layer, two calls
    with pytest.raises(ValueError, match="ran 2 times"):
        GhostEngine(1.0).per_example_clipped_sum(
            model, trainable_params(model), (torch.randn(3, 4), _labels(3, 2))
        )
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    model[2].weight = model[0].weight  # two layers, one weight
    with pytest.raises(ValueError, match=r"0\.weight = 2\.weight \(tied parameter\)"):
        GhostEngine(1.0).per_example_clipped_sum(
            model, trainable_params(model), (torch.randn(3, 4), _labels(3, 2))
        )

    class Twice(nn.Module):  # one registration, two calls
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.fc(torch.tanh(self.fc(x))))

    with pytest.raises(ValueError, match="ran 2 times"):
        GhostEngine(1.0).per_example_clipped_sum(
            Twice(), trainable_params(Twice()), (torch.randn(3, 4), _labels(3, 2))
        )


def test_ghost_engines_leave_no_state_behind():
    model = nn.Sequential(nn.Linear(4, 3))
    GhostEngine(1.0).per_example_clipped_sum(
        model, trainable_params(model), (torch.randn(2, 4), _labels(2))
    )
    assert all(p.grad is None for p in model.parameters())
    assert not model[0]._forward_hooks


@pytest.mark.kernels  # also under capped CPU kernel families (test_kernel_families.py)
@pytest.mark.parametrize("bad", [3e38, float("nan")])
@pytest.mark.parametrize("engine_name", ["vmap", "bk", "ghost"])
def test_a_non_finite_example_contributes_exactly_zero_in_float32_and_is_counted(engine_name, bad):
    """fp32: an input of 3e38 overflows (or a NaN in its own data); that example's gradient is not
    finite. It must contribute zero (was: the whole update NaN, showing it was in the batch)."""
    torch.manual_seed(11)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 36, 3)
    )
    x, y = torch.randn(7, 1, 8, 8), _labels(7)
    x[3] = bad
    engine, _ = make_engine(engine_name, 0.5, model)
    grad_sum, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    assert (~torch.isfinite(norms)).tolist() == [i == 3 for i in range(7)]
    others = torch.arange(7) != 3
    want = float64_reference(model, (x[others], y[others]), 0.5).clipped_sum
    for name, ref in want.items():
        torch.testing.assert_close(grad_sum[name].double(), ref, rtol=1e-5, atol=1e-6, msg=name)
    update, stats = noisy_clipped_mean(
        engine,
        model,
        physical_chunks(x, y, torch.arange(7), 3),
        noise_std=0.0,
        expected_batch_size=7,
        noise_generator=DPRandom(0),
    )
    assert stats.nonfinite_examples == 1 and stats.examples == 7
    for name, ref in want.items():
        torch.testing.assert_close(update[name].double() * 7, ref, rtol=1e-5, atol=1e-6, msg=name)
