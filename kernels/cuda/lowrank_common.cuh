// What the two builds of the low-rank score pass share (kernels/cuda/lowrank_score.cu on mma.sync,
// kernels/cuda/lowrank_score_wg.cu on wgmma): the launch's arguments, the tile run of a CTA, the stage of a tile's
// codes and scales, their dequantization, the query's fragments and the cos/sin of RoPE. Include it after the
// build's macros (KC, KBITS, KTG, META8, REP, Q_BF16, RDT_BF16, BT, KCP, NGT, MB, PNB, PNW, NPL, SZW).
#pragma once

#include "ptx.cuh"

__device__ __forceinline__ float h2f1(u16 h) {
    float f;
    asm("{.reg .f16 t;\n mov.b16 t, %1;\n cvt.f32.f16 %0, t;}\n" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ float fp8f(u32 b) {  // fp8 e4m3 byte -> float (exact; NaN unused)
    return __uint_as_float(((b & 0x7Fu) << 20) | ((b & 0x80u) << 24)) * 1.329227995784916e36f;  // 2^120
}
__device__ __forceinline__ float qf(const u16* q, long i) {
#if Q_BF16
    return bf2f(q[i]);
#else
    return h2f1(q[i]);
#endif
}
// two values rounded to the model dtype, held as fp16 for the half2 RoPE (a bf16 value of magnitude <= 1 is an fp16
// one, down to fp16's subnormals), packed: a in the low 16 bits
__device__ __forceinline__ u32 pair_rdt(float a, float b) {
#if RDT_BF16
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(b), "f"(a));
    a = __uint_as_float(r << 16);
    b = __uint_as_float(r & 0xFFFF0000u);
#endif
    return f2h(a, b);
}
// cos and sin of a float32 angle as the model's tables hold them: reduced to [-pi, pi] in float32, then the SFU
__device__ __forceinline__ void sincos_red(float ang, float* c, float* s) {
    const float kq = floorf(ang * 0.15915494309189535f + 0.5f);
    ang = fmaf(-kq, 6.2831854820251465f, ang);
    ang = fmaf(-kq, -1.7484556000744487e-07f, ang);
    asm("cos.approx.ftz.f32 %0, %1;" : "=f"(*c) : "f"(ang));
    asm("sin.approx.ftz.f32 %0, %1;" : "=f"(*s) : "f"(ang));
}

// the launch's arguments (kernels/lowrank_score.py scores)
#define LR_SCORE_ARGS                                                                                           \
    const u16* __restrict__ q, int s_qb, int s_qh, float qk,             /* query [B, H, 1, 128] */                 \
        const int* __restrict__ pos, int s_pb,                           /* slot positions [B, cap] */              \
        const int* __restrict__ len_p, int len_v, int cap,               /* length: *len_p if len_v < 0 */          \
        const int* __restrict__ roff,                                    /* rope offset per row [B] */              \
        const float* __restrict__ invf, float rsc,                       /* inv_freq [64], attention scaling */     \
        const float* __restrict__ cos_t, const float* __restrict__ sin_t, int s_cb, int s_ct, /* [B, cap, 128] */  \
        const unsigned char* __restrict__ codes, int s_kb, int s_kh, int s_kt,   /* [B, Kb, cap, PNB] */            \
        const unsigned char* __restrict__ ksc, const unsigned char* __restrict__ kzr, /* [B, Kb, cap / KTG, KC] */ \
        int s_sb, int s_sh, int s_st,                                    /* their strides, elements */              \
        const float* __restrict__ bias_p, float inv_v,                   /* 1 / bias or shift; <= 0: 1 / *bias_p */ \
        const u16* __restrict__ dlo, const u16* __restrict__ dhi, int s_dblk, int s_dec, /* [Kb, C, K 64] fp16 */  \
        const float* __restrict__ rows, int knh,                         /* [4, K 64]: mean lo, hi, scale lo, hi */ \
        int hpb,                                                         /* KV heads per basis block */             \
        float* __restrict__ sc, int s_scb, int s_sch,                    /* scores [B, H, cap] */                   \
        int nsplit

// the tiles of BT slots that split `sp` of `nsplit` owns below the length: [tile0, tile1)
struct TileRun {
    int L, tile0, tile1;
};
__device__ __forceinline__ TileRun tile_run(const int* len_p, int len_v, int cap, int sp, int nsplit) {
    const int L = len_v >= 0 ? len_v : min(*len_p, cap);
    const int ntile = (L + BT - 1) / BT;
    const int per = (ntile + nsplit - 1) / nsplit;
    return {L, sp * per, min(sp * per + per, ntile)};
}

// where a CTA's basis block `blk` of batch row b keeps its codes [cap, PNB] and their groups' scales and zeros
// [cap / KTG, KC]
struct CodeRows {
    const unsigned char *k, *s, *z;
    int s_kt, s_st, ngroups;
};
__device__ __forceinline__ CodeRows code_rows(const unsigned char* codes, const unsigned char* ksc,
                                              const unsigned char* kzr, int s_kb, int s_kh, int s_kt, int s_sb,
                                              int s_sh, int s_st, int cap, int b, int blk) {
    const long sz0 = ((long)b * s_sb + (long)blk * s_sh) * MB;
    return {codes + (long)b * s_kb + (long)blk * s_kh, ksc + sz0, kzr + sz0, s_kt, s_st, cap / KTG};
}

// cp.async of the tile at slot t0 into the stage: codes [BT][PNB], then its groups' scales [NGT][KC] and zeros
// [NGT][KC] (rows past the length are left stale: their scores are never written). The caller commits.
template <int NT>
__device__ __forceinline__ void stage_codes(unsigned char* stc, unsigned char* sts, const CodeRows& r, int t0, int L,
                                            int tid) {
    for (int i = tid; i < BT * PNW; i += NT) {
        const int t = i / PNW, w = i % PNW;
        if (t0 + t < L) cp4(smem_u32(stc + t * PNB + 4 * w), r.k + (long)(t0 + t) * r.s_kt + 4 * w);
    }
    for (int i = tid; i < 2 * NGT * SZW; i += NT) {
        const int z = i / (NGT * SZW), g = (i / SZW) % NGT, w = i % SZW;
        const int gg = t0 / KTG + g;
        if (gg < r.ngroups)
            cp4(smem_u32(sts + ((z * NGT + g) * KC) * MB + 4 * w), (z ? r.z : r.s) + (long)gg * r.s_st * MB + 4 * w);
    }
}

// the staged scales and zeros (fp8 or 16-bit, times 1 / bias) -> fp16 [NGT][KCP] each, scales first
template <int NT>
__device__ __forceinline__ void scales_fp16(const unsigned char* sts, u16* sz, float kinv, int tid) {
    for (int i = tid; i < 2 * NGT * KC; i += NT) {
        const int z = i / (NGT * KC), r = i % (NGT * KC);
#if META8
        const float v = fp8f(sts[z * NGT * KC + r]);
#else
        const float v = h2f1(((const u16*)sts)[z * NGT * KC + r]);
#endif
        sz[(z * NGT + r / KC) * KCP + r % KC] = (u16)(f2h(v * kinv, 0.f) & 0xFFFF);
    }
}

// the packed word w of staged row t, and its token group's fp16 scale and zero rows
__device__ __forceinline__ u32 code_word(const unsigned char* stc, const u16* sz, int t, int w, const u16** srow,
                                         const u16** zrow) {
    const int g = KTG < BT ? t / KTG : 0;
    *srow = sz + g * KCP;
    *zrow = sz + (NGT + g) * KCP;
    return *(const u32*)(stc + t * PNB + 4 * w);
}

// plane p of a packed word -> coefficients c .. c + 3 (c = p PNB + 4 w for word w), as two fp16 pairs: a code plus
// 1024 under an fp16 exponent, one sub and one fma (times the scale, plus the zero) per pair
__device__ __forceinline__ uint2 dequant4(u32 word, int p, const u16* srow, const u16* zrow, int c) {
    const u32 x = (word >> (p * KBITS)) & (KBITS == 8 ? 0xFFFFFFFFu : KBITS == 4 ? 0x0F0F0F0Fu : 0x03030303u);
    const u32 c01 = hsub2(__byte_perm(x, 0x64646464u, 0x4140), 0x64006400u);
    const u32 c23 = hsub2(__byte_perm(x, 0x64646464u, 0x4342), 0x64006400u);
    const uint2 s2 = *(const uint2*)(srow + c), z2 = *(const uint2*)(zrow + c);
    return make_uint2(hfma2(c01, s2.x, z2.x), hfma2(c23, s2.y, z2.y));
}

// the score mma's B fragment of 16 channels from d: rows k = channel, column n = query head (lane / 4; zero past
// REP) of the KV head whose first query row is qrow0, times qk, as fp16
__device__ __forceinline__ void q_frag(u32* f, const u16* q, long qrow0, int s_qh, int d, float qk, int lane) {
    const int n = lane >> 2;
    const long qrow = qrow0 + (long)(n < REP ? n : 0) * s_qh;
    d += 2 * (lane & 3);
    float v0 = 0.f, v1 = 0.f, v2 = 0.f, v3 = 0.f;
    if (n < REP) {
        v0 = qf(q, qrow + d) * qk, v1 = qf(q, qrow + d + 1) * qk;
        v2 = qf(q, qrow + d + 8) * qk, v3 = qf(q, qrow + d + 9) * qk;
    }
    f[0] = f2h(v0, v1);
    f[1] = f2h(v2, v3);
}
