"""Test configuration: property tests are derandomised so the suite gives the same verdict on
every run (CI included); widen exploration locally with --hypothesis-seed=random."""

from hypothesis import settings

settings.register_profile("dpscale", derandomize=True, database=None)
settings.load_profile("dpscale")
