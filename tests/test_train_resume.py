"""Runs that stop and go on: resume bit-identity (every sampling and mechanism), interrupts, checkpoints
(atomic, periodic, by time), a run directory claimed once, and the outputs of the shared full run."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.privacy import compute_epsilon
from dpscale._io import load_checkpoint, save_checkpoint
from dpscale.train.loop import Trainer
from helpers import small_config


def _without_wall_time(records):
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in records]


def _assert_identical_runs(dir_a: Path, dir_b: Path):
    ckpt_a, ckpt_b = (
        load_checkpoint(dir_a / "checkpoint.pt"),
        load_checkpoint(dir_b / "checkpoint.pt"),
    )
    for name, tensor in ckpt_a["model"].items():
        assert torch.equal(tensor, ckpt_b["model"][name]), name
    assert ckpt_a["mechanism"]["accountant"] == ckpt_b["mechanism"]["accountant"]
    # DPRandom states: dicts of ints
    assert ckpt_a["mechanism"]["noise_generator"] == ckpt_b["mechanism"]["noise_generator"]
    summary_a = json.loads((dir_a / "summary.json").read_text())
    summary_b = json.loads((dir_b / "summary.json").read_text())
    summary_a.pop("wall_time_s"), summary_b.pop("wall_time_s")
    assert summary_a == summary_b
    read = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert _without_wall_time(read(dir_a)) == _without_wall_time(read(dir_b))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted ``small_config()`` run, shared by the tests that compare against it or read its
    outputs (they only read it): a 24-step run costs as much as each test's own work."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    Trainer.create(small_config(run_dir), progress=False).run()
    return run_dir


MODES = {
    "poisson": (),
    "shuffle": ("dp.sampling=shuffle",),
    "non-private": ("dp.epsilon=null", "dp.noise_multiplier=0"),
    # correlated noise (issue 27): the noise history, the cyclic sampler's step and partition resume
    "bandmf": ("dp.mechanism=bandmf", "dp.bands=3"),
    # Features + private Data Normalization: the released statistics must be reused on resume.
    "scatter-datanorm": (
        "features.extractor=scatternet",
        "features.normalize=datanorm",
        "features.norm_clip=[0.2, 0.05]",
        "data.normalize=false",
        "model.name=scatter-linear",
        "dp.max_grad_norm=0.1",
    ),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_continues_bit_identically_and_never_counts_a_step_twice(tmp_path, mode, request):
    if MODES[mode]:
        full_dir = tmp_path / "full"
        Trainer.create(small_config(full_dir, *MODES[mode]), progress=False).run()
    else:  # poisson: small_config() itself, the shared uninterrupted run
        full_dir = request.getfixturevalue("full_run")
    assert json.loads((full_dir / "summary.json").read_text())["steps"] == 24

    split_dir = tmp_path / "split #2"  # also: a name YAML would mangle
    part = Trainer.create(small_config(split_dir, *MODES[mode]), progress=False)
    assert part.run(max_steps=11) is None  # stops between evaluations, mid-window
    assert load_checkpoint(split_dir / "checkpoint.pt")["step"] == 11
    moved = tmp_path / "2024"  # a moved/renamed run directory resumes where it now is
    split_dir.rename(moved)
    resumed = Trainer.resume(moved, progress=False)
    accounted = resumed.plan.compositions  # ceil(steps / b): b = 1 but for BandMF
    assert resumed.step == 11 and resumed.mechanism.accountant.steps == (
        accounted(11) if mode != "non-private" else 0
    )
    resumed.run()
    assert resumed.mechanism.accountant.steps == (accounted(24) if mode != "non-private" else 0)
    assert not (tmp_path / "split").exists()
    _assert_identical_runs(full_dir, moved)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_checkpoints_a_consistent_state_then_resumes_identically(
    tmp_path, monkeypatch, signum, full_run
):
    trainer = Trainer.create(small_config(tmp_path / "cut"), progress=False)
    original = Trainer.train_step

    def step_then_signal(self):
        original(self)
        if self.step == 5:  # Ctrl-C / preemption arrives during step 5: it completes, then we stop
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    monkeypatch.setattr(Trainer, "train_step", original)
    state = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert state["step"] == 5 and state["mechanism"]["accountant"]["history"][0][2] == 5
    Trainer.resume(tmp_path / "cut", progress=False).run()
    _assert_identical_runs(full_run, tmp_path / "cut")


def test_run_outputs_and_epsilon_accounting(full_run):
    run_dir = full_run
    summary = json.loads((run_dir / "summary.json").read_text())  # what run() returned, as written
    for name in ("config.yaml", "metrics.jsonl", "checkpoint.pt", "summary.json"):
        assert (run_dir / name).is_file()
    for key in (
        "test_accuracy",
        "epsilon",
        "delta",
        "noise_multiplier",
        "steps",
        "sampling",
        "accountant",
        "wall_time_s",
    ):
        assert key in summary
    # The reported epsilon is what an independent recomputation of the same mechanism gives,
    # and never more than the target.
    independent = compute_epsilon(
        sample_rate=128 / 4000,
        noise_multiplier=summary["noise_multiplier"],
        steps=24,
        delta=1e-5,
        kind="pld",
    )
    assert summary["epsilon"] == pytest.approx(independent, rel=1e-9)
    assert 4 * (1 - 1e-3) <= summary["epsilon"] <= 4.0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [8, 16, 24]
    assert all(a["epsilon"] < b["epsilon"] for a, b in zip(records, records[1:]))
    for r in records:
        assert {"step", "train_loss", "test_accuracy", "epsilon", "wall_time_s"} <= set(r)
        # its only caveat (small_config sets run.seed)
        assert r["privacy_note"].startswith("run.seed is fixed")
    # The resolved config reloads to the same config.
    assert load_config(run_dir / "config.yaml") == small_config(run_dir)


def test_cli_max_steps_then_resume(tmp_path, capsys):
    run_dir = tmp_path / "stop"
    args = [
        "train",
        "--quiet",
        "--set",
        f"run.out_dir={run_dir}",
        "--set",
        "train.steps=8",
        "--set",
        "dp.batch_size=200",
        "--set",
        "model.name=linear",
    ]
    assert main(args + ["--max-steps", "3"]) == 0
    assert "--resume" in capsys.readouterr().out
    assert not (run_dir / "summary.json").exists()
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
    # Starting a new run over an existing one is refused (nothing is lost).
    assert main(args) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 1})

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left behind
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="unreadable"):
        load_checkpoint(path)


def test_a_run_directory_is_claimed_once(tmp_path):
    first = Trainer.create(small_config(tmp_path / "same"), progress=False)
    with pytest.raises(ConfigError, match="in use by another dpscale process"):
        # before any checkpoint exists
        Trainer.create(small_config(tmp_path / "same"), progress=False)
    first.run(max_steps=2)
    assert load_config(tmp_path / "same" / "config.yaml") == small_config(tmp_path / "same")


def test_periodic_checkpoints_survive_a_crash(tmp_path, monkeypatch):
    trainer = Trainer.create(
        small_config(tmp_path / "crash", "train.checkpoint_every_steps=2"), progress=False
    )
    original = Trainer.train_step

    def crash_at_step_6(self):
        if self.step == 5:
            raise RuntimeError("simulated crash")
        original(self)

    monkeypatch.setattr(Trainer, "train_step", crash_at_step_6)
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.run()
    assert load_checkpoint(tmp_path / "crash" / "checkpoint.pt")["step"] == 4


def test_resume_refuses_changed_training_data(tmp_path):
    import numpy as np

    def write(path, seed):
        rng = np.random.default_rng(seed)
        np.savez(
            path,
            x_train=rng.integers(0, 256, (300, 8, 8), dtype=np.uint8),
            y_train=rng.integers(0, 3, 300),
            x_test=rng.integers(0, 256, (50, 8, 8), dtype=np.uint8),
            y_test=rng.integers(0, 3, 50),
        )

    data = tmp_path / "d.npz"
    write(data, 0)
    cfg = small_config(
        tmp_path / "run",
        "data.name=npz",
        f"data.root={data}",
        "model.name=linear",
        "dp.batch_size=50",
    )
    Trainer.create(cfg, progress=False).run(max_steps=3)
    write(data, 1)  # same size, different examples
    with pytest.raises(ConfigError, match="differs"):
        Trainer.resume(tmp_path / "run", progress=False)


def test_checkpoints_by_time_and_at_the_end(tmp_path, monkeypatch):
    saves = []
    original = Trainer.save
    monkeypatch.setattr(Trainer, "save", lambda self: saves.append(self.step) or original(self))
    Trainer.create(small_config(tmp_path / "default"), progress=False).run()
    assert saves == [24]  # a short run: only the end (evaluations no longer checkpoint)
    saves.clear()
    trainer = Trainer.create(
        small_config(tmp_path / "often", "train.checkpoint_every_minutes=1e-9"), progress=False
    )
    trainer.run(max_steps=5)
    assert saves == [1, 2, 3, 4, 5, 5]  # every step, then on stopping early
    saves.clear()
    Trainer.create(
        small_config(
            tmp_path / "steps",
            "train.checkpoint_every_minutes=null",
            "train.checkpoint_every_steps=10",
        ),
        progress=False,
    ).run()
    assert saves == [10, 20, 24]
