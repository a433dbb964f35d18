"""The tensors the vLLM plugin hands to vLLM's layers, against tale_runtime's TaleAttention (no engine: torch only).

For softmax weights s over T tokens, vLLM computes per query head z_q = sum_t s_qt hv_t[m(q)] with hv = x W'_v + b'
(the "v" rows and bias of qkv_proj) and then o_proj(z). That must equal TaleAttention.output of the zero-padded
latent sum pad_R(h[:r]) (DESIGN.md 4), and at r = R the base model's attention output."""

from __future__ import annotations

import json

import pytest
import torch

from tale_runtime.vllm import source


def vllm_side(t: dict, prefix: str, x: torch.Tensor, s: torch.Tensor, K: int) -> torch.Tensor:
    """x [T, d], s [H, T] -> [d], as vLLM's qkv_proj 'v' rows, attention and o_proj compute it (float64). K: the
    value heads (the packed cache: the G latent groups, query head q reading group q // (H / G))."""
    w = t[prefix + "v_proj.weight"].double()  # [K*r, d]
    hv = x @ w.T
    if prefix + "v_proj.bias" in t:
        hv = hv + t[prefix + "v_proj.bias"].double()
    T, H = x.shape[0], s.shape[0]
    hv = hv.view(T, K, -1)  # [T, K, r]
    z = torch.einsum("ht,thr->hr", s, hv[:, torch.arange(H) // (H // K)])  # [H, r]
    out = t[prefix + "o_proj.weight"].double() @ z.reshape(-1)
    if prefix + "o_proj.bias" in t:
        out = out + t[prefix + "o_proj.bias"].double()
    return out


@pytest.mark.parametrize("arch,group", [("llama", 2), ("qwen2", 1), ("mistral", 2)])
def test_latent_values_and_cut_output_equal_tale_runtime(converted, arch, group):
    import tale_runtime

    _, art = converted(arch, group)
    model, _ = tale_runtime.load(art, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    for rank in ("full", 8, "packed"):
        # packed: the tensors of the packed cache (each group's latent once, at full rank, and O^R whole)
        src = source.open_artifact(art, 8, kv_cache="k4v4") if rank == "packed" else source.open_artifact(art, rank)
        t = dict(source.tensors(src))
        a = src.arch
        for i, layer in enumerate(model.model.layers):
            att, r = layer.self_attn, a.latent_rank if rank == "packed" else src.ranks[i]
            prefix = f"model.layers.{i}.self_attn."
            x = torch.randn(5, a.hidden_size, dtype=torch.float64)
            s = torch.softmax(torch.randn(a.num_heads, 5, dtype=torch.float64), -1)
            got = vllm_side(t, prefix, x, s, a.num_groups if rank == "packed" else a.num_kv_heads)

            # TaleAttention: z_q = sum_t s_qt pad_R(h_t[c(q)][:r]), output through O^r (+ the value bias's output)
            m = torch.arange(a.num_heads) // (a.num_heads // a.num_kv_heads)  # KV head of each query head
            h = att.latents(x[None].float())[0].double()  # [G, T, R]
            h[..., r:] = 0
            z = torch.einsum("qt,qtr->qr", s, h[m // a.group_size])  # [H, R]
            want = att.output(z[None, None].float())[0, 0].double()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            if r == a.latent_rank:  # the base model's attention output: v = x W_V (+ b), through W_O
                v = att.v_proj(x.float()).double().view(5, a.num_kv_heads, a.head_dim)  # [T, K, n]
                zb = torch.einsum("qt,tqn->qn", s, v[:, m])  # [H, n]
                base = att.o_proj(zb.reshape(-1).float()).double()
                torch.testing.assert_close(got, base, rtol=1e-4, atol=1e-5)


def test_the_plugin_serves_every_family_the_converter_takes():
    from tale_runtime import families
    from tale_runtime.vllm import ARCHITECTURES

    assert set(ARCHITECTURES) == set(families.SUPPORTED)


def test_the_packed_cache_refuses_sliding_layers_in_one_line(converted):
    _, art = converted("gemma3", 1)
    with pytest.raises(ValueError) as e:
        source.open_artifact(art, "full", kv_cache="k4v4")
    assert str(e.value) == (
        "the packed cache (kv_cache='k4v4') has no sliding-window attention, which gemma3_text's sliding layers need: "
        "serve it with kv_cache=None"
    )
    assert source.open_artifact(art, "full").bits is None  # stage 1 serves it


def test_value_rank_refusals(converted):
    _, art = converted("llama", 2)
    with pytest.raises(ValueError, match=r"value rank 65 is outside \[1, 32\]"):
        source.open_artifact(art, 65)
    with pytest.raises(ValueError, match="'full', 'level0' or a whole number"):
        source.open_artifact(art, "half")
    src = source.open_artifact(art, 16)  # = head dim: one head size
    source.check_backend(src, cpu=True)
    with pytest.raises(ValueError, match=r"value rank 32 != head dim 16: vLLM's CPU attention"):
        source.check_backend(source.open_artifact(art, "full"), cpu=True)
    source.check_backend(source.open_artifact(art, "full"), cpu=False)  # the DIFFKV backends (CUDA)


def test_engine_args(converted):
    """engine_args names the TALE class and carries the value rank; on the CPU it refuses r != n before any engine."""
    pytest.importorskip("vllm.v1.attention.backend")  # vLLM itself, not this test directory
    import tale_runtime.vllm as tale_vllm

    _, art = converted("llama", 2)
    args = tale_vllm.engine_args(art, 16)
    # config.json says model_type "tale": the plugin's config class names the TALE class (tale_runtime.vllm.config)
    assert args == {"model": str(art), "hf_overrides": {"tale_value_rank": 16}}
    from transformers import AutoConfig

    from tale_runtime.vllm import config as served

    served.register()
    config = AutoConfig.from_pretrained(art)
    assert (config.model_type, config.architectures, config.head_dim) == ("llama", ["TaleLlamaForCausalLM"], 16)
    with pytest.raises(ValueError, match=r"value rank 32 != head dim 16"):
        tale_vllm.engine_args(art, "full")


def test_rank_cut_inside_latent_rotation_blocks_refused(converted, tmp_path):
    from conftest import main_fixtures

    from tale_convert.convert import Options, convert

    base, _ = converted("llama", 2)
    art = tmp_path / "rotated"
    convert(str(base), art, Options(group=2, rotate_latents=True, **main_fixtures.TINY_OPTS))  # blocks of value_group 8
    assert len(source.open_artifact(art, 16).ranks) == 3
    with pytest.raises(ValueError, match=r"value rank 12 cuts inside the latents' rotation blocks of 8"):
        source.open_artifact(art, 12)


def test_packed_levels_and_refusals(converted):
    _, art = converted("llama", 2)  # 3 layers, head dim 16, g = 2: R = 32
    src = source.open_artifact(art, "full", kv_cache="k4v4")  # first and last layer at 16 bits by default
    assert src.bits == ((16, 16), (4, 4), (16, 16))
    f = src.paged_format(1, torch.bfloat16)
    assert (f.key_bits, f.lat_bits, f.rank, f.key_group, f.lat_group) == (4, 4, 32, 16, 32)
    source.check_backend(src, cpu=True)  # R != n is served on the CPU by the packed backend
    level0 = source.open_artifact(art, "level0", kv_cache="level0", exact_layers=0)
    sched = json.loads((art / "tale_config.json").read_text())["schedule"]
    lv = sched["levels"][0]
    assert level0.bits == ((lv["key_bits"], lv["bits"]),) * 3
    assert level0.ranks == tuple(r[0] for r in sched["ranks"])
    for kv, exact, msg in [
        ("k3v4", 1, r"the packed cache holds keys and latents at 2, 4, 8, 16 bits, not keys 3 / latents 4"),
        ("fp8", 1, r"kv cache must be 'level0' or 'k<bits>v<bits>' \(e.g. 'k4v4'\), got 'fp8'"),
        ("k4v4", -1, r"exact layers must be a whole number >= 0, got -1"),
        ("k4v4", "rot", r"rotate must be 'hadamard' or 'none', got 'rot'"),
    ]:
        with pytest.raises(ValueError, match=msg) as e:
            if exact == "rot":
                source.open_artifact(art, kv_cache=kv, rotate="rot")
            else:
                source.open_artifact(art, kv_cache=kv, exact_layers=exact)
        assert "\n" not in str(e.value)


def test_engine_args_carry_the_packed_level(converted):
    pytest.importorskip("vllm.v1.attention.backend")  # vLLM itself, not this test directory
    import tale_runtime.vllm as tale_vllm

    _, art = converted("llama", 2)
    args = tale_vllm.engine_args(art, "full", kv_cache="k4v4", exact_layers=0)  # R = 32 != n = 16: fine when packed
    from tale_runtime.artifact import read_manifest, schedule_of

    sinks = schedule_of(read_manifest(art)).sinks  # the default: the artifact's sinks
    assert sinks > 0
    want = {"tale_value_rank": "full", "tale_kv_cache": "k4v4", "tale_kv_exact_layers": 0, "tale_kv_rotate": "hadamard"}
    assert args == {"model": str(art), "hf_overrides": want | {"tale_kv_sinks": sinks}}
    args = tale_vllm.engine_args(art, "full", kv_cache="k4v4", exact_layers=0, sinks=0)
    assert args["hf_overrides"]["tale_kv_sinks"] == 0
    for kw, msg in [
        (dict(kv_cache="k4v4", sinks=-1), "sinks must be a whole number >= 0, got -1"),
        (dict(sinks=4), r"sinks are kept by the packed cache only \(kv_cache=...\)"),
    ]:
        with pytest.raises(ValueError, match=msg):
            tale_vllm.engine_args(art, "full", **kw)
