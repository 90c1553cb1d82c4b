"""How a door names the privacy settings in a refusal: the config in its keys (``dp.sampling=fixed``),
``make_private`` in its typed options (``FixedSize sampling``, ``BandMF.bands=4``). A rule is
written once, with ``said``/``key`` for every setting it names, and each door hands the rule its
spelling (``make_dp_plan(..., spell=)``). Torch-free (the errors and the options only): every layer may use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from dpscale.errors import ConfigError
from dpscale.privacy.options import OptionError

# (option class, field) -> the flat setting it comes from (a config rewords an option's field error)
FIELD_SETTINGS: dict[tuple[str, str], str] = {
    ("Poisson", "batch_size"): "batch_size",
    ("FixedSize", "batch_size"): "batch_size",
    ("Shuffle", "batch_size"): "batch_size",
    ("Poisson", "max_batch_size"): "max_batch_size",
    ("Flat", "max_grad_norm"): "max_grad_norm",
    ("PerLayer", "bounds"): "max_grad_norm",
    ("PerLayer", "per"): "max_grad_norm_per",
    ("Adaptive", "max_grad_norm"): "max_grad_norm",
    ("Adaptive", "quantile"): "clip_quantile",
    ("Adaptive", "learning_rate"): "clip_learning_rate",
    ("Adaptive", "count_noise"): "clip_count_noise",
    ("Automatic", "max_grad_norm"): "max_grad_norm",
    ("Automatic", "per"): "max_grad_norm_per",
    ("Automatic", "gamma"): "clip_gamma",
    ("BandMF", "bands"): "bands",
    ("BandMF", "max_bands"): "max_bands",
    ("BandMF", "max_noise_memory_mb"): "max_noise_memory_mb",
    ("TargetEpsilon", "epsilon"): "target_epsilon",
    ("TargetEpsilon", "delta"): "delta",
    ("NoiseMultiplier", "sigma"): "noise_multiplier",
    ("NoiseMultiplier", "delta"): "delta",
}


@dataclass(frozen=True)
class Spelling:
    """How a door names its settings.

    Attributes:
        door: who refuses ("make_private"; "" for the config, whose keys say it).
        names: a setting -> the door's name for it (default: ``prefix`` + the setting).
        values: (setting, value) -> how the door says that choice ("FixedSize sampling").
        prefix: put before a setting's name ("dp." in the config).
        rename: reword the typed options' own field errors in the door's names (the config).
        typed_names: a refused name lists the typed options too (Python callers).
        warn_unused: a setting of a strategy not chosen is warned of, not refused (the config: run
            directories of earlier releases hold such settings and must still load, evaluate and resume).
    """

    door: str = ""
    names: Mapping[str, str] = field(default_factory=dict)
    values: Mapping[tuple[str, str], str] = field(default_factory=dict)
    prefix: str = ""
    rename: bool = False
    typed_names: bool = False
    warn_unused: bool = False

    def key(self, setting: str) -> str:
        """The setting's name (``dp.bands``; ``BandMF.bands``)."""
        return self.names.get(setting, self.prefix + setting)

    def said(self, setting: str, value: Any) -> str:
        """The setting with its value (``dp.sampling=fixed``; ``FixedSize sampling``; ``BandMF.bands=4``)."""
        if (setting, str(value)) in self.values:
            return self.values[(setting, str(value))]
        return f"{self.key(setting)}={value}" if self.prefix else f"{self.key(setting)}={value!r}"

    def refusal(self, text: str) -> ValueError:
        """A refusal in this door's words (a ``ConfigError``, a ValueError too, for every door)."""
        return ConfigError(f"{self.door}: {text}" if self.door else text)

    def built(self, make: Callable[[], Any]) -> Any:
        """``make()``, a typed option's field error reworded as the door's setting when ``rename``."""
        try:
            return make()
        except OptionError as err:
            setting = FIELD_SETTINGS.get((err.owner, err.field))
            if not self.rename or setting is None:
                raise
            raise self.refusal(
                f"{self.key(setting)} must be {err.wanted}, got {err.value!r}"
            ) from err


def clipping_needed(spell: Spelling) -> ValueError:
    """The refusal of a private run without a clipping norm (its noise std sigma x C has no C), in
    ``spell``'s words: config validation and the plan both say it."""
    if spell.typed_names:
        return spell.refusal(
            "a private run needs clipping: Flat(max_grad_norm=None) is for NoiseMultiplier(sigma=0) only"
        )
    return spell.refusal(
        f"a private run needs clipping: set {spell.key('max_grad_norm')} (null is for non-private runs only)"
    )


CONFIG = Spelling(
    names={"target_epsilon": "dp.epsilon", "noise_mechanism": "dp.mechanism"},
    prefix="dp.",
    rename=True,
    warn_unused=True,
)
PYTHON = Spelling(
    door="make_private",
    names={
        "max_batch_size": "Poisson.max_batch_size",
        "bands": "BandMF.bands",
        "max_bands": "BandMF.max_bands",
        "max_noise_memory_mb": "BandMF.max_noise_memory_mb",
        "noise_multiplier": "NoiseMultiplier.sigma",
        "target_epsilon": "TargetEpsilon.epsilon",
    },
    values={
        ("sampling", "poisson"): "Poisson sampling",
        ("sampling", "fixed"): "FixedSize sampling",
        ("sampling", "shuffle"): "Shuffle sampling",
        ("clipping", "adaptive"): "Adaptive clipping",
        ("clipping", "automatic"): "Automatic clipping",
        ("noise_mechanism", "bandmf"): "BandMF noise",
        ("noise_mechanism", "dpsgd"): "Independent noise",
    },
    typed_names=True,
)
