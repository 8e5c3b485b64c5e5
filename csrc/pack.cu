// pack.cu -- bit packing of unsigned 1/2/4/8-bit codes into uint8 (compressors/bitpack.py).
// Layout: code i lives in byte (i*bits)/8 at bit offset (i*bits)%8, least significant first;
// the tail of the last byte is zero.
//
// Both kernels give each thread groups of 8 codes per step (grid-stride): 8 code bytes are
// one 8-byte access where that side is 8-byte aligned, the group's packed form is `bits`
// bytes in one naturally aligned access (store_code_group / load_code_group); element-wise
// for the last, partial group and for misaligned buffers.
//
// Kernels:
//   pack_bits(const u8* codes, i64 n, int bits, u8* packed, i64 nbytes)
//       codes[i] < 2^bits (higher bits are masked off). Bytes/element: 1 + b/8.
//   unpack_bits(const u8* packed, i64 n, int bits, u8* codes)
//       codes[i] = (packed[(i*bits)/8] >> ((i*bits)%8)) & (2^bits - 1). Bytes/element: b/8 + 1.

extern "C" __global__ void pack_bits(const u8* codes, i64 n, int bits, u8* packed, i64 nbytes) {
    const u32 mask = (1U << bits) - 1U;
    const i64 ngroups = (n + 7) >> 3;
    const bool cvec = aligned_to(codes, 8), pvec = aligned_to(packed, (unsigned)bits);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
        const i64 i = g << 3;
        unsigned long long in = 0;
        if (cvec && i + 8 <= n) {
            vec2u w = *reinterpret_cast<const vec2u*>(codes + i);
            in = (unsigned long long)w.x | ((unsigned long long)w.y << 32);
        } else {
            for (int k = 0; k < 8 && i + k < n; ++k) in |= (unsigned long long)codes[i + k] << (8 * k);
        }
        unsigned long long out = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) out |= ((in >> (8 * k)) & mask) << (k * bits);
        store_code_group(packed, g * bits, out, bits, pvec, nbytes);
    }
}

extern "C" __global__ void unpack_bits(const u8* packed, i64 n, int bits, u8* codes) {
    const u32 mask = (1U << bits) - 1U;
    const i64 ngroups = (n + 7) >> 3, nbytes = (n * bits + 7) >> 3;
    const bool cvec = aligned_to(codes, 8), pvec = aligned_to(packed, (unsigned)bits);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
        const i64 i = g << 3;
        const unsigned long long in = load_code_group(packed, g * bits, bits, pvec, nbytes);
        unsigned long long out = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) out |= ((in >> (k * bits)) & mask) << (8 * k);
        if (cvec && i + 8 <= n) {
            vec2u w;
            w.x = (u32)out;
            w.y = (u32)(out >> 32);
            *reinterpret_cast<vec2u*>(codes + i) = w;
        } else {
            for (int k = 0; k < 8 && i + k < n; ++k) codes[i + k] = (u8)(out >> (8 * k));
        }
    }
}
