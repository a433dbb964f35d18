// A GEMM-only probe of wgmma (sm_90a) at the low-rank score pass's shape: per CTA tile D [64, NT] = A [64, KP] B [KP, NT]
// (NT = NWG x 256 columns: a warpgroup per 256), fp16 operands in shared memory in wgmma's K-major layout without
// swizzle (core matrices of 8 rows x 16 bytes), float32 accumulators. experiments/wgmma_probe.py builds it per
// layout and descriptor convention, checks D against torch and times it.
//
// -D: NWG, KP (a multiple of 16), LAYOUT (1: the core matrices of a row group adjacent along K, 128 bytes apart;
// 2: the row groups of a K column adjacent, 128 bytes apart), SWAP (1: the descriptor's two offsets exchanged),
// TRANS_B (wgmma's imm-trans-b), REPS (the k-loop repeated on the same tile: the tensor rate without the loads).

typedef unsigned short u16;
typedef unsigned int u32;
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
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(u32 saddr, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(g));
}

#define STR2(x) #x
#define STR(x) STR2(x)
#define TRANS_B_STR STR(TRANS_B)

// d (64 x 256 float32; 128 per thread) = (acc ? d : 0) + A (64 x 16) B (16 x 256)
__device__ __forceinline__ void wgmma256(float* d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
        "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
        "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, "
        "%67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, "
        "%89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, "
        "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
        "%127}, %128, %129, p, 1, 1, 0, " TRANS_B_STR ";\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
          "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
          "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
          "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),
          "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),
          "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),
          "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),
          "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),
          "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]),
          "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]),
          "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(acc));
}

// a: [T, 64, KP] fp16, b: [KP, NT] fp16 (row-major), d: [T, 64, NT] float32 (write) or [grid x threads] checksums
// the accumulators ordered against wgmma's asynchronous writes (ptxas sees no dependence through the async proxy)
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");
}

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
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // this thread's writes, read by wgmma
        __syncthreads();
        fence_regs(d_);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        const u32 a0 = smem_u32(sa), b0 = smem_u32(sb + koff(256 * wg, 0, NT));
#pragma unroll 1
        for (int rep = 0; rep < REPS; rep++)
#pragma unroll
            for (int ks = 0; ks < KP / 16; ks++)
                wgmma256(d_, desc(a0 + koff(0, 16 * ks, 64), 64), desc(b0 + koff(0, 16 * ks, NT), NT), rep + ks);
        asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_regs(d_);
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
