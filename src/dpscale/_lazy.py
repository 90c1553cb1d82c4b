"""Packages whose names are imported on first use (PEP 562), so that importing one submodule (the
DP plan, the accountant) does not load its siblings' torch."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable


def lazy_getattr(
    package: str, module_of: dict[str, str], moved: dict[str, str] | None = None
) -> Callable[[str], Any]:
    """A package's ``__getattr__``: ``name`` from its submodule ``module_of[name]``, imported then.

    Args:
        package: the package's ``__name__``.
        module_of: exported name -> submodule name (relative to the package).
        moved: names this package exported before a release moved them -> their new module
            (absolute); served for one release with a ``DeprecationWarning`` naming the new home.
    """

    def __getattr__(name: str) -> Any:
        if name in module_of:
            return getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)
        if moved and name in moved:
            warnings.warn(
                f"{package}.{name} moved to {moved[name]}.{name}; the old name goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(moved[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def lazy_dir(
    module_of: dict[str, str], submodules: tuple[str, ...] = ()
) -> Callable[[], list[str]]:
    """A package's ``__dir__``: its exported names (imported or not) and its sub-packages.

    Args:
        module_of: exported name -> submodule name, as given to ``lazy_getattr``.
        submodules: the sub-packages or modules to list besides the names.
    """

    def __dir__() -> list[str]:
        return sorted({*module_of, *submodules})

    return __dir__
