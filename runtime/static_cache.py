"""The static TALE cache: preallocated fixed-capacity buffers, lengths on the device (DESIGN.md 4, storage).

Same tokens, levels and quantization as the dynamic cache (cache.py: both follow placement.py), but
every region lives in a buffer allocated once, at the prefill, for `max_length` tokens, so a decode
step of the whole model has fixed shapes and can be captured as a CUDA graph (runtime/decode.py).

Per layer (B batch rows, K KV heads, n head dim, G groups, R = g*n latent width, r_i rank of level i):

    sinks     keys [B, K, S, n], latents [B, G, S, R]          16-bit, S = max left padding + alpha
    level i   keys QTensor [B, K, C_i, n*kb/8] (+ scale/zero [B, K, C_i/key_group, n]), or Bands of such
              buffers over the band's channels (index [K, c] on the device, the layer's key_order);
              per-token keys (key_axis "token") [B, K, C_i, n*kb/8] (+ scale/zero [B, K, C_i, n/key_channel_group]);
              low-rank keys (the layer's key rank r, Schedule.key_rank) the coefficients [B, Kb, C_i, r*kb/8] on the
              layer's key basis of Kb blocks,
              latents QTensor [B, G, C_i, r_i*b/8] (+ scale/zero [B, G, C_i, r_i/value_group]); with 16-bit
              scales the codes channel-major (a transposed view of [B, G, r_i*b/8, C_i']: the kernel's dot layout)
              fp8 scales/zeros (key_meta, value_meta "8/16", "8/8"): one bias per buffer, a device scalar
              (a captured graph reads the current one) mirrored on the host; a write with a smaller bias
              re-biases the buffer first (as quant.cat does), one with a larger bias is re-biased to the buffer's;
              layout "frag": the paper preset's levels on the shapes of tale_kernels' CUDA decode kernel, held as
              frag.FragLevel (the same bytes permuted into mma fragments; flushes and demotions convert)
              a ring of C_i slots (whole key groups): tokens enter at the write counter w_i and
              leave (demoted) from the read counter r_i; level 0 never wraps
    residual  keys [B, K, residual, n], latents [B, G, residual, R]   16-bit, the newest tokens

A sliding-window layer (window W, `windows`) holds none of these: only W - 1 earlier tokens can ever be read (a query
at position p reads positions > p - W, and p itself comes as the new token, attention running before the write), so
it holds a ring of C = min(W - 1, max_length) slots, exact like the sinks:

    ring      keys [B, K, C, n] (after RoPE), latents [B, G, C, R]   16-bit; the token at position p in slot p % C

Shared by all layers (every layer holds the same positions):

    pos[j]    [B, cap_j] int32  cache position of each slot of region j; -1 = empty or padding
    rope[j]   (cos, sin) [B, cap_j, n] float32, key_rope "pre" only: the RoPE tables each slot's key was rotated by,
              for the levels (read back as they are attended) and the residual (undone when it is quantized)
    lens      [2 + levels] int32 slots in use per region (a prefix of the capacity: the high-water mark)
    next_pos  int64 scalar       position of the next token (kappa)
    res_slot  [1] int64          residual slot of the next decode token
    rings[C]  Ring               per ring capacity C: pos [B, C] int32, length [] int32 (min(kappa, C): a prefix),
                                 slot [1] int64 (next_pos % C, the slot of the next decode token)

Counts are integer arithmetic on the host (placement.py): the host knows, without reading the device,
when the residual fills (every `residual` steps) and when a level demotes a key group. A decode step
that only writes the new token into the residual and the rings (slots and positions from the device tensors) is
what a CUDA graph captures; the flush and the demotions are fixed-size work (whole key groups) that
runs after the step, outside its graph, every few steps. Demotions in the row layout are addressed on the device
(`move_base`: the first slot read and written; fp8 biases there), so on CUDA each (level, tokens) is a CUDA graph
of its own, captured at its second run and replayed after; with fp8 scales the per-layer writes are compiled
(`fused`). The fragment layout's demotions and the flushes run eagerly.
"""

from __future__ import annotations

import copy
import itertools
import math
import types
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache

from . import key_basis as kb
from .artifact import Schedule
from .attention import apply_rope
from .backends import TORCH, AttentionBackend
from .cache import CacheStep, TransformersCacheLayer, band_index, baseline_nbytes, demote_level, key_layout, quant_level
from .frag import FragLevel, FragRegion, fits
from .key_basis import KeyBasis
from .placement import demotions, fill_counts, flush_count
from .quant import FP8, Bands, QTensor, _rebias, cat, meta_format, rescaled
from .regions import LayerView, Region, Rotary
from .spec import CacheSpec


@dataclass
class Book:
    """Host bookkeeping of a static cache (the same for every layer and batch row)."""

    sink_cap: int
    residual_cap: int
    kappa: int = 0
    sink_len: int = 0
    res_len: int = 0
    w: list[int] = field(default_factory=list)  # tokens ever written into level i
    r: list[int] = field(default_factory=list)  # tokens ever demoted out of level i

    def counts(self) -> list[int]:
        return [a - b for a, b in zip(self.w, self.r)]

    def beyond_sinks(self) -> bool:
        return self.res_len > 0 or any(self.w)

    def add(self, s: Schedule, T: int) -> tuple[int, list[int] | None, int]:
        """Take T new tokens: (tokens into the sinks, per-level counts of a direct fill or None,
        tokens into the residual)."""
        take = min(T, self.sink_cap - self.sink_len)
        rest = T - take
        fill = None
        self.kappa += T
        self.sink_len += take
        if rest and not self.beyond_sinks():
            fill, n_res = fill_counts(s, rest)
            self.w = [a + c for a, c in zip(self.w, fill)]
        else:
            n_res = rest
        if self.res_len + n_res > self.residual_cap:
            raise ValueError(
                f"static cache: {n_res} new tokens do not fit in the residual after the prefill "
                f"(feed them one at a time, or use the dynamic cache)"
            )
        self.res_len += n_res
        return take, fill, n_res

    def maintain(self, s: Schedule) -> tuple[int, list[tuple[int, int, int, int]]]:
        """Flush and demote as placement.py says: (residual tokens flushed, [(level i, tokens, read
        counter of i, write counter of i - 1)])."""
        L = len(self.w) - 1
        q = flush_count(s, self.res_len)
        self.w[L] += q
        self.res_len -= q
        moves = []
        for i, m in demotions(s, self.counts(), self.res_len, self.kappa - self.sink_cap):
            moves.append((i, m, self.r[i], self.w[i - 1]))
            self.r[i] += m
            self.w[i - 1] += m
        return q, moves


@dataclass
class Ring:
    """The slots of the sliding-window layers of one ring capacity C (shared by them: every layer holds the same
    positions): the token at cache position p sits in slot p % C, so the ring holds the last C positions."""

    cap: int
    pos: torch.Tensor  # [B, C] int32: cache position of each slot; -1 = empty or padding
    length: torch.Tensor  # [] int32: slots in use, min(kappa, C) (a prefix: slots fill in order before they wrap)
    slot: torch.Tensor  # [1] int64: next_pos % C, where the next decode token goes

    def tensors(self) -> list[torch.Tensor]:
        return [self.pos, self.length, self.slot]


def ring_capacity(window: int, max_length: int) -> int:
    """Slots of a sliding layer's ring: the W - 1 positions before a query's own that its window reaches (attention
    reads the cache before the new tokens are written), or max_length if fewer tokens ever come."""
    return max(1, min(window - 1, max_length))


def capacities(s: Schedule, book: Book, max_length: int) -> list[int]:
    """Ring slots per level: the most tokens each level holds from `book` until `max_length` tokens,
    decoding one at a time (counted right after a flush, before demotions empty the top level)."""
    b = copy.deepcopy(book)
    caps = b.counts()
    while True:
        _, moves = b.maintain(s)
        run = b.counts()
        for i, m, _, _ in moves:  # back to right after the flush, then replay the moves
            run[i] += m
            run[i - 1] -= m
        caps = [max(a, x) for a, x in zip(caps, run)]
        for i, m, _, _ in moves:
            run[i] -= m
            run[i - 1] += m
            caps[i - 1] = max(caps[i - 1], run[i - 1])
        if b.kappa >= max_length:
            break
        b.add(s, 1)
    gk = s.key_group
    return [max(gk, -(-c // gk) * gk) for c in caps]


def _spans(start: int, m: int, cap: int) -> list[tuple[int, int, int]]:
    """Token indices [start, start + m) of a ring of `cap` slots as (slot, offset in the run, length)."""
    out, off = [], 0
    while off < m:
        slot = (start + off) % cap
        n = min(m - off, cap - slot)
        out.append((slot, off, n))
        off += n
    return out


def _rows(q: QTensor, a: int, b: int) -> list[torch.Tensor]:
    """Slices of q's data, scale, zero for tokens [a, b) along dim -2 (buffers are [B, X, tokens, ...])."""
    g = q.group if q.dim in (-2, q.data.dim() - 2) else 1  # keys: one scale row per token group
    out = [q.data[..., a:b, :]]
    if q.scale is not None:
        out += [q.scale[..., a // g : b // g, :], q.zero[..., a // g : b // g, :]]
    return out


def _qbufs(x: QTensor | Bands) -> list[QTensor]:
    return list(x.parts) if isinstance(x, Bands) else [x]


def _raw(t: torch.Tensor) -> QTensor:
    return QTensor(t, None, None, 16, 1, -2)


@dataclass
class Slots:
    """Slots of a level addressed on the device (a captured graph reads the current ones): `tok` [m] int64 the
    tokens' slots, `grp` the scale rows of keys quantized over token groups (slot // key_group, whole groups)."""

    tok: torch.Tensor
    grp: torch.Tensor


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 as its bytes: not every device indexes float8 eagerly (inductor on CUDA does, and cannot view a result's
    dtype)."""
    return t if t.dtype != FP8 or (t.is_cuda and torch.compiler.is_compiling()) else t.view(torch.uint8)


def _by_group(q: QTensor) -> bool:
    return q.dim in (-2, q.data.dim() - 2)  # keys over token groups: one scale row per group (as _rows)


def take_at(q: QTensor | Bands, at: Slots) -> QTensor | Bands:
    """The tokens at slots `at` of a buffer [B, X, C, ...] (dim 2), with the buffer's bias (a device scalar)."""
    if isinstance(q, Bands):
        return Bands([take_at(p, at) for p in q.parts], q.index, q.n)
    rows = at.grp if _by_group(q) else at.tok
    sel = [None if t is None else _bytes(t).index_select(2, rows).view(t.dtype) for t in (q.scale, q.zero)]
    return replace(q, data=q.data.index_select(2, at.tok), scale=sel[0], zero=sel[1])


def put_at(dst: QTensor | Bands, src: QTensor | Bands, at: Slots) -> None:
    """src's tokens into dst's slots `at`; fp8 formats re-biased on the device by the host's rule (one bias per buffer,
    the smaller: what it holds and what comes are rescaled to it, exact; a bias of inf, an empty buffer, takes the
    first write's). No host read: a CUDA graph captures it. The same codes as StaticTaleLayer._put."""
    if isinstance(dst, Bands):
        for d, x in zip(dst.parts, src.parts):
            put_at(d, x, at)
        return
    if dst.meta != "16":
        newb = torch.minimum(dst.bias, src.bias)
        held = rescaled(dst, newb)
        dst.scale.copy_(held.scale)
        if dst.zero.dtype == FP8:
            dst.zero.copy_(held.zero)
        dst.bias.copy_(newb)
        src = rescaled(src, newb)
    rows = at.grp if _by_group(dst) else at.tok
    for d, x, ix in ((dst.data, src.data, at.tok), (dst.scale, src.scale, rows), (dst.zero, src.zero, rows)):
        if d is not None:
            _bytes(d).index_copy_(2, ix, _bytes(x.to(d.dtype)))


def _empty_q(
    lead: tuple,
    tokens: int,
    channels: int,
    bits: int,
    group: int,
    dim: int,
    dtype,
    device,
    meta: str = "16",
    channel_major: bool = True,
) -> QTensor:
    """A zeroed QTensor buffer [*lead, tokens, channels] at `bits` (dim: -2 per channel over token groups, -1 per
    token over channel groups); fp8 scale/zero per `meta`, with the bias a device scalar; 16-bit ones per
    meta_format. `channel_major`: per-token codes with 16-bit scales slot-contiguous (latents; keys stay row-major)."""
    if bits == 16:
        return QTensor(torch.zeros(*lead, tokens, channels, dtype=dtype, device=device), None, None, 16, group, dim)
    if dim == -1 and meta == "16" and channel_major:  # latents channel-major (slots contiguous): the decode kernel
        # unpacks them in the dot's operand layout (H100: paper preset 1.13-1.17x; with fp8 scales 0.75-0.84x, so
        # those stay row-major: docs/kernels.md); rows padded to 16 bytes, so a channel byte's stride is 16-aligned
        pad = -(-tokens // 16) * 16
        data = torch.zeros(*lead, channels * bits // 8, pad, dtype=torch.uint8, device=device).transpose(-1, -2)
        data = data[..., :tokens, :]
    else:
        data = torch.zeros(*lead, tokens, channels * bits // 8, dtype=torch.uint8, device=device)
    sshape = (*lead, tokens // group, channels) if dim == -2 else (*lead, tokens, channels // group)
    mdt, shift = meta_format(dtype, meta)
    scale = torch.zeros(sshape, dtype=mdt if meta == "16" else FP8, device=device)
    zero = torch.zeros(sshape, dtype=FP8 if meta == "8/8" else mdt, device=device)
    bias = 1.0 if meta == "16" else torch.ones((), dtype=torch.float32, device=device)
    return QTensor(data, scale, zero, bits, group, dim, meta, bias, shift)


def write_top(
    s: Schedule, L: int, rank: int, key_ranks, k, h, rope, keys: QTensor, lat: QTensor, order, basis, slot
) -> None:
    """A decode token (k post-RoPE [B, K, 1, n], h [B, G, 1, R]; rope its (cos, sin) with key_rope "pre") quantized
    into the per-token top level L at the device-held `slot`, biases on the device; `key_ranks`: the layer's."""
    if rope is not None:
        k = apply_rope(k.float(), rope[0].float(), -rope[1].float()).to(k.dtype)
    kq, hq = quant_level(s, L, rank, key_ranks, k, h, order, basis, device_bias=True)
    at = Slots(slot, slot)  # per-token keys: a scale row per slot
    put_at(keys, kq, at)
    put_at(lat, hq, at)


def demote_at(
    s: Schedule, level: int, rank: int, key_ranks, keys, lat, keys_to, lat_to, order, basis, src: Slots, dst: Slots
):
    """The tokens at slots `src` of the level above (keys, lat) requantized into `level` (keys_to, lat_to) at slots
    `dst` (cache.demote_level), biases on the device; `key_ranks`: the layer's."""
    kq, hq = take_at(keys, src), take_at(lat, src)
    kq, hq = demote_level(s, level, key_ranks, kq, hq, rank, order, basis, device_bias=True)
    put_at(keys_to, kq, dst)
    put_at(lat_to, hq, dst)


_FUSED: dict = {}
_CODES = itertools.count()  # each compiled copy's own code name


def _exact() -> dict:
    """Inductor options for eager's rounding (no FMA contraction; IEEE division where the version offers it): a
    quantizer's codes flip at rounding boundaries, and the static cache must hold the dynamic cache's codes."""
    from torch._inductor import config

    return {"emulate_precision_casts": True} | (
        {"eager_numerics.division_rounding": True} if hasattr(config, "eager_numerics") else {}
    )


def own_code(fn, i: int):
    """fn as a function with a code object (and name) of its own: dynamo's record of which inputs varied is kept per
    file, line and name, so each copy keeps its own integers constant."""
    name = f"{fn.__name__}_{i}"
    return types.FunctionType(fn.__code__.replace(co_name=name, co_qualname=name), fn.__globals__, name)


def fused(fn, device: torch.device, key: tuple = ()):
    """fn as inductor compiles it on CUDA, else fn. Per layer and step these are ~180 (write_top) and ~300
    (demote_at) small ops: inside a CUDA graph each still costs a launch (about 10 ms a token at 32 layers), compiled
    they are a few fused kernels. The same codes (checked against the eager path on the GPU). `key`: what fixes the
    integers fn reads (schedule, level, rank): each key compiles a code object of its own, so that dynamo keeps them
    constant (one that changed between calls would become symbolic, and bit widths cannot) while tensor sizes, which
    change with every cache's capacity, may become dynamic."""
    return compiled(fn, key) if device.type == "cuda" else fn


def compiled(fn, key: tuple = (), made: dict = _FUSED):
    """fn compiled by inductor as `fused` compiles it (whole graph, eager's rounding), once per (fn, key) in `made`."""
    f = made.get((fn, key))
    if f is None:
        f = made[fn, key] = torch.compile(own_code(fn, next(_CODES)), fullgraph=True, options=_exact())
    return f


class StaticTaleLayer(TransformersCacheLayer):
    """One decoder layer's buffers of a StaticTaleCache (the bookkeeping lives in the cache)."""

    def __init__(self, cache: StaticTaleCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.ranks = cache.schedule.ranks[layer_idx]
        self.key_ranks = cache.schedule.layer_key_ranks(layer_idx)  # low-rank keys' coefficients per level (0: plain)
        ko = cache.schedule.key_order
        self.order = None if ko is None else ko[layer_idx]
        self.basis: KeyBasis | None = None if cache.key_basis is None else cache.key_basis[layer_idx]
        self.bias: dict[int, float] = {}  # id(fp8 buffer) -> its bias on the host (the device scalar's value)
        self._view: LayerView | None = None
        # a sliding-window layer's window: made with it (the cache's `windows`), the layer holds a ring of that window;
        # passed only with its updates, it sets the 16-bit baseline and the layer holds every token (attention masks)
        self.window: int | None = cache.windows[layer_idx]
        self.ring: int | None = None  # the ring's capacity (set at the allocation), None: the regions of the schedule

    # -- HF cache layer interface ------------------------------------------------------

    @property
    def kappa(self) -> int:
        return self.cache.book.kappa if self.cache.book else 0

    def update(self, key_states, value_states, valid=None, queries=None, rope=None, window=None):
        """transformers' cache-layer update, as TALE caches it: post-RoPE keys [B, K, T, n] and latents [B, G, T, R]
        of the step's T new tokens, written where the step's plan puts them (`valid` [B, T]: real tokens, read at the
        prefill; `rope`: the (cos, sin) [B or 1, T, n] the keys were rotated by, read with key_rope "pre"). The static
        cache does not read queries (it places by recency). `window`: the layer's sliding window, which must be the
        one the cache was made with (its ring); a cache made without windows only counts it in the 16-bit baseline
        and holds every token (attention masks what a window cannot read)."""
        if window is not None and self.cache.windows[self.layer_idx] is None:
            self.window = window
        elif window != self.window and window is not None:
            raise ValueError(
                f"static cache: layer {self.layer_idx} attends through a window of {window} tokens; the cache was made "
                f"for {self.window}"
            )
        self.cache._write(self, key_states, value_states, valid, rope)
        return key_states, value_states

    def get_max_length(self) -> int:
        return self.cache.max_length or -1

    def reset(self) -> None:
        self.cache.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: pick batch rows of every buffer, in place (captured graphs stay valid)."""
        if self.cache.book is None:
            return
        for t in self._tensors():
            t.copy_(t.index_select(0, beam_idx.to(t.device)))
        if self.layer_idx == 0:
            for p in self.cache.pos + self.cache._rope_tensors() + [r.pos for r in self.cache.rings.values()]:
                p.copy_(p.index_select(0, beam_idx.to(p.device)))

    @property
    def is_initialized(self) -> bool:
        return self.cache.book is not None

    @is_initialized.setter
    def is_initialized(self, value) -> None:
        pass

    # -- buffers ---------------------------------------------------------------------------

    def allocate(self, B: int, dtype: torch.dtype, device: torch.device) -> None:
        c, s = self.cache, self.cache.schedule
        K, n, G, R = c.K, c.n, c.G, c.R
        S, caps = c.book.sink_cap, c.caps
        kw = dict(dtype=dtype, device=device)
        self._view = None
        self.ring = c.ring_of[self.layer_idx]
        if self.ring is not None:  # a sliding layer: its ring only
            self.ring_k = torch.zeros(B, K, self.ring, n, **kw)
            self.ring_h = torch.zeros(B, G, self.ring, R, **kw)
            self.frag, self.keys, self.lat, self.bias = [], [], [], {}
            return
        self.sink_k = torch.zeros(B, K, S, n, **kw)
        self.sink_h = torch.zeros(B, G, S, R, **kw)
        if c.layout == "frag":
            self.frag = [
                FragLevel.empty(B, G, C, lv.key_bits, lv.bits, r, dtype, device)
                for lv, C, r in zip(s.levels, caps, self.ranks)
            ]
            self.keys, self.lat = [], []
        else:
            self.frag = []
            self.keys = [self._empty_keys(i, B, C, dtype, device) for i, C in enumerate(caps)]
            self.lat = [
                _empty_q((B, G), C, r, lv.bits, s.value_group, -1, dtype, device, s.value_meta)
                for lv, C, r in zip(s.levels, caps, self.ranks)
            ]
        self.bias = {}
        for q in self._qbufs():  # no bias yet: the first write's is taken (put_at: the smaller of the two)
            if q.meta != "16":
                q.bias.fill_(float("inf"))
        self.res_k = torch.zeros(B, K, s.residual, n, **kw)
        self.res_h = torch.zeros(B, G, s.residual, R, **kw)
        self._view = None

    def _empty_keys(self, level: int, B: int, C: int, dtype, device) -> QTensor | Bands:
        c, s = self.cache, self.cache.schedule
        lv = s.levels[level]
        lay = key_layout(s, level)  # per channel over token groups, or per token over channel groups
        if self.key_ranks[level]:  # coefficients [B, Kb, C, r] on the layer's key basis (cache.quant_keys)
            lead, width = (B, self.basis.blocks), self.key_ranks[level]
        else:
            lead, width = (B, c.K), c.n
        if not lv.key_hi_bits:
            return _empty_q(lead, C, width, lv.key_bits, lay["group"], lay["dim"], dtype, device, lay["meta"], False)
        hi, lo = band_index(self.order, lv.key_hi_channels)  # the parts in quant_keys' order: low band, high band
        parts = [
            _empty_q((B, c.K), C, idx.shape[-1], bits, s.key_group, -2, dtype, device, s.key_meta)
            for bits, idx in ((lv.key_bits, lo), (lv.key_hi_bits, hi))
        ]
        return Bands(parts, [lo.to(device), hi.to(device)], c.n)

    def _qbufs(self) -> list[QTensor]:
        return [q for x in self.keys + self.lat for q in _qbufs(x)]

    def _names(self) -> tuple[str, ...]:
        """The 16-bit buffers of this layer (attribute names)."""
        return ("ring_k", "ring_h") if self.ring is not None else ("sink_k", "sink_h", "res_k", "res_h")

    def _tensors(self) -> list[torch.Tensor]:
        out = [getattr(self, nm) for nm in self._names()]
        for q in self._qbufs():
            out += [t for t in (q.data, q.scale, q.zero) if t is not None]
        return out + [t for f in self.frag for t in f.tensors()]

    def nbytes(self) -> int:
        """Bytes of the slots holding tokens (packed codes, scales, zero points, sinks, residual)."""
        b = self.cache.book
        if b is None:
            return 0
        per_tok = lambda t: t.element_size() * t[0].numel() // t.shape[-2]  # noqa: E731  (one token, all rows)
        if self.ring is not None:  # the slots in use: min(kappa, C)
            return min(b.kappa, self.ring) * (per_tok(self.ring_k) + per_tok(self.ring_h)) * self.ring_k.shape[0]
        B = self.sink_k.shape[0]
        total = b.sink_len * (per_tok(self.sink_k) + per_tok(self.sink_h))
        total += b.res_len * (per_tok(self.res_k) + per_tok(self.res_h))
        fp8 = 0
        for x, cnt in zip(self.keys + self.lat, b.counts() * 2):
            for q in _qbufs(x):
                fp8 += 4 if q.meta != "16" and cnt else 0  # its bias: one float32 per tensor, as QTensor.nbytes
                for t in (q.data, q.scale, q.zero):
                    if t is not None:
                        rows = cnt * t.shape[-2] // q.data.shape[-2]  # token groups for key scales
                        total += rows * t.element_size() * t[0].numel() // t.shape[-2]
        total += sum(cnt * f.slot_nbytes() for f, cnt in zip(self.frag, b.counts())) // B
        return total * B + fp8

    def capacity_nbytes(self) -> int:
        """Bytes allocated for this layer."""
        return sum(t.untyped_storage().nbytes() for t in self._tensors()) + 4 * sum(
            q.meta != "16" for q in self._qbufs()
        )

    def view(self) -> LayerView:
        """Every region over its whole capacity; lengths and positions are the cache's device tensors."""
        if self._view is None and self.ring is not None:
            r = self.cache.rings[self.ring]
            self._view = LayerView(
                [Region(_raw(self.ring_k), _raw(self.ring_h), self.cache.R, r.pos, r.length)], self.cache.next_pos
            )
        if self._view is None:
            c = self.cache
            regions = [Region(_raw(self.sink_k), _raw(self.sink_h), c.R, c.pos[0], c.lens[0])]
            for i, (k, h) in enumerate(zip(self.keys, self.lat)):
                rope = c.rotary or (c.rope[1 + i] if c.rope else None)  # keys before RoPE: rotated as they are read
                basis = self.basis if self.key_ranks[i] else None
                regions.append(Region(k, h, self.ranks[i], c.pos[1 + i], c.lens[1 + i], rope, basis))
            for i, f in enumerate(self.frag):
                regions.append(FragRegion(f, self.ranks[i], c.pos[1 + i], c.lens[1 + i]))
            regions.append(Region(_raw(self.res_k), _raw(self.res_h), c.R, c.pos[-1], c.lens[-1]))
            self._view = LayerView(regions, c.next_pos)
        return self._view

    # -- writes (host-planned spans; every layer does the same ones) -------------------------

    def append(self, k: torch.Tensor, h: torch.Tensor, valid: torch.Tensor | None = None, q=None, rope=None) -> None:
        """Cache T new exact tokens (RegionStore.append's arguments; `q` is not read): inside the open step, or (a
        one-layer cache) in a step of their own."""
        c = self.cache
        if c._step is not None:
            self.update(k, h, valid, rope=rope)
            return
        if c.num_layers != 1:
            raise RuntimeError("StaticTaleCache: write every layer inside one step (with cache.step(T): ...)")
        with c.step(k.shape[-2]):
            self.update(k, h, valid, rope=rope)

    def _quant(self, i: int, k: torch.Tensor, h: torch.Tensor, rope, device_bias: bool = False) -> tuple:
        """Exact tokens (k post-RoPE [B, K, T, n], h [B, G, T, R]) quantized at level i (cache.quant_level); with
        key_rope "pre" the keys are first rotated back by their tables `rope` (cos, sin [B, T, n]), as the dynamic
        cache does (RegionStore._quant)."""
        if rope is not None:
            k = apply_rope(k.float(), rope[0].float(), -rope[1].float()).to(k.dtype)
        return quant_level(
            self.cache.schedule, i, self.ranks[i], self.key_ranks, k, h, self.order, self.basis, device_bias
        )

    def _write_new(self, op, k: torch.Tensor, h: torch.Tensor, rope=None) -> None:
        """The step's new tokens where the plan puts them; `rope` (cos, sin) [B, T, n] with key_rope "pre"."""
        c = self.cache
        if self.ring is not None:
            self._write_ring(op, k, h)
            return
        if op.decode and op.direct:  # one token straight into the per-token top level: capturable
            self._write_direct(k, h, rope)
            return
        if op.decode:  # one token into the residual slot the device holds: capturable
            self.res_k.index_copy_(2, c.res_slot, k)
            self.res_h.index_copy_(2, c.res_slot, h)
            return
        a = op.sink_start
        self.sink_k[:, :, a : a + op.take] = k[:, :, : op.take]
        self.sink_h[:, :, a : a + op.take] = h[:, :, : op.take]
        t = op.take
        if op.fill is not None:
            for i, cnt in enumerate(op.fill):
                if cnt:
                    k_, h_ = k[:, :, t : t + cnt], h[:, :, t : t + cnt]
                    tab = None if rope is None else tuple(x[:, t : t + cnt] for x in rope)
                    keys, lat = self._quant(i, k_, h_, tab)
                    self._put_level(i, keys, lat, op.fill_start[i], 0, cnt)
                t += cnt
        if op.n_res:
            a = op.res_start
            self.res_k[:, :, a : a + op.n_res] = k[:, :, t:]
            self.res_h[:, :, a : a + op.n_res] = h[:, :, t:]

    def _write_ring(self, op, k: torch.Tensor, h: torch.Tensor) -> None:
        """The step's new tokens into the ring: position p at slot p % C; of T > C tokens only the last C."""
        ring = self.cache.rings[self.ring]
        if op.decode:  # at the slot the device holds: capturable
            self.ring_k.index_copy_(2, ring.slot, k)
            self.ring_h.index_copy_(2, ring.slot, h)
            return
        T, C = k.shape[-2], self.ring
        m = min(T, C)
        for slot, off, n in _spans(self.cache.book.kappa + T - m, m, C):
            self.ring_k[:, :, slot : slot + n] = k[:, :, T - m + off : T - m + off + n]
            self.ring_h[:, :, slot : slot + n] = h[:, :, T - m + off : T - m + off + n]

    def _write_direct(self, k: torch.Tensor, h: torch.Tensor, rope=None) -> None:
        """A decode step's token quantized into the top level (per token, residual 1: the flush that would follow at
        once) at the slot the device holds, fp8 biases kept on the device: no host read, so a CUDA graph captures it.
        The same codes as the flush (_flush), which picks the bias on the host."""
        c = self.cache
        L = len(c.schedule.levels) - 1
        args = (c.schedule, L, self.ranks[L], self.key_ranks, k, h, rope, self.keys[L], self.lat[L])
        args += (self.order, self.basis, c.top_slot)
        c.writer(write_top, k.device, L, self.ranks[L], self.key_ranks)(*args)

    def _flush(self, q: int, w: int) -> None:
        """Quantize the first q residual tokens into the top level at its write counter w."""
        c = self.cache
        L = len(c.schedule.levels) - 1
        keys, lat = self._quant(L, self.res_k[:, :, :q], self.res_h[:, :, :q], c._residual_rope(q))
        for slot, off, n in _spans(w, q, c.caps[L]):
            self._put_level(L, keys, lat, slot, off, n)
        left = c.book.res_len  # tokens after the flushed ones (chunks only)
        if left:
            self.res_k[:, :, :left] = self.res_k[:, :, q : q + left].clone()
            self.res_h[:, :, :left] = self.res_h[:, :, q : q + left].clone()

    def _demote(self, i: int, m: int, r: int, w: int) -> None:
        """Move m tokens from level i (read counter r) to level i - 1 (write counter w): dequantize,
        truncate to the lower rank, requantize at the lower bits (cache.demote_level, as the dynamic cache)."""
        c = self.cache
        parts = [self._take_level(i, slot, n) for slot, _, n in _spans(r, m, c.caps[i])]
        kq, hq = cat([k for k, _ in parts]), cat([h for _, h in parts])
        keys, lat = demote_level(c.schedule, i - 1, self.key_ranks, kq, hq, self.ranks[i - 1], self.order, self.basis)
        for slot, off, n in _spans(w, m, c.caps[i - 1]):
            self._put_level(i - 1, keys, lat, slot, off, n)

    def _demote_at(self, i: int, src: Slots, dst: Slots) -> None:
        """_demote with the slots on the device and the fp8 biases there: no host read, so a CUDA graph captures it
        (StaticTaleCache._move_at); the same codes as _demote."""
        keys, lat = (self.keys[i], self.lat[i]), (self.keys[i - 1], self.lat[i - 1])
        args = (self.cache.schedule, i - 1, self.ranks[i - 1], self.key_ranks, *keys, *lat, self.order, self.basis)
        self.cache.writer(demote_at, src.tok.device, i, self.ranks[i - 1], self.key_ranks)(*args, src, dst)

    def _put_level(self, i: int, keys, lat, slot: int, off: int, n: int) -> None:
        """Tokens [off, off + n) of a level's keys and latents into its slots [slot, slot + n)."""
        if self.frag:
            self.frag[i].write_slots(
                slot,
                *(replace(q, data=d, scale=s_, zero=z) for q in (keys, lat) for d, s_, z in [_rows(q, off, off + n)]),
            )
            return
        self._put(self.keys[i], keys, slot, off, n)
        self._put(self.lat[i], lat, slot, off, n)

    def _take_level(self, i: int, slot: int, n: int):
        """Slots [slot, slot + n) of level i: (keys, latents) in the row layout."""
        if self.frag:
            return self.frag[i].take_keys(slot, n), self.frag[i].take_lat(slot, n)
        return self._take(self.keys[i], slot, n), self._take(self.lat[i], slot, n)

    def _put(self, dst: QTensor | Bands, src: QTensor | Bands, slot: int, off: int, n: int) -> None:
        """src's tokens [off, off + n) into dst's slots [slot, slot + n)."""
        if isinstance(dst, Bands):
            for d, s_ in zip(dst.parts, src.parts):
                self._put(d, s_, slot, off, n)
            return
        if (src.scale is None) != (dst.scale is None) or (src.scale is not None and src.shift != dst.shift):
            raise ValueError("static cache: tokens quantized in another scale/zero format than the buffer's")
        if dst.meta != "16":
            src = self._rebias(dst, src)
        for d, s_ in zip(_rows(dst, slot, slot + n), _rows(src, off, off + n)):
            d.copy_(s_)

    def _rebias(self, dst: QTensor, src: QTensor) -> QTensor:
        """One fp8 bias for the buffer and the tokens written into it: the smaller one (quant.cat's rule)."""
        hb = self.bias.get(id(dst))
        if hb is not None and src.bias >= hb:
            return _rebias(src, hb)
        if hb is not None:  # what the buffer holds, re-biased in place (exact but for e4m3 subnormals)
            held = _rebias(replace(dst, bias=hb), src.bias)
            dst.scale.copy_(held.scale)
            dst.zero.copy_(held.zero)
        self.bias[id(dst)] = src.bias
        dst.bias.fill_(src.bias)
        return src

    def _take(self, src: QTensor | Bands, slot: int, n: int) -> QTensor | Bands:
        """Slots [slot, slot + n) of a buffer as a QTensor (Bands) with the host's bias."""
        if isinstance(src, Bands):
            return Bands([self._take(p, slot, n) for p in src.parts], src.index, src.n)
        data, *sz = _rows(src, slot, slot + n)
        bias = self.bias.get(id(src), 1.0) if src.meta != "16" else 1.0
        scale, zero = sz or [None, None]
        return replace(src, data=data, scale=scale, zero=zero, bias=bias)


@dataclass
class _Op:
    """What one forward writes for its T new tokens (the same for every layer)."""

    decode: bool  # one token into the residual at the device slot
    take: int = 0  # tokens into the sinks, at sink_start
    sink_start: int = 0
    fill: list[int] | None = None  # a direct fill: tokens per level, at fill_start
    fill_start: list[int] | None = None
    n_res: int = 0  # tokens into the residual, at res_start
    res_start: int = 0
    rope_written: bool = False  # the step's RoPE tables are in place (key_rope "pre": by the first non-ring layer)
    direct: bool = False  # decode: the token goes straight into the per-token top level (StaticTaleCache.direct)


class StaticTaleCache(CacheStep, Cache):
    """The TALE cache in preallocated buffers for `max_length` tokens per row (allocated at the prefill).

    Pass as `past_key_values` to forward/generate like TaleCache; `runtime/decode.py` captures its decode
    step as a CUDA graph. The prefill must be the first call; later calls take one token each (or short
    chunks that fit in the residual). `backend` serves decode attention (tale_runtime.backends); the quantized
    levels are held in the layout it reads (`layout` None), or in the one given ("row", or "frag": the CUDA kernel's,
    which the torch reference reads too). `windows`: per layer its attention's sliding window (None: a global layer);
    a sliding layer holds a 16-bit ring of the tokens its window can still reach instead of the schedule's regions.
    """

    is_compileable = False

    def __init__(
        self,
        schedule: Schedule,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_groups: int,
        latent_rank: int,
        max_length: int | None = None,
        layout: str | None = None,
        num_heads: int | None = None,
        backend: AttentionBackend = TORCH,
        key_basis: list[KeyBasis] | None = None,
        windows: list[int | None] | tuple[int | None, ...] | None = None,
        rotary: tuple[torch.Tensor, float] | None = None,
    ):
        layout = backend.layout if layout is None else layout
        windows = [None] * num_layers if not windows else [None if w is None else int(w) for w in windows]
        if len(windows) != num_layers or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"static cache: windows must give each of the {num_layers} layers a window >= 1 or None")
        if layout not in ("row", "frag"):
            raise ValueError(f"static cache layout must be 'row' or 'frag', not {layout!r}")
        for i in range(num_layers):  # low-rank keys: every layer's basis, with the schedule's blocks and directions
            if why := kb.missing(schedule, None if key_basis is None else key_basis[i], i):
                raise ValueError(f"static cache: layer {i}: {why}")
        if layout == "frag" and (why := fits(schedule, head_dim, num_kv_heads, num_groups, torch.bfloat16)):
            raise ValueError(f"static cache layout 'frag': {why}")
        if backend.layout != layout and backend.name != TORCH.name:  # the reference reads both
            raise ValueError(f"the {backend.name} backend reads the {backend.layout} layout, not {layout!r}")
        self.schedule = schedule
        self.schedule_key = repr(schedule)  # what the compiled writes are specialized on (fused)
        # fp8 scales: the writes are torch ops that inductor fuses; 16-bit ones have tale_kernels' quantizers on CUDA
        # (fused already, and what the dynamic cache runs: compiled, the torch formula would round otherwise)
        self.fuse = schedule.key_meta != "16" and schedule.value_meta != "16"
        top = schedule.levels[-1]
        # the top level takes each token on arrival (per-token keys, residual 1): a decode step writes it there itself,
        # inside the captured graph, rather than into the residual for a flush on the host after each replay
        self.direct = (
            layout == "row"
            and schedule.residual == 1
            and top.key_axis == "token"
            and not top.key_hi_bits
            and not top.key_rank
        )
        self._bias_stale = False  # device writes moved fp8 biases on the device, not yet on the host (_pull_bias)
        # demotions on the device (_move_at), on CUDA one captured graph per (level, tokens), valid for a generation
        self._moves: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self._moves_gen = -1
        self.graph_error: str | None = None  # why capturing a demotion failed (they then run eagerly)
        self.K, self.n, self.G, self.R = num_kv_heads, head_dim, num_groups, latent_rank
        self.key_basis = key_basis  # per layer (levels with key_rank read it)
        self.rope: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per region (key_rope "pre"; None: sinks)
        self.rope_width = head_dim  # the tables' channels: head_dim, fewer with partial rotary (set by the prefill)
        # key_rope "pre": the model's RoPE (inv_freq, attention_scaling; families.rotary) where it depends on the
        # position alone. The cache then holds no tables (8 n bytes per slot, read by every layer's decode): the
        # regions' keys are rotated by a Rotary made from their positions, checked against the model's tables at
        # every prefill write (on a mismatch the cache falls back to tables)
        self._rotary_args = rotary
        self.rotary: Rotary | None = None
        self.layout = layout
        self.num_heads = num_heads
        self.backend = backend
        self.max_length = max_length
        self.num_layers = num_layers
        self.book: Book | None = None
        self.caps: list[int] = []
        self.windows = windows
        self.ring_of: list[int | None] = [None] * num_layers  # per layer its ring's capacity (set at the allocation)
        self.rings: dict[int, Ring] = {}  # by capacity
        # counts buffer allocations: a CUDA graph captured over this cache's buffers (decode.CudaGraphDecoder) is valid
        # while it is unchanged
        self.generation = 0
        super().__init__(layers=[StaticTaleLayer(self, i) for i in range(num_layers)])

    @classmethod
    def from_spec(
        cls,
        spec: CacheSpec,
        *,
        max_length: int | None = None,
        layout: str | None = None,
        backend: AttentionBackend = TORCH,
        key_basis: list[KeyBasis] | None = None,
        rotary: tuple[torch.Tensor, float] | None = None,
    ) -> StaticTaleCache:
        """The static cache a CacheSpec describes: its schedule, the shapes of its arch, its layers' windows."""
        a = spec.arch
        return cls(
            spec.schedule,
            a.num_layers,
            a.num_kv_heads,
            a.head_dim,
            a.num_groups,
            a.latent_rank,
            max_length=max_length,
            layout=layout,
            num_heads=a.num_heads,
            backend=backend,
            key_basis=key_basis,
            windows=spec.windows,
            rotary=rotary,
        )

    def reset(self) -> None:
        self.book = None
        self.generation += 1

    # -- sizes ----------------------------------------------------------------------------

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def capacity_nbytes(self) -> int:
        """Bytes allocated (all layers, buffers and shared positions)."""
        if self.book is None:
            return 0
        rings = [t for r in self.rings.values() for t in r.tensors()]
        pos = sum(p.numel() * p.element_size() for p in self.pos + self._rope_tensors() + rings)
        return sum(layer.capacity_nbytes() for layer in self.layers) + pos

    def baseline_nbytes(self) -> int:
        if self.book is None:
            return 0
        B, windows = self.pos[0].shape[0], [layer.window for layer in self.layers]
        return baseline_nbytes(B, self.K, self.n, self.book.kappa, windows)

    # -- filling ----------------------------------------------------------------------------

    def _allocate(self, k: torch.Tensor, valid: torch.Tensor | None) -> None:
        B, T, dev = k.shape[0], k.shape[-2], k.device
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=dev)
        lead = (~valid).int().cumprod(dim=-1).sum(dim=-1, dtype=torch.int32)  # each row's leading padding
        pad = int(lead.max())  # the prefill's one sync
        max_length = self.max_length or T
        if max_length < T:
            raise ValueError(f"static cache: the prompt ({T} tokens) is longer than max_length ({max_length})")
        s = self.schedule
        book = Book(sink_cap=pad + s.sinks, residual_cap=s.residual, w=[0] * len(s.levels), r=[0] * len(s.levels))
        if self.layout == "frag" and k.dtype != torch.bfloat16:
            raise ValueError(f"static cache layout 'frag' holds bfloat16 caches, not {k.dtype}")
        probe = copy.deepcopy(book)
        probe.add(s, T)
        self.caps = capacities(s, probe, max_length)
        self.generation += 1
        self.book = book
        self.ring_of = [None if w is None else ring_capacity(w, max_length) for w in self.windows]
        i32 = dict(dtype=torch.int32, device=dev)
        self.rings = {
            C: Ring(
                C, torch.full((B, C), -1, **i32), torch.zeros((), **i32), torch.zeros(1, dtype=torch.long, device=dev)
            )
            for C in dict.fromkeys(c for c in self.ring_of if c is not None)
        }
        for layer in self.layers:
            layer.allocate(B, k.dtype, dev)
        caps = [book.sink_cap, *self.caps, s.residual]
        self.pos = [torch.full((B, c), -1, **i32) for c in caps]
        pre = s.key_rope == "pre"
        self.rotary, self.rope = None, []
        if pre and self._rotary_args is not None:  # the row's left padding: rope position = cache position - it
            inv, scaling = self._rotary_args
            self.rotary = Rotary(inv.to(device=dev, dtype=torch.float32).contiguous(), scaling, lead, k.dtype)
        elif pre:
            f32 = dict(dtype=torch.float32, device=dev)  # the tables as the dynamic cache reads them (RopeTables.at)
            w = self.rope_width
            self.rope = [None] + [(torch.zeros(B, c, w, **f32), torch.zeros(B, c, w, **f32)) for c in caps[1:]]
        self.lens = torch.zeros(len(caps), **i32)
        self.next_pos = torch.zeros((), dtype=torch.int64, device=dev)
        self.res_slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self.top_slot = torch.zeros(1, dtype=torch.int64, device=dev)  # direct: the top level's next slot
        self.move_base = torch.zeros(2, dtype=torch.int64, device=dev)  # _move_at: first slot read, first written
        self._bias_stale = False
        self._valid0 = valid

    def _write(self, layer: StaticTaleLayer, k: torch.Tensor, h: torch.Tensor, valid, rope=None) -> None:
        """A layer's update inside the open step: the first write allocates (the prefill) and plans the step's spans,
        the same for every layer, and writes the tokens' RoPE tables (key_rope "pre"); end_step settles them."""
        st = self._step
        if st is None:
            raise RuntimeError("StaticTaleCache: writes happen inside a step (with cache.step(T): model forward)")
        if self.schedule.key_rope == "pre":
            B, T, n = k.shape[0], k.shape[-2], k.shape[-1]
            w = None if rope is None else rope[0].shape[-1]  # < n: partial rotary (the first w channels rotate)
            if rope is None or rope[0].shape[-2] != T or w > n or w % 2 or rope[0].shape[0] not in (1, B):
                raise ValueError('key_rope "pre" needs the cos, sin [B, T, r <= n] the appended keys were rotated by')
            if self.book is not None and w != self.rope_width:
                raise ValueError(f"RoPE over {w} channels, but this cache's tokens were rotated over {self.rope_width}")
            self.rope_width = w
            rope = tuple(x.expand(B, T, w) for x in rope)
        else:
            rope = None
        if st.op is None:
            if self.book is None:
                self._allocate(k, valid)
            st.op = self._plan(st.T, st.graph)
        if rope is not None and layer.ring is None and not st.op.rope_written:  # rings hold keys after RoPE
            if self.rotary is not None and not st.op.decode and not self._rotary_matches(rope):
                self._tables_from_rotary()
            if self.rotary is None:
                self._write_rope(st.op, rope)
            st.op.rope_written = True
        layer._write_new(st.op, k, h, rope)

    def _write_rope(self, op: _Op, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The step's RoPE tables (cos, sin [B, T, n]) into the slots its tokens take (sinks need none: exact)."""
        if op.decode:  # at the residual's (or direct: the top level's) slot the device holds: capturable
            bufs, slot = (self.rope[-2], self.top_slot) if op.direct else (self.rope[-1], self.res_slot)
            for buf, x in zip(bufs, rope):
                buf.index_copy_(1, slot, x.float())
            return
        t = op.take
        for i, cnt in enumerate(op.fill or []):
            if cnt:
                for buf, x in zip(self.rope[1 + i], rope):
                    buf[:, op.fill_start[i] : op.fill_start[i] + cnt] = x[:, t : t + cnt]
            t += cnt
        if op.n_res:
            for buf, x in zip(self.rope[-1], rope):
                buf[:, op.res_start : op.res_start + op.n_res] = x[:, t:]

    def _rotary_matches(self, rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether the Rotary makes the very tables (cos, sin [B, T, n]) the model rotated this write's tokens by
        (cache positions kappa .. kappa + T - 1; padding not compared)."""
        B, T, p0, dev = rope[0].shape[0], rope[0].shape[1], self.book.kappa, rope[0].device
        pos = torch.arange(p0, p0 + T, dtype=torch.int32, device=dev).expand(B, T)
        ok = self._valid0 if p0 == 0 else torch.ones(B, T, dtype=torch.bool, device=dev)
        mine = self.rotary.tables(pos)
        return all(torch.equal(a.float()[ok], b[ok]) for a, b in zip(rope, mine))

    def _tables_from_rotary(self) -> None:
        """Fall back to stored tables (the model's positions do not follow the cache's, or its RoPE is not the
        Rotary's): the slots written so far get the Rotary's tables, which matched them."""
        rot, self.rotary = self.rotary, None
        self.rope = [None] + [tuple(x.contiguous() for x in rot.tables(p)) for p in self.pos[1:]]
        self.generation += 1  # captured graphs read the regions' rotation
        for layer in self.layers:
            layer._view = None

    def _residual_rope(self, q: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE tables (cos, sin [B, q, n]) of the residual's first q slots with key_rope "pre", else None."""
        if self.rotary is not None:
            return self.rotary.tables(self.pos[-1][:, :q])
        return tuple(x[:, :q] for x in self.rope[-1]) if self.rope else None

    def _rope_tensors(self) -> list[torch.Tensor]:
        if self.rotary is not None:
            return [self.rotary.offset]
        return [x for r in self.rope if r is not None for x in r]

    def _tracks(self) -> list[list]:
        """What moves with the tokens between regions besides the layers' buffers: positions, and the RoPE tables."""
        return [self.pos] + [[None if r is None else r[j] for r in self.rope] for j in range(2) if self.rope]

    def end_step(self) -> None:
        """After every layer wrote the step's tokens: positions and counters, then flush and demotions (a captured
        step: the device part only; `advance()` does the host's after each replay)."""
        st, self._step = self._step, None
        if st is not None and st.op is not None:
            self._commit(st.op, st.T, st.graph)

    def capturable(self) -> bool:
        """Whether the next one-token step is a plain decode step (the token goes into the residual at a device-held
        slot): what a CUDA graph can capture."""
        b = self.book
        return b is not None and b.sink_len == b.sink_cap and b.res_len < b.residual_cap

    def _plan(self, T: int, graph: bool = False) -> _Op:
        b = self.book
        if self.max_length is not None and b.kappa + T > self.max_length:
            raise ValueError(
                f"static cache: {b.kappa} + {T} tokens exceed its max_length ({self.max_length}); its levels are sized "
                "for that many: make it with a larger max_length"
            )
        if T == 1 and b.sink_len == b.sink_cap and b.res_len < b.residual_cap:
            return _Op(decode=True, direct=self._direct_step())
        if graph:
            raise RuntimeError("static cache: only a plain decode step (one token into the residual) can be captured")
        self._pull_bias()  # the eager writes below read the fp8 biases on the host
        take, fill, n_res = copy.deepcopy(b).add(self.schedule, T)  # _commit advances the real bookkeeping
        return _Op(False, take, b.sink_len, fill, list(b.w) if fill else None, n_res, b.res_len)

    def _commit(self, op: _Op, T: int, graph: bool = False) -> None:
        """After the last layer wrote the new tokens: positions, counters, then flush and demotions."""
        b = self.book
        if op.decode:
            B = self.pos[-1].shape[0]
            p = self.next_pos.view(1, 1).expand(B, 1).to(torch.int32)
            if op.direct:  # the top level: ring slots (w mod its capacity), its length capped there (sync_device)
                cap = self.caps[-1]
                self.pos[-2].index_copy_(1, self.top_slot, p)
                self.top_slot.add_(1).remainder_(cap)
                self.lens[-2:-1].add_(1).clamp_(max=cap)
            else:
                self.pos[-1].index_copy_(1, self.res_slot, p)
                self.res_slot += 1
                self.lens[-1:] += 1
            for r in self.rings.values():  # the slot's old token (position p - C) is one no query reads again
                r.pos.index_copy_(1, r.slot, p)
                r.slot.add_(1).remainder_(r.cap)
                r.length.add_(1).clamp_(max=r.cap)
            self.next_pos += 1
            if not graph:
                self.advance()
            return
        p0, B = b.kappa, self.pos[0].shape[0]
        pos = torch.arange(p0, p0 + T, dtype=torch.int32, device=self.pos[0].device).expand(B, T)
        if p0 == 0:  # the prefill: padding gets -1 (it only ever sits in the sinks)
            pos = pos.masked_fill(~self._valid0, -1)
        self.pos[0][:, op.sink_start : op.sink_start + op.take] = pos[:, : op.take]
        t = op.take
        for i, cnt in enumerate(op.fill or []):
            if cnt:
                self.pos[1 + i][:, op.fill_start[i] : op.fill_start[i] + cnt] = pos[:, t : t + cnt]
            t += cnt
        if op.n_res:
            self.pos[-1][:, op.res_start : op.res_start + op.n_res] = pos[:, t:]
        for r in self.rings.values():  # the last C tokens, position p at slot p % C
            m = min(T, r.cap)
            for slot, off, n in _spans(p0 + T - m, m, r.cap):
                r.pos[:, slot : slot + n] = pos[:, T - m + off : T - m + off + n]
        b.add(self.schedule, T)
        self._maintain()
        self.sync_device()

    def advance(self) -> None:
        """Host side of a decode step (after a captured step's replay): count the token, then flush and
        demote when the schedule says so."""
        b = self.book
        if self.max_length is not None and b.kappa >= self.max_length:
            raise ValueError(f"static cache: a token past its max_length ({self.max_length}) was written")
        if self._direct_step():  # the token is in the top level already
            b.w[-1] += 1
            self._bias_stale = True
        else:
            b.res_len += 1
        b.kappa += 1
        if self._maintain():
            self.sync_device()

    def _direct_step(self) -> bool:
        """The next one-token step writes straight into the top level (direct caches, nothing in the residual)."""
        return self.direct and self.book.res_len == 0

    def _pull_bias(self) -> None:
        """After device writes (direct writes, demotions on the device): the fp8 biases, which moved on the device,
        into the layers' host copies (one host read), before any eager write or host demotion reads them."""
        if not self._bias_stale:
            return
        self._bias_stale = False
        held = [(layer, q) for layer in self.layers if layer.ring is None for q in layer._qbufs() if q.meta != "16"]
        if not held:
            return
        for (layer, q), v in zip(held, torch.stack([q.bias for _, q in held]).tolist()):
            if math.isfinite(v):
                layer.bias[id(q)] = v

    def _maintain(self) -> bool:
        b = self.book
        L = len(b.w) - 1
        res_before, wL = b.res_len, b.w[L]
        q, moves = b.maintain(self.schedule)
        on_dev = [self._on_device(i, m, r, w) for i, m, r, w in moves]
        if q or not all(on_dev):
            self._pull_bias()
        if q:
            for layer in self.layers:
                if layer.ring is None:
                    layer._flush(q, wL)  # reads the residual's RoPE tables: they move after
            left = res_before - q
            for t in self._tracks():
                rp = t[-1]
                for slot, off, n in _spans(wL, q, self.caps[L]):
                    t[1 + L][:, slot : slot + n] = rp[:, off : off + n]
                if left:
                    rp[:, :left] = rp[:, q : q + left].clone()
            self.pos[-1][:, left:res_before] = -1
        for (i, m, r, w), dev in zip(moves, on_dev):
            if dev:
                self._move_at(i, m, r, w)
                continue
            for layer in self.layers:
                if layer.ring is None:
                    layer._demote(i, m, r, w)
            for t in self._tracks():
                src, dst = t[1 + i], t[i]
                moved = torch.cat([src[:, slot : slot + n] for slot, _, n in _spans(r, m, self.caps[i])], dim=1)
                for slot, off, n in _spans(w, m, self.caps[i - 1]):
                    dst[:, slot : slot + n] = moved[:, off : off + n]
            for slot, _, n in _spans(r, m, self.caps[i]):
                self.pos[1 + i][:, slot : slot + n] = -1
        return bool(q or moves)

    def writer(self, fn, device: torch.device, level: int, rank: int, key_ranks: tuple[int, ...]):
        """write_top or demote_at as this cache runs it: compiled (fused) for fp8 scales on CUDA, else as it is; one
        code per (level, rank, the layer's key ranks): the integers it reads."""
        return fused(fn, device, (self.schedule_key, level, rank, key_ranks)) if self.fuse else fn

    def _on_device(self, i: int, m: int, r: int, w: int) -> bool:
        """Whether a demotion runs addressed on the device (_move_at): row layout, whole key groups."""
        g = self.schedule.key_group
        return self.layout == "row" and not (m % g or r % g or w % g)

    def _move_at(self, i: int, m: int, r: int, w: int) -> None:
        """Demote m tokens from level i (read counter r) to level i - 1 (write counter w) in every layer, with the
        slots and the fp8 biases on the device: on CUDA a graph per (i, m), captured at its second run (the first,
        eager, warms it up) and replayed after; the slots come from `move_base`, set without a host read."""
        self.move_base[0].fill_(r % self.caps[i])
        self.move_base[1].fill_(w % self.caps[i - 1])
        self._bias_stale = True
        if self._moves_gen != self.generation:  # new buffers: graphs over the old ones are stale
            self._moves, self._moves_gen = {}, self.generation
        key, dev = (i, m), self.move_base.device
        if dev.type != "cuda" or self.graph_error or key not in self._moves:
            self._move_body(i, m)
            self._moves[key] = None  # warm: capture at the next one
            return
        graph = self._moves[key]
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            try:  # torch.cuda.graph's capture without its synchronize, gc.collect and empty_cache (~0.1 s)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    graph.capture_begin()
                    try:
                        self._move_body(i, m)
                    finally:
                        graph.capture_end()
                torch.cuda.current_stream().wait_stream(side)
            except Exception as e:  # noqa: BLE001  (the captured work never ran: run it eagerly from now on)
                self.graph_error = f"{type(e).__name__}: {e}"
                self._move_body(i, m)
                return
            self._moves[key] = graph
        graph.replay()

    def _move_body(self, i: int, m: int) -> None:
        """_move_at's work, from the slots in `move_base`: every layer's codes, then positions and RoPE tables."""
        g = self.schedule.key_group
        ar = torch.arange(m, device=self.move_base.device)
        a = (self.move_base[0] + ar) % self.caps[i]  # [m] slots read in level i
        b = (self.move_base[1] + ar) % self.caps[i - 1]  # [m] slots written in level i - 1
        src, dst = Slots(a, a[::g] // g), Slots(b, b[::g] // g)
        for layer in self.layers:
            if layer.ring is None:
                layer._demote_at(i, src, dst)
        for t in self._tracks():
            t[i].index_copy_(1, b, t[1 + i].index_select(1, a))
        self.pos[1 + i].index_fill_(1, a, -1)

    def sync_device(self) -> None:
        """Device lengths and counters from the host bookkeeping (fills: no host sync); also what a decoder calls
        after a failed capture, should anything of it have run."""
        b = self.book
        lens = [b.sink_len, *(min(w, c) for w, c in zip(b.w, self.caps)), b.res_len]
        for j, v in enumerate(lens):
            self.lens[j].fill_(v)
        self.next_pos.fill_(b.kappa)
        self.res_slot.fill_(b.res_len)
        self.top_slot.fill_(b.w[-1] % self.caps[-1] if self.caps[-1] else 0)
        for r in self.rings.values():
            r.length.fill_(min(b.kappa, r.cap))
            r.slot.fill_(b.kappa % r.cap)

    # -- HF API ---------------------------------------------------------------------------

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Every batch row repeated `repeats` times (HF Cache API; new buffers: recapture graphs after)."""
        if self.book is None:
            return
        self.generation += 1
        for layer in self.layers:
            for nm in layer._names():
                setattr(layer, nm, getattr(layer, nm).repeat_interleave(repeats, dim=0))
            for f in layer.frag:
                f.repeat_interleave(repeats)
            for q in layer._qbufs():
                q.data = q.data.repeat_interleave(repeats, dim=0)
                if q.scale is not None:
                    q.scale = q.scale.repeat_interleave(repeats, dim=0)
                    q.zero = q.zero.repeat_interleave(repeats, dim=0)
            layer._view = None
        self.pos = [p.repeat_interleave(repeats, dim=0) for p in self.pos]
        for r in self.rings.values():
            r.pos = r.pos.repeat_interleave(repeats, dim=0)
        self.rope = [None if r is None else tuple(x.repeat_interleave(repeats, dim=0) for x in r) for r in self.rope]
        self.rotary = self.rotary and self.rotary.repeat_interleave(repeats)
