"""The decode kernel's error against the float32 torch reference, per preset, draw and operand type (GPU).

    PYTHONPATH=/tmp/pk python3 experiments/kernel_error.py [--draws 3]

For each preset's static cache (bench_decode.preset_schedule: a prefill of L random tokens, keys x 2, then 40
decode steps) at 128K batch 1 and 32K batch 4: the kernel (float16 operands: bf16 caches store float16 metadata)
against the reference; on the first draw of the paper preset also the reference run on the
view with keys and/or latents dequantized to bf16 (or fp16) first, i.e. what a kernel with those operands must
compute at best. docs/notes.md ("float16 metadata") has the numbers.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_decode as bd  # noqa: E402

import tale_kernels  # noqa: E402
from tale_runtime.quant import QTensor, dequantize  # noqa: E402
from tale_runtime.regions import LayerView, Region  # noqa: E402
from tale_runtime.static_cache import StaticTaleCache  # noqa: E402


def rounded(v: LayerView, keys: torch.dtype, lat: torch.dtype) -> LayerView:
    """v with every region's keys and latents dequantized, rounded to `keys` / `lat`, held as 16-bit parts."""

    def raw(t, dt):
        return QTensor(dequantize(t, torch.float32).to(dt), None, None, 16, 1, -1)

    regions = [Region(raw(r.keys, keys), raw(r.lat, lat), r.rank, r.pos, r.length) for r in v.regions]
    return LayerView(regions, v.next_pos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_error.py: needs a CUDA device")
    s = bd.N**-0.5
    for L, B in ((131072, 1), (32768, 4)):
        for name in ("paper", "tale"):
            for seed in range(args.draws):
                torch.manual_seed(seed)
                c = StaticTaleCache(bd.preset_schedule(name), 1, bd.K, bd.N, bd.G, bd.R, max_length=L + 64)
                layer = c.layers[0]
                layer.append(
                    torch.randn(B, bd.K, L, bd.N, device=bd.DEV, dtype=bd.DT) * 2,
                    torch.randn(B, bd.G, L, bd.R, device=bd.DEV, dtype=bd.DT),
                )
                for _ in range(40):
                    _, k, h = bd.new_token(B)
                    layer.append(k, h)
                q, k, h = bd.new_token(B)
                v = layer.view()
                ref = bd.ref_attention(q, k, h, v, s)
                e = bd.rel(tale_kernels.latent_attention(q, k, h, v, s), ref)
                line = f"{name} {L // 1024}K B={B} draw {seed}: kernel {e:.2e}"
                if seed == 0 and name == "paper":
                    f32, b16, f16 = torch.float32, torch.bfloat16, torch.float16
                    for what, kd, ld in (
                        ("keys+lat", b16, b16),
                        ("keys", b16, f32),
                        ("lat", f32, b16),
                        ("fp16", f16, f16),
                    ):
                        e = bd.rel(bd.ref_attention(q, k, h, rounded(v, kd, ld), s), ref)
                        line += f"; reference with {what} rounded {e:.2e}"
                print(line, flush=True)
                del c, layer, v
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
