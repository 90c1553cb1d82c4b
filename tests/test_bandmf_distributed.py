"""BandMF on torch.distributed (gloo, CPU processes): two ranks equal one.

Several steps of correlated noise on 2 ranks (each clipping its shard of the same logical
batches, the noise rank alone adding the correlated noise) give the 1-process weights, and a
2-process ``dpscale train`` job with ``dp.mechanism=bandmf`` resumed as one process spends exactly
the epsilon of the uninterrupted 1-process run (the partition and the accounting carry over).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpscale.models import build_model
from dpscale.privacy.noise.banded import BandedNoise
from dpscale.privacy.noise.bandmf import optimize_strategy
from dpscale.privacy.workload import Workload
from dpscale.privacy.clipping.engines import make_engine
from dpscale.rng import DPRandom
from dpscale.train.distributed import Distributed, launch_command
from dpscale.train.step import apply_gradient, noisy_clipped_mean, physical_chunks

from helpers import leave_spawned_worker

REPO = Path(__file__).resolve().parents[1]
SIGMA, CLIP, EXPECTED_B, STEPS, BANDS = 1.3, 0.7, 16.0, 5, 3
BATCHES = [
    torch.tensor(b)
    for b in (
        [0, 3, 4, 9, 17, 22, 30],
        [1, 5, 8, 13, 40, 41],
        [2, 6, 33, 35, 50, 61, 62, 63],
        [7, 10, 11, 20],
        [12, 14, 15, 16, 18, 19, 21],
    )
]


def _problem():
    torch.manual_seed(0)
    model = build_model("papernot-cnn", 10, (1, 28, 28), "tanh", filters=[4, 4])
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)


def _train(
    rank: int = 0, world: int = 1, reduce=None, adds_noise: bool = True
) -> dict[str, torch.Tensor]:
    """STEPS steps of BandMF on this rank's shard of BATCHES; the final weights."""
    model, x, y = _problem()
    engine, _ = make_engine("auto", CLIP, model)
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9
    )
    noise = BandedNoise(optimize_strategy(Workload(steps=STEPS, momentum=0.9), BANDS).coefficients)
    generator = DPRandom(99)
    for batch in BATCHES:
        mine = batch[batch % world == rank]
        gradient, _ = noisy_clipped_mean(
            engine,
            model,
            physical_chunks(x, y, mine, 3),
            noise_std=SIGMA * CLIP,
            expected_batch_size=EXPECTED_B,
            noise_generator=generator,
            all_reduce_sum=reduce,
            add_noise=adds_noise,
            correlate=noise.next,
        )
        apply_gradient(model, gradient, optimizer)
    return dict(model.state_dict())


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ctx = Distributed(rank, world, rank, "gloo")
    params = _train(rank, world, ctx.all_reduce_sum_, ctx.adds_noise)
    if rank == 0:
        torch.save(params, Path(out) / "rank0.pt")
    dist.barrier()
    dist.destroy_process_group()
    leave_spawned_worker()


def test_two_ranks_take_the_one_process_bandmf_steps(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    two = torch.load(tmp_path / "rank0.pt", weights_only=False)
    one = _train()
    for name, p in one.items():
        torch.testing.assert_close(two[name], p, rtol=1e-5, atol=1e-6)
    # the test can fail: without the noise history (DP-SGD's noise) the weights differ
    model, _, _ = _problem()
    assert any(not torch.allclose(p, model.state_dict()[k]) for k, p in one.items())


def _job(nproc: int, *args: str) -> None:
    cmd, env = launch_command(nproc, list(args))
    import subprocess

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]


JOB = [
    "--set",
    "model.name=linear",
    "--set",
    "dp.batch_size=256",
    "--set",
    "dp.accountant=rdp",
    "--set",
    "dp.mechanism=bandmf",
    "--set",
    "dp.bands=4",
    "--set",
    "train.steps=20",
    "--set",
    "train.eval_every_epochs=0.5",
    "--set",
    "run.seed=0",
    "--set",
    "run.threads=1",
    "--quiet",
]


@pytest.mark.slow
def test_a_two_process_bandmf_job_resumed_as_one_process_spends_the_one_process_epsilon(tmp_path):
    whole = tmp_path / "whole"
    _job(1, "train", *JOB, "--set", f"run.out_dir={whole}")
    cut = tmp_path / "cut"
    _job(2, "train", *JOB, "--set", f"run.out_dir={cut}", "--max-steps", "9")
    _job(1, "train", "--resume", str(cut), "--quiet")
    a, b = (json.loads((d / "summary.json").read_text()) for d in (whole, cut))
    assert b["epsilon"] == a["epsilon"] and b["steps"] == a["steps"] == 20 and b["world_size"] == 1
    assert a["bandmf"]["bands"] == b["bandmf"]["bands"] == 4 and b["sampling"] == "cyclic poisson"
    history = torch.load(cut / "checkpoint.pt", weights_only=False)["mechanism"]["accountant"][
        "history"
    ]
    assert sum(seg[2] for seg in history) == 5  # ceil(20 / 4) compositions, none twice
