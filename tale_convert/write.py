"""Write the artifact (DESIGN.md 6): sharded safetensors + index, manifest, model card, and
move it into place in one step."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tale_runtime.artifact import MANIFEST, Schedule, sha256_file, write_json

from . import ConvertError

INDEX = "model.safetensors.index.json"


@dataclass
class Entry:
    name: str
    nbytes: int
    tensor: Callable[[], torch.Tensor]  # built when its shard is written: only one shard is in memory


def parse_size(s: str | int) -> int:
    """'2GB', '500MB', '1.5GiB' or a byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(s), re.I)
    if not m:
        raise ConvertError(f"bad size {s!r}: use e.g. 2GB, 500MB or a byte count")
    base = 1024 if m.group(3) else 1000
    size = int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))
    if size < 1:
        raise ConvertError(f"bad size {s!r}: must be positive")
    return size


def write_tensors(root: Path, entries: list[Entry], shard_size: int) -> dict[str, str]:
    """Shards of at most shard_size bytes (a bigger tensor gets a shard of its own), always with
    an index, as transformers writes them. Returns {file: sha256}."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    weight_map, files = {}, {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({e.name: e.tensor().contiguous() for e in shard}, root / name, metadata={"format": "pt"})
        files[name] = sha256_file(root / name)
        weight_map.update({e.name: name for e in shard})
    write_json(root / INDEX, {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map})
    return files


def model_card(manifest: dict, hub_id: str | None, license: str | None) -> str:
    sched = Schedule.from_dict(manifest["schedule"])
    arch = manifest["architecture"]
    ranks = sched.ranks[0]
    uniform = all(r == ranks for r in sched.ranks)
    front = ["---"]
    if hub_id:
        front.append(f"base_model: {hub_id}")
    front += ["library_name: tale-kv", f"license: {license or 'other'}",
              "tags:", "- tale", "- kv-cache-compression", "- low-rank", "- quantization", f"- {arch['model_type']}", "---"]
    rows = []
    for i, (lv, share) in enumerate(zip(sched.levels, sched.shares())):
        rank = str(ranks[i]) if uniform else f"{min(r[i] for r in sched.ranks)}..{max(r[i] for r in sched.ranks)}"
        who = "middle (oldest non-sink)" if i == 0 else ("most recent" if i == len(sched.levels) - 1 else f"level {i}")
        rows.append(f"| {i} | {who} | {share:.3g} | {rank} / {arch['latent_rank']} | {lv.bits} | {lv.key_bits} |")
    base = hub_id or manifest["base"]["id"]
    body = f"""
# {base} - TALE

A TALE (token-adaptive low-rank KV-cache compression) artifact of `{base}`: the value projection of every layer is
replaced by SVD-LLM-whitened low-rank factors (`self_attn.tale.u_v`, `self_attn.tale.v_v`) over
head groups of {arch['group_size']} KV heads (latent rank R = {arch['latent_rank']}), plus a fused output
matrix (`self_attn.tale.o_fused`). All other weights are the base model's. Nothing is truncated:
the runtime keeps each cached token's value latent at a rank and bit width chosen by its
position, and keys quantized.

## Cache schedule

The first {sched.sinks} tokens (sinks) stay at 16 bits. Other tokens, oldest first:

| level | tokens | share | value rank | value bits | key bits |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Quantization groups: keys {sched.key_group} tokens, latents {sched.value_group} channels; a 16-bit
residual of up to {sched.residual} recent tokens. Nominal compression of the K+V cache versus 16 bits:
**{manifest['nominal_ratio']:.2f}x** (ignoring sinks, scales and zero points).

## Use

```bash
pip install tale-kv
tale-run <this repo or directory> --prompt "Hello"
```

Made with `tale-convert` {manifest['tool']['version']}; calibration: {manifest['calibration']['samples']} x
{manifest['calibration']['seq_len']} tokens from {manifest['calibration']['source']}. See `tale_config.json` for the full record.
"""
    return "\n".join(front) + "\n" + body


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse before any work: an existing output needs --overwrite, and only a TALE artifact
    (or an empty directory) may be replaced."""
    if not out.exists():
        if not out.parent.is_dir():
            raise ConvertError(f"output parent directory does not exist: {out.parent}")
        return
    if not overwrite:
        raise ConvertError(f"{out} exists (pass --overwrite to replace it)")
    if not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file()):
        raise ConvertError(f"refusing to overwrite {out}: it is not a TALE artifact")


def publish(tmp: Path, out: Path) -> None:
    """Move the finished temp dir into place; an old artifact is replaced only once the new one is complete."""
    if out.exists():
        old = out.with_name(f"{out.name}.tmp-{os.getpid()}-old")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def copy_model_files(root: Path, config, tokenizer, generation_config, dtype: torch.dtype) -> None:
    """config.json (dtype set to what is stored), tokenizer files, generation_config.json."""
    config.dtype = dtype
    config.save_pretrained(root)
    tokenizer.save_pretrained(root)
    generation_config.save_pretrained(root)
