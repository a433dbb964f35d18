"""What the vLLM model classes read from a TALE artifact: the checked manifest and the tensors, renamed and shaped
for vLLM's layers.

The artifact is read as tale_runtime.load reads it: manifest, then every file against its sha256, then only the
shards the verified index names. vLLM's own directory reader is not used (it would read unverified files).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tale_runtime.artifact import ArtifactError, Schedule, read_manifest, schedule_of, verify_files
from tale_runtime.paged import BITS, PagedFormat
from tale_runtime.remote_code import base_dict, is_tale
from tale_runtime.spec import Arch

# the per-layer tensors the attention needs together (they may sit in different shards)
_ATTN = re.compile(
    r"^(model\.layers\.(\d+)\.self_attn\.)(v_proj\.weight|v_proj\.bias|o_proj\.weight|o_proj\.bias|tale\.\w+)$"
)


@dataclass(frozen=True)
class Source:
    root: Path
    model_type: str  # the base model's (a family of tale_runtime.families.SUPPORTED)
    own_type: bool  # config.json says model_type "tale" (artifacts before it carry the base's config.json)
    arch: Arch
    ranks: tuple[int, ...]  # value rank r per layer: the head size of vLLM's values
    verified: frozenset[str] | None  # the files checked against the manifest (None: not checked)
    # the packed cache (stage 2): (key bits, latent bits) per layer; None: keys and latents in vLLM's 16-bit cache
    bits: tuple[tuple[int, int], ...] | None = None
    sinks: int = 0  # the packed cache's 16-bit sinks per request

    def same_head_size(self) -> bool:
        """Keys and values of one head size in every layer: what vLLM's ordinary attention backends hold."""
        return self.bits is not None or all(r == self.arch.head_dim for r in self.ranks)

    def paged_format(self, layer: int, dtype: torch.dtype) -> PagedFormat | None:
        """The slot of `layer` in the packed cache (None: stage 1). Keys and latents per token over groups of 32
        channels (16 or 8 where 32 does not fit a row or its packed planes), scales and zeros in 16 bits
        (tale_runtime.paged)."""
        if self.bits is None:
            return None
        kb, hb = self.bits[layer]
        n, g, r = self.arch.head_dim, self.arch.group_size, self.ranks[layer]
        # each row's group on its own: the widest that divides it without straddling its packed planes
        kg = next((c for c in (32, 16, 8) if _fits(n, g, r, kb, 16, c, 32)), 32)
        hg = next((c for c in (32, 16, 8) if _fits(n, g, r, 16, hb, 32, c)), 32)
        return PagedFormat(n, g, r, kb, hb, kg, hg, dtype)  # ValueError where none fits (a rank not a multiple of 8)


def _fits(*args) -> bool:
    try:
        PagedFormat(*args)
        return True
    except ValueError:
        return False


def packed_bits(kv_cache: str, sched: Schedule, num_layers: int, exact_layers: int) -> tuple[tuple[int, int], ...]:
    """(key bits, latent bits) per layer: kv_cache "level0" (the schedule's level 0) or "k<bits>v<bits>" (e.g.
    "k4v4"); the first and last `exact_layers` layers at 16 bits."""
    if kv_cache == "level0":
        kb, hb = sched.levels[0].key_bits, sched.levels[0].bits
    elif m := re.fullmatch(r"k(\d+)v(\d+)", str(kv_cache)):
        kb, hb = int(m.group(1)), int(m.group(2))
    else:
        raise ValueError(f"kv cache must be 'level0' or 'k<bits>v<bits>' (e.g. 'k4v4'), got {kv_cache!r}")
    if kb not in BITS or hb not in BITS:
        raise ValueError(
            f"the packed cache holds keys and latents at {', '.join(map(str, BITS))} bits, not keys {kb} / latents {hb}"
        )
    if not (isinstance(exact_layers, int) and 0 <= exact_layers):
        raise ValueError(f"exact layers must be a whole number >= 0, got {exact_layers!r}")
    return tuple(
        (16, 16) if i < exact_layers or i >= num_layers - exact_layers else (kb, hb) for i in range(num_layers)
    )


def value_ranks(value_rank: int | str, arch: Arch, level0: list[int]) -> tuple[int, ...]:
    """One value rank per layer: "full" (R, the exact setting), "level0" (the manifest's level-0 ranks), or r."""
    R, L = arch.latent_rank, arch.num_layers
    if value_rank == "full":
        return (R,) * L
    if value_rank == "level0":
        return tuple(level0)
    try:
        r = int(value_rank)
    except (TypeError, ValueError):
        raise ValueError(f"value rank must be 'full', 'level0' or a whole number, got {value_rank!r}") from None
    if not 1 <= r <= R:
        raise ValueError(f"value rank {r} is outside [1, {R}] (R = group size x head dim = {R})")
    return (r,) * L


def open_artifact(
    path: str | os.PathLike,
    value_rank: int | str = "full",
    verify: bool = True,
    kv_cache: str | None = None,
    exact_layers: int = 1,
    rotate: str = "hadamard",
    sinks: int | None = None,
) -> Source:
    """The checked artifact at `path` (a directory or a Hub repo id); ArtifactError/ValueError in one line.

    value_rank: "full" (each layer's full latent rank R: the exact setting), "level0" (the manifest's level-0 rank of
    each layer, for every token) or a rank r <= R for every layer. verify: check every file's sha256.
    kv_cache: None (stage 1: keys and latents in vLLM's 16-bit cache) or the packed cache (stage 2, TALE's own
    attention backend): "level0" (the artifact's level-0 key and latent bits) or "k<bits>v<bits>" (e.g. "k4v4"), each
    layer's latents kept at its value rank; the first and last `exact_layers` layers at 16 bits (packed_bits).
    rotate: "hadamard" (queries and keys rotated after RoPE before the keys are quantized per token, q.k unchanged)
    or "none". sinks: the first tokens of each request kept at 16 bits beside the packed pages (None: the artifact's
    schedule's sinks; 0: none).
    """
    from tale_runtime.load import SUPPORTED, resolve

    root = resolve(path)
    manifest = read_manifest(root)
    verified = frozenset(verify_files(root, manifest)) if verify else None
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise ArtifactError(f"{root}: missing or corrupt config.json") from None
    own_type = isinstance(config, dict) and is_tale(config)
    if isinstance(config, dict):
        config = base_dict(config)  # model_type "tale" -> the base's (tale_runtime.remote_code)
    if not isinstance(config, dict) or config.get("model_type") not in SUPPORTED:
        got = config.get("model_type") if isinstance(config, dict) else None
        raise ArtifactError(f"{root}: model_type {got!r} is not supported (only {', '.join(SUPPORTED)})")
    try:
        arch = Arch.from_manifest(manifest)
        sched = schedule_of(manifest)
        sched.validate(arch.latent_rank, arch.num_layers)
    except (ArtifactError, KeyError, TypeError) as e:
        raise ArtifactError(f"{root}: malformed manifest ({e})") from None
    ranks = value_ranks(value_rank, arch, [rs[0] for rs in sched.ranks])
    if (q := sched.latent_rotation) and any(r % q for r in ranks):
        # latents rotated in Hadamard blocks at conversion: a cut inside a block mixes in the dropped channels
        raise ValueError(
            f"value rank {ranks[0]} cuts inside the latents' rotation blocks of {q} (use a multiple of {q})"
        )
    bits = None if kv_cache is None else packed_bits(kv_cache, sched, arch.num_layers, exact_layers)
    if bits is not None and "sliding_attention" in (config.get("layer_types") or []):
        raise ValueError(
            f"the packed cache (kv_cache={kv_cache!r}) has no sliding-window attention, which "
            f"{config['model_type']}'s sliding layers need: serve it with kv_cache=None"
        )
    if rotate not in ("hadamard", "none"):
        raise ValueError(f"rotate must be 'hadamard' or 'none', got {rotate!r}")
    if sinks is None:
        sinks = sched.sinks if bits is not None else 0
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise ValueError(f"sinks must be a whole number >= 0, got {sinks!r}")
    if sinks and bits is None:
        raise ValueError("sinks are kept by the packed cache only (kv_cache=...)")
    src = Source(root, config["model_type"], own_type, arch, ranks, verified, bits, sinks)
    if bits is not None:
        for i in range(arch.num_layers):
            try:
                src.paged_format(i, torch.float32)
            except ValueError as e:
                raise ValueError(f"layer {i}: {e}") from None
    if not src.same_head_size() and len(set(ranks)) > 1:
        # vLLM's different-head-size backends (TRITON_ATTN_DIFFKV, FLASH_ATTN_DIFFKV) hold one value size per model
        raise ValueError(f"value ranks {sorted(set(ranks))} differ across layers: vLLM holds one value head size")
    return src


def check_backend(src: Source, cpu: bool) -> None:
    """vLLM's CPU attention holds keys and values at one head size: a value rank other than the head dim needs a
    different-head-size backend, which vLLM has on CUDA only."""
    if cpu and not src.same_head_size():
        n = src.arch.head_dim
        raise ValueError(
            f"value rank {src.ranks[0]} != head dim {n}: vLLM's CPU attention holds keys and values at one head size "
            f"(serve with value rank {n}, or on a GPU)"
        )


def shards(src: Source) -> list[str]:
    """The safetensors files the (verified) index names."""
    index = src.root / "model.safetensors.index.json"
    if not index.is_file():
        files = ["model.safetensors"]
    else:
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise ArtifactError(f"{index}: corrupt safetensors index") from None
        if src.verified is not None and index.name not in src.verified:
            raise ArtifactError(f"{src.root}: {index.name} is not covered by the manifest checksums")
    for f in files:
        if src.verified is not None and (not isinstance(f, str) or f not in src.verified):
            raise ArtifactError(f"{src.root}: the index names {f!r}, which the manifest does not list (refused unread)")
    return files


def tensors(src: Source) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the base model's names for vLLM's load_weights: every tensor as stored, but per layer the
    value projection is the latent projection cut to rank r (v_proj.weight [K*r, d]) and the output projection is
    O^r cut to the same ranks (o_proj.weight [d, H*r]), see attention_tensors."""
    held: dict[int, dict[str, torch.Tensor]] = {}
    for f in shards(src):
        try:
            with safe_open(src.root / f, framework="pt", device="cpu") as st:
                for name in st.keys():
                    m = _ATTN.match(name)
                    if m:
                        held.setdefault(int(m.group(2)), {})[m.group(3)] = st.get_tensor(name)
                    else:
                        yield from unfused(name, st.get_tensor(name), src.arch)
        except (SafetensorError, OSError) as e:
            raise ArtifactError(f"{src.root / f}: unreadable safetensors file ({e})") from None
    if sorted(held) != list(range(src.arch.num_layers)):
        raise ArtifactError(f"{src.root}: the tensors cover layers {sorted(held)}, the manifest {src.arch.num_layers}")
    for i in sorted(held):
        prefix = f"model.layers.{i}.self_attn."
        r = None if src.bits is not None else src.ranks[i]  # packed: the full-rank latents (the slot keeps r)
        for name, t in attention_tensors(held.pop(i), src.arch, r, f"{src.root}: layer {i}"):
            yield prefix + name, t


def unfused(name: str, t: torch.Tensor, a: Arch) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's fused weights in the names of vLLM's Llama layer, whose loader stacks q/k/v and gate/up itself: qkv_proj
    [(H + 2K) n, d] -> q_proj, k_proj (its value rows are replaced by the latent projection: attention_tensors);
    gate_up_proj [2 I, d] -> gate_proj, up_proj. Any other tensor as it is."""
    if name.endswith(".self_attn.qkv_proj.weight"):
        q, k, _ = t.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim])
        stem = name[: -len("qkv_proj.weight")]
        yield stem + "q_proj.weight", q
        yield stem + "k_proj.weight", k
    elif name.endswith(".mlp.gate_up_proj.weight"):
        gate, up = t.chunk(2)
        stem = name[: -len("gate_up_proj.weight")]
        yield stem + "gate_proj.weight", gate
        yield stem + "up_proj.weight", up
    else:
        yield name, t


def attention_tensors(
    t: dict[str, torch.Tensor], a: Arch, r: int | None, where: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's value and output projections for vLLM (DESIGN.md 3-4), from u_v [G, d, R] and o_fused [d, H*R].

    KV head m's value is the latent of its group c = m // g cut to rank r: x A_c[:, :r] (the g heads of a group hold
    the same latent). Query head q's latent output z_q [r] maps to the hidden size through rows q*R .. q*R + r of O^r.
    r None (the packed cache): each group's latent once at full rank, v_proj.weight [G*R, d], and O^R whole.
    A value bias b passes through attention unchanged (softmax weights sum to 1): its output concat_q b_m(q) W_O
    becomes the o_proj bias, and the value (latent) bias is zero."""
    for need in ("tale.u_v", "tale.o_fused"):
        if need not in t:
            raise ArtifactError(f"{where}: lacks {need} (not a TALE artifact, or an incomplete one)")
    H, K, n, g, G, R, d = (
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        a.group_size,
        a.num_groups,
        a.latent_rank,
        a.hidden_size,
    )
    u, o = t["tale.u_v"], t["tale.o_fused"]
    if tuple(u.shape) != (G, d, R) or tuple(o.shape) != (d, H * R):
        raise ArtifactError(f"{where}: u_v {tuple(u.shape)} / o_fused {tuple(o.shape)} do not match the manifest")
    if r is None:  # [G, d, R] -> [G*R, d] (G*R = K*n: vLLM's value rows at head size n)
        rows = G * R
        yield "v_proj.weight", u.transpose(1, 2).reshape(rows, d).contiguous()
        yield "o_proj.weight", o
    else:  # [G, d, R] -> per KV head [K, r, d] (nn.Linear layout) -> [K*r, d]
        rows = K * r
        yield "v_proj.weight", u[:, :, :r].transpose(1, 2).repeat_interleave(g, dim=0).reshape(rows, d).contiguous()
        yield "o_proj.weight", o.view(d, H, R)[:, :, :r].reshape(d, H * r).contiguous()
    bias = t.get("v_proj.bias")
    if bias is not None:
        yield "v_proj.bias", torch.zeros(rows, dtype=bias.dtype)
        w_o = t["o_proj.weight"].double()  # [d, H*n]
        b = bias.double().view(K, 1, n).expand(K, H // K, n).reshape(H * n)
        out = w_o @ b
        if "o_proj.bias" in t:
            out = out + t["o_proj.bias"].double()
        yield "o_proj.bias", out.to(bias.dtype)
    elif "o_proj.bias" in t:
        yield "o_proj.bias", t["o_proj.bias"]
