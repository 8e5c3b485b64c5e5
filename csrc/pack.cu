// pack.cu -- bit packing of unsigned 1/2/4/8-bit codes into uint8 (compressors/bitpack.py).
// Layout: code i lives in byte (i*bits)/8 at bit offset (i*bits)%8, least significant first;
// the tail of the last byte is zero.
//
// Kernels:
//   pack_bits(const u8* codes, i64 n, int bits, u8* packed, i64 nbytes)
//       codes[i] < 2^bits (higher bits are masked off); warp groups of 32/bits lanes build one
//       32-bit word each; grid-stride over elements. packed must be 4-byte aligned.
//   unpack_bits(const u8* packed, i64 n, int bits, u8* codes)
//       codes[i] = (packed[(i*bits)/8] >> ((i*bits)%8)) & (2^bits - 1); grid-stride.

extern "C" __global__ void pack_bits(const u8* codes, i64 n, int bits, u8* packed, i64 nbytes) {
    const int per_word = 32 / bits;
    const u32 mask = (1U << bits) - 1U;
    const unsigned lane = threadIdx.x & 31U;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 base = (i64)blockIdx.x * blockDim.x + threadIdx.x - lane; base < n; base += stride) {
        i64 i = base + lane;
        u32 v = i < n ? ((u32)codes[i] & mask) << ((u32)(i % per_word) * bits) : 0U;
        for (int off = 1; off < per_word; off <<= 1) v |= __shfl_xor_sync(0xffffffffU, v, off);
        if (i < n && (i % per_word) == 0) {
            i64 w = i / per_word, b = w * 4;
            if (b + 4 <= nbytes) {
                ((u32*)packed)[w] = v;
            } else {
                for (int j = 0; j < 4 && b + j < nbytes; ++j) packed[b + j] = (u8)(v >> (8 * j));
            }
        }
    }
}

extern "C" __global__ void unpack_bits(const u8* packed, i64 n, int bits, u8* codes) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        codes[i] = (u8)get_code(packed, i, bits);
}
