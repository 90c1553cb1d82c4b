"""Errors shared by every layer (kept free of imports, so the privacy core need not import the config)."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""
