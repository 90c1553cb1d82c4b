"""The sampling modes and what the accounting says of them: torch-free, so that the privacy plan
(and ``dpscale account``) can name them without loading the samplers."""

SAMPLING_MODES = ("poisson", "fixed", "shuffle")
# b*q may exceed 1 by a rounding error when B*b == N (e.g. 3 * (1/3)); such a rate means "always".
RATE_TOLERANCE = 1e-12
SHUFFLE_CAVEAT = (
    "sampling=shuffle: epsilon bounds shuffled batches without amplification by sampling (each image in at "
    "most one step per epoch, the epochs composed; replace-one adjacency), so it is far above a Poisson "
    "run's; dp.sampling=fixed keeps fixed-size batches with amplification (Chua et al. 2024)"
)
FIXED_CAVEAT = (
    "sampling=fixed: epsilon is under replace-one adjacency (one image replaced by another), the adjacency "
    "sampling without replacement is proven for: not comparable with an add/remove epsilon of Poisson sampling"
)
