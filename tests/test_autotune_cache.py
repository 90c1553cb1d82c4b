"""The tuner's disk cache stays right (issue 63, 5): keyed by the chunk's rows (bucketed); entries
without that key (an older dpscale's) or timed under load never trusted; a cached choice that runs
well off its prediction timed again before it computes anything, and one that later runs off it
dropped for the next run; a reset; each choice's provenance in the run's line. Timings come from a
fake clock (``autotune_timing.measure_once`` replaced) wherever a verdict depends on them."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dpscale.privacy import make_engine

from dpscale.privacy.clipping import autotune, autotune_cache, autotune_timing
from dpscale.privacy.clipping.autotune import MethodTuner
from dpscale.privacy.clipping.autotune_timing import Candidate
from dpscale.privacy.clipping.per_example import trainable_params

CPU = torch.device("cpu")


def _matmuls(name: str, size: int, calls: list[str]) -> Candidate:
    """A candidate doing three size x size matmuls: 400 against 60 is ~300x the work, a gap no
    load on a shared machine closes."""
    work = torch.randn(size, size)

    def run() -> None:
        calls.append(name)
        for _ in range(3):
            work @ work

    return Candidate(name, 1.0, 0.0, run)


def _idle(name: str) -> Candidate:
    return Candidate(name, 1.0, 0.0, lambda: None)


def _fake_clock(monkeypatch, ms: dict[str, float], wall_over_cpu: float = 1.0) -> list[str]:
    """Every timed run of candidate ``c`` takes ``ms[c.name]`` thread-CPU milliseconds (and that
    times ``wall_over_cpu`` on the wall clock); returns the names timed, in order."""
    timed: list[str] = []

    def measure(candidate: Candidate, device: torch.device) -> tuple[float, float]:
        timed.append(candidate.name)
        return ms[candidate.name], ms[candidate.name] * wall_over_cpu

    monkeypatch.setattr(autotune_timing, "measure_once", measure)
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    # the thread clock ranks (the CI may run more)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    return timed


def _entries(path) -> dict:
    return json.loads(path.read_text())[autotune_cache.device_descriptor(CPU)]


def test_a_slow_choice_an_older_cache_holds_is_timed_again_and_not_kept(tmp_path, monkeypatch):
    """The issue's cache: a choice written without the chunk's rows (and without how busy the
    machine was) names the slow method; it is not taken: the layer is timed, the old entry leaves
    the file, and the next run does not take it either (real timings, ~300x apart)."""
    monkeypatch.setattr(autotune, "TUNE_MIN_MACS", 0.0)
    path = tmp_path / "autotune.json"
    path.write_text(json.dumps({autotune_cache.device_descriptor(CPU): {"sig": "slow"}}))
    calls: list[str] = []
    candidates = [_matmuls("slow", 400, calls), _matmuls("fast", 60, calls)]
    assert (
        MethodTuner(cache_file=path).choose("conv1", "sig", CPU, "slow", candidates, rows=100)
        == "fast"
    )
    assert "slow" in calls and "fast" in calls  # timed here
    entries = _entries(path)  # the old entry gone; the new one there if the timing saw no load
    assert "sig" not in entries and all(entry["method"] == "fast" for entry in entries.values())
    assert (
        MethodTuner(cache_file=path).choose("conv1", "sig", CPU, "slow", candidates, rows=100)
        == "fast"
    )


class _Convs(nn.Module):
    """Two 3x3 convolutions (tramer-cifar-cnn's kind, smaller) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv2(torch.tanh(self.conv1(x)))).flatten(1))


CONV_MS = {"pixel-gram": 40.0, "gram": 30.0, "bmm": 8.0, "bmm-positions": 9.0, "grouped": 5.0}


def _step(rows: int = 12) -> MethodTuner:
    """One bk chunk of ``rows`` examples of ``_Convs`` through the default tuner (its cache at
    $DPSCALE_CACHE_DIR); returns the tuner."""
    torch.manual_seed(0)
    model = _Convs()
    engine, _ = make_engine("bk", 1.0, model)
    engine.per_example_clipped_sum(
        model, trainable_params(model), (torch.randn(rows, 3, 8, 8), torch.randint(0, 10, (rows,)))
    )
    return engine.tuner


@pytest.fixture
def conv_cache(tmp_path, monkeypatch):
    """A fresh cache dir with the autotuner on, the fake clock at ``CONV_MS``; yields the cache
    file after one idle step wrote both convolutions' entries (grouped)."""
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DPSCALE_AUTOTUNE", "1")
    _fake_clock(monkeypatch, CONV_MS)
    tuner = _step()
    assert {
        tuner.choices[s].method for name, s in tuner.layers.items() if name.startswith("conv")
    } == {"grouped"}
    path = tmp_path / "autotune.json"
    assert {e["method"] for k, e in _entries(path).items() if k.startswith("Conv2d")} == {"grouped"}
    return path


def _seed(path, method: str, ms: dict[str, float]) -> None:
    """Every Conv2d entry set to ``method`` with timings ``ms``, as a machine that saw no load wrote it."""
    entries = _entries(path)
    for key in entries:
        if key.startswith("Conv2d"):
            entries[key].update(method=method, ms=ms, timed="2026-11-28")
    path.write_text(json.dumps({autotune_cache.device_descriptor(CPU): entries}))


def test_a_cached_slow_choice_for_a_3x3_conv_that_runs_off_its_prediction_is_timed_again_and_replaced(
    conv_cache,
):
    """A busy machine timed pixel-gram at 10 ms and grouped at 12 (the load hit grouped harder) and
    its check missed it: here pixel-gram runs at 40 ms, 4x its prediction, so the layer is timed
    again before pixel-gram computes anything, and grouped replaces it in the cache."""
    _seed(conv_cache, "pixel-gram", {"pixel-gram": 10.0, "grouped": 12.0})
    tuner = _step()
    conv = tuner.choices[tuner.layers["conv1"]]
    assert (conv.method, conv.source) == ("grouped", "timed")
    assert (
        "re-timed: the cached pixel-gram ran 4.00x its 10.0 ms (cached 2026-11-28)"
        in tuner.describe()
    )
    assert {e["method"] for k, e in _entries(conv_cache).items() if k.startswith("Conv2d")} == {
        "grouped"
    }


def test_a_cached_ranking_a_load_made_is_timed_again_though_the_choice_runs_as_predicted(
    conv_cache,
):
    """The issue's case: the busy machine's pixel-gram time was right (40 ms), but the load slowed
    grouped to 45: here grouped, the runner-up, runs 8x faster than pixel-gram, so the layer is
    timed again and grouped cached."""
    _seed(conv_cache, "pixel-gram", {"pixel-gram": 40.0, "grouped": 45.0})
    tuner = _step()
    assert tuner.choices[tuner.layers["conv2"]].method == "grouped"
    assert (
        "re-timed: the cached pixel-gram ran 8.00x grouped's time (cached 2026-11-28)"
        in tuner.describe()
    )
    assert {e["method"] for k, e in _entries(conv_cache).items() if k.startswith("Conv2d")} == {
        "grouped"
    }


def test_a_cached_choice_that_runs_as_predicted_is_taken_and_the_line_says_so(conv_cache):
    """Within CHECK_OFF of its prediction (scaled to the chunk's rows): taken from the cache, and
    the run's line (and ``describe_methods``, the bench's) says cached, when, and under what load."""
    # timed on 10 rows; 12 here
    _seed(conv_cache, "bmm", {"bmm": 8.0 * 10 / 12, "bmm-positions": 9.5})
    entries = _entries(conv_cache)
    for entry in entries.values():
        entry["rows"] = 10
    conv_cache.write_text(json.dumps({autotune_cache.device_descriptor(CPU): entries}))
    tuner = _step()
    assert tuner.choices[tuner.layers["conv1"]].method == "bmm"
    line = tuner.describe()
    assert "conv1 bmm (cached 2026-11-28, timed idle: bmm 6.7/bmm-positions 9.5 ms)" in line
    assert autotune.describe_methods(type("Engine", (), {"tuner": tuner})()) == line
    assert autotune.describe_methods(object()) is None


def test_an_older_entry_for_a_3x3_conv_is_not_read(conv_cache):
    """The issue's format (a bare method name under the signature without rows): timed again."""
    signatures = [k.rsplit("|rows=", 1)[0] for k in _entries(conv_cache) if k.startswith("Conv2d")]
    conv_cache.write_text(
        json.dumps({autotune_cache.device_descriptor(CPU): {s: "pixel-gram" for s in signatures}})
    )
    tuner = _step()
    assert {tuner.choices[s].method for n, s in tuner.layers.items() if n.startswith("conv")} == {
        "grouped"
    }
    assert all("|rows=" in k for k in _entries(conv_cache))


def test_the_cache_is_keyed_by_the_chunks_rows_in_powers_of_two(tmp_path, monkeypatch):
    timed = _fake_clock(monkeypatch, {"a": 5.0, "b": 9.0})
    path = tmp_path / "autotune.json"
    assert (
        autotune_cache.cache_key("sig", 100) == "sig|rows=65-128"
        and autotune_cache.cache_key("sig", 128) == "sig|rows=65-128"
    )
    assert (
        autotune_cache.cache_key("sig", 129) == "sig|rows=129-256"
        and autotune_cache.cache_key("sig", 1) == "sig|rows=1-1"
    )
    assert (
        MethodTuner(cache_file=path).choose(
            "l", "sig", CPU, "b", [_idle("a"), _idle("b")], rows=100
        )
        == "a"
    )
    assert list(_entries(path)) == ["sig|rows=65-128"]
    timed.clear()
    same = MethodTuner(cache_file=path)
    assert (
        same.choose("l", "sig", CPU, "b", [_idle("a"), _idle("b")], rows=90) == "a"
        and same.choices["sig"].source == "cache"
    )
    # its check only: it and the runner-up
    assert timed.count("a") == timed.count("b") == autotune.CHECK_RUNS
    timed.clear()
    larger = MethodTuner(cache_file=path)
    assert (
        larger.choose("l", "sig", CPU, "b", [_idle("a"), _idle("b")], rows=256) == "a"
        and larger.choices["sig"].source == "timed"
    )
    assert set(timed) == {"a", "b"} and sorted(_entries(path)) == [
        "sig|rows=129-256",
        "sig|rows=65-128",
    ]


@pytest.mark.parametrize("wall_over_cpu, kept", [(1.0, True), (2.0, False)])
def test_a_timing_whose_thread_waited_for_a_core_is_used_but_not_cached(
    tmp_path, monkeypatch, wall_over_cpu, kept
):
    _fake_clock(monkeypatch, {"a": 5.0, "b": 9.0}, wall_over_cpu)
    path = tmp_path / "autotune.json"
    tuner = MethodTuner(cache_file=path)
    assert tuner.choose("l", "sig", CPU, "b", [_idle("a"), _idle("b")], rows=64) == "a"
    assert path.exists() == kept
    if not kept:
        assert (
            "l a (timed now, under load (wall clock 2.00x thread CPU): not cached: a 5.0/b 9.0 ms)"
            in tuner.describe()
        )


def test_a_timing_whose_runs_spread_is_under_load_and_short_runs_are_not_judged():
    runs = {"a": [(4.0, 4.0), (9.0, 9.0), (9.5, 9.5)], "b": [(9.0, 9.0), (9.1, 9.1)]}
    assert autotune_timing.load_verdict(runs, thread=True) == "under load (a's runs spread 56%)"
    # one slow run (a page-fault burst) is not load
    runs["a"] = [(5.0, 5.0), (5.5, 5.5), (9.0, 9.0)]
    assert autotune_timing.load_verdict(runs, thread=True) == autotune_timing.IDLE
    tiny = {"a": [(0.01, 0.05), (0.01, 0.05), (0.03, 0.05)]}  # a clock call's cost: not judged
    assert autotune_timing.load_verdict(tiny, thread=True) == autotune_timing.IDLE
    # the wall clock ranks
    assert (
        autotune_timing.load_verdict({"a": [(1.0, 5.0)] * 3}, thread=False) == autotune_timing.IDLE
    )


def test_later_chunks_off_their_prediction_drop_the_entry_and_keep_the_runs_choice(
    tmp_path, monkeypatch
):
    """Checks on chunks 2, 4, 8: three in a row 2x off the prediction remove the cache entry (the
    next run times the layer), the run keeps its method (a resume from a checkpoint taken before
    would pin it), and the run's line is printed again with the finding."""
    ms = {"a": 5.0, "b": 9.0}
    timed = _fake_clock(monkeypatch, ms)
    path = tmp_path / "autotune.json"
    tuner = MethodTuner(cache_file=path)
    candidates = [_idle("a"), _idle("b")]
    assert tuner.choose("l", "sig", CPU, "b", candidates, rows=64) == "a"
    assert tuner.unreported() and tuner.unreported() is None
    ms["a"] = 10.0
    checked = []
    for chunk in range(2, 11):
        timed.clear()
        if tuner.remembered("l", "sig") is None:
            assert tuner.choose("l", "sig", CPU, "b", candidates, rows=64) == "a"
            checked.append(chunk)
            assert timed == ["a"]  # one timed run of the chosen method, nothing else
    assert checked == [2, 4, 8] and tuner.choices["sig"].method == "a"
    assert "sig|rows=33-64" not in _entries(path)
    assert "ran 2.00x its prediction in 3 checks in a row: dropped from the cache" in (
        tuner.unreported() or ""
    )
    assert tuner.remembered("l", "sig") == "a"  # no more checks once dropped


def test_a_check_within_the_prediction_resets_the_count_and_chunks_past_check_every_are_sampled(
    tmp_path, monkeypatch
):
    ms = {"a": 5.0, "b": 9.0}
    _fake_clock(monkeypatch, ms)
    monkeypatch.setattr(autotune, "CHECK_EVERY", 8)
    path = tmp_path / "autotune.json"
    tuner, candidates = MethodTuner(cache_file=path), [_idle("a"), _idle("b")]
    tuner.choose("l", "sig", CPU, "b", candidates, rows=64)
    checked = []
    for chunk in range(2, 33):
        # chunk 8's check within: the run of off checks starts again
        ms["a"] = 5.0 if chunk == 8 else 10.0
        if tuner.remembered("l", "sig") is None:
            tuner.choose("l", "sig", CPU, "b", candidates, rows=64)
            checked.append(chunk)
    assert checked == [2, 4, 8, 16, 24, 32]
    assert "sig|rows=33-64" not in _entries(path)  # 16, 24, 32: three in a row


def test_no_checks_on_a_gpu_nor_for_pinned_choices(tmp_path, monkeypatch):
    """A check on a GPU would add launches and a synchronisation to the step: never; a pinned
    choice computes as its checkpoint's run did: never checked, and it says where it came from."""
    _fake_clock(monkeypatch, {"a": 5.0, "b": 9.0})
    tuner = MethodTuner(cache_file=tmp_path / "autotune.json")
    choice = autotune.LayerChoice(
        "a", "timed", {"a": 5.0, "b": 9.0}, 64, "2026-11-28", autotune_timing.IDLE
    )
    assert tuner._checkable(choice, CPU) and not tuner._checkable(choice, torch.device("cuda"))
    pinned = MethodTuner(cache_file=tmp_path / "autotune.json")
    pinned.pin({"methods": {"sig": "b"}})
    assert pinned.choose("l", "sig", CPU, "a", [_idle("a"), _idle("b")], rows=64) == "b"
    assert all(pinned.remembered("l", "sig") == "b" for _ in range(20))
    assert "l b (pinned from the checkpoint)" in pinned.describe()


def test_dpscale_autotune_retime_times_every_layer_again_and_replaces_its_entry(
    tmp_path, monkeypatch
):
    ms = {"a": 5.0, "b": 9.0}
    timed = _fake_clock(monkeypatch, ms)
    monkeypatch.setenv("DPSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DPSCALE_AUTOTUNE", "1")
    assert (
        autotune.default_tuner().choose("l", "sig", CPU, "b", [_idle("a"), _idle("b")], rows=64)
        == "a"
    )
    # the cache
    assert (
        autotune.default_tuner().choose("l", "sig", CPU, "b", [_idle("a"), _idle("b")], rows=64)
        == "a"
    )
    monkeypatch.setenv("DPSCALE_AUTOTUNE", "retime")
    ms.update(a=9.0, b=5.0)
    timed.clear()
    retimed = autotune.default_tuner()
    assert retimed.enabled and not retimed.read_cache
    assert retimed.choose("l", "sig", CPU, "b", [_idle("a"), _idle("b")], rows=64) == "b" and set(
        timed
    ) == {"a", "b"}
    assert _entries(tmp_path / "autotune.json")["sig|rows=33-64"]["method"] == "b"
