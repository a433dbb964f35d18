"""Triton kernels that move packed codes between the row layout (runtime/quant.py) and the fragment layout of the
CUDA decode kernel (runtime/frag.py): one launch per level and direction instead of ~20 torch ops, so that a static
cache's flushes and demotions cost no more host time in the fragment layout than in rows.

Both directions read runtime/frag.py's tables: word w's field f holds the code at logical index table[w, f] (keys:
head * 128 + channel of one slot; latents: slot * 256 + channel of a 32-slot block's half); `inverse_*` give, per
logical index, w * F + f. A row-layout code c of a row of NB bytes sits in byte c % NB at bit (c // NB) * BITS.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tale_runtime import frag


@triton.jit
def _pack_kernel(
    src, out, tab, slot0, n, G, H2,
    sB, sG, sT, oB, oG, oT, oH,
    scale, zero, mout, mtab, mB, mG, mT, qB, qG, qT, qH,
    LAT: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, W: tl.constexpr, F: tl.constexpr,
):  # fmt: skip
    # program: keys, one slot (b, g, t) of n; latents, one block-half (b, g, half, blk) of n blocks and H2 halves
    u = tl.program_id(0)  # int32 offsets: a level buffer of one layer stays far below 2^31 elements on one GPU
    w = tl.arange(0, W)[:, None]
    f = tl.arange(0, F)[None, :]
    if LAT:
        blk = u % n
        half = (u // n) % H2
        g = (u // (n * H2)) % G
        b = u // (n * H2 * G)
        idx = tl.load(tab + w * F + f)
        c = half * 256 + idx % 256
        addr = src + b * sB + g * sG + (blk * 32 + idx // 256) * sT + c % NB
        dst = out + b * oB + g * oG + half * oH + blk * oT + tl.arange(0, W)
        # the block-half's scale/zero pairs: entry i holds (scale | zero, slot, value group) = mtab[i]
        i = tl.arange(0, 512)
        mi = tl.load(mtab + i)
        off = b * mB + g * mG + (blk * 32 + (mi // 8) % 32) * mT + half * 8 + mi % 8
        m = tl.where(mi < 256, tl.load(scale + off), tl.load(zero + off))
        tl.store(mout + b * qB + g * qG + half * qH + blk * qT + i, m)
    else:
        t = u % n
        g = (u // n) % G
        b = u // (n * G)
        idx = tl.load(tab + ((slot0 + t) % 2) * W * F + w * F + f)  # the slot's parity picks the word swizzle
        c = idx % 128
        addr = src + b * sB + (g * 4 + idx // 128) * sG + t * sT + c % NB
        dst = out + b * oB + g * oG + t * oT + tl.arange(0, W)
        if t % 32 == 0:  # the block's scale/zero: entry i holds (scale | zero, head, channel) = mtab[i]
            i = tl.arange(0, 1024)
            mi = tl.load(mtab + i)
            off = b * mB + (g * 4 + (mi // 128) % 4) * mG + (t // 32) * mT + mi % 128
            m = tl.where(mi < 512, tl.load(scale + off), tl.load(zero + off))
            tl.store(mout + b * qB + g * qG + (t // 32) * qT + i, m)
    code = (tl.load(addr).to(tl.uint32) >> ((c // NB) * BITS).to(tl.uint32)) & ((1 << BITS) - 1)
    word = tl.sum(code << (f * BITS).to(tl.uint32), axis=1)  # disjoint fields: the sum is their OR
    tl.store(dst, word.to(tl.int32, bitcast=True))


@triton.jit
def _unpack_kernel(
    words, out, inv, slot0, n, G,
    wB, wG, wT, wH, oB, oG, oT,
    meta, scale, zero, minv, qB, qG, qT, qH, mB, mG, mT,
    LAT: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, F: tl.constexpr,
    H2: tl.constexpr,
):  # fmt: skip
    # program: keys, one slot (b, g, t): 4 heads x NB bytes; latents, one slot (b, g, s) of n: its NB bytes
    u = tl.program_id(0)  # int32 offsets: a level buffer of one layer stays far below 2^31 elements on one GPU
    t = u % n
    g = (u // n) % G
    b = u // (n * G)
    j = tl.arange(0, ROWS * NB)[:, None]
    p = tl.arange(0, 8 // BITS)[None, :]
    c = p * NB + j % NB  # the logical channel of plane p of byte j
    if LAT:
        iv = tl.load(inv + (t % 32) * 256 + c % 256)
        src = words + b * wB + g * wG + (c // 256) * wH + (t // 32) * wT + iv // F
        dst = out + b * oB + g * oG + t * oT + tl.arange(0, ROWS * NB)
        if t % 32 == 0:  # the block's scale/zero pairs back: logical entry e (scale | zero, slot, group) per half
            e = tl.arange(0, H2 * 512)  # (a name of its own: Triton types a name once per scope)
            jj = e % 512
            m = tl.load(meta + b * qB + g * qG + (e // 512) * qH + (t // 32) * qT + tl.load(minv + jj))
            off = b * mB + g * mG + (t + (jj // 8) % 32) * mT + (e // 512) * 8 + jj % 8
            tl.store(scale + off, m, mask=jj < 256)
            tl.store(zero + off, m, mask=jj >= 256)
    else:
        iv = tl.load(inv + ((slot0 + t) % 2) * 512 + (j // NB) * 128 + c)
        src = words + b * wB + g * wG + t * wT + iv // F
        dst = out + b * oB + (g * 4 + tl.arange(0, ROWS * NB) // NB) * oG + t * oT + tl.arange(0, ROWS * NB) % NB
        if t % 32 == 0:  # the block's scale/zero back: logical entry e = (scale | zero, head, channel)
            e = tl.arange(0, 1024)
            m = tl.load(meta + b * qB + g * qG + (t // 32) * qT + tl.load(minv + e))
            off = b * mB + (g * 4 + (e // 128) % 4) * mG + (t // 32) * mT + e % 128
            tl.store(scale + off, m, mask=e < 512)
            tl.store(zero + off, m, mask=e >= 512)
    code = (tl.load(src).to(tl.uint32, bitcast=True) >> ((iv % F) * BITS).to(tl.uint32)) & ((1 << BITS) - 1)
    byte = tl.sum(code << (p * BITS).to(tl.uint32), axis=1)
    tl.store(dst, byte.to(tl.uint8))


def _inner(*ts: torch.Tensor) -> None:
    """The kernels address the last dim with stride 1 (views of whole rows, as the static cache hands them)."""
    if any(t.stride(-1) != 1 for t in ts):
        raise ValueError("frag_pack: every tensor's last dim must be contiguous")


def _table(name: str, device, *args) -> torch.Tensor:
    """A runtime/frag.py table as int32 on `device` (built once)."""
    return _int32(str(device), name, *args)


@functools.lru_cache
def _int32(device: str, name: str, *args) -> torch.Tensor:
    return frag.on_device(device, name, *args).to(torch.int32).contiguous()


def pack_keys(keys, kc: torch.Tensor, km: torch.Tensor, slot0: int = 0) -> None:
    """A keys QTensor [B, K, n, 128] (row layout, 16-bit scale/zero [B, K, n / 32, 128]) -> kc [B, G, n, 16 bits]
    int32 and km [B, G, n / 32, 4, 32, 8]: views of a level's buffers starting at slot slot0 (its parity picks the
    word swizzle; n and slot0 multiples of 32)."""
    data, bits = keys.data, keys.bits
    B, K, n, NB = data.shape
    G = K // 4
    sc, ze = keys.scale, keys.zero
    _inner(data, sc, ze, kc, km)
    _pack_kernel[(B * G * n,)](
        data, kc, _table("key", data.device, bits), slot0, n, G, 1,
        data.stride(0), data.stride(1), data.stride(2), kc.stride(0), kc.stride(1), kc.stride(2), 0,
        sc, ze, km, _table("key_meta", data.device), sc.stride(0), sc.stride(1), sc.stride(2),
        km.stride(0), km.stride(1), km.stride(2), 0,
        LAT=False, BITS=bits, NB=NB, W=16 * bits, F=32 // bits,
    )  # fmt: skip


def pack_lat(lat, lc: torch.Tensor, lm: torch.Tensor) -> None:
    """A latents QTensor [B, G, 32 m, r] (row layout, scale/zero [B, G, 32 m, r / 32]) -> lc [B, G, r / 256, m,
    256 bits] int32 and lm [B, G, r / 256, m, 8, 2, 4, 8] (views of a level's buffers)."""
    data, bits = lat.data, lat.bits
    B, G, n, NB = data.shape
    halves, m = lc.shape[2], n // 32
    sc, ze = lat.scale, lat.zero
    _inner(data, sc, ze, lc, lm)
    _pack_kernel[(B * G * halves * m,)](
        data, lc, _table("lat", data.device, bits), 0, m, G, halves,
        data.stride(0), data.stride(1), data.stride(2), lc.stride(0), lc.stride(1), lc.stride(3), lc.stride(2),
        sc, ze, lm, _table("lat_meta", data.device), sc.stride(0), sc.stride(1), sc.stride(2),
        lm.stride(0), lm.stride(1), lm.stride(3), lm.stride(2),
        LAT=True, BITS=bits, NB=NB, W=256 * bits, F=32 // bits,
    )  # fmt: skip


def unpack_keys(kc: torch.Tensor, km: torch.Tensor, bits: int, mdtype: torch.dtype, slot0: int = 0):
    """kc [B, G, n, 16 bits], km [B, G, n / 32, 4, 32, 8] (a level's slots slot0..) -> row-layout key bytes
    [B, 4 G, n, 128 bits / 8], scale and zero [B, 4 G, n / 32, 128] (mdtype)."""
    B, G, n, _ = kc.shape
    _inner(kc, km)
    NB = 128 * bits // 8
    out = torch.empty(B, 4 * G, n, NB, dtype=torch.uint8, device=kc.device)
    sc = torch.empty(B, 4 * G, n // 32, 128, dtype=mdtype, device=kc.device)
    ze = torch.empty_like(sc)
    _unpack_kernel[(B * G * n,)](
        kc, out, _table("key_inv", kc.device, bits), slot0 % 2, n, G,
        kc.stride(0), kc.stride(1), kc.stride(2), 0, out.stride(0), out.stride(1), out.stride(2),
        km, sc, ze, _table("key_meta_inv", kc.device), km.stride(0), km.stride(1), km.stride(2), 0,
        sc.stride(0), sc.stride(1), sc.stride(2),
        LAT=False, BITS=bits, NB=NB, ROWS=4, F=32 // bits, H2=1,
    )  # fmt: skip
    return out, sc, ze


def unpack_lat(lc: torch.Tensor, lm: torch.Tensor, bits: int, mdtype: torch.dtype):
    """lc [B, G, r / 256, m, 256 bits], lm [B, G, r / 256, m, 8, 2, 4, 8] -> row-layout latent bytes
    [B, G, 32 m, r bits / 8], scale and zero [B, G, 32 m, r / 32] (mdtype)."""
    B, G, halves, m, _ = lc.shape
    _inner(lc, lm)
    NB = 256 * halves * bits // 8
    out = torch.empty(B, G, 32 * m, NB, dtype=torch.uint8, device=lc.device)
    sc = torch.empty(B, G, 32 * m, 8 * halves, dtype=mdtype, device=lc.device)
    ze = torch.empty_like(sc)
    _unpack_kernel[(B * G * 32 * m,)](
        lc, out, _table("lat_inv", lc.device, bits), 0, 32 * m, G,
        lc.stride(0), lc.stride(1), lc.stride(3), lc.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lm, sc, ze, _table("lat_meta_inv", lc.device), lm.stride(0), lm.stride(1), lm.stride(3), lm.stride(2),
        sc.stride(0), sc.stride(1), sc.stride(2),
        LAT=True, BITS=bits, NB=NB, ROWS=1, F=32 // bits, H2=halves,
    )  # fmt: skip
    return out, sc, ze
