"""Build a wheelhouse for an air-gapped machine (issue 44): dpscale's own wheel and a wheel of every
runtime dependency for the target Python and platform, so that the machine installs with no index:

    python scripts/wheelhouse.py --dest wheelhouse --python-version 3.11 --platform manylinux_2_28_x86_64
    # copy wheelhouse/ over, then on the air-gapped machine:
    pip install --no-index --find-links wheelhouse dpscale

torch is the large one: ``--torch "torch==2.6.0"`` names the build to fetch (a CUDA build from its
own index with ``--torch-index https://download.pytorch.org/whl/cu124``), ``--torch skip`` leaves it
out when the machine has torch already. ``make wheelhouse`` runs this for this machine's Python and
platform with the pinned CPU torch of constraints.txt.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The ``[project] dependencies`` of pyproject.toml (torch among them)."""
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def _is_torch(requirement: str) -> bool:
    return requirement.replace(" ", "").lower().startswith(("torch>", "torch=", "torch<", "torch~", "torch!"))


def _target_flags(args: argparse.Namespace) -> list[str]:
    """pip download's flags for another interpreter/platform (none: this machine's)."""
    if not (args.python_version or args.platform):
        return []
    flags = ["--only-binary=:all:", "--implementation", "cp"]
    if args.python_version:
        flags += ["--python-version", args.python_version]
    if args.platform:
        flags += ["--platform", args.platform]
    return flags


def build(args: argparse.Namespace) -> int:
    """Write the wheelhouse; returns the exit code."""
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    # dpscale's own wheel (pure Python: one wheel for every target)
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dest), str(ROOT)], check=True)
    if args.no_deps:
        return 0
    requirements = [r for r in runtime_requirements() if not _is_torch(r)]
    subprocess.run([*pip, "download", "--dest", str(dest), *_target_flags(args), *requirements], check=True)
    if args.torch != "skip":
        index = ["--index-url", args.torch_index] if args.torch_index else []
        subprocess.run([*pip, "download", "--no-deps", "--dest", str(dest), *_target_flags(args), *index, args.torch],
                       check=True)  # fmt: skip
    print(f"wheelhouse: {len(list(dest.glob('*.whl')))} wheels in {dest}; install offline with "
          f"`pip install --no-index --find-links {dest} dpscale`")  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default="wheelhouse")
    parser.add_argument("--python-version", default=None, help="e.g. 3.11 (default: this interpreter's)")
    parser.add_argument("--platform", default=None, help=f"e.g. manylinux_2_28_x86_64 (default: {sysconfig.get_platform()})")
    parser.add_argument("--torch", default="torch==2.13.0", help='the torch requirement to fetch, or "skip"')
    parser.add_argument("--torch-index", default=None, help="an index for torch's CUDA or CPU builds")
    parser.add_argument("--no-deps", action="store_true", help="dpscale's own wheel only")
    return build(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
