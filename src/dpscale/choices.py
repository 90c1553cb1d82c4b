"""The allowed values of the settings that more than one layer checks: config validation, the
privacy core and the command line's ``choices=`` all read them here.

Kept free of imports (like ``dpscale.errors``): the privacy core may not import the config, and
``dpscale --help`` must not pay for importing the accountant to list two names.
"""

ACCOUNTANT_KINDS: tuple[str, ...] = ("pld", "rdp")  # dp.accountant, --accountant
ENGINE_NAMES: tuple[str, ...] = ("auto", "bk", "ghost", "vmap")  # train.engine (make_engine)
PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")  # train.precision, bench --precision
PEFT_METHODS: tuple[str, ...] = ("none", "lora", "bitfit", "last_groups")  # model.peft
# dp.clipping, make_private(clipping=)
CLIPPINGS: tuple[str, ...] = ("fixed", "adaptive", "automatic")
BENCH_CLOCKS: tuple[str, ...] = ("wall", "thread")  # dpscale bench step-time --clock
# dpscale bench ops --methods: per-layer methods
BENCH_METHODS: tuple[str, ...] = ("shape-rule", "tuned")
PRIVACY_UNITS: tuple[str, ...] = ("example", "user")  # data.privacy_unit, dpscale account --unit
# dp.mechanism, make_private(noise_mechanism=), --mechanism
MECHANISMS: tuple[str, ...] = ("dpsgd", "bandmf")
# dp.max_bands, make_private(max_bands=), --max-bands: the largest b that bands=auto tries
DEFAULT_MAX_BANDS = 64
# dp.max_noise_memory_mb, make_private(max_noise_memory_mb=): BandMF history limit
DEFAULT_MAX_NOISE_MEMORY_MB = 1024.0
# ``dpscale export --format`` (dpscale.export, dpscale.exported)
EXPORT_FORMATS = ("safetensors", "torchscript", "onnx")
