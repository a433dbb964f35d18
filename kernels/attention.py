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
Each program writes a partial (max, sum, acc[:rank]) into its slot; a second launch merges
the slots with the new token into z [B, 1, H, R]. Lengths and positions are read on the
device and the grid comes from capacities, so a call can be captured in a CUDA graph;
programs past a region's length write an empty partial.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from tale_runtime.cache import latent_attention as reference
from tale_runtime.quant import QTensor
from tale_runtime.regions import LayerView, Region

from ._common import TL_DTYPE, interpreting, is_pow2, plane, plane_asm, pow2, runnable, to_float

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
def _lat_plane(
    h_ptr,
    hb,
    hoff,
    hs_ptr,
    hz_ptr,
    soff,
    ok,
    tm,
    i: tl.constexpr,
    HBITS: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    VG: tl.constexpr,
    BT: tl.constexpr,
    DOT: tl.constexpr,
    ASM: tl.constexpr,
):
    """Latent channels i*P .. i*P + P - 1 of a tile, dequantized: [BT, PP] in DOT. Rows that are
    not real slots come out zero (scales masked), whatever the buffer holds there."""
    jp = tl.arange(0, PP)
    if HBITS < 16:  # per token over channel groups
        if P >= VG:  # whole groups in the plane: [BT, PP // VG]
            gi = tl.arange(0, PP // VG)
            gm = ok[:, None] & (gi < P // VG)[None, :]
            so = soff[:, None] + ((i * P) // VG + gi)[None, :]
            hs = tl.load(hs_ptr + so, mask=gm, other=0.0).to(DOT)
            hz = tl.load(hz_ptr + so, mask=gm, other=0.0).to(DOT)
        else:  # the plane lies inside one group: [BT]
            hs = tl.load(hs_ptr + soff + (i * P) // VG, mask=ok, other=0.0).to(DOT)
            hz = tl.load(hz_ptr + soff + (i * P) // VG, mask=ok, other=0.0).to(DOT)
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
            x = tl.load(
                h_ptr + hoff[:, None] + (i * P + jp)[None, :], mask=ok[:, None] & (jp < P)[None, :], other=0.0
            ).to(DOT)
        if HBITS < 16:
            if P >= VG:
                x = tl.reshape(tl.reshape(x, (BT, PP // VG, VG)) * hs[:, :, None] + hz[:, :, None], (BT, PP))
            else:
                x = x * hs[:, None] + hz[:, None]
    return x


@triton.jit
def _region(
    q_ptr,
    s_qb,
    s_qh,
    qk_scale,
    b,
    c,
    slot,
    spl,
    n_slots,
    H,
    next_pos,
    window,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    s_acc,
    rk_ptr,
    k_ptr,
    s_kb,
    s_kh,
    s_kt,
    ks_ptr,
    kz_ptr,
    s_ksb,
    s_ksh,
    s_kst,
    h_ptr,
    s_hb,
    s_hg,
    s_ht,
    hs_ptr,
    hz_ptr,
    s_hsb,
    s_hsg,
    s_hst,
    p_ptr,
    s_pb,
    len_arg,
    nsplit,
    N: tl.constexpr,
    GS: tl.constexpr,
    REP: tl.constexpr,
    QGP: tl.constexpr,
    KG: tl.constexpr,
    VG: tl.constexpr,
    WIN: tl.constexpr,
    DOT: tl.constexpr,
    QLOOP: tl.constexpr,
    KBITS: tl.constexpr,
    HBITS: tl.constexpr,
    RANK: tl.constexpr,
    NPK: tl.constexpr,
    KW: tl.constexpr,
    KROWS: tl.constexpr,
    NPH: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    BT: tl.constexpr,
    KDOT: tl.constexpr,
    HDOT: tl.constexpr,
    LENP: tl.constexpr,
    KASM: tl.constexpr,
    HASM: tl.constexpr,
):
    """One split of one region: partial (max, sum, acc[:RANK]) of the group's query heads."""
    QG: tl.constexpr = GS * REP
    PK: tl.constexpr = N // NPK  # key channels per plane (packed: bytes per head row)
    if LENP:
        L = tl.load(len_arg).to(tl.int32)
    else:
        L = len_arg
    chunk = tl.cdiv(tl.cdiv(L, nsplit), BT) * BT
    t_start = spl * chunk
    t_end = tl.minimum(t_start + chunk, L)

    rows = tl.arange(0, QGP)
    head = c * QG + rows
    rmask = rows < QG
    # key tile columns: KV head u // PK of the group, channel (plane) * PK + u % PK
    u = tl.arange(0, KW)
    ju = u // PK
    jj = u % PK
    um = u < GS * PK
    kvu = c * GS + ju
    # block-diagonal queries [QGP, KW] per plane, log2-domain scores
    pi = tl.arange(0, NPK)
    qm2 = rmask[:, None] & ((rows // REP)[:, None] == ju[None, :])
    qm = qm2[:, :, None]
    qoff = b * s_qb + head[:, None] * s_qh + jj[None, :]  # [QGP, KW]
    if QLOOP:  # the query planes are reloaded per tile (cache hits): fewer live registers
        q_scale = qk_scale
        qp0 = qoff
        qp1 = qoff
        qp2 = qoff
        qp3 = qoff
    else:
        q3 = tl.load(q_ptr + qoff[:, :, None] + pi[None, None, :] * PK, mask=qm, other=0.0)
        q3 = (q3.to(tl.float32) * qk_scale).to(DOT)
        qp0, qp1, qp2, qp3 = _split4(q3, NPK, QGP, KW)
        q_scale = 1.0
    koff = b * s_kb + kvu * s_kh + jj  # [KW]
    ksoff = b * s_ksb + kvu * s_ksh + jj
    hrow = b * s_hb + c * s_hg
    srow = b * s_hsb + c * s_hsg

    m_i = tl.full([QGP], float("-inf"), tl.float32)
    l_i = tl.zeros([QGP], tl.float32)
    acc0 = tl.zeros([QGP, PP], tl.float32)
    acc1 = tl.zeros([QGP, PP], tl.float32)
    acc2 = tl.zeros([QGP, PP], tl.float32)
    acc3 = tl.zeros([QGP, PP], tl.float32)
    jp = tl.arange(0, PP)
    for t0 in range(t_start, t_end, BT):
        t = t0 + tl.arange(0, BT)
        tm = t < t_end
        pv = tl.load(p_ptr + b * s_pb + t, mask=tm, other=-1)
        ok = pv >= 0
        if WIN:
            ok = ok & (next_pos - pv < window)
        # -- scores
        kmask = tm[:, None] & um[None, :]
        if KBITS < 8:
            kb = tl.load(k_ptr + koff[None, :] + t[:, None] * s_kt, mask=kmask, other=0)
        logits = tl.zeros([QGP, BT], tl.float32)
        for i in tl.static_range(NPK):
            if KBITS < 16:  # per channel over key groups: KROWS scale rows per tile
                r = t0 // KG + tl.arange(0, KROWS)
                sm = (r * KG < L)[:, None] & um[None, :]
                so = ksoff[None, :] + i * PK + r[:, None] * s_kst
                ks = tl.load(ks_ptr + so, mask=sm, other=0.0).to(DOT)
                kz = tl.load(kz_ptr + so, mask=sm, other=0.0).to(DOT)
            if KBITS < 8 and KASM:  # unpack and scale in one PTX block, 4 codes per register
                kc = plane_asm(tl.reshape(kb, (KROWS, BT // KROWS, KW)), ks[:, None, :], kz[:, None, :], i, KBITS, DOT)
                kc = tl.reshape(kc, (BT, KW))
            else:
                if KBITS < 8:
                    kc = plane(kb, i, KBITS, DOT)
                elif KBITS == 8:
                    kc = to_float(
                        tl.load(k_ptr + koff[None, :] + i * PK + t[:, None] * s_kt, mask=kmask, other=0).to(tl.int32),
                        8,
                        DOT,
                    )
                else:
                    kc = tl.load(k_ptr + koff[None, :] + i * PK + t[:, None] * s_kt, mask=kmask, other=0.0).to(DOT)
                if KBITS < 16:
                    kc = tl.reshape(
                        tl.reshape(kc, (KROWS, BT // KROWS, KW)) * ks[:, None, :] + kz[:, None, :], (BT, KW)
                    )
            if QLOOP:
                qi = tl.load(q_ptr + qoff + i * PK, mask=qm2, other=0.0).to(DOT)
            elif i == 0:
                qi = qp0
            elif i == 1:
                qi = qp1
            elif i == 2:
                qi = qp2
            else:
                qi = qp3
            logits = _dot(qi, tl.trans(kc), logits, KDOT)
        if QLOOP:
            logits = logits * q_scale
        logits = tl.where(ok[None, :], logits, float("-inf"))
        # -- online softmax
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(logits - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        pd = p.to(DOT)

        # -- latents, plane by plane
        hoff = hrow + t * s_ht
        soff = srow + t * s_hst
        hb = pv  # stands in when the latents are not packed
        if HBITS < 8:
            hb = tl.load(h_ptr + hoff[:, None] + jp[None, :], mask=tm[:, None] & (jp < P)[None, :], other=0)
        acc0 = _dot(
            pd,
            _lat_plane(h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, 0, HBITS, P, PP, VG, BT, DOT, HASM),
            acc0 * alpha[:, None],
            HDOT,
        )
        if NPH > 1:
            acc1 = _dot(
                pd,
                _lat_plane(h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, 1, HBITS, P, PP, VG, BT, DOT, HASM),
                acc1 * alpha[:, None],
                HDOT,
            )
        if NPH > 2:
            acc2 = _dot(
                pd,
                _lat_plane(h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, 2, HBITS, P, PP, VG, BT, DOT, HASM),
                acc2 * alpha[:, None],
                HDOT,
            )
            acc3 = _dot(
                pd,
                _lat_plane(h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, 3, HBITS, P, PP, VG, BT, DOT, HASM),
                acc3 * alpha[:, None],
                HDOT,
            )

    # -- the partial of this split: channels past RANK are never written (the combine skips them)
    prow = (b * H + head) * n_slots + slot
    tl.store(rk_ptr + slot + tl.arange(0, 1), tl.full([1], RANK, tl.int32))  # the combine reads this many channels
    tl.store(pm_ptr + prow, m_i, mask=rmask)
    tl.store(pl_ptr + prow, l_i, mask=rmask)
    am = rmask[:, None] & (jp < P)[None, :]
    base = pacc_ptr + prow[:, None] * s_acc + jp[None, :]
    tl.store(base, acc0, mask=am)
    if NPH > 1:
        tl.store(base + P, acc1, mask=am)
    if NPH > 2:
        tl.store(base + 2 * P, acc2, mask=am)
        tl.store(base + 3 * P, acc3, mask=am)


@triton.jit
def _attn_kernel(
    q_ptr,
    s_qb,
    s_qh,
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
    k0,
    s_kb0,
    s_kh0,
    s_kt0,
    ks0,
    kz0,
    s_ksb0,
    s_ksh0,
    s_kst0,
    h0,
    s_hb0,
    s_hg0,
    s_ht0,
    hs0,
    hz0,
    s_hsb0,
    s_hsg0,
    s_hst0,
    pos0,
    s_pb0,
    ln0,
    ns0,
    k1,
    s_kb1,
    s_kh1,
    s_kt1,
    ks1,
    kz1,
    s_ksb1,
    s_ksh1,
    s_kst1,
    h1,
    s_hb1,
    s_hg1,
    s_ht1,
    hs1,
    hz1,
    s_hsb1,
    s_hsg1,
    s_hst1,
    pos1,
    s_pb1,
    ln1,
    ns1,
    k2,
    s_kb2,
    s_kh2,
    s_kt2,
    ks2,
    kz2,
    s_ksb2,
    s_ksh2,
    s_kst2,
    h2,
    s_hb2,
    s_hg2,
    s_ht2,
    hs2,
    hz2,
    s_hsb2,
    s_hsg2,
    s_hst2,
    pos2,
    s_pb2,
    ln2,
    ns2,
    k3,
    s_kb3,
    s_kh3,
    s_kt3,
    ks3,
    kz3,
    s_ksb3,
    s_ksh3,
    s_kst3,
    h3,
    s_hb3,
    s_hg3,
    s_ht3,
    hs3,
    hz3,
    s_hsb3,
    s_hsg3,
    s_hst3,
    pos3,
    s_pb3,
    ln3,
    ns3,
    KBITS0: tl.constexpr,
    HBITS0: tl.constexpr,
    RANK0: tl.constexpr,
    NPK0: tl.constexpr,
    KW0: tl.constexpr,
    KROWS0: tl.constexpr,
    NPH0: tl.constexpr,
    P0: tl.constexpr,
    PP0: tl.constexpr,
    BT0: tl.constexpr,
    KDOT0: tl.constexpr,
    HDOT0: tl.constexpr,
    LENP0: tl.constexpr,
    KASM0: tl.constexpr,
    HASM0: tl.constexpr,
    KBITS1: tl.constexpr,
    HBITS1: tl.constexpr,
    RANK1: tl.constexpr,
    NPK1: tl.constexpr,
    KW1: tl.constexpr,
    KROWS1: tl.constexpr,
    NPH1: tl.constexpr,
    P1: tl.constexpr,
    PP1: tl.constexpr,
    BT1: tl.constexpr,
    KDOT1: tl.constexpr,
    HDOT1: tl.constexpr,
    LENP1: tl.constexpr,
    KASM1: tl.constexpr,
    HASM1: tl.constexpr,
    KBITS2: tl.constexpr,
    HBITS2: tl.constexpr,
    RANK2: tl.constexpr,
    NPK2: tl.constexpr,
    KW2: tl.constexpr,
    KROWS2: tl.constexpr,
    NPH2: tl.constexpr,
    P2: tl.constexpr,
    PP2: tl.constexpr,
    BT2: tl.constexpr,
    KDOT2: tl.constexpr,
    HDOT2: tl.constexpr,
    LENP2: tl.constexpr,
    KASM2: tl.constexpr,
    HASM2: tl.constexpr,
    KBITS3: tl.constexpr,
    HBITS3: tl.constexpr,
    RANK3: tl.constexpr,
    NPK3: tl.constexpr,
    KW3: tl.constexpr,
    KROWS3: tl.constexpr,
    NPH3: tl.constexpr,
    P3: tl.constexpr,
    PP3: tl.constexpr,
    BT3: tl.constexpr,
    KDOT3: tl.constexpr,
    HDOT3: tl.constexpr,
    LENP3: tl.constexpr,
    KASM3: tl.constexpr,
    HASM3: tl.constexpr,
    N: tl.constexpr,
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
    sp = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    S0 = 0
    if NPP:
        next_pos = tl.load(np_arg).to(tl.int32)
    else:
        next_pos = np_arg
    if sp < S1:
        _region(
            q_ptr,
            s_qb,
            s_qh,
            qk_scale,
            b,
            c,
            slot0 + sp,
            sp - S0,
            n_slots,
            H,
            next_pos,
            window,
            pm_ptr,
            pl_ptr,
            pacc_ptr,
            s_acc,
            rk_ptr,
            k0,
            s_kb0,
            s_kh0,
            s_kt0,
            ks0,
            kz0,
            s_ksb0,
            s_ksh0,
            s_kst0,
            h0,
            s_hb0,
            s_hg0,
            s_ht0,
            hs0,
            hz0,
            s_hsb0,
            s_hsg0,
            s_hst0,
            pos0,
            s_pb0,
            ln0,
            ns0,
            N,
            GS,
            REP,
            QGP,
            KG,
            VG,
            WIN,
            DOT,
            QLOOP,
            KBITS0,
            HBITS0,
            RANK0,
            NPK0,
            KW0,
            KROWS0,
            NPH0,
            P0,
            PP0,
            BT0,
            KDOT0,
            HDOT0,
            LENP0,
            KASM0,
            HASM0,
        )
    elif NREG > 1:
        if sp < S2:
            _region(
                q_ptr,
                s_qb,
                s_qh,
                qk_scale,
                b,
                c,
                slot0 + sp,
                sp - S1,
                n_slots,
                H,
                next_pos,
                window,
                pm_ptr,
                pl_ptr,
                pacc_ptr,
                s_acc,
                rk_ptr,
                k1,
                s_kb1,
                s_kh1,
                s_kt1,
                ks1,
                kz1,
                s_ksb1,
                s_ksh1,
                s_kst1,
                h1,
                s_hb1,
                s_hg1,
                s_ht1,
                hs1,
                hz1,
                s_hsb1,
                s_hsg1,
                s_hst1,
                pos1,
                s_pb1,
                ln1,
                ns1,
                N,
                GS,
                REP,
                QGP,
                KG,
                VG,
                WIN,
                DOT,
                QLOOP,
                KBITS1,
                HBITS1,
                RANK1,
                NPK1,
                KW1,
                KROWS1,
                NPH1,
                P1,
                PP1,
                BT1,
                KDOT1,
                HDOT1,
                LENP1,
                KASM1,
                HASM1,
            )
        elif NREG > 2:
            if sp < S3:
                _region(
                    q_ptr,
                    s_qb,
                    s_qh,
                    qk_scale,
                    b,
                    c,
                    slot0 + sp,
                    sp - S2,
                    n_slots,
                    H,
                    next_pos,
                    window,
                    pm_ptr,
                    pl_ptr,
                    pacc_ptr,
                    s_acc,
                    rk_ptr,
                    k2,
                    s_kb2,
                    s_kh2,
                    s_kt2,
                    ks2,
                    kz2,
                    s_ksb2,
                    s_ksh2,
                    s_kst2,
                    h2,
                    s_hb2,
                    s_hg2,
                    s_ht2,
                    hs2,
                    hz2,
                    s_hsb2,
                    s_hsg2,
                    s_hst2,
                    pos2,
                    s_pb2,
                    ln2,
                    ns2,
                    N,
                    GS,
                    REP,
                    QGP,
                    KG,
                    VG,
                    WIN,
                    DOT,
                    QLOOP,
                    KBITS2,
                    HBITS2,
                    RANK2,
                    NPK2,
                    KW2,
                    KROWS2,
                    NPH2,
                    P2,
                    PP2,
                    BT2,
                    KDOT2,
                    HDOT2,
                    LENP2,
                    KASM2,
                    HASM2,
                )
            elif NREG > 3:
                _region(
                    q_ptr,
                    s_qb,
                    s_qh,
                    qk_scale,
                    b,
                    c,
                    slot0 + sp,
                    sp - S3,
                    n_slots,
                    H,
                    next_pos,
                    window,
                    pm_ptr,
                    pl_ptr,
                    pacc_ptr,
                    s_acc,
                    rk_ptr,
                    k3,
                    s_kb3,
                    s_kh3,
                    s_kt3,
                    ks3,
                    kz3,
                    s_ksb3,
                    s_ksh3,
                    s_kst3,
                    h3,
                    s_hb3,
                    s_hg3,
                    s_ht3,
                    hs3,
                    hz3,
                    s_hsb3,
                    s_hsg3,
                    s_hst3,
                    pos3,
                    s_pb3,
                    ln3,
                    ns3,
                    N,
                    GS,
                    REP,
                    QGP,
                    KG,
                    VG,
                    WIN,
                    DOT,
                    QLOOP,
                    KBITS3,
                    HBITS3,
                    RANK3,
                    NPK3,
                    KW3,
                    KROWS3,
                    NPH3,
                    P3,
                    PP3,
                    BT3,
                    KDOT3,
                    HDOT3,
                    LENP3,
                    KASM3,
                    HASM3,
                )


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


# -- host side -------------------------------------------------------------------------------

NREG = 4  # region slots of one launch
_QFIELDS = {"data", "scale", "zero", "bits", "group", "dim"}


def _plain_qtensor(t: QTensor) -> bool:
    """A QTensor in the format the kernel reads: any field added since (a new metadata format)
    must still hold its default, otherwise the kernel declines."""
    if type(t) is not QTensor:
        return False
    for f in dataclasses.fields(t):
        if f.name in _QFIELDS:
            continue
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        )
        if default is dataclasses.MISSING or getattr(t, f.name) != default:
            return False
    return True


def _region_ok(r: Region, B: int, K: int, G: int, n: int, dtype: torch.dtype) -> bool:
    kq, hq = r.keys, r.lat
    if not (_plain_qtensor(kq) and _plain_qtensor(hq)) or kq.bits not in (2, 4, 8, 16) or hq.bits not in (2, 4, 8, 16):
        return False
    cap = r.capacity
    if r.pos.dtype != torch.int32 or tuple(r.pos.shape) != (B, cap) or r.pos.stride(-1) != 1 or cap == 0:
        return False
    ln = r.length
    if isinstance(ln, torch.Tensor) and (ln.numel() != 1 or ln.dtype not in (torch.int32, torch.int64)):
        return False
    if tuple(kq.shape) != (B, K, cap, n) or tuple(hq.shape) != (B, G, cap, r.rank) or hq.shape[-2] != cap:
        return False
    for t, bits in ((kq, kq.bits), (hq, hq.bits)):
        if bits == 16:
            if t.data.dtype != dtype:
                return False
            continue
        if t.data.dtype != torch.uint8 or t.scale is None or t.zero is None or not is_pow2(t.group):
            return False
        if t.scale.dtype != dtype or t.zero.dtype != dtype or t.scale.shape != t.zero.shape:
            return False
    if kq.bits != 16:
        if kq.dim not in (-2, 2) or tuple(kq.scale.shape) != (B, K, cap // kq.group, n) or cap % kq.group:
            return False
    if hq.bits != 16:
        P = r.rank * hq.bits // 8 if hq.bits < 8 else _lat_planes(r.rank)[1]
        if hq.dim not in (-1, 3) or tuple(hq.scale.shape) != (B, G, cap, r.rank // hq.group) or r.rank % hq.group:
            return False
        if not (P % hq.group == 0 or (hq.group % P == 0 and is_pow2(P))):  # groups must not straddle planes
            return False
    return True


def _view(cache) -> LayerView:
    return cache if isinstance(cache, LayerView) else cache.view()


def supported(q: torch.Tensor, k_new: torch.Tensor, h_new: torch.Tensor, cache) -> bool:
    """What the kernel covers: one new token, power-of-two head dim and groups, 2/4/8/16-bit
    regions in the packed format of runtime/quant.py with scales in the query's dtype."""
    B, H, T, n = q.shape
    if T != 1 or not runnable(q, k_new, h_new) or q.dtype not in TL_DTYPE:
        return False
    K, G = k_new.shape[1], h_new.shape[1]
    if not is_pow2(n) or n < 16 or H % K or K % G or k_new.dtype != q.dtype or h_new.dtype != q.dtype:
        return False
    view = _view(cache)
    if not all(_region_ok(r, B, K, G, n, q.dtype) for r in view.regions):
        return False
    if not runnable(q, *(r.keys.data for r in view.regions), *(r.lat.data for r in view.regions)):
        return False
    gk = {r.keys.group for r in view.regions if r.keys.bits != 16}
    gv = {r.lat.group for r in view.regions if r.lat.bits != 16}
    if len(gk) > 1 or len(gv) > 1:
        return False
    npos = view.next_pos
    return not isinstance(npos, torch.Tensor) or (npos.numel() == 1 and npos.dtype in (torch.int32, torch.int64))


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


def _region_args(r: Region, n: int, g: int, KG: int, block_t: int, ns: int, asm: tuple[int, ...]) -> tuple[list, list]:
    kq, hq = r.keys, r.lat
    kt, ht = _c(kq.data), _c(hq.data)
    ks, kz = (_c(kq.scale), _c(kq.zero)) if kq.bits != 16 else (kt, kt)  # never read at 16 bits
    hs, hz = (_c(hq.scale), _c(hq.zero)) if hq.bits != 16 else (ht, ht)
    kb, hb = kq.bits, hq.bits
    BT = block_t if (kb != 16 or hb != 16) else 32
    NPK = 8 // kb if kb < 8 else (4 if n >= 64 else 1)
    PK = n // NPK
    KW = max(16, pow2(g * PK))  # tiles of width 4 or 8 came out wrong compiled (Triton 3.6, H100)
    NPH, P = (8 // hb, r.rank * hb // 8) if hb < 8 else _lat_planes(r.rank)
    PP = max(16, pow2(P))
    ln = r.length
    lenp = isinstance(ln, torch.Tensor)
    rt = [
        kt,
        kt.stride(0),
        kt.stride(1),
        kt.stride(2),
        ks,
        kz,
        ks.stride(0),
        ks.stride(1),
        ks.stride(2),
        ht,
        ht.stride(0),
        ht.stride(1),
        ht.stride(2),
        hs,
        hz,
        hs.stride(0),
        hs.stride(1),
        hs.stride(2),
        r.pos,
        r.pos.stride(0),
        ln,
        ns,
    ]
    ct = [kb, hb, r.rank, NPK, KW, max(1, BT // KG), NPH, P, PP, BT, KW >= 32, PP >= 32, lenp, kb in asm, hb in asm]
    return rt, ct


def _splits(
    view: LayerView, B: int, G: int, n: int, K: int, sms: int, waves: float, min_split: int, split_tokens: int | None
) -> list[int]:
    """Splits per region, from capacities only (graph-safe): about `waves` programs per SM in all,
    shared by the regions in proportion to their bytes, at least `min_split` slots each."""
    caps = [r.capacity for r in view.regions]
    if split_tokens:
        return [max(1, triton.cdiv(cp, split_tokens)) for cp in caps]
    cost = [cp * (K * n * r.keys.bits + G * r.rank * r.lat.bits) for cp, r in zip(caps, view.regions)]
    total = max(1.0, waves * sms / (B * G))
    out = []
    for cp, w in zip(caps, cost):
        want = round(total * w / max(1, sum(cost)))
        out.append(max(1, min(triton.cdiv(cp, min_split), want)))
    return out


def latent_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    h_new: torch.Tensor,
    cache,
    scaling: float,
    *,
    block_t: int = 64,
    split_tokens: int | None = None,
    min_split: int = 64,
    waves: float = 2.0,
    num_warps: int = 4,
    num_stages: int = 2,
    q_in_loop: bool = True,
    asm: bool | tuple[int, ...] = True,
    maxnreg: int | None = None,
    split: bool | dict = False,
) -> torch.Tensor:
    """Drop-in for tale_runtime.cache.latent_attention: z [B, T, H, R] (float32).

    `cache` is a TaleLayerCache or a LayerView. Decode steps (T = 1) run the Triton kernels;
    anything else (prefill chunks, CPU tensors unless TRITON_INTERPRET=1, formats the kernel
    does not read) runs the torch reference. `split_tokens` fixes the slots per split (tests);
    otherwise the regions share about `waves` programs per SM, at least `min_split` slots each.
    `asm` unpacks 2/4-bit codes of 16-bit caches with inline PTX (True: both widths; or a tuple of
    the widths that use it). Compiled GPU runs only: the interpreter and float32 caches take the
    plain Triton path, as does asm=False. `maxnreg` caps the registers per thread (more programs
    per SM, at the price of spills). `split` runs the two-pass kernel of attention_split.py instead
    (True, or a dict of its options: `k_tiles`, `k_warps`, ...).
    """
    view = _view(cache)
    if not supported(q, k_new, h_new, view):
        return reference(q, k_new, h_new, view, scaling)
    if split:
        from .attention_split import latent_attention_split

        kw = dict(block_t=block_t, split_tokens=split_tokens, min_split=min_split, waves=waves, asm=asm)
        return latent_attention_split(
            q, k_new, h_new, view, scaling, **{**kw, **(split if isinstance(split, dict) else {})}
        )
    B, H, _, n = q.shape
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    rep, g = H // K, K // G
    dev = q.device
    dtype = TL_DTYPE[q.dtype]
    q, k_new, h_new = _c(q), _c(k_new), _c(h_new)
    qk = scaling * LOG2E
    regions = view.regions
    asm_bits = (2, 4) if asm is True else tuple(asm or ())
    if interpreting() or q.dtype == torch.float32:
        asm_bits = ()
    KG = next((r.keys.group for r in regions if r.keys.bits != 16), 1)
    VG = next((r.lat.group for r in regions if r.lat.bits != 16), 1)
    BT = max(32, block_t)  # 16-token tiles gave wrong results compiled (Triton 3.6, H200); not understood
    splits = _splits(view, B, G, n, K, _num_sms(dev), waves, min_split, split_tokens)
    n_slots = max(1, sum(splits))
    RPAD = pow2(R)
    pm = torch.empty(B, H, n_slots, device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B, H, n_slots, RPAD, device=dev, dtype=torch.float32)
    rk = torch.empty(n_slots, device=dev, dtype=torch.int32)  # rank of each slot's region, written by its programs
    npos, win = view.next_pos, view.window
    QGP = max(16, pow2(g * rep))
    slot0 = 0
    for i0 in range(0, len(regions), NREG):
        part = list(zip(regions[i0 : i0 + NREG], splits[i0 : i0 + NREG]))
        args = [_region_args(r, n, g, KG, BT, ns, asm_bits) for r, ns in part]
        total = sum(ns for _, ns in part)
        bounds = [sum(ns for _, ns in part[:j]) if j < len(part) else total for j in range(1, NREG)]  # S1..S3
        while len(args) < NREG:
            args.append(args[0])
        rt = [a for r_, _ in args for a in r_]
        ct = {
            f"{name}{j}": v
            for j, (_, c_) in enumerate(args)
            for name, v in zip(
                (
                    "KBITS",
                    "HBITS",
                    "RANK",
                    "NPK",
                    "KW",
                    "KROWS",
                    "NPH",
                    "P",
                    "PP",
                    "BT",
                    "KDOT",
                    "HDOT",
                    "LENP",
                    "KASM",
                    "HASM",
                ),
                c_,
            )
        }
        _attn_kernel[(total, G, B)](
            q,
            q.stride(0),
            q.stride(1),
            qk,
            npos,
            0 if win is None else int(win),
            pm,
            pl,
            pacc,
            pacc.stride(2),
            rk,
            n_slots,
            H,
            slot0,
            *bounds,
            *rt,
            N=n,
            GS=g,
            REP=rep,
            QGP=QGP,
            KG=KG,
            VG=VG,
            WIN=win is not None,
            NPP=isinstance(npos, torch.Tensor),
            NREG=len(part),
            DOT=dtype,
            QLOOP=q_in_loop,
            **ct,
            num_warps=num_warps,
            num_stages=num_stages,
            **({"maxnreg": maxnreg} if maxnreg else {}),
        )
        slot0 += total
    z = torch.empty(B, 1, H, R, device=dev, dtype=torch.float32)
    BR = min(RPAD, 64)
    _combine_kernel[(B * H, triton.cdiv(R, BR))](
        pm,
        pl,
        pacc,
        pacc.stride(2),
        rk,
        z,
        n_slots if regions else 0,
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
        BS=64,
        BR=BR,
        num_warps=4,
    )
    return z
