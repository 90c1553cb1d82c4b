"""Errors shared by every layer (kept free of imports, so the privacy core need not import the config)."""


class UserError(Exception):
    """Something the user gave is wrong or unusable: a config value, a flag, a data set, a file or a
    run directory. The ``dpscale`` command prints its message as one line (exit code 2); any other
    exception is a bug and keeps its traceback."""


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown or out of range (a ValueError too, as it always was)."""
