"""End-to-end decode of an 8B-shaped model: TALE static cache + CUDA graphs against transformers.

Model: a random Llama with Llama-3.1-8B shapes (32 layers, hidden 4096, MLP 14336, 32 query heads,
8 KV heads, head dim 128) and vocab 49152, bf16. Its TALE weights are built directly from the random
factors (plain SVD of each group's W_V, no calibration: the values do not change the timing), head
groups of 4 (R = 512), the paper's schedule (4 sinks, p = 0.1 at 4 bits full rank, middle at 2 bits
rank 256, key/value groups 32, 16-bit residual of 32).

Rows (per context and batch), each measured in this run:
- TALE static: StaticTaleCache + one CUDA graph per decode step holding DecodeStep (runtime/decode.py: the
  code around attention compiled), flushes and demotions eager between replays; fused and factored output
  both timed, the faster reported; at batch 1 also the model's own forward in the graph (compile off) and
  the kernels per step of both (torch.profiler); the decode attention is the backend the cache was made with
  (tale_runtime.backends: the CUDA kernel on Hopper, else the Triton kernel; the `attention` column says which);
- HF eager: the same model with its own attention (SDPA), DynamicCache, eager decode;
- HF static+compile: `generate` with transformers' StaticCache and its automatic torch.compile of
  the decode step (the best a transformers user gets today), at batch 1 (32K prompt, and 512 tokens into
  the same cache: its step reads the whole cache either way) and at batches 8, 12 and its largest (512).
A 4096-token prefill and 72 decode steps run first (warm-up: Triton and torch.compile are not timed).
Every prefill runs without an attention mask (SDPA is_causal: no full-size mask). Batches > 1 are
filled by repeating the prefilled rows (`Cache.batch_repeat_interleave`): decode time does not depend
on the values. ms/token = wall time of N decode steps (greedy, argmax on the device, no host sync per
step; flush/demotion work included) / N. Peak = torch.cuda.max_memory_allocated during the decode.

    python benchmarks/bench_e2e.py --deadline 465 --out e2e.md   # one device call, ~7 minutes on an H100
    python benchmarks/bench_e2e.py --quick                      # tiny model, CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import signal
import sys
import time
import traceback

import harness
import torch
from harness import GIB as GiB
from harness import sync
from transformers import DynamicCache

from tale_runtime import backends, new_cache, set_backend, set_output_path
from tale_runtime.artifact import Schedule, uniform_ranks
from tale_runtime.decode import CudaGraphDecoder, DecodeStep
from tale_runtime.load import tale_class
from tale_runtime.model import TaleAttention, cache_arg
from tale_runtime.spec import Arch, TaleSpec

LAYOUT = None  # --layout: the TALE static caches' (None: the backend's; runtime/static_cache.py)
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def build(
    quick: bool,
    device: str,
    layers: int | None = None,
    dtype: torch.dtype | None = None,
    preset: str = "paper",
    key_basis_blocks: str = "head",
):
    """The random base model, and its TALE attention modules (sharing q/k/o projections). preset "lowrank": the
    `lowrank` preset's schedule (tale-convert's: 7/24 of each basis block's dims as coefficients; blocks per
    `key_basis_blocks`: joint, group or head) with a random orthonormal key basis per layer, decoded by the
    low-rank-key kernel (`triton-lowrank`) on a GPU."""
    if quick:
        cfg = dict(harness.SMOKE, num_hidden_layers=2, head_dim=32)
    else:
        cfg = dict(harness.LLAMA_8B, head_dim=128, vocab_size=49152)
    if layers:
        cfg["num_hidden_layers"] = layers
    dtype = dtype or (torch.float32 if quick else torch.bfloat16)
    model = harness.random_llama(cfg | dict(max_position_embeddings=1 << 20), device, dtype)
    config = model.config
    model.__class__ = tale_class(type(model))  # what tale_runtime.load does: generate() knows TALE caches
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    g = 2 if quick else 4
    n, Kh, H = config.head_dim, config.num_key_value_heads, config.num_attention_heads
    G, R, rep = Kh // g, g * n, H // Kh
    orig, tale = [], []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            o = layer.self_attn
            att = TaleAttention(o, config, i, g)
            W = o.v_proj.weight.float().T  # [d, K*n]
            Wo = o.o_proj.weight.float().T  # [H*n, d]
            A, B = [], []
            for c in range(G):
                U, S, Vh = torch.linalg.svd(W[:, c * R : (c + 1) * R], full_matrices=False)
                A.append(U * S.sqrt())
                B.append(S.sqrt()[:, None] * Vh)
            Of = [
                B[(q // rep) // g][:, ((q // rep) % g) * n : ((q // rep) % g + 1) * n] @ Wo[q * n : (q + 1) * n]
                for q in range(H)
            ]
            att.tale.u_v.data = torch.stack(A).to(dtype)
            att.tale.v_v.data = torch.stack(B).to(dtype)
            att.tale.o_fused.data = torch.cat(Of).T.contiguous().to(dtype)
            orig.append(o)
            tale.append(att)
    L = config.num_hidden_layers
    vg = 8 if quick else 32
    sched = Schedule(ranks=uniform_ranks(R, L, 0.5, value_group=vg), key_group=vg, value_group=vg, residual=vg)
    basis, backend = None, "auto"
    if preset == "lowrank":
        from tale_convert.options import Options
        from tale_runtime.key_basis import KeyBasis

        # the preset's latent groups (64) on the GPU; the quick model's tiny widths keep 8
        opts = Options(
            group=g,
            preset="lowrank",
            key_group=vg,
            value_group=vg if quick else None,
            key_basis_blocks=key_basis_blocks,
        )
        sched = opts.schedule(R, L, Kh, n)
        gen = torch.Generator().manual_seed(0)
        basis = []
        Kb = opts.blocks(Kh)
        nb = Kh * n // Kb
        for _ in range(L):  # per block an orthonormal basis (timing does not depend on which)
            enc = torch.linalg.qr(torch.randn(Kb, nb, nb, generator=gen))[0]
            dec = enc.transpose(1, 2).contiguous()
            basis.append(KeyBasis(enc.to(device), dec.to(device), torch.zeros(Kh * n, device=device), Kh, n))
        backend = "auto"  # cuda-lowrank where it reads the cache, else triton-lowrank (the users' choice)
    arch = Arch.from_config(config, g)
    model.tale_spec = TaleSpec(arch, sched, basis, {"architecture": arch.to_manifest()}, backend=backend)
    return model, orig, tale


def use(model, modules):
    for layer, m in zip(model.model.layers, modules):
        layer.self_attn = m


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_reset():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak() -> float:
    return torch.cuda.max_memory_allocated() / GiB if torch.cuda.is_available() else float("nan")


@torch.inference_mode()
def prefill(model, cache, ctx: int, B: int = 1):
    ids = torch.randint(
        1,
        model.config.vocab_size,
        (B, ctx),
        device=model.device,
        generator=torch.Generator(model.device).manual_seed(ctx),
    )
    sync()
    peak_reset()
    t = time.perf_counter()
    logits = model(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    sync()
    return logits.argmax(-1, keepdim=True), time.perf_counter() - t


@torch.inference_mode()
def decode(step, first: torch.Tensor, pos0: int, n: int) -> tuple[float, torch.Tensor]:
    """ms/token of n greedy steps through step(ids, position_ids) -> logits [B, V]; returns the tokens."""
    B = first.shape[0]
    ids = first.clone()
    pos = torch.full((B, 1), pos0, dtype=torch.long, device=first.device)
    toks = []
    for _ in range(2):  # warm-up (the graph decoder captures here)
        ids = step(ids, pos).argmax(-1, keepdim=True)
        pos += 1
        toks.append(ids)
    sync()
    t = time.perf_counter()
    for _ in range(n):
        ids = step(ids, pos).argmax(-1, keepdim=True)
        pos += 1
        toks.append(ids)
    sync()
    return (time.perf_counter() - t) * 1e3 / n, torch.cat(toks, 1)


def tale_step(model, cache, graphs: bool, compile: bool = True):
    """graphs: CudaGraphDecoder (compile: DecodeStep inside the graph, else the model's forward); else eager
    steps through the model's forward."""
    if graphs:
        return CudaGraphDecoder(model, cache, compile=compile)

    return hf_step(model, cache)


def launches(fn) -> tuple[int, float]:
    """GPU kernels (memcpy/memset included) that one call of fn() runs, and their summed time in ms (torch.profiler
    on an eager, uncaptured step: a CUDA graph of the step replays the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    log("kernels per step:", collections.Counter(e.name[:60] for e in evs).most_common(12))
    return len(evs), sum(e.time_range.elapsed_us() for e in evs) / 1e3


def hf_step(model, cache):
    def step(ids, pos):
        out = model(input_ids=ids, position_ids=pos, **cache_arg(cache), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    return step


# -- the rows --------------------------------------------------------------------------------

ROWS: list[dict] = []


def row(**kw):
    ROWS.append(kw)
    log(json.dumps(kw))


def check(model, tale, graphs: bool, n_steps: int, label: str, generate: bool):
    """Teacher-forced logits of the same decode steps (batch 2, left padding, through flushes and demotions)
    in five ways: dynamic and static cache eager with the torch reference, static eager with the kernel (the
    model's forward), static eager through DecodeStep (compiled pieces, no graph), static CUDA graph of
    DecodeStep. Graph vs DecodeStep isolates the graph machinery, DecodeStep vs the model's forward the fused
    kernels' rounding, static vs dynamic the storage, kernel vs reference the accepted noise of the dtype. Then
    greedy tokens of model.generate with a static cache, CUDA-graph steps against eager steps (disable_compile)."""
    use(model, tale)
    ctx, V, dev = 1000 if graphs else 200, model.config.vocab_size, model.device
    gen = torch.Generator(dev).manual_seed(1)
    ids = torch.randint(1, V, (2, ctx), device=dev, generator=gen)
    feed = torch.randint(1, V, (2, n_steps), device=dev, generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :37], mask[1, :37] = 0, 0
    kernel = model.tale_spec.backend != "torch"
    out = {}
    with torch.inference_mode():
        for name, static, graphed, kern in [  # (no kernel on the dynamic cache: its growing regions recompile it)
            ("dyn-ref", False, False, False),
            ("static-ref", True, False, False),
            ("static-eager", True, False, True),
            ("static-step", True, "step", True),
            ("static-graph", True, graphs, True),
        ]:
            set_backend(model, "auto" if kern and kernel else "torch")
            cache = new_cache(model, static=static, max_length=ctx + n_steps + 2)
            model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True, logits_to_keep=1)
            pos = mask.sum(-1, keepdim=True)  # positions of the next token, per row
            t0 = time.perf_counter()
            if graphed == "step":
                step = DecodeStep(model, cache, backend="inductor" if graphs else "eager")
            else:
                step = tale_step(model, cache, graphed)
            ls = []
            for t in range(n_steps):
                ls.append(step(feed[:, t : t + 1].contiguous(), pos).float().clone())
                pos += 1
            out[name] = torch.stack(ls, 1)
            if graphed == "step":
                row(kind="check-compile", label=label, first_steps_s=round(time.perf_counter() - t0, 1))
            if getattr(step, "error", None):
                row(kind="tale-graph-error", where="check", error=step.error[:300])
            del cache, step
            free()
        set_backend(model, "auto" if kernel else "torch")

        def rel(a, b):
            return float((out[a] - out[b]).norm() / out[b].norm())

        row(
            kind="check",
            label=label,
            prompt=ctx,
            steps=n_steps,
            graph_vs_step=rel("static-graph", "static-step"),
            step_vs_eager=rel("static-step", "static-eager"),
            static_vs_dynamic=rel("static-ref", "dyn-ref"),
            kernel_vs_reference=rel("static-eager", "static-ref"),
            argmax_agree=float((out["static-graph"].argmax(-1) == out["dyn-ref"].argmax(-1)).float().mean()),
            argmax_agree_step_eager=float(
                (out["static-step"].argmax(-1) == out["static-eager"].argmax(-1)).float().mean()
            ),
        )
        if generate:  # model.generate: the static cache's decode steps replay a CUDA graph (TaleGenerationMixin)
            kw = dict(attention_mask=mask, max_new_tokens=n_steps, do_sample=False)
            want = model.generate(ids, **cache_arg(new_cache(model, static=True)), disable_compile=True, **kw)
            got = model.generate(ids, **cache_arg(new_cache(model, static=True)), **kw)
            same = (got == want).all(0)[ctx:]
            row(
                kind="check-generate",
                label=label,
                tokens_equal=bool(same.all()),
                first_difference=None if same.all() else int((~same).nonzero()[0]),
            )
            free()


def _max_batch(per_row: float, fixed: float, frac: float) -> int:
    if not torch.cuda.is_available():
        return 4  # --quick
    total = torch.cuda.get_device_properties(0).total_memory
    return max(1, int((total * frac - fixed) // per_row))


def _ctx(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def _batches(model, base, first, ctx: int, batches: list, kind: str, deadline: float, largest, measure):
    """Batch 1 on `base` (prefilled with `ctx` tokens), then each larger batch on a copy of it with its rows
    repeated. `measure(cache, first, pos0)` -> dict or raises OOM; 'max' = `largest()`, the largest batch the memory
    model allows, lowered by a quarter after an out-of-memory error."""
    pos0 = ctx
    for target in batches:
        if time.perf_counter() - T0 > deadline:
            row(kind=kind, ctx=ctx, batch=target, skipped="time budget")
            continue
        tries = 3 if target == "max" else 1
        B = largest() if target == "max" else target
        while tries:
            tries -= 1
            cache = base
            try:
                if B != 1:
                    cache = copy.deepcopy(base)
                    cache.batch_repeat_interleave(B)
                measure(cache, first.repeat_interleave(B, 0), pos0, B)
                break
            except torch.cuda.OutOfMemoryError as e:
                row(kind=kind, ctx=ctx, batch=B, error=f"OOM: {str(e).splitlines()[0][:100]}")
                del e
                B = B * 3 // 4
            finally:
                if cache is not base:
                    del cache
                free()
        if B == 1:
            pos0 = base.get_seq_length()
            first = measure.last[:, -1:]


def tale_rows(model, tale, ctx: int, batches: list, n: int, graphs: bool, deadline: float, frac: float):
    use(model, tale)
    cache = new_cache(model, static=True, max_length=ctx + 8 * (n + 2) + 8, layout=LAYOUT)
    free()
    first, pre_s = prefill(model, cache, ctx)
    row_bytes = cache.capacity_nbytes()
    row(
        kind="tale-prefill",
        ctx=ctx,
        prefill_s=round(pre_s, 3),
        cache_alloc_gib=row_bytes / GiB,
        cache_used_gib=cache.nbytes() / GiB,
        prefill_peak_gib=peak(),
    )
    state = {"step_bytes": 4 * ctx * 1024}  # per row and step transients, measured below (a guess before)

    def measure(c, first, pos0, B):
        best = None
        for path in ("factored", "fused"):
            set_output_path(model, path)
            free()
            base_mem = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            peak_reset()
            step = tale_step(model, c, graphs)
            ms, toks = decode(step, first, pos0, n)
            if getattr(step, "error", None):
                row(kind="tale-graph-error", ctx=ctx, batch=B, error=step.error[:300])
            compiled = dict(compile_s=round(getattr(step, "compile_s", 0.0), 1))
            if getattr(step, "compile_error", None):
                compiled["compile_error"] = step.compile_error[:300]
            del step
            pk = peak()
            if torch.cuda.is_available():
                state["step_bytes"] = max(state["step_bytes"] if B > 1 else 0, (pk * GiB - base_mem) / B)
            measure.last = toks
            first, pos0 = toks[:, -1:], pos0 + n + 2
            r = dict(
                kind="tale",
                ctx=ctx,
                batch=B,
                path=path,
                ms_per_token=round(ms, 2),
                tokens_per_s=round(B * 1e3 / ms, 1),
                peak_gib=round(pk, 2),
                **compiled,
            )
            row(**r)
            if best is None or ms < best["ms_per_token"]:
                best = r
        row(**{**best, "kind": "tale-best"})
        if B == 1 and graphs:  # before/after: the model's own forward in the graph; kernels per step of both
            set_output_path(model, best["path"])
            ms, toks = decode(tale_step(model, c, graphs, compile=False), first, pos0, n)
            first, pos0 = toks[:, -1:], pos0 + n + 2
            measure.last = toks
            pos = torch.full((1, 1), pos0, dtype=torch.long, device=first.device)
            k_hf, t_hf = launches(lambda: hf_step(model, c)(first, pos))
            # a fresh [B, 1] tensor: the [:, -1:] slice of the tokens has another stride and storage offset, which
            # recompiles the embedding (the 32K count of the run in docs/performance.md includes that autotuning)
            ids1 = first.clone(memory_format=torch.contiguous_format)
            k_st, t_st = launches(lambda: DecodeStep(model, c)(ids1, pos + 1))
            pos0 += 2
            row(
                kind="tale-nocompile",
                ctx=ctx,
                batch=B,
                path=best["path"],
                ms_per_token=round(ms, 2),
                ms_compiled=best["ms_per_token"],
                launches_forward=k_hf,
                kernel_ms_forward=round(t_hf, 2),
                launches_compiled=k_st,
                kernel_ms_compiled=round(t_st, 2),
            )
        if B == 1 and kernel and ctx == 32768:  # what the kernel brings: the same step and cache, the torch reference
            c.backend, chosen = backends.TORCH, c.backend
            set_output_path(model, best["path"])
            ms, toks = decode(tale_step(model, c, graphs), first, pos0, n)
            measure.last = toks
            row(kind="tale-reference", ctx=ctx, batch=B, path=best["path"], ms_per_token=round(ms, 2))
            c.backend = chosen

    kernel = cache.backend.name != "torch"
    fixed = torch.cuda.memory_allocated() - row_bytes if torch.cuda.is_available() else 0

    def largest():
        return _max_batch(row_bytes + state["step_bytes"], fixed, frac)

    _batches(model, cache, first, ctx, batches, "tale", deadline, largest, measure)
    del cache
    free()


def hf_eager_rows(model, orig, ctx: int, batches: list, n: int, deadline: float, frac: float):
    use(model, orig)
    cache = DynamicCache(config=model.config)
    free()
    first, pre_s = prefill(model, cache, ctx)
    row(kind="hf-prefill", ctx=ctx, prefill_s=round(pre_s, 3), prefill_peak_gib=peak())
    c = model.config
    kv_row = 2 * (ctx + 4 * n) * c.num_key_value_heads * c.head_dim * 2 * c.num_hidden_layers

    def measure(cache, first, pos0, B):
        total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 1 << 60
        if B * kv_row > total:
            raise torch.cuda.OutOfMemoryError(f"16-bit KV alone is {B * kv_row / GiB:.0f} GiB")
        peak_reset()
        ms, toks = decode(hf_step(model, cache), first, pos0, n)
        measure.last = toks
        row(
            kind="hf-eager",
            ctx=ctx,
            batch=B,
            ms_per_token=round(ms, 2),
            tokens_per_s=round(B * 1e3 / ms, 1),
            peak_gib=round(peak(), 2),
        )

    fixed = torch.cuda.memory_allocated() - kv_row if torch.cuda.is_available() else 0

    def largest():
        # DynamicCache.update concatenates: one layer's K/V exists twice for a moment
        return _max_batch(kv_row * 1.05, fixed + 2 * GiB, frac)

    _batches(model, cache, first, ctx, batches, "hf-eager", deadline, largest, measure)
    del cache
    free()


def hf_static_rows(model, orig, ctx: int, batches: list, n: int, deadline: float, frac: float, short: int):
    """generate() with transformers' StaticCache (its automatic torch.compile of the decode step: CUDA graphs,
    one compile per batch size); ms/token from the difference of two calls (their prefills cancel), after a
    warm-up call that compiles. Its decode step reads the whole cache (max_cache_len, masked) however much of it
    is filled, so a `short`-token prompt in a cache of ctx + n + 16 tokens times the same step as a ctx-token
    prompt at a fraction of the prefill: batch 1 runs both ways to show it, larger batches with the short prompt.
    'max': the largest batch that fits by the per-row peak memory of the largest batch measured before it."""
    from transformers import StaticCache

    use(model, orig)
    c = model.config
    max_len = ctx + n + 16
    kv_row = 2 * max_len * c.num_key_value_heads * c.head_dim * 2 * c.num_hidden_layers
    plan = [(1, ctx), (1, short)] + [(b, short) for b in batches]
    base = torch.cuda.memory_allocated()
    per_row = 1.5 * kv_row  # replaced by the measured peak per row
    done, failed = 0, 1 << 30
    for B, T in plan:
        if B == "max":
            total = torch.cuda.get_device_properties(0).total_memory
            B = min(int((total * frac - base) // per_row), failed - 1)
            if B <= done:
                row(kind="hf-static-max", ctx=ctx, batch=B, per_row_gib=round(per_row / GiB, 2), largest_run=done)
                continue
        if time.perf_counter() - T0 > deadline:
            row(kind="hf-static-compile", ctx=ctx, batch=B, prompt=T, skipped="time budget")
            continue
        ids = torch.randint(1, c.vocab_size, (B, T), device=model.device)
        cache = StaticCache(config=c, max_cache_len=max_len)
        kw = dict(**cache_arg(cache), do_sample=False, attention_mask=torch.ones_like(ids))
        try:
            times = {}
            for m in (4, 4, n + 4):  # compile + capture, then two timed calls
                cache.reset()
                sync()
                t = time.perf_counter()
                peak_reset()
                model.generate(ids, max_new_tokens=m, min_new_tokens=m, **kw)
                sync()
                times.setdefault("first", time.perf_counter() - t)
                times[m] = time.perf_counter() - t
            ms = (times[n + 4] - times[4]) * 1e3 / n
            if B > done:
                done, per_row = B, max(kv_row, (peak() * GiB - base) / B)
            row(
                kind="hf-static-compile" if T == ctx or B != 1 else "hf-static-short",
                ctx=ctx,
                batch=B,
                prompt=T,
                cache_len=max_len,
                ms_per_token=round(ms, 2),
                tokens_per_s=round(B * 1e3 / ms, 1),
                peak_gib=round(peak(), 2),
                first_call_s=round(times["first"], 1),
                call_s=round(times[4], 2),
            )
        except Exception as e:  # noqa: BLE001  (OOM, compile failure: record and go on)
            failed = min(failed, B)
            row(
                kind="hf-static-compile",
                ctx=ctx,
                batch=B,
                prompt=T,
                error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
            )
            del e
        del cache, ids
        free()


def largest(weight_bytes: int) -> None:
    """Largest context at batch 1, estimated from the 128K (or longest) prefill: weights + per-token bytes
    (cache and prefill transients, from the measured peak) within the GPU's memory."""
    if not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    for kind in ("tale-prefill", "hf-prefill"):
        rs = [r for r in ROWS if r["kind"] == kind]
        if not rs:
            continue
        r = max(rs, key=lambda r: r["ctx"])
        per_tok = (r["prefill_peak_gib"] * GiB - weight_bytes) / r["ctx"]
        row(
            kind="largest-context",
            who=kind.split("-")[0],
            per_token_kib=round(per_tok / 1024, 1),
            est_tokens=int((total * 0.97 - weight_bytes) / per_tok),
            from_ctx=r["ctx"],
        )


# -- table -------------------------------------------------------------------------------------


def table(device: str, attention: str, floor_ms: dict) -> str:
    lines = [
        f"Measured on {device}, torch {torch.__version__}. TALE decode attention: {attention}.",
        "",
        "| context | batch | TALE static ms/tok | TALE path | TALE tok/s | TALE peak GiB | HF eager ms/tok "
        "| HF eager tok/s "
        "| HF eager peak GiB | HF static+compile ms/tok | HF static tok/s | byte floor ms/tok (B=1) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {
            (r["ctx"], r["batch"])
            for r in ROWS
            if r["kind"] in ("tale-best", "hf-eager", "hf-static-compile", "tale") and "batch" in r
        },
        key=lambda x: (x[0], x[1] if isinstance(x[1], int) else 1 << 30),
    )

    def get(kind, ctx, b):
        return next((r for r in ROWS if r["kind"] == kind and r.get("ctx") == ctx and r.get("batch") == b), None)

    def cell(r, k):
        if r is None:
            return "-"
        if k in r:
            return str(r[k])
        return r.get("error", r.get("skipped", "-"))[:40]

    for ctx, b in keys:
        t = get("tale-best", ctx, b) or get("tale", ctx, b)
        he, hs = get("hf-eager", ctx, b), get("hf-static-compile", ctx, b)
        fl = f"{floor_ms[ctx]:.1f}" if b == 1 and ctx in floor_ms else ""
        lines.append(
            f"| {_ctx(ctx)} | {b} | {cell(t, 'ms_per_token')} | {cell(t, 'path')} | {cell(t, 'tokens_per_s')} "
            f"| {cell(t, 'peak_gib')} | {cell(he, 'ms_per_token')} | {cell(he, 'tokens_per_s')} "
            f"| {cell(he, 'peak_gib')} | {cell(hs, 'ms_per_token')} | {cell(hs, 'tokens_per_s')} | {fl} |"
        )
    pre = [r for r in ROWS if r["kind"] in ("tale-prefill", "hf-prefill")]

    def prefill_cells(ctx):
        t = next((r for r in pre if r["kind"] == "tale-prefill" and r["ctx"] == ctx), {})
        h = next((r for r in pre if r["kind"] == "hf-prefill" and r["ctx"] == ctx), {})
        return (
            f"| {_ctx(ctx)} | {t.get('prefill_s', '-')} | {h.get('prefill_s', '-')} "
            f"| {t.get('cache_alloc_gib', float('nan')):.2f} |"
        )

    lines += subtable(
        "Prefill (batch 1, no mask, SDPA is_causal):",
        "| context | TALE s | HF s | TALE cache allocated GiB |",
        sorted({r["ctx"] for r in pre}),
        prefill_cells,
    )
    lines += notes(
        {
            "check-generate": lambda r: (
                f"model.generate ({r['label']}) with a StaticTaleCache, CUDA-graph steps of DecodeStep (through "
                f"TaleGenerationMixin) vs eager steps of the model's forward (disable_compile=True), greedy: "
                f"tokens equal: {r['tokens_equal']} (first "
                f"difference at step {r['first_difference']})."
            )
        }
    )
    lines += notes(
        {
            "largest-context": lambda r: (
                f"Largest context at batch 1 ({r['who']}): about {r['est_tokens'] // 1024}K tokens, from the "
                f"peak of the {_ctx(r['from_ctx'])} prefill ({r['per_token_kib']} KiB per token beyond the "
                "weights)."
            )
        }
    )
    lines += subtable(
        "TALE static at batch 1 with the model's own forward in the CUDA graph against DecodeStep (the code "
        "around attention compiled); kernels per step and their summed GPU time from torch.profiler on one "
        "uncaptured step:",
        "| context | path | forward ms/tok | compiled ms/tok | forward kernels/step | compiled kernels/step "
        "| forward kernel ms/step | compiled kernel ms/step |",
        [r for r in ROWS if r["kind"] == "tale-nocompile"],
        lambda r: (
            f"| {_ctx(r['ctx'])} | {r['path']} | {r['ms_per_token']} | {r['ms_compiled']} "
            f"| {r['launches_forward']} "
            f"| {r['launches_compiled']} | {r['kernel_ms_forward']} | {r['kernel_ms_compiled']} |"
        ),
    )

    def short_prompt(r):
        full = next((x for x in ROWS if x["kind"] == "hf-static-compile" and x.get("batch") == 1), {})
        return (
            f"HF static+compile rows at batch > 1 prefill {r['prompt']} tokens into a cache of "
            f"{r['cache_len']} tokens: its decode step reads the whole cache whatever its fill. Batch 1 both "
            f"ways: {full.get('ms_per_token', '-')} ms/token after a {_ctx(r['ctx'])} "
            f"prompt, {r['ms_per_token']} after {r['prompt']} tokens."
        )

    lines += notes(
        {
            "warmup": lambda r: (
                f"Warm-up ({r['prompt']}-token prefill and 72 decode steps before the timed rows): "
                f"DecodeStep compiled in "
                f"{r['compile_s']} s{' (failed: ' + r['compile_error'] + ')' if r.get('compile_error') else ''}."
            ),
            "hf-static-short": short_prompt,
        }
    )
    lines += notes(
        {
            "tale-reference": lambda r: (
                f"The same TALE step at {_ctx(r['ctx'])} batch {r['batch']} with the torch reference "
                "attention (runtime/attention.py, the whole capacity dequantized per layer) instead of the "
                f"kernel: "
                f"{r['ms_per_token']} ms/token."
            )
        }
    )
    lines += subtable(
        "Checks (batch 2, left padding, teacher-forced decode steps through flushes and demotions; "
        "relative L2 difference of the logits):",
        "| model | prompt | steps | graph vs DecodeStep eager | DecodeStep (compiled) vs model forward "
        "| argmax agreement DecodeStep / forward | static vs dynamic cache (reference) | kernel vs torch reference "
        "(static) | argmax agreement static graph / dynamic reference |",
        [r for r in ROWS if r["kind"] == "check" and "label" in r],
        lambda r: (
            f"| {r['label']} | {r['prompt']} | {r['steps']} | {r['graph_vs_step']:.2e} | {r['step_vs_eager']:.2e} "
            f"| {r['argmax_agree_step_eager']:.3f} | {r['static_vs_dynamic']:.2e} | {r['kernel_vs_reference']:.2e} "
            f"| {r['argmax_agree']:.3f} |"
        ),
    )
    lines += notes(
        {"tale-graph-error": lambda r: f"CUDA graph capture failed ({r.get('where', r.get('ctx'))}): {r['error']}"}
    )
    return "\n".join(lines)


def notes(texts: dict) -> list[str]:
    """A paragraph per row whose kind `texts` names (kind -> its text), in the order the rows were measured."""
    return [line for r in ROWS if r["kind"] in texts for line in ("", texts[r["kind"]](r))]


def subtable(caption: str, header: str, items: list, cells) -> list[str]:
    """A captioned markdown table, a line `cells(item)` per item; nothing without items."""
    if not items:
        return []
    return ["", caption, "", header, "|---" * (header.count("|") - 1) + "|", *map(cells, items)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU: the script's logic only")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds; later rows are skipped")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--mem-frac", type=float, default=0.92)
    ap.add_argument("--no-hf-static", action="store_true")
    ap.add_argument(
        "--hf-static-batches", default="8,12,max", help="HF static+compile batches at the smallest context (and 1)"
    )
    ap.add_argument("--hf-static-prompt", type=int, default=512, help="prompt tokens of the HF static rows at B > 1")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--batches", default=None, help="batches of every context (default: 1,8,max at 32K, else 1,8)")
    ap.add_argument("--no-hf", action="store_true", help="TALE rows only (no HF eager or static rows)")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--json", default=None)
    ap.add_argument("--layout", default="auto", help="static cache layout: auto (the backend's), row or frag")
    args = ap.parse_args()
    global LAYOUT
    LAYOUT = None if args.layout == "auto" else args.layout

    device = "cpu" if args.quick else "cuda"
    graphs = device == "cuda"
    # DecodeStep's graphs are compiled per dtype (float32 check, bf16 run), batch (static, then dynamic) and output
    # path: more than dynamo's default of 8 entries per function
    torch._dynamo.config.cache_size_limit = 64
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 check must be float32 (the run below is bf16)
    if not args.no_check:  # float32, 4 layers of the same shapes: the static path must agree to rounding
        small, _, st = build(args.quick, device, layers=4 if not args.quick else None, dtype=torch.float32)
        use(small, st)
        set_backend(small, "auto" if graphs else "torch")
        try:
            check(small, st, graphs, n_steps=40, label=f"float32, {len(st)} layers", generate=False)
        except Exception as e:  # noqa: BLE001
            row(kind="check-error", error=f"{type(e).__name__}: {e}")
            traceback.print_exc()
        del small, st
        free()
    model, orig, tale = build(args.quick, device)
    use(model, tale)
    set_backend(model, "auto" if graphs else "torch")
    log("model built")
    ctxs = [int(c) for c in args.contexts.split(",")]
    if args.quick:
        ctxs = [128, 512]
    n = 4 if args.quick else args.steps
    dl = args.deadline

    emb = model.model.embed_tokens.weight
    weight_bytes = (
        sum(p.numel() * p.element_size() for p in model.parameters())
        - sum(t.tale.o_fused.numel() * t.tale.o_fused.element_size() for t in tale)
        - emb.numel() * emb.element_size()
    )
    # (the factored path reads W_O, not O^r; decode reads one embedding row)
    bw = 3.35e12  # H100 SXM HBM3 datasheet; replaced by a measured copy below on CUDA
    if graphs:
        bw = harness.copy_bandwidth() * 1e9
        free()
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s; weights read per token {weight_bytes / GiB:.2f} GiB")

    if not args.no_check:
        try:
            check(model, tale, graphs, n_steps=40, label=f"{str(model.dtype)[6:]}, {len(tale)} layers", generate=True)
        except Exception as e:  # noqa: BLE001
            row(kind="check-error", error=f"{type(e).__name__}: {e}")
            traceback.print_exc()

    # warm-up: a short prefill each way, then decode steps through flushes (the compiled TALE step is compiled here),
    # so that Triton's compilation of the quantization kernels and cuBLAS/SDPA set-up are not in the timed rows
    warm = 4096 if graphs else 64
    use(model, tale)
    cache = new_cache(model, static=True, max_length=warm + 80, layout=LAYOUT)
    first, pre_s = prefill(model, cache, warm)
    attention = cache.backend_name  # tale_runtime.backends chose it for this cache
    log("static cache layout:", cache.layout, "; attention:", attention)
    step = tale_step(model, cache, graphs)
    ms, _ = decode(step, first, warm, 70)
    if note := cache.reference_calls.note():  # decode calls the backend handed to the torch reference
        attention += f" ({note})"
    row(
        kind="warmup",
        prompt=warm,
        prefill_s=round(pre_s, 2),
        ms_per_token=round(ms, 2),
        compile_s=round(getattr(step, "compile_s", 0.0), 1),
        compile_error=getattr(step, "compile_error", None),
    )
    del cache, step
    use(model, orig)
    prefill(model, DynamicCache(config=model.config), warm)
    free()

    floor_ms = {}
    for ctx in ctxs:
        batches = [1, 8, "max"] if ctx <= 32768 else [1, 8]
        if args.batches:
            batches = [b if b == "max" else int(b) for b in args.batches.split(",")]
        if args.quick:
            batches = [1, 2, "max"]
        try:
            tale_rows(model, tale, ctx, batches, n, graphs, dl, args.mem_frac)
        except Exception as e:  # noqa: BLE001
            row(kind="tale", ctx=ctx, batch=0, error=f"{type(e).__name__}: {e}")
            traceback.print_exc()
        pf = next((r for r in ROWS if r["kind"] == "tale-prefill" and r["ctx"] == ctx), None)
        if pf:
            floor_ms[ctx] = (weight_bytes + pf["cache_used_gib"] * GiB) / bw * 1e3
        if args.no_hf:
            continue
        try:
            hf_eager_rows(model, orig, ctx, batches if not args.quick else [1, 8, "max"], n, dl, args.mem_frac)
        except Exception as e:  # noqa: BLE001
            row(kind="hf-eager", ctx=ctx, batch=0, error=f"{type(e).__name__}: {e}")
            traceback.print_exc()
    if not (args.no_hf_static or args.no_hf or args.quick):
        for t in tale:  # HF's largest batch without TALE's extra weights (O^r, A, B) on the GPU
            t.tale.to("cpu")
        free()
        hb = [b if b == "max" else int(b) for b in args.hf_static_batches.split(",") if b]
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` ends the last rows, not the table
        try:
            hf_static_rows(model, orig, min(ctxs), hb, n, dl, args.mem_frac, args.hf_static_prompt)
        except KeyboardInterrupt:
            row(kind="hf-static-compile", ctx=min(ctxs), batch="?", skipped="stopped at the time limit")
    largest(weight_bytes)
    use(model, tale)

    dev_name = torch.cuda.get_device_name(0) if graphs else "CPU"
    md = table(dev_name, attention, floor_ms)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + md + "\n")


if __name__ == "__main__":
    sys.exit(main())
