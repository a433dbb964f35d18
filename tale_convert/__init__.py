"""tale-convert: turn a Llama-family checkpoint into a TALE artifact (DESIGN.md sections 3 and 6).

Pipeline, one module per stage: source (resolve + load + check) -> calibrate (v_proj input
covariance, layer by layer) -> whiten (SVD-LLM factors) -> fuse (O^r) -> write (artifact).

`tale_convert.convert(model, out, Options(...))` is the whole conversion as one call (what tale-convert makes); the
names below are imported on first use, so that `import tale_convert` and the CLI's option checks start without torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from tale_runtime.lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
