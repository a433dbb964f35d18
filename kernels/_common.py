"""Pieces shared by the Triton kernels: code unpacking, the split-K prologue and the CPU/interpreter gate."""

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


@triton.jit
def plane3(lo, hi, i: tl.constexpr, OUT: tl.constexpr):
    """Sub-plane i of bit-sliced 3-bit rows (runtime/quant.py) -> OUT: `lo` the low-byte half i % 2, `hi` the
    high-bit bytes; the code is 2 bits of lo at 2 (i // 2) and bit i of hi above them."""
    lo = (lo.to(tl.int32) >> (2 * (i // 2))) & 3
    return to_float(lo | (((hi.to(tl.int32) >> i) & 1) << 2), 3, OUT)


def _dq_asm(bits: int, fp16: bool) -> str:
    """PTX for 4 codes of one bit plane of a 32-bit word ($2: 4 packed bytes; $7: the shift i * bits)
    -> 4 values code * scale + zero ($3,$4: scale pairs, $5,$6: zero pairs) as two 16-bit pairs ($0, $1).
    3 bits (bit-sliced, runtime/quant.py): $2 the low-byte word, $3 the high-bit word, $4,$5 scale pairs,
    $6,$7 zero pairs, $8 the low shift 2 (i // 2), $12 the high shift i; the high bit joins at bit 2.

    The masked codes sit in the low bits of the word's 4 bytes; prmt puts each under the exponent
    byte of 128 (bf16, 0x43) / 1024 (fp16, 0x64), so every 16-bit lane reads 128 + c (1024 + c)
    exactly; one fma per pair subtracts that power (exact: the code), a second applies scale and
    zero with one rounding. 2 instructions per value instead of the ~8 of the int32 path.
    """
    mask = 0x0F0F0F0F if bits == 4 else 0x03030303
    e = 0x64 if fp16 else 0x43
    t = "f16x2" if fp16 else "bf16x2"
    one, neg = (0x3C003C00, 0xE400E400) if fp16 else (0x3F803F80, 0xC300C300)  # 1.0, -1024.0 / -128.0
    s0, s1, z0, z1, sh = ("$4", "$5", "$6", "$7", "$8") if bits == 3 else ("$3", "$4", "$5", "$6", "$7")
    high = "shr.b32 h, $3, $12;\nand.b32 h, h, 0x01010101;\nshl.b32 h, h, 2;\nor.b32 c, c, h;\n" if bits == 3 else ""
    return (
        "{\n"
        f".reg .b32 c, {'h, ' if bits == 3 else ''}lo, hi, one, neg;\n"
        f"mov.b32 one, {one:#010x};\n"
        f"mov.b32 neg, {neg:#010x};\n"
        f"shr.b32 c, $2, {sh};\n"
        f"and.b32 c, c, {mask:#010x};\n"
        f"{high}"
        f"prmt.b32 lo, c, {e * 0x01010101:#010x}, 0x4140;\n"  # bytes c0, e, c1, e
        f"prmt.b32 hi, c, {e * 0x01010101:#010x}, 0x4342;\n"  # bytes c2, e, c3, e
        f"fma.rn.{t} lo, lo, one, neg;\n"
        f"fma.rn.{t} hi, hi, one, neg;\n"
        f"fma.rn.{t} $0, lo, {s0}, {z0};\n"
        f"fma.rn.{t} $1, hi, {s1}, {z1};\n"
        "}"
    )


_DQ_BF16_2 = tl.constexpr(_dq_asm(2, False))
_DQ_BF16_4 = tl.constexpr(_dq_asm(4, False))
_DQ_F16_2 = tl.constexpr(_dq_asm(2, True))
_DQ_F16_4 = tl.constexpr(_dq_asm(4, True))
_DQ_CONSTRAINTS = tl.constexpr("=r,=r,r,r,r,r,r,r,r,r,r")  # out pair x2; bytes; scale x2; zero x2; shift x4
_DQ3_BF16 = tl.constexpr(_dq_asm(3, False))
_DQ3_F16 = tl.constexpr(_dq_asm(3, True))
_DQ3_CONSTRAINTS = tl.constexpr("=r,=r" + ",r" * 14)  # out pair x2; low, high bytes; scale x2; zero x2; shifts x4 x2


@triton.jit
def plane_asm(byts, scale, zero, i: tl.constexpr, BITS: tl.constexpr, OUT: tl.constexpr):
    """plane(byts, i, BITS, OUT) * scale + zero (scale, zero in OUT, broadcast to byts' shape) in
    inline PTX, 4 codes per 32-bit register (GPU only: the interpreter cannot run PTX; 2/4 bits,
    OUT float16 or bfloat16). The multiply-add rounds once (fma), the plain path may round twice."""
    sh = tl.full(byts.shape, i * BITS, tl.int32)
    if OUT == tl.float16:
        if BITS == 2:
            x = tl.inline_asm_elementwise(_DQ_F16_2, _DQ_CONSTRAINTS, [byts, scale, zero, sh], tl.float16, True, 4)
        else:
            x = tl.inline_asm_elementwise(_DQ_F16_4, _DQ_CONSTRAINTS, [byts, scale, zero, sh], tl.float16, True, 4)
    else:
        if BITS == 2:
            x = tl.inline_asm_elementwise(_DQ_BF16_2, _DQ_CONSTRAINTS, [byts, scale, zero, sh], tl.bfloat16, True, 4)
        else:
            x = tl.inline_asm_elementwise(_DQ_BF16_4, _DQ_CONSTRAINTS, [byts, scale, zero, sh], tl.bfloat16, True, 4)
    return x


@triton.jit
def plane3_asm(lo, hi, scale, zero, i: tl.constexpr, OUT: tl.constexpr):
    """plane3(lo, hi, i, OUT) * scale + zero in inline PTX, 4 codes per 32-bit register (GPU only)."""
    sl = tl.full(lo.shape, 2 * (i // 2), tl.int32)
    sh = tl.full(lo.shape, i, tl.int32)
    if OUT == tl.float16:
        x = tl.inline_asm_elementwise(_DQ3_F16, _DQ3_CONSTRAINTS, [lo, hi, scale, zero, sl, sh], tl.float16, True, 4)
    else:
        x = tl.inline_asm_elementwise(_DQ3_BF16, _DQ3_CONSTRAINTS, [lo, hi, scale, zero, sl, sh], tl.bfloat16, True, 4)
    return x


# -- the prologue every split-K decode kernel shares: its scalars, its split's slots, its rows, each tile's slots


@triton.jit
def program_ids():
    """The program's (split, head group, batch row) of a grid (splits, groups, B); the last two as int64 offsets."""
    return tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)


@triton.jit
def scalar(arg, PTR: tl.constexpr):
    """An int32 scalar: `arg` itself, or (PTR) the value of the device scalar it points to (read when the kernel
    runs, so that a captured graph follows it)."""
    if PTR:
        x = tl.load(arg).to(tl.int32)
    else:
        x = arg
    return x


@triton.jit
def split_bounds(L, ns, sp, BT: tl.constexpr):
    """Slots [t_start, t_end) of split sp of ns over a used length L: whole tiles of BT slots each, computed on the
    device (a split past L gets none)."""
    chunk = tl.cdiv(tl.cdiv(L, ns), BT) * BT
    t_start = sp * chunk
    return t_start, tl.minimum(t_start + chunk, L)


@triton.jit
def group_rows(c, QG: tl.constexpr, QGP: tl.constexpr):
    """The QGP (a power of two >= QG) query rows of head group c: row index, query head, and which are real."""
    rows = tl.arange(0, QGP)
    return rows, c * QG + rows, rows < QG


@triton.jit
def tile_slots(t0, t_end, BT: tl.constexpr):
    """The slots of the tile at t0, and which are in the split."""
    t = t0 + tl.arange(0, BT)
    return t, t < t_end


@triton.jit
def slot_ok(p_row, t, tm, next_pos, window, WIN: tl.constexpr):
    """Each slot's cache position (p_row: the row's positions; -1 outside the split) and whether it counts: a
    position >= 0 and, with a window (WIN), next_pos - position < window."""
    pv = tl.load(p_row + t, mask=tm, other=-1)
    ok = pv >= 0
    if WIN:
        ok = ok & (next_pos - pv < window)
    return pv, ok
