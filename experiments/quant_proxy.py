"""Fast proxy for choosing cache formats: per-layer attention-output error of quantized keys/latents.

Captures exact post-RoPE q, k and latents h of one held-out (dev) window through the runtime, then,
per layer and format, quantizes every non-sink token's key and latent the way a cache level would,
runs causal attention in latent space, maps it through O^r and reports the relative error of the
attention output (queries after `--from`) against the exact one. Seconds per format instead of
minutes per tale-eval run; use it to rank formats, then confirm the winners with tale-eval.

    python experiments/quant_proxy.py out/smollm2-tale --threads 1

--screen picks a screen of docs/notes.md (keys, groups, latents, prerope, oaware). Environment: ONLY=TEXT runs
the formats whose name contains TEXT; ORACLE_FROM=FILE (oaware) adds latents whose basis is fitted on another
window, a file saved by capture().
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from tale_convert.rank_policy import singular_values
from tale_runtime import load, new_cache
from tale_runtime.artifact import Level, Schedule
from tale_runtime.attention import apply_rope
from tale_runtime.backends import TORCH, AttentionBackend
from tale_runtime.key_basis import KeyBasis, fit, pair_mean
from tale_runtime.model import cache_arg, hadamard
from tale_runtime.quant import quantize


def capture(model, ids: torch.Tensor) -> list[tuple]:
    """(q [H,T,n], k [K,T,n], h [G,T,R]) per layer, exact, post-RoPE."""
    got = []

    @dataclass(frozen=True)
    class Grab(AttentionBackend):  # the torch reference, keeping every call's new q, k, h
        name: str = "grab"
        label: str = "torch reference"

        def __call__(self, q, k, h, view, scaling, window=None):
            got.append((q[0].float(), k[0].float(), h[0].float()))
            return TORCH.run(q, k, h, view, scaling, window)

    sched = model.tale_spec.schedule
    exact = Schedule(
        sinks=1,
        levels=[Level(16, 16, None)],
        ranks=[[sched.ranks[0][-1]]] * len(sched.ranks),
        key_group=1,
        value_group=1,
        residual=1,
    )
    cache = new_cache(model, exact, backend=Grab())
    with torch.inference_mode():
        model(ids[:, :1], **cache_arg(cache))
        model(ids[:, 1:], **cache_arg(cache))
    # prepend the first token's k and h from the cache sinks
    out = []
    for (q, k, h), lc in zip(got, cache.layers):
        out.append((q, torch.cat([lc.sink_k[0].float(), k], 1), torch.cat([lc.sink_h[0].float(), h], 1)))
    return out


def rope_tables(model, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, n] of positions 0 .. T-1, from the model's own rotary embedding."""
    pos = torch.arange(T)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].float(), sin[0].float()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [K, T, n] rotated by RoPE at its positions (inverse: back to the pre-RoPE key; exact in float)."""
    return apply_rope(x[None], cos[None], (-sin if inverse else sin)[None])[0]


def fq(x: torch.Tensor, bits: int, group: int, dim: int, meta: str) -> tuple[torch.Tensor, float]:
    """Quantize-dequantize [.., T, C]; returns (x', bits per number incl. scales/zeros)."""
    if bits == 16:
        return x, 16.0
    q = quantize(x.to(torch.bfloat16), bits, group, dim, meta)
    return q.dequantize(torch.float32), q.nbytes() * 8 / x.numel()


def attn_out(q, k, h, o_fused, scaling, g, sink, start):
    H, T, n = q.shape  # queries are positions 1 .. T of the T + 1 keys
    K = k.shape[0]
    rep = H // K
    logits = torch.einsum("kitn,kln->kitl", q.view(K, rep, T, n), k) * scaling
    mask = torch.ones(T, T + 1, dtype=torch.bool).tril(diagonal=1)
    logits = logits.masked_fill(~mask, float("-inf"))[..., start:, :]
    p = logits.softmax(-1).reshape(K // g, g * rep, T - start, T + 1)
    z = torch.einsum("cqtl,clr->tcqr", p, h).reshape(T - start, -1)  # [T', H*R]
    return z @ o_fused.float().T


def oaware(attn, cov: torch.Tensor | None = None, out: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-aware re-factorization of a layer's latents: returns (T [G, R, R], O'^r [d, H*R]) with h' = h T and
    B' = T^-1 B, where T makes truncation optimal in sum_q ||X (W_c - W_c,r)_j(q) O_q||_F (the value error as the
    output projection sees it, softmax ignored) instead of ||X (W_c - W_c,r)||_F. The whitened basis is u = h S^-1/2
    (h's covariance on calibration data is S), in which the value map is S V^T = S^1/2 B."""
    from tale_convert.fuse import fuse

    B = attn.tale.v_v.double()  # [G, R, R] = S^1/2 V^T
    G, R, _ = B.shape
    n, H = attn.head_dim, attn.config.num_attention_heads
    g = R // n
    rep = H // (G * g)
    WO = attn.o_proj.weight.double().T  # [H*n, d]
    sh = singular_values(B).sqrt()  # S^1/2
    Ts, Bs = [], []
    for c in range(G):
        E = torch.eye(R, dtype=torch.float64)
        for j in range(g if out else 0):
            m = c * g + j
            Gj = sum(WO[q * n : (q + 1) * n] @ WO[q * n : (q + 1) * n].T for q in range(m * rep, (m + 1) * rep))
            E[j * n : (j + 1) * n, j * n : (j + 1) * n] = torch.linalg.cholesky(Gj)
        if cov is None:  # the calibration covariance of h: S
            U2, S2, _ = torch.linalg.svd(sh[c, :, None] * B[c] @ E)
            T = (U2 * S2.sqrt()) / sh[c, :, None]  # diag(s^-1/2) U2 S2^1/2
        else:  # another covariance of h (e.g. measured on the test window itself: an oracle)
            L = torch.linalg.cholesky(cov[c].double() + 1e-6 * torch.eye(R, dtype=torch.float64))
            U2, S2, _ = torch.linalg.svd(L.T @ B[c] @ E)
            T = torch.linalg.solve_triangular(L.T, U2 * S2.sqrt(), upper=True)
        Ts.append(T)
        Bs.append(torch.linalg.solve(T, B[c]))
    T, B2 = torch.stack(Ts), torch.stack(Bs)
    return T.float(), fuse(B2, WO, H).T.float()


def run_format(layers, model, fmt: dict, sink=4, start=128):
    errs, kb, vb = [], [], []
    for li, (q, k, h) in enumerate(layers):
        attn = model.model.layers[li].self_attn
        g, n = attn.g, attn.head_dim
        if fmt.get("rotate"):
            Q = hadamard(n, q.device, torch.float32)
            q, k = q @ Q, k @ Q
        r = fmt.get("rank", h.shape[-1])
        h0, o_use = h, attn.tale.o_fused
        if fmt.get("oaware") or fmt.get("oracle"):
            cov = None
            if fmt.get("oracle"):
                hm = (fmt["oracle"][li][2] if isinstance(fmt["oracle"], list) else h)[:, sink:].double()
                hm = hm[:, : fmt.get("prompt", hm.shape[1])]  # a prompt's first tokens only
                cov = hm.transpose(1, 2) @ hm
                cov = cov / cov.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None]
                lam = fmt.get("shrink", 0.0)  # toward the calibration covariance of h (S), trace-normalized
                if lam:
                    S = singular_values(attn.tale.v_v)
                    cov = (1 - lam) * cov + lam * torch.diag_embed(S / S.sum(-1, keepdim=True))
            T_, o_use = oaware(attn, cov, out=bool(fmt.get("oaware")))
            h = torch.einsum("ctr,crs->cts", h, T_)
        kk, hh = k.clone(), h.clone()
        T = k.shape[1]
        if fmt.get("pre"):  # quantize the pre-RoPE keys (KVQuant), rotate them after dequantizing
            cos, sin = rope_tables(model, T)
            k = rope(k, cos, sin, inverse=True)
        kg = fmt.get("kg", 32)  # key token group (per-channel keys)
        grain = fmt.get("grain", 32)  # tokens quantized: a multiple of this (the rest stays exact, like a residual)
        m = (T - sink) // grain * grain
        sl = slice(sink, sink + m)
        if fmt["kaxis"] == "band":  # per-channel keys, bits per channel by importance E[q_c^2] * range_c^2
            kq = k[:, sl].clone()
            tot = 0.0
            for kh in range(k.shape[0]):
                rep = q.shape[0] // k.shape[0]
                qi = q[kh * rep : (kh + 1) * rep].pow(2).mean((0, 1))  # [n]
                kg = k[kh, sl].view(-1, 32, k.shape[-1])
                rng = (kg.amax(1) - kg.amin(1)).pow(2).mean(0)
                w = qi * rng
                b = torch.full((k.shape[-1],), fmt["bmin"])
                budget = int(fmt["kbits"] * k.shape[-1]) - int(b.sum())
                for _ in range(budget):  # greedy: the bit that removes the most error
                    gain = w / (2.0**b - 1).pow(2) - w / (2.0 ** (b + 1) - 1).pow(2)
                    gain[b >= fmt["bmax"]] = -1
                    b[gain.argmax()] += 1
                for bits in b.unique().tolist():
                    ch = (b == bits).nonzero().flatten()
                    xs = k[kh : kh + 1, sl][..., ch]
                    pad = (-len(ch)) % 8
                    xs = torch.nn.functional.pad(xs, (0, pad))
                    xq, _ = fq(xs.contiguous(), int(bits), 32, -2, fmt.get("kmeta", "16"))
                    kq[kh : kh + 1, :, ch] = xq[..., : len(ch)]
                    tot += (bits + {"16": 32, "8/16": 24, "8/8": 16}[fmt.get("kmeta", "16")] / 32) * len(ch)
            kbits = tot / (k.shape[0] * k.shape[-1])
        elif fmt["kaxis"] == "calband":  # two bit bands per head, channels by CALIBRATION importance
            kq, kbits = band_keys(k[:, sl], fmt["stats"][li]["bits"], fmt.get("kmeta", "16"), kg)
        elif fmt["kaxis"] == "nuq":  # per-channel groups, codes -> a per-layer non-uniform table (calibration)
            kq, kbits = nuq_keys(k[:, sl], fmt["kbits"], fmt["stats"][li]["table"], fmt.get("kmeta", "16"))
        elif fmt["kaxis"] == "lowrank":  # pre-RoPE keys of all KV heads on a calibrated basis: rank rk, then quantized
            kq, kbits = lowrank_keys(k[:, sl], fmt["stats"][li], fmt)
        elif fmt["kaxis"] == "channel":
            kq, kbits = fq(k[:, sl], fmt["kbits"], kg, -2, fmt.get("kmeta", "16"))
        else:
            kq, kbits = fq(k[:, sl], fmt["kbits"], fmt.get("kcg", 64), -1, fmt.get("kmeta", "16"))
        kk[:, sl] = rope(kq, cos[sl], sin[sl]) if fmt.get("pre") else kq
        if fmt.get("pre"):
            k = rope(k, cos, sin)  # the exact reference keys
        if "vbands" in fmt:  # contiguous latent channel ranges (SVD order: most energy first) at their own bits
            parts, c0, nb = [], 0, 0.0
            for ch, bits in fmt["vbands"]:
                xq, bb = fq(h[:, sl, c0 : c0 + ch].contiguous(), bits, min(32, ch), -1, fmt.get("vmeta", "16"))
                parts.append(xq)
                nb += bb * ch
                c0 += ch
            r = c0
            hq, vbits = torch.cat(parts, dim=-1), nb / r
        else:
            hq, vbits = fq(h[:, sl, :r].contiguous(), fmt["vbits"], 32, -1, fmt.get("vmeta", "16"))
        hh[:, sl] = 0
        hh[:, sl, :r] = hq
        ref = attn_out(q, k, h0, attn.tale.o_fused, attn.scaling, g, sink, start)
        got = attn_out(q, kk, hh, o_use, attn.scaling, g, sink, start)
        errs.append(((got - ref).norm() / ref.norm()).item())
        kb.append(kbits)
        vb.append(vbits * r / h.shape[-1])
    return errs, sum(kb) / len(kb), sum(vb) / len(vb)


META_BITS = {"16": 32, "8/16": 24, "8/8": 16}  # scale + zero bits per group


def importance(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per KV head and channel: E[q_c^2] * E_groups[range_c^2] ([K, n]), the logit error weight of
    a channel quantized per channel over groups of 32 tokens (error ~ q_c * range_c * u)."""
    K, T, n = k.shape
    rep = q.shape[0] // K
    qi = q.view(K, rep, -1, n).pow(2).mean((1, 2))
    kg = k[:, : T // 32 * 32].reshape(K, -1, 32, n)
    return qi * (kg.amax(2) - kg.amin(2)).pow(2).mean(1)


def band_bits(w: torch.Tensor, mean: float, lo: int, hi: int) -> torch.Tensor:
    """Two bands: the round(share * n) most important channels of each head get `hi` bits, the rest `lo`,
    with share = (mean - lo) / (hi - lo) rounded to a multiple of 8 channels (packing)."""
    K, n = w.shape
    m = round((mean - lo) / (hi - lo) * n / 8) * 8
    b = torch.full((K, n), lo)
    top = w.argsort(-1, descending=True)[:, :m]
    b.scatter_(1, top, hi)
    return b


def band_keys(k: torch.Tensor, bits: torch.Tensor, meta: str, group: int = 32) -> tuple[torch.Tensor, float]:
    out, tot = k.clone(), 0.0
    for kh in range(k.shape[0]):
        for b in bits[kh].unique().tolist():
            ch = (bits[kh] == b).nonzero().flatten()
            xq, _ = fq(k[kh : kh + 1][..., ch].contiguous(), int(b), group, -2, meta)
            out[kh : kh + 1, :, ch] = xq
            tot += (b + META_BITS[meta] / group) * len(ch)
    return out, tot / bits.numel()


def lloyd(u: torch.Tensor, w: torch.Tensor, levels: int, iters: int = 30) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd-Max) of u in [0, 1]: `levels` sorted centroids."""
    c = torch.linspace(0, 1, levels)
    for _ in range(iters):
        a = (u[:, None] - c[None]).abs().argmin(1)
        for j in range(levels):
            m = a == j
            if m.any():
                c[j] = (u[m] * w[m]).sum() / w[m].sum()
    return c.sort().values


def nuq_table(q: torch.Tensor, k: torch.Tensor, bits: int) -> torch.Tensor:
    """A layer's code -> normalized value table, fitted on calibration keys normalized per channel group."""
    K, T, n = k.shape
    kg = k[:, : T // 32 * 32].reshape(K, -1, 32, n)
    mn, mx = kg.amin(2, keepdim=True), kg.amax(2, keepdim=True)
    u = ((kg - mn) / (mx - mn).clamp_min(1e-8)).flatten()
    qi = q.view(K, q.shape[0] // K, -1, n).pow(2).mean((1, 2))  # [K, n]: E[q_c^2]
    w = (qi[:, None, None, :] * (mx - mn).pow(2)).expand_as(kg).flatten()  # logit error weight: E[q_c^2] range^2
    pick = torch.randperm(len(u), generator=torch.Generator().manual_seed(0))[:200_000]
    return lloyd(u[pick], w[pick], 1 << bits)


def nuq_keys(k: torch.Tensor, bits: int, table: torch.Tensor, meta: str) -> tuple[torch.Tensor, float]:
    K, T, n = k.shape
    kg = k.reshape(K, T // 32, 32, n)
    mn, mx = kg.amin(2, keepdim=True), kg.amax(2, keepdim=True)
    if meta != "16":  # the stored scale/zero as the runtime rounds them
        q = quantize(k.to(torch.bfloat16), bits, 32, -2, meta)
        mn = (q.zero.float() / (q.bias if q.zero.dtype == torch.float8_e4m3fn else 1.0))[:, :, None]
        mx = mn + (q.scale.float() / q.bias)[:, :, None] * ((1 << bits) - 1)
    else:
        mn, mx = mn.bfloat16().float(), mx.bfloat16().float()
    u = ((kg - mn) / (mx - mn).clamp_min(1e-8)).clamp(0, 1)
    code = (u[..., None] - table).abs().argmin(-1)
    x = mn + (mx - mn) * table[code]
    return x.reshape(K, T, n), bits + META_BITS[meta] / 32


def key_basis(layers, model, weighted: bool, sink: int = 4, center: bool = True) -> list[KeyBasis]:
    """Per layer: the basis tale-convert --key-basis fits (tale_runtime.key_basis.fit), from captured keys and
    queries undone from RoPE: weighted by the pre-RoPE queries' per-channel second moments or not; center=False
    keeps the mean in the directions (a zero mean)."""
    out = []
    for q, k, _h in layers:
        K, T, n = k.shape
        cos, sin = rope_tables(model, T)
        X = rope(k, cos, sin, inverse=True)[:, sink:].permute(1, 0, 2).reshape(-1, K * n).double()
        mu = X.mean(0) if center else torch.zeros_like(X[0])
        q2 = None
        if weighted:
            qp = rope(q, cos[1:T], sin[1:T], inverse=True)  # queries sit at positions 1 .. T - 1
            q2 = pair_mean(qp.view(K, q.shape[0] // K, -1, n).pow(2).mean((1, 2)).flatten(), K, n)
        enc, dec = fit(X.T @ X / len(X), mu, q2)
        out.append(KeyBasis(enc, dec, mu.float(), K, n))
    return out


def lowrank_keys(k: torch.Tensor, basis: KeyBasis, fmt: dict) -> tuple[torch.Tensor, float]:
    """k [K, T, n] (pre-RoPE) -> its rank-`rk` reconstruction with the coefficients quantized at `kbits` per channel
    over 32 tokens (`caxis` channel) or per token over 32 channels (token); bits per key number."""
    K, T, n = k.shape
    rk = fmt["rk"]
    c = basis.encode(k[None], rk)[:, 0]  # [1, T, rk]
    dim = -2 if fmt.get("caxis", "channel") == "channel" else -1
    cq, cb = fq(c.contiguous(), fmt["kbits"], 32, dim, fmt.get("kmeta", "16"))
    return basis.decode(cq[:, None])[0], cb * rk / (K * n)


def keyrank_screen(layers, model, tok, ctx: int) -> dict:
    """Low-rank pre-RoPE keys (one basis per layer over its KV heads, from a calibration window of `ctx` tokens;
    `oracle`: from the tested window itself) at a few ranks and bits, latents exact, against plain pre-RoPE keys."""
    from tale_calib import calib_paths, documents

    text = "\n\n".join(d for p in calib_paths() for d in documents(p))
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids)[:ctx][None]
    cal = capture(model, ids)
    bases = {"cal": key_basis(cal, model, False), "calq": key_basis(cal, model, True)}
    bases["oracle"] = key_basis(layers, model, False)
    bases["unc"] = key_basis(cal, model, False, center=False)
    fm = {f"pre k{b}c 8/16": dict(kaxis="channel", kbits=b, vbits=16, kmeta="8/16", pre=True) for b in (2, 3)}
    for name, st in bases.items():
        for rk in (64, 96, 128, 192):
            for b, ax in ((16, "channel"), (2, "channel"), (3, "channel"), (4, "channel"), (3, "token"), (4, "token")):
                if b == 16 and rk == 192:
                    continue
                fm[f"{name} r{rk} c{b}{ax[0]}"] = dict(
                    kaxis="lowrank", rk=rk, kbits=b, caxis=ax, kmeta="8/16", vbits=16, pre=True, stats=st
                )
    return fm


def calib_stats(model, tok, ctx: int, bits_list=(2, 3)) -> list[dict]:
    """Per layer: key channel importance and nuq tables from one window of the CALIBRATION corpus."""
    from tale_calib import calib_paths, documents

    text = "\n\n".join(d for p in calib_paths() for d in documents(p))
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids)[:ctx][None]
    layers = capture(model, ids)
    out = []
    cos, sin = rope_tables(model, ctx)
    for q, k, _h in layers:
        w_pre = importance(q[:, 4:], rope(k, cos[: k.shape[1]], sin[: k.shape[1]], inverse=True)[:, 4:])
        k = k[:, 4:]
        q = q[:, 4:]
        out.append({"w": importance(q, k), "w_pre": w_pre, **{f"table{b}": nuq_table(q, k, b) for b in bits_list}})
    return out


def key_screen(layers, model, stats) -> dict:
    """Key formats at a few bit budgets (latents exact): uniform, calibrated two-band, calibrated nuq."""
    fm = {}
    for meta in ("16", "8/16"):
        for b in (2, 3):
            fm[f"k{b}c {meta}"] = dict(kaxis="channel", kbits=b, vbits=16, kmeta=meta)
            st = [{"table": s[f"table{b}"]} for s in stats]
            fm[f"nuq{b} {meta}"] = dict(kaxis="nuq", kbits=b, vbits=16, kmeta=meta, stats=st)
        for mean, lo, hi in ((2.25, 2, 3), (2.5, 2, 3), (2.5, 2, 4), (2.0, 1, 3), (2.75, 2, 3)):
            st = [{"bits": band_bits(s["w"], mean, lo, hi)} for s in stats]
            fm[f"band {mean} [{lo},{hi}] {meta}"] = dict(kaxis="calband", vbits=16, kmeta=meta, stats=st)
    fm["k8 token g64 (tail)"] = dict(kaxis="token", kbits=8, vbits=16, kcg=64)
    fm["k16 v8 token (tail)"] = dict(kaxis="channel", kbits=16, vbits=8)
    return fm


def group_screen(stats) -> dict:
    """Per-channel keys over token groups of 32 / 64 / 128 (cheaper scales and zeros per number), uniform 2 and 3
    bits and calibrated two-band keys (latents exact); every format quantizes the same tokens (multiples of 128)."""
    fm = {}
    for kg in (32, 64, 128):
        for meta in ("8/16", "8/8"):
            for b in (2, 3):
                fm[f"k{b}c g{kg} {meta}"] = dict(kaxis="channel", kbits=b, vbits=16, kmeta=meta, kg=kg, grain=128)
            for mean in (2.25, 2.5):
                st = [{"bits": band_bits(s["w"], mean, 2, 3)} for s in stats]
                fm[f"band {mean} [2,3] g{kg} {meta}"] = dict(
                    kaxis="calband", vbits=16, kmeta=meta, stats=st, kg=kg, grain=128
                )
    return fm


def prerope_screen(stats) -> dict:
    """Per-channel keys quantized before RoPE (KVQuant's pre-RoPE keys) against after, uniform and calibrated
    two-band (importance from the pre-RoPE key ranges), latents exact."""
    fm = {}
    for meta in ("16", "8/16"):
        for pre in (False, True):
            tag = "pre " if pre else "post"
            for b in (2, 3):
                fm[f"{tag} k{b}c {meta}"] = dict(kaxis="channel", kbits=b, vbits=16, kmeta=meta, pre=pre)
            for mean in (2.25, 2.5):
                st = [{"bits": band_bits(s["w_pre" if pre else "w"], mean, 2, 3)} for s in stats]
                fm[f"{tag} band {mean} {meta}"] = dict(kaxis="calband", vbits=16, kmeta=meta, stats=st, pre=pre)
                if pre:  # the artifact's band order (post-RoPE statistic) applied to pre-RoPE keys
                    st = [{"bits": band_bits(s["w"], mean, 2, 3)} for s in stats]
                    fm[f"pre(post order) band {mean} {meta}"] = dict(
                        kaxis="calband", vbits=16, kmeta=meta, stats=st, pre=True
                    )
    return fm


def window_parser() -> argparse.ArgumentParser:
    """The options of a screen over one captured window: the artifact, threads, the window's length and start."""
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--window", type=int, default=0)
    return ap


def main():
    ap = window_parser()
    ap.add_argument(
        "--screen",
        default="formats",
        choices=("formats", "keys", "groups", "latents", "prerope", "oaware", "keyrank"),
        help="formats: a screen of docs/notes.md",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tale_eval.perplexity import heldout_windows

    model, tok = load(args.artifact, device="cpu", dtype=torch.bfloat16)
    if model.tale_spec.schedule.latent_rotation:  # the formats below scale latent channels by S: the SVD basis itself
        raise SystemExit("quant_proxy reads unrotated latents: convert with --no-rotate-latents")
    ids = heldout_windows(tok, args.ctx, args.window + 1)[args.window :]
    import os

    cached = f"/tmp/quant_proxy_{args.window}_{args.ctx}_{Path(args.artifact).name}.pt"
    if os.path.exists(cached):
        layers = torch.load(cached)
    else:
        layers = capture(model, ids)
        torch.save(layers, cached)
    fmts = {
        "k2c v16": dict(kaxis="channel", kbits=2, vbits=16),
        "k3c v16": dict(kaxis="channel", kbits=3, vbits=16),
        "band 2.0 [1,4] v16": dict(kaxis="band", kbits=2.0, bmin=1, bmax=4, vbits=16),
        "band 2.5 [1,4] v16": dict(kaxis="band", kbits=2.5, bmin=1, bmax=4, vbits=16),
        "band 2.5 [2,4] v16": dict(kaxis="band", kbits=2.5, bmin=2, bmax=4, vbits=16),
        "band 3.0 [2,4] v16": dict(kaxis="band", kbits=3.0, bmin=2, bmax=4, vbits=16),
        "band 2.0 [1,4] 8/16 v16": dict(kaxis="band", kbits=2.0, bmin=1, bmax=4, vbits=16, kmeta="8/16"),
        "k16 v2 r96": dict(kaxis="channel", kbits=16, vbits=2, rank=96),
        "k16 v4 r64": dict(kaxis="channel", kbits=16, vbits=4, rank=64),
        "k16 v3 r64": dict(kaxis="channel", kbits=16, vbits=3, rank=64),
        "k16 v2 r128": dict(kaxis="channel", kbits=16, vbits=2, rank=128),
        "k16 v4 r32": dict(kaxis="channel", kbits=16, vbits=4, rank=32),
        "k16 v2 r192": dict(kaxis="channel", kbits=16, vbits=2),
    }
    if args.screen == "latents":  # keys exact; latent rank and bits by singular-value energy at similar bytes
        fmts = {
            f"v{b} r{r}": dict(kaxis="channel", kbits=16, vbits=b, rank=r) for b in (2, 3) for r in (32, 64, 96, 128)
        }
        for name, bands in {
            "32@3 + 32@2": [(32, 3), (32, 2)],
            "32@4 + 32@2": [(32, 4), (32, 2)],
            "32@3 + 64@2": [(32, 3), (64, 2)],
            "32@4 + 64@2": [(32, 4), (64, 2)],
            "32@3 + 32@2 + 32@1": [(32, 3), (32, 2), (32, 1)],
            "32@2 + 64@1": [(32, 2), (64, 1)],
            "64@2 + 64@1": [(64, 2), (64, 1)],
            "32@4 + 32@3 + 64@2": [(32, 4), (32, 3), (64, 2)],
        }.items():
            fmts[name] = dict(kaxis="channel", kbits=16, vbands=bands)
    elif args.screen == "keys":
        fmts = key_screen(layers, model, calib_stats(model, tok, args.ctx))
    elif args.screen == "oaware":  # keys exact; latents of the artifact's factors against output-aware ones
        fmts = {
            f"{'oaw ' if o else 'base'} v{b} r{r}": dict(kaxis="channel", kbits=16, vbits=b, rank=r, oaware=o)
            for o in (False, True)
            for b, r in ((16, 192), (16, 64), (16, 96), (2, 64), (2, 96), (2, 128), (4, 192))
        }
        for P in (128, 512):
            for lam in (0.0, 0.3, 0.6):
                for b, r in ((16, 64), (2, 64), (2, 96)):
                    fmts[f"prompt{P} shrink{lam} v{b} r{r}"] = dict(
                        kaxis="channel", kbits=16, vbits=b, rank=r, oracle=True, prompt=P, shrink=lam
                    )
        other = torch.load(os.environ["ORACLE_FROM"]) if "ORACLE_FROM" in os.environ else None
        for b, r in ((16, 64), (16, 96), (2, 64), (2, 96)):
            fmts[f"oracle v{b} r{r}"] = dict(kaxis="channel", kbits=16, vbits=b, rank=r, oracle=True)
            if other is not None:
                fmts[f"other-window v{b} r{r}"] = dict(kaxis="channel", kbits=16, vbits=b, rank=r, oracle=other)
            fmts[f"oracle+oaw v{b} r{r}"] = dict(kaxis="channel", kbits=16, vbits=b, rank=r, oracle=True, oaware=True)
    elif args.screen == "prerope":
        fmts = prerope_screen(calib_stats(model, tok, args.ctx))
    elif args.screen == "keyrank":
        fmts = keyrank_screen(layers, model, tok, int(os.environ.get("CAL_CTX", 4096)))
    elif args.screen == "groups":
        fmts = group_screen(calib_stats(model, tok, args.ctx))
    print(f"{'format':24s} {'mean err':>8s} {'max err':>8s} {'key b/num':>9s} {'lat b/num(R)':>12s}  per layer")
    for name, f in fmts.items():
        if os.environ.get("ONLY") and os.environ["ONLY"] not in name:
            continue
        errs, kb, vb = run_format(layers, model, f)
        print(
            f"{name:24s} {sum(errs) / len(errs):8.4f} {max(errs):8.4f} {kb:9.2f} {vb:12.2f}  "
            + " ".join(f"{e:.2f}" for e in errs)
        )


if __name__ == "__main__":
    main()
