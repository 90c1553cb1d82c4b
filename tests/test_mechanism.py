"""``dpscale.make_private``: a user's own model and loop, against ``dpscale train`` itself.

The own-loop run must give the Trainer's weights bit for bit (same seed and recipe: the same
sampler, chunks, clipping, noise and accounting), resume from its ``state_dict`` bit-identically,
refuse a step past the budget, and refuse a loss that is not per example.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpscale
from dpscale.config import load_config
from dpscale.data.run_data import prepare_data
from dpscale.train.loop import Trainer

RECIPE = {
    "batch_size": 64,
    "max_grad_norm": 0.5,
    "noise_multiplier": 1.2,
    "delta": 1e-5,
    "steps": 6,
}
LR, MOMENTUM, CHUNK, SEED = 0.3, 0.9, 24, 11


class OwnNet(nn.Module):
    """The user's model (not in dpscale's registry): papernot-cnn's layers, k=4, written out."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 8, stride=2, padding=2),
            nn.Tanh(),
            nn.MaxPool2d(2, stride=1),
            nn.Conv2d(4, 4, 4, stride=2),
            nn.Tanh(),
            nn.MaxPool2d(2, stride=1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _config(out_dir):
    return load_config(
        None,
        [
            "model.name=papernot-cnn",
            "model.kwargs={filters: [4, 4]}",
            f"dp.batch_size={RECIPE['batch_size']}",
            f"dp.max_grad_norm={RECIPE['max_grad_norm']}",
            f"dp.noise_multiplier={RECIPE['noise_multiplier']}",
            "dp.epsilon=null",
            f"train.steps={RECIPE['steps']}",
            f"train.max_physical_batch_size={CHUNK}",
            f"optim.lr={LR}",
            f"optim.momentum={MOMENTUM}",
            f"run.seed={SEED}",
            f"run.out_dir={out_dir}",
        ],
    )


def _own_run(init_state, x, y, steps=None, mechanism_state=None, stop_after=None):
    model = OwnNet()
    model.load_state_dict(init_state["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if "optimizer" in init_state:
        optimizer.load_state_dict(init_state["optimizer"])
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=len(y),
        max_physical_batch_size=CHUNK,
        seed=SEED,
        **RECIPE,  # seeded: the noise state resumes (an unseeded one draws fresh noise)
    )
    if mechanism_state is not None:
        mechanism.load_state_dict(mechanism_state)
    for taken, indices in enumerate(mechanism.batches()):
        mechanism.step(x[indices], y[indices])
        if stop_after is not None and taken + 1 == stop_after:
            break
    return model, optimizer, mechanism


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``dpscale train`` on the recipe, with the initial weights it started from."""
    out = tmp_path_factory.mktemp("train")
    trainer = Trainer.create(_config(out), progress=False)
    init = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.run()
    data = prepare_data(_config(out), torch.device("cpu"))
    return init, trainer, summary, data


def test_own_model_and_loop_through_make_private_equals_dpscale_train(reference):
    init, trainer, summary, data = reference
    model, _, mechanism = _own_run({"model": init}, data.x_train, data.y_train)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert mechanism.epsilon() == summary["epsilon"] and mechanism.steps_taken == summary["steps"]
    assert mechanism.plan == trainer.plan.__class__(**{**trainer.plan.__dict__, "seeded": True})


def test_resuming_from_state_dicts_mid_run_is_bit_identical(reference):
    init, trainer, _, data = reference
    first, optimizer, mechanism = _own_run(
        {"model": init}, data.x_train, data.y_train, stop_after=2
    )
    saved = {"model": first.state_dict(), "optimizer": optimizer.state_dict()}
    state = mechanism.state_dict()
    torch.save(state, "/dev/null")  # a plain state: the user's own checkpoint can hold it
    resumed, _, again = _own_run(saved, data.x_train, data.y_train, mechanism_state=state)
    assert again.steps_taken == RECIPE["steps"]
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_a_step_past_the_budget_is_refused(reference):
    init, _, _, data = reference
    _, _, mechanism = _own_run({"model": init}, data.x_train, data.y_train)
    assert mechanism.remaining_steps() == 0 and list(mechanism.batches()) == []
    spent = mechanism.epsilon()
    with pytest.raises(dpscale.PrivacyBudgetExhausted, match="all 6 planned steps are taken"):
        mechanism.step(data.x_train[:4], data.y_train[:4])
    with pytest.raises(dpscale.PrivacyBudgetExhausted):
        mechanism.sample()
    assert mechanism.epsilon() == spent  # nothing more was accounted


def test_a_loss_that_is_not_per_example_is_refused():
    model = OwnNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=100,
        loss_fn=lambda logits, y: F.cross_entropy(logits, y),
        **RECIPE,
    )
    n = len(mechanism.sample())
    with pytest.raises(
        ValueError, match=rf"one loss per example, shape \({n},\), got \(\).*reduction='none'"
    ):
        mechanism.step(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
    assert mechanism.steps_taken == 0 and mechanism.accountant.steps == 0


def test_custom_per_example_loss_for_a_regression_model():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(200, 3), torch.randn(200, 1)
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=200,
        batch_size=50,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        delta=1e-5,
        epochs=1,
        loss_fn=lambda out, target: ((out - target) ** 2).sum(1),
    )
    before = model.weight.detach().clone()
    for indices in mechanism.batches():
        stats = mechanism.step(x[indices], y[indices])
    assert mechanism.steps_taken == 4 and not torch.equal(before, model.weight)
    assert stats.examples == len(indices)


def test_make_private_argument_errors_are_clear():
    model = OwnNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    base = {"dataset_size": 100, "batch_size": 10, "max_grad_norm": 1.0, "delta": 1e-5}
    with pytest.raises(ValueError, match="exactly one of epochs= and steps="):
        dpscale.make_private(model, optimizer, noise_multiplier=1.0, **base)
    with pytest.raises(ValueError, match="exactly one of target_epsilon="):
        dpscale.make_private(model, optimizer, steps=3, **base)
    with pytest.raises(TypeError):
        dpscale.make_private(model, optimizer, 100, 10)  # privacy numbers are keyword-only


def test_a_state_from_another_plan_is_refused(reference):
    init, _, _, data = reference
    _, _, mechanism = _own_run({"model": init}, data.x_train, data.y_train, stop_after=1)
    other = dpscale.make_private(
        OwnNet(),
        torch.optim.SGD(OwnNet().parameters(), lr=0.1),
        dataset_size=len(data.y_train),
        **{**RECIPE, "noise_multiplier": 2.0},
    )
    with pytest.raises(ValueError, match="different DP plan"):
        other.load_state_dict(mechanism.state_dict())


def test_the_bring_your_own_loop_example_in_the_docs_runs(tmp_path, monkeypatch):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "own-loop.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/own-loop.md", "exec"), scope)
    mechanism = scope["mechanism"]
    assert mechanism.remaining_steps() == 0 and (tmp_path / "checkpoint.pt").exists()
    # sigma calibrated to spend (at most) the target over the plan
    assert 2.99 < mechanism.epsilon() <= 3.0


def test_the_epoch_loop_example_in_the_docs_runs_the_whole_plan(capsys):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "own-loop.md").read_text()
    code = text.split("## An epoch loop", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code, "docs/own-loop.md", "exec"), scope)
    assert scope["mechanism"].remaining_steps() == 0 and scope["steps_per_epoch"] == 40
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "epoch 1",
        "epoch 2",
        "epoch 3",
    ] and "(120 steps)" in lines[-1]


def _tiny(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)


def test_step_on_chunks_and_the_data_loader_equal_step_on_the_whole_batch():
    x, y = torch.randn(90, 1, 3, 4), torch.randint(0, 3, (90,))
    dataset = torch.utils.data.TensorDataset(x, y)
    recipe = dict(
        dataset_size=90,
        batch_size=30,
        max_grad_norm=0.5,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=3,
        seed=4,
    )
    finals = []
    for way in ("whole", "chunks", "loader"):
        model, optimizer = _tiny()
        mechanism = dpscale.make_private(model, optimizer, max_physical_batch_size=7, **recipe)
        if way == "loader":
            for chunks in mechanism.data_loader(dataset):
                assert all(len(cy) <= 7 for _, cy in chunks)
                mechanism.step(chunks)
        else:
            for indices in mechanism.batches():
                if way == "whole":
                    mechanism.step(x[indices], y[indices])
                else:
                    mechanism.step([(x[part], y[part]) for part in indices.split(7)])
        finals.append(model[1].weight.detach().clone())
    assert torch.equal(finals[0], finals[1]) and torch.equal(finals[0], finals[2])


def test_augment_multiplicity_takes_k_views_per_example():
    model, optimizer = _tiny()
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=40,
        batch_size=8,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        delta=1e-5,
        steps=1,
        augment_multiplicity=3,
    )
    indices = mechanism.sample()
    views = torch.randn(len(indices), 3, 1, 3, 4)  # (B, K, C, H, W)
    stats = mechanism.step(views, torch.randint(0, 3, (len(indices),)))
    assert stats.examples == len(indices)


def test_changing_the_head_or_unfreezing_after_building_a_run_is_refused_not_ignored(tmp_path):

    trainer = Trainer.create(_config(tmp_path / "head"), progress=False)
    trainer.model.reset_head(10)  # the optimizer still holds the old head
    with pytest.raises(
        ValueError, match=r"not in the optimizer: head\.0\.bias, head\.0\.weight, head\.2\.bias"
    ):
        trainer.run()
    # nothing trained, nothing spent
    assert trainer.step == 0 and trainer.mechanism.accountant.steps == 0

    frozen = load_config(
        None, [f"run.out_dir={tmp_path / 'frozen'}", "model.freeze_groups=1", "train.steps=2"]
    )
    trainer = Trainer.create(frozen, progress=False)
    trainer.model.features[0].weight.requires_grad_(True)  # unfrozen after the optimizer was made
    with pytest.raises(ValueError, match=r"not in the optimizer: features\.0\.weight"):
        trainer.train_step()

    model, optimizer = _tiny()
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=40,
        batch_size=8,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=3,
    )
    model[1] = nn.Linear(12, 5)
    n = len(mechanism.sample())
    with pytest.raises(ValueError, match=r"not in the optimizer: 1\.bias, 1\.weight"):
        mechanism.step(torch.randn(n, 1, 3, 4), torch.randint(0, 5, (n,)))


def test_freezing_after_building_leaves_the_frozen_layers_unchanged(tmp_path):
    from dpscale.models import freeze_block_groups

    trainer = Trainer.create(_config(tmp_path / "late"), progress=False)
    freeze_block_groups(trainer.model, 1)  # frozen layers get no gradient: the optimizer skips them
    before = trainer.model.features[0].weight.detach().clone()
    head_before = trainer.model.head[2].weight.detach().clone()
    trainer.train_step()
    assert torch.equal(trainer.model.features[0].weight, before)
    assert not torch.equal(trainer.model.head[2].weight, head_before)
