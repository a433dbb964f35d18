"""Lazy package exports (PEP 562): a package names what its submodules define and imports a submodule the first time
one of those names is read, so that importing the package (and the CLIs' --help) stays free of torch."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable


def lazy_exports(
    package: str, exports: dict[str, str], submodules: tuple[str, ...] = ()
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """Make the package `package` (its __name__) export `exports` (name -> the submodule that defines it) lazily, and
    its `submodules` on first access too. Returns the module's __getattr__ and __dir__, to assign at module level.

    An exported name wins over a submodule of the same name (`tale_runtime.load` is the function, as with eager
    imports): importing that submodule, which the import system then sets as the package's attribute, does not hide
    it. The package's __all__ must be set before __dir__ is called."""
    module = sys.modules[package]

    class Package(types.ModuleType):
        def __setattr__(self, name: str, value) -> None:
            if name in exports and isinstance(value, types.ModuleType):
                return
            super().__setattr__(name, value)

    module.__class__ = Package

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(f".{exports[name]}", package), name)
            setattr(module, name, value)  # later lookups skip this hook
            return value
        if name in submodules:
            return importlib.import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*vars(module), *module.__all__])

    return __getattr__, __dir__
