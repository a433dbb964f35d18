"""What the product benchmarks share: model shapes with random weights, CUDA-event timing with the L2 flushed, the
copy-bandwidth yardstick, the SDPA baseline, and markdown tables.

Used by every bench_*.py here, directly or through bench_decode / bench_e2e (run from the
repo root: `python3 benchmarks/bench_X.py`; the script's directory is on sys.path, so `import harness` works).
Importing it needs no GPU; the timing functions do.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

GIB = 2**30

# -- model shapes (Hugging Face Llama configs; weights are random: the timing does not depend on them) ------------

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)
LLAMA_70B = dict(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_attention_heads=64)
# a CPU-sized Llama of the same structure (a check of a script, not a measurement)
SMOKE = dict(
    LLAMA_8B,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=4,
    vocab_size=512,
)


def random_llama(cfg: dict, device: str, dtype: torch.dtype, seed: int = 0, attn: str = "sdpa"):
    """A Hugging Face Llama of config `cfg` with transformers' random initialization, built on `device` in `dtype`
    (what bench_e2e.py times)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()


def write_random_llama(path: Path, cfg: dict, seed: int = 0, device: str = "cuda") -> Path:
    """A random bf16 Llama checkpoint: one safetensors shard per tensor group, an index, a tokenizer.
    Weights ~ N(0, 0.02) (transformers' initializer_range), norms 1, drawn on `device`; one group in memory at a time
    (what bench_convert.py converts)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tale_helpers import byte_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer()
    config = LlamaConfig(**cfg, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, dtype="bfloat16")
    with torch.device("meta"):
        names = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    L = cfg["num_hidden_layers"]
    groups = [[n for n in names if not n.startswith("model.layers.") and "embed" in n]]
    groups += [[n for n in names if n.startswith(f"model.layers.{i}.")] for i in range(L)]
    groups += [[n for n in names if not n.startswith("model.layers.") and "embed" not in n]]
    gen = torch.Generator(device).manual_seed(seed)
    weight_map = {}
    for k, group in enumerate(groups):
        f = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in group:
            if n.endswith("norm.weight"):
                t = torch.ones(names[n], dtype=torch.bfloat16)
            else:
                t = torch.randn(names[n], generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02).cpu()
            tensors[n] = t
            weight_map[n] = f
        save_file(tensors, path / f, metadata={"format": "pt"})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# -- timing --------------------------------------------------------------------------------------------------------

FLUSH: torch.Tensor | None = None  # written before each timed call (evicts L2); init_flush() allocates it


def init_flush(nbytes: int = 256 << 20, device: str = "cuda") -> torch.Tensor:
    """Allocate the buffer timeit() writes before each timed call (256 MB: more than any L2)."""
    global FLUSH
    FLUSH = torch.empty(nbytes, dtype=torch.int8, device=device)
    return FLUSH


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def graphed(fn):
    """A CUDA graph of fn (warmed up on a side stream), returned with fn's output inside the graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = fn()
    return gr, out


def timeit(fn, graph: bool = True, budget_ms: float = 100.0) -> float:
    """Median microseconds of fn (a CUDA-graph replay of it when graph=True), timed with CUDA events, L2 flushed
    before each call when init_flush() was called."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        gr, _ = graphed(fn)
        run = gr.replay
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-5) * 1e3
    reps = int(min(40, max(7, budget_ms / est)))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        if FLUSH is not None:
            FLUSH.zero_()
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3


def median_us(fn, *a, reps: int = 30, warmup: int = 10) -> float:
    """Median microseconds of fn(*a) by CUDA events, eager (host launch time included), L2 not flushed."""
    for _ in range(warmup):
        fn(*a)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn(*a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str = "cuda") -> float:
    """GB/s of a 4 GiB device-to-device copy, bytes read + written: the yardstick every '% of copy' is against."""
    x = torch.randn(1 << 30, device=device)
    y = torch.empty_like(x)
    t = timeit(lambda x=x, y=y: y.copy_(x), graph=False, budget_ms=200)
    bw = 2 * x.numel() * 4 / (t * 1e-6) / 1e9
    del x, y
    return bw


def best_sdpa(B: int, H: int, K: int, n: int, L: int, dtype: torch.dtype, device: str = "cuda") -> tuple[float, str]:
    """(us, name) of the fastest of cuDNN, flash and memory-efficient SDPA for one decode step (one query token) over
    a 16-bit cache of L + 1 tokens: H query heads over K KV heads of head dim n (GQA), CUDA-graph replays: the
    baseline every decode table is against."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(B, H, 1, n, device=device, dtype=dtype)
    kf = torch.randn(B, K, L + 1, n, device=device, dtype=dtype)
    vf = torch.randn_like(kf)
    best = (float("nan"), "none")
    for name, be in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def fn(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, kf, vf, enable_gqa=True)

        try:
            t = timeit(fn)
        except RuntimeError:  # the backend does not take these shapes
            torch.cuda.synchronize()
            continue
        if not t >= best[0]:
            best = (t, name)
    return best


def pct(us: float, mb: float, bw: float) -> str:
    """Microseconds and the share of the copy bandwidth `bw` (GB/s) that moving `mb` MB in them is."""
    return f"{us:.1f} ({mb * 1e6 / (us * 1e-6) / 1e9 / bw * 100:.0f}%)"


def device_name() -> str:
    """The GPU, its SM count, torch and Triton versions, for a table's caption."""
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        tri = f", triton {triton.__version__}"
    except ImportError:
        tri = ""
    return f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}{tri}"


# -- tables --------------------------------------------------------------------------------------------------------


def fmt(x, p: int = 1) -> str:
    """A number to p decimals; NaN (not measured) as n/a."""
    return "n/a" if x != x else f"{x:.{p}f}"


def table_row(*cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def print_row(*cells) -> None:
    print(table_row(*cells), flush=True)


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table: the header, its rule, the rows."""
    return "\n".join([table_row(*header), table_row(*["---"] * len(header))] + [table_row(*r) for r in rows]) + "\n"
