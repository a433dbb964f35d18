"""Decode-attention kernels for the TALE runtime (Triton, and CUDA on Hopper), KIVI quantize/pack.

They register as attention backends of tale_runtime ("triton", "cuda": plugin.py, through the entry point group
"tale_runtime.backends"); the runtime imports nothing from here. `latent_attention` has the signature of
tale_runtime.attention.latent_attention (plus a TritonConfig): a chunk of several new tokens (a prefill chunk) is the
reference's by design, and a decode step the kernel does not serve (`supported`: its reason; CPU tensors unless
TRITON_INTERPRET=1) is refused with a ValueError, never run on the reference under the kernel's name.

Imports are lazy: from a checkout's root this folder is also visible as a top-level `kernels`,
which transformers probes (for the Hub `kernels` package) by importing it mid-import; an eager
import of tale_runtime here would make that probe circular.
"""

import importlib

_EXPORTS = {
    "TritonConfig": ".attention",
    "latent_attention": ".attention",
    "supported": ".attention",
    "latent_attention_lowrank": ".lowrank_attention",
    "PagedConfig": ".paged_attention",
    "paged_latent_attention": ".paged_attention",
    "dequantize": ".quant",
    "quantize": ".quant",
    "requantize": ".quant",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
