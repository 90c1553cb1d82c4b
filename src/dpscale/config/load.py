"""Loading a config: YAML files, presets and ``--set key=value`` overrides, type-checked into the
sections' dataclasses (``build_dataclass`` reads the fields and type hints of the dataclass it is
given) and validated (``load_config``: defaults <- YAML <- ``--set``)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dpscale.config.schema import Config
from dpscale.config.validation import validate
from dpscale.errors import ConfigError


@dataclass(frozen=True)
class _Override:
    """A ``--set`` value: the text as typed and its YAML reading. String fields take the text
    itself, so paths like ``runs/a #2`` or ``2024`` are not mangled by YAML (comments, numbers)."""

    raw: str
    parsed: Any
    error: str | None = None  # why the text is not valid YAML (fine for a string-typed key)

    def resolve(self, path: str, annotation: Any) -> Any:
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        options = typing.get_args(annotation) if union else (annotation,)
        if str not in options:
            if self.error:
                raise ConfigError(f"{path}: cannot parse value {self.raw!r}: {self.error}")
            return self.parsed
        text = self.raw.strip()
        if text in ("", "null", "~", "Null", "NULL"):
            return None
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            return self.parsed
        if int in options and isinstance(self.parsed, int) and not isinstance(self.parsed, bool):
            # a number or a word (dp.bands: 4 or auto): the number, as YAML reads it
            return self.parsed
        return text


def _unwrap(value: Any) -> Any:
    """Free-form values (model.kwargs) take the YAML reading of any --set inside them."""
    if isinstance(value, _Override):
        return value.parsed
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check/convert ``value`` against a (simple) type annotation, with a clear error."""
    if isinstance(value, _Override):
        value = value.resolve(path, annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(path, value, typing.get_args(annotation))
    if value is None:
        raise ConfigError(f"{path} must not be null")
    if annotation in (bool, int, float, str):
        return _coerce_scalar(path, value, annotation)
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{path} must be a list, got {value!r}")
            return tuple(_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value))
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{path} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return _unwrap(value)
    raise ConfigError(f"{path}: unsupported type {annotation}")  # pragma: no cover


def _coerce_union(path: str, value: Any, options: tuple[Any, ...]) -> Any:
    """``value`` as the first of a union's ``options`` that takes it (None only where the union has it);
    else the error of the first option."""
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{path} must not be null")
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _coerce(path, value, option)
        except ConfigError as err:
            errors.append(str(err))
    raise ConfigError(errors[0])


def _coerce_scalar(path: str, value: Any, annotation: type) -> Any:
    """``value`` (not None) as a bool, int, float or str, the ``annotation``."""
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if annotation is int:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or int(value) != value
        ):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return int(value)
    if annotation is float:
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, which reads 1e-5 (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{path} must be a string, got {value!r}")
    return value


def build_dataclass(cls: type, path: str, values: dict[str, Any]) -> Any:
    """One dataclass (a config section, and the sections inside it) from its values, each checked
    against its field's type; a key it has no field for is refused, with the closest key named.

    Args:
        cls: the dataclass to build (``dpscale.config.Config`` for a whole config).
        path: its dotted key in the config, for the errors ("" for the whole config).
        values: its keys and values, as YAML and ``parse_override`` read them; a field not given
            keeps its default.

    Returns:
        The ``cls`` instance.

    Raises:
        ConfigError: not a mapping, an unknown key, or a value of the wrong type.
    """
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in values if k not in names]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, names, n=1)
        where = f"{path}.{key}" if path else key
        hint = f" (did you mean {path + '.' if path else ''}{close[0]}?)" if close else ""
        raise ConfigError(f"unknown config key {where!r}{hint}; valid keys: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name not in values:
            continue
        sub_path = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hints[name]):
            section = values[name]
            if isinstance(section, _Override):  # --set dp={epsilon: 2, delta: 1e-6}
                section = section.parsed
            kwargs[name] = build_dataclass(hints[name], sub_path, section or {})
        else:
            kwargs[name] = _coerce(sub_path, values[name], hints[name])
    return cls(**kwargs)


def _yaml_problem(err: yaml.YAMLError, text: str, in_file: bool) -> tuple[str | None, str, str]:
    """Where and what PyYAML found wrong, for a one-line message.

    PyYAML's own ``str(err)`` spans 4-8 lines (an excerpt with a caret, "<unicode string>" as
    the file name), which breaks the one-line error contract of the command line.

    Args:
        err: the error ``yaml.safe_load(text)`` raised.
        text: the text it was reading.
        in_file: positions as compilers write them after a file name (``line:column``); else, for
            a one-line ``--set`` value, ``column C`` (``line L, column C`` past its first line).

    Returns:
        (position, problem, context): the position is None when PyYAML gives none; the context
        says what PyYAML was parsing and where that started, in parentheses ("" if it does not).
    """

    def at(line: int, column: int) -> str:  # 0-based in, 1-based out
        if in_file:
            return f"{line + 1}:{column + 1}"
        return f"column {column + 1}" if line == 0 else f"line {line + 1}, column {column + 1}"

    if isinstance(err, yaml.reader.ReaderError):  # a character offset, no line/column mark
        offset = min(err.position, len(text))
        character = f" (#x{err.character:04x})" if isinstance(err.character, int) else ""
        start = text.rfind("\n", 0, offset) + 1
        return at(text.count("\n", 0, offset), offset - start), f"{err.reason}{character}", ""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    what, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    context = (
        f" ({what} at {at(context_mark.line, context_mark.column)})"
        if what and context_mark
        else ""
    )
    return (at(mark.line, mark.column) if mark else None), problem, context


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (numbers, null, lists, mappings), except
    that string-typed keys take the text as typed.

    Args:
        text: one ``--set`` argument.

    Returns:
        (keys, value): the dotted key split into its parts, and the value to merge (an
        ``_Override`` keeping the text as typed, its YAML reading and, when the text is not
        valid YAML, why, in one line).

    Raises:
        ConfigError: no ``=`` or an empty key.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {text!r}")
    try:
        return key.strip().split("."), _Override(raw, yaml.safe_load(raw) if raw.strip() else None)
    except yaml.YAMLError as err:  # only acceptable for a string-typed key; checked when built
        position, problem, context = _yaml_problem(err, raw, in_file=False)
        where = f" at {position}" if position else ""
        return key.strip().split("."), _Override(raw, raw, f"{problem}{where}{context}")


def _merge(base: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set ``keys`` (a dotted ``--set`` key) in the nested mapping ``base``, making sections as needed."""
    node = base
    for key in keys[:-1]:
        child = node.get(key)
        if isinstance(child, _Override) and isinstance(child.parsed, dict):
            child = node[key] = dict(child.parsed)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {key} is not a section")
        node = child
    node[keys[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one
    silently, so a second ``epsilon:`` further down a file would override the first unseen."""


def _construct_unique_mapping(
    loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False
) -> dict:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base" may override what it merges in
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first given on line {first_line[key] + 1})",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line
        except TypeError:  # an unhashable key: SafeLoader's own error follows
            break
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def read_config_file(path: Path) -> dict[str, Any]:
    """The sections of a YAML config file; every problem is one line naming the file (and, for
    malformed YAML, ``file:line:column``, as compilers write it).

    Args:
        path: the YAML file.

    Returns:
        Its mapping of sections ({} for an empty file).

    Raises:
        ConfigError: missing, unreadable, not UTF-8, not valid YAML, or not a mapping.
    """
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {err.start}: {err.reason})"
        ) from err
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err.strerror or err}") from err
    try:
        values = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        position, problem, context = _yaml_problem(err, text, in_file=True)
        where = f"{path}:{position}" if position else str(path)
        raise ConfigError(f"config file {where}: not valid YAML: {problem}{context}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return values


def read_config_values(path: str | Path | None, overrides: Sequence[str]) -> dict[str, Any]:
    """The sections a config's sources give, before they are checked: a preset's or a YAML file's,
    with the ``--set`` overrides merged in, in order.

    Args:
        path: a YAML file, "preset:<name>", or None (only the overrides).
        overrides: "section.key=value" strings.

    Returns:
        The nested mapping of sections that ``build_dataclass`` turns into a config (override
        values still kept as typed).

    Raises:
        ConfigError: an unknown preset, an unreadable file, or a malformed override.
    """
    values: dict[str, Any] = {}
    if isinstance(path, str) and path.startswith("preset:"):
        from dpscale.presets import get_preset  # local: presets are plain data, loaded on demand

        try:
            values = get_preset(path).values
        except KeyError as err:
            raise ConfigError(err.args[0]) from err
    elif path is not None:
        values = read_config_file(Path(path))
    for text in overrides:
        keys, value = parse_override(text)
        _merge(values, keys, value)
    return values


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated.

    Args:
        path: YAML file with sections data, features, augment, model, dp, optim, train, run,
            eval (any may be omitted), or "preset:<name>" (``dpscale presets`` lists them).
        overrides: "section.key=value" strings, applied in order.

    Returns:
        The validated config.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or out-of-range value.
    """
    config: Config = build_dataclass(Config, "", read_config_values(path, overrides))
    validate(config)
    return config
