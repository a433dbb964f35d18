"""Fused decode attention (T = 1) over a paged TALE cache (tale_runtime.paged: per-token slots in a byte pool,
addressed by a block table), split-K with a combine, as the contiguous kernel (attention.py) does it.

Grid (splits, G, B): a program takes a chunk of sequence b's tokens (computed on the device from its length, so
lengths may change between replays of a captured graph) for all g * rep query heads of latent group c. Per tile of
BT tokens:
- page ids of the tile's tokens from the block table (a tile may span pages: page_size need not divide BT), so
  every token's slot base is page * page_stride + offset * slot_stride: the slot holds the group's g key rows, their
  per-token scales/zeros, the latent codes and theirs, one after the other (tale_runtime.paged);
- keys of the g KV heads as one [BT, g * n / planes] tile per plane, dequantized per token over channel groups and
  scored on tensor cores against a block-diagonal query tile (row r keeps KV head r // rep's channels);
- online softmax in base 2, latents plane by plane (attention._lat_plane: per token over channel groups).
Each program writes a partial (max, sum, acc[:rank]); attention._combine merges them with the new token (exact k, h)
into z [B, 1, H, R], the contiguous kernel's result, so the fused O^r applies unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tale_runtime.attention import cached_keys
from tale_runtime.paged import PagedPool, Sinks, _planes, paged_attention_reference, paged_view
from tale_runtime.quant import META_SHIFT, dequantize

from ._common import (
    TL_DTYPE,
    group_rows,
    interpreting,
    plane,
    plane_asm,
    pow2,
    program_ids,
    runnable,
    scalar,
    split_bounds,
    tile_slots,
    to_float,
)
from .attention import (
    LOG2E,
    _combine,
    _dot,
    _lat_accs,
    _meta,
    _nth,
    _num_sms,
    _partial_args,
    _partials,
    _shifted,
    _softmax_init,
    _softmax_step,
    _store_partial,
)


@triton.jit
def _q_plane(q_ptr, qoff, qm, i: tl.constexpr, PK: tl.constexpr, sh, DOT: tl.constexpr):
    """Query plane i, block-diagonal [QGP, KW] (channels i * PK + column % PK of its KV head), times sh in DOT."""
    return (tl.load(q_ptr + qoff + i * PK, mask=qm, other=0.0).to(tl.float32) * sh).to(DOT)


@triton.jit
def _key_plane(
    u8_ptr,
    e_ptr,
    m_ptr,
    kb,
    base,
    col,
    ju,
    kmask,
    tm,
    sh,
    i: tl.constexpr,
    N: tl.constexpr,
    GS: tl.constexpr,
    KBITS: tl.constexpr,
    PK: tl.constexpr,
    KW: tl.constexpr,
    KGRP: tl.constexpr,
    KS: tl.constexpr,
    KZ: tl.constexpr,
    MSZ: tl.constexpr,
    ESZ: tl.constexpr,
    META: tl.constexpr,
    BT: tl.constexpr,
    DOT: tl.constexpr,
    ASM: tl.constexpr,
    SH: tl.constexpr,
):
    """Channels i * PK + u % PK of KV head u // PK of the tile's tokens, dequantized: [BT, KW] in DOT, times SH.
    kb: the tile's packed key bytes [BT, KW] (2/4 bits; loaded once for all planes). Columns past the group's heads
    and tokens past the chunk come out zero (scales masked)."""
    if KBITS == 16:
        kc = _shifted(
            tl.load(e_ptr + (base // ESZ)[:, None] + (ju * N + i * PK + col % PK)[None, :], mask=kmask, other=0.0),
            sh,
            SH,
            DOT,
        )
    else:
        # scale groups of the tile's columns: W columns each (a whole group, or the plane when a group spans planes)
        W: tl.constexpr = PK if PK < KGRP else KGRP
        NGK: tl.constexpr = N // KGRP
        m = tl.arange(0, KW // W)
        mh = m // (PK // W)  # the group's KV head
        moff = mh * NGK + (i * PK + (m % (PK // W)) * W) // KGRP
        mm = tm[:, None] & (mh < GS)[None, :]
        soff = (base // MSZ)[:, None] + moff[None, :]
        ks, kz = _meta(m_ptr + KS // MSZ, m_ptr + KZ // MSZ, soff, mm, 1.0, sh, META, DOT, SH)
        if KBITS < 8 and ASM:  # unpack and scale in one PTX block, 4 codes per register
            kc = plane_asm(tl.reshape(kb, (BT, KW // W, W)), ks[:, :, None], kz[:, :, None], i, KBITS, DOT)
            kc = tl.reshape(kc, (BT, KW))
        else:
            if KBITS < 8:
                kc = plane(kb, i, KBITS, DOT)
            else:
                kc = to_float(
                    tl.load(u8_ptr + base[:, None] + (ju * N + i * PK + col % PK)[None, :], mask=kmask, other=0).to(
                        tl.int32
                    ),
                    8,
                    DOT,
                )
            kc = tl.reshape(tl.reshape(kc, (BT, KW // W, W)) * ks[:, :, None] + kz[:, :, None], (BT, KW))
    return kc


@triton.jit
def _paged_kernel(
    q_ptr,
    s_qb,
    s_qh,
    u8_ptr,  # the pool as bytes
    e_ptr,  # the pool as the cache dtype (16-bit keys and latents)
    m_ptr,  # the pool as the scale/zero dtype
    bt_ptr,
    s_bt,
    len_ptr,
    s_page,  # bytes
    s_slot,
    s_grp,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    s_acc,
    rk_ptr,
    n_slots,
    H,
    S,
    qk_scale,
    sh,
    PS: tl.constexpr,
    GS: tl.constexpr,
    REP: tl.constexpr,
    QGP: tl.constexpr,
    N: tl.constexpr,
    KBITS: tl.constexpr,
    NPK: tl.constexpr,
    PK: tl.constexpr,
    KW: tl.constexpr,
    KGRP: tl.constexpr,
    KS: tl.constexpr,  # byte offsets of the slot's fields (tale_runtime.paged.PagedFormat.offsets)
    KZ: tl.constexpr,
    LOFF: tl.constexpr,
    LS: tl.constexpr,
    LZ: tl.constexpr,
    RANK: tl.constexpr,
    HBITS: tl.constexpr,
    NPH: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    VG: tl.constexpr,
    MSZ: tl.constexpr,
    ESZ: tl.constexpr,
    META: tl.constexpr,
    BT: tl.constexpr,
    KASM: tl.constexpr,
    HASM: tl.constexpr,
    DOT: tl.constexpr,
    SH: tl.constexpr,
):
    """Program (split sp, latent group c, sequence b): partial (max, sum, acc[:RANK]) of the group's query heads."""
    sp, c, b = program_ids()
    t_start, t_end = split_bounds(scalar(len_ptr + b, True), S, sp, BT)
    rows, head, rmask = group_rows(c, GS * REP, QGP)
    col = tl.arange(0, KW)
    ju = col // PK
    kcol = col < GS * PK
    qm = rmask[:, None] & ((rows // REP)[:, None] == ju[None, :])
    qoff = b * s_qb + head[:, None] * s_qh + (col % PK)[None, :]
    # the query planes, held in registers (times the operand shift; the score scale goes on the logits)
    q0 = _q_plane(q_ptr, qoff, qm, 0, PK, sh, DOT)
    q1 = q0
    q2 = q0
    q3 = q0
    if NPK > 1:
        q1 = _q_plane(q_ptr, qoff, qm, 1, PK, sh, DOT)
    if NPK > 2:
        q2 = _q_plane(q_ptr, qoff, qm, 2, PK, sh, DOT)
        q3 = _q_plane(q_ptr, qoff, qm, 3, PK, sh, DOT)
    q_scale = qk_scale / (SH * SH)
    hm = (1.0, sh)

    m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_init(QGP, PP)
    jp = tl.arange(0, PP)
    for t0 in range(t_start, t_end, BT):
        t, tm = tile_slots(t0, t_end, BT)
        page = tl.load(bt_ptr + b * s_bt + t // PS, mask=tm, other=0).to(tl.int64)
        base = page * s_page + (t % PS) * s_slot + c * s_grp  # [BT] the slot of each token (bytes)
        kmask = tm[:, None] & kcol[None, :]
        kb = page  # stands in when the keys are not packed
        if KBITS < 8:  # the g key rows: one contiguous run of bytes per token
            kb = tl.load(u8_ptr + base[:, None] + col[None, :], mask=kmask, other=0)
        # -- scores
        logits = tl.zeros([QGP, BT], tl.float32)
        for i in tl.static_range(NPK):  # NPK is 1, 2 or 4
            ki = _key_plane(
                u8_ptr, e_ptr, m_ptr, kb, base, col, ju, kmask, tm, sh, i, N, GS, KBITS, PK, KW, KGRP, KS, KZ, MSZ,
                ESZ, META, BT, DOT, KASM, SH,
            )  # fmt: skip
            logits = _dot(_nth(i, q0, q1, q2, q3), tl.trans(ki), logits, KW >= 32)
        logits = tl.where(tm[None, :], logits * q_scale, float("-inf"))
        # -- online softmax
        p, alpha, m_i, l_i = _softmax_step(logits, m_i, l_i)
        pd = p.to(DOT)
        # -- latents, plane by plane
        if HBITS == 16:
            h_ptr = e_ptr
            hoff = (base + LOFF) // ESZ
        else:
            h_ptr = u8_ptr
            hoff = base + LOFF
        soff = (base + LS) // MSZ
        hz_ptr = m_ptr + (LZ - LS) // MSZ
        hb = page  # stands in when the latents are not packed
        if HBITS < 8:
            hb = tl.load(u8_ptr + hoff[:, None] + jp[None, :], mask=tm[:, None] & (jp < P)[None, :], other=0)
        acc0, acc1, acc2, acc3 = _lat_accs(
            acc0, acc1, acc2, acc3, pd, alpha, h_ptr, hb, hoff, m_ptr, hz_ptr, soff, tm, tm, hm, NPH, HBITS, META, P, PP,
            VG, BT, DOT, HASM, SH, False, PP >= 32,
        )  # fmt: skip

    prow = (b * H + head) * n_slots + sp
    _store_partial(
        pm_ptr, pl_ptr, pacc_ptr, s_acc, rk_ptr, sp, prow, rmask, m_i, l_i, jp, acc0, acc1, acc2, acc3, RANK, NPH, P,
        SH,
    )  # fmt: skip


@dataclass(frozen=True)
class PagedConfig:
    """Tuning knobs of the paged kernel (as attention.TritonConfig's): block_t tokens per tile; split_tokens tokens
    per split (tests), else about `waves` programs per SM, at least `min_split` tokens each; asm: unpack 2/4-bit
    codes with inline PTX (compiled 16-bit caches only)."""

    block_t: int = 64
    split_tokens: int | None = None
    min_split: int = 64
    waves: float = 2.0
    num_warps: int = 4
    num_stages: int = 2
    asm: bool = True


DEFAULT = PagedConfig()


def _check(q, k_new, h_new, pool: PagedPool, block_table, lengths) -> None:
    f = pool.fmt
    B, H, T, n = q.shape
    K, G = k_new.shape[1], h_new.shape[1]
    if T != 1 or n != f.head_dim or K != G * f.group or G != pool.num_groups or H % K:
        raise ValueError(
            f"paged attention: query {tuple(q.shape)}, new key {tuple(k_new.shape)}, new latent {tuple(h_new.shape)}"
            f" do not fit the pool ({pool.num_groups} groups of {f})"
        )
    if h_new.shape[-1] < f.rank or q.dtype != f.dtype or k_new.dtype != q.dtype or h_new.dtype != q.dtype:
        raise ValueError(f"paged attention: new latent width {h_new.shape[-1]} or dtype {q.dtype} do not fit {f}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"paged attention: block table must be int32 [{B}, max_pages], not {block_table.dtype}")
    if lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"paged attention: lengths must be int32/int64 [{B}]")
    if not pool.data.is_contiguous():
        raise ValueError("paged attention: the pool must be contiguous")


def paged_latent_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    h_new: torch.Tensor,
    pool: PagedPool,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    config: PagedConfig | None = None,
) -> torch.Tensor:
    """z [B, 1, H, R] (float32) of one new token over the paged tokens and itself: paged_attention_reference's
    result, by the Triton kernel (CPU tensors: the reference, unless TRITON_INTERPRET=1).

    q [B, H, 1, n], k_new [B, K, 1, n] (post-RoPE), h_new [B, G, 1, R] (the new token attends exactly; it is not in
    the pages), block_table [B, max_pages] int32 page ids, lengths [B] cached tokens per sequence (device tensors:
    no host sync, so a call can be captured in a CUDA graph and replayed after the lengths changed)."""
    _check(q, k_new, h_new, pool, block_table, lengths)
    if not runnable(q, k_new, h_new, pool.data, block_table, lengths):
        return paged_attention_reference(q, k_new, h_new, pool, block_table, lengths, scaling)
    return _combine(*_launch(q, k_new, h_new, pool, block_table, lengths, scaling, config or DEFAULT, 0))


def _launch(q, k_new, h_new, pool: PagedPool, block_table, lengths, scaling: float, cfg: PagedConfig, extra: int):
    """The paged kernel's partials, with `extra` more slots per row left for the caller to fill: the arguments of
    _combine."""
    f, o = pool.fmt, pool.fmt.offsets
    B, H, _, n = q.shape
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    rep, g = H // K, f.group
    dev = q.device
    # bf16 caches enter the tensor cores as float16 times 2^-8 (attention.py: their float16 scales read as they are)
    dt = torch.float32 if q.dtype == torch.float32 else torch.float16
    sh = META_SHIFT if q.dtype == torch.bfloat16 else 1.0
    asm = cfg.asm and not interpreting() and q.dtype != torch.float32
    kb, hb = f.key_bits, f.lat_bits
    NPK, PK = _planes(n, kb)
    NPH, P = _planes(f.rank, hb)
    KW = max(16, pow2(g * PK))
    PP = max(16, pow2(P))
    BT = max(32, cfg.block_t)
    cap = block_table.shape[1] * pool.page_size
    if cfg.split_tokens:
        S = max(1, triton.cdiv(cap, cfg.split_tokens))
    else:
        S = max(1, min(triton.cdiv(cap, cfg.min_split), round(cfg.waves * _num_sms(dev) / (B * G))))
    n_slots, (pm, pl, pacc, rk) = _partials(B, H, R, [S] + [1] * extra, dev)
    q, k_new, h_new = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_new, h_new))
    data = pool.data
    qk = scaling * LOG2E
    _paged_kernel[(S, G, B)](
        q,
        q.stride(0),
        q.stride(1),
        data,
        data.view(f.dtype),
        data.view(f.meta_dtype),
        block_table,
        block_table.stride(0),
        lengths,
        data.stride(0),
        data.stride(1),
        data.stride(2),
        *_partial_args(pm, pl, pacc, rk),
        n_slots,
        H,
        S,
        qk,
        sh,
        PS=pool.page_size,
        GS=g,
        REP=rep,
        QGP=max(16, pow2(g * rep)),
        N=n,
        KBITS=kb,
        NPK=NPK,
        PK=PK,
        KW=KW,
        KGRP=f.key_group,
        KS=o["key_scale"],
        KZ=o["key_zero"],
        LOFF=o["lat"],
        LS=o["lat_scale"],
        LZ=o["lat_zero"],
        RANK=f.rank,
        HBITS=hb,
        NPH=NPH,
        P=P,
        PP=PP,
        VG=f.lat_group,
        MSZ=f.meta_dtype.itemsize,
        ESZ=f.dtype.itemsize,
        META=3 if f.shift == META_SHIFT else 0,
        BT=BT,
        KASM=asm and kb < 8,
        HASM=asm and hb < 8,
        DOT=TL_DTYPE[dt],
        SH=sh,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return pm, pl, pacc, rk, n_slots, q, k_new, h_new, qk, rep, g


def paged_latent_attention_sinks(
    q: torch.Tensor,
    k_new: torch.Tensor,
    h_new: torch.Tensor,
    pool: PagedPool,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    sinks: Sinks,
    config: PagedConfig | None = None,
) -> torch.Tensor:
    """paged_latent_attention with each sequence's first tokens read from 16-bit sinks outside the pages
    (tale_runtime.paged.Sinks; paged_attention_reference(..., sinks) is the reference): one softmax over the sinks,
    the pages from position sinks.first[b] on, and the new token.

    The kernel reads the pages from page P0 = ceil(A / page_size) on; the first P0 pages of every sequence (their
    positions first[b] .. P0 * page_size) and the sinks, at most A + P0 * page_size tokens, are scored in torch into
    one more partial per row (max, sum, accumulator, in the kernel's base 2), which the kernel's combine merges with
    the splits and the new token. No host sync: the partial is computed from device tensors."""
    _check(q, k_new, h_new, pool, block_table, lengths)
    if not runnable(q, k_new, h_new, pool.data, block_table, lengths):
        return paged_attention_reference(q, k_new, h_new, pool, block_table, lengths, scaling, sinks)
    B, H, _, n = q.shape
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    A, PS = sinks.keys.shape[-2], pool.page_size
    if tuple(sinks.keys.shape) != (B, K, A, n) or tuple(sinks.lat.shape) != (B, G, A, R) or sinks.first.shape != (B,):
        raise ValueError(
            f"paged attention: sinks {tuple(sinks.keys.shape)} / {tuple(sinks.lat.shape)} / {tuple(sinks.first.shape)}"
            f" do not fit the query {tuple(q.shape)} and new latent {tuple(h_new.shape)}"
        )
    P0 = min(block_table.shape[1], -(-A // PS))
    rest = block_table[:, P0:]
    if rest.shape[1] == 0:  # every sequence fits its first pages: the kernel reads one empty page per row
        rest = block_table[:, :1]
    rest_len = (lengths - P0 * PS).clamp(min=0)
    parts = _launch(q, k_new, h_new, pool, rest, rest_len, scaling, config or DEFAULT, 1)
    pm, pl, pacc, rk, n_slots, qk = parts[0], parts[1], parts[2], parts[3], parts[4], parts[8]
    # the sinks and the first pages' tokens from first[b] on: [B, K, A + P0 * PS, n] keys, [B, G, ., R] latents
    view = paged_view(pool, block_table[:, :P0], lengths.clamp(max=P0 * PS), sinks)
    keys, pos, oks = cached_keys(view, torch.float32, B, K, n, q.device)
    lat = torch.cat(
        [
            torch.nn.functional.pad(dequantize(r.lat, torch.float32), (0, R - r.rank)).masked_fill(
                ~ok[:, None, :, None], 0.0
            )
            for r, ok in zip(view.regions, oks)
        ],
        dim=-2,
    )
    rep, g = H // K, K // G
    s = torch.einsum("bkin,bkln->bkil", q[:, :, 0].float().view(B, K, rep, n), keys) * qk  # [B, K, rep, L] base 2
    s = s.masked_fill((pos < 0)[:, None, None], float("-inf")).reshape(B, H, -1)
    m = s.amax(-1)  # [B, H]; -inf where the row has none of these tokens
    p = torch.exp2(s - torch.where(m == float("-inf"), 0.0, m)[..., None])
    acc = torch.einsum("bcql,bclr->bcqr", p.view(B, G, g * rep, -1), lat).reshape(B, H, R)
    last = n_slots - 1
    pm[:, :, last], pl[:, :, last] = m, p.sum(-1)
    pacc[:, :, last].zero_()
    pacc[:, :, last, :R] = acc
    rk[last] = R
    return _combine(*parts)
