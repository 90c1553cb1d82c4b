"""dpscale: fast DP-SGD training of image classifiers with honest privacy accounting."""

__version__ = "0.1.0"
