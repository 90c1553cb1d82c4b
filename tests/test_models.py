"""Model registry, architectures and activations, checked against the papers.

Parameter counts are computed by hand, layer by layer, from the architecture tables:
  * Tramer & Boneh 2021, Table 6 (MNIST CNN, = Papernot et al. 2021 Table 1 with k = 16, 32).
  * Tramer & Boneh 2021, Table 7 (CIFAR-10 CNN, "551K" params quoted in Table 20) and its
    smaller variant ("168K").
A conv layer with c_in -> c_out channels and a k x k kernel has c_out * c_in * k * k + c_out
parameters; a linear layer n -> m has n * m + m.
"""

import json

import pytest
import torch
from torch import nn

from dpscale.cli import main
from dpscale.models import (
    TemperedSigmoid,
    build_model,
    count_parameters,
    list_models,
    make_activation,
)
from dpscale.models.registry import register_model

# --- hand-computed parameter counts ----------------------------------------------------

# Table 6: 28x28x1 -> conv 16 8x8/2 pad 2 -> 16x13x13 -> maxpool 2/1 -> 16x12x12
#          -> conv 32 4x4/2 -> 32x5x5 -> maxpool 2/1 -> 32x4x4 = 512 -> fc 32 -> fc 10
PAPERNOT_MNIST = (
    (16 * 1 * 8 * 8 + 16)  # conv1: 1,040
    + (32 * 16 * 4 * 4 + 32)  # conv2: 8,224
    + (512 * 32 + 32)  # fc1: 16,416
    + (32 * 10 + 10)  # fc2: 330
)

# Table 7: 32x32x3, 3x3 'same' convs 32,32,(pool) 64,64,(pool) 128,128,(pool) -> 4x4x128 = 2048,
#          fc 128, fc 10.
TRAMER_CIFAR = (
    (32 * 3 * 9 + 32)  # conv 3->32: 896
    + (32 * 32 * 9 + 32)  # conv 32->32: 9,248
    + (64 * 32 * 9 + 64)  # conv 32->64: 18,496
    + (64 * 64 * 9 + 64)  # conv 64->64: 36,928
    + (128 * 64 * 9 + 128)  # conv 64->128: 73,856
    + (128 * 128 * 9 + 128)  # conv 128->128: 147,584
    + (128 * 4 * 4 * 128 + 128)  # fc 2048->128: 262,272
    + (128 * 10 + 10)  # fc 128->10: 1,290
)

# Small variant: convs 16,16,(pool) 32,32,(pool) 64,(pool) -> 4x4x64 = 1024, fc 128, fc 10.
TRAMER_CIFAR_SMALL = (
    (16 * 3 * 9 + 16)  # 448
    + (16 * 16 * 9 + 16)  # 2,320
    + (32 * 16 * 9 + 32)  # 4,640
    + (32 * 32 * 9 + 32)  # 9,248
    + (64 * 32 * 9 + 64)  # 18,496
    + (64 * 4 * 4 * 128 + 128)  # fc 1024->128: 131,200
    + (128 * 10 + 10)  # 1,290
)

LINEAR_MNIST = 28 * 28 * 10 + 10

HAND_COUNTS = {
    "papernot-cnn": PAPERNOT_MNIST,
    "tramer-cifar-cnn": TRAMER_CIFAR,
    "tramer-cifar-cnn-small": TRAMER_CIFAR_SMALL,
    "linear": LINEAR_MNIST,
}
DEFAULT_SHAPES = {
    "papernot-cnn": (1, 28, 28),
    "tramer-cifar-cnn": (3, 32, 32),
    "tramer-cifar-cnn-small": (3, 32, 32),
    "linear": (1, 28, 28),
}


def test_hand_counts_match_paper_figures():
    # Guards the hand arithmetic itself against the numbers quoted in the papers.
    assert PAPERNOT_MNIST == 26_010
    assert TRAMER_CIFAR == 550_570 and round(TRAMER_CIFAR, -3) == 551_000
    assert TRAMER_CIFAR_SMALL == 167_642 and round(TRAMER_CIFAR_SMALL, -3) == 168_000


def test_registry_lists_the_builtin_models():
    assert set(HAND_COUNTS) <= set(list_models())
    assert list_models() == sorted(list_models())


@pytest.mark.parametrize("name", list(HAND_COUNTS))
def test_parameter_count_matches_hand_count(name):
    model = build_model(name, 10, DEFAULT_SHAPES[name])
    assert count_parameters(model) == HAND_COUNTS[name]
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())


def test_papernot_cnn_layer_shapes_follow_table_6():
    model = build_model("papernot-cnn", 10, (1, 28, 28))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [tuple(c.weight.shape) for c in convs] == [(16, 1, 8, 8), (32, 16, 4, 4)]
    assert [(c.stride, c.padding) for c in convs] == [((2, 2), (2, 2)), ((2, 2), (0, 0))]
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    assert [(p.kernel_size, p.stride) for p in pools] == [(2, 1), (2, 1)]
    # Intermediate shapes: 16x13x13 -> 16x12x12 -> 32x5x5 -> 32x4x4.
    shapes = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape[1:])))
        for m in convs + pools
    ]
    try:
        model.forward_features(torch.zeros(2, 1, 28, 28))
    finally:
        for h in hooks:
            h.remove()
    assert shapes == [(16, 13, 13), (16, 12, 12), (32, 5, 5), (32, 4, 4)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(32, 512), (10, 32)]


@pytest.mark.parametrize(
    "k, expected",
    [
        # conv1 k*1*8*8+k, conv2 k*k*4*4+k, fc1 (k*4*4)*32+32, fc2 32*10+10
        (8, (8 * 64 + 8) + (8 * 8 * 16 + 8) + (8 * 16 * 32 + 32) + 330),  # 6,010
        (16, (16 * 64 + 16) + (16 * 16 * 16 + 16) + (16 * 16 * 32 + 32) + 330),  # 13,706
        (32, (32 * 64 + 32) + (32 * 32 * 16 + 32) + (32 * 16 * 32 + 32) + 330),  # 35,242
        (64, (64 * 64 + 64) + (64 * 64 * 16 + 64) + (64 * 16 * 32 + 32) + 330),  # 103,306
    ],
)
def test_papernot_cnn_filter_width_k(k, expected):
    model = build_model("papernot-cnn", 10, (1, 28, 28), filters=[k, k])
    assert count_parameters(model) == expected
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_papernot_cnn_hand_values_for_k():
    assert count_parameters(build_model("papernot-cnn", 10, (1, 28, 28), filters=[8, 8])) == 6_010
    assert (
        count_parameters(build_model("papernot-cnn", 10, (1, 28, 28), filters=(16, 16))) == 13_706
    )


@pytest.mark.parametrize("filters", [[16], [16, 32, 64], []])
def test_papernot_cnn_needs_two_filter_counts(filters):
    with pytest.raises(ValueError, match="two filter counts"):
        build_model("papernot-cnn", 10, (1, 28, 28), filters=filters)


def test_unknown_builder_option_is_a_value_error():
    with pytest.raises(ValueError, match="bad options for model 'papernot-cnn'"):
        build_model("papernot-cnn", 10, (1, 28, 28), filterz=[8, 8])


@pytest.mark.parametrize(
    "name, shape", [("papernot-cnn", (1, 8, 8)), ("tramer-cifar-cnn", (3, 4, 4))]
)
def test_too_small_input_is_rejected(name, shape):
    with pytest.raises(ValueError, match="too small"):
        build_model(name, 10, shape)


@pytest.mark.parametrize("name", list(HAND_COUNTS))
@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28), (3, 29, 24)])
def test_feature_dim_matches_real_input_shapes(name, shape):
    # The builders compute the flattened size analytically; a wrong formula breaks forward().
    model = build_model(name, 7, shape)
    assert model(torch.randn(2, *shape)).shape == (2, 7)


# --- the common model interface ----------------------------------------------------------


@pytest.mark.parametrize("name", list(HAND_COUNTS))
def test_output_shape_and_feature_head_split(name):
    torch.manual_seed(0)
    model = build_model(name, 10, DEFAULT_SHAPES[name])
    x = torch.randn(4, *DEFAULT_SHAPES[name])
    logits = model(x)
    assert logits.shape == (4, 10)
    features = model.forward_features(x)
    assert features.shape == (4, model.feature_dim)
    assert torch.equal(model.forward_head(features), logits)


@pytest.mark.parametrize("name", list(HAND_COUNTS))
def test_reset_head_changes_classes_and_keeps_features(name):
    torch.manual_seed(0)
    model = build_model(name, 10, DEFAULT_SHAPES[name])
    before = {k: v.clone() for k, v in model.features.state_dict().items()}
    old_head = [p.detach().clone() for p in model.head.parameters()]
    model.reset_head(5)
    x = torch.randn(3, *DEFAULT_SHAPES[name])
    assert model(x).shape == (3, 5)
    after = model.features.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    new_head = list(model.head.parameters())
    assert new_head[-1].shape == (5,)
    # Hidden head layers (if any) are freshly initialised, not the old tensors.
    if len(old_head) > 2:
        assert not torch.equal(old_head[0], new_head[0])
    # Parameter count changes only by the last layer: (in + 1) * (10 - 5).
    last_in = new_head[-2].shape[1]
    assert count_parameters(model) == HAND_COUNTS[name] - (last_in + 1) * 5


def test_count_parameters_trainable_only():
    model = build_model("papernot-cnn", 10, (1, 28, 28))
    for p in model.features.parameters():
        p.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == (512 * 32 + 32) + (32 * 10 + 10)
    assert count_parameters(model) == PAPERNOT_MNIST


# --- no batch mixing ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(HAND_COUNTS))
def test_no_batchnorm(name):
    model = build_model(name, 10, DEFAULT_SHAPES[name])
    norms = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)
    assert not any(isinstance(m, norms) for m in model.modules())


@pytest.mark.kernels  # also under capped CPU kernel families (test_kernel_families.py)
@pytest.mark.parametrize("name", list(HAND_COUNTS))
def test_examples_are_processed_independently(name):
    # Per-example gradients need f(batch)[i] == f(batch[i:i+1]), in train mode too.
    torch.manual_seed(0)
    model = build_model(name, 10, DEFAULT_SHAPES[name]).train()
    x = torch.randn(5, *DEFAULT_SHAPES[name])
    together = model(x)
    alone = torch.cat([model(x[i : i + 1]) for i in range(5)])
    assert torch.allclose(together, alone, atol=1e-5)
    model.eval()
    assert torch.allclose(model(x), together, atol=1e-6)


# --- activations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, cls",
    [("tanh", nn.Tanh), ("relu", nn.ReLU), (" relu ", nn.ReLU), ("sigmoid", nn.Sigmoid)],
)
def test_simple_activations(spec, cls):
    act = make_activation(spec)
    assert type(act) is cls
    assert make_activation(spec) is not act  # fresh module each time


X = torch.linspace(-8, 8, 1001)


def test_tempered_sigmoid_defaults_equal_tanh():
    act = make_activation("tempered_sigmoid")
    assert isinstance(act, TemperedSigmoid)
    assert (act.scale, act.inverse_temperature, act.offset) == (2.0, 2.0, 1.0)
    assert torch.allclose(act(X), torch.tanh(X), atol=1e-6)
    assert torch.allclose(
        make_activation("tempered_sigmoid(s=2,T=2,o=1)")(X), torch.tanh(X), atol=1e-6
    )


def test_tempered_sigmoid_111_is_sigmoid_and_not_tanh():
    act = make_activation("tempered_sigmoid(s=1,T=1,o=0)")
    assert torch.allclose(act(X), torch.sigmoid(X), atol=1e-7)
    assert not torch.allclose(act(X), torch.tanh(X), atol=1e-2)


def test_tempered_sigmoid_partial_args_and_spaces():
    act = make_activation("tempered_sigmoid( s=3, T=0.5 )")
    assert (act.scale, act.inverse_temperature, act.offset) == (3.0, 0.5, 1.0)
    expected = 3 * torch.sigmoid(0.5 * X) - 1
    assert torch.allclose(act(X), expected, atol=1e-6)
    # Output range is [-o, s - o]; slope at the origin is s*T/4.
    assert act(torch.tensor(1e3)).item() == pytest.approx(2.0)
    assert act(torch.tensor(-1e3)).item() == pytest.approx(-1.0)


@pytest.mark.parametrize("spec", ["swish", "Tanh", "tempered", "tempered_sigmoid[s=1]"])
def test_unknown_activation_lists_choices(spec):
    with pytest.raises(ValueError) as err:
        make_activation(spec)
    message = str(err.value)
    assert repr(spec.strip()) in message
    for choice in ("relu", "tanh", "tempered_sigmoid"):
        assert choice in message


@pytest.mark.parametrize(
    "spec", ["tempered_sigmoid(x=1)", "tempered_sigmoid(s=)", "tempered_sigmoid(t=2)"]
)
def test_bad_tempered_sigmoid_argument(spec):
    with pytest.raises(ValueError, match=r"bad tempered_sigmoid argument .*s=\.\.,T=\.\.,o=\.\."):
        make_activation(spec)


@pytest.mark.parametrize("name", ["papernot-cnn", "tramer-cifar-cnn-small"])
def test_activation_option_reaches_every_layer(name):
    relu = build_model(name, 10, DEFAULT_SHAPES[name], activation="relu")
    kinds = [type(m) for m in relu.modules()]
    convs = sum(k is nn.Conv2d for k in kinds)
    assert kinds.count(nn.ReLU) == convs + 1  # one per conv plus the hidden fc layer
    assert nn.Tanh not in kinds
    tanh = build_model(name, 10, DEFAULT_SHAPES[name])  # the default is tanh
    assert nn.ReLU not in [type(m) for m in tanh.modules()]
    assert [type(m) for m in tanh.modules()].count(nn.Tanh) == convs + 1
    tempered = build_model(
        name, 10, DEFAULT_SHAPES[name], activation="tempered_sigmoid(s=1,T=1,o=0)"
    )
    assert sum(isinstance(m, TemperedSigmoid) for m in tempered.modules()) == convs + 1


def test_bad_activation_in_build_model():
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        build_model("papernot-cnn", 10, (1, 28, 28), activation="swish")


# --- registry errors ------------------------------------------------------------------


def test_unknown_model_suggests_close_match_and_lists_known():
    with pytest.raises(ValueError) as err:
        build_model("papernot-cn", 10, (1, 28, 28))
    message = str(err.value)
    assert "'papernot-cn'" in message
    assert "Did you mean papernot-cnn" in message
    known = message.split("Known models:")[1]
    for name in HAND_COUNTS:
        assert name in known


def test_unknown_model_without_close_match_has_no_suggestion():
    with pytest.raises(ValueError) as err:
        build_model("transformer-xl", 10, (3, 32, 32))
    assert "Did you mean" not in str(err.value)
    assert "Known models:" in str(err.value)


def test_duplicate_registration_is_rejected_and_keeps_original():
    before = list_models()
    with pytest.raises(ValueError, match="already registered"):
        register_model("linear")(lambda **kw: nn.Identity())
    assert list_models() == before
    assert count_parameters(build_model("linear", 10, (1, 28, 28))) == LINEAR_MNIST


# --- dpscale models --json ----------------------------------------------------------------


def test_cli_models_json(capsys):
    assert main(["models", "--json"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out)
    assert isinstance(rows, list)
    assert [r["name"] for r in rows] == list_models()
    for row in rows:
        assert set(row) == {"name", "params", "input_shape", "engines"}
        assert isinstance(row["engines"], list) and "vmap" in row["engines"]
        if row["name"] in HAND_COUNTS:
            assert row["params"] == HAND_COUNTS[row["name"]]
            assert row["input_shape"] == list(DEFAULT_SHAPES[row["name"]])


def test_cli_models_table(capsys):
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(row for row in lines if row.startswith("papernot-cnn "))
    assert "26,010 params" in line and "1x28x28" in line and "vmap" in line


# ----- MaxPool2d: the channels-last CPU path must be nn.MaxPool2d bit for bit -----

POOL_GEOMETRIES = [
    dict(kernel_size=2, stride=1),
    dict(kernel_size=2, stride=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=2, stride=1, dilation=2),
    dict(kernel_size=(2, 3), stride=(1, 2)),
]


@pytest.mark.parametrize("geometry", POOL_GEOMETRIES)
def test_maxpool_matches_torch_values_and_gradients_with_ties_and_nan(geometry):
    from dpscale.layers import MaxPool2d

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (4, 5, 9, 11), generator=gen).float()  # many ties in every window
    x[0, 0, 1, 1] = float("nan")
    grad = torch.randn(nn.MaxPool2d(**geometry)(x).shape, generator=gen)
    results = []
    for layer in (nn.MaxPool2d(**geometry), MaxPool2d(**geometry)):
        leaf = x.clone().requires_grad_(True)
        out = layer(leaf)
        out.backward(grad)
        with torch.no_grad():
            results.append((out.detach(), leaf.grad, layer(x)))
    (ref_out, ref_grad, ref_eval), (out, grad_x, eval_out) = results
    assert torch.equal(ref_out.nan_to_num(-1), out.nan_to_num(-1))
    assert out.is_contiguous() and torch.isnan(out).any()
    assert torch.equal(ref_grad, grad_x)
    assert torch.equal(ref_eval.nan_to_num(-1), eval_out.nan_to_num(-1))


def test_maxpool_falls_back_inside_vmap_and_for_unbatched_input():
    from torch.func import grad, vmap

    from dpscale.layers import MaxPool2d

    x = torch.randn(3, 2, 6, 6)
    ours, ref = MaxPool2d(2, stride=1), nn.MaxPool2d(2, stride=1)
    per_example = [
        vmap(grad(lambda t, m=m: m(t.unsqueeze(0)).square().sum()))(x) for m in (ref, ours)
    ]
    assert torch.equal(per_example[0], per_example[1])
    assert torch.equal(ours(x[0]), ref(x[0]))


# Issue 28's models. scatter-cnn "mnist" on 81x7x7: conv c1 3x3/2 pad 1 -> c1x4x4, conv c2 3x3 pad 1
# -> c2x4x4, fc h, fc 10. simplevgg-16(1)-32(1)-64 on 28x28x1: conv 16 3x3 'same', pool -> 14x14,
# conv 32, pool -> 7x7x32 = 1568, fc 64, fc 10.
def _scatter_cnn_count(c1: int, c2: int, hidden: int) -> int:
    return (
        (c1 * 81 * 9 + c1) + (c2 * c1 * 9 + c2) + (c2 * 16 * hidden + hidden) + (hidden * 10 + 10)
    )


@pytest.mark.parametrize("widths", [(16, 32, 32), (32, 64, 32), (8, 8, 16)])
def test_scatter_cnn_widths_set_its_conv_and_fc_widths(widths):
    model = build_model("scatter-cnn", 10, (81, 7, 7), "tanh", widths=widths)
    assert count_parameters(model) == _scatter_cnn_count(*widths)
    assert model(torch.randn(2, 81, 7, 7)).shape == (2, 10)
    assert _scatter_cnn_count(16, 32, 32) == 33_066  # the paper's Table 8 network, the default


def test_scatter_cnn_linear_skip_adds_a_linear_map_of_the_features_to_the_logits():
    """On 81x8x8 (padded images): conv 16/2 -> 16x4x4, conv 32 -> 32x4x4 = 512, fc 32; the last
    layer reads [fc 32 output, the 5184 features]: (32 + 5184) x 10 + 10."""
    model = build_model("scatter-cnn", 10, (81, 8, 8), "tanh", linear_skip=True)
    by_hand = (16 * 81 * 9 + 16) + (32 * 16 * 9 + 32) + (512 * 32 + 32) + ((32 + 5184) * 10 + 10)
    assert count_parameters(model) == by_hand == 84_906
    x = torch.randn(3, 81, 8, 8, dtype=torch.float64)
    model = model.double()
    last = model.head[-1]
    with torch.no_grad():  # the CNN path alone, then the linear path alone
        cnn_only = last(
            torch.cat([model.features.branch(x), torch.zeros(3, 5184, dtype=torch.float64)], 1)
        )
        linear_only = x.flatten(1) @ last.weight[:, 32:].T
        torch.testing.assert_close(model(x), cnn_only + linear_only)
    # default unchanged
    assert count_parameters(build_model("scatter-cnn", 10, (81, 8, 8), "tanh")) == 33_066


def test_scatter_cnn_linear_skip_is_clipped_exactly_by_bk():
    from dpscale.privacy.clipping.engines import make_engine
    from dpscale.privacy.clipping.reference import float64_reference

    torch.manual_seed(0)
    model = build_model("scatter-cnn", 10, (81, 8, 8), "tanh", linear_skip=True).double()
    batch = (torch.randn(5, 81, 8, 8, dtype=torch.float64), torch.randint(0, 10, (5,)))
    engine, notice = make_engine("auto", 0.1, model)
    assert engine.name == "bk" and notice is None
    grad_sum, norms, _ = engine.clipped_sum_and_losses(
        model, {n: p.detach() for n, p in model.named_parameters()}, batch
    )
    reference = float64_reference(model, batch, 0.1)
    torch.testing.assert_close(norms, reference.norms, rtol=1e-9, atol=1e-12)
    for name, value in reference.clipped_sum.items():
        torch.testing.assert_close(grad_sum[name], value, rtol=1e-9, atol=1e-12)


def test_scatter_cnn_refuses_widths_that_are_not_three_positive_numbers():
    with pytest.raises(ValueError, match="widths"):
        build_model("scatter-cnn", 10, (81, 7, 7), "tanh", widths=(16, 32))
    with pytest.raises(ValueError, match="widths"):
        build_model("scatter-cnn", 10, (81, 7, 7), "tanh", widths=(16, 0, 32))


def test_simplevgg_on_fashion_mnist_counts_by_hand():
    model = build_model("simplevgg-16(1)-32(1)-64", 10, (1, 28, 28), "tanh")
    by_hand = (16 * 9 + 16) + (32 * 16 * 9 + 32) + (1568 * 64 + 64) + (64 * 10 + 10)
    assert count_parameters(model) == by_hand == 105_866


def test_the_registry_sees_the_zoo_however_it_is_imported():
    """Importing ``dpscale.models.registry`` alone runs the package, which registers the built-ins
    (a lazy package would leave the registry empty and let a user's model take a built-in's name)."""
    import subprocess
    import sys

    code = (
        "from dpscale.models.registry import build_model, list_models\n"
        "assert 'papernot-cnn' in list_models() and len(list_models()) > 10, list_models()\n"
        "build_model('papernot-cnn', num_classes=10, input_shape=(1, 28, 28))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
