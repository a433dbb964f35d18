"""The CUDA decode kernel's packed layout (kernels/cuda/latent_level.cu, runtime/frag.py), checked on the CPU.

The kernel reads each thread's mma fragments straight out of words that runtime/frag.py (through
benchmarks/bench_cuda_decode.pack) lays out. This test replays the kernel's per-lane arithmetic for one 32-slot block (the query-scale build with its
shared-memory addresses and swizzles, ldmatrix.x4, the mask / mask-or unpack, mma.m16n8k16's fragment layout) in
numpy and compares the scores and the latent output with a float32 reference of the same codes. A wrong index in
the packer or a wrong constant in this replay moves the error from ~3e-4 (float16 rounding) to O(1). The GPU run
of the real kernel: tests/test_mma_attention.py and benchmarks/bench_cuda_decode.py (docs/kernels.md, "The CUDA kernel").
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_cuda_decode as bcd  # noqa: E402

SHIFT, N, RANK = bcd.SHIFT, bcd.N, bcd.RANK
MAGIC = 0x64006400  # fp16 1024 in both halves


def _h2(u: int) -> np.ndarray:
    return np.array([u & 0xFFFF, (u >> 16) & 0xFFFF], dtype=np.uint16).view(np.float16).astype(np.float64)


def _u32(lo: float, hi: float) -> int:
    a = np.array([lo, hi], dtype=np.float16).view(np.uint16).astype(np.uint64)
    return int(a[0] | (a[1] << 16))


def _mma(afr, bfr) -> np.ndarray:
    """mma.m16n8k16 row.col: per-lane A (4 x u32) and B (2 x u32) fragments -> C [16, 8]."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = [_h2(x) for x in afr[lane]]
        b = [_h2(x) for x in bfr[lane]]
        for i in range(2):
            A[g, 2 * t + i], A[g + 8, 2 * t + i] = a[0][i], a[1][i]
            A[g, 2 * t + 8 + i], A[g + 8, 2 * t + 8 + i] = a[2][i], a[3][i]
            B[2 * t + i, g], B[2 * t + 8 + i, g] = b[0][i], b[1][i]
    return A @ B


def _scores(q, kc, km, g: int, subn: int, kb: int) -> np.ndarray:
    """The kernel's scores of group g's 16 query heads over one block, before the softmax scale: [16, 32]."""
    # 1. the query-scale build, written to a byte image of the A tile with the kernel's addresses
    rowcomp = 2.0**-kb  # rows 8..15 meet the b1 operands, one field higher
    qt = np.stack([q[0, 16 * g + j].float().numpy() * (rowcomp if j >= 8 else 1.0) / SHIFT for j in range(16)])
    tile = np.zeros(8192 + 128, dtype=np.uint8)
    kmb = km[0, g, 0].numpy()
    bias = np.zeros(16)
    for lane in range(32):
        jr, hf = lane >> 1, lane & 1
        hh = jr >> 2
        addr = (hh >> 1) * 128 + ((jr & 7) ^ (hf * 4)) * 16 + (hh & 1) * 8 + hf * 16 * 256
        for p in range(16):
            qv = qt[jr, hf * 64 + 4 * p : hf * 64 + 4 * p + 4]
            m = kmb[hh, hf * 16 + (p ^ (2 * hh + hf))].astype(np.float64)
            a = (qv * m[:4] * (0.0625 if kb == 2 and p & 1 else 1.0)).astype(np.float16)
            tile[addr + p * 256 : addr + p * 256 + 8] = a.view(np.uint8)
            bias[jr] += (qv * m[4:]).sum()
    bias *= np.where(np.arange(16) >= 8, 1 / rowcomp, 1.0)

    def a_fragments(c: int):  # ldmatrix.x4: lane l gives the address of row l % 8 of matrix l // 8
        rows = []
        for lane in range(32):
            quad, r = lane >> 3, lane & 7
            if quad in (1, 2):
                rows.append(8192 + r * 16)
            else:
                rows.append((128 if quad == 3 else 0) + ((r ^ 4) if c >= 16 else r) * 16 + c * 256)
        mats = [[tile[rows[8 * i + r] : rows[8 * i + r] + 16].view(np.float16) for r in range(8)] for i in range(4)]
        return [
            [int(mats[i][lane >> 2][2 * (lane & 3) : 2 * (lane & 3) + 2].view(np.uint32)[0]) for i in range(4)]
            for lane in range(32)
        ]

    # 2. scores: 32 chunks x 4 n-tiles of 8 slots; a thread's 4 kb words per slot in 16-byte quads (swizzled)
    words = kc[0, g].numpy().view(np.uint32)
    kw, cpw, fmask = 4 * kb, 8 // kb, 0x00030003 if kb == 2 else 0x000F000F
    S, off = np.zeros((16, 32)), np.zeros((16, 8))
    for c in range(32):
        j, ci = c // cpw, c % cpw
        af = a_fragments(c)
        sh = 4 * (ci & 1) if kb == 2 else 0
        lo, hi = fmask << sh, fmask << (sh + kb)
        hi8 = ci >= 2 if kb == 2 else ci == 1
        for nt in range(4):
            bf = []
            for lane in range(32):
                gq, t = lane >> 2, lane & 3
                sw = (gq & 1) if kb == 2 else 2 * (gq & 1) + (t >> 1)
                x = int(words[8 * nt + gq, kw * t + 4 * (((j // 4) ^ sw) % (kw // 4)) + j % 4])
                x = x >> 8 if hi8 else x
                bf.append([x & lo, x & hi] if subn else [(x & lo) | MAGIC, (x & hi) | MAGIC])
            S[:, 8 * nt : 8 * nt + 8] += _mma(af, bf)
        if not subn:
            off += _mma(af, [[MAGIC, MAGIC]] * 32)
    return S * 2.0**24 + bias[:, None] if subn else S - off[:, :1] + bias[:, None]


def _latent_out(P: np.ndarray, lc, lm, g: int, half: int, lb: int) -> np.ndarray:
    """The kernel's P @ latents for one block and 256 channels (P [16, 32] float), in real units: [16, 256]."""
    pa = [
        [
            [
                _u32(P[gq, s0], P[gq, s0 + 1]),
                _u32(P[gq + 8, s0], P[gq + 8, s0 + 1]),
                _u32(P[gq, s0 + 8], P[gq, s0 + 9]),
                _u32(P[gq + 8, s0 + 8], P[gq + 8, s0 + 9]),
            ]
            for lane in range(32)
            for gq, s0 in [(lane >> 2, 16 * kc_ + 2 * (lane & 3))]
        ]
        for kc_ in range(2)
    ]
    lw = lc[0, g, half, 0].numpy().view(np.uint32).reshape(2 * lb, 32, 4)
    lmb = lm[0, g, half, 0].numpy()
    fmask = 0x00030003 if lb == 2 else 0x000F000F
    O = np.zeros((16, RANK))
    for wd in range(8 * lb):
        cg = wd >> 1 if lb == 2 else wd >> 2
        for nto in range(4 // lb):
            for kc_ in range(2):
                bf = []
                for lane in range(32):
                    x0 = int(lw[wd // 4, lane, wd % 4])
                    x = x0 >> (8 * (nto if lb == 2 else kc_))
                    M = lmb[cg, kc_, lane & 3].astype(np.float64)
                    pair = []
                    for r in range(2):
                        f = 2 * kc_ + r if lb == 2 else r
                        u = _h2((x & (fmask << lb * f)) | MAGIC) * 2.0 ** (-lb * f) - 1024 * 2.0 ** (-lb * f)
                        pair.append(_u32(*(u * M[[2 * r, 2 * r + 1]] + M[[4 + 2 * r, 5 + 2 * r]])))
                    bf.append(pair)
                nt = 2 * wd + nto if lb == 2 else wd
                O[:, 8 * nt : 8 * nt + 8] += _mma(pa[kc_], bf)
    return O / SHIFT


def _reference(data, g: int):
    q, kcode, ks, kz = data[:4]
    keys = kcode.float() * (ks.float() / SHIFT) + kz.float() / SHIFT
    scores = torch.einsum("bkrn,bkln->bkrl", q.float().view(1, bcd.K, 4, N), keys).reshape(1, bcd.H, 32)
    return scores[0, 16 * g : 16 * g + 16].numpy(), bcd.reference(*data)[0, 16 * g : 16 * g + 16].numpy()


@pytest.mark.parametrize("level", ["2bit", "4bit"])
@pytest.mark.parametrize("subn", [1, 0])
@pytest.mark.parametrize("g", [0, 1])
def test_packed_fragments_reproduce_the_reference(level: str, subn: int, g: int):
    kb, lb, rank = bcd.LEVELS[level][:3]
    data = bcd.random_level(1, 32, level, seed=3 + g, device="cpu")
    kc, km, lc, lm = bcd.pack(*data[1:], kb, lb)
    scores, zref = _reference(data, g)
    got = _scores(data[0], kc, km, g, subn, kb)
    assert np.abs(got - scores).max() <= 1e-3 * np.abs(scores).max()
    lg = scores * N**-0.5
    P = np.exp(lg - lg.max(1, keepdims=True))
    z = np.concatenate([_latent_out(P, lc, lm, g, h, lb) for h in range(rank // RANK)], 1) / P.sum(1, keepdims=True)
    assert np.linalg.norm(z - zref) / np.linalg.norm(zref) <= 1e-3


@pytest.mark.parametrize("kb", [2, 4])
def test_the_replay_sees_a_wrong_layout(kb: int):
    """Without the packer's swizzle of the key words' quads, the replayed scores are wrong: the check can fail."""
    data = bcd.random_level(1, 32, f"{kb}bit", seed=9, device="cpu")
    kc, km, _, _ = bcd.pack(*data[1:], kb, kb)
    unswizzled = kc.clone()
    n = kc.shape[-1]
    unswizzled[:, :, 1::2] = (
        kc[:, :, 1::2].view(*kc.shape[:2], -1, 4, n // 16, 4).flip(-2).reshape(*kc.shape[:2], -1, n)
    )
    scores, _ = _reference(data, 0)
    assert np.abs(_scores(data[0], kc, km, 0, 1, kb) - scores).max() <= 1e-3 * np.abs(scores).max()
    assert np.abs(_scores(data[0], unswizzled, km, 0, 1, kb) - scores).max() > 0.1 * np.abs(scores).max()
