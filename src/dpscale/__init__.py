"""dpscale: fast DP-SGD training of image classifiers with honest privacy accounting."""

from dpscale._version import __version__ as __version__  # re-exported

# make_private's typed options (torch-free: importing their module keeps ``import dpscale`` light) and the
# training entry points
from dpscale.privacy.options import OPTION_CLASSES as OPTIONS

__all__ = ["DPMechanism", "PrivacyBudgetExhausted", "make_private", *OPTIONS]


def __getattr__(name: str):
    """``dpscale.make_private`` and friends, imported on first use (``import dpscale`` stays light)."""
    if name in OPTIONS:
        from dpscale.privacy import options

        return getattr(options, name)
    if name in __all__:
        from importlib import import_module

        return getattr(
            import_module(
                "dpscale.train." + ("private" if name == "make_private" else "mechanism")
            ),
            name,
        )
    raise AttributeError(f"module 'dpscale' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (``dir(dpscale)``), the lazily imported ones included."""
    return sorted([*__all__, "__version__"])
