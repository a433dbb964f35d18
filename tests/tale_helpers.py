"""Test helpers: tiny random models turned into TALE models in memory (no converter needed)."""

from __future__ import annotations

import copy

import torch
from tiny_configs import IN_MEMORY as TINY
from transformers import AutoConfig, AutoModelForCausalLM

from tale_runtime import families
from tale_runtime.artifact import Level, Schedule, uniform_ranks
from tale_runtime.load import tale_class
from tale_runtime.model import TaleAttention
from tale_runtime.spec import Arch, TaleSpec


def shapes(K: int, n: int, G: int, R: int, layers: int = 1) -> Arch:
    """The Arch of a cache of K KV heads of head dim n in G latent groups of rank R (what the caches and the byte count
    read; one query head per KV head, hidden size R)."""
    return Arch("llama", layers, R, K, K, n, K // G, G, R)


def tiny_model(arch: str = "llama", seed: int = 0, dtype=torch.float32):
    return random_model(TINY[arch], seed, dtype, attn_implementation="sdpa")


def random_model(cfg: dict, seed: int = 0, dtype=torch.float32, attn_implementation=None, **config):
    """A random-init model of the config `cfg` (model_type and sizes) with `config` added; the value bias (Qwen2)
    and per-head q/k norms (Qwen3, Gemma 3) randomized so that the conversion must carry them."""
    cfg = dict(cfg)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg, **config)
    torch.manual_seed(seed)
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kw).eval()
    if config.model_type == "qwen2":
        for layer in model.model.layers:
            layer.self_attn.v_proj.bias.data.normal_(0, 0.5)
    randomize_norms(model)
    return model


def randomize_norms(model) -> None:
    """Random per-head q/k norm weights (Qwen3, Gemma 3 start them at the identity): the norms must matter."""
    for layer in model.model.layers:
        for name in ("q_norm", "k_norm"):
            if (norm := getattr(layer.self_attn, name, None)) is not None:
                norm.weight.data.uniform_(-0.5, 1.5)


def talify(model, group: int, schedule: Schedule | None = None):
    """A TALE copy of `model` with plain (unwhitened) SVD factors: enough for runtime identities."""
    tm = copy.deepcopy(model)
    cfg = tm.config
    n = tm.model.layers[0].self_attn.head_dim
    K = cfg.num_key_value_heads
    G, R = K // group, group * n
    for i, layer in enumerate(tm.model.layers):
        orig = layer.self_attn
        att = TaleAttention(orig, cfg, i, group)
        W = families.value_weight(orig, cfg).detach().double().T  # [d, K*n]
        Wo = orig.o_proj.weight.detach().double().T  # [H*n, d]
        A, B, Of = [], [], []
        for c in range(G):
            U, S, Vh = torch.linalg.svd(W[:, c * R : (c + 1) * R], full_matrices=False)
            A.append(U * S.sqrt())
            B.append(S.sqrt()[:, None] * Vh)
        rep = cfg.num_attention_heads // K
        for q in range(cfg.num_attention_heads):
            m = q // rep
            c, j = m // group, m % group
            Of.append(B[c][:, j * n : (j + 1) * n] @ Wo[q * n : (q + 1) * n])
        dt = orig.o_proj.weight.dtype
        att.tale.u_v.data = torch.stack(A).to(dt)
        att.tale.v_v.data = torch.stack(B).to(dt)
        att.tale.o_fused.data = torch.cat(Of).T.contiguous().to(dt)
        layer.self_attn = att
    L = cfg.num_hidden_layers
    sched = schedule or Schedule(ranks=uniform_ranks(R, L, 0.5, value_group=8), value_group=8, key_group=8, residual=8)
    arch = Arch.from_config(cfg, group)
    tm.tale_spec = TaleSpec(arch, sched, None, {"architecture": arch.to_manifest()})
    tm.__class__ = tale_class(type(tm))
    return tm


@torch.no_grad()
def feed(model, ids: torch.Tensor, cache, prefix: int, end: int | None = None, chunks: list[int] | None = None):
    """Prefill ids[:, :prefix] into `cache`, then feed ids[:, prefix:end] in `chunks` (default: one token at a
    time): the logits [B, 1 + fed, V] of the prefill's last position and of every position fed."""
    from tale_runtime.model import cache_arg

    out = [model(ids[:, :prefix], **cache_arg(cache)).logits[:, -1:]]
    t = prefix
    for c in chunks or [1] * ((ids.shape[1] if end is None else end) - prefix):
        out.append(model(ids[:, t : t + c], **cache_arg(cache)).logits)
        t += c
    return torch.cat(out, 1)


def exact_schedule(R: int, layers: int, sinks: int = 4) -> Schedule:
    """No compression: r0 = R, all bits 16."""
    return Schedule(
        sinks=sinks,
        levels=[Level(16, 16, None), Level(16, 16, 0.1)],
        ranks=[[R, R]] * layers,
        key_group=8,
        value_group=8,
        residual=8,
    )


def grouped_schedule(levels: list[Level], ranks: list[list[int]], **kw) -> Schedule:
    """A schedule at the tiny models' quantization groups of 8 (key tokens, latent channels), its latents' scales
    and zeros at 8 bits ("8/8"); `kw`: the other Schedule fields (residual, key_channel_group, key_meta, ...)."""
    return Schedule(levels=levels, ranks=ranks, key_group=8, value_group=8, value_meta="8/8", **kw)


def interrupt_at_call(monkeypatch, owner, name: str, n: int):
    """Patch `owner.name` so that its n-th call raises KeyboardInterrupt (a Ctrl-C mid-run) while the others go
    through; returns the original."""
    real, calls = getattr(owner, name), []

    def patched(*a, **kw):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, patched)
    return real


def byte_tokenizer():
    """A byte-level tokenizer without merges (256 bytes + <eos>) and a chat template: multi-byte
    characters span several tokens. Fits the tiny models' vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=257,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    t.train_from_iterator(["x"], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


def save_artifact(tm, path, tokenizer=None):
    """Write a talified model as a TALE artifact directory (the layout of DESIGN.md 6)."""
    from pathlib import Path

    from safetensors.torch import save_file

    from tale_runtime.artifact import FORMAT, FORMAT_VERSION, MANIFEST, hash_files, nominal_ratio, write_json

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tm.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in tm.state_dict().items()}
    if tm.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, path / "model.safetensors")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    arch = tm.tale_spec.arch
    write_json(
        path / MANIFEST,
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "architecture": arch.to_manifest(),
            "schedule": tm.tale_spec.schedule.to_dict(),
            "nominal_ratio": nominal_ratio(tm.tale_spec.schedule, arch.head_dim, arch.group_size),
            "files": hash_files(path),  # every file, as the converter writes it
        },
    )
    return path


def invoke(main, args, input=None):
    """Run a console-script entry point (`main(argv)`, tale_runtime.console.run_app) the way a shell would,
    output captured as typer's CliRunner does (`input`: standard input): -> .exit_code, .stdout, .stderr."""
    import sys
    from types import SimpleNamespace

    from typer.testing import CliRunner

    with CliRunner().isolation(input=input) as (out, err, _):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        o, e = out.getvalue().decode(), err.getvalue().decode()
        return SimpleNamespace(exit_code=code, stdout=o, stderr=e, output=o + e)


def one_line_error(r, fragment: str, code: int = 2) -> None:
    """`r` (invoke's result) exited with `code` and said one line on stderr, `error: ...` with `fragment` in it, and
    no traceback: the CLI contract on bad input (docs/errors.md)."""
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert fragment in lines[0], r.stderr
    assert "Traceback" not in r.output and "internal error" not in r.output


def refusals(cases: dict[str, str]):
    """Parametrizes a test of a CLI's refusals over `args, fragment`: {its arguments, split at spaces: a fragment of
    the one-line error they must give}, each case's id its arguments."""
    import pytest  # not at the top: benchmarks import this module too

    return pytest.mark.parametrize("args, fragment", [(a.split(), f) for a, f in cases.items()], ids=list(cases))


def three_levels(sinks: int = 3, residual: int = 8) -> Schedule:
    """A 2/4/8-bit schedule of three levels at ranks 8/16/32 of 32 (head dim 16, two KV heads)."""
    return Schedule(
        sinks=sinks,
        levels=[Level(2, 2, None), Level(4, 4, 0.2), Level(8, 8, 0.1)],
        ranks=[[8, 16, 32]],
        key_group=8,
        value_group=8,
        residual=residual,
    )
