"""The prefill's memory per prompt token, measured on the CPU: what is alive at its peak, tensor by tensor.

A TorchDispatchMode (`LiveBytes`) counts the bytes of every tensor storage created under it while it is alive (a
storage is freed when its last tensor goes; views and in-place results are not new storage) and keeps what was alive
at the peak, with the module that made each tensor. Run over a TALE model of Llama-3.1-70B widths as one rank of 4
holds them (hidden 8192, 16 query and 2 KV heads of 128, MLP 7168, one latent group of g = 2, the paper schedule) at a
reduced depth, the difference between two prompt lengths is the bytes per prompt token; the cache is what is still
alive after the call (the logits are one row).

    OMP_NUM_THREADS=1 python benchmarks/prefill_memory.py                         # bf16, 2 layers, 512 and 1024
    OMP_NUM_THREADS=1 python benchmarks/prefill_memory.py --dtype float32 --ctx 1024,2048 --chunk 256
    OMP_NUM_THREADS=1 python benchmarks/prefill_memory.py --chunk 0               # the prefill in one piece

`--chunk N`: tokens per piece of the chunked prefill (runtime/model.py, set_prefill_chunk; 0: one piece). Widths
are the per-rank ones of tensor parallelism over 4 GPUs; one process runs them (the TP plan's collectives reduce in
place, tests/test_tp.py checks two gloo ranks against one process). Each length is one model call (~20 s per 1024
tokens at 2 layers in bf16 on one core).
"""

from __future__ import annotations

import argparse
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KiB = 1024


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode and still alive: `now`, `peak`, and `at_peak` (one entry per
    storage alive at the peak: bytes, the module that made it, the op, shape, dtype). `model`: modules whose forward
    names the tensors they make (the innermost one)."""

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__()
        self.now = self.peak = 0
        self.live: dict[int, tuple] = {}  # id of a storage's entry -> (bytes, where, op, shape, dtype)
        self.at_peak: list[tuple] = []
        self.where: list[str] = []
        self.hooks = []
        for name, m in model.named_modules() if model is not None else []:
            self.hooks.append(m.register_forward_pre_hook(lambda m, a, name=name: self._enter(name)))
            self.hooks.append(m.register_forward_hook(lambda m, a, o: self._leave()))
        self._mine: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> its key in live

    def _enter(self, name: str) -> None:
        self.where.append(name)

    def _leave(self) -> None:  # a forward hook that returned something would replace the module's output
        self.where.pop()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()

    def __enter__(self):
        # torch cannot make a CausalBias (a tensor subclass) under a dispatch mode: the runtime's lower-right causal
        # bias (runtime/model.py, made through the module attribute) is made outside this one; it holds no storage
        from torch.nn.attention import bias
        from torch.utils._python_dispatch import _disable_current_modes

        self._bias = made = bias.causal_lower_right

        def outside(*size):
            with _disable_current_modes():
                return made(*size)

        bias.causal_lower_right = outside
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.nn.attention import bias

        bias.causal_lower_right = self._bias
        return super().__exit__(*exc)

    def _drop(self, key: int) -> None:
        self.now -= self.live.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st in self._mine or id(st) in seen or st.nbytes() == 0:
                continue
            key = id(st)
            self._mine[st] = key
            where = self.where[-1] if self.where else ""
            self.live[key] = (st.nbytes(), where, str(func.overloadpacket.__name__), tuple(t.shape), t.dtype)
            weakref.finalize(st, self._drop, key)
            self.now += st.nbytes()
            if self.now > self.peak:
                self.peak = self.now
                self.at_peak = list(self.live.values())
        return out


def alive(entries: list[tuple]) -> dict[tuple, int]:
    """Bytes by (module, op, shape, dtype)."""
    out: dict[tuple, int] = defaultdict(int)
    for b, where, op, shape, dtype in entries:
        out[(where, op, shape, str(dtype).removeprefix("torch."))] += b
    return out


def build(layers: int, dtype: torch.dtype, widths: dict, group: int = 2, vocab: int = 1024):
    """A TALE model of `widths` (random weights, N(0, 0.02), norms 1) at `layers` depth on the CPU, the paper
    schedule as bench_tp.py runs it."""
    from transformers import AutoConfig

    from tale_runtime.artifact import Schedule, uniform_ranks
    from tale_runtime.load import finish, meta_model
    from tale_runtime.spec import Arch, TaleSpec

    cfg = dict(widths, num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=1 << 18)
    config = AutoConfig.for_model("llama", **cfg)
    model, _ = meta_model(config, group, dtype)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02))
    n, K, H, L = config.head_dim, config.num_key_value_heads, config.num_attention_heads, layers
    G, R = K // group, group * n
    vg = min(32, R // 2)
    sched = Schedule(ranks=uniform_ranks(R, L, 0.5, value_group=vg), key_group=vg, value_group=vg, residual=vg)
    finish(model, torch.device("cpu"), TaleSpec(Arch("llama", L, config.hidden_size, H, K, n, group, G, R), sched))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def prefill(model, T: int, static: bool = True, generate: bool = False, model_names: bool = True) -> dict:
    """One prefill of a T-token prompt (a forward with logits_to_keep=1, as generate's; `generate`: model.generate of
    one token) under LiveBytes: peak, held after it (the cache and the logits), and what was alive at the peak."""
    from tale_runtime import new_cache
    from tale_runtime.model import cache_arg

    ids = torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
    cache = new_cache(model, static=static, max_length=T + 1 if static else None)
    mode = LiveBytes(model if model_names else None)
    try:
        with mode:
            if generate:
                out = model.generate(ids, **cache_arg(cache), max_new_tokens=1, do_sample=False)
            else:
                out = model(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
            held = mode.now
    finally:
        mode.close()
    del out
    return dict(T=T, peak=mode.peak, held=held, at_peak=alive(mode.at_peak), cache=cache)


def per_token(a: dict, b: dict) -> dict:
    """Bytes per prompt token between two prefills (b longer): peak, held, and each tensor alive at the peak."""
    dT = b["T"] - a["T"]
    rows = {k: (b["at_peak"].get(k, 0) - a["at_peak"].get(k, 0)) / dT for k in {*a["at_peak"], *b["at_peak"]}}
    # the same tensor at two lengths has two shapes: group by (module, op, dtype) and the rank of its shape
    grouped: dict[tuple, float] = defaultdict(float)
    for (where, op, shape, dtype), v in rows.items():
        grouped[(where, op, len(shape), dtype)] += v
    return dict(peak=(b["peak"] - a["peak"]) / dT, held=(b["held"] - a["held"]) / dT, rows=grouped)


LLAMA_70B_TP4 = dict(
    hidden_size=8192,
    intermediate_size=28672 // 4,
    num_attention_heads=64 // 4,
    num_key_value_heads=8 // 4,
    head_dim=128,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ctx", default="512,1024", help="two prompt lengths")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--chunk", default=None, help="tokens per prefill chunk (0: one piece; default: the runtime's)")
    ap.add_argument("--dynamic", action="store_true", help="the dynamic cache (default: the static cache)")
    ap.add_argument("--generate", action="store_true", help="through model.generate (one new token)")
    ap.add_argument("--top", type=int, default=16, help="rows of the breakdown")
    ap.add_argument("--depth", type=int, default=80, help="layers to extrapolate to (each adds its cache)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model = build(args.layers, dtype, LLAMA_70B_TP4)
    if args.chunk is not None:
        from tale_runtime import set_prefill_chunk

        set_prefill_chunk(model, int(args.chunk))
    a, b = (prefill(model, int(T), not args.dynamic, args.generate) for T in args.ctx.split(","))
    p = per_token(a, b)
    cache = b["cache"].nbytes() / b["T"]
    print(f"{args.layers} layers, {args.dtype}, {'dynamic' if args.dynamic else 'static'} cache, T = {args.ctx}")
    print(f"peak {b['peak'] / 2**20:.1f} MiB at T = {b['T']}; per prompt token: peak {p['peak'] / KiB:.2f} KiB")
    print(
        f"held after (cache + logits) {p['held'] / KiB:.2f} KiB/token; the cache's nbytes {cache / KiB:.2f} KiB/token"
    )
    print("alive at the peak, KiB per prompt token (module, op, rank of shape, dtype):")
    for k, v in sorted(p["rows"].items(), key=lambda kv: -abs(kv[1]))[: args.top]:
        if abs(v) >= 0.01 * KiB:
            print(f"  {v / KiB:8.2f}  {k}")
    transient, cache = (p["peak"] - p["held"]) / KiB, p["held"] / KiB / args.layers
    const = (b["peak"] - p["peak"] * b["T"]) / 2**20
    print(f"transient at the peak: {transient:.2f} KiB/token, plus {const:.1f} MiB whatever the length")
    print(
        f"at {args.depth} layers: {transient:.2f} + {args.depth} x {cache:.3f} (cache per layer) = "
        f"{transient + args.depth * cache:.1f} KiB per prompt token"
    )


if __name__ == "__main__":
    main()
