"""The token-adaptive lazy cache of one decoder layer (DESIGN.md section 4).

Per layer, tokens sit in position order in these regions (one rectangular tensor per
region for the whole batch):

    sinks | level 0 (middle) | level 1 | ... | level L (recent) | residual
    16-bit  r_0 @ b_0          r_1 @ b_1        r_L @ b_L          16-bit

- keys: [B, K, L, n] after RoPE; latents h = x A: [B, G, L, R] (truncated to r_i at level i).
- Level stores hold whole key groups (key quantization runs per channel over `key_group`
  tokens); the residual holds the newest tokens until `residual` of them fill groups.
- Left-padded batches: the sink region covers the first `max_pad + sinks` positions, so every
  row's first `sinks` real tokens are exact (rows with less padding keep a few more exact
  tokens); padding is masked through `valid`.
- Level i >= 1 keeps ceil(p_i * N) of the N non-sink tokens (the last level counts the
  residual too); the oldest whole groups above that move down one level at a time
  (dequantize, truncate to the lower rank, requantize).
- keep="salient" (MiKV / SnapKV-style importance): the per-channel levels keep the key groups that
  receive the most attention from the last `key_group` queries instead of the newest ones: at the
  prefill the groups are placed by that mass, and a level over its share moves down its least
  attended groups. The counts per level (so the bytes) are the recency rule's; only membership
  changes. Regions are order-free (attention masks by `pos`), so each store keeps its tokens'
  positions. The residual and per-token levels stay by recency.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import CacheLayerMixin

from . import key_basis
from .artifact import Schedule
from .attention import apply_rope, cached_keys, key_mass
from .backends import TORCH, AttentionBackend, ReferenceCalls
from .key_basis import KeyBasis
from .placement import demotions, fill_counts, flush_count
from .quant import Bands, QTensor, cat, dequantize, quantize, quantize_bands, requantize, split, take
from .regions import LayerView, Region
from .spec import Arch


def baseline_nbytes(batch: int, kv_heads: int, head_dim: int, positions: int, windows) -> int:
    """16-bit K+V bytes that transformers' cache holds after `positions` positions of `batch` rows, over layers of
    sliding windows `windows` (one per layer; None: a global layer): every position, or a sliding-window layer's last
    window - 1 (DynamicSlidingWindowLayer). The reference of every measured ratio."""
    held = sum(positions if w is None else min(positions, w - 1) for w in windows)
    return 2 * batch * kv_heads * held * head_dim * 2


def call_pattern(tokens: int, prefill: int, chunk: int) -> list[int]:
    """Tokens per forward call over a sequence of `tokens`: the prefill, then chunks of `chunk` up to the
    second-to-last token (the last one is only predicted)."""
    rest = tokens - 1 - prefill
    return [prefill] + [chunk] * (rest // chunk) + ([rest % chunk] if rest % chunk else [])


def dry_run_nbytes(
    schedule: Schedule, arch: Arch, pattern: list[int], dtype: torch.dtype = torch.bfloat16, memo: dict | None = None
) -> tuple[int, int]:
    """(bytes held, 16-bit K+V bytes) of a batch-1 TALE cache of `schedule` over the shapes of `arch`, every layer of
    the schedule, after forward calls of `pattern` tokens each: a dry run with zeros, one layer per distinct row of
    ranks and key ranks (the bytes depend on the call pattern and the ranks only: not on the tokens, the key basis or
    the key bands' channel order). `memo` (a layer's ranks and key ranks -> counts) carries over between schedules
    that differ in their ranks only."""
    K, n, G, R = arch.num_kv_heads, arch.head_dim, arch.num_groups, arch.latent_rank
    memo = {} if memo is None else memo
    held = base = 0
    for li, ranks in enumerate(schedule.ranks):
        krs = schedule.layer_key_ranks(li)
        key = (tuple(ranks), krs)
        if key not in memo:
            # low-rank keys: any basis of the right shape (key_blocks blocks) holds the same bytes
            eye = torch.eye(K * n // schedule.key_blocks).expand(schedule.key_blocks, -1, -1)
            basis = KeyBasis(eye, eye, torch.zeros(K * n), K, n) if any(krs) else None
            one = replace(schedule, ranks=[list(ranks)], key_ranks=None if schedule.key_ranks is None else [list(krs)])
            c = RegionStore(one, 0, K, n, G, R, basis=basis)
            for T in pattern:
                # keys held before RoPE keep the tables they were rotated by: any will do for a count of bytes
                rope = (torch.ones(1, T, n), torch.zeros(1, T, n)) if schedule.key_rope == "pre" else None
                c.append(torch.zeros(1, K, T, n, dtype=dtype), torch.zeros(1, G, T, R, dtype=dtype), rope=rope)
            memo[key] = c.nbytes(), c.baseline_nbytes()
        held, base = held + memo[key][0], base + memo[key][1]
    return held, base


class TransformersCacheLayer(CacheLayerMixin):
    """The transformers side of a TALE cache layer (the dynamic cache's model.DynamicTaleLayer, the static cache's
    StaticTaleLayer): what transformers asks of a cache layer, from its `kappa` (cached positions): the sequence
    length and the mask sizes. Regions are made by `update`, not by transformers' lazy initialization."""

    is_compileable = False
    is_sliding = False

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def get_seq_length(self) -> int:
        return self.kappa

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kappa + query_length, 0


class CacheStep:
    """What both TALE caches (model.TaleCache, static_cache.StaticTaleCache) share around a forward pass.

    - `backend`: the decode-attention backend chosen when the cache was made (tale_runtime.backends); `attend` runs
      it over a layer's view, `layout` is the static layout it reads. A decode call the backend declines
      (`AttentionBackend.declines`: a condition of the call its spec could not show) runs on the torch reference and is
      counted in `reference_calls`, which the stats line reads beside `backend_name`.
    - The step: whoever runs the model over the cache (the model's forward, DecodeStep, the CUDA-graph decoder) opens
      one per forward pass of T new tokens (`with cache.step(T):`); every layer's `update` writes inside it and the
      cache settles its bookkeeping when it closes. `graph=True`: the step is being captured into a CUDA graph (the
      host bookkeeping then waits for `advance()` after each replay). The dynamic cache needs no bookkeeping.
    """

    backend: AttentionBackend = TORCH
    _step = None
    _reference_calls: ReferenceCalls | None = None

    def attend(self, layer_idx: int, q, k_new, h_new, scaling: float, window: int | None = None):
        """Latent attention of the new tokens over layer `layer_idx`'s cached tokens: z [B, T, H, R] float32."""
        view, b = self.layers[layer_idx].view(), self.backend
        if q.shape[2] == 1:  # a decode call (several tokens are the reference's by design: not counted)
            why = b.declines(q, k_new, h_new, view)
            self.reference_calls.count(b, why)
            if why is not None:  # counted and warned about: the stats line names it beside the backend
                return TORCH.run(q, k_new, h_new, view, scaling, window)
        return b(q, k_new, h_new, view, scaling, window)

    @property
    def reference_calls(self) -> ReferenceCalls:
        """The decode calls of this cache and those its backend handed to the torch reference (backends.ReferenceCalls)."""
        if self._reference_calls is None:
            self._reference_calls = ReferenceCalls()
        return self._reference_calls

    @property
    def backend_name(self) -> str:
        """The backend in use, as the stats line names it."""
        return self.backend.describe(getattr(self, "layout", "row"))

    def begin_step(self, T: int, graph: bool = False) -> None:
        if self._step is not None:
            raise RuntimeError("a step over this cache is already open (one forward pass at a time)")
        self._step = _Open(T, graph)

    def end_step(self) -> None:
        self._step = None

    def abort_step(self) -> None:
        """A forward pass that failed: forget the step without settling it."""
        self._step = None

    @contextmanager
    def step(self, T: int, graph: bool = False) -> Iterator[None]:
        self.begin_step(T, graph)
        try:
            yield
        except BaseException:
            self.abort_step()
            raise
        self.end_step()


@dataclass
class _Open:
    T: int
    graph: bool
    op: object = None  # the static cache's plan of the writes, made at the first write


@dataclass
class Store:
    """One quantized level: keys per channel over token groups, latents per token over channel groups."""

    keys: QTensor | Bands  # [B, K, L, n]; [B, Kb, L, key_rank] at levels with low-rank keys (Kb: the basis blocks)
    lat: QTensor  # [B, G, L, r]
    rank: int
    pos: torch.Tensor  # [L] int64: cache position of each token (the same in every row), any order
    # on a CPU, what reading the store derives from it alone (its RoPE tables and view positions; the torch
    # reference's dequantized keys and latents): a store is never changed in place, every change makes a new one, so
    # these are computed once per store instead of at every decode step (view(), regions.Region.memo)
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def take(self, tokens: torch.Tensor) -> Store:
        """The tokens at indices `tokens` [L'] of this store (whole key groups)."""
        return Store(take(self.keys, tokens), take(self.lat, tokens), self.rank, self.pos[tokens.to(self.pos.device)])

    @property
    def length(self) -> int:
        return self.keys.shape[-2]

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.lat.nbytes()


def quant_level(
    s: Schedule,
    level: int,
    rank: int,
    key_ranks: tuple[int, ...],
    k: torch.Tensor,
    h: torch.Tensor,
    order: list[list[int]] | None = None,
    basis: KeyBasis | None = None,
    device_bias: bool = False,
) -> tuple[QTensor | Bands, QTensor]:
    """Exact tokens (k [B, K, T, n], h [B, G, T, R]) quantized at a level: keys per channel over token
    groups (in two bands at levels with key_hi_bits: `order` is the layer's Schedule.key_order; as
    coefficients on the layer's key `basis` at levels with key_rank: `key_ranks` is the layer's,
    Schedule.layer_key_ranks), latents truncated to `rank` and quantized per token over channel groups.
    device_bias: fp8 biases as device scalars (quant.quantize)."""
    lv = s.levels[level]
    lat = quantize(h[..., :rank].contiguous(), lv.bits, s.value_group, -1, s.value_meta, device_bias)
    return quant_keys(s, level, key_ranks, k, order, basis, device_bias), lat


def quant_keys(
    s: Schedule,
    level: int,
    key_ranks: tuple[int, ...],
    k: torch.Tensor,
    order: list[list[int]] | None = None,
    basis: KeyBasis | None = None,
    device_bias: bool = False,
) -> QTensor | Bands:
    lv = s.levels[level]
    if key_ranks[level]:
        if basis is None:
            raise ValueError("low-rank keys (key_rank) need the layer's key basis")
        k = basis.encode(k, key_ranks[level])
    if not lv.key_hi_bits:
        return quantize(k, lv.key_bits, **key_layout(s, level), device_bias=device_bias)
    if order is None:
        raise ValueError("key bands need the layer's key_order")
    hi, lo = band_index(order, lv.key_hi_channels)
    return quantize_bands(k, [(lv.key_bits, lo), (lv.key_hi_bits, hi)], s.key_group, s.key_meta, device_bias)


def demote_level(
    s: Schedule,
    level: int,
    key_ranks: tuple[int, ...],
    keys: QTensor | Bands,
    lat: QTensor,
    rank: int,
    order: list[list[int]] | None = None,
    basis: KeyBasis | None = None,
    device_bias: bool = False,
) -> tuple[QTensor | Bands, QTensor]:
    """Tokens of the level above requantized into `level` (keys [B, K, T, n], latents truncated to `rank`):
    the demotion step of both caches; `key_ranks`: the layer's (Schedule.layer_key_ranks). device_bias: fp8 biases as
    device scalars (quant.quantize)."""
    lv, kr, src, db = s.levels[level], key_ranks[level], key_ranks[level + 1], device_bias
    if kr and src:  # coefficients to fewer coefficients: truncate, as latents
        keys = requantize(keys, lv.key_bits, min(kr, src), **key_layout(s, level), device_bias=db)
    elif kr or src:  # between plain keys and coefficients: through the keys before RoPE
        x = dequantize(keys)
        keys = quant_keys(s, level, key_ranks, basis.decode(x) if src else x, order, basis, db)
    elif lv.key_hi_bits:  # into bands; requantize handles bands into a plain level
        keys = quant_keys(s, level, key_ranks, dequantize(keys), order, device_bias=db)
    else:
        keys = requantize(keys, lv.key_bits, **key_layout(s, level), device_bias=db)
    return keys, requantize(lat, lv.bits, rank, meta=s.value_meta, device_bias=db)


def band_index(order: list[list[int]], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key_order ([K][n], most important first) -> channel indices [K, m] of the high band and
    [K, n - m] of the low one, each sorted."""
    o = torch.tensor(order, dtype=torch.long)
    if not 0 < m < o.shape[-1]:
        raise ValueError(f"key_hi_channels {m} must lie in (0, {o.shape[-1]})")
    return o[:, :m].sort(-1).values, o[:, m:].sort(-1).values


def key_layout(s: Schedule, level: int) -> dict:
    """Quantization group, dim and scale format of a level's keys (per channel over token groups, or per token)."""
    if s.levels[level].key_axis == "token":
        return dict(group=s.key_channel_group, dim=-1, meta=s.key_meta)
    return dict(group=s.key_group, dim=-2, meta=s.key_meta)


class RopeTables:
    """key_rope "pre": the cos, sin [B, kappa, n] the model rotated each cached key by (bookkeeping like `pos`), to
    undo RoPE before quantizing and redo it when reading. Every layer of a model sees the same positions, so the
    layers of one TaleCache share one table: the first layer to append a span extends it, the others find it there."""

    def __init__(self):
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.cos is None else self.cos.shape[1]

    def extend(self, cos: torch.Tensor, sin: torch.Tensor, p0: int) -> None:
        """Tables [B, T, n] of cache positions p0 .. p0 + T - 1."""
        T = cos.shape[1]
        if self.length == p0:
            self.cos = cos.clone() if self.cos is None else torch.cat([self.cos, cos], 1)
            self.sin = sin.clone() if self.sin is None else torch.cat([self.sin, sin], 1)
        elif self.length < p0 + T:
            raise RuntimeError(f"rope tables hold {self.length} positions; a layer appended {p0}..{p0 + T - 1}")

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, L, n] float32 of cache positions `pos` [L]."""
        p = pos.to(self.cos.device)
        return self.cos[:, p].float(), self.sin[:, p].float()

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search: pick batch rows (once per cache, not per layer)."""
        if self.cos is not None:
            self.cos, self.sin = (t.index_select(0, rows.to(t.device)) for t in (self.cos, self.sin))


KEEP = ("recent", "salient")  # which key groups the per-channel levels above level 0 keep


class RegionStore:
    """One layer's cached tokens in the dynamic layout: the regions (sinks, levels, residual) of the module docstring
    and their bookkeeping (append, flush, demotion, eviction), with no tie to transformers. model.DynamicTaleLayer is
    one layer of TaleCache built on it; tale-eval's KIVI and Palu baselines hold their tokens in one."""

    def __init__(
        self,
        schedule: Schedule,
        layer_idx: int,
        num_kv_heads: int,
        head_dim: int,
        num_groups: int,
        latent_rank: int,
        keep: str = "recent",
        basis: KeyBasis | None = None,
        rope: RopeTables | None = None,
    ):
        if keep not in KEEP:
            raise ValueError(f"keep must be one of {', '.join(KEEP)}, got {keep!r}")
        self.s, self.keep = schedule, keep
        self.ranks = schedule.ranks[layer_idx]
        self.key_ranks = schedule.layer_key_ranks(layer_idx)  # low-rank keys' coefficients per level (0: plain)
        self.order = None if schedule.key_order is None else schedule.key_order[layer_idx]
        if self.order is not None and (len(self.order) != num_kv_heads or any(len(c) != head_dim for c in self.order)):
            raise ValueError(f"layer {layer_idx}: key_order is not [{num_kv_heads} heads][{head_dim} channels]")
        self.K, self.n, self.G, self.R = num_kv_heads, head_dim, num_groups, latent_rank
        self.basis = basis  # the layer's key basis (levels with key_rank read it)
        if why := key_basis.missing(schedule, basis, layer_idx):
            raise ValueError(f"layer {layer_idx}: {why}")
        if any(lv.key_axis == "token" for lv in schedule.levels) and head_dim % schedule.key_channel_group:
            raise ValueError(f"key_channel_group {schedule.key_channel_group} does not divide the head dim {head_dim}")
        if schedule.rotate == "hadamard" and head_dim & (head_dim - 1):
            raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {head_dim}")
        self.sink_cap: int | None = None  # set at the first append
        self.sink_k = self.sink_h = None
        self._sink_memo: tuple[torch.Tensor, dict] | None = None  # (sink_k, what view() keeps of it)
        self.levels: list[Store | None] = [None] * len(schedule.levels)
        self.res_k = self.res_h = None
        self.valid: torch.Tensor | None = None  # [B, kappa] bool; False = padding
        # keep="salient": the last `key_group` queries (times the attention scaling) and their positions
        self.q_obs: torch.Tensor | None = None  # [B, H, W, n]
        self.q_pos: torch.Tensor | None = None  # [W] int64
        # key_rope "pre": the tables of RoPE at every cached position, shared with the cache's other layers
        self.rope = RopeTables() if rope is None else rope
        # a sliding-window layer's window (its attention's, passed with each update): the levels then drop the key
        # groups no later query can read, and the 16-bit baseline is what transformers' cache holds for such a layer
        self.window: int | None = None

    # -- bookkeeping -------------------------------------------------------------------

    @property
    def kappa(self) -> int:
        return 0 if self.valid is None else self.valid.shape[-1]

    def lengths(self) -> dict[str, int]:
        """Tokens per region, in position order."""
        out = {"sinks": 0 if self.sink_k is None else self.sink_k.shape[-2]}
        for i, st in enumerate(self.levels):
            out[f"level{i}"] = 0 if st is None else st.length
        out["residual"] = 0 if self.res_k is None else self.res_k.shape[-2]
        return out

    def nbytes(self) -> int:
        """Bytes of every cached tensor: packed codes, scales, zero points, sinks, residual."""
        ts = [self.sink_k, self.sink_h, self.res_k, self.res_h]
        held = [st for st in self.levels if st is not None and st.length]  # an emptied store: no fp8 bias either
        return sum(t.numel() * t.element_size() for t in ts if t is not None) + sum(st.nbytes() for st in held)

    def baseline_nbytes(self) -> int:
        """16-bit K+V bytes of what transformers' cache holds for this layer: every position, or in a sliding-window
        layer the last window - 1 (DynamicSlidingWindowLayer), batch rows x positions."""
        if self.valid is None:
            return 0
        return baseline_nbytes(self.valid.shape[0], self.K, self.n, self.kappa, [self.window])

    # -- quantization of a span of exact tokens into level i --------------------------

    def _quant(self, k: torch.Tensor, h: torch.Tensor, level: int, pos: torch.Tensor) -> Store:
        r = self.ranks[level]
        if self.s.key_rope == "pre":  # back to the key before RoPE, then quantized (float32; exact up to the
            # rounding of bf16 tables, whose cos^2 + sin^2 misses 1 by up to ~2^-8: far below 2-4 bit steps)
            cos, sin = self.rope.at(pos)
            k = apply_rope(k.float(), cos, -sin).to(k.dtype)
        return Store(*quant_level(self.s, level, r, self.key_ranks, k, h, self.order, self.basis), r, pos)

    def _push(self, level: int, st: Store) -> None:
        cur = self.levels[level]
        if cur is None or cur.length == 0:
            self.levels[level] = st
        else:
            self.levels[level] = Store(
                cat([cur.keys, st.keys]), cat([cur.lat, st.lat]), cur.rank, torch.cat([cur.pos, st.pos])
            )

    def _salient(self, level: int) -> bool:
        """Whether `level` picks its members by attention mass (per-channel levels only: they move whole groups)."""
        return self.keep == "salient" and self.s.levels[level].key_axis == "channel"

    def _mass(self) -> torch.Tensor:
        """Attention mass of every cached position [kappa] from the observation window (the last queries)."""
        view = self.view()
        B, K, n = self.valid.shape[0], self.K, self.n
        keys, pos, _ = cached_keys(view, torch.float32, B, K, n, self.valid.device)
        per_slot = key_mass(self.q_obs, self.q_pos, keys, pos)  # [Lc]: slots in the view's order
        return per_slot.new_zeros(self.kappa).index_add_(0, self._columns(), per_slot)

    def _demote(self) -> None:
        """Move whole key groups of over-full levels one level down (placement.demotions): the oldest ones, or
        with keep="salient" the ones the observation window attends to least."""
        counts = [0 if st is None else st.length for st in self.levels]
        n_res = 0 if self.res_k is None else self.res_k.shape[-2]
        mass = None
        for i, n_move in demotions(self.s, counts, n_res, self.kappa - (self.sink_cap or 0)):
            st = self.levels[i]
            if self._salient(i) and self._salient(i - 1) and self.q_obs is not None:
                mass = self._mass() if mass is None else mass
                u = self.s.unit(i)
                score = mass[st.pos].view(-1, u).sum(-1)  # [groups]
                low = torch.zeros(st.length // u, dtype=torch.bool)
                low[score.argsort(stable=True)[: n_move // u].cpu()] = True
                tok = torch.arange(st.length).view(-1, u)
                old, self.levels[i] = st.take(tok[low].flatten()), st.take(tok[~low].flatten())
            else:
                k_old, k_keep = split(st.keys, n_move)
                h_old, h_keep = split(st.lat, n_move)
                old = Store(k_old, h_old, st.rank, st.pos[:n_move])
                self.levels[i] = Store(k_keep, h_keep, st.rank, st.pos[n_move:])
            r = self.ranks[i - 1]
            keys, lat = demote_level(self.s, i - 1, self.key_ranks, old.keys, old.lat, r, self.order, self.basis)
            self._push(i - 1, Store(keys, lat, r, old.pos))

    # -- filling -----------------------------------------------------------------------

    def append(
        self,
        k: torch.Tensor,
        h: torch.Tensor,
        valid: torch.Tensor | None = None,
        q: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        window: int | None = None,
    ) -> None:
        """Cache T new exact tokens: k [B, K, T, n] (post-RoPE), h [B, G, T, R].

        `valid` [B, T] marks real (non-padding) tokens; only read at the first call. `q` [B, H, T, n]: the
        tokens' post-RoPE queries times the attention scaling, read with keep="salient" (the last
        `key_group` of them are the observation window). `rope`: the (cos, sin) [B, T, r] the keys were rotated
        by (r <= n channels: partial rotary), read with key_rope "pre". `window`: the layer's sliding window (its
        attention reads positions j > i - window only): the levels then hold no key group that no later query reads.
        """
        B, T = k.shape[0], k.shape[-2]
        if self.s.key_rope == "pre":
            # r = n, or fewer channels with partial rotary (Phi-3's partial_rotary_factor: the first r rotate)
            r = None if rope is None else rope[0].shape[-1]
            if r is None or r > k.shape[-1] or tuple(rope[0].shape) not in ((B, T, r), (1, T, r)):
                raise ValueError('key_rope "pre" needs the cos, sin [B, T, r <= n] the appended keys were rotated by')
            self.rope.extend(*(t.expand(B, T, r) for t in rope), self.kappa)
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=k.device)
        first = self.valid is None
        p0 = self.kappa
        if self.keep == "salient":
            if q is None:
                raise ValueError('keep="salient" needs the queries of the appended tokens')
            qp = torch.arange(p0, p0 + T)
            W = self.s.key_group
            self.q_obs = q[..., -W:, :] if self.q_obs is None else torch.cat([self.q_obs, q], dim=-2)[..., -W:, :]
            self.q_pos = qp[-W:] if self.q_pos is None else torch.cat([self.q_pos, qp])[-W:]
        if first:
            pad = (~valid).int().cumprod(dim=-1).sum(dim=-1)  # leading padding per row
            self.sink_cap = int(pad.max()) + self.s.sinks
            self.valid = valid.clone()
        else:
            self.valid = torch.cat([self.valid, valid], dim=-1)

        # sinks first, exact
        n_sink = 0 if self.sink_k is None else self.sink_k.shape[-2]
        take = min(T, self.sink_cap - n_sink)
        if take > 0:
            ks, hs = k[..., :take, :], h[..., :take, :]
            self.sink_k = ks.clone() if self.sink_k is None else torch.cat([self.sink_k, ks], dim=-2)
            self.sink_h = hs.clone() if self.sink_h is None else torch.cat([self.sink_h, hs], dim=-2)
            k, h = k[..., take:, :], h[..., take:, :]
        if k.shape[-2] == 0:
            return

        if first or self._empty_beyond_sinks():
            self._fill(k, h, p0 + max(take, 0))
        else:
            self.res_k = k if self.res_k is None else torch.cat([self.res_k, k], dim=-2)
            self.res_h = h if self.res_h is None else torch.cat([self.res_h, h], dim=-2)
            self._flush()
        self._demote()
        if window is not None:
            self.window = window
            self._evict()

    def _evict(self) -> None:
        """Drop the key groups of a sliding-window layer that no later query can read: every position <= kappa -
        window (queries come at positions >= kappa and read j > i - window). Whole groups of each level; the sinks
        (a few 16-bit tokens) and the residual stay."""
        cut = self.kappa - self.window
        if cut < 0:  # the window still reaches position 0: nothing to drop, no per-step scan of the levels
            return
        for i, st in enumerate(self.levels):
            if st is None or not st.length:
                continue
            u = self.s.unit(i)
            live = (st.pos.view(-1, u) > cut).any(-1)  # [groups]: a group with a readable token stays whole
            if not live.all():
                self.levels[i] = st.take(torch.arange(st.length).view(-1, u)[live].flatten())

    def _empty_beyond_sinks(self) -> bool:
        return self.res_k is None and all(st is None for st in self.levels)

    def _flush(self) -> None:
        """Quantize whole groups of a full residual into the last level."""
        q = flush_count(self.s, self.res_k.shape[-2])
        if q == 0:
            return
        L = len(self.levels) - 1
        p = torch.arange(self.kappa - self.res_k.shape[-2], self.kappa - self.res_k.shape[-2] + q)
        self._push(L, self._quant(self.res_k[..., :q, :], self.res_h[..., :q, :], L, p))
        self.res_k, self.res_h = self.res_k[..., q:, :].clone(), self.res_h[..., q:, :].clone()
        if self.res_k.shape[-2] == 0:
            self.res_k = self.res_h = None

    def _fill(self, k: torch.Tensor, h: torch.Tensor, p0: int) -> None:
        """Place a run of exact non-sink tokens (prefill, positions p0..) straight into their final levels,
        so the middle is quantized once from exact values, not requantized. With keep="salient" the
        per-channel levels take whole key groups by the observation window's attention mass (most to the
        newest such level), in the counts of the recency rule."""
        counts, n_res = fill_counts(self.s, k.shape[-2])
        pos = torch.arange(p0, p0 + k.shape[-2])
        C = 0  # the leading per-channel levels that pick by mass
        while C < len(counts) and self._salient(C):
            C += 1
        S, start, lo = sum(counts[:C]), 0, 0
        if C > 1 and S:
            u = self.s.key_group
            keys = k if self.sink_k is None else torch.cat([self.sink_k, k], dim=-2)  # [B, K, sinks + T, n]
            kpos = torch.cat([torch.arange(keys.shape[-2] - k.shape[-2]), pos]).to(k.device)  # sinks: 0..
            kpos = kpos.expand(k.shape[0], -1).masked_fill(~self.valid[:, kpos], -1)
            mass = key_mass(self.q_obs, self.q_pos, keys, kpos)[-k.shape[-2] :]  # [T]
            groups = mass[:S].view(-1, u).sum(-1).argsort(descending=True, stable=True).cpu()  # most attended first
            tok = torch.arange(S).view(-1, u)
            for i in range(C - 1, -1, -1):
                g, groups = groups[: counts[i] // u].sort().values, groups[counts[i] // u :]
                if len(g):
                    idx = tok[g].flatten()
                    self._push(i, self._quant(k[..., idx, :], h[..., idx, :], i, pos[idx]))
            start, lo = S, C
        for i in range(lo, len(counts)):
            c = counts[i]
            if c:
                sl = slice(start, start + c)
                self._push(i, self._quant(k[..., sl, :], h[..., sl, :], i, pos[sl]))
            start += c
        if n_res:
            self.res_k, self.res_h = k[..., start:, :].clone(), h[..., start:, :].clone()

    # -- reading ------------------------------------------------------------------------

    def _parts(self) -> list[tuple[QTensor | Bands, QTensor, int, bool, KeyBasis | None, torch.Tensor]]:
        """(keys, latents, rank, keys held before RoPE, key basis of low-rank keys, cache positions [L]) of every
        non-empty region: sinks, levels, residual."""
        parts, k, pre = [], self.kappa, self.s.key_rope == "pre"
        if self.sink_k is not None:
            sink = (_raw(self.sink_k), _raw(self.sink_h), self.R, False, None, torch.arange(self.sink_k.shape[-2]))
            parts.append(sink)
        for kr, st in zip(self.key_ranks, self.levels):
            if st is not None and st.length:
                parts.append((st.keys, st.lat, st.rank, pre, self.basis if kr else None, st.pos))
        if self.res_k is not None:
            res = (_raw(self.res_k), _raw(self.res_h), self.R, False, None, torch.arange(k - self.res_k.shape[-2], k))
            parts.append(res)
        return parts

    def _columns(self) -> torch.Tensor:
        """The cache position of each slot of view(), in its order [Lc]."""
        return torch.cat([p for *_, p in self._parts()]).to(self.valid.device)

    def view(self) -> LayerView:
        """The cached tokens as regions (sinks, levels, residual) for decode attention; each slot's `pos` is
        its token's cache position (a level's tokens need not be in order: keep="salient")."""
        if self.valid is None:
            return LayerView([], 0)
        B, kappa = self.valid.shape
        pos = None
        stores = [None] * (self.sink_k is not None) + [st for st in self.levels if st is not None and st.length]
        regions = []
        for (keys, lat, rank, pre, basis, p), st in zip(self._parts(), stores + [None]):
            # On a CPU a level store keeps its positions and RoPE tables for as long as it lives (its tokens' `valid`
            # never changes), and what the torch reference dequantizes of it; the sinks keep theirs while their
            # tensor is the same (every change makes a new one). Not on a GPU: device memory for every layer.
            keep = st is not None or keys.data is self.sink_k
            keep = keep and keys.shape[-2] > 0 and _on_cpu(keys)
            memo = st.memo if keep and st is not None else {}
            if keep and st is None:
                if self._sink_memo is None or self._sink_memo[0] is not self.sink_k:
                    self._sink_memo = (self.sink_k, {})
                memo = self._sink_memo[1]
            if "pos" not in memo:
                if pos is None:
                    pos = torch.arange(kappa, dtype=torch.int32, device=self.valid.device).expand(B, kappa)
                    pos = pos.masked_fill(~self.valid, -1)  # [B, kappa]
                memo["pos"] = pos[:, p.to(pos.device)]
                memo["rope"] = self.rope.at(p) if pre else None  # sinks and the tail stay exact, after RoPE
            r = Region(keys, lat, rank, memo["pos"], keys.shape[-2], memo["rope"], basis, memo if keep else None)
            regions.append(r)
        return LayerView(regions, kappa)


def _on_cpu(q: QTensor | Bands) -> bool:
    return (q.parts[0] if isinstance(q, Bands) else q).data.device.type == "cpu"


def _raw(t: torch.Tensor) -> QTensor:
    """An exact (16-bit) tensor as a region's QTensor."""
    return QTensor(t, None, None, 16, 1, -2)


TaleLayerCache = RegionStore  # the former name (tale_runtime.TaleLayerCache)
