"""Tensor-parallel decode over N GPUs: TALE against transformers' own tensor parallelism, Llama-3.1-70B and 8B shapes.

Run one process per GPU under torchrun (a plain `python` run is one process: the N=1 rows):

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --model 8b --out tp2-8b.md        # the check, then 8B
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --model 70b --no-check --out tp2-70b.md
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --model 70b --no-check --output-path factored --out tp4-70b.md
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --model 70b --no-check --output-path factored --ctx 32768 \
        --no-hf --throughput 32768                                  # TALE: batch 1 and the largest batch at 32K
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py --model 70b --no-check --output-path factored --ctx 131072 \
        --no-tale --throughput 32768                                # transformers: 128K, and its largest batch at 32K
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --device cpu --tiny      # CPU, gloo: checks the script
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --device cpu --tiny --throughput 96   # ... with --throughput
    bash benchmarks/run_tp.sh OUT 540         # the 70B rows over 4 GPUs in 9 minutes, a timeout per step

Models: random Llama weights (N(0, 0.02), norms 1) with Llama-3.1 shapes (70B: 80 layers, hidden 8192, 64 query /
8 KV heads of 128, MLP 28672; 8B: 32 layers, hidden 4096, 32 / 8 heads, MLP 14336; vocab 128256), bf16, drawn on the
GPUs: each tensor is drawn whole on the rank's GPU from a seed of its name and cut to the rank's slice (transformers'
DtensorShardOperation), so every rank and a one-process model hold the same model, and nothing is read from disk.
TALE's factors are random too (their values do not change the timing), in groups of g KV heads (`--group`; by default
the largest of 4, 2, 1 that N splits, each rank holding whole groups: 2 groups of 4 over up to 2 GPUs, 4 groups of 2
over 4, groups of 1 over 8), the paper's schedule (4 sinks, p = 0.1 at 4 bits full rank, middle at 2 bits and half
rank, key/value groups and residual 32). The TALE model is built as runtime/load.py's meta_model builds it (TALE
attention, then transformers' TP plan with TALE's entries, runtime/tp.py) and made ready by its finish(). The baseline
is the same base weights with the model's own attention, after TALE's factors are dropped.

1. Correctness first (8B shapes, or the tiny model): the same prompt through the TP model and through a one-process
   model of the same weights on rank 0, greedy, TALE with the dynamic and the static cache, transformers with its
   static cache: the relative error of the prefill logits, the largest over the decode steps fed the same tokens, and
   how many greedy tokens agree. transformers' TP against its own one-process model is the yardstick of what N-way
   reductions change in bf16; the run stops (every rank, exit code 1) if TALE's error exceeds 4 times it and 5%.
2. Timing, per model and context, batch 1, through model.generate: TALE's static cache (decode steps replayed as CUDA
   graphs of the compiled step, runtime/decode.py); transformers' static cache with its automatic torch.compile.
   ms/token = median of the decode steps' intervals after `--warm` steps (a logits processor takes the time after a
   device sync at every step; generate syncs at every step anyway). Peak = torch.cuda.max_memory_allocated during the
   call, the largest over the ranks. An out-of-memory is a row of its own; transformers is not run where its weights
   and 16-bit KV cache alone pass the GPU's memory.

3. `--throughput CTX`: tokens/s (batch x 1000 / ms per token) at the largest batch that fits at CTX tokens, found
   from bytes rather than by running out of memory: the batch-1 run gives what the process holds before it (`base`),
   the prefill's peak and the decode steps' workspace (their peak over what they start with), and a batch of B holds
   held + workspace + B x (one row's cache + its logits), which must stay under the ceiling (the driver's free memory
   plus what torch holds, less `--headroom` GiB). That batch runs once; after an out-of-memory, once more at 85%.
   TALE: one row prefilled, repeated to B rows (the cache's values do not change the timing), its static cache and
   CUDA graphs; transformers' static cache (torch.compile): B rows of a `--short`-token prompt in a cache of CTX +
   steps tokens, since its decode step attends over the whole cache, filled or not; its DynamicCache (eager): one
   row prefilled, repeated. The largest context at batch 1 comes from the same numbers: (ceiling - base) over the
   bytes per prompt token of the batch-1 prefill's peak (its activations and the cache). TALE prefills a prompt of
   more than 4096 tokens in pieces (`--prefill-chunk`, docs/runtime.md "Long prompts"): one piece's temporaries are
   then a constant part, which counted per token only makes the estimate smaller (by ~0.3 GiB over the context).

O^r is g times the size of W_O (40 GiB at 70B with g = 4): `--output-path auto` (the default) takes the factored
output (B then W_O, the same result, O^r not built) when the weights with O^r would pass 80% of the GPU's memory
(70B on 2 GPUs). NCCL's NVLink multicast (NVLS) stays as the environment sets it (NCCL_NVLS_ENABLE): this script sets
no NCCL variable. Each model with the check and two contexts is several minutes of compiles and prefills: one model per
call keeps a call short (`--ctx 32768` shorter still).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib

import harness
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from tale_runtime import new_cache, set_output_path, set_prefill_chunk, tp
from tale_runtime.artifact import Schedule, uniform_ranks
from tale_runtime.load import finish
from tale_runtime.model import PREFILL_CHUNK, TaleAttention, cache_arg
from tale_runtime.spec import Arch, TaleSpec

GiB = harness.GIB
SHAPES = {
    "8b": dict(harness.LLAMA_8B, head_dim=128),
    "70b": dict(harness.LLAMA_70B, head_dim=128, num_hidden_layers=80),
    "tiny": dict(harness.SMOKE, num_hidden_layers=2, head_dim=32),
}
T0 = time.perf_counter()


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def log(*a) -> None:
    if rank() == 0:
        print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(tp_size: int) -> None:
    if tp_size > 1:
        torch.distributed.barrier()


def gather(tp_size: int, x):
    """x of every rank (a list), [x] in one process."""
    if tp_size == 1:
        return [x]
    out = [None] * tp_size
    torch.distributed.all_gather_object(out, x)
    return out


# -- the models ---------------------------------------------------------------------------------------------------


def draw(model, device: torch.device, dtype: torch.dtype, skip: tuple[str, ...] = ()) -> None:
    """Random weights: each tensor drawn whole on `device` from a seed of its name, then cut to this rank's slice for a
    parameter the TP plan sharded. Names ending in one of `skip` get an empty tensor (not used by the run)."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.sharding_utils import DtensorShardOperation, _dtensor_from_local_like

    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if name.endswith(skip):
            module._parameters[leaf] = nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)
            continue
        if name.endswith("norm.weight"):
            full = torch.ones(p.shape, device=device, dtype=dtype)
        else:
            gen = torch.Generator(device).manual_seed(zlib.crc32(name.encode()))
            full = torch.randn(p.shape, generator=gen, device=device, dtype=dtype).mul_(0.02)
        if isinstance(p, DTensor):
            # the shard is a view of the whole tensor: a copy of its own, or every rank keeps the whole model
            local = DtensorShardOperation(p).shard_tensor(full, device=device, dtype=dtype).clone()
            del full
            full = _dtensor_from_local_like(local, p)
        module._parameters[leaf] = nn.Parameter(full, requires_grad=False)


class Pair:
    """One set of random weights as a TALE model and as the base model: the decoder layers' attention is swapped
    between TaleAttention and the model's own (they share q/k/v/o_proj)."""

    def __init__(self, shape: str, layers: int | None, group, device, dtype, tp_size: int, start, output: str):
        cfg = dict(SHAPES[shape], max_position_embeddings=1 << 18)
        K = cfg["num_key_value_heads"]
        if group is None:  # each rank holds whole groups: 8 KV heads in 2 groups of 4 split over 2 GPUs at most
            group = next(g for g in (4, 2, 1) if (K // g) % tp_size == 0)
        tp.check_size(tp_size, K // group, group)
        self.group, self.shape = group, shape
        if layers:
            cfg["num_hidden_layers"] = layers
        config = AutoConfig.for_model("llama", **cfg)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        self.orig = [layer.self_attn for layer in model.model.layers]
        for i, layer in enumerate(model.model.layers):
            layer.self_attn = TaleAttention(layer.self_attn, config, i, group)
        rank_tp = None
        if tp_size > 1:
            cfg_tp, _, mesh = start
            rank_tp = tp.distribute(model, cfg_tp, mesh)
        n, K, H, L = config.head_dim, config.num_key_value_heads, config.num_attention_heads, config.num_hidden_layers
        G, R = K // group, group * n
        self.output = output
        if output == "auto":
            self.output = "fused" if fits_fused(config, group, tp_size, dtype, device) else "factored"
        draw(model, device, dtype, skip=("tale.o_fused",) if self.output == "factored" else ())
        vg = 8 if shape == "tiny" else 32
        sched = Schedule(ranks=uniform_ranks(R, L, 0.5, value_group=vg), key_group=vg, value_group=vg, residual=vg)
        arch = Arch("llama", L, config.hidden_size, H, K, n, group, G, R)
        finish(model, device, TaleSpec(arch, sched, None, {}, tp=rank_tp))
        set_output_path(model, self.output)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        self.model, self.tale = model, [layer.self_attn for layer in model.model.layers]

    def use(self, which: str):
        for layer, a in zip(self.model.model.layers, self.tale if which == "tale" else self.orig):
            layer.self_attn = a
        return self.model


def weight_bytes(config, group: int, dtype: torch.dtype, fused: bool) -> int:
    """Bytes of the TALE model's weights: the base model, A and B per group, O^r when fused."""
    c = config
    d, n, H, K, L = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers
    R, G = group * n, K // group
    return base_bytes(c, dtype) + L * (G * d * R + G * R * R + (d * H * R if fused else 0)) * dtype.itemsize


def fits_fused(config, group: int, tp_size: int, dtype, device) -> bool:
    if device.type != "cuda":
        return True
    total = torch.cuda.get_device_properties(device).total_memory
    return weight_bytes(config, group, dtype, True) / tp_size < 0.8 * total


# -- generate, timed ----------------------------------------------------------------------------------------------


class Clock(LogitsProcessor):
    """The time of every generate step, after a device sync. On CUDA also, at the first step (the prefill's end): the
    peak so far and what is held then; the peak is reset there, so the call's later peak is the decode steps'."""

    def __init__(self, device):
        self.device, self.t = device, []
        self.prefill_peak = self.held = float("nan")

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.t.append(time.perf_counter())
        if len(self.t) == 1 and self.device.type == "cuda":
            self.prefill_peak = torch.cuda.max_memory_allocated(self.device)
            self.held = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return scores


def prompt(vocab: int, T: int, device, rows: int = 1) -> torch.Tensor:
    gen = torch.Generator("cpu").manual_seed(T)
    return torch.randint(1, vocab, (rows, T), generator=gen).to(device)


def peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device) -> float:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else float("nan")


@torch.inference_mode()
def run(model, ids: torch.Tensor, new: int, cache=None, clock: Clock | None = None, logits: bool = True, **kw):
    """Greedy generate of `new` tokens: (tokens [new] of row 0, its logits [new, V] float32 or None, step times)."""
    clock = clock or Clock(ids.device)
    out = model.generate(
        ids,
        **({} if cache is None else cache_arg(cache)),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        output_logits=logits,
        return_dict_in_generate=True,
        logits_processor=LogitsProcessorList([clock]),
        **kw,
    )
    lg = torch.stack(out.logits)[:, 0].float() if logits else None
    return out.sequences[0, ids.shape[1] :].tolist(), lg, clock.t


def hf_static_kw(device) -> dict:
    """transformers' static cache; on CUDA with its automatic torch.compile of the decode step (off on the CPU)."""
    return dict(cache_implementation="static", disable_compile=device.type != "cuda")


# -- 1. correctness ---------------------------------------------------------------------------------------------------


def check(args, device, dtype, tp_size: int, start) -> str:
    """TP against one process on rank 0 (same weights), TALE (dynamic and static cache) and transformers (static): a
    markdown table; SystemExit on every rank if TALE's logits are out of line (more than 4 times transformers' own
    TP error and 5%)."""
    shape = "tiny" if args.tiny else "8b"
    T, new = (64, 8) if args.tiny else (1024, 16)
    cases = {
        "TALE, dynamic cache": lambda m: run(m, ids, new, cache=new_cache(m)),
        "TALE, static cache": lambda m: run(m, ids, new, cache=new_cache(m, static=True)),
        "transformers, static cache": lambda m: run(m, ids, new, **hf_static_kw(device)),
    }

    def results(pair) -> dict:
        out = {}
        for name, fn in cases.items():
            out[name] = fn(pair.use("transformers" if name.startswith("transformers") else "tale"))[:2]
        return out

    pair = Pair(shape, args.check_layers, args.group, device, dtype, tp_size, start, "fused")
    ids = prompt(pair.model.config.vocab_size, T, device)
    par, group = results(pair), pair.group
    del pair
    free(device)
    rows, bad = [], []
    barrier(tp_size)
    if rank() == 0:
        one = Pair(shape, args.check_layers, group, device, dtype, 1, None, "fused")
        ref = results(one)
        del one
        free(device)
        errs = {}
        for name in cases:
            (tok, lg), (rtok, rlg) = par[name], ref[name]
            rel = ((lg - rlg).norm(dim=-1) / rlg.norm(dim=-1)).tolist()  # per step
            same = next((i for i, (a, b) in enumerate(zip(tok, rtok)) if a != b), len(tok))
            errs[name] = max(rel[: same + 1])  # the steps fed the same tokens: up to the first that differs
            rows.append([name, f"{rel[0]:.2e}", f"{errs[name]:.2e}", f"{same}/{len(tok)}"])
        # a wrong split gives errors of order 1 (a group's heads against another's factors: 1.4 on the tiny model);
        # bf16 rounding differs in the reductions, and a quantization code may flip with it
        yard = errs["transformers, static cache"]
        bad = [n for n, e in errs.items() if n.startswith("TALE") and e > max(4 * yard, 0.05)]
    barrier(tp_size)
    bad = gather(tp_size, bad)[0]
    table = harness.table(
        [
            f"{shape}, {T}-token prompt, {new} greedy tokens",
            "prefill logits rel. error",
            "largest over the steps with the same input",
            "same tokens",
        ],
        rows,
    )
    if bad:
        log(f"correctness check FAILED for {', '.join(bad)}:\n{table}")
        raise SystemExit(1)
    return table


# -- 2. timing --------------------------------------------------------------------------------------------------------


def free(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated(device) -> float:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else float("nan")


def ceiling(device, headroom_gib: float) -> float:
    """The most bytes torch may hold on this GPU: what the driver has free plus what torch holds allocated, after
    empty_cache (what torch keeps reserved past that, such as a compiled step's CUDA graph pool, is not free for a
    cache), less a headroom (NCCL and cuBLAS take memory outside the measured peaks). NaN on the CPU."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device) - headroom_gib * GiB


def timed(model, ids, new: int, warm: int, device, tp_size: int, cache=None, headroom: float = 3.0, **kw) -> dict:
    """One generate call of `warm + new` steps: ms/token (median of the timed steps), peak GiB per GPU (the largest of
    the ranks), and what the memory model reads (GiB, the largest of the ranks): `base` held before the call,
    `prefill_peak`, `ws` the decode steps' peak over what they start with, `ceiling` (see ceiling())."""
    peak_reset(device)
    base, clock = allocated(device), Clock(device)
    t0 = time.perf_counter()
    try:
        _, _, t = run(model, ids, warm + new, cache=cache, clock=clock, logits=False, **kw)
        steps = [b - a for a, b in zip(t, t[1:])][warm - 1 :]  # t[0] ends the prefill
        res = dict(ms=statistics.median(steps) * 1e3, peak=max(clock.prefill_peak / GiB, peak(device)))
        res.update(
            prefill_s=t[0] - t0,
            base=base / GiB,
            prefill_peak=clock.prefill_peak / GiB,
            ws=peak(device) - clock.held / GiB,
        )
    except torch.OutOfMemoryError:
        res = dict(error="out of memory")
    except RuntimeError as e:
        res = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
    if hasattr(cache, "backend_name") and "error" not in res:  # a TALE cache
        res["cache"] = cache.nbytes() / GiB
        note = cache.reference_calls.note()  # decode calls the backend handed to the torch reference
        res["attention"] = cache.backend_name + (f" ({note})" if note else "")
    del cache
    free(device)
    if "error" not in res:
        res["ceiling"] = ceiling(device, headroom) / GiB
    every = gather(tp_size, res)
    if any("error" in r for r in every):
        return next(r for r in every if "error" in r)
    most = {k: max(r[k] for r in every) for k in ("peak", "base", "prefill_peak", "ws")}
    return dict(every[0], **most, ceiling=min(r["ceiling"] for r in every), cache=res.get("cache", float("nan")))


def attention(r: dict) -> str:
    return r.get("attention", "")


def timings(args, device, dtype, tp_size: int, start, notes: list, batch_rows: list) -> list[list]:
    """Per model: TALE at every context (and, with --throughput, at the largest batch), then TALE's factors are dropped
    and transformers runs on the base weights alone (its peak memory holds nothing of TALE's). `notes` gets the
    largest-context estimates, `batch_rows` the largest-batch rows."""
    rows = []
    for shape in ["tiny"] if args.tiny else args.model.split(","):
        pair = Pair(shape, args.layers, args.group, device, dtype, tp_size, start, args.output_path)
        c = pair.model.config
        if args.prefill_chunk is not None:
            set_prefill_chunk(pair.model, args.prefill_chunk)
        chunk = getattr(pair.model, "tale_prefill_chunk", PREFILL_CHUNK)
        pieces = f"prompts over {chunk} tokens in pieces of {chunk}" if chunk else "in one piece"
        log(
            f"{shape}: {c.num_hidden_layers} layers on {tp_size} rank(s), group {pair.group}, output {pair.output}, "
            f"TALE prefills {pieces}"
        )
        tale, m = {}, None
        for ctx in args.ctx:
            if args.no_tale:
                tale[ctx] = {"error": "not run (--no-tale)"}
                continue
            m = pair.use("tale")
            ids = prompt(c.vocab_size, ctx, device)
            cache = new_cache(m, static=True)
            tale[ctx] = timed(m, ids, args.new, args.warm, device, tp_size, cache=cache, headroom=args.headroom)
            del cache
            free(device)
            log(shape, ctx, "TALE", tale[ctx])
        context_notes(shape, "TALE", tale, args, device, notes)  # before the batch runs: a hang there keeps the line
        if args.throughput and not args.no_tale:
            batch_rows.append(tale_batch(pair, args, device, tp_size, measured(tale, args.throughput)))
        for a in pair.tale:
            for name in list(a.tale._parameters):
                a.tale._parameters[name] = None
        free(device)
        hfs = {}
        for ctx in args.ctx:
            hf = {"error": "not run (--no-hf)"}
            need = (base_bytes(c, dtype) + kv_bytes(c, ctx + args.warm + args.new, dtype)) / tp_size
            if (
                not args.no_hf
                and device.type == "cuda"
                and need > torch.cuda.get_device_properties(device).total_memory
            ):
                hf = {"error": f"does not fit: weights + 16-bit KV cache {need / GiB:.0f} GiB per GPU"}
            elif not args.no_hf:
                ids = prompt(c.vocab_size, ctx, device)
                hf = timed(
                    pair.use("transformers"),
                    ids,
                    args.new,
                    args.warm,
                    device,
                    tp_size,
                    headroom=args.headroom,
                    **hf_static_kw(device),
                )
                log(shape, ctx, "transformers", hf)
            hfs[ctx] = hf
            t = tale[ctx]
            speedup = hf["ms"] / t["ms"] if "ms" in hf and "ms" in t else float("nan")
            floor = float("nan")
            if args.bandwidth and "cache" in t:
                floor = (
                    (read_bytes(c, pair.group, dtype, pair.output) / tp_size + t["cache"] * GiB) / args.bandwidth / 1e6
                )
            over = t["ms"] / floor if "ms" in t and floor == floor else float("nan")
            rows.append(
                [
                    f"{shape} ({c.num_hidden_layers} layers, g={pair.group}, {pair.output})",
                    tp_size,
                    f"{ctx // 1024}K" if ctx >= 1024 else ctx,
                    *cells(t, cache=True),
                    attention(t),
                    *cells(hf),
                    harness.fmt(speedup, 2) + "x" if speedup == speedup else "n/a",
                    f"{harness.fmt(floor, 2)} ({harness.fmt(over, 2)}x)" if over == over else "n/a",
                ]
            )
        context_notes(shape, "transformers", hfs, args, device, notes)
        if args.throughput and not args.no_hf:
            ref = measured(hfs, args.throughput)
            if not args.no_hf_dynamic:
                batch_rows.append(hf_batch(pair, args, device, dtype, tp_size, ref, dynamic=True))
            batch_rows.append(hf_batch(pair, args, device, dtype, tp_size, ref, dynamic=False))
        del pair, m
        free(device)
    return rows


def context_notes(shape: str, name: str, res: dict, args, device, notes: list) -> None:
    """The largest context at batch 1 from the runs `res` (per context): from the peaks of the two longest contexts,
    and from the byte model (also logged, for a run that goes on to verify it)."""
    if (est := largest(res, args.ctx, device)) is not None:
        notes.append(f"{shape}, {name}: largest context at batch 1 about {est // 1024}K tokens (estimated)")
    if (one := largest_context(measured(res, max(args.ctx)))) is not None:
        T, text = one
        log(f"largest context at batch 1, {name}: {T} tokens (byte model)")
        notes.append(f"{shape}, {name}: {text}")


def measured(res: dict, ctx: int) -> dict | None:
    """The batch-1 run at `ctx` if it ran, else the one at the longest context that ran (what the memory model reads)."""
    ok = {c: r for c, r in res.items() if "ms" in r}
    if not ok:
        return None
    return dict(ok.get(ctx) or ok[max(ok)], ctx=ctx if ctx in ok else max(ok))


# -- the largest batch, the largest context: from bytes ---------------------------------------------------------------
#
# Every number is bytes per GPU (this rank). A batch-1 generate call gives `base` (held before the call: weights and
# what else the process keeps), the prefill's peak and the decode steps' workspace `ws` (their peak over what they
# start with: the CUDA graph's pool, the attention kernel's partial sums, logits). A larger batch holds
#     base + ws + B * (cache bytes of one row + its share of the step's transients)
# and must stay under the ceiling (what the driver has free plus what torch reserved, less --headroom GiB). The
# batch is run once at that B and stepped down once (by 15%) if it runs out of memory anyway.

ROW_LOGITS = 4  # float32 copies of one row's logits a step makes (the gathered logits, generate's, argmax input)


def fit_batch(ceiling: float, held: float, workspace: float, per_row: float) -> int:
    """The largest B with held + workspace + B * per_row <= ceiling (0: not even one row)."""
    return max(0, int((ceiling - held - workspace) // per_row))


def context_fits(ceiling: float, base: float, prefill_peak: float, ctx: int) -> int:
    """The largest prompt at batch 1 whose prefill fits, from one prefill's peak at `ctx` tokens: its bytes over
    `base` (the cache and the prefill's activations) grow linearly in the prompt (no full-size mask; a constant part
    counted per token only makes the estimate smaller)."""
    return int((ceiling - base) // max((prefill_peak - base) / ctx, 1e-30))


def largest_context(r: dict | None) -> tuple[int, str] | None:
    """(tokens, a line) from a batch-1 run's memory on CUDA (None without one)."""
    if r is None or r.get("ceiling", float("nan")) != r.get("ceiling", float("nan")):
        return None
    ceil, base, pk, ctx = r["ceiling"], r["base"], r["prefill_peak"], r["ctx"]
    T = context_fits(ceil, base, pk, ctx)
    per = (pk - base) * GiB / ctx / 1024
    return T, (
        f"largest context at batch 1 about {T // 1024}K tokens (byte model: {base:.1f} GiB held, "
        f"{per:.1f} KiB per prompt token from the {ctx // 1024}K prefill's peak, ceiling {ceil:.1f} GiB per GPU)"
    )


def plan_batch(args, device, tp_size: int, held: float, workspace: float, per_row: float) -> tuple[int, str]:
    """The batch to run and how it was found, the same on every rank (the smallest of the ranks'). `--batch` forces
    it; on the CPU (no device memory to fill) it is 3 rows, enough to run the code."""
    if args.batch:
        B, how = args.batch, "--batch"
    elif device.type != "cuda":
        B, how = 3, "3 (CPU)"
    else:
        ceil = ceiling(device, args.headroom)
        B = fit_batch(ceil, held, workspace, per_row)
        how = (
            f"bytes: {held / GiB:.1f} held + {workspace / GiB:.2f} workspace + B x {per_row / GiB:.3f} "
            f"<= {ceil / GiB:.1f} GiB"
        )
    return min(gather(tp_size, (B, how)))


def at_batch(B: int, how: str, attempt) -> dict:
    """attempt(B) -> timed()'s dict; once more at 85% of B after running out of memory."""
    if B < 1:
        return dict(error=f"not even one row fits ({how})", batch=0, how=how)
    res = attempt(B)
    if "out of memory" in res.get("error", ""):  # torch's OutOfMemoryError, or a CUDA error while capturing a graph
        log(f"batch {B} ran out of memory: {int(B * 0.85)}")
        B, how = max(1, int(B * 0.85)), f"{how}; out of memory at {B}, 85% of it"
        res = attempt(B)
    return dict(res, batch=B, how=how)


def workspace(ref: dict | None, device) -> tuple[float, str]:
    """The decode steps' workspace (bytes) from the batch-1 run `ref`; 5% of the GPU when there is none (CUDA)."""
    if ref is not None and ref.get("ws", float("nan")) == ref.get("ws", float("nan")):
        return ref["ws"] * GiB, ""
    if device.type != "cuda":
        return 0.0, ""
    return 0.05 * torch.cuda.get_device_properties(device).total_memory, " (workspace assumed: 5% of the GPU)"


@torch.inference_mode()
def tale_batch(pair, args, device, tp_size: int, ref: dict | None) -> dict:
    """TALE's static cache at the largest batch that fits at --throughput tokens: one row prefilled (a forward),
    repeated to B rows (the cache's values do not change the timing), then generate's steps over it (CUDA graphs)."""
    m = pair.use("tale")
    c, ctx = m.config, args.throughput
    ids = prompt(c.vocab_size, ctx, device)
    ws, assumed = workspace(ref, device)

    def filled() -> tuple:
        """A one-row cache after the prompt's prefill (a forward), and the prompt one token longer (not 0: generate
        would take it for padding)."""
        cache = new_cache(m, static=True, max_length=ctx + 1 + args.warm + args.new)
        out = m(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
        return cache, torch.cat([ids, out.logits[:, -1:].argmax(-1).clamp_min(1)], 1)

    first = [filled()]
    row = first[0][0].capacity_nbytes()  # the bytes of one row
    free(device)

    def attempt(B: int) -> dict:
        cache, more = first.pop() if first else filled()
        cache.batch_repeat_interleave(B)  # B rows replace the one
        res = timed(m, more.repeat(B, 1), args.new, args.warm, device, tp_size, cache=cache, headroom=args.headroom)
        del cache
        free(device)
        return res

    per_row = row + ROW_LOGITS * 4 * c.vocab_size
    B, how = plan_batch(args, device, tp_size, allocated(device) - row, ws, per_row)
    res = at_batch(B, how + assumed, attempt)
    log(pair.shape, ctx, "TALE, largest batch", res)
    kind = "static" + (", CUDA graphs" if device.type == "cuda" else "")
    return dict(res, runtime="TALE", cache_kind=kind, row=row / GiB, ctx=ctx)


@torch.inference_mode()
def hf_batch(pair, args, device, dtype, tp_size: int, ref: dict | None, dynamic: bool) -> dict:
    """transformers at the largest batch that fits at --throughput tokens.
    Static cache (with its torch.compile on CUDA): B rows of a --short-token prompt in a cache of --throughput +
    steps tokens; its decode step attends over the whole cache, filled or not, so the step is the one of a full
    prompt, without B full prefills.
    DynamicCache (eager steps): one row prefilled, repeated to B rows (what the dynamic cache holds is the tokens)."""
    from transformers import DynamicCache, StaticCache

    m = pair.use("transformers")
    c, ctx = m.config, args.throughput
    steps = args.warm + args.new
    ws, assumed = workspace(ref, device)
    logits = ROW_LOGITS * 4 * c.vocab_size
    if dynamic:
        # a step's torch.cat holds a layer's old and new tensors at once: 1 / layers more per row
        row = kv_bytes(c, ctx + steps, dtype) / tp_size * (1 + 1 / c.num_hidden_layers)
        per_row = row + logits
    else:
        short = min(args.short, ctx // 2)
        row = kv_bytes(c, ctx + steps, dtype) / tp_size
        act = 0.0  # the short prompt's prefill activations per row, per token as measured by the batch-1 prefill
        if ref is not None and device.type == "cuda":
            act = max(0.0, (ref["prefill_peak"] - ref["base"]) * GiB - kv_bytes(c, ref["ctx"] + steps, dtype) / tp_size)
            act = act / ref["ctx"] * short
        per_row = row + act + logits
    B, how = plan_batch(args, device, tp_size, allocated(device), ws, per_row)

    def attempt(B: int) -> dict:
        if dynamic:
            ids = prompt(c.vocab_size, ctx, device)
            cache = DynamicCache(config=c)
            out = m(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
            ids = torch.cat([ids, out.logits[:, -1:].argmax(-1).clamp_min(1)], 1).repeat(B, 1)
            del out
            cache.batch_repeat_interleave(B)
            kw = dict(disable_compile=True)
        else:
            ids = prompt(c.vocab_size, short, device, rows=B)
            cache = StaticCache(config=c, max_cache_len=ctx + steps)
            kw = dict(disable_compile=device.type != "cuda")
        res = timed(m, ids, args.new, args.warm, device, tp_size, cache=cache, headroom=args.headroom, **kw)
        del cache
        free(device)
        return res

    res = at_batch(B, how + assumed, attempt)
    kind = (
        "DynamicCache, eager"
        if dynamic
        else "static cache + torch.compile" + ("" if device.type == "cuda" else " (off on the CPU)")
    )
    log(pair.shape, ctx, f"transformers, {kind}, largest batch", res)
    return dict(res, runtime="transformers", cache_kind=kind, row=row / GiB, ctx=ctx)


def batch_table(rows: list[dict]) -> tuple[str, str]:
    """The largest-batch rows as a markdown table, and the line of TALE's tokens/s over the best transformers'."""
    out, rate = [], {}
    for r in rows:
        ok = "ms" in r
        tps = r["batch"] * 1000 / r["ms"] if ok else float("nan")
        if ok:
            rate[r["runtime"]] = max(rate.get(r["runtime"], 0.0), tps)
        out.append(
            [
                r["runtime"],
                r["cache_kind"],
                r["batch"],
                harness.fmt(r["ms"], 2) if ok else r["error"],
                harness.fmt(tps, 1),
                harness.fmt(r.get("peak", float("nan")), 1),
                harness.fmt(r["row"], 3),
                r["how"],
            ]
        )
    header = [
        "runtime",
        "cache",
        "batch",
        "ms/token",
        "tokens/s",
        "peak GiB/GPU",
        "cache GiB per row per GPU",
        "how the batch was found",
    ]
    ratio = ""
    if "TALE" in rate and "transformers" in rate:
        ratio = f"TALE / best transformers: **{rate['TALE'] / rate['transformers']:.2f}x** tokens/s"
    return harness.table(header, out), ratio


def read_bytes(c, group: int, dtype, output: str) -> int:
    """Bytes of weights a TALE decode step reads, all ranks together: the base model but the embedding table (one row
    is gathered) and v_proj (the latent projection A replaces it), plus A and, fused, O^r instead of W_O, or, factored,
    B before W_O."""
    d, n, H, K, L = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers
    R, G = group * n, K // group
    out = d * H * R - d * H * n if output == "fused" else G * R * R
    return base_bytes(c, dtype) - (c.vocab_size * d + L * d * K * n - L * (G * d * R + out)) * dtype.itemsize


def largest(res: dict, ctxs: list, device) -> int | None:
    """The largest context at batch 1 that 92% of the GPU's memory holds, from the peaks of the two longest contexts
    measured (peak grows linearly in the context: the cache and the prefill's activations)."""
    ok = [c for c in ctxs if "peak" in res.get(c, {}) and res[c]["peak"] == res[c]["peak"]]
    if device.type != "cuda" or len(ok) < 2:
        return None
    c1, c2 = sorted(ok)[-2:]
    per = (res[c2]["peak"] - res[c1]["peak"]) / (c2 - c1)
    total = torch.cuda.get_device_properties(device).total_memory / GiB
    return int(c2 + (0.92 * total - res[c2]["peak"]) / per) if per > 0 else None


def base_bytes(c, dtype) -> int:
    d, n, H, K, L = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers
    return (L * (d * (2 * H + 2 * K) * n + 3 * d * c.intermediate_size + 2 * d) + 2 * c.vocab_size * d) * dtype.itemsize


def kv_bytes(c, tokens: int, dtype) -> int:
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * tokens * dtype.itemsize


def cells(r: dict, cache: bool = False) -> list[str]:
    if "error" in r:
        return [r["error"], "", ""][: 3 if cache else 2]
    out = [harness.fmt(r["ms"], 2), harness.fmt(r["peak"], 1)]
    return out + [harness.fmt(r["cache"], 3)] if cache else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b,70b", help="8b, 70b or both (comma-separated)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the timed models (default: all)")
    ap.add_argument("--ctx", default="32768,131072", help="prompt lengths (comma-separated)")
    ap.add_argument("--new", type=int, default=32, help="timed decode steps")
    ap.add_argument("--warm", type=int, default=4, help="decode steps before the timed ones (compile, capture)")
    ap.add_argument(
        "--group",
        type=int,
        default=None,
        help="KV heads per latent group (default: the largest of 4, 2, 1 that N splits)",
    )
    ap.add_argument("--output-path", default="auto", choices=["auto", "fused", "factored"])
    ap.add_argument("--check-layers", type=int, default=None, help="layers of the 8B check model (default: all)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' rows")
    ap.add_argument("--no-tale", action="store_true", help="skip TALE's rows (transformers' alone)")
    ap.add_argument(
        "--throughput",
        type=int,
        default=None,
        metavar="CTX",
        help="also tokens/s at the largest batch that fits at CTX tokens (from bytes and the batch-1 run's memory)",
    )
    ap.add_argument("--batch", type=int, default=None, help="--throughput at this batch instead of the largest")
    ap.add_argument("--no-hf-dynamic", action="store_true", help="--throughput without transformers' DynamicCache")
    ap.add_argument("--short", type=int, default=512, help="prompt of transformers' static-cache batch (tokens)")
    ap.add_argument("--headroom", type=float, default=3.0, help="GiB per GPU the memory model leaves free")
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="TALE's prefill in pieces of this many tokens (0: one piece; default: the runtime's, set_prefill_chunk)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, short prompts: checks the script (CPU)")
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file (rank 0)")
    args = ap.parse_args()
    args.ctx = [int(x) for x in args.ctx.split(",")]
    if args.tiny:
        args.ctx = [c for c in args.ctx if c <= 512] or [96, 160]
        args.new, args.warm = min(args.new, 8), min(args.warm, 2)
        if args.throughput:
            args.throughput = min(args.throughput, max(args.ctx))
    dtype = torch.float32 if args.tiny else torch.bfloat16
    tp_size = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(args.device)
    start = None
    if tp_size > 1:
        start = tp.start(tp_size, device)
        device = start[1]
    elif device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    gpu = harness.device_name() if device.type == "cuda" else "CPU"
    log(f"{tp_size} rank(s) on {gpu}; NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', '(unset)')}")

    lines = [f"# Tensor parallelism: {tp_size} x {gpu}", ""]
    if tp_size > 1 and not args.no_check:
        lines += ["## TP against one process, same weights", "", check(args, device, dtype, tp_size, start)]
    args.bandwidth = None
    if device.type == "cuda":  # the yardstick of the byte floor: a device-to-device copy on this rank's GPU
        args.bandwidth = gather(tp_size, harness.copy_bandwidth(str(device)))[0]
        log(f"copy bandwidth {args.bandwidth:.0f} GB/s")
    notes: list[str] = []
    batch_rows: list[dict] = []
    rows = timings(args, device, dtype, tp_size, start, notes, batch_rows)
    header = [
        "model",
        "GPUs",
        "context",
        "TALE ms/token",
        "TALE peak GiB/GPU",
        "TALE cache GiB/GPU",
        "TALE decode attention",
        "transformers TP ms/token",
        "transformers peak GiB/GPU",
        "speed-up",
        "TALE byte floor ms/token (TALE over it)",
    ]
    lines += [
        "## Decode, batch 1, model.generate",
        "",
        "TALE: static cache, CUDA-graph steps; transformers: static cache + torch.compile, same TP size.",
        "",
        harness.table(header, rows),
        "",
        "Byte floor: this rank's weights a step reads and its cache, over the copy bandwidth measured in the run"
        + (f" ({args.bandwidth:.0f} GB/s)." if args.bandwidth else " (not on the CPU)."),
        *(f"- {n}" for n in notes),
    ]
    if args.throughput:
        ctx = args.throughput
        table, ratio = batch_table(batch_rows)
        lines += [
            "",
            f"## Throughput at {ctx // 1024}K tokens, the largest batch that fits"
            if ctx >= 1024
            else f"## Throughput at {ctx} tokens, the largest batch that fits",
            "",
            "tokens/s = batch x 1000 / ms per token. TALE: one prefilled row repeated to the batch, static cache, CUDA "
            f"graphs; transformers' static cache: {min(args.short, ctx // 2)}-token prompts in a cache of the full length "
            "(its step attends over the whole cache); its DynamicCache: one prefilled row repeated, eager steps.",
            "",
            table,
            *([ratio] if ratio else []),
        ]
    if rank() == 0:
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    if tp_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
