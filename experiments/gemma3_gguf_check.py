"""Checks the bundled Gemma 3 270M checkpoint (tale-convert gemma3-270m) against the GGUF file it was rebuilt from,
through an independent forward pass: the GGUF tensors dequantized by the `gguf` package and run with llama.cpp's
Gemma 3 graph written out here (norm weights stored as 1 + w, embeddings times sqrt(hidden), tied output, no
soft-caps, q/k RMSNorm, local RoPE base 10000 on sliding layers, scale 1/sqrt(head_dim)), never transformers' GGUF
loader or its Gemma 3 module. Prints the logits of a few positions of both, and of the bf16 checkpoint.

    OMP_NUM_THREADS=1 python experiments/gemma3_gguf_check.py
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from tale_convert.bundled import GEMMA3_270M

TEXT = "The Eiffel Tower is in Paris, the capital of France. The chemical symbol for gold is"


def field(r: GGUFReader, key: str):
    return r.fields[key].contents()


def reference_logits(gguf: Path, ids: list[int]) -> torch.Tensor:
    r = GGUFReader(str(gguf))
    W = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)) for t in r.tensors}
    a = "gemma3"
    d, L = field(r, f"{a}.embedding_length"), field(r, f"{a}.block_count")
    H, K, n = (
        field(r, f"{a}.attention.head_count"),
        field(r, f"{a}.attention.head_count_kv"),
        field(r, f"{a}.attention.key_length"),
    )
    eps, window = field(r, f"{a}.attention.layer_norm_rms_epsilon"), field(r, f"{a}.attention.sliding_window")
    base_global, base_local = field(r, f"{a}.rope.freq_base"), 10000.0  # llama.cpp: local base fixed for Gemma 3
    T = len(ids)

    def norm(x, w):  # GGUF holds Gemma's RMSNorm weight as 1 + w
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, base):  # x [T, heads, n], NeoX halves
        inv = 1.0 / base ** (torch.arange(0, n, 2, dtype=torch.float64) / n)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
        x1, x2 = x[..., : n // 2], x[..., n // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    emb = W["token_embd.weight"]  # [vocab, d]
    x = emb[ids] * math.sqrt(d)
    pos = torch.arange(T)
    for i in range(L):
        p = f"blk.{i}."
        sliding = (i + 1) % 6 != 0  # llama.cpp's Gemma 3 pattern: every 6th layer global
        h = norm(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T).view(T, H, n)
        k = (h @ W[p + "attn_k.weight"].T).view(T, K, n)
        v = (h @ W[p + "attn_v.weight"].T).view(T, K, n)
        q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        base = base_local if sliding else base_global
        q, k = rope(q, base), rope(k, base)
        k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
        s = torch.einsum("thn,shn->hts", q, k) / math.sqrt(n)
        mask = pos[None] > pos[:, None]
        if sliding:
            mask |= pos[:, None] - pos[None] >= window
        s = s.masked_fill(mask, float("-inf")).softmax(-1)
        o = torch.einsum("hts,shn->thn", s, v).reshape(T, H * n) @ W[p + "attn_output.weight"].T
        x = x + norm(o, W[p + "post_attention_norm.weight"])
        h = norm(x, W[p + "ffn_norm.weight"])
        m = torch.nn.functional.gelu(h @ W[p + "ffn_gate.weight"].T, approximate="tanh") * (
            h @ W[p + "ffn_up.weight"].T
        )
        x = x + norm(m @ W[p + "ffn_down.weight"].T, W[p + "post_ffw_norm.weight"])
    assert "output.weight" not in W  # tied: the output reads the embedding
    return norm(x, W["output_norm.weight"]) @ emb.T


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    path = GEMMA3_270M.path()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(TEXT).input_ids
    mod = GEMMA3_270M._assembler()
    with tempfile.TemporaryDirectory() as tmp:
        ref = reference_logits(mod.assemble(Path(tmp) / mod.MODEL_NAME), ids)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # bf16 weights, fp32 compute
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0]
    print(
        f"{len(ids)} tokens; embed scale {model.model.embed_tokens.embed_scale!r}, tied "
        f"{model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()}, "
        f"final_logit_softcapping {model.config.final_logit_softcapping}, "
        f"attn_logit_softcapping {model.config.attn_logit_softcapping}"
    )
    for t in (0, len(ids) // 2, len(ids) - 1):
        print(f"position {t}: reference top-3 {ref[t].topk(3).indices.tolist()} {ref[t].topk(3).values.tolist()}")
        print(f"            checkpoint top-3 {got[t].topk(3).indices.tolist()} {got[t].topk(3).values.tolist()}")
    diff = (got - ref).abs()
    rel = float((got - ref).norm() / ref.norm())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"all positions: max |logit diff| {diff.max():.4f}, rel. L2 {rel:.2e}, top-1 agreement {agree:.0%}")
    print("next token:", repr(tok.decode(ref[-1].argmax())), "/", repr(tok.decode(got[-1].argmax())))


if __name__ == "__main__":
    main()
