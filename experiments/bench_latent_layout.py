"""Packed latents channel-major (the static cache's layout with 16-bit scales) against row-major: the same codes and
caches, one device run, correctness against the torch reference first, then CUDA-graph times alternating twice
(docs/notes.md, "Packed latents channel-major").

    PYTHONPATH=/tmp/pk python3 experiments/bench_latent_layout.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode as bd  # noqa: E402

import tale_kernels  # noqa: E402
from tale_runtime.attention import latent_attention as ref  # noqa: E402
from tale_runtime.static_cache import StaticTaleCache  # noqa: E402

scale = bd.N**-0.5
bd.FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
bw = bd.copy_bandwidth()
print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
bad = 0
for L, B in ((32768, 1), (131072, 1), (32768, 4), (131072, 4), (524288, 1)):
    for name in ("paper", "tale"):
        c = StaticTaleCache(bd.preset_schedule(name), 1, bd.K, bd.N, bd.G, bd.R, max_length=L + 64)
        layer = c.layers[0]
        layer.append(
            torch.randn(B, bd.K, L, bd.N, device="cuda", dtype=bd.DT) * 2,
            torch.randn(B, bd.G, L, bd.R, device="cuda", dtype=bd.DT),
        )
        for _ in range(40):
            _, k, h = bd.new_token(B)
            layer.append(k, h)
        q, k, h = bd.new_token(B)
        vc = layer.view()
        assert any(r.lat.bits < 8 and r.lat.data.stride(-2) == 1 for r in vc.regions)
        vr = bd.channel_major(vc, False)
        want = ref(q, k, h, vc, scale)
        e = {}
        for nm, v in (("row", vr), ("cm", vc)):
            bd.poison()
            e[nm] = bd.rel(tale_kernels.latent_attention(q, k, h, v, scale), want)
            bad += e[nm] > bd.TOL
        ts = {"row": [], "cm": []}
        for _ in range(2):
            for nm, v in (("row", vr), ("cm", vc)):
                ts[nm].append(bd.timeit(lambda v=v, q=q, k=k, h=h: tale_kernels.latent_attention(q, k, h, v, scale)))
        nb = layer.nbytes()
        tr, tc = min(ts["row"]), min(ts["cm"])
        print(
            f"{name} {L // 1024}K B={B}: row-major {tr:.1f} us ({100 * nb / tr / 1e3 / bw:.0f}%), channel-major "
            f"{tc:.1f} us ({100 * nb / tc / 1e3 / bw:.0f}%), {tr / tc:.2f}x; all {ts}; err row {e['row']:.1e} "
            f"cm {e['cm']:.1e}",
            flush=True,
        )
        del c, layer, vc, vr
        torch.cuda.empty_cache()
    if B == 1 and L <= 131072:
        t, be = bd.best_sdpa(B, L)
        print(f"SDPA {L // 1024}K B={B}: {t:.1f} us ({be})", flush=True)
# levels alone (synthetic views, 128K B=1)
q, k, h = bd.new_token(1)
for only in ("2bit", "4bit"):
    v = bd.synth_view(1, 131072, only=only)
    for nm, vv in (("row", bd.channel_major(v, False)), ("cm", bd.channel_major(v, True))):
        e = bd.rel(tale_kernels.latent_attention(q, k, h, vv, scale), ref(q, k, h, vv, scale))
        t = min(bd.timeit(lambda vv=vv: tale_kernels.latent_attention(q, k, h, vv, scale)) for _ in range(2))
        nb = bd.view_bytes(vv)
        print(
            f"level {only} 128K B=1 {nm}: {t:.1f} us ({100 * nb / t / 1e3 / bw:.0f}% of copy), err {e:.1e}", flush=True
        )
        bad += e > bd.TOL
print("BAD", bad)
