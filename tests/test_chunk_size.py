"""train.max_physical_batch_size: auto (issue 63, item 6): the largest chunk under a memory budget,
measured once and cached, recorded so that a resumed run chunks as before."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from dpscale import make_private
from dpscale.cli import main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.models import build_model
from dpscale.privacy.clipping.engines import make_engine
from dpscale.train import build as build_module
from dpscale.train import chunk_size
from dpscale.train.chunk_search import choose_units
from dpscale.train.chunk_size import auto_chunk, largest_batch_units, synthetic_unit
from dpscale.train.chunk_cache import CACHE_NAME
from dpscale.train.loop import Trainer
from helpers import plan_of, tiny_config

MB = 1e6


def _linear(fixed: float, per_unit: float, calls: list[int] | None = None):
    """A fake peak measurer: ``fixed + per_unit * n`` bytes, each size asked recorded in ``calls``."""

    def measure(units: int) -> float:
        if calls is not None:
            calls.append(units)
        return fixed + per_unit * units

    return measure


def _largest(peak, budget: float, max_units: int) -> int:
    """The brute-force answer: the largest multiple of 8 (or max_units itself) whose peak fits."""
    if peak(max_units) <= budget:
        return max_units
    return max(n for n in range(8, max_units, 8) if peak(n) <= budget)


@pytest.mark.parametrize("budget_mb", [100, 173.5, 500, 4096])
def test_the_fit_picks_the_largest_multiple_of_8_under_the_budget(budget_mb):
    peak = _linear(20 * MB, 1.5 * MB)
    checked: list[int] = []
    units, measured = choose_units(
        peak, _linear(20 * MB, 1.5 * MB, checked), budget_mb * MB, max_units=10_000
    )
    assert units == _largest(peak, budget_mb * MB, 10_000) and units % 8 == 0
    # run once at the chosen size, and that is what it reports
    assert checked == [units] and measured == peak(units)


def test_a_chunk_is_never_larger_than_the_largest_logical_batch():
    units, _ = choose_units(_linear(MB, MB), _linear(MB, MB), 1e4 * MB, max_units=300)
    assert units == 300  # the whole batch in one chunk: not rounded down to 296
    units, _ = choose_units(_linear(MB, MB), _linear(MB, MB), 1e4 * MB, max_units=1)
    assert units == 1


def test_the_step_parameter_copies_count_against_the_budget():
    units, measured = choose_units(
        _linear(0, MB), _linear(0, MB), 100 * MB, max_units=10_000, extra=20 * MB
    )
    assert units == 80 and measured == 100 * MB


def test_a_peak_above_the_fitted_line_backs_off_to_a_size_that_fits():
    """Convex memory (e.g. a method that switches at larger sizes): the line through the probes
    promises too much; the checked size is refitted until one fits, each fitting size below the truth."""

    def peak(n: int) -> float:
        return 10 * MB + 1 * MB * n + 0.02 * MB * n * n

    checked: list[int] = []

    def check(n: int) -> float:
        checked.append(n)
        return peak(n)

    units, measured = choose_units(peak, check, 500 * MB, max_units=10_000)
    assert measured == peak(units) <= 500 * MB and units % 8 == 0
    assert len(checked) >= 2 and checked[0] > units  # the first checked size did not fit
    assert units >= 0.75 * _largest(peak, 500 * MB, 10_000)


def test_memory_growing_slower_than_the_probes_line_is_used():
    """Methods that change with the size (papernot-cnn: the probes' line promised 22 MB at 240 examples under
    a 30 MB budget, which 603 examples peak at 54 MB): a checked size with room to spare is grown once more."""

    def peak(n: int) -> float:
        return 10 * MB + 2 * MB * n if n <= 16 else 42 * MB + MB * (n - 16)

    checked: list[int] = []
    units, measured = choose_units(
        peak, lambda n: checked.append(n) or peak(n), 300 * MB, max_units=10_000
    )
    assert measured == peak(units) <= 300 * MB and checked[0] < units and units % 8 == 0
    assert units >= 0.9 * _largest(peak, 300 * MB, 10_000)


def test_out_of_memory_at_the_checked_size_halves_it():
    def check(n: int) -> float | None:
        return None if n > 100 else 10 * MB + MB * n  # a CUDA OOM above 100

    checked: list[int] = []
    units, measured = choose_units(
        _linear(10 * MB, MB), lambda n: checked.append(n) or check(n), 400 * MB, max_units=10_000
    )
    assert (
        checked[0] == 384
        and measured == check(units)
        and units in checked
        and units % 8 == 0
        and 64 <= units <= 96
    )


def test_a_budget_between_one_and_two_examples_gives_chunks_of_one():
    assert choose_units(
        _linear(50 * MB, 10 * MB), _linear(50 * MB, 10 * MB), 65 * MB, max_units=256
    ) == (1, 60 * MB)
    with pytest.raises(
        ConfigError, match="one example peaked at 60.0 MB, above the memory budget of 59.0 MB"
    ):
        # the tuned methods need more
        choose_units(_linear(50 * MB, 5 * MB), _linear(50 * MB, 10 * MB), 59 * MB, max_units=256)


def test_a_budget_smaller_than_one_example_is_refused_saying_what_one_needs():
    with pytest.raises(ConfigError) as err:
        choose_units(_linear(50 * MB, 10 * MB), _linear(50 * MB, 10 * MB), 40 * MB, max_units=256)
    message = str(err.value)
    assert "\n" not in message
    assert "one example needs about 60.0 MB (50.0 MB fixed + 10.0 MB per example)" in message
    assert "the memory budget is 40.0 MB" in message


def test_the_largest_logical_batch_of_each_sampling():
    facts = {
        "batch_size": 256,
        "dataset_size": 60_000,
        "steps": 10,
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "delta": 1e-5,
    }
    assert largest_batch_units(plan_of(**facts)) == 256 + 64  # B + 4 sqrt(B)
    assert largest_batch_units(plan_of(**facts, sampling="fixed")) == 256
    assert largest_batch_units(plan_of(**facts, max_batch_size=300)) == 300


def _tiny_engine():
    torch.manual_seed(0)
    model = build_model("linear", 10, (1, 28, 28), "tanh")
    engine, _ = make_engine("bk", 1.0, model)
    return model, engine, synthetic_unit((1, 28, 28), 1, False, torch.float32, torch.device("cpu"))


def test_a_cached_choice_is_not_measured_again_and_the_probe_leaves_the_rng_alone(
    tmp_path, monkeypatch
):
    model, engine, unit = _tiny_engine()
    probes: list[int] = []
    measure = chunk_size.engine_peak

    def counted(*args):
        inner = measure(*args)
        return lambda n: probes.append(n) or inner(n)

    monkeypatch.setattr(chunk_size, "engine_peak", counted)
    options = {
        "rows_per_unit": 1,
        "max_units": 4096,
        "device": torch.device("cpu"),
        "budget_mb": 1.0,
        "setting": "budget",
        "cache_file": tmp_path / CACHE_NAME,
    }
    rng = torch.get_rng_state()
    first = auto_chunk(engine, model, unit, **options)
    assert torch.equal(torch.get_rng_state(), rng)  # the run's streams untouched
    assert (
        first.source.startswith("measured in ")
        and probes
        and first.peak_bytes <= 1.0 * MB
        and 8 <= first.units < 4096
    )
    probes.clear()
    second = auto_chunk(engine, model, unit, **options)
    assert second.source == "cached" and not probes and second.units == first.units
    # a cached peak above today's budget (same bucket) is measured again
    table = json.loads((tmp_path / CACHE_NAME).read_text())
    (entry,) = table.values()
    entry["peak_bytes"] = 2 * MB
    (tmp_path / CACHE_NAME).write_text(json.dumps(table))
    assert auto_chunk(engine, model, unit, **options).source.startswith("measured") and probes


def test_config_takes_auto_and_refuses_other_words_in_one_line(tmp_path):
    assert (
        load_config(None, ["train.max_physical_batch_size=auto"]).train.max_physical_batch_size
        == "auto"
    )
    assert (
        load_config(None, ["train.max_physical_batch_size=96"]).train.max_physical_batch_size == 96
    )
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"train": {"max_physical_batch_size": "auto", "memory_budget_mb": 2048}})
    )
    assert load_config(path).train.memory_budget_mb == 2048.0
    for value, match in [
        ("big", "must be auto or an integer >= 1, got 'big'"),
        ("0", "got 0"),
        ("1.5", "got '1.5'"),
    ]:
        with pytest.raises(ConfigError, match=match) as err:
            load_config(None, [f"train.max_physical_batch_size={value}"])
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="train.memory_budget_mb must be a positive number"):
        load_config(None, ["train.memory_budget_mb=-1"])


def test_dpscale_train_refuses_a_budget_below_one_example_in_one_line(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path / "cache"))
    argv = [
        "train",
        "--quiet",
        "--set",
        f"run.out_dir={tmp_path / 'run'}",
        "--set",
        "model.name=linear",
        "--set",
        "train.max_physical_batch_size=auto",
        "--set",
        "train.memory_budget_mb=0.1",
    ]
    assert main(argv) == 2
    # after the header lines the build printed
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"dpscale train: error: max_physical_batch_size=auto: one example needs about 0\.\d MB \(0\.\d MB fixed "
        r"\+ \d+\.\d kB per example\) but the memory budget is 0\.1 MB \(train.memory_budget_mb=0.1\)",
        error,
    ), error
    assert not (tmp_path / "run").exists()


def test_an_auto_run_prints_its_chunk_records_it_and_resumes_bit_identically(
    tmp_path, monkeypatch, capsys
):
    """The chunk chosen (16 of a B = 64 batch under 0.5 MB) is written into config.yaml; the resume reads it
    there (a second measurement would fail here) and ends where the uninterrupted run ends."""
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path / "cache"))
    sets = (
        "run.seed=0",
        "train.steps=6",
        "train.max_physical_batch_size=auto",
        "train.memory_budget_mb=0.5",
    )
    full = Trainer.create(tiny_config(tmp_path / "full", *sets), progress=False, report=True)
    chosen = full.config.train.max_physical_batch_size
    assert isinstance(chosen, int) and 8 <= chosen < 64 and chosen % 8 == 0
    full.run()
    assert f"chunk size auto: {chosen} examples (peak " in capsys.readouterr().err
    part = Trainer.create(tiny_config(tmp_path / "part", *sets), progress=False, report=True)
    assert part.run(max_steps=2) is None
    assert "; cached)" in capsys.readouterr().err  # the second run on this machine measured nothing
    assert (
        yaml.safe_load((tmp_path / "part" / "config.yaml").read_text())["train"][
            "max_physical_batch_size"
        ]
        == chosen
    )

    def refuse(*args, **kwargs):
        raise AssertionError("a resumed run measured its chunk again")

    monkeypatch.setattr(build_module, "run_chunk", refuse)
    resumed = Trainer.resume(tmp_path / "part", progress=False)
    assert resumed.config.train.max_physical_batch_size == chosen
    resumed.run()
    a, b = (
        torch.load(tmp_path / "full" / "checkpoint.pt"),
        torch.load(tmp_path / "part" / "checkpoint.pt"),
    )
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["mechanism"]["noise_generator"] == b["mechanism"]["noise_generator"]


def test_make_private_auto_measures_on_check_batch_and_refuses_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path))
    model, _, _ = _tiny_engine()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    settings = {
        "dataset_size": 1000,
        "batch_size": 64,
        "max_grad_norm": 1.0,
        "delta": 1e-5,
        "noise_multiplier": 1.0,
        "steps": 3,
    }
    mechanism = make_private(
        model, optimizer, **settings, max_physical_batch_size="auto", check_batch=batch
    )
    # a linear model's whole batch fits half of any RAM
    assert mechanism.max_physical_batch_size == 64 + 32
    with pytest.raises(ValueError, match="needs check_batch") as err:
        make_private(model, optimizer, **settings, max_physical_batch_size="auto")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="got 'big'"):
        make_private(model, optimizer, **settings, max_physical_batch_size="big", check_batch=batch)


def test_a_compiled_engine_is_probed_eagerly_and_checked_compiled_through_make_private(
    tmp_path, monkeypatch
):
    # The compiled step peaks above the eager one (about 1.3x on resnet18-gn): a chunk checked only eagerly
    # could run out of memory. Fake peaks per engine (no compile runs): the compiled one 3x the eager one.
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path))
    measured: list[tuple[str, int]] = []

    def fake_peak(engine, model, unit, device):
        name = type(engine).__name__
        per_example = (3.0 if name == "CompiledEngine" else 1.0) * 4 * MB
        return lambda n: measured.append((name, n)) or per_example * n

    monkeypatch.setattr(chunk_size, "engine_peak", fake_peak)
    # a 200 MB budget
    monkeypatch.setattr(chunk_size, "available_cpu_bytes", lambda: int(2 * 200 * MB))
    model, _, _ = _tiny_engine()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    mechanism = make_private(
        model,
        optimizer,
        dataset_size=100_000,
        batch_size=1024,
        max_grad_norm=1.0,
        delta=1e-5,
        noise_multiplier=1.0,
        steps=3,
        max_physical_batch_size="auto",
        check_batch=batch,
        engine="vmap",
        compile=True,
    )
    probes = [n for name, n in measured if name == "VmapEngine"]
    checks = [n for name, n in measured if name == "CompiledEngine"]
    assert sorted(set(probes)) == [2, 16] and checks, measured
    # the eager line allows 48 examples; at the compiled step's 12 MB each, 16 fit, checked compiled
    assert mechanism.max_physical_batch_size == 16 and checks[-1] == 16
