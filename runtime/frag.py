"""The mma-fragment layout of a quantized level: what tale_kernels' CUDA decode kernel reads (docs/kernels.md).

A static cache of the shapes that kernel covers (`fits`) holds its quantized levels this way (static_cache.py).
The codes, 16-bit scales and zeros are those of runtime/quant.py's layout, permuted per 32-slot block so that each
thread's 32-bit word already holds its `mma.m16n8k16` operands. `FragLevel.write_slots` / `take_keys`, `take_lat` convert whole blocks both
ways without loss, so flushes and demotions read and write QTensors as in the row layout.

Shapes fixed by the kernel: head dim 128, latent groups of 4 KV heads, any whole number of query heads per KV head,
key and value groups of 32, 16-bit scales/zeros, latents in halves of 256 channels. Per batch row b and latent
group g, a level of C slots (a multiple of 32) with kb-bit keys and lb-bit latents of rank r (r / 256 halves):

    kc [B, G, C, 16 kb]                int32  one slot's key codes, 4 heads x 128 channels; word order swizzled by
                                              the slot's parity (bank conflicts)
    km [B, G, C/32, 4, 32, 8]          16-bit a block's key scale and zero: per head, quad c of channels 4c..4c+3
                                              (scales, then zeros), stored at c ^ ((2 head + c // 16) & 7)
    lc [B, G, r/256, C/32, 8 lb * 32]  int32  a block's latent codes of 256 channels: lane-major fragments
    lm [B, G, r/256, C/32, 8, 2, 4, 8] 16-bit a block's latent scale/zero pairs per (value group, k-chunk, lane % 4)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from .quant import QTensor, meta_format, pack, unpack

N, GS, BLOCK, HALF = 128, 4, 32, 256  # head dim, KV heads per latent group, slots per block, channels per half


def fits(schedule, n: int, K: int, G: int, dtype: torch.dtype) -> str | None:
    """None if the layout holds a cache of this schedule and these shapes, else why not: head dim 128, latent groups
    of 4 KV heads, the paper preset's two levels (2-bit keys and latents at rank 256, 4-bit at rank 512) in every layer,
    key and value groups of 32, 16-bit scales/zeros, bfloat16. (The CUDA kernel also needs `kernel_heads`.)"""
    s = schedule
    levels = [(lv.key_bits, lv.bits, r) for lv, r in zip(s.levels, s.ranks[0])] if s.ranks else []
    if n != N or K != GS * G:
        return f"the fragment layout needs head dim {N} and latent groups of {GS} KV heads (got {n}, {K // max(G, 1)})"
    if any(lv.key_hi_bits or lv.key_rank or lv.key_axis != "channel" for lv in s.levels) or s.key_rope != "post":
        return "the fragment layout holds whole per-channel keys after RoPE (no bands, no low-rank keys)"
    if levels != [(2, 2, 256), (4, 4, 512)] or any(list(r) != list(s.ranks[0]) for r in s.ranks):
        return "the fragment layout holds the paper preset's levels (2-bit rank 256, 4-bit rank 512) in every layer"
    if s.key_group != BLOCK or s.value_group != BLOCK or (s.key_meta, s.value_meta) != ("16", "16"):
        return "the fragment layout needs key and value groups of 32 and 16-bit scales/zeros"
    if dtype != torch.bfloat16:
        return f"the fragment layout holds bfloat16 caches, not {dtype}"
    return None


def kernel_heads(num_heads: int | None, num_kv_heads: int) -> bool:
    """Whether the CUDA kernel serves this many query heads: a whole number per KV head (GQA), run as ceil(GQA / 4)
    CTAs of 16 rows, 4 per KV head (rows past GQA left empty): Llama-2-7B's 1, Llama-3.1-8B's 4, Qwen2.5-14B's 5,
    Qwen2.5-7B's 7, Llama-3.1-70B's 8, Llama-3.1-405B's 16. None (a cache not told its query heads): no."""
    return num_heads is not None and num_heads >= num_kv_heads > 0 and num_heads % num_kv_heads == 0


# -- index tables: word w's field f holds the code at index table[w, f] of the source ---------------------------


def _fields(bits: int, q: int) -> tuple[int, int, int]:
    """Field q of a 16-bit half (bits * q ..): (byte, field in byte, fields per byte)."""
    fb = 8 // bits
    return q // fb, q % fb, fb


@lru_cache
def key_table(kb: int) -> torch.Tensor:
    """[2 slot parities, 16 kb words, 32 / kb fields] -> index head * 128 + channel of one slot's key code. Thread
    t = lane % 4 owns words t * 4 kb ..; fields 16 / kb .. are the high half of its operand pair."""
    kw, nf = 4 * kb, 16 // kb
    idx = torch.empty(4 * kw, 2 * nf, dtype=torch.long)
    for t in range(4):
        for j in range(kw):
            for pos in range(2 * nf):
                e, q = pos // nf, pos % nf
                byte, fi, fb = _fields(kb, q)
                ci, r = byte * (fb // 2) + fi // 2, fi % 2
                head, ch = t // 2 + 2 * r, 4 * ((8 // kb) * j + ci) + 2 * (t % 2) + e
                idx[kw * t + j, pos] = head * N + ch
    out = torch.empty(2, 4 * kw, 2 * nf, dtype=torch.long)
    for par in (0, 1):  # 16-byte quad u of thread t stored at u ^ (par) (2-bit) or u ^ (2 par + t // 2) (4-bit)
        sw = [
            kw * t + 4 * ((u ^ (par if kb == 2 else 2 * par + t // 2)) % (kw // 4)) + jj
            for t in range(4)
            for u in range(kw // 4)
            for jj in range(4)
        ]
        out[par] = idx[torch.tensor(sw).argsort()]
    return out


@lru_cache
def key_meta_table() -> torch.Tensor:
    """[4 heads * 32 quads * 8] -> index into [scale | zero, head, channel] (2 * 4 * 128) of a block's key meta."""
    idx = torch.empty(GS, 32, 8, dtype=torch.long)
    for h in range(GS):
        for c in range(32):
            src = c ^ ((2 * h + c // 16) & 7)  # an involution within each half of 16 quads
            for e in range(8):
                idx[h, c, e] = (e // 4) * GS * N + h * N + 4 * src + e % 4
    return idx.flatten()


@lru_cache
def lat_table(lb: int) -> torch.Tensor:
    """[lb * 256 words, 32 / lb fields] -> index slot * 256 + channel of a block's latent code (256 channels)."""
    lw, nf = 8 * lb, 16 // lb
    idx = torch.empty(32 * lw, 2 * nf, dtype=torch.long)
    for lane in range(32):
        n, t = lane // 4, lane % 4
        for w in range(lw):
            for pos in range(2 * nf):
                el, q = pos // nf, pos % nf
                byte, fi, _ = _fields(lb, q)
                nt, kc, r = (2 * w + byte, fi // 2, fi % 2) if lb == 2 else (w, byte, fi)
                ch, slot = 8 * nt + n, 16 * kc + 8 * r + 2 * t + el
                idx[((w // 4) * 32 + lane) * 4 + w % 4, pos] = slot * HALF + ch
    return idx


@lru_cache
def lat_meta_table() -> torch.Tensor:
    """[8 value groups * 2 k-chunks * 4 t * 8] -> index into [scale | zero, slot, value group] (2 * 32 * 8): per
    (group, chunk, t) the scales of slots 16 kc + 2t + (0, 1, 8, 9), then their zeros."""
    idx = torch.empty(8, 2, 4, 8, dtype=torch.long)
    for cg in range(8):
        for kc in range(2):
            for t in range(4):
                slots = (16 * kc + 2 * t, 16 * kc + 2 * t + 1, 16 * kc + 2 * t + 8, 16 * kc + 2 * t + 9)
                for e in range(8):
                    idx[cg, kc, t, e] = (e // 4) * 256 + slots[e % 4] * 8 + cg
    return idx.flatten()


def _inverse(table: torch.Tensor) -> torch.Tensor:
    """Per logical index, w * F + f of the field that holds it (table [..., W, F] over a permutation)."""
    flat = table.flatten(-2)
    inv = torch.empty_like(flat)
    inv.scatter_(-1, flat, torch.arange(flat.shape[-1]).expand_as(flat).contiguous())
    return inv


TABLES = {
    "key": key_table,
    "key_meta": key_meta_table,
    "lat": lat_table,
    "lat_meta": lat_meta_table,
    "key_inv": lambda kb: _inverse(key_table(kb)),
    "lat_inv": lambda lb: _inverse(lat_table(lb)),
    "key_meta_inv": lambda: key_meta_table().argsort(),
    "lat_meta_inv": lambda: lat_meta_table().argsort(),
}


@lru_cache
def on_device(device: str, name: str, *args) -> torch.Tensor:
    """TABLES[name](*args) on `device`, built once per device (flushes and demotions gather with it)."""
    return TABLES[name](*args).to(device)


def _kernels(t: torch.Tensor):
    """The registered "frag_pack" op (tale_runtime.backends) for CUDA tensors, else None: the torch path below."""
    if not t.is_cuda:
        return None
    from .backends import op

    return op("frag_pack")


def to_words(codes: torch.Tensor, table: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., M] gathered by table [W, F] into int32 words [..., W] (field f at bit bits * f)."""
    g = codes[..., table].long()  # [..., W, F]
    w = (g << (bits * torch.arange(table.shape[1], device=codes.device))).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def from_words(words: torch.Tensor, table: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of to_words: int32 words [..., W] -> uint8 codes [..., W * F]."""
    sh = bits * torch.arange(table.shape[1], device=words.device)
    f = (words.long()[..., None] >> sh) & ((1 << bits) - 1)  # [..., W, F]
    out = torch.empty(*words.shape[:-1], table.numel(), dtype=torch.uint8, device=words.device)
    out[..., table.flatten()] = f.flatten(-2).to(torch.uint8)
    return out


def _unpermute(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out[..., table] = x
    return out


def _out(dst: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x if dst is None else dst.copy_(x)


# -- whole blocks both ways (on CUDA the codes move in one Triton launch each: tale_kernels.frag_pack) -------------


def pack_keys(keys: QTensor, kc: torch.Tensor | None = None, km: torch.Tensor | None = None):
    """Keys QTensor [B, K, C, 128] (C a multiple of 32, the first slot's parity even) -> (kc, km), written into
    the given views of a level's buffers, else new tensors."""
    B, K, C, _ = keys.shape
    G, nb, kb, dev = K // GS, C // BLOCK, keys.bits, keys.data.device
    k = _kernels(keys.data)
    if k is not None:
        kc = torch.empty(B, G, C, 16 * kb, dtype=torch.int32, device=dev) if kc is None else kc
        km = torch.empty(B, G, nb, GS, 32, 8, dtype=keys.scale.dtype, device=dev) if km is None else km
        k.pack_keys(keys, kc, km)
        return kc, km
    meta = torch.stack((keys.scale, keys.zero)).view(2, B, G, GS, nb, N).permute(1, 2, 4, 0, 3, 5)
    meta = meta.reshape(B, G, nb, 2 * GS * N)[..., on_device(str(dev), "key_meta")].view(B, G, nb, GS, 32, 8)
    codes = unpack(keys.data, kb).view(B, G, GS, C, N).transpose(2, 3).reshape(B, G, C, GS * N)
    kt = on_device(str(dev), "key", kb)
    words = torch.empty(B, G, C, 16 * kb, dtype=torch.int32, device=dev)
    words[:, :, 0::2] = to_words(codes[:, :, 0::2], kt[0], kb)
    words[:, :, 1::2] = to_words(codes[:, :, 1::2], kt[1], kb)
    return _out(kc, words), _out(km, meta)


def unpack_keys(kc: torch.Tensor, km: torch.Tensor, proto: QTensor) -> QTensor:
    """kc, km (from an even slot) -> the keys QTensor [B, 4 G, C, 128] (bits, group, meta, shift of `proto`)."""
    B, G, C, _ = kc.shape
    nb, kb, dev = C // BLOCK, proto.bits, kc.device
    k = _kernels(kc)
    if k is not None:
        data, scale, zero = k.unpack_keys(kc, km, kb, km.dtype)
        return replace(proto, data=data, scale=scale, zero=zero)
    meta = _unpermute(km.reshape(B, G, nb, 2 * GS * N), on_device(str(dev), "key_meta")).view(B, G, nb, 2, GS, N)
    scale, zero = (meta[:, :, :, i].transpose(2, 3).reshape(B, G * GS, nb, N) for i in (0, 1))
    kt = on_device(str(dev), "key", kb)
    codes = torch.empty(B, G, C, GS * N, dtype=torch.uint8, device=dev)
    codes[:, :, 0::2] = from_words(kc[:, :, 0::2], kt[0], kb)
    codes[:, :, 1::2] = from_words(kc[:, :, 1::2], kt[1], kb)
    codes = codes.view(B, G, C, GS, N).transpose(2, 3).reshape(B, G * GS, C, N)
    return replace(proto, data=pack(codes, kb), scale=scale, zero=zero)


def pack_lat(lat: QTensor, lc: torch.Tensor | None = None, lm: torch.Tensor | None = None):
    """Latents QTensor [B, G, C, r] (r a multiple of 256) -> (lc, lm), written into the given views, else new."""
    B, G, C, r = lat.shape
    nb, halves, lb, dev = C // BLOCK, r // HALF, lat.bits, lat.data.device
    k = _kernels(lat.data)
    if k is not None:
        lc = torch.empty(B, G, halves, nb, 256 * lb, dtype=torch.int32, device=dev) if lc is None else lc
        lm = torch.empty(B, G, halves, nb, 8, 2, 4, 8, dtype=lat.scale.dtype, device=dev) if lm is None else lm
        k.pack_lat(lat, lc, lm)
        return lc, lm
    meta = torch.stack((lat.scale, lat.zero)).view(2, B, G, nb, BLOCK, halves, 8).permute(1, 2, 5, 3, 0, 4, 6)
    meta = meta.reshape(B, G, halves, nb, 512)[..., on_device(str(dev), "lat_meta")].view(B, G, halves, nb, 8, 2, 4, 8)
    codes = unpack(lat.data, lb).view(B, G, nb, BLOCK, halves, HALF).permute(0, 1, 4, 2, 3, 5)
    words = to_words(codes.reshape(B, G, halves, nb, BLOCK * HALF), on_device(str(dev), "lat", lb), lb)
    return _out(lc, words), _out(lm, meta)


def unpack_lat(lc: torch.Tensor, lm: torch.Tensor, proto: QTensor) -> QTensor:
    """lc, lm -> the latents QTensor [B, G, C, r] (bits, group, meta and shift of `proto`)."""
    B, G, halves, nb, _ = lc.shape
    C, r, lb, dev = nb * BLOCK, halves * HALF, proto.bits, lc.device
    k = _kernels(lc)
    if k is not None:
        data, scale, zero = k.unpack_lat(lc, lm, lb, lm.dtype)
        return replace(proto, data=data, scale=scale, zero=zero)
    meta = _unpermute(lm.reshape(B, G, halves, nb, 512), on_device(str(dev), "lat_meta"))
    meta = meta.view(B, G, halves, nb, 2, BLOCK, 8)
    scale, zero = (meta[..., i, :, :].permute(0, 1, 3, 4, 2, 5).reshape(B, G, C, halves * 8) for i in (0, 1))
    codes = from_words(lc, on_device(str(dev), "lat", lb), lb).view(B, G, halves, nb, BLOCK, HALF)
    codes = codes.permute(0, 1, 3, 4, 2, 5).reshape(B, G, C, r)
    return replace(proto, data=pack(codes, lb), scale=scale, zero=zero)


@dataclass
class FragLevel:
    """One quantized level of one layer in the fragment layout: C slots (a ring of whole blocks)."""

    kc: torch.Tensor
    km: torch.Tensor
    lc: torch.Tensor
    lm: torch.Tensor
    key_proto: QTensor  # the format of the keys and latents it takes and gives (data/scale/zero unused)
    lat_proto: QTensor

    @classmethod
    def empty(cls, B: int, G: int, C: int, kb: int, lb: int, rank: int, dtype, device) -> FragLevel:
        if C % BLOCK or rank % HALF:
            raise ValueError(f"fragment layout: capacity {C} and rank {rank} must be multiples of {BLOCK}, {HALF}")
        mdt, shift = meta_format(dtype)
        nb, halves = C // BLOCK, rank // HALF
        z = dict(device=device)
        return cls(
            torch.zeros(B, G, C, 16 * kb, dtype=torch.int32, **z),
            torch.zeros(B, G, nb, GS, 32, 8, dtype=mdt, **z),
            torch.zeros(B, G, halves, nb, 8 * lb * 32, dtype=torch.int32, **z),
            torch.zeros(B, G, halves, nb, 8, 2, 4, 8, dtype=mdt, **z),
            QTensor(torch.empty(0), None, None, kb, BLOCK, -2, "16", 1.0, shift),
            QTensor(torch.empty(0), None, None, lb, BLOCK, -1, "16", 1.0, shift),
        )

    @property
    def capacity(self) -> int:
        return self.kc.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.kc, self.km, self.lc, self.lm]

    def slot_nbytes(self) -> int:
        """Cache bytes per slot, all batch rows: the same as the row layout's (codes, scales, zeros)."""
        return sum(t.numel() * t.element_size() for t in self.tensors()) // self.capacity

    def _check(self, slot: int, n: int) -> None:
        if slot % BLOCK or n % BLOCK or slot + n > self.capacity:
            raise ValueError(f"fragment layout: slots [{slot}, {slot + n}) are not whole blocks of {self.capacity}")

    def write_slots(self, slot: int, keys: QTensor, lat: QTensor) -> None:
        """Write tokens (keys [B, K, n, 128], latents [B, G, n, r], in this level's format) at slots slot.."""
        n = keys.shape[-2]
        self._check(slot, n)
        for src, proto in ((keys, self.key_proto), (lat, self.lat_proto)):
            if (src.bits, src.group, src.meta, src.shift) != (proto.bits, proto.group, proto.meta, proto.shift):
                raise ValueError("fragment layout: tokens quantized in another format than the level's")
        b0, b1 = slot // BLOCK, (slot + n) // BLOCK
        pack_keys(keys, self.kc[:, :, slot : slot + n], self.km[:, :, b0:b1])
        pack_lat(lat, self.lc[:, :, :, b0:b1], self.lm[:, :, :, b0:b1])

    def take_keys(self, slot: int, n: int) -> QTensor:
        """Slots [slot, slot + n)'s keys as a row-layout QTensor."""
        self._check(slot, n)
        b0, b1 = slot // BLOCK, (slot + n) // BLOCK
        return unpack_keys(self.kc[:, :, slot : slot + n], self.km[:, :, b0:b1], self.key_proto)

    def take_lat(self, slot: int, n: int) -> QTensor:
        """Slots [slot, slot + n)'s latents as a row-layout QTensor."""
        self._check(slot, n)
        b0, b1 = slot // BLOCK, (slot + n) // BLOCK
        return unpack_lat(self.lc[:, :, :, b0:b1], self.lm[:, :, :, b0:b1], self.lat_proto)

    def repeat_interleave(self, repeats: int) -> None:
        self.kc, self.km, self.lc, self.lm = (t.repeat_interleave(repeats, dim=0) for t in self.tensors())


class FragRegion:
    """A fragment-layout level as a regions.Region: the kernel reads `frag`; `keys` and `lat` unpack the whole
    level on each access (the torch reference and other readers of the row layout)."""

    rope = None
    basis = None

    def __init__(self, frag: FragLevel, rank: int, pos: torch.Tensor, length):
        self.frag, self.rank, self.pos, self.length = frag, rank, pos, length

    @property
    def capacity(self) -> int:
        return self.frag.capacity

    @property
    def keys(self) -> QTensor:
        return self.frag.take_keys(0, self.capacity)

    @property
    def lat(self) -> QTensor:
        return self.frag.take_lat(0, self.capacity)
