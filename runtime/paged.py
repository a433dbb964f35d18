"""A paged cache of packed TALE tokens (docs/serving.md, stage 2): the slot format, writing slots, reading them back,
and the torch reference of decode attention over it.

A layer's cache is one byte pool `[num_pages, page_size, G, slot_bytes]` (uint8), addressed per sequence by a block
table `[B, max_pages]` (int32 page ids) and a length `[B]` (cached tokens), as a serving engine (vLLM) keeps it:
vLLM sees `G` cache heads, one per latent group. A token's slot in group c is complete when written: no field
depends on other tokens, so it is written once, in any order, to any page. It holds, one field after the other:

    key codes     g rows of n channels at key_bits (runtime/quant.py planar packing; 16 bits: the cache dtype)
    key scales    g * n / key_group, then key zeros (the same count): per token over groups of channels
    latent codes  `rank` channels at lat_bits (planar; 16 bits: the cache dtype)
    latent scales rank / lat_group, then latent zeros

Scales and zeros are stored as quant.meta_format gives them (bfloat16 caches: float16 times 2^-8), and the slot is
padded to a multiple of 16 bytes. Keys are quantized per token, not per channel over token groups (KIVI): a
per-channel scale over a group of tokens is known only once the whole group is there, so it would need a 16-bit
residual until then, or groups equal to pages (and a page rewritten as it fills); per-token keys make each slot
self-contained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import latent_attention
from .quant import QTensor, dequantize, meta_format, quantize
from .regions import LayerView, Region

BITS = (2, 4, 8, 16)


def _planes(c: int, bits: int) -> tuple[int, int]:
    """(planes, channels per plane) of a row of c codes: packed ones per runtime/quant.py, 8/16-bit ones in blocks
    of contiguous channels (what the kernel dequantizes per step)."""
    if bits < 8:
        return 8 // bits, c * bits // 8
    return (4, c // 4) if c % 4 == 0 and c >= 64 else (1, c)


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class PagedFormat:
    """The slot of one latent group: `group` KV heads of `head_dim` channels and one latent of `rank` channels."""

    head_dim: int  # n
    group: int  # g: KV heads per latent group
    rank: int  # latent channels cached (<= g * n)
    key_bits: int
    lat_bits: int
    key_group: int = 32  # key channels per scale/zero (per token)
    lat_group: int = 32  # latent channels per scale/zero (per token)
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        n, g, r = self.head_dim, self.group, self.rank
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"paged caches hold float16, bfloat16 or float32, not {self.dtype}")
        for what, bits in (("key", self.key_bits), ("latent", self.lat_bits)):
            if bits not in BITS:
                raise ValueError(f"{what} bits must be one of {', '.join(map(str, BITS))}, not {bits}")
        if n < 16 or n & (n - 1):
            raise ValueError(f"head dim must be a power of two >= 16, not {n}")
        if not 0 < r <= g * n or r % 8:
            raise ValueError(f"latent rank {r} must be a multiple of 8 in (0, {g * n}]")
        for what, c, bits, grp in (
            ("key", n, self.key_bits, self.key_group),
            ("latent", r, self.lat_bits, self.lat_group),
        ):
            if bits == 16:
                continue
            if grp < 1 or grp & (grp - 1) or c % grp:
                raise ValueError(f"{what} group {grp} must be a power of two dividing {c}")
            per = _planes(c, bits)[1]
            if per % grp and grp % per:  # a scale group must not straddle a plane (the kernel scales plane by plane)
                raise ValueError(f"{what} group {grp} straddles the planes of {per} channels ({bits}-bit codes of {c})")

    @property
    def meta_dtype(self) -> torch.dtype:
        return meta_format(self.dtype)[0]

    @property
    def shift(self) -> float:
        return meta_format(self.dtype)[1]

    def _row(self, c: int, bits: int) -> int:
        """Bytes of one row of c values."""
        return c * self.dtype.itemsize if bits == 16 else c * bits // 8

    def _meta(self, c: int, bits: int, grp: int) -> int:
        """Bytes of one row's scales (its zeros: the same again)."""
        return 0 if bits == 16 else c // grp * self.meta_dtype.itemsize

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each field in the slot, and `end` (its unpadded size)."""
        g, n, r = self.group, self.head_dim, self.rank
        o = {"key": 0}
        o["key_scale"] = g * self._row(n, self.key_bits)
        o["key_zero"] = o["key_scale"] + g * self._meta(n, self.key_bits, self.key_group)
        lat = o["key_zero"] + g * self._meta(n, self.key_bits, self.key_group)
        o["lat"] = _align(lat, self.dtype.itemsize if self.lat_bits == 16 else 1)
        o["lat_scale"] = _align(o["lat"] + self._row(r, self.lat_bits), self.meta_dtype.itemsize)
        o["lat_zero"] = o["lat_scale"] + self._meta(r, self.lat_bits, self.lat_group)
        o["end"] = o["lat_zero"] + self._meta(r, self.lat_bits, self.lat_group)
        return o

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's slot in one latent group (padded to 16 for aligned loads)."""
        return _align(self.offsets["end"], 16)


@dataclass
class PagedPool:
    """One layer's pages: data [num_pages, page_size, G, fmt.slot_bytes] uint8."""

    data: torch.Tensor
    fmt: PagedFormat

    @property
    def page_size(self) -> int:
        return self.data.shape[1]

    @property
    def num_groups(self) -> int:
        return self.data.shape[2]


def new_pool(fmt: PagedFormat, num_pages: int, page_size: int, num_groups: int, device="cpu") -> PagedPool:
    """An empty pool (zeros: a page never written reads as zero codes and scales)."""
    data = torch.zeros(num_pages, page_size, num_groups, fmt.slot_bytes, dtype=torch.uint8, device=device)
    return PagedPool(data, fmt)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., c] of any dtype -> its bytes [..., c * itemsize] (uint8)."""
    return x.contiguous().view(torch.uint8)


def write_slots(pool: PagedPool, slot_mapping: torch.Tensor, k: torch.Tensor, h: torch.Tensor) -> None:
    """Quantize tokens and store each in its slot: k [N, K, n] post-RoPE keys, h [N, G, >= rank] latents (the first
    `rank` channels are kept), slot_mapping [N] (page * page_size + offset; negative: not written, as vLLM marks
    padding tokens). Keys and latents are quantized per token over channel groups (runtime/quant.py)."""
    f, (N, K, n) = pool.fmt, k.shape
    G, g = pool.num_groups, f.group
    if n != f.head_dim or K != G * g or tuple(h.shape[:2]) != (N, G) or h.shape[-1] < f.rank:
        raise ValueError(f"write_slots: keys {tuple(k.shape)} / latents {tuple(h.shape)} do not fit {f} x {G} groups")
    if N == 0:
        return
    k, h = k.to(f.dtype), h[..., : f.rank].to(f.dtype)
    kq = quantize(k, f.key_bits, f.key_group, -1)
    hq = quantize(h.contiguous(), f.lat_bits, f.lat_group, -1)
    fields = [_bytes(kq.data).reshape(N, G, -1)]
    if f.key_bits != 16:
        fields += [_bytes(kq.scale).reshape(N, G, -1), _bytes(kq.zero).reshape(N, G, -1)]
    o = f.offsets
    slot = torch.zeros(N, G, f.slot_bytes, dtype=torch.uint8, device=k.device)
    at = 0
    for x in fields:
        slot[..., at : at + x.shape[-1]] = x
        at += x.shape[-1]
    lat = [(o["lat"], hq.data)]
    if f.lat_bits != 16:
        lat += [(o["lat_scale"], hq.scale), (o["lat_zero"], hq.zero)]
    for at, x in lat:
        x = _bytes(x)
        slot[..., at : at + x.shape[-1]] = x
    keep = slot_mapping >= 0
    flat = pool.data.view(-1, G, f.slot_bytes)
    flat[slot_mapping[keep].long()] = slot[keep.to(slot.device)]


def gather(pool: PagedPool, block_table: torch.Tensor, lengths: torch.Tensor) -> tuple[QTensor, QTensor, torch.Tensor]:
    """Each sequence's pages read back in order: keys QTensor [B, K, cap, n] and latents QTensor [B, G, cap, rank]
    (per token over channel groups), and positions [B, cap] int32 (-1 past the sequence's length), with
    cap = max_pages * page_size. Block-table entries past a sequence's pages may hold anything."""
    f, data = pool.fmt, pool.data
    B, max_pages = block_table.shape
    P, S, G, SB = data.shape
    g, r, o = f.group, f.rank, f.offsets
    cap = max_pages * S
    slots = data[block_table.long().clamp(0, P - 1)].reshape(B, cap, G, SB)

    def field(at: int, nbytes: int, dtype: torch.dtype, heads: int) -> torch.Tensor:
        """bytes [at, at + nbytes) of every slot as [B, heads, cap, -1] in dtype."""
        x = slots[..., at : at + nbytes].contiguous().view(dtype)  # [B, cap, G, c]
        return x.reshape(B, cap, heads, -1).transpose(1, 2)

    kb, hb = f.key_bits, f.lat_bits
    kdt = f.dtype if kb == 16 else torch.uint8
    hdt = f.dtype if hb == 16 else torch.uint8
    kdata = field(o["key"], o["key_scale"] - o["key"], kdt, G * g)
    hdata = field(o["lat"], f._row(r, hb), hdt, G)
    if kb == 16:
        keys = QTensor(kdata, None, None, 16, f.key_group, -1)
    else:
        nm = o["key_zero"] - o["key_scale"]
        ks = field(o["key_scale"], nm, f.meta_dtype, G * g)
        kz = field(o["key_zero"], nm, f.meta_dtype, G * g)
        keys = QTensor(kdata, ks, kz, kb, f.key_group, -1, shift=f.shift)
    if hb == 16:
        lat = QTensor(hdata, None, None, 16, f.lat_group, -1)
    else:
        nm = o["lat_zero"] - o["lat_scale"]
        hs = field(o["lat_scale"], nm, f.meta_dtype, G)
        hz = field(o["lat_zero"], nm, f.meta_dtype, G)
        lat = QTensor(hdata, hs, hz, hb, f.lat_group, -1, shift=f.shift)
    t = torch.arange(cap, device=data.device, dtype=torch.int32)
    pos = torch.where(t[None, :] < lengths.to(data.device)[:, None], t[None, :], -1).to(torch.int32)
    return keys, lat, pos


def read_slots(pool: PagedPool, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens at slot_mapping [N] dequantized: keys [N, K, n] and latents [N, G, rank], in the pool's dtype."""
    f = pool.fmt
    flat = pool.data.view(-1, 1, pool.num_groups, f.slot_bytes)
    sel = flat[slot_mapping.long()].transpose(0, 1)  # one "page" of N slots
    one = PagedPool(sel.contiguous(), f)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=pool.data.device)
    keys, lat, _ = gather(one, bt, torch.tensor([sel.shape[1]], device=pool.data.device))
    return dequantize(keys, f.dtype)[0].transpose(0, 1), dequantize(lat, f.dtype)[0].transpose(0, 1)


@dataclass
class Sinks:
    """The first tokens of each sequence held at 16 bits outside the pages (TALE's sinks): keys [B, K, A, n] (post-RoPE,
    as the pages'), full-rank latents [B, G, A, R], and `first` [B]: sequence b's positions below first[b] (<= A) are
    read from here, its pages from position first[b] on (their slots below it are not read)."""

    keys: torch.Tensor
    lat: torch.Tensor
    first: torch.Tensor


def paged_view(
    pool: PagedPool, block_table: torch.Tensor, lengths: torch.Tensor, sinks: Sinks | None = None
) -> LayerView:
    """The pages of every sequence as one region (gather), after the sinks' region if any: what
    tale_runtime.attention reads."""
    keys, lat, pos = gather(pool, block_table, lengths)
    if sinks is None:
        return LayerView([Region(keys, lat, pool.fmt.rank, pos, pos.shape[-1])], next_pos=0)
    first = sinks.first.to(pos.device)[:, None]
    pos = pos.masked_fill(pos < first, -1)
    B, _, A, _ = sinks.keys.shape
    a = torch.arange(A, device=pos.device, dtype=torch.int32)
    spos = torch.where(a[None, :] < first, a[None, :], -1).to(torch.int32)  # [B, A]
    sk = QTensor(sinks.keys, None, None, 16, 1, -1)
    sh = QTensor(sinks.lat, None, None, 16, 1, -1)
    return LayerView(
        [Region(sk, sh, sinks.lat.shape[-1], spos, A), Region(keys, lat, pool.fmt.rank, pos, pos.shape[-1])],
        next_pos=0,
    )


def paged_attention_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    h_new: torch.Tensor,
    pool: PagedPool,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    sinks: Sinks | None = None,
) -> torch.Tensor:
    """Decode attention (T = 1) over the paged tokens plus the new exact one, in float32: the pages gathered and
    dequantized, then tale_runtime.attention.latent_attention. q [B, H, 1, n], k_new [B, K, 1, n], h_new [B, G, 1,
    R] -> z [B, 1, H, R]; cached tokens add only to their first `rank` channels (sinks: to all R, in one softmax with
    the pages)."""
    return latent_attention(q, k_new, h_new, paged_view(pool, block_table, lengths, sinks), scaling)
