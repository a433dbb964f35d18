"""Fused decode attention (T = 1) over a cache whose keys are held before RoPE, low-rank ones included.

The `lowrank` preset (runtime/schedule.py) caches its middle level's keys as coefficients on the layer's key
basis (runtime/key_basis.py: per block, c = (k_pre - mean) enc[:, :r], k_pre ~ mean + c dec[:r]; one joint block
over the KV heads, or one block per head), its other levels' keys before RoPE (Schedule.key_rope "pre"), and the
sinks and the 16-bit tail after RoPE. This module serves such a view whole, one launch per region, grid (splits,
G, B) like kernels/attention.py (flash-decoding: the splits share the slots, about `waves` programs per SM), and
writes the same split partials (max, sum, acc[:rank]) that its `_combine` merges with the new token. Per tile of
BT slots and latent group:

- keys: low-rank ones rebuilt on tensor cores from the coefficient codes, unpacked and dequantized chunk by chunk
  ([BT, KRC] of the r coefficients, quantized per coefficient over token groups or per token), times the basis'
  dec rows ([KRC, n/2] per head and RoPE half), plus the mean. A joint basis rebuilds the group's g heads in one
  [BT, KRC] x [KRC, g n/2] dot per half (the coefficients dequantized once per tile); a per-head basis (K blocks,
  coefficients [B, K, cap, r_h]) head by head, each head's own coefficients: r_h x n multiply-adds per head and
  slot, K times fewer than a joint basis with as many coefficient bytes. Plain keys are dequantized head by head
  (per channel over token groups, per token over channel groups, or 16-bit);
- RoPE for keys held before it, on the halves (rotate_half): cos and sin read from the region's tables, or
  computed in the kernel from the model's own rotary (inv_freq, attention_scaling: any rope scaling the model
  applies, llama3 included, is in its inv_freq), at the slot's rope position, once per tile for every head;
- scores of the group's query rows (a block-diagonal query tile, or the rows of one head), online softmax in base 2;
- latents per token over channel groups (2/3/4/8/16 bits), p @ h in up to four channel chunks (_lat_chunks).

Two launches per such region by default (two_pass): the scores of every slot first (grid (splits, K, B), a
program per KV head: the rebuild and RoPE of one head, no latent accumulators), then the softmax and the latents over
those scores (grid (splits, G, B)); the scores make a round trip through memory (8 bytes per slot and query head),
which costs less than the fused program's register spills.

Codes are read element-wise from the packed planes of runtime/quant.py (element c of a row in byte c % nb at bit
(c // nb) * bits; 3 bits bit-sliced), so any width the cache writes is read in place; scales and zeros in 16 bits
(the cache dtype, or float16 times 2^-8 for bf16 tensors) or fp8 times the tensor's bias (a float, or a device
scalar). Lengths, positions and next_pos may be device tensors and the grid comes from capacities only: no host
sync, capturable in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tale_runtime.attention import latent_attention as reference
from tale_runtime.frag import FragRegion
from tale_runtime.key_basis import KeyBasis
from tale_runtime.quant import FP8, QTensor
from tale_runtime.regions import LayerView, Region, Rotary

from . import attention as _attn
from . import lowrank_latent as _ll
from . import lowrank_score as _ls
from ._common import (
    TL_DTYPE,
    group_rows,
    interpreting,
    plane,
    plane3,
    plane3_asm,
    plane_asm,
    pow2,
    program_ids,
    runnable,
    scalar,
    slot_ok,
    split_bounds,
    tile_slots,
)
from .attention import _inv_bias, _nth, _put, _softmax_init, _softmax_step, _store_stats

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    """acc + a @ b in float32; a and b enter the tensor cores in DOT (float32: full precision, not tf32)."""
    if DOT == tl.float32:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a.to(DOT), b.to(DOT), acc)
    return r


@triton.jit
def _round(x, RDT: tl.constexpr):
    """float32 x rounded to RDT (to nearest, ties to even) and back: bfloat16 by its bits (Triton's interpreter
    truncates in .to(bfloat16); this agrees with torch there and on the GPU)."""
    if RDT == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
        y = u.to(tl.float32, bitcast=True)
    elif RDT == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _approx(x, FN: tl.constexpr):
    """cos or sin of float32 x in [-pi, pi] on the SFU (PTX cos/sin.approx: a few instructions, not libdevice's ~90)."""
    if FN == "cos":
        y = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=f,f", [x], tl.float32, True, 1)
    else:
        y = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=f,f", [x], tl.float32, True, 1)
    return y


@triton.jit
def _q_halves(query, b, head, rmask, d, dm, HALF: tl.constexpr):
    """The query rows `head` [QGP] of batch row b (query: q, its batch and head strides, qk_scale): their RoPE halves
    [QGP, NH] in float32, times qk_scale (rows past rmask and channels past dm: 0)."""
    q_ptr, s_qb, s_qh, qk_scale = query
    qrow = q_ptr + b * s_qb + head[:, None] * s_qh
    qm = rmask[:, None] & dm[None, :]
    q_lo = tl.load(qrow + d[None, :], mask=qm, other=0.0).to(tl.float32) * qk_scale
    q_hi = tl.load(qrow + HALF + d[None, :], mask=qm, other=0.0).to(tl.float32) * qk_scale
    return q_lo, q_hi


@triton.jit
def _deq(
    d_ptr,
    base,
    t,
    s_t,
    ch,
    m2,
    s_ptr,
    z_ptr,
    sbase,
    s_srow,
    inv_s,
    inv_z,
    BITS: tl.constexpr,
    CT: tl.constexpr,
    TG: tl.constexpr,
    CG: tl.constexpr,
    t0=0,
    ROW1: tl.constexpr = False,
):
    """Elements ch [C] of slots t [BT] of a (quantized) row-major tensor, float32 [BT, C] (0 where m2 is False;
    ROW1: the zero point there, or NaN where an unused group's metadata holds it: masked later, never summed).

    Row of slot t at d_ptr + base + t * s_t (elements, or bytes when packed); CT elements per row. Packed codes
    (runtime/quant.py): element c in byte c % nb at bit (c // nb) * BITS; 3 bits: the low 2 bits so at 2 bits over
    the first CT / 4 bytes, the high bit at 1 bit over the next CT / 8. Scale and zero of (slot t, element c) at
    sbase + (t // TG) * s_srow + c // CG (keys per channel over token groups: TG = group, CG = 1; per token over
    channel groups: TG = 1, CG = group), times inv_s / inv_z (1 / fp8 bias, or 1 / the 16-bit shift). ROW1: every
    slot of the tile is in the token group of slot t0 (a tile starting at t0 within one group): one [1, C] row of
    scales and zeros instead of a [BT, C] gather."""
    rowp = d_ptr + base + t[:, None] * s_t
    if BITS == 16:
        x = tl.load(rowp + ch[None, :], mask=m2, other=0.0).to(tl.float32)
    else:
        if BITS == 8:
            code = tl.load(rowp + ch[None, :], mask=m2, other=0).to(tl.int32)
        elif BITS == 3:
            NB2: tl.constexpr = CT // 4
            NB1: tl.constexpr = CT // 8
            lo = tl.load(rowp + (ch % NB2)[None, :], mask=m2, other=0).to(tl.int32)
            hi = tl.load(rowp + (NB2 + ch % NB1)[None, :], mask=m2, other=0).to(tl.int32)
            code = ((lo >> ((ch // NB2) * 2)[None, :]) & 3) | (((hi >> (ch // NB1)[None, :]) & 1) << 2)
        else:
            NB: tl.constexpr = CT * BITS // 8
            byt = tl.load(rowp + (ch % NB)[None, :], mask=m2, other=0).to(tl.int32)
            code = (byt >> ((ch // NB) * BITS)[None, :]) & ((1 << BITS) - 1)
        if ROW1:
            soff = sbase + (t0 // TG) * s_srow + (ch // CG)[None, :]
            rm = (ch < CT)[None, :]
            sc = tl.load(s_ptr + soff, mask=rm, other=0.0).to(tl.float32) * inv_s
            zr = tl.load(z_ptr + soff, mask=rm, other=0.0).to(tl.float32) * inv_z
        else:
            soff = sbase + (t // TG)[:, None] * s_srow + (ch // CG)[None, :]
            sc = tl.load(s_ptr + soff, mask=m2, other=0.0).to(tl.float32) * inv_s
            zr = tl.load(z_ptr + soff, mask=m2, other=0.0).to(tl.float32) * inv_z
        x = code.to(tl.float32) * sc + zr
    return x


@triton.jit
def _lat_chunk(
    acc,
    p,
    alpha,
    i: tl.constexpr,
    h_ptr,
    hbase,
    t,
    s_ht,
    ok,
    hs_ptr,
    hz_ptr,
    hsbase,
    s_hst,
    hinv_s,
    hinv_z,
    RANK: tl.constexpr,
    LC: tl.constexpr,
    HBITS: tl.constexpr,
    HG: tl.constexpr,
    DOT: tl.constexpr,
):
    """acc * alpha + p @ latent channels i*LC .. i*LC + LC - 1 of the tile (unused slots: zero)."""
    ch = i * LC + tl.arange(0, LC)
    m2 = ok[:, None] & (ch < RANK)[None, :]
    h = _deq(h_ptr, hbase, t, s_ht, ch, m2, hs_ptr, hz_ptr, hsbase, s_hst, hinv_s, hinv_z, HBITS, RANK, 1, HG)
    return _dot(p, h, acc * alpha[:, None], DOT)


@triton.jit
def _lat_plane(
    acc,
    pd,
    alpha,
    i: tl.constexpr,
    lo0,
    lo1,
    hi,
    hs_ptr,
    hz_ptr,
    srow,
    ok,
    inv_s,
    inv_z,
    BITS: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    VB: tl.constexpr,
    HG: tl.constexpr,
    BT: tl.constexpr,
    DOT: tl.constexpr,
    ASM: tl.constexpr,
):
    """acc * alpha + pd @ latent channels i P .. i P + P - 1 of the tile: plane i of 2/4-bit rows (bytes lo0), or
    sub-plane i of 3-bit ones (low-byte half lo0 / lo1, high bits hi), all [BT, PP] bytes loaded once per tile, so
    each code is a constant shift of a byte the thread holds. Scales and zeros per block of VB channels (VB divides
    P and the group HG, so a block lies in one group): [BT, PP / VB] loads broadcast over the block."""
    NBK: tl.constexpr = PP // VB
    kb = tl.arange(0, NBK)
    bm = ok[:, None] & (kb < P // VB)[None, :]
    soff = srow[:, None] + ((i * P + kb * VB) // HG)[None, :]
    sc = tl.load(hs_ptr + soff, mask=bm, other=0.0).to(tl.float32) * inv_s
    zr = tl.load(hz_ptr + soff, mask=bm, other=0.0).to(tl.float32) * inv_z
    if i % 2 == 0:
        lo = lo0
    else:
        lo = lo1
    if ASM:  # unpack and scale in PTX, 4 codes per register (kernels/_common.py)
        s3 = sc.to(DOT)[:, :, None]
        z3 = zr.to(DOT)[:, :, None]
        if BITS == 3:
            x3 = plane3_asm(tl.reshape(lo, (BT, NBK, VB)), tl.reshape(hi, (BT, NBK, VB)), s3, z3, i, DOT)
        else:
            x3 = plane_asm(tl.reshape(lo0, (BT, NBK, VB)), s3, z3, i, BITS, DOT)
        x = tl.reshape(x3, (BT, PP))
    else:
        if BITS == 3:
            c = plane3(lo, hi, i, tl.float32)
        else:
            c = plane(lo0, i, BITS, tl.float32)
        x = tl.reshape(tl.reshape(c, (BT, NBK, VB)) * sc[:, :, None] + zr[:, :, None], (BT, PP))
    return _dot(pd, x, acc * alpha[:, None], DOT)


@triton.jit
def _meta_inv(qa, QC: tl.constexpr):
    """The factors (inv_s, inv_z) of a tensor's scales and zeros (_deq) from its _qargs arguments qa (bias arg, 1 /
    shift) and constexprs QC: 1 / the fp8 bias where they are fp8, else 1 / the 16-bit shift."""
    bias = qa[9]
    inv_s = qa[10]
    inv_z = qa[10]
    if QC[3]:
        inv_s = _inv_bias(bias, QC[5])
    if QC[4]:
        inv_z = _inv_bias(bias, QC[5])
    return inv_s, inv_z


@triton.jit
def _q_block_diag(
    query, b, head, rmask, jrow, NH: tl.constexpr, HALF: tl.constexpr, WB: tl.constexpr, DOT: tl.constexpr
):
    """The group's query rows `head` [QGP] of batch row b side by side, a block-diagonal tile [QGP, WB NH] in DOT per
    RoPE half, times qk_scale: row r holds its head's channel d at column jrow[r] NH + d (d < n/2; elsewhere 0)."""
    q_ptr, s_qb, s_qh, qk_scale = query
    cols = tl.arange(0, WB * NH)
    cd = cols % NH
    qrow = q_ptr + b * s_qb + head[:, None] * s_qh
    sel = rmask[:, None] & ((cols // NH)[None, :] == jrow[:, None]) & (cd < HALF)[None, :]
    q_lo = (tl.load(qrow + cd[None, :], mask=sel, other=0.0).to(tl.float32) * qk_scale).to(DOT)
    q_hi = (tl.load(qrow + HALF + cd[None, :], mask=sel, other=0.0).to(tl.float32) * qk_scale).to(DOT)
    return q_lo, q_hi


@triton.jit
def _rope_tables(rope, b, t, ok, d, dm, HALF: tl.constexpr):
    """cos and sin of slots t [BT] read from the region's tables [B, cap, N] per RoPE half: cos_lo, cos_hi, sin_lo,
    sin_hi [BT, NH] float32 (slots that hold no token and channels past n/2: 0)."""
    cos_ptr, sin_ptr, s_cb, s_ct, _, _ = rope
    cm = ok[:, None] & dm[None, :]
    crow = b * s_cb + t[:, None] * s_ct + d[None, :]
    cos_lo = tl.load(cos_ptr + crow, mask=cm, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + crow + HALF, mask=cm, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + crow, mask=cm, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + crow + HALF, mask=cm, other=0.0).to(tl.float32)
    return cos_lo, cos_hi, sin_lo, sin_hi


@triton.jit
def _cos_sin(ang, rope_scale, RDT: tl.constexpr, PRECISE: tl.constexpr, RSC: tl.constexpr):
    """cos and sin of float32 angles `ang` (any range) times rope_scale, rounded to RDT as the model's tables are.
    PRECISE 2: the SFU's; 1: libdevice's cosf/sinf (the GPU); 0: numpy's (the interpreter)."""
    if PRECISE == 2:  # reduced to [-pi, pi] in float32 (Cody-Waite: 2 pi = C1 + C2, <= 2e-7 off), then the SFU's
        # approximations (abs error <= 2^-20.9 there: below the bf16 tables' rounding)
        kq = tl.floor(ang * 0.15915494309189535 + 0.5)
        ang = tl.fma(-kq, 6.2831854820251465, ang)
        ang = tl.fma(-kq, -1.7484556000744487e-07, ang)
        cos_a = _approx(ang, "cos")
        sin_a = _approx(ang, "sin")
        if RSC:
            cos_a = cos_a * rope_scale
            sin_a = sin_a * rope_scale
        # rounded as the model's tables by the hardware's conversion (the interpreter, which truncates, never takes
        # this branch)
        cos_a = cos_a.to(RDT).to(tl.float32)
        sin_a = sin_a.to(RDT).to(tl.float32)
    else:  # reduced in float64 (exact to ~1e-11; then rounded to float32: <= 2e-7 off), so cosf/sinf take their fast
        # path at any position
        a64 = ang.to(tl.float64)
        ang = (a64 - tl.floor(a64 * 0.15915494309189535 + 0.5) * 6.283185307179586).to(tl.float32)
        if PRECISE:
            cos_a = _round(libdevice.cos(ang) * rope_scale, RDT)
            sin_a = _round(libdevice.sin(ang) * rope_scale, RDT)
        else:
            cos_a = _round(tl.cos(ang) * rope_scale, RDT)
            sin_a = _round(tl.sin(ang) * rope_scale, RDT)
    return cos_a, sin_a


@triton.jit
def _lr_keys(
    keys, kinv, basis, KNH, b, h0, t0, t, tm, ok,
    NH: tl.constexpr, WB: tl.constexpr, BT: tl.constexpr, HPB: tl.constexpr, KC: tl.constexpr, KRC: tl.constexpr,
    KQ: tl.constexpr, KROW1: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """The keys before RoPE of KV heads h0 .. h0 + WB - 1 (of one basis block) at slots t [BT], rebuilt on tensor
    cores from their KC coefficients, KRC at a time: k_pre = mean + c dec[:KC], k_lo and k_hi [BT, WB NH] float32 per
    RoPE half (channel d of head w at column w NH + d). basis: (dec lo, dec hi [blocks, KC, K NH / blocks], their
    block and row strides, the rows buffer of _basis_on (K NH a row): mean lo, mean hi, column scale lo, hi)."""
    k_ptr, s_kb, s_kh, s_kt, ks_ptr, kz_ptr, s_ksb, s_ksh, s_kst, _, _ = keys
    dec_ptr, dhi_ptr, s_dblk, s_dec, mean_ptr = basis
    kinv_s, kinv_z = kinv
    KBITS: tl.constexpr = KQ[0]
    KTG: tl.constexpr = KQ[1]
    KCG: tl.constexpr = KQ[2]
    # coefficients grouped per tile (KROW1) at 2/4/8 bits (whole codes per byte) are read by planes: each packed row
    # once, its code planes in turn
    KPLANE: tl.constexpr = KROW1 and KCG == 1 and (KBITS == 2 or KBITS == 4 or KBITS == 8)
    PNB: tl.constexpr = KC * KBITS // 8  # bytes per packed row (KPLANE)
    WN: tl.constexpr = WB * NH
    cols = tl.arange(0, WN)
    blk = h0 // HPB  # the heads' basis block, and their first column in it
    cb = (h0 % HPB) * NH
    kb = b * s_kb + blk * s_kh
    ksb = b * s_ksb + blk * s_ksh
    k_lo = tl.zeros([BT, WN], tl.float32)
    k_hi = tl.zeros([BT, WN], tl.float32)
    if KPLANE:  # packed rows read KRC contiguous bytes at a time, each chunk's code planes in turn
        pksb = ksb + (t0 // KTG) * s_kst  # the tile's token group: one row
        for p0 in range(0, PNB, KRC):
            pj = p0 + tl.arange(0, KRC)
            pjm = pj < PNB
            # masked by the tile's range, not by the positions: the loads need not wait for them (the scores of
            # slots that hold no token are masked later)
            pbyt = tl.load(k_ptr + kb + t[:, None] * s_kt + pj[None, :], mask=tm[:, None] & pjm[None, :], other=0)
            pbyt = pbyt.to(tl.int32)
            for i in tl.static_range(8 // KBITS):
                pch = i * PNB + pj  # plane i: coefficient i PNB + j sits in byte j at bit i KBITS
                pcode = (pbyt >> (i * KBITS)) & ((1 << KBITS) - 1)
                psc = tl.load(ks_ptr + pksb + pch, mask=pjm, other=0.0).to(tl.float32) * kinv_s
                pzr = tl.load(kz_ptr + pksb + pch, mask=pjm, other=0.0).to(tl.float32) * kinv_z
                pcoef = (pcode.to(tl.float32) * psc[None, :] + pzr[None, :]).to(DOT)
                prow = blk * s_dblk + pch[:, None] * s_dec + cb + cols[None, :]
                k_lo = _dot(pcoef, tl.load(dec_ptr + prow, mask=pjm[:, None], other=0.0), k_lo, DOT)
                k_hi = _dot(pcoef, tl.load(dhi_ptr + prow, mask=pjm[:, None], other=0.0), k_hi, DOT)
    for c0 in range(0, 0 if KPLANE else KC, KRC):
        ch = c0 + tl.arange(0, KRC)
        chm = ch < KC
        cm2 = ok[:, None] & chm[None, :]
        coef = _deq(
            k_ptr, kb, t, s_kt, ch, cm2, ks_ptr, kz_ptr, ksb, s_kst, kinv_s, kinv_z, KBITS, KC, KTG, KCG, t0, KROW1
        ).to(DOT)
        drow = blk * s_dblk + ch[:, None] * s_dec + cb + cols[None, :]
        k_lo = _dot(coef, tl.load(dec_ptr + drow, mask=chm[:, None], other=0.0), k_lo, DOT)
        k_hi = _dot(coef, tl.load(dhi_ptr + drow, mask=chm[:, None], other=0.0), k_hi, DOT)
    gc = h0 * NH + cols
    k_lo = k_lo * tl.load(mean_ptr + 2 * KNH + gc)[None, :] + tl.load(mean_ptr + gc)[None, :]
    k_hi = k_hi * tl.load(mean_ptr + 3 * KNH + gc)[None, :] + tl.load(mean_ptr + KNH + gc)[None, :]
    return k_lo, k_hi


@triton.jit
def _plain_keys(keys, kinv, b, h0, t0, t, ok, d, dm, N: tl.constexpr, KQ: tl.constexpr, KROW1: tl.constexpr):
    """The keys of KV head h0 at slots t [BT], dequantized per RoPE half: k_lo, k_hi [BT, NH] float32 (slots that hold
    no token and channels past n/2: 0)."""
    k_ptr, s_kb, s_kh, s_kt, ks_ptr, kz_ptr, s_ksb, s_ksh, s_kst, _, _ = keys
    kinv_s, kinv_z = kinv
    KBITS: tl.constexpr = KQ[0]
    KTG: tl.constexpr = KQ[1]
    KCG: tl.constexpr = KQ[2]
    HALF: tl.constexpr = N // 2
    km = ok[:, None] & dm[None, :]
    kb = b * s_kb + h0 * s_kh
    ksb = b * s_ksb + h0 * s_ksh
    k_lo = _deq(k_ptr, kb, t, s_kt, d, km, ks_ptr, kz_ptr, ksb, s_kst, kinv_s, kinv_z, KBITS, N, KTG, KCG, t0, KROW1)
    k_hi = _deq(
        k_ptr, kb, t, s_kt, HALF + d, km, ks_ptr, kz_ptr, ksb, s_kst, kinv_s, kinv_z, KBITS, N, KTG, KCG, t0, KROW1
    )
    return k_lo, k_hi


@triton.jit
def _rotate(k_lo, k_hi, cos_lo, cos_hi, sin_lo, sin_hi, WB: tl.constexpr, NH: tl.constexpr, BT: tl.constexpr):
    """RoPE of keys k_lo, k_hi [BT, WB NH] (WB heads side by side), x cos + rotate_half(x) sin with rotate_half(x) =
    (-x_hi, x_lo); cos and sin [BT, NH] per half, the same for every head."""
    if WB == 1:
        r_lo = k_lo * cos_lo - k_hi * sin_lo
        r_hi = k_hi * cos_hi + k_lo * sin_hi
    else:
        lo3 = tl.reshape(k_lo, (BT, WB, NH))
        hi3 = tl.reshape(k_hi, (BT, WB, NH))
        r_lo = tl.reshape(lo3 * cos_lo[:, None, :] - hi3 * sin_lo[:, None, :], (BT, WB * NH))
        r_hi = tl.reshape(hi3 * cos_hi[:, None, :] + lo3 * sin_hi[:, None, :], (BT, WB * NH))
    return r_lo, r_hi


@triton.jit
def _add_scores(logits, q_lo, q_hi, k_lo, k_hi, jrow, j: tl.constexpr, WB: tl.constexpr, DOT: tl.constexpr):
    """logits [QGP, BT] plus the query rows' dots with keys k_lo, k_hi [BT, WB NH]: WB = 1, the rows of the dot's
    head j (jrow: the head of each row) from the query halves [QGP, NH]; else the block-diagonal tile
    (_q_block_diag)."""
    if WB == 1:
        sel_j = (jrow == j)[:, None]
        logits = _dot(tl.where(sel_j, q_lo, 0.0), tl.trans(k_lo), logits, DOT)
        logits = _dot(tl.where(sel_j, q_hi, 0.0), tl.trans(k_hi), logits, DOT)
    else:
        logits = _dot(q_lo, tl.trans(k_lo), logits, DOT)
        logits = _dot(q_hi, tl.trans(k_hi), logits, DOT)
    return logits


@triton.jit
def _lat_tile(
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, p, alpha, lats, hinv, hbase, hsbase, t, tm, ok,
    RANK: tl.constexpr, LC: tl.constexpr, NLC: tl.constexpr, HQ: tl.constexpr, HPL: tl.constexpr, HP: tl.constexpr,
    HVB: tl.constexpr, HASM: tl.constexpr, BT: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """The accumulators [QGP, LC] times alpha [QGP] plus the tile's weights p [QGP, BT] times its latents (rows at
    hbase, metadata rows at hsbase): accumulator i takes plane i (HPL > 0: LC the padded plane width, NLC = HPL planes;
    the tile's bytes read once), else chunk i."""
    h_ptr, _, _, s_ht, hs_ptr, hz_ptr, _, _, s_hst, _, _ = lats
    hinv_s, hinv_z = hinv
    HBITS: tl.constexpr = HQ[0]
    HG: tl.constexpr = HQ[2]
    if HPL > 0:
        jp = tl.arange(0, LC)
        bmask = tm[:, None] & (jp < HP)[None, :]
        hrow = h_ptr + hbase + t[:, None] * s_ht + jp[None, :]
        lo0 = tl.load(hrow, mask=bmask, other=0)
        if HBITS == 3:  # low-byte halves of HP bytes each, then the high bits
            lo1 = tl.load(hrow + HP, mask=bmask, other=0)
            hi = tl.load(hrow + 2 * HP, mask=bmask, other=0)
        else:
            lo1 = lo0
            hi = lo0
        srow = hsbase + t * s_hst
        pd = p.to(DOT)
    for i in tl.static_range(NLC):
        a = _nth(i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)
        if HPL > 0:
            a = _lat_plane(
                a, pd, alpha, i, lo0, lo1, hi, hs_ptr, hz_ptr, srow, ok, hinv_s, hinv_z, HBITS, HP, LC, HVB, HG, BT,
                DOT, HASM,
            )  # fmt: skip
        else:
            a = _lat_chunk(
                a, p, alpha, i, h_ptr, hbase, t, s_ht, ok, hs_ptr, hz_ptr, hsbase, s_hst, hinv_s, hinv_z, RANK, LC,
                HBITS, HG, DOT,
            )  # fmt: skip
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _put(i, a, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _store_lr_partial(
    parts, slot, prow, rmask, m, l, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
    RANK: tl.constexpr, LC: tl.constexpr, NLC: tl.constexpr, HPL: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    """One split's partial in kernels/attention.py's layout (parts: _attn._partial_args) at its heads' rows `prow`:
    max m and sum l [QGP], and the accumulators [QGP, LC], accumulator i holding channels i CW + j, j < CW (planes:
    HP of LC; chunks: all LC). Channels past RANK are never written."""
    pm_ptr, pl_ptr, pacc_ptr, s_acc, rk_ptr = parts
    _store_stats(pm_ptr, pl_ptr, rk_ptr, slot, prow, rmask, m, l, RANK)
    jl = tl.arange(0, LC)
    CW: tl.constexpr = HP if HPL > 0 else LC
    jm = rmask[:, None] & (jl < CW)[None, :]
    base = pacc_ptr + prow[:, None] * s_acc + jl[None, :]
    for i in tl.static_range(NLC):
        a = _nth(i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)
        tl.store(base + i * CW, a, mask=jm & (i * CW + jl < RANK)[None, :])


@triton.jit
def _lr_kernel(
    query,  # (q, its batch and head strides, qk_scale)
    pos_ptr,
    s_pb,
    len_arg,
    np_arg,
    window,
    roff_ptr,
    keys,  # the keys (_qargs): codes, their strides (row, block or head, slot), scale, zero, theirs, bias, 1 / shift
    basis,  # (dec lo, dec hi, their block and row strides, rows): _lr_keys
    rope,  # (cos, sin, their batch and slot strides, inv_freq, rope_scale)
    lats,  # the latents, as keys (strides per row, latent group, slot)
    parts,  # the partials (_attn._partial_args: pm, pl, pacc, its row stride, rk)
    sc_buf,  # the scores [B, H, cap] float32 of the score launch, its batch and head strides
    slot0,
    n_slots,
    H,
    ns,
    N: tl.constexpr,
    NH: tl.constexpr,
    GS: tl.constexpr,
    REP: tl.constexpr,
    QGP: tl.constexpr,
    BT: tl.constexpr,
    LOWRANK: tl.constexpr,
    HPB: tl.constexpr,
    WB: tl.constexpr,
    KC: tl.constexpr,
    KRC: tl.constexpr,
    KQ: tl.constexpr,  # the keys' (BITS, TG, CG, SF8, ZF8, BP) (_qargs)
    ROPE: tl.constexpr,
    RDT: tl.constexpr,
    PRECISE: tl.constexpr,  # RoPE computed here (ROPE 2): 0 numpy's (interpreter), 1 libdevice, 2 the SFU
    RSC: tl.constexpr,  # rope_scale != 1
    RANK: tl.constexpr,
    LC: tl.constexpr,
    NLC: tl.constexpr,
    HQ: tl.constexpr,  # the latents', as KQ
    HPL: tl.constexpr,
    HP: tl.constexpr,
    HVB: tl.constexpr,
    HASM: tl.constexpr,
    LENP: tl.constexpr,
    NPP: tl.constexpr,
    WIN: tl.constexpr,
    DOT: tl.constexpr,
    PHASE: tl.constexpr = 0,
    KALL: tl.constexpr = False,
):
    """Program (split sp, latent group c, batch row b) of one region: its partial (m, l, acc[:RANK]) per query head
    of the group. LOWRANK: keys are [B, Hc, cap, KC] coefficients on a basis of Hc blocks of HPB = K / Hc KV heads
    each (Hc = 1: joint, HPB = K; Hc = K: per head, HPB = 1); else [B, K, cap, N] keys (KC = N). The group's GS KV
    heads are rebuilt (or dequantized) and scored WB at a time (WB = GS: one [BT, KRC] x [KRC, GS NH] dot per
    RoPE half and chunk, the coefficients dequantized once per tile; WB = 1: head by head, plain keys always).
    ROPE 0: keys after RoPE; 1: before, rotated by the tables cos/sin [B, cap, N]; 2: before, rotated by
    cos/sin(rope position * inv_freq) * rope_scale computed here (rope position = slot position - roff[b]),
    rounded to RDT as the model's tables are."""
    sp, c, b = program_ids()
    L = scalar(len_arg, LENP)
    next_pos = scalar(np_arg, NPP)
    t_start, t_end = split_bounds(L, ns, sp, BT)

    QG: tl.constexpr = GS * REP
    HALF: tl.constexpr = N // 2
    rows, head, rmask = group_rows(c, QG, QGP)
    jrow = rows // REP  # the KV head (within the group) each query row reads
    d = tl.arange(0, NH)
    dm = d < HALF
    if WB == 1:  # head by head: the rows of head j picked per dot from the query halves
        q_lo, q_hi = _q_halves(query, b, head, rmask, d, dm, HALF)
    else:  # the group's heads side by side (WB = GS): a block-diagonal query tile [QGP, GS NH] per half
        q_lo, q_hi = _q_block_diag(query, b, head, rmask, jrow, NH, HALF, WB, DOT)

    kinv = _meta_inv(keys, KQ)
    hinv = _meta_inv(lats, HQ)
    if ROPE == 2:
        _, _, _, _, invf_ptr, rope_scale = rope
        invf = tl.load(invf_ptr + d, mask=dm, other=0.0).to(tl.float32)
        roff = tl.load(roff_ptr + b).to(tl.int32)
    KNH = (H // QG) * GS * NH  # K NH: the length of a row of the basis' rows buffer (_basis_on)
    # keys per channel over token groups that each hold whole tiles (tiles start at multiples of BT): one row of
    # scales and zeros per tile
    KROW1: tl.constexpr = KQ[1] % BT == 0
    sc_ptr, s_scb, s_sch = sc_buf

    m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _softmax_init(QGP, LC, 8)
    _, s_hb, s_hg, _, _, _, s_hsb, s_hsg, _, _, _ = lats
    hbase = b * s_hb + c * s_hg  # the group's latent rows, and their scales' and zeros'
    hsbase = b * s_hsb + c * s_hsg
    for t0 in range(t_start, t_end, BT):
        t, tm = tile_slots(t0, t_end, BT)
        pv, ok = slot_ok(pos_ptr + b * s_pb, t, tm, next_pos, window, WIN)
        if PHASE == 2:  # the tile's scores, written by the score launch (-inf where no token is)
            scm = rmask[:, None] & tm[None, :]
            logits = tl.load(sc_ptr + b * s_scb + head[:, None] * s_sch + t[None, :], mask=scm, other=0.0)
        else:
            if ROPE == 1:
                cos_lo, cos_hi, sin_lo, sin_hi = _rope_tables(rope, b, t, ok, d, dm, HALF)
            elif ROPE == 2:  # the halves share cos and sin
                ang = (pv - roff).to(tl.float32)[:, None] * invf[None, :]  # one rounding, as the model's product
                cos_lo, sin_lo = _cos_sin(ang, rope_scale, RDT, PRECISE, RSC)
                cos_hi = cos_lo
                sin_hi = sin_lo
            logits = tl.zeros([QGP, BT], tl.float32)
            # KALL (the score launch): this program scores every KV head of its slots, RoPE's cos/sin made once
            for cc in range(H // QG if KALL else 1):
                cg = c + cc  # c is 0 where KALL
                logits = tl.zeros([QGP, BT], tl.float32)
                if KALL:
                    head = cg * QG + rows
                    q_lo, q_hi = _q_halves(query, b, head, rmask, d, dm, HALF)
                for j in tl.static_range(GS // WB):
                    h0 = cg * GS + j * WB  # the first KV head of this dot
                    if LOWRANK:  # [BT, WB NH] per RoPE half
                        k_lo, k_hi = _lr_keys(
                            keys, kinv, basis, KNH, b, h0, t0, t, tm, ok, NH, WB, BT, HPB, KC, KRC, KQ, KROW1, DOT
                        )
                    else:  # plain keys of head h0 (WB = 1)
                        k_lo, k_hi = _plain_keys(keys, kinv, b, h0, t0, t, ok, d, dm, N, KQ, KROW1)
                    if ROPE != 0:
                        k_lo, k_hi = _rotate(k_lo, k_hi, cos_lo, cos_hi, sin_lo, sin_hi, WB, NH, BT)
                    logits = _add_scores(logits, q_lo, q_hi, k_lo, k_hi, jrow, j, WB, DOT)
                if PHASE == 1:  # the score launch: the tile's scores, for the latent launch
                    scm = rmask[:, None] & tm[None, :]
                    sco = tl.where(ok[None, :], logits, float("-inf"))
                    tl.store(sc_ptr + b * s_scb + head[:, None] * s_sch + t[None, :], sco, mask=scm)
        logits = tl.where(ok[None, :], logits, float("-inf"))
        if PHASE != 1:  # -- online softmax (base 2), then the latents
            p, alpha, m_i, l_i = _softmax_step(logits, m_i, l_i)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _lat_tile(
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, p, alpha, lats, hinv, hbase, hsbase, t, tm, ok, RANK,
                LC, NLC, HQ, HPL, HP, HVB, HASM, BT, DOT,
            )  # fmt: skip

    if PHASE != 1:  # -- this split's partial
        slot = slot0 + sp
        prow = (b * H + head) * n_slots + slot
        _store_lr_partial(
            parts, slot, prow, rmask, m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, RANK, LC, NLC, HPL, HP
        )


# -- host side -------------------------------------------------------------------------------

_BITS_K = (2, 3, 4, 8, 16)
_BITS_H = (2, 3, 4, 8, 16)


def _rotary(rope):
    """(inv_freq [n/2] float32 tensor, attention_scaling float) of `rope`: the model's rotary embedding module
    (anything with .inv_freq and .attention_scaling) or such a pair; None: read the regions' tables."""
    if rope is None:
        return None
    if isinstance(rope, tuple):
        inv, sc = rope
    else:
        inv, sc = rope.inv_freq, getattr(rope, "attention_scaling", 1.0)
    return inv, float(sc)


def _qt_reason(t, C: int, lead: tuple, cap: int, dtype: torch.dtype, what: str) -> str | None:
    """Why the kernel cannot read QTensor t (logical [*lead, cap, C]), or None."""
    if type(t) is not QTensor:
        return f"{what} are {type(t).__name__}, not a QTensor (key bands are not read here)"
    if tuple(t.shape) != (*lead, cap, C):
        return f"{what} of shape {tuple(t.shape)}, expected {(*lead, cap, C)}"
    if t.bits == 16:
        return None if t.data.dtype == dtype else f"16-bit {what} in {t.data.dtype}, not {dtype}"
    if t.bits not in _BITS_K or t.data.dtype != torch.uint8:
        return f"{what} at {t.bits} bits"
    if t.bits == 3 and C % 8:
        return f"3-bit {what} of {C} channels (not a multiple of 8)"
    if t.meta not in ("16", "8/16", "8/8") or t.scale is None or t.zero is None:
        return f"{what}: scale/zero format {t.meta!r}"
    if t.meta != "16" and not (isinstance(t.bias, float) or (isinstance(t.bias, torch.Tensor) and t.bias.numel() == 1)):
        return f"{what}: fp8 bias of type {type(t.bias).__name__}"
    dim = t.dim % 4
    if dim == 2:  # per channel over token groups
        if cap % t.group or tuple(t.scale.shape) != (*lead, cap // t.group, C):
            return f"{what}: scales of shape {tuple(t.scale.shape)}"
    elif dim == 3:  # per token over channel groups
        if C % t.group or tuple(t.scale.shape) != (*lead, cap, C // t.group):
            return f"{what}: scales of shape {tuple(t.scale.shape)}"
    else:
        return f"{what} quantized along dim {t.dim}"
    return None


def supported(q: torch.Tensor, k_new: torch.Tensor, h_new: torch.Tensor, view, rope=None) -> str | None:
    """None when latent_attention_lowrank serves this call in the kernel, else a one-line reason (a decode step is
    then refused with it; several new tokens run the torch reference). Serves one new token over regions whose keys are after RoPE, before it (region.rope:
    rotated by the tables, or by `rope` computed in the kernel), or low-rank before it (region.basis), at 2/3/4/8/16
    bits quantized per channel over token groups or per token over channel groups; latents at 2/3/4/8/16 bits per
    token over channel groups; scales/zeros in 16 bits or fp8 ("8/16", "8/8")."""
    B, H, T, n = q.shape
    if T != 1:
        return f"{T} new tokens (the kernel decodes one)"
    if q.dtype not in TL_DTYPE or k_new.dtype != q.dtype or h_new.dtype != q.dtype:
        return f"dtype {q.dtype}"
    if not runnable(q, k_new, h_new):
        return "CPU tensors without TRITON_INTERPRET=1"
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    if H % K or K % G or n % 2 or n < 16 or n & (n - 1):
        return f"heads {H}/{K}/{G} and head dim {n}"
    view = view if isinstance(view, LayerView) else view.view()
    npos = view.next_pos
    if isinstance(npos, torch.Tensor) and (npos.numel() != 1 or npos.dtype not in (torch.int32, torch.int64)):
        return "next_pos is not a one-element integer tensor"
    rot = _rotary(rope)
    if rot is not None and (rot[0].numel() * 2 != n or not runnable(rot[0].to(q.device))):
        return f"the rotary's inv_freq has {rot[0].numel()} entries (partial rotary?), head dim {n}"
    for r in view.regions:
        if isinstance(r, FragRegion):
            return "a region in the CUDA kernel's fragment layout"
        cap = r.capacity
        if cap == 0:
            continue
        if r.pos.dtype != torch.int32 or tuple(r.pos.shape) != (B, cap) or r.pos.stride(-1) != 1:
            return "region positions are not int32 [B, cap]"
        ln = r.length
        if isinstance(ln, torch.Tensor) and (ln.numel() != 1 or ln.dtype not in (torch.int32, torch.int64)):
            return "region length is not a one-element integer tensor"
        if r.basis is not None:
            bs = r.basis
            if not isinstance(bs, KeyBasis) or r.rope is None and rot is None:
                return "low-rank keys without RoPE tables or a rotary"
            kr, Kb = r.keys.shape[-1], bs.blocks
            if Kb < 1 or K % Kb:
                return f"a key basis of {Kb} blocks for {K} KV heads (blocks of whole heads)"
            if (
                tuple(bs.dec.shape[::2]) != (Kb, K * n // Kb)
                or bs.dec.shape[1] < kr
                or tuple(bs.mean.shape) != (K * n,)
            ):
                return f"key basis of shape {tuple(bs.dec.shape)} for {K} x {n} keys at rank {kr}"
            if why := _qt_reason(r.keys, kr, (B, Kb), cap, q.dtype, "low-rank keys"):
                return why
        elif why := _qt_reason(r.keys, n, (B, K), cap, q.dtype, "keys"):
            return why
        if isinstance(r.rope, Rotary) and rot is None:
            if r.rope.inv_freq.numel() * 2 != n or r.rope.dtype != q.dtype or tuple(r.rope.offset.shape) != (B,):
                return f"a Rotary of {r.rope.inv_freq.numel()} frequencies in {r.rope.dtype} (head dim {n}, {q.dtype})"
        elif r.rope is not None and rot is None:
            cos, sin = r.rope
            if tuple(cos.shape) != (B, cap, n) or tuple(sin.shape) != (B, cap, n) or cos.stride() != sin.stride():
                return "RoPE tables are not [B, cap, n]"
        if r.rank > R or r.rank < 1:
            return f"latent rank {r.rank} of {R}"
        if why := _qt_reason(r.lat, r.rank, (B, G), cap, q.dtype, "latents"):
            return why
        if r.lat.bits != 16 and r.lat.dim % 4 != 3:
            return "latents quantized over tokens"
    return None


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _qargs(t: QTensor, C: int) -> tuple[tuple, tuple]:
    """The kernel's arguments of a region QTensor [X, Y, cap, C]: (data, its strides [3], scale, zero, scale strides
    [3], bias arg, 1/shift) and its constexprs (BITS, TG, CG, SF8, ZF8, BP)."""
    data = _c(t.data)
    if t.bits == 16:
        return (data, *data.stride()[:3], data, data, 0, 0, 0, 1.0, 1.0), (16, 1, 1, False, False, False)
    sc, zr = _c(t.scale), _c(t.zero)
    per_tok = t.dim % 4 == 3
    tg, cg = (1, t.group) if per_tok else (t.group, 1)
    bp = isinstance(t.bias, torch.Tensor)
    bias = t.bias if bp else float(t.bias)
    s8, z8 = sc.dtype == FP8, zr.dtype == FP8
    return (data, *data.stride()[:3], sc, zr, *sc.stride()[:3], bias, 1.0 / t.shift), (t.bits, tg, cg, s8, z8, bp)


def _splits(regions: list[Region], B: int, G: int, sms: int, waves: float, min_split: int):
    """Splits per region from capacities only (graph-safe): about `waves` programs per SM shared by the regions in
    proportion to their slots, >= min_split slots each. A tile costs about the same whatever its region holds (on an
    H100 the kernel is bound by each tile's chain of dependent loads and layout conversions, not by the rebuild's
    multiply-adds), so equal slots per program end the regions, which run side by side, together."""
    total = max(1.0, waves * sms / (B * G))
    slots = max(1, sum(r.capacity for r in regions))
    return [max(1, min(triton.cdiv(r.capacity, min_split), round(total * r.capacity / slots))) for r in regions]


# side streams per device on which the regions' launches run concurrently (made once: a graph capture forks to them)
_STREAMS: dict = {}


def _side_streams(device, n: int) -> list:
    have = _STREAMS.setdefault(str(device), [])
    while len(have) < n:
        have.append(torch.cuda.Stream(device=device))
    return have[:n]


def _lat_chunks(rank: int) -> tuple[int, int]:
    """(chunks, channels per chunk: a power of two) that cover `rank` latent channels with the fewest padded ones
    (every padded channel is unpacked and multiplied like a real one), chunks of 64 to 128 (fewer where the rank is
    smaller, more where 4 do not cover it); ties: fewer chunks. 320: 3 x 128, not 4 x 128. (2/3/4-bit latents are read
    by planes instead: _lat_planes.)"""
    best, low = None, min(64, max(16, pow2(rank)))
    for nlc in (1, 2, 3, 4):
        lc = max(16, pow2(triton.cdiv(rank, nlc)))
        if low <= lc and (lc <= 128 or nlc == 4) and (best is None or nlc * lc < best[0] * best[1]):
            best = (nlc, lc)
    return best


def _lat_planes(lat: QTensor, rank: int) -> tuple[int, int, int]:
    """(planes, channels per plane, channels per scale block) where the kernel reads `lat` by planes (2/4-bit: the
    8 / bits planes of runtime/quant.py; 3-bit: its 8 sub-planes of rank / 8 channels), else (0, 0, 0): 8/16 bits,
    or planes wider than 256 channels (their accumulators would not fit). A scale block is the largest power of two
    dividing both the plane width and the latents' channel group, so each lies in one group."""
    if lat.bits not in (2, 3, 4):
        return 0, 0, 0
    npl = 8 if lat.bits == 3 else 8 // lat.bits
    width = rank // npl
    if rank % npl or width > 256:
        return 0, 0, 0
    common = math.gcd(width, lat.group)
    return npl, width, common & -common


def _pad_offset(view: LayerView, B: int, device) -> torch.Tensor:
    """Per row, its padding slots (pos -1 below the length): the rope position of a slot is its cache position
    minus them (transformers' generate: position_ids = cumsum(attention_mask) - 1). int32 [B], on the device."""
    off = torch.zeros(B, dtype=torch.int32, device=device)
    for r in view.regions:
        if r.capacity:
            used = torch.arange(r.capacity, device=device) < r.length
            off += ((r.pos < 0) & used).sum(-1, dtype=torch.int32)
    return off


def latent_attention_lowrank(
    q: torch.Tensor,
    k_new: torch.Tensor,
    h_new: torch.Tensor,
    view,
    scaling: float,
    window: int | None = None,
    *,
    rope=None,
    rope_offset: torch.Tensor | None = None,
    block_t: int = 64,
    coef_chunk: int | None = None,
    min_split: int = 64,
    waves: float = 4.0,
    split_tokens: int | None = None,
    fused_heads: bool = True,
    concurrent: bool = True,
    two_pass: bool = True,
    fast_rope: bool = True,
    score_tokens: int = 256,
    score_warps: int | None = None,
    score_block: int = 64,
    score_heads: bool | None = None,
    score_groups: bool | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
    score_cuda: bool | str | None = False,
) -> torch.Tensor:
    """Decode attention over a view with keys before RoPE / low-rank keys: z [B, T, H, R] float32, the backend
    signature of tale_runtime.attention.latent_attention. A decode step (T = 1) it does not serve (`supported`) is
    refused with a ValueError that names why; it never runs anything slower in the kernel's name. A call of several
    new tokens (a prefill chunk: the kernel decodes one) is the torch reference's by design.

    `rope`: None rotates each pre-RoPE region by its own rope: its (cos, sin) tables (exact for any positions, 8 n
    bytes per slot), or its Rotary (computed here from the slots' positions, like a given rotary);
    the model's rotary embedding (model.model.rotary_emb: .inv_freq, .attention_scaling) or a pair
    (inv_freq, attention_scaling) computes them in the kernel at each slot's rope position = cache position minus
    `rope_offset` [B] (default: the row's padding slots, transformers' convention for left-padded batches).
    `split_tokens` fixes the slots per split (tests); `coef_chunk` the coefficients per rebuild step (None: 32 for
    the score launch by groups, else 16). `fused_heads` rebuilds the low-rank keys of a latent group's KV heads on a
    joint or per-group basis in one [block_t, coef_chunk] x [coef_chunk, g n/2] dot per RoPE half and scores them in
    one block-diagonal dot (the coefficients dequantized once per tile); False: head by head (the coefficients
    dequantized once per head, small dots). A per-head basis is always rebuilt head by head (each head has its own
    coefficients). `concurrent`: the regions' launches run side by side on side streams (CUDA; False: one after the
    other on the current stream). `two_pass` (regions with keys before RoPE or low rank): a first launch writes every
    slot's scores [B, H, cap] float32 (`score_warps` warps, None: 8 by groups, else 4: the key work alone, no latent
    accumulators, so no register spills; tiles of `score_block` slots), a program per KV head and about
    `score_tokens` slots, or (`score_heads`) a program for every KV head of about score_tokens / K slots that
    computes RoPE's cos/sin once for all of them, or (`score_groups`, None: wherever a basis block holds several
    heads) a program per latent group that rebuilds its g KV heads in one dot per RoPE half (the coefficients
    dequantized once per tile for the g heads, not once per head); a second runs softmax and latents over them;
    False: both per tile in one program (255 registers and
    spills on an H100). `fast_rope`: RoPE computed in the kernel takes the SFU's cos/sin after a float32 reduction to
    [-pi, pi] (abs error about 5e-7, below the bf16 tables' rounding), not libdevice's (about 90 instructions each).
    `score_cuda` (two_pass, low-rank regions): the score pass in CUDA on tensor cores (kernels/lowrank_score.py),
    and the latent pass too where kernels/lowrank_latent.py reads the region (else the Triton latent launch);
    None: where it reads the region, else in Triton; True: required (ValueError where it cannot); "warn": where it
    can, else in Triton with a one-time warning naming why; False (the default): Triton."""
    if not isinstance(view, LayerView):
        view = view.view()
    if q.shape[2] != 1:  # a prefill chunk: not a decode step
        return reference(q, k_new, h_new, view, scaling, window)
    if why := supported(q, k_new, h_new, view, rope):
        raise ValueError(f"triton low-rank-key latent attention: {why}")
    B, H, _, n = q.shape
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    dev = q.device
    q, k_new, h_new = _c(q), _c(k_new), _c(h_new)
    regions = [r for r in view.regions if r.capacity]
    sms = _attn._num_sms(dev)
    if split_tokens:
        splits = [max(1, triton.cdiv(r.capacity, split_tokens)) for r in regions]
    else:
        splits = _splits(regions, B, G, sms, waves, min_split)
    n_slots, partials = _attn._partials(B, H, R, splits, dev)
    rot, roff = _rotary(rope), None
    if rot is not None:  # the caller's rotary rotates every region held before RoPE
        rot = (rot[0].to(device=dev, dtype=torch.float32).contiguous(), rot[1])
        roff = rope_offset if rope_offset is not None else _pad_offset(view, B, dev)
        roff = roff.to(device=dev, dtype=torch.int32).contiguous()
    c = _Call(
        q=q,
        qk=scaling * LOG2E,
        K=K,
        G=G,
        npos=view.next_pos,
        win=window,
        rot=rot,
        roff=roff,
        partials=partials,
        n_slots=n_slots,
        BT=max(32, block_t),  # 16-token tiles gave wrong results compiled (docs/kernels.md, Triton quirks)
        SBT=max(32, score_block),  # the score launch's tiles
        coef_chunk=coef_chunk,
        fused_heads=fused_heads,
        two_pass=two_pass,
        fast_rope=fast_rope,
        score_tokens=score_tokens,
        score_warps=score_warps,
        score_heads=score_heads,
        score_groups=score_groups,
        num_warps=num_warps,
        num_stages=num_stages,
        score_cuda=score_cuda,
    )
    slot0 = 0
    # the regions run side by side, each on a stream of its own (forked from and joined to the current one: a
    # CUDA graph captures them as parallel branches)
    cur = torch.cuda.current_stream(dev) if concurrent and dev.type == "cuda" and len(regions) > 1 else None
    streams = [cur, *_side_streams(dev, len(regions) - 1)] if cur is not None else [None] * len(regions)
    side = streams[1:] if cur is not None else []
    for st in side:
        st.wait_stream(cur)
    for r, ns, st in zip(regions, splits, streams):
        with torch.cuda.stream(st) if st is not None else contextlib.nullcontext():
            _launch_region(c, r, _region_plan(c, r, ns), slot0)
        slot0 += ns
    for st in side:
        cur.wait_stream(st)
    return _attn._combine(*partials, n_slots if regions else 0, q, k_new, h_new, c.qk, c.rep, c.g)


@dataclass(frozen=True)
class _Call:
    """What every region's launches of one latent_attention_lowrank call share: the query, the cache's shape, the
    partial results they write, the caller's rotary, and the call's launch options."""

    q: torch.Tensor
    qk: float  # scaling * log2(e)
    K: int
    G: int
    npos: int | torch.Tensor
    win: int | None
    rot: tuple | None  # (inv_freq, attention scaling) of the caller's rotary
    roff: torch.Tensor | None  # with rot: each row's rope offset
    partials: tuple  # (m, l, acc, rank): _attn._partials
    n_slots: int
    BT: int
    SBT: int
    coef_chunk: int | None
    fused_heads: bool
    two_pass: bool
    fast_rope: bool
    score_tokens: int
    score_warps: int | None
    score_heads: bool | None
    score_groups: bool | None
    num_warps: int
    num_stages: int
    score_cuda: bool | str | None

    @property
    def rep(self) -> int:  # query heads per KV head
        return self.q.shape[1] // self.K

    @property
    def g(self) -> int:  # KV heads per latent group
        return self.K // self.G


@dataclass
class _RegionPlan:
    """One region's launches: the kernel's arguments up to the score buffer (`args`) and its constexprs (`meta`) that
    every phase shares, the phases (phase, splits), and what the phases choose between."""

    args: list
    meta: dict
    phases: tuple
    lowrank: bool
    hpb: int  # KV heads per basis block
    wb: int  # KV heads per block-diagonal dot
    heads: bool  # the score launch: a program for every KV head
    grp: bool  # the score launch: a program per latent group
    swarps: int
    tabs: tuple | None  # the region's RoPE tables (cos, sin), where the kernel reads them
    sc: torch.Tensor | None  # the score buffer the score pass writes and the latent pass reads
    scores: tuple  # lowrank_score.scores' arguments after the query's: the region's keys, RoPE, basis, score buffer


def _region_plan(c: _Call, r: Region, ns: int) -> _RegionPlan:
    """The arguments of one region's launches (`ns` splits): its quantized keys and latents, its basis, its RoPE, the
    latents' plane layout and the score launch's programs."""
    q, K, g = c.q, c.K, c.g
    B, H, _, n = q.shape
    dev = q.device
    NH = max(16, n // 2)
    pm, pl, pacc, rk = c.partials
    lowrank = r.basis is not None
    KC = r.keys.shape[-1] if lowrank else n
    keys, KQ = _qargs(r.keys, KC)
    lats, HQ = _qargs(r.lat, r.rank)
    kd = keys[0]  # stands in for the pointers a region does not use
    if lowrank:
        dec, dhi, mean = _basis_on(r.basis, NH, dev, torch.float32 if q.dtype == torch.float32 else torch.float16)
        hpb = K // r.basis.blocks
        # a group's heads in one dot where one block holds them all (the query tile is block-diagonal over
        # the whole group); blocks smaller than a group: head by head
        wb = g if c.fused_heads and hpb % g == 0 else 1
    else:
        dec = dhi = mean = kd
        hpb, wb = 1, 1
    # RoPE: none (keys after it), the region's tables (1), or computed here (2) from a rotary: the caller's,
    # or the region's own (a cache that holds no tables)
    invf, rsc, ro = kd, 1.0, r.pos
    if r.rope is None:
        mode, cos, sin = 0, kd, kd
    elif c.rot is not None or isinstance(r.rope, Rotary):
        mode, cos, sin = 2, kd, kd
        (invf, rsc), ro = (c.rot, c.roff) if c.rot is not None else ((r.rope.inv_freq, r.rope.scaling), r.rope.offset)
    else:
        mode, cos, sin = 1, _c(r.rope[0]), _c(r.rope[1])
    cstr = cos.stride()[:2] if mode == 1 else (0, 0)
    HPL, HP, HVB = _lat_planes(r.lat, r.rank)
    NLC, LC = (HPL, max(16, pow2(HP))) if HPL else _lat_chunks(r.rank)
    ln = r.length
    # two launches (two_pass): the scores of every slot first, many programs each holding only the key
    # work; then softmax and latents over them. One launch: both per tile (today's fused program)
    two = c.two_pass and (lowrank or mode != 0)
    sc = torch.empty(B, H, r.capacity, device=dev, dtype=torch.float32) if two else pm  # pm: never read
    # the score launch's programs: about score_tokens slots of one KV head each, or (score_heads) of all K
    # (None: all K where a head's rebuild is small, i.e. over plain keys or a per-head basis: measured on an
    # H100)
    heads = c.score_heads if c.score_heads is not None else not (lowrank and hpb > 1)
    per = max(c.SBT, c.score_tokens // K) if heads else c.score_tokens
    # the score launch by latent groups (blocks of heads; None: wherever a block holds several heads), 8
    # warps over 32 coefficients at a time; else 4 warps over 16 (per head: 40 coefficients in 3 chunks, not
    # 2 of 32). Measured at 32K batch 1 on an H200: a basis per group of 4 heads 272 -> 201 us, joint
    # 350 -> 257 us; per head 186 us either way (docs/kernels.md)
    grp = (c.score_groups if c.score_groups is not None else hpb > 1) and not heads and wb > 1
    krc = c.coef_chunk or (32 if grp else 16)
    swarps = c.score_warps or (8 if grp else 4)
    phases = ((1, max(ns, triton.cdiv(r.capacity, per))), (2, ns)) if two else ((0, ns),)
    args = [
        (q, q.stride(0), q.stride(1), c.qk),
        r.pos,
        r.pos.stride(0),
        ln,
        c.npos,
        0 if c.win is None else int(c.win),
        ro,
        keys,
        (dec, dhi, dec.stride(0) if lowrank else 0, dec.stride(1) if lowrank else 0, mean),
        (cos, sin, *cstr, invf, rsc),
        lats,
        _attn._partial_args(pm, pl, pacc, rk),
        (sc, sc.stride(0), sc.stride(1)),
    ]
    meta = dict(
        N=n,
        NH=NH,
        REP=c.rep,
        LOWRANK=lowrank,
        HPB=hpb,
        KC=KC,
        KRC=max(16, krc),
        KQ=KQ,
        ROPE=mode,
        RDT=TL_DTYPE[q.dtype],
        PRECISE=0 if interpreting() else 2 if c.fast_rope else 1,
        RSC=rsc != 1.0,
        RANK=r.rank,
        LC=LC,
        NLC=NLC,
        HQ=HQ,
        HPL=HPL,
        HP=HP,
        HVB=HVB,
        HASM=bool(HPL) and HVB >= 4 and not interpreting() and q.dtype != torch.float32,
        LENP=isinstance(ln, torch.Tensor),
        NPP=isinstance(c.npos, torch.Tensor),
        WIN=c.win is not None,
        DOT=tl.float32 if q.dtype == torch.float32 else tl.float16,
        num_stages=c.num_stages,
    )
    tabs = (cos, sin) if mode == 1 else None
    scores = (r.keys, r.pos, ln, ro, invf, rsc, dec, dhi, mean, hpb, sc, tabs)
    return _RegionPlan(args, meta, phases, lowrank, hpb, wb, heads, grp, swarps, tabs, sc, scores)


def _launch_region(c: _Call, r: Region, p: _RegionPlan, slot0: int) -> None:
    """One region's launches: per phase the score pass in CUDA where asked and it reads the region, else the Triton
    kernel (its programs: per split, per KV head or latent group, per row). Its slots start at `slot0` of the
    partial results."""
    q, K, G = c.q, c.K, c.G
    B, H = q.shape[:2]
    QGP = max(16, pow2(c.g * c.rep))
    for phase, nsp in p.phases:
        if phase == 1 and p.lowrank and c.score_cuda is not False:
            # the score pass on tensor cores in CUDA (kernels/lowrank_score.py) where it reads the region
            why = _ls.reason(q, r.keys, c.rep, p.hpb, K, p.tabs)
            if why is None:
                _ls.scores(q, c.qk, *p.scores)
                continue
            if c.score_cuda == "warn":  # the cuda-lowrank backend: never silently slower (once per reason)
                warnings.warn(
                    f"the CUDA score pass cannot read a low-rank region ({why}); its scores run in Triton",
                    stacklevel=3,  # latent_attention_lowrank's caller
                )
            elif c.score_cuda:
                raise ValueError(f"the CUDA score pass cannot read this region: {why}")
        if phase == 2 and p.lowrank and c.score_cuda is not False and _ll.VARIANT == "cuda":
            # the latent pass in CUDA (kernels/lowrank_latent.py) where it reads the region's latents (rank 512,
            # 3 bits), else the Triton launch below: both on tensor cores, neither the reference
            if _ll.reason(q, r.lat, r.rank, c.g * c.rep, p.sc, r.pos) is None:
                _ll.latents(p.sc, r.pos, r.length, c.npos, c.win, r.lat, c.g * c.rep, c.partials, slot0, c.n_slots, nsp)
                continue
        tile = c.SBT if phase == 1 else c.BT
        kall = p.heads and phase == 1
        whole = phase != 1 or p.grp  # programs of whole latent groups
        _lr_kernel[(nsp, 1 if kall else G if whole else K, B)](
            *p.args,
            slot0,
            c.n_slots,
            H,
            nsp,
            **p.meta,
            GS=c.g if whole else 1,  # the score launch: a program per KV head, unless by groups
            QGP=QGP if whole else max(16, pow2(c.rep)),
            BT=tile,
            WB=p.wb if whole else 1,
            PHASE=phase,
            KALL=kall,
            num_warps=p.swarps if phase == 1 else c.num_warps,
        )


# the key basis in the dots' dtype on the query's device, made once per basis (before any CUDA graph captures a step)
_BASIS: dict = {}


def _basis_on(basis: KeyBasis, NH: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dec_lo, dec_hi [Kb, C, K NH / Kb] in `dtype` (the tensor cores' operand type), rows [4, K NH] float32) of
    `basis` (Kb blocks of K / Kb KV heads) on `device`. In block j, column k NH + d holds channel d (lo) / n/2 + d
    (hi) of its k-th head's key (d < n/2; zero up to NH), so that heads side by side are one contiguous block of
    columns per RoPE half. Each column is divided by a power of two that brings its largest entry into [0.5, 1]
    (float16 holds dec whatever its range: a channel the queries barely read has large entries: key_basis.fit
    divides by their weights); rows, per KV head h at columns h NH + d: the mean's lo and hi halves, then those
    powers of two (lo, hi), by which the kernel multiplies the rebuilt keys back (exact)."""
    import weakref

    key = (id(basis.dec), NH, str(device), dtype)
    hit = _BASIS.get(key)
    if hit is None:
        n = basis.head_dim
        half = n // 2

        def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., k n] -> lo, hi [..., k NH]
            x = x.to(device=device, dtype=torch.float32).unflatten(-1, (x.shape[-1] // n, n))
            pad = lambda y: torch.nn.functional.pad(y, (0, NH - half)).flatten(-2)  # noqa: E731
            return pad(x[..., :half]), pad(x[..., half:])

        def scaled(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [Kb, C, cols] -> itself / s, s [Kb cols]
            top = m.abs().amax(1, keepdim=True)
            e = torch.where(top > 0, torch.ceil(torch.log2(top.clamp_min(1e-30))), torch.zeros_like(top))
            s = torch.exp2(e)
            return (m / s).to(dtype).contiguous(), s.flatten()

        (lo, slo), (hi, shi) = (scaled(x) for x in halves(basis.dec))
        mlo, mhi = halves(basis.mean)
        hit = _BASIS[key] = (lo, hi, torch.stack([mlo, mhi, slo, shi]).contiguous())
        weakref.finalize(basis.dec, _BASIS.pop, key, None)
    return hit


__all__ = ["latent_attention_lowrank", "supported"]
