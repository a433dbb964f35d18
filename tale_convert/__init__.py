"""tale-convert: turn a Llama-family checkpoint into a TALE artifact (DESIGN.md sections 3 and 6).

Pipeline, one module per stage: source (resolve + load + check) -> calibrate (v_proj input
covariance, layer by layer) -> whiten (SVD-LLM factors) -> fuse (O^r) -> write (artifact).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tale-kv")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"


class ConvertError(Exception):
    """Bad input, or a conversion that cannot go on. The CLI prints it as one line and exits 2."""
