"""kvpress's presses as baselines of tale-eval, run through kvpress itself (`tale-eval ARTIFACT --kvpress ...`).

kvpress (NVIDIA's library of KV-cache compression methods for transformers) compresses at the prefill: a press is a
forward hook on every attention layer that, once the layer's attention over the whole prompt has run, prunes the
layer's cache (SnapKV, Expected Attention, StreamingLLM, ...: the lowest-scored KV pairs are dropped), or, for KVzip,
scores every KV pair by reconstructing the context afterwards and masks the lowest-scored ones (kvpress keeps them in
the cache and hides them from the attention with a key no query attends to: its "fake compression"). Decoding then
reads the compressed cache and appends every new token uncompressed.

kvpress 0.5 pins transformers < 5.3, so it runs in its own venv (`make kvpress-env`, transformers 5.2), where the
TALE runtime does not run (its cache layers follow the cache API of later transformers releases): a kvpress run holds
the artifact's base model only, built from the artifact's own tensors without TALE's factors (the weights every TALE
row runs on), with transformers' DynamicCache. Its `full` row is that model with no press. TALE's rows come from the
main venv on the same samples (docs/eval.md).

The tasks are tale-eval's, unchanged: decode-mode perplexity (the press compresses the `--prefill` tokens; the
teacher-forced chunks after it are appended uncompressed, as kvpress decodes), pass-key and long-context retrieval
(the whole prompt, question included, is prefilled through the press; the answer is generated greedily through the
compressed cache, at the tokens' true positions, as kvpress's pipeline generates).

Bytes. `ratio` (ours): 16-bit K+V bytes of every token that went through the cache over the bytes of the tensors
the cache holds at the end of the run. `kept`: the same over the bytes of the entries the attention still reads (for
KVzip's masked entries, what an evicting implementation would hold; the same as `ratio` for the other presses).
kvpress's own accounting is `compression_ratio`, the share of the prompt's KV pairs pruned at the prefill
(1 / (1 - compression_ratio) times fewer on the prompt, before any decoded token): reported beside ours.

One prefill per prompt: every press whose hook only compresses what the prefill wrote (all but KVzip) shares one
forward pass of the prompt (the full cache's), its hook run on a cache of its own holding that layer's keys and values
(kvpress's own forward_hook, so the same pruning as under its context manager: the prefill's hidden states do not
depend on what a layer's cache keeps afterwards). KVzip's presses of one setting share one scoring pass (its context
reconstruction) and apply each compression ratio with kvpress's own compress_post. `--no-shared-prefill` runs every
press under its own context manager (the tests check that both give the same answers and bytes).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

# press names of --kvpress -> kvpress's class names (the presses that need no trained weights and no eager attention)
PRESSES = {
    "snapkv": "SnapKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "kvzip": "KVzipPress",
    "streaming_llm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "pyramidkv": "PyramidKVPress",
}
MISSING = "--kvpress needs kvpress, which this environment lacks: build its venv with `make kvpress-env` and run .venv-kvpress/bin/tale-eval"


def available() -> bool:
    """Whether kvpress is installed (a directory named kvpress on sys.path, such as tests/kvpress under pytest, is a
    namespace package, not kvpress)."""
    spec = importlib.util.find_spec("kvpress")
    return spec is not None and spec.origin not in (None, "namespace")


def import_kvpress():
    """kvpress, or ValueError with the reason (not installed, or not importable with this transformers)."""
    if not available():
        raise ValueError(MISSING)
    try:
        import kvpress
    except ImportError as e:
        raise ValueError(f"--kvpress: kvpress does not import here ({e}); use its venv (make kvpress-env)") from None
    return kvpress


@dataclass(frozen=True)
class Spec:
    """One row: a press at a compression ratio (kvpress's: the share of the prompt's KV pairs pruned) or at a byte
    target (`target` N: N times fewer bytes than the 16-bit cache at the end of each run, kept entries counted).
    press None: the full cache (no press)."""

    press: str | None
    ratio: float | None = None
    target: float | None = None

    @property
    def name(self) -> str:
        if self.press is None:
            return "full"
        return f"{self.press}:{self.ratio:g}" if self.target is None else f"{self.press}:{self.target:g}x"

    def label(self) -> str:
        if self.press is None:
            return "16-bit K+V (the base model, transformers' DynamicCache)"
        if self.target is None:
            return f"compression_ratio {self.ratio:g}"
        return f"{self.target:g}x fewer bytes (compression_ratio per prompt)"

    def compression_ratio(self, prompt: int, later: int) -> float:
        """kvpress's compression_ratio for a prompt of `prompt` tokens followed by `later` uncompressed ones."""
        if self.target is None:
            return self.ratio or 0.0
        keep = (prompt + later) / self.target - later  # prompt tokens kept for the target
        # + 0.5: kvpress keeps int(tokens * (1 - ratio)), which must not round below `keep`; at least one token
        return min(max(1.0 - (math.floor(keep) + 0.5) / prompt, 0.0), 1.0 - 1.5 / prompt)


def parse(s: str) -> list[Spec]:
    """'snapkv:0.75,kvzip:4x' -> Specs; ValueError for an unknown press or a bad ratio."""
    out = []
    for item in (x.strip() for x in s.split(",")):
        if not item:
            continue
        name, sep, val = item.partition(":")
        if name not in PRESSES:
            raise ValueError(f"--kvpress: unknown press {name!r}: use {', '.join(PRESSES)}")
        if not sep or not val:
            raise ValueError(f"--kvpress: {item!r} needs a ratio, e.g. {name}:0.75 (share pruned) or {name}:4x")
        try:
            if val.endswith("x"):
                t = float(val[:-1])
                if not t >= 1 or not math.isfinite(t):
                    raise ValueError
                spec = Spec(name, target=t)
            else:
                r = float(val)
                if not 0 <= r < 1:
                    raise ValueError
                spec = Spec(name, ratio=r)
        except ValueError:
            raise ValueError(
                f"--kvpress: bad ratio {val!r} in {item!r}: a share of the prompt pruned in [0, 1) (kvpress's "
                "compression_ratio), or Nx with N >= 1 (N times fewer bytes than 16-bit)"
            ) from None
        if spec in out:
            raise ValueError(f"--kvpress: {spec.name} is given twice")
        out.append(spec)
    if not out:
        raise ValueError("--kvpress is empty: name at least one PRESS:RATIO, e.g. snapkv:0.75")
    return out


WINDOW = 64  # SnapKV's and PyramidKV's observation window (kvpress's default): the prompt must be longer


def too_short(specs: list[Spec], prefill: int) -> str | None:
    """Why the perplexity run's prefill is too short for a press (kvpress asserts it), or None."""
    for s in specs:
        if s.press in ("snapkv", "pyramidkv") and prefill <= WINDOW:
            return (
                f"--kvpress {s.name}: the press scores with the prompt's last {WINDOW} queries, so the perplexity "
                f"run's --prefill must be above {WINDOW} (got {prefill}; docs/eval.md suggests --ctx 1024 --prefill 896)"
            )
    return None


# --- the base model --------------------------------------------------------------------------------------------------


def base_model(artifact, dtype: torch.dtype, device: str = "cpu"):
    """The artifact's base model as plain transformers runs it (sdpa attention), from the artifact's own tensors with
    TALE's factors left out, and its tokenizer. ValueError where the artifact does not hold a base model kvpress can
    press (sliding-window layers: their cache keeps a window of its own)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tale_runtime.artifact import read_manifest
    from tale_runtime.load import resolve
    from tale_runtime.remote_code import base_config

    root = resolve(artifact)
    read_manifest(root)  # ArtifactError if it is not one
    config = base_config(root)
    if getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(
            f"--kvpress: {config.model_type} has sliding-window layers, whose cache keeps a window of its own; the "
            "kvpress baselines run on models with global attention only"
        )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    index = Path(root) / "model.safetensors.index.json"  # the weights' files (not key_basis.safetensors)
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    state = {}
    for f in files:
        with safe_open(Path(root) / f, "pt") as s:
            state |= {k: s.get_tensor(k).to(dtype) for k in s.keys() if ".tale." not in k}
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise ValueError(f"{artifact}: its tensors do not make a {type(model).__name__}: {result}")
    if "lm_head.weight" in result.missing_keys and not config.tie_word_embeddings:
        raise ValueError(f"{artifact}: no lm_head.weight and untied embeddings")
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(root, config=config)
    return model.to(device).eval(), tok


def _kvzip_tokenizer_dir(model, tok) -> tempfile.TemporaryDirectory:
    """KVzip reads a tokenizer from model.config.name_or_path for its reconstruction prompt, and its chat template's
    prefix as the part of the prompt not to reconstruct. The prompts here are raw text, not in the chat template: a
    copy of the tokenizer without one gives KVzip its own default for such models (no prefix, suffix '\\n')."""
    d = tempfile.TemporaryDirectory(prefix="tale-kvzip-tok-")
    t = copy.copy(tok)
    t.chat_template = None
    t.save_pretrained(d.name)
    model.config.name_or_path = d.name
    return d


# --- one prompt through every press -----------------------------------------------------------------------------------


@dataclass
class Filled:
    """A prompt prefilled for one row: its cache, the prefill's last logits, KVzip's masks (per layer)."""

    cache: object
    logits: torch.Tensor
    ratio: float  # kvpress's compression_ratio used
    masks: list | None = None
    seconds: float = 0.0


def _is_kvzip(press) -> bool:
    return type(press).__name__ == "KVzipPress"


def _make(kvpress, spec: Spec, prompt: int, later: int):
    if spec.press is None:
        return None
    cls = getattr(kvpress, PRESSES[spec.press])
    return cls(compression_ratio=spec.compression_ratio(prompt, later))


def _layers(model):
    return model.model.layers


def _clear_masks(model) -> None:
    for layer in _layers(model):
        layer.self_attn.masked_key_indices = None


def _read_masks(model) -> list:
    out = [getattr(layer.self_attn, "masked_key_indices", None) for layer in _layers(model)]
    _clear_masks(model)
    return out


def _forward(model, ids, cache, **kw):
    return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kw).logits[:, -1]


@torch.inference_mode()
def prefill(model, tok, ids: torch.Tensor, specs: list[Spec], later: int, share: bool = True) -> list[Filled]:
    """Every row's cache after the prefill of `ids` [1, T] (`later`: tokens through the cache after it, for byte
    targets). Shared as the module docstring says, or each press under its own context manager. `tok`: the
    tokenizer (KVzip builds its reconstruction prompt with it)."""
    from transformers import DynamicCache

    kvpress = import_kvpress()
    T = ids.shape[1]
    presses = [_make(kvpress, s, T, later) for s in specs]
    out: list[Filled | None] = [None] * len(specs)
    _clear_masks(model)
    fan = [i for i, p in enumerate(presses) if p is not None and not _is_kvzip(p)] if share else []
    if fan or any(p is None for p in presses):  # one forward with the full cache: the full row's, and the shared
        caches = {i: DynamicCache() for i in fan}
        for i in fan:  # what BasePress.__call__ sets up before it hooks the layers
            presses[i].post_init_from_model(model)
        for layer in _layers(model):
            layer.self_attn.rotary_emb = model.model.rotary_emb

        def hook(module, args, kwargs, output):
            i = module.layer_idx
            full = kwargs["past_key_values"].layers[i]
            for j in fan:
                caches[j].update(full.keys, full.values, i)
                presses[j].forward_hook(module, args, dict(kwargs, past_key_values=caches[j]), output)
            return output

        hooks = (
            [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in _layers(model)] if fan else []
        )
        t0 = time.perf_counter()
        full = DynamicCache()
        try:
            logits = _forward(model, ids, full)
        finally:
            for h in hooks:
                h.remove()
        dt = (time.perf_counter() - t0) / max(1, len(fan) + any(p is None for p in presses))
        for i, p in enumerate(presses):
            if p is None:
                out[i] = Filled(full, logits, 0.0, seconds=dt)
            elif i in fan:
                out[i] = Filled(caches[i], logits, p.compression_ratio, seconds=dt)
    # KVzip (always), and every press when not shared: under the press's own context manager
    own = [i for i, p in enumerate(presses) if p is not None and out[i] is None]
    kvzip = [i for i in own if _is_kvzip(presses[i])]
    tok_dir = _kvzip_tokenizer_dir(model, tok) if kvzip else None
    try:
        if share and kvzip:
            _kvzip_shared(model, ids, presses, kvzip, out)
        for i in own:
            if out[i] is not None:
                continue
            t0 = time.perf_counter()
            cache = DynamicCache()
            with presses[i](model):
                logits = _forward(model, ids, cache)
            masks = _read_masks(model) if _is_kvzip(presses[i]) else None
            out[i] = Filled(cache, logits, presses[i].compression_ratio, masks, time.perf_counter() - t0)
    finally:
        if tok_dir is not None:
            tok_dir.cleanup()
    return out


def _kvzip_shared(model, ids, presses, idx: list[int], out: list) -> None:
    """KVzip presses of one setting but the ratio: one scoring pass (the prefill and the context reconstruction)
    under the context manager of the one with the highest ratio, then each ratio's masks from the same scores by
    kvpress's compress_post (which masks the lowest-scored entries, sinks kept)."""
    from transformers import DynamicCache

    groups: dict[tuple, list[int]] = {}
    for i in idx:
        p = presses[i]
        groups.setdefault((p.layerwise, p.n_sink, p.kvzip_plus_normalization, p.chunk_size), []).append(i)
    for members in groups.values():
        lead = presses[max(members, key=lambda i: presses[i].compression_ratio)]
        if lead.compression_ratio == 0:
            continue  # nothing to score: each runs (cheaply) on its own
        scores = {}
        post = lead.compress_post

        def capture(model, lead=lead, post=post, scores=scores):
            scores["val"] = lead.score_val.clone()
            post(model)

        lead.compress_post = capture
        t0 = time.perf_counter()
        cache = DynamicCache()
        try:
            with lead(model):
                logits = _forward(model, ids, cache)
        finally:
            del lead.compress_post
        _clear_masks(model)
        dt = (time.perf_counter() - t0) / len(members)
        for i in members:
            p = presses[i]
            masks = None
            if p.compression_ratio > 0:
                p.score_val = scores["val"].clone()
                p.compress_post(model)
                p._reset_internal_parameters()
                masks = _read_masks(model)
            out[i] = Filled(copy.deepcopy(cache), logits, p.compression_ratio, masks, dt)


# --- bytes -------------------------------------------------------------------------------------------------------------


def held_nbytes(cache) -> int:
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )


def kept_nbytes(cache, masks) -> int:
    """Held bytes less the entries KVzip masks (a key and a value of head_dim each, per masked index)."""
    held = held_nbytes(cache)
    if not masks:
        return held
    for layer, m in zip(cache.layers, masks):
        if m is not None:
            held -= len(m[0]) * 2 * layer.keys.shape[-1] * layer.keys.element_size()
    return held


def baseline(model, tokens: int) -> int:
    from tale_runtime.cache import baseline_nbytes

    c = model.config
    n = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return baseline_nbytes(1, c.num_key_value_heads, n, tokens, [None] * c.num_hidden_layers)


# --- decoding ----------------------------------------------------------------------------------------------------------


class _Masks:
    """KVzip's masks on the attention layers for one row's decode calls, cleared after."""

    def __init__(self, model, masks):
        self.model, self.masks = model, masks

    def __enter__(self):
        if self.masks:
            for layer, m in zip(_layers(self.model), self.masks):
                layer.self_attn.masked_key_indices = m

    def __exit__(self, *exc):
        _clear_masks(self.model)


@torch.inference_mode()
def greedy(model, f: Filled, prompt: int, steps: int) -> list[int]:
    """`steps` greedy tokens through the row's cache, at their true positions (the cache may hold fewer)."""
    nxt, out = f.logits.argmax(-1, keepdim=True), []
    with _Masks(model, f.masks):
        for i in range(steps):
            out.append(int(nxt))
            if i + 1 < steps:
                pos = torch.tensor([[prompt + i]], device=nxt.device)
                nxt = model(input_ids=nxt, past_key_values=f.cache, position_ids=pos, use_cache=True).logits
                nxt = nxt[:, -1].argmax(-1, keepdim=True)
    return out


@torch.inference_mode()
def chunk_nll(model, ids: torch.Tensor, f: Filled, prefill: int, chunk: int) -> tuple[float, int]:
    """perplexity.decode_nll after the prefill: the rest teacher-forced in chunks, at their true positions."""
    from tale_runtime.generate import NonFiniteLogits

    from .perplexity import pattern

    nll, count, s = 0.0, 0, prefill
    with _Masks(model, f.masks):
        for T in pattern(ids.shape[1], prefill, chunk)[1:]:
            pos = torch.arange(s, s + T, device=ids.device)[None]
            logits = model(
                input_ids=ids[:, s : s + T], past_key_values=f.cache, position_ids=pos, use_cache=True
            ).logits
            target = ids[:, s + 1 : s + T + 1]
            nll += F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum").item()
            if not math.isfinite(nll):
                raise NonFiniteLogits(f"the decode call at token {s}")
            count += target.numel()
            s += T
    return nll, count


# --- the runs ----------------------------------------------------------------------------------------------------------


@dataclass
class _Acc:
    base: int = 0
    held: int = 0
    kept: int = 0
    ratios: list = field(default_factory=list)  # kvpress's compression_ratio of each run
    seconds: float = 0.0

    def add(self, model, f: Filled, tokens: int) -> tuple[int, int, int]:
        b, h, k = baseline(model, tokens), held_nbytes(f.cache), kept_nbytes(f.cache, f.masks)
        self.base, self.held, self.kept = self.base + b, self.held + h, self.kept + k
        self.ratios.append(f.ratio)
        return b, h, k

    def summary(self) -> dict:
        cr = sum(self.ratios) / len(self.ratios) if self.ratios else 0.0
        return {
            "ratio": self.base / self.held if self.held else float("nan"),
            "kept_ratio": self.base / self.kept if self.kept else float("nan"),
            "compression_ratio": cr,
            "kvpress_ratio": 1 / (1 - cr),
        }


def _detail(spec: Spec, prompt_note: str) -> str:
    if spec.press is None:
        return "the artifact's base model, transformers' DynamicCache, no press"
    return f"kvpress {PRESSES[spec.press]}, {spec.label()}, at the prefill ({prompt_note})"


def measure(model, tok, specs: list[Spec], texts: dict, prefill_n: int, chunk: int, samples: list, share: bool, log):
    """tale-eval's rows (measure.measure's fields) for every spec: decode-mode perplexity per text (each window a
    run of its own: KVzip takes one row at a time), the ratios of the first text's runs, and pass-key."""
    from . import passkey
    from .perplexity import pattern

    rows = [
        {
            "policy": s.name,
            "family": "full" if s.press is None else "kvpress",
            "setting": s.label(),
            "detail": _detail(s, f"the first {prefill_n} tokens of each window; the rest appended uncompressed"),
            "ppl": {},
            "ranks": None,
            "kvpress": None if s.press is None else {"press": PRESSES[s.press], "ratio": s.ratio, "target": s.target},
        }
        for s in specs
    ]
    accs = [_Acc() for _ in specs]
    for ti, (name, ids) in enumerate(texts.items()):
        nll = [0.0] * len(specs)
        count = [0] * len(specs)
        pat = pattern(ids.shape[1], prefill_n, chunk)
        for w in range(ids.shape[0]):
            x = ids[w : w + 1].to(model.device)
            filled = prefill(model, tok, x[:, :prefill_n], specs, sum(pat[1:]), share)
            for i, f in enumerate(filled):
                t0 = time.perf_counter()
                a, c = chunk_nll(model, x, f, prefill_n, chunk)
                nll[i], count[i] = nll[i] + a, count[i] + c
                accs[i].seconds += f.seconds + time.perf_counter() - t0
                if ti == 0:
                    accs[i].add(model, f, sum(pat))
            log(f"ppl {name} window {w + 1}/{ids.shape[0]}: " + ", ".join(f"{s.name}" for s in specs))
        for i in range(len(specs)):
            rows[i]["ppl"][name] = math.exp(nll[i] / count[i])
            if ti == 0:
                rows[i]["tokens"] = count[i]
    for r, a in zip(rows, accs):
        s = a.summary()
        r.update(ratio=s["ratio"], ratio_total=s["ratio"], kept_ratio=s["kept_ratio"])
        r["nominal"] = s["kvpress_ratio"] if r["family"] == "kvpress" else None
        r["compression_ratio"] = s["compression_ratio"]
    if samples:
        res = _generate_all(model, tok, samples, specs, share, 8, lambda s: s["answer"], log, "pass-key")
        for r, x in zip(rows, res):
            ok = [passkey.first_number(a["output"]) == a["answer"] for a in x["answers"]]
            r.update(
                passkey=sum(ok) / len(ok),
                passkey_ratio=x["ratio"],
                passkey_answers=[
                    {"id": a["id"], "tokens": a["tokens"], "output": a["output"], "correct": c}
                    for a, c in zip(x["answers"], ok)
                ],
            )
    for r, a in zip(rows, accs):
        r["seconds"] = a.seconds
    return rows


def _generate_all(model, tok, samples, specs, share, steps_of, answer_of, log, what, on_sample=None):
    """Every sample prefilled once for every spec and answered greedily; per spec the answers and the byte ratios."""
    accs = [_Acc() for _ in specs]
    answers = [[] for _ in specs]
    for s in samples:
        ids = tok(s["prompt"], return_tensors="pt").input_ids.to(model.device)
        T = ids.shape[1]
        steps = steps_of if isinstance(steps_of, int) else steps_of(s)
        filled = prefill(model, tok, ids, specs, steps - 1, share)
        line, done = [], {}
        for i, (spec, f) in enumerate(zip(specs, filled)):
            t0 = time.perf_counter()
            text = tok.decode(greedy(model, f, T, steps), skip_special_tokens=True)
            accs[i].seconds += f.seconds + time.perf_counter() - t0
            b, h, k = accs[i].add(model, f, T + steps - 1)
            answers[i].append({"id": s["id"], "tokens": T, "output": text, "answer": answer_of(s)})
            done[spec.name] = {"output": text, "bytes": h, "kept_bytes": k, "base": b, "compression_ratio": f.ratio}
            line.append(spec.name)
        log(f"{what} {s['id']} ({T} tokens): " + ", ".join(line))
        if on_sample:
            on_sample(s, done, answers)
    return [dict(a.summary(), answers=x, seconds=a.seconds) for a, x in zip(accs, answers)]


def retrieval_run(model, tok, samples: list[dict], specs: list[Spec], log, share: bool = True, on_sample=None):
    """retrieval.run's results for every spec (score, tasks, ratio, answers), with kept_ratio and kvpress's
    compression_ratio beside them."""
    from .retrieval import length_name, score

    def scored(s, done, answers):
        for spec in specs:
            d = done[spec.name]
            d["score"] = score(d["output"], s["answers"])
        log(f"retrieval {s['id']}: " + ", ".join(f"{n} {d['score']:.2f}" for n, d in done.items()))
        if on_sample:
            on_sample(s, done)

    res = _generate_all(
        model,
        tok,
        samples,
        specs,
        share,
        lambda s: s["max_new_tokens"],
        lambda s: s["answers"],
        lambda *_: None,
        "retrieval",
        scored,
    )
    out = []
    for r in res:
        tasks: dict[str, list[float]] = {}
        answers = []
        for s, a in zip(samples, r["answers"]):
            sc = score(a["output"], s["answers"])
            tasks.setdefault(f"{length_name(s['length'])}/{s['family']}", []).append(sc)
            answers.append({"id": a["id"], "tokens": a["tokens"], "output": a["output"], "score": sc})
        tasks = {k: sum(v) / len(v) for k, v in tasks.items()}
        out.append(
            {
                "score": sum(tasks.values()) / len(tasks) if tasks else 0.0,
                "tasks": tasks,
                "samples": len(samples),
                "ratio": r["ratio"],
                "kept_ratio": r["kept_ratio"],
                "compression_ratio": r["compression_ratio"],
                "answers": answers,
            }
        )
    return out


def quiet_warnings() -> None:
    """kvpress warns of KVzip's cost at every press made and of models it has not tested at every use: once is in
    docs/eval.md."""
    for name in ("kvpress.presses.kvzip_press", "kvpress.presses.base_press"):
        logging.getLogger(name).setLevel(logging.ERROR)


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("kvpress", "transformers", "torch")}


def spec_names(specs: list[Spec]) -> str:
    return ", ".join(s.name for s in specs)
