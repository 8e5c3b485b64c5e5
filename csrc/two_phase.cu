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
//       c; dynamic shared memory: chunk floats (the owner sum y) + 2*world floats (the
//       senders' scale and step). Per element i:
//         y = fl(...fl(fl(0 + d_0) + d_1)... + d_{world-1}) (+ residual_in[i] if non-null),
//         d_r = fl(fl(q_r * w_r) - s_r)                       (QSGD decode, rank order)
//       then s2 = max|y| over the chunk, the codes of y with hash stream `key` (scales_out,
//       packed_out: QSGD.compress of y), and residual_out[i] = fl(y - decode(code)) when
//       residual_out is non-null (may alias residual_in). Needs (chunk*bits) % 32 == 0 and a
//       4-byte aligned packed_out.

__device__ __forceinline__ float load_f32_unaligned(const u8* p) {
    u32 b = (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
    return __uint_as_float(b);
}

extern "C" __global__ void two_phase_qsgd_owner(const u8* recv, i64 seg_bytes, int world, i64 m,
                                                i64 chunk, i64 nch, int bits, u32 key,
                                                const float* residual_in, float* residual_out,
                                                float* scales_out, u8* packed_out, i64 nbytes) {
    extern __shared__ float smem[];
    float* y = smem;                 // chunk
    float* s_r = smem + chunk;       // world
    float* w_r = s_r + world;        // world
    const float M = (float)((1U << bits) - 1U);
    const float half = __fmul_rn(M, 0.5f);
    const int per_word = 32 / bits;
    const unsigned lane = threadIdx.x & 31U;
    const i64 codes_off = 4 * nch;
    for (i64 c = blockIdx.x; c < nch; c += gridDim.x) {
        i64 start = c * chunk;
        i64 len = min(chunk, m - start);
        for (int r = threadIdx.x; r < world; r += blockDim.x) {
            float s = load_f32_unaligned(recv + r * seg_bytes + 4 * c);
            s_r[r] = s;
            w_r[r] = qsgd_step(s, M);
        }
        __syncthreads();
        float mx = 0.0f;
        for (i64 j = threadIdx.x; j < len; j += blockDim.x) {
            i64 i = start + j;
            float v = 0.0f;
            for (int r = 0; r < world; ++r) {
                u32 q = get_code(recv + r * seg_bytes + codes_off, i, bits);
                v = __fadd_rn(v, qsgd_value(q, w_r[r], s_r[r]));
            }
            if (residual_in) v = __fadd_rn(v, residual_in[i]);
            y[j] = v;
            mx = max_nan(mx, fabsf(v));
        }
        float s2 = block_reduce_max_nan(mx);  // its __syncthreads also publishes y
        if (threadIdx.x == 0) scales_out[c] = s2;
        float r2 = qsgd_inv_scale(s2, half);
        float w2 = qsgd_step(s2, M);
        for (i64 base = threadIdx.x - lane; base < len; base += blockDim.x) {
            i64 j = base + lane;
            u32 word = 0;
            if (j < len) {
                i64 i = start + j;
                u32 q = qsgd_code(y[j], r2, half, M, (u32)i, key);
                if (residual_out) residual_out[i] = __fsub_rn(y[j], qsgd_value(q, w2, s2));
                word = q << ((u32)(j % per_word) * bits);
            }
            for (int off = 1; off < per_word; off <<= 1) word |= __shfl_xor_sync(0xffffffffU, word, off);
            if (j < len && (j % per_word) == 0) {
                i64 w = (start + j) / per_word, b = w * 4;
                if (b + 4 <= nbytes) {
                    ((u32*)packed_out)[w] = word;
                } else {
                    for (int k = 0; k < 4 && b + k < nbytes; ++k) packed_out[b + k] = (u8)(word >> (8 * k));
                }
            }
        }
        __syncthreads();  // y, s_r, w_r are rewritten for the next chunk
    }
}
