"""Models: a name -> builder registry; importing this package registers the built-ins."""

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
    "freeze_block_groups",
    "count_parameters",
    "default_input_shape",
    "list_models",
    "make_activation",
    "register_model",
]
