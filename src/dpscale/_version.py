"""The dpscale version, in a module of its own: lower layers (``dpscale._io``) record it in what
they write without importing the package's ``__init__`` (which imports the training code lazily)."""

__version__ = "0.1.0"
