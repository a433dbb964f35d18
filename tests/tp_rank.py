"""One rank of tests/test_tp.py: started twice (RANK 0 and 1, gloo on the CPU), writes what it saw to OUT.rank{r}.json.

    python tests/tp_rank.py OUT ARTIFACTS_JSON PROMPT_IDS NEW_TOKENS

ARTIFACTS_JSON maps each case to its artifact: good, odd, tied, lowrank, lowrank_joint, lowrank_head, qwen2, qwen3,
gemma3, phi3.

Cases, in one process group (starting Python and torch costs more than all of them): greedy tokens and per-rank cache
bytes through model.generate (dynamic cache with the fused output, and with the factored one and O^r left unread;
static cache; both with the prefill in pieces; tied embeddings; low-rank keys on a basis per latent group, a joint one
and one per head; Qwen2, Qwen3, Gemma 3 and Phi-3, dynamic and static cache); the compiled decode step; an artifact whose groups do
not split over 2 ranks; a bad
path on rank 1 only; the same through `tale-run --tp 2`; benchmarks/bench_tp.py --tiny (with --throughput).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch
from tale_helpers import invoke

from tale_runtime import cli, load, new_cache, set_prefill_chunk
from tale_runtime.model import cache_arg

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def generate(model, ids: list[int], new: int, **cache_kw) -> tuple[list[int], int, list[float]]:
    cache = new_cache(model, **cache_kw)
    x = torch.tensor([ids])
    out = model.generate(
        x, **cache_arg(cache), max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    # a few of the prefill's logits and of the last step's (past the flushes into the quantized levels)
    logits = out.logits[0][0, :8].tolist() + out.logits[-1][0, :8].tolist()
    return out.sequences[0, len(ids) :].tolist(), cache.nbytes(), logits


@torch.inference_mode()
def coefficients(model, ids: list[int]) -> list[float]:
    """Layer 0's low-rank key coefficients after a prefill of ids (dynamic cache), dequantized."""
    from tale_runtime.quant import dequantize

    cache = new_cache(model)
    model(torch.tensor([ids]), **cache_arg(cache))
    region = next(r for r in cache.layers[0].view().regions if r.basis is not None)
    return dequantize(region.keys).flatten().tolist()


@torch.inference_mode()
def decode_step(model, ids: list[int]) -> bool:
    """DecodeStep (what the CUDA graph of a GPU decode step holds: the code around attention compiled, here traced
    without inductor) gives the model's forward's logits bit for bit under tensor parallelism."""
    from tale_runtime.decode import DecodeStep

    x, pos = torch.tensor([ids]), torch.tensor([[len(ids)]])
    out = []
    for compiled in (False, True):
        cache = new_cache(model, static=True, max_length=len(ids) + 4)
        tok = model(input_ids=x, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
        if compiled:
            step = DecodeStep(model, cache, backend="aot_eager")
            step.warm(tok, pos)
            out.append(step(tok, pos))
        else:
            out.append(model(input_ids=tok, position_ids=pos, **cache_arg(cache), use_cache=True).logits[:, -1])
    return torch.equal(*out)


def failure(fn) -> dict | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test checks type and text)
        return {"type": type(e).__name__, "message": str(e)}
    return None


def main() -> None:
    out, artifacts, prompt, new = sys.argv[1:5]
    arts = json.loads(artifacts)
    good, odd, tied = arts["good"], arts["odd"], arts["tied"]
    rank = int(os.environ["RANK"])
    ids, new = json.loads(prompt), int(new)
    res: dict = {"rank": rank}
    model, _ = load(good, device="cpu", dtype=torch.float32, tp_size=2)
    spec = model.tale_spec
    res["tp"] = [spec.tp.size, spec.tp.rank]
    res["local_groups"] = [layer.self_attn.tale.u_v.shape[0] for layer in model.model.layers]
    res["dynamic"] = generate(model, ids, new)
    res["static"] = generate(model, ids, new, static=True)
    set_prefill_chunk(model, 16)  # the prompt's prefill in pieces of 16 tokens (runtime/model.py chunked_prefill)
    rows: list[int] = []  # the rows of each call of layer 0's MLP: the pieces, then the decode steps
    hook = model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[1]))
    res["pieces"] = generate(model, ids, new)
    hook.remove()
    res["piece_rows"] = rows[:4]
    res["pieces_static"] = generate(model, ids, new, static=True)
    set_prefill_chunk(model, 0)
    res["decode_step"] = decode_step(model, ids)
    del model
    model, _ = load(good, device="cpu", dtype=torch.float32, tp_size=2, output_path="factored")  # O^r left unread
    res["factored"] = generate(model, ids, new)
    del model
    model, _ = load(tied, device="cpu", dtype=torch.float32, tp_size=2)
    res["tied"] = generate(model, ids, new)
    for name in ("lowrank", "lowrank_joint", "lowrank_head", "qwen2", "qwen3", "gemma3", "phi3"):
        model, _ = load(arts[name], device="cpu", dtype=torch.float32, tp_size=2)
        res[name] = generate(model, ids, new)
        res[name + "_static"] = generate(model, ids, new, static=True)
        if name.startswith("lowrank"):
            res[name + "_coefficients"] = coefficients(model, ids)
        del model
    res["odd"] = failure(lambda: load(odd, device="cpu", dtype=torch.float32, tp_size=2))
    res["bad_path"] = failure(
        lambda: load(good if rank == 0 else good + "-missing", device="cpu", dtype=torch.float32, tp_size=2)
    )
    args = ["--prompt", "hello", "--max-new-tokens", "4", "--dtype", "fp32", "--device", "cpu", "--tp", "2"]
    res["cli"] = vars(invoke(cli.main, [good, *args]))
    res["cli_bad_path"] = vars(invoke(cli.main, [good if rank == 0 else good + "-missing", *args]))
    res["bench"] = bench(["--device", "cpu", "--tiny", "--ctx", "64", "--new", "3", "--throughput", "64"])
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(res, f)


def bench(argv: list[str]) -> str:
    """benchmarks/bench_tp.py's output (it ends the process group)."""
    sys.path.insert(0, str(BENCH))
    import bench_tp

    sys.argv = ["bench_tp.py", *argv]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        bench_tp.main()
    return text.getvalue()


if __name__ == "__main__":
    main()
