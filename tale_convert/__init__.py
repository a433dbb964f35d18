"""tale-convert: turn a Llama-family checkpoint into a TALE artifact (DESIGN.md sections 3 and 6).

Pipeline, one module per stage: source (resolve + load + check) -> calibrate (v_proj input
covariance, layer by layer) -> whiten (SVD-LLM factors) -> fuse (O^r) -> write (artifact).

`tale_convert.convert(model, out, Options(...))` is the whole conversion as one call (what tale-convert makes); the
names below are imported on first use, so that `import tale_convert` and the CLI's option checks start without torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tale-kv")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"


class ConvertError(Exception):
    """Bad input, or a conversion that cannot go on. The CLI prints it as one line and exits 2."""


# name -> the module that defines it
_EXPORTS = {
    "LayerReport": "convert",
    "Options": "options",
    "Report": "convert",
    "check_inputs": "options",
    "convert": "convert",
}
__all__ = sorted(["ConvertError", "__version__", *_EXPORTS])


class _Package(types.ModuleType):
    """`tale_convert.convert` is the function: importing the submodule of the same name (which the import system
    then sets as the package's attribute) must not hide it. The module is sys.modules' (importlib.import_module)."""

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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
