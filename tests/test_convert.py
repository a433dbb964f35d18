"""tale-convert on tiny random checkpoints: the artifact is checked from the written files alone."""

from __future__ import annotations

import importlib
import json
import math
import re
import shutil

import pytest
import torch
from conftest import TINY, TINY_GROUP, TINY_OPTS
from safetensors import safe_open
from safetensors.torch import load_file

from tale_convert import ConvertError, calibrate, resume, source
from tale_convert.convert import Options, convert
from tale_runtime.artifact import O_FUSED, U_V, V_V, ArtifactError, Schedule, nominal_ratio, read_manifest, verify_files
from tale_runtime.spec import Arch

convert_mod = importlib.import_module("tale_convert.convert")  # the package exports a function of that name


def tiny_opts(arch: str, **kw) -> Options:
    return Options(group=TINY_GROUP[arch], **{**TINY_OPTS, **kw})


def read_artifact(path):
    """(manifest, index, {name: tensor}) read back from disk."""
    manifest = read_manifest(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(path / f))
    return manifest, index, tensors


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def artifacts(converted):
    """One fp32 conversion per tiny architecture (conftest.converted), shared by the invariant tests."""
    return converted


@pytest.mark.parametrize("arch", list(TINY))
def test_factors_reproduce_base_weights(arch, artifacts, tiny_model_dir):
    """A_c B_c = W_c per group, O^r blocks = B_{c(q),j(q)} O_q, all other tensors untouched."""
    cfg = TINY[arch]
    d, H, K = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n = cfg.get("head_dim", d // H)
    g = TINY_GROUP[arch]
    G, R, rep = K // g, g * n, H // K
    _, index, art = read_artifact(artifacts[arch])
    base = load_file(tiny_model_dir(arch) / "model.safetensors")

    # the original v_proj.weight (Phi-3: qkv_proj.weight, values in its last K n rows) is kept beside the factors
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        A, B, Of = art[p + U_V], art[p + V_V], art[p + O_FUSED]
        assert A.shape == (G, d, R) and B.shape == (G, R, R) and Of.shape == (d, H * R)
        fused = p + "qkv_proj.weight" in base
        W = (base[p + "qkv_proj.weight"][(H + K) * n :] if fused else base[p + "v_proj.weight"]).T.double()  # [d, K*n]
        for c in range(G):
            assert rel(A[c].double() @ B[c].double(), W[:, c * R : (c + 1) * R]) < 1e-5
        Wo = base[p + "o_proj.weight"].T.double()  # [H*n, d]
        for q in range(H):
            c, j = divmod(q // rep, g)
            want = B[c, :, j * n : (j + 1) * n].double() @ Wo[q * n : (q + 1) * n]
            assert rel(Of.T[q * R : (q + 1) * R].double(), want) < 1e-5
    untouched = dict(base)
    assert set(untouched) <= set(art)
    for k, v in untouched.items():
        assert torch.equal(art[k], v), k
    assert set(art) - set(untouched) == {
        f"model.layers.{i}.self_attn.{t}" for i in range(cfg["num_hidden_layers"]) for t in (U_V, V_V, O_FUSED)
    }
    if arch == "qwen2":
        assert "model.layers.0.self_attn.v_proj.bias" in art
    if arch == "mha":  # tied embeddings are stored once
        assert "lm_head.weight" not in art


@pytest.mark.parametrize("arch", list(TINY))
def test_manifest_architecture_round_trips(arch, artifacts, tiny_model_dir):
    """One shape type (tale_runtime.spec.Arch): the manifest's architecture block reads back into the Arch the
    converter wrote it from (source.check_config), and writes back out byte for byte."""
    m = read_manifest(artifacts[arch])
    config, written = source.load_config(source.resolve(str(tiny_model_dir(arch))), TINY_GROUP[arch])
    assert Arch.from_manifest(m, config) == written
    assert json.dumps(Arch.from_manifest(m).to_manifest()) == json.dumps(m["architecture"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_manifest_index_and_model_files(arch, artifacts, tiny_model_dir, tmp_path):
    path = artifacts[arch]
    m, index, art = read_artifact(path)
    verify_files(path, m)
    cfg, g = TINY[arch], TINY_GROUP[arch]
    a = m["architecture"]
    assert (a["model_type"], a["hidden_size"], a["num_heads"], a["num_kv_heads"], a["head_dim"], a["num_layers"]) == (
        cfg["model_type"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["num_hidden_layers"],
    )
    R = g * cfg["head_dim"]
    assert (a["group_size"], a["num_groups"], a["latent_rank"]) == (g, cfg["num_key_value_heads"] // g, R)
    assert a["layers"] == [{"g": g, "G": a["num_groups"], "R": R}] * cfg["num_hidden_layers"]

    sched = Schedule.from_dict(m["schedule"])
    assert sched.to_dict() == m["schedule"]
    sched.validate(R, cfg["num_hidden_layers"])
    assert (sched.sinks, [(lv.bits, lv.key_bits, lv.share) for lv in sched.levels]) == (4, [(2, 2, None), (4, 4, 0.1)])
    assert sched.ranks == [[R // 2, R]] * cfg["num_hidden_layers"]
    assert m["nominal_ratio"] == pytest.approx(nominal_ratio(sched, cfg["head_dim"], g), abs=1e-4)
    assert m["svd"]["method"] == "svd-llm-whitened" and len(m["svd"]["whitening_eps"]) == cfg["num_hidden_layers"]
    energy = m["energy_kept"]
    assert len(energy) == cfg["num_hidden_layers"] and all(0 < e0 < e1 == pytest.approx(1.0) for e0, e1 in energy)
    c = m["calibration"]
    assert (c["source"], c["samples"], c["seq_len"], c["seed"], c["tokens"]) == ("tale_calib", 8, 64, 0, 512)
    assert m["base"]["id"] == str(tiny_model_dir(arch)) and m["base"]["revision"] is None
    assert list(m["base"]["files"]) == ["model.safetensors"]

    # the index: every tensor in exactly the shard it names, sizes add up, same files as the manifest
    shards = {f for f in m["files"] if f.endswith(".safetensors")}  # the manifest hashes every file
    assert set(index["weight_map"].values()) == shards
    for f in shards:
        with safe_open(path / f, "pt") as st:
            assert {k for k, v in index["weight_map"].items() if v == f} == set(st.keys())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in art.values())

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from tale_runtime import remote_code

    # config.json names the artifact's modeling_tale.py (hashed like every file); plain transformers reads the
    # config through it, and the runtime reads the base's back
    assert "modeling_tale.py" in m["files"] and (path / "modeling_tale.py").read_bytes() == remote_code.module_source()
    hub_cfg = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert (hub_cfg.model_type, hub_cfg.tale_base_model_type) == ("tale", cfg["model_type"])
    drop = ("_name_or_path", "dtype", "transformers_version")
    want, got = (
        {k: v for k, v in c.to_dict().items() if k not in drop}
        for c in (AutoConfig.from_pretrained(tiny_model_dir(arch)), remote_code.base_config(path))
    )
    assert got == want
    assert AutoTokenizer.from_pretrained(path, trust_remote_code=True).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
    GenerationConfig.from_pretrained(path)
    card = (path / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: tale-kv" in front and "- tale" in front and "- kv-cache-compression" in front
    assert f"license: {'mit' if arch == 'llama' else 'other'}" in front
    assert not list(path.parent.glob("*.tmp-*")) and not (path / resume.DIR).exists()

    # tampering is caught by the shared checksum reader
    copy = shutil.copytree(path, tmp_path / "copy")
    shard = copy / sorted(shards)[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum"):
        verify_files(copy, m)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_runtime_prefill_matches_base(arch, artifacts, tiny_model_dir):
    """The artifact is what the runtime loads: its exact prefill reproduces the base logits."""
    from transformers import AutoModelForCausalLM

    from tale_runtime import load

    model, _ = load(artifacts[arch], device="cpu", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32).eval()
    ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel(model(ids).logits, base(ids).logits) < 1e-4


def test_v_proj_input_is_what_v_proj_sees(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), attn_implementation="sdpa").eval()
    layer = model.model.layers[1]
    seen = []
    hook = layer.self_attn.v_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    h = torch.randn(2, 16, TINY["qwen2"]["hidden_size"])
    rope = calibrate.rotary(model, 16, torch.device("cpu"))[1]
    with torch.no_grad():
        layer(h, attention_mask=None, position_embeddings=rope)
        want = calibrate.v_proj_input(layer, h)
    hook.remove()
    assert len(seen) == 1 and torch.equal(seen[0], want)


def test_calibration_sampling_is_seeded_and_checked(tiny_tok):
    docs = ["one two three four five six seven eight nine ten " * 20] * 4
    a = calibrate.sample_tokens(tiny_tok, docs, 6, 32, seed=1)
    assert a.shape == (6, 32)
    assert torch.equal(a, calibrate.sample_tokens(tiny_tok, docs, 6, 32, seed=1))
    assert not torch.equal(a, calibrate.sample_tokens(tiny_tok, docs, 6, 32, seed=2))
    with pytest.raises(ConvertError, match="too short"):
        calibrate.sample_tokens(tiny_tok, docs, 1000, 32, seed=1)


def test_cholesky_jitter():
    from tale_convert.whiten import cholesky, whiten

    X = torch.randn(200, 8, dtype=torch.float64)
    C = X.T @ X
    assert cholesky(C)[1] == 0
    Cs = C.clone()
    Cs[:, 0] = Cs[0, :] = 0  # a dead input channel: singular
    L, eps = cholesky(Cs)
    assert eps >= 1e-6 and torch.allclose(L @ L.T, Cs + eps * Cs.diagonal().mean() * torch.eye(8, dtype=torch.float64))
    # factors are still exact for W, and truncation ranks by whitened energy
    W = torch.randn(8, 4, dtype=torch.float64)
    f = whiten(Cs, W, g=2, n=2)
    assert torch.allclose(f.A[0] @ f.B[0], W, atol=1e-10)
    assert torch.all(f.S[:, :-1] >= f.S[:, 1:])


def test_shrunk_whitening_keeps_the_identity():
    """--shrink pulls the covariance toward mean(diag C) I: the factors still give W exactly at any shrink, and at 1
    the whitening is gone (a plain SVD of W, scaled by sqrt(mean diag C))."""
    from tale_convert.whiten import shrunk, whiten

    X = torch.randn(300, 8, dtype=torch.float64) * torch.linspace(0.1, 5, 8, dtype=torch.float64)
    C, W = X.T @ X, torch.randn(8, 4, dtype=torch.float64)
    assert shrunk(C, 0.0) is C
    m = C.diagonal().mean()
    assert torch.allclose(shrunk(C, 0.25), 0.75 * C + 0.25 * m * torch.eye(8, dtype=torch.float64))
    for a in (0.0, 0.3, 1.0):
        f = whiten(C, W, g=2, n=2, shrink=a)
        assert torch.allclose(f.A[0] @ f.B[0], W, atol=1e-10)
    plain = whiten(C, W, g=2, n=2, shrink=1.0)
    assert torch.allclose(plain.S[0], torch.linalg.svdvals(W) * m.sqrt())
    assert not torch.allclose(whiten(C, W, g=2, n=2).S[0] / m.sqrt(), torch.linalg.svdvals(W), rtol=0.05)


def test_rotated_latents_keep_values_and_truncation():
    """A Q, Q^T B: A B and every block-aligned truncation A_r B_r unchanged; on the calibration activations the
    latents of a block carry its singular values' mean each (the whitened latents are uncorrelated)."""
    from tale_convert.whiten import rotate_latents, whiten

    X = torch.randn(400, 16, dtype=torch.float64) @ torch.randn(16, 16, dtype=torch.float64)
    W = torch.randn(16, 16, dtype=torch.float64)
    f = whiten(X.T @ X, W, g=2, n=8)
    r = rotate_latents(f, 4)
    assert torch.equal(r.S, f.S)
    for k in (4, 8, 12, 16):
        assert torch.allclose(r.A[0, :, :k] @ r.B[0, :k], f.A[0, :, :k] @ f.B[0, :k], atol=1e-9)
    assert not torch.allclose(r.A[0, :, :6] @ r.B[0, :6], f.A[0, :, :6] @ f.B[0, :6], atol=1e-3)  # inside a block
    assert torch.allclose((X @ f.A[0]).square().sum(0), f.S[0], rtol=1e-8)
    assert torch.allclose((X @ r.A[0]).square().sum(0), f.S[0].view(4, 4).mean(1).repeat_interleave(4), rtol=1e-8)
    with pytest.raises(ConvertError, match="power of two"):
        rotate_latents(f, 6)


def test_layout_check_refuses_other_attention(tiny_model_dir):
    src = source.resolve(str(tiny_model_dir("llama")))
    _, arch = source.load_config(src, 2)
    model = source.load_model(src)
    source.check_layout(model, arch)
    model.model.layers[1].self_attn.v_proj = torch.nn.Identity()
    with pytest.raises(ConvertError, match="layer 1: v_proj"):
        source.check_layout(model, arch)


def test_calib_files_and_sharding(tiny_model_dir, tmp_path):
    """--calib .txt + .jsonl, and small shards: same tensors as one shard."""
    from tale_calib import calib_paths

    txt = tmp_path / "a.txt"
    txt.write_text(calib_paths()[0].read_text())
    jl = tmp_path / "b.jsonl"
    paragraphs = calib_paths()[1].read_text().split("\n\n")
    jl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(paragraphs)))
    one = tmp_path / "one"
    convert(str(tiny_model_dir("mistral")), one, tiny_opts("mistral", calib=[txt, jl]))
    many = tmp_path / "many"
    # dtype auto: fp32 as saved, so the same tensors as `one`
    convert(
        str(tiny_model_dir("mistral")), many, tiny_opts("mistral", calib=[txt, jl], shard_size="100KB", dtype="auto")
    )
    m1, _, t1 = read_artifact(one)
    m2, index, t2 = read_artifact(many)
    assert m1["calibration"]["source"] == "files" and set(m1["calibration"]["files"]) == {"a.txt", "b.jsonl"}
    shards1, shards2 = ([f for f in m["files"] if f.endswith(".safetensors")] for m in (m1, m2))
    assert len(shards1) == 1 and len(shards2) > 3
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards2):05d}\.safetensors", f) for f in shards2)
    verify_files(many, m2)
    assert t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)
    # a different seed draws other calibration sequences, hence other factors
    other = tmp_path / "other"
    convert(str(tiny_model_dir("mistral")), other, tiny_opts("mistral", calib=[txt, jl], seed=1))
    name = f"model.layers.0.self_attn.{U_V}"
    assert not torch.equal(read_artifact(other)[2][name], t1[name])


def test_overwrite_replaces_artifact(tiny_model_dir, tmp_path):
    out = tmp_path / "tale"
    convert(str(tiny_model_dir("mha")), out, tiny_opts("mha"))
    with pytest.raises(ConvertError, match="exists"):
        convert(str(tiny_model_dir("mha")), out, tiny_opts("mha", seed=3))
    assert read_manifest(out)["calibration"]["seed"] == 0
    convert(str(tiny_model_dir("mha")), out, tiny_opts("mha", seed=3, overwrite=True, dtype="bf16"))
    m, _, art = read_artifact(out)
    assert m["calibration"]["seed"] == 3 and m["dtype"] == "bfloat16"
    assert {t.dtype for t in art.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tale"]


@pytest.mark.parametrize("checkpoint_hidden", [True, False])
def test_resume_reuses_finished_layers(checkpoint_hidden, tiny_model_dir, tmp_path, monkeypatch):
    """Interrupt after layer 0; --resume recomputes only layers 1 and 2 and gives the same artifact."""
    model = str(tiny_model_dir("llama"))  # 3 layers
    fresh = tmp_path / "fresh"
    convert(model, fresh, tiny_opts("llama"))

    calls = {"whiten": [], "run_layer": []}
    real_whiten, real_run = convert_mod.whiten, calibrate.run_layer

    def whiten(*a, **kw):
        calls["whiten"].append(1)
        if crash and len(calls["whiten"]) == 2:
            raise KeyboardInterrupt
        return real_whiten(*a, **kw)

    def run_layer(layer, hidden, rope, index, covariance):
        calls["run_layer"].append(index)
        return real_run(layer, hidden, rope, index, covariance)

    monkeypatch.setattr(convert_mod, "whiten", whiten)
    monkeypatch.setattr(calibrate, "run_layer", run_layer)
    monkeypatch.setattr(resume, "HIDDEN_EVERY_S", 0.0 if checkpoint_hidden else math.inf)
    out = tmp_path / "tale"
    crash = True
    with pytest.raises(KeyboardInterrupt):
        convert(model, out, tiny_opts("llama"))
    assert not out.exists()
    (partial,) = tmp_path.glob("tale.tmp-*")
    assert sorted(p.name for p in (partial / resume.DIR).glob("layer_*")) == ["layer_0000.safetensors"]

    crash = False
    calls = {"whiten": [], "run_layer": []}
    report = convert(model, out, tiny_opts("llama", resume=True))
    assert len(calls["whiten"]) == 2
    assert calls["run_layer"] == ([1, 2] if checkpoint_hidden else [0, 1, 2])  # layer 0 replayed forward only
    assert [lr.reused for lr in report.layers] == [True, False, False]
    assert read_manifest(out)["files"] == read_manifest(fresh)["files"]  # bit-identical shards
    assert not list(tmp_path.glob("*.tmp-*"))

    # without --resume, or with other settings, nothing is reused
    calls = {"whiten": [], "run_layer": []}
    crash = True
    with pytest.raises(KeyboardInterrupt):
        convert(model, tmp_path / "again", tiny_opts("llama"))
    crash = False
    calls = {"whiten": [], "run_layer": []}
    convert(model, tmp_path / "again", tiny_opts("llama", resume=True, seed=5))
    assert len(calls["whiten"]) == 3


def test_hub_model_records_id_and_revision(tiny_model_dir, tmp_path, monkeypatch):
    """A Hub id goes through snapshot_download; the manifest and card name the repo and commit."""
    import huggingface_hub

    snapshot = tmp_path / "models--someone--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir("qwen2"), snapshot)
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: asked.append(repo) or str(snapshot))
    out = tmp_path / "tale"
    convert("someone/tiny", out, tiny_opts("qwen2"))
    m = read_manifest(out)
    assert asked == ["someone/tiny"]
    assert (m["base"]["id"], m["base"]["revision"]) == ("someone/tiny", "0123abcd")
    assert "base_model: someone/tiny" in (out / "README.md").read_text()
