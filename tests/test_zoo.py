"""Model zoo additions: paper parameter counts, simpleVGG specs, block groups and freezing,
BatchNorm conversion."""

import pytest
import torch
from torch import nn

from dpscale.config import load_config
from dpscale.models import (
    build_model,
    convert_batchnorm_to_groupnorm,
    count_parameters,
    freeze_block_groups,
    list_models,
)
from dpscale.models.cnn import parse_simplevgg
from dpscale.privacy.clipping.layer_refusals import check_per_example_compatible
from dpscale._io import load_checkpoint
from dpscale.train.loop import Trainer

from helpers import tiny_config


def conv(cin, cout, k=3):
    return cin * cout * k * k + cout


def test_papernot_table2_cifar_cnn_has_2395434_parameters():
    # Papernot Table 2: convs 32,32,64,64,128,128 (3x3), fc 1024, softmax 10 -> 2,395,434.
    convs = (
        conv(3, 32) + conv(32, 32) + conv(32, 64) + conv(64, 64) + conv(64, 128) + conv(128, 128)
    )
    expected = convs + (128 * 4 * 4) * 1024 + 1024 + 1024 * 10 + 10
    assert expected == 2_395_434
    assert count_parameters(build_model("papernot-cifar-cnn", 10, (3, 32, 32))) == expected


def test_papernot_appendix_a_allconv_has_2334730_parameters():
    expected = (
        conv(3, 64)
        + conv(64, 128)
        + conv(128, 128)
        + conv(128, 256)
        + conv(256, 256)
        + conv(256, 512)
        + conv(512, 10)
    )
    assert expected == 2_334_730
    model = build_model("papernot-allconv", 10, (3, 32, 32))
    assert count_parameters(model) == expected
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    model.reset_head(4)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_simplevgg_specs():
    assert parse_simplevgg("32(2)-64(2)-128(2)-128") == ([(32, 2), (64, 2), (128, 2)], 128)
    # The paper's reference simpleVGG is Tramer's Table 7 network.
    assert (
        count_parameters(build_model("simplevgg-32(2)-64(2)-128(2)-128", 10, (3, 32, 32)))
        == 550_570
    )
    small = build_model("simplevgg-16(1)-32(1)-64", 10, (3, 32, 32))
    assert (
        count_parameters(small)
        == conv(3, 16) + conv(16, 32) + (32 * 8 * 8) * 64 + 64 + 64 * 10 + 10
    )
    assert small(torch.randn(3, 3, 32, 32)).shape == (3, 10)
    assert "simplevgg-32(2)-64(2)-128(2)-128" in list_models()
    for bad in ("simplevgg-32-64", "simplevgg-32(x)-128", "simplevgg-128", "simplevgg-0(2)-10"):
        with pytest.raises(ValueError, match="simpleVGG spec"):
            build_model(bad, 10, (3, 32, 32))


def test_simplevgg_group_norm_and_weight_standardisation_options():
    plain = build_model("simplevgg-16(1)-32(1)-64", 10, (1, 28, 28))
    normed = build_model(
        "simplevgg-16(1)-32(1)-64", 10, (1, 28, 28), norm_groups=8, weight_standardization=True
    )
    # each conv gains a per-filter gain (WS) and GroupNorm's weight and bias per channel
    assert count_parameters(normed) == count_parameters(plain) + 3 * 16 + 3 * 32
    kinds = [type(m).__name__ for m in normed.features]
    assert kinds[:4] == ["ScaledStdConv2d", "GroupNorm", "Tanh", "MaxPool2d"]
    assert [m.num_groups for m in normed.features if isinstance(m, nn.GroupNorm)] == [8, 8]
    # groups that do not divide the width fall to the largest divisor below them (as in the ResNets)
    odd = build_model("simplevgg-12(1)-10", 10, (1, 8, 8), norm_groups=8)
    assert [m.num_groups for m in odd.features if isinstance(m, nn.GroupNorm)] == [6]
    # without the options the network and its state dict keys are the paper's (checkpoints load)
    assert [type(m).__name__ for m in plain.features][:3] == ["Conv2d", "Tanh", "MaxPool2d"]
    assert "features.3.weight" in plain.state_dict()
    with pytest.raises(ValueError, match="norm_groups must be >= 0"):
        build_model("simplevgg-16(1)-32(1)-64", 10, (1, 28, 28), norm_groups=-1)


def test_head_weight_standardisation_standardises_each_hidden_row_in_float64():
    from dpscale.layers import ScaledStdLinear
    from dpscale.privacy.clipping.engines import supported_engines

    model = build_model(
        "simplevgg-16(1)-32(1)-64",
        10,
        (1, 28, 28),
        weight_standardization=True,
        head_weight_standardization=True,
    )
    hidden, logits = model.head[0], model.head[2]
    # the logits layer stays plain
    assert isinstance(hidden, ScaledStdLinear) and type(logits) is nn.Linear
    assert count_parameters(model) == 105_914 + 64  # one gain per hidden row
    assert "bk" in supported_engines(model)  # an exact rule, so auto does not fall back to vmap
    layer = ScaledStdLinear(7, 3).double()
    with torch.no_grad():
        layer.gain.copy_(torch.tensor([[0.5], [2.0], [-1.0]], dtype=torch.float64))
    x = torch.randn(4, 7, dtype=torch.float64)
    w = layer.weight
    u = (w - w.mean(1, keepdim=True)) / torch.sqrt(
        7 * w.var(1, unbiased=False, keepdim=True) + layer.eps
    )
    torch.testing.assert_close(
        layer(x), x @ (layer.gain * u).T + layer.bias, rtol=1e-12, atol=1e-12
    )
    # each row of the standardised weight has mean 0 and norm ~1 whatever the weight's scale
    layer.weight.data *= 1000
    rows = layer.standardized_weight()
    torch.testing.assert_close(
        rows.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(
        rows.norm(dim=1), torch.ones(3, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_simplevgg_options_train_through_the_config(tmp_path):
    options = "model.kwargs={norm_groups: 4, weight_standardization: true, head_weight_standardization: true}"
    config = tiny_config(tmp_path, "model.name=simplevgg-8(1)-16", options)
    trainer = Trainer.create(config, progress=False)
    trainer.run()
    assert [type(m).__name__ for m in trainer.model.features][:2] == [
        "ScaledStdConv2d",
        "GroupNorm",
    ]
    # no fallback
    assert (
        type(trainer.model.head[0]).__name__ == "ScaledStdLinear"
        and trainer.built.engine.name == "bk"
    )
    saved = load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    assert {"features.0.gain", "features.1.weight", "features.1.bias", "head.0.gain"} <= set(saved)


@pytest.mark.parametrize("name", list_models())
def test_block_groups_cover_every_parameter_in_order(name):
    from dpscale.models import default_input_shape

    model = build_model(name, 10, default_input_shape(name))
    groups = model.block_groups()
    flat = [p for g in groups for p in g]
    assert len(flat) == len(list(model.parameters())) and {id(p) for p in flat} == {
        id(p) for p in model.parameters()
    }
    logits = groups[-1]
    assert any(p.shape[0] == 10 for p in logits)  # the logits layer is last


def test_freezing_k_groups_leaves_exactly_the_rest_trainable():
    model = build_model("papernot-cnn", 10, (1, 28, 28))  # groups: conv1, conv2, fc 32, fc 10
    assert freeze_block_groups(model, 3) == 32 * 10 + 10
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "head.2.weight",
        "head.2.bias",
    ]
    with pytest.raises(ValueError, match="block groups"):
        # would freeze everything
        freeze_block_groups(build_model("papernot-cnn", 10, (1, 28, 28)), 4)


def test_training_with_frozen_groups_updates_and_noises_only_trainable_parameters(tmp_path):
    cfg = load_config(
        None,
        [
            f"run.out_dir={tmp_path / 'f'}",
            "run.seed=0",
            "model.freeze_groups=2",
            "train.steps=3",
            "dp.batch_size=100",
            "dp.epsilon=2",
        ],
    )
    trainer = Trainer.create(cfg, progress=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    summary = trainer.run()
    after = load_checkpoint(tmp_path / "f" / "checkpoint.pt")["model"]
    frozen = {"features.0.weight", "features.0.bias", "features.3.weight", "features.3.bias"}
    for name, value in before.items():
        assert torch.equal(after[name], value) == (name in frozen), name
    assert summary["trainable_params"] == 16_416 + 330


def test_batchnorm_is_rejected_and_converted():
    model = nn.Sequential(
        nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48), nn.ReLU(), nn.Conv2d(48, 6, 3), nn.BatchNorm2d(6)
    )
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    with pytest.raises(ValueError, match="BatchNorm2d.*convert_batchnorm_to_groupnorm"):
        check_per_example_compatible(model)
    convert_batchnorm_to_groupnorm(model, num_groups=32)
    check_per_example_compatible(model)
    assert (
        isinstance(model[1], nn.GroupNorm)
        and model[1].num_groups == 24
        and model[4].num_groups == 6
    )
    assert torch.all(model[1].weight == 2.0)
    with pytest.raises(ValueError, match="running statistics"):
        check_per_example_compatible(nn.Sequential(nn.InstanceNorm2d(4, track_running_stats=True)))


def test_resnet_v2_18_gn_parameter_count_by_hand():
    # ResNet-v2-18, 224x224 stem, 10 classes: convs as in He et al. (no biases), pre-activation
    # GroupNorm affine params (2 per channel) before every conv pair and once after the last group.
    convs = 7 * 7 * 3 * 64
    convs += 4 * conv(64, 64) - 4 * 64  # layer1 (bias-free)
    convs += 64 * 128 * 9 + 3 * 128 * 128 * 9 + 64 * 128  # layer2 + 1x1 projection
    convs += 128 * 256 * 9 + 3 * 256 * 256 * 9 + 128 * 256
    convs += 256 * 512 * 9 + 3 * 512 * 512 * 9 + 256 * 512
    norms = 2 * (4 * 64 + (64 + 3 * 128) + (128 + 3 * 256) + (256 + 3 * 512) + 512)
    expected = convs + norms + 512 * 10 + 10
    assert expected == 11_179_850
    model = build_model("resnet18-gn", 10, (3, 224, 224))
    assert count_parameters(model) == expected
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 10)
    cifar = build_model("resnet18-gn", 10, (3, 32, 32))  # 3x3 stem for small inputs
    assert count_parameters(cifar) == expected - 7 * 7 * 3 * 64 + 3 * 3 * 3 * 64
    assert cifar(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_resnet50_gn_and_freezing_four_groups_leaves_the_logits():
    model = build_model("resnet50-gn", 10, (3, 224, 224))
    # 25.5M with 1000 classes, as ResNet-50
    assert 23_000_000 < count_parameters(model) < 24_000_000
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 10)
    r18 = build_model("resnet18-gn", 10, (3, 32, 32))
    assert freeze_block_groups(r18, 4) == 512 * 10 + 10
    assert [n for n, p in r18.named_parameters() if p.requires_grad] == ["head.weight", "head.bias"]


def test_wrn16_4_parameters_and_norm_order():
    # WRN-16-4: stem 3->16; three groups of 2 blocks, widths 64, 128, 256; 1x1 projections; GN 2/ch.
    convs = 3 * 16 * 9
    convs += 16 * 64 * 9 + 64 * 64 * 9 + 16 * 64 + 2 * 64 * 64 * 9
    convs += 64 * 128 * 9 + 128 * 128 * 9 + 64 * 128 + 2 * 128 * 128 * 9
    convs += 128 * 256 * 9 + 256 * 256 * 9 + 128 * 256 + 2 * 256 * 256 * 9
    norms = 2 * (16 + 4 * 64 + 4 * 128 + 4 * 256)
    expected = convs + norms + 256 * 10 + 10
    post = build_model("wrn16-4", 10, (3, 32, 32), order="conv-norm-act")
    pre = build_model("wrn16-4", 10, (3, 32, 32))  # default: conv-act-norm (TAN Section 4.4)
    assert count_parameters(post) == count_parameters(pre) == expected == 2_748_890
    pre.load_state_dict(post.state_dict())
    x = torch.randn(2, 3, 32, 32)
    # same weights, other order
    assert post(x).shape == (2, 10) and not torch.allclose(post(x), pre(x))
    with pytest.raises(ValueError, match="order"):
        build_model("wrn16-4", 10, (3, 32, 32), order="norm-conv")
    no_norm = build_model("wrn16-4", 10, (3, 32, 32), norm_groups=0)
    assert count_parameters(no_norm) == expected - norms


@pytest.mark.parametrize(
    "name, dim, expected", [("vit-tiny", 192, 5_717_416), ("vit-small", 384, 22_050_664)]
)
def test_vit_parameter_counts_match_the_standard_models(name, dim, expected):
    # 224x224, patch 16, 12 blocks, MLP 4x, 1000 classes (the published ViT-Ti/16 and ViT-S/16 sizes).
    block = (
        2 * dim
        + (dim * 3 * dim + 3 * dim)
        + (dim * dim + dim)
        + 2 * dim
        + (dim * 4 * dim + 4 * dim)
        + (4 * dim * dim + dim)
    )
    count = (3 * 16 * 16 * dim + dim) + dim + 197 * dim + 12 * block + 2 * dim + (dim * 1000 + 1000)
    assert count == expected
    model = build_model(name, 1000, (3, 224, 224))
    assert count_parameters(model) == expected
    small = build_model(name, 10, (3, 32, 32))  # patch 4 on 32x32: 64 tokens
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert freeze_block_groups(small, 13) == dim * 10 + 10  # 1 embedding + 12 block groups frozen


def test_nf_resnet50_is_normaliser_free_and_trains_with_bk():
    from dpscale.privacy import GhostEngine, make_engine

    model = build_model("nf-resnet50", 1000, (3, 224, 224))
    # ResNet-50 convolutions plus per-channel WS gains and conv biases, 16 skip gains: ~25.6M
    # (Brock et al. 2021 report 25.5M for NF-ResNet-50).
    assert 25_400_000 < count_parameters(model) < 25_700_000
    assert not any(
        isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm))
        for m in model.modules()
    )
    small = build_model("nf-resnet50", 10, (3, 32, 32))
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    engine, notice = make_engine("auto", 1.0, small)
    # the exact WS-conv and skip-gain rules
    assert isinstance(engine, GhostEngine) and notice is None
    with torch.no_grad():  # weight standardisation: each output filter has zero mean, unit scale
        conv = small.stem[0]
        # the reference in float64: no dependence on the CPU's float32 kernels
        w = conv.weight.double()
        standardized = (w - w.mean((1, 2, 3), keepdim=True)) / (
            w.var((1, 2, 3), keepdim=True, unbiased=False) * w[0].numel() + conv.eps
        ).sqrt()
        x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
        weight, bias = standardized * conv.gain.double(), conv.bias.double()
        expected = torch.nn.functional.conv2d(x, weight, bias, padding=1)
        # float32 error of a sum of products is bounded relative to the sum of their magnitudes
        # (a few units of 6e-8 times the 27-term fan-in; 1.6e-7 measured), not to the sum itself
        magnitude = torch.nn.functional.conv2d(x.abs(), weight.abs(), bias.abs(), padding=1)
        assert ((conv(x.float()).double() - expected).abs() <= 1e-5 * magnitude).all()


def _timm_imports() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _timm_imports(), reason="timm does not import with this torch build")
def test_timm_adapter_builds_a_model():
    model = build_model("timm:resnet18", 10, (3, 32, 32))
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


@pytest.mark.skipif(_timm_imports(), reason="checks the message shown when timm is unavailable")
def test_timm_adapter_without_timm_is_a_clear_error():
    with pytest.raises(ValueError, match="timm:resnet18 needs the timm package"):
        build_model("timm:resnet18", 10, (3, 32, 32))


def _input_sizes(name):
    from dpscale.models import default_input_shape

    shape = default_input_shape(name)
    return [shape, (3, 32, 32)] if shape[1] == 224 else [shape]


# The heavy models only in the slow suite: their interface is ResidualNetwork's and
# VisionTransformer's, checked here on resnet18-gn and vit-tiny at both sizes; nf-resnet50's
# forward at 32x32 and its engine stay in the default suite
# (test_nf_resnet50_is_normaliser_free_and_trains_with_bk).
HEAVY_MODELS = {"resnet50-gn", "nf-resnet50", "vit-small"}


@pytest.mark.parametrize(
    "name, shape",
    [
        pytest.param(n, s, marks=pytest.mark.slow) if n in HEAVY_MODELS else (n, s)
        for n in list_models()
        for s in _input_sizes(n)
    ],
)
def test_every_model_has_the_common_interface_at_every_supported_size(name, shape):
    torch.manual_seed(0)
    model = build_model(name, 10, shape).eval()
    x = torch.randn(2, *shape)
    logits = model(x)
    assert logits.shape == (2, 10)
    torch.testing.assert_close(model.forward_head(model.forward_features(x)), logits)
    model.reset_head(5)
    assert model(x).shape == (2, 5)
    check_per_example_compatible(model)


def test_nf_resnet_checkpoints_from_before_the_skip_gain_layer_still_load():
    model = build_model("nf-resnet50", 10, (3, 32, 32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    old_style = {
        k.removesuffix(".skip_gain.gain") + ".skip_gain" if k.endswith(".skip_gain.gain") else k: v
        for k, v in model.state_dict().items()
    }
    assert any(k.endswith(".skip_gain") for k in old_style)
    fresh = build_model("nf-resnet50", 10, (3, 32, 32))
    fresh.load_state_dict(old_style)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
