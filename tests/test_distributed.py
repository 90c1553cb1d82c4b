"""Data-parallel DP-SGD on torch.distributed (gloo, CPU processes).

The 2-process step is checked against the 1-process step (same logical batch, same noise seed),
the total noise std against sigma * C (a chi-square test: twice the noise would show as sqrt(2)),
the sharded sampler against Poisson sampling of the whole set, and whole torchrun jobs against
single-process runs (epsilon, accuracy band, resume with a different number of processes).
"""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpscale.privacy.sampling.samplers import PoissonSampler
from dpscale.models import build_model
from dpscale.privacy.clipping.engines import make_engine
from dpscale.rng import DPRandom
from dpscale.train.distributed import Distributed, launch_command, rank_stream_seed
from dpscale.train.step import apply_gradient, noisy_clipped_mean, physical_chunks

from helpers import REPO, SHARED_MNIST, leave_spawned_worker, run_job

SIGMA, CLIP, EXPECTED_B = 1.3, 0.7, 32.0
NOISE_DRAWS = 400


# --------------------------------------------------------------- sampler
def test_sharded_poisson_sampler_is_a_poisson_sample_of_the_whole_set():
    n, q, world, draws = 1001, 0.2, 3, 3000
    samplers = [PoissonSampler(n, q, DPRandom(10 + r), r, world) for r in range(world)]
    counts = torch.zeros(n)
    for _ in range(draws):
        parts = [s.sample() for s in samplers]
        for r, part in enumerate(parts):
            assert bool((part % world == r).all())  # each rank draws only from its shard
        union = torch.cat(parts)
        assert union.unique().numel() == union.numel()  # disjoint
        counts[union] += 1
    # every example is included with probability q: per-example binomial z-scores
    z = (counts - draws * q) / math.sqrt(draws * q * (1 - q))
    assert z.abs().max() < 5.0
    assert abs(float(z.mean())) < 4.0 / math.sqrt(n)
    assert samplers[0].shard_size + samplers[1].shard_size + samplers[2].shard_size == n


def test_one_process_sampler_is_unchanged():
    # rank 0 of 1 draws exactly uniform(N) < q, as before distributed training existed
    a = PoissonSampler(500, 0.1, DPRandom(4))
    g = DPRandom(4)
    for _ in range(5):
        expected = (g.uniform(500) < 0.1).nonzero().flatten()
        assert torch.equal(a.sample(), expected)
    assert rank_stream_seed(123, 0, 1, 0) == 123
    seeds = {
        rank_stream_seed(123, r, p, s) for r, p, s in [(0, 2, 0), (1, 2, 0), (0, 1, 50), (0, 2, 50)]
    }
    assert len(seeds) == 4 and 123 not in seeds
    assert all(s < 2**128 for s in seeds) and max(seeds) >= 2**64  # 128-bit seeds for DPRandom


# ------------------------------------------------- one step on 1 vs 2 ranks
def _problem():
    torch.manual_seed(0)
    model = build_model("papernot-cnn", 10, (1, 28, 28), "tanh", filters=[4, 4])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    batch = torch.tensor([0, 3, 4, 7, 8, 9, 15, 16, 22, 23, 30, 31, 33, 40, 41, 47, 50, 51, 58, 63])
    return model, x, y, batch


def _step(model, x, y, indices, reduce=None, add_noise=True):
    engine, _ = make_engine("auto", CLIP, model)
    generator = DPRandom(99)
    gradient, stats = noisy_clipped_mean(
        engine,
        model,
        physical_chunks(x, y, indices, 6),
        noise_std=SIGMA * CLIP,
        expected_batch_size=EXPECTED_B,
        noise_generator=generator,
        all_reduce_sum=reduce,
        add_noise=add_noise,
    )
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9
    )
    apply_gradient(model, gradient, optimizer)
    return gradient, stats


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ctx = Distributed(rank, world, rank, "gloo")
    model, x, y, batch = _problem()
    mine = batch[batch % world == rank]  # this rank's shard of the logical batch
    gradient, stats = _step(model, x, y, mine, ctx.all_reduce_sum_, ctx.adds_noise)
    # noise only: an empty batch, so the all-reduced sum is exactly the added noise
    engine, _ = make_engine("auto", CLIP, model)
    generator = DPRandom(1000 + rank)
    draws = []
    for _ in range(NOISE_DRAWS):
        noise, _ = noisy_clipped_mean(
            engine,
            model,
            [],
            noise_std=SIGMA * CLIP,
            expected_batch_size=1.0,
            noise_generator=generator,
            all_reduce_sum=ctx.all_reduce_sum_,
            add_noise=ctx.adds_noise,
        )
        draws.append(torch.cat([v.flatten() for v in noise.values()])[:200])
    if rank == 0:
        torch.save(
            {
                "gradient": gradient,
                "stats": stats.as_dict(),
                "params": dict(model.state_dict()),
                "noise": torch.stack(draws),
            },
            Path(out) / "rank0.pt",
        )
    dist.barrier()
    dist.destroy_process_group()
    leave_spawned_worker()


@pytest.fixture(scope="module")
def two_process_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return torch.load(tmp / "rank0.pt", weights_only=False)


def test_two_process_update_equals_one_process_update(two_process_result):
    model, x, y, batch = _problem()
    gradient, stats = _step(model, x, y, batch)
    for name, g in gradient.items():
        torch.testing.assert_close(two_process_result["gradient"][name], g, rtol=1e-5, atol=1e-6)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(two_process_result["params"][name], p, rtol=1e-5, atol=1e-6)
    two = two_process_result["stats"]
    assert two["examples"] == stats.examples == 20
    assert two["loss_sum"] == pytest.approx(stats.loss_sum, rel=1e-6)
    assert two["clipped_fraction"] == pytest.approx(stats.clipped_fraction)


def test_two_process_noise_has_std_sigma_c_in_total(two_process_result):
    noise = two_process_result["noise"].double()  # NOISE_DRAWS x 200 coordinates
    n = noise.numel()
    variance = float((noise**2).mean())  # mean 0 is known
    expected = (SIGMA * CLIP) ** 2
    # n * var / expected ~ chi-square(n): z-score of the variance ratio; added twice it would be 2.
    z = (variance / expected - 1) / math.sqrt(2 / n)
    assert abs(z) < 4, (variance, expected)
    assert abs(float(noise.mean())) < 4 * SIGMA * CLIP / math.sqrt(n)


# ------------------------------------------------------- torchrun jobs
TINY_JOB = [
    "--set",
    "model.name=linear",
    "--set",
    "dp.batch_size=256",
    "--set",
    "dp.accountant=rdp",
    "--set",
    "train.steps=24",
    "--set",
    "train.eval_every_epochs=0.5",
    "--set",
    "run.seed=0",
    "--set",
    "run.threads=1",
    "--quiet",
]


def _assert_stopped_at(run_dir: Path, step: int, world: int) -> None:
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert (
        state["step"] == step
        and state["world_size"] == world
        and len(state["rank_streams"]) == world
    )
    assert sum(seg[2] for seg in state["mechanism"]["accountant"]["history"]) == step
    assert not (run_dir / "summary.json").exists()


def test_a_checkpoint_of_another_process_count_resumes_on_fresh_streams_in_one_process(
    tmp_path, capsys
):
    """The default stand-in for the torchrun test below (three jobs, ~25 s): a checkpoint that says it
    was written by 2 processes, resumed in one, continues no saved stream (fresh ones, derived from the
    run's seeds and the step: never a replay), says so, and accounts every step once."""
    from dpscale._io import load_checkpoint, save_checkpoint
    from dpscale.train.loop import Trainer

    from helpers import tiny_config

    run_dir = tmp_path / "run"
    Trainer.create(tiny_config(run_dir, "train.steps=6", "run.seed=3"), progress=False).run(
        max_steps=3
    )
    state = load_checkpoint(run_dir / "checkpoint.pt")
    saved_sampler = state["rank_streams"][0]["sampler"]
    # as 2 ranks would write it
    state["world_size"], state["rank_streams"] = (2, state["rank_streams"] * 2)
    save_checkpoint(run_dir / "checkpoint.pt", state)
    resumed = Trainer.resume(run_dir, progress=False, report=True)
    assert "resuming a 2-process run with 1 process(es)" in capsys.readouterr().err
    # a fresh stream, not the saved one
    assert resumed.mechanism.sampler.state_dict() != saved_sampler
    summary = resumed.run()
    assert summary["steps"] == 6 and summary["world_size"] == 1
    history = load_checkpoint(run_dir / "checkpoint.pt")["mechanism"]["accountant"]["history"]
    assert sum(seg[2] for seg in history) == 6  # every step accounted once, none twice


# ~25 s (three torchrun jobs); the default suite keeps the one-process stand-in above.
@pytest.mark.slow
def test_resume_with_a_different_number_of_processes(tmp_path):
    """Both directions on one run (once two tests, [2-1] and [1-2], each with its own reference and
    cut jobs): 2 processes to step 10, resumed on 1 to step 17, resumed on 2 to the end."""
    whole = tmp_path / "whole"
    run_job(1, "train", *TINY_JOB, "--set", f"run.out_dir={whole}")
    cut = tmp_path / "cut"
    run_job(2, "train", *TINY_JOB, "--set", f"run.out_dir={cut}", "--max-steps", "10")
    _assert_stopped_at(cut, 10, world=2)
    run_job(1, "train", "--resume", str(cut), "--quiet", "--max-steps", "17")  # 2 -> 1
    _assert_stopped_at(cut, 17, world=1)
    out = run_job(2, "train", "--resume", str(cut), "--quiet").stdout  # 1 -> 2
    assert "steps=24" in out
    a = json.loads((whole / "summary.json").read_text())
    b = json.loads((cut / "summary.json").read_text())
    assert b["epsilon"] == a["epsilon"] and b["steps"] == a["steps"] == 24 and b["world_size"] == 2
    history = torch.load(cut / "checkpoint.pt", weights_only=False)["mechanism"]["accountant"][
        "history"
    ]
    assert sum(seg[2] for seg in history) == 24  # every step accounted once, none twice
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 24


# ~25 s (three torchrun jobs): the default suite keeps test_batch_sampling's sharded-draw test,
# which checks the ranks' parts against the one-process draw exactly.
@pytest.mark.slow
@pytest.mark.parametrize(
    "sampler", [["dp.sampling=fixed"], ["dp.max_batch_size=300"]], ids=["fixed", "capped"]
)
def test_fixed_size_and_capped_batches_run_and_resume_across_process_counts(tmp_path, sampler):
    """Issue 45: every rank draws the whole batch from one shared stream and keeps its shard; a run
    cut on 2 processes and resumed on 1 spends what the plan says, each step accounted once."""
    extra = [arg for setting in sampler for arg in ("--set", setting)]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_job(1, "train", *TINY_JOB, *extra, "--set", f"run.out_dir={whole}")
    run_job(2, "train", *TINY_JOB, *extra, "--set", f"run.out_dir={cut}", "--max-steps", "10")
    _assert_stopped_at(cut, 10, world=2)
    run_job(1, "train", "--resume", str(cut), "--quiet")
    a = json.loads((whole / "summary.json").read_text())
    b = json.loads((cut / "summary.json").read_text())
    assert (
        b["epsilon"] == a["epsilon"]
        and b["steps"] == a["steps"] == 24
        and b["sampling"] == a["sampling"]
    )
    history = torch.load(cut / "checkpoint.pt", weights_only=False)["mechanism"]["accountant"][
        "history"
    ]
    assert sum(seg[2] for seg in history) == 24 and {seg[4] for seg in history} == {
        sampler[0].split("=")[1].replace("300", "truncated")
    }


# 36 s (an accuracy band on real MNIST): test_two_process_update_equals_one_process_update checks the
# same equivalence exactly and cheaply in the default suite.
@pytest.mark.slow
@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="needs ../shared/data/mnist-10k")
def test_two_process_mnist_run_matches_one_process(tmp_path):
    args = [
        "train",
        "preset:papernot-mnist-tanh",
        "--set",
        f"data.root={SHARED_MNIST}",
        "--set",
        "train.epochs=4",
        "--set",
        "optim.momentum=0.9",
        "--set",
        "run.seed=0",
        "--set",
        "run.threads=1",
        "--quiet",
    ]
    run_job(1, *args, "--set", f"run.out_dir={tmp_path / 'one'}")
    run_job(2, *args, "--set", f"run.out_dir={tmp_path / 'two'}")
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["noise_rank"] == 0
    assert two["epsilon"] == one["epsilon"] and two["steps"] == one["steps"]
    assert one["test_accuracy"] > 0.88
    # same band: other batches and noise, same law
    assert abs(two["test_accuracy"] - one["test_accuracy"]) < 0.02


# 25 s (a real torchrun kill): the default suite keeps the cross-world-size resume below and
# test_run_faults' single-process kills.
@pytest.mark.slow
def test_sigterm_stops_every_rank_at_one_step_and_a_single_process_finishes(tmp_path):
    """A real kill: SIGTERM to torchrun mid-run, then resume on one process."""
    import signal
    import time

    from dpscale.privacy import compute_epsilon

    run = tmp_path / "run"
    sets = [
        "--set",
        "model.name=papernot-cnn",
        "--set",
        "model.kwargs={filters: [4, 4]}",
        "--set",
        "dp.batch_size=128",
        "--set",
        "dp.accountant=rdp",
        "--set",
        "train.steps=300",
        "--set",
        "train.eval_every_epochs=1000",
        "--set",
        "train.checkpoint_every_steps=5",
        "--set",
        "run.seed=1",
        "--set",
        "run.threads=1",
    ]
    cmd, env = launch_command(2, ["train", *sets, "--set", f"run.out_dir={run}", "--quiet"])
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while (
        not (run / "checkpoint.pt").exists() and time.monotonic() < deadline and job.poll() is None
    ):
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert "interrupted after step" in err, err[-2000:]
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    stopped = state["step"]
    assert 0 < stopped < 300 and state["world_size"] == 2
    # ranks stopped together
    assert sum(seg[2] for seg in state["mechanism"]["accountant"]["history"]) == stopped

    run_job(1, "train", "--resume", str(run), "--quiet")
    summary = json.loads((run / "summary.json").read_text())
    history = torch.load(run / "checkpoint.pt", weights_only=False)["mechanism"]["accountant"][
        "history"
    ]
    assert summary["steps"] == 300 and sum(seg[2] for seg in history) == 300
    expected = compute_epsilon(
        sample_rate=summary["sample_rate"],
        noise_multiplier=summary["noise_multiplier"],
        steps=300,
        delta=summary["delta"],
        kind="rdp",
    )
    # what an uninterrupted run spends
    assert summary["epsilon"] == pytest.approx(expected, rel=1e-12)
