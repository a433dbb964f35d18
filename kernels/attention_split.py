"""Decode attention (T = 1) in two passes split by role: keys, then latents.

The one-pass kernel (attention.py) chains, per 64-slot tile, the key unpack, the score dot, a
cross-warp max and sum, the rescale and the latent dots: on the H100 that loop is latency-bound
(docs/kernels.md). Here each pass does one job:

1. `_keys_kernel`, grid (tile programs, G, B): unpack a tile of keys, score it against the
   group's query heads on tensor cores (block-diagonal query, as attention.py), mask it and
   store the float32 log2-domain logits [B, H, slots]. No reduction, no loop-carried state:
   programs are independent, so the launch is wide and the loop pipelines.
2. `_lat_kernel`, grid (splits, G, B): per split, the max of its logits (a first sweep that
   reads them back, mostly from L2), then p = exp2(logit - max) and p @ latents plane by plane,
   with no rescaling. Writes the same partials (max, sum, acc) as attention.py, merged with the
   new token by its `_combine_kernel`.

The logits cost 4 bytes per slot and query head written once and read twice: 128 B per token at
Llama-3.1-8B shapes against ~650 B of compressed cache per token (docs/kernels.md has the
arithmetic and the measurements). One launch per pass for up to four regions (NREG), then the combine; no host
syncs (lengths and next_pos may live on the device), so a call can be captured in a CUDA graph.
Formats: the plain layout only (`supported_split`); key bands, fp8 scales/zeros, 3-bit keys and float16 metadata
(what bf16 caches store) are left to the one-pass kernel, which latent_attention(split=...) then runs instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tale_runtime.quant import QTensor

from ._common import TL_DTYPE, plane, plane_asm, pow2, to_float
from .attention import (
    LOG2E,
    NREG,
    _c,
    _combine,
    _dot,
    _lat_plane,
    _lat_planes,
    _meta,
    _nth,
    _num_sms,
    _partials,
    _split4,
    _splits,
    _store_partial,
    _view,
    _widths_and_groups,
)


@triton.jit
def _keys_region(
    pid,
    c,
    b,
    next_pos,
    q_ptr,
    s_qb,
    s_qh,
    qk_scale,
    window,
    lg_ptr,
    s_lgb,
    s_lgh,
    lg_off,
    k_ptr,
    s_kb,
    s_kh,
    s_kt,
    ks_ptr,
    kz_ptr,
    s_ksb,
    s_ksh,
    s_kst,
    p_ptr,
    s_pb,
    len_arg,
    N: tl.constexpr,
    GS: tl.constexpr,
    REP: tl.constexpr,
    QGP: tl.constexpr,
    KG: tl.constexpr,
    WIN: tl.constexpr,
    DOT: tl.constexpr,
    QREG: tl.constexpr,
    KBITS: tl.constexpr,
    NPK: tl.constexpr,
    KW: tl.constexpr,
    KROWS: tl.constexpr,
    BT: tl.constexpr,
    KDOT: tl.constexpr,
    LENP: tl.constexpr,
    KASM: tl.constexpr,
    TPP: tl.constexpr,
):
    """Logits of TPP tiles of BT slots (the region's program pid, head group c, batch row b):
    lg[b, head, lg_off + t]."""
    QG: tl.constexpr = GS * REP
    PK: tl.constexpr = N // NPK  # key channels per plane
    if LENP:
        L = tl.load(len_arg).to(tl.int32)
    else:
        L = len_arg
    rows = tl.arange(0, QGP)
    head = c * QG + rows
    rmask = rows < QG
    u = tl.arange(0, KW)  # key tile column: KV head u // PK of the group, channel plane * PK + u % PK
    ju = u // PK
    jj = u % PK
    um = u < GS * PK
    kvu = c * GS + ju
    qm2 = rmask[:, None] & ((rows // REP)[:, None] == ju[None, :])  # block-diagonal query
    qoff = b * s_qb + head[:, None] * s_qh + jj[None, :]
    koff = b * s_kb + kvu * s_kh + jj
    ksoff = b * s_ksb + kvu * s_ksh + jj
    lrow = b * s_lgb + head * s_lgh + lg_off
    if QREG:  # the query planes once per program, in registers
        pi = tl.arange(0, NPK)
        q3 = tl.load(q_ptr + qoff[:, :, None] + pi[None, None, :] * PK, mask=qm2[:, :, None], other=0.0).to(DOT)
        qp0, qp1, qp2, qp3 = _split4(q3, NPK, QGP, KW)
    t_lo = pid * (TPP * BT)
    for t0 in range(t_lo, tl.minimum(t_lo + TPP * BT, L), BT):
        t = t0 + tl.arange(0, BT)
        tm = t < L
        pv = tl.load(p_ptr + b * s_pb + t, mask=tm, other=-1)
        ok = pv >= 0
        if WIN:
            ok = ok & (next_pos - pv < window)
        kmask = tm[:, None] & um[None, :]
        if KBITS < 8:
            kb = tl.load(k_ptr + koff[None, :] + t[:, None] * s_kt, mask=kmask, other=0)
        logits = tl.zeros([QGP, BT], tl.float32)
        for i in tl.static_range(NPK):
            if KBITS < 16:  # per channel over key groups: KROWS scale rows per tile
                r = t0 // KG + tl.arange(0, KROWS)
                sm = (r * KG < L)[:, None] & um[None, :]
                so = ksoff[None, :] + i * PK + r[:, None] * s_kst
                ks, kz = _meta(ks_ptr, kz_ptr, so, sm, 1.0, 1.0, 0, DOT, 1.0)  # in the cache dtype (supported_split)
            if KBITS < 8 and KASM:
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
            if not QREG:
                qi = tl.load(q_ptr + qoff + i * PK, mask=qm2, other=0.0).to(DOT)
            else:
                qi = _nth(i, qp0, qp1, qp2, qp3)
            logits = _dot(qi, tl.trans(kc), logits, KDOT)
        logits = tl.where(ok[None, :], logits * qk_scale, float("-inf"))
        tl.store(lg_ptr + lrow[:, None] + t[None, :], logits, mask=rmask[:, None] & tm[None, :])


@triton.jit
def _keys_kernel(
    q_ptr,
    s_qb,
    s_qh,
    qk_scale,
    np_arg,
    window,
    lg_ptr,
    s_lgb,
    s_lgh,
    regs,
    N: tl.constexpr,
    GS: tl.constexpr,
    REP: tl.constexpr,
    QGP: tl.constexpr,
    KG: tl.constexpr,
    WIN: tl.constexpr,
    NPP: tl.constexpr,
    DOT: tl.constexpr,
    QREG: tl.constexpr,
    CFG: tl.constexpr,
    NR: tl.constexpr,
):
    """Program (p, head group c, batch row b) of the key pass over NR regions: region j owns programs
    regs[j][0] <= p < regs[j][1]; its tensors and strides are regs[j], its constexprs CFG[j]."""
    pid = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if NPP:
        next_pos = tl.load(np_arg).to(tl.int32)
    else:
        next_pos = np_arg
    for j in tl.static_range(NR):
        rg = regs[j]
        if (pid >= rg[0]) & (pid < rg[1]):
            _keys_region(
                pid - rg[0],
                c,
                b,
                next_pos,
                q_ptr,
                s_qb,
                s_qh,
                qk_scale,
                window,
                lg_ptr,
                s_lgb,
                s_lgh,
                rg[2],
                rg[3],
                rg[4],
                rg[5],
                rg[6],
                rg[7],
                rg[8],
                rg[9],
                rg[10],
                rg[11],
                rg[12],
                rg[13],
                rg[14],
                N,
                GS,
                REP,
                QGP,
                KG,
                WIN,
                DOT,
                QREG,
                CFG[j][0],
                CFG[j][1],
                CFG[j][2],
                CFG[j][3],
                CFG[j][4],
                CFG[j][5],
                CFG[j][6],
                CFG[j][7],
                CFG[j][8],
            )


@triton.jit
def _lat_region(
    sp,
    slot,
    c,
    b,
    next_pos,
    lg_ptr,
    s_lgb,
    s_lgh,
    window,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    s_acc,
    rk_ptr,
    n_slots,
    H,
    lg_off,
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
    GS: tl.constexpr,
    REP: tl.constexpr,
    QGP: tl.constexpr,
    VG: tl.constexpr,
    WIN: tl.constexpr,
    DOT: tl.constexpr,
    BT: tl.constexpr,
    HBITS: tl.constexpr,
    RANK: tl.constexpr,
    NPH: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    HDOT: tl.constexpr,
    LENP: tl.constexpr,
    HASM: tl.constexpr,
):
    """Partial (max, sum, acc[:RANK]) of split sp of a region for head group c, batch row b, into `slot`."""
    QG: tl.constexpr = GS * REP
    if LENP:
        L = tl.load(len_arg).to(tl.int32)
    else:
        L = len_arg
    chunk = tl.cdiv(tl.cdiv(L, nsplit), BT) * BT
    t_start = sp * chunk
    t_end = tl.minimum(t_start + chunk, L)
    rows = tl.arange(0, QGP)
    head = c * QG + rows
    rmask = rows < QG
    lrow = b * s_lgb + head * s_lgh + lg_off
    # the split's max first: elementwise over tiles, one reduction at the end
    mx = tl.full([QGP, BT], float("-inf"), tl.float32)
    for t0 in range(t_start, t_end, BT):
        t = t0 + tl.arange(0, BT)
        x = tl.load(
            lg_ptr + lrow[:, None] + t[None, :], mask=rmask[:, None] & (t < t_end)[None, :], other=float("-inf")
        )
        mx = tl.maximum(mx, x)
    m = tl.max(mx, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    ls = tl.zeros([QGP, BT], tl.float32)
    acc0 = tl.zeros([QGP, PP], tl.float32)
    acc1 = tl.zeros([QGP, PP], tl.float32)
    acc2 = tl.zeros([QGP, PP], tl.float32)
    acc3 = tl.zeros([QGP, PP], tl.float32)
    jp = tl.arange(0, PP)
    hm = (1.0, 1.0)  # no fp8 bias (supported_split), no shift
    hrow = b * s_hb + c * s_hg
    srow = b * s_hsb + c * s_hsg
    for t0 in range(t_start, t_end, BT):
        t = t0 + tl.arange(0, BT)
        tm = t < t_end
        pv = tl.load(p_ptr + b * s_pb + t, mask=tm, other=-1)
        ok = pv >= 0  # masked slots: latent scales loaded as 0, so NaN in the buffer cannot leak
        if WIN:
            ok = ok & (next_pos - pv < window)
        x = tl.load(lg_ptr + lrow[:, None] + t[None, :], mask=rmask[:, None] & tm[None, :], other=float("-inf"))
        p = tl.exp2(x - m_safe[:, None])
        ls += p
        pd = p.to(DOT)
        hoff = hrow + t * s_ht
        soff = srow + t * s_hst
        hb = pv  # stands in when the latents are not packed
        if HBITS < 8:
            hb = tl.load(h_ptr + hoff[:, None] + jp[None, :], mask=tm[:, None] & (jp < P)[None, :], other=0)
        acc0 = _dot(
            pd,
            _lat_plane(h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, hm, 0, HBITS, 0, P, PP, VG, BT, DOT, HASM, 1.0),
            acc0,
            HDOT,
        )
        if NPH > 1:
            acc1 = _dot(
                pd,
                _lat_plane(
                    h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, hm, 1, HBITS, 0, P, PP, VG, BT, DOT, HASM, 1.0
                ),
                acc1,
                HDOT,
            )
        if NPH > 2:
            acc2 = _dot(
                pd,
                _lat_plane(
                    h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, hm, 2, HBITS, 0, P, PP, VG, BT, DOT, HASM, 1.0
                ),
                acc2,
                HDOT,
            )
            acc3 = _dot(
                pd,
                _lat_plane(
                    h_ptr, hb, hoff, hs_ptr, hz_ptr, soff, ok, tm, hm, 3, HBITS, 0, P, PP, VG, BT, DOT, HASM, 1.0
                ),
                acc3,
                HDOT,
            )
    prow = (b * H + head) * n_slots + slot
    _store_partial(
        pm_ptr,
        pl_ptr,
        pacc_ptr,
        s_acc,
        rk_ptr,
        slot,
        prow,
        rmask,
        m,
        tl.sum(ls, axis=1),
        jp,
        acc0,
        acc1,
        acc2,
        acc3,
        RANK,
        NPH,
        P,
    )


@triton.jit
def _lat_kernel(
    lg_ptr,
    s_lgb,
    s_lgh,
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
    regs,
    GS: tl.constexpr,
    REP: tl.constexpr,
    QGP: tl.constexpr,
    VG: tl.constexpr,
    WIN: tl.constexpr,
    NPP: tl.constexpr,
    DOT: tl.constexpr,
    BT: tl.constexpr,
    CFG: tl.constexpr,
    NR: tl.constexpr,
):
    """Program (p, head group c, batch row b) of the latent pass over NR regions: region j's splits are
    regs[j][0] <= p < regs[j][1]; program p writes partial slot slot0 + p."""
    pid = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if NPP:
        next_pos = tl.load(np_arg).to(tl.int32)
    else:
        next_pos = np_arg
    for j in tl.static_range(NR):
        rg = regs[j]
        if (pid >= rg[0]) & (pid < rg[1]):
            _lat_region(
                pid - rg[0],
                slot0 + pid,
                c,
                b,
                next_pos,
                lg_ptr,
                s_lgb,
                s_lgh,
                window,
                pm_ptr,
                pl_ptr,
                pacc_ptr,
                s_acc,
                rk_ptr,
                n_slots,
                H,
                rg[2],
                rg[3],
                rg[4],
                rg[5],
                rg[6],
                rg[7],
                rg[8],
                rg[9],
                rg[10],
                rg[11],
                rg[12],
                rg[13],
                rg[14],
                rg[1] - rg[0],
                GS,
                REP,
                QGP,
                VG,
                WIN,
                DOT,
                BT,
                CFG[j][0],
                CFG[j][1],
                CFG[j][2],
                CFG[j][3],
                CFG[j][4],
                CFG[j][5],
                CFG[j][6],
                CFG[j][7],
            )


def supported_split(cache) -> bool:
    """What the two passes read, beyond `attention.supported` (which the caller has checked): every region's keys
    whole (no quant.Bands) and keys and latents in the plain layout (QTensor.plain: 2/4/8/16 bits, scales and zeros
    in the cache dtype). Key bands, fp8 metadata, 3-bit keys and the float16 metadata of bf16 caches
    (quant.meta_format: the two passes' bf16 operands would round it again, ~1e-2 from the reference) are the one-pass
    kernel's only."""
    return all(
        type(r.keys) is QTensor and all(t.plain and t.shift == 1.0 for t in (r.keys, r.lat))
        for r in _view(cache).regions
    )


def _geometry(r, n: int, g: int) -> dict:
    kb, hb = r.keys.bits, r.lat.bits
    NPK = 8 // kb if kb < 8 else (4 if n >= 64 else 1)
    KW = max(16, pow2(g * (n // NPK)))  # tiles narrower than 16 came out wrong compiled (docs/kernels.md)
    NPH, P = (8 // hb, r.rank * hb // 8) if hb < 8 else _lat_planes(r.rank)
    PP = max(16, pow2(P))
    return dict(NPK=NPK, KW=KW, NPH=NPH, P=P, PP=PP, KDOT=KW >= 32, HDOT=PP >= 32)


def latent_attention_split(
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
    asm: bool | tuple[int, ...] = True,
    k_tiles: int = 4,
    k_block_t: int | None = None,
    q_regs: bool = False,
    k_warps: int = 4,
    k_stages: int = 2,
    v_warps: int = 8,
    v_stages: int = 2,
    solo: int = 1,
    logits_only: bool = False,
):
    """tale_kernels.latent_attention in two passes (see the module doc); the caller has checked
    `attention.supported` and `supported_split`. `k_tiles` tiles of `block_t` slots per key program; the latent pass
    splits as attention.py (`waves` programs per SM, `min_split`, `split_tokens`).
    `k_block_t` sets the key tile apart from the latent one; `q_regs` holds the query planes in
    registers through the key pass instead of reloading them per tile. `solo`: how many of the regions
    with the most bytes get launches of their own (0: one launch per pass for up to four regions).
    `logits_only` returns the logits buffer after the first pass (benchmarks)."""
    view = _view(cache)
    B, H, _, n = q.shape
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    rep, g = H // K, K // G
    dev = q.device
    dtype = TL_DTYPE[q.dtype]
    q, k_new, h_new = _c(q), _c(k_new), _c(h_new)
    qk = scaling * LOG2E
    regions = view.regions
    asm_bits, KG, VG = _widths_and_groups(asm, q, regions)
    BT = max(32, block_t)  # 16-slot tiles gave wrong results compiled (docs/kernels.md)
    QGP = max(16, pow2(g * rep))
    npos, win = view.next_pos, view.window
    common = dict(GS=g, REP=rep, QGP=QGP, WIN=win is not None, NPP=isinstance(npos, torch.Tensor), DOT=dtype)
    wv = 0 if win is None else int(win)
    caps = [r.capacity for r in regions]
    offs = [sum(caps[:i]) for i in range(len(caps))]
    lg = torch.empty(B, H, max(1, sum(caps)), device=dev, dtype=torch.float32)
    BTK = max(32, k_block_t or BT)
    # launches: the `solo` regions with the most bytes alone (a launch takes the registers of its hungriest
    # region, so the big 2-bit level keeps its occupancy), the rest together, up to NREG per launch
    cost = [r.capacity * (K * n * r.keys.bits + G * r.rank * r.lat.bits) for r in regions]
    order = sorted(range(len(regions)), key=lambda i: -cost[i])
    rest = sorted(order[solo:])
    groups = [[i] for i in order[:solo]] + [rest[j : j + NREG] for j in range(0, len(rest), NREG)]
    for grp in groups:  # the key pass
        regs, cfg, p0 = [], [], 0
        for r, off in ((regions[i], offs[i]) for i in grp):
            geo = _geometry(r, n, g)
            kq = r.keys
            kt = _c(kq.data)
            ks, kz = (_c(kq.scale), _c(kq.zero)) if kq.bits != 16 else (kt, kt)  # never read at 16 bits
            tpp = max(1, min(k_tiles, triton.cdiv(r.capacity, BTK)))
            p1 = p0 + triton.cdiv(r.capacity, BTK * tpp)
            regs.append((p0, p1, off, kt, *kt.stride()[:3], ks, kz, *ks.stride()[:3], r.pos, r.pos.stride(0), r.length))
            lenp = isinstance(r.length, torch.Tensor)
            cfg.append(
                (kq.bits, geo["NPK"], geo["KW"], max(1, BTK // KG), BTK, geo["KDOT"], lenp, kq.bits in asm_bits, tpp)
            )
            p0 = p1
        _keys_kernel[(p0, G, B)](
            q,
            q.stride(0),
            q.stride(1),
            qk,
            npos,
            wv,
            lg,
            lg.stride(0),
            lg.stride(1),
            tuple(regs),
            N=n,
            KG=KG,
            QREG=q_regs and all(c_[1] in (1, 2, 4) for c_ in cfg),
            CFG=tuple(cfg),
            NR=len(regs),
            num_warps=k_warps,
            num_stages=k_stages,
            **common,
        )
    if logits_only:
        return lg
    splits = _splits(view, B, G, n, K, _num_sms(dev), waves, min_split, split_tokens)
    n_slots, (pm, pl, pacc, rk) = _partials(B, H, R, splits, dev)
    slot0 = 0
    for grp in groups:  # the latent pass
        regs, cfg, p0 = [], [], 0
        for r, off, ns in ((regions[i], offs[i], splits[i]) for i in grp):
            geo = _geometry(r, n, g)
            hq = r.lat
            ht = _c(hq.data)
            hs, hz = (_c(hq.scale), _c(hq.zero)) if hq.bits != 16 else (ht, ht)
            regs.append(
                (p0, p0 + ns, off, ht, *ht.stride()[:3], hs, hz, *hs.stride()[:3], r.pos, r.pos.stride(0), r.length)
            )
            lenp = isinstance(r.length, torch.Tensor)
            cfg.append((hq.bits, r.rank, geo["NPH"], geo["P"], geo["PP"], geo["HDOT"], lenp, hq.bits in asm_bits))
            p0 += ns
        _lat_kernel[(p0, G, B)](
            lg,
            lg.stride(0),
            lg.stride(1),
            npos,
            wv,
            pm,
            pl,
            pacc,
            pacc.stride(2),
            rk,
            n_slots,
            H,
            slot0,
            tuple(regs),
            VG=VG,
            BT=BT,
            CFG=tuple(cfg),
            NR=len(regs),
            num_warps=v_warps,
            num_stages=v_stages,
            **common,
        )
        slot0 += p0
    return _combine(pm, pl, pacc, rk, n_slots if regions else 0, q, k_new, h_new, qk, rep, g)
