"""What a finished run hands on (issue 30): TensorBoard events, ``dpscale plot`` PNGs and
``dpscale export`` files, checked against the run's own metrics.jsonl and summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpscale.cli import main
from dpscale.runs import read_metrics

STEPS = 20


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A short private run on the embedded MNIST sample (papernot-cnn, 20 steps, EMA on)."""
    out = tmp_path_factory.mktemp("run") / "run"
    sets = ["model.name=papernot-cnn", "dp.batch_size=16", f"train.steps={STEPS}", "train.ema_decay=0.9",
            "run.seed=0", f"run.out_dir={out}"]  # fmt: skip
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    return out


def _events(run_dir: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    board.Reload()
    return board


def test_tensorboard_holds_the_run_scalars_and_its_privacy_statement(run_dir):
    board = _events(run_dir)
    for tag in ("train/loss", "train/clipped_fraction", "train/mean_grad_norm", "train/lr", "time/step_ms"):
        assert [e.step for e in board.Scalars(tag)] == [10, 20], tag
    assert all(0.0 <= e.value <= 1.0 for e in board.Scalars("train/clipped_fraction"))
    assert all(e.value > 0 for e in board.Scalars("train/mean_grad_norm"))
    last = read_metrics(run_dir)[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    for tag, key in [("test/accuracy", "test_accuracy"), ("test/accuracy_ema", "test_accuracy_ema"),
                     ("privacy/epsilon", "epsilon"), ("test/loss", "test_loss")]:  # fmt: skip
        event = board.Scalars(tag)[-1]
        assert event.step == STEPS and event.value == pytest.approx(last[key], rel=1e-6), tag
    assert board.Scalars("privacy/epsilon")[-1].value == pytest.approx(summary["epsilon"], rel=1e-6)
    texts = {tag: board.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in board.Tags()["tensors"]}
    config_tag = next(t for t in texts if t.startswith("config"))
    privacy_tag = next(t for t in texts if t.startswith("privacy"))
    assert "papernot-cnn" in texts[config_tag] and "batch_size: 16" in texts[config_tag]
    assert "epsilon" in texts[privacy_tag] and "delta" in texts[privacy_tag]


def test_tensorboard_off_writes_no_events(tmp_path):
    out = tmp_path / "run"
    sets = ["model.name=papernot-cnn", "dp.batch_size=16", "train.steps=2", "run.tensorboard=false", f"run.out_dir={out}"]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    assert (out / "summary.json").is_file() and not (out / "tensorboard").exists()
