"""The paths users take against the inner loop: `model.generate` with a new StaticTaleCache per call, and
`tale_runtime.generate` (what `tale-run` calls), against bench_e2e's inner loop (CudaGraphDecoder steps) and
transformers' static cache + torch.compile, on the same random 8B-shaped model (bench_e2e.build) in one process.

    python3 benchmarks/bench_generate.py --out generate.md     # GPU: 32K, batch 1
    python3 benchmarks/bench_generate.py --quick               # CPU, tiny model: the script's logic only
    python3 benchmarks/bench_generate.py --profile-first       # where the process's first call spends its time

Per path: the first call of the process (it compiles the decode step: once per model and process), a later call
with a new cache (it captures that cache's CUDA graph), and ms/token from the difference of two calls of m and
m + n new tokens, each with a new cache of the same capacity (their prefills and captures cancel; the long call runs
once untimed first, so that its kernels are compiled). tale_runtime.generate reports its own split
(GenStats.first_step_s: the decode steps up to the CUDA graph's first replay, with the compile and the capture; decode
tok/s after them).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e as e2e  # noqa: E402

from tale_runtime import new_cache  # noqa: E402
from tale_runtime.generate import generate as tale_generate  # noqa: E402
from tale_runtime.model import cache_arg  # noqa: E402


def split(st) -> str:
    """The decode steps up to the graph's first replay, which the tok/s of GenStats leaves out."""
    return f": first {st.first_steps} decode step(s) {st.first_step_s:.2f} s" if st.first_step_s else ""


def timed(fn) -> float:
    e2e.sync()
    t = time.perf_counter()
    fn()
    e2e.sync()
    return time.perf_counter() - t


PROFILE_FIRST = False


def profiled(fn):
    """fn() under cProfile: prints the calls that took the most cumulative time (compiling, capturing, loading
    cached code, the prefill) and dynamo's own phase times; returns fn's result."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    print(buf.getvalue())
    print(torch._dynamo.utils.compile_times(repr="str"))
    return out


@torch.inference_mode()
def user_path(model, ids: torch.Tensor, m: int, n: int) -> dict:
    """model.generate with a new static cache per call: first call, a later call, ms/token.

    Every call's cache has the same capacity (prompt + m + n: generate accepts a static cache larger than the call
    needs), and the long call runs once before it is timed: Triton specializes kernels on integer arguments such as
    capacities and strides, so a call at a capacity of its own would pay those compiles inside (long - short)."""
    static = ids.device.type == "cuda"
    cap = ids.shape[1] + m + n if static else None

    def call(k: int):
        cache = new_cache(model, static=static, max_length=cap)
        kw = dict(do_sample=False, max_new_tokens=k, min_new_tokens=k, attention_mask=torch.ones_like(ids))
        return timed(lambda: model.generate(ids, **cache_arg(cache), **kw))

    first = call(m) if not PROFILE_FIRST else profiled(lambda: call(m))
    later = call(m)
    call(m + n)  # every flush and demotion of the long call, compiled once
    long = call(m + n)
    short = call(m)
    return dict(first_call_s=first, later_call_s=later, ms_per_token=(long - short) * 1e3 / n)


@torch.inference_mode()
def cli_path(model, ids: torch.Tensor, n: int) -> dict:
    """tale_runtime.generate (tale-run's call), twice: its own stats."""
    out = {}
    for k in ("first", "later"):
        _, st = tale_generate(model, ids[0].tolist(), max_new_tokens=n + 2)
        out[k] = st
    return out


@torch.inference_mode()
def inner_loop(model, ctx: int, n: int) -> float:
    cache = new_cache(model, static=model.device.type == "cuda", max_length=ctx + n + 8)
    first, _ = e2e.prefill(model, cache, ctx)
    ms, _ = e2e.decode(e2e.tale_step(model, cache, graphs=model.device.type == "cuda"), first, ctx, n)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--new", type=int, default=64, help="the n of ms/token")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--preset", default="paper", choices=["paper", "lowrank"], help="the TALE schedule (bench_e2e.build)"
    )
    ap.add_argument(
        "--key-basis-blocks", default="group", choices=["joint", "group", "head"], help="the lowrank preset's key basis"
    )
    ap.add_argument(
        "--profile-first",
        action="store_true",
        help="the first model.generate call under cProfile (slower): where a process's first call spends its time",
    )
    a = ap.parse_args()
    global PROFILE_FIRST
    PROFILE_FIRST = a.profile_first
    device = "cpu" if a.quick else "cuda"
    ctx, n, m = (64, 8, 2) if a.quick else (a.ctx, a.new, 4)
    model, orig, tale = e2e.build(a.quick, device, preset=a.preset, key_basis_blocks=a.key_basis_blocks)
    e2e.use(model, tale)
    ids = torch.randint(
        1, model.config.vocab_size, (1, ctx), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    e2e.log(f"{gpu}, {versions}, context {ctx}, batch 1")
    up = user_path(model, ids, m, n)
    e2e.log("model.generate", up)
    cp = cli_path(model, ids, n)
    e2e.log("tale_runtime.generate", {k: v.as_dict() for k, v in cp.items()})
    inner = inner_loop(model, ctx, n)
    e2e.log("inner loop ms/token", inner)
    hf = None
    if not a.no_hf and device == "cuda":
        e2e.ROWS.clear()
        e2e.hf_static_rows(model, orig, ctx, [], n, deadline=1e9, frac=0.92, short=512)
        hf = next((r for r in e2e.ROWS if r.get("kind") == "hf-static-compile" and "ms_per_token" in r), None)
        e2e.log("transformers static + compile", hf)
    lines = [
        f"Decode through the user paths, bench_e2e's random model ({len(model.model.layers)} layers), context {ctx}, "
        f"batch 1, {gpu}, {versions}, preset {a.preset}"
        + (f" (key basis: {a.key_basis_blocks})" if a.preset == "lowrank" else ""),
        "",
        "| path | first call of the process s | a later call s | ms/token | vs the inner loop |",
        "|---|---:|---:|---:|---:|",
        f"| `model.generate`, new StaticTaleCache per call ({m} new tokens) | {up['first_call_s']:.2f} "
        f"| {up['later_call_s']:.2f} | {up['ms_per_token']:.2f} | {up['ms_per_token'] / inner:.2f}x |",
    ]
    for k, st in cp.items():
        ms = 1e3 / st.decode_tokens_per_s if st.decode_tokens_per_s else float("nan")
        lines.append(
            f"| `tale_runtime.generate` (tale-run), {k} call{split(st)} | "
            f"{st.prefill_s + st.decode_s:.2f} | | {ms:.2f} | {ms / inner:.2f}x |"
        )
    lines.append(f"| inner loop (CudaGraphDecoder steps, bench_e2e) | | | {inner:.2f} | 1.00x |")
    if hf:
        lines.append(
            f"| transformers StaticCache + compile (`generate`) | {hf['first_call_s']:.1f} | {hf['call_s']:.2f} "
            f"| {hf['ms_per_token']:.2f} | {hf['ms_per_token'] / inner:.2f}x |"
        )
    text = "\n".join(lines)
    print("\n" + text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
