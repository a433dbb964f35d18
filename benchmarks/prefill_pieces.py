"""The prefill in pieces on a GPU against the prefill in one piece: peak memory, time and error.

A random model of Llama-3.1-8B shapes (bench_e2e.build, cut to --layers), a prompt of --ctx tokens, batch 2 with 301
tokens of left padding on the second row, the `paper` schedule. The reference is TALE's prefill in one piece in
float32, then the same model in bf16 (its rotary's inv_freq kept in float32, as transformers keeps it) prefills in one
piece and in pieces of --chunk, over the dynamic and the static cache; the yardstick is transformers' own forward in
bf16 against its float32 forward. Decode steps are fed the reference's greedy tokens, so every step compares the same
inputs. Peak = torch.cuda.max_memory_allocated during the prefill, over what was allocated before the cache.

    python benchmarks/prefill_pieces.py                      # 8 layers, 32K + 77 tokens, pieces of 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as e2e  # noqa: E402

from tale_runtime import new_cache, set_prefill_chunk  # noqa: E402
from tale_runtime.model import cache_arg  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def prefill(model, ids, mask, chunk: int, static: bool, feed: torch.Tensor | None, steps: int):
    """Last-position logits of the prefill and of `steps` decode steps [B, 1 + steps, V] float32, its seconds and
    peak GiB; the steps are fed `feed` [B, steps] (None: their own greedy tokens)."""
    set_prefill_chunk(model, chunk)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    T = ids.shape[1]
    cache = new_cache(model, static=True, max_length=T + steps + 8) if static else new_cache(model)
    t0 = time.perf_counter()
    lg = model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True, logits_to_keep=1).logits
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    out = [lg[:, -1].float()]
    for i in range(steps):
        nxt = feed[:, i : i + 1] if feed is not None else out[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out.append(model(input_ids=nxt, attention_mask=mask, **cache_arg(cache), use_cache=True).logits[:, -1].float())
    del cache
    torch.cuda.empty_cache()
    return torch.stack(out, 1), dt, peak


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=32768 + 77)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    model, orig, tale = e2e.build(False, "cuda", layers=a.layers, dtype=torch.float32)
    e2e.use(model, tale)
    gen = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (2, a.ctx), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :301] = 0
    ref, dt, peak = prefill(model, ids, mask, 0, False, None, a.steps)
    feed = ref[:, :-1].argmax(-1)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {a.layers} layers, {a.ctx} tokens, batch 2")
    print(f"float32, one piece: prefill {dt:.2f} s, peak {peak:.2f} GiB", flush=True)
    e2e.use(model, orig)
    with torch.no_grad():
        hf32 = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()
        inv_freq = model.model.rotary_emb.inv_freq.clone()
        model.to(torch.bfloat16)
        model.model.rotary_emb.inv_freq = inv_freq
        hf16 = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()
    for m in tale:  # the TALE modules not in the model during .to
        m.to(torch.bfloat16)
    e2e.use(model, tale)
    print(f"TALE float32 vs transformers float32, prefill logits: rel {rel(ref[:, 0], hf32):.2e}")
    rows = [("transformers' own forward", "", "", f"{rel(hf16, hf32):.2e}", "", "")]
    for static in (False, True):
        for chunk in (0, a.chunk):
            lg, dt, peak = prefill(model, ids, mask, chunk, static, feed, a.steps)
            dec = max(rel(lg[:, i], ref[:, i]) for i in range(1, lg.shape[1]))
            same = int((lg.argmax(-1) == ref.argmax(-1)).sum())
            name = f"TALE, {'static' if static else 'dynamic'} cache, " + (
                f"pieces of {chunk}" if chunk else "one piece"
            )
            rows.append((name, f"{peak:.2f} GiB", f"{dt:.2f} s", f"{rel(lg[:, 0], ref[:, 0]):.2e}", f"{dec:.3f}",
                         f"{same} of {lg.shape[0] * lg.shape[1]}"))  # fmt: skip
            print(rows[-1], flush=True)
    print("\n| prefill (bf16) | peak | time | last-token logits vs float32 | decode steps, largest rel. error "
          "| greedy tokens as the reference's |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
