"""Hyper-parameter tuning: sweeps, TAN simulation and scaling laws, privacy-parameter tables,
and Kurakin's clip-norm / learning-rate procedure.

Tuning on the private training data is itself not covered by any run's privacy guarantee;
every output here says so (``TUNING_CAVEAT``).
"""

TUNING_CAVEAT = (
    "Tuning on the private training data is NOT covered by the privacy guarantee: each run's "
    "epsilon covers that run alone, not the choice among runs (tune on public or held-out data, "
    "or account for the selection)"
)
