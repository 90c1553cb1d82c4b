"""A checkpoint written by the code of 2026-11-24 (checkpoint format 1, before the mechanism
wrote its own state) resumes under today's code, where it left off: the same accounting, the
same sampling stream, and the result of the uninterrupted run it was cut from."""

import json
import shutil
from pathlib import Path

import pytest

from dpscale._io import load_checkpoint
from dpscale.checkpoint_format import CHECKPOINT_FORMAT, migrate
from dpscale.train.loop import Trainer

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint-format-1"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_format_1_checkpoint_is_migrated_to_the_current_layout():
    state = load_checkpoint(FIXTURE / "checkpoint.pt")
    assert state["format"] == CHECKPOINT_FORMAT == 2 and migrate(state) is state
    mechanism = state["mechanism"]
    assert mechanism["steps_taken"] == state["step"] == 6 and not state["fresh_streams"]
    assert mechanism["sampler"] == state["rank_streams"][0]["sampler"]
    assert mechanism["accountant"]["history"][0][2] == 6  # six steps accounted, in one segment
    assert not {"plan", "accountant", "noise_generator"} & set(state)


def test_a_checkpoint_of_format_1_resumes_where_it_stopped(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    (run_dir / "full-run-metrics.jsonl").unlink()
    resumed = Trainer.resume(run_dir, progress=False)
    assert resumed.step == 6 and resumed.mechanism.accountant.steps == 6
    # the sampler continues its stream: its next draws are those of a run started afresh, after 6 draws
    fresh = Trainer(_moved(resumed.config, tmp_path / "fresh"), progress=False)
    for _ in range(6):
        fresh.mechanism.sampler.sample()
    assert resumed.mechanism.sampler.state_dict() == fresh.mechanism.sampler.state_dict()
    summary = resumed.run()
    expected = _records(FIXTURE / "full-run-metrics.jsonl")
    got = _records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    # float64 accounting: the epsilons of the uninterrupted run. The fixture's were computed with
    # the numpy/scipy of 2026-11-24; a newer build's FFT rounds the PLD convolutions differently
    # (measured: 1.2e-11 relative with numpy 2.4.6), far below what one step more or less moves (~1e-2).
    assert [r["epsilon"] for r in got] == pytest.approx([r["epsilon"] for r in expected], rel=1e-9)
    # float32 training on another CPU may differ in the last bits; the same run within 1% accuracy
    assert summary["test_accuracy"] == pytest.approx(expected[-1]["test_accuracy"], abs=0.01)
    assert summary["steps"] == 12


def _moved(config, out_dir):
    from dataclasses import replace

    return replace(config, run=replace(config.run, out_dir=str(out_dir)))
