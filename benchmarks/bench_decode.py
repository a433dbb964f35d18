"""Decode attention of one layer on Llama-3.1-8B shapes: the TALE kernel against cuDNN/flash SDPA.

Shapes: 32 query heads, 8 KV heads, head dim 128, head groups g = 4 (R = 512, r0 = 256); `--shape 70b`:
Llama-3.1-70B's 64 query heads over the same 8 KV heads (8 query heads per KV head); `--shape 70b-g2`: the
same with latent groups of 2 KV heads (16 query rows per group, as the 8B shapes have). The
paper's schedule: 4 sinks, recent share p = 0.1 at 4 bits and full rank, the middle at 2 bits
and rank r0, key and value groups of 32, a 16-bit residual under 32 tokens. bf16. Inputs are
random (real weights cannot travel) with real shapes and region lengths, read through a
LayerView (runtime/regions.py) as the runtime hands it to attention.

First correctness against the torch reference (fresh random inputs, outputs poisoned with NaN
through the allocator, bf16 rel. error <= 5e-3): batch 1/4/16, odd lengths, left padding,
empty regions, sliding windows, capacities larger than lengths with NaN in the unused slots,
lengths as device tensors, regions in shuffled order, a CUDA-graph replay, the real cache
pipeline (prefill, decode steps with flushes and demotions), and the Triton quantize/requantize
against the torch path. Then the table: per context and batch the whole call (one layer, one
decode step), the 2-bit and the 4-bit level alone (a view holding just that region), and SDPA
bf16 (flash / efficient / cuDNN with enable_gqa, the fastest) on the same shapes. Times are
medians of CUDA-graph replays with L2 flushed (256 MB written) before each; bandwidth = bytes of
the cache tensors read (packed codes, scales, zeros, sinks, residual) over the time, against a
device-to-device copy measured in the same run (bytes read + written over its time).

    python benchmarks/bench_decode.py --out decode.md
    python benchmarks/bench_decode.py --presets --no-check --contexts 131072 --batches 1   # paper vs tale caches
    python benchmarks/bench_decode.py --shape 70b                 # Llama-3.1-70B's attention shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import traceback

import harness
import torch
from harness import copy_bandwidth, fmt, graphed, timeit

import tale_kernels
from tale_kernels import TritonConfig
from tale_kernels import attention as kattn
from tale_runtime import backends
from tale_runtime import quant as rquant
from tale_runtime.artifact import Level, Schedule, ceil_share
from tale_runtime.attention import latent_attention as ref_attention
from tale_runtime.cache import RegionStore
from tale_runtime.quant import QTensor, meta_format
from tale_runtime.regions import LayerView, Region

# name: (model, query heads H, KV heads K, head dim N, KV heads per latent group GS)
SHAPES = {
    "8b": ("Llama-3.1-8B", 32, 8, 128, 4),
    "70b": ("Llama-3.1-70B", 64, 8, 128, 4),
    "70b-g2": ("Llama-3.1-70B, latent groups of 2 KV heads (tale-convert --group 2)", 64, 8, 128, 2),
    "qwen2.5-7b": ("Qwen2.5-7B", 28, 4, 128, 4),
    "405b": ("Llama-3.1-405B", 128, 8, 128, 4),
    "llama2-7b": ("Llama-2-7B (no GQA)", 32, 32, 128, 4),
}
SINKS, P, KG, VG = 4, 0.1, 32, 32


def set_shape(name: str) -> None:
    """The module's shape constants (read by every function below) for one of SHAPES."""
    global MODEL, H, K, N, GS, G, R, R0, REP, SCHED
    MODEL, H, K, N, GS = SHAPES[name]
    G, R, R0, REP = K // GS, GS * N, GS * N // 2, H // K
    SCHED = Schedule(
        sinks=SINKS,
        levels=[Level(2, 2, None), Level(4, 4, P)],
        ranks=[[R0, R]],
        key_group=KG,
        value_group=VG,
        residual=KG,
    )


set_shape("8b")
DEV = "cuda"
DT = torch.bfloat16
TOL = 5e-3


# -- caches as views -----------------------------------------------------------------------


def region_lengths(L: int) -> tuple[int, int, int, int]:
    """(sinks, level 0, level 1, residual) for a cache of L tokens, as the runtime lays them out."""
    if L <= SINKS:
        return L, 0, 0, 0
    n = L - SINKS
    res = n % KG
    l1 = min(-(-ceil_share(P, n) // KG) * KG, n - res)
    return SINKS, n - res - l1, l1, res


def qrand(lead, cap, used, C, bits, group, dim) -> QTensor:
    """Random packed codes with scales/zeros (stored per meta_format, as quantize writes them); slots past `used`
    hold NaN scales (an unused buffer)."""
    if bits == 16:
        x = torch.randn(*lead, cap, C, device=DEV, dtype=DT)
        x[..., used:, :] = float("nan")
        return QTensor(x, None, None, 16, group, dim)
    data = torch.randint(0, 256, (*lead, cap, C * bits // 8), dtype=torch.uint8, device=DEV)
    sshape = (*lead, cap // group, C) if dim == -2 else (*lead, cap, C // group)
    mdt, shift = meta_format(DT)
    scale = torch.rand(sshape, device=DEV) * 0.2 + 0.05
    zero = torch.randn(sshape, device=DEV) * 0.2 - scale * ((1 << bits) - 1) / 2
    scale, zero = (scale * shift).to(mdt), (zero * shift).to(mdt)
    used_rows = used // group if dim == -2 else used
    scale[..., used_rows:, :] = float("nan")
    return QTensor(data, scale, zero, bits, group, dim, shift=shift)


def synth_view(
    B: int, L: int, pad=None, extra: int = 0, tensor_len: bool = False, only=None, shuffle: bool = False
) -> LayerView:
    """A LayerView of a cache of L positions per row: sinks | 2-bit level | 4-bit level | residual.
    `pad[b]` leading positions of row b are padding (pos -1); every region gets `extra` unused
    slots (capacity > length, NaN inside, pos -1); `only` keeps one region ("2bit" / "4bit")."""
    lens = region_lengths(L)
    kinds = [(16, 16, R), (2, 2, R0), (4, 4, R), (16, 16, R)]
    names = ["sinks", "2bit", "4bit", "res"]
    regions, p0 = [], 0
    for name, used, (kb, hb, rank) in zip(names, lens, kinds):
        cap = used + extra
        pos = torch.full((B, cap), -1, dtype=torch.int32, device=DEV)
        pos[:, :used] = torch.arange(p0, p0 + used, device=DEV, dtype=torch.int32)
        if pad is not None:
            for b, pb in enumerate(pad):
                pos[b][pos[b] < pb] = -1
        p0 += used
        if cap == 0 or (only and name != only):
            continue
        length = torch.tensor([used], dtype=torch.int32, device=DEV) if tensor_len else used
        regions.append(
            Region(
                qrand((B, K), cap, used, N, kb, KG, -2), qrand((B, G), cap, used, rank, hb, VG, -1), rank, pos, length
            )
        )
    if shuffle:
        random.shuffle(regions)
    npos = torch.tensor(L, dtype=torch.int32, device=DEV) if tensor_len else L
    return LayerView(regions, npos)


def channel_major(v: LayerView, on: bool = True) -> LayerView:
    """The view with its packed latents stored channel-major (slots contiguous: the static cache's layout, which
    the kernel unpacks in the dot's operand layout), or (on=False) row-major; the same codes either way."""

    def lay(t: QTensor) -> QTensor:
        if t.bits >= 8:
            return t
        d = t.data.transpose(-1, -2).contiguous().transpose(-1, -2) if on else t.data.contiguous()
        return dataclasses.replace(t, data=d)

    return LayerView([dataclasses.replace(r, lat=lay(r.lat)) for r in v.regions], v.next_pos)


def view_bytes(v: LayerView, part: str = "all") -> int:
    """Bytes of the used slots: packed codes, scales, zeros (and 16-bit tensors); `part` "keys" / "lat": one side."""
    total = 0
    for r in v.regions:
        used = int(r.length) if not isinstance(r.length, int) else r.length
        for t in {"all": (r.keys, r.lat), "keys": (r.keys,), "lat": (r.lat,)}[part]:
            frac = used / r.capacity
            total += int(sum(x.numel() * x.element_size() for x in (t.data, t.scale, t.zero) if x is not None) * frac)
    return total


def new_token(B: int):
    return (
        torch.randn(B, H, 1, N, device=DEV, dtype=DT),
        torch.randn(B, K, 1, N, device=DEV, dtype=DT),
        torch.randn(B, G, 1, R, device=DEV, dtype=DT),
    )


def kernel_cfg(cfg: dict) -> TritonConfig:
    """The Triton kernel's TritonConfig from JSON: `dot` by name ("bfloat16", "float16"), `asm` a list or a bool; an
    unknown name or field exits 2."""
    if isinstance(cfg.get("dot"), str):
        dt = getattr(torch, cfg["dot"], None)
        if not isinstance(dt, torch.dtype):
            print(f'bench_decode.py: unknown dot {cfg["dot"]!r}: use "bfloat16" or "float16"', file=sys.stderr)
            sys.exit(2)
        cfg = {**cfg, "dot": dt}
    if isinstance(cfg.get("asm"), list):
        cfg = {**cfg, "asm": tuple(cfg["asm"])}
    try:
        return TritonConfig(**cfg)
    except (TypeError, ValueError) as e:
        print(f"bench_decode.py: bad --config: {e}", file=sys.stderr)
        sys.exit(2)


def triton(q, k, h, v, scale, cfg: TritonConfig, window=None):
    return tale_kernels.latent_attention(q, k, h, v, scale, window, config=cfg)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def poison() -> None:
    """Fill the allocator's free blocks with NaN, so an output the kernel fails to write shows."""
    x = torch.full((256 << 20,), float("nan"), device=DEV)
    del x


# -- correctness on real shapes ------------------------------------------------------------


def check(cfg: TritonConfig) -> bool:
    ok = True
    scale = N**-0.5

    def one(name, v, B, window=None):
        nonlocal ok
        q, k, h = new_token(B)
        poison()
        got = triton(q, k, h, v, scale, cfg, window)
        e = rel(got, ref_attention(q, k, h, v, scale, window))
        good = e <= TOL and bool(torch.isfinite(got).all())
        ok &= good
        print(f"check {name}: rel err {e:.2e} {'ok' if good else 'FAIL'}", flush=True)
        return q, k, h

    assert kattn.supported(*new_token(1), synth_view(1, 1000)) is None
    for B, L in ((1, 4099), (4, 33333), (16, 20001)):
        pad = [0] + [L // 7 * (i % 3) for i in range(1, B)]
        one(f"B={B} L={L} padded rows", synth_view(B, L, pad=pad), B)
        one(f"B={B} L={L} window {L // 3}", synth_view(B, L, pad=pad), B, L // 3)
        one(
            f"B={B} L={L} capacity +96, device lengths, shuffled",
            synth_view(B, L, pad=pad, extra=96, tensor_len=True, shuffle=True),
            B,
        )
    one("B=2 L=37 (no level 0: empty region)", synth_view(2, 37), 2)
    one("B=1 L=1 (sinks only)", synth_view(1, 1), 1)
    one("B=1 L=131077 window 4096", synth_view(1, 131077), 1, 4096)
    # a CUDA-graph replay: lengths, positions and next_pos on the device, changed between replays
    # (the quantized levels lose their last 64 slots, then get them back)
    v = synth_view(4, 20000, extra=256, tensor_len=True)
    q, k, h = new_token(4)
    gr, out = graphed(lambda: triton(q, k, h, v, scale, cfg, 5000))
    saved = [(r.length.clone(), r.pos.clone()) for r in v.regions]
    for shrink in (64, 0):
        for r, (ln, pos) in zip(v.regions, saved):
            if r.keys.bits != 16:
                r.length.copy_(ln - shrink)
                r.pos.copy_(pos)
                r.pos[:, int(ln) - shrink :] = -1
        v.next_pos.fill_(20000 + 3 * shrink)  # after every cached position, as in a real cache
        for t in (q, k, h):
            t.normal_()
        gr.replay()
        e = rel(out, ref_attention(q, k, h, v, scale, 5000))
        ok &= e <= TOL
        print(
            f"check graph replay, levels shrunk by {shrink}: rel err {e:.2e} {'ok' if e <= TOL else 'FAIL'}", flush=True
        )
    # the real pipeline: prefill with padding, then decode steps (flush, demotion, Triton quantize)
    for window in (None, 1000):
        B, L0 = 2, 3000
        c = RegionStore(SCHED, 0, K, N, G, R)
        valid = torch.ones(B, L0, dtype=torch.bool, device=DEV)
        valid[1, :37] = False
        c.append(
            torch.randn(B, K, L0, N, device=DEV, dtype=DT) * 2, torch.randn(B, G, L0, R, device=DEV, dtype=DT), valid
        )
        worst = 0.0
        for _ in range(40):
            q, k, h = new_token(B)
            poison()
            worst = max(
                worst,
                rel(
                    triton(q, k, h, c, scale, cfg, window),
                    ref_attention(q, k, h, c, scale, window),
                ),
            )
            c.append(k, h)
        ok &= worst <= TOL
        print(f"check pipeline window={window} B={B} prompt={L0} +40 steps {c.lengths()}: worst rel err {worst:.2e}")
    # quantize / requantize at real shapes vs the torch path on the CPU
    for x, bits, group, dim, rank in (
        (torch.randn(2, K, 4096, N, device=DEV, dtype=DT), 2, KG, -2, None),
        (torch.randn(2, G, 4096, R, device=DEV, dtype=DT), 4, VG, -1, R0),
    ):
        a, b = tale_kernels.quantize(x, bits, group, dim), rquant.quantize(x.cpu(), bits, group, dim)
        mis = (rquant.unpack(a.data.cpu(), bits) != rquant.unpack(b.data, bits)).float().mean().item()
        s_ok = torch.equal(a.scale.cpu(), b.scale) and torch.equal(a.zero.cpu(), b.zero)
        r2 = tale_kernels.requantize(a, 2, rank)
        xd = rquant.dequantize(dataclasses.replace(a, data=a.data.cpu(), scale=a.scale.cpu(), zero=a.zero.cpu()))
        w2 = rquant.quantize(xd if rank is None else xd[..., :rank].contiguous(), 2, group, dim)
        mis2 = (rquant.unpack(r2.data.cpu(), 2) != rquant.unpack(w2.data, 2)).float().mean().item()
        ok &= mis <= 1e-3 and mis2 <= 1e-3
        print(
            f"check quantize dim={dim} {bits}-bit: codes differing {mis:.1e}, scale/zero equal {s_ok}; "
            f"requantize ->2-bit rank {rank}: codes differing {mis2:.1e}"
        )
    print("CHECKS", "PASS" if ok else "FAIL", flush=True)
    return ok


# -- the comparison ------------------------------------------------------------------------


def best_sdpa(B: int, L: int) -> tuple[float, str]:
    return harness.best_sdpa(B, H, K, N, L, DT, DEV)


def row(B: int, L: int, cfg: TritonConfig, copy_bw: float) -> dict:
    r = {"L": L, "B": B}
    scale = N**-0.5
    q, k, h = new_token(B)
    for key, only in (("all", None), ("2bit", "2bit"), ("4bit", "4bit")):
        v = synth_view(B, L, only=only)
        t = timeit(lambda v=v: triton(q, k, h, v, scale, cfg))
        nb = view_bytes(v)
        r[f"{key}_us"], r[f"{key}_bytes"] = t, nb
        r[f"{key}_gbs"] = nb / (t * 1e-6) / 1e9
        r[f"{key}_pct"] = 100 * r[f"{key}_gbs"] / copy_bw
        del v
    torch.cuda.empty_cache()
    try:
        r["sdpa_us"], r["sdpa_backend"] = best_sdpa(B, L)
    except torch.OutOfMemoryError:
        r["sdpa_us"], r["sdpa_backend"] = float("nan"), "OOM"
    torch.cuda.empty_cache()
    r["speedup"] = r["sdpa_us"] / r["all_us"]
    return r


# candidates of --sweep (earlier sweeps of block_t / warps / stages / waves: docs/notes.md)
SWEEP = (
    {},
    {"asm": False},
    {"asm": [2]},
    {"asm": [2], "num_stages": 1},
    {"asm": [2], "maxnreg": 168, "num_stages": 1, "waves": 3},
    {"asm": True, "maxnreg": 168, "num_stages": 1, "waves": 3},
    {"asm": [2], "maxnreg": 128, "num_stages": 1, "waves": 4},
)


def last_compiled() -> str:
    try:
        kern = list(next(iter(kattn._attn_kernel.device_caches.values()))[0].values())[-1]
        return f"regs {kern.n_regs} spills {kern.n_spills} shared {kern.metadata.shared}"
    except Exception as ex:
        return f"resources unavailable ({ex})"


def sweep(cfg: TritonConfig) -> TritonConfig:
    """Launch parameters at 128K batch 1 (the SWEEP candidates over cfg), best by time among the correct."""
    v = synth_view(1, 131072)
    q, k, h = new_token(1)
    want = ref_attention(q, k, h, v, N**-0.5)
    res = []
    for cand in SWEEP:
        c = dataclasses.replace(cfg, **{f: tuple(x) if isinstance(x, list) else x for f, x in cand.items()})
        try:
            e = rel(triton(q, k, h, v, N**-0.5, c), want)
            t = timeit(lambda c=c: triton(q, k, h, v, N**-0.5, c))
        except Exception as ex:
            print(f"sweep {c}: failed: {str(ex).splitlines()[0][:120]}")
            continue
        print(f"sweep 128K B=1 {c}: {t:.1f} us, rel err {e:.1e}; {last_compiled()}", flush=True)
        if e <= TOL:
            res.append((t, c))
    best = min(res, key=lambda x: x[0])[1]
    print("sweep best:", best, flush=True)
    return best


def compare(cfgs: list[TritonConfig], contexts: list[int], batches: str, copy_bw: float) -> None:
    """Each launch config at each context and batch (same inputs), then SDPA once: one line each."""
    scale = N**-0.5
    for L in contexts:
        for B in (int(x) for x in batches.split(",")):
            q, k, h = new_token(B)
            views = {
                key: synth_view(B, L, only=only) for key, only in (("all", None), ("2bit", "2bit"), ("4bit", "4bit"))
            }
            want = ref_attention(q, k, h, views["all"], scale)
            for c in cfgs:
                try:
                    e = rel(triton(q, k, h, views["all"], scale, c), want)
                    ts = {
                        key: timeit(lambda v=v, c=c, q=q, k=k, h=h: triton(q, k, h, v, scale, c))
                        for key, v in views.items()
                    }
                except Exception as ex:
                    print(f"compare {L // 1024}K B={B} {c}: failed: {str(ex).splitlines()[0][:160]}", flush=True)
                    continue
                pct = {key: 100 * view_bytes(views[key]) / (ts[key] * 1e-6) / 1e9 / copy_bw for key in ts}
                print(
                    f"compare {L // 1024}K B={B} {c}: all {ts['all']:.1f} us ({pct['all']:.0f}%), "
                    f"2-bit {ts['2bit']:.1f} us ({pct['2bit']:.0f}%), 4-bit {ts['4bit']:.1f} us ({pct['4bit']:.0f}%), "
                    f"rel err {e:.1e}",
                    flush=True,
                )
            del views
            torch.cuda.empty_cache()
            t, be = best_sdpa(B, L)
            print(f"compare {L // 1024}K B={B} SDPA {t:.1f} us ({be})", flush=True)


def preset_schedule(name: str) -> Schedule:
    """The tale-convert presets on these shapes: "paper" (SCHED) or "tale": the middle level's keys with the 64
    most important of each head's 128 channels at 3 bits (a random order stands in for the calibration's), the
    rest at 2; fp8 scales (keys "8/16", latents "8/8")."""
    if name == "paper":
        return SCHED
    order = [[torch.randperm(N).tolist() for _ in range(K)]]
    levels = [Level(2, 2, None, key_hi_bits=3, key_hi_channels=N // 2), Level(4, 4, P)]
    return Schedule(
        sinks=SINKS,
        levels=levels,
        ranks=[[R0, R]],
        key_group=KG,
        value_group=VG,
        residual=KG,
        key_meta="8/16",
        value_meta="8/8",
        key_order=order,
    )


def presets(contexts: list[int], batches: str, copy_bw: float, cfg: TritonConfig) -> bool:
    """The kernel over real caches of each preset (a static cache filled by a prefill of random keys and latents,
    then 40 decode steps: flushes and demotions): correctness against the reference, time of one layer's decode
    attention (CUDA-graph replays, as a captured decode step runs it), and SDPA on the same shapes. The paper preset
    twice: in the row layout (the Triton kernel) and in the fragment layout (runtime/frag.py: the CUDA kernel of
    tale_kernels.mma_attention, what a static cache picks on Hopper). Each cache runs its own backend (cache.attend),
    as a decode step does."""
    from tale_kernels import mma_attention
    from tale_runtime.static_cache import StaticTaleCache

    scale, ok = N**-0.5, True
    for L in contexts:
        for B in (int(x) for x in batches.split(",")):
            for name, layout in (("paper", "row"), ("paper", "frag"), ("tale", "row")):
                be = backends.get("cuda") if layout == "frag" else backends.get("triton").configure(cfg)
                c = StaticTaleCache(preset_schedule(name), 1, K, N, G, R, max_length=L + 64, backend=be)
                layer = c.layers[0]
                layer.append(
                    torch.randn(B, K, L, N, device=DEV, dtype=DT) * 2, torch.randn(B, G, L, R, device=DEV, dtype=DT)
                )
                for _ in range(40):
                    _, k, h = new_token(B)
                    layer.append(k, h)
                q, k, h = new_token(B)
                v = layer.view()
                assert (mma_attention if layout == "frag" else kattn).supported(q, k, h, v) is None, (name, layout)
                name = f"{name}-cuda" if layout == "frag" else name
                e = rel(c.attend(0, q, k, h, scale), ref_attention(q, k, h, v, scale))
                ok &= e <= TOL
                t = timeit(lambda c=c, q=q, k=k, h=h: c.attend(0, q, k, h, scale))
                nb = layer.nbytes()
                ratio = 2 * B * K * c.book.kappa * N * 2 / nb
                print(
                    f"preset {name} {L // 1024}K B={B}: {t:.1f} us, cache {nb / 1e6:.1f} MB ({ratio:.2f}x), "
                    f"{nb / (t * 1e-6) / 1e9:.0f} GB/s ({100 * nb / (t * 1e-6) / 1e9 / copy_bw:.0f}% of copy), "
                    f"rel err {e:.1e} {'ok' if e <= TOL else 'FAIL'}",
                    flush=True,
                )
                if layout == "frag" and REP > 4:  # the same bytes read by 4 query heads per KV head: what more cost
                    q4 = q.view(B, K, REP, 1, N)[:, :, :4].reshape(B, 4 * K, 1, N)
                    t4 = timeit(lambda c=c, q4=q4, k=k, h=h: c.attend(0, q4, k, h, scale))
                    print(f"preset {name} {L // 1024}K B={B}, 4 query heads per KV head: {t4:.1f} us", flush=True)
                del c, layer, v
                torch.cuda.empty_cache()
            t, be = best_sdpa(B, L)
            print(f"preset SDPA {L // 1024}K B={B}: {t:.1f} us ({be})", flush=True)
    return ok


def kernel_resources() -> None:
    for kfn in (kattn._attn_kernel,):
        try:
            for _, entry in kfn.device_caches.items():
                for kern in entry[0].values():
                    md = kern.metadata
                    print(
                        f"compiled {kfn.fn.__name__}: regs {kern.n_regs} spills {kern.n_spills} shared {md.shared} "
                        f"warps {md.num_warps} stages {md.num_stages}"
                    )
        except Exception as ex:
            print("compiled kernel info unavailable:", ex)


def markdown(rows, copy_bw, cfg, cmd, env) -> str:
    out = [
        "## Decode attention kernel (one layer, one decode step)",
        "",
        f"Measured on {env}. Command (from the repo root): `{cmd}`",
        "",
        f"{MODEL} attention shapes (H={H}, K={K}, head dim {N}, g={GS}: R={R}, r0={R0}), bf16, the paper schedule "
        f"(4 sinks, p=0.1 at 4 bits full rank, the middle at 2 bits rank {R0}, key/value groups 32, 16-bit residual), "
        "random inputs of real shapes read through a LayerView. Kernel launch config: "
        f"{cfg}. Medians of CUDA-graph replays, L2 flushed before "
        f"each. Copy bandwidth measured in the same run: {copy_bw:.0f} GB/s (read + write). GB/s = bytes of the cache "
        "tensors (packed codes, scales, zeros, sinks, residual) over the time; the slot positions (4 bytes per slot "
        "and row, read once per head group) are not counted. 2-bit / 4-bit: a view holding only that level "
        "(plus the new token), timed alone, whole call. SDPA: torch bf16 flash / efficient / cuDNN with "
        "enable_gqa=True over the full K/V, the fastest.",
        "",
        "| context | batch | TALE us | cache MB | GB/s | % of copy | 2-bit level: us, GB/s, % | "
        "4-bit level: us, GB/s, % | SDPA bf16 us (backend) | TALE vs SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['L'] // 1024}K | {r['B']} | {fmt(r['all_us'])} | {r['all_bytes'] / 1e6:.1f} | {r['all_gbs']:.0f} "
            f"| {r['all_pct']:.0f}% | {fmt(r['2bit_us'])}, {r['2bit_gbs']:.0f}, {r['2bit_pct']:.0f}% "
            f"| {fmt(r['4bit_us'])}, {r['4bit_gbs']:.0f}, {r['4bit_pct']:.0f}% "
            f"| {fmt(r['sdpa_us'])} ({r['sdpa_backend']}) | {fmt(r['speedup'], 2)}x |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="8b", help="attention shapes of this model")
    ap.add_argument("--contexts", default="32768,131072,524288")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    ap.add_argument("--sweep", action="store_true", help="pick launch parameters (SWEEP) at 128K batch 1 first")
    ap.add_argument("--config", default=None, help="JSON launch parameters for latent_attention")
    ap.add_argument("--out", default=None, help="markdown file for the table")
    ap.add_argument(
        "--compare", default=None, help="JSON list of launch configs: time each (whole call, 2-bit, 4-bit), no table"
    )
    ap.add_argument(
        "--presets", action="store_true", help="time the paper and tale presets' real (static) caches, then SDPA"
    )
    args = ap.parse_args()
    set_shape(args.shape)
    harness.init_flush(device=DEV)
    torch.manual_seed(0)
    random.seed(0)
    cfg = kernel_cfg(json.loads(args.config)) if args.config else TritonConfig()
    env = harness.device_name()
    print(env, flush=True)
    ok = True
    if args.sweep:  # first, so that the checks run on the chosen parameters
        try:
            cfg = sweep(cfg)
        except Exception:
            traceback.print_exc()
    if not args.no_check:
        try:
            ok = check(cfg)
        except Exception:
            traceback.print_exc()
            ok = False
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    if args.presets:
        ok &= presets([int(x) for x in args.contexts.split(",")], args.batches, copy_bw, cfg)
        kernel_resources()
        return 0 if ok else 1
    if args.compare:
        compare(
            [kernel_cfg(c) for c in json.loads(args.compare)],
            [int(x) for x in args.contexts.split(",")],
            args.batches,
            copy_bw,
        )
        kernel_resources()
        return 0 if ok else 1
    rows = []
    md = ""
    for L in (int(x) for x in args.contexts.split(",")):
        for B in (int(x) for x in args.batches.split(",")):
            try:
                r = row(B, L, cfg, copy_bw)
            except Exception:
                traceback.print_exc()
                torch.cuda.empty_cache()
                continue
            rows.append(r)
            print(json.dumps(r), flush=True)
            md = markdown(rows, copy_bw, cfg, " ".join(["python"] + sys.argv), env)
            if args.out:  # rewritten after every row: a run cut short still leaves its table
                with open(args.out, "w") as f:
                    f.write(md)
    kernel_resources()
    print(md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
