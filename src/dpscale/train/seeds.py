"""A run's seeds: one run seed (or fresh OS entropy) split into independent streams."""

from __future__ import annotations

import secrets

import numpy as np

from dpscale.rng import words_to_int


def run_seeds(seed: int | None) -> dict[str, int]:
    """Independent seeds for model init, batch sampling, DP-SGD noise and the noise of private
    feature normalisation, from one run seed.

    With no seed, fresh OS entropy that is never written down: the DP analysis assumes the
    noise is unknown to the adversary. (Resume restores the generators' states instead.)

    The privacy-relevant streams (sampler, noise, features) get 128-bit seeds for ``DPRandom``:
    a torch generator keeps 32 bits of its seed, few enough to enumerate. Init and augmentation
    are not privacy-relevant and keep 64-bit seeds for torch generators.
    """
    if seed is None:
        seed = secrets.randbits(128)
    # generate_state(n) extends generate_state(n - 1), so adding a stream keeps the old ones:
    # init/augment/augtest keep their values; words 1-3 (the retired 64-bit sampler/noise/
    # features seeds) stay unused; words 6-13 are the 128-bit seeds, two words each.
    words = np.random.SeedSequence(seed).generate_state(14, dtype=np.uint64)
    return {
        "init": int(words[0]),
        "sampler": words_to_int(words[6:8]),
        "noise": words_to_int(words[8:10]),
        "features": words_to_int(words[10:12]),
        "partition": words_to_int(
            words[12:14]
        ),  # BandMF's groups: the same on every rank, for the whole run
        "augment": int(words[4]),
        "augtest": int(words[5]),
    }
