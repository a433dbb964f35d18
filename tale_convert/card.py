"""The model card (README.md) of a TALE artifact: Hub metadata, the cache schedule, measured
figures when there are any, and how to run it. Everything comes from the manifest; fields the
converter or the evaluator did not record are left out, never guessed."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from tale_runtime.artifact import Schedule, nominal_ratio

# A generated card carries this line; tale-push regenerates such a card and keeps any other README.
MARKER = "<!-- tale-kv: generated card, tale-push rewrites it. Delete this line to keep your own edits. -->"
TAGS = ["tale", "kv-cache-compression", "text-generation"]
# Base-model tags that would be false for a TALE artifact (other formats, other serving stacks).
DROP_TAGS = {
    "gguf",
    "onnx",
    "mlx",
    "transformers.js",
    "autotrain_compatible",
    "endpoints_compatible",
    "text-generation-inference",
    "region:us",
    "region:eu",
}
PLACEHOLDER_ID = "OWNER/NAME"
# the tale-kv distribution (tale_runtime, tale_convert) is not on PyPI: it installs from the toolkit's source tree
INSTALL = "pip install /path/to/tale-toolkit  # a checkout of the TALE toolkit (the tale-kv package; not on PyPI)"


def base_model_id(manifest: dict) -> str | None:
    """The base model's Hub id, or None when it was converted from a local directory."""
    base = manifest.get("base")
    bid = base.get("id") if isinstance(base, dict) else base
    if not isinstance(bid, str) or bid.startswith(("/", ".", "~")) or bid.count("/") != 1:
        return None
    try:
        validate_repo_id(bid)
    except HFValidationError:
        return None
    return bid


def card_data(text: str | None) -> ModelCardData:
    """The front matter of a card, empty if it has none or it does not parse."""
    if not text or not text.lstrip().startswith("---"):
        return ModelCardData()
    try:
        return ModelCard(text).data
    except ValueError:  # malformed YAML
        return ModelCardData()


def render_card(
    manifest: dict, base_card: str | None = None, quality: dict | None = None, *, repo_id: str | None = None
) -> str:
    """README.md for an artifact.

    base_card: the base model's README (or a previous TALE card): its license, tags and
    language are carried over. quality: measured figures (e.g. from tale-eval), merged over
    manifest["measured"] / manifest["quality"]. repo_id: where the artifact is published
    (the usage lines name it; a placeholder otherwise).
    """
    base = manifest.get("base") if isinstance(manifest.get("base"), dict) else {}
    hub_base = base_model_id(manifest)
    base_name = hub_base or Path(str(base.get("id") or "the base model")).name  # never a local absolute path
    prev = card_data(base_card)
    arch = _arch(manifest)
    tags = list(dict.fromkeys(TAGS + [arch.model_type] + list(prev.tags or [])))
    data = ModelCardData(
        base_model=hub_base,
        library_name="tale-kv",
        license=base.get("license") or manifest.get("license") or prev.license or "other",
        language=prev.language,
        pipeline_tag="text-generation",
        tags=[t for t in tags if t and t not in DROP_TAGS],
    )
    sections = [
        f"# {repo_id or base_name + ' (TALE)'}\n\n{MARKER}",
        _intro(manifest, arch, base_name, hub_base),
        _schedule(manifest, arch),
        _measured([manifest.get("measured"), manifest.get("quality"), None if is_eval_json(quality) else quality]),
        _eval_table(quality) if is_eval_json(quality) else "",
        _usage(repo_id or PLACEHOLDER_ID),
        _provenance(manifest),
    ]
    body = "\n\n".join(s for s in sections if s)
    return f"---\n{data.to_yaml()}\n---\n\n{body}\n"


def complete_metadata(card: str, manifest: dict) -> str:
    """A user's own card, with the metadata the Hub needs for a TALE artifact filled in
    (base_model, library_name, tags); everything the user wrote is kept."""
    mc = ModelCard(card) if card.lstrip().startswith("---") else ModelCard(f"---\n---\n{card}")
    mc.data.base_model = mc.data.base_model or base_model_id(manifest)
    mc.data.library_name = mc.data.library_name or "tale-kv"
    mc.data.tags = list(dict.fromkeys(list(mc.data.tags or []) + TAGS))
    return str(mc)


def _arch(m: dict):
    """The manifest's shapes (tale_runtime.spec.Arch; imported here, not when tale-push starts: it imports torch)."""
    from tale_runtime.spec import Arch

    return Arch.from_manifest(m)


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def _intro(m: dict, arch, base_name: str, hub_base: str | None) -> str:
    link = f"[`{base_name}`](https://huggingface.co/{hub_base})" if hub_base else f"`{base_name}`"
    ratio = measured_ratio(m)
    lead = (
        f"**KV cache {ratio:.2f}x smaller than 16-bit at 1K tokens** (measured: the bytes the TALE cache holds, "
        "sinks, residual, scales and zero points included; `tale-run` prints the ratio of each run).\n\n"
        if ratio
        else ""
    )
    return lead + (
        f"A TALE (token-adaptive low-rank KV-cache compression, training-free) artifact of {link}. "
        f"Each layer's value projection is replaced by whitened SVD factors over groups of "
        f"{arch.group_size} KV heads (latent rank R = {arch.latent_rank}) plus a fused output "
        "matrix; all other weights are the base model's. Nothing is truncated in the weights: at run time "
        "each cached token keeps a value rank and bit width chosen by its position, and its key quantized, "
        "while the forward pass itself stays exact."
    )


def _schedule(m: dict, arch) -> str:
    s = Schedule.from_dict(m["schedule"])
    R = arch.latent_rank
    C = arch.num_kv_heads * arch.head_dim  # the joined keys of a layer
    hpb = arch.num_kv_heads // s.key_blocks  # KV heads per key basis block
    per = (
        f" of {C}"
        if s.key_blocks == 1
        else f" per {'KV head' if hpb == 1 else f'{hpb} KV heads'} of {C // s.key_blocks}"
    )
    rows = []
    for i, (lv, share) in enumerate(zip(s.levels, s.shares())):
        ranks = [rs[i] for rs in s.ranks]
        rank = "?" if not ranks else str(ranks[0]) if len(set(ranks)) == 1 else f"{min(ranks)}..{max(ranks)} (by layer)"
        who = "oldest (middle)" if i == 0 else "most recent" if i == len(s.levels) - 1 else f"level {i}"
        krs = sorted({row[i] for row in s.key_ranks} if s.key_ranks else {lv.key_rank})  # the counts of its layers
        count = f"{krs[0]}" if len(krs) == 1 else f"{krs[0]}..{krs[-1]} (by layer, mean {lv.key_rank})"
        kb = f"{lv.key_bits}" + (f" ({count} coefficients{per})" if lv.key_rank else "")
        rows.append(f"| {i} | {who} | {share:.3g} | {rank} / {R} | {lv.bits} | {kb} |")
    ratio = m.get("nominal_ratio")
    if ratio is None:
        ratio = nominal_ratio(s, arch.head_dim, arch.group_size, arch.num_kv_heads)
    lines = [
        "## Cache schedule",
        "",
        f"The first {s.sinks} tokens (attention sinks) stay at 16 bits. The other tokens, oldest first:",
        "",
        "| level | tokens | share | value rank | value bits | key bits |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Quantization groups: keys per channel over {s.key_group} tokens, value latents per token over "
        f"{s.value_group} channels; the newest tokens wait in a 16-bit residual of up to {s.residual} tokens. "
        f"Level policy: {s.policy}.",
    ]
    if s.key_rope == "pre":
        lines[-1] += " Quantized keys are held before RoPE and rotated as they are read."
    if any(lv.key_rank for lv in s.levels):
        lines[-1] += (
            " Low-rank keys: those levels hold the first coefficients of the layer's "
            + ("joined keys" if s.key_blocks == 1 else "keys, per block of KV heads,")
            + " on the calibrated basis in key_basis.safetensors."
        )
    if s.key_ranks is not None:  # tale-convert --key-rank-policy energy: the coefficients each layer holds
        for i, lv in enumerate(s.levels):
            if lv.key_rank:
                per_layer = ", ".join(str(krs[i]) for krs in s.key_ranks)
                lines += ["", f"Key coefficients per layer at level {i} (by calibration key energy): {per_layer}."]
    if ratio is not None:
        lines += [
            "",
            f"Nominal K+V cache compression versus 16 bits: {ratio:.2f}x (the levels' bits alone, ignoring sinks, "
            "scales, zero points and the residual"
            + ("; the measured ratio above counts them)." if measured_ratio(m) else ")."),
        ]
    return "\n".join(lines)


def measured_ratio(m: dict) -> float | None:
    """16-bit K+V bytes over the bytes a batch-1 TALE cache of the manifest's schedule holds after 1K tokens (a dry
    run of the cache itself: sinks, residual, scales and zero points included; the bytes do not depend on the text)."""
    from .rank_policy import REFERENCE
    from .rank_policy import measured_ratio as dry_run

    try:
        arch = _arch(m)
        if arch.model_type in ("gemma3", "gemma3_text"):
            return None  # sliding layers of 512 tokens: the 16-bit reference holds less than 1K there, the dry run not
        return dry_run(Schedule.from_dict(m["schedule"]), arch, REFERENCE)
    except Exception:  # a manifest too old or odd for the dry run: the card says nothing rather than guess
        return None


def _flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float, str, bool)):
            out.append((f"{prefix}{k}", v))
    return out


def _measured(sources: list) -> str:
    """One table of the scalar figures, nested keys dotted; later sources win key by key."""
    merged = {k: v for src in sources for k, v in _flat(_dict(src))}
    rows = [f"| {k} | {f'{v:.4g}' if isinstance(v, float) else v} |" for k, v in merged.items()]
    if not rows:
        return ""
    return "\n".join(["## Measured", "", "| metric | value |", "|---|---|", *rows])


def is_eval_json(q) -> bool:
    """Whether `q` is what `tale-eval --json` writes: {"config": {...}, "results": [row, ...]}."""
    return isinstance(q, dict) and isinstance(q.get("config"), dict) and isinstance(q.get("results"), list)


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"


def _eval_table(q: dict) -> str:
    """tale-eval's results as a table: perplexity (and its change against the reference) per held-out text,
    the measured compression, pass-key accuracy."""
    cfg = q["config"]
    rows = [r for r in q["results"] if isinstance(r, dict)]
    texts = [str(t) for t in cfg.get("texts") or []] or sorted({t for r in rows for t in _dict(r.get("ppl"))})
    head = ["cache", *[f"ppl {t}" for t in texts], "measured compression"]
    task = any("passkey" in r for r in rows)
    if task:
        head.append("pass-key")
    lines = [
        "## Measured with tale-eval",
        "",
        f"Decode-mode perplexity on {cfg.get('windows', '?')} x {cfg.get('ctx', '?')} tokens of "
        f"{', '.join(texts) or '?'} (prefill {cfg.get('prefill', '?')}, {cfg.get('dtype', '?')}); the change is "
        f"against the {'full 16-bit cache' if cfg.get('delta_vs', 'full') == 'full' else 'plain forward pass'}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        name = str(r.get("policy", "?")) + (f" ({r['setting']})" if r.get("setting") else "")
        ppl, delta = _dict(r.get("ppl")), _dict(r.get("delta_pct"))
        cells = [name.replace("|", "/")]
        for t in texts:
            d = f" ({_num(delta.get(t), '+.2f')}%)" if t in delta else ""
            cells.append(_num(ppl.get(t), ".3f") + d)
        cells.append(_num(r.get("ratio"), ".2f") + "x" if isinstance(r.get("ratio"), (int, float)) else "n/a")
        if task:
            cells.append(_num(r.get("passkey"), ".0%") if "passkey" in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _usage(repo_id: str) -> str:
    return f"""## Use

```bash
{INSTALL}
tale-run {repo_id} --prompt "Explain KV-cache compression in one paragraph."
```

With plain transformers (the artifact's `modeling_tale.py` loads it through `tale_runtime`; without
`trust_remote_code=True` transformers refuses it rather than run the base model with a 16-bit cache):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True, device_map="auto")
tok = AutoTokenizer.from_pretrained("{repo_id}", trust_remote_code=True)
inputs = tok("Explain KV-cache compression in one paragraph.", return_tensors="pt").to(model.device)
out = model.generate(**inputs, max_new_tokens=64, do_sample=False)  # over a fresh TALE cache
print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

Or with the runtime itself, which returns the same model:

```python
from tale_runtime import cache_arg, load, new_cache

model, tok = load("{repo_id}")
cache = new_cache(model)
inputs = tok("Explain KV-cache compression in one paragraph.", return_tensors="pt").to(model.device)
# cache_arg: the installed transformers' name of the argument (cache= from 5.24, past_key_values= before)
out = model.generate(**inputs, **cache_arg(cache), max_new_tokens=64, do_sample=False)
print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(f"KV cache {{cache.baseline_nbytes() / cache.nbytes():.2f}}x smaller than 16-bit")
```

`load` also takes a local artifact directory; offline (`HF_HUB_OFFLINE=1`) it loads from the local
Hugging Face cache."""


def _provenance(m: dict) -> str:
    lines = []
    tool = _dict(m.get("tool"))
    if tool.get("version"):
        lines.append(f"- made with {tool.get('name', 'tale-kv')} {tool['version']}")
    base = _dict(m.get("base"))
    if base.get("revision"):
        lines.append(f"- base revision `{base['revision']}`")
    if base.get("origin"):
        lines.append(f"- base weights: {base['origin']}")
    cal = _dict(m.get("calibration"))
    if cal.get("samples") and cal.get("seq_len"):
        lines.append(
            f"- calibration: {cal['samples']} x {cal['seq_len']} tokens from {cal.get('source', '?')}"
            f" (seed {cal.get('seed', '?')})"
        )
    svd = _dict(m.get("svd"))
    if svd.get("method"):
        lines.append(f"- factorization: {svd['method']}")
    energy = m.get("energy_kept")
    if isinstance(energy, list) and energy and all(isinstance(e, list) and e for e in energy):
        mean = [sum(e[i] for e in energy) / len(energy) for i in range(len(energy[0]))]
        lines.append(
            "- whitened value energy kept at each level's rank (mean over layers): "
            + ", ".join(f"{x:.1%}" for x in mean)
        )
    if not lines:
        return ""
    return "\n".join(["## Conversion", "", *lines, "", "The full record is in `tale_config.json`."])
