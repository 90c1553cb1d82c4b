"""DPRandom, the 128-bit-seeded generator of every privacy-relevant stream.

torch's CPU generator keeps the low 32 bits of ``manual_seed``: seeds s and s + k * 2^32 gave the
same DP noise and the same Poisson batches, so the noise behind released statistics could be
recovered by trying all 2^32 seeds. Here: every seed bit counts, states survive checkpoints
(``torch.load(weights_only=True)``) bit-identically, the draws have the right distributions, and
checkpoints of before (torch ByteTensor generator states) resume with fresh streams.
"""

import io
import math
import shutil

import numpy as np
import pytest
import torch
from scipy import stats

from dpscale._io import load_checkpoint, save_torch_file
from dpscale.privacy.sampling.samplers import PoissonSampler, ShuffleSampler, make_sampler
from dpscale.features.normalize import private_channel_mean
from dpscale.privacy.noise.gaussian import add_gaussian_noise
from dpscale.rng import DPRandom, derive_seed, is_dprandom_state, words_to_int
from dpscale.train.distributed import rank_stream_seed
from dpscale.train.loop import Trainer
from dpscale.train.seeds import run_seeds
from helpers import small_config

HIGH_BITS = [2**32, 2 * 2**32, 2**32 * 2**32]  # k * 2^32 for k = 1, 2, 2^32


def _through_torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # as the checkpoint loader reads


# ------------------------------------------------------------ seed bits
@pytest.mark.parametrize("offset", HIGH_BITS)
def test_seeds_differing_above_bit_32_give_different_noise_and_samples(offset):
    for seed in (0, 12345):
        a, b = DPRandom(seed), DPRandom(seed + offset)
        assert not torch.equal(a.normal((64,)), b.normal((64,)))
        pa, pb = (
            PoissonSampler(2000, 0.1, DPRandom(seed)),
            PoissonSampler(2000, 0.1, DPRandom(seed + offset)),
        )
        assert not torch.equal(pa.sample(), pb.sample())
        noise = lambda s: add_gaussian_noise({"w": torch.zeros(50)}, 1.0, DPRandom(s))["w"]  # noqa: E731
        assert not torch.equal(noise(seed), noise(seed + offset))


def test_every_bit_of_a_128_bit_seed_counts():
    base = (1 << 127) | 0x1234
    first = {DPRandom(base ^ (1 << bit)).normal((4,)).numpy().tobytes() for bit in range(128)}
    assert len(first) == 128 and DPRandom(base).normal((4,)).numpy().tobytes() not in first


@pytest.mark.parametrize("offset", HIGH_BITS)
def test_trainer_seeds_give_128_bit_privacy_streams(offset):
    a, b = run_seeds(7), run_seeds(7 + offset)
    for stream in ("noise", "sampler", "features"):
        assert a[stream] != b[stream]
        assert not torch.equal(DPRandom(a[stream]).normal((32,)), DPRandom(b[stream]).normal((32,)))
        assert not torch.equal(
            make_sampler("poisson", 3000, 300, DPRandom(a[stream])).sample(),
            make_sampler("poisson", 3000, 300, DPRandom(b[stream])).sample(),
        )
    # fresh runs: 128-bit seeds (each below 2^64 with probability 2^-64)
    fresh = run_seeds(None)
    assert all(2**64 <= fresh[s] < 2**128 for s in ("noise", "sampler", "features"))
    assert len({fresh[s] for s in ("noise", "sampler", "features")}) == 3
    # the torch streams (init, augmentation) keep their 64-bit seeds of before
    old = np.random.SeedSequence(7).generate_state(6, dtype=np.uint64)
    assert (a["init"], a["augment"], a["augtest"]) == (int(old[0]), int(old[4]), int(old[5]))


def test_rank_streams_are_128_bit_and_distinct():
    base = run_seeds(3)["sampler"]
    assert rank_stream_seed(base, 0, 1, 0) == base  # one process from step 0: the run's own stream
    derived = [
        rank_stream_seed(base, r, p, s)
        for r, p, s in [(0, 2, 0), (1, 2, 0), (0, 1, 50), (0, 2, 50)]
    ]
    assert len(set(derived) | {base}) == 5 and all(d < 2**128 for d in derived)
    assert rank_stream_seed(base + 2**64, 0, 2, 0) != derived[0]  # high bits of the base count too
    assert derive_seed(5, (1, 2)) != derive_seed(5, (2, 1))
    assert words_to_int(np.array([1, 2], dtype=np.uint64)) == 1 + (2 << 64)


# ------------------------------------------------------------ state
def test_state_round_trip_through_weights_only_load_continues_bit_identically():
    rng = DPRandom(2**200 + 17)
    rng.normal((3,))  # odd count of float32 draws: half a 64-bit output is buffered in the state
    rng.uniform(5)
    state = _through_torch_save({"rng": rng.state_dict()})["rng"]
    assert is_dprandom_state(state)
    expected = [
        rng.normal((7, 3)),
        rng.normal((5,), dtype=torch.float64),
        rng.uniform(11),
        rng.permutation(9),
    ]
    resumed = DPRandom(0)
    resumed.load_state_dict(state)
    got = [
        resumed.normal((7, 3)),
        resumed.normal((5,), dtype=torch.float64),
        resumed.uniform(11),
        resumed.permutation(9),
    ]
    assert all(torch.equal(e, g) for e, g in zip(expected, got))


@pytest.mark.parametrize(
    "make",
    [
        lambda: PoissonSampler(500, 0.05, DPRandom(9), rank=1, world_size=2),
        lambda: ShuffleSampler(20, 6, DPRandom(9)),
    ],
)
def test_sampler_state_survives_a_checkpoint(make):
    sampler = make()
    for _ in range(5):
        sampler.sample()
    state = _through_torch_save(sampler.state_dict())
    after = [sampler.sample() for _ in range(6)]
    other = make()
    other.load_state_dict(state)
    assert all(torch.equal(a, other.sample()) for a in after)


def test_loading_a_torch_generator_state_is_refused():
    with pytest.raises(ValueError, match="PCG64DXSM"):
        DPRandom(0).load_state_dict(torch.Generator().get_state())


def test_torch_generators_are_refused_for_privacy_streams():
    with pytest.raises(TypeError, match="DPRandom"):
        add_gaussian_noise({"w": torch.zeros(3)}, 1.0, torch.Generator())
    with pytest.raises(TypeError, match="DPRandom"):
        PoissonSampler(10, 0.5, torch.Generator())
    with pytest.raises(TypeError, match="DPRandom"):
        ShuffleSampler(10, 2, torch.Generator())
    with pytest.raises(TypeError, match="DPRandom"):
        private_channel_mean(torch.zeros(4, 2, 1, 1), 1.0, 1.0, torch.Generator())
    for bad in (-1, 1.5, True, "7"):
        with pytest.raises(ValueError, match="non-negative integer"):
            DPRandom(bad)


# ------------------------------------------------------------ draws
def test_normal_dtypes_shapes_and_devices():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = DPRandom(1).normal((2, 3), dtype=dtype)
        assert x.dtype == dtype and x.shape == (2, 3) and x.device.type == "cpu"
    # half precision: the float32 draws, cast
    assert torch.equal(
        DPRandom(1).normal((8,), dtype=torch.bfloat16), DPRandom(1).normal((8,)).bfloat16()
    )
    assert DPRandom(1).normal(()).shape == () and DPRandom(1).normal((0, 4)).shape == (0, 4)
    with pytest.raises(TypeError, match="floating"):
        DPRandom(1).normal((2,), dtype=torch.int64)
    perm = DPRandom(2).permutation(100)
    assert perm.dtype == torch.int64 and torch.equal(perm.sort().values, torch.arange(100))
    u = DPRandom(2).uniform(1000)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_same_noise_on_cpu_and_cuda():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        cpu = DPRandom(5).normal((1000,), dtype=dtype)
        cuda = DPRandom(5).normal((1000,), dtype=dtype, device="cuda")
        assert cuda.device.type == "cuda" and torch.equal(cpu, cuda.cpu())
    grads = {"a": torch.zeros(10, device="cuda"), "b": torch.zeros(3, 3, device="cuda")}
    noisy = add_gaussian_noise(grads, 2.0, DPRandom(4))
    reference = add_gaussian_noise({k: v.cpu() for k, v in grads.items()}, 2.0, DPRandom(4))
    assert all(torch.equal(noisy[k].cpu(), reference[k]) for k in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_noise_is_standard_normal(dtype):
    x = DPRandom(20240101).normal((200_000,), dtype=dtype).double().numpy()
    n = x.size
    assert abs(x.mean()) < 5 / math.sqrt(n)
    assert x.std() == pytest.approx(1.0, rel=5 / math.sqrt(2 * n))
    assert abs(stats.skew(x)) < 5 * math.sqrt(6 / n) and abs(stats.kurtosis(x)) < 5 * math.sqrt(
        24 / n
    )
    assert stats.kstest(x, "norm").pvalue > 1e-3


def test_large_draws_are_parallel_chunks_with_the_same_values_on_any_thread_count():
    from dpscale.rng import PARALLEL_CHUNK

    threads = torch.get_num_threads()
    shape = (3, PARALLEL_CHUNK + 12345)  # several chunks, the last one partial
    try:
        torch.set_num_threads(1)
        one = DPRandom(2**100 + 5).normal(shape)
        torch.set_num_threads(2)
        generator = DPRandom(2**100 + 5)
        two = generator.normal(shape)
        after = generator.normal((7,))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    flat = two.flatten()
    # chunks differ
    assert not torch.equal(flat[:1000], flat[PARALLEL_CHUNK : PARALLEL_CHUNK + 1000])
    x = flat.double().numpy()
    assert abs(x.mean()) < 5 / math.sqrt(x.size) and x.std() == pytest.approx(
        1.0, rel=5 / math.sqrt(2 * x.size)
    )
    assert stats.kstest(x[::7], "norm").pvalue > 1e-3
    # the key comes from the stream: a checkpoint taken before the draw continues bit-identically
    restored = DPRandom(0)
    restored.load_state_dict(_through_torch_save(DPRandom(2**100 + 5).state_dict()))
    assert torch.equal(restored.normal(shape), two) and torch.equal(restored.normal((7,)), after)
    for offset in HIGH_BITS:  # and every seed bit still counts
        assert not torch.equal(DPRandom(2**100 + 5 + offset).normal(shape)[:, :100], two[:, :100])


def test_noise_std_through_add_gaussian_noise():
    std = 0.91
    noisy = add_gaussian_noise(
        {"w": torch.zeros(100, 1000), "b": torch.zeros(3)}, std, DPRandom(77)
    )
    sample = noisy["w"].flatten().double().numpy()
    assert stats.kstest(sample, "norm", args=(0, std)).pvalue > 1e-3


def test_uniforms_and_permutations_are_uniform():
    u = DPRandom(8).uniform(100_000).numpy()
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    rng, n, draws = DPRandom(8), 10, 5000
    positions = np.zeros((n, n))  # where each element lands: uniform over the n places
    for _ in range(draws):
        positions[np.arange(n), rng.permutation(n).numpy()] += 1
    chi2 = float(((positions - draws / n) ** 2 / (draws / n)).sum())
    assert stats.chi2.sf(chi2, (n - 1) ** 2) > 1e-3


def test_poisson_inclusion_frequency_per_example_is_q():
    n, q, draws = 400, 0.03, 5000
    sampler = PoissonSampler(n, q, DPRandom(2**100 + 3))
    counts = np.zeros(n)
    for _ in range(draws):
        counts[sampler.sample().numpy()] += 1
    # every example: a two-sided binomial test, Bonferroni over the n examples
    p_values = [stats.binomtest(int(c), draws, q).pvalue for c in counts]
    assert min(p_values) > 1e-3 / n
    assert stats.binomtest(int(counts.sum()), n * draws, q).pvalue > 1e-3


# ------------------------------------------------------------ checkpoints of before
def _make_legacy(run_dir):
    """Rewrite a checkpoint as the code before DPRandom wrote it: torch ByteTensor generator states."""
    state = as_format_1(load_checkpoint(run_dir / "checkpoint.pt"))
    state["noise_generator"] = torch.Generator().manual_seed(1).get_state()
    for stream in state["rank_streams"]:
        stream["sampler"]["generator"] = torch.Generator().manual_seed(2).get_state()
    save_torch_file(run_dir / "checkpoint.pt", state, 1)


def as_format_1(state):
    """A current checkpoint state in checkpoint format 1's layout (plan, accountant and noise
    generator at the top level), as the code of before wrote it."""
    old = {k: v for k, v in state.items() if k not in ("mechanism", "fresh_streams", "format")}
    mechanism = state["mechanism"]
    return {
        **old,
        "plan": mechanism["plan"],
        "accountant": mechanism["accountant"],
        "noise_generator": mechanism["noise_generator"],
    }


def test_a_legacy_checkpoint_resumes_with_fresh_streams_and_a_notice(tmp_path, capsys):
    run_dir = tmp_path / "legacy"
    Trainer.create(small_config(run_dir, "train.steps=8"), progress=False).run(max_steps=3)
    shutil.copytree(run_dir, tmp_path / "current")
    _make_legacy(run_dir)
    capsys.readouterr()
    resumed = Trainer.resume(run_dir, progress=True)
    notice = [
        line for line in capsys.readouterr().err.splitlines() if "32-bit-seeded torch" in line
    ]
    assert len(notice) == 1 and "fresh 128-bit streams from step 3" in notice[0]
    assert resumed.step == 3 and resumed.mechanism.accountant.steps == 3
    # fresh, derived from run.seed and the step: neither the step-0 streams nor the continued ones
    current = Trainer.resume(tmp_path / "current", progress=False)
    seeds = run_seeds(0)
    for stream, rng in (
        ("noise", resumed.mechanism.noise_generator),
        ("sampler", resumed.mechanism.sampler.generator),
    ):
        assert rng.state_dict() != DPRandom(seeds[stream]).state_dict()
    assert (
        resumed.mechanism.noise_generator.state_dict()
        != current.mechanism.noise_generator.state_dict()
    )
    assert resumed.mechanism.sampler.state_dict() != current.mechanism.sampler.state_dict()
    resumed.close()  # the run directory's lock, taken again by resumed.run()
    again = Trainer.resume(run_dir, progress=False)  # a seeded run: the same fresh streams again
    assert (
        again.mechanism.noise_generator.state_dict()
        == resumed.mechanism.noise_generator.state_dict()
    )
    again.close()
    summary = resumed.run()
    assert summary["steps"] == 8 and resumed.mechanism.accountant.steps == 8
    written = load_checkpoint(run_dir / "checkpoint.pt")
    assert is_dprandom_state(written["mechanism"]["noise_generator"])
    assert is_dprandom_state(written["rank_streams"][0]["sampler"]["generator"])


def test_an_unseeded_legacy_checkpoint_resumes_with_new_entropy(tmp_path):
    run_dir = tmp_path / "unseeded"
    Trainer.create(small_config(run_dir, "run.seed=null", "train.steps=4"), progress=False).run(
        max_steps=2
    )
    _make_legacy(run_dir)
    first = Trainer.resume(run_dir, progress=False)
    first.close()  # the run directory's lock (one process at a time), taken again by first.run()
    second = Trainer.resume(run_dir, progress=False)
    second.close()
    assert (
        first.mechanism.noise_generator.state_dict()
        != second.mechanism.noise_generator.state_dict()
    )
    assert first.mechanism.sampler.state_dict() != second.mechanism.sampler.state_dict()
    first.run()
    assert first.step == 4
