"""The shared layers now live in :mod:`dpscale.layers` (engines use them without loading the model zoo)."""

from dpscale.layers import ClassTokenPositionEmbedding, MaxPool2d, ScalarGain, ScaledStdConv2d

__all__ = ["ClassTokenPositionEmbedding", "MaxPool2d", "ScalarGain", "ScaledStdConv2d"]
