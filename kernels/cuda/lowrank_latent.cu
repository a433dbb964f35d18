// The latent pass of a low-rank-key region for one decoded token: over the scores the score pass wrote
// (kernels/cuda/lowrank_score*.cu: s[b, h, t], float32, base 2), per split of the region's slots and per latent group,
//     m = max_t s,  l = sum_t 2^(s - m),  acc[c] = sum_t 2^(s - m) h_t[c]        (masked slots left out)
// for the group's QG query heads, where h_t are the slot's 3-bit latents (runtime/quant.py's planar rows: low two
// bits of channel c in byte c % 2P at bit 2 (c / 2P), the high bit in byte 2P + c % P at bit c / P; P = RANK / 8),
// each channel group of P channels with its own per-slot scale and zero. The partials go to kernels/attention.py's
// layout (m, l [B, H, S], acc [B, H, S, RPAD], the slot's rank), which its combine merges with the other regions'.
// tale_kernels.lowrank_latent compiles it per configuration (-D below) and launches it in place of the Triton
// kernel's latent launch.
//
// A CTA owns (split, latent group, batch row) and NW = P / 8 warps; per 64-slot tile:
//   1. cp.async brings the tile's packed latents (one tile ahead); the scores, positions, scales and zeros of the
//      next tile are loaded into registers meanwhile;
//   2. each warp: the masked scores of 8 slots for all 16 rows, their row maxima into shared memory; the scales and
//      zeros of the tile to fp16, in the order the mma's B fragments read them;
//   3. each warp: the tile's row maxima, the online softmax of its 8 slots, p as fp16 into shared memory;
//   4. each warp: channels 8 w + i + P j (i < 8, j < 8) of all 16 rows, by mma.sync m16n8k16 over 16 slots at a
//      time: A = p (ldmatrix), B = the codes of the thread's channel (i = lane / 4) at 4 slots, as 1024 + 4^k code
//      under an fp16 exponent (two lop3 per pair: the low bits of byte c0 or c0 + P in place at bit 2k, the high
//      bit shifted next to them), minus 1024, times the scale / 4^k, plus the zero (one sub and one fma per pair).
//      So one thread's channels c0 + P j, j < 8, come from three bytes per slot, and n-tile j is channel group j.
// The scales and zeros are used as stored (fp8 values times bias, or fp16 times shift): the accumulators are
// multiplied by 1 / bias (1 / shift) once, when written.
//
// Fixed per build: RANK (512: P = 64 channels per scale group, 8 warps), META8 (1: fp8 e4m3 scale and
// zero; 0: fp16), QG query rows per latent group (<= 16), WIN (a sliding window masks slots).

#if RANK != 512
#error "the latent pass is built for 512 latent channels (8 warps of 8 x 8 channels)"
#endif
#define BT 64                          // slots per tile
#define P8 (RANK / 8)                  // channels per sub-plane and per scale group
#define NW (P8 / 8)                    // warps: 8 values of c0 each
#define NTHR (32 * NW)
#define ROWB (RANK * 3 / 8)            // packed bytes per slot
#define RSTR (ROWB + 16)               // shared row stride: rows 2t of a warp's loads land in distinct banks
#define PSTR 72                        // p rows, halves: ldmatrix's 8 rows in distinct banks
#define MB (META8 ? 1 : 2)             // bytes per scale or zero

// shared memory, bytes
#define OFF_C 0                                  // packed latents [2][64][RSTR]
#define OFF_P (OFF_C + 2 * BT * RSTR)            // p [16][PSTR] fp16
#define OFF_SZ (OFF_P + 16 * PSTR * 2)           // [8 groups][4 k-steps][4 t] {s x4, z x4} fp16
#define OFF_RED (OFF_SZ + 8 * 4 * 4 * 16)        // row maxima [16][8 warps] float, then the row sums
#define SMEM (OFF_RED + 16 * 8 * 4)

#ifndef INFINITY  // NVRTC compiles without the C headers
#define INFINITY __int_as_float(0x7f800000)
#endif

#include "ptx.cuh"

__device__ __forceinline__ float ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
// two scales (or zeros) as stored -> half2 (exact: e4m3 and fp16 values are fp16 numbers)
__device__ __forceinline__ u32 meta2(u32 v) {
#if META8
    u32 r;
    asm("{.reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;}\n" : "=r"(r) : "r"(v));
    return r;
#else
    return v;
#endif
}
__device__ __forceinline__ void cp16z(u32 saddr, const void* g, int bytes) {  // zero-filled past `bytes`
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(g), "r"(bytes));
}
__device__ __forceinline__ u32 lds8(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr));
    return v;
}

extern "C" __global__ void __launch_bounds__(NTHR, 2) tale_lr_latent(
    const float* __restrict__ sc, int s_scb, int s_sch,                  // scores [B, H, cap]
    const int* __restrict__ pos, int s_pb,                               // slot positions [B, cap]
    const int* __restrict__ len_p, int len_v, int cap,                   // length: *len_p if len_v < 0
    const int* __restrict__ np_p, int np_v, int window,                  // next position: *np_p if np_v < 0
    const unsigned char* __restrict__ lat, int s_hb, int s_hg, int s_ht, // packed latents [B, G, cap, ROWB]
    const unsigned char* __restrict__ hsc, const unsigned char* __restrict__ hzr,  // [B, G, cap, 8]
    int s_sb, int s_sg, int s_st,                                        // their strides, elements
    const float* __restrict__ bias_p, float inv_v,                       // 1 / bias or shift; <= 0: 1 / *bias_p
    float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ pacc, int s_acc,  // partials
    int* __restrict__ rk,                                                // the slot's rank
    int slot0, int n_slots, int H, int ns) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int sp = blockIdx.x, c = blockIdx.y, b = blockIdx.z;
    const int L = len_v >= 0 ? len_v : min(*len_p, cap);
    const int next_pos = np_v >= 0 ? np_v : *np_p;
    const int chunk = ((L + ns - 1) / ns + BT - 1) / BT * BT;
    const int t_start = sp * chunk, t_end = min(t_start + chunk, L);
    const float inv = inv_v > 0.f ? inv_v : 1.0f / *bias_p;

    const u32 sC = smem_u32(smem + OFF_C), sP = smem_u32(smem + OFF_P), sSZ = smem_u32(smem + OFF_SZ);
    float* red = (float*)(smem + OFF_RED);

    const unsigned char* lbase = lat + (long)b * s_hb + (long)c * s_hg;
    const unsigned char* sbase = hsc + ((long)b * s_sb + (long)c * s_sg) * MB;
    const unsigned char* zbase = hzr + ((long)b * s_sb + (long)c * s_sg) * MB;
    const int* pbase = pos + (long)b * s_pb;
    // step 2/3's slots and row: row lane / 2, slots 8 w + 4 (lane % 2) + e of the tile
    const int r2 = lane >> 1, s2 = 8 * w + 4 * (lane & 1);
    const float* srow = sc + (long)b * s_scb + (long)(c * QG + r2) * s_sch;
    const int t = lane & 3, c0 = 8 * w + (lane >> 2);  // step 4: the B fragments' slots 2t.. and channel c0

    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m_run = -INFINITY, l_run = 0.f;  // row r2's running max (the same in every warp) and this lane's sum

    // the next tile's scores, positions (row r2, slots s2..s2+3) and, per staging unit, positions and meta
    float4 nsc;
    int4 npv;
    auto load_row = [&](int t0, float4& v, int4& p) {
        const int tt = t0 + s2;
        if (tt + 3 < t_end) {
            p = *(const int4*)(pbase + tt);
            v = r2 < QG ? *(const float4*)(srow + tt) : make_float4(0.f, 0.f, 0.f, 0.f);
        } else {
            p.x = tt < t_end ? pbase[tt] : -1;
            p.y = tt + 1 < t_end ? pbase[tt + 1] : -1;
            p.z = tt + 2 < t_end ? pbase[tt + 2] : -1;
            p.w = tt + 3 < t_end ? pbase[tt + 3] : -1;
            v.x = r2 < QG && tt < t_end ? srow[tt] : 0.f;
            v.y = r2 < QG && tt + 1 < t_end ? srow[tt + 1] : 0.f;
            v.z = r2 < QG && tt + 2 < t_end ? srow[tt + 2] : 0.f;
            v.w = r2 < QG && tt + 3 < t_end ? srow[tt + 3] : 0.f;
        }
    };
    // staging units: (slot, pair of groups) = 64 x 4, one per thread
#define NSU 1
    u32 nms[NSU], nmz[NSU];
    int nmp[NSU];
    auto load_meta = [&](int t0) {
#pragma unroll
        for (int u = 0; u < NSU; ++u) {
            const int unit = tid + u * NTHR, ss = unit & 63, gp = unit >> 6;
            const int tt = t0 + ss;
            if (tt < t_end) {
                const long o = ((long)tt * s_st + 2 * gp) * MB;
#if META8
                nms[u] = *(const u16*)(sbase + o);
                nmz[u] = *(const u16*)(zbase + o);
#else
                nms[u] = *(const u32*)(sbase + o);
                nmz[u] = *(const u32*)(zbase + o);
#endif
                nmp[u] = pbase[tt];
            } else {
                nms[u] = nmz[u] = 0;
                nmp[u] = -1;
            }
        }
    };
    auto load_codes = [&](int t0, int stage) {
        constexpr int CH = ROWB / 16;  // 16-byte chunks per row
        for (int k = tid; k < BT * CH; k += NTHR) {
            const int row = k / CH, ch = k % CH, tt = t0 + row;
            const bool in = tt < t_end;
            cp16z(sC + (stage * BT + row) * RSTR + ch * 16, lbase + (long)(in ? tt : t_start) * s_ht + ch * 16,
                  in ? 16 : 0);
        }
    };
    auto valid = [&](int pv) { return pv >= 0 && (!WIN || next_pos - pv < window); };

    if (t_start < t_end) {
        load_codes(t_start, 0);
        load_row(t_start, nsc, npv);
        load_meta(t_start);
    }
    cp_commit();
    int it = 0;
    for (int t0 = t_start; t0 < t_end; t0 += BT, ++it) {
        const float4 csc = nsc;
        const int4 cpv = npv;
        u32 cms[NSU], cmz[NSU];
        int cmp[NSU];
#pragma unroll
        for (int u = 0; u < NSU; ++u) cms[u] = nms[u], cmz[u] = nmz[u], cmp[u] = nmp[u];
        __syncthreads();  // the previous tile's products are done: its stage, p and scales may be overwritten
        if (t0 + BT < t_end) {
            load_codes(t0 + BT, (it + 1) & 1);
            load_row(t0 + BT, nsc, npv);
            load_meta(t0 + BT);
        }
        cp_commit();

        // -- 2: masked scores, the row maxima of the warp's 8 slots; the tile's scales and zeros to fp16
        float lg[4] = {csc.x, csc.y, csc.z, csc.w};
        const int pv[4] = {cpv.x, cpv.y, cpv.z, cpv.w};
        float mx = -INFINITY;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            lg[e] = (r2 < QG && valid(pv[e])) ? lg[e] : -INFINITY;
            mx = fmaxf(mx, lg[e]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        if (!(lane & 1)) red[r2 * 8 + w] = mx;
#pragma unroll
        for (int u = 0; u < NSU; ++u) {
            const int unit = tid + u * NTHR, ss = unit & 63, gp = unit >> 6;
            const bool ok = valid(cmp[u]);  // masked slots: scale and zero 0, whatever the cache holds there
            u32 s2h = ok ? meta2(cms[u]) : 0u, z2h = ok ? meta2(cmz[u]) : 0u;
            // the group's scale / 4^k (k = group / 2: its codes sit at bit 2k), exact in fp16
            const u32 qk = (gp == 0) ? 0x3c003c00u : (gp == 1) ? 0x34003400u : (gp == 2) ? 0x2c002c00u : 0x24002400u;
            s2h = hmul2(s2h, qk);
            // slot ss in the B fragments: k-step ss / 16, t = (ss % 8) / 2, index (ss % 2) + 2 ((ss % 16) / 8)
            const int ks = ss >> 4, tq = (ss & 7) >> 1, e = (ss & 1) + 2 * ((ss & 15) >> 3);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int g = 2 * gp + h;
                const u32 a = sSZ + ((g * 4 + ks) * 4 + tq) * 16 + e * 2;
                const u32 sv = h ? s2h >> 16 : s2h & 0xffffu, zv = h ? z2h >> 16 : z2h & 0xffffu;
                asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(a), "h"((u16)sv));
                asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(a + 8), "h"((u16)zv));
            }
        }
        __syncthreads();

        // -- 3: the tile's row maxima, online softmax over the warp's slots, p into shared memory
        float mt = -INFINITY;
#pragma unroll
        for (int k = 0; k < 8; ++k) mt = fmaxf(mt, red[r2 * 8 + k]);
        const float m_new = fmaxf(m_run, mt);
        const float m_safe = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = ex2(m_run - m_safe);
        float p[4], ps = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) ps += (p[e] = ex2(lg[e] - m_safe));
        l_run = l_run * alpha + ps;
        m_run = m_new;
        sts64(sP + r2 * PSTR * 2 + s2 * 2, f2h(p[0], p[1]), f2h(p[2], p[3]));
        cp_wait<1>();  // this tile's latents (the next tile's are the newest group)
        __syncthreads();

        // -- 4: acc = acc alpha + p h over the tile
        const float al_a = __shfl_sync(0xffffffffu, alpha, 2 * (lane >> 2));       // row lane / 4
        const float al_b = __shfl_sync(0xffffffffu, alpha, 2 * (lane >> 2) + 16);  // row lane / 4 + 8
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j][0] *= al_a, acc[j][1] *= al_a, acc[j][2] *= al_b, acc[j][3] *= al_b;
        const u32 stage = sC + (it & 1) * BT * RSTR;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            u32 a[4];
            ldsm4(a, sP + ((lane & 7) + 8 * ((lane >> 3) & 1)) * PSTR * 2 + (16 * ks + 8 * (lane >> 4)) * 2);
            // slots 16 ks + 2t + {0, 1} (pair A) and + {8, 9} (pair B): bytes c0, c0 + P (low bits), 2P + c0 (high)
            const u32 ra = stage + (16 * ks + 2 * t) * RSTR + c0;
            const u32 rb = ra + 8 * RSTR;
            u32 wl0[2], wl1[2], whe[2], who[2];
#pragma unroll
            for (int pr = 0; pr < 2; ++pr) {
                const u32 r0 = pr ? rb : ra, r1 = r0 + RSTR;
                wl0[pr] = __byte_perm(lds8(r0), lds8(r1), 0x5410);
                wl1[pr] = __byte_perm(lds8(r0 + P8), lds8(r1 + P8), 0x5410);
                const u32 hb = __byte_perm(lds8(r0 + 2 * P8), lds8(r1 + 2 * P8), 0x5410);
                whe[pr] = hb << 2;  // even j = 2k: the high bit j to bit 2k + 2
                who[pr] = hb << 1;  // odd j = 2k + 1: likewise
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int k = j >> 1;
                const u32 mlo = 0x00030003u << (2 * k), mhi = 0x00040004u << (2 * k);
                const uint4 m = lds128(sSZ + ((j * 4 + ks) * 4 + t) * 16);  // s A, s B, z A, z B
                u32 x[2];
#pragma unroll
                for (int pr = 0; pr < 2; ++pr) {
                    u32 v = lop3_andor((j & 1) ? wl1[pr] : wl0[pr], mlo, 0x64006400u);
                    v = lop3_andor((j & 1) ? who[pr] : whe[pr], mhi, v);
                    v = hsub2(v, 0x64006400u);  // 4^k code, exact
                    x[pr] = hfma2(v, pr ? m.y : m.x, pr ? m.w : m.z);
                }
                mma(acc[j], a[0], a[1], a[2], a[3], x[0], x[1]);
            }
        }
    }
    cp_wait_all();

    // -- the partials: l over the warps, then m, l, acc (times 1 / bias) of the rows below QG
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    __syncthreads();
    if (!(lane & 1)) red[r2 * 8 + w] = l_run;
    __syncthreads();
    const int slot = slot0 + sp;
    if (w == 0 && !(lane & 1) && r2 < QG) {
        float l = 0.f;
        for (int k = 0; k < 8; ++k) l += red[r2 * 8 + k];
        const long prow = ((long)b * H + c * QG + r2) * n_slots + slot;
        pm[prow] = m_run;
        pl[prow] = l;
    }
    if (tid == 0 && c == 0 && b == 0) rk[slot] = RANK;
    const int ra = lane >> 2, rb = ra + 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int ch = 8 * w + 2 * t + P8 * j;
        if (ra < QG) {
            float* o = pacc + (((long)b * H + c * QG + ra) * n_slots + slot) * s_acc + ch;
            *(float2*)o = make_float2(acc[j][0] * inv, acc[j][1] * inv);
        }
        if (rb < QG) {
            float* o = pacc + (((long)b * H + c * QG + rb) * n_slots + slot) * s_acc + ch;
            *(float2*)o = make_float2(acc[j][2] * inv, acc[j][3] * inv);
        }
    }
}
