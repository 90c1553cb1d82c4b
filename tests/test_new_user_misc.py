"""Issue 42, rows 3, 7 and 8: a converted BatchNorm1d trains per example, `dpscale plot` writes
owner-only PNGs and takes a folder of runs, a closed stdout pipe is quiet, and every checkpoint
and summary records the dpscale version that a newer-format refusal names."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dpscale
from dpscale._io import VERSION_KEY, load_checkpoint
from dpscale.checkpoint_format import CHECKPOINT_FORMAT
from dpscale.cli import CLOSED_STDOUT_EXIT, main
from dpscale.models import convert_batchnorm_to_groupnorm
from dpscale.plots import PLOT_NAMES


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished 2-step private run (linear model, sigma given: no calibration), one evaluation."""
    out = tmp_path_factory.mktemp("run") / "run"
    sets = [
        "model.name=linear",
        "dp.batch_size=16",
        "train.steps=2",
        "dp.epsilon=null",
        "dp.noise_multiplier=1.0",
        "dp.accountant=rdp",
        "run.tensorboard=false",
        "run.seed=0",
        f"run.out_dir={out}",
    ]
    assert main(["train", "--quiet", *(a for s in sets for a in ("--set", s))]) == 0
    return out


def _is_per_example(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether the first example's output is the same alone and beside others (train mode), up to
    float32 rounding (a convolution's kernel differs with the batch size: ~1e-7)."""
    with torch.no_grad():
        return torch.allclose(model(x[:1]), model(torch.cat([x[:1], 100 * x[1:8]]))[:1], atol=1e-5)


def test_a_converted_batchnorm1d_is_per_example_and_trains_a_private_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    convert_batchnorm_to_groupnorm(model)
    assert _is_per_example(model, x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mechanism = dpscale.make_private(
        model,
        optimizer,
        dataset_size=64,
        batch_size=16,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        steps=1,
        delta=1e-5,
        seed=0,
    )
    before = model[1].weight.detach().clone()
    for indices in mechanism.batches():
        mechanism.step(x[indices], y[indices])
    assert mechanism.steps_taken == 1 and not torch.equal(model[1].weight, before)
    # the same rule on (N, C, L) input: each example's channels and positions normalised together
    sequence = convert_batchnorm_to_groupnorm(
        nn.Sequential(nn.Conv1d(16, 32, 3), nn.BatchNorm1d(32))
    )
    assert _is_per_example(sequence, torch.randn(8, 16, 5))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_batchnorm1d_of_one_feature_is_refused_naming_the_layer():
    # GroupNorm(1, 1) on (N, 1) input would normalise each example's one value to 0 (a review found it)
    model = nn.Sequential(nn.Linear(3, 1), nn.BatchNorm1d(1), nn.Linear(1, 2))
    with pytest.raises(
        ValueError, match=r"layer '1': BatchNorm1d\(1\) has no per-example equivalent"
    ):
        convert_batchnorm_to_groupnorm(model)


def test_plot_of_a_folder_of_runs_writes_owner_only_pngs_one_line_each(run_dir, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for name in ("b", "a"):
        shutil.copytree(run_dir, sweep / "runs" / name)
    (sweep / "runs" / "c").mkdir()
    shutil.copy(run_dir / "config.yaml", sweep / "runs" / "c")  # started, not evaluated yet
    umask = os.umask(0o022)  # a usual umask: without care, files 0644 and folders 0755
    try:
        assert main(["plot", str(sweep)]) == 0
    finally:
        os.umask(umask)
    out = sweep / "plots"
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [str(out / name) for name in PLOT_NAMES]
    assert captured.err.splitlines() == [f"{sweep / 'runs' / 'c'}: no evaluation yet, left out"]
    assert _mode(out) == 0o700 and all(_mode(out / name) == 0o600 for name in PLOT_NAMES)
    assert all((out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in PLOT_NAMES)


def test_a_closed_stdout_pipe_is_quiet(tmp_path):
    read_end, write_end = os.pipe()
    # the reader is gone before dpscale writes: `dpscale presets --json | head` at its worst
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dpscale", "presets", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (CLOSED_STDOUT_EXIT, "")


def test_checkpoint_and_summary_record_the_dpscale_version(run_dir):
    assert load_checkpoint(run_dir / "checkpoint.pt")[VERSION_KEY] == dpscale.__version__
    assert json.loads((run_dir / "summary.json").read_text())[VERSION_KEY] == dpscale.__version__


def test_resume_of_a_newer_format_names_both_versions(run_dir, tmp_path, capsys):
    moved = tmp_path / "newer"
    shutil.copytree(run_dir, moved)
    state = {
        **load_checkpoint(moved / "checkpoint.pt"),
        "format": CHECKPOINT_FORMAT + 1,
        VERSION_KEY: "9.0",
    }
    torch.save(state, moved / "checkpoint.pt")
    assert main(["train", "--resume", str(moved)]) == 2
    newer = CHECKPOINT_FORMAT + 1
    assert capsys.readouterr().err.strip() == (
        f"dpscale train: error: {moved / 'checkpoint.pt'}: checkpoint written by a newer dpscale (version 9.0, "
        f"format {newer}); this is dpscale {dpscale.__version__} reading checkpoint format {CHECKPOINT_FORMAT} "
        "or older: upgrade dpscale"
    )
    del state[VERSION_KEY]  # written before versions were recorded: the format alone
    torch.save(state, moved / "checkpoint.pt")
    with pytest.raises(
        ValueError, match=rf"written by a newer dpscale \(format {newer}\); this is dpscale"
    ):
        load_checkpoint(moved / "checkpoint.pt")
    torch.save({**state, "format": "x"}, moved / "checkpoint.pt")  # not ours: the message of before
    with pytest.raises(
        ValueError, match=rf"is not a dpscale checkpoint \(format {CHECKPOINT_FORMAT}\)$"
    ):
        load_checkpoint(moved / "checkpoint.pt")
