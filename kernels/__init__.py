"""Triton kernels for the TALE runtime: decode attention over the mixed cache, KIVI quantize/pack.

`latent_attention` has the signature of tale_runtime.cache.latent_attention and falls back to it
for what the kernel does not cover (prefill chunks T > 1, CPU tensors unless TRITON_INTERPRET=1).
"""

from .attention import latent_attention, supported
from .quant import dequantize, quantize, requantize

__all__ = ["dequantize", "latent_attention", "quantize", "requantize", "supported"]
