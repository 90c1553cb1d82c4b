"""The model zoo, and the references judged against it, that the every-model tests share (test_engines, test_augmult, test_self_check,
test_autotune): every registered model, the heavy ones marked slow, small stand-ins for their
layers, and the engines to run on each. Import it as ``from zoo import ...``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpscale.models import build_model, default_input_shape, list_models
from dpscale.privacy import make_engine, unsupported_modules
from dpscale.privacy.clipping.engines import supported_engines
from dpscale.privacy.clipping.per_example import tolerance_for
from dpscale.privacy.clipping.reference import per_example_reference

FLOAT32_RTOL = tolerance_for(torch.float32)

SMALL_INPUT = {
    "resnet18-gn": (3, 32, 32),
    "resnet50-gn": (3, 32, 32),
    "nf-resnet50": (3, 32, 32),
    "vit-tiny": (3, 32, 32),
    "vit-small": (3, 32, 32),
}

# The every-model tests (here, test_augmult, test_self_check) run these only in the slow suite:
# they are the dearest cases. Their layer types are checked in the default suite on small models
# (and each conv path of the engines' rule in test_conv_each_per_example_path): resnet50-gn's
# (Conv2d 1x1 / 3x3 / strided, pre-activation GroupNorm, Linear) on resnet18-gn and wrn16-4;
# vit-small's (Linear on tokens, LayerNorm, class token and position embedding, patch Conv2d) on
# vit-tiny; nf-resnet50's (weight-standardised convs with bias, strided shortcut, SkipInit gains,
# scaled activations) on nf-resnet-tiny below, built from its own blocks.
HEAVY_MODELS = {"resnet50-gn", "nf-resnet50", "vit-small"}


def tiny_nf_resnet(num_classes: int = 10) -> nn.Module:
    """NF-ResNet-50's layers at a fraction of its cost: a weight-standardised stem, an identity
    bottleneck and a strided transition bottleneck (WS shortcut), from ``dpscale.models.nfnet``'s
    own blocks. Its skip gains are set non-zero: SkipInit starts them at 0, which would leave every
    branch convolution without a gradient (as in a fresh nf-resnet50)."""
    from dpscale.layers import ScaledStdConv2d
    from dpscale.models.nfnet import NFBottleneck
    from dpscale.models.resnet import ResidualNetwork

    blocks = nn.Sequential(
        NFBottleneck(16, 4, 1, 0.2, 1.0, "relu"), NFBottleneck(16, 8, 2, 0.2, 1.0, "relu")
    )
    with torch.no_grad():
        for block in blocks:
            block.skip_gain.gain.fill_(0.5)
    return ResidualNetwork(
        nn.Sequential(ScaledStdConv2d(3, 16, 3, padding=1)), [blocks], nn.ReLU(), 32, num_classes
    )


def tiny_normalised_simplevgg(num_classes: int = 10) -> nn.Module:
    """simpleVGG with its options on: weight-standardised convs, each followed by GroupNorm, and a
    weight-standardised hidden fc layer."""
    options = {
        "norm_groups": 4,
        "weight_standardization": True,
        "head_weight_standardization": True,
    }
    return build_model("simplevgg-8(1)-8(1)-16", num_classes, (1, 12, 12), **options)


# Small models built in the tests, with their input shapes: stand-ins for a heavy model's layers
# and registered families with options that change their layers.
TEST_MODELS = {
    "nf-resnet-tiny": (tiny_nf_resnet, (3, 16, 16)),
    "simplevgg-ws-gn-tiny": (tiny_normalised_simplevgg, (1, 12, 12)),
}


def zoo_cases() -> list:
    """Every registered model (the heavy ones marked slow) and the small stand-ins."""
    registered = [
        pytest.param(n, marks=pytest.mark.slow) if n in HEAVY_MODELS else n for n in list_models()
    ]
    return registered + sorted(TEST_MODELS)


def build_zoo_model(name: str, num_classes: int = 10) -> tuple[nn.Module, tuple[int, ...]]:
    """A ``zoo_cases`` model and the input shape it is checked on (a small one where it has two)."""
    if name in TEST_MODELS:
        make, shape = TEST_MODELS[name]
        return make(num_classes), shape
    shape = SMALL_INPUT.get(name, default_input_shape(name))
    return build_model(name, num_classes, shape), shape


def engines_besides_auto(model: nn.Module, max_grad_norm: float, **options) -> list[str]:
    """``supported_engines(model)`` less "auto", once "auto" is checked to build exactly the engine
    it picks (bk, or vmap when a layer is unsupported: the same class and settings). Running "auto"
    as well would repeat that engine's computation, the dearest part of the zoo-wide tests."""
    names = supported_engines(model)
    if "auto" in names:
        auto, _ = make_engine("auto", max_grad_norm, model, **options)
        twin, _ = make_engine(
            "vmap" if unsupported_modules(model) else "bk", max_grad_norm, model, **options
        )
        assert type(auto) is type(twin) and vars(auto) == vars(twin), (vars(auto), vars(twin))
    return [name for name in names if name != "auto"]


def assert_matches_float64(grad_sum, norms, reference, what):
    """A float32 engine's clipped sum and norms against the float64 loop: norms relative to
    themselves (no cancellation), sums relative to their tensor's per-example scale (its largest
    absolute entry over the examples' clipped gradients)."""
    expected, expected_norms, scale = (
        reference.clipped_sum,
        reference.norms,
        reference.clipped_max_abs,
    )
    torch.testing.assert_close(
        norms.double(), expected_norms, rtol=FLOAT32_RTOL, atol=0.0, msg=f"{what} norms"
    )
    # ghost takes every weight's norm from Gram matrices, whose release adds its slack to the
    # bound (gamma_{T K + 1} W, docs/precision.md): it clips up to 5e-3 lower than the loop on
    # wrn16-4 with 3 views of 32x32 images (T K = 3072), so it is judged at 1.5e-2
    rtol = FLOAT32_RTOL * (15 if what.startswith("ghost") else 1)
    for p, ref in expected.items():
        error = (grad_sum[p].double() - ref).abs().max().item()
        assert error <= rtol * scale[p].item(), (
            f"{what} {p}: error {error:.2e}, scale {scale[p].item():.2e}"
        )


def naive_clipped_sum(model, x, y, clip):
    """sum_i min(1, C / (||g_i|| + eps)) g_i, one backward per example (the definition), through
    ``model`` itself: the models here are float64 already, and a copy would lose the user hooks
    bound to the original (HookedOutput)."""
    return per_example_reference(model, (x, y), clip).clipped_sum


class CancellingTokens(nn.Module):
    """logits = 1e3 (h_0 - h_1) of two nearly equal tokens: each example's per-token gradients
    almost cancel, which a float32 Gram-matrix norm reads as ~0 (the review found 3455 C)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 10, bias=False)

    def forward(self, x):
        h = self.lin(x)
        return (h[:, 0] - h[:, 1]) * 1e3
