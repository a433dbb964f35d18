"""TALE runtime: load a tale-convert artifact and generate with the token-adaptive lazy cache.

The names below are imported on first use (PEP 562): `tale-run --help` and the other CLIs' option checks start
without importing torch and transformers.
"""

from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "Arch": "spec",
    "ArtifactError": "artifact",
    "Output": "textgen",
    "RunOptions": "textgen",
    "CacheSpec": "spec",
    "Level": "artifact",
    "RegionStore": "cache",
    "Schedule": "artifact",
    "StaticTaleCache": "static_cache",
    "TaleAttention": "model",
    "TaleCache": "model",
    "TaleLayerCache": "cache",  # RegionStore's former name
    "TaleSpec": "spec",
    "cache_arg": "model",
    "chat": "textgen",
    "generate_text": "textgen",
    "latent_attention": "attention",
    "load": "load",
    "new_cache": "load",
    "resolve": "load",
    "set_backend": "load",
    "set_output_path": "load",
    "set_prefill_chunk": "model",
}
__all__ = sorted([*_EXPORTS, "backends"])


class _Package(types.ModuleType):
    """`tale_runtime.load` is the function, as with eager imports: importing the submodule of the same name (which
    the import system then sets as the package's attribute) must not hide it. The module is sys.modules'."""

    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if name == "backends":
        return importlib.import_module(".backends", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
