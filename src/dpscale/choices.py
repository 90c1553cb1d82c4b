"""The allowed values of the settings that more than one layer checks: config validation, the
privacy core and the command line's ``choices=`` all read them here.

Kept free of imports (like ``dpscale.errors``): the privacy core may not import the config, and
``dpscale --help`` must not pay for importing the accountant to list two names.
"""

ACCOUNTANT_KINDS: tuple[str, ...] = ("pld", "rdp")  # dp.accountant, --accountant
ENGINE_NAMES: tuple[str, ...] = ("auto", "bk", "ghost", "vmap")  # train.engine (make_engine)
PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")  # train.precision, bench --precision
