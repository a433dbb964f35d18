"""Triton kernels for the TALE runtime: decode attention over the mixed cache, KIVI quantize/pack.

`latent_attention` has the signature of tale_runtime.cache.latent_attention and falls back to it
for what the kernel does not cover (prefill chunks T > 1, CPU tensors unless TRITON_INTERPRET=1).

Imports are lazy: from a checkout's root this folder is also visible as a top-level `kernels`,
which transformers probes (for the Hub `kernels` package) by importing it mid-import; an eager
import of tale_runtime here would make that probe circular.
"""

import importlib

_EXPORTS = {
    "latent_attention": ".attention",
    "supported": ".attention",
    "latent_attention_lowrank": ".lowrank_attention",
    "dequantize": ".quant",
    "quantize": ".quant",
    "requantize": ".quant",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
