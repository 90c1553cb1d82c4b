"""Test configuration: property tests are derandomised so the suite gives the same verdict on
every run (CI included); widen exploration locally with --hypothesis-seed=random."""

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("dpscale", derandomize=True, database=None)
settings.load_profile("dpscale")


def _shared_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache directory for the whole session: with pytest-xdist, the workers' temporary
    directories share a parent, so a worker loads the features another one extracted (ScatterNet
    over the 5,000-image sample costs ~11 s a configuration). Cache files are written atomically,
    so two workers writing the same key at once leave one whole file."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "feature-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("feature-cache")


@pytest.fixture(autouse=True, scope="session")
def _feature_cache_in_a_temporary_directory(tmp_path_factory):
    """Tests never write features (or method timings) into the user's ~/.cache; within a session
    they share one cache (later runs on the same data load what earlier ones extracted)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("DPSCALE_CACHE_DIR", str(_shared_cache_dir(tmp_path_factory)))
    # Per-layer method timing off (the shape rule): a verdict must not depend on which exact method
    # this machine's timings pick, and timing every zoo shape would cost minutes. Every method is
    # checked against the float64 loop on its own, and the tuner with timing on, in test_autotune.py, test_autotune_choice.py and test_autotune_runs.py.
    patch.setenv("DPSCALE_AUTOTUNE", "0")
    yield
    patch.undo()
