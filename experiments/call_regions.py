"""What each region of the low-rank-key kernel's call costs (GPU): one layer's decode attention at 128K batch 1 on
Llama-3.1-8B shapes (the `lowrank` layout of benchmarks/bench_lowrank_kernel.py, a key basis per latent group),
timed as CUDA-graph replays over all regions, over all on one stream, and over subsets of them, with the paper
preset's CUDA kernel in the same process (docs/notes.md, "the wgmma score pass profiled").

    python3 experiments/call_regions.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_lowrank_kernel as b  # noqa: E402

from tale_runtime.regions import LayerView  # noqa: E402

L = 131072


def main() -> None:
    rot = b.rotary(b.DEV)
    q, k, h = b.new_token(1)
    print("paper", {name: round(us, 1) for name, us in b.paper_times(1, L, q, k, h).items()})
    v = b.kernel_view(b.lowrank_view(1, L, b.parse_spec("304g"), rot))
    names = ("sinks", "low-rank level", "recent level", "newest tokens")
    print("regions", [(n, r.capacity) for n, r in zip(names, v.regions)])
    for label, keep, kw in [
        ("all regions", (0, 1, 2, 3), {}),
        ("all, one stream", (0, 1, 2, 3), dict(concurrent=False)),
        ("sinks + low-rank level", (0, 1), {}),
        ("low-rank level only", (1,), {}),
        ("sinks + recent + newest", (0, 2, 3), {}),
    ]:
        vv = LayerView([v.regions[i] for i in keep], v.next_pos)
        us = b.safe_time(lambda vv=vv, kw=kw: b.attend(q, k, h, vv, rot, score_cuda=True, **kw))
        print(f"{label:26s} {us:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
