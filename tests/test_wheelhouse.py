"""The offline install (issue 44): scripts/wheelhouse.py builds dpscale's wheel (and, with the
network, every runtime dependency's) and pip installs it with --no-index."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _wheelhouse(dest: Path, *extra: str) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), "--dest", str(dest), *extra],
        check=True,
        capture_output=True,
    )


def test_dpscales_own_wheel_installs_with_no_index(tmp_path):
    _wheelhouse(tmp_path / "wh", "--no-deps")
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--find-links",
            str(tmp_path / "wh"),
            "--target",
            str(target),
            "dpscale",
        ],
        check=True,
    )
    code = (
        "import dpscale, sys; print(dpscale.__file__); sys.exit(dpscale.cli.main(['account', '--dataset-size', "
        "'1000', '--batch-size', '10', '--noise', '1.0', '--steps', '10', '--delta', '1e-5']))"
    )
    # the installed wheel before the editable checkout
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", "import dpscale.cli; " + code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines()[0].startswith(str(target)) and "What it means" in out


@pytest.mark.slow
def test_the_full_wheelhouse_installs_into_a_fresh_environment_with_no_index(tmp_path):
    """Needs the package index once (pip download), then installs with --no-index into a new venv
    that sees this environment's torch only (the target machine's own torch, --torch skip)."""
    import torch

    _wheelhouse(tmp_path / "wh", "--torch", "skip")
    # torch's own requirement, met on a machine with torch
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--dest",
            str(tmp_path / "wh"),
            "setuptools>=77.0.3",
        ],
        check=True,
    )
    torch_only = tmp_path / "torch-only"
    torch_only.mkdir()
    site = Path(torch.__file__).parent.parent
    for pattern in (
        "torch",
        "torch-*.dist-info",
        "torchgen",
        "functorch",
        "typing_extensions*",
        "sympy*",
        "mpmath*",
        "networkx*",
        "jinja2*",
        "markupsafe*",
        "MarkupSafe*",
        "fsspec*",
        "filelock*",
    ):
        for path in site.glob(pattern):
            (torch_only / path.name).symlink_to(path)
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "torch-only.pth").write_text(str(torch_only) + "\n")
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--find-links",
            str(tmp_path / "wh"),
            "dpscale",
        ],
        check=True,
    )
    out = subprocess.run(
        [python, "-c", "import dpscale; print(dpscale.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(tmp_path / "venv") in out
