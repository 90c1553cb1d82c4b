"""``dpscale presets`` and ``dpscale models``: what the package offers."""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import TypedDict

from dpscale.errors import ConfigError


class _ModelRow(TypedDict):
    """One model of ``dpscale models`` (an object of its ``--json`` list)."""

    name: str
    params: int
    input_shape: list[int]
    engines: list[str]


def _cmd_presets(args: argparse.Namespace) -> int:
    from dpscale.presets import list_presets

    if args.name:
        return _print_preset(args.name, args.json)
    presets = list_presets()
    if args.json:
        print(
            json.dumps(
                [
                    {"name": p.name, "description": p.description, "source": p.source}
                    for p in presets
                ]
            )
        )
        return 0
    width = max(len(p.name) for p in presets) + 1
    for preset in presets:
        print(f"{preset.name:<{width}} {preset.description}")
    print(
        "\nrun one with: dpscale train preset:NAME --set data.root=DIR   (dpscale presets NAME shows it as YAML)"
    )
    return 0


def _print_preset(name: str, as_json: bool) -> int:
    """One preset: as JSON, or as a YAML config with its description and source as comments."""
    import yaml

    from dpscale.presets import get_preset

    try:
        preset = get_preset(name)
    except KeyError as err:
        raise ConfigError(err.args[0]) from err
    if as_json:
        print(
            json.dumps(
                {
                    "name": preset.name,
                    "description": preset.description,
                    "source": preset.source,
                    "values": preset.values,
                }
            )
        )
        return 0
    source = "\n".join(f"# {line}" for line in textwrap.wrap(preset.source, 96))
    print(f"# preset:{preset.name}: {preset.description}\n{source}")
    print(f"#   dpscale train preset:{preset.name} --set data.root=DIR")
    print(yaml.safe_dump(preset.values, sort_keys=False).rstrip())
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from dpscale.models import build_model, count_parameters, default_input_shape, list_models
    from dpscale.privacy.clipping.engines import supported_engines

    rows: list[_ModelRow] = []
    for name in list_models():
        shape = default_input_shape(name)
        model = build_model(name, 10, shape)
        rows.append(
            {
                "name": name,
                "params": count_parameters(model),
                "input_shape": list(shape),
                "engines": supported_engines(model),
            }
        )
    if args.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        shown = "x".join(map(str, row["input_shape"]))
        print(
            f"{row['name']:<26} {row['params']:>10,} params  input {shown:<8} engines: {', '.join(row['engines'])}"
        )
    return 0


def add_presets_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``presets``."""
    presets = sub.add_parser("presets", help="list the paper presets, or print one as YAML")
    presets.add_argument("name", nargs="?", help="a preset to print as a YAML config")
    presets.add_argument("--json", action="store_true")
    presets.set_defaults(func=_cmd_presets)


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``models``."""
    models = sub.add_parser("models", help="list the registered models")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=_cmd_models)
