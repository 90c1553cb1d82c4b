"""The tuner's choice (issue 44): the fastest measured candidate is kept and remembered for any
batch size; of candidates within the timing noise, the one with the lowest measured peak (not
under a user's profiler); a pinned choice wins and small or untuned chunks take the shape rule;
the disk cache is read, rewritten when unreadable, found at $DPSCALE_CACHE_DIR and kept apart per
instruction set."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import ModuleType

import torch

from dpscale.privacy.clipping import autotune, autotune_cache, autotune_timing
from dpscale.privacy.clipping.autotune import MethodTuner
from dpscale.privacy.clipping.autotune_timing import Candidate
from autotune_helpers import cache_as_written


def _candidate(name: str, size: int, calls: list[str]) -> Candidate:
    work = torch.randn(size, size)

    def run() -> None:
        calls.append(name)
        for _ in range(3):
            work @ work

    return Candidate(name, float(size), 0.0, run)


def _methods(path) -> dict[str, str]:
    """The cache file's methods: device -> {key: method}."""
    return {
        d: {k: e["method"] for k, e in t.items()} for d, t in json.loads(path.read_text()).items()
    }


def test_the_fastest_measured_candidate_is_kept_and_remembered_for_any_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    cache_as_written(monkeypatch)
    calls: list[str] = []
    # the estimates say "slow" is cheaper: the measurement decides (and "slow" is still in contention)
    slow, fast = _candidate("slow", 400, calls), _candidate("fast", 60, calls)
    slow.macs, fast.macs = 1.0, 2.0
    tuner = MethodTuner(cache_file=tmp_path / "autotune.json")
    cpu = torch.device("cpu")
    assert tuner.choose("layer.a", "sig", cpu, "slow", [slow, fast], rows=64) == "fast"
    timed = len(calls)
    # same shapes, other batch
    assert tuner.choose("layer.b", "sig", cpu, "slow", [slow, fast], rows=3) == "fast"
    assert len(calls) == timed  # not timed again
    state = tuner.as_json()
    assert state["methods"] == {"sig": "fast"} and state["layers"]["layer.a"][:2] == [
        "fast",
        "timed",
    ]
    assert set(state["layers"]["layer.a"][2]) == {"slow", "fast"}
    assert (
        "layer.a fast (timed" in tuner.describe()
        and tuner.unreported()
        and tuner.unreported() is None
    )
    # the next run on this machine reads the disk cache
    cached = _methods(tmp_path / "autotune.json")
    assert (
        list(cached.values()) == [{"sig|rows=33-64": "fast"}]
        and autotune_cache.device_descriptor(cpu) in cached
    )
    later = MethodTuner(cache_file=tmp_path / "autotune.json")
    assert later.choose("layer.a", "sig", cpu, "slow", [slow, fast], rows=64) == "fast"
    assert len(calls) == timed and later.as_json()["layers"]["layer.a"][1] == "cache"


def _allocating(name: str, floats: int, calls: list[str]) -> Candidate:
    def run() -> None:
        calls.append(name)
        # two tensors of ``floats`` live at once
        sum(t.sum() for t in [torch.ones(floats), torch.ones(floats)])

    return Candidate(name, 1.0, 0.0, run)


def _timed_as(monkeypatch, timings: dict[str, float]) -> None:
    """Every timing pass gives each candidate its ``timings`` entry, idle (the tuner's timing pass,
    ``autotune_timing.time_candidates``, replaced)."""

    def timed(candidates: list[Candidate], device: torch.device) -> autotune_timing.Timing:
        return autotune_timing.Timing(
            {c.name: timings[c.name] for c in candidates}, autotune_timing.IDLE
        )

    monkeypatch.setattr(autotune_timing, "time_candidates", timed)


def test_of_candidates_within_the_timing_noise_the_one_with_the_lowest_measured_peak_is_kept(
    tmp_path, monkeypatch
):
    """Medians within TUNE_TIE of the fastest: the lowest measured peak wins and the log says why;
    a slower candidate beyond it is not kept however lean."""
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    timings = {"heavy": 5.96, "light": 6.27, "far": 9.0}
    _timed_as(monkeypatch, timings)
    calls: list[str] = []
    made = [
        _allocating("heavy", 2**21, calls),
        _allocating("light", 2**18, calls),
        _allocating("far", 2**10, calls),
    ]
    cpu, path = torch.device("cpu"), tmp_path / "autotune.json"
    tuner = MethodTuner(cache_file=path)
    assert tuner.choose("conv", "sig", cpu, "heavy", made, rows=256) == "light"
    assert (
        tuner.as_json()["layers"]["conv"][1]
        == "timed, least memory (peak MB: heavy 16.0, light 2.0)"
    )
    assert sorted(calls) == ["heavy", "light"]  # the one beyond the noise is not measured
    assert _methods(path)[autotune_cache.device_descriptor(cpu)] == {"sig|rows=129-256": "light"}
    # just beyond the noise: the fastest, unmeasured
    timings["light"] = 5.96 * (1 + autotune.TUNE_TIE) * 1.01
    calls.clear()
    fresh = MethodTuner(cache_file=None)
    assert fresh.choose("conv", "sig", cpu, "light", made, rows=256) == "heavy" and not calls
    assert fresh.as_json()["layers"]["conv"][1] == "timed"


def test_peaks_within_peak_tie_of_the_lowest_count_as_equal_and_the_faster_is_kept(monkeypatch):
    """bmm and bmm-positions hold the same tensors: a few bytes more must not outweigh being faster."""
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    timings = {"heavy": 5.96, "light": 6.27, "twin": 6.0}
    _timed_as(monkeypatch, timings)
    calls: list[str] = []
    made = [
        _allocating("heavy", 2**21, calls),
        _allocating("light", 2**18, calls),
        _allocating("twin", 2**18 + 2**12, calls),
    ]
    tuner = MethodTuner(cache_file=None)
    assert tuner.choose("conv", "sig", torch.device("cpu"), "heavy", made, rows=256) == "twin"
    assert tuner.as_json()["layers"]["conv"][1].startswith(
        "timed, least memory (peak MB: heavy 16.0, light 2.0, twin 2.0"
    )
    timings["twin"] = 6.5  # now the slower of the two lean ones
    assert (
        MethodTuner(cache_file=None).choose(
            "conv", "sig", torch.device("cpu"), "heavy", made, rows=256
        )
        == "light"
    )


def test_under_a_users_profiler_the_fastest_is_kept_and_the_profile_survives(monkeypatch):
    """The CPU measurement is a profiler: nested in the user's, it would end theirs with no events."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    _timed_as(monkeypatch, {"heavy": 5.96, "light": 6.27})
    calls: list[str] = []
    made = [_allocating("heavy", 2**21, calls), _allocating("light", 2**18, calls)]
    tuner = MethodTuner(cache_file=None)
    with profile(activities=[ProfilerActivity.CPU]) as users:
        chosen = tuner.choose("conv", "sig", torch.device("cpu"), "heavy", made, rows=256)
        torch.ones(8).sum()
    # timed, no peak measured
    assert chosen == "heavy" and not calls and tuner.as_json()["layers"]["conv"][1] == "timed"
    assert any(e.name == "aten::sum" for e in users.events())
    # on CUDA the measurement would reset the user's peak statistics: not taken (no CUDA call made)
    assert autotune._leanest_near_fastest(
        {"heavy": 5.96, "light": 6.27}, made, torch.device("cuda")
    ) == ("heavy", "timed")
    assert not calls


def test_a_pinned_choice_wins_and_small_or_untuned_chunks_take_the_rule(tmp_path, monkeypatch):
    calls: list[str] = []
    slow, fast = _candidate("slow", 200, calls), _candidate("fast", 20, calls)
    cpu = torch.device("cpu")
    pinned = MethodTuner(cache_file=tmp_path / "autotune.json")
    pinned.pin({"methods": {"sig": "slow"}})
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    assert pinned.choose("l", "sig", cpu, "fast", [slow, fast], rows=64) == "slow" and not calls
    assert pinned.as_json()["layers"]["l"][1] == "pinned"
    off = MethodTuner(enabled=False, cache_file=tmp_path / "autotune.json")
    assert (
        off.choose("l", "sig", cpu, "slow", [slow, fast], rows=64) == "slow"
        and not calls
        and not off.choices
    )
    # the same chunk on a tuner that is on and holds no choice is timed (what the two above did not do)
    assert (
        MethodTuner(cache_file=None).choose("l", "sig", cpu, "slow", [slow, fast], rows=64)
        == "fast"
        and calls
    )
    calls.clear()
    # too small a chunk to time: the rule, nothing kept
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 1e12)
    small = MethodTuner(cache_file=tmp_path / "autotune.json")
    assert (
        small.choose("l", "sig", cpu, "slow", [slow, fast], rows=64) == "slow"
        and not calls
        and not small.choices
    )
    assert not (tmp_path / "autotune.json").exists()


def test_an_unreadable_cache_is_timed_again_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    cache_as_written(monkeypatch)
    path = tmp_path / "autotune.json"
    path.write_text("{not json")
    calls: list[str] = []
    tuner = MethodTuner(cache_file=path)
    assert (
        tuner.choose(
            "l",
            "sig",
            torch.device("cpu"),
            "a",
            [_candidate("a", 100, calls), _candidate("b", 10, calls)],
            8,
        )
        == "b"
    )
    assert _methods(path)[autotune_cache.device_descriptor(torch.device("cpu"))] == {
        "sig|rows=5-8": "b"
    }


def test_the_cache_follows_dpscale_cache_dir_and_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path))
    assert autotune_cache.autotune_cache_path() == tmp_path / "autotune.json"
    monkeypatch.setenv("DPSCALE_AUTOTUNE", "0")
    assert not autotune.default_tuner().enabled
    monkeypatch.delenv("DPSCALE_AUTOTUNE")
    assert autotune.default_tuner().enabled  # on unless switched off


def test_a_cache_written_under_one_instruction_set_is_not_read_under_another(tmp_path, monkeypatch):
    """VMs name an AVX-512 and an AVX2-only EPYC alike ("AMD EPYC") and the two rank methods
    differently: a cache shared between them (a home directory on a cluster) keeps them apart."""
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    monkeypatch.setattr(autotune_cache, "cpu_model", lambda: "AMD EPYC (either VM)")
    cache_as_written(monkeypatch)
    path, cpu = tmp_path / "autotune.json", torch.device("cpu")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert autotune_cache.device_descriptor(cpu).startswith("cpu:AMD EPYC (either VM):isa=AVX512:")
    calls: list[str] = []
    wide = MethodTuner(cache_file=path)
    assert (
        wide.choose(
            "l", "sig", cpu, "a", [_candidate("a", 100, calls), _candidate("b", 10, calls)], 8
        )
        == "b"
    )
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    calls.clear()
    narrow, small, large = (
        MethodTuner(cache_file=path),
        _candidate("a", 10, calls),
        _candidate("b", 100, calls),
    )
    small.macs = large.macs = 1.0  # both in contention: only a timing can pick "a"
    assert narrow.choose("l", "sig", cpu, "b", [small, large], 8) == "a"
    # timed here, not taken from the AVX-512 entry
    assert calls and narrow.as_json()["layers"]["l"][1] == "timed"
    assert {key.split(":")[2] for key in json.loads(path.read_text())} == {"isa=AVX512", "isa=AVX2"}


def _patches(path: Path) -> set[tuple[str, str]]:
    """(module, name) of every ``monkeypatch.setattr(module, "name", ...)`` in ``path`` on a module
    of the tuner's."""
    calls = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "monkeypatch.setattr"
    ]
    return {
        (ast.unparse(c.args[0]), c.args[1].value)
        for c in calls
        if ast.unparse(c.args[0]) in TUNER_MODULES
    }


def _defined(module: ModuleType) -> set[str]:
    """The names ``module``'s own top level defines (imported names left out)."""
    names = set()
    for node in ast.parse(Path(module.__file__ or "").read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {
                n.id for target in node.targets for n in ast.walk(target) if isinstance(n, ast.Name)
            }
    return names


TUNER_MODULES = {
    "autotune": autotune,
    "autotune_timing": autotune_timing,
    "autotune_cache": autotune_cache,
}


def test_the_tuners_tests_patch_each_name_in_the_module_its_callers_look_it_up_in():
    """A patch on a module that only imports a name changes nothing: every module-level patch in the
    tuner's tests is on the module that defines the name, and no module of dpscale imports that
    name from it and calls its own binding (which the patch would miss)."""
    tests = Path(__file__).parent
    patched = set().union(
        *(_patches(p) for p in [*tests.glob("test_autotune*.py"), tests / "autotune_helpers.py"])
    )
    assert {
        ("autotune_timing", "time_candidates"),
        ("autotune_timing", "measure_once"),
        ("autotune", "TUNE_MIN_MACS"),
    } <= patched
    assert [
        f"{m}.{name}" for m, name in sorted(patched) if name not in _defined(TUNER_MODULES[m])
    ] == []
    src = Path(autotune.__file__).parents[3]
    bound_and_called = []
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text())
        bound = {
            (node.module, a.name): a.asname or a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for a in node.names
        }
        called = {
            n.func.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        bound_and_called += [
            f"{path.name}: {name}"
            for m, name in patched
            if bound.get((TUNER_MODULES[m].__name__, name)) in called
        ]
    assert bound_and_called == []
