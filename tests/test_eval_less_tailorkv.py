"""LESS and TailorKV in tale-eval: LESS's trained state lowers the attention-output error of its sparse policy on
text it was not trained on, its cache computes what it was trained to, and without a state it is StreamingLLM;
TailorKV's dense-preference score, layer split and top-k attention against independent references."""

from __future__ import annotations

import math

import pytest
import torch
from tale_helpers import byte_tokenizer, talify, tiny_model

from tale_eval import capture, less, less_train, perplexity, policies, tailorkv
from tale_eval.attention import prepare

RECIPE = less_train.Recipe(window=12, rank=4, hidden=16, steps=60, stride=4, windows=2, length=192)


@pytest.fixture(scope="module")
def model():
    return prepare(talify(tiny_model("llama"), 2))


@pytest.fixture(scope="module")
def trained(model):
    torch.manual_seed(0)
    return less_train.train(model, byte_tokenizer(), RECIPE, log=lambda *a: None)


def heldout_qkv(model, length: int = 160):
    tok = byte_tokenizer()
    ids = perplexity.heldout_windows(tok, length, 2, "dev")
    return capture.qkv(model, [ids])


def test_less_state_lowers_the_attention_error_on_heldout_text(model, trained):
    kernels, calib = trained
    assert all(after < before for before, after in calib)  # on the calibration windows
    s, w = RECIPE.sinks, RECIPE.window
    first = s + w + 1
    scaling = model.model.layers[0].self_attn.tale.scaling
    for kern, (q, k, v) in zip(kernels, heldout_qkv(model)):
        full, num, den, m = less_train.targets(q, k, v, scaling, s, w)
        sparse = (num / den[..., None] - full)[:, :, first:].pow(2).mean()
        with torch.no_grad():
            out = less_train.less_outputs(kern, q, k, v, scaling, s, w, num, den, m, first)
        err = (out - full[:, :, first:]).pow(2).mean()
        assert err < 0.8 * sparse, (err, sparse)


def test_strided_training_outputs_are_the_dense_ones(model, trained):
    kern = trained[0][1]
    q, k, v = heldout_qkv(model, 96)[1]
    s, w = 4, 12
    scaling = model.model.layers[0].self_attn.tale.scaling
    full, num, den, m = less_train.targets(q, k, v, scaling, s, w)
    first = s + w + 1
    with torch.no_grad():
        dense = less_train.less_outputs(kern, q, k, v, scaling, s, w, num, den, m, first)
        for offset in (0, 2, 3):
            part = less_train.less_outputs(kern, q, k, v, scaling, s, w, num, den, m, first, 4, offset)
            torch.testing.assert_close(part, dense[:, :, offset::4], rtol=1e-5, atol=1e-6)


def test_less_cache_computes_what_it_was_trained_to(model, trained):
    """Prefill P tokens, then decode one token at a time through LessLayer: every decode output equals the training
    formula (Λ cache of window + 1 tokens, the state of everything older) at that position."""
    kernels = trained[0]
    q, k, v = heldout_qkv(model, 64)[0]
    s, w, P = RECIPE.sinks, RECIPE.window, 20
    scaling = model.model.layers[0].self_attn.tale.scaling
    full, num, den, m = less_train.targets(q, k, v, scaling, s, w)
    with torch.no_grad():
        want = less_train.less_outputs(kernels[0], q, k, v, scaling, s, w, num, den, m, s + w + 1)
        layer = less.LessLayer(s, w, kernels[0], scaling)
        layer.attend(q[:, :, :P], k[:, :, :P], v[:, :, :P])
        for t in range(P, 64):
            got = layer.attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            torch.testing.assert_close(got[:, :, 0], want[:, :, t - (s + w + 1)], rtol=1e-4, atol=1e-5)
    assert layer.keys.shape[-2] == s + w and layer.H.shape == (2, 4, RECIPE.rank, 16)


def test_less_without_state_is_streaming(model):
    ids = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    pattern = perplexity.pattern(48, 10, 3)
    sparse = policies.Less(window=8, trained=False)
    stream = policies.Streaming(sinks=4, window=8)
    a = perplexity.decode_nll(model, ids, sparse.build(model, pattern), 10, 3)
    b = perplexity.decode_nll(model, ids, stream.build(model, pattern), 10, 3)
    assert a[1] == b[1] and math.exp(a[0] / a[1]) == pytest.approx(math.exp(b[0] / b[1]), rel=1e-5)


def test_less_refuses_to_run_untrained():
    with pytest.raises(ValueError, match="prepare"):
        policies.Less(window=8).build(prepare(talify(tiny_model("llama"), 2)), [16])


def test_dense_preference_score():
    """P = n_q - sum over the last n_q queries of their top-k probabilities: 0 when every query puts all its mass
    on k keys; equal keys (uniform attention over the t + 1 visible keys) give n_q - sum_t k / (t + 1)."""
    N, H, K, T, n, n_q, k = 1, 2, 1, 40, 8, 5, 3
    keys = torch.zeros(N, K, T, n)
    q = torch.randn(N, H, T, n)
    want = n_q - sum(k / (t + 1) for t in range(T - n_q, T))
    assert tailorkv.dense_preference(q, keys, 1.0, n_q, k) == pytest.approx(want, rel=1e-5)
    keys[:, :, 0, 0] = 1000.0  # every query: all mass on key 0
    q = torch.ones(N, H, T, n)
    assert tailorkv.dense_preference(q, keys, 1.0, n_q, k) == pytest.approx(0.0, abs=1e-5)
    assert tailorkv.quantized_layers([0.5, 3.0, 1.0, 2.0], 2) == [1, 3]


def test_offloaded_layer_attends_to_sinks_recent_and_each_querys_topk():
    torch.manual_seed(0)
    B, H, K, n, sinks, recent, topk = 1, 4, 2, 8, 2, 3, 4
    layer = tailorkv.OffloadLayer(sinks, recent, topk, scaling=0.5)
    k, v = torch.randn(B, K, 30, n), torch.randn(B, K, 30, n)
    q = torch.randn(B, H, 32, n)
    layer.attend(q[:, :, :30], k, v)  # prefill: exact, then the middle goes to the host
    assert layer.host_keys.shape[-2] == 30 - sinks - recent and layer.keys.shape[-2] == sinks + recent
    qn, kn, vn = q[:, :, 30:], torch.randn(B, K, 2, n), torch.randn(B, K, 2, n)
    out = layer.attend(qn, kn, vn)
    # reference: per query and KV head, the top-k middle tokens by the summed probabilities of its query heads
    mid = slice(sinks, 30 - recent)
    for b in range(B):
        for h in range(H):
            kv = h // (H // K)
            for t in range(2):
                group = qn[b, kv * 2 : kv * 2 + 2, t]  # the KV head's query heads
                score = (group @ k[b, kv, mid].T * 0.5).softmax(-1).sum(0)
                pick = score.topk(topk).indices + sinks
                idx = torch.cat([torch.arange(sinks), pick, torch.arange(30 - recent, 30)])
                keys = torch.cat([k[b, kv, idx], kn[b, kv, : t + 1]])
                vals = torch.cat([v[b, kv, idx], vn[b, kv, : t + 1]])
                ref = (qn[b, h, t] @ keys.T * 0.5).softmax(-1) @ vals
                torch.testing.assert_close(out[b, h, t], ref, rtol=1e-5, atol=1e-6)
    assert layer.fetched_keys.shape[-2] <= 2 * topk  # the union over the step's two queries


def test_less_training_is_reproducible_and_cached_per_model_and_recipe(model, tmp_path, monkeypatch):
    q, k, v = heldout_qkv(model, 64)[0]
    scaling = model.model.layers[0].self_attn.tale.scaling
    r = less_train.Recipe(window=8, rank=4, hidden=8, steps=5, stride=4)
    a, b = (less_train.train_layer(q, k, v, scaling, r)[0] for _ in range(2))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    monkeypatch.setenv("TALE_CACHE", str(tmp_path))
    path = less_train.cache_path(model, r)
    assert path.parent == tmp_path / "less" and path != less_train.cache_path(model, RECIPE)
    other = prepare(talify(tiny_model("llama", seed=1), 2))
    assert less_train.cache_path(other, r) != path  # other weights, other file
    less_train.save(path, [a, b], r)
    back = less_train.load(path, 2)
    assert all(torch.equal(x, y) for x, y in zip(back[1].parameters(), b.parameters()))
