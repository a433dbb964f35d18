// The score pass of a low-rank-key region (kernels/cuda/lowrank_score.cu's contract: the same arguments, the same
// scores) with the rebuild on Hopper's warpgroup tensor cores (sm_90a):
//     s[b, h, t] = (q_h * qk) . RoPE_t(mean + c_t dec[:r])
// A CTA is one warpgroup owning 2 KV heads of one basis block (256 basis columns) and a run of 64-slot tiles; at
// 108 KB of shared memory two CTAs share an SM, so one's unpacking runs while the other's GEMM holds the tensor
// cores. Per tile:
//   1. cp.async brings the tile's packed codes and its groups' scales and zeros into a stage (issued one tile ahead);
//   2. scales/zeros to fp16, then codes -> fp16 coefficients [64, KCP] in wgmma's K-major layout (column KC holds 1:
//      the means' row of the basis);
//   3. the rebuild as wgmma m64n256k16 over KCP / 16 steps against the basis, held in shared memory for the CTA's
//      life with its column scales folded in and the column means as row KC; while it runs, the cos/sin of the
//      thread's 2 slots x 16 frequencies from the positions (SFU after a float32 reduction to [-pi, pi], rounded to
//      the model dtype as its tables);
//   4. the keys packed to fp16 pairs, RoPE in half2, and the dot with the query heads as mma.sync m16n8k16 (a warp's
//      wgmma accumulator layout is mma's A layout), written as float32 scores.
// Fixed per build as lowrank_score.cu (KC, KBITS, KTG, META8, REP, Q_BF16, RDT_BF16, RSC, ROPE_TAB, SMEM_LAUNCH).
// The descriptors are experiments/wgmma_probe.py's convention: K-major without swizzle, LBO between core matrices
// along K, SBO between 8-row groups.

#define BT 64                             // slots per tile
#define NHALF 64                          // channels per RoPE half (head dim 128)
#define KCP ((KC + 16) / 16 * 16)         // coefficients and the means' constant one, padded to wgmma's k
#define PNB (KC * KBITS / 8)              // bytes per packed row
#define PNW (PNB / 4)                     // words per packed row
#define NPL (8 / KBITS)                   // code planes per byte
#define NCOL 256                          // basis columns per CTA: head j's lo half at 128 j, hi half at 128 j + 64
#define NGT (KTG < BT ? BT / KTG : 1)     // scale groups per tile
#define MB (META8 ? 1 : 2)                // bytes per scale or zero
#define SZW (KC * MB / 4)                 // words of one group's scales (or zeros)

// byte offset of (row r, coefficient k) in a K-major operand without swizzle: core matrices of 8 rows x 16 bytes,
// those of a row group adjacent along K (128 bytes apart), row groups KCP * 16 bytes apart
#define KOFF(r, k) ((((r) >> 3) * KCP + ((k) >> 3) * 8 + ((r) & 7)) * 16 + ((k) & 7) * 2)
#define LBO 128
#define SBO (KCP * 16)

// shared memory, bytes
#define OFF_B 0                                       // basis [NCOL rows][KCP], K-major
#define OFF_A (OFF_B + NCOL * KCP * 2)                // coefficients [64 rows][KCP], K-major
#define OFF_STC (OFF_A + BT * KCP * 2)                // stage: codes [64][PNB]
#define OFF_STS (OFF_STC + BT * PNB)                  // stage: scales [NGT][KC], then zeros [NGT][KC]
#define OFF_SZ (OFF_STS + 2 * NGT * KC * MB)          // fp16 scales [NGT][KCP], then zeros [NGT][KCP]
#define OFF_SINK (OFF_SZ + 2 * NGT * KCP * 2)    // a word written and never read (below)
#define SMEM (OFF_SINK + 16)
#ifdef SMEM_LAUNCH  // the launch's bytes (kernels/lowrank_score.py smem_bytes): a layout edit must move both
static_assert(SMEM == SMEM_LAUNCH, "the launch's shared memory differs from the kernel's layout");
#endif

#include "lowrank_common.cuh"
#include "wgmma.cuh"


extern "C" __global__ void __launch_bounds__(128, 2) tale_lr_score(LR_SCORE_ARGS) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int sp = blockIdx.x, cta = blockIdx.y, b = blockIdx.z;
    const int kv0 = cta * 2;                              // the CTA's first KV head
    const int blk = kv0 / hpb, cb = (kv0 % hpb) * NHALF;  // its basis block and first column in it
    const TileRun run = tile_run(len_p, len_v, cap, sp, nsplit);
    const int L = run.L, tile0 = run.tile0, tile1 = run.tile1;
    if (tile0 >= tile1) return;
    const float kinv = inv_v > 0.f ? inv_v : 1.0f / *bias_p;

    unsigned char* stc = smem + OFF_STC;
    unsigned char* sts = smem + OFF_STS;
    u16* sz = (u16*)(smem + OFF_SZ);
    const CodeRows cr = code_rows(codes, ksc, kzr, s_kb, s_kh, s_kt, s_sb, s_sh, s_st, cap, b, blk);
    auto stage = [&](int t0) {
        stage_codes<128>(stc, sts, cr, t0, L, tid);
        cp_commit();
    };
    stage(tile0 * BT);

    // the basis times its column scales for the CTA's life, the column means as row KC, zero rows after: a thread
    // reads 8 coefficients' rows of one column (lanes along the columns: coalesced) and stores them as one 16-byte
    // row of a core matrix
    for (int i = tid; i < KCP / 8 * NCOL; i += 128) {
        const int n = i % NCOL, k0 = i / NCOL * 8;
        const int j = n >> 7, hf = (n >> 6) & 1, f = n & 63, gc = (kv0 + j) * NHALF + f;
        const u16* src = (hf ? dhi : dlo) + (long)blk * s_dblk + cb + j * NHALF + f;
        const float scale = rows[(2 + hf) * knh + gc], mean = rows[hf * knh + gc];
        float v[8];
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            const int k = k0 + kk;
            v[kk] = k < KC ? h2f1(src[(long)k * s_dec]) * scale : k == KC ? mean : 0.f;
        }
        *(uint4*)(smem + OFF_B + KOFF(n, k0)) =
            make_uint4(f2h(v[0], v[1]), f2h(v[2], v[3]), f2h(v[4], v[5]), f2h(v[6], v[7]));
    }
    // the coefficient tile's padding columns, for good: the means' constant one at KC, zeros after
    for (int i = tid; i < BT * (KCP - KC); i += 128) {
        const int r = i / (KCP - KC), c = KC + i % (KCP - KC);
        *(u16*)(smem + OFF_A + KOFF(r, c)) = c == KC ? 0x3C00 : 0;
    }

    // the query heads' B fragments for the score mma, per head h and 16 channels q8: rows k = channel, column n =
    // query head (n < REP; else zero)
    u32 qb[2][8][2];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int q8 = 0; q8 < 8; q8++) q_frag(qb[h][q8], q, (long)b * s_qb + (long)(kv0 + h) * REP * s_qh, s_qh, 16 * q8, qk, lane);
#if !ROPE_TAB
    const int my_roff = roff[b];
#endif
    const u32 acol = smem_u32(smem + OFF_A), bcol = smem_u32(smem + OFF_B);
    float d[128];

    for (int tile = tile0; tile < tile1; tile++) {
        const int t0 = tile * BT;
        cp_wait_all();
        __syncthreads();  // the stage (and, first time, the basis) landed; the last tile's epilogue is done
        scales_fp16<128>(sts, sz, kinv, tid);
        __syncthreads();
        // codes -> coefficients: word wd of row t holds, per plane p, codes p PNB + 4 wd .. + 3. Lanes take 8 rows x
        // 2 neighbouring words x 2 row groups: the K-major stores of 16 lanes then fill 32 banks (a warp along one
        // row would put its stores 128 bytes apart, all in the same banks)
        for (int i = tid; i < BT * ((PNW + 1) / 2) * 2; i += 128) {
            const int rest = i >> 4, t = (rest % (BT / 8)) * 8 + (i & 7), wd = (rest / (BT / 8)) * 2 + ((i >> 3) & 1);
            if (wd >= PNW) continue;
            const u16 *srow, *zrow;
            const u32 word = code_word(stc, sz, t, wd, &srow, &zrow);
#pragma unroll
            for (int p = 0; p < NPL; p++)
                *(uint2*)(smem + OFF_A + KOFF(t, p * PNB + 4 * wd)) = dequant4(word, p, srow, zrow, p * PNB + 4 * wd);
        }
        fence_proxy_async();  // this thread's coefficients (and, first time, the basis), read by wgmma
        __syncthreads();      // the coefficient tile is complete and the stage consumed
        if (tile + 1 < tile1) stage(t0 + BT);

        // -- the rebuild: d = the tile's 64 slots x the 2 heads' 256 columns (warp w: slots 16 w ..)
        wg_fence_regs<128>(d);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KCP / 16; ks++)
            wgmma256<0>(d, wg_desc(acol + KOFF(0, 16 * ks), LBO, SBO), wg_desc(bcol + KOFF(0, 16 * ks), LBO, SBO), ks);
        wg_commit();
        // while it runs: cos/sin of slots 16 w + lane / 4 (+ 8) at frequencies 8 j + 2 (lane % 4) (+ 1), j < 8, as
        // half2 pairs {cos f, cos f + 1} and {sin f, sin f + 1}
        u32 c2[2][8], s2[2][8];
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            const int t = t0 + 16 * w + (lane >> 2) + 8 * rr;
#if !ROPE_TAB
            const float p = (float)((t < L ? pos[(long)b * s_pb + t] : 0) - my_roff);
#endif
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int f = 8 * j + 2 * (lane & 3);
                float ca, sa, cb_, sb_;
#if ROPE_TAB
                const long ci = (long)b * s_cb + (long)(t < L ? t : 0) * s_ct + f;
                ca = cos_t[ci], sa = sin_t[ci], cb_ = cos_t[ci + 1], sb_ = sin_t[ci + 1];
#else
                sincos_red(p * invf[f], &ca, &sa);
                sincos_red(p * invf[f + 1], &cb_, &sb_);
#if RSC
                ca *= rsc, sa *= rsc, cb_ *= rsc, sb_ *= rsc;
#endif
#endif
                c2[rr][j] = pair_rdt(ca, cb_);
                s2[rr][j] = pair_rdt(sa, sb_);
            }
        }
        {  // a store that needs every cos/sin: ptxas keeps their SFU work before the wait, where it overlaps the GEMM
           // (it sinks them past the wait otherwise, into the epilogue)
            u32 x = 0;
#pragma unroll
            for (int rr = 0; rr < 2; rr++)
#pragma unroll
                for (int j = 0; j < 8; j++) x ^= c2[rr][j] ^ s2[rr][j];
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(smem_u32(smem + OFF_SINK)), "r"(x) : "memory");
        }
        wg_wait<0>();
        wg_fence_regs<128>(d);
        // per head: RoPE in half2 on the packed keys (lo' = lo cos - hi sin, hi' = hi cos + lo sin; column block nb
        // of the lo half pairs with nb + 8 of the hi half), then the scores of its query heads
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float S[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int q8 = 0; q8 < 4; q8++) {
                u32 klo[2][2], khi[2][2];
#pragma unroll
                for (int u = 0; u < 2; u++)
#pragma unroll
                    for (int rr = 0; rr < 2; rr++) {
                        const int nl = 16 * h + 2 * q8 + u, nh = nl + 8, j = 2 * q8 + u;
                        const u32 lo2 = f2h(d[4 * nl + 2 * rr], d[4 * nl + 2 * rr + 1]);
                        const u32 hi2 = f2h(d[4 * nh + 2 * rr], d[4 * nh + 2 * rr + 1]);
                        klo[u][rr] = hfma2(lo2, c2[rr][j], hmul2(hi2, s2[rr][j] ^ 0x80008000u));
                        khi[u][rr] = hfma2(hi2, c2[rr][j], hmul2(lo2, s2[rr][j]));
                    }
                mma(S, klo[0][0], klo[0][1], klo[1][0], klo[1][1], qb[h][q8][0], qb[h][q8][1]);
                mma(S, khi[0][0], khi[0][1], khi[1][0], khi[1][1], qb[h][q8 + 4][0], qb[h][q8 + 4][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int t = t0 + 16 * w + (lane >> 2) + 8 * (i >> 1), n = 2 * (lane & 3) + (i & 1);
                if (n < REP && t < L) sc[(long)b * s_scb + (long)((kv0 + h) * REP + n) * s_sch + t] = S[i];
            }
        }
    }
}
