"""Load a tale-convert artifact (a directory or a Hub repo id) into a ready model."""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import key_basis
from .artifact import ArtifactError, Level, Schedule, read_manifest, schedule_of, verify_files
from .model import CACHE_KW, TaleAttention, TaleCache, cache_arg
from .static_cache import StaticTaleCache

SUPPORTED = ("llama", "mistral", "qwen2")


def resolve(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local artifact dir, or a Hub repo id fetched with snapshot_download (honours HF_HUB_OFFLINE and the cache)."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        return p
    s = str(path_or_id)
    if s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise ArtifactError(f"{s}: no such artifact directory (and not a Hub repo id 'owner/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(s, revision=revision))
    except RevisionNotFoundError:
        raise ArtifactError(f"{s}: no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise ArtifactError(
            f"{s}: no such local directory, and no such repo on the Hub (or no access; log in or pass a token)"
        ) from None
    except LocalEntryNotFoundError:
        raise ArtifactError(
            f"{s}: not in the local cache and the Hub is unreachable (HF_HUB_OFFLINE set or no network)"
        ) from None
    except HfHubHTTPError as e:
        raise ArtifactError(f"{s}: download failed: {str(e).splitlines()[0]}") from None


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16


def override_schedule(
    base: Schedule,
    R: int,
    num_layers: int,
    *,
    sinks: int | None = None,
    recent: float | list[float] | None = None,
    ranks: float | int | list[float | int] | None = None,
    bits: int | list[int] | None = None,
    key_bits: int | list[int] | None = None,
    key_group: int | None = None,
    value_group: int | None = None,
    residual: int | None = None,
    key_axis: str | list[str] | None = None,
    key_meta: str | None = None,
    value_meta: str | None = None,
    key_channel_group: int | None = None,
    rotate: str | None = None,
    key_rope: str | None = None,
    key_rank: int | list[int] | None = None,
) -> Schedule:
    """`base` (the artifact's schedule) with some knobs replaced; raises ValueError if the result is invalid.

    recent: the share p of each level above level 0, oldest first (one float: the paper's two levels).
    ranks: one per level or one for all, a fraction of R (float, rounded down to value_group) or a rank
      (int); the same for every layer.
    bits: one per level or one for all, for latents and keys; key_bits then replaces the key bits only.
    key_axis: "channel" or "token" per level (or one for all); key_rank: per level (or one for all), 0 for plain
      keys; key_meta, value_meta, key_channel_group, rotate, key_rope: see Schedule.
    Changing the number of levels needs `bits`; without `ranks`, level 0 keeps its ranks, the others get R.
    """
    n_old = len(base.levels)
    shares = None if recent is None else _listify(recent)
    n = n_old if shares is None else len(shares) + 1
    if n != n_old and bits is None:
        raise ValueError(f"schedule override: {n} levels (from recent) need bits for each level ({n} values)")
    levels = [replace(lv) for lv in base.levels] if n == n_old else [Level(16, 16, None) for _ in range(n)]
    if shares is not None:
        for lv, p in zip(levels[1:], shares):
            lv.share = float(p)
    if bits is not None:
        for lv, b in zip(levels, _per_level("bits", bits, n)):
            lv.bits = lv.key_bits = int(b)
    if key_bits is not None:
        for lv, b in zip(levels, _per_level("key_bits", key_bits, n)):
            lv.key_bits = int(b)
    if key_axis is not None:
        for lv, a in zip(levels, _per_level("key_axis", key_axis, n)):
            lv.key_axis = a
    if key_rank is not None:
        for lv, r in zip(levels, _per_level("key_rank", key_rank, n)):
            lv.key_rank = int(r)

    vg = base.value_group if value_group is None else value_group
    if ranks is not None:
        rs = [_rank(r, R, vg) for r in _per_level("ranks", ranks, n)]
        layer_ranks = [list(rs) for _ in range(num_layers)]
    elif n != n_old:
        layer_ranks = [[rs[0]] + [R] * (n - 1) for rs in base.ranks]
    else:
        layer_ranks = [list(rs) for rs in base.ranks]

    sched = Schedule(
        sinks=base.sinks if sinks is None else sinks,
        levels=levels,
        ranks=layer_ranks,
        key_group=base.key_group if key_group is None else key_group,
        value_group=vg,
        residual=base.residual if residual is None else residual,
        policy=base.policy if ranks is None else "uniform",
        key_meta=base.key_meta if key_meta is None else key_meta,
        value_meta=base.value_meta if value_meta is None else value_meta,
        key_channel_group=base.key_channel_group if key_channel_group is None else key_channel_group,
        rotate=base.rotate if rotate is None else rotate,
        key_rope=base.key_rope if key_rope is None else key_rope,
        key_order=base.key_order,  # the artifact's calibration statistic (levels with key bands read it)
        latent_rotation=base.latent_rotation,  # how the artifact's factors were written: not a knob
    )
    try:
        sched.validate(R, num_layers)
    except ArtifactError as e:
        raise ValueError(f"schedule override: {e}") from None
    return sched


def _listify(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _per_level(name: str, v, n: int) -> list:
    vs = _listify(v)
    if len(vs) == 1:
        vs = vs * n
    if len(vs) != n:
        raise ValueError(f"schedule override: {name} has {len(vs)} values for {n} levels")
    return vs


def _rank(r: float | int, R: int, value_group: int) -> int:
    if isinstance(r, float):
        if not 0.0 < r <= 1.0:
            raise ValueError(f"schedule override: rank fraction {r} must lie in (0, 1]")
        return min(R, max(value_group, int(r * R + 1e-9) // value_group * value_group))
    return int(r)


# transformers releases the runtime was tested on: 5.24 renamed the cache argument (past_key_values -> cache), which
# the runtime follows (model.CACHE_KW), and a release past the tested ones is refused rather than trusted to decode
TRANSFORMERS_BELOW = (5, 25)


def check_transformers(version: str | None = None) -> None:
    """Refuse (UserError, one line) a transformers release the runtime does not read yet."""
    import re

    import transformers

    from .console import UserError

    v = version or transformers.__version__
    if tuple(int(x) for x in re.findall(r"\d+", v)[:2]) >= TRANSFORMERS_BELOW:
        lo = ".".join(map(str, TRANSFORMERS_BELOW))
        raise UserError(
            f"transformers {v} is newer than the releases tale-kv is tested on (5.24 renamed past_key_values to "
            f"cache; such changes can silently drop the TALE cache): pip install 'transformers>=5.0,<{lo}'"
        )


def load(
    path_or_id: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    schedule: Schedule | None = None,
    verify: bool = True,
    revision: str | None = None,
    **overrides,
):
    """Return (model, tokenizer) with TALE attention in every layer.

    `schedule` replaces the artifact's; `overrides` (sinks, recent, ranks, bits, key_bits, key_group,
    value_group, residual, key_axis, key_meta, value_meta, key_channel_group, rotate, key_rope, key_rank) then change
    single knobs, see `override_schedule`. Problems with the
    artifact raise ArtifactError, bad overrides ValueError. The tokenizer is None if the artifact has none.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .console import check_device, check_dtype

    device, dtype = check_device(device), check_dtype(dtype)  # ValueError before anything loads
    check_transformers()
    root = resolve(path_or_id, revision)
    manifest = read_manifest(root)
    # only verified files are read below: the shards come from the index, and each must be in the manifest
    verified = verify_files(root, manifest) if verify else None
    arch = manifest["architecture"]
    try:
        g, R = int(arch["group_size"]), int(arch["latent_rank"])
    except (KeyError, TypeError, ValueError):
        raise ArtifactError(f"{root}: manifest architecture lacks group_size/latent_rank") from None
    model_type = _model_type(root)
    if model_type not in SUPPORTED:
        raise ArtifactError(f"{root}: model_type {model_type!r} is not supported (only {', '.join(SUPPORTED)})")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or default_dtype(device)

    config = AutoConfig.from_pretrained(root)
    config._attn_implementation = "sdpa"
    try:
        sched = schedule or schedule_of(manifest)
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{root}: malformed schedule in the manifest ({e})") from None
    if overrides:
        sched = override_schedule(sched, R, config.num_hidden_layers, **overrides)
    else:
        sched.validate(R, config.num_hidden_layers)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = TaleAttention(layer.self_attn, config, i, g)

    state = _read_tensors(root, device, dtype, verified)
    expected = set(model.state_dict().keys())
    tied = getattr(config, "tie_word_embeddings", False)
    missing = expected - set(state) - ({"lm_head.weight"} if tied else set())
    if missing and all(m.endswith(".v_proj.weight") for m in missing):  # the exact prefill needs them
        raise ArtifactError(
            f"{root}: artifact lacks the original v_proj.weight (written by an older tale-convert): "
            "convert the model again"
        )
    if missing:
        raise ArtifactError(f"{root}: artifact lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    unexpected = set(state) - expected
    if unexpected:
        raise ArtifactError(f"{root}: artifact has unexpected tensors, e.g. {sorted(unexpected)[0]}")
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise ArtifactError(f"{root}: tensors do not match config.json/manifest: {first}") from None
    if tied:
        model.tie_weights()
    # non-persistent buffers (rotary inv_freq) were created on meta: rebuild them for real
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.to(device).eval()

    model.tale_manifest = manifest
    model.tale_schedule = sched
    # low-rank keys (Level.key_rank): the artifact's key basis, if it has one (verify_files refused it unlisted)
    model.tale_key_basis = key_basis.load_file(
        root, config.num_hidden_layers, config.num_key_value_heads, int(arch["head_dim"]), device
    )
    if why := key_basis.missing(sched.levels, model.tale_key_basis):
        raise ArtifactError(f"{root}: the schedule's low-rank keys: {why}")
    model.tale_path = root
    model.__class__ = tale_class(type(model))
    if device.type == "cuda":
        use_kernels(model)

    tok = None
    if any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(root)
    return model, tok


class TaleGenerationMixin:
    """generate() for TALE models, through transformers' own hooks:
    - without past_key_values it gets a fresh TaleCache instead of HF's DynamicCache (TALE attention does
      not fill a DynamicCache: decoding would see no past at all);
    - a StaticTaleCache made without max_length is sized for the call (prompt + max_new_tokens);
    - with a StaticTaleCache on CUDA, the decode steps that generate() would hand to torch.compile replay
      a CUDA graph instead (runtime/decode.py; `disable_compile=True` keeps them eager)."""

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get(CACHE_KW)
        default = generation_config.use_cache is not False and generation_config.cache_implementation is None
        if cache is None and default:
            model_kwargs[CACHE_KW] = new_cache(self)
        elif isinstance(cache, StaticTaleCache) and cache.max_length is None:
            cache.max_length = kwargs.get("max_cache_length", args[-1] if args else None)
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        cache = model_kwargs.get(CACHE_KW)
        if isinstance(cache, StaticTaleCache):  # not through cache.is_compileable: HF would then build 4D masks
            return self.device.type == "cuda" and not generation_config.disable_compile
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def get_compiled_call(self, compile_config):
        return functools.partial(_graphed_call, self, super().get_compiled_call(compile_config))


def _graphed_call(model, compiled, input_ids=None, position_ids=None, **kwargs):
    """A decode step of generate(): one token per row over a StaticTaleCache replays its CUDA graph;
    other caches get transformers' compiled call. kwargs carry the cache under CACHE_KW."""
    cache = kwargs.get(CACHE_KW)
    if not isinstance(cache, StaticTaleCache):
        return compiled(input_ids=input_ids, position_ids=position_ids, **kwargs)
    if input_ids is None or input_ids.shape[1] != 1:
        return model(input_ids=input_ids, position_ids=position_ids, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from .decode import CudaGraphDecoder

    dec = getattr(cache, "decoder", None)
    if dec is None or dec.model is not model:
        dec = cache.decoder = CudaGraphDecoder(model, cache)
    if position_ids is None:  # what the model itself would use: the cache position
        position_ids = torch.full_like(input_ids, cache.get_seq_length())
    return CausalLMOutputWithPast(logits=dec(input_ids, position_ids)[:, None], **cache_arg(cache))


_TALE_CLASSES: dict[type, type] = {}


def tale_class(cls: type) -> type:
    """The model class with TaleGenerationMixin in front (one subclass per HF class, like HF's own auto classes)."""
    if issubclass(cls, TaleGenerationMixin):
        return cls
    if cls not in _TALE_CLASSES:
        _TALE_CLASSES[cls] = type(f"Tale{cls.__name__}", (TaleGenerationMixin, cls), {"__module__": __name__})
    return _TALE_CLASSES[cls]


def _model_type(root: Path) -> str | None:
    f = root / "config.json"
    if not f.is_file():
        raise ArtifactError(f"{root}: no config.json")
    try:
        return json.loads(f.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        raise ArtifactError(f"{f}: corrupt config.json") from None


def _read_tensors(
    root: Path, device: torch.device, dtype: torch.dtype, verified: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of the shards named by the index. verified: the files verify_files checked; a shard
    outside it (an index edited to point at another file) is refused, never read. None: no checking."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise ArtifactError(f"{index}: corrupt safetensors index") from None
    else:
        files = ["model.safetensors"]
    if verified is not None:
        if index.is_file() and index.name not in verified:
            raise ArtifactError(f"{root}: {index.name} is not covered by the manifest checksums")
        for f in files:
            if not isinstance(f, str) or f not in verified:
                raise ArtifactError(f"{root}: the index names {f!r}, which the manifest does not list (refused unread)")
    state = {}
    for f in files:
        if not isinstance(f, str) or not (root / f).is_file():
            raise ArtifactError(f"{root}: tensor file {f} is missing")
        try:
            with safe_open(root / f, framework="pt", device=str(device)) as st:
                for name in st.keys():
                    t = st.get_tensor(name).to(dtype)
                    # CPU tensors from safetensors may sit 8 bytes off a 64-byte boundary; BLAS results then
                    # depend on the file layout (1e-7 differences). An aligned copy makes them reproducible.
                    state[name] = t.clone() if t.device.type == "cpu" and t.data_ptr() % 64 else t
        except SafetensorError as e:
            raise ArtifactError(f"{root / f}: unreadable safetensors file ({e})") from None
    return state


def new_cache(
    model,
    schedule: Schedule | None = None,
    *,
    static: bool = False,
    max_length: int | None = None,
    keep: str = "recent",
    layout: str = "auto",
) -> TaleCache | StaticTaleCache:
    """A fresh TALE cache for `model` (pass as past_key_values to forward/generate).

    static=False: TaleCache, tensors grow as tokens come. static=True: StaticTaleCache, buffers for
    `max_length` tokens per row allocated at the prefill (model.generate fills in prompt + max_new_tokens
    when max_length is None); its decode step can be captured as a CUDA graph (runtime/decode.py).
    keep: which key groups the levels above level 0 keep, "recent" or "salient" (the most attended by the
    last queries; tale_runtime.cache; dynamic cache only).
    layout (static only): how the quantized levels are held, "auto" (the CUDA kernel's fragment layout where it
    runs: Hopper, the paper preset at head dim 128 with a whole number of query heads per KV head; else rows),
    "row" or "frag".
    """
    if not static and layout != "auto":
        raise ValueError(f'layout="{layout}" is a static cache\'s: pass static=True')
    if static and keep != "recent":
        raise ValueError(f'keep="{keep}" needs the dynamic cache (the static cache places by recency)')
    arch = model.tale_manifest["architecture"]
    cfg = model.config
    args = (
        schedule or model.tale_schedule,
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        int(arch["head_dim"]),
        int(arch["num_groups"]),
        int(arch["latent_rank"]),
    )
    if static:
        if layout == "auto" and not _cuda_kernel_installed(model):  # the fragment layout serves only that kernel
            layout = "row"
        return StaticTaleCache(*args, max_length=max_length, layout=layout, num_heads=cfg.num_attention_heads)
    return TaleCache(*args, keep=keep, key_basis=getattr(model, "tale_key_basis", None))


def _installed_kernels(model) -> dict | None:
    """The options tale_kernels' decode attention was installed with (use_kernels), or None where the model's
    attention is not tale_kernels' (the torch reference)."""
    fn = model.model.layers[0].self_attn.attention_fn
    kw = getattr(fn, "keywords", {}) or {}
    fn = getattr(fn, "func", fn)  # use_kernels(..., **options) installs a partial
    return dict(kw) if getattr(fn, "__module__", "").startswith("tale_kernels") else None


def _cuda_kernel_installed(model) -> bool:
    """Whether decode attention goes through tale_kernels with its CUDA kernel allowed (use_kernels, cuda not False)."""
    opts = _installed_kernels(model)
    return opts is not None and opts.get("cuda", True) is not False


def set_output_path(model, path: str) -> None:
    if path not in ("fused", "factored"):
        raise ValueError(f"output path must be 'fused' or 'factored', got {path!r}")
    for layer in model.model.layers:
        layer.self_attn.output_path = path


def use_kernels(model, enable: bool = True, **options) -> bool:
    """Route decode attention through the Triton kernel (CUDA) or back to the torch reference. `options` go to
    every call of the kernel (tale_kernels.latent_attention's keywords, e.g. asm=False); an unknown one is refused
    here."""
    import inspect

    from .attention import latent_attention

    if options and not enable:
        raise ValueError(f"use_kernels: options {sorted(options)} given with enable=False (the reference takes none)")
    fn = latent_attention
    if enable:
        try:
            from tale_kernels import latent_attention as kernel_fn  # noqa: F401
        except Exception:  # Triton missing or no kernel for this setup: keep the reference
            kernel_fn = None
        # the backend is handed a regions.LayerView; a kernel module from before the view (it reads
        # TaleLayerCache fields) is not used
        if kernel_fn is not None and "LayerView" not in vars(sys.modules[kernel_fn.__module__]):
            kernel_fn = None
        fn = kernel_fn or latent_attention
        if kernel_fn is not None and options:
            inspect.signature(kernel_fn).bind_partial(**options)  # TypeError names an unknown option
            fn = functools.partial(kernel_fn, **options)
    for layer in model.model.layers:
        layer.self_attn.attention_fn = fn
    return fn is not latent_attention
