"""Decode attention in CUDA for the paper preset's static caches in the fragment layout (kernels/cuda/latent_level.cu).

Two launches per call: both quantized levels (2-bit rank 256, 4-bit rank 512; runtime/frag.py's layout) in one grid,
each CTA a split of a level's slots for one (batch row, latent group[, half of the 512 channels]); then the merge,
a programmatic dependent launch, which scores the 16-bit sinks, residual and new token while the first grid ends
and merges everything by log-sum-exp. Design, measurements and limits: docs/kernels.md ("CUDA kernel").

The "cuda" attention backend (kernels/plugin.py) serves static caches in the fragment layout with it; `supported`
says when a call qualifies (one new token, bf16, head dim 128, a whole number of query heads per KV head, the view of
a fragment-layout StaticTaleCache; with more than 4, each CTA runs once per set of 4 query heads, on the same bytes).
"""

from __future__ import annotations

import math
import os

import torch

from tale_runtime.frag import FragRegion, kernel_heads
from tale_runtime.regions import LayerView

SRC = os.path.join(os.path.dirname(__file__), "cuda", "latent_level.cu")
OPTIONS = ("--use_fast_math", "-DSUBN=1", "-DABATCH=4")
NW = {2: 8, 4: 5}  # warps per CTA of each level (the paper launch's CTAs have 8; 4-bit ones use 5)
RANK = 256  # latent channels per CTA
# the levels' launch as a programmatic dependent launch too: its CTAs request their first block while the kernel
# before it (the query's) ends, and wait for it only before reading the query (docs/kernels.md)
PDL_MAIN = True
KEY_BYTES = {kb: 4 * 128 * kb // 8 + 4 * 128 * 4 // 32 for kb in (2, 4)}  # per slot and group: codes, scale/zero
LEVEL_BYTES = {2: KEY_BYTES[2] + 256 * 2 // 8 + 256 // 32 * 4, 4: KEY_BYTES[4] + 512 * 4 // 8 + 512 // 32 * 4}

_FAILED: dict = {}


def smem_bytes(kb: int, lb: int, nw: int) -> int:
    """Dynamic shared memory of a CTA of nw warps (the .cu's Cfg::SMEM): per warp two stages (a 32-slot block's key
    codes and scales/zeros, 256 latent channels' codes and scales/zeros, its 32 positions), the A tile and its zero
    rows; the query."""
    stage = 32 * KEY_BYTES[kb] + 32 * RANK * lb // 8 + 32 * RANK // 32 * 4 + 128
    return nw * (2 * stage + 8192 + 128) + 8704


PAPER_SMEM = max(smem_bytes(2, 2, NW[2]), smem_bytes(4, 4, NW[4]))


def module(device: torch.device | None = None, options: tuple[str, ...] = OPTIONS, src: str = SRC):
    """The compiled kernels on `device` (built once per options; cached on disk by cuda_module)."""
    from .cuda_module import loaded

    dev = torch.device("cuda", torch.cuda.current_device() if device is None or device.index is None else device.index)
    mod = loaded(src, options, dev)
    mod.function("tale_attn_paper", PAPER_SMEM)
    for kb in (2, 4):
        mod.function(f"tale_attn_k{kb}l{kb}", smem_bytes(kb, kb, NW[kb]))
    return mod


def available(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: a Hopper GPU (sm_90: griddepcontrol, the subnormal tensor-core operands
    it was verified with) and a compiler (NVRTC or nvcc) for the first build. A failed build is reported once."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _FAILED:
        return False
    try:
        module(torch.device("cuda", idx))
    except Exception as e:  # no compiler, or a driver too old for the cubin: the Triton kernel serves
        import warnings

        _FAILED[idx] = str(e)
        warnings.warn(
            f"tale_kernels: the CUDA decode kernel is not available ({e}); static caches keep the row layout "
            "(the Triton kernel)",
            stacklevel=2,
        )
        return False
    return True


def _levels(view: LayerView):
    """(sinks, 2-bit level, 4-bit level, residual) regions of a fragment-layout static cache's view, or a one-line
    reason it is not one."""
    r = view.regions
    if len(r) != 4 or not (isinstance(r[1], FragRegion) and isinstance(r[2], FragRegion)):
        return "a view that is not a fragment-layout static cache's (sinks, two levels, residual)"
    if isinstance(r[0], FragRegion) or isinstance(r[3], FragRegion) or r[0].keys.bits != 16 or r[3].keys.bits != 16:
        return "sinks or residual that are not 16-bit"
    if (r[1].frag.key_proto.bits, r[1].rank, r[2].frag.key_proto.bits, r[2].rank) != (2, 256, 4, 512):
        return "levels other than the paper preset's (2-bit rank 256, 4-bit rank 512)"
    return r


def supported(q: torch.Tensor, k_new: torch.Tensor, h_new: torch.Tensor, view) -> str | None:
    """None when the kernel serves this call, else a one-line reason. It serves one new token of a bf16 model with head
    dim 128 and a whole number of query heads per KV head, over the view of a fragment-layout StaticTaleCache (device
    lengths and positions), on a GPU where the kernel is available.
    The kernel masks slots by position only: a cache must hold -1 at every slot at or past a region's length (the
    static cache does: slots never written, emptied by a flush or left by a demotion)."""
    if not isinstance(view, LayerView):
        return f"a {type(view).__name__}, not a LayerView"
    B, H, T, n = q.shape
    if T != 1:
        return f"{T} new tokens (the kernel decodes one)"
    if q.dtype != torch.bfloat16:
        return f"{str(q.dtype).removeprefix('torch.')} queries (it reads bfloat16)"
    if k_new.dtype != q.dtype or h_new.dtype != q.dtype:
        return f"new keys in {k_new.dtype} and latents in {h_new.dtype} beside bfloat16 queries"
    G = h_new.shape[1]
    if n != 128 or h_new.shape[-1] != 512 or k_new.shape[1] != 4 * G:
        return f"head dim {n}, latent rank {h_new.shape[-1]}, {k_new.shape[1]} KV heads in {G} groups (128, 512, 4 per group)"
    if not kernel_heads(H, 4 * G):
        return f"{H} query heads over {4 * G} KV heads (a whole number per KV head)"
    if not q.is_cuda:
        return "CPU tensors (it runs on a GPU)"
    if not isinstance(view.next_pos, torch.Tensor):
        return "next_pos is not a device tensor"
    r = _levels(view)
    if isinstance(r, str):
        return r
    if any(not isinstance(x.length, torch.Tensor) for x in r):
        return "region lengths are not device tensors"
    if not available(q.device):
        return f"not available on {q.device} (a Hopper GPU, sm_90, and NVRTC or nvcc for its first build)"
    return None


def query_sets(H: int, G: int) -> int:
    """CTAs per level split: sets of 4 query heads per KV head (the last one padded with empty rows)."""
    return (H // (4 * G) + 3) // 4


def splits(B: int, G: int, n2: int, n4: int, sms: int) -> tuple[int, int]:
    """Splits of the two levels (slots n2, n4) so that their CTAs share one wave in proportion to the bytes they
    read (the 4-bit level's keys twice: once per channel half). B counts batch rows times query sets."""
    b2, b4 = n2 * LEVEL_BYTES[2], n4 * (LEVEL_BYTES[4] + KEY_BYTES[4])
    f2 = b2 / max(b2 + b4, 1)
    s2 = max(1, min(max(n2 // 32 // NW[2], 1), round(sms * f2 / (B * G))))
    s4 = max(1, min(max(n4 // 32 // NW[4], 1), round(sms * (1 - f2) / (B * 2 * G))))
    return s2, s4


def launch(
    mod, q, lv2, lv4, tail, npos, window: int, scaling: float, shift: float, S2: int, S4: int, pdl: bool = True
) -> torch.Tensor:
    """The two launches over raw arrays: q [B, H, 128] bf16; lv2 / lv4: (kc, km, lc, lm, pos [B, cap] int32,
    length [1] int32 on the device); tail: ((sinks k, h, pos), (residual k, h, pos), (new k, h)), keys
    [B, K, cap, 128] and latents [B, G, cap, 512] bf16, contiguous; npos [1] int64. Returns z [B, H, 512] float32."""
    B, H = q.shape[0], q.shape[1]
    G = lv2[0].shape[1]
    gqa = H // (4 * G)  # query heads per KV head: ceil(gqa / 4) CTAs of 16 query rows per level split
    (sk, sh, sp), (rk, rh, rp), (nk, nh) = tail
    St = S2 + S4
    dev = q.device
    po = torch.empty(B, H, St, 512, device=dev)
    pm = torch.empty(B, H, St, device=dev)
    pl = torch.empty(B, H, St, device=dev)
    z = torch.empty(B, H, 512, device=dev)
    qk = scaling * math.log2(math.e)
    cap2, cap4 = lv2[4].shape[1], lv4[4].shape[1]
    mod.launch(
        "tale_attn_paper",
        (S2 * G + S4 * 2 * G) * B * query_sets(H, G),
        256,
        (
            q,
            *lv2[:4],
            *lv4[:4],
            po,
            pm,
            pl,
            G,
            cap2,
            S2,
            cap4,
            S4,
            1 / shift,
            qk,
            lv2[4],
            lv2[5],
            lv4[4],
            lv4[5],
            npos,
            window,
            gqa,
        ),
        PAPER_SMEM,
        pdl=pdl and PDL_MAIN,
    )
    mod.launch(
        "tale_combine_paper",
        (B * H, 8),
        256,
        (
            po,
            pm,
            pl,
            q,
            sk,
            sh,
            sp,
            sk.shape[2],
            rk,
            rh,
            rp,
            rk.shape[2],
            nk,
            nh,
            z,
            St,
            S2,
            G,
            1 / shift,
            qk,
            npos,
            window,
            gqa,
        ),
        pdl=pdl,
    )
    return z


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def latent_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    h_new: torch.Tensor,
    view: LayerView,
    scaling: float,
    window: int | None = None,
    *,
    pdl: bool = True,
) -> torch.Tensor:
    """z [B, 1, H, 512] float32, tale_runtime.attention.latent_attention's result, by the CUDA kernel. A decode step
    (T = 1) it does not serve (`supported`: float32 queries, a view of another layout, a GPU without the kernel) is
    refused with a ValueError that names why; it never runs anything slower in the kernel's name. A call of several
    new tokens (a prefill chunk: the backend signature takes T tokens, the kernel decodes one) is the torch
    reference's by design, z [B, T, H, 512]."""
    if q.shape[2] != 1:  # a prefill chunk: not a decode step
        from tale_runtime.attention import latent_attention as reference

        return reference(q, k_new, h_new, view, scaling, window)
    if why := supported(q, k_new, h_new, view):
        raise ValueError(f"cuda latent attention: {why}")
    B, H = q.shape[0], q.shape[1]
    G = h_new.shape[1]
    sinks, l2, l4, res = _levels(view)
    f2, f4 = l2.frag, l4.frag
    S2, S4 = splits(B * query_sets(H, G), G, f2.capacity, f4.capacity, _sms(q.device))
    npos = view.next_pos.view(1)
    tail = (
        (sinks.keys.data, sinks.lat.data, sinks.pos),
        (res.keys.data, res.lat.data, res.pos),
        (k_new.contiguous(), h_new.contiguous()),
    )
    lv2 = (*f2.tensors(), l2.pos, l2.length.view(1))
    lv4 = (*f4.tensors(), l4.pos, l4.length.view(1))
    window = 0 if window is None else int(window)
    mod = module(q.device)
    with torch.cuda.device(q.device):  # the driver launches on the current device's stream: q's
        z = launch(
            mod, q.contiguous().view(B, H, 128), lv2, lv4, tail, npos, window, scaling, f2.key_proto.shift, S2, S4, pdl
        )
    return z.view(B, 1, H, 512)
