"""CPU decode: the TALE cache against the same model with transformers' DynamicCache (16-bit K+V, the base model's
attention), token by token after a prompt of N tokens, in one process, one torch thread by default.

    python benchmarks/bench_cpu.py out/smollm2-tale --tokens 1024,2048 --dtype fp32,bf16
    python benchmarks/bench_cpu.py out/smollm2-tale --tokens 1024 --profile 20   # + torch.profiler's table

The prompt is calib/demo_long_prompt.txt's tokens, repeated to N. Per dtype and length: prefill seconds of each
cache, then ms/token as the median of `--steps` greedy decode steps (both caches fed the same tokens: the full
cache's greedy ones, their steps timed alternately), and on how many steps both caches pick the same greedy token.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import tale_runtime
from tale_runtime.model import cache_arg

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROMPT = Path(__file__).resolve().parent.parent / "calib" / "demo_long_prompt.txt"


def prompt_ids(tok, n: int) -> torch.Tensor:
    ids = tok(PROMPT.read_text(), return_tensors="pt").input_ids[0]
    return ids.repeat(n // len(ids) + 1)[:n][None]


@torch.inference_mode()
def decode(model, caches: list, ids: torch.Tensor, steps: int):
    """Prefill each cache, then decode greedily from the first one's tokens, feeding every cache the same token
    and timing their steps alternately (a shared machine's load then weighs on each alike). Per cache: prefill
    seconds, step seconds, its own greedy picks."""
    prefill, logits = [], []
    for c in caches:
        t = time.perf_counter()
        logits.append(model(input_ids=ids, **cache_arg(c), use_cache=True, logits_to_keep=1).logits)
        prefill.append(time.perf_counter() - t)
    times, toks = [[] for _ in caches], [[] for _ in caches]
    for _ in range(steps):
        for i in range(len(caches)):
            toks[i].append(int(logits[i][0, -1].argmax()))
        nxt = torch.tensor([[toks[0][-1]]])
        for i, c in enumerate(caches):
            t = time.perf_counter()
            logits[i] = model(input_ids=nxt, **cache_arg(c), use_cache=True, logits_to_keep=1).logits
            times[i].append(time.perf_counter() - t)
    return prefill, times, toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--tokens", default="1024,2048", help="prompt lengths, comma list")
    ap.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per cache")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, help="also profile this many TALE decode steps (torch.profiler)")
    ap.add_argument("--output-path", default=None, help="fused or factored (default: load's)")
    a = ap.parse_args()
    kw = {} if a.output_path is None else {"output_path": a.output_path}
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(
        "| dtype | prompt | prefill TALE (s) | prefill full (s) | TALE ms/token | full ms/token | TALE / full | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dn in a.dtype.split(","):
        model, tok = tale_runtime.load(a.artifact, device="cpu", dtype=DTYPES[dn], **kw)
        for n in (int(x) for x in a.tokens.split(",")):
            ids = prompt_ids(tok, n)
            (fp, tp), (ft, tt), (ftoks, ttoks) = decode(
                model, [DynamicCache(config=model.config), tale_runtime.new_cache(model)], ids, a.steps
            )
            tm, fm = statistics.median(tt) * 1e3, statistics.median(ft) * 1e3
            same = sum(x == y for x, y in zip(ttoks, ftoks))
            print(f"| {dn} | {n} | {tp:.2f} | {fp:.2f} | {tm:.1f} | {fm:.1f} | {tm / fm:.2f}x | {same}/{len(ftoks)} |")
            if a.profile:
                cache = tale_runtime.new_cache(model)
                with torch.inference_mode():
                    model(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        for i in range(a.profile):
                            nxt = torch.tensor([[ftoks[i % len(ftoks)]]])
                            model(input_ids=nxt, **cache_arg(cache), use_cache=True, logits_to_keep=1)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
