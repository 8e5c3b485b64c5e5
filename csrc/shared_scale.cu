// shared_scale.cu -- shared-scale integer quantization (comms/algorithms/shared_scale.py).
// Every rank quantizes with the SAME per-chunk scale to integers in [-L, L]:
//   t = fl(x * inv[c]); q = clamp(floor(fl(t + u)), -L, L) (NaN -> 0); own = fl(q * step[c])
// and the integer sum decodes as out = fl(float(sum) * step[c]). inv = L / s and
// step = s / L are tiny per-chunk vectors computed by the caller with the same torch ops as the
// reference (so the division semantics are those of torch on the same device).
//
// Kernels:
//   shared_scale_encode(const void* x, int dtype, i64 n, i64 chunk, const float* inv,
//                       const float* step, float levels, u32 key, void* q, int q_is_int32,
//                       void* own, int own_dtype)
//       q: int8 (q_is_int32 = 0) or int32 wire integers; own (may be null): this rank's
//       decoded contribution in own_dtype. u from hash stream `key` at the element's index.
//   shared_scale_decode(const void* q, int q_is_int32, i64 n, i64 chunk, const float* step,
//                       void* out, int out_dtype)
//       out[i] = fl(float(q[i]) * step[i / chunk]) (int -> fp32 rounds to nearest even).

extern "C" __global__ void shared_scale_encode(const void* x, int dtype, i64 n, i64 chunk,
                                               const float* inv, const float* step, float levels,
                                               u32 key, void* q, int q_is_int32, void* own,
                                               int own_dtype) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        i64 c = i / chunk;
        float t = __fmul_rn(load_f32(x, i, dtype), inv[c]);
        t = floorf(__fadd_rn(t, hash_uniform((u32)i, key)));
        // NaN t (NaN/inf x, or 0 * inf when inv overflowed) -> 0, like the reference; fminf/fmaxf
        // alone would turn it into -levels
        t = t != t ? 0.0f : fminf(fmaxf(t, -levels), levels);
        if (q_is_int32) ((int*)q)[i] = (int)t;
        else ((signed char*)q)[i] = (signed char)(int)t;
        if (own) store_from_f32(own, i, __fmul_rn(t, step[c]), own_dtype);
    }
}

extern "C" __global__ void shared_scale_decode(const void* q, int q_is_int32, i64 n, i64 chunk,
                                               const float* step, void* out, int out_dtype) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int v = q_is_int32 ? ((const int*)q)[i] : (int)((const signed char*)q)[i];
        store_from_f32(out, i, __fmul_rn(__int2float_rn(v), step[i / chunk]), out_dtype);
    }
}
