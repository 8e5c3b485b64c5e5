// shared_scale.cu -- shared-scale integer quantization (comms/algorithms/shared_scale.py).
// Every rank quantizes with the SAME per-chunk scale to integers in [-L, L]:
//   t = fl(x * inv[c]); q = clamp(floor(fl(t + u)), -L, L) (NaN -> 0); own = fl(q * step[c])
// and the integer sum decodes as out = fl(float(sum) * step[c]). inv = L / s and
// step = s / L are tiny per-chunk vectors computed by the caller with the same torch ops as the
// reference (so the division semantics are those of torch on the same device).
//
// Both kernels give each thread one group of 8 consecutive elements per step (grid-stride):
// 16-byte vector loads and stores of x / own / out where the base pointers are 16-byte
// aligned, the 8 wire integers as one 8-byte (int8) or two 16-byte (int32) accesses, one
// inv/step per group when chunk % 8 == 0; element-wise otherwise and for the last, partial
// group. No atomics, no shared memory.
//
// Bytes per element: E = x's element size, W = wire integer size (1 or 4), O = own/out size.
//   shared_scale_encode(const void* x, int dtype, i64 n, i64 chunk, const float* inv,
//                       const float* step, float levels, u32 key, void* q, int q_is_int32,
//                       void* own, int own_dtype)
//       q: int8 (q_is_int32 = 0) or int32 wire integers; own (may be null): this rank's
//       decoded contribution in own_dtype. u from hash stream `key` at the element's index.
//       Bytes/element: E + W (+ O with own) + 8/chunk.
//   shared_scale_decode(const void* q, int q_is_int32, i64 n, i64 chunk, const float* step,
//                       void* out, int out_dtype)
//       out[i] = fl(float(q[i]) * step[i / chunk]) (int -> fp32 rounds to nearest even).
//       Bytes/element: W + O + 4/chunk.

__device__ __forceinline__ float ss_level(float xv, float inv, u32 i, u32 key, float levels) {
    float t = floorf(__fadd_rn(__fmul_rn(xv, inv), hash_uniform(i, key)));
    // NaN t (NaN/inf x, or 0 * inf when inv overflowed) -> 0, like the reference; fminf/fmaxf
    // alone would turn it into -levels
    return t != t ? 0.0f : fminf(fmaxf(t, -levels), levels);
}

extern "C" __global__ void shared_scale_encode(const void* x, int dtype, i64 n, i64 chunk,
                                               const float* inv, const float* step, float levels,
                                               u32 key, void* q, int q_is_int32, void* own,
                                               int own_dtype) {
    const i64 ngroups = (n + 7) >> 3;
    const bool xvec = aligned_to(x, 16), ovec = aligned_to(own, 16), chunk8 = (chunk & 7) == 0;
    const bool qvec = aligned_to(q, q_is_int32 ? 16 : 8);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
        const i64 i = g << 3;
        float v[8], t[8];
        load_group(x, i, n, dtype, xvec, v);
        i64 c = chunk_of(i, chunk);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (!chunk8 && k > 0 && i + k < n && (i + k) % chunk == 0) c = (i + k) / chunk;
            t[k] = ss_level(v[k], inv[c], (u32)(i + k), key, levels);
            v[k] = __fmul_rn(t[k], step[c]);  // own
        }
        const bool whole = i + 8 <= n;
        if (q_is_int32) {
            if (qvec && whole) {
                vec4u a, b;
                a.x = (u32)(int)t[0]; a.y = (u32)(int)t[1]; a.z = (u32)(int)t[2]; a.w = (u32)(int)t[3];
                b.x = (u32)(int)t[4]; b.y = (u32)(int)t[5]; b.z = (u32)(int)t[6]; b.w = (u32)(int)t[7];
                reinterpret_cast<vec4u*>((int*)q + i)[0] = a;
                reinterpret_cast<vec4u*>((int*)q + i)[1] = b;
            } else {
                for (int k = 0; k < 8 && i + k < n; ++k) ((int*)q)[i + k] = (int)t[k];
            }
        } else {
            if (qvec && whole) {
                u32 lo = 0, hi = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    lo |= ((u32)(int)t[k] & 0xFFU) << (8 * k);
                    hi |= ((u32)(int)t[k + 4] & 0xFFU) << (8 * k);
                }
                vec2u w;
                w.x = lo;
                w.y = hi;
                *reinterpret_cast<vec2u*>((signed char*)q + i) = w;
            } else {
                for (int k = 0; k < 8 && i + k < n; ++k) ((signed char*)q)[i + k] = (signed char)(int)t[k];
            }
        }
        if (own) store_group(own, i, n, own_dtype, ovec, v);
    }
}

extern "C" __global__ void shared_scale_decode(const void* q, int q_is_int32, i64 n, i64 chunk,
                                               const float* step, void* out, int out_dtype) {
    const i64 ngroups = (n + 7) >> 3;
    const bool ovec = aligned_to(out, 16), chunk8 = (chunk & 7) == 0;
    const bool qvec = aligned_to(q, q_is_int32 ? 16 : 8);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
        const i64 i = g << 3;
        int iv[8];
        if (qvec && i + 8 <= n) {
            if (q_is_int32) {
                vec4u a = reinterpret_cast<const vec4u*>((const int*)q + i)[0];
                vec4u b = reinterpret_cast<const vec4u*>((const int*)q + i)[1];
                iv[0] = (int)a.x; iv[1] = (int)a.y; iv[2] = (int)a.z; iv[3] = (int)a.w;
                iv[4] = (int)b.x; iv[5] = (int)b.y; iv[6] = (int)b.z; iv[7] = (int)b.w;
            } else {
                vec2u w = *reinterpret_cast<const vec2u*>((const signed char*)q + i);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    iv[k] = (int)(signed char)(u8)(w.x >> (8 * k));
                    iv[k + 4] = (int)(signed char)(u8)(w.y >> (8 * k));
                }
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k)
                iv[k] = i + k >= n ? 0 : q_is_int32 ? ((const int*)q)[i + k] : (int)((const signed char*)q)[i + k];
        }
        float v[8];
        i64 c = chunk_of(i, chunk);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (!chunk8 && k > 0 && i + k < n && (i + k) % chunk == 0) c = (i + k) / chunk;
            v[k] = __fmul_rn(__int2float_rn(iv[k]), step[c]);
        }
        store_group(out, i, n, out_dtype, ovec, v);
    }
}
