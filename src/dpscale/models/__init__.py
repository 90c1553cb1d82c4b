"""Models: a name -> builder registry; importing this package (or any module in it) registers the
built-ins, so ``dpscale.models.registry`` always sees the whole zoo."""

# in the zoo's order: each import registers its models
from dpscale.models import cnn as _cnn  # noqa: F401  (registers the models)
from dpscale.models import resnet as _resnet  # noqa: F401
from dpscale.models import nfnet as _nfnet  # noqa: F401
from dpscale.models import vit as _vit  # noqa: F401
from dpscale.models import scatter as _scatter  # noqa: F401
from dpscale.models.activations import TemperedSigmoid, make_activation
from dpscale.models.adapt import convert_batchnorm_to_groupnorm, freeze_block_groups
from dpscale.models.registry import (
    build_model,
    count_parameters,
    default_input_shape,
    list_models,
    register_model,
)

__all__ = [
    "TemperedSigmoid",
    "build_model",
    "convert_batchnorm_to_groupnorm",
    "count_parameters",
    "default_input_shape",
    "freeze_block_groups",
    "list_models",
    "make_activation",
    "register_model",
]


def __dir__() -> list[str]:
    """The public names and the registry module."""
    return sorted([*__all__, "registry"])
