"""Fused decode attention (T = 1) over one layer's TALE cache, flash-decoding style.

The cache is a list of regions in position order (sinks | level 0 | ... | level L | residual)
plus the new token; each level has its own key/latent bit widths and latent rank. One launch
per level, grid (splits, G, B): a program takes a contiguous chunk of the level's tokens for
one head group c of one batch row, so each latent tile is read once for all g*rep query heads
of the group. Per tile it dequantizes the keys of the g KV heads, scores them against the
group's queries (query head q reads KV head q // rep), keeps an online softmax (max, sum)
per query head and accumulates the rank-truncated latent sum p @ h. Every program writes a
partial (max, sum, acc[R]) into one slot. A last launch, one program per (batch row, query
head, column block), attends the short 16-bit segments itself (sinks, residual, new token)
and merges them with all slots into z [B, 1, H, R]. Splits are sized so that batch 1 at
long context still fills the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tale_runtime.cache import TaleLayerCache
from tale_runtime.cache import latent_attention as reference

from ._common import TL_DTYPE, is_pow2, pow2, runnable, unpack

LOG2E = 1.4426950408889634


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr):
    """q [M, N] . k [T, N]^T -> [M, T] in float32."""
    if USE_DOT and q.dtype == tl.float32:  # float32 caches: full precision, not tf32
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    elif USE_DOT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    return s


@triton.jit
def _mix(p, h, USE_DOT: tl.constexpr):
    """p [M, T] @ h [T, R] -> [M, R] in float32."""
    if USE_DOT and p.dtype == tl.float32:
        z = tl.dot(p, h, input_precision="ieee")
    elif USE_DOT:
        z = tl.dot(p, h)
    else:
        z = tl.sum(p.to(tl.float32)[:, :, None] * h.to(tl.float32)[None, :, :], axis=1)
    return z


@triton.jit
def _region_kernel(
    q_ptr, s_qb, s_qh,
    k_ptr, s_kb, s_kh, s_kt,
    ks_ptr, kz_ptr, s_ksb, s_ksh, s_kst,
    h_ptr, s_hb, s_hg, s_ht,
    hs_ptr, hz_ptr, s_hsb, s_hsg, s_hst,
    valid_ptr, s_vb, pos0,
    pm_ptr, pl_ptr, pacc_ptr, slot0, n_slots,
    L, chunk, qk_scale,
    N: tl.constexpr, GS: tl.constexpr, REP: tl.constexpr, QGP: tl.constexpr,
    KBITS: tl.constexpr, HBITS: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
    RANK: tl.constexpr, RP: tl.constexpr, RPAD: tl.constexpr,
    BT: tl.constexpr, USE_DOT: tl.constexpr, DOT: tl.constexpr,
):
    sp = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    QG: tl.constexpr = GS * REP
    NBK: tl.constexpr = N * KBITS // 8  # packed key bytes per token and head
    ROWS: tl.constexpr = BT // KG if BT > KG else 1  # key scale rows (token groups) in a tile
    NB: tl.constexpr = RANK * HBITS // 8  # packed latent bytes per token
    NBP: tl.constexpr = RP * HBITS // 8
    NGP: tl.constexpr = RP // VG  # latent scale groups per token (padded)
    rows = tl.arange(0, QGP)
    head = c * QG + rows
    rmask = rows < QG
    slot = rows // REP  # KV head of each query row, within the group
    dn = tl.arange(0, N)
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + dn[None, :], mask=rmask[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(DOT)  # log2-domain scores

    m_i = tl.full([QGP], float("-inf"), tl.float32)
    l_i = tl.zeros([QGP], tl.float32)
    acc = tl.zeros([QGP, RP], tl.float32)
    cols = tl.arange(0, RP)

    t_start = sp * chunk
    t_end = tl.minimum(t_start + chunk, L)
    for t0 in range(t_start, t_end, BT):
        t = t0 + tl.arange(0, BT)
        tmask = t < t_end
        # -- scores of the group's query heads against the tile's keys
        logits = tl.zeros([QGP, BT], tl.float32)
        for j in tl.static_range(GS):
            kv = c * GS + j
            if KBITS == 16:
                k = tl.load(k_ptr + b * s_kb + kv * s_kh + t[:, None] * s_kt + dn[None, :], mask=tmask[:, None], other=0.0)
                k = k.to(DOT)
            else:
                byts = tl.load(k_ptr + b * s_kb + kv * s_kh + t[:, None] * s_kt + tl.arange(0, NBK)[None, :],
                               mask=tmask[:, None], other=0)
                codes = unpack(byts, KBITS, DOT)  # [BT, N], dequantized in the dot's dtype
                r = t0 // KG + tl.arange(0, ROWS)
                rm = r * KG < L
                soff = b * s_ksb + kv * s_ksh + r[:, None] * s_kst + dn[None, :]
                ks = tl.load(ks_ptr + soff, mask=rm[:, None], other=0.0).to(DOT)
                kz = tl.load(kz_ptr + soff, mask=rm[:, None], other=0.0).to(DOT)
                k = tl.reshape(codes, (ROWS, BT // ROWS, N)) * ks[:, None, :] + kz[:, None, :]
                k = tl.reshape(k, (BT, N))
            s = _scores(q, k, USE_DOT)
            logits = tl.where(slot[:, None] == j, s, logits)
        v = tl.load(valid_ptr + b * s_vb + pos0 + t, mask=tmask, other=0)
        ok = tmask & (v != 0)
        logits = tl.where(ok[None, :], logits, float("-inf"))

        # -- online softmax
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(logits - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # -- latents of the group, truncated at RANK (zero beyond)
        if HBITS == 16:
            h = tl.load(h_ptr + b * s_hb + c * s_hg + t[:, None] * s_ht + cols[None, :],
                        mask=tmask[:, None] & (cols < RANK)[None, :], other=0.0)
            h = h.to(DOT)
        else:
            cb = tl.arange(0, NBP)
            byts = tl.load(h_ptr + b * s_hb + c * s_hg + t[:, None] * s_ht + cb[None, :],
                           mask=tmask[:, None] & (cb < NB)[None, :], other=0)
            codes = unpack(byts, HBITS, DOT)  # [BT, RP]
            gi = tl.arange(0, NGP)
            gmask = tmask[:, None] & (gi < RANK // VG)[None, :]
            soff = b * s_hsb + c * s_hsg + t[:, None] * s_hst + gi[None, :]
            hs = tl.load(hs_ptr + soff, mask=gmask, other=0.0).to(DOT)
            hz = tl.load(hz_ptr + soff, mask=gmask, other=0.0).to(DOT)
            h = tl.reshape(codes, (BT, NGP, VG)) * hs[:, :, None] + hz[:, :, None]
            h = tl.reshape(h, (BT, RP))
        acc = acc * alpha[:, None] + _mix(p.to(DOT), h, USE_DOT)

    # -- partial results of this split
    sl = slot0 + sp
    prow = (b * tl.num_programs(1) * QG + head) * n_slots + sl
    tl.store(pm_ptr + prow, m_i, mask=rmask)
    tl.store(pl_ptr + prow, l_i, mask=rmask)
    tl.store(pacc_ptr + prow[:, None] * RPAD + cols[None, :], acc, mask=rmask[:, None])
    for c0 in tl.static_range(RP, RPAD, RP):  # channels beyond this region's rank
        tl.store(pacc_ptr + prow[:, None] * RPAD + (c0 + cols)[None, :], tl.zeros([QGP, RP], tl.float32),
                 mask=rmask[:, None])


@triton.jit
def _tail(m, l, acc, q, k_ptr, s_kt, h_ptr, s_ht, L, valid_ptr, cols, R,
          HAS_VALID: tl.constexpr, N: tl.constexpr, TB: tl.constexpr):
    """Online-softmax update of one query head with a short 16-bit segment (sinks, residual, new token)."""
    dn = tl.arange(0, N)
    for t0 in range(0, L, TB):
        t = t0 + tl.arange(0, TB)
        tm = t < L
        k = tl.load(k_ptr + t[:, None] * s_kt + dn[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)
        ok = tm
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + t, mask=tm, other=0) != 0)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0, keep_dims=True))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe)
        l = l * alpha + tl.sum(p, axis=0, keep_dims=True)
        h = tl.load(h_ptr + t[:, None] * s_ht + cols[None, :], mask=tm[:, None] & (cols < R)[None, :], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * h.to(tl.float32), axis=0)
        m = m_new
    return m, l, acc


@triton.jit
def _combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, z_ptr, n_slots, R, H,
    q_ptr, s_qb, s_qh, qk_scale, valid_ptr, s_vb,
    ks_ptr, s_ksb, s_ksh, s_kst, hs_ptr, s_hsb, s_hsg, s_hst, Ls,
    kr_ptr, s_krb, s_krh, s_krt, hr_ptr, s_hrb, s_hrg, s_hrt, Lr, pos_r,
    kn_ptr, s_knb, s_knh, hn_ptr, s_hnb, s_hng,
    N: tl.constexpr, REP: tl.constexpr, GS: tl.constexpr,
    RPAD: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr, TB: tl.constexpr,
):
    """z for one (batch row, query head, column block): the short 16-bit segments (sinks,
    residual, new token) are attended here directly and merged with the region partials."""
    row = tl.program_id(0).to(tl.int64)  # b * H + query head
    b = row // H
    hq = row % H
    kv = hq // REP
    c = kv // GS
    cols = tl.program_id(1) * BR + tl.arange(0, BR)
    q = tl.load(q_ptr + b * s_qb + hq * s_qh + tl.arange(0, N)).to(tl.float32) * qk_scale
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([BR], tl.float32)
    vb = valid_ptr + b * s_vb
    m, l, acc = _tail(m, l, acc, q, ks_ptr + b * s_ksb + kv * s_ksh, s_kst, hs_ptr + b * s_hsb + c * s_hsg, s_hst,
                      Ls, vb, cols, R, True, N, TB)
    m, l, acc = _tail(m, l, acc, q, kr_ptr + b * s_krb + kv * s_krh, s_krt, hr_ptr + b * s_hrb + c * s_hrg, s_hrt,
                      Lr, vb + pos_r, cols, R, True, N, TB)
    m, l, acc = _tail(m, l, acc, q, kn_ptr + b * s_knb + kv * s_knh, 0, hn_ptr + b * s_hnb + c * s_hng, 0,
                      1, vb, cols, R, False, N, 1)

    base = row * n_slots
    for s0 in range(0, n_slots, BS):  # one pass over the slots, rescaling as the max grows
        s = s0 + tl.arange(0, BS)
        sm = s < n_slots
        ms = tl.load(pm_ptr + base + s, mask=sm, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(ms, axis=0, keep_dims=True))  # finite: m holds the new token
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(ms - m_new)
        l = l * alpha + tl.sum(w * tl.load(pl_ptr + base + s, mask=sm, other=0.0), axis=0, keep_dims=True)
        a = tl.load(pacc_ptr + (base + s)[:, None] * RPAD + cols[None, :], mask=sm[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
        m = m_new
    tl.store(z_ptr + row * R + cols, acc / l, mask=cols < R)


@dataclass
class _Region:
    keys: torch.Tensor  # [B, K, L, n] raw, or packed uint8 [B, K, L, n*bits/8]
    key_scale: torch.Tensor | None  # [B, K, L/key_group, n]
    key_zero: torch.Tensor | None
    key_bits: int
    lat: torch.Tensor  # [B, G, L, >= rank] raw, or packed uint8 [B, G, L, rank*bits/8]
    lat_scale: torch.Tensor | None  # [B, G, L, rank/value_group]
    lat_zero: torch.Tensor | None
    lat_bits: int
    rank: int
    pos0: int  # first position in the cache (for the valid mask); -1: the new token (always valid)

    @property
    def length(self) -> int:
        return self.keys.shape[-2]


TAIL_MAX = 256  # 16-bit segments up to this length are attended in the combine launch


def _regions(cache: TaleLayerCache) -> tuple[list[_Region], tuple | None, tuple | None]:
    """Launch regions in position order, plus the sinks and the residual as (k, h, length, first
    position) when short enough for the combine launch (long sinks, from heavy left padding, and
    16-bit levels are launch regions)."""
    out, pos, sinks, res = [], 0, None, None
    if cache.sink_k is not None:
        S = cache.sink_k.shape[-2]
        if S <= TAIL_MAX:
            sinks = (cache.sink_k, cache.sink_h, S, 0)
        else:
            out.append(_Region(cache.sink_k, None, None, 16, cache.sink_h, None, None, 16, cache.sink_h.shape[-1], 0))
        pos += S
    for st in cache.levels:
        if st is None or st.length == 0:
            continue
        kq, hq = st.keys, st.lat
        out.append(_Region(kq.data, kq.scale, kq.zero, kq.bits, hq.data, hq.scale, hq.zero, hq.bits, st.rank, pos))
        pos += st.length
    if cache.res_k is not None and cache.res_k.shape[-2]:  # under one flush of tokens by construction
        res = (cache.res_k, cache.res_h, cache.res_k.shape[-2], pos)
    return out, sinks, res


def supported(q: torch.Tensor, k_new: torch.Tensor, h_new: torch.Tensor, cache: TaleLayerCache) -> bool:
    """Shapes the kernel covers: one new token, power-of-two head dim and quantization groups."""
    B, H, T, n = q.shape
    if T != 1 or cache.valid is None or not runnable(q, k_new, h_new):
        return False
    if not is_pow2(n) or H % k_new.shape[1] or q.dtype not in TL_DTYPE:
        return False
    s = cache.s
    if not s.plain_layout():  # 3-bit codes, per-token keys, fp8 scales/zeros: the torch reference reads them
        return False
    return is_pow2(s.key_group) and is_pow2(s.value_group)


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _last_contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def latent_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    h_new: torch.Tensor,
    cache: TaleLayerCache,
    scaling: float,
    *,
    block_t: int = 64,
    split_tokens: int | None = None,
    min_split: int = 64,
    waves: float = 2.0,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Drop-in for tale_runtime.cache.latent_attention: z [B, T, H, R] (float32).

    Decode steps (T = 1) on CUDA run the Triton kernel; anything else (prefill chunks,
    CPU tensors unless TRITON_INTERPRET=1, unusual shapes) runs the torch reference.
    `split_tokens` fixes the tokens per split (tests); otherwise each region is split so that
    about `waves` programs per SM run, with at least `min_split` tokens each.
    """
    if not supported(q, k_new, h_new, cache):
        return reference(q, k_new, h_new, cache, scaling)
    B, H, _, n = q.shape
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    rep, g = H // K, K // G
    s = cache.s
    regions, sinks, res = _regions(cache)
    dtype = TL_DTYPE[q.dtype]
    dev = q.device
    valid = cache.valid.view(torch.uint8)
    q = _last_contig(q)

    BT = max(32, block_t)  # 16-token tiles gave wrong results compiled (Triton 3.6, H200); not understood
    # The regions run one launch after another, so each is split to fill the GPU on its own:
    # about `waves` programs per SM, at least `min_split` tokens each.
    sms = _num_sms(q.device)
    chunks = [split_tokens or max(min_split, triton.cdiv(r.length * B * G, int(waves * sms))) for r in regions]
    chunks = [triton.cdiv(ch, BT) * BT for ch in chunks]
    splits = [triton.cdiv(r.length, ch) for r, ch in zip(regions, chunks)]
    n_slots = sum(splits)
    RPAD = pow2(R)
    # 16-wide dot operands from the in-register dequantization also came out wrong (Triton 3.6,
    # H200): heads of 16 take the CUDA-core path.
    use_dot = n >= 32 and all(pow2(r.rank) >= 16 for r in regions)
    QGP = max(16 if use_dot else 1, pow2(g * rep))

    pm = torch.empty(B, H, max(n_slots, 1), device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B, H, max(n_slots, 1), RPAD, device=dev, dtype=torch.float32)
    slot0 = 0
    for reg, ns, chunk in zip(regions, splits, chunks):
        kt, ks, kz = _last_contig(reg.keys), _last_contig(reg.key_scale), _last_contig(reg.key_zero)
        ht, hs, hz = _last_contig(reg.lat), _last_contig(reg.lat_scale), _last_contig(reg.lat_zero)
        ks, kz, hs, hz = (t if t is not None else kt for t in (ks, kz, hs, hz))  # never read at 16 bits
        _region_kernel[(ns, G, B)](
            q, q.stride(0), q.stride(1),
            kt, kt.stride(0), kt.stride(1), kt.stride(2),
            ks, kz, ks.stride(0), ks.stride(1), ks.stride(2),
            ht, ht.stride(0), ht.stride(1), ht.stride(2),
            hs, hz, hs.stride(0), hs.stride(1), hs.stride(2),
            valid, valid.stride(0), reg.pos0,
            pm, pl, pacc, slot0, n_slots,
            reg.length, chunk, scaling * LOG2E,
            N=n, GS=g, REP=rep, QGP=QGP,
            KBITS=reg.key_bits, HBITS=reg.lat_bits, KG=s.key_group, VG=s.value_group,
            RANK=reg.rank, RP=pow2(reg.rank), RPAD=RPAD,
            BT=BT, USE_DOT=use_dot, DOT=dtype,
            num_warps=num_warps, num_stages=num_stages,
        )
        slot0 += ns

    z = torch.empty(B, 1, H, R, device=dev, dtype=torch.float32)
    BR = min(RPAD, 64)
    ks_, hs_, Ls, _ = sinks or (k_new, h_new, 0, 0)
    kr, hr, Lr, pos_r = res or (k_new, h_new, 0, 0)
    ks_, hs_, kr, hr, kn, hn = (_last_contig(t) for t in (ks_, hs_, kr, hr, k_new, h_new))
    _combine_kernel[(B * H, triton.cdiv(R, BR))](
        pm, pl, pacc, z, n_slots, R, H,
        q, q.stride(0), q.stride(1), scaling * LOG2E, valid, valid.stride(0),
        ks_, ks_.stride(0), ks_.stride(1), ks_.stride(2), hs_, hs_.stride(0), hs_.stride(1), hs_.stride(2), Ls,
        kr, kr.stride(0), kr.stride(1), kr.stride(2), hr, hr.stride(0), hr.stride(1), hr.stride(2), Lr, pos_r,
        kn, kn.stride(0), kn.stride(1), hn, hn.stride(0), hn.stride(1),
        N=n, REP=rep, GS=g, RPAD=RPAD, BS=64, BR=BR, TB=32, num_warps=4,
    )
    return z
