"""Every plain ``dpscale`` command line in docs/*.md parses as written (issue 62, point 11).

A plain line (continued lines joined) is one a reader pastes into a shell unchanged: no
placeholder syntax (``[...]``, ``...``), no shell variable or redirection. Synopses with those stay checked
by hand; README.md has its own, fuller check (tests/test_readme.py).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from dpscale.cli import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_PLAIN = ("[", "...", "$", ">", "\\")


def _plain_commands() -> list[tuple[str, str]]:
    found = []
    for doc in sorted(DOCS.glob("*.md")):
        for block in FENCE.finditer(doc.read_text(encoding="utf-8")):
            for line in block.group(2).replace("\\\n", " ").splitlines():  # continued lines joined
                command = line.strip().split(" #")[0].strip()
                if command.startswith("dpscale ") and not any(
                    mark in command for mark in NOT_PLAIN
                ):
                    found.append((doc.name, command))
    return found


def test_the_docs_hold_plain_commands():
    names = {doc for doc, _ in _plain_commands()}
    assert {"sampling.md", "privacy.md", "privacy-units.md"} <= names, names


@pytest.mark.parametrize(("doc", "command"), _plain_commands(), ids=lambda v: v[:60])
def test_plain_command_parses(doc, command):
    """A ``--sampling poisson|fixed|shuffle`` line pipes into commands named fixed and shuffle in a
    shell: one command a line, each parsed by dpscale's own parser."""
    assert "|" not in command, f"{doc}: {command!r} pipes in a shell: write one command per line"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit:
        pytest.fail(
            f"{doc}: {command!r} does not parse: {stderr.getvalue().strip().splitlines()[-1]}"
        )


def test_own_loop_names_the_step_statistics_that_exist():
    """own-loop.md once read ``stats.batch_size``; the attribute is ``examples``."""
    from dpscale.train.step import StepStats

    text = (DOCS / "own-loop.md").read_text(encoding="utf-8")
    paragraph = text[text.index("What `mechanism.step` returns") :].split("\n\n")[0]
    named = re.findall(r"`(\w+)`", paragraph)
    attributes = [name for name in named if name not in {"StepStats"}]
    assert "examples" in attributes
    missing = [name for name in attributes if not hasattr(StepStats, name)]
    assert not missing, f"own-loop.md names StepStats attributes that do not exist: {missing}"
