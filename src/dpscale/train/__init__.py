"""Training: the DP-SGD step, the run loop, checkpoints and metrics.

The names below are imported on first use: ``dpscale.make_private`` (``dpscale.train.private``)
does not load the Trainer, the config loader or the data pipeline."""

from importlib import import_module

_HOMES = {
    "Trainer": "loop",
    "StepStats": "step",
    "apply_gradient": "step",
    "noisy_clipped_mean": "step",
    "physical_chunks": "step",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(f"dpscale.train.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'dpscale.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
