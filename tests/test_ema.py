"""EMA of the weights: the update formula, checkpointing and resume."""

import json

import pytest
import torch
from torch import nn

from dpscale._io import load_checkpoint
from dpscale.train.ema import WeightEMA, decay_not_reached_note, warmup_reaches_decay_at
from dpscale.train.loop import Trainer
from helpers import short_config


def test_ema_follows_the_warmed_up_recursion():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema = WeightEMA(model, decay=0.9)
    expected = [p.detach().clone() for p in model.parameters()]
    for t in range(30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        d = min(0.9, (1 + t) / (10 + t))
        expected = [d * e + (1 - d) * p.detach() for e, p in zip(expected, model.parameters())]
        ema.update(model)
    for e, p in zip(expected, ema.model.parameters()):
        torch.testing.assert_close(p, e)
    assert ema.updates == 30 and ema.current_decay() == pytest.approx(31 / 40)
    # The average is a separate copy: no gradients, and the live model is untouched.
    assert all(not p.requires_grad for p in ema.model.parameters())
    with pytest.raises(ValueError):
        WeightEMA(model, 1.0)


@pytest.mark.parametrize("decay", [0.5, 0.9, 0.99, 0.995, 0.999, 0.9999])
def test_warmup_reaches_the_decay_where_a_step_by_step_search_finds_it(decay):
    first = next(t for t in range(200_000) if (1 + t) / (10 + t) >= decay)
    assert warmup_reaches_decay_at(decay) == first
    ema = WeightEMA(nn.Linear(1, 1), decay)
    ema.updates = first
    assert ema.current_decay() == decay
    ema.updates = first - 1 if first else 0
    assert ema.current_decay() < decay or first == 0


def test_a_decay_the_run_never_reaches_is_reported(tmp_path, capsys):
    note = decay_not_reached_note(0.999, 977)  # the dpscale-fmnist-cnn preset's EMA
    assert note is not None and "8,990" in note and "977 steps" in note and "0.9909" in note
    assert (
        decay_not_reached_note(0.99, 891) is None and decay_not_reached_note(0.99, 890) is not None
    )
    Trainer.create(
        short_config(tmp_path / "run", 12, "train.ema_decay=0.99"), progress=False, report=True
    )
    assert "train.ema_decay=0.99 is never reached" in capsys.readouterr().err


# Slow: the same run-level checks (every record reports the EMA's accuracy, the average resumes
# bit-identically, its update count) are made in the default suite by
# test_augmult_train.py::test_resumed_run_draws_the_same_augmentations, whose run keeps an EMA.
@pytest.mark.slow
def test_run_reports_the_ema_model_and_resumes_it_bit_identically(tmp_path):
    def config(out):
        return short_config(out, 12, "train.ema_decay=0.99")

    full = Trainer.create(config(tmp_path / "full"), progress=False).run()
    assert 0 < full["test_accuracy_ema"] <= 1
    records = [
        json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all("test_accuracy_ema" in r for r in records)

    Trainer.create(config(tmp_path / "split"), progress=False).run(max_steps=5)
    resumed = Trainer.resume(tmp_path / "split", progress=False)
    assert resumed.built.ema.updates == 5
    resumed.run()
    a, b = (
        load_checkpoint(tmp_path / "full" / "checkpoint.pt"),
        load_checkpoint(tmp_path / "split" / "checkpoint.pt"),
    )
    for name, tensor in a["ema"]["model"].items():
        assert torch.equal(tensor, b["ema"]["model"][name]), name
    assert a["ema"]["updates"] == b["ema"]["updates"] == 12
