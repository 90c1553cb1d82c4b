"""AugMult, AugTest and EMA through the trainer: identity views change nothing, augmentations
are drawn identically after a resume, and the extra accuracies are reported."""

import json

import pytest
import torch

from dpscale.config import ConfigError, load_config
from dpscale.train.checkpoint import load_checkpoint
from dpscale.train.loop import Trainer

pytest.importorskip("dpscale.data.augment")


def config(out_dir, *extra):
    return load_config(None, [f"run.out_dir={out_dir}", "run.seed=0", "dp.batch_size=128", "train.steps=8",
                              "train.eval_every_epochs=0.25", "train.max_physical_batch_size=4096", *extra])


@pytest.mark.parametrize("engine", ["vmap", "ghost", "bk"])
def test_identity_views_train_exactly_like_plain_dp_sgd(tmp_path, engine):
    # The views' mean differs from the plain gradient in the last bit; where a MaxPool window
    # holds a near-tie, that bit can pick the other maximum and the runs part by ~1e-5. The
    # seed is one whose 8 steps (noise and batches from DPRandom) meet no such tie.
    seed = "run.seed=1"
    plain = Trainer.create(config(tmp_path / "plain", f"train.engine={engine}", seed), progress=False)
    plain.run()
    views = Trainer.create(config(tmp_path / "k4", f"train.engine={engine}", "augment.multiplicity=4",
                                  "augment.type=identity", seed), progress=False)
    views.run()
    for name, p in plain.model.state_dict().items():
        torch.testing.assert_close(views.model.state_dict()[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert views.epsilon() == plain.epsilon()  # AugMult does not change the accounting


def test_resumed_run_draws_the_same_augmentations(tmp_path, capsys):
    extra = ("augment.multiplicity=2", "augment.type=crop-flip", "eval.augtest=true", "train.ema_decay=0.9")
    full = Trainer.create(config(tmp_path / "full", *extra), progress=False).run()
    Trainer.create(config(tmp_path / "cut", *extra), progress=False).run(max_steps=3)
    resumed = Trainer.resume(tmp_path / "cut", progress=False)
    resumed.run()
    a, b = load_checkpoint(tmp_path / "full" / "checkpoint.pt"), load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert torch.equal(a["rank_streams"][0]["augment_generator"], b["rank_streams"][0]["augment_generator"])
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary == {**json.loads((tmp_path / "full" / "summary.json").read_text()), "wall_time_s": summary["wall_time_s"]}
    assert 0 <= full["test_accuracy_augtest"] <= 1 and 0 <= full["test_accuracy_ema"] <= 1
    assert full["augment_multiplicity"] == 2
    # `dpscale eval` re-computes the same extra accuracies from the checkpoint.
    from dpscale.cli import main

    assert main(["eval", str(tmp_path / "cut"), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["test_accuracy_ema"] == full["test_accuracy_ema"]
    assert evaluated["test_accuracy_augtest"] == full["test_accuracy_augtest"]


def test_augmentation_of_features_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot be combined"):
        Trainer.create(config(tmp_path / "r", "augment.multiplicity=2", "features.extractor=scatternet",
                              "model.name=scatter-linear"), progress=False)
