// quantize.cu -- QSGD b-bit stochastic quantization with per-chunk max-abs scales, packing fused.
// Reference and format: compressors/qsgd.py (chunk_absmax, QSGD.compress / decompress).
//
// Kernels (all `extern "C"`, blockDim.x a multiple of 32, <= 1024):
//   chunk_absmax(const void* x, int dtype, i64 n, i64 chunk, i64 nchunks, float* scales)
//       scales[c] = max|x| over chunk c (NaN propagates like torch.amax). One block per chunk,
//       grid-stride over chunks.
//   qsgd_quantize_fused(const void* x, int dtype, i64 n, i64 chunk, i64 nchunks, int bits,
//                       u32 key, float* scales, u8* packed, i64 nbytes)
//       one pass per chunk: max-abs, then encode + pack (the second read of the chunk hits L2).
//       Needs (chunk * bits) % 32 == 0 and packed 4-byte aligned, so each chunk owns whole
//       32-bit words of the packed stream. Writes the scales and the packed codes.
//   qsgd_quantize_packed(const void* x, int dtype, i64 n, i64 chunk, int bits, u32 key,
//                        const float* scales, u8* packed, i64 nbytes)
//       any chunk: encode + pack with scales from chunk_absmax; grid-stride over elements.
//   qsgd_dequantize(const u8* packed, const float* scales, i64 n, i64 chunk, int bits,
//                   void* out, int out_dtype, int accumulate)
//       out[i] = fl(fl(q*w) - s) (accumulate=1: out[i] = fl(out[i] + that), fp32 out only).
// dtype codes: 0 float32, 1 float16, 2 bfloat16. key: hashrng.stream_key(seed, step, bucket, rank).
// The code of element i sits at bit i*bits of the packed stream (compressors/bitpack.py).

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
    for (i64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        i64 start = c * chunk;
        i64 m = min(chunk, n - start);
        float v = 0.0f;
        for (i64 j = threadIdx.x; j < m; j += blockDim.x) v = max_nan(v, fabsf(load_f32(x, start + j, dtype)));
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

extern "C" __global__ void qsgd_dequantize(const u8* packed, const float* scales, i64 n, i64 chunk,
                                           int bits, void* out, int out_dtype, int accumulate) {
    const float M = (float)((1U << bits) - 1U);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float s = scales[i / chunk];
        float v = qsgd_value(get_code(packed, i, bits), qsgd_step(s, M), s);
        if (accumulate) {
            float* acc = (float*)out;
            acc[i] = __fadd_rn(acc[i], v);
        } else {
            store_from_f32(out, i, v, out_dtype);
        }
    }
}
