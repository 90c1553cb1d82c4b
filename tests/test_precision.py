"""Mixed precision: every engine in bf16/fp16 against a float64 per-example loop, the clip bound
in 16 bits, fp16's fixed loss scale and its non-finite examples, and a bf16 run on CPU."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpscale
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy.clipping.engines import make_engine
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.precision import Precision, make_precision
from dpscale.privacy.clipping.reference import float64_reference
from dpscale.privacy.clipping.self_check import checked_engine
from dpscale.train import Trainer
from helpers import short_config
from zoo import CancellingTokens

# Relative error against the float64 loop (documented in docs/precision.md; measured maxima on
# the zoo CNNs and ViT, 8 examples on CPU: bf16 norms 6.8e-3 / sums 4.1e-2, fp16 3.4e-4 / 1.4e-2).
NORM_TOLERANCE = {"bf16": 1.5e-2, "fp16": 1e-3}
SUM_TOLERANCE = {"bf16": 6e-2, "fp16": 2e-2}
PRECISIONS = [make_precision("bf16"), make_precision("fp16")]


class SmallConvNet(nn.Module):
    """Conv + GroupNorm + in-place ReLU + Linear: every kind of record the bk rules handle."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.head = nn.Linear(8 * 3 * 3, 5)

    def forward(self, x):
        h = F.relu_(self.norm(self.conv(x)))
        return self.head(torch.tanh(self.conv2(h)).flatten(1))


def naive_float64(model, x, y, clip):
    """Clipped sum and norms of a float64 copy, one backward per example, no autocast."""
    reference = float64_reference(model, (x, y), clip)
    return reference.clipped_sum, reference.norms


def _data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 7, 7, generator=g), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.kernels  # also under capped CPU kernel families (test_kernel_families.py)
@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("engine", ["bk", "ghost", "vmap"])
@pytest.mark.parametrize("clip", [0.05, 50.0])
def test_every_engine_in_16_bits_matches_the_float64_loop(engine, precision, clip):
    torch.manual_seed(0)
    model, (x, y) = SmallConvNet(), _data()
    want, want_norms = naive_float64(model, x, y, clip)
    got, norms = make_engine(engine, clip, model, precision=precision)[0].per_example_clipped_sum(
        model, trainable_params(model), (x, y)
    )
    assert all(g.dtype == torch.float32 for g in got.values()) and norms.dtype == torch.float32
    assert (
        float(((norms.double() - want_norms).abs() / want_norms).max())
        < NORM_TOLERANCE[precision.name]
    )
    error = torch.sqrt(sum((got[n].double() - want[n]).square().sum() for n in want))
    size = torch.sqrt(sum(w.square().sum() for w in want.values()))
    assert float(error / size) < SUM_TOLERANCE[precision.name]


@pytest.mark.kernels  # also under capped CPU kernel families (test_kernel_families.py)
@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("engine", ["bk", "ghost", "vmap"])
def test_no_example_contributes_more_than_c_in_16_bits(engine, precision):
    torch.manual_seed(1)
    model, (x, y) = SmallConvNet(), _data(6, seed=1)
    clip = 0.01  # far below every norm: each contribution is clipped
    run = make_engine(engine, clip, model, precision=precision)[0]
    for i in range(len(x)):
        grad_sum, norm = run.per_example_clipped_sum(
            model, trainable_params(model), (x[i : i + 1], y[i : i + 1])
        )
        released = float(torch.sqrt(sum(g.double().square().sum() for g in grad_sum.values())))
        assert float(norm) > clip and released <= clip, (engine, precision.name, i, released)


@pytest.mark.parametrize("engine", ["bk", "vmap"])
def test_an_fp16_overflow_makes_that_example_contribute_exactly_zero(engine):
    torch.manual_seed(2)
    model, (x, y) = SmallConvNet(), _data(5, seed=2)
    run = make_engine(engine, 1.0, model, precision=make_precision("fp16"))[0]
    params = trainable_params(model)
    clean, _ = run.per_example_clipped_sum(model, params, (x[1:], y[1:]))
    x_bad = x.clone()
    x_bad[0] = 1e5  # beyond fp16's range (65504) after the first convolution
    dirty, norms = run.per_example_clipped_sum(model, params, (x_bad, y))
    assert not torch.isfinite(norms[0]) and torch.isfinite(norms[1:]).all()
    for name in clean:
        assert torch.isfinite(dirty[name]).all()
        torch.testing.assert_close(dirty[name], clean[name], rtol=1e-5, atol=1e-7)


def test_the_loss_scale_is_applied_and_undone():
    """The engines see the loss times S (gradients that would underflow in fp16 survive) and
    return gradients of the loss itself."""
    torch.manual_seed(3)
    model, (x, y) = SmallConvNet(), _data(4, seed=3)
    params = trainable_params(model)
    small, large = (
        make_engine("bk", 1e3, model, precision=Precision("fp16", s))[0] for s in (1.0, 2.0**14)
    )
    a, norms_a = small.per_example_clipped_sum(model, params, (x, y))
    b, norms_b = large.per_example_clipped_sum(model, params, (x, y))
    torch.testing.assert_close(norms_a, norms_b, rtol=2e-3, atol=0)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=2e-2, atol=1e-5)


def test_precision_settings_are_validated():
    with pytest.raises(ValueError, match="power of two"):
        Precision("fp16", 1000.0)
    with pytest.raises(ValueError, match="fp16 only"):
        Precision("bf16", 8.0)
    with pytest.raises(ValueError, match="precision must be one of"):
        Precision("fp8")
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(None, ["train.precision=half"])
    with pytest.raises(ConfigError, match="fp16_loss_scale"):
        load_config(None, ["train.fp16_loss_scale=3"])


def test_the_self_check_passes_in_bf16_and_still_catches_a_missed_route():
    torch.manual_seed(4)
    model, (x, y) = SmallConvNet(), _data()
    engine, notices, result = checked_engine(
        "auto", 0.1, model, (x, y), precision=make_precision("bf16")
    )
    assert result.ok and not notices and engine.precision.name == "bf16"
    head = model.head  # a replaced forward: the records see half the weight's gradient
    head.forward = lambda t: F.linear(t, head.weight * 2.0, head.bias)
    engine, notices, result = checked_engine(
        "auto", 0.1, model, (x, y), precision=make_precision("bf16")
    )
    assert notices and "head.weight" in notices[0] and result.ok and engine.name == "vmap"


def test_a_bf16_run_on_cpu_trains_with_the_same_privacy(tmp_path):
    summaries = {}
    for precision in ("fp32", "bf16"):
        config = short_config(
            tmp_path / precision,
            12,
            "dp.epsilon=4",
            "train.eval_every_epochs=1",
            "train.max_physical_batch_size=64",
            f"train.precision={precision}",
        )
        summaries[precision] = Trainer.create(config, progress=False).run()
        on_disk = json.loads((tmp_path / precision / "summary.json").read_text())
        assert on_disk["precision"] == precision and on_disk["engine_self_check"]["passed"]
    fp32, bf16 = summaries["fp32"], summaries["bf16"]
    assert (
        bf16["epsilon"] == fp32["epsilon"] and bf16["noise_multiplier"] == fp32["noise_multiplier"]
    )
    assert bf16["test_accuracy"] > 0.5 and abs(bf16["test_accuracy"] - fp32["test_accuracy"]) < 0.1


def test_tf32_sets_the_cuda_matmul_flags_only_inside_and_restores_them():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with make_precision("tf32").matmul_flags():
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        with make_precision("fp32").matmul_flags():
            assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


class FlagProbe(nn.Module):
    """Records the CUDA TF32 flags (matmul, cuDNN) that each of its forward passes runs under."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return self.fc(x)


@pytest.mark.parametrize("precision, tf32", [("fp32", False), ("tf32", True)])
def test_make_private_steps_under_its_precision_not_the_users_tf32_flags(precision, tf32):
    # cuDNN's default is TF32: "fp32" left to it ran convolutions in TF32 on an H200, and the
    # self-check then refused bk and vmap on resnet18-gn at 224x224 (docs/benchmarks.md)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    # the user's setting
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    try:
        model = FlagProbe()
        mechanism = dpscale.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset_size=64,
            batch_size=16,
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            delta=1e-5,
            steps=3,
            seed=0,
            precision=precision,
        )
        x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
        checked = 0
        for indices in mechanism.batches():
            mechanism.step(x[indices], y[indices])
            checked = checked or len(model.seen)  # the first step's check compares in full float32
        assert len(model.seen) > checked and set(model.seen[checked:]) == {(tf32, tf32)}
        assert precision == "tf32" or set(model.seen) == {(False, False)}
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (
            not tf32,
            not tf32,
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.kernels  # also under capped CPU kernel families (test_kernel_families.py)
@pytest.mark.parametrize(
    "precision", [make_precision("fp32"), make_precision("bf16")], ids=lambda p: p.name
)
@pytest.mark.parametrize("engine", ["bk", "ghost"])
def test_gram_norms_never_underestimate_when_tokens_cancel(engine, precision):
    torch.manual_seed(0)
    model, clip = CancellingTokens(), 1e-3
    base = torch.randn(6, 256).bfloat16().float()
    x = torch.stack([base, base.clone()], 1)
    x[:, 1, :1] += base[:, :1] * 2**-7  # the second token one bf16 ulp off the first
    y = torch.randint(0, 10, (6,))
    run = make_engine(engine, clip, model, precision=precision)[0]
    # a benign first batch passes the route check (in bf16 the autograd reference itself cancels)
    run.per_example_clipped_sum(model, trainable_params(model), (torch.randn(4, 2, 256), y[:4]))
    for i in range(len(x)):  # a batch of one: the release is that example's contribution
        grad_sum, _ = run.per_example_clipped_sum(
            model, trainable_params(model), (x[i : i + 1], y[i : i + 1])
        )
        released = float(torch.sqrt(sum(g.double().square().sum() for g in grad_sum.values())))
        # no tolerance: by construction
        assert released <= clip, (engine, precision.name, i, released / clip)


def test_squared_norms_of_large_per_example_gradients_are_accurate():
    from dpscale.privacy.clipping.bounds import blocked_sq_norms

    t = torch.randn(3, 2_100_000, generator=torch.Generator().manual_seed(0))
    exact = t.double().square().sum(1)
    # torch's vector_norm: 6e-5
    assert float(((blocked_sq_norms(t).double() - exact) / exact).abs().max()) < 1e-7


@pytest.mark.parametrize("engine", ["bk", "ghost", "vmap"])
def test_fp16_engines_return_the_loss_itself_not_the_scaled_one(engine):
    torch.manual_seed(5)
    model, (x, y) = SmallConvNet(), _data(4, seed=5)
    want = F.cross_entropy(model(x), y, reduction="none")
    run = make_engine(engine, 1.0, model, precision=make_precision("fp16"))[0]
    _, _, losses = run.clipped_sum_and_losses(model, trainable_params(model), (x, y))
    torch.testing.assert_close(losses.float(), want.detach(), rtol=2e-2, atol=1e-3)


def test_a_step_counts_the_examples_whose_gradients_were_not_finite():
    from dpscale.rng import DPRandom
    from dpscale.train.step import noisy_clipped_mean, physical_chunks

    torch.manual_seed(6)
    model, (x, y) = SmallConvNet(), _data(6, seed=6)
    x[2] = 1e5  # overflows fp16
    engine = make_engine("bk", 1.0, model, precision=make_precision("fp16"))[0]
    grad, stats = noisy_clipped_mean(
        engine,
        model,
        physical_chunks(x, y, torch.arange(6), 4),
        noise_std=0.0,
        expected_batch_size=6,
        noise_generator=DPRandom(0),
    )
    assert (
        stats.nonfinite_examples == 1
        and stats.examples == 6
        and stats.as_dict()["nonfinite_examples"] == 1
    )
    assert (
        all(torch.isfinite(g).all() for g in grad.values())
        and stats.mean_grad_norm == stats.mean_grad_norm
    )


class NormedNet(nn.Module):
    """Conv + GroupNorm, then Linear + LayerNorm: each norm layer gets a 16-bit input (CPU autocast
    leaves its float32 affine parameters as they are) and passes a gradient back to that input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.group = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8 * 7 * 7, 16)
        self.layer = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.tanh(self.group(self.conv(x)))
        return self.head(torch.tanh(self.layer(self.fc(h.flatten(1)))))


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("clip", [0.05, 50.0])
def test_vmap_in_16_bits_handles_group_norm_and_layer_norm(precision, clip):
    """vmap (auto's fallback) under autocast with norm layers: was 'expected scalar type
    BFloat16 but found Float'; now within the 16-bit tolerance of the float64 loop."""
    torch.manual_seed(7)
    model, (x, y) = NormedNet(), _data(6, seed=7)
    want, want_norms = naive_float64(model, x, y, clip)
    got, norms = make_engine("vmap", clip, model, precision=precision)[0].per_example_clipped_sum(
        model, trainable_params(model), (x, y)
    )
    assert (
        float(((norms.double() - want_norms).abs() / want_norms).max())
        < NORM_TOLERANCE[precision.name]
    )
    error = torch.sqrt(sum((got[n].double() - want[n]).square().sum() for n in want))
    size = torch.sqrt(sum(w.square().sum() for w in want.values()))
    assert float(error / size) < SUM_TOLERANCE[precision.name]


# Relative error of a released sum against the float64 loop: fp32 and tf32 (no TF32 on CPU) are
# float32 arithmetic, ~1e-7 here; 16 bits as above.
RELEASE_TOLERANCE = {"fp32": 1e-5, "tf32": 1e-5, **SUM_TOLERANCE}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("engine", ["bk", "ghost", "vmap"])
def test_an_overflowing_example_contributes_zero_through_make_private_and_is_counted(
    engine, precision
):
    """A drawn example of 3e38 overflows in every precision: the release must be the clipped sum
    of the others plus the noise (was NaN in fp32/tf32: membership visible), and the step counts it.
    It arrives at the second step (the first sampled batch is the one make_private checks)."""
    import dpscale
    from dpscale.privacy.noise.gaussian import draw_noise

    torch.manual_seed(8)
    model, (x, y) = SmallConvNet(), _data(12, seed=8)
    options = dict(
        dataset_size=12,
        batch_size=6,
        max_grad_norm=1.0,
        delta=1e-5,
        noise_multiplier=0.5,
        steps=2,
        engine=engine,
        precision=precision,
        seed=3,
    )
    other = copy.deepcopy(model)
    twin = dpscale.make_private(other, torch.optim.SGD(other.parameters(), lr=0.0), **options)
    # the seed's draws
    noise = [draw_noise(trainable_params(other), twin.noise_generator) for _ in range(2)]
    mechanism = dpscale.make_private(model, torch.optim.SGD(model.parameters(), lr=0.0), **options)
    released = []
    mechanism.observer = released.append
    drawn = mechanism.sample()
    mechanism.step(x[drawn], y[drawn])
    drawn = mechanism.sample()
    assert len(drawn) >= 2
    x[drawn[0]] = 3e38
    want, _ = naive_float64(model, x[drawn[1:]], y[drawn[1:]], 1.0)  # lr 0: the model has not moved
    stats = mechanism.step(x[drawn], y[drawn])
    assert stats.nonfinite_examples == 1 and stats.examples == len(drawn)
    # the clipped sum
    got = {n: g.double() * 6 - 0.5 * noise[1][n].double() for n, g in released[1].items()}
    assert all(torch.isfinite(g).all() for g in got.values())
    error = torch.sqrt(sum((got[n] - want[n]).square().sum() for n in want))
    size = torch.sqrt(sum(w.square().sum() for w in want.values()))
    assert float(error / size) < RELEASE_TOLERANCE[precision]


@pytest.mark.parametrize("cast", ["half", "bfloat16", "mixed"])
def test_parameters_other_than_all_float32_or_all_float64_are_refused_in_one_line(cast):
    """16-bit precision is the forward's (autocast), never the parameters': a model.half() crashed
    inside the engines (issue 63's review); float32 and float64 layers mixed did too."""
    import dpscale

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    if cast == "mixed":
        model[1].double()
    else:
        getattr(model, cast)()
    with pytest.raises(ValueError, match="all float32 or all float64") as err:
        dpscale.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset_size=100,
            batch_size=10,
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            delta=1e-5,
            steps=3,
        )
    assert "\n" not in str(err.value)
