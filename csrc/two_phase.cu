// two_phase.cu -- fused owner step of the two-phase scatter-reduce for QSGD payloads
// (comms/algorithms/two_phase.py, steps 3: decode every rank's chunk in rank order, sum in
// fp32, add the owner residual, re-quantize; plus the new owner residual).
//
// Kernel:
//   two_phase_qsgd_owner(const u8* recv, i64 seg_bytes, int world, i64 m, i64 chunk, i64 nch,
//                        int bits, u32 key, const float* residual_in, float* residual_out,
//                        float* scales_out, u8* packed_out, i64 nbytes)
//       recv: world segments of seg_bytes = 4*nch + ceil(m*bits/8) bytes, each the wire form
//       of one QSGD payload [scales (nch fp32), packed codes] (comms/algorithms/wire.py
//       to_bytes; the scales may be unaligned and are read bytewise). One block per QSGD chunk
//       c (grid-stride over chunks); dynamic shared memory: 2*world floats (the senders'
//       scale and step of the chunk). Each thread takes groups of 8 elements of the chunk:
//       per rank, the group's b code bytes in one aligned load (bytewise where that segment's
//       codes are not b-byte aligned), and per element i:
//         y = fl(...fl(fl(0 + d_0) + d_1)... + d_{world-1}) (+ residual_in[i] if non-null),
//         d_r = fl(fl(q_r * w_r) - s_r)                       (QSGD decode, rank order)
//       kept in registers (up to OWNER_CACHE_GROUPS groups per thread; the rest of a longer
//       chunk is decoded again in the second pass) while the block reduces s2 = max|y|; then
//       the codes of y with hash stream `key` (scales_out, packed_out: QSGD.compress of y, one
//       aligned store per group) and residual_out[i] = fl(y - decode(code)) when residual_out
//       is non-null (may alias residual_in: every element is read before it is written, by
//       the same thread). Needs chunk % 8 == 0.
//       Bytes/element: world * b/8 (every rank's codes) + b/8 (owner codes) + 4 + 4 (residual
//       in and out, when given) + (4 world + 4) / chunk.

#define OWNER_CACHE_GROUPS 2  // groups of 8 per thread in registers: 4096 elements at 256 threads

__device__ __forceinline__ float load_f32_unaligned(const u8* p) {
    u32 b = (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
    return __uint_as_float(b);
}

// y of group [i, i+8) of the owner chunk (0 past m): the rank-ordered decode-sum (+ residual)
__device__ __forceinline__ void owner_group_sum(const u8* recv, i64 seg_bytes, int world, i64 codes_off,
                                                i64 code_bytes, int bits, const float* s_r, const float* w_r,
                                                const float* residual_in, i64 i, i64 m, float y[8]) {
    const u32 mask = (1U << bits) - 1U;
#pragma unroll
    for (int k = 0; k < 8; ++k) y[k] = 0.0f;
    for (int r = 0; r < world; ++r) {
        const u8* codes = recv + r * seg_bytes + codes_off;
        const unsigned long long g =
            load_code_group(codes, (i >> 3) * bits, bits, aligned_to(codes, (unsigned)bits), code_bytes);
        const float s = s_r[r], w = w_r[r];
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = __fadd_rn(y[k], qsgd_value((u32)(g >> (k * bits)) & mask, w, s));
    }
    if (residual_in) {
        float res[8];
        load_group(residual_in, i, m, DT_F32, aligned_to(residual_in, 16), res);
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = __fadd_rn(y[k], res[k]);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k)
        if (i + k >= m) y[k] = 0.0f;
}

// codes of y (stored) and the owner residual y - decode(code) (when residual_out)
__device__ __forceinline__ void owner_group_encode(const float y[8], i64 i, i64 m, float r2, float half, float M,
                                                   float w2, float s2, int bits, u32 key, u8* packed_out,
                                                   bool pvec, i64 nbytes, float* residual_out) {
    unsigned long long g = 0;
    float res[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        u32 q = i + k < m ? qsgd_code(y[k], r2, half, M, (u32)(i + k), key) : 0U;
        g |= (unsigned long long)q << (k * bits);
        res[k] = __fsub_rn(y[k], qsgd_value(q, w2, s2));
    }
    store_code_group(packed_out, (i >> 3) * bits, g, bits, pvec, nbytes);
    if (residual_out) store_group(residual_out, i, m, DT_F32, aligned_to(residual_out, 16), res);
}

extern "C" __global__ void two_phase_qsgd_owner(const u8* recv, i64 seg_bytes, int world, i64 m,
                                                i64 chunk, i64 nch, int bits, u32 key,
                                                const float* residual_in, float* residual_out,
                                                float* scales_out, u8* packed_out, i64 nbytes) {
    extern __shared__ float smem[];
    float* s_r = smem;               // world
    float* w_r = smem + world;       // world
    const float M = (float)((1U << bits) - 1U);
    const float half = __fmul_rn(M, 0.5f);
    const i64 codes_off = 4 * nch, code_bytes = (m * bits + 7) >> 3;
    const bool pvec = aligned_to(packed_out, (unsigned)bits);
    for (i64 c = blockIdx.x; c < nch; c += gridDim.x) {
        const i64 start = c * chunk;
        const i64 ngroups = (min(chunk, m - start) + 7) >> 3;
        for (int r = threadIdx.x; r < world; r += blockDim.x) {
            float s = load_f32_unaligned(recv + r * seg_bytes + 4 * c);
            s_r[r] = s;
            w_r[r] = qsgd_step(s, M);
        }
        __syncthreads();
        float y[OWNER_CACHE_GROUPS][8];
        float mx = 0.0f;
#pragma unroll
        for (int k = 0; k < OWNER_CACHE_GROUPS; ++k) {
            const i64 g = threadIdx.x + (i64)k * blockDim.x;
            if (g < ngroups) {
                owner_group_sum(recv, seg_bytes, world, codes_off, code_bytes, bits, s_r, w_r, residual_in,
                                start + 8 * g, m, y[k]);
                for (int e = 0; e < 8; ++e) mx = max_nan(mx, fabsf(y[k][e]));
            }
        }
        for (i64 g = threadIdx.x + (i64)OWNER_CACHE_GROUPS * blockDim.x; g < ngroups; g += blockDim.x) {
            float t[8];
            owner_group_sum(recv, seg_bytes, world, codes_off, code_bytes, bits, s_r, w_r, residual_in,
                            start + 8 * g, m, t);
            for (int e = 0; e < 8; ++e) mx = max_nan(mx, fabsf(t[e]));
        }
        const float s2 = block_reduce_max_nan(mx);
        if (threadIdx.x == 0) scales_out[c] = s2;
        const float r2 = qsgd_inv_scale(s2, half), w2 = qsgd_step(s2, M);
#pragma unroll
        for (int k = 0; k < OWNER_CACHE_GROUPS; ++k) {
            const i64 g = threadIdx.x + (i64)k * blockDim.x;
            if (g < ngroups)
                owner_group_encode(y[k], start + 8 * g, m, r2, half, M, w2, s2, bits, key, packed_out, pvec, nbytes,
                                   residual_out);
        }
        for (i64 g = threadIdx.x + (i64)OWNER_CACHE_GROUPS * blockDim.x; g < ngroups; g += blockDim.x) {
            float t[8];
            owner_group_sum(recv, seg_bytes, world, codes_off, code_bytes, bits, s_r, w_r, residual_in,
                            start + 8 * g, m, t);
            owner_group_encode(t, start + 8 * g, m, r2, half, M, w2, s2, bits, key, packed_out, pvec, nbytes,
                               residual_out);
        }
        __syncthreads();  // s_r, w_r are rewritten for the next chunk
    }
}
