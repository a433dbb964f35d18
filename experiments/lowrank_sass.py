"""Compile the low-rank-key kernel's launches (kernels/lowrank_attention.py) for sm_90 on a machine without a GPU:
registers, stack (spills), shared memory, SASS instructions and loop lengths of every launch one decode call makes,
at Llama-3.1-8B shapes, 32K tokens, batch 1, over bench_lowrank_kernel.py's view of the lowrank layout.

    python experiments/lowrank_sass.py R0 VALUE_GROUP BASIS      # e.g. 512 64 320h (the preset), 416 32 384h
    KW='{"score_block": 32}' python experiments/lowrank_sass.py 512 64 320h    # kernel options (latent_attention_lowrank)

The launches are captured from latent_attention_lowrank (nothing runs) and compiled as the JIT would specialize them
(tensors and ints divisible by 16 marked so); experiments/sass_common.py reads the cubins (written to $SASS_OUT).
"""

import json
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if len(sys.argv) != 4:
    print(__doc__, file=sys.stderr)
    sys.exit(2)
R0, VG, SPEC = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sys.argv = sys.argv[:1]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_lowrank_kernel as b  # noqa: E402
from sass_common import POINTER_TYPES, sass  # noqa: E402

b.DEV, b.R0, b.VG = "cpu", R0, VG
from tale_kernels import lowrank_attention as lra  # noqa: E402

calls = []


class Cap:
    def __getitem__(self, grid):
        return lambda *a, **kw: calls.append((grid, a, kw))


fn = lra._lr_kernel
lra._lr_kernel = Cap()
lra.supported = lambda *a, **k: None
lra._attn._num_sms = lambda dev: 132
lra._attn._combine = lambda *a, **k: None
lra.interpreting = lambda: False
rot = b.rotary("cpu")
spec = b.parse_spec(SPEC)
q, k, h = b.new_token(1)
v = b.kernel_view(b.lowrank_view(1, 32768, spec, rot))
lra.latent_attention_lowrank(q, k, h, v, 128**-0.5, rope=rot, **json.loads(os.environ.get("KW", "{}")))


def typed(val, path, attrs):
    """The signature type of a runtime argument (a tuple: of each element), and in attrs, at its path, what the JIT
    specializes: pointers and ints divisible by 16."""
    if isinstance(val, tuple):
        return tuple(typed(v, (*path, j), attrs) for j, v in enumerate(val))
    if isinstance(val, torch.Tensor):
        attrs[path] = [["tt.divisibility", 16]]
        return POINTER_TYPES[val.dtype]
    if isinstance(val, float):
        return "fp32"
    if isinstance(val, bool):
        return "i1"
    if val and val % 16 == 0:
        attrs[path] = [["tt.divisibility", 16]]
    return "i64" if abs(val) >= 2**31 else "i32"


for n, (grid, a, kw) in enumerate(calls):
    kw = dict(kw)
    warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
    sig, cx, attrs = {}, {}, {}
    pos = list(a)
    for i, nm in enumerate(fn.arg_names):
        if nm in kw:
            sig[nm] = "constexpr"
            cx[(i,)] = kw[nm]
        else:
            sig[nm] = typed(pos.pop(0), (i,), attrs)
    kern = triton.compile(
        ASTSource(fn, sig, cx, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )
    res, _, ops, loops = sass(kern, f"lowrank_{n}")
    regs, stack = re.findall(r"REG:(\d+)", res), re.findall(r"STACK:(\d+)", res)
    loops = [(at - to) // 16 for to, at in loops]
    print(
        f"launch {n}: grid {grid} PHASE {kw.get('PHASE')} LOWRANK {kw.get('LOWRANK')} BT {kw.get('BT')} warps {warps} "
        f"HPL {kw.get('HPL')} HP {kw.get('HP')} LC {kw.get('LC')} HVB {kw.get('HVB')}: regs {regs} stack {stack} "
        f"shared {kern.metadata.shared} instr {len(ops)} loops {loops}",
        flush=True,
    )
