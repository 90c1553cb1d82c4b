"""Changes a privacy audit makes to an ordinary run (``dpscale audit``): canaries added to the
training set before the plan is made (so N, q and epsilon count them), an engine wrapped to
inject gradient canaries, and an observer of every released noisy gradient. A plain run has none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from dpscale.data.image_dataset import ImageDataset
from dpscale.privacy.clipping.per_example import PerExampleEngine
from dpscale.privacy.noise.gaussian import Params


@dataclass(frozen=True)
class RunHooks:
    """Attributes:
    training_set: maps the training data (after feature extraction) to what the run trains on.
    engine: wraps the checked clipping engine, given the model (before the first step).
    observe_gradient: called after every logical step with the released gradient (the noisy
        clipped sum divided by B, by parameter name): what a white-box adversary sees.
    """

    training_set: Callable[[ImageDataset], ImageDataset] | None = None
    engine: Callable[[PerExampleEngine, nn.Module], PerExampleEngine] | None = None
    observe_gradient: Callable[[Params], None] | None = None
