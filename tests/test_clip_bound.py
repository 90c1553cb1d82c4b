"""The clip bound by construction: an example's released contribution is <= C under worst-case
rounding, in every precision and engine, and each part of the construction is needed.

Each release here is of a batch of one (the release is that example's contribution), measured in
float64 from the engine's output, and compared with C with no tolerance. The "without" tests
remove a part of the construction (the margin, the slack) and find an example, by a short seeded
search, whose release then exceeds C: on any x86 kernel, since the constructed cases round in a
few scalar operations (docs/precision.md, "The clip bound under rounding").
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpscale.privacy import make_engine
from dpscale.privacy.clipping import bounds as clipping

from dpscale.privacy.clipping.ghost import conv as ghost_conv

from dpscale.privacy.clipping.ghost import rules as ghost_rules

from dpscale.privacy.clipping import per_example
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.precision import make_precision

# also run under capped oneDNN/ATen/MKL kernels (test_kernel_families)
pytestmark = pytest.mark.kernels

PRECISIONS = ["fp32", "tf32", "bf16", "fp16"]
ENGINES = ["bk", "ghost", "vmap"]


def released(engine, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The L2 norm (float64) of what ``engine`` releases for the batch (x, y)."""
    grad_sum, _ = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
    return math.sqrt(sum(float(g.double().square().sum()) for g in grad_sum.values()))


def _without_margin(monkeypatch) -> None:
    monkeypatch.setattr(clipping, "clip_margin", lambda dtype: 0.0)


def _without_slack(monkeypatch) -> None:
    for rules in (ghost_rules, ghost_conv):  # the rule modules whose releases accumulate positions
        monkeypatch.setattr(
            rules,
            "release_slack",
            lambda terms, weight, dtype: torch.zeros_like(weight, dtype=torch.float64),
        )


def _derived_margin(u: float) -> float:
    """The margin from first principles: measured squares as low as (1 - gamma_{4096+5}), two
    roundings after the factor (its cast, the release's scaling), float64 arithmetic gamma_{2^20}."""
    gamma = lambda n, unit: n * unit / (1 - n * unit)  # noqa: E731
    return 1 - math.sqrt(1 - gamma(4101, u)) / ((1 + u) ** 2 * (1 + gamma(2**20, 2.0**-53)))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("engine_name", ENGINES)
def test_every_precision_clips_in_float32_with_the_margin_of_its_unit_roundoff(
    monkeypatch, engine_name, precision
):
    seen = []
    exact = per_example.clip_factors
    monkeypatch.setattr(
        per_example,
        "clip_factors",
        lambda *a, **k: (seen.append(k["release_dtype"]), exact(*a, **k))[1],
    )
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    engine = make_engine(engine_name, 1.0, model, precision=make_precision(precision))[0]
    released(engine, model, torch.randn(2, 1, 2, 2), torch.tensor([0, 2]))
    assert seen and set(seen) == {torch.float32}  # 16-bit gradients are taken to float32 first
    assert clipping.clip_margin(torch.float32) == pytest.approx(
        _derived_margin(2.0**-24), rel=1e-12
    )
    assert 1.22e-4 < clipping.clip_margin(torch.float32) < 1.23e-4
    assert clipping.clip_margin(torch.float64) == pytest.approx(_derived_margin(2.0**-53), rel=1e-9)


def _scalar_cases(count: int):
    """Linear(1 -> 2) on one input of ~100: a norm far above CLIP_EPS, and a release of one
    rounded product per entry, whose rounding decides whether it lands above C."""
    generator = torch.Generator().manual_seed(0)
    for i in range(count):
        torch.manual_seed(i)
        x = (torch.rand(1, 1, generator=generator) + 0.5) * 100
        yield nn.Linear(1, 2, bias=False), x, torch.randint(0, 2, (1,), generator=generator)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("engine_name", ENGINES)
def test_without_the_margin_a_constructed_example_exceeds_c(monkeypatch, engine_name, precision):
    def worst(count: int) -> float:
        most = 0.0
        for model, x, y in _scalar_cases(count):
            engine = make_engine(engine_name, 1.0, model, precision=make_precision(precision))[0]
            most = max(most, released(engine, model, x, y))
            if most > 1.0:
                break
        return most

    assert worst(60) <= 1.0  # with the margin: never above C
    _without_margin(monkeypatch)
    _without_slack(monkeypatch)
    assert worst(400) > 1.0  # without it, one of the first 400 lands above C (measured: within 40)


class CancellingPositions(nn.Module):
    """Two positions whose per-position gradients g a_0^T and -g a_1^T nearly cancel."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        h = self.lin(x)
        return h[:, 0] - h[:, 1]


def _cancelling_cases(count: int, ulp: float = 2.0**-16):
    """One example whose second position differs from the first by ``ulp`` of one coordinate:
    its gradient is ~ulp of W = sum_t ||g_t|| ||a_t||, and a float32 release of the two
    products errs by ~u W, i.e. ~2^-8 of the gradient (far above the margin)."""
    generator = torch.Generator().manual_seed(0)
    for i in range(count):
        torch.manual_seed(i)
        base = torch.randn(1, 16, generator=generator)
        x = torch.stack([base, base.clone()], 1)
        x[:, 1, :1] += base[:, :1] * ulp
        yield CancellingPositions(), x * 1e4, torch.randint(0, 2, (1,), generator=generator)


@pytest.mark.parametrize("engine_name", ["bk", "ghost"])
def test_without_the_slack_cancelling_positions_exceed_c(monkeypatch, engine_name):
    clip = 2.0**-16 * 100  # about 1/100 of these gradients' norms: every one is clipped

    def worst(count: int) -> float:
        most = 0.0
        for model, x, y in _cancelling_cases(count):
            engine = make_engine(engine_name, clip, model)[0]
            most = max(most, released(engine, model, x, y) / clip)
            if most > 1.0:
                break
        return most

    assert worst(40) <= 1.0  # with the slack (and the margin): never above C
    _without_slack(monkeypatch)  # the margin alone (1.2e-4) is far below this rounding
    assert worst(40) > 1.0  # measured: 1.0009 C


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("engine_name", ENGINES)
def test_per_layer_groups_release_at_most_each_groups_bound(engine_name, precision):
    torch.manual_seed(3)
    model, bounds = TwoLayers(), {"conv.*": 0.01, "fc.*": 0.02}
    engine = make_engine(engine_name, bounds, model, precision=make_precision(precision))[0]
    x, y = torch.randn(6, 1, 6, 6) * 3, torch.randint(0, 5, (6,))
    for i in range(len(x)):
        grad_sum, _ = engine.per_example_clipped_sum(
            model, trainable_params(model), (x[i : i + 1], y[i : i + 1])
        )
        for pattern, bound in (("conv.", 0.01), ("fc.", 0.02)):
            group = math.sqrt(
                sum(
                    float(g.double().square().sum())
                    for n, g in grad_sum.items()
                    if n.startswith(pattern)
                )
            )
            assert 0.9 * bound < group <= bound, (engine_name, precision, i, pattern, group / bound)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("engine_name", ENGINES)
def test_lora_releases_at_most_c(engine_name, precision):
    from dpscale.models.peft import apply_lora

    torch.manual_seed(4)
    model = TwoLayers()
    apply_lora(model, rank=2)
    engine = make_engine(engine_name, 1e-3, model, precision=make_precision(precision))[0]
    x, y = torch.randn(5, 1, 6, 6) * 3, torch.randint(0, 5, (5,))
    for i in range(len(x)):
        norm = released(engine, model, x[i : i + 1], y[i : i + 1])
        assert 0.9e-3 < norm <= 1e-3, (engine_name, precision, i, norm / 1e-3)


def _standardised_cancelling_cases(count: int):
    """A weight-standardised Linear (gain frozen) whose two rows standardise to nearly the same u,
    and one input nearly along u: each row's gradient k g (a_c - u <u, a_c>) is ~1e-4 of W =
    |k g| |a_c|, so the closed form's norm (|a_c|^2 - (2 - |u|^2) t^2) cancels."""
    from dpscale.layers import ScaledStdLinear

    generator = torch.Generator().manual_seed(1)
    for i in range(count):
        torch.manual_seed(i)
        model = ScaledStdLinear(16, 2, bias=False)
        model.gain.requires_grad_(False)
        with torch.no_grad():
            model.weight[1] = 2 * model.weight[0] + 1e-3 * torch.randn(16, generator=generator)
            u = model.standardized_weight()[0]
        x = (u + 1e-4 * torch.randn(16, generator=generator)).unsqueeze(0) * 100
        yield model, x, torch.randint(0, 2, (1,), generator=generator)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("engine_name", ENGINES)
def test_weight_standardised_linear_releases_at_most_c_when_its_norm_cancels(
    engine_name, precision
):
    def norm_and_release(model, x, y, clip: float) -> tuple[float, float]:
        engine = make_engine(engine_name, clip, model, precision=make_precision(precision))[0]
        grad_sum, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x, y))
        return float(norms[0]), math.sqrt(
            sum(float(g.double().square().sum()) for g in grad_sum.values())
        )

    for model, x, y in _standardised_cancelling_cases(20):
        norm, _ = norm_and_release(model, x, y, clip=1e6)  # unclipped: the gradient's own norm
        assert norm > 0
        clip = norm / 100  # every example clipped, the gradient a 1e-4 remnant of W
        _, release = norm_and_release(model, x, y, clip)
        assert release <= clip


@pytest.mark.parametrize("engine_name", ENGINES)
def test_weight_standardised_linear_drops_an_overflowing_example_exactly(engine_name):
    """An example whose input overflows adds exactly nothing through the closed form's float64
    cache (the engine zeroes its cached rows), as removing it would."""
    from dpscale.layers import ScaledStdLinear

    torch.manual_seed(0)
    model = nn.Sequential(ScaledStdLinear(12, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(6, 12), torch.randint(0, 3, (6,))
    engine = make_engine(engine_name, 0.5, model)[0]
    keep = torch.arange(6) != 2
    without, _ = engine.per_example_clipped_sum(model, trainable_params(model), (x[keep], y[keep]))
    x_bad = x.clone()
    x_bad[2, :4] = float("inf")
    with_bad, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x_bad, y))
    assert not bool(torch.isfinite(norms[2])) and bool(torch.isfinite(norms[keep]).all())
    for n in without:
        torch.testing.assert_close(with_bad[n], without[n], rtol=1e-6, atol=1e-9)


def test_a_single_row_linear_s_float64_sums_of_squares_are_taken_in_a_bounded_buffer():
    """Issue 62: a T = 1 Linear's input norms squared a float64 copy of the whole (B, n) input (2 x
    315 MB for a linear model's 512-image chunk at 160 px, a streamed run's peak); block by block in
    one reused buffer they are the whole copy's sums bit for bit (every block of 2 rows or more)."""
    from dpscale.privacy.clipping.peak_memory import cpu_allocation_peak

    gen = torch.Generator().manual_seed(0)
    for rows, n in [(40, 76_800), (41, 76_800), (3, 200_000), (1000, 300), (2, 5), (1, 9), (0, 4)]:
        # a strided view, as a3[:, 0] may be
        v = torch.randn(rows, 1, 2 * n, generator=gen)[:, 0, ::2] * 10
        assert torch.equal(ghost_rules.float64_row_sq_sums(v), v.double().square().sum(1)), (
            rows,
            n,
        )
    v = torch.randn(64, 76_800, generator=gen)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        ghost_rules.float64_row_sq_sums(v)
    # measured 1.2 MB; the whole float64 copy and its square: 75 MB
    assert cpu_allocation_peak(prof) < 4 * 2**20
