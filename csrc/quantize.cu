// quantize.cu -- QSGD b-bit stochastic quantization with per-chunk max-abs scales, packing fused.
// Reference and format: compressors/qsgd.py (chunk_absmax, QSGD.compress / decompress).
//
// Bytes per element (the roofline bench/kernels.py prints): E = input element size (4 fp32, 2
// fp16/bf16), O = output element size, b = bits.
//
// Kernels (all `extern "C"`, blockDim.x a multiple of 32, <= 1024):
//   qsgd_encode_chunks(const void* x, int dtype, i64 n, i64 chunk, i64 nchunks, int bits, u32 key,
//                      float* scales, u8* packed, i64 nbytes)
//       the main encode: ONE read of x. One block per chunk (grid-stride over chunks; the
//       launcher sizes the block to the chunk: one thread per group, 32 to 256 threads); each
//       thread loads groups of 8 consecutive elements (16-byte vector loads when x is 16-byte
//       aligned) and keeps up to QSGD_CACHE_GROUPS of them in registers while the block
//       reduces the chunk's max-abs; it then encodes them from registers and stores the group's
//       b bytes of codes with one naturally aligned store (no shuffles, no atomics). Chunks
//       longer than QSGD_CACHE_GROUPS * 8 * blockDim re-read the rest (an L2 hit). Needs
//       chunk % 8 == 0 (a group never straddles two chunks' bytes).
//       Bytes/element: E + b/8 + 4/chunk (read x, write codes and scales).
//   chunk_absmax(const void* x, int dtype, i64 n, i64 chunk, i64 nchunks, float* scales)
//       scales[c] = max|x| over chunk c (NaN propagates like torch.amax). One block per chunk,
//       grid-stride over chunks; groups of 8 by 16-byte loads when chunk % 8 == 0 and x is
//       16-byte aligned. Bytes/element: E + 4/chunk.
//   qsgd_quantize_fused(const void* x, int dtype, i64 n, i64 chunk, i64 nchunks, int bits,
//                       u32 key, float* scales, u8* packed, i64 nbytes)
//       chunks with chunk % 8 != 0 but (chunk * bits) % 32 == 0: max-abs, then encode + pack by
//       warp shuffles (the second read of the chunk hits L2). Needs packed 4-byte aligned.
//       Bytes/element: E (2E through L2) + b/8 + 4/chunk.
//   qsgd_quantize_packed(const void* x, int dtype, i64 n, i64 chunk, int bits, u32 key,
//                        const float* scales, u8* packed, i64 nbytes)
//       any chunk: encode + pack with scales from chunk_absmax; grid-stride over elements.
//       Bytes/element: E + b/8 (+ chunk_absmax's E before it).
//   qsgd_dequantize(const u8* packed, const float* scales, i64 n, i64 chunk, int bits,
//                   void* out, int out_dtype, int accumulate)
//       out[i] = fl(fl(q*w) - s) (accumulate=1: out[i] = fl(out[i] + that), fp32 out only).
//       One group of 8 per thread and step (grid-stride): the group's b code bytes in one
//       aligned load, one scale per group when chunk % 8 == 0, the 8 results in 16-byte vector
//       stores (loads too for accumulate) when out is 16-byte aligned; element-wise otherwise.
//       Bytes/element: b/8 + 4/chunk + O (+ 4 more read when accumulating).
// dtype codes: 0 float32, 1 float16, 2 bfloat16. key: hashrng.stream_key(seed, step, bucket, rank).
// The code of element i sits at bit i*bits of the packed stream (compressors/bitpack.py).

#define QSGD_CACHE_GROUPS 4  // groups of 8 per thread in registers: 8192 elements at 256 threads

__device__ __forceinline__ float group_absmax(float mx, const float v[8]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) mx = max_nan(mx, fabsf(v[k]));
    return mx;
}

// OR the per-lane shifted codes of each aligned group of (32/bits) lanes: every lane of the
// group ends up with the group's 32-bit word.
__device__ __forceinline__ u32 group_or(u32 v, int per_word) {
    for (int off = 1; off < per_word; off <<= 1) v |= __shfl_xor_sync(0xffffffffU, v, off);
    return v;
}

__device__ __forceinline__ void store_word(u8* packed, i64 word, u32 v, i64 nbytes) {
    i64 b = word * 4;
    if (b + 4 <= nbytes) {
        ((u32*)packed)[word] = v;
    } else {
        for (int j = 0; j < 4 && b + j < nbytes; ++j) packed[b + j] = (u8)(v >> (8 * j));
    }
}

extern "C" __global__ void chunk_absmax(const void* x, int dtype, i64 n, i64 chunk, i64 nchunks,
                                        float* scales) {
    // groups of 8 by vector loads where the chunk starts on a group (chunk % 8 == 0, x 16-byte
    // aligned); element-wise otherwise
    const bool vec = aligned_to(x, 16) && (chunk & 7) == 0;
    for (i64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        i64 start = c * chunk;
        i64 m = min(chunk, n - start);
        float v = 0.0f;
        if (vec) {
            for (i64 g = threadIdx.x; g < ((m + 7) >> 3); g += blockDim.x) {
                float w[8];
                load_group(x, start + 8 * g, n, dtype, true, w);
                v = group_absmax(v, w);
            }
        } else {
            for (i64 j = threadIdx.x; j < m; j += blockDim.x) v = max_nan(v, fabsf(load_f32(x, start + j, dtype)));
        }
        v = block_reduce_max_nan(v);
        if (threadIdx.x == 0) scales[c] = v;
    }
}

extern "C" __global__ void qsgd_quantize_fused(const void* x, int dtype, i64 n, i64 chunk, i64 nchunks,
                                               int bits, u32 key, float* scales, u8* packed,
                                               i64 nbytes) {
    const float M = (float)((1U << bits) - 1U);
    const float half = __fmul_rn(M, 0.5f);
    const int per_word = 32 / bits;
    const unsigned lane = threadIdx.x & 31U;
    for (i64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        i64 start = c * chunk;
        i64 m = min(chunk, n - start);
        float v = 0.0f;
        for (i64 j = threadIdx.x; j < m; j += blockDim.x) v = max_nan(v, fabsf(load_f32(x, start + j, dtype)));
        float s = block_reduce_max_nan(v);
        if (threadIdx.x == 0) scales[c] = s;
        float r = qsgd_inv_scale(s, half);
        // warp-uniform loop: all lanes take part in the shuffles
        for (i64 base = threadIdx.x - lane; base < m; base += blockDim.x) {
            i64 j = base + lane;
            u32 code = 0;
            if (j < m) {
                i64 i = start + j;
                code = qsgd_code(load_f32(x, i, dtype), r, half, M, (u32)i, key) << ((u32)(j % per_word) * bits);
            }
            code = group_or(code, per_word);
            if (j < m && (j % per_word) == 0) store_word(packed, (start + j) / per_word, code, nbytes);
        }
    }
}

extern "C" __global__ void qsgd_quantize_packed(const void* x, int dtype, i64 n, i64 chunk, int bits,
                                                u32 key, const float* scales, u8* packed, i64 nbytes) {
    const float M = (float)((1U << bits) - 1U);
    const float half = __fmul_rn(M, 0.5f);
    const int per_word = 32 / bits;
    const unsigned lane = threadIdx.x & 31U;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 base = (i64)blockIdx.x * blockDim.x + threadIdx.x - lane; base < n; base += stride) {
        i64 i = base + lane;
        u32 code = 0;
        if (i < n) {
            float s = scales[i / chunk];
            code = qsgd_code(load_f32(x, i, dtype), qsgd_inv_scale(s, half), half, M, (u32)i, key)
                   << ((u32)(i % per_word) * bits);
        }
        code = group_or(code, per_word);
        if (i < n && (i % per_word) == 0) store_word(packed, i / per_word, code, nbytes);
    }
}

// 8 codes of group x[i..i+8) (zeros past n) as the group's bits * 8 bits, element i lowest
__device__ __forceinline__ unsigned long long qsgd_group_codes(const float v[8], i64 i, i64 n, float r, float half,
                                                               float M, int bits, u32 key) {
    unsigned long long g = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k)
        if (i + k < n) g |= (unsigned long long)qsgd_code(v[k], r, half, M, (u32)(i + k), key) << (k * bits);
    return g;
}

extern "C" __global__ void qsgd_encode_chunks(const void* x, int dtype, i64 n, i64 chunk, i64 nchunks, int bits,
                                              u32 key, float* scales, u8* packed, i64 nbytes) {
    const float M = (float)((1U << bits) - 1U);
    const float half = __fmul_rn(M, 0.5f);
    const bool xvec = aligned_to(x, 16);
    const bool pvec = aligned_to(packed, (unsigned)bits);
    for (i64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const i64 start = c * chunk;
        const i64 ngroups = (min(chunk, n - start) + 7) >> 3;
        float v[QSGD_CACHE_GROUPS][8];
        float mx = 0.0f;
#pragma unroll
        for (int k = 0; k < QSGD_CACHE_GROUPS; ++k) {
            const i64 g = threadIdx.x + (i64)k * blockDim.x;
            if (g < ngroups) {
                load_group(x, start + 8 * g, n, dtype, xvec, v[k]);
                mx = group_absmax(mx, v[k]);
            }
        }
        for (i64 g = threadIdx.x + (i64)QSGD_CACHE_GROUPS * blockDim.x; g < ngroups; g += blockDim.x) {
            float w[8];
            load_group(x, start + 8 * g, n, dtype, xvec, w);
            mx = group_absmax(mx, w);
        }
        const float s = block_reduce_max_nan(mx);
        if (threadIdx.x == 0) scales[c] = s;
        const float r = qsgd_inv_scale(s, half);
#pragma unroll
        for (int k = 0; k < QSGD_CACHE_GROUPS; ++k) {
            const i64 g = threadIdx.x + (i64)k * blockDim.x;
            if (g < ngroups) {
                const i64 i = start + 8 * g;
                store_code_group(packed, (i >> 3) * bits, qsgd_group_codes(v[k], i, n, r, half, M, bits, key), bits,
                                 pvec, nbytes);
            }
        }
        for (i64 g = threadIdx.x + (i64)QSGD_CACHE_GROUPS * blockDim.x; g < ngroups; g += blockDim.x) {
            const i64 i = start + 8 * g;
            float w[8];
            load_group(x, i, n, dtype, xvec, w);
            store_code_group(packed, (i >> 3) * bits, qsgd_group_codes(w, i, n, r, half, M, bits, key), bits, pvec,
                             nbytes);
        }
    }
}

extern "C" __global__ void qsgd_dequantize(const u8* packed, const float* scales, i64 n, i64 chunk,
                                           int bits, void* out, int out_dtype, int accumulate) {
    const float M = (float)((1U << bits) - 1U);
    const u32 mask = (1U << bits) - 1U;
    const i64 ngroups = (n + 7) >> 3, nbytes = (n * bits + 7) >> 3;
    const bool pvec = aligned_to(packed, (unsigned)bits), ovec = aligned_to(out, 16);
    const bool chunk8 = (chunk & 7) == 0;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
        const i64 i = g << 3;
        const unsigned long long codes = load_code_group(packed, g * bits, bits, pvec, nbytes);
        float v[8];
        float s = scales[chunk_of(i, chunk)], w = qsgd_step(s, M);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (!chunk8 && k > 0 && i + k < n && (i + k) % chunk == 0) {  // a chunk starts inside the group
                s = scales[(i + k) / chunk];
                w = qsgd_step(s, M);
            }
            v[k] = qsgd_value((u32)(codes >> (k * bits)) & mask, w, s);
        }
        if (accumulate) {
            float a[8];
            load_group(out, i, n, DT_F32, ovec, a);
#pragma unroll
            for (int k = 0; k < 8; ++k) a[k] = __fadd_rn(a[k], v[k]);
            store_group(out, i, n, DT_F32, ovec, a);
        } else {
            store_group(out, i, n, out_dtype, ovec, v);
        }
    }
}
