// The score pass of a low-rank-key region (as kernels/cuda/lowrank_score.cu computes it) with the rebuild on Hopper's
// warpgroup tensor cores (wgmma, sm_90a): for every slot t below the region's length and every query head h of the
// CTA's two KV heads,
//     s[b, h, t] = (q_h * qk) . RoPE_t(mean + c_t dec[:r])          (float32; qk = scaling * log2 e)
// The latent launch of kernels/lowrank_attention.py runs the softmax and the latents over these scores.
//
// A CTA owns two KV heads of one basis block and a run of 64-slot tiles; its two warpgroups take alternate tiles and
// synchronize only within themselves (named barriers), so one warpgroup's unpacking, cos/sin and epilogue run while
// the other's products keep the tensor cores busy. Per tile and warpgroup:
//   1. cp.async brought the tile's packed codes, the scales/zeros of its token groups and its positions into the
//      warpgroup's stage (issued one tile of its own ahead);
//   2. scales/zeros to fp16; cos/sin of every (slot, frequency); codes -> fp16 coefficients [64, KCP] in the
//      canonical K-major layout of wgmma (8 x 16-byte core matrices, no swizzle), the coefficient KC held at 1 so
//      that the basis' row KC adds the mean;
//   3. the rebuild as wgmma m64n256k16 over KCP / 16 steps: [64 slots, KCP] x [KCP, 256 columns] (the two heads'
//      channels in order, K-major in shared memory for the CTA's life, divided per column pair by a power of two);
//   4. RoPE in the accumulators (a channel and its partner 64 apart sit in one thread), times the power of two, then
//      the accumulators re-packed as fp16 A fragments times the query heads by mma.sync m16n8k16: a warp's 16 slots
//      hold all 128 channels of both heads, so the scores need no exchange between warps.
//
// Fixed per build: KC, KBITS, KTG, META8, REP, Q_BF16, RDT_BF16, RSC, ROPE_TAB as in lowrank_score.cu (head dim 128).
// LBO_K / SBO_MN: the descriptors' byte offsets between core matrices along K and along M/N (defaults: the layout
// written here).

#define BT 64
#define KCP ((KC + 16) / 16 * 16)     // coefficients and the mean's, padded to the k of wgmma
#define PNB (KC * KBITS / 8)
#define PNW (PNB / 4)
#define NPL (8 / KBITS)
#define CSTR 72                       // cos/sin row stride, words (the epilogue's reads hit distinct banks)
#define NGT (KTG < BT ? BT / KTG : 1)
#define MB (META8 ? 1 : 2)
#define SZW (KC * MB / 4)
#define KROW (KCP * 16)               // bytes from one 8-row group of core matrices to the next
#ifndef LBO_K
#define LBO_K 128
#endif
#ifndef SBO_MN
#define SBO_MN KROW
#endif
#define A16(x) (((x) + 15) / 16 * 16)

// shared memory, bytes
#define OFF_B 0                                   // basis [256 columns][KCP], core matrices
#define OFF_S (OFF_B + 256 * KCP * 2)             // float [2][64]: per head and frequency, the columns' power of two
#define OFF_Q (OFF_S + 2 * 64 * 4)                // uint2 [2][8][32]: the score mma's query fragments per lane
#define OFF_W A16(OFF_Q + 2 * 8 * 32 * 8)         // the warpgroups' own regions:
#define W_A 0                                     //   coefficients [64][KCP], core matrices
#define W_CS (W_A + BT * KCP * 2)                 //   {cos, sin} [64][CSTR] in the model dtype
#define W_STC (W_CS + BT * CSTR * 4)              //   stage: codes [64][PNB]
#define W_STS A16(W_STC + BT * PNB)               //   stage: scales [NGT][KC], then zeros
#define W_STP A16(W_STS + 2 * NGT * KC * MB)      //   stage: positions [64]
#define W_SZ (W_STP + BT * 4)                     //   fp16 scales, zeros [2][NGT][KCP]
#define WSZ ((W_SZ + 2 * NGT * KCP * 2 + 127) / 128 * 128)
#define SMEM (OFF_W + 2 * WSZ)

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
__device__ __forceinline__ u32 pack_cs(float c, float s) {  // {cos, sin} in the model dtype, cos low
    u32 r;
#if RDT_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(s), "f"(c));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(s), "f"(c));
#endif
    return r;
}
__device__ __forceinline__ float2 unpack_cs(u32 v) {
#if RDT_BF16
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
#else
    return make_float2(h2f1((u16)(v & 0xFFFF)), h2f1((u16)(v >> 16)));
#endif
}
__device__ __forceinline__ float qf(const u16* q, long i) {
#if Q_BF16
    return bf2f(q[i]);
#else
    return h2f1(q[i]);
#endif
}

// a shared-memory matrix descriptor of wgmma: no swizzle, start address and the two core-matrix offsets
__device__ __forceinline__ unsigned long long gdesc(u32 saddr) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)(LBO_K >> 4) << 16) |
           ((unsigned long long)(SBO_MN >> 4) << 32);
}
__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void bar_wg(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

// d (64 x 256, float32; per thread 128) = (acc ? d : 0) + A (64 x 16, K-major) B (16 x 256, K-major)
__device__ __forceinline__ void wgmma256(float* d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(acc));
}

extern "C" __global__ void __launch_bounds__(256, 1) tale_lr_score_wg(
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
    const u16* __restrict__ bt,     // [Kb, hpb 128, KCP] fp16: per column (head, channel) its coefficients, mean at KC
    const float* __restrict__ svec,  // [K 64]: per KV head and frequency, the power of two its two columns were divided by
    int hpb,                                                             // KV heads per basis block
    float* __restrict__ sc, int s_scb, int s_sch,                      // scores [B, H, cap]
    int nsplit) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wt = tid & 127, w4 = warp & 3;
    const int sp = blockIdx.x, b = blockIdx.z;
    const int kv0 = blockIdx.y * 2;            // the CTA's KV heads kv0, kv0 + 1
    const int blk = kv0 / hpb, cb = (kv0 % hpb) * 128;  // their basis block and first column in it
    const int L = len_v >= 0 ? len_v : min(*len_p, cap);
    const int ntile = (L + BT - 1) / BT;
    const int per = (ntile + nsplit - 1) / nsplit;
    const int tile0 = sp * per, tile1 = min(tile0 + per, ntile);
    if (tile0 >= tile1) return;
    const float kinv = inv_v > 0.f ? inv_v : 1.0f / *bias_p;

    unsigned char* W = smem + OFF_W + wg * WSZ;
    const u32 sB = smem_u32(smem + OFF_B), sA = smem_u32(W + W_A);
    u32* cs = (u32*)(W + W_CS);
    const unsigned char* stc = W + W_STC;
    const unsigned char* sts = W + W_STS;
    const int* stp = (const int*)(W + W_STP);
    u16* sz = (u16*)(W + W_SZ);
    const float* ssc = (const float*)(smem + OFF_S);

    const unsigned char* kbase = codes + (long)b * s_kb + (long)blk * s_kh;
    const unsigned char* sbase = ksc + ((long)b * s_sb + (long)blk * s_sh) * MB;
    const unsigned char* zbase = kzr + ((long)b * s_sb + (long)blk * s_sh) * MB;
    const int ngroups = cap / KTG;
    // this warpgroup stages the tile at slot t0 (rows past the length: left stale, their scores are never written)
    auto stage = [&](int t0) {
        for (int i = wt; i < BT * PNW; i += 128) {
            const int t = i / PNW, w = i % PNW;
            if (t0 + t < L) cp4(smem_u32(stc + t * PNB + 4 * w), kbase + (long)(t0 + t) * s_kt + 4 * w);
        }
        for (int i = wt; i < 2 * NGT * SZW; i += 128) {
            const int z = i / (NGT * SZW), g = (i / SZW) % NGT, w = i % SZW;
            const int gg = t0 / KTG + g;
            if (gg < ngroups)
                cp4(smem_u32(sts + ((z * NGT + g) * KC) * MB + 4 * w), (z ? zbase : sbase) + (long)gg * s_st * MB + 4 * w);
        }
        for (int i = wt; i < BT; i += 128)
            if (t0 + i < L) cp4(smem_u32(stp + i), pos + (long)b * s_pb + t0 + i);
        cp_commit();
    };
    const int my0 = tile0 + wg;                // this warpgroup's tiles: my0, my0 + 2, ...
    if (my0 < tile1) stage(my0 * BT);

    // the two heads' 256 columns of the basis, for the CTA's life: 16-byte chunks into core matrices
    for (int i = tid; i < 256 * (KCP / 8); i += 256) {
        const int n = i / (KCP / 8), k8 = i % (KCP / 8);
        cp16(sB + (n >> 3) * KROW + k8 * 128 + (n & 7) * 16, bt + ((long)(blk * hpb * 128 + cb + n) * KCP + k8 * 8));
    }
    cp_commit();
    for (int i = tid; i < 128; i += 256) ((float*)(smem + OFF_S))[i] = svec[kv0 * 64 + i];
    // both coefficient tiles' constant columns: KC holds 1 (the basis' row KC is the mean), the padding 0
    for (int i = tid; i < 2 * BT * (KCP - KC); i += 256) {
        const int w = i / (BT * (KCP - KC)), r = i % (BT * (KCP - KC));
        const int t = r / (KCP - KC), k = KC + r % (KCP - KC);
        *(u16*)(smem + OFF_W + w * WSZ + W_A + (t >> 3) * KROW + (k >> 3) * 128 + (t & 7) * 16 + (k & 7) * 2) =
            k == KC ? (u16)0x3C00 : (u16)0;
    }
    // the query heads' B fragments of the score mma, per head h, 16 channels c and lane: rows k = channel, column
    // n = query head (n < REP; else zero); in shared memory, as registers are all the accumulators'
    for (int i = tid; i < 2 * 8 * 32; i += 256) {
        const int h = i >> 8, c = (i >> 5) & 7, l = i & 31;
        const int n = l >> 2, dd = 16 * c + 2 * (l & 3);
        const long qrow = (long)b * s_qb + (long)((kv0 + h) * REP + (n < REP ? n : 0)) * s_qh;
        float v0 = 0.f, v1 = 0.f, v2 = 0.f, v3 = 0.f;
        if (n < REP) {
            v0 = qf(q, qrow + dd) * qk, v1 = qf(q, qrow + dd + 1) * qk;
            v2 = qf(q, qrow + dd + 8) * qk, v3 = qf(q, qrow + dd + 9) * qk;
        }
        ((uint2*)(smem + OFF_Q))[i] = make_uint2(f2h(v0, v1), f2h(v2, v3));
    }
#if !ROPE_TAB
    const float my_invf = invf[wt & 63];
    const int my_roff = roff[b];
#endif
    cp_wait_all();
    fence_async();  // the basis (and the constant columns) written by the generic proxy, read by wgmma
    __syncthreads();

    const int tr = w4 * 16 + (lane >> 2);     // this thread's accumulator rows (slots): tr, tr + 8
    for (int tile = my0; tile < tile1; tile += 2) {
        const int t0 = tile * BT;
        cp_wait_all();
        bar_wg(1 + wg);  // the stage landed; the last tile's epilogue is done with cs
        for (int i = wt; i < 2 * NGT * KC; i += 128) {  // scales/zeros -> fp16 [NGT][KCP] (scales, then zeros)
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
        for (int t = wt >> 6; t < BT; t += 2) {  // cos/sin of every (slot, frequency), the frequency fixed per thread
#if ROPE_TAB
            if (t0 + t < L) {
                const long ci = (long)b * s_cb + (long)(t0 + t) * s_ct + (wt & 63);
                cs[t * CSTR + (wt & 63)] = pack_cs(cos_t[ci], sin_t[ci]);
            }
#else
            float ang = (float)(stp[t] - my_roff) * my_invf;
            const float kq = floorf(ang * 0.15915494309189535f + 0.5f);
            ang = fmaf(-kq, 6.2831854820251465f, ang);
            ang = fmaf(-kq, -1.7484556000744487e-07f, ang);
            float c, s;
            asm("cos.approx.ftz.f32 %0, %1;" : "=f"(c) : "f"(ang));
            asm("sin.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(ang));
#if RSC
            c *= rsc;
            s *= rsc;
#endif
            cs[t * CSTR + (wt & 63)] = pack_cs(c, s);
#endif
        }
        bar_wg(1 + wg);
        // codes -> coefficients in core matrices: 8 consecutive items are the 8 rows of one core matrix (whole
        // 128-byte stores per 8 lanes); word w of row t holds, per plane p, codes p PNB + 4 w .. + 3
        for (int i = wt; i < BT * PNW; i += 128) {
            const int rem = i % (8 * PNW), w = rem >> 3, t = (i / (8 * PNW)) * 8 + (rem & 7);
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
                sts64(sA + (t >> 3) * KROW + (c >> 3) * 128 + (t & 7) * 16 + (c & 7) * 2, hfma2(c01, s2.x, z2.x),
                      hfma2(c23, s2.y, z2.y));
            }
        }
        fence_async();   // the coefficients written by the generic proxy, read by wgmma
        bar_wg(1 + wg);  // the coefficient tile is complete and the stage consumed
        if (tile + 2 < tile1) stage(t0 + 2 * BT);

        // -- the rebuild: d[64 slots x 256 columns] (per thread: rows tr, tr + 8; columns 8 j + 2 (lane & 3) + e)
        float d[128];
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KCP / 16; ks++) wgmma256(d, gdesc(sA + ks * 2 * LBO_K), gdesc(sB + ks * 2 * LBO_K), ks);
        wg_commit();
        wg_wait0();
        // -- RoPE (lo' = lo cos - hi sin, hi' = hi cos + lo sin: columns j and j + 8 of a head), times the pair's
        // power of two
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int f = 8 * i + 2 * (lane & 3);
            const uint2 c0 = *(const uint2*)(cs + tr * CSTR + f), c1 = *(const uint2*)(cs + (tr + 8) * CSTR + f);
            const float2 s0 = *(const float2*)(ssc + f), s1 = *(const float2*)(ssc + 64 + f);
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float2 csv = unpack_cs(r ? (e ? c1.y : c1.x) : (e ? c0.y : c0.x));
                        const float s = h ? (e ? s1.y : s1.x) : (e ? s0.y : s0.x);
                        const int jl = 4 * (16 * h + i) + 2 * r + e, jh = jl + 32;
                        const float lo = d[jl], hi = d[jh];
                        d[jl] = s * (lo * csv.x - hi * csv.y);
                        d[jh] = s * (hi * csv.x + lo * csv.y);
                    }
        }
        // -- scores: the rotated keys as fp16 A fragments (the accumulator layout is the A layout) times the queries
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float S[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int c = 0; c < 8; c++) {
                const float* x0 = d + 4 * (16 * h + 2 * c);
                const float* x1 = x0 + 4;
                const uint2 qv = ((const uint2*)(smem + OFF_Q))[(h * 8 + c) * 32 + lane];
                mma(S, f2h(x0[0], x0[1]), f2h(x0[2], x0[3]), f2h(x1[0], x1[1]), f2h(x1[2], x1[3]), qv.x, qv.y);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int t = t0 + tr + 8 * (i >> 1), n = 2 * (lane & 3) + (i & 1);
                if (n < REP && t < L) sc[(long)b * s_scb + (long)((kv0 + h) * REP + n) * s_sch + t] = S[i];
            }
        }
    }
}
