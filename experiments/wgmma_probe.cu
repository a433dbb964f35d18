// A GEMM-only probe of wgmma (sm_90a) at the low-rank score pass's shape: per CTA tile D [64, NT] = A [64, KP] B [KP, NT]
// (NT = NWG x 256 columns: a warpgroup per 256), fp16 operands in shared memory in wgmma's K-major layout without
// swizzle (core matrices of 8 rows x 16 bytes), float32 accumulators. experiments/wgmma_probe.py builds it per
// layout and descriptor convention, checks D against torch and times it.
//
// -D: NWG, KP (a multiple of 16), LAYOUT (1: the core matrices of a row group adjacent along K, 128 bytes apart;
// 2: the row groups of a K column adjacent, 128 bytes apart), SWAP (1: the descriptor's two offsets exchanged),
// TRANS_B (wgmma's imm-trans-b), REPS (the k-loop repeated on the same tile: the tensor rate without the loads).

#include "wgmma.cuh"  // kernels/cuda: wgmma256 and its fences, and through ptx.cuh u16, u32, smem_u32, cp16
#define NT (NWG * 256)

// byte offset of element (row r, k) of a K-major operand of R rows
__device__ __forceinline__ u32 koff(int r, int k, int R) {
#if LAYOUT == 1
    return (r >> 3) * (KP * 16) + (k >> 3) * 128 + (r & 7) * 16 + (k & 7) * 2;
#else
    return (k >> 3) * (R * 16) + (r >> 3) * 128 + (r & 7) * 16 + (k & 7) * 2;
#endif
}
// a shared-memory matrix descriptor without swizzle: the start address, then the byte offsets between core matrices
// along K and along the rows (or exchanged: SWAP)
__device__ __forceinline__ unsigned long long desc(u32 saddr, int R) {
    const u32 k_off = LAYOUT == 1 ? 128 : R * 16, r_off = LAYOUT == 1 ? KP * 16 : 128;
    const u32 lbo = SWAP ? r_off : k_off, sbo = SWAP ? k_off : r_off;
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}
// a: [T, 64, KP] fp16, b: [KP, NT] fp16 (row-major), d: [T, 64, NT] float32 (write) or [grid x threads] checksums

extern "C" __global__ void __launch_bounds__(NWG * 128, 1)
    probe(const u16* __restrict__ a, const u16* __restrict__ b, float* __restrict__ d, int T, int write) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* sa = smem;                 // [64 x KP]
    unsigned char* sb = smem + 64 * KP * 2;   // [NT x KP]
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
    for (int i = tid; i < NT * KP; i += blockDim.x) {  // B transposed into K-major rows (n, k), once
        const int n = i % NT, k = i / NT;
        *(u16*)(sb + koff(n, k, NT)) = b[(long)k * NT + n];
    }
    float d_[128];
    float check = 0.f;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        __syncthreads();  // the last tile's wgmma are done (waited below) before its A is overwritten
        for (int i = tid; i < 64 * KP / 8; i += blockDim.x) {
            const int r = i / (KP / 8), k8 = i % (KP / 8);
            cp16(smem_u32(sa + koff(r, 8 * k8, 64)), a + ((long)t * 64 + r) * KP + 8 * k8);
        }
        cp_commit();
        cp_wait_all();
        fence_proxy_async();  // this thread's writes, read by wgmma
        __syncthreads();
        wg_fence_regs<128>(d_);
        wg_fence();
        const u32 a0 = smem_u32(sa), b0 = smem_u32(sb + koff(256 * wg, 0, NT));
#pragma unroll 1
        for (int rep = 0; rep < REPS; rep++)
#pragma unroll
            for (int ks = 0; ks < KP / 16; ks++)
                wgmma256<TRANS_B>(d_, desc(a0 + koff(0, 16 * ks, 64), 64), desc(b0 + koff(0, 16 * ks, NT), NT), rep + ks);
        wg_commit();
        wg_wait<0>();
        wg_fence_regs<128>(d_);
        if (write) {
#pragma unroll
            for (int j = 0; j < 128; j++) {  // d[4 nb + 2 rr + e]: row 16 warp + lane / 4 + 8 rr, column 8 nb + 2 (lane % 4) + e
                const int nb = j >> 2, rr = (j >> 1) & 1, e = j & 1;
                const int row = 16 * warp + (lane >> 2) + 8 * rr, col = 256 * wg + 8 * nb + 2 * (lane & 3) + e;
                d[((long)t * 64 + row) * NT + col] = d_[j];
            }
        } else {
#pragma unroll
            for (int j = 0; j < 128; j++) check += d_[j];
        }
    }
    if (!write) d[blockIdx.x * blockDim.x + tid] = check;
}
