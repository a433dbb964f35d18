"""What the packed cache's 16-bit sinks buy under vLLM (docs/serving.md): one packed level for every layer and token,
with and without the sinks buffer, against the base model under vLLM (greedy tokens) and against tale_runtime on the
same artifact and the same one-level schedule (log-probabilities teacher-forced along vLLM's tokens: the oracle), and
against tale_runtime with 16-bit keys and latents (what the 4 bits cost).

    .venv-vllm/bin/python benchmarks/serve_sinks.py ARTIFACT BASE_CHECKPOINT [--level k4v4] [--sinks 0 --sinks 4]

Engines in this process, one after the other (float32); prints one markdown row per sinks setting.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_packed import PROMPTS  # noqa: E402  (and its vLLM engine environment, set on import)


def generate(engine: dict, max_tokens: int):
    """Greedy tokens, top-5 log-probabilities per step and the prompts' token ids."""
    import vllm

    from tale_runtime.vllm import shutdown

    llm = vllm.LLM(**engine)
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        ids = [llm.get_tokenizer()(p).input_ids for p in PROMPTS]
        return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs], ids
    finally:
        shutdown(llm)


def oracle(art, ids: list[int], tokens: list[int], bits: int, sinks: int):
    """tale_runtime's log-probabilities [steps, vocab] along `tokens`: every token at `bits` per-token keys and latents
    (Hadamard-rotated keys, full rank), the first `sinks` exact, each token quantized after it attended (residual 1)."""
    import torch

    import tale_runtime
    from tale_runtime.load import new_cache

    model, _ = tale_runtime.load(
        art, device="cpu", dtype=torch.float32, sinks=sinks, recent=[], bits=bits, ranks=1.0, key_axis="token",
        rotate="hadamard", key_channel_group=32, value_group=32, residual=1,
    )  # fmt: skip
    cache, out = new_cache(model), []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]
        for t in tokens:
            out.append(logits.log_softmax(-1))
            logits = model(torch.tensor([[t]]), past_key_values=cache).logits[0, -1]
    return torch.stack(out)


def main() -> None:
    import torch

    import tale_runtime.vllm as tale_vllm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("base")
    ap.add_argument("--level", default="k4v4")
    ap.add_argument("--sinks", type=int, action="append")
    ap.add_argument("--exact-layers", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    common = dict(dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=len(PROMPTS), seed=0)
    bits = int(args.level[1 : args.level.index("v")])
    base_tokens, _, _ = generate(dict(model=args.base, **common), args.max_tokens)
    steps = len(PROMPTS) * args.max_tokens
    print(
        f"| {args.level}, sinks | greedy tokens = base | argmax = tale_runtime's | \\|log-prob - tale_runtime\\| mean / max "
        f"| vLLM's \\|log-prob - 16-bit\\| mean / max | tale_runtime's \\|log-prob - 16-bit\\| mean / max | engine + generate |"
    )
    print("|---|---|---|---|---|---|---|")
    for sinks in args.sinks or [0, 4]:
        t0 = time.perf_counter()
        kw = dict(kv_cache=args.level, exact_layers=args.exact_layers, sinks=sinks)
        tokens, lps, ids = generate(dict(**tale_vllm.engine_args(args.artifact, **kw), **common), args.max_tokens)
        wall = time.perf_counter() - t0
        same = sum(x == y for t, b in zip(tokens, base_tokens) for x, y in zip(t, b))
        whole = sum(t == b for t, b in zip(tokens, base_tokens))
        d_oracle, d_exact, d_tale = [], [], []
        agree = 0
        for p_ids, toks, lp in zip(ids, tokens, lps):
            want = oracle(args.artifact, p_ids, toks, bits, sinks)
            exact = oracle(args.artifact, p_ids, toks, 16, sinks)
            agree += toks == [int(x) for x in want.argmax(-1)]
            for step, top in enumerate(lp):
                top_ids = list(top)
                got = torch.tensor([top[i].logprob for i in top_ids])
                d_oracle.append((got - want[step, top_ids]).abs())
                d_exact.append((got - exact[step, top_ids]).abs())
                d_tale.append((want[step, top_ids] - exact[step, top_ids]).abs())

        def mm(d):
            d = torch.cat(d)
            return f"{d.mean():.1e} / {d.max():.1e}"

        print(
            f"| {sinks} | {same}/{steps} ({whole}/{len(PROMPTS)} prompts) | {agree}/{len(PROMPTS)} prompts "
            f"| {mm(d_oracle)} | {mm(d_exact)} | {mm(d_tale)} | {wall:.0f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
