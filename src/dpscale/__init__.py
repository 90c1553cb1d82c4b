"""dpscale: fast DP-SGD training of image classifiers with honest privacy accounting."""

from dpscale._version import __version__ as __version__  # re-exported

__all__ = ["DPMechanism", "PrivacyBudgetExhausted", "make_private"]


def __getattr__(name: str):
    """``dpscale.make_private`` and friends, imported on first use (``import dpscale`` stays light)."""
    if name in __all__:
        from dpscale.train import mechanism, private

        return getattr(private if name == "make_private" else mechanism, name)
    raise AttributeError(f"module 'dpscale' has no attribute {name!r}")
