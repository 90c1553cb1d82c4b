"""Per-tensor clipping (issue 42, row 2): ``max_grad_norm_per="tensor"``, Opacus' ``clipping="per_layer"``.

The report's translation of Opacus' ``max_grad_norm=[0.5]*4 + [1.0]*4`` into ``{"conv*": 0.5,
"fc*": 1.0}`` clips each pattern's tensors together (sensitivity 1.118); Opacus clips each tensor on
its own (2.236). Here: every engine's per-tensor clipping equals a float64 per-example loop written
in this file (Opacus' rule, each tensor on its own), each released tensor is <= its C_i with no
tolerance, removing one example moves each tensor by at most C_i, the sensitivity and the noise
through ``make_private`` are sqrt(sum_i C_i^2), the two forms differ, and a shadowed pattern says so.
A config run (``dp.max_grad_norm_per=tensor``) plans sqrt(sum_i C_i^2) over the tensors that train
after model.peft, its engine clips with that mapping, and a resume keeps the form.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpscale
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy.clipping.ghost import rules as ghost_rules
from dpscale.privacy.clipping.bounds import clip_bounds
from dpscale.privacy.clipping.engines import make_engine
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.precision import make_precision
from dpscale.train.loop import Trainer

PATTERNS = {"conv*": 0.5, "fc*": 1.0}  # the report's translation
OPACUS_LIST = [0.5] * 4 + [1.0] * 4  # Opacus' max_grad_norm, one per tensor in parameter order
ENGINES = ["vmap", "bk", "ghost", "auto"]


class ReportNet(nn.Module):
    """The report's shape: 4 conv tensors (2 convolutions, weight and bias) and 4 fc tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 3, 3), nn.Conv2d(3, 4, 3)
        self.fc1, self.fc2 = nn.Linear(4 * 4 * 4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x)))).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h)))


def _net(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return ReportNet().to(dtype)


def _batch(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """8 examples at scales 0.03 to 30: some tensors clipped, others not (checked where it matters)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 1, 8, 8, generator=generator, dtype=torch.float64)
    x = x * torch.logspace(-1.5, 1.5, 8, dtype=torch.float64).view(-1, 1, 1, 1)
    return x.to(dtype), torch.randint(0, 3, (8,), generator=generator)


def _opacus_bounds(model: nn.Module) -> dict[str, float]:
    """Opacus' list by position: the i-th trainable tensor (``model.parameters()`` order) gets the i-th C."""
    return dict(zip((n for n, p in model.named_parameters() if p.requires_grad), OPACUS_LIST))


def _float64_loop(
    model: nn.Module, batch, bounds: dict[str, float]
) -> tuple[list[dict], list[dict]]:
    """Each example alone: its gradient by autograd, each tensor clipped on its own by Opacus'
    rule min(1, C_i / (||g_i|| + 1e-6)). Shares no code with the engines.

    Returns:
        (per example: tensor -> unclipped norm, per example: tensor -> clipped gradient).
    """
    params = dict(model.named_parameters())
    x, y = batch
    norms, clipped = [], []
    for i in range(len(y)):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        norms.append({n: float(g.norm()) for n, g in grads.items()})
        clipped.append(
            {n: min(1.0, bounds[n] / (norms[-1][n] + 1e-6)) * g for n, g in grads.items()}
        )
    return norms, clipped


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def test_the_opacus_list_in_parameter_order_is_the_patterns_per_tensor():
    names = list(trainable_params(_net()))
    assert clip_bounds(PATTERNS, "tensor", names) == _opacus_bounds(_net())
    # the default: today's meaning, unchanged
    assert clip_bounds(PATTERNS, "group", names) == PATTERNS
    assert clip_bounds(0.5, "tensor", names) == {n: 0.5 for n in names}  # Opacus' [0.5] * 8


@pytest.mark.parametrize("engine_name", ENGINES)
def test_every_engine_clips_each_tensor_as_the_float64_loop_and_within_its_bound(engine_name):
    model, batch = _net(), _batch()
    bounds = _opacus_bounds(model)
    norms, clipped = _float64_loop(model, batch, bounds)
    pairs = [(i, n) for i in range(len(norms)) for n in bounds]
    assert any(norms[i][n] > bounds[n] for i, n in pairs) and any(
        norms[i][n] < bounds[n] for i, n in pairs
    )
    engine, notice = make_engine(engine_name, clip_bounds(PATTERNS, "tensor", list(bounds)), model)
    # no fallback
    assert notice is None and engine.name == ("bk" if engine_name == "auto" else engine_name)
    params = trainable_params(model)
    grad_sum, total = engine.per_example_clipped_sum(model, params, batch)
    want_total = torch.tensor(
        [math.sqrt(sum(v * v for v in e.values())) for e in norms], dtype=torch.float64
    )
    torch.testing.assert_close(total, want_total, rtol=1e-7, atol=0.0)
    for n in bounds:
        torch.testing.assert_close(grad_sum[n], sum(c[n] for c in clipped), rtol=1e-7, atol=1e-12)
    x, y = batch
    # each example alone: its release is its clipped gradient, tensor by tensor
    for i in range(len(y)):
        alone, _ = engine.per_example_clipped_sum(model, params, (x[i : i + 1], y[i : i + 1]))
        for n, bound in bounds.items():
            torch.testing.assert_close(alone[n], clipped[i][n], rtol=1e-7, atol=1e-12)
            assert _norm(alone[n]) <= bound, (engine_name, i, n, _norm(alone[n]) / bound)


# the layer-split release (vmap's: the test above)
@pytest.mark.parametrize("engine_name", ["bk", "ghost"])
def test_removing_one_example_moves_each_tensor_by_at_most_its_bound(engine_name):
    model, (x, y) = _net(), _batch()
    bounds = _opacus_bounds(model)
    engine, _ = make_engine(engine_name, clip_bounds(PATTERNS, "tensor", list(bounds)), model)
    params = trainable_params(model)
    full, _ = engine.per_example_clipped_sum(model, params, (x, y))
    sensitivity, reached = math.sqrt(sum(c * c for c in bounds.values())), 0.0
    for i in range(len(y)):
        keep = torch.arange(len(y)) != i
        rest, _ = engine.per_example_clipped_sum(model, params, (x[keep], y[keep]))
        moved = {n: _norm(full[n] - rest[n]) for n in bounds}
        for n, bound in bounds.items():
            assert moved[n] <= bound, (engine_name, i, n, moved[n] / bound)
            reached = max(reached, moved[n] / bound)
        assert math.sqrt(sum(m * m for m in moved.values())) <= sensitivity
    assert reached > 0.99  # a clipped tensor's removal reaches its C_i


@pytest.mark.parametrize("engine_name", ["bk", "ghost"])
def test_an_overflowing_example_contributes_zero_to_every_tensor(engine_name):
    """The adversarial input through the layer-split release: an example whose gradient is not
    finite adds exactly nothing, as removing it would."""
    model, (x, y) = _net(), _batch()
    engine, _ = make_engine(
        engine_name, clip_bounds(PATTERNS, "tensor", list(trainable_params(model))), model
    )
    x_bad = x.clone()
    x_bad[4] = float("inf")
    with_bad, norms = engine.per_example_clipped_sum(model, trainable_params(model), (x_bad, y))
    keep = torch.arange(len(y)) != 4
    without, _ = engine.per_example_clipped_sum(model, trainable_params(model), (x[keep], y[keep]))
    assert not bool(torch.isfinite(norms[4]))
    for n in without:
        torch.testing.assert_close(with_bad[n], without[n], rtol=1e-12, atol=1e-15)


class _ZeroInputNet(nn.Module):
    """A 4000-input linear layer fed zeros (its weight's gradient is zero: its update is the noise
    alone) before a second layer; 4 tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4000, 1), nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_make_private_adds_noise_of_std_sigma_times_the_root_sum_over_tensors():
    """sqrt(sum_i C_i^2) over a.weight, a.bias, b.weight, b.bias = 0.707 (the same patterns per
    group give sqrt(0.3^2 + 0.4^2) = 0.5, ~25 standard errors of this measurement away)."""
    sensitivity = math.sqrt(2 * 0.3**2 + 2 * 0.4**2)  # computed here, not by the library
    torch.manual_seed(0)
    model = _ZeroInputNet()
    sigma, batch = 3.0, 20
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        dataset_size=200,
        batch_size=batch,
        max_grad_norm={"a.*": 0.3, "b.*": 0.4},
        max_grad_norm_per="tensor",
        noise_multiplier=sigma,
        delta=1e-5,
        steps=1,
        seed=5,
        check=False,  # the checks: test_every_engine_... (here the noise alone is measured)
    )
    assert mechanism.plan.sensitivity == pytest.approx(sensitivity, rel=1e-12)
    assert mechanism.plan.noise_std == pytest.approx(sigma * sensitivity, rel=1e-12)
    before = model.a.weight.detach().clone()
    indices = mechanism.sample()
    mechanism.step(torch.zeros(len(indices), 4000), torch.zeros(len(indices), dtype=torch.long))
    measured = float((model.a.weight.detach() - before).std()) * batch / sigma
    assert abs(measured - sensitivity) < 5 * sensitivity / math.sqrt(2 * 4000)
    assert abs(measured - 0.5) > 20 * 0.5 / math.sqrt(2 * 4000)  # not the group form's noise


def _plan(per: str | None):
    model = _net()
    options = {} if per is None else {"max_grad_norm_per": per}
    return dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=1000,
        batch_size=10,
        max_grad_norm=PATTERNS,
        noise_multiplier=2.0,
        delta=1e-5,
        steps=1,
        **options,
    ).plan


def test_the_reports_translation_differs_from_opacus_and_each_form_says_what_it_is():
    group, default, tensor = _plan("group"), _plan(None), _plan("tensor")
    assert default == group  # today's meaning stays the default
    # today: each pattern's tensors clipped together, sqrt(0.5^2 + 1^2)
    assert group.sensitivity == pytest.approx(math.sqrt(1.25))
    assert group.noise_std == pytest.approx(2.0 * 1.118034, rel=1e-6)
    assert "C per layer {conv*: 0.5, fc*: 1} (sensitivity 1.11803)" in group.describe()
    # Opacus' per_layer: each of the 8 tensors on its own, sqrt(4 * 0.5^2 + 4 * 1^2)
    assert tensor.sensitivity == pytest.approx(math.sqrt(5.0))
    assert tensor.noise_std == pytest.approx(2.0 * 2.236068, rel=1e-6)
    listed = ", ".join(f"{n}: {c:g}" for n, c in _opacus_bounds(_net()).items())
    assert f"C per tensor {{{listed}}} (8 tensors, sensitivity 2.23607)" in tensor.describe()
    # and they clip differently: the same batch gives other sums
    model, batch = _net(), _batch()
    names = list(trainable_params(model))
    sums = [
        make_engine("vmap", clip_bounds(PATTERNS, per, names), model)[0].per_example_clipped_sum(
            model, trainable_params(model), batch
        )[0]
        for per in ("group", "tensor")
    ]
    assert max(_norm(sums[0][n] - sums[1][n]) for n in names) > 1e-2


def test_a_deep_models_header_counts_the_tensors_at_each_bound():
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(7)], nn.Linear(3, 2))  # 16 tensors
    plan = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=1000,
        batch_size=10,
        max_grad_norm={"7.*": 2.0, "*": 0.5},
        max_grad_norm_per="tensor",
        noise_multiplier=1.0,
        delta=1e-5,
        steps=1,
    ).plan
    assert "C per tensor (16 tensors: 14 at 0.5, 2 at 2; sensitivity 3.39116)" in plan.describe()


@pytest.mark.parametrize("per", [None, "tensor"])  # None: today's call (the default, "group")
@pytest.mark.parametrize(
    "mapping, message",
    [
        (
            {"*": 1.0, "conv*": 0.5},
            r"pattern 'conv\*' is shadowed by the earlier pattern '\*', which takes all 4 "
            r"parameters it matches .*put specific ones first, a catch-all '\*' last",
        ),
        (
            {"conv*": 0.5, "conv1.*": 0.1, "*": 1.0},
            r"pattern 'conv1\.\*' is shadowed by the earlier pattern 'conv\*'",
        ),
        ({"conv*": 0.5, "zz*": 1.0, "*": 1.0}, r"pattern 'zz\*' matches no trainable parameter"),
    ],
)
def test_a_pattern_left_without_parameters_says_why_in_one_line(per, mapping, message):
    model = _net()
    options = {} if per is None else {"max_grad_norm_per": per}
    with pytest.raises(ValueError, match=message) as caught:
        dpscale.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            dataset_size=1000,
            batch_size=10,
            max_grad_norm=mapping,
            noise_multiplier=1.0,
            delta=1e-5,
            steps=1,
            **options,
        )
    assert "\n" not in str(caught.value) and "match no trainable" not in str(caught.value)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"max_grad_norm_per": "layer"},
            r"PerLayer.per must be one of 'group', 'tensor', got 'layer'",
        ),
        (
            {"max_grad_norm_per": "tensor", "max_grad_norm": None, "noise_multiplier": 0.0},
            r"PerLayer.bounds must be one positive number, got None",
        ),
    ],
)
def test_bad_max_grad_norm_per_is_one_line(options, message):
    model = _net()
    numbers = {
        "dataset_size": 1000,
        "batch_size": 10,
        "max_grad_norm": 1.0,
        "noise_multiplier": 1.0,
        "delta": 1e-5,
    }
    with pytest.raises(ValueError, match=message) as caught:
        dpscale.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1, **{**numbers, **options}
        )
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------------------ config runs

# papernot-cnn with its last two block groups training (head.0, head.2): the frozen features.*
# tensors get no bound, and would add 4 x 0.8^2 to the sum if they did
CONFIG_BOUNDS = {"head.0.*": 0.3, "*": 0.8}
CONFIG_SIGMA = 1.5


def _config_run(run_dir: Path, per: str):
    overrides = [
        f"run.out_dir={run_dir}",
        "run.seed=0",
        "model.name=papernot-cnn",
        "model.peft=last_groups",
        "model.train_last_groups=2",
        "dp.batch_size=16",
        "train.steps=2",
        "dp.epsilon=null",
        f"dp.noise_multiplier={CONFIG_SIGMA}",
        f"dp.max_grad_norm={CONFIG_BOUNDS}",
        f"dp.max_grad_norm_per={per}",
    ]
    trainer = Trainer.create(load_config(None, overrides), progress=False)
    trainer.run(max_steps=1)  # a checkpoint at step 1 of 2
    return trainer


def _first_match(name: str) -> float:
    return next(c for p, c in CONFIG_BOUNDS.items() if fnmatch.fnmatchcase(name, p))


@pytest.mark.parametrize("per, other", [("tensor", "group"), ("group", "tensor")])
def test_a_config_run_plans_the_sensitivity_of_the_clipping_it_runs_and_a_resume_keeps_its_form(
    tmp_path, per, other
):
    trainer = _config_run(tmp_path / "run", per)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    # after model.peft
    assert trainable == ["head.0.weight", "head.0.bias", "head.2.weight", "head.2.bias"]
    plan, header = trainer.plan, trainer.plan.describe()
    if per == "tensor":  # each trainable tensor on its own: sqrt(sum_i C_i^2), computed here
        sensitivity = math.sqrt(sum(_first_match(n) ** 2 for n in trainable))
        assert plan.max_grad_norm == {n: _first_match(n) for n in trainable}
        listed = ", ".join(f"{n}: {_first_match(n):g}" for n in trainable)
        assert f"C per tensor {{{listed}}} (4 tensors, sensitivity {sensitivity:.6g})" in header
    else:  # the old meaning: each pattern's tensors together, sqrt(sum_g C_g^2) (0.854, not 1.208)
        sensitivity = math.sqrt(sum(c**2 for c in CONFIG_BOUNDS.values()))
        assert plan.max_grad_norm == CONFIG_BOUNDS
        assert f"C per layer {{head.0.*: 0.3, *: 0.8}} (sensitivity {sensitivity:.6g})" in header
    assert plan.noise_std == pytest.approx(CONFIG_SIGMA * sensitivity, rel=1e-12)
    assert trainer.built.engine.max_grad_norm == plan.max_grad_norm  # what the engine clips with
    run_dir = tmp_path / "run"
    with pytest.raises(
        ConfigError, match=r"the checkpoint's DP plan clips .*dp\.max_grad_norm_per=" + other
    ) as caught:
        Trainer.resume(run_dir, progress=False, overrides=[f"dp.max_grad_norm_per={other}"])
    assert "\n" not in str(caught.value)
    # unchanged, the checkpoint's mapping and the config's spelled out compare equal
    if per == "tensor":
        resumed = Trainer.resume(run_dir, progress=False)
        assert resumed.plan.max_grad_norm == plan.max_grad_norm
        resumed.run()
        assert (
            json.loads((run_dir / "summary.json").read_text())["max_grad_norm"]
            == plan.max_grad_norm
        )


def test_a_resume_compares_a_mappings_order_first_match_wins():
    """{"head.*.bias": 1, "head.*": 2} gives the biases 1; reversed, 2: other clipping, equal dicts."""
    from dpscale.config import DPConfig
    from dpscale.train.plan_config import check_plan_against_config, plan_from_config

    dp = DPConfig(
        epsilon=None, noise_multiplier=1.0, max_grad_norm={"head.*.bias": 1.0, "head.*": 2.0}
    )
    plan = plan_from_config(dp, 1000, 10)
    check_plan_against_config(plan, dp, 1000, 10)
    reordered = DPConfig(
        epsilon=None, noise_multiplier=1.0, max_grad_norm={"head.*": 2.0, "head.*.bias": 1.0}
    )
    with pytest.raises(
        ConfigError, match=r"the checkpoint's DP plan clips C per layer \{head\.\*\.bias: 1"
    ):
        check_plan_against_config(plan, reordered, 1000, 10)


def test_a_plan_made_without_the_model_refuses_tensor_in_one_line(capsys, monkeypatch):
    """``tan simulate --dry-run`` and ``tan privacy-search --config`` plan without building the
    model: "tensor" is refused there (not planned as "group"), before the data is opened."""
    from dpscale.cli import main
    from dpscale.config import DPConfig
    from dpscale.train import inputs
    from dpscale.train.plan_config import plan_from_config

    def no_data(*args, **kwargs):
        raise AssertionError("the data was opened")

    monkeypatch.setattr(inputs, "open_training_data", no_data)
    message = r"dp\.max_grad_norm_per=tensor needs the model's trainable tensor names .* without building the model"
    with pytest.raises(ConfigError, match=message):
        inputs.plan_inputs(load_config(overrides=["dp.max_grad_norm_per=tensor"]))
    with pytest.raises(ConfigError, match=message):
        plan_from_config(DPConfig(max_grad_norm_per="tensor"), 1000, 10)
    assert (
        main(
            [
                "tan",
                "simulate",
                "--batch-size",
                "64",
                "--dry-run",
                "--set",
                "dp.max_grad_norm_per=tensor",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and "\n" not in err


def test_the_config_key_is_validated_and_tensor_is_accepted():
    assert load_config(overrides=["dp.max_grad_norm_per=group"]).dp.max_grad_norm_per == "group"
    assert load_config(overrides=["dp.max_grad_norm_per=tensor"]).dp.max_grad_norm_per == "tensor"
    with pytest.raises(ConfigError, match=r"dp\.max_grad_norm_per must be 'group'"):
        load_config(overrides=["dp.max_grad_norm_per=layer"])


# ------------------------------------------------------------------- the clip bound, float32


@pytest.mark.kernels  # also under capped CPU kernel families (test_kernel_families.py)
@pytest.mark.parametrize(
    "engine_name, precision", [("vmap", "fp32"), ("bk", "fp32"), ("ghost", "fp32"), ("bk", "bf16")]
)
def test_each_tensor_releases_at_most_its_bound_in_float32(engine_name, precision):
    model, (x, y) = _net(torch.float32), _batch(torch.float32)
    bounds = {n: 1e-3 if n.startswith("conv") else 2e-3 for n in trainable_params(model)}
    engine = make_engine(engine_name, bounds, model, precision=make_precision(precision))[0]
    most = 0.0
    for i in range(len(y)):
        alone, _ = engine.per_example_clipped_sum(
            model, trainable_params(model), (x[i : i + 1], y[i : i + 1])
        )
        for n, bound in bounds.items():
            assert _norm(alone[n]) <= bound, (engine_name, precision, i, n, _norm(alone[n]) / bound)
            most = max(most, _norm(alone[n]) / bound)
    assert most > 0.99


class _CancellingWithBias(nn.Module):
    """Two positions whose weight gradients g a_0^T and -g a_1^T nearly cancel (as in
    test_clip_bound.py), in a layer with a bias: per tensor, the weight is a group of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[:, 0] - h[:, 1]


@pytest.mark.parametrize("engine_name", ["bk", "ghost"])
def test_a_split_layers_weight_keeps_the_slack_of_its_accumulating_release(
    monkeypatch, engine_name
):
    clip = 2.0**-16 * 100  # about 1/100 of these weight gradients' norms: each one is clipped

    def worst(count: int) -> float:
        most, generator = 0.0, torch.Generator().manual_seed(0)
        for i in range(count):
            torch.manual_seed(i)
            model = _CancellingWithBias()
            base = torch.randn(1, 16, generator=generator)
            x = torch.stack([base, base.clone()], 1)
            x[:, 1, :1] += base[:, :1] * 2.0**-16
            y = torch.randint(0, 2, (1,), generator=generator)
            engine = make_engine(
                engine_name, clip_bounds(clip, "tensor", ["lin.weight", "lin.bias"]), model
            )[0]
            grad_sum, _ = engine.per_example_clipped_sum(
                model, trainable_params(model), (x * 1e4, y)
            )
            most = max(most, _norm(grad_sum["lin.weight"]) / clip)
            if most > 1.0:
                break
        return most

    assert worst(40) <= 1.0  # the split weight keeps its slack: never above its C
    no_slack = lambda terms, weight, dtype: torch.zeros_like(weight, dtype=torch.float64)  # noqa: E731
    monkeypatch.setattr(ghost_rules, "release_slack", no_slack)  # the Linear rule
    assert worst(40) > 1.0  # without it, a cancelling example lands above C


# ------------------------------------------------------------------------------------- docs


def test_the_opacus_table_and_clipping_doc_give_the_per_tensor_form():
    docs = Path(__file__).resolve().parents[1] / "docs"
    row = next(
        line
        for line in (docs / "own-loop.md").read_text().splitlines()
        if 'clipping="per_layer"' in line
    )
    assert (
        'PerLayer(bounds={"conv*": 0.5, "fc*": 1.0}, per="tensor")' in row
        and "model.parameters()" in row
    )
    clipping = (docs / "clipping.md").read_text()
    section = re.search(r"\n## Per-tensor norms.*?(?=\n## )", clipping, re.DOTALL)
    assert (
        section
        and "sqrt(sum_i C_i^2)" in section.group(0)
        and 'clipping="per_layer"' in section.group(0)
    )


def test_freezing_a_tensor_after_per_tensor_bounds_were_fixed_is_refused_saying_why():
    # a review found the old refusal spoke of patterns the user never wrote ("add a last '*'")
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    mechanism = dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=40,
        batch_size=8,
        max_grad_norm=0.5,
        max_grad_norm_per="tensor",
        noise_multiplier=1.0,
        delta=1e-5,
        steps=4,
        seed=0,
    )
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    indices = mechanism.sample()
    mechanism.step(x[indices], y[indices])
    model[2].bias.requires_grad_(False)
    indices = mechanism.sample()
    with pytest.raises(
        ValueError,
        match=r"max_grad_norm_per='tensor' fixed one bound per trainable tensor .*now 3, planned 4",
    ):
        mechanism.step(x[indices], y[indices])
