"""Parameter-efficient DP fine-tuning (issue 29, part 3): LoRA, BiTFiT, last k groups.

Every engine's clipped sum and norms of the adapted model equal the float64 per-example loop's;
the frozen backbone is neither clipped nor noised (its weights stay bit-identical through
``make_private`` and ``dpscale train``); LoRA starts as the pretrained function and merges back
into the plain architecture; removing one example moves the released sum by at most C.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import dpscale
from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.layers import LoRADownConv2d, LoRADownLinear
from dpscale.models import build_model
from dpscale.models.peft import LoRAConv2d, LoRALinear, apply_peft, merge_lora
from dpscale.privacy.clipping.engines import make_engine
from dpscale.privacy.clipping.reference import float64_reference

METHODS = ["lora", "bitfit", "last_groups"]


def _adapted(name: str, shape: tuple[int, int, int], method: str) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(name, 10, shape, "tanh").double()
    apply_peft(model, method, rank=4, last_groups=2)
    with torch.no_grad():  # LoRA's B starts at zero: move every trainable tensor off its init
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("engine", ["vmap", "bk", "ghost"])
@pytest.mark.parametrize("method", METHODS)
def test_every_engine_equals_the_float64_loop_on_an_adapted_model(method, engine):
    model = _adapted("papernot-cnn", (1, 28, 28), method)
    batch = (torch.randn(6, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (6,)))
    chosen, notice = make_engine(engine, 0.5, model)
    grad_sum, norms, _ = chosen.clipped_sum_and_losses(model, _trainable(model), batch)
    reference = float64_reference(model, batch, 0.5)
    assert set(grad_sum) == set(reference.clipped_sum) and notice is None
    torch.testing.assert_close(norms, reference.norms, rtol=1e-9, atol=1e-12)
    for name, value in reference.clipped_sum.items():
        torch.testing.assert_close(grad_sum[name], value, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_auto_takes_bk_on_an_adapted_resnet_and_is_exact(method):
    model = _adapted("resnet18-gn", (3, 32, 32), method)
    batch = (torch.randn(3, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (3,)))
    engine, notice = make_engine("auto", 1.0, model)
    assert engine.name == "bk" and notice is None  # exact rules for the adapters: no vmap fallback
    grad_sum, norms, _ = engine.clipped_sum_and_losses(model, _trainable(model), batch)
    reference = float64_reference(model, batch, 1.0)
    torch.testing.assert_close(norms, reference.norms, rtol=1e-8, atol=1e-12)
    for name, value in reference.clipped_sum.items():
        torch.testing.assert_close(grad_sum[name], value, rtol=1e-8, atol=1e-12)


def test_lora_trains_adapters_and_the_logits_layer_only():
    torch.manual_seed(0)
    model = build_model("papernot-cnn", 10, (1, 28, 28), "tanh")
    full = sum(p.numel() for p in model.parameters())
    trainable = apply_peft(model, "lora", rank=4)
    wrapped = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAConv2d))]
    assert len(wrapped) == 3  # two convs and the hidden Linear; the logits layer is not wrapped
    adapters = sum(p.numel() for m in wrapped for p in (m.lora_a.weight, m.lora_b.weight))
    assert trainable == adapters + 32 * 10 + 10 < full / 5
    assert all(not p.requires_grad for m in wrapped for p in m.base.parameters())


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_lora_down_projection_computes_a_and_the_frozen_layer_in_one_call(kind):
    torch.manual_seed(0)
    frozen = (
        nn.Linear(12, 5)
        if kind == "linear"
        else nn.Conv2d(3, 5, 3, stride=2, padding=1, dilation=1)
    )
    frozen = frozen.double().requires_grad_(False)
    down = (LoRADownLinear if kind == "linear" else LoRADownConv2d)(frozen, 2)
    assert [n for n, _ in down.named_parameters()] == ["weight"]  # W stays the adapter's, not A's
    x = (
        torch.randn(4, 12, dtype=torch.float64)
        if kind == "linear"
        else torch.randn(4, 3, 9, 9, dtype=torch.float64)
    )
    alone = down._conv_forward(x, down.weight, None) if kind == "conv" else x @ down.weight.T
    torch.testing.assert_close(down(x), alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(down.take_frozen_output(), frozen(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="before the layer ran"):
        down.take_frozen_output()  # handed over once: no stale tensor kept


def test_lora_starts_as_the_pretrained_function_and_merges_back_exactly():
    torch.manual_seed(0)
    plain = build_model("resnet18-gn", 10, (3, 32, 32), "tanh").double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    before = plain(x)
    model = build_model("resnet18-gn", 10, (3, 32, 32), "tanh").double()
    model.load_state_dict(plain.state_dict())
    apply_peft(model, "lora", rank=4, alpha=8.0)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)  # B = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    adapted = model(x)
    merge_lora(model)
    assert set(model.state_dict()) == set(plain.state_dict())  # the plain architecture again
    torch.testing.assert_close(model(x), adapted, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(adapted, before)
    plain.load_state_dict(model.state_dict())  # exportable as the zoo model


@pytest.mark.parametrize("method", METHODS)
def test_removing_one_example_moves_the_sum_by_at_most_c(method):
    model = _adapted("papernot-cnn", (1, 28, 28), method)
    x, y = torch.randn(5, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (5,))
    x[2] *= 1e3  # an outlier
    engine, _ = make_engine("bk", 0.5, model)
    full, _, _ = engine.clipped_sum_and_losses(model, _trainable(model), (x, y))
    for i in range(5):
        keep = torch.arange(5) != i
        rest, _, _ = engine.clipped_sum_and_losses(model, _trainable(model), (x[keep], y[keep]))
        change = math.sqrt(sum(float((full[n] - rest[n]).square().sum()) for n in full))
        assert change <= 0.5 * (1 + 1e-9)


def test_make_private_leaves_the_frozen_backbone_bit_identical():
    torch.manual_seed(0)
    model = build_model("papernot-cnn", 10, (1, 28, 28), "tanh")
    apply_peft(model, "lora", rank=2)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=200,
        batch_size=20,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=2,
        seed=0,
    )
    x, y = torch.randn(200, 1, 28, 28), torch.randint(0, 10, (200,))
    for indices in mechanism.batches():
        mechanism.step(x[indices], y[indices])
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert any(
        float(m.lora_b.weight.abs().max()) > 0 for m in model.modules() if isinstance(m, LoRALinear)
    )


@pytest.mark.parametrize("method", METHODS)
def test_dpscale_train_with_peft_trains_fewer_parameters(tmp_path, method):
    out = tmp_path / method
    sets = [
        "model.name=papernot-cnn",
        f"model.peft={method}",
        "model.lora_rank=2",
        "dp.batch_size=16",
        "train.steps=2",
        f"run.out_dir={out}",
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["trainable_params"] < 26_010 / 1.5


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.peft=prefix"], "model.peft must be"),
        (["model.peft=lora", "model.freeze_groups=1"], "do not set model.freeze_groups"),
        (["model.peft=lora", "model.lora_targets=[nothing*]"], "match no Linear or Conv2d layer"),
        (
            ["model.peft=last_groups", "model.train_last_groups=9"],
            r"train_last_groups must be in 1..4",
        ),
    ],
)
def test_bad_peft_settings_are_refused(tmp_path, overrides, message):
    from dpscale.train.loop import Trainer

    with pytest.raises(ConfigError, match=message):
        config = load_config(
            None, ["dp.batch_size=16", "train.steps=2", f"run.out_dir={tmp_path}", *overrides]
        )
        Trainer.create(config, progress=False)


def test_evaluation_computes_with_the_merged_weights():
    """Under no_grad an adapted layer is one layer with W + (alpha/r) B A: the merged model's output."""
    import copy

    model = _adapted("papernot-cnn", (1, 28, 28), "lora")
    x = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    training_path = model(x)  # grad enabled: base + adapter branch
    with torch.no_grad():
        evaluated = model(x)
        merged = merge_lora(copy.deepcopy(model))(x)
    torch.testing.assert_close(evaluated, merged, rtol=0, atol=0)
    torch.testing.assert_close(evaluated, training_path.detach(), rtol=1e-10, atol=1e-12)


def test_an_unfrozen_base_under_lora_is_refused_by_bk_and_exact_in_vmap():
    """Adversarial: a user unfreezes W inside a LoRA adapter. W then gets its gradient through the
    fused [A; W] call of A's layer, a route bk's records do not see: bk must refuse, vmap stay exact."""
    model = _adapted("papernot-cnn", (1, 28, 28), "lora")
    model.features[0].base.weight.requires_grad_(True)
    batch = (torch.randn(5, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (5,)))
    bk, _ = make_engine("bk", 0.5, model)
    with pytest.raises(ValueError, match="engine=vmap"):
        bk.clipped_sum_and_losses(model, _trainable(model), batch)
    vmap, _ = make_engine("vmap", 0.5, model)
    grad_sum, norms, _ = vmap.clipped_sum_and_losses(model, _trainable(model), batch)
    reference = float64_reference(model, batch, 0.5)
    assert "features.0.base.weight" in reference.clipped_sum
    torch.testing.assert_close(norms, reference.norms, rtol=1e-9, atol=1e-12)
    for name, value in reference.clipped_sum.items():
        torch.testing.assert_close(grad_sum[name], value, rtol=1e-9, atol=1e-12)


def test_make_private_takes_vmap_for_an_unfrozen_base_under_lora():
    """The public door on the same adversarial model: auto leaves bk for the exact vmap."""
    model = _adapted("papernot-cnn", (1, 28, 28), "lora").float()
    model.features[0].base.weight.requires_grad_(True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=200,
        batch_size=16,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=2,
        seed=0,
    )
    x, y = torch.randn(200, 1, 28, 28), torch.randint(0, 10, (200,))
    before = model.features[0].base.weight.detach().clone()
    for indices in mechanism.batches():
        mechanism.step(x[indices], y[indices])
        break
    assert mechanism.engine.name == "vmap" and not torch.equal(
        model.features[0].base.weight, before
    )
