// Scores of a low-rank-key region for one decoded token, on tensor cores: for every slot t below the region's length
// and every query head h of the CTA's KV heads,
//     s[b, h, t] = (q_h * qk) . RoPE_t(mean + c_t dec[:r])          (float32; qk = scaling * log2 e)
// where c_t are the slot's key coefficients (runtime/key_basis.py), dequantized from their codes. The latent launch
// of kernels/lowrank_attention.py (its second pass) runs the softmax and the latents over these scores and masks
// the slots (positions, windows) itself, so this kernel writes every slot below the length unmasked.
// tale_kernels.lowrank_attention compiles it (kernels/cuda_module.py: NVRTC or nvcc) per configuration (-D below).
//
// A CTA owns HPC KV heads of one basis block (2 HPC warps) and a run of BT-slot tiles; per tile:
//   1. cp.async brings the tile's packed codes, the scales/zeros of its token groups and its positions into a stage
//      (issued one tile ahead, while the previous tile's products run);
//   2. all threads: scales/zeros to fp16; cos/sin of every (slot, frequency) from the positions and the model's
//      inv_freq (the SFU's cos/sin after a float32 reduction to [-pi, pi], rounded to the model dtype as its tables;
//      CS_REC: a slot one step after the thread's last one rotates that one's pair instead, one SFU pair per thread
//      and tile); then codes -> fp16 coefficients [BT, KCP] (1024 + code under an fp16 exponent, one sub and one fma
//      per pair). ALIAS: the cos/sin table is made after step 3 instead, in the coefficient tile's space, with the
//      dot's halves of step 5 beside it: the CTA shrinks to 112 KB at 2 KV heads and 64 slots, two per SM, so one
//      CTA's GEMM runs beside the other's unpacking;
//   3. the rebuild as one GEMM [BT, KCP] x [KCP, HPC * 128] by mma.sync m16n8k16 (float32 accumulators): the basis
//      block's columns of the CTA's heads, times their column scales, stay in shared memory for the CTA's life, with
//      the column means as row KC against a coefficient held at 1 (where KC leaves a padding column; else the mean
//      is added after); warp (j, f) owns head j's channels f * 32 .. f * 32 + 31 of both RoPE halves, so RoPE pairs
//      sit in one thread's registers;
//   4. the keys packed to fp16 pairs and rotated in half2 arithmetic (RoPE), which is the A layout of the next mma
//      (the C layout of one mma is the A layout of the next), times the query [128, 8 heads]: one m16n8k16 per 16
//      channels and 16 slots;
//   5. the two warps of a head add their halves of the dot through shared memory; one writes the scores.
//
// Fixed per build: KC coefficients per block row (KC * KBITS / 8 bytes: whole 32-bit words), KBITS
// 2/4/8 (codes in runtime/quant.py's planar rows: code c in byte c % PNB at bit (c / PNB) * KBITS), KTG slots per
// scale group (16, 32, or a multiple of 64), META8 (1: fp8 e4m3 scale and zero times 1 / bias; 0: 16-bit fp16
// bits times 1 / shift), REP query heads per KV head (<= 8), the CTA's cut (HPC KV heads, BT slots per tile, ALIAS,
// CS_REC: kernels/lowrank_score.py Tiling), Q_BF16 (query dtype), RDT_BF16 (cos/sin rounded to bf16, else fp16), RSC
// (cos/sin times the rotary's attention scaling), ROPE_TAB (1: cos/sin read from the region's float32 tables
// [B, cap, 128], the lo half of each: a cache that stores them), SMEM_LAUNCH (the bytes the launch gives). Head dim
// 128.

#ifndef BT
#define BT 64                         // slots per tile: 64, or 32 (a smaller CTA, two per SM)
#endif
#define MT (BT / 16)                  // m-tiles of 16 slots per tile
#define NHALF 64                      // channels per RoPE half (head dim 128)
#define CSTR 72                       // cos/sin row stride, words: the epilogue's 8 slots x 4 frequency pairs of a
                                      // half-warp land in distinct banks (a stride of 64 put every slot on one)
#define KCP ((KC + 15) / 16 * 16)     // coefficients padded to the mma's k
#define FOLD_MEAN (KC < KCP)          // the column means as the GEMM's row KC (a padding coefficient held at 1)
#define PNB (KC * KBITS / 8)          // bytes per packed row
#define PNW (PNB / 4)                 // words per packed row
#define NPL (8 / KBITS)               // code planes per byte
#define NCOL (HPC * 128)              // basis columns per CTA: head j's lo half at j 128, hi half at j 128 + 64
#define BSTR (NCOL + 8)               // shared row strides in halves: + 16 bytes, so ldmatrix rows hit distinct banks
#define ASTR (KCP + 8)
#define NWARP (2 * HPC)
#define NTHR (32 * NWARP)
#define TSTEP (NTHR >> 6)             // slots between one thread's cos/sin rows
#ifndef CS_REC
#define CS_REC 0                      // 1: cos/sin of a slot TSTEP positions after the thread's last by rotation
#endif
#define NGT (KTG < BT ? BT / KTG : 1) // scale groups per tile
#define MB (META8 ? 1 : 2)            // bytes per scale or zero
#define SZW (KC * MB / 4)             // words of one group's scales (or zeros)
#define RW ((REP + 1) / 2)            // lanes per row of the score mma's C fragment that hold a query head
#ifndef ALIAS
#define ALIAS 0                       // 1: cos/sin and the dot's halves live in the coefficient tile's space, made
#endif                                // after the GEMM (a smaller CTA: two per SM at 2 KV heads and 64 slots)

// shared memory, bytes
#define AB (BT * ASTR * 2)                             // the coefficient tile
#define CSB (BT * CSTR * 4)                            // [BT slots][CSTR] {cos, sin} fp16, of the model dtype's
#define REDB (HPC * MT * 8 * RW * 16)                  // float4 [HPC][MT][8][RW]: the second warps' halves of the dot
#define COLB (FOLD_MEAN ? 0 : 2 * HPC * NHALF * 4)     // float [2][HPC][64]: the column means, lo and hi
#define OFF_B 0
#define OFF_A (OFF_B + KCP * BSTR * 2)
#if ALIAS
#define OFF_CS OFF_A
#define OFF_RED (OFF_A + CSB)
#define OFF_STC (OFF_A + (AB > CSB + REDB ? AB : CSB + REDB))
#else
#define OFF_CS (OFF_A + AB)
#define OFF_RED (OFF_CS + CSB)
#define OFF_STC (OFF_RED + REDB)                       // stage: codes [BT][PNB]
#endif
#define OFF_STS (OFF_STC + BT * PNB)                   // stage: scales [NGT][KC], then zeros [NGT][KC]
#define OFF_STP (OFF_STS + 2 * NGT * KC * MB)          // stage: positions [1 + ALIAS][BT] (ALIAS: by tile parity)
#define OFF_SZ (OFF_STP + (1 + ALIAS) * BT * 4)        // fp16 scales [NGT][KCP], then zeros [NGT][KCP]
#define OFF_COL (OFF_SZ + 2 * NGT * KCP * 2)
#define SMEM (OFF_COL + COLB)
#ifdef SMEM_LAUNCH  // the launch's bytes (kernels/lowrank_score.py smem_bytes): a layout edit must move both
static_assert(SMEM == SMEM_LAUNCH, "the launch's shared memory differs from the kernel's layout");
#endif

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
// {cos, sin} rounded to the model dtype, held as fp16 for the half2 RoPE (a bf16 value of magnitude <= 1 is an fp16
// one, down to fp16's subnormals), packed: cos in the low 16 bits
__device__ __forceinline__ u32 pack_cs(float c, float s) {
#if RDT_BF16
    u32 b;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(b) : "f"(s), "f"(c));
    c = __uint_as_float(b << 16);
    s = __uint_as_float(b & 0xFFFF0000u);
#endif
    return f2h(c, s);
}
__device__ __forceinline__ float qf(const u16* q, long i) {
#if Q_BF16
    return bf2f(q[i]);
#else
    return h2f1(q[i]);
#endif
}

extern "C" __global__ void __launch_bounds__(NTHR, 1) tale_lr_score(
    const u16* __restrict__ q, int s_qb, int s_qh, float qk,             // query [B, H, 1, 128]
    const int* __restrict__ pos, int s_pb,                               // slot positions [B, cap]
    const int* __restrict__ len_p, int len_v, int cap,                   // length: *len_p if len_v < 0
    const int* __restrict__ roff,                                        // rope offset per row [B]
    const float* __restrict__ invf, float rsc,                           // inv_freq [64], attention scaling
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int s_cb, int s_ct,  // ROPE_TAB: [B, cap, 128]
    const unsigned char* __restrict__ codes, int s_kb, int s_kh, int s_kt,       // [B, Kb, cap, PNB]
    const unsigned char* __restrict__ ksc, const unsigned char* __restrict__ kzr,  // [B, Kb, cap / KTG, KC]
    int s_sb, int s_sh, int s_st,                                      // their strides, elements
    const float* __restrict__ bias_p, float inv_v,                       // 1 / bias or shift; <= 0: 1 / *bias_p
    const u16* __restrict__ dlo, const u16* __restrict__ dhi, int s_dblk, int s_dec,  // [Kb, C, K 64] fp16
    const float* __restrict__ rows, int knh,                             // [4, K 64]: mean lo, hi, scale lo, hi
    int hpb,                                                             // KV heads per basis block
    float* __restrict__ sc, int s_scb, int s_sch,                      // scores [B, H, cap]
    int nsplit) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sp = blockIdx.x, cta = blockIdx.y, b = blockIdx.z;
    const int kv0 = cta * HPC;                 // the CTA's first KV head
    const int blk = kv0 / hpb, cb = (kv0 % hpb) * NHALF;  // its basis block and first column in it
    const int L = len_v >= 0 ? len_v : min(*len_p, cap);
    const int ntile = (L + BT - 1) / BT;
    const int per = (ntile + nsplit - 1) / nsplit;
    const int tile0 = sp * per, tile1 = min(tile0 + per, ntile);
    if (tile0 >= tile1) return;
    const float kinv = inv_v > 0.f ? inv_v : 1.0f / *bias_p;

    const u32 sB = smem_u32(smem + OFF_B), sA = smem_u32(smem + OFF_A);
    u32* cs = (u32*)(smem + OFF_CS);
    const unsigned char* stc = smem + OFF_STC;
    const unsigned char* sts = smem + OFF_STS;
    const int* stp0 = (const int*)(smem + OFF_STP);
    u16* sz = (u16*)(smem + OFF_SZ);
#if !FOLD_MEAN
    float* col = (float*)(smem + OFF_COL);
#endif
    float4* red = (float4*)(smem + OFF_RED);

    const unsigned char* kbase = codes + (long)b * s_kb + (long)blk * s_kh;
    const unsigned char* sbase = ksc + ((long)b * s_sb + (long)blk * s_sh) * MB;
    const unsigned char* zbase = kzr + ((long)b * s_sb + (long)blk * s_sh) * MB;
    const int ngroups = cap / KTG;
    // stage the tile at slot t0: codes, its groups' scales and zeros, positions (rows past the length: left stale,
    // their scores are never written)
    auto stage = [&](int t0) {
        for (int i = tid; i < BT * PNW; i += NTHR) {
            const int t = i / PNW, w = i % PNW;
            if (t0 + t < L) cp4(smem_u32(stc + t * PNB + 4 * w), kbase + (long)(t0 + t) * s_kt + 4 * w);
        }
        for (int i = tid; i < 2 * NGT * SZW; i += NTHR) {
            const int z = i / (NGT * SZW), g = (i / SZW) % NGT, w = i % SZW;
            const int gg = t0 / KTG + g;
            if (gg < ngroups)
                cp4(smem_u32(sts + ((z * NGT + g) * KC) * MB + 4 * w), (z ? zbase : sbase) + (long)gg * s_st * MB + 4 * w);
        }
        const int* stp = stp0 + (ALIAS ? ((t0 / BT) & 1) * BT : 0);  // ALIAS: read after the next stage is issued
        for (int i = tid; i < BT; i += NTHR)
            if (t0 + i < L) cp4(smem_u32(stp + i), pos + (long)b * s_pb + t0 + i);
        cp_commit();
    };
    stage(tile0 * BT);

    // the basis columns of the CTA's heads times their column scales, for the CTA's life: row k, head j: lo channels
    // at j 128, hi at j 128 + 64; row KC the column means (FOLD_MEAN), the rest of the padding rows zero
    for (int i = tid; i < KC * HPC * 16; i += NTHR) {
        const int k = i / (HPC * 16), j = (i / 16) % HPC, hf = (i / 8) % 2, c = i % 8;
        const u16* src = (hf ? dhi : dlo) + (long)blk * s_dblk + (long)k * s_dec + cb + j * NHALF + c * 8;
        const float4* srow = (const float4*)(rows + (2 + hf) * knh + (kv0 + j) * NHALF + c * 8);
        const uint4 v = *(const uint4*)src;
        const float4 s0 = srow[0], s1 = srow[1];
        const float2 h0 = h2f(v.x), h1 = h2f(v.y), h2 = h2f(v.z), h3 = h2f(v.w);
        *(uint4*)(smem + OFF_B + (k * BSTR + j * 128 + hf * 64 + c * 8) * 2) =
            make_uint4(f2h(h0.x * s0.x, h0.y * s0.y), f2h(h1.x * s0.z, h1.y * s0.w), f2h(h2.x * s1.x, h2.y * s1.y),
                       f2h(h3.x * s1.z, h3.y * s1.w));
    }
#if FOLD_MEAN
    for (int i = tid; i < HPC * 128; i += NTHR) {
        const int j = i / 128, hf = (i / 64) % 2, f = i % 64;
        ((u16*)(smem + OFF_B))[KC * BSTR + i] = (u16)(f2h(rows[hf * knh + (kv0 + j) * NHALF + f], 0.f) & 0xFFFF);
    }
#endif
    for (int i = tid; i < (KCP - KC - FOLD_MEAN) * BSTR / 2; i += NTHR)
        ((u32*)(smem + OFF_B))[(KC + FOLD_MEAN) * BSTR / 2 + i] = 0u;
    // the coefficient tile's padding columns (1.0 at KC: the mean's row), for good (ALIAS: per tile, see below)
    auto pad_tile = [&]() {
#if KCP > KC
        for (int i = tid; i < BT * (KCP - KC); i += NTHR) {
            const int c = KC + i % (KCP - KC);
            ((u16*)(smem + OFF_A))[(i / (KCP - KC)) * ASTR + c] = FOLD_MEAN && c == KC ? 0x3C00 : 0;
        }
#endif
    };
    if (!ALIAS) pad_tile();
#if !FOLD_MEAN
    for (int i = tid; i < HPC * NHALF; i += NTHR) {
        const int gc = kv0 * NHALF + i;
        col[i] = rows[gc];
        col[HPC * NHALF + i] = rows[knh + gc];
    }
#endif
    // this warp: head j, channels f * 32 .. + 31 of each RoPE half. Its query heads' B fragments for the score mma,
    // per 16 channels s (0, 1: lo; 2, 3: hi): rows k = channel, column n = query head (n < REP; else zero)
    const int j = warp >> 1, fh = warp & 1;
    u32 qb[4][2];
    {
        const int n = lane >> 2, kk = 2 * (lane & 3);
        const long qrow = (long)b * s_qb + (long)((kv0 + j) * REP + (n < REP ? n : 0)) * s_qh;
        for (int s = 0; s < 4; s++) {
            const int d = (s >> 1) * 64 + fh * 32 + (s & 1) * 16 + kk;
            float v0 = 0.f, v1 = 0.f, v2 = 0.f, v3 = 0.f;
            if (n < REP) {
                v0 = qf(q, qrow + d) * qk, v1 = qf(q, qrow + d + 1) * qk;
                v2 = qf(q, qrow + d + 8) * qk, v3 = qf(q, qrow + d + 9) * qk;
            }
            qb[s][0] = f2h(v0, v1);
            qb[s][1] = f2h(v2, v3);
        }
    }
#if !ROPE_TAB
    const float my_invf = invf[tid & 63];
    const int my_roff = roff[b];
#if CS_REC
    // the rotation by TSTEP positions at this thread's frequency, once, in double: the recurrence below steps by it
    float rc, rs;
    {
        double ds, dc;
        sincos((double)TSTEP * (double)my_invf, &ds, &dc);
        rc = (float)dc, rs = (float)ds;
    }
#endif
#endif

    // cos/sin of every (slot, frequency) of the tile at t0 into cs: the frequency is fixed per thread (NTHR is a
    // multiple of 64)
    auto rope_table = [&](const int* stp, int t0) {
#if !ROPE_TAB && CS_REC
        float c = 0.f, s = 0.f;
        int pprev = 0;
#endif
        for (int t = tid >> 6; t < BT; t += TSTEP) {
#if ROPE_TAB  // the region's tables (the model's own cos/sin, already rounded and scaled)
            if (t0 + t < L) {
                const long ci = (long)b * s_cb + (long)(t0 + t) * s_ct + (tid & 63);
                cs[t * CSTR + (tid & 63)] = pack_cs(cos_t[ci], sin_t[ci]);
            }
#else
            const int p = stp[t] - my_roff;
#if CS_REC  // a slot TSTEP positions after this thread's last one (the usual case): rotate that one's pair
            if (t != (tid >> 6) && p == pprev + TSTEP) {
                const float c2 = fmaf(c, rc, -s * rs);
                s = fmaf(s, rc, c * rs);
                c = c2;
            } else
#else
            float c, s;
#endif
            {
                float ang = (float)p * my_invf;
                const float kq = floorf(ang * 0.15915494309189535f + 0.5f);
                ang = fmaf(-kq, 6.2831854820251465f, ang);
                ang = fmaf(-kq, -1.7484556000744487e-07f, ang);
                asm("cos.approx.ftz.f32 %0, %1;" : "=f"(c) : "f"(ang));
                asm("sin.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(ang));
            }
#if CS_REC
            pprev = p;
#endif
#if RSC
            cs[t * CSTR + (tid & 63)] = pack_cs(c * rsc, s * rsc);
#else
            cs[t * CSTR + (tid & 63)] = pack_cs(c, s);
#endif
#endif
        }
    };

    for (int tile = tile0; tile < tile1; tile++) {
        const int t0 = tile * BT;
        const int* stp = stp0 + (ALIAS ? (tile & 1) * BT : 0);
        cp_wait_all();
        __syncthreads();  // the stage (and, first time, the basis) landed; the last tile's readers are done
        // scales/zeros -> fp16 [NGT][KCP] (scales, then zeros)
        for (int i = tid; i < 2 * NGT * KC; i += NTHR) {
            const int z = i / (NGT * KC), r = i % (NGT * KC);
            float v;
#if META8
            v = fp8f(sts[z * NGT * KC + r]);
#else
            v = h2f1(((const u16*)sts)[z * NGT * KC + r]);
#endif
            const int g = r / KC, c = r % KC;
            sz[(z * NGT + g) * KCP + c] = (u16)(f2h(v * kinv, 0.f) & 0xFFFF);
        }
#if !ALIAS
        rope_table(stp, t0);
#endif
        __syncthreads();
        if (ALIAS) pad_tile();  // the last tile's cos/sin and dot halves wrote over them
        // codes -> coefficients: word w of row t holds, per plane p, codes p PNB + 4 w .. + 3
        for (int i = tid; i < BT * PNW; i += NTHR) {
            const int t = i / PNW, w = i % PNW;
            const u32 word = *(const u32*)(stc + t * PNB + 4 * w);
            const int g = KTG < BT ? t / KTG : 0;
            const u16* srow = sz + g * KCP;
            const u16* zrow = sz + (NGT + g) * KCP;
#pragma unroll
            for (int p = 0; p < NPL; p++) {
                const u32 x = (word >> (p * KBITS)) & (KBITS == 8 ? 0xFFFFFFFFu : KBITS == 4 ? 0x0F0F0F0Fu : 0x03030303u);
                const int c = p * PNB + 4 * w;
                const u32 c01 = hsub2(__byte_perm(x, 0x64646464u, 0x4140), 0x64006400u);
                const u32 c23 = hsub2(__byte_perm(x, 0x64646464u, 0x4342), 0x64006400u);
                const uint2 s2 = *(const uint2*)(srow + c), z2 = *(const uint2*)(zrow + c);
                uint2 o;
                o.x = hfma2(c01, s2.x, z2.x);
                o.y = hfma2(c23, s2.y, z2.y);
                *(uint2*)(smem + OFF_A + (t * ASTR + c) * 2) = o;
            }
        }
        __syncthreads();  // the coefficient tile is complete and the stage consumed
        if (tile + 1 < tile1) stage(t0 + BT);

        // -- the rebuild: acc[mt][nt] = slots mt*16.. x columns (nt < 4: lo, else hi) of head j, channels fh*32 + ..
        float acc[MT][8][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < 8; nt++) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
        const u32 a_row = sA + ((lane & 15) * ASTR + (lane >> 4) * 8) * 2;
        const u32 b_row = sB + ((((lane & 7) + ((lane >> 3) & 1) * 8) * BSTR) + j * 128 + fh * 32 + (lane >> 4) * 8) * 2;
#pragma unroll 1
        for (int ks = 0; ks < KCP / 16; ks++) {
            u32 a[MT][4], bf[4][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) ldsm4(a[mt], a_row + (mt * 16 * ASTR + ks * 16) * 2);
#pragma unroll
            for (int np = 0; np < 4; np++)  // n-tile pairs: lo 0-15, lo 16-31, hi 0-15, hi 16-31
                ldsm4t(bf[np], b_row + (ks * 16 * BSTR + (np >> 1) * 64 + (np & 1) * 16) * 2);
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
                    mma(acc[mt][nt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], bf[nt >> 1][(nt & 1) * 2],
                        bf[nt >> 1][(nt & 1) * 2 + 1]);
        }
#if ALIAS
        __syncthreads();  // every warp's GEMM has read the coefficient tile: the cos/sin table takes its space
        rope_table(stp, t0);
        __syncthreads();
#endif
        // -- RoPE in half2 (lo' = lo cos - hi sin, hi' = hi cos + lo sin) on the keys packed to fp16: kh[mt][nt][r]
        // holds slot mt 16 + lane / 4 + 8 r, channels f, f + 1 (nt < 4 the lo half, else hi) as one A fragment register
        u32 kh[MT][8][2];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const int f = fh * 32 + nt * 8 + 2 * (lane & 3);
#if !FOLD_MEAN
            const float2 mlo = *(const float2*)(col + j * NHALF + f);
            const float2 mhi = *(const float2*)(col + (HPC + j) * NHALF + f);
#endif
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int t = mt * 16 + (lane >> 2) + 8 * r;
                    const uint2 cw = *(const uint2*)(cs + t * CSTR + f);
                    const u32 c2 = __byte_perm(cw.x, cw.y, 0x5410), s2 = __byte_perm(cw.x, cw.y, 0x7632);
                    float l0 = acc[mt][nt][2 * r], l1 = acc[mt][nt][2 * r + 1];
                    float h0 = acc[mt][nt + 4][2 * r], h1 = acc[mt][nt + 4][2 * r + 1];
#if !FOLD_MEAN
                    l0 += mlo.x, l1 += mlo.y, h0 += mhi.x, h1 += mhi.y;
#endif
                    const u32 lo2 = f2h(l0, l1), hi2 = f2h(h0, h1);
                    kh[mt][nt][r] = hfma2(lo2, c2, hmul2(hi2, s2 ^ 0x80008000u));
                    kh[mt][nt + 4][r] = hfma2(hi2, c2, hmul2(lo2, s2));
                }
        }
        // -- scores: the rotated keys (fp16 A fragments) times the query heads
        float S[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            S[mt][0] = S[mt][1] = S[mt][2] = S[mt][3] = 0.f;
#pragma unroll
            for (int s = 0; s < 4; s++)
                mma(S[mt], kh[mt][2 * s][0], kh[mt][2 * s][1], kh[mt][2 * s + 1][0], kh[mt][2 * s + 1][1], qb[s][0],
                    qb[s][1]);
        }
        // lanes with lane % 4 < RW hold query heads (n = 2 (lane % 4) + 0, 1 < REP): only they trade halves
        const int ri = (lane >> 2) * RW + (lane & 3);
        if (fh && (lane & 3) < RW)
#pragma unroll
            for (int mt = 0; mt < MT; mt++) red[(j * MT + mt) * 8 * RW + ri] = make_float4(S[mt][0], S[mt][1], S[mt][2], S[mt][3]);
        __syncthreads();
        if (!fh && (lane & 3) < RW) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const float4 o = red[(j * MT + mt) * 8 * RW + ri];
                const float v[4] = {S[mt][0] + o.x, S[mt][1] + o.y, S[mt][2] + o.z, S[mt][3] + o.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int t = t0 + mt * 16 + (lane >> 2) + 8 * (i >> 1), n = 2 * (lane & 3) + (i & 1);
                    if (n < REP && t < L) sc[(long)b * s_scb + (long)((kv0 + j) * REP + n) * s_sch + t] = v[i];
                }
            }
        }
    }
}
