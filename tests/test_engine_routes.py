"""Models outside the zoo whose parameters reach the loss by routes a per-layer record can miss
(the adversarial review's table): every engine equals a naive per-example loop in float64, or
refuses / falls back with a message naming the parameter; no released per-example contribution
ever exceeds C."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpscale.layers import ClassTokenPositionEmbedding
from dpscale.privacy import GhostEngine, VmapEngine, make_engine
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.precision import make_precision
from dpscale.privacy.clipping.self_check import checked_engine, self_check
from zoo import CancellingTokens, naive_clipped_sum

ENGINES = ("auto", "bk", "ghost", "vmap")


class WeightNormMLP(nn.Module):
    def __init__(self, parametrization=False):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecates the old-style weight_norm
            wn = nn.utils.parametrizations.weight_norm if parametrization else nn.utils.weight_norm
            self.fc = wn(nn.Linear(4, 5))
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


class TiedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.out = nn.Linear(5, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx).mean(1)))


class InPlace(nn.Module):
    """in-place activation on a recorded output, optionally followed by an in-place residual add."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.act = nn.ReLU(inplace=True)
        self.skip = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc1(x)
        if self.kind in ("relu_", "residual"):
            h = F.relu_(h)
        elif self.kind == "module":
            h = self.act(h)
        z = self.fc2(h)
        if self.kind == "residual":  # relu_ on fc1's output, then an in-place residual add on fc2's
            z += self.skip(x)
        return self.out(torch.tanh(z))


class SharedLinear(nn.Module):
    def __init__(self, functional):
        super().__init__()
        self.functional = functional
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        if not functional:
            self.fc2.weight = self.fc1.weight
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        if self.functional:  # a tied head written functionally
            return F.linear(h, self.head.weight) + self.head(h)
        return self.head(h)


class PosEmbedOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.tokens = ClassTokenPositionEmbedding(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        t = self.tokens(self.proj(x)) + self.tokens.pos_embed  # the embedding used a second time
        return self.head(t.mean(1))


class ExtraParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.fc.scale = nn.Parameter(torch.ones(5))  # attached to the Linear, used by the parent
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x) * self.fc.scale))


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock with GroupNorm, inplace ReLU and an in-place residual add."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.GroupNorm(2, cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.GroupNorm(2, cout)
        self.downsample = nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(2, cout)
        )

    def forward(self, x):
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 4)
        self.relu = nn.ReLU(inplace=True)
        self.layer = BasicBlock(4, 4 * 2, 2)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.layer(self.relu(self.gn(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class HookedOutput(nn.Module):
    """A user forward hook that replaces a Linear's output (scaled by a trainable gain)."""

    def __init__(self, with_gain):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 5), nn.Linear(5, 3)
        self.gain = nn.Linear(1, 1, bias=False)  # a supported layer, its weight used in the hook
        self.fc.register_forward_hook(lambda m, i, o: o * 2.0)
        if with_gain:
            self.out.register_forward_hook(lambda m, i, o: o * self.gain.weight[0, 0])

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


class SharedRowLayer(nn.Module):
    """A layer called on one constant row, its output broadcast to every example: its records
    cannot be split by example."""

    def __init__(self):
        super().__init__()
        self.fc, self.offset, self.out = nn.Linear(4, 5), nn.Linear(1, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x) + self.offset(torch.ones(1, 1, dtype=x.dtype))))


class WeightStandardised(nn.Module):
    """NF-ResNet's pieces: scaled weight-standardised convs (with and without bias, strided, grouped)
    and a SkipInit scalar gain on a residual branch."""

    def __init__(self):
        super().__init__()
        from dpscale.layers import ScalarGain, ScaledStdConv2d

        self.stem = ScaledStdConv2d(1, 4, 3, padding=1)
        self.branch = ScaledStdConv2d(4, 4, 3, padding=1, groups=2, bias=False)
        self.gain = ScalarGain(0.2, init=0.5)
        self.down = ScaledStdConv2d(4, 6, 3, stride=2)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = h + self.gain(torch.tanh(self.branch(h)))
        return self.head(self.down(h).mean((2, 3)))


def _vectors(n=5):
    return torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))


CASES = {
    "weight_norm": (lambda: WeightNormMLP(), _vectors, "fc.weight_g"),
    "weight_norm_parametrization": (
        lambda: WeightNormMLP(True),
        _vectors,
        "fc.parametrizations.weight",
    ),
    "tied_embedding_head": (
        TiedEmbedding,
        lambda: (torch.randint(0, 7, (5, 3)), torch.randint(0, 7, (5,))),
        "out.weight",
    ),
    "relu_": (lambda: InPlace("relu_"), _vectors, None),
    "inplace_relu_module": (lambda: InPlace("module"), _vectors, None),
    "relu_then_residual": (lambda: InPlace("residual"), _vectors, None),
    "shared_linear": (lambda: SharedLinear(False), _vectors, "fc2.weight"),
    "functional_tied_head": (lambda: SharedLinear(True), _vectors, "head.weight"),
    "pos_embed_outside": (
        PosEmbedOutside,
        lambda: (torch.randn(5, 2, 3, dtype=torch.float64), torch.randint(0, 3, (5,))),
        "tokens.pos_embed",
    ),
    "extra_parameter": (ExtraParameter, _vectors, "scale"),
    "user_forward_hook": (lambda: HookedOutput(False), _vectors, None),
    "user_forward_hook_with_a_parameter": (lambda: HookedOutput(True), _vectors, "gain.weight"),
    "layer_called_on_one_shared_row": (SharedRowLayer, _vectors, "offset"),
    "weight_standardised_conv": (
        WeightStandardised,
        lambda: (torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))),
        None,
    ),
    "resnet_block": (
        TinyResNet,
        lambda: (torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))),
        None,
    ),
}


def _build(case, seed=0):
    make, data, expected = CASES[case]
    torch.manual_seed(seed)
    model = make().double()
    x, y = data()
    return model, x, y, expected


def _engine_result(name, model, x, y, clip):
    """(clipped sum, None) or (None, message) for an engine the way a run chooses it."""
    try:
        engine, notices, _ = checked_engine(name, clip, model, (x[:3], y[:3]))
        grad_sum, _ = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    except ValueError as err:
        return None, str(err)
    return grad_sum, " ".join(notices) or None


@pytest.mark.parametrize("clip", [0.1, 0.5])
@pytest.mark.parametrize("case", sorted(CASES))
def test_engines_equal_the_naive_loop_or_refuse_naming_the_parameter(case, clip):
    model, x, y, expected = _build(case)
    want = naive_clipped_sum(model, x, y, clip)
    for name in ENGINES:
        got, message = _engine_result(name, model, x, y, clip)
        if got is None:  # refused: must name the parameter, and only the exact engines may refuse
            assert name in ("bk", "ghost") and expected is not None and expected in message, (
                name,
                message,
            )
            continue
        if expected is not None and name == "auto":
            assert message and expected in message, message  # the fallback notice names it
        assert set(got) == set(want)
        for param, ref in want.items():
            torch.testing.assert_close(
                got[param], ref, rtol=0, atol=1e-10, msg=f"{case} {name} {param}"
            )


@pytest.mark.kernels  # also under capped CPU kernel families (test_kernel_families.py)
@pytest.mark.parametrize("case", sorted(CASES))
def test_no_released_per_example_contribution_exceeds_the_clip_norm(case):
    model, x, y, _ = _build(case, seed=1)
    clip = 0.1
    for name in ENGINES:
        try:
            engine, _, _ = checked_engine(name, clip, model, (x[:3], y[:3]), check=False)
        except ValueError:
            continue  # refused (asserted to name the parameter above)
        params = trainable_params(model)
        for i in range(len(x)):  # a batch of one: the release is that example's contribution
            grad_sum, _ = engine.per_example_clipped_sum(
                model, params, (x[i : i + 1], y[i : i + 1])
            )
            norm = float(torch.sqrt(sum(g.double().square().sum() for g in grad_sum.values())))
            assert norm <= clip, (case, name, i, norm)


def test_in_place_models_are_handled_exactly_by_bk_not_refused():
    for case in (
        "relu_",
        "inplace_relu_module",
        "relu_then_residual",
        "resnet_block",
        "weight_standardised_conv",
    ):
        model, x, y, _ = _build(case)
        engine, notices, result = checked_engine("auto", 0.5, model, (x[:3], y[:3]))
        assert isinstance(engine, GhostEngine) and not notices and result.ok, (case, notices)


def test_static_support_names_the_parameters():
    from dpscale.privacy import unsupported_modules

    problems = " ".join(unsupported_modules(WeightNormMLP()))
    assert "weight_g" in problems and "weight_v" in problems
    assert "out.weight = emb.weight" in " ".join(
        unsupported_modules(TiedEmbedding())
    ) or "emb.weight = out.weight" in " ".join(unsupported_modules(TiedEmbedding()))
    assert isinstance(make_engine("auto", 1.0, ExtraParameter())[0], VmapEngine)


# ------------------------------------------------------------- routes the first checks cannot see


class TrainOnlyRoute(nn.Module):
    """fc.weight reaches the loss outside fc's call only in train mode (the self-check runs in eval)."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = h + F.linear(x, self.fc.weight)
        return self.out(torch.tanh(h))


class ViewAlias(nn.Module):
    """A view of fc.weight kept by the parent at construction (its id is not the parameter's)."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 3)
        self.weight_t = self.fc.weight.T

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x) + x @ self.weight_t))


class CopyAlias(ViewAlias):
    """A copy of fc.weight made at construction (not a view: no ``_base`` leads back)."""

    def __init__(self):
        super().__init__()
        self.weight_t = self.fc.weight.T.clone()


class ReplacedForward(nn.Module):
    """An instance-level ``forward`` that scales the weight by ``scale``: output != the rule's
    x W^T + b (a route worth ``scale - 1`` of fc.weight's gradient)."""

    def __init__(self, width: int = 4, scale: float = 2.0):
        super().__init__()
        self.fc, self.out = nn.Linear(width, width), nn.Linear(width, 3)
        fc = self.fc
        fc.forward = lambda x: F.linear(x, fc.weight * scale, fc.bias)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


ALIAS_CASES = {
    "view_alias": (ViewAlias, "fc.weight"),
    "copy_alias": (CopyAlias, "fc.weight"),
    "replaced_forward": (ReplacedForward, "fc.weight"),
}


def _plain_mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("case", sorted(ALIAS_CASES))
def test_routes_past_the_monitor_are_refused_by_the_route_check_naming_the_parameter(case):
    make, expected = ALIAS_CASES[case]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    # built in float64: .double() would not convert the alias
    torch.set_default_dtype(torch.float64)
    try:
        model = make()
    finally:
        torch.set_default_dtype(default)
    x, y = _vectors()
    want = naive_clipped_sum(model, x, y, 0.1)
    for name in ("bk", "ghost"):
        with pytest.raises(ValueError, match=expected.replace(".", r"\.")):
            GhostEngine(0.1, mode=name).per_example_clipped_sum(
                model, trainable_params(model), (x, y)
            )
    for name in ENGINES:  # with the self-check: equal to the naive loop, or refused
        got, message = _engine_result(name, model, x, y, 0.1)
        if got is not None:
            for param, ref in want.items():
                torch.testing.assert_close(
                    got[param], ref, rtol=0, atol=1e-10, msg=f"{case} {name} {param}"
                )


def test_a_global_forward_hook_changing_outputs_is_refused():
    torch.manual_seed(0)
    model = _plain_mlp().double()
    x, y = _vectors()
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o * 1.5 if isinstance(m, nn.Linear) else None
    )
    try:
        with pytest.raises(ValueError, match=r"0\.weight"):
            GhostEngine(0.1).per_example_clipped_sum(model, trainable_params(model), (x, y))
    finally:
        handle.remove()


def test_a_route_taken_only_in_train_mode_is_checked_when_training_starts():
    torch.manual_seed(0)
    model = TrainOnlyRoute().double()
    x, y = _vectors()
    engine = GhostEngine(0.1)
    assert self_check(engine, model, (x, y)).ok  # the self-check runs in eval mode
    model.train()
    with pytest.raises(ValueError, match=r"fc\.weight"):
        engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    # the start-up checks also run in train mode (batch independence): bk is refused there, auto falls back
    with pytest.raises(ValueError, match=r"in training mode, bk engine: parameter\(s\) fc\.weight"):
        checked_engine("bk", 0.1, model, (x, y))
    assert checked_engine("auto", 0.1, model, (x, y))[0].name == "vmap"


def test_a_parameter_unfrozen_later_is_checked_on_its_first_pass():
    torch.manual_seed(0)
    model = TrainOnlyRoute().double().train()
    model.fc.weight.requires_grad_(False)  # frozen: its outside use carries no gradient
    x, y = _vectors()
    engine = GhostEngine(0.1)
    engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    model.fc.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"fc\.weight"):
        engine.per_example_clipped_sum(model, trainable_params(model), (x, y))


def test_the_route_check_runs_once_per_mode_and_parameter_set(monkeypatch):
    from dpscale.privacy.clipping.ghost import engine as ghost

    calls = []
    original = ghost.unseen_routes
    monkeypatch.setattr(ghost, "unseen_routes", lambda *a: calls.append(1) or original(*a))
    model, (x, y), engine = _plain_mlp().double(), _vectors(), GhostEngine(0.1)
    for mode in (True, True, False, False, True):
        engine.per_example_clipped_sum(model.train(mode), trainable_params(model), (x, y))
    assert len(calls) == 2
    model[0].bias.requires_grad_(False)
    engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    assert len(calls) == 3


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant
        )
        return self.b(h)


# torch's, for the reentrant case
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_activation_checkpointing_is_exact_or_refused_naming_the_layer():
    torch.manual_seed(0)
    x, y = _vectors()
    model = Checkpointed(reentrant=False).double()
    got, _ = GhostEngine(0.1).per_example_clipped_sum(model, trainable_params(model), (x, y))
    for param, ref in naive_clipped_sum(model, x, y, 0.1).items():
        torch.testing.assert_close(got[param], ref, rtol=0, atol=1e-10)
    model = Checkpointed(reentrant=True).double()
    with pytest.raises(ValueError, match="layer.* a .*use_reentrant"):
        GhostEngine(0.1).per_example_clipped_sum(model, trainable_params(model), (x, y))


def test_a_compiled_model_is_refused_by_bk_and_auto_falls_back():
    model = _plain_mlp().double()
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(ValueError, match="torch.compile"):
        GhostEngine(0.1).per_example_clipped_sum(compiled, trainable_params(compiled), _vectors())
    engine, notices = make_engine("auto", 0.1, compiled)
    assert isinstance(engine, VmapEngine) and "torch.compile" in notices


# ------------------------------------------------------------------ the route check in 16 bits


# zoo's CancellingTokens (test_precision's case): logits = 1e3 (h_0 - h_1). With the two tokens one bf16 ulp
# apart, each example's per-token gradients nearly cancel, so a bf16 autograd weight gradient keeps
# few correct digits (7% off the records) while the records, multiplied in float32, stay exact.


def _cancelling_tokens(n=6):
    base = torch.randn(n, 256).bfloat16().float()
    x = torch.stack([base, base.clone()], 1)
    x[:, 1, :1] += base[:, :1] * 2**-7  # the second token one bf16 ulp off the first
    return x, torch.randint(0, 10, (n,))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_16_bit_rounding_is_not_mistaken_for_a_route(mode):
    """Was: 'bk engine: the gradient of lin.weight (records 0.074 off, relative) reaches the loss by
    a route the layer records do not see' on a sound model's first bf16 pass (the default model
    on MNIST: 0.033 off at the 0.03 tolerance). Routes do not depend on the precision."""
    torch.manual_seed(0)
    model, (x, y) = CancellingTokens(), _cancelling_tokens()
    engine = GhostEngine(1e-3, mode=mode, precision=make_precision("bf16"))
    # the checked pass
    got, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    assert bool(torch.isfinite(norms).all()) and bool((norms > 1e-3).all())
    assert float(torch.linalg.vector_norm(got["lin.weight"].double())) <= len(x) * 1e-3 * (1 + 1e-6)


def slightly_replaced_forward() -> nn.Module:
    """fc's forward scales its weight by 1.01: a route worth 1% of fc.weight's gradient, below the
    16-bit tolerance (3e-2) that the check used in bf16/fp16/tf32, far above float32 rounding."""
    return ReplacedForward(width=16, scale=1.01)


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_small_route_is_caught_in_every_precision(mode, precision):
    torch.manual_seed(0)
    model, x, y = slightly_replaced_forward(), torch.randn(8, 16), torch.randint(0, 3, (8,))
    engine = GhostEngine(0.1, mode=mode, precision=make_precision(precision))
    with pytest.raises(ValueError, match=r"fc\.weight \(records"):
        engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    model, x, y = ReplacedForward(), x[:, :4], y  # and the large route, as in fp32
    with pytest.raises(ValueError, match=r"fc\.weight \(records"):
        engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
