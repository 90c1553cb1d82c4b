"""Named configurations that reproduce papers: ``dpscale train preset:<name> --set data.root=DIR``.

A preset is a plain nested mapping of config sections, exactly what a YAML config file holds
(``dpscale presets NAME`` prints it as YAML, ready to copy and edit). Every preset says where its
numbers come from.
"""

from __future__ import annotations

import copy
import difflib

from dpscale.presets.base import Preset
from dpscale.presets.dpscale_fmnist import DPSCALE_FMNIST_PRESETS
from dpscale.presets.papernot import PAPERNOT_PRESETS
from dpscale.presets.scale import SCALE_PRESETS
from dpscale.presets.transfer import TRANSFER_PRESETS
from dpscale.presets.tramer import TRAMER_PRESETS

PRESET_PREFIX = "preset:"


_ALL = (
    *PAPERNOT_PRESETS,
    *TRAMER_PRESETS,
    *SCALE_PRESETS,
    *TRANSFER_PRESETS,
    *DPSCALE_FMNIST_PRESETS,
)
_PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}


def list_presets() -> list[Preset]:
    """All presets, sorted by name."""
    return [_PRESETS[name] for name in sorted(_PRESETS)]


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (with or without the ``preset:`` prefix).

    Raises:
        KeyError: unknown name; the message lists the close and the known names.
    """
    key = name[len(PRESET_PREFIX) :] if name.startswith(PRESET_PREFIX) else name
    if key not in _PRESETS:
        close = difflib.get_close_matches(key, list(_PRESETS), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise KeyError(
            f"unknown preset {key!r}.{hint} Known presets: {', '.join(sorted(_PRESETS))}"
        )
    preset = _PRESETS[key]
    return Preset(preset.name, preset.description, preset.source, copy.deepcopy(preset.values))


__all__ = ["PRESET_PREFIX", "Preset", "get_preset", "list_presets"]
