// sign.cu -- ScaledSign encode / decode (compressors/sign.py).
// Format: bit 1 for x >= 0 (so -0.0 -> 1, NaN -> 0), 0 otherwise, packed 1 bit per element
// (bitpack layout); per-chunk scale s = mean|x| is computed by the caller with the SAME torch
// reduction as the reference (torch does not fix its summation order, so a hand-written sum
// could differ in the last bit); decode gives +s or -s.
//
// Bytes per element: E = input element size (4 fp32, 2 fp16/bf16), O = output element size.
//
// Kernels:
//   sign_pack(const void* x, int dtype, i64 n, u8* packed, i64 nbytes)
//       16-byte aligned x: one group of 8 elements per thread and step (grid-stride), read by
//       vector loads, its 8 sign bits one byte, stored directly (a warp stores 32 consecutive
//       bytes: one 32-byte sector). Otherwise one __ballot_sync per 32 elements = one 32-bit
//       word (coalesced scalar loads; packed 4-byte aligned). Bytes/element: E + 1/8.
//   sign_decode(const u8* packed, const float* scales, i64 n, i64 chunk, void* out,
//               int out_dtype, int accumulate)
//       out[i] = bit ? s : -s  (torch: (2b - 1) * s, exact); accumulate=1 adds into fp32 out.
//       One group of 8 per thread and step: one code byte, one scale per group when chunk % 8
//       == 0, 16-byte vector stores when out is 16-byte aligned. Bytes/element: 1/8 + 4/chunk
//       + O (+ 4 read when accumulating).

__device__ __forceinline__ void sign_pack_ballot(const void* x, int dtype, i64 n, u8* packed, i64 nbytes) {
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

extern "C" __global__ void sign_pack(const void* x, int dtype, i64 n, u8* packed, i64 nbytes) {
    if (!aligned_to(x, 16)) {  // uniform over the launch
        sign_pack_ballot(x, dtype, n, packed, nbytes);
        return;
    }
    const i64 ngroups = (n + 7) >> 3;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
        const i64 i = g << 3;
        float v[8];
        load_group(x, i, n, dtype, true, v);
        u32 byte = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) byte |= (u32)(i + k < n && v[k] >= 0.0f) << k;
        packed[g] = (u8)byte;
    }
}

extern "C" __global__ void sign_decode(const u8* packed, const float* scales, i64 n, i64 chunk,
                                       void* out, int out_dtype, int accumulate) {
    const i64 ngroups = (n + 7) >> 3;
    const bool ovec = aligned_to(out, 16), chunk8 = (chunk & 7) == 0;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
        const i64 i = g << 3;
        const u32 byte = packed[g];
        float s = scales[chunk_of(i, chunk)], v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (!chunk8 && k > 0 && i + k < n && (i + k) % chunk == 0) s = scales[(i + k) / chunk];
            v[k] = ((byte >> k) & 1U) ? s : -s;
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
