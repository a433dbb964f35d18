"""Where a decode step's GPU time goes (GPU): bench_e2e's random 8B-shaped model with a preset's schedule at a
context, the graph decoder's ms/token, then torch.profiler over 64 replays: per kernel name its time and launches per
step, and the kernels' summed time per step against the wall time (docs/notes.md, "the wgmma score pass profiled").
Side streams overlap, so one kernel's time under them is not additive.

    python3 experiments/decode_step_profile.py --ctx 131072 --preset lowrank
"""

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_e2e as e2e  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tale_runtime import new_cache  # noqa: E402

N = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--preset", default="lowrank", choices=["paper", "lowrank"])
    a = ap.parse_args()
    model, _, tale = e2e.build(False, "cuda", preset=a.preset, key_basis_blocks="group")
    e2e.use(model, tale)
    with torch.inference_mode():
        cache = new_cache(model, static=True, max_length=a.ctx + 4 * N + 16)
        first, pf = e2e.prefill(model, cache, a.ctx)
        step = e2e.tale_step(model, cache, graphs=True)
        ms, toks = e2e.decode(step, first, a.ctx, N)  # its first steps compile and capture
        print(f"{a.preset}: prefill {pf:.1f} s, first {N} graph steps {ms:.2f} ms/token", flush=True)
        ids, pos = toks[:, -1:], torch.full((1, 1), a.ctx + N + 2, dtype=torch.long, device="cuda")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(N):
                ids = step(ids, pos).argmax(-1, keepdim=True)
                pos += 1
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) * 1e3 / N
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot, cnt = collections.defaultdict(float), collections.Counter()
    for e in evs:
        tot[e.name[:90]] += e.time_range.elapsed_us()
        cnt[e.name[:90]] += 1
    busy = sum(tot.values()) / N / 1e3
    print(f"wall {wall:.2f} ms/step, kernels {busy:.2f} ms/step, {len(evs) / N:.0f} kernels/step")
    for name, us in sorted(tot.items(), key=lambda kv: -kv[1])[:28]:
        print(f"{us / N:9.1f} us/step {cnt[name] / N:7.2f}/step  {name}")


if __name__ == "__main__":
    main()
