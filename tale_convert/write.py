"""Write the artifact (DESIGN.md 6): sharded safetensors + index, model files, and the move of
the finished directory into place."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tale_runtime.artifact import MANIFEST, sha256_file, write_json

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
        os.chmod(root / name, 0o644)  # safetensors creates it owner-only; an artifact is meant to be shared
        files[name] = sha256_file(root / name)
        weight_map.update({e.name: name for e in shard})
    write_json(root / INDEX, {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map})
    return files


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse before any work: an existing output needs --overwrite, and only a TALE artifact
    (or an empty directory) may be replaced."""
    if not out.exists():
        if out.parent.exists() and not out.parent.is_dir():
            raise ConvertError(f"cannot write {out}: {out.parent} is not a directory")
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
