"""tale_kernels' attention backends, registered with tale_runtime.backends (entry point "tale_runtime.backends").

- "cuda": the CUDA decode kernel (mma_attention) over a static cache in the fragment layout: Hopper, bf16, the paper
  preset at head dim 128, latent groups of 4 KV heads, any whole number of query heads per KV head; no sliding-window
  layers (their static cache is a 16-bit ring).
- "triton": the Triton decode kernel (attention.py) over the row layout, dynamic or static: keys after RoPE at
  2/3/4/8/16 bits (whole or in bands), latents at 2/4/8/16 bits, any scale/zero format.
- "cuda-lowrank": the same with the low-rank keys' score pass in CUDA on tensor cores (lowrank_score.py): head dim
  128, bf16/fp16, sm_80 and later.
- "triton-lowrank": the Triton kernel for keys before RoPE and low-rank keys (lowrank_attention.py), the last "auto"
  tries.

Each `supports` reads only the cache's spec (shapes, schedule, device): the decision is made once, when the cache is
made, and covers every format a kernel's entry point checks of a call, so a cache a backend accepted never hands it a
decode step it cannot serve. The kernels' entry points refuse such a step (ValueError with the reason) instead of
running the torch reference under their name. What the spec cannot see, the dtype of the call's queries (and for
"cuda" the device of the layer), each backend checks per call (`declines`): the cache then runs the torch reference,
warns once and counts the call, and tale-run's stats line says so beside the backend's name
(tale_runtime.backends.ReferenceCalls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tale_runtime import backends, frag
from tale_runtime.spec import CacheSpec


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _call_dtypes(q, k_new, h_new, want: torch.dtype | None = None) -> str | None:
    """Why a decode call's dtypes are not what a kernel reads (None: they are): queries in the dtype of the new keys
    and latents (the cache's), and `want` where the kernel reads one dtype only."""
    if want is not None and q.dtype != want:
        return f"{_name(q.dtype)} queries (the kernel reads {_name(want)})"
    if k_new.dtype != q.dtype or h_new.dtype != q.dtype:
        return f"{_name(q.dtype)} queries over {_name(k_new.dtype)} keys"
    return None


def _triton_common(spec: CacheSpec) -> str | None:
    """What both Triton kernels need: a CUDA device (or the interpreter), a dtype they read, a power-of-two head dim."""
    from ._common import TL_DTYPE, interpreting, is_pow2

    if spec.device.type != "cuda" and not interpreting():
        return "needs a CUDA device (or TRITON_INTERPRET=1)"
    if spec.dtype not in TL_DTYPE:
        return f"reads float16, bfloat16 or float32 caches, not {spec.dtype}"
    if not is_pow2(spec.arch.head_dim) or spec.arch.head_dim < 16:
        return f"needs a power-of-two head dim >= 16, not {spec.arch.head_dim}"
    return None


def _triton_reason(spec: CacheSpec) -> str | None:
    if why := _triton_common(spec):
        return why
    from .attention import schedule_reason

    return schedule_reason(spec.schedule, spec.arch.head_dim)


@dataclass(frozen=True)
class TritonBackend(backends.AttentionBackend):
    name: str = "triton"
    label: str = "triton kernel"
    priority: int = 20

    def supports(self, spec: CacheSpec) -> str | None:
        return _triton_reason(spec)

    def declines(self, q, k_new, h_new, view) -> str | None:
        return _call_dtypes(q, k_new, h_new)

    def run(self, q, k_new, h_new, view, scaling, window):
        from .attention import latent_attention

        return latent_attention(q, k_new, h_new, view, scaling, window, config=self.config)


def _cuda_reason(spec: CacheSpec) -> str | None:
    s, a = spec.schedule, spec.arch
    if not spec.static:
        return "reads static caches only (new_cache(model, static=True))"
    if spec.sliding:  # its one launch reads the fragment layout's four regions, not a ring
        return "sliding-window layers hold a 16-bit ring it does not read (the triton backend does)"
    if spec.dtype != torch.bfloat16:
        return f"reads bfloat16 caches, not {spec.dtype}"
    if not frag.kernel_heads(a.num_heads, a.num_kv_heads):
        return f"needs a whole number of query heads per KV head ({a.num_heads} over {a.num_kv_heads})"
    if why := frag.fits(s, a.head_dim, a.num_kv_heads, a.num_groups, spec.dtype):
        return why
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    from . import mma_attention

    if not mma_attention.available(spec.device):
        return "needs a Hopper GPU (sm_90) and NVRTC or nvcc for its first build"
    return None


@dataclass(frozen=True)
class CudaBackend(backends.AttentionBackend):
    name: str = "cuda"
    label: str = "cuda kernel"
    priority: int = 30
    layout: str = "frag"

    def supports(self, spec: CacheSpec) -> str | None:
        return _cuda_reason(spec)

    def declines(self, q, k_new, h_new, view) -> str | None:
        # what the spec cannot see: the queries' dtype (the spec's is the model's first weight's) and device
        from . import mma_attention

        if why := _call_dtypes(q, k_new, h_new, torch.bfloat16):
            return why
        if not mma_attention.available(q.device):
            return f"a layer on {q.device}, where the kernel is not available"
        return None

    def run(self, q, k_new, h_new, view, scaling, window):
        from . import mma_attention

        return mma_attention.latent_attention(q, k_new, h_new, view, scaling, window)


def _lowrank_reason(spec: CacheSpec) -> str | None:
    if why := _triton_common(spec):
        return why
    if spec.arch.rotary_dim not in (0, spec.arch.head_dim):
        return (
            f"applies RoPE to whole heads; this model rotates {spec.arch.rotary_dim} of {spec.arch.head_dim} channels"
        )
    if any(lv.key_hi_bits for lv in spec.schedule.levels):
        return "key bands (the tale preset) are read by the triton backend"
    return None


@dataclass(frozen=True)
class LowRankBackend(backends.AttentionBackend):
    """The Triton kernel for keys before RoPE and low-rank keys (lowrank_attention.py): reads every layout of the
    lowrank preset, with RoPE from each region's tables or Rotary. Slower than the paper kernels (on an H200 at 32K
    batch 1, the preset's basis per latent group: 207 us against the paper CUDA kernel's 33 us, docs/performance.md) but far faster
    than the torch reference, so "auto" picks it last: for the caches the other kernels do not read."""

    name: str = "triton-lowrank"
    label: str = "triton low-rank-key kernel"
    priority: int = 10

    def supports(self, spec: CacheSpec) -> str | None:
        return _lowrank_reason(spec)

    def declines(self, q, k_new, h_new, view) -> str | None:
        return _call_dtypes(q, k_new, h_new)

    def run(self, q, k_new, h_new, view, scaling, window):
        from .lowrank_attention import latent_attention_lowrank

        return latent_attention_lowrank(q, k_new, h_new, view, scaling, window, score_cuda=False)


def _cuda_lowrank_reason(spec: CacheSpec) -> str | None:
    if why := _lowrank_reason(spec):
        return why
    s, a = spec.schedule, spec.arch
    lows = [lv for lv in s.levels if lv.key_rank]
    if not lows:
        return "no low-rank keys (keys before RoPE alone: the triton-lowrank backend)"
    if a.num_heads % a.num_kv_heads:
        return f"needs a whole number of query heads per KV head ({a.num_heads} over {a.num_kv_heads})"
    from . import lowrank_score

    K, rep = a.num_kv_heads, a.num_heads // a.num_kv_heads
    for i, lv in enumerate(s.levels):
        if not lv.key_rank:
            continue
        if lv.key_axis != "channel":
            return "reads coefficients quantized per coefficient over token groups (key_axis 'channel')"
        for kr in sorted({s.key_rank(layer, i) for layer in range(max(1, len(s.ranks)))}):  # each layer's count
            why = lowrank_score.format_reason(
                spec.device, a.head_dim, spec.dtype, rep, K // s.key_blocks, K, kr, lv.key_bits, s.key_group,
                s.key_meta,
            )  # fmt: skip
            if why:
                return why
    return None


@dataclass(frozen=True)
class CudaLowRankBackend(backends.AttentionBackend):
    """The low-rank-key kernel with its score pass in CUDA (kernels/lowrank_score.py: the keys' rebuild as a
    tensor-core GEMM against the basis held in shared memory, RoPE, the query dot), the softmax and latents in
    Triton (lowrank_attention.py). Serves the lowrank preset's caches at head dim 128 on sm_80 and later."""

    name: str = "cuda-lowrank"
    label: str = "cuda low-rank-key kernel"
    priority: int = 15

    def supports(self, spec: CacheSpec) -> str | None:
        return _cuda_lowrank_reason(spec)

    def declines(self, q, k_new, h_new, view) -> str | None:
        return _call_dtypes(q, k_new, h_new)

    def run(self, q, k_new, h_new, view, scaling, window):
        from .lowrank_attention import latent_attention_lowrank

        return latent_attention_lowrank(q, k_new, h_new, view, scaling, window, score_cuda="warn")


def register() -> None:
    """Entry point: import what Triton needs (ImportError without it: nothing registered) and register."""
    import triton  # noqa: F401

    from . import frag_pack, paged_attention, quant
    from .attention import TritonConfig

    ops = {"quant": quant, "frag_pack": frag_pack, "paged_attention": paged_attention}
    backends.register(TritonBackend(config=TritonConfig()), ops=ops)
    backends.register(CudaBackend())
    backends.register(CudaLowRankBackend())
    backends.register(LowRankBackend())
