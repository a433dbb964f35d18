"""The streaming converter: same tensors as a whole-model conversion, exact prefill through the kept
v_proj, resume across shards, source validation, interrupts, and no `datasets` needed."""

from __future__ import annotations

import importlib
import json
import shutil
import sys

import pytest
import torch
from conftest import TINY, TINY_GROUP, TINY_OPTS, save_tiny
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tale_helpers import interrupt_at_call

from tale_convert import ConvertError, calibrate, resume, source, write
from tale_convert.convert import Options, convert
from tale_convert.fuse import fuse
from tale_convert.whiten import rotate_latents, whiten
from tale_runtime.artifact import O_FUSED, U_V, V_V, read_manifest
from tale_runtime.model import cache_arg
from tale_runtime.schedule import PRESETS

convert_mod = importlib.import_module("tale_convert.convert")  # the package exports a function of that name


def tiny_opts(arch: str, **kw) -> Options:
    return Options(group=TINY_GROUP[arch], **{**TINY_OPTS, **kw})


def artifact_tensors(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_file(path / f))
    return out


@torch.no_grad()
def reference(model_dir, opts: Options, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The artifact's tensors computed the way tale-convert did before it streamed: the whole model
    loaded by transformers, each layer upcast in place, factors from the same whitening."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    docs, _ = calibrate.load_documents(None)
    tokens = calibrate.sample_tokens(tok, docs, opts.samples, opts.seq_len, opts.seed)
    cfg = hf.config
    K, H = cfg.num_key_value_heads, cfg.num_attention_heads
    n = cfg.head_dim
    hidden = torch.cat([hf.model.embed_tokens(t).float() for t in tokens.split(max(1, 4096 // opts.seq_len))])
    rope = hf.model.rotary_emb(torch.zeros(1), torch.arange(opts.seq_len)[None])
    preset = PRESETS[opts.preset].rotate_latents
    rotate = preset if opts.rotate_latents is None else opts.rotate_latents  # latents rotated as tale-convert does
    out = {}
    for i, layer in enumerate(hf.model.layers):
        layer.float()
        C = calibrate.run_layer(layer, hidden, rope, i, covariance=True)
        f = whiten(C, layer.self_attn.v_proj.weight.T, opts.group, n)
        if rotate:
            f = rotate_latents(f, opts.latent_group(opts.group * n))
        p = f"model.layers.{i}.self_attn."
        out[p + U_V], out[p + V_V] = f.A.to(dtype), f.B.to(dtype)
        out[p + O_FUSED] = fuse(f.B, layer.self_attn.o_proj.weight.T.double(), H).T.to(dtype)
        assert K % opts.group == 0
    base = load_file(model_dir / "model.safetensors")
    if cfg.tie_word_embeddings:
        base.pop("lm_head.weight", None)
    return {**out, **{k: v.to(dtype) for k, v in base.items()}}


@pytest.mark.parametrize("arch,dtype", [("llama", "fp32"), ("qwen2", "bf16"), ("mha", "fp32")])
def test_streamed_artifact_equals_whole_model_conversion(arch, dtype, tiny_model_dir, tmp_path):
    opts = tiny_opts(arch, dtype=dtype)
    out = tmp_path / "tale"
    convert(str(tiny_model_dir(arch)), out, opts)
    got = artifact_tensors(out)
    want = reference(tiny_model_dir(arch), opts, convert_mod.DTYPES[dtype])
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_logits_equal_the_base_model(arch, dtype, tiny_model_dir, tmp_path):
    """Lazy means exact: the prefill runs the kept v_proj, so logits are the base model's bit for bit."""
    from transformers import AutoModelForCausalLM

    from tale_runtime import load, new_cache

    out = tmp_path / "tale"
    convert(str(tiny_model_dir(arch)), out, tiny_opts(arch, dtype="bf16" if dtype == torch.bfloat16 else "fp32"))
    model, _ = load(out, device="cpu", dtype=dtype)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=dtype, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base(ids).logits
        assert torch.equal(model(ids).logits, want)
        assert torch.equal(model(ids, **cache_arg(new_cache(model))).logits, want)  # filling the cache too


def test_resume_across_shards_keeps_complete_shards_and_gives_identical_bytes(tiny_model_dir, tmp_path, monkeypatch):
    """Small shards: an interrupted run leaves complete shards (renamed) and one .part; the resumed
    run keeps the complete ones, rewrites the rest, and the artifact is byte-identical."""
    model = str(tiny_model_dir("llama"))  # 3 layers
    opts = tiny_opts("llama", shard_size="200KB")
    fresh = tmp_path / "fresh"
    convert(model, fresh, opts)
    assert len(read_manifest(fresh)["files"]) > 3

    real_whiten = interrupt_at_call(monkeypatch, convert_mod, "whiten", 3)  # at layer 2
    out = tmp_path / "tale"
    with pytest.raises(KeyboardInterrupt):
        convert(model, out, opts)
    (tmp,) = tmp_path.glob("tale.tmp-*")
    kept = json.loads((tmp / resume.DIR / "shards.json").read_text())["done"]
    assert kept and all((tmp / f).is_file() for f in kept)

    monkeypatch.setattr(convert_mod, "whiten", real_whiten)
    rewritten = []
    real_open = write.ShardWriter._open
    monkeypatch.setattr(
        write.ShardWriter, "_open", lambda self, k: rewritten.append(self.files[k]) or real_open(self, k)
    )
    convert(model, out, tiny_opts("llama", shard_size="200KB", resume=True))
    assert not set(rewritten) & set(kept)
    assert read_manifest(out)["files"] == read_manifest(fresh)["files"]
    for f in read_manifest(out)["files"]:
        assert (out / f).read_bytes() == (fresh / f).read_bytes()
    assert (out / "model.safetensors.index.json").read_bytes() == (fresh / "model.safetensors.index.json").read_bytes()


def test_interrupt_before_any_layer_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch):
    def interrupt(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate, "run_layer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(str(tiny_model_dir("llama")), tmp_path / "tale", tiny_opts("llama"))
    assert not list(tmp_path.iterdir())


def test_interrupted_resume_keeps_its_layers(tiny_model_dir, tmp_path, monkeypatch):
    model = str(tiny_model_dir("llama"))
    real_whiten, n = convert_mod.whiten, []

    def crash(at):
        def w(*a, **kw):
            n.append(1)
            if len(n) == at:
                raise KeyboardInterrupt
            return real_whiten(*a, **kw)

        return w

    out = tmp_path / "tale"
    monkeypatch.setattr(convert_mod, "whiten", crash(2))  # layer 0 finishes
    with pytest.raises(KeyboardInterrupt):
        convert(model, out, tiny_opts("llama"))
    n.clear()
    monkeypatch.setattr(convert_mod, "whiten", crash(2))  # the resume finishes layer 1, then stops
    with pytest.raises(KeyboardInterrupt):
        convert(model, out, tiny_opts("llama", resume=True))
    (tmp,) = tmp_path.glob("tale.tmp-*")
    assert resume.finished(tmp) == 2
    # an interrupt before the resumed run computed anything keeps what it adopted
    monkeypatch.setattr(calibrate, "run_layer", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert(model, out, tiny_opts("llama", resume=True))
    (tmp,) = tmp_path.glob("tale.tmp-*")
    assert resume.finished(tmp) == 2


def test_bundled_corpus_and_json_need_no_datasets(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    convert(str(tiny_model_dir("llama")), tmp_path / "a", tiny_opts("llama"))
    docs = tmp_path / "c.jsonl"
    text = " ".join(f"word{i}" for i in range(400))
    docs.write_text("\n".join(json.dumps({"text": text}) for _ in range(30)))
    convert(str(tiny_model_dir("llama")), tmp_path / "b", tiny_opts("llama", calib=[docs]))
    pq = tmp_path / "c.parquet"
    pq.write_bytes(b"PAR1")
    with pytest.raises(ConvertError, match=r"needs the `datasets` package: pip install 'tale-kv\[convert\]'"):
        calibrate.load_documents([pq])


def test_json_calibration_files(tmp_path):
    one = tmp_path / "a.json"
    one.write_text(json.dumps([{"text": "first"}, {"text": ""}, {"text": "second"}]))
    lines = tmp_path / "b.jsonl"
    lines.write_text('{"text": "third"}\n\n{"text": "fourth"}\n')
    txt = tmp_path / "c.txt"
    txt.write_text("a whole\nfile")
    docs, info = calibrate.load_documents([one, lines, txt])
    assert docs == ["a whole\nfile", "first", "second", "third", "fourth"]  # text files first, as before
    assert set(info["files"]) == {"a.json", "b.jsonl", "c.txt"}
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ConvertError, match="d.jsonl, line 2: not JSON"):
        calibrate.load_documents([bad])


def test_shard_writer_files_read_back(tmp_path):
    """The streamed safetensors files are what safetensors itself reads, chunks included."""
    a, b = torch.randn(5, 7), torch.randn(3).to(torch.bfloat16)
    entries = [write.Entry("a", torch.float32, (5, 7)), write.Entry("b", torch.bfloat16, (3,))]
    w = write.ShardWriter(tmp_path, entries, shard_size=10**9)
    w.write_tensor("a", a[:2])
    w.write_tensor("a", a[2:])
    w.write_tensor("b", b)
    files = w.close()
    (name,) = files
    got = load_file(tmp_path / name)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    with safe_open(tmp_path / name, "pt") as st:
        assert st.metadata() == {"format": "pt"}
    w = write.ShardWriter(tmp_path / "x", entries, shard_size=10**9)
    with pytest.raises(RuntimeError, match="expected a"):
        w.write_tensor("b", b)
    w.abort()


# -- source validation: one line, exit 2, nothing written --------------------------------------


def _bad_sources(tmp_path, tiny_tok, tiny_model_dir):
    good = tiny_model_dir("llama")

    def copy(name):
        return shutil.copytree(good, tmp_path / "src" / name)

    def edit_tensors(name, fn):
        d = copy(name)
        t = load_file(d / "model.safetensors")
        fn(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
        return d

    truncated = copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    sharded = copy("sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    tale_dir = tmp_path / "src" / "tale"
    convert(str(good), tale_dir, tiny_opts("llama"))
    old_tale = edit_tensors("old-tale", lambda t: [t.pop(k) for k in list(t) if k.endswith("v_proj.weight")])
    binonly = copy("bin")
    (binonly / "model.safetensors").rename(binonly / "pytorch_model.bin")
    return {
        "truncated": (truncated, "truncated or partially downloaded"),
        "missing-shard": (sharded, "shard model-00002-of-00002.safetensors is missing"),
        "missing-tensor": (
            edit_tensors("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
            "missing, e.g. model.layers.1.mlp.up_proj.weight",
        ),
        "unexpected-tensor": (
            edit_tensors("extra", lambda t: t.update({"model.layers.9.foo": torch.zeros(2)})),
            "does not know, e.g. model.layers.9.foo",
        ),
        "wrong-shape": (
            edit_tensors(
                "shape",
                lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(7, TINY["llama"]["hidden_size"])}),
            ),
            "model.layers.0.mlp.up_proj.weight has shape [7, 128]",
        ),
        "tale-artifact": (tale_dir, "already a TALE artifact"),
        "old-tale-artifact": (old_tale, "looks like a TALE artifact"),
        "bin-only": (binonly, "no *.safetensors weights"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "truncated",
        "missing-shard",
        "missing-tensor",
        "unexpected-tensor",
        "wrong-shape",
        "tale-artifact",
        "old-tale-artifact",
        "bin-only",
        "seq-len",
    ],
)
def test_bad_sources_are_one_line_errors(case, tmp_path, tiny_tok, tiny_model_dir, capsys):
    from test_convert_cli import TINY_ARGS, run

    if case == "seq-len":
        src, match, extra = (
            tiny_model_dir("llama"),
            "exceeds the model's context (max_position_embeddings 512)",
            ["--seq-len", "600"],
        )
    else:
        (src, match), extra = _bad_sources(tmp_path, tiny_tok, tiny_model_dir)[case], []
    work = tmp_path / "work"
    work.mkdir()
    code, out, err = run([src, "--group", "2", "--out", work / "tale", *TINY_ARGS, *extra], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    assert not list(work.iterdir())


def test_source_reads_lazily_in_chunks(tiny_model_dir, monkeypatch):
    src = source.resolve(str(tiny_model_dir("llama")))
    config, _ = source.load_config(src, 2)
    ckpt = source.open_checkpoint(src, config, convert_mod._source_tensors(source.skeleton(config)))
    monkeypatch.setattr(source, "CHUNK_BYTES", 1000)
    name = "model.embed_tokens.weight"
    parts = list(ckpt.chunks(name, torch.bfloat16))
    assert len(parts) > 1
    assert torch.equal(torch.cat(parts), ckpt.read([name])[name].to(torch.bfloat16))
    assert list(ckpt.shapes)[:2] == [name, "model.layers.0.self_attn.q_proj.weight"]  # state_dict order


def test_tied_head_stored_anyway_is_accepted(tiny_tok, tmp_path):
    d = save_tiny(tmp_path / "mha", "mha", tiny_tok)
    t = load_file(d / "model.safetensors")
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    convert(str(d), tmp_path / "tale", tiny_opts("mha"))
    assert "lm_head.weight" not in artifact_tensors(tmp_path / "tale")
