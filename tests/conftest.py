"""Test configuration: property tests are derandomised so the suite gives the same verdict on
every run (CI included); widen exploration locally with --hypothesis-seed=random."""

import pytest
from hypothesis import settings

settings.register_profile("dpscale", derandomize=True, database=None)
settings.load_profile("dpscale")


@pytest.fixture(autouse=True, scope="session")
def _feature_cache_in_a_temporary_directory(tmp_path_factory):
    """Tests never write features into the user's ~/.cache; within a session they share one
    cache (later runs on the same data load what earlier ones extracted)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("DPSCALE_CACHE_DIR", str(tmp_path_factory.mktemp("feature-cache")))
    yield
    patch.undo()
