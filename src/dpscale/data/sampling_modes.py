"""The sampling modes and what the accounting says of them: torch-free, so that the privacy plan
(and ``dpscale account``) can name them without loading the samplers."""

SAMPLING_MODES = ("poisson", "shuffle")
# b*q may exceed 1 by a rounding error when B*b == N (e.g. 3 * (1/3)); such a rate means "always".
RATE_TOLERANCE = 1e-12
SHUFFLE_CAVEAT = (
    "sampling=shuffle: the reported epsilon is computed for Poisson sampling and does not "
    "strictly cover the fixed-size shuffled batches that ran"
)
