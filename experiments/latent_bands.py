"""Latent bands: value latents quantized at different bits per band of channels, screened with quant_proxy's
attention-output error (docs/notes.md, "latent bands").

The latents of a latent group, h [T, R], in the whitened SVD's order (most energy first; the artifact's rotation in
Hadamard blocks is undone first), split into contiguous bands of channels, each quantized per token over channel
groups at its own bits (runtime/quant.py's quantize, as a level quantizes latents; 0 bits: the channels dropped, a
rank cut), each band rotated in Hadamard blocks (`rot`: blocks of that many channels over all R channels, so a band
edge that is not a multiple of it is crossed; "band": one block per band, the largest power of two dividing its
width; 0: none). Keys: exact, or low-rank coefficients on the artifact's key basis (the preset's layout).

    python experiments/latent_bands.py out/smollm2-tale --threads 1 --screen all --capture out/bands_capture.pt

Screens: `main` (named formats: the preset's level 0, uniform bits, a few band splits), `all` (every split of the
R = 192 channels into blocks of 32 at non-increasing bits 4/3/2/1/0, keys exact; prints the least error per budget
for uniform bits with a rank cut, today's knobs, and for bands), `rot` (the best splits with other rotations),
`eight` (latent formats at the bytes of the 8x schedules of experiments/search/eight_dev.json, with those
schedules' keys, and the end-to-end ratio each would measure at 1K tokens). Bits per latent number include the
scales and zeros (fp8 scale and zero, 16 bits per group: the preset's value_meta 8/8), counted over all R channels.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from quant_proxy import attn_out, capture, fq, lowrank_keys, rope, rope_tables, window_parser

from tale_runtime import load
from tale_runtime.model import hadamard

META = "8/8"
META_BITS = 16  # fp8 scale + fp8 zero per group


def blockdiag(R: int, block: int) -> torch.Tensor:
    """[R, R]: normalized Hadamard blocks of `block` channels on the diagonal (the artifact's latent rotation)."""
    return torch.block_diag(*[hadamard(block, "cpu", torch.float32)] * (R // block))


def band_group(ch: int, group: int) -> int:
    return group if ch % group == 0 else 32


def pow2_block(ch: int) -> int:
    b = 1
    while ch % (b * 2) == 0:
        b *= 2
    return b


def latent_bits(bands: list[tuple[int, int]], group: int = 64) -> float:
    """Bits per token of one latent group: codes plus fp8 scale and zero per group of each quantized band."""
    return sum(ch * b + (ch // band_group(ch, group)) * META_BITS for ch, b in bands if b)


def quant_bands(h: torch.Tensor, bands, rot, group: int = 64) -> torch.Tensor:
    """h [G, T, R] in SVD order -> dequantized, in SVD order."""
    R = h.shape[-1]
    if isinstance(rot, int) and rot > 1:
        Q = blockdiag(R, rot)
        h = h @ Q
    out, c0 = torch.zeros_like(h), 0
    for ch, b in bands:
        x = h[..., c0 : c0 + ch]
        if b:
            P = blockdiag(ch, pow2_block(ch)) if rot == "band" else None
            x = x @ P if P is not None else x
            xq, _ = fq(x.contiguous(), b, band_group(ch, group), -1, META)
            out[..., c0 : c0 + ch] = xq @ P.T if P is not None else xq
        c0 += ch
    assert c0 == R, bands
    return out @ Q.T if isinstance(rot, int) and rot > 1 else out


class Proxy:
    """Per layer: exact q, k, h (SVD order), the reference output, and quantized keys per key format."""

    def __init__(self, model, layers, sink=4, start=128, grain=32):
        self.model, self.sink, self.start = model, sink, start
        sched = model.tale_spec.schedule
        self.rot_art = sched.latent_rotation
        T = layers[0][1].shape[1]
        self.sl = slice(sink, sink + (T - sink) // grain * grain)
        self.layers = []
        for li, (q, k, h) in enumerate(layers):
            attn = model.model.layers[li].self_attn
            R = h.shape[-1]
            Qa = blockdiag(R, self.rot_art) if self.rot_art else torch.eye(R)
            ref = attn_out(q, k, h, attn.tale.o_fused, attn.scaling, attn.g, sink, start)
            self.layers.append(dict(q=q, k=k, h=h @ Qa.T, Qa=Qa, ref=ref, attn=attn))
        self.keys: dict[str, list[torch.Tensor]] = {}
        self._p = (None, None)

    def key_format(self, name: str) -> list[torch.Tensor]:
        """ "exact" or "k{rank}b{bits}": pre-RoPE coefficients on the artifact's key basis, per channel over 32 tokens."""
        if name not in self.keys:
            out = []
            for li, L in enumerate(self.layers):
                k = L["k"]
                if name == "exact":
                    out.append(k)
                    continue
                rk, kb = (int(x) for x in name[1:].split("b"))
                cos, sin = rope_tables(self.model, k.shape[1])
                pre = rope(k, cos, sin, inverse=True)
                basis = self.model.tale_spec.key_basis[li]
                kq, _ = lowrank_keys(pre[:, self.sl], basis, dict(rk=rk, kbits=kb, kmeta=META))
                kk = k.clone()
                kk[:, self.sl] = rope(kq, cos[self.sl], sin[self.sl])
                out.append(kk)
            self.keys[name] = out
        return self.keys[name]

    def probs(self, li: int, keys: str) -> torch.Tensor:
        """Layer li's attention probabilities [G, g rep, T', T + 1] with key format `keys` (one layer kept)."""
        if self._p[0] != (li, keys):
            L = self.layers[li]
            q, k = L["q"], self.key_format(keys)[li]
            H, T, n = q.shape
            K, g = k.shape[0], L["attn"].g
            rep = H // K
            logits = torch.einsum("kitn,kln->kitl", q.view(K, rep, T, n), k) * L["attn"].scaling
            mask = torch.ones(T, T + 1, dtype=torch.bool).tril(diagonal=1)
            logits = logits.masked_fill(~mask, float("-inf"))[..., self.start :, :]
            self._p = (li, keys), logits.softmax(-1).reshape(K // g, g * rep, T - self.start, T + 1)
        return self._p[1]

    def errors(self, formats: list[tuple], keys: list[str]) -> list[list[float]]:
        """Mean relative attention-output error over layers, [format][key format]; formats: (bands, rot, group)."""
        tot = [[0.0] * len(keys) for _ in formats]
        for li, L in enumerate(self.layers):
            a = L["attn"]
            hs = []
            for bands, rot, group in formats:
                h = L["h"].clone()
                h[:, self.sl] = quant_bands(L["h"][:, self.sl], bands, rot, group)
                hs.append(h @ L["Qa"])
            for j, kf in enumerate(keys):
                p = self.probs(li, kf)
                for i, h in enumerate(hs):
                    z = torch.einsum("cqtl,clr->tcqr", p, h).reshape(p.shape[2], -1)
                    got = z @ a.tale.o_fused.float().T
                    tot[i][j] += ((got - L["ref"]).norm() / L["ref"].norm()).item()
        return [[e / len(self.layers) for e in row] for row in tot]


def name_of(bands) -> str:
    return " + ".join(f"{c}@{b}" for c, b in bands)


def merge(bits_per_block, block=32):
    bands = []
    for b in bits_per_block:
        if bands and bands[-1][1] == b:
            bands[-1] = (bands[-1][0] + block, b)
        else:
            bands.append((block, b))
    return bands


def uniform(bands) -> bool:
    """Today's knobs: one bit width, then a rank cut."""
    return len([b for _, b in bands if b]) == 1


def main_formats(R: int) -> dict:
    f = {
        "preset level 0: 192@3": [(192, 3)],
        "uniform 192@2": [(192, 2)],
        "uniform 160@3 (r 5R/6)": [(160, 3), (32, 0)],
        "uniform 128@3 (r 2R/3)": [(128, 3), (64, 0)],
        "uniform 128@4": [(128, 4), (64, 0)],
        "uniform 96@4": [(96, 4), (96, 0)],
        "uniform 192@1": [(192, 1)],
    }
    for bands in (
        [(128, 4), (64, 2)],
        [(64, 4), (128, 2)],
        [(32, 4), (160, 2)],
        [(128, 3), (64, 2)],
        [(64, 3), (128, 2)],
        [(32, 3), (160, 2)],
        [(64, 4), (64, 3), (64, 2)],
        [(32, 4), (32, 3), (128, 2)],
        [(64, 3), (64, 2), (64, 1)],
        [(64, 4), (64, 2), (64, 0)],
        [(32, 4), (96, 2), (64, 1)],
        [(64, 3), (128, 1)],
        [(96, 3), (96, 1)],
        [(128, 2), (64, 1)],
        [(160, 2), (32, 0)],
        # the best splits of the `all` screen between 2 and 2.6 bits per number
        [(32, 4), (96, 2), (64, 0)],
        [(32, 3), (128, 2), (32, 0)],
        [(96, 3), (32, 2), (64, 0)],
        [(32, 4), (128, 2), (32, 0)],
        [(32, 4), (64, 3), (32, 2), (64, 0)],
        [(64, 3), (96, 2), (32, 0)],
        [(96, 3), (64, 2), (32, 0)],
        [(32, 4), (64, 3), (64, 2), (32, 0)],
    ):
        f[name_of(bands)] = bands
    return f


def main():
    ap = window_parser()
    ap.add_argument("--text", default="dev", help="dev, or a path to a file of documents (a domain left out)")
    ap.add_argument("--screen", default="main", choices=("main", "all", "rot", "eight"))
    ap.add_argument("--capture", type=Path, default=None, help="keep the captured window here (a .pt file)")
    ap.add_argument("--keys", default="exact,k56b4", help="key formats, one error column each")
    ap.add_argument("--json", type=Path, default=None, help="append one JSON line per format")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tale_eval.perplexity import heldout_windows

    model, tok = load(args.artifact, device="cpu", dtype=torch.bfloat16)
    if args.capture and args.capture.exists():
        layers = torch.load(args.capture)
    else:
        ids = heldout_windows(tok, args.ctx, args.window + 1, args.text)[args.window :]
        layers = capture(model, ids)
        if args.capture:
            torch.save(layers, args.capture)
    px = Proxy(model, layers)
    R = layers[0][2].shape[-1]
    keys = args.keys.split(",")

    def show(rows, keys=keys):
        """rows: (name, bands, rot, extra); one pass over the layers, then one line per row."""
        errs = px.errors([(bands, rot, 64) for _, bands, rot, _ in rows], keys)
        print(f"{'format (channels@bits, SVD order)':40s} {'b/num':>6s} " + " ".join(f"{'err ' + k:>9s}" for k in keys))
        for (name, bands, rot, extra), es in zip(rows, errs):
            bits = latent_bits(bands) / R
            print(f"{name:40s} {bits:6.3f} " + " ".join(f"{e:9.4f}" for e in es) + extra, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    row = dict(name=name, bands=bands, rot=rot, bits=bits, errs=dict(zip(keys, es)))
                    f.write(json.dumps(row) + "\n")
        return errs

    if args.screen == "main":
        show([(name, bands, 32, "") for name, bands in main_formats(R).items()])
    elif args.screen == "rot":  # rot: Hadamard blocks over R (crossing band edges that are not multiples); band; none
        rows = []
        for bands in ([(192, 3)], [(192, 2)], [(128, 3), (64, 2)], [(64, 4), (128, 2)], [(32, 4), (160, 2)]):
            for rot in (32, 64, "band", 0):
                rows.append((f"{name_of(bands)} rot {rot}", bands, rot, ""))
        show(rows)
    elif args.screen == "all":  # keys exact: the latents' error alone
        splits = []
        for bpb in itertools.product((4, 3, 2, 1, 0), repeat=R // 32):
            if list(bpb) != sorted(bpb, reverse=True) or not any(bpb):
                continue
            if latent_bits(merge(bpb)) / R <= 3.6:
                splits.append(merge(bpb))
        errs = px.errors([(bands, 32, 64) for bands in splits], ["exact"])
        rows = [(latent_bits(bd) / R, e[0], bd) for bd, e in zip(splits, errs)]
        if args.json:
            with open(args.json, "a") as f:
                for bits, e, bd in rows:
                    f.write(json.dumps(dict(bands=bd, bits=bits, errs={"exact": e})) + "\n")
        print(f"{len(rows)} splits; least error per budget (bits per latent number, scales included; keys exact)")
        print(f"{'budget <=':>9s} {'uniform + rank cut':>26s} {'err':>7s} {'bands':>34s} {'err':>7s} {'gain':>6s}")
        for budget in (1.5, 1.75, 2.0, 2.1667, 2.25, 2.3333, 2.5, 2.75, 2.9167, 3.0, 3.25, 3.5):
            u = min(((e, b, bd) for b, e, bd in rows if b <= budget + 1e-6 and uniform(bd)), default=None)
            a = min(((e, b, bd) for b, e, bd in rows if b <= budget + 1e-6), default=None)
            if u is None or a is None:
                continue
            print(
                f"{budget:9.3f} {name_of(u[2]) + f' ({u[1]:.3f})':>26s} {u[0]:7.4f} "
                f"{name_of(a[2]) + f' ({a[1]:.3f})':>34s} {a[0]:7.4f} {1 - a[0] / u[0]:6.1%}"
            )
    else:
        eight(px, show, R, model)


def eight(px, show, R, model, extra: dict | None = None):
    """Latent formats at the level-0 bytes of the 8x schedules, with each schedule's keys; end-to-end ratios
    (`extra`: more formats, name -> bands)."""
    extra = extra or {}
    from tale_eval.perplexity import pattern
    from tale_runtime.cache import dry_run_nbytes
    from tale_runtime.load import override_schedule

    base = model.tale_spec.schedule
    arch = model.tale_spec.arch
    L = len(base.ranks)
    pat = pattern(1024, 128, 8)

    def held(**kw):
        s = override_schedule(base, R, L, **kw)
        return dry_run_nbytes(s, arch, pat)

    variants = json.loads((Path(__file__).parent / "search" / "eight_dev.json").read_text())
    for sched_name, key_fmt in (("L2-k48", "k48b4"), ("L3r128-kb3k64", "k64b3")):
        kw = variants[sched_name]
        kw = {k: (round(v / R + 5e-4, 3) if k == "r0" else v) for k, v in kw.items()}
        h0, base_b = held(**kw)
        # level-0 latent token-count (over layers and groups): two dry runs that differ in 64 level-0 channels only
        lv_bits = kw.get("bits", [3])[0]
        kw_full = {k: v for k, v in kw.items() if k != "r0"}
        kw_cut = kw_full | {"r0": round(128 / R + 5e-4, 3)}
        d = held(**kw_full)[0] - held(**kw_cut)[0]
        n0 = d * 8 / (64 * lv_bits + META_BITS)
        r_sched = kw.get("r0", 1.0)
        sched_lat = latent_bits([(round(r_sched * R) // 64 * 64, lv_bits)] if r_sched < 1 else [(R, lv_bits)])
        other = h0 - n0 * sched_lat / 8
        print(f"\n{sched_name}: {base_b / h0:.2f}x dry run at 1K tokens; keys {key_fmt}; level-0 latents held")
        rows = []
        for name, bands in {**main_formats(R), **extra}.items():
            ratio = base_b / (other + n0 * latent_bits(bands) / 8)
            if ratio >= 7.5:
                rows.append((name, bands, 32, f" {ratio:6.2f}x"))
        show(sorted(rows, key=lambda r: r[3]), keys=["exact", key_fmt])


if __name__ == "__main__":
    main()
