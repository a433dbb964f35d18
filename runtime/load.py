"""Load a tale-convert artifact (a directory or a Hub repo id) into a ready model."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from . import backends, families, key_basis, tp
from .artifact import O_FUSED, ArtifactError, Schedule, read_manifest, schedule_of, verify_files
from .decode import graph_decoder
from .model import CACHE_KW, TALE_CACHES, TaleAttention, TaleCache, cache_arg, chunked_prefill
from .schedule import check_context, override_schedule
from .spec import Arch, CacheSpec, TaleSpec
from .static_cache import StaticTaleCache

SUPPORTED = families.SUPPORTED


def resolve(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local artifact dir, or a Hub repo id fetched with snapshot_download (honours HF_HUB_OFFLINE and the cache)."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        return p
    s = str(path_or_id)
    if s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise ArtifactError(f"{s}: no such artifact directory (and not a Hub repo id 'owner/name')")
    if p.parent.is_dir():  # out/smollm2-tal: shaped like a repo id, but its directory is here; a typo, not the Hub
        raise ArtifactError(
            f"{s}: no such artifact directory ({p.parent}/ has no {p.name}); a Hub repo id would not name a local "
            "directory"
        )
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
    """bf16 on GPUs. On a CPU bf16 only where PyTorch runs bf16 matmuls natively (AVX512-BF16 or AMX, with its
    AVX-512 kernels), else float32: without them bf16 prefills several times slower (SmolLM2, 1K tokens, one thread,
    an AVX512-BF16 EPYC held to AVX2: 29.7 s against 7.5 s; with AVX512-BF16: 4.1 s against 5.5 s,
    docs/performance.md)."""
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if native_bf16() else torch.float32


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16, AMX) and PyTorch uses its AVX-512 kernels."""
    has = [getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(has) and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def default_output_path(device: torch.device, dtype: torch.dtype) -> str:
    """On a CPU in float32 "factored": its decode step is bound by the bytes of weights it reads, and O^r is g times
    the size of W_O while B adds only G (g n)^2 (SmolLM2, g = 3: 0.37M weights per layer instead of 1.0M; docs/
    performance.md#cpu); float32 rounds both paths alike. "fused" (one matmul with O^r) elsewhere: on GPUs, and in
    16-bit, whose rounding differs between the paths enough to change a greedy token where the top two are close."""
    return "factored" if device.type == "cpu" and dtype == torch.float32 else "fused"


# transformers releases the runtime was tested on: 5.24 renamed the cache argument (past_key_values -> cache), which
# the runtime follows (model.CACHE_KW); 5.2 asks the cache layers for their mask sizes by cache_position; a release
# outside the tested ones is refused rather than trusted to decode
TRANSFORMERS_FROM, TRANSFORMERS_BELOW = (5, 17), (5, 25)


def check_transformers(version: str | None = None) -> None:
    """Refuse (UserError, one line) a transformers release the runtime was not tested on."""
    import re

    import transformers

    from .console import UserError

    v = version or transformers.__version__
    have = tuple(int(x) for x in re.findall(r"\d+", v)[:2])
    lo, hi = (".".join(map(str, x)) for x in (TRANSFORMERS_FROM, TRANSFORMERS_BELOW))
    if have >= TRANSFORMERS_BELOW:
        raise UserError(
            f"transformers {v} is newer than the releases tale-kv is tested on (5.24 renamed past_key_values to "
            f"cache; such changes can silently drop the TALE cache): pip install 'transformers>={lo},<{hi}'"
        )
    if have < TRANSFORMERS_FROM:
        raise UserError(
            f"transformers {v} is older than the releases tale-kv is tested on (5.2 asks the cache for its mask sizes "
            f"another way): pip install 'transformers>={lo},<{hi}'"
        )


def load(
    path_or_id: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    schedule: Schedule | None = None,
    verify: bool = True,
    revision: str | None = None,
    backend: str = "auto",
    backend_config=None,
    tp_size: int = 1,
    output_path: str | None = None,
    **overrides,
):
    """Return (model, tokenizer) with TALE attention in every layer.

    `tp_size` N > 1: tensor parallelism over the N processes of a torchrun job (call load on every rank); each rank
    holds G/N latent groups with their heads, and caches only those (runtime/tp.py, transformers' TP plan). The device
    is each rank's (cuda:LOCAL_RANK, or the CPU under gloo). A failure on any rank raises on every rank.

    `output_path` "factored": decode through B then W_O (the same result) and leave O^r unread: g times the size of
    W_O less memory (40 GiB at Llama-3.1-70B shapes with g = 4); set_output_path(model, "fused") is then refused.
    None: "factored" on a CPU in float32, else "fused" (default_output_path). `dtype` None: default_dtype (bf16 on
    GPUs; on a CPU bf16 where it has bf16 instructions, else float32).

    `backend`: the decode-attention backend the model's new caches ask for ("auto": the fastest that serves each
    cache; "torch", "triton", "cuda": see tale_runtime.backends), with `backend_config` its tuning knobs.

    `schedule` replaces the artifact's; `overrides` (sinks, recent, ranks, bits, key_bits, key_group,
    value_group, residual, key_axis, key_meta, value_meta, key_channel_group, rotate, key_rope, key_rank) then change
    single knobs, see `override_schedule`. Problems with the
    artifact raise ArtifactError, bad overrides ValueError. The tokenizer is None if the artifact has none.
    """
    from transformers import AutoTokenizer

    from . import remote_code
    from .console import check_device, check_dtype

    device, dtype = check_device(device), check_dtype(dtype)  # ValueError before anything loads
    if output_path not in ("fused", "factored", None):
        raise ValueError(f"output path must be 'fused' or 'factored', got {output_path!r}")
    check_transformers()
    tp_cfg = mesh = None
    if tp_size != 1:
        tp.check_whole(tp_size)  # divisibility once the manifest is read
        tp_cfg, device, mesh = tp.start(tp_size, device)
    with tp.all_ranks(tp_size):  # a bad path or file on one rank ends every rank, none waits for it
        root = resolve(path_or_id, revision)
        manifest = read_manifest(root)
        # only verified files are read below: the shards come from the index, and each must be in the manifest
        verified = verify_files(root, manifest) if verify else None
        model_type = _model_type(root)
        if model_type not in SUPPORTED:
            raise ArtifactError(f"{root}: model_type {model_type!r} is not supported (only {', '.join(SUPPORTED)})")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or default_dtype(device)
        output_path = output_path or default_output_path(device, dtype)

        config = remote_code.base_config(root)  # an artifact's config.json says model_type "tale" (remote_code.py)
        if why := families.unsupported(config):
            raise ArtifactError(f"{root}: {why}")
        config._attn_implementation = "sdpa"
        try:
            arch = Arch.from_manifest(manifest, config)
        except ArtifactError as e:
            raise ArtifactError(f"{root}: {e}") from None
        g, R = arch.group_size, arch.latent_rank
        try:
            sched = schedule or schedule_of(manifest)
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{root}: malformed schedule in the manifest ({e})") from None
        if overrides:
            sched = override_schedule(sched, R, config.num_hidden_layers, **overrides)
        else:
            sched.validate(R, config.num_hidden_layers)
        check_context(sched, config.max_position_embeddings)
        if tp_size != 1:
            tp.check_size(tp_size, arch.num_groups, g, root)

    model, rank_tp = meta_model(config, g, dtype, tp_cfg, mesh)

    with tp.all_ranks(tp_size):
        params = dict(model.named_parameters()) if rank_tp is not None else None
        skip = O_FUSED if output_path == "factored" else None
        state = _read_tensors(root, device, dtype, verified, params, skip)
        expected = set(model.state_dict().keys())
        if skip:
            expected = {k for k in expected if not k.endswith(skip)}
            for layer in model.model.layers:  # O^r left out: an empty tensor in its place
                layer.self_attn.tale.o_fused = nn.Parameter(torch.empty(0, device=device, dtype=dtype), False)
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
        del state
        if tied:
            model.tie_weights()
        # low-rank keys (Level.key_rank): the artifact's key basis, if it has one (verify_files refused it unlisted)
        basis = key_basis.load_file(root, arch.num_layers, arch.num_kv_heads, arch.head_dim, device)
        if basis is not None and rank_tp is not None:  # this rank's heads (runtime/key_basis.py, shard)
            group = rank_tp.mesh.get_group()
            basis = [key_basis.shard(b, rank_tp.rank, rank_tp.size, group) for b in basis]
        if why := key_basis.missing(sched, basis):
            raise ArtifactError(f"{root}: the schedule's low-rank keys: {why}")
    finish(model, device, TaleSpec(arch, sched, basis, manifest, root, tp=rank_tp))
    set_output_path(model, output_path)
    set_backend(model, backend, backend_config)

    tok = None
    if any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(root, config=config)  # not config.json's "tale": no remote-code prompt
    return model, tok


def meta_model(config, group: int, dtype: torch.dtype, tp_cfg=None, mesh=None):
    """The model of `config` on the meta device with TALE attention in every layer (`group` KV heads per latent
    group), and, given tp.start()'s config and mesh, sharded by the TP plan (parameters become DTensor placeholders):
    (model, tp.TP or None). Its weights are then loaded (or drawn, benchmarks/bench_tp.py), then finish()."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = TaleAttention(layer.self_attn, config, i, group)
    if tp_cfg is None:
        return model, None
    if getattr(config, "tie_word_embeddings", False):
        # tied on meta, lm_head.weight is the embedding's parameter, which the TP plan would miss under that name:
        # a placeholder of its own until load() ties them again (both split by vocabulary)
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight), requires_grad=False)
    return model, tp.distribute(model, tp_cfg, mesh)


def finish(model, device: torch.device, spec: TaleSpec) -> None:
    """A model whose weights are loaded, made ready: the rotary tables and Gemma's embedding scale (created on meta),
    eval mode, TALE's factors as this rank's plain tensors under TP, `model.tale_spec` and the TALE model class
    (generate knows TALE caches)."""
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    if (scale := families.embed_scale(model)) is not None:  # Gemma's scaled embedding: a buffer, also made on meta
        model.model.embed_tokens.embed_scale = torch.tensor(scale)
    model.to(device).eval()
    if spec.tp is not None:
        tp.localize(model, spec.tp)
    model.tale_spec = spec
    model.__class__ = tale_class(type(model))


class TaleGenerationMixin:
    """forward() and generate() for TALE models, through transformers' own hooks:
    - forward() over a TALE cache opens one step on it around the layers' writes (runtime/cache.py CacheStep);
    - generate() without a cache gets a fresh TALE cache (new_cache) instead of transformers' DynamicCache (a
      DynamicCache passed explicitly runs the base model: the 16-bit baseline);
    - a StaticTaleCache made without max_length is sized for the call (prompt + max_new_tokens);
    - with a StaticTaleCache on CUDA, the decode steps that generate() would hand to torch.compile replay
      a CUDA graph instead (runtime/decode.py; `disable_compile=True` keeps them eager)."""

    def forward(self, input_ids=None, *args, tale_graph: bool = False, **kwargs):
        # tale_class gives this the signature of the model's own forward: transformers reads it (position_ids, ...)
        cache = kwargs.get(CACHE_KW, kwargs.get("past_key_values"))
        if not isinstance(cache, TALE_CACHES):
            return super().forward(input_ids, *args, **kwargs)
        x = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        # a long prompt over an empty cache: each decoder layer over pieces of it (runtime/model.py chunked_prefill)
        with cache.step(x.shape[1], graph=tale_graph), chunked_prefill(self, cache, x.shape[1], kwargs):
            return super().forward(input_ids, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get(CACHE_KW)
        default = generation_config.use_cache is not False and generation_config.cache_implementation is None
        need = kwargs.get("max_cache_length", args[-1] if args else None)  # prompt + max_new_tokens
        if cache is None and default:
            model_kwargs[CACHE_KW] = new_cache(self)
        elif isinstance(cache, TALE_CACHES):
            _check_reuse(cache, need, generation_config.max_new_tokens)
            if isinstance(cache, StaticTaleCache) and cache.max_length is None:
                cache.max_length = need
            elif isinstance(cache, StaticTaleCache) and need is not None and need > cache.max_length:
                raise ValueError(
                    f"the static cache holds {cache.max_length} tokens per row; this call caches {need} (prompt + "
                    "max_new_tokens - 1): new_cache(model, static=True) sizes it for the call"
                )
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        cache = model_kwargs.get(CACHE_KW)
        if isinstance(cache, StaticTaleCache):  # not through cache.is_compileable: HF would then build 4D masks
            return self.device.type == "cuda" and not generation_config.disable_compile
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def get_compiled_call(self, compile_config):
        return _GraphedCall(self, super().get_compiled_call(compile_config))

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """Write the TALE artifact this model was loaded from (manifest, tensors, key basis, modeling_tale.py), so
        that it reloads as TALE: transformers' own save would write the base model, whose reload decodes on a
        16-bit cache. The weights are the artifact's (the runtime is for inference); refused (ValueError) where the
        artifact cannot be written as it was loaded."""
        save_artifact(self, save_directory, **kwargs)


def save_artifact(model, save_directory, push_to_hub: bool = False, state_dict=None, **_ignored) -> None:
    """model.save_pretrained for a TALE model: the files of its artifact, verified again after the copy."""
    import shutil

    from .artifact import MANIFEST

    spec: TaleSpec = model.tale_spec
    why = None
    if push_to_hub:
        why = "push_to_hub: publish the artifact with tale-push"
    elif state_dict is not None:
        why = "a state_dict: a TALE artifact's tensors are the ones it was converted with"
    elif spec.tp is not None:
        why = "under tensor parallelism each rank holds part of the model; save from the artifact directory"
    elif spec.path is None or not (Path(spec.path) / MANIFEST).is_file():
        why = "the model's artifact directory is gone"
    elif spec.schedule.to_dict() != schedule_of(spec.manifest).to_dict():
        why = "its schedule was overridden at load (the artifact holds the converted one); pass the overrides again at load"
    if why:
        raise ValueError(f"save_pretrained of a TALE model writes its artifact, not with {why}")
    out, root = Path(save_directory).expanduser(), Path(spec.path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"save_pretrained: {out} exists and is not an empty directory; name a new one")
    if out.resolve() == root.resolve():
        return
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        for name in [*spec.manifest["files"], MANIFEST]:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, out / name)
        verify_files(out)
    except (OSError, ArtifactError) as e:  # nothing half-written is left behind (an empty directory stays empty)
        shutil.rmtree(out, ignore_errors=True)
        if not made:
            out.mkdir(exist_ok=True)
        raise ValueError(f"save_pretrained: could not copy the artifact {root}: {e}") from None


def _check_reuse(cache, need: int | None, max_new_tokens: int | None) -> None:
    """A TALE cache that already holds tokens continues them: the prompt must extend what it holds (transformers feeds
    only the uncached tail). Anything else is refused in one line instead of decoding over the wrong past."""
    held = cache.get_seq_length()
    if not held or need is None or max_new_tokens is None:
        return
    prompt = need + 1 - max_new_tokens  # transformers: max_cache_length = max_length - 1 (the last token is not cached)
    if prompt <= held:
        raise ValueError(
            f"this TALE cache already holds {held} tokens and the prompt has {prompt}: pass a fresh cache "
            "(new_cache(model)) for each generate() call, or the whole sequence it continues"
        )


class _GraphedCall:
    """generate()'s decode call (one per generate() call): a step of one token per row over a StaticTaleCache replays
    its CUDA graph; other caches get transformers' compiled call. kwargs carry the cache under CACHE_KW.

    A replay returns the decoder's one logits buffer each time: the output built around it at the first replay is
    handed out again at the next ones (generate() reads the logits and the cache from it and keeps neither; building
    a ModelOutput costs ~20 us of Python a step, while the GPU waits for the step)."""

    def __init__(self, model, compiled):
        self.model, self.compiled = model, compiled
        self.last: tuple | None = None  # (logits [B, V] the decoder returned, the cache, the output holding them)

    def __call__(self, input_ids=None, position_ids=None, **kwargs):
        cache = kwargs.get(CACHE_KW)
        if not isinstance(cache, StaticTaleCache):
            return self.compiled(input_ids=input_ids, position_ids=position_ids, **kwargs)
        if input_ids is None or input_ids.shape[1] != 1:
            return self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
        if position_ids is None:  # what the model itself would use: the cache position
            position_ids = torch.full_like(input_ids, cache.get_seq_length())
        logits = graph_decoder(self.model, cache)(input_ids, position_ids)
        last = self.last
        if last is None or last[0] is not logits or last[1] is not cache:
            from transformers.modeling_outputs import CausalLMOutputWithPast

            last = self.last = (logits, cache, CausalLMOutputWithPast(logits=logits[:, None], **cache_arg(cache)))
        return last[2]


_TALE_CLASSES: dict[type, type] = {}


def tale_class(cls: type) -> type:
    """The model class with TaleGenerationMixin in front (one subclass per HF class, like HF's own auto classes)."""
    if issubclass(cls, TaleGenerationMixin):
        return cls
    if cls not in _TALE_CLASSES:

        def forward(self, *args, **kwargs):
            return TaleGenerationMixin.forward(self, *args, **kwargs)

        # generate() passes what the forward's signature names (position_ids for left-padded batches, the cache)
        forward.__signature__ = inspect.signature(cls.forward)
        forward.__doc__ = cls.forward.__doc__
        ns = {"__module__": __name__, "forward": forward}
        _TALE_CLASSES[cls] = new = type(f"Tale{cls.__name__}", (TaleGenerationMixin, cls), ns)
        _known_to_pipelines(new)
    return _TALE_CLASSES[cls]


def _known_to_pipelines(cls: type) -> None:
    """List a TALE class among the causal LMs, under the artifact's model_type "tale" (which no transformers config
    has, so no auto class resolves it): pipeline("text-generation") then takes the model without logging its ~200
    supported class names."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    known = names.get("tale", ())
    names["tale"] = (*(known if isinstance(known, tuple) else (known,)), cls.__name__)


def _model_type(root: Path) -> str | None:
    f = root / "config.json"
    if not f.is_file():
        raise ArtifactError(f"{root}: no config.json")
    from .remote_code import base_dict

    try:
        return base_dict(json.loads(f.read_text())).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        raise ArtifactError(f"{f}: corrupt config.json") from None


def _read_tensors(
    root: Path,
    device: torch.device,
    dtype: torch.dtype,
    verified: set[str] | None = None,
    params: dict | None = None,
    skip: str | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of the shards named by the index. verified: the files verify_files checked; a shard
    outside it (an index edited to point at another file) is refused, never read. None: no checking.
    params: the model's parameters under tensor parallelism: a sharded one gets (and reads) only this rank's slice.
    skip: tensors whose names end so are not read."""
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
                    if skip and name.endswith(skip):
                        continue
                    if params is not None and name in params:
                        try:
                            state[name] = tp.read_sharded(st, name, params[name], device, dtype)
                        except ArtifactError as e:
                            raise ArtifactError(f"{root}: {e}") from None
                        continue
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
    backend: str | backends.AttentionBackend | None = None,
    layout: str | None = None,
) -> TaleCache | StaticTaleCache:
    """A fresh TALE cache for `model` (pass as past_key_values to forward/generate).

    static=False: TaleCache, tensors grow as tokens come. static=True: StaticTaleCache, buffers for
    `max_length` tokens per row allocated at the prefill (model.generate fills in prompt + max_new_tokens
    when max_length is None); its decode step can be captured as a CUDA graph (runtime/decode.py).
    keep: which key groups the levels above level 0 keep, "recent" or "salient" (the most attended by the
    last queries; tale_runtime.cache; dynamic cache only).
    backend: the decode-attention backend (None: the model's, `load(backend=...)`; "auto": the fastest that serves
    this cache; see tale_runtime.backends; or a backend object, used as it is). The cache carries it (`cache.backend`); a static cache holds its levels
    in the layout that backend reads, or in `layout` ("row" or "frag") if given.
    """
    if not static and layout is not None:
        raise ValueError(f'layout="{layout}" is a static cache\'s: pass static=True')
    if static and keep != "recent":
        raise ValueError(f'keep="{keep}" needs the dynamic cache (the static cache places by recency)')
    spec: TaleSpec = model.tale_spec
    sched = schedule or spec.schedule
    w = next(model.parameters())
    # under tensor parallelism: this rank's heads and groups only (rank_arch)
    cs = CacheSpec(spec.rank_arch(), sched, static, w.device, w.dtype, families.sliding_windows(model))
    if isinstance(backend, backends.AttentionBackend):
        chosen = backend
    else:
        want = backend or spec.backend
        chosen = backends.choose(cs, want, spec.backend_config if want == spec.backend else None, layout)
    if static:
        rotary = families.rotary(model) if sched.key_rope == "pre" else None
        return StaticTaleCache.from_spec(
            cs, max_length=max_length, layout=layout, backend=chosen, key_basis=spec.key_basis, rotary=rotary
        )
    rope_types = families.rope_types(model.config)
    return TaleCache.from_spec(cs, keep=keep, key_basis=spec.key_basis, backend=chosen, rope_types=rope_types)


def set_backend(model, name: str = "auto", config=None) -> None:
    """The decode-attention backend the model's new caches ask for: "auto" (the fastest that serves each cache), or
    a registered name (tale_runtime.backends.registered()); `config` its tuning knobs (the backend's config class,
    e.g. tale_kernels.TritonConfig). Caches made before keep theirs. An unknown name or config is refused here."""
    if name != "auto":
        b = backends.get(name).configure(config)
        # refused now, not at the first generate: a backend that serves neither a dynamic nor a static cache here
        spec, w = model.tale_spec, next(model.parameters())
        windows = families.sliding_windows(model)
        specs = [CacheSpec(spec.rank_arch(), spec.schedule, st, w.device, w.dtype, windows) for st in (False, True)]
        why = [b.supports(cs) for cs in specs]
        if all(why):
            raise ValueError(f"attention backend {name!r} does not serve this model's caches: {why[0]}")
    elif config is not None:
        raise ValueError("a backend config needs a backend name (set_backend(model, 'triton', config))")
    model.tale_spec.backend, model.tale_spec.backend_config = name, config


def set_output_path(model, path: str) -> None:
    if path not in ("fused", "factored"):
        raise ValueError(f"output path must be 'fused' or 'factored', got {path!r}")
    if path == "fused" and model.model.layers[0].self_attn.tale.o_fused.numel() == 0:
        raise ValueError("this model was loaded without O^r (load(..., output_path='factored')): load it again")
    for layer in model.model.layers:
        layer.self_attn.output_path = path
