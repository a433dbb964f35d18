"""TALE's packed cache under vLLM (docs/serving.md): greedy tokens against the base model under vLLM, and the
KV bytes per token vLLM allocated against PagedFormat's formula and against a 16-bit cache of the base model.

    .venv-vllm/bin/python benchmarks/serve_packed.py ARTIFACT BASE_CHECKPOINT [--setting k16v16:full:1 ...]

A setting is KV_CACHE:VALUE_RANK:EXACT_LAYERS[:ROTATE] (tale_runtime.vllm.engine_args; ROTATE "hadamard" if left out). One engine per setting, in this process,
one after the other; prints one markdown row per setting.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # LLM.apply_model reaches the model
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = [
    "The chemical symbol for gold is",
    "Once upon a time there was a little girl who",
    "The capital of France is a city that many people visit every year because",
    "Water boils at a temperature of",
]


def run(engine: dict, max_tokens: int) -> tuple[list[list[int]], int, float, float]:
    import vllm

    from tale_runtime.vllm import kv_bytes_per_token, shutdown

    t0 = time.perf_counter()
    llm = vllm.LLM(**engine)
    t1 = time.perf_counter()
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    t2 = time.perf_counter()
    nbytes = kv_bytes_per_token(llm)
    shutdown(llm)
    return tokens, nbytes, t1 - t0, t2 - t1


def main() -> None:
    import torch

    import tale_runtime.vllm as tale_vllm
    from tale_runtime.vllm import source

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("base")
    ap.add_argument("--setting", action="append", help="KV_CACHE:VALUE_RANK:EXACT_LAYERS[:ROTATE] (repeatable)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--sinks", type=int, default=None, help="exact first tokens (default: the artifact schedule's)")
    args = ap.parse_args()
    settings = args.setting or ["k16v16:full:1", "k4v4:full:1", "level0:level0:1"]
    common = dict(dtype=args.dtype, max_model_len=256, enforce_eager=True, max_num_seqs=len(PROMPTS), seed=0)
    dtype = getattr(torch, args.dtype)

    base_tokens, base_bytes, start, gen = run(dict(model=args.base, **common), args.max_tokens)
    a = source.open_artifact(args.artifact).arch
    bf16 = a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2
    print(f"base: KV bytes/token {base_bytes} ({args.dtype}), 16-bit {bf16}; engine start {start:.0f} s")
    print(
        "| setting | slot bytes (per token, layer, group) | greedy tokens = base | prompts identical | KV bytes/token allocated "
        "| formula | vs 16-bit cache | engine start, generate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s in settings:
        kv, rank, exact, rotate = (s.split(":") + ["hadamard"])[:4]
        rank = int(rank) if rank.isdigit() else rank
        kw = dict(kv_cache=kv, exact_layers=int(exact), rotate=rotate, sinks=args.sinks)
        src = source.open_artifact(args.artifact, rank, **kw)
        fmts = [src.paged_format(i, dtype) for i in range(a.num_layers)]
        formula = sum(a.num_groups * f.slot_bytes for f in fmts)
        at16 = sum(a.num_groups * src.paged_format(i, torch.bfloat16).slot_bytes for i in range(a.num_layers))
        engine = dict(**tale_vllm.engine_args(args.artifact, rank, **kw), **common)
        tokens, nbytes, start, gen = run(engine, args.max_tokens)
        same = sum(x == y for t, b in zip(tokens, base_tokens) for x, y in zip(t, b))
        whole = sum(t == b for t, b in zip(tokens, base_tokens))
        sizes = sorted({f.slot_bytes for f in fmts})
        print(
            f"| `{s}` | {', '.join(map(str, sizes))} | {same}/{len(PROMPTS) * args.max_tokens} | {whole}/{len(PROMPTS)} "
            f"| {nbytes} | {formula} | {bf16 / at16:.2f}x (bf16: {at16} vs {bf16}) | {start:.0f} s, {gen:.1f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
