"""Fused decode attention (T = 1) over one layer's TALE cache, read through its LayerView.

One launch for all the cache's regions (up to four per launch; more take further launches),
grid (splits, G, B): the splits of every region, a program per split, head group c and batch
row. A program takes a contiguous chunk of its region's slots for all g*rep query heads of
its group, so each latent tile is read once for the group (M = the group's query heads,
padded to 16). Per tile of slots:
- keys of the group's g KV heads as one [BT, g*n/planes] tile per plane of the packed layout
  (runtime/quant.py: plane i of a row's bytes holds a contiguous channel block), scored on
  tensor cores against a block-diagonal query tile (row r keeps KV head r // rep's channels),
  so no score is computed for a head it does not belong to and no select follows;
- masks from the slot positions (-1: padding or empty; sliding window: next_pos - pos <
  window), online softmax in base 2;
- latents plane by plane: p @ plane_i into its own accumulator (channels i*nb ..).
Keys in channel bands (quant.Bands: the tale preset) are scored part by part against the query's
channels of each part (gathered, shifted and converted by one small launch first), fp8 scales/zeros are divided by their tensor's bias
(a float, or a device scalar in static caches), 3-bit keys from their bit-sliced layout (8 sub-planes).
Each program writes a partial (max, sum, acc[:rank]) into its slot; a second launch merges
the slots with the new token into z [B, 1, H, R]. Lengths and positions are read on the
device and the grid comes from capacities, so a call can be captured in a CUDA graph;
programs past a region's length write an empty partial.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tale_runtime.attention import latent_attention as reference
from tale_runtime.frag import FragRegion
from tale_runtime.quant import FP8, META_SHIFT, Bands, QTensor, meta_format
from tale_runtime.regions import LayerView, Region

from ._common import (
    TL_DTYPE,
    group_rows,
    interpreting,
    is_pow2,
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
    to_float,
)

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, USE_DOT: tl.constexpr):
    """acc + a [M, K] @ b [K, N] in float32 (tensor cores, or CUDA cores for small tiles)."""
    if USE_DOT and a.dtype == tl.float32:  # float32 caches: full precision, not tf32
        r = tl.dot(a, b, acc, input_precision="ieee")
    elif USE_DOT:
        r = tl.dot(a, b, acc)
    else:
        r = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return r


@triton.jit
def _split4(x, NP: tl.constexpr, M: tl.constexpr, W: tl.constexpr):
    """[M, W, NP] -> its NP slices [M, W] along the last dim (NP = 1, 2, 4); unused ones repeat the first."""
    if NP == 1:
        a = tl.reshape(x, (M, W))
        b = a
        c = a
        d = a
    elif NP == 2:
        a, b = tl.split(x)
        c = a
        d = a
    else:
        lo, hi = tl.split(tl.reshape(x, (M, W, 2, 2)))  # lo: slices 0, 2; hi: 1, 3
        a, c = tl.split(lo)
        b, d = tl.split(hi)
    return a, b, c, d


@triton.jit
def _nth(i: tl.constexpr, a, b, c, d, e=None, f=None, g=None, h=None):
    """The i-th of four tensors (i < 4; e.g. a query plane of _split4 held in registers), or of eight (e .. h given)."""
    if i == 0:
        x = a
    elif i == 1:
        x = b
    elif i == 2:
        x = c
    elif i == 3:
        x = d
    elif i == 4:
        x = e
    elif i == 5:
        x = f
    elif i == 6:
        x = g
    else:
        x = h
    return x


@triton.jit
def _put(i: tl.constexpr, x, a, b, c, d, e=None, f=None, g=None, h=None):
    """The four (or eight) tensors with the i-th replaced by x: _nth's inverse."""
    r = (x if i == 0 else a), (x if i == 1 else b), (x if i == 2 else c), (x if i == 3 else d)
    if e is not None:
        r = r + ((x if i == 4 else e), (x if i == 5 else f), (x if i == 6 else g), (x if i == 7 else h))
    return r


_META_SHIFT = tl.constexpr(META_SHIFT)  # 2^-8: also the operand shift of bf16 caches in float16 dots (SH)


@triton.jit
def _shifted(x, sh, SH: tl.constexpr, DOT: tl.constexpr, MS: tl.constexpr = 1.0):
    """x, stored times the power of two MS, as DOT times SH (sh: SH's runtime value, so that the compiler cannot move
    the multiply after the conversion, where it would narrow the range; exact unless below DOT's normal range).
    Nothing to do where they match: float16 metadata of bf16 caches (MS = 2^-8) in float16 dots (SH = 2^-8)."""
    if SH != MS:
        x = x.to(tl.float32) * (sh / MS)
    return x.to(DOT)


@triton.jit
def _meta(s_ptr, z_ptr, off, m, inv, sh, META: tl.constexpr, DOT: tl.constexpr, SH: tl.constexpr):
    """Scale and zero at `off` (masked: 0) in DOT, times sh (_shifted). META % 3 (_METAS): 0: both 16-bit; 1: an
    fp8 scale stored times the tensor's power-of-two bias (inv = 1 / bias: exact), a 16-bit zero; 2: both fp8.
    META >= 3: the 16-bit ones are float16 times 2^-8 (bf16 caches, runtime/quant.py meta_format), else in the
    cache dtype."""
    s = tl.load(s_ptr + off, mask=m, other=0.0)
    z = tl.load(z_ptr + off, mask=m, other=0.0)
    MS: tl.constexpr = _META_SHIFT if META >= 3 else 1.0
    f = inv * sh if SH != 1.0 else inv  # fp8: unbias and shift in one multiply
    if META % 3 > 0:
        s = (s.to(tl.float32) * f).to(DOT)
    else:
        s = _shifted(s, sh, SH, DOT, MS)
    if META % 3 > 1:
        z = (z.to(tl.float32) * f).to(DOT)
    else:
        z = _shifted(z, sh, SH, DOT, MS)
    return s, z


@triton.jit
def _inv_bias(bias, BP: tl.constexpr):
    """1 / the fp8 bias: a float argument, or (BP) read from a device scalar (static caches: a captured graph
    reads the current one)."""
    if BP:
        inv = 1.0 / tl.load(bias).to(tl.float32)
    else:
        inv = 1.0 / bias
    return inv


@triton.jit
def _lat_plane(
    h_ptr,
    hb,
    hoff,
    hs_ptr,
    hz_ptr,
    soff,
    ok,
    tm,
    hm,
    i: tl.constexpr,
    HBITS: tl.constexpr,
    HMETA: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    VG: tl.constexpr,
    BT: tl.constexpr,
    DOT: tl.constexpr,
    ASM: tl.constexpr,
    SH: tl.constexpr,
    HT: tl.constexpr = False,
):
    """Latent channels i*P .. i*P + P - 1 of a tile, dequantized: [BT, PP] in DOT, times SH. Rows that are
    not real slots come out zero (scales masked), whatever the buffer holds there. hm: (1 / fp8 bias, shift).
    HT (packed latents stored channel-major, unpacked in PTX): hb is [PP, BT], dequantized in that orientation and
    handed back transposed, so the bytes reach the dot's operand layout without a 16-bit tile in shared memory."""
    hinv = hm[0]
    sh = hm[1]
    jp = tl.arange(0, PP)
    if HBITS < 8 and ASM and HT:
        if P >= VG:  # scales [PP // VG, BT]
            gi = tl.arange(0, PP // VG)
            gm = ok[None, :] & (gi < P // VG)[:, None]
            hs, hz = _meta(hs_ptr, hz_ptr, soff[None, :] + ((i * P) // VG + gi)[:, None], gm, hinv, sh, HMETA, DOT, SH)
            x3 = plane_asm(tl.reshape(hb, (PP // VG, VG, BT)), hs[:, None, :], hz[:, None, :], i, HBITS, DOT)
            x = tl.trans(tl.reshape(x3, (PP, BT)))
        else:  # the plane lies inside one group: [BT]
            hs, hz = _meta(hs_ptr, hz_ptr, soff + (i * P) // VG, ok, hinv, sh, HMETA, DOT, SH)
            x = tl.trans(plane_asm(hb, hs[None, :], hz[None, :], i, HBITS, DOT))
    else:
        if HBITS < 16:  # per token over channel groups
            if P >= VG:  # whole groups in the plane: [BT, PP // VG]
                gi = tl.arange(0, PP // VG)
                gm = ok[:, None] & (gi < P // VG)[None, :]
                hs, hz = _meta(
                    hs_ptr, hz_ptr, soff[:, None] + ((i * P) // VG + gi)[None, :], gm, hinv, sh, HMETA, DOT, SH
                )
            else:  # the plane lies inside one group: [BT]
                hs, hz = _meta(hs_ptr, hz_ptr, soff + (i * P) // VG, ok, hinv, sh, HMETA, DOT, SH)
        if HBITS < 8 and ASM:  # unpack and scale in one PTX block, 4 codes per register
            if P >= VG:
                x3 = plane_asm(tl.reshape(hb, (BT, PP // VG, VG)), hs[:, :, None], hz[:, :, None], i, HBITS, DOT)
                x = tl.reshape(x3, (BT, PP))
            else:
                x = plane_asm(hb, hs[:, None], hz[:, None], i, HBITS, DOT)
        else:
            if HBITS < 8:
                x = plane(hb, i, HBITS, DOT)
            elif HBITS == 8:
                x = to_float(
                    tl.load(
                        h_ptr + hoff[:, None] + (i * P + jp)[None, :], mask=tm[:, None] & (jp < P)[None, :], other=0
                    ).to(tl.int32),
                    8,
                    DOT,
                )
            else:
                x = _shifted(
                    tl.load(
                        h_ptr + hoff[:, None] + (i * P + jp)[None, :], mask=ok[:, None] & (jp < P)[None, :], other=0.0
                    ),
                    sh,
                    SH,
                    DOT,
                )
            if HBITS < 16:
                if P >= VG:
                    x = tl.reshape(tl.reshape(x, (BT, PP // VG, VG)) * hs[:, :, None] + hz[:, :, None], (BT, PP))
                else:
                    x = x * hs[:, None] + hz[:, None]
    return x


# A region's arguments travel as two flat tuples (Triton passes tuples, not lists), written once here:
#   runtime RT: latents h, s_hb, s_hg, s_ht, hs, hz, s_hsb, s_hsg, s_hst, h_bias | pos, s_pb | length, splits,
#               shift, then per key part (RT_KEY items from RT_KEY0 + RT_KEY * j): q_j, s_qb, s_qh, k, s_kb, s_kh, s_kt,
#               ks, kz, s_ksb, s_ksh, s_kst, k_bias (q_j: the query's channels of part j, gathered per KV head)
#   constexpr CT: RANK, NPH, P, PP, BT, HDOT, LENP, HBITS, HMETA, HBP, HASM, KROWS, NKP, SH, HT (packed latents stored
#               channel-major: slots contiguous, s_ht then holds the stride of a channel byte),
#               then per key part (CT_KEY items from CT_KEY0 + CT_KEY * j): KBITS, NK, NPK, KW, KDOT, KASM, KMETA, KBP
RT_KEY0 = tl.constexpr(15)
RT_KEY = tl.constexpr(13)
CT_KEY0 = tl.constexpr(15)
CT_KEY = tl.constexpr(8)


@triton.jit
def _q_planes(
    RT, CT, j: tl.constexpr, b, head, rows, rmask, c, qk_scale,
    GS: tl.constexpr, REP: tl.constexpr, QGP: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """The block-diagonal query planes [QGP, KW] of key part j times qs, held in registers (q_in_loop=False)."""
    o: tl.constexpr = RT_KEY0 + RT_KEY * j
    oc: tl.constexpr = CT_KEY0 + CT_KEY * j
    NK: tl.constexpr = CT[oc + 1]
    NPK: tl.constexpr = CT[oc + 2]
    KW: tl.constexpr = CT[oc + 3]
    PK: tl.constexpr = NK // NPK
    u = tl.arange(0, KW)
    ju = u // PK
    jj = u % PK
    qm = (rmask[:, None] & ((rows // REP)[:, None] == ju[None, :]))[:, :, None]
    qoff = b * RT[o + 1] + head[:, None] * RT[o + 2] + jj[None, :]
    pi = tl.arange(0, NPK)
    q3 = tl.load(RT[o] + qoff[:, :, None] + pi[None, None, :] * PK, mask=qm, other=0.0)
    q3 = (q3.to(tl.float32) * qk_scale).to(DOT)
    return _split4(q3, NPK, QGP, KW)


@triton.jit
def _key_logits(
    logits, RT, CT, j: tl.constexpr, b, c, head, rows, rmask, t0, t, tm, L, qp0, qp1, qp2, qp3,
    GS: tl.constexpr, REP: tl.constexpr, KG: tl.constexpr, DOT: tl.constexpr, QLOOP: tl.constexpr,
):  # fmt: skip
    """logits [QGP, BT] + the scores of key part j over a tile of slots t (all channels when the keys are one
    part; one band of channels otherwise: the parts' dot products sum to q . k)."""
    o: tl.constexpr = RT_KEY0 + RT_KEY * j
    oc: tl.constexpr = CT_KEY0 + CT_KEY * j
    BT: tl.constexpr = CT[4]
    KROWS: tl.constexpr = CT[11]
    KBITS: tl.constexpr = CT[oc]
    NK: tl.constexpr = CT[oc + 1]
    NPK: tl.constexpr = CT[oc + 2]
    KW: tl.constexpr = CT[oc + 3]
    KDOT: tl.constexpr = CT[oc + 4]
    KASM: tl.constexpr = CT[oc + 5]
    KMETA: tl.constexpr = CT[oc + 6]
    KBP: tl.constexpr = CT[oc + 7]
    SH: tl.constexpr = CT[13]
    sh = RT[14]
    q_ptr = RT[o]
    k_ptr = RT[o + 3]
    s_kt = RT[o + 6]
    PK: tl.constexpr = NK // NPK  # key channels per plane (2/4 bits: bytes per head row)
    # key tile columns: KV head u // PK of the group, channel (plane) * PK + u % PK
    u = tl.arange(0, KW)
    ju = u // PK
    jj = u % PK
    um = u < GS * PK
    kvu = c * GS + ju
    qm2 = rmask[:, None] & ((rows // REP)[:, None] == ju[None, :])
    qoff = b * RT[o + 1] + head[:, None] * RT[o + 2] + jj[None, :]  # [QGP, KW]
    krow = b * RT[o + 4] + kvu * RT[o + 5]  # [KW]
    ksoff = b * RT[o + 9] + kvu * RT[o + 10] + jj
    kinv = _inv_bias(RT[o + 12], KBP)
    kmask = tm[:, None] & um[None, :]
    if KBITS < 8 and KBITS != 3:
        kb = tl.load(k_ptr + (krow + jj)[None, :] + t[:, None] * s_kt, mask=kmask, other=0)
    if KBITS == 3:  # bit-sliced (runtime/quant.py): low-byte halves A / B (PK bytes each), then the high bits
        kp = k_ptr + (krow + jj)[None, :] + t[:, None] * s_kt
        k3a = tl.load(kp, mask=kmask, other=0)
        k3b = tl.load(kp + PK, mask=kmask, other=0)
        k3h = tl.load(kp + 2 * PK, mask=kmask, other=0)
    for i in tl.static_range(NPK):
        if KBITS < 16:  # per channel over key groups: KROWS scale rows per tile
            r = t0 // KG + tl.arange(0, KROWS)
            sm = (r * KG < L)[:, None] & um[None, :]
            ks, kz = _meta(
                RT[o + 7], RT[o + 8], ksoff[None, :] + i * PK + r[:, None] * RT[o + 11], sm, kinv, sh, KMETA, DOT, SH
            )
        if KBITS < 8 and KASM:  # unpack and scale in one PTX block, 4 codes per register
            if KBITS == 3:  # sub-plane i: low half i % 2 and the high bits
                kc = plane3_asm(
                    tl.reshape(k3a if i % 2 == 0 else k3b, (KROWS, BT // KROWS, KW)),
                    tl.reshape(k3h, (KROWS, BT // KROWS, KW)),
                    ks[:, None, :],
                    kz[:, None, :],
                    i,
                    DOT,
                )
            else:
                kc = plane_asm(tl.reshape(kb, (KROWS, BT // KROWS, KW)), ks[:, None, :], kz[:, None, :], i, KBITS, DOT)
            kc = tl.reshape(kc, (BT, KW))
        else:
            if KBITS == 3:  # sub-plane i: 2 bits of low half i % 2 at 2 (i // 2), the high bit at i
                kc = plane3(k3a if i % 2 == 0 else k3b, k3h, i, DOT)
            elif KBITS < 8:
                kc = plane(kb, i, KBITS, DOT)
            elif KBITS == 8:
                kc = to_float(
                    tl.load(k_ptr + (krow + jj)[None, :] + i * PK + t[:, None] * s_kt, mask=kmask, other=0).to(
                        tl.int32
                    ),
                    8,
                    DOT,
                )
            else:
                kc = _shifted(
                    tl.load(k_ptr + (krow + jj)[None, :] + i * PK + t[:, None] * s_kt, mask=kmask, other=0.0),
                    sh,
                    SH,
                    DOT,
                )
            if KBITS < 16:
                kc = tl.reshape(tl.reshape(kc, (KROWS, BT // KROWS, KW)) * ks[:, None, :] + kz[:, None, :], (BT, KW))
        if QLOOP == 1:
            qi = tl.load(q_ptr + qoff + i * PK, mask=qm2, other=0.0).to(DOT)
        else:
            qi = _nth(i, qp0, qp1, qp2, qp3)
        logits = _dot(qi, tl.trans(kc), logits, KDOT)
    return logits


@triton.jit
def _store_stats(pm_ptr, pl_ptr, rk_ptr, slot, prow, rmask, m, l, RANK: tl.constexpr):
    """One split's max m and sum l [QGP] at its heads' rows `prow`, and the region's rank at the slot (the combine
    reads that many channels)."""
    tl.store(rk_ptr + slot + tl.arange(0, 1), tl.full([1], RANK, tl.int32))
    tl.store(pm_ptr + prow, m, mask=rmask)
    tl.store(pl_ptr + prow, l, mask=rmask)


@triton.jit
def _store_partial(
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    s_acc,
    rk_ptr,
    slot,
    prow,
    rmask,
    m,
    l,
    jp,
    acc0,
    acc1,
    acc2,
    acc3,
    RANK: tl.constexpr,
    NPH: tl.constexpr,
    P: tl.constexpr,
    SH: tl.constexpr,
):
    """One split's partial for the combine: max m and sum l [QGP] of its heads' rows `prow`, the accumulator planes
    (entered the dots times SH, undone here; channels past RANK are never written), and the region's rank for the
    slot (the combine reads that many)."""
    if SH != 1.0:
        acc0 = acc0 * (1.0 / SH)
        acc1 = acc1 * (1.0 / SH)
        acc2 = acc2 * (1.0 / SH)
        acc3 = acc3 * (1.0 / SH)
    _store_stats(pm_ptr, pl_ptr, rk_ptr, slot, prow, rmask, m, l, RANK)
    am = rmask[:, None] & (jp < P)[None, :]
    base = pacc_ptr + prow[:, None] * s_acc + jp[None, :]
    tl.store(base, acc0, mask=am)
    if NPH > 1:
        tl.store(base + P, acc1, mask=am)
    if NPH > 2:
        tl.store(base + 2 * P, acc2, mask=am)
        tl.store(base + 3 * P, acc3, mask=am)


@triton.jit
def _softmax_init(QGP: tl.constexpr, PP: tl.constexpr, NACC: tl.constexpr = 4):
    """The online softmax's state before the first tile: max, sum [QGP] and NACC (4 or 8) accumulator planes
    [QGP, PP]."""
    m_i = tl.full([QGP], float("-inf"), tl.float32)
    l_i = tl.zeros([QGP], tl.float32)
    acc0 = tl.zeros([QGP, PP], tl.float32)
    acc1 = tl.zeros([QGP, PP], tl.float32)
    acc2 = tl.zeros([QGP, PP], tl.float32)
    acc3 = tl.zeros([QGP, PP], tl.float32)
    r = m_i, l_i, acc0, acc1, acc2, acc3
    if NACC == 8:
        acc4 = tl.zeros([QGP, PP], tl.float32)
        acc5 = tl.zeros([QGP, PP], tl.float32)
        acc6 = tl.zeros([QGP, PP], tl.float32)
        acc7 = tl.zeros([QGP, PP], tl.float32)
        r = r + (acc4, acc5, acc6, acc7)
    return r


@triton.jit
def _softmax_step(logits, m_i, l_i):
    """One tile of the online softmax in base 2: the tile's weights p [QGP, BT], the factor alpha [QGP] that rescales
    what came before, and the new max and sum (a row with no slot yet keeps max -inf and weights 0)."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(logits - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _lat_accs(acc0, acc1, acc2, acc3, pd, alpha, h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, hm, NPH: tl.constexpr,
    HBITS: tl.constexpr, HMETA: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, VG: tl.constexpr, BT: tl.constexpr,
    DOT: tl.constexpr, ASM: tl.constexpr, SH: tl.constexpr, HT: tl.constexpr, USE_DOT: tl.constexpr):  # fmt: skip
    """The accumulator planes rescaled by alpha plus the tile's weights pd times its latents, plane by plane
    (_lat_plane's arguments; NPH planes, the others are returned as they came)."""
    for i in tl.static_range(NPH):  # NPH is 1, 2 or 4
        x = _lat_plane(
            h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, hm, i, HBITS, HMETA, P, PP, VG, BT, DOT, ASM, SH, HT
        )
        a = _dot(pd, x, _nth(i, acc0, acc1, acc2, acc3) * alpha[:, None], USE_DOT)
        acc0, acc1, acc2, acc3 = _put(i, a, acc0, acc1, acc2, acc3)
    return acc0, acc1, acc2, acc3


@triton.jit
def _region(
    RT, CT, slot, spl, args,
    GS: tl.constexpr, REP: tl.constexpr, QGP: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr, WIN: tl.constexpr,
    DOT: tl.constexpr, QLOOP: tl.constexpr,
):  # fmt: skip
    """One split of one region: partial (max, sum, acc[:RANK]) of the group's query heads. args: the launch's
    runtime arguments that every region reads (_attn_kernel)."""
    qk_scale, b, c, n_slots, H, next_pos, window, pm_ptr, pl_ptr, pacc_ptr, s_acc, rk_ptr = args
    RANK: tl.constexpr = CT[0]
    NPH: tl.constexpr = CT[1]
    P: tl.constexpr = CT[2]
    PP: tl.constexpr = CT[3]
    BT: tl.constexpr = CT[4]
    HDOT: tl.constexpr = CT[5]
    LENP: tl.constexpr = CT[6]
    HBITS: tl.constexpr = CT[7]
    HMETA: tl.constexpr = CT[8]
    HBP: tl.constexpr = CT[9]
    HASM: tl.constexpr = CT[10]
    NKP: tl.constexpr = CT[12]
    SH: tl.constexpr = CT[13]  # keys, latents and queries enter the dots times SH: undone on logits and acc
    HT: tl.constexpr = CT[14]
    sh = RT[14]  # SH as a runtime value (_shifted)
    h_ptr = RT[0]
    hs_ptr = RT[4]
    hz_ptr = RT[5]
    p_ptr = RT[10]
    L = scalar(RT[12], LENP)
    t_start, t_end = split_bounds(L, RT[13], spl, BT)
    rows, head, rmask = group_rows(c, GS * REP, QGP)
    if QLOOP == 1:  # the query planes are reloaded per tile (cache hits): fewer live registers
        q_scale = qk_scale / (SH * SH)
        qa0 = rows
        qa1 = rows
        qa2 = rows
        qa3 = rows
        qb0 = rows
        qb1 = rows
        qb2 = rows
        qb3 = rows
    else:  # held in registers. QLOOP 2: from the caller's query, times the shift only (exact: no conversion launch,
        # no rounding), the score scale on the logits; QLOOP 0: from the converted query, times the score scale
        qs = sh if QLOOP == 2 else qk_scale
        qa0, qa1, qa2, qa3 = _q_planes(RT, CT, 0, b, head, rows, rmask, c, qs, GS, REP, QGP, DOT)
        qb0, qb1, qb2, qb3 = qa0, qa1, qa2, qa3
        if NKP > 1:
            qb0, qb1, qb2, qb3 = _q_planes(RT, CT, 1, b, head, rows, rmask, c, qs, GS, REP, QGP, DOT)
        q_scale = (qk_scale if QLOOP == 2 else 1.0) / (SH * SH)
    hrow = b * RT[1] + c * RT[2]
    srow = b * RT[6] + c * RT[7]
    hm = (_inv_bias(RT[9], HBP), sh)

    m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_init(QGP, PP)
    jp = tl.arange(0, PP)
    for t0 in range(t_start, t_end, BT):
        t, tm = tile_slots(t0, t_end, BT)
        pv, ok = slot_ok(p_ptr + b * RT[11], t, tm, next_pos, window, WIN)
        # -- scores: one key part, or the bands' parts summed
        logits = tl.zeros([QGP, BT], tl.float32)
        logits = _key_logits(
            logits, RT, CT, 0, b, c, head, rows, rmask, t0, t, tm, L, qa0, qa1, qa2, qa3, GS, REP, KG, DOT, QLOOP
        )
        if NKP > 1:
            logits = _key_logits(
                logits, RT, CT, 1, b, c, head, rows, rmask, t0, t, tm, L, qb0, qb1, qb2, qb3, GS, REP, KG, DOT, QLOOP
            )
        if QLOOP != 0 or SH != 1.0:
            logits = logits * q_scale
        logits = tl.where(ok[None, :], logits, float("-inf"))
        # -- online softmax
        p, alpha, m_i, l_i = _softmax_step(logits, m_i, l_i)
        pd = p.to(DOT)

        # -- latents, plane by plane
        hoff = hrow + t * RT[3]
        soff = srow + t * RT[8]
        hb = pv  # stands in when the latents are not packed
        if HBITS < 8 and HT:  # [PP, BT]: byte j of slot t at hrow + j * s_ht + t
            # masked by the row (s_ht slots, a multiple of 16), not the length: a mask that is uniform over 16 slots
            # keeps the loads vectorized (t_end read on the device is not known to be aligned). Slots past the
            # length read codes of unused slots, which the masked scales zero.
            hm_ = (jp < P)[:, None] & (t < RT[3])[None, :]
            hb = tl.load(h_ptr + hrow + jp[:, None] * RT[3] + t[None, :], mask=hm_, other=0)
            if not HASM:
                hb = tl.trans(hb)
        elif HBITS < 8:
            hb = tl.load(h_ptr + hoff[:, None] + jp[None, :], mask=tm[:, None] & (jp < P)[None, :], other=0)
        acc0, acc1, acc2, acc3 = _lat_accs(
            acc0, acc1, acc2, acc3, pd, alpha, h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, hm, NPH, HBITS, HMETA, P,
            PP, VG, BT, DOT, HASM, SH, HT, HDOT,
        )  # fmt: skip

    # -- the partial of this split: channels past RANK are never written (the combine skips them)
    prow = (b * H + head) * n_slots + slot
    _store_partial(
        pm_ptr, pl_ptr, pacc_ptr, s_acc, rk_ptr, slot, prow, rmask, m_i, l_i, jp, acc0, acc1, acc2, acc3, RANK, NPH, P,
        SH,
    )  # fmt: skip


@triton.jit
def _attn_kernel(
    qk_scale,
    np_arg,
    window,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    s_acc,
    rk_ptr,
    n_slots,
    H,
    slot0,
    S1,
    S2,
    S3,
    RT0,
    RT1,
    RT2,
    RT3,
    CT0: tl.constexpr,
    CT1: tl.constexpr,
    CT2: tl.constexpr,
    CT3: tl.constexpr,
    GS: tl.constexpr,
    REP: tl.constexpr,
    QGP: tl.constexpr,
    KG: tl.constexpr,
    VG: tl.constexpr,
    WIN: tl.constexpr,
    NPP: tl.constexpr,
    NREG: tl.constexpr,
    DOT: tl.constexpr,
    QLOOP: tl.constexpr,
):
    """Program (split sp, head group c, batch row b): sp < S1 is region 0's split sp, and so on."""
    sp, c, b = program_ids()
    next_pos = scalar(np_arg, NPP)
    args = (qk_scale, b, c, n_slots, H, next_pos, window, pm_ptr, pl_ptr, pacc_ptr, s_acc, rk_ptr)
    slot = slot0 + sp
    if sp < S1:
        _region(RT0, CT0, slot, sp, args, GS, REP, QGP, KG, VG, WIN, DOT, QLOOP)
    elif NREG > 1:
        if sp < S2:
            _region(RT1, CT1, slot, sp - S1, args, GS, REP, QGP, KG, VG, WIN, DOT, QLOOP)
        elif NREG > 2:
            if sp < S3:
                _region(RT2, CT2, slot, sp - S2, args, GS, REP, QGP, KG, VG, WIN, DOT, QLOOP)
            elif NREG > 3:
                _region(RT3, CT3, slot, sp - S3, args, GS, REP, QGP, KG, VG, WIN, DOT, QLOOP)


@triton.jit
def _combine_kernel(
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    s_acc,
    rk_ptr,
    z_ptr,
    n_slots,
    R,
    H,
    q_ptr,
    s_qb,
    s_qh,
    qk_scale,
    kn_ptr,
    s_knb,
    s_knh,
    hn_ptr,
    s_hnb,
    s_hng,
    N: tl.constexpr,
    REP: tl.constexpr,
    GS: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
):
    """z for one (batch row, query head, column block): the new token merged with every slot."""
    row = tl.program_id(0).to(tl.int64)  # b * H + query head
    b = row // H
    hq = row % H
    kv = hq // REP
    c = kv // GS
    cols = tl.program_id(1) * BR + tl.arange(0, BR)
    dn = tl.arange(0, N)
    q = tl.load(q_ptr + b * s_qb + hq * s_qh + dn).to(tl.float32) * qk_scale
    k = tl.load(kn_ptr + b * s_knb + kv * s_knh + dn).to(tl.float32)
    m = tl.sum(q * k, axis=0, keep_dims=True)  # the new token: always seen
    l = tl.full([1], 1.0, tl.float32)
    acc = tl.load(hn_ptr + b * s_hnb + c * s_hng + cols, mask=cols < R, other=0.0).to(tl.float32)
    base = row * n_slots
    for s0 in range(0, n_slots, BS):  # one pass over the slots, rescaling as the max grows
        s = s0 + tl.arange(0, BS)
        sm = s < n_slots
        ms = tl.load(pm_ptr + base + s, mask=sm, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(ms, axis=0, keep_dims=True))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(ms - m_new)
        l = l * alpha + tl.sum(w * tl.load(pl_ptr + base + s, mask=sm, other=0.0), axis=0, keep_dims=True)
        rk = tl.load(rk_ptr + s, mask=sm, other=0)  # the slot's region rank: channels past it get nothing
        am = sm[:, None] & (cols[None, :] < rk[:, None])
        a = tl.load(pacc_ptr + (base + s)[:, None] * s_acc + cols[None, :], mask=am, other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
        m = m_new
    tl.store(z_ptr + row * R + cols, acc / l, mask=cols < R)


@triton.jit
def _query_kernel(q_ptr, s_qb, s_qh, idx_ptr, out_ptr, sh, H, N: tl.constexpr):
    """out[b, h, 0] = q[b, h, 0, idx[h]] * sh in out's dtype (computed in float32, rounded once)."""
    row = tl.program_id(0)
    j = tl.arange(0, N)
    ix = tl.load(idx_ptr + (row % H) * N + j)
    x = tl.load(q_ptr + (row // H) * s_qb + (row % H) * s_qh + ix).to(tl.float32) * sh
    tl.store(out_ptr + row * N + j, x.to(out_ptr.dtype.element_ty))


# -- host side -------------------------------------------------------------------------------

NREG = 4  # region slots of one launch
_METAS = {"16": 0, "8/16": 1, "8/8": 2}  # scale/zero storage (runtime/quant.py META) -> the kernel's KMETA/HMETA


def _meta_code(t: QTensor) -> int:
    """KMETA / HMETA of a quantized tensor: _METAS, + 3 where its 16-bit scale/zero are float16 times 2^-8."""
    return _METAS[t.meta] + (3 if t.shift == META_SHIFT else 0)


def _key_parts(keys) -> list[tuple[QTensor, torch.Tensor | None]]:
    """A region's keys as (QTensor, channel index [K, c] or None: all channels) per part."""
    if type(keys) is Bands:
        return list(zip(keys.parts, keys.index))
    return [(keys, None)]


def _half_meta(view: LayerView) -> bool:
    """Some region stores 16-bit scales/zeros as float16 times 2^-8 (quant.meta_format of bf16 tensors)."""
    return any(
        t.bits != 16 and t.shift != 1.0 for r in view.regions for t in [r.lat, *(k for k, _ in _key_parts(r.keys))]
    )


def _meta_ok(t: QTensor, dtype: torch.dtype, device: torch.device) -> bool:
    """Scale and zero as the kernel reads them: 16-bit ones in the cache dtype or per quant.meta_format (bf16 caches:
    float16 times 2^-8), fp8 e4m3 ones per META with the bias a float or a one-element float32 tensor on the cache's
    device."""
    if t.scale is None or t.zero is None or t.scale.shape != t.zero.shape or t.meta not in _METAS:
        return False
    fmt, shift = meta_format(dtype)
    mdt = dtype if t.shift == 1.0 else fmt if t.shift == shift else None  # 16-bit ones: the cache dtype or meta_format
    want = {"16": (mdt, mdt), "8/16": (FP8, mdt), "8/8": (FP8, FP8)}[t.meta]
    if (t.scale.dtype, t.zero.dtype) != want:
        return False
    b = t.bias
    if isinstance(b, torch.Tensor):
        return b.numel() == 1 and b.dtype == torch.float32 and b.device == t.scale.device
    return t.meta == "16" or (isinstance(b, float) and b > 0)


def _meta_desc(t: QTensor) -> str:
    dt = [None if x is None else x.dtype for x in (t.scale, t.zero)]
    return f"scales/zeros of format {t.meta!r} in {dt[0]}/{dt[1]} (shift {t.shift})"


def _planes_reason(rank: int, bits: int, group: int) -> str | None:
    """Why latents of `rank` channels at `bits` in groups of `group` are not read (None: they are): a group must lie
    in one plane of the packed layout (2/4 bits: the 8 / bits planes of runtime/quant.py; 8 bits: _lat_planes)."""
    if bits == 16:
        return None
    P = rank * bits // 8 if bits < 8 else _lat_planes(rank)[1]
    if P % group == 0 or (group % P == 0 and is_pow2(P)):
        return None
    return f"latent groups of {group} channels straddle the {P}-channel planes of rank {rank} at {bits} bits"


def _region_reason(r: Region, B: int, K: int, G: int, n: int, dtype: torch.dtype) -> str | None:
    hq = r.lat
    parts = _key_parts(r.keys)
    if len(parts) > 2:
        return f"keys in {len(parts)} bands (it reads up to two)"
    if type(hq) is not QTensor or not all(type(kq) is QTensor for kq, _ in parts):
        return "a QTensor subclass in a region"
    if hq.bits not in (2, 4, 8, 16):
        return f"{hq.bits}-bit latents are not read by this kernel"
    cap = r.capacity
    if r.pos.dtype != torch.int32 or tuple(r.pos.shape) != (B, cap) or r.pos.stride(-1) != 1:
        return "region positions are not int32 [B, cap]"
    ln = r.length
    if isinstance(ln, torch.Tensor) and (ln.numel() != 1 or ln.dtype not in (torch.int32, torch.int64)):
        return "region length is not a one-element integer tensor"
    if tuple(r.keys.shape) != (B, K, cap, n) or tuple(hq.shape) != (B, G, cap, r.rank) or hq.shape[-2] != cap:
        return f"a region of keys {tuple(r.keys.shape)} and latents {tuple(hq.shape)} for {B} x {K} x {n}, {G} groups"
    seen = 0
    for kq, idx in parts:
        c = n if idx is None else idx.shape[-1]
        seen += c
        if kq.bits not in (2, 3, 4, 8, 16):
            return f"{kq.bits}-bit keys are not read by this kernel"
        if tuple(kq.shape) != (B, K, cap, c) or c % 8 or c < 8:
            return f"a key band of {c} channels (whole multiples of 8)"
        if idx is not None and (tuple(idx.shape) != (K, c) or idx.dtype != torch.long):
            return "a key band index that is not long [K, c]"
        if kq.bits == 16:
            if kq.data.dtype != dtype:
                return f"16-bit keys in {kq.data.dtype}, queries in {dtype}"
            if idx is not None:  # refused from the schedule too (schedule_reason)
                return "key bands beside 16-bit keys are not read by this kernel"
            continue
        if kq.data.dtype != torch.uint8 or not is_pow2(kq.group):
            return f"keys quantized in groups of {kq.group} tokens (it reads power-of-two groups)"
        if not _meta_ok(kq, dtype, kq.data.device):
            return f"key {_meta_desc(kq)} for {dtype} queries"
        if kq.dim not in (-2, 2) or tuple(kq.scale.shape) != (B, K, cap // kq.group, c) or cap % kq.group:
            return "keys not quantized per channel over token groups of the region"
    if seen != n:
        return f"key bands cover {seen} of {n} channels"
    if hq.bits == 16:
        return None if hq.data.dtype == dtype else f"16-bit latents in {hq.data.dtype}, queries in {dtype}"
    if hq.data.dtype != torch.uint8 or not is_pow2(hq.group):
        return f"latents quantized in groups of {hq.group} channels (it reads power-of-two groups)"
    if not _meta_ok(hq, dtype, hq.data.device):
        return f"latent {_meta_desc(hq)} for {dtype} queries"
    if hq.dim not in (-1, 3) or tuple(hq.scale.shape) != (B, G, cap, r.rank // hq.group) or r.rank % hq.group:
        return "latents not quantized per token over channel groups"
    return _planes_reason(r.rank, hq.bits, hq.group)


def _view(cache) -> LayerView:
    """The call's view without regions of no capacity (a static cache of no sinks): they hold nothing to attend."""
    v = cache if isinstance(cache, LayerView) else cache.view()
    return v if all(r.capacity for r in v.regions) else LayerView([r for r in v.regions if r.capacity], v.next_pos)


def supported(q: torch.Tensor, k_new: torch.Tensor, h_new: torch.Tensor, cache) -> str | None:
    """None when the kernel serves this call, else a one-line reason. It covers one new token, power-of-two head dim
    and groups, regions in the packed format of runtime/quant.py: keys at 2/3/4/8/16 bits, whole or in up to two
    channel bands (quant.Bands), latents at 2/4/8/16 bits, scales and zeros in the query's dtype or fp8 (META "8/16",
    "8/8"); keys after RoPE."""
    B, H, T, n = q.shape
    if T != 1:
        return f"{T} new tokens (the kernel decodes one)"
    if not runnable(q, k_new, h_new):
        return "CPU tensors (it runs on CUDA, or on the CPU under TRITON_INTERPRET=1)"
    if q.dtype not in TL_DTYPE or k_new.dtype != q.dtype or h_new.dtype != q.dtype:
        return f"queries in {q.dtype}, new keys in {k_new.dtype}, latents in {h_new.dtype} (one of float16, bfloat16, float32)"
    K, G = k_new.shape[1], h_new.shape[1]
    if not is_pow2(n) or n < 16 or H % K or K % G:
        return f"{H} query heads, {K} KV heads, {G} latent groups and head dim {n} (a power of two >= 16)"
    view = _view(cache)
    if any(isinstance(r, FragRegion) for r in view.regions):
        return "a view in the CUDA kernel's fragment layout"
    if any(r.rope is not None for r in view.regions):
        return "keys held before RoPE are not read by this kernel"
    if any(r.basis is not None for r in view.regions):
        return "low-rank keys are not read by this kernel"
    for r in view.regions:
        if why := _region_reason(r, B, K, G, n, q.dtype):
            return why
    keys = [kq for r in view.regions for kq, _ in _key_parts(r.keys)]
    if not runnable(q, *(kq.data for kq in keys), *(r.lat.data for r in view.regions)):
        return "cache tensors on another device than the queries"
    gk = {kq.group for kq in keys if kq.bits != 16}
    gv = {r.lat.group for r in view.regions if r.lat.bits != 16}
    if len(gk) > 1 or len(gv) > 1:
        return f"key groups {sorted(gk)} and latent groups {sorted(gv)} differ between regions"
    npos = view.next_pos
    if isinstance(npos, torch.Tensor) and (npos.numel() != 1 or npos.dtype not in (torch.int32, torch.int64)):
        return "next_pos is not a one-element integer tensor"
    return None


def schedule_reason(schedule, head_dim: int) -> str | None:
    """None when the kernel reads every region of a cache of this schedule (runtime/artifact.Schedule) at this head
    dim, else a one-line reason: what `supported` checks of a call, decided from the schedule, so that a backend
    refuses such a cache when it is made instead of being handed calls it cannot serve."""
    s = schedule
    if any(lv.key_rank for lv in s.levels):
        return "low-rank keys (key_rank) are not read by this kernel"
    if s.key_rope != "post":
        return "keys held before RoPE (key_rope 'pre') are not read by this kernel"
    if any(lv.key_axis != "channel" for lv in s.levels):
        return "per-token keys (key_axis 'token') are not read by this kernel"
    if any(lv.bits == 3 for lv in s.levels):
        return "3-bit latents are not read by this kernel"
    if any(lv.key_hi_bits and lv.key_bits == 16 for lv in s.levels):
        return "key bands beside 16-bit keys are not read by this kernel"
    if any(lv.key_hi_bits and not 8 <= lv.key_hi_channels <= head_dim - 8 for lv in s.levels):
        return f"key bands of fewer than 8 channels at head dim {head_dim}"
    if any(lv.key_bits != 16 for lv in s.levels) and not is_pow2(s.key_group):
        return f"keys quantized in groups of {s.key_group} tokens (it reads power-of-two groups)"
    if any(lv.bits != 16 for lv in s.levels) and not is_pow2(s.value_group):
        return f"latents quantized in groups of {s.value_group} channels (it reads power-of-two groups)"
    for ranks in s.ranks:
        for lv, rank in zip(s.levels, ranks):
            if why := _planes_reason(rank, lv.bits, s.value_group):
                return why
    return None


def _lat_planes(rank: int) -> tuple[int, int]:
    """(planes, channels per plane) of 8/16-bit latents: blocks of contiguous channels."""
    return (4, rank // 4) if rank % 4 == 0 and rank >= 128 else (1, rank)


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# the bands' channel indices [K, c_i] -> one [H, n] index on the query's device (per query head: its KV head's rows,
# the bands one after the other), made once per set of indices (before any CUDA graph captures a step), dropped with them
_HEAD_INDEX: dict[tuple, torch.Tensor] = {}


def _band_queries(
    q: torch.Tensor, index: list[torch.Tensor], rep: int, sh: float, dt: torch.dtype
) -> list[torch.Tensor]:
    """The query's channels of each key band, [B, H, 1, c_i] each in dt times sh: views of one kernel's output (the
    gather, the shift and the conversion in one launch per call)."""
    key = (*(id(i) for i in index), rep, str(q.device))
    hit = _HEAD_INDEX.get(key)
    if hit is None:
        hit = _HEAD_INDEX[key] = torch.cat(index, -1).to(q.device).repeat_interleave(rep, 0).contiguous()
        for i in index:
            weakref.finalize(i, _HEAD_INDEX.pop, key, None)
    B, H, _, n = q.shape
    out = torch.empty(B, H, 1, n, device=q.device, dtype=dt)
    _query_kernel[(B * H,)](q, q.stride(0), q.stride(1), hit, out, sh, H, N=n, num_warps=1)
    return list(torch.split(out, [i.shape[-1] for i in index], dim=-1))


def _bias_arg(t: QTensor):
    """(argument, is a pointer) of an fp8 bias: a device scalar as it is, a float as a float (1.0: "16")."""
    if isinstance(t.bias, torch.Tensor):
        return t.bias, True
    return float(t.bias) if t.meta != "16" else 1.0, False


def _region_args(
    r: Region,
    q: torch.Tensor,
    rep: int,
    n: int,
    g: int,
    KG: int,
    block_t: int,
    ns: int,
    asm: tuple[int, ...],
    sh: float = 1.0,
    raw: torch.Tensor | None = None,
) -> tuple[tuple, tuple]:
    """The region's runtime and constexpr tuples (their layout: RT_KEY0 / CT_KEY0 above). q: the query as the dots
    read it (times sh, in their dtype); key bands gather theirs from `raw` (the caller's query; default q)."""
    hq = r.lat
    parts = _key_parts(r.keys)
    hb = hq.bits
    # packed latents stored channel-major (the static cache's buffers): read in place, s_ht = a channel byte's stride
    HT = hb < 8 and hq.data.stride(-2) == 1 and hq.data.stride(-1) != 1
    ht = hq.data if HT else _c(hq.data)
    hs, hz = (_c(hq.scale), _c(hq.zero)) if hq.bits != 16 else (ht, ht)  # never read at 16 bits
    hbias, hbp = _bias_arg(hq)
    BT = block_t if (hb != 16 or any(kq.bits != 16 for kq, _ in parts)) else 32
    NPH, P = (8 // hb, r.rank * hb // 8) if hb < 8 else _lat_planes(r.rank)
    PP = max(16, pow2(P))
    ln = r.length
    rt = [ht, *ht.stride()[:2], ht.stride(3) if HT else ht.stride(2), hs, hz, *hs.stride()[:3], hbias]
    rt += [r.pos, r.pos.stride(0), ln, ns, sh]
    ct = [r.rank, NPH, P, PP, BT, PP >= 32, isinstance(ln, torch.Tensor), hb, _meta_code(hq), hbp, hb in asm]
    ct += [max(1, BT // KG), len(parts), sh, HT]
    # per part [B, H, 1, c]: per query head, the channels of its KV head in that band
    src, ssh = (q, 1.0) if raw is None else (raw, sh)
    qs = [q] if parts[0][1] is None else _band_queries(src, [i for _, i in parts], rep, ssh, q.dtype)
    for (kq, idx), qj in zip(parts, qs):
        kb, c = kq.bits, n if idx is None else idx.shape[-1]
        kt = _c(kq.data)
        ks, kz = (_c(kq.scale), _c(kq.zero)) if kb != 16 else (kt, kt)
        kbias, kbp = _bias_arg(kq)
        NPK = 8 // kb if kb in (2, 4) else 8 if kb == 3 else (4 if c >= 64 else 1)  # 3 bits: 8 sub-planes
        KW = max(16, pow2(g * c // NPK))  # tiles of width 4 or 8 came out wrong compiled (Triton 3.6, H100)
        rt += [qj, qj.stride(0), qj.stride(1), kt, *kt.stride()[:3], ks, kz, *ks.stride()[:3], kbias]
        ct += [kb, c, NPK, KW, KW >= 32, kb in asm, _meta_code(kq) if kb != 16 else 0, kbp]
    return tuple(rt), tuple(ct)


def _key_bits(keys) -> float:
    """Key bits per channel of a region (bands: the parts' channel-weighted mean)."""
    parts = _key_parts(keys)
    n = sum(kq.shape[-1] for kq, _ in parts)
    return sum(kq.bits * kq.shape[-1] for kq, _ in parts) / n


def _splits(
    view: LayerView, B: int, G: int, n: int, K: int, sms: int, waves: float, min_split: int, split_tokens: int | None
) -> list[int]:
    """Splits per region, from capacities only (graph-safe): about `waves` programs per SM in all,
    shared by the regions in proportion to their bytes, at least `min_split` slots each."""
    caps = [r.capacity for r in view.regions]
    if split_tokens:
        return [max(1, triton.cdiv(cp, split_tokens)) for cp in caps]
    cost = [cp * (K * n * _key_bits(r.keys) + G * r.rank * r.lat.bits) for cp, r in zip(caps, view.regions)]
    total = max(1.0, waves * sms / (B * G))
    out = []
    for cp, w in zip(caps, cost):
        want = round(total * w / max(1, sum(cost)))
        out.append(max(1, min(triton.cdiv(cp, min_split), want)))
    return out


def _partials(B: int, H: int, R: int, splits: list[int], dev) -> tuple[int, tuple[torch.Tensor, ...]]:
    """Per-split partial results of both kernels: running max m and sum l [B, H, S], accumulator [B, H, S, RPAD],
    and the rank of each slot's region [S] (written by its programs)."""
    n_slots = max(1, sum(splits))
    pm = torch.empty(B, H, n_slots, device=dev, dtype=torch.float32)
    pacc = torch.empty(B, H, n_slots, pow2(R), device=dev, dtype=torch.float32)
    return n_slots, (pm, torch.empty_like(pm), pacc, torch.empty(n_slots, device=dev, dtype=torch.int32))


def _partial_args(pm, pl, pacc, rk) -> tuple:
    """The partials as the kernels that write or merge them take them: pm_ptr, pl_ptr, pacc_ptr, s_acc, rk_ptr."""
    return pm, pl, pacc, pacc.stride(2), rk


# the combine launch (columns per program, slots per step, warps), by how many rows B * H it merges: few rows
# (batch 1) want narrow column blocks and long slot steps over 4 warps, many rows wide blocks over 2 warps. Swept
# on the H100 (docs/kernels.md: combine 8.6 -> 6.4 us at 32K B=1, 8.8 -> 5.5 at 32K B=4, 23.1 -> 13.3 at 32K B=16).
# A dict here overrides the choice (benchmarks sweep it).
COMBINE: dict | None = None


def _combine_launch(rows: int, sms: int) -> dict:
    if COMBINE is not None:
        return COMBINE
    return {"BR": 64, "BS": 128, "num_warps": 4} if 2 * rows <= sms else {"BR": 128, "BS": 64, "num_warps": 2}


def _combine(pm, pl, pacc, rk, n_slots: int, q, k_new, h_new, qk: float, rep: int, g: int) -> torch.Tensor:
    """Merge the splits' partials by log-sum-exp with the new token's own score and latent -> z [B, 1, H, R]."""
    B, H, _, n = q.shape
    R = h_new.shape[-1]
    z = torch.empty(B, 1, H, R, device=q.device, dtype=torch.float32)
    cfg = _combine_launch(B * H, _num_sms(q.device))
    BR = min(pacc.shape[-1], cfg["BR"])
    _combine_kernel[(B * H, triton.cdiv(R, BR))](
        *_partial_args(pm, pl, pacc, rk),
        z,
        n_slots,
        R,
        H,
        q,
        q.stride(0),
        q.stride(1),
        qk,
        k_new,
        k_new.stride(0),
        k_new.stride(1),
        h_new,
        h_new.stride(0),
        h_new.stride(1),
        N=n,
        REP=rep,
        GS=g,
        BS=cfg["BS"],
        BR=BR,
        num_warps=cfg["num_warps"],
    )
    return z


def _widths_and_groups(asm, q: torch.Tensor, regions) -> tuple[tuple[int, ...], int, int]:
    """What the decode kernel derives from its options and cache: the code widths unpacked by inline PTX
    (`asm`: True = 2, 3 and 4 bits; none in the interpreter or for float32), and the key / latent quantization
    groups (one each per view: `supported`)."""
    widths = (2, 3, 4) if asm is True else tuple(asm or ())
    if interpreting() or q.dtype == torch.float32:
        widths = ()
    KG = next((kq.group for r in regions for kq, _ in _key_parts(r.keys) if kq.bits != 16), 1)
    VG = next((r.lat.group for r in regions if r.lat.bits != 16), 1)
    return widths, KG, VG


@dataclass(frozen=True)
class TritonConfig:
    """The Triton decode kernel's tuning knobs (the "triton" backend's config; tale_runtime.set_backend takes one).

    split_tokens: slots per split (tests); otherwise the regions share about `waves` programs per SM, at least
    `min_split` slots each. block_t: slots per tile. asm: unpack 2/3/4-bit codes of 16-bit caches with inline PTX
    (True: all three widths; or a tuple of the widths that use it: docs/kernels.md compares them); compiled GPU runs
    only: the interpreter and float32 caches take the plain Triton path, as does asm=False. maxnreg: caps the
    registers per thread (more programs per SM, at the price of spills). q_in_loop: reload the query planes per tile
    (from a query converted once per call) instead of holding them in registers (3-bit keys always do).

    dot: the type the operands (queries, dequantized keys and latents, probabilities) enter the tensor cores in.
    float32 caches: always float32. None: float16 for a bfloat16 cache whose 16-bit scales and zeros are stored in
    float16 (runtime/quant.py meta_format: what quantize writes), else the cache's dtype. torch.float16 for a bfloat16
    cache rounds the dequantized values with 11 significant bits instead of 8: every operand is scaled by 2^-8 into
    float16's range (exact; undone in float32 on the logits and the accumulators), so values up to 1.6e7 in magnitude
    are safe; float16 metadata is stored so scaled and read as it is (docs/kernels.md: about 8x less error against
    the float32 reference than bfloat16 operands). torch.bfloat16 is refused for such caches (it would round their
    metadata again: ~1e-2 error); it serves bf16 tensors built with bfloat16 metadata, where torch.float16 converts
    every scale and zero per tile (4-36% more time).
    """

    block_t: int = 64
    split_tokens: int | None = None
    min_split: int = 64
    waves: float = 2.0
    num_warps: int = 4
    num_stages: int = 2
    q_in_loop: bool = False
    asm: bool | tuple[int, ...] = True
    maxnreg: int | None = None
    dot: torch.dtype | None = None

    def __post_init__(self):
        if self.dot not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"dot must be None, torch.float16 or torch.bfloat16, not {self.dot}")


DEFAULT = TritonConfig()


def latent_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    h_new: torch.Tensor,
    cache,
    scaling: float,
    window: int | None = None,
    config: TritonConfig | None = None,
) -> torch.Tensor:
    """tale_runtime.attention.latent_attention's result, z [B, T, H, R] (float32), by the Triton kernel.

    `cache` is a RegionStore or a LayerView. A decode step (T = 1) runs the Triton kernels, or is refused with a
    ValueError that names why (`supported`: a format the kernel does not read, CPU tensors unless
    TRITON_INTERPRET=1); it never runs anything slower in the kernel's name. A call of several new tokens (a prefill
    chunk: the backend signature takes T tokens, the kernel decodes one) is the torch reference's by design.
    `config`: the tuning knobs (TritonConfig; None: the defaults).
    """
    cfg = config or DEFAULT
    block_t, split_tokens, min_split, waves = cfg.block_t, cfg.split_tokens, cfg.min_split, cfg.waves
    num_warps, num_stages, q_in_loop, asm, maxnreg, dot = (
        cfg.num_warps,
        cfg.num_stages,
        cfg.q_in_loop,
        cfg.asm,
        cfg.maxnreg,
        cfg.dot,
    )
    if q.shape[2] != 1:  # a prefill chunk: not a decode step
        return reference(q, k_new, h_new, cache if isinstance(cache, LayerView) else cache.view(), scaling, window)
    view = _view(cache)
    if dot == torch.bfloat16 and q.dtype == torch.bfloat16 and _half_meta(view):
        raise ValueError(
            "dot=torch.bfloat16 would round this cache's float16 scales/zeros to bfloat16 (~1e-2 from the reference):"
            " use the default (float16)"
        )
    if why := supported(q, k_new, h_new, view):
        raise ValueError(f"triton latent attention: {why}")
    B, H, _, n = q.shape
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    rep, g = H // K, K // G
    dev = q.device
    if q.dtype == torch.float32:
        dt = q.dtype
    else:  # by default float16 for bf16 caches of float16 metadata: read as it is
        dt = dot or (torch.float16 if q.dtype == torch.bfloat16 and _half_meta(view) else q.dtype)
    sh = META_SHIFT if (dt == torch.float16 and q.dtype == torch.bfloat16) else 1.0  # bf16 caches into fp16 range
    q, k_new, h_new = _c(q), _c(k_new), _c(h_new)
    qk = scaling * LOG2E
    regions = view.regions
    asm_bits, KG, VG = _widths_and_groups(asm, q, regions)
    BT = max(32, block_t)  # 16-token tiles gave wrong results compiled (Triton 3.6, H200); not understood
    splits = _splits(view, B, G, n, K, _num_sms(dev), waves, min_split, split_tokens)
    n_slots, (pm, pl, pacc, rk) = _partials(B, H, R, splits, dev)
    npos, win = view.next_pos, window
    QGP = max(16, pow2(g * rep))
    # 3-bit keys have 8 sub-planes: more than the 4 query planes held in registers, so reloaded per tile
    q_in_loop = q_in_loop or any(kq.bits == 3 for r in regions for kq, _ in _key_parts(r.keys))
    # query planes held in registers are read from the caller's query and shifted by each program (QLOOP 2: no
    # launch for it); reloaded per tile (or gathered for key bands), the query is converted once per call first:
    # one kernel, computed in float32, rounded once
    raw = not q_in_loop and not any(type(r.keys) is Bands for r in regions)
    qd = q if (dt == q.dtype or raw) else torch.mul(q, sh, out=torch.empty(q.shape, device=dev, dtype=dt))
    slot0 = 0
    for i0 in range(0, len(regions), NREG):
        part = list(zip(regions[i0 : i0 + NREG], splits[i0 : i0 + NREG]))
        args = [_region_args(r, qd, rep, n, g, KG, BT, ns, asm_bits, sh, q) for r, ns in part]
        total = sum(ns for _, ns in part)
        bounds = [sum(ns for _, ns in part[:j]) if j < len(part) else total for j in range(1, NREG)]  # S1..S3
        while len(args) < NREG:
            args.append(args[0])
        _attn_kernel[(total, G, B)](
            qk,
            npos,
            0 if win is None else int(win),
            *_partial_args(pm, pl, pacc, rk),
            n_slots,
            H,
            slot0,
            *bounds,
            *(rt for rt, _ in args),
            *(ct for _, ct in args),
            GS=g,
            REP=rep,
            QGP=QGP,
            KG=KG,
            VG=VG,
            WIN=win is not None,
            NPP=isinstance(npos, torch.Tensor),
            NREG=len(part),
            DOT=TL_DTYPE[dt],
            QLOOP=1 if q_in_loop else 2 if raw else 0,
            num_warps=num_warps,
            num_stages=num_stages,
            **({"maxnreg": maxnreg} if maxnreg else {}),
        )
        slot0 += total
    return _combine(pm, pl, pacc, rk, n_slots if regions else 0, q, k_new, h_new, qk, rep, g)
