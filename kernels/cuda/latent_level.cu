// One-pass decode attention over TALE's quantized levels in CUDA, with a per-warp online softmax.
// tale_kernels.mma_attention compiles it (NVRTC, or nvcc) and runs it for static caches in the fragment layout
// (runtime/frag.py writes it); benchmarks/bench_cuda_decode.py checks it against a float32 torch reference and
// times it against the Triton kernel in the same run.
//
// Shapes fixed (paper preset): head dim 128, 4 KV heads per latent group, any number of query heads per KV head
// (GQA 4, Llama-3.1-8B: one CTA's 16 rows are the group's query heads; GQA 1-3: one CTA, the rows past GQA left
// empty; GQA 5-8, Llama-3.1-70B: two CTAs of 16 rows; and so on), key
// group 32 slots (per-channel scale/zero), latent group 32 channels (per-slot scale/zero). Two levels, one template:
//   tale_attn_k2l2: the 2-bit middle (2-bit keys, rank-256 latents at 2 bits), 8 warps per CTA;
//   tale_attn_k4l4: the 4-bit recent level (4-bit keys, rank-512 latents at 4 bits), 5 warps per CTA; each CTA
//     handles one half of the 512 latent channels (blockIdx.y = 2 g + half), so the keys are read twice (their
//     accumulators would not fit otherwise: 16 x 512 float32 per warp).
// Each level's used length is read from the device (len[0]) and rounded up to whole key groups ("blocks" of 32
// slots): a slot never written holds position -1, like padding. Slots are masked by their positions (pos < 0: padding; a sliding window against npos[0]). A masked slot's scores become
// -inf; its latents still enter the product with p = 0, so its latent scales/zeros must be finite (the cache
// writes zeros into padding).
//
// What differs from the Triton kernel (docs/kernels.md, "What limits it"):
// - each warp owns whole 32-slot blocks and runs its own online softmax: no cross-warp reductions or barriers in
//   the loop; the warps of a CTA merge once at the end;
// - the packed bytes are laid out at pack time so that each thread's 32-bit word already holds its mma fragment:
//   a mask (SUBN=1: the code read as an fp16 subnormal, c * 2^(bits f) * 2^-24) or a mask-or (SUBN=0:
//   1024 + 2^(bits f) c) gives two operands per instruction, no shuffles, no shared-memory staging of dequantized
//   tiles;
// - key scales are folded into the query once per block (A = q * s * 2^-(bits f), block-diagonal over the 4 KV
//   heads, through shared memory and ldmatrix), key zeros into one per-row bias (sum q z); latent scales/zeros are
//   applied per pair with two fma.f16x2 (they vary per slot);
// - a cp.async double buffer per warp keeps the next block's bytes in flight.
//
// Layout per (batch b, latent group g, block of 32 slots), written by runtime/frag.py; t = lane % 4:
//   kc  [32 slots][KB * 16 words]  key codes: thread t's KB * 4 words of a slot hold its pairs of all 32 chunks
//                                  (2-bit: 4 chunks per word, 4-bit: 2); 16-byte quads swizzled against conflicts
//   km  [4 heads][32 quads][s0..3 z0..3]  key scale/zero (fp16, times `shift`), 4 channels per quad, swizzled
//   lc  [LB * 2][32 lanes][4 words] latent codes of 256 channels (per half at 4 bits): a word holds n-tiles
//                                  2w, 2w+1 (2-bit) or w (4-bit), both k-chunks
//   lm  [8 cg][2 kc][4 t][s_b0 s_b1 z_b0 z_b1]  latent scale/zero pairs (fp16, times `shift`), per 256 channels

#ifndef INFINITY  // NVRTC compiles without the C headers
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef ABATCH
#define ABATCH 4
#endif
#ifndef SUBN
#define SUBN 1
#endif
#define ATILE_B 8192
#define AZERO_B 128  // zeros read as the a1 / a2 matrices (rows 8..15 x k 0..7, rows 0..7 x k 8..15)
#define QT_B 8704    // [16][136] float: rows padded, halves at 0 and 68, so the A build's loads hit distinct banks

#include "ptx.cuh"

__device__ __forceinline__ float ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// half2 constants for the latent normalization u = v * 2^-e - 1024 * 2^-e (exact), e = bits * f in 0, 2, 4, 6:
// 2^-e: 1, 0.25, 0.0625, 0.015625 ; -1024 * 2^-e: -1024, -256, -64, -16 (fp16 bits)
__device__ __forceinline__ u32 inv2e(int e) {
    return e == 0 ? 0x3C003C00u : e == 2 ? 0x34003400u : e == 4 ? 0x2C002C00u : 0x24002400u;
}
__device__ __forceinline__ u32 neg1024e(int e) {
    return e == 0 ? 0xE400E400u : e == 2 ? 0xDC00DC00u : e == 4 ? 0xD400D400u : 0xCC00CC00u;
}


template <int KB, int LB, int NW>
struct Cfg {
    static constexpr int KC = 32 * KB * 64;     // key codes per block: 32 slots x 4 heads x 128 ch x KB bits
    static constexpr int KM = 2048;             // key scales/zeros
    static constexpr int LC = 32 * 256 * LB / 8;  // latent codes of 256 channels
    static constexpr int LM = 1024;             // latent scales/zeros of 256 channels
    static constexpr int PS = 128;              // the block's 32 slot positions (int32)
    static constexpr int STAGE = KC + KM + LC + LM + PS;
    static constexpr int WARP = 2 * STAGE + ATILE_B + AZERO_B;
    static constexpr int SMEM = NW * WARP + QT_B;
    static constexpr int NT = NW * 32;
    static constexpr int KW = KB * 4;           // key words per thread and slot
    static constexpr int CPW = 8 / KB;          // key chunks per word
    static constexpr int LW = LB * 8;           // latent words per lane and block (256 channels)
};

template <int KB, int LB, int NW>
__device__ __forceinline__ void attn_body(const unsigned short* __restrict__ q, const char* __restrict__ kc,
                                          const char* __restrict__ km, const char* __restrict__ lc,
                                          const char* __restrict__ lm, float* __restrict__ po,
                                          float* __restrict__ pm, float* __restrict__ pl, int G, int L, int S,
                                          int RW, float shift_inv, float qk_scale, const int* __restrict__ pos,
                                          const int* __restrict__ len, const long long* __restrict__ npos,
                                          int window, int sp, int g, int half, int b, int St, int soff, int GQA,
                                          int qs) {
    // this CTA: split sp of S over the level's used slots, latent group g, channel half `half`, batch row b, query
    // set qs; its partial is split soff + sp of St in po / pm / pl. Warps NW and up (when blockDim holds more) sit it
    // out. GQA query heads per KV head (any): its 16 rows are query heads 4 qs .. 4 qs + 3 of each of the group's
    // 4 KV heads (row j: KV head 4 g + j / 4; a row past GQA is empty: zero query, no output). With GQA 5-8 two CTAs
    // (qs 0, 1) read the same bytes; the second read mostly hits L2, as all CTAs of the launch share one wave and
    // advance at the same rate (docs/kernels.md).
    // L is the capacity (the arrays' stride); len[0] the used slots (whole blocks), read here, so a captured graph
    // follows the cache; pos [B, L] the slots' positions (-1: padding); a slot counts when pos >= 0 and, with a
    // window, npos[0] - pos < window.
    using C = Cfg<KB, LB, NW>;
    constexpr int HALVES = LB == 4 ? 2 : 1;  // CTAs per latent group (256 latent channels each)
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, NT = blockDim.x;
    const bool active = w < NW;
    u32 dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < C::SMEM) __trap();  // the launch gave less shared memory than this layout uses: stop, never corrupt
    const int H = G * 4 * GQA;
    // query head of row j (0..15) of this CTA, for the rows that hold one (qs * 4 + (j & 3) < GQA)
    auto qhead = [&](int j) { return (g * 4 + (j >> 2)) * GQA + qs * 4 + (j & 3); };
    auto real = [&](int j) { return qs * 4 + (j & 3) < GQA; };
    const u32 sbase = (u32)__cvta_generic_to_shared(smem);
    float* qt = (float*)smem;  // [16][136]: q * rowcomp * shift_inv (rowcomp 2^-KB for rows 8..15: the a3 half)
    const u32 wbase = sbase + QT_B + w * C::WARP;
    const u32 atile = wbase + 2 * C::STAGE;

    // blocks of this CTA and warp
    const int nblk = L >> 5, nused = min(nblk, (len[0] + 31) >> 5);
    const int next = (int)npos[0];
    const int* posb = pos + (size_t)b * L;
    const int per = (nused + S - 1) / S;
    const int c0 = min(nused, sp * per), c1 = min(nused, c0 + per);
    const int wper = (c1 - c0 + NW - 1) / NW;
    const int w0 = active ? min(c1, c0 + w * wper) : 0, w1 = active ? min(c1, w0 + wper) : 0;

    const size_t bg = (size_t)b * G + g;
    const char* kcg = kc + bg * (size_t)L * (C::KC / 32);
    const char* kmg = km + bg * (size_t)nblk * C::KM;
    const char* lcg = lc + (bg * HALVES + half) * (size_t)nblk * C::LC;
    const char* lmg = lm + (bg * HALVES + half) * (size_t)nblk * C::LM;

    auto issue = [&](int blk, u32 st) {
        const char* k0 = kcg + (size_t)blk * C::KC;
#pragma unroll
        for (int i = 0; i < C::KC / 512; i++) cp16(st + (i * 32 + lane) * 16, k0 + (i * 32 + lane) * 16);
        const char* k1 = kmg + (size_t)blk * C::KM;
#pragma unroll
        for (int i = 0; i < C::KM / 512; i++) cp16(st + C::KC + (i * 32 + lane) * 16, k1 + (i * 32 + lane) * 16);
        const char* l0 = lcg + (size_t)blk * C::LC;
#pragma unroll
        for (int i = 0; i < C::LC / 512; i++)
            cp16(st + C::KC + C::KM + (i * 32 + lane) * 16, l0 + (i * 32 + lane) * 16);
        const char* l1 = lmg + (size_t)blk * C::LM;
#pragma unroll
        for (int i = 0; i < C::LM / 512; i++)
            cp16(st + C::KC + C::KM + C::LC + (i * 32 + lane) * 16, l1 + (i * 32 + lane) * 16);
        if (lane < 8) cp16(st + C::KC + C::KM + C::LC + C::LM + lane * 16, posb + blk * 32 + lane * 4);
        cp_commit();
    };

    // the first block's bytes are requested before the query table is loaded (the two latencies overlap)
    if (w0 < w1) issue(w0, wbase);
    // launched as a programmatic dependent of the kernel before it (mma_attention.PDL_MAIN), this CTA may start while
    // that kernel ends: the cache's bytes, lengths and positions are not written by it (flushes run between steps),
    // so the first block is requested above; the query is, so it is read only after the wait (a no-op otherwise)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    constexpr float ROWCOMP = KB == 2 ? 0.25f : 0.0625f;  // rows 8..15 multiply the b1 operands: one field higher
    for (int i = tid; i < 16 * 128; i += NT) {
        int j = i >> 7, ch = i & 127;
        u32 bits = real(j) ? (u32)q[((size_t)b * H + qhead(j)) * 128 + ch] << 16 : 0u;
        qt[j * 136 + (ch >> 6) * 68 + (ch & 63)] = __int_as_float(bits) * (j >= 8 ? ROWCOMP : 1.0f) * shift_inv;
    }
    // the block-diagonal A tile: zeros outside each row's own head, written once
    if (active) {
#pragma unroll
        for (int i = 0; i < ATILE_B / 16 / 32; i++) sts128(atile + (i * 32 + lane) * 16, 0, 0, 0, 0);
        if (lane < AZERO_B / 16) sts128(atile + ATILE_B + lane * 16, 0, 0, 0, 0);
    }
    __syncthreads();

    const int gq = lane >> 2, t = lane & 3;  // fragment row group and column pair
    float O[32][4];
#pragma unroll
    for (int i = 0; i < 32; i++) O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.f;
    float m1 = -INFINITY, m2 = -INFINITY, l1 = 0.f, l2 = 0.f;

    // the A-tile builder's lane: row jr (query head), half hf of its head's channels
    const int jr = lane >> 1, hf = lane & 1, hh = jr >> 2;
    // chunks 16..31 (hf = 1) store their 8x8 rows in the order r ^ 4, so the two halves' stores hit distinct banks
    const u32 abuild = atile + (hh >> 1) * 128 + ((jr & 7) ^ (hf * 4)) * 16 + (hh & 1) * 8 + hf * 16 * 256;
    const float* qrow = qt + jr * 136 + hf * 68;
    const int ksw = 2 * hh + hf;  // key-meta quads are stored at c ^ ksw (the packer's swizzle): distinct banks
    const float rowun = jr >= 8 ? 1.f / ROWCOMP : 1.f;
    // ldmatrix.x4 row address of this lane: lanes 0-7 a0 (chunk's first 128 B), 8-15 and 16-23 the zero rows
    // (a1, a2), 24-31 a3 (the chunk's second 128 B); the zero rows sit at a fixed address, so `chunk * 256` is
    // added only for the a0 / a3 lanes
    const int quad = lane >> 3;
    const bool zrow = quad == 1 || quad == 2;
    const u32 aread = zrow ? atile + ATILE_B + (lane & 7) * 16 : atile + (quad == 3 ? 128 : 0) + (lane & 7) * 16;
    const u32 aread_hi = zrow ? aread : atile + (quad == 3 ? 128 : 0) + ((lane & 7) ^ 4) * 16;
    const u32 astep = zrow ? 0u : 256u;
    // key-word quads: 2-bit slots hold 2 per thread (odd slots swapped), 4-bit slots 4 (swizzled by slot and t)
    const int kqsw = KB == 2 ? (gq & 1) : 2 * (gq & 1) + (t >> 1);

    // constants kept in registers, so (x & mask) | magic is one lop3
    constexpr u32 FMASK = KB == 2 ? 0x00030003u : 0x000F000Fu;
    u32 magic = 0x64006400u, lmask[4];
#pragma unroll
    for (int f = 0; f < 4; f++) lmask[f] = (LB == 2 ? 0x00030003u : 0x000F000Fu) << (LB * f);
    asm volatile("" : "+r"(magic));
#pragma unroll
    for (int f = 0; f < 4; f++) asm volatile("" : "+r"(lmask[f]));

    for (int blk = w0; blk < w1; blk++) {
        const int stg = (blk - w0) & 1;
        const u32 st = wbase + stg * C::STAGE;
        if (blk + 1 < w1) {
            issue(blk + 1, wbase + (stg ^ 1) * C::STAGE);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncwarp();

        // 1. A = q * s * 2^-(KB f) for this block's key scales; bias = sum q z
        float bacc = 0.f;
        {
            const u32 kmq = st + C::KC + (hh * 32 + hf * 16) * 16;  // + (p ^ ksw) * 16
            float bp[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int pb = 0; pb < 16; pb += ABATCH) {
                float4 qv[ABATCH];
                uint4 m[ABATCH];
#pragma unroll
                for (int i = 0; i < ABATCH; i++) {
                    qv[i] = *(const float4*)(qrow + 4 * (pb + i));
                    m[i] = lds128(kmq + ((pb + i) ^ ksw) * 16);
                }
#pragma unroll
                for (int i = 0; i < ABATCH; i++) {
                    const int p = pb + i;
                    float2 s01 = h2f(m[i].x), s23 = h2f(m[i].y), z01 = h2f(m[i].z), z23 = h2f(m[i].w);
                    // 2-bit: odd chunks' codes sit two fields higher in their word
                    const float cm = (KB == 2 && (p & 1)) ? 0.0625f : 1.0f;
                    u32 a01 = f2h(qv[i].x * s01.x * cm, qv[i].y * s01.y * cm);
                    u32 a23 = f2h(qv[i].z * s23.x * cm, qv[i].w * s23.y * cm);
                    sts64(abuild + p * 256, a01, a23);
                    bp[i & 3] += qv[i].x * z01.x + qv[i].y * z01.y + qv[i].z * z23.x + qv[i].w * z23.y;
                }
            }
            bacc = (bp[0] + bp[1]) + (bp[2] + bp[3]);
        }
        bacc += __shfl_xor_sync(0xffffffffu, bacc, 1);
        bacc *= rowun * qk_scale;
        const float b1 = __shfl_sync(0xffffffffu, bacc, 2 * gq), b2 = __shfl_sync(0xffffffffu, bacc, 2 * gq + 16);
        __syncwarp();

        // 2. scores: S[nt] = A (16 x 512, block-diagonal) x codes (512 x 8 slots), 4 n-tiles of 8 slots
        float Sc[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++) Sc[i][0] = Sc[i][1] = Sc[i][2] = Sc[i][3] = 0.f;
#if !SUBN
        float off[4] = {0.f, 0.f, 0.f, 0.f};
#endif
#pragma unroll
        for (int u = 0; u < C::KW / 4; u++) {  // 16-byte quads of this thread's key words
            uint4 W[4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
                W[nt] = lds128(st + (8 * nt + gq) * (C::KC / 32) + t * (C::KW * 4) + ((u ^ kqsw) & (C::KW / 4 - 1)) * 16);
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * u + jj;
#pragma unroll
                for (int ci = 0; ci < C::CPW; ci++) {
                    const int c = C::CPW * j + ci;
                    u32 a[4];
                    ldsm4(a, (c >= 16 ? aread_hi : aread) + c * astep);
                    // 2-bit: chunks 0,1 in the low byte (fields 0..3), 2,3 in the high byte; 4-bit: chunk 0 low, 1 high
                    const int sh = KB == 2 ? 4 * (ci & 1) : 0;
                    const u32 mlo = FMASK << sh, mhi = FMASK << (sh + KB);
                    const bool hi8 = KB == 2 ? ci >= 2 : ci == 1;
#pragma unroll
                    for (int nt = 0; nt < 4; nt++) {
                        u32 x = jj == 0 ? W[nt].x : jj == 1 ? W[nt].y : jj == 2 ? W[nt].z : W[nt].w;
                        if (hi8) x >>= 8;
#if SUBN
                        mma(Sc[nt], a[0], a[1], a[2], a[3], x & mlo, x & mhi);
#else
                        mma(Sc[nt], a[0], a[1], a[2], a[3], lop3_andor(x, mlo, magic), lop3_andor(x, mhi, magic));
#endif
                    }
#if !SUBN
                    mma(off, a[0], a[1], a[2], a[3], magic, magic);
#endif
                }
            }
        }

        // 3. online softmax (base 2), rows gq and gq + 8
#if SUBN
        const float ks = 16777216.f * qk_scale;
        const float o1 = 0.f, o2 = 0.f;
#else
        const float ks = qk_scale;
        const float o1 = off[0] * qk_scale, o2 = off[2] * qk_scale;
#endif
        float mx1 = -INFINITY, mx2 = -INFINITY;
        const u32 pss = st + C::KC + C::KM + C::LC + C::LM;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            // this thread's two slots of the n-tile: masked by position (padding) and window
            const uint2 pp = lds64(pss + (8 * nt + 2 * t) * 4);
            const int q0 = (int)pp.x, q1 = (int)pp.y;
            const bool v0 = q0 >= 0 && (window <= 0 || next - q0 < window);
            const bool v1 = q1 >= 0 && (window <= 0 || next - q1 < window);
            Sc[nt][0] = v0 ? Sc[nt][0] * ks - o1 + b1 : -INFINITY;
            Sc[nt][1] = v1 ? Sc[nt][1] * ks - o1 + b1 : -INFINITY;
            Sc[nt][2] = v0 ? Sc[nt][2] * ks - o2 + b2 : -INFINITY;
            Sc[nt][3] = v1 ? Sc[nt][3] * ks - o2 + b2 : -INFINITY;
            mx1 = fmaxf(mx1, fmaxf(Sc[nt][0], Sc[nt][1]));
            mx2 = fmaxf(mx2, fmaxf(Sc[nt][2], Sc[nt][3]));
        }
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        mx2 = fmaxf(mx2, __shfl_xor_sync(0xffffffffu, mx2, 1));
        mx2 = fmaxf(mx2, __shfl_xor_sync(0xffffffffu, mx2, 2));
        if (__any_sync(0xffffffffu, mx1 > m1 || mx2 > m2)) {
            const float n1 = fmaxf(m1, mx1), n2 = fmaxf(m2, mx2);
            const float al1 = ex2(m1 - n1), al2 = ex2(m2 - n2);
            l1 *= al1;
            l2 *= al2;
#pragma unroll
            for (int i = 0; i < 32; i++) {
                O[i][0] *= al1;
                O[i][1] *= al1;
                O[i][2] *= al2;
                O[i][3] *= al2;
            }
            m1 = n1;
            m2 = n2;
        }
        u32 pa[2][4];
        // a row with no valid slot yet keeps m = -inf: exponentiate against 0 there (its scores are -inf: p = 0)
        const float e1 = m1 == -INFINITY ? 0.f : m1, e2 = m2 == -INFINITY ? 0.f : m2;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const float p0 = ex2(Sc[nt][0] - e1), p1 = ex2(Sc[nt][1] - e1);
            const float p2 = ex2(Sc[nt][2] - e2), p3 = ex2(Sc[nt][3] - e2);
            l1 += p0 + p1;
            l2 += p2 + p3;
            pa[nt >> 1][(nt & 1) * 2 + 0] = f2h(p0, p1);
            pa[nt >> 1][(nt & 1) * 2 + 1] = f2h(p2, p3);
        }

        // 4. latents: O[nt] += P (16 x 32 slots) x latents (32 slots x 8 channels), 32 n-tiles of this CTA's 256
        const u32 lcs = st + C::KC + C::KM, lms = st + C::KC + C::KM + C::LC;
#pragma unroll
        for (int qd = 0; qd < C::LW / 4; qd++) {
            const uint4 LWq = lds128(lcs + (qd * 32 + lane) * 16);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int wd = 4 * qd + e;
                const int cg = LB == 2 ? wd >> 1 : wd >> 2;  // value group: 4 n-tiles
                const uint4 M0 = lds128(lms + ((cg * 2 + 0) * 4 + t) * 16);
                const uint4 M1 = lds128(lms + ((cg * 2 + 1) * 4 + t) * 16);
                const u32 x0 = e == 0 ? LWq.x : e == 1 ? LWq.y : e == 2 ? LWq.z : LWq.w;
#pragma unroll
                for (int nto = 0; nto < 4 / LB; nto++) {  // 2-bit: two n-tiles per word (low / high byte)
#pragma unroll
                    for (int kc = 0; kc < 2; kc++) {
                        const uint4 M = kc ? M1 : M0;
                        // 2-bit: fields f = 2 kc + r of byte nto; 4-bit: fields f = r of byte kc
                        const u32 x = LB == 2 ? (nto ? (x0 >> 8) : x0) : (kc ? (x0 >> 8) : x0);
                        const int f0 = LB == 2 ? 2 * kc : 0, f1 = f0 + 1;
                        u32 v0 = lop3_andor(x, lmask[f0], magic);
                        u32 v1 = lop3_andor(x, lmask[f1], magic);
                        v0 = hfma2(hfma2(v0, inv2e(LB * f0), neg1024e(LB * f0)), M.x, M.z);
                        v1 = hfma2(hfma2(v1, inv2e(LB * f1), neg1024e(LB * f1)), M.y, M.w);
                        const int nt = LB == 2 ? 2 * wd + nto : wd;
                        mma(O[nt], pa[kc][0], pa[kc][1], pa[kc][2], pa[kc][3], v0, v1);
                    }
                }
            }
        }
        __syncwarp();
    }

    // the merge launch (programmatic dependent launch) may start now: it scores the tail, then waits for this grid
    asm volatile("griddepcontrol.launch_dependents;");
    // 5. merge the warps' partials through shared memory (the stage buffers are free now)
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    l2 += __shfl_xor_sync(0xffffffffu, l2, 1);
    l2 += __shfl_xor_sync(0xffffffffu, l2, 2);
    __syncthreads();
    float* wO = (float*)(smem + QT_B + w * C::WARP);  // [16][256]
    float* wm = wO + 16 * 256;                         // [16] max, [16] sum
    if (active) {
#pragma unroll
        for (int nt = 0; nt < 32; nt++) {
            *(float2*)(wO + gq * 256 + 8 * nt + 2 * t) = make_float2(O[nt][0], O[nt][1]);
            *(float2*)(wO + (gq + 8) * 256 + 8 * nt + 2 * t) = make_float2(O[nt][2], O[nt][3]);
        }
    }
    if (active && t == 0) {
        wm[gq] = m1;
        wm[gq + 8] = m2;
        wm[16 + gq] = l1;
        wm[16 + gq + 8] = l2;
    }
    __syncthreads();
    // thread -> (row, 4 channels), looping over the 16 x 64 quads
    for (int o = tid; o < 16 * 64; o += NT) {
        const int row = o >> 6, chb = (o & 63) * 4;
        if (!real(row)) continue;  // an empty row: its index would be another KV head's query head
        float M = -INFINITY;
#pragma unroll
        for (int v = 0; v < NW; v++) M = fmaxf(M, ((const float*)(smem + QT_B + v * C::WARP))[16 * 256 + row]);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float Ls = 0.f;
#pragma unroll
        for (int v = 0; v < NW; v++) {
            const float* vO = (const float*)(smem + QT_B + v * C::WARP);
            const float a = M == -INFINITY ? 0.f : ex2(vO[16 * 256 + row] - M);
            Ls += a * vO[16 * 256 + 16 + row];
            const float4 x = *(const float4*)(vO + row * 256 + chb);
            acc.x += a * x.x;
            acc.y += a * x.y;
            acc.z += a * x.z;
            acc.w += a * x.w;
        }
        const size_t hrow = ((size_t)b * H + qhead(row)) * St + soff + sp;
        *(float4*)(po + hrow * RW + half * 256 + chb) = acc;
        if ((o & 63) == 0) {
            pm[hrow] = M;
            pl[hrow] = Ls;
        }
    }
}

#define ATTN_ARGS                                                                                                   \
    const unsigned short *__restrict__ q, const char *__restrict__ kc, const char *__restrict__ km,                 \
        const char *__restrict__ lc, const char *__restrict__ lm, float *__restrict__ po, float *__restrict__ pm,   \
        float *__restrict__ pl, int G, int L, int S, int RW, float shift_inv, float qk_scale,                     \
        const int *__restrict__ pos, const int *__restrict__ len, const long long *__restrict__ npos, int window
#define ATTN_PASS q, kc, km, lc, lm, po, pm, pl, G, L, S, RW, shift_inv, qk_scale, pos, len, npos, window

// the 2-bit middle level alone: 8 warps (216 KB of shared memory); grid (S, G, B)
extern "C" __global__ void __launch_bounds__(256, 1) tale_attn_k2l2(ATTN_ARGS) {
    attn_body<2, 2, 8>(ATTN_PASS, blockIdx.x, blockIdx.y, 0, blockIdx.z, S, 0, 4, 0);
}
// the 4-bit recent level alone: 5 warps (its blocks are 15 KB; 199 KB of shared memory); grid (S, 2 G, B)
extern "C" __global__ void __launch_bounds__(160, 1) tale_attn_k4l4(ATTN_ARGS) {
    attn_body<4, 4, 5>(ATTN_PASS, blockIdx.x, blockIdx.y >> 1, blockIdx.y & 1, blockIdx.z, S, 0, 4, 0);
}
// both levels of the paper preset in one launch of 8-warp CTAs (the 4-bit CTAs use 5 of them): CTAs 0 .. S2 G B - 1
// take the 2-bit level (partials 0 .. S2 - 1, channels 0..255), the next S4 2 G B the 4-bit level (partials S2 ..);
// each of them ceil(GQA / 4) times (adjacent CTAs: one per query set, the same bytes)
extern "C" __global__ void __launch_bounds__(256, 1)
    tale_attn_paper(const unsigned short* __restrict__ q, const char* __restrict__ kc2, const char* __restrict__ km2,
                    const char* __restrict__ lc2, const char* __restrict__ lm2, const char* __restrict__ kc4,
                    const char* __restrict__ km4, const char* __restrict__ lc4, const char* __restrict__ lm4,
                    float* __restrict__ po, float* __restrict__ pm, float* __restrict__ pl, int G, int L2, int S2,
                    int L4, int S4, float shift_inv, float qk_scale, const int* __restrict__ pos2,
                    const int* __restrict__ len2, const int* __restrict__ pos4, const int* __restrict__ len4,
                    const long long* __restrict__ npos, int window, int GQA) {
    const int QS = (GQA + 3) >> 2, B = gridDim.x / (QS * (S2 * G + S4 * 2 * G));
    const int qs = blockIdx.x % QS;
    int bid = blockIdx.x / QS;
    if (bid < S2 * G * B) {
        attn_body<2, 2, 8>(q, kc2, km2, lc2, lm2, po, pm, pl, G, L2, S2, 512, shift_inv, qk_scale, pos2, len2, npos,
                           window, bid % S2,
                           (bid / S2) % G, 0, bid / (S2 * G), S2 + S4, 0, GQA, qs);
    } else {
        bid -= S2 * G * B;
        const int gh = (bid / S4) % (2 * G);
        attn_body<4, 4, 5>(q, kc4, km4, lc4, lm4, po, pm, pl, G, L4, S4, 512, shift_inv, qk_scale, pos4, len4, npos,
                           window, bid % S4, gh >> 1,
                           gh & 1, bid / (S4 * 2 * G), S2 + S4, S2, GQA, qs);
    }
}

// one step of a running log-sum-exp merge: (M, acc, Ls) absorbs a part with max ms, output os and sum ls
__device__ __forceinline__ void lse_step(float& M, float& acc, float& Ls, float ms, float os, float ls) {
    const float n = fmaxf(M, ms);
    const float a = n == -INFINITY ? 0.f : ex2(M - n), b = n == -INFINITY ? 0.f : ex2(ms - n);
    acc = acc * a + os * b;
    Ls = Ls * a + ls * b;
    M = n;
}

// the 4 threads of channel c merged through shared memory: sum_i 2^(m_i - M) o_i / sum_i 2^(m_i - M) l_i
__device__ __forceinline__ float lse_merge4(const float (*sm_m)[64], const float (*sm_l)[64],
                                            const float (*sm_o)[64], int c) {
    const float Mx = fmaxf(fmaxf(sm_m[0][c], sm_m[1][c]), fmaxf(sm_m[2][c], sm_m[3][c]));
    float A = 0.f, Lt = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float a = Mx == -INFINITY ? 0.f : ex2(sm_m[i][c] - Mx);
        A += a * sm_o[i][c];
        Lt += a * sm_l[i][c];
    }
    return Lt > 0.f ? A / Lt : 0.f;
}

// merge the S partials of each (batch, head): z = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s, times shift_inv.
// grid (B * H, RW / 64): 64 channels per CTA; thread (channel, k) merges splits k, k + 4, ... on its own (their
// max, sum and output loaded together: one round trip to L2), then the 4 threads of a channel merge through
// shared memory
extern "C" __global__ void __launch_bounds__(256)
    tale_combine(const float* __restrict__ po, const float* __restrict__ pm, const float* __restrict__ pl,
                 float* __restrict__ z, int S, int RW, float shift_inv) {
    __shared__ float sm_m[4][64], sm_l[4][64], sm_o[4][64];
    const int r = blockIdx.x, tid = threadIdx.x, c = tid & 63, k = tid >> 6;
    const int ch = blockIdx.y * 64 + c;
    const float* m = pm + (size_t)r * S;
    const float* l = pl + (size_t)r * S;
    const float* o = po + (size_t)r * S * RW + ch;
    float M = -INFINITY, acc = 0.f, Ls = 0.f;
#pragma unroll 4
    for (int s = k; s < S; s += 4) lse_step(M, acc, Ls, m[s], o[(size_t)s * RW], l[s]);
    sm_m[k][c] = M;
    sm_l[k][c] = Ls;
    sm_o[k][c] = acc;
    __syncthreads();
    if (k == 0) z[(size_t)r * RW + ch] = lse_merge4(sm_m, sm_l, sm_o, c) * shift_inv;
}

// the paper preset's merge: the St partials of each (batch, head) (the first S2 of them hold channels 0..255 only,
// the 2-bit level's rank) and the 16-bit tail, whose scores this kernel computes itself: each tail slot is one more
// "split" with sum 1. The tail is three segments of bf16 keys [B, K, cap, 128] and latents [B, G, cap, 512]: the
// sinks (cap S, positions spos [B, S]), the residual (cap Rc, positions rpos [B, Rc]) and the new token (cap 1, at
// position npos[0]); a position < 0 (padding, an empty slot) or outside the window masks a slot; GQA query heads
// per KV head. grid (B * H, 8),
// 256 threads: 64 channels per CTA; the tail in chunks of 256 slots.
#define TAIL_CHUNK 256
extern "C" __global__ void __launch_bounds__(256)
    tale_combine_paper(const float* __restrict__ po, const float* __restrict__ pm, const float* __restrict__ pl,
                       const unsigned short* __restrict__ q, const unsigned short* __restrict__ sk,
                       const unsigned short* __restrict__ sh, const int* __restrict__ spos, int S,
                       const unsigned short* __restrict__ rk, const unsigned short* __restrict__ rh,
                       const int* __restrict__ rpos, int Rc, const unsigned short* __restrict__ nk,
                       const unsigned short* __restrict__ nh, float* __restrict__ z, int St, int S2, int G,
                       float shift_inv, float qk_scale, const long long* __restrict__ npos, int window,
                       int GQA) {
    __shared__ float sm_m[4][64], sm_l[4][64], sm_o[4][64], st_s[TAIL_CHUNK];
    const int r = blockIdx.x, tid = threadIdx.x, c = tid & 63, k = tid >> 6, lane = tid & 31, w = tid >> 5;
    const int H = G * 4 * GQA, b = r / H, h = r % H, kv = h / GQA, gr = kv / 4;
    const int ch = blockIdx.y * 64 + c, T = S + Rc + 1, next = (int)npos[0];
    // tail slot s -> its segment's row base (slot index within the segment's capacity) and position
    auto slot = [&](int s, const unsigned short*& kp, const unsigned short*& hp, int& cap, int& ss, int& ps) {
        if (s < S) {
            kp = sk, hp = sh, cap = S, ss = s, ps = spos[b * S + s];
        } else if (s < S + Rc) {
            kp = rk, hp = rh, cap = Rc, ss = s - S, ps = rpos[b * Rc + s - S];
        } else {
            kp = nk, hp = nh, cap = 1, ss = 0, ps = next;
        }
    };
    const unsigned short* qh = q + (size_t)r * 128;
    float qv[4];
#pragma unroll
    for (int i = 0; i < 4; i++) qv[i] = __int_as_float((u32)qh[lane * 4 + i] << 16);
    float M = -INFINITY, acc = 0.f, Ls = 0.f;
    for (int base = 0; base < T; base += TAIL_CHUNK) {
        const int n = min(TAIL_CHUNK, T - base);
        // tail scores: warp w takes slots w, w + 8, ...; lanes split the 128 dims
        for (int s = w; s < n; s += 8) {
            const unsigned short *kp, *hp;
            int cap, ss, ps;
            slot(base + s, kp, hp, cap, ss, ps);
            const unsigned short* kk = kp + (((size_t)b * (G * 4) + kv) * cap + ss) * 128 + lane * 4;
            float d = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++) d += qv[i] * __int_as_float((u32)kk[i] << 16);
#pragma unroll
            for (int o = 16; o; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            const bool valid = ps >= 0 && (window <= 0 || next - ps < window);
            if (lane == 0) st_s[s] = valid ? d * qk_scale : -INFINITY;
        }
        __syncthreads();
        if (base == 0) {
            asm volatile("griddepcontrol.wait;" ::: "memory");  // the levels' partials are written (no-op without PDL)
            const float* m = pm + (size_t)r * St;
            const float* l = pl + (size_t)r * St;
            const float* o = po + (size_t)r * St * 512 + ch;
#pragma unroll 4
            for (int s = k; s < St; s += 4)
                lse_step(M, acc, Ls, m[s], (s < S2 && ch >= 256) ? 0.f : o[(size_t)s * 512] * shift_inv, l[s]);
        }
        for (int s = k; s < n; s += 4) {  // tail slots: one more part each, with sum 1
            if (st_s[s] == -INFINITY) continue;  // masked: whatever the slot holds stays out
            const unsigned short *kp, *hp;
            int cap, ss, ps;
            slot(base + s, kp, hp, cap, ss, ps);
            const float os = __int_as_float((u32)hp[(((size_t)b * G + gr) * cap + ss) * 512 + ch] << 16);
            lse_step(M, acc, Ls, st_s[s], os, 1.f);
        }
        __syncthreads();  // st_s is rewritten by the next chunk
    }
    sm_m[k][c] = M;
    sm_l[k][c] = Ls;
    sm_o[k][c] = acc;
    __syncthreads();
    if (k == 0) z[(size_t)r * 512 + ch] = lse_merge4(sm_m, sm_l, sm_o, c);
}
