"""tale-convert at scale on the GPU: time, host peak RSS and GPU peak memory, flat as models get deeper.

1. An 8B-shaped random Llama (Llama-3.1-8B shapes: 32 layers, hidden 4096, 32 query / 8 KV heads,
   intermediate 14336, vocab 128256, bf16; 16 GB) converted end to end, `--device cuda --group 4`.
2. 70B layer shapes (hidden 8192, 64 / 8 heads, intermediate 28672, vocab 128256, bf16) with 2, 4
   and 8 layers: seconds per layer, host and GPU peaks, and the 80-layer time extrapolated by a
   linear fit of the total time over the number of layers.

The random checkpoints are written to local disk one shard per layer (plus one for the embeddings
and one for norm + head), one tensor group at a time, never whole in memory; the 2- and 4-layer
checkpoints link to the 8-layer one's shards. Each conversion runs in a fresh process, so its
peak RSS (getrusage) is its own; the GPU peak is torch.cuda.max_memory_allocated. Calibration:
the converter's defaults, 64 sequences x 512 tokens of the bundled corpus (byte-level tokenizer).
Before timing, the artifact of the smallest model is checked: A_c B_c = W_c, O^r blocks, the
kept v_proj, and prefill logits through tale_runtime equal to the base model's (torch.equal, bf16).

    python benchmarks/bench_convert.py --work /tmp/bench-convert --report docs/convert-bench.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import harness
import torch
from harness import GIB

from tale_runtime.model import cache_arg

LLAMA_8B, LLAMA_70B = harness.LLAMA_8B, harness.LLAMA_70B
SMOKE_8B = harness.SMOKE
SMOKE_70B = dict(SMOKE_8B, hidden_size=512, num_attention_heads=8)
DEVICE = "cuda"


def write_random_llama(path: Path, cfg: dict, seed: int = 0) -> Path:
    """harness.write_random_llama on DEVICE (read at call time: --smoke and the memory test set it to "cpu")."""
    return harness.write_random_llama(path, cfg, seed, device=DEVICE)


def first_layers(src: Path, dst: Path, layers: int) -> Path:
    """A `layers`-deep copy of checkpoint `src`: config, index and links to its shards."""
    from transformers import AutoConfig

    dst.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers = layers
    config.save_pretrained(dst)
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    keep = {n: f for n, f in wm.items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers}
    for f in set(keep.values()):
        (dst / f).symlink_to(src / f)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, dst / f.name)
    return dst


def convert_once(src: Path, out: Path, args) -> dict:
    """One conversion in a fresh process (its own peak RSS); returns the report as a dict."""
    cmd = [
        sys.executable,
        __file__,
        *(["--smoke"] if DEVICE == "cpu" else []),
        "--one",
        str(src),
        str(out),
        "--group",
        str(args.group),
        "--device",
        DEVICE,
        "--samples",
        str(args.samples),
        "--seq-len",
        str(args.seq_len),
        "--preset",
        args.preset,
        *(["--key-basis-blocks", args.key_basis_blocks] if args.key_basis_blocks else []),
    ]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode:
        raise RuntimeError(f"conversion of {src} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    rep["wall"] = wall
    return rep


def one(src: str, out: str, args) -> None:
    from tale_convert.convert import Options, convert

    opts = Options(
        group=args.group,
        device=DEVICE,
        samples=args.samples,
        seq_len=args.seq_len,
        overwrite=True,
        preset=args.preset,
        key_basis_blocks=args.key_basis_blocks,
    )
    rep = convert(src, out, opts)
    size = sum(f.stat().st_size for f in Path(out).iterdir())
    print(
        json.dumps(
            {
                "seconds": rep.seconds,
                "layers": [lr.seconds for lr in rep.layers],
                "peak_rss": rep.peak_rss,
                "peak_device": rep.peak_device or 0,
                "reserved": torch.cuda.max_memory_reserved() if DEVICE == "cuda" else 0,
                "artifact_bytes": size,
            }
        )
    )


@torch.no_grad()
def check(src: Path, art: Path) -> list[str]:
    """The artifact against the source, from the written files; prefill logits exact on CUDA."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tale_runtime import load, new_cache
    from tale_runtime.artifact import O_FUSED, U_V, V_V, read_manifest, verify_files

    m = read_manifest(art)
    verify_files(art, m)
    a = m["architecture"]
    H, K, n, g, R = a["num_heads"], a["num_kv_heads"], a["head_dim"], a["group_size"], a["latent_rank"]
    idx = json.loads((art / "model.safetensors.index.json").read_text())["weight_map"]
    p = "model.layers.0.self_attn."

    def get(root, name, index):
        with safe_open(root / index[name], "pt", device=DEVICE) as st:
            return st.get_tensor(name).double()

    src_idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    W = get(src, p + "v_proj.weight", src_idx).T
    Wo = get(src, p + "o_proj.weight", src_idx).T
    A, B, Of = get(art, p + U_V, idx), get(art, p + V_V, idx), get(art, p + O_FUSED, idx)
    assert torch.equal(get(art, p + "v_proj.weight", idx).T, W), "v_proj.weight is kept unchanged"
    errs = [
        float((A[c] @ B[c] - W[:, c * R : (c + 1) * R]).norm() / W[:, c * R : (c + 1) * R].norm())
        for c in range(K // g)
    ]
    rep = H // K
    oerr = max(
        float(
            (
                Of.T[q * R : (q + 1) * R]
                - B[(q // rep) // g, :, ((q // rep) % g) * n : ((q // rep) % g + 1) * n] @ Wo[q * n : (q + 1) * n]
            ).norm()
            / Of.T[q * R : (q + 1) * R].norm()
        )
        for q in range(H)
    )
    lines = [
        f"layer 0: max_c ||A_c B_c - W_c|| / ||W_c|| = {max(errs):.2e} (bf16 factors), "
        f"max_q O^r block rel. error = {oerr:.2e}"
    ]
    assert max(errs) < 2e-2 and oerr < 2e-2, lines
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, attn_implementation="sdpa").to(DEVICE).eval()
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    want = base(ids).logits
    del base
    model, _ = load(art, device=DEVICE, dtype=torch.bfloat16)
    same = torch.equal(model(ids, **cache_arg(new_cache(model))).logits, want)
    lines.append(f"prefill logits (512 tokens, bf16, {DEVICE}) equal to the base model's: {same}")
    assert same, lines
    return lines


def disk_speed(work: Path) -> str:
    f = work / "dd.tmp"
    t = time.perf_counter()
    with open(f, "wb") as fh:
        block = os.urandom(1 << 24)
        for _ in range(128):  # 2 GiB
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    s = time.perf_counter() - t
    f.unlink()
    return f"{2 / s:.2f} GiB/s (2 GiB written with fsync)"


def drop_caches() -> bool:
    """Source reads come from disk, not from the page cache they were just written into."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def deep_rows(work: Path, args, row) -> list[str]:
    """The 70B-shaped conversions (one checkpoint of max(--deep) layers, its first layers for the others); the check
    lines of the shallowest artifact."""
    lines = []
    t = time.perf_counter()
    deep = write_random_llama(work / "llama70b", dict(LLAMA_70B, num_hidden_layers=max(args.deep)), seed=1)
    print(f"70B-shaped checkpoint ({max(args.deep)} layers) written in {time.perf_counter() - t:.1f} s", flush=True)
    for L in sorted(args.deep):
        src = deep if L == max(args.deep) else first_layers(deep, work / f"llama70b-{L}", L)
        cold = drop_caches()
        out = work / f"llama70b-{L}-tale"
        row(f"70B layer shapes{'' if cold else ' (warm cache)'}", L, convert_once(src, out, args))
        if L == min(args.deep):
            lines += check(src, out)
            print(lines[-2:], flush=True)
        shutil.rmtree(out)

    return lines


def main() -> None:
    from tale_convert.options import Options

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-convert"))
    ap.add_argument("--report", type=Path, default=None, help="markdown table written here")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--deep", type=int, nargs="+", default=[2, 4, 8], help="70B-shaped depths")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="small shapes on the CPU: checks the script only")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default=Options().preset, help="tale-convert's --preset")
    ap.add_argument("--key-basis-blocks", default=None, help="tale-convert's --key-basis-blocks (joint, head)")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("SRC", "OUT"))
    args = ap.parse_args()
    global DEVICE, LLAMA_8B, LLAMA_70B
    DEVICE = "cpu" if args.smoke else args.device
    if args.smoke:
        LLAMA_8B, LLAMA_70B = SMOKE_8B, SMOKE_70B
    if args.one:
        return one(*args.one, args)

    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    lines = [
        f"device: {dev}; torch {torch.__version__}; local disk {disk_speed(work)}; "
        f"calibration {args.samples} x {args.seq_len} tokens; --group {args.group} --preset {args.preset}"
        f"{' --key-basis-blocks ' + args.key_basis_blocks if args.key_basis_blocks else ''}; bf16 in and out"
    ]
    print(lines[0], flush=True)
    rows = []

    def row(name, L, rep):
        per = sorted(rep["layers"])[len(rep["layers"]) // 2]
        r = dict(
            name=name,
            L=L,
            total=rep["seconds"],
            wall=rep["wall"],
            per_layer=per,
            rss=rep["peak_rss"] / GIB,
            gpu=rep["peak_device"] / GIB,
            reserved=rep["reserved"] / GIB,
            size=rep["artifact_bytes"] / 1e9,
        )
        rows.append(r)
        print(json.dumps(r), flush=True)

    if not args.skip_8b:
        t = time.perf_counter()
        src = write_random_llama(work / "llama8b", LLAMA_8B)
        print(
            f"8B checkpoint written in {time.perf_counter() - t:.1f} s; page cache dropped: {drop_caches()}", flush=True
        )
        row("8B shapes (Llama-3.1-8B)", LLAMA_8B["num_hidden_layers"], convert_once(src, work / "llama8b-tale", args))
        shutil.rmtree(work / "llama8b-tale")
        shutil.rmtree(src)

    if not args.skip_70b:
        lines += deep_rows(work, args, row)

    fit = [r for r in rows if r["name"].startswith("70B")]
    if len(fit) >= 2:
        xs, ys = [r["L"] for r in fit], [r["total"] for r in fit]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        t80 = my + slope * (80 - mx)
        lines.append(
            f"70B extrapolated to 80 layers: {t80:.0f} s = {t80 / 60:.1f} "
            f"min (fit: {my - slope * mx:.1f} s + {slope:.2f} s per layer)"
        )
    table = [
        "| model | layers | total (s) | wall incl. start-up (s) | median s / layer | host peak RSS (GiB) "
        "| GPU peak allocated (GiB) | GPU reserved (GiB) | artifact (GB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['name']} | {r['L']} | {r['total']:.1f} | {r['wall']:.1f} | {r['per_layer']:.2f} | {r['rss']:.2f} "
        f"| {r['gpu']:.2f} | {r['reserved']:.2f} | {r['size']:.1f} |"
        for r in rows
    ]
    text = "\n".join(["\n".join(f"- {ln}" for ln in lines), "", *table, ""])
    print(text, flush=True)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
