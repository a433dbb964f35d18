"""Host memory of tale-convert does not grow with depth: it streams one layer at a time (the key basis too: its
statistics are gathered in the same layer pass and its file is written layer by layer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_convert  # noqa: E402  (the benchmark's random checkpoint writer)
import pytest  # noqa: E402

# converts 2-, 4- and 8-layer wide models in fresh processes: about a minute of CPU time (make test-slow)
pytestmark = pytest.mark.slow

# Wide enough that a layer (30 MB in bf16) dwarfs the noise of a fresh process's RSS.
WIDE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=512,
    max_position_embeddings=512,
)
CHILD = """
import json, resource, sys
from tale_convert.convert import Options, convert
r = convert(sys.argv[1], sys.argv[2], Options(group=2, device="cpu", samples=4, seq_len=64, key_basis=True))
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "layers": len(r.layers)}))
"""


def peak_rss(src: Path, out: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out)], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])["rss"]


def test_peak_rss_is_flat_in_depth(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_convert, "DEVICE", "cpu")
    deep = bench_convert.write_random_llama(tmp_path / "deep", dict(WIDE, num_hidden_layers=12))
    shallow = bench_convert.first_layers(deep, tmp_path / "shallow", 3)
    size = {
        L: sum(
            (d / f).stat().st_size
            for f in {*json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()}
        )
        for L, d in ((3, shallow), (12, deep))
    }
    assert size[12] - size[3] > 250e6  # the model grows 4x in depth, by >0.25 GB
    rss3 = peak_rss(shallow, tmp_path / "t3")
    rss12 = peak_rss(deep, tmp_path / "t12")
    # a whole-model converter would grow by at least size[12] - size[3]; streaming stays within 10% of that
    assert rss12 - rss3 < 0.1 * (size[12] - size[3]), (rss3 / 2**20, rss12 / 2**20, size)
    print(
        f"peak RSS: 3 layers {rss3 / 2**20:.0f} MiB, 12 layers {rss12 / 2**20:.0f} MiB; "
        f"checkpoints {size[3] / 1e6:.0f} MB vs {size[12] / 1e6:.0f} MB"
    )
