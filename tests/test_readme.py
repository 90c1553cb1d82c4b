"""The README runs as written (issue 25, row 11).

Every fenced block is Python or bash. Python blocks are executed as they stand, in a fresh
working directory. Every command line of a bash block is parsed by ``dpscale``'s own argparse
parser (``[...]`` groups both left out and filled in; upper-case words are placeholders), the
cheap ones (``account``, ``models``, ``presets``, with a preset for NAME) are run, and ``make``
targets must exist in the Makefile. Numbers and names the prose takes from the code (config
sections and keys, the embedded sample's split, the Tramèr presets, defaults) are checked against it.
The whole file stays cheap: the Python blocks train a few steps only.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
import typing
from pathlib import Path

import pytest

from dpscale.cli import build_parser, main
from dpscale.config import Config, DPConfig, FeaturesConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
CHEAP_COMMANDS = ("account", "models", "presets")  # run for real; the others train or need data
EXAMPLES = {"NAME": "papernot-mnist-tanh"}  # placeholders the cheap commands can run with
PLACEHOLDER = re.compile(r"(?<![\w.-])[A-Z][A-Z0-9_]*(?![\w-])")  # CONFIG, RUN_DIR, DIR, NAME, SRC


def _blocks(language: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block in ``language``."""
    return [
        (README.count("\n", 0, m.start()) + 1, m.group(2))
        for m in FENCE.finditer(README)
        if m.group(1) == language
    ]


def _block_id(block: tuple[int, str]) -> str:
    return f"README.md:{block[0]}"


def test_every_code_block_is_python_or_bash_and_none_is_left_open():
    languages = [m.group(1) for m in FENCE.finditer(README)]
    assert languages and set(languages) <= {"python", "bash"}, languages
    assert README.count("```") == 2 * len(languages), "an unmatched ``` fence"


# --------------------------------------------------------------------------- Python blocks


@pytest.mark.parametrize("block", _blocks("python"), ids=_block_id)
def test_python_block_runs_as_written(block, tmp_path, monkeypatch):
    """Executed unchanged in an empty directory, so ``runs/...`` lands in ``tmp_path``; no block
    may rely on data outside the package (the development data in ../shared is optional)."""
    line, code = block
    assert "../shared" not in code, f"README.md:{line} needs the development data"
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


# --------------------------------------------------------------------------- bash blocks


def _variants(tokens: list[str]) -> list[list[str]]:
    """The command lines a synopsis stands for.

    ``[...]`` groups are left out (the shortest form) and filled in (the longest form); ``...``
    (more of the same) is dropped; ``a|b`` inside a token gives one longest form per alternative.

    Args:
        tokens: the shell words of one line.

    Returns:
        The shortest form first, then the longest form(s).
    """
    shortest, longest, depth = [], [], 0
    for token in tokens:
        opens, closes = token.startswith("["), token.endswith("]")
        word = token[1 if opens else 0 : -1 if closes else None]
        depth += opens
        if word and word != "...":
            longest.append(word)
            if depth == 0:
                shortest.append(word)
        depth -= closes
    assert depth == 0, f"unbalanced [ ] in {' '.join(tokens)}"

    def pick(word: str, k: int) -> str:  # the k-th of "a|b|c" (the last one past its end)
        options = word.split("|")
        return options[min(k, len(options) - 1)]

    choices = max((w.count("|") + 1 for w in longest), default=1)
    forms = [shortest] + [[pick(w, k) for w in longest] for k in range(choices)]
    return [f for i, f in enumerate(forms) if f not in forms[:i]]


def _command_lines() -> list[tuple[str, list[str]]]:
    """(``README.md:line``, shell words) of every command in the bash blocks."""
    lines = []
    for first, code in _blocks("bash"):
        for offset, text in enumerate(code.splitlines()):
            tokens = shlex.split(text, comments=True)
            if tokens:
                lines.append((f"README.md:{first + 1 + offset}", tokens))
    return lines


COMMAND_LINES = _command_lines()


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def _dpscale_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after ``dpscale`` (also ``torchrun ... -m dpscale ARGS``); None for make."""
    if tokens[0] == "dpscale":
        return tokens[1:]
    if tokens[0] == "torchrun":
        at = next(i for i in range(len(tokens) - 1) if tokens[i : i + 2] == ["-m", "dpscale"])
        return tokens[at + 2 :]
    assert tokens[0] == "make", f"unexpected command {tokens[0]!r} in a bash block"
    return None


def _parse(argv: list[str], where: str, capsys: pytest.CaptureFixture) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse's way to report an error
        pytest.fail(
            f"{where}: `dpscale {' '.join(argv)}` does not parse: {capsys.readouterr().err.strip()} ({stop})"
        )


@pytest.mark.parametrize("where, tokens", COMMAND_LINES, ids=[where for where, _ in COMMAND_LINES])
def test_bash_command_parses_and_the_cheap_ones_run(where, tokens, capsys):
    argv = _dpscale_argv(tokens)
    if argv is None:
        missing = set(tokens[1:]) - _make_targets()
        assert not missing, f"{where}: no Makefile target {sorted(missing)}"
        return
    forms = _variants(argv)
    for form in forms:
        _parse(form, where, capsys)
    if argv[0] not in CHEAP_COMMANDS:
        return
    examples = [[EXAMPLES.get(w, w) for w in f] for f in forms]
    runnable = [f for f in examples if not any(PLACEHOLDER.search(w) for w in f)]
    assert runnable, f"{where}: no form of this line can run"
    for form in runnable:
        assert main(form) == 0, (
            f"{where}: `dpscale {' '.join(form)}` failed: {capsys.readouterr().err}"
        )


def test_make_targets_named_in_the_prose_exist():
    named = set(re.findall(r"`make ([\w-]+)`", README))
    assert named and named <= _make_targets(), sorted(named - _make_targets())


# --------------------------------------------------------------------------- numbers and names


def test_config_sections_listed_are_the_configs():
    listed = re.search(r"YAML sections ((?:`\w+`,?\s*)+)\(see", README)
    assert listed, "the README no longer lists the YAML sections"
    assert re.findall(r"`(\w+)`", listed.group(1)) == [f.name for f in dataclasses.fields(Config)]


def test_every_config_key_named_exists():
    sections = typing.get_type_hints(Config)  # the annotations are strings (postponed evaluation)
    keys = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in sections.items()}
    pattern = rf"(?<![\w/.-])({'|'.join(keys)})\.([a-z][a-z0-9_]*)"
    # the text and the bash blocks: Python blocks name variables (data.x_train), not keys
    prose = FENCE.sub(lambda m: "" if m.group(1) == "python" else m.group(0), README)
    named = set(re.findall(pattern, prose))
    assert len(named) > 20, "the key pattern finds too little: is it stale?"
    unknown = sorted(f"{s}.{k}" for s, k in named if k not in keys[s])
    assert not unknown, f"README names config keys that do not exist: {unknown}"


def test_the_tramer_presets_counted_are_the_registered_ones():
    from dpscale.presets import list_presets

    found = re.search(r"the (\w+)\s+Tramèr Table 13 settings\s+`([^`]+)`", README)
    assert found, "the README no longer names the Tramèr Table 13 presets"
    count = ("one two three four five six seven eight nine ten eleven twelve".split()).index(
        found.group(1)
    ) + 1
    parts = re.split(r"\{([^}]*)\}", found.group(2))  # literal, choices, literal, choices, ...
    options = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
    names = {"".join(choice) for choice in itertools.product(*options)}
    registered = {p.name for p in list_presets()}
    assert len(names) == count and names <= registered, (count, sorted(names - registered))


def test_the_embedded_sample_and_the_default_run_are_as_described():
    from dpscale.data import load_mnist_5k

    sample = re.search(
        r"the\s+([\d,]+)-image MNIST sample.*?\(([\d,]+) train / ([\d,]+) held-out",
        README,
        re.DOTALL,
    )
    assert sample, "the README no longer describes the embedded sample"
    total, train, test = (int(g.replace(",", "")) for g in sample.groups())
    info = load_mnist_5k().info
    assert (info.num_train, info.num_test) == (train, test) and train + test == total
    default = re.search(
        r"calibrating the noise to epsilon = (\S+) at delta = (\d[\de.-]*\d)", README
    )
    assert default and (float(default.group(1)), float(default.group(2))) == (
        DPConfig.epsilon,
        DPConfig.delta,
    )


def test_the_scatternet_shape_is_the_default_configs():
    found = re.search(r"J=(\d+), (\d+) angles: (\d+) x H/4 x W/4", README)
    assert found, "the README no longer gives the ScatterNet shape"
    j, angles, channels = map(int, found.groups())
    assert (j, angles) == (FeaturesConfig.scatter_j, FeaturesConfig.scatter_angles)
    assert channels == 1 + j * angles + angles**2 * j * (j - 1) // 2  # orders 0, 1 and 2
