// sign.cu -- ScaledSign encode / decode (compressors/sign.py).
// Format: bit 1 for x >= 0 (so -0.0 -> 1, NaN -> 0), 0 otherwise, packed 1 bit per element
// (bitpack layout); per-chunk scale s = mean|x| is computed by the caller with the SAME torch
// reduction as the reference (torch does not fix its summation order, so a hand-written sum
// could differ in the last bit); decode gives +s or -s.
//
// Kernels:
//   sign_pack(const void* x, int dtype, i64 n, u8* packed, i64 nbytes)
//       one __ballot_sync per 32 elements = one 32-bit word; grid-stride; packed 4-byte aligned.
//   sign_decode(const u8* packed, const float* scales, i64 n, i64 chunk, void* out,
//               int out_dtype, int accumulate)
//       out[i] = bit ? s : -s  (torch: (2b - 1) * s, exact); accumulate=1 adds into fp32 out.

extern "C" __global__ void sign_pack(const void* x, int dtype, i64 n, u8* packed, i64 nbytes) {
    const unsigned lane = threadIdx.x & 31U;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 base = (i64)blockIdx.x * blockDim.x + threadIdx.x - lane; base < n; base += stride) {
        i64 i = base + lane;
        bool bit = i < n && load_f32(x, i, dtype) >= 0.0f;
        u32 w = __ballot_sync(0xffffffffU, bit);
        if (lane == 0) {
            i64 wi = base / 32, b = wi * 4;
            if (b + 4 <= nbytes) {
                ((u32*)packed)[wi] = w;
            } else {
                for (int j = 0; j < 4 && b + j < nbytes; ++j) packed[b + j] = (u8)(w >> (8 * j));
            }
        }
    }
}

extern "C" __global__ void sign_decode(const u8* packed, const float* scales, i64 n, i64 chunk,
                                       void* out, int out_dtype, int accumulate) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float s = scales[i / chunk];
        float v = ((packed[i >> 3] >> (i & 7)) & 1) ? s : -s;
        if (accumulate) {
            float* acc = (float*)out;
            acc[i] = __fadd_rn(acc[i], v);
        } else {
            store_from_f32(out, i, v, out_dtype);
        }
    }
}
