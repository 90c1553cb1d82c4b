"""BandMF: the strategy math against dense float64 references, the sensitivity of banded C
under b-min-separated participation (brute force), the optimiser, its cache, and the online
correlated-noise recursion against the dense C^{-1} Z."""

import itertools
import json
import math

import pytest
import torch

from dpscale.privacy.noise import bandmf, bandmf_math
from dpscale.privacy.noise.banded import BandedNoise
from dpscale.privacy.noise.bandmf import optimize_strategy
from dpscale.privacy.noise.bandmf_math import (
    inverse_column,
    normalize,
    relative_error,
    squared_error,
    strategy_matrix,
    workload_matrix,
)
from dpscale.privacy.workload import Workload

F64 = torch.float64


def warmup_cosine(steps: int, warmup: int) -> tuple[float, ...]:
    """Linear warmup over ``warmup`` steps, then cosine decay to 0 (the last step's rate is 0)."""
    return tuple(
        (t + 1) / warmup
        if t < warmup
        else 0.5 * (1 + math.cos(math.pi * (t - warmup) / (steps - warmup - 1)))
        for t in range(steps)
    )


def random_band(bands: int, seed: int) -> tuple[float, ...]:
    """Normalised coefficients, c_0 > 0 and the others of random signs, |c_i| >= 0.1 c_0 / 2."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.where(torch.rand(bands - 1, generator=g) < 0.3, -1.0, 1.0).to(F64)
    rest = signs * (0.1 + 0.5 * torch.rand(bands - 1, generator=g, dtype=F64))
    return normalize([1.0 + float(torch.rand((), generator=g, dtype=F64))] + rest.tolist())


def dense_error(coefficients, workload: Workload) -> float:
    """||A C^{-1}||_F^2 from the dense matrices (float64)."""
    c = strategy_matrix(normalize(coefficients), workload.steps)
    product = torch.linalg.solve_triangular(c, workload_matrix(workload), upper=False, left=False)
    return float((product**2).sum())


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@pytest.fixture(autouse=True)
def _fresh_memory_cache(monkeypatch):
    """Each test starts with an empty in-process strategy cache."""
    monkeypatch.setattr(bandmf, "_MEMORY_CACHE", {})


# ------------------------------------------------------------------ online noise


@pytest.mark.parametrize("bands", [1, 3, 8])
def test_online_noise_equals_dense_inverse_times_z(bands):
    steps = 64
    optimised = optimize_strategy(Workload(steps), bands).coefficients
    g = torch.Generator().manual_seed(bands)
    shapes = {"conv.weight": (3, 2, 2), "fc.bias": (5,)}
    z = {
        name: torch.randn((steps, *shape), generator=g, dtype=F64) for name, shape in shapes.items()
    }
    for coefficients in (random_band(bands, seed=10 + bands), optimised):
        noise = BandedNoise(coefficients)
        outputs = [noise.next({name: z[name][t] for name in shapes}) for t in range(steps)]
        c = strategy_matrix(coefficients, steps)
        for name in shapes:
            expected = torch.linalg.solve_triangular(c, z[name].reshape(steps, -1), upper=False)
            got = torch.stack([out[name] for out in outputs]).reshape(steps, -1)
            assert got.dtype == F64
            assert relative_distance(got, expected) < 1e-10
        if bands > 1:  # the noise really is correlated (C^{-1} != I)
            assert relative_distance(outputs[5]["fc.bias"], z["fc.bias"][5]) > 1e-3


def test_one_band_returns_z_bit_for_bit():
    noise = BandedNoise((1.0,))
    z = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    for _ in range(3):
        w = noise.next(z)
        assert all(w[name] is z[name] for name in z)
    assert noise.memory_bytes(z) == 0
    assert noise.state_dict() == {"coefficients": [1.0], "history": []}


def test_state_dict_resumes_bit_for_bit_mid_sequence():
    coefficients = optimize_strategy(Workload(40), 4).coefficients
    g = torch.Generator().manual_seed(3)
    zs = [
        {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)} for _ in range(20)
    ]
    straight = BandedNoise(coefficients)
    reference = []
    for z in zs:
        out = straight.next(z)
        reference.append({name: t.clone() for name, t in out.items()})
        for t in out.values():
            t.mul_(0.0)  # the caller may modify what it gets: the history keeps its own copy
    first = BandedNoise(coefficients)
    for z in zs[:7]:
        first.next(z)
    state = first.state_dict()
    assert len(state["history"]) == 3
    assert torch.equal(state["history"][0]["w"], reference[6]["w"])  # newest first
    assert torch.equal(state["history"][2]["b"], reference[4]["b"])
    assert all(t.device.type == "cpu" for entry in state["history"] for t in entry.values())
    resumed = BandedNoise(coefficients)
    # coefficients survive a JSON round trip exactly (e.g. stored next to a checkpoint)
    resumed.load_state_dict(
        {"coefficients": json.loads(json.dumps(state["coefficients"])), "history": state["history"]}
    )
    for t, z in enumerate(zs[7:], start=7):
        out = resumed.next(z)
        assert all(out[name].dtype == torch.float32 for name in out)
        assert all(torch.equal(out[name], reference[t][name]) for name in out), t
    assert resumed.memory_bytes(zs[0]) == 3 * (30 + 5) * 4


def test_load_state_dict_refuses_other_coefficients_and_bad_history():
    noise = BandedNoise(normalize((1.0, 0.5, 0.25)))
    other = BandedNoise(normalize((1.0, 0.5, 0.2)))
    other.next({"w": torch.randn(3)})
    with pytest.raises(ValueError, match="coefficients"):
        noise.load_state_dict(other.state_dict())
    state = noise.state_dict()
    state["history"] = [{"w": torch.zeros(3)}] * 3  # more than b-1 steps
    with pytest.raises(ValueError, match="at most 2"):
        noise.load_state_dict(state)
    noise.next({"w": torch.randn(3)})
    with pytest.raises(ValueError, match="parameter names"):
        noise.next({"v": torch.randn(3)})
    with pytest.raises(ValueError, match="normalised"):
        BandedNoise((1.0, 0.5))


# ------------------------------------------------------------------ sensitivity


def test_optimised_strategy_columns_have_norm_at_most_one():
    for workload in (Workload(64), Workload(64, 0.9, warmup_cosine(64, 6))):
        coefficients = optimize_strategy(workload, 8).coefficients
        norms = torch.linalg.vector_norm(strategy_matrix(coefficients, 64), dim=0)
        assert float(norms.max()) <= 1 + 1e-12
        assert float(norms.max()) == pytest.approx(1.0, abs=1e-12)
        assert float(norms[-1]) < 0.999  # the last columns are truncated by the matrix's end


def separated_patterns(steps: int, bands: int):
    """Every set of steps whose pairwise distances are >= bands (the empty set included)."""

    def extend(start):
        yield ()
        for first in range(start, steps):
            for rest in extend(first + bands):
                yield (first, *rest)

    return list(extend(0))


@pytest.mark.parametrize("bands", [2, 3, 4])
def test_every_separated_participation_pattern_is_orthogonal(bands):
    checked = 0
    for steps in range(6, 13):
        for coefficients in (
            random_band(bands, seed=steps),
            optimize_strategy(Workload(steps), bands).coefficients,
        ):
            c = strategy_matrix(coefficients, steps)
            patterns = separated_patterns(steps, bands)
            # Fibonacci-like count: every pattern enumerated (e.g. 233 sets for S=12, b=2)
            assert len(patterns) == len({p for p in patterns})
            for pattern in patterns[1:]:
                gram = c[:, list(pattern)].T @ c[:, list(pattern)]
                off = gram - torch.diag(torch.diagonal(gram))
                assert float(off.abs().max()) < 1e-12, pattern
                assert float(torch.diagonal(gram).max()) <= 1 + 1e-12, pattern
                checked += 1
            # Negative control: two steps closer than b share a row of C.
            close = c[:, [2, 2 + bands - 1]]
            assert abs(float(close[:, 0] @ close[:, 1])) > 1e-3
    assert checked > 400  # 434 patterns x 2 bands for b=4, more for b < 4


def test_pattern_enumeration_is_complete():
    # Brute force over all subsets of 8 steps, for the enumeration used above.
    for bands in (2, 3):
        expected = {
            s
            for r in range(9)
            for s in itertools.combinations(range(8), r)
            if all(b - a >= bands for a, b in zip(s, s[1:]))
        }
        assert set(separated_patterns(8, bands)) == expected


# ------------------------------------------------------------------ error


WORKLOADS = {
    "prefix": lambda s: Workload(s),
    "momentum": lambda s: Workload(s, 0.9),
    "momentum+schedule": lambda s: Workload(s, 0.9, warmup_cosine(s, max(2, s // 10))),
    "schedule": lambda s: Workload(s, 0.0, warmup_cosine(s, max(2, s // 10))),
    "constant-lr": lambda s: Workload(s, 0.5, (0.3,) * s),
}


@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_squared_error_equals_dense(kind, monkeypatch):
    # Small blocks and chunks so that the blocked recursion, the blocked momentum filter and
    # the chunked schedule sum all cross several boundaries (and b > block).
    monkeypatch.setattr(bandmf_math, "_BLOCK", 16)
    monkeypatch.setattr(bandmf_math, "_CHUNK_ELEMENTS", 1100)
    steps = 103
    workload = WORKLOADS[kind](steps)
    for seed, bands in enumerate((1, 2, 5, 17, 40, steps)):
        coefficients = random_band(bands, seed) if bands > 1 else (1.0,)
        expected = dense_error(coefficients, workload)
        assert squared_error(coefficients, workload) == pytest.approx(expected, rel=1e-9)
        # scale invariance: the error is that of the normalised band
        scaled = [3.0 * x for x in coefficients]
        assert squared_error(scaled, workload) == pytest.approx(expected, rel=1e-12)
    assert relative_error((1.0,), workload) == 1.0
    assert relative_error((2.5,), workload) == 1.0


def test_inverse_column_equals_dense_inverse(monkeypatch):
    monkeypatch.setattr(bandmf_math, "_BLOCK", 8)
    for bands in (1, 3, 9, 30):
        coefficients = (2.0, *random_band(bands, seed=bands)[1:])  # not normalised: used as given
        c = strategy_matrix(coefficients, 70)
        expected = torch.linalg.solve_triangular(c, torch.eye(70, dtype=F64), upper=False)[:, 0]
        got = inverse_column(coefficients, 70)
        assert got.dtype == F64
        assert relative_distance(got, expected) < 1e-12


@pytest.mark.parametrize("kind", ["prefix", "momentum+schedule"])
def test_error_gradient_equals_dense_autograd(kind, monkeypatch):
    monkeypatch.setattr(bandmf_math, "_BLOCK", 8)
    monkeypatch.setattr(bandmf_math, "_CHUNK_ELEMENTS", 300)
    steps = 45
    workload = WORKLOADS[kind](steps)
    band = torch.tensor(random_band(6, seed=1), dtype=F64, requires_grad=True)
    bandmf_math.error_graph(band, workload).backward()
    dense_band = band.detach().clone().requires_grad_(True)
    index = torch.arange(steps)
    lag = index[:, None] - index[None, :]
    c = torch.where((lag >= 0) & (lag < 6), dense_band[lag.clamp(0, 5)], torch.zeros((), dtype=F64))
    product = torch.linalg.solve_triangular(c, workload_matrix(workload), upper=False, left=False)
    (product**2).sum().backward()
    assert relative_distance(band.grad, dense_band.grad) < 1e-9


def test_workload_matrix_by_hand():
    a = workload_matrix(Workload(3, 0.5, (1.0, 2.0, 4.0)))
    # A[t, r] = sum_{s=r}^{t} eta_s beta^(s-r)
    expected = torch.tensor(
        [[1.0, 0, 0], [1 + 2 * 0.5, 2, 0], [1 + 1 + 4 * 0.25, 2 + 4 * 0.5, 4]], dtype=F64
    )
    assert torch.equal(a, expected)


def test_workload_key_and_description():
    assert Workload(10).key() == Workload(10, 0.0, [1.0] * 10).key()
    keys = {
        Workload(10).key(),
        Workload(11).key(),
        Workload(10, 0.9).key(),
        Workload(10, 0.0, (2.0,) * 10).key(),
    }
    assert len(keys) == 4 and all(len(k) == 16 for k in keys)
    assert Workload(500).describe() == "prefix sums, S=500"
    assert (
        Workload(500, 0.9, warmup_cosine(500, 50)).describe()
        == "prefix sums with momentum 0.9 and a learning-rate schedule, S=500"
    )


# ------------------------------------------------------------------ optimisation


def test_one_band_is_dp_sgd():
    strategy = optimize_strategy(Workload(50, 0.9), 1)
    assert strategy.coefficients == (1.0,)
    assert strategy.bands == 1
    assert strategy.relative_error == 1.0
    assert strategy.squared_error == pytest.approx(
        dense_error((1.0,), Workload(50, 0.9)), rel=1e-12
    )
    assert strategy.rmse == pytest.approx(math.sqrt(strategy.squared_error / 50))


def test_prefix_sum_error_decreases_with_bands():
    workload = Workload(128)
    errors = []
    for bands in (2, 4, 8, 16):
        strategy = optimize_strategy(workload, bands)
        assert strategy.bands == bands
        assert strategy.coefficients[0] > 0
        assert sum(x * x for x in strategy.coefficients) == pytest.approx(1.0, abs=1e-12)
        assert strategy.relative_error == pytest.approx(
            relative_error(strategy.coefficients, workload), rel=1e-12
        )
        # the optimiser does better than its starting point
        assert (
            strategy.relative_error
            < relative_error(bandmf._sqrt_prefix_coefficients(bands), workload) - 1e-3
        )
        errors.append(strategy.relative_error)
    assert errors[0] < 1
    assert all(later <= earlier + 1e-9 for earlier, later in zip(errors, errors[1:]))


def test_two_bands_match_a_grid_search():
    # b = 2: c = (cos a, sin a), one parameter; a coarse grid, then a fine one around its best.
    workload = Workload(128)

    def best_angle(angles):
        return min(angles, key=lambda a: squared_error((math.cos(a), math.sin(a)), workload))

    coarse = best_angle([-1.5 + 3.0 * i / 60 for i in range(61)])
    fine = best_angle([coarse - 0.05 + 0.1 * i / 100 for i in range(101)])
    best = (math.cos(fine), math.sin(fine))
    strategy = optimize_strategy(workload, 2)
    assert strategy.squared_error <= squared_error(best, workload) * (1 + 1e-9)
    assert strategy.coefficients == pytest.approx(best, abs=2e-3)


@pytest.mark.parametrize("bands", [2, 8])
def test_never_worse_than_dp_sgd_with_momentum_and_schedule(bands):
    for workload in (
        Workload(96, 0.9, warmup_cosine(96, 10)),
        Workload(96, 0.99, (0.0,) * 90 + (1.0,) * 6),
    ):
        strategy = optimize_strategy(workload, bands)
        assert strategy.relative_error <= 1.0
        assert (
            strategy.relative_error
            <= relative_error(bandmf._sqrt_prefix_coefficients(bands), workload) + 1e-12
        )
        assert strategy.squared_error == pytest.approx(
            dense_error(strategy.coefficients, workload), rel=1e-9
        )


def test_full_toeplitz_is_at_least_as_good_as_the_square_root():
    workload = Workload(32)
    strategy = optimize_strategy(workload, 32)
    assert (
        strategy.relative_error
        <= relative_error(bandmf._sqrt_prefix_coefficients(32), workload) + 1e-9
    )
    assert strategy.relative_error < optimize_strategy(workload, 8).relative_error


def test_optimisation_is_deterministic(monkeypatch):
    workload = Workload(80, 0.9, warmup_cosine(80, 8))
    first = optimize_strategy(workload, 6)
    monkeypatch.setattr(bandmf, "_MEMORY_CACHE", {})
    assert optimize_strategy(workload, 6) == first


# ------------------------------------------------------------------ cache


@pytest.fixture
def counted(monkeypatch):
    calls = []
    original = bandmf._optimize

    def counting(workload, init):
        calls.append(workload)
        return original(workload, init)

    monkeypatch.setattr(bandmf, "_optimize", counting)
    return calls


def test_cache_in_memory_and_on_disk(tmp_path, counted, monkeypatch):
    workload = Workload(60, 0.9)
    first = optimize_strategy(workload, 5, cache_dir=tmp_path)
    assert len(counted) == 1
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and workload.key() in files[0].name
    assert list(tmp_path.iterdir()) == files  # no temporary file left behind
    assert optimize_strategy(workload, 5, cache_dir=tmp_path) == first  # in memory
    monkeypatch.setattr(bandmf, "_MEMORY_CACHE", {})
    assert optimize_strategy(workload, 5, cache_dir=tmp_path) == first  # from the file
    assert len(counted) == 1
    # An equivalent workload (all-ones multipliers) shares the entry and is reported as given.
    same = optimize_strategy(Workload(60, 0.9, (1.0,) * 60), 5, cache_dir=tmp_path)
    assert same.coefficients == first.coefficients and same.workload.lr_multipliers == (1.0,) * 60
    assert len(counted) == 1


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        b"\xff\xfe binary",
        json.dumps({"coefficients": [1.0, 0.5]}),
        "NAN_COEFFICIENTS",
        "WRONG_LENGTH",
        "NON_POSITIVE_C0",
        "STRINGS",
    ],
)
def test_a_bad_cache_file_is_ignored_and_replaced(tmp_path, counted, monkeypatch, content):
    workload = Workload(60)
    good = optimize_strategy(workload, 4, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    bad = {
        "NAN_COEFFICIENTS": [1.0, float("nan"), 0.1, 0.1],
        "WRONG_LENGTH": [1.0, 0.5, 0.1],
        "NON_POSITIVE_C0": [-0.5, 0.5, 0.5, 0.5],
        "STRINGS": ["1", "0", "0", "0"],
    }
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content in bad:
        path.write_text(json.dumps({**record, "coefficients": bad[content]}))
    else:
        path.write_text(content)
    monkeypatch.setattr(bandmf, "_MEMORY_CACHE", {})
    assert optimize_strategy(workload, 4, cache_dir=tmp_path) == good
    assert len(counted) == 2  # recomputed
    assert json.loads(path.read_text())["coefficients"] == list(good.coefficients)  # and rewritten


def test_a_cached_strategy_comes_back_with_the_exact_bits_computed(tmp_path, counted, monkeypatch):
    """Re-normalising a normalised band changes its last bits for about a third of bands (an
    AVX-512 machine's L-BFGS landed on one): the cache must give back what was computed."""
    import random

    rng = random.Random(0)
    bands = ([1.0] + [rng.random() for _ in range(3)] for _ in range(100))
    raw = next(c for c in bands if normalize(normalize(c)) != normalize(c))  # what "L-BFGS" returns
    workload = Workload(60)
    monkeypatch.setattr(bandmf, "_optimize", lambda w, init: (counted.append(w), tuple(raw))[1])
    computed = optimize_strategy(workload, 4, cache_dir=tmp_path)
    assert computed.coefficients == normalize(raw)  # (the best candidate here) ...
    # ... which re-normalising would change
    assert normalize(computed.coefficients) != computed.coefficients
    monkeypatch.setattr(bandmf, "_MEMORY_CACHE", {})
    loaded = optimize_strategy(workload, 4, cache_dir=tmp_path)
    assert len(counted) == 1 and loaded == computed  # every bit: coefficients and errors
    assert [x.hex() for x in loaded.coefficients] == [x.hex() for x in computed.coefficients]


def test_an_unnormalised_cache_file_comes_back_normalised(tmp_path, counted, monkeypatch):
    workload = Workload(60)
    good = optimize_strategy(workload, 4, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "coefficients": [7.0 * x for x in good.coefficients]}))
    monkeypatch.setattr(bandmf, "_MEMORY_CACHE", {})
    loaded = optimize_strategy(workload, 4, cache_dir=tmp_path)
    assert len(counted) == 1  # read, not recomputed
    assert sum(x * x for x in loaded.coefficients) == pytest.approx(1.0, abs=1e-14)
    assert loaded.coefficients == pytest.approx(good.coefficients, rel=1e-14)
    assert loaded.squared_error == pytest.approx(good.squared_error, rel=1e-12)
    # (1, 0, 0, 0) scaled: also a valid band, read as DP-SGD
    path.write_text(json.dumps({**record, "coefficients": [3.0, 0.0, 0.0, 0.0]}))
    monkeypatch.setattr(bandmf, "_MEMORY_CACHE", {})
    assert optimize_strategy(workload, 4, cache_dir=tmp_path).coefficients == (1.0, 0.0, 0.0, 0.0)
    assert len(counted) == 1


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: optimize_strategy(Workload(10), 0), "bands must be an integer >= 1"),
        (lambda: optimize_strategy(Workload(10), 11), "bands must be between 1"),
        (lambda: optimize_strategy(Workload(10), 2.5), "bands must be an integer"),
        (lambda: Workload(10, 1.0), "momentum must be in"),
        (lambda: Workload(10, -0.1), "momentum must be in"),
        (lambda: Workload(10, float("nan")), "momentum must be in"),
        (lambda: Workload(10, 0.0, (1.0,) * 9), "9 entries"),
        (lambda: Workload(3, 0.0, (1.0, -0.5, 1.0)), "finite and >= 0"),
        (lambda: Workload(3, 0.0, (1.0, float("inf"), 1.0)), "finite and >= 0"),
        (lambda: Workload(3, 0.0, (0.0, 0.0, 0.0)), "all 0"),
        (lambda: Workload(0), "steps must be an integer >= 1"),
        (lambda: normalize((0.0, 1.0)), "c_0 must be > 0"),
        (lambda: normalize(()), "must not be empty"),
        (
            lambda: squared_error((1.0, 0.5, 0.2), Workload(2)),
            "3 bands need at least as many steps",
        ),
        (lambda: BandedNoise((-1.0,)), "c_0 must be > 0"),
    ],
)
def test_bad_input_is_refused_clearly(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_an_unstable_band_gives_infinite_error_and_a_finite_loss():
    # c(x) = 1 - 3x has its root inside the unit circle: C^{-1} grows like 3^t and overflows.
    workload = Workload(1000)
    assert squared_error((1.0, -3.0), workload) == math.inf
    params = torch.tensor([1.0, -3.0], dtype=F64, requires_grad=True)
    # L-BFGS gets a huge finite value and a zero gradient, so its line search backs off
    assert bandmf._log_error_closure(params, workload) == bandmf._DIVERGED_LOSS
    assert torch.equal(params.grad, torch.zeros(2, dtype=F64))
    assert math.isfinite(
        bandmf._log_error_closure(
            torch.tensor([1.0, -0.5], dtype=F64, requires_grad=True), workload
        )
    )


@pytest.mark.parametrize("steps", [1, 2])
def test_tiny_workloads(steps):
    for workload in (Workload(steps), Workload(steps, 0.5, (1.0, 0.5)[:steps])):
        assert squared_error((1.0,), workload) == pytest.approx(
            dense_error((1.0,), workload), rel=1e-14
        )
        assert optimize_strategy(workload, steps).relative_error <= 1.0
