// Scores of a low-rank-key region for one decoded token, on tensor cores: for every slot t below the region's length
// and every query head h of the CTA's KV heads,
//     s[b, h, t] = (q_h * qk) . RoPE_t(mean + c_t dec[:r])          (float32; qk = scaling * log2 e)
// where c_t are the slot's key coefficients (runtime/key_basis.py), dequantized from their codes. The latent launch
// of kernels/lowrank_attention.py (its second pass) runs the softmax and the latents over these scores and masks
// the slots (positions, windows) itself, so this kernel writes every slot below the length unmasked.
// tale_kernels.lowrank_attention compiles it (kernels/cuda_module.py: NVRTC or nvcc) per configuration (-D below).
//
// A CTA owns HPC KV heads of one basis block (2 HPC warps) and a run of 64-slot tiles; per tile:
//   1. cp.async brings the tile's packed codes, the scales/zeros of its token groups and its positions into a stage
//      (issued one tile ahead, while the previous tile's products run);
//   2. all threads: scales/zeros to fp16; cos/sin of every (slot, frequency) from the positions and the model's
//      inv_freq (the SFU's cos/sin after a float32 reduction to [-pi, pi], rounded to the model dtype as its
//      tables); then codes -> fp16 coefficients [BT, KCP] (1024 + code under an fp16 exponent, one sub and one fma
//      per pair);
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
// bits times 1 / shift), REP query heads per KV head (<= 8), HPC KV heads per CTA (kernels/lowrank_score.py
// Tiling), Q_BF16 (query dtype), RDT_BF16 (cos/sin rounded to bf16, else fp16), RSC
// (cos/sin times the rotary's attention scaling), ROPE_TAB (1: cos/sin read from the region's float32 tables
// [B, cap, 128], the lo half of each: a cache that stores them), SMEM_LAUNCH (the bytes the launch gives). Head dim
// 128.

#define BT 64                         // slots per tile
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
#define NGT (KTG < BT ? BT / KTG : 1) // scale groups per tile
#define MB (META8 ? 1 : 2)            // bytes per scale or zero
#define SZW (KC * MB / 4)             // words of one group's scales (or zeros)
#define RW ((REP + 1) / 2)            // lanes per row of the score mma's C fragment that hold a query head

// shared memory, bytes
#define AB (BT * ASTR * 2)                             // the coefficient tile
#define CSB (BT * CSTR * 4)                            // [BT slots][CSTR] {cos, sin} fp16, of the model dtype's
#define REDB (HPC * MT * 8 * RW * 16)                  // float4 [HPC][MT][8][RW]: the second warps' halves of the dot
#define COLB (FOLD_MEAN ? 0 : 2 * HPC * NHALF * 4)     // float [2][HPC][64]: the column means, lo and hi
#define OFF_B 0
#define OFF_A (OFF_B + KCP * BSTR * 2)
#define OFF_CS (OFF_A + AB)
#define OFF_RED (OFF_CS + CSB)
#define OFF_STC (OFF_RED + REDB)                       // stage: codes [BT][PNB]
#define OFF_STS (OFF_STC + BT * PNB)                   // stage: scales [NGT][KC], then zeros [NGT][KC]
#define OFF_STP (OFF_STS + 2 * NGT * KC * MB)          // stage: positions [BT]
#define OFF_SZ (OFF_STP + BT * 4)                      // fp16 scales [NGT][KCP], then zeros [NGT][KCP]
#define OFF_COL (OFF_SZ + 2 * NGT * KCP * 2)
#define SMEM (OFF_COL + COLB)
#ifdef SMEM_LAUNCH  // the launch's bytes (kernels/lowrank_score.py smem_bytes): a layout edit must move both
static_assert(SMEM == SMEM_LAUNCH, "the launch's shared memory differs from the kernel's layout");
#endif

#include "lowrank_common.cuh"
extern "C" __global__ void __launch_bounds__(NTHR, 1) tale_lr_score(LR_SCORE_ARGS) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sp = blockIdx.x, cta = blockIdx.y, b = blockIdx.z;
    const int kv0 = cta * HPC;                 // the CTA's first KV head
    const int blk = kv0 / hpb, cb = (kv0 % hpb) * NHALF;  // its basis block and first column in it
    const TileRun run = tile_run(len_p, len_v, cap, sp, nsplit);
    const int L = run.L, tile0 = run.tile0, tile1 = run.tile1;
    if (tile0 >= tile1) return;
    const float kinv = inv_v > 0.f ? inv_v : 1.0f / *bias_p;

    const u32 sB = smem_u32(smem + OFF_B), sA = smem_u32(smem + OFF_A);
    u32* cs = (u32*)(smem + OFF_CS);
    unsigned char* stc = smem + OFF_STC;
    unsigned char* sts = smem + OFF_STS;
    const int* stp = (const int*)(smem + OFF_STP);
    u16* sz = (u16*)(smem + OFF_SZ);
#if !FOLD_MEAN
    float* col = (float*)(smem + OFF_COL);
#endif
    float4* red = (float4*)(smem + OFF_RED);

    const CodeRows cr = code_rows(codes, ksc, kzr, s_kb, s_kh, s_kt, s_sb, s_sh, s_st, cap, b, blk);
    // stage the tile at slot t0: codes, scales, zeros and positions
    auto stage = [&](int t0) {
        stage_codes<NTHR>(stc, sts, cr, t0, L, tid);
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
    // the coefficient tile's padding columns (1.0 at KC: the mean's row), for good
    for (int i = tid; i < BT * (KCP - KC); i += NTHR) {
        const int c = KC + i % (KCP - KC);
        ((u16*)(smem + OFF_A))[(i / (KCP - KC)) * ASTR + c] = FOLD_MEAN && c == KC ? 0x3C00 : 0;
    }
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
#pragma unroll
    for (int s = 0; s < 4; s++)
        q_frag(qb[s], q, (long)b * s_qb + (long)(kv0 + j) * REP * s_qh, s_qh, (s >> 1) * 64 + fh * 32 + (s & 1) * 16,
               qk, lane);
#if !ROPE_TAB
    const float my_invf = invf[tid & 63];
    const int my_roff = roff[b];
#endif

    // cos/sin of every (slot, frequency) of the tile at t0 into cs: the frequency is fixed per thread (NTHR is a
    // multiple of 64)
    auto rope_table = [&](int t0) {
        for (int t = tid >> 6; t < BT; t += TSTEP) {
#if ROPE_TAB  // the region's tables (the model's own cos/sin, already rounded and scaled)
            if (t0 + t < L) {
                const long ci = (long)b * s_cb + (long)(t0 + t) * s_ct + (tid & 63);
                cs[t * CSTR + (tid & 63)] = pair_rdt(cos_t[ci], sin_t[ci]);
            }
#else
            float c, s;
            sincos_red((float)(stp[t] - my_roff) * my_invf, &c, &s);
#if RSC
            c *= rsc, s *= rsc;
#endif
            cs[t * CSTR + (tid & 63)] = pair_rdt(c, s);
#endif
        }
    };

    for (int tile = tile0; tile < tile1; tile++) {
        const int t0 = tile * BT;
        cp_wait_all();
        __syncthreads();  // the stage (and, first time, the basis) landed; the last tile's readers are done
        scales_fp16<NTHR>(sts, sz, kinv, tid);
        rope_table(t0);
        __syncthreads();
        // codes -> coefficients: word w of row t holds, per plane p, codes p PNB + 4 w .. + 3
        for (int i = tid; i < BT * PNW; i += NTHR) {
            const int t = i / PNW, w = i % PNW;
            const u16 *srow, *zrow;
            const u32 word = code_word(stc, sz, t, w, &srow, &zrow);
#pragma unroll
            for (int p = 0; p < NPL; p++)
                *(uint2*)(smem + OFF_A + (t * ASTR + p * PNB + 4 * w) * 2) = dequant4(word, p, srow, zrow, p * PNB + 4 * w);
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
