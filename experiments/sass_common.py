"""What experiments/sass_report.py and lowrank_sass.py read from a kernel compiled for sm_90: its cubin's resource
usage and SASS, with ptxas/cuobjdump from the Triton wheel of this environment."""

import os
import re
import subprocess

import torch
import triton

# a tensor argument's Triton signature type, by its dtype (what the JIT would specialize)
POINTER_TYPES = {
    torch.uint8: "*u8",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float8_e4m3fn: "*fp8e4nv",
}

OP = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", re.M)
BRA = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?BRA (0x[0-9a-f]+)")


def sass(kernel, name: str) -> tuple[str, str, list[tuple[str, str]], list[tuple[int, int]]]:
    """(resource usage, SASS, its (address, opcode) pairs, its loops as (start, end) addresses) of a compiled
    kernel; the cubin, SASS and TTGIR are written to $SASS_OUT (default /tmp) as NAME.*."""
    bd = os.path.dirname(triton.__file__) + "/backends/nvidia/bin/"
    out = os.environ.get("SASS_OUT", "/tmp")
    cub = f"{out}/{name}.cubin"
    with open(cub, "wb") as f:
        f.write(kernel.asm["cubin"])
    res = subprocess.run([bd + "cuobjdump", "-res-usage", cub], capture_output=True, text=True).stdout
    text = subprocess.run([bd + "cuobjdump", "-sass", cub], capture_output=True, text=True).stdout
    with open(f"{out}/{name}.sass", "w") as f:
        f.write(text)
    with open(f"{out}/{name}.ttgir", "w") as f:
        f.write(kernel.asm["ttgir"])
    loops = []
    for m in BRA.finditer(text):  # a backward branch closes a loop
        at, to = int(m.group(1), 16), int(m.group(2), 16)
        if to < at:
            loops.append((to, at))
    return res, text, OP.findall(text), loops
