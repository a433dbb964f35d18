"""Pieces shared by the Triton kernels: code unpacking and the CPU/interpreter gate."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runnable(*ts: torch.Tensor) -> bool:
    """The kernels run on CUDA tensors, and on CPU tensors only under the interpreter."""
    return all(t.is_cuda for t in ts) or (interpreting() and not any(t.is_cuda for t in ts))


def pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def to_float(c, BITS: tl.constexpr, OUT: tl.constexpr):
    """int32 codes (< 2^BITS) -> OUT, exactly.

    The exponent trick instead of the quarter-rate int->float conversion: the code ORed into
    the mantissa of 1024 (float16), 128 (bfloat16, codes < 128) or 2^23 (float32), then that
    power of two subtracted; 16-bit results let the dequantization run in 16-bit.
    """
    if OUT == tl.float16:
        x = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif OUT == tl.bfloat16 and BITS <= 4:  # 128 + c is exact in bfloat16 up to c = 127
        x = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        x = ((c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(OUT)
    return x


@triton.jit
def plane(byts, i: tl.constexpr, BITS: tl.constexpr, OUT: tl.constexpr):
    """uint8 [M, nb] packed rows -> OUT [M, nb]: plane i, i.e. elements i*nb .. i*nb + nb - 1 of
    each row (runtime/quant.py: element c in byte c % nb at bit (c // nb) * BITS)."""
    return to_float((byts.to(tl.int32) >> (i * BITS)) & ((1 << BITS) - 1), BITS, OUT)
