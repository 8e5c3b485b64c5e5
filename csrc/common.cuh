// common.cuh -- helpers shared by every csrc/*.cu kernel file (no kernels here).
//
// The loader (compressors/cuda/loader.py) compiles this header followed by every .cu file as
// ONE NVRTC translation unit per device, with --fmad=false: each fp32 operation below is a
// separately rounded IEEE op (__fmul_rn/__fadd_rn/__fdiv_rn), exactly as torch performs the
// reference (one elementwise op per kernel, no FMA), so payloads are bit-identical.
//
// Helpers:
//   lowbias32(x)                the hash of compressors/hashrng.py (wrapping uint32 multiplies)
//   hash_uniform(i, key)        u = ((lowbias32(i ^ key) >> 8) + 0.5) * 2^-24 in fp32
//   load_f32(p, i, dtype)       element i of a float32 (0) / float16 (1) / bfloat16 (2) buffer
//   store_from_f32(p, i, v, dt) round-to-nearest-even store, NaN -> canonical like torch
//   block_reduce_max_nan(v)     block-wide max that propagates NaN (like torch.amax)
//   load8 / store8              8 consecutive elements as fp32 through 16-byte vector accesses
//   load8_tail / store8_tail    the same element by element, bounded by n (tails, misaligned data)
//   load_group / store_group    one of the two, by alignment and by whether the group is whole
//   store_code_group / load_code_group   the bits bytes of 8 packed codes (QSGD, sign)
//
// Vector accesses: 8 consecutive elements starting at a multiple of 8 are 32 bytes (fp32) or 16
// bytes (fp16/bf16), so one 16-byte aligned base pointer makes every such group 16-byte aligned.
// vec4u / vec2u are this file's own aligned structs (not CUDA's uint4, so nothing depends on
// NVRTC's built-in vector types); the kernels test the base pointers' alignment at run time and
// take the element-wise path otherwise.
#ifndef COMMPRESS_COMMON_CUH
#define COMMPRESS_COMMON_CUH

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

__device__ __forceinline__ u32 lowbias32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// torch: int -> fp32 copy (exact, < 2^24), then add_(0.5) (rounded), then mul_(2^-24) (exact).
__device__ __forceinline__ float hash_uniform(u32 i, u32 key) {
    u32 h = lowbias32(i ^ key) >> 8;
    return __fmul_rn(__fadd_rn(__uint2float_rn(h), 0.5f), 5.9604644775390625e-08f);
}

// One PTX cvt each (round to nearest even; NaN -> 0x7FFF, cvt.rn.f16.f32's canonical NaN). The
// CPU emulator of tests/emu compiles this same branch and emulates the two instructions.
__device__ __forceinline__ float half_bits_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_half_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// c10::round_to_nearest_even: NaN -> 0x7FC0, else add the rounding bias and truncate.
__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 b = __float_as_uint(f);
    if (f != f) return (u16)0x7FC0;
    b += 0x7FFFU + ((b >> 16) & 1U);
    return (u16)(b >> 16);
}

__device__ __forceinline__ float load_f32(const void* p, i64 i, int dtype) {
    if (dtype == DT_F32) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    if (dtype == DT_F16) return half_bits_to_f32(h);
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ void store_from_f32(void* p, i64 i, float v, int dtype) {
    if (dtype == DT_F32) { ((float*)p)[i] = v; return; }
    ((u16*)p)[i] = dtype == DT_F16 ? f32_to_half_bits(v) : f32_to_bf16_bits(v);
}

__device__ __forceinline__ float max_nan(float a, float b) {
    if (a != a) return a;
    if (b != b) return b;
    return fmaxf(a, b);
}

// Block-wide max over blockDim.x <= 1024 threads; every thread gets the result.
__device__ __forceinline__ float block_reduce_max_nan(float v) {
    __shared__ float warp_max[32];
    __shared__ float result;
    unsigned lane = threadIdx.x & 31U, wid = threadIdx.x >> 5;
    for (int off = 16; off > 0; off >>= 1) v = max_nan(v, __shfl_down_sync(0xffffffffU, v, off));
    if (lane == 0) warp_max[wid] = v;
    __syncthreads();
    if (wid == 0) {
        unsigned nw = (blockDim.x + 31U) >> 5;
        v = lane < nw ? warp_max[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) v = max_nan(v, __shfl_down_sync(0xffffffffU, v, off));
        if (lane == 0) result = v;
    }
    __syncthreads();
    float r = result;
    __syncthreads();  // the shared slots may be reused by the caller's next reduction
    return r;
}

// QSGD element encode (compressors/qsgd.py): t = fl(fl(x*r) + half); q = clamp(floor(fl(t+u)), 0, M)
__device__ __forceinline__ u32 qsgd_code(float x, float r, float half, float M, u32 i, u32 key) {
    float t = __fadd_rn(__fmul_rn(x, r), half);
    float v = floorf(__fadd_rn(t, hash_uniform(i, key)));
    v = fminf(fmaxf(v, 0.0f), M);
    return (u32)v;
}

// r = fp32(M/2) / s, 0 when s is not > 0 (torch.where(s > 0, half / s, 0))
__device__ __forceinline__ float qsgd_inv_scale(float s, float half) {
    return s > 0.0f ? __fdiv_rn(half, s) : 0.0f;
}

// decode: w = fl(fl(2*s) / M); x' = fl(fl(q*w) - s)
__device__ __forceinline__ float qsgd_step(float s, float M) {
    return __fdiv_rn(__fmul_rn(2.0f, s), M);
}

__device__ __forceinline__ float qsgd_value(u32 q, float w, float s) {
    return __fsub_rn(__fmul_rn(__uint2float_rn(q), w), s);
}

__device__ __forceinline__ u32 get_code(const u8* packed, i64 i, int bits) {
    i64 bitpos = i * bits;
    return ((u32)packed[bitpos >> 3] >> (u32)(bitpos & 7)) & ((1U << bits) - 1U);
}

// i / chunk in 32-bit arithmetic where both fit (a 64-bit division is a long subroutine on the
// GPU, paid once per group of 8 by the decode kernels)
__device__ __forceinline__ i64 chunk_of(i64 i, i64 chunk) {
    return (i | chunk) < 0x80000000LL ? (i64)((u32)i / (u32)chunk) : i / chunk;
}

struct alignas(16) vec4u { u32 x, y, z, w; };
struct alignas(8) vec2u { u32 x, y; };

__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
    return ((unsigned long long)p & (bytes - 1U)) == 0;
}

__device__ __forceinline__ float bits16_to_f32(u32 h, int dtype) {
    return dtype == DT_F16 ? half_bits_to_f32((u16)h) : __uint_as_float(h << 16);
}

__device__ __forceinline__ u32 f32_to_bits16(float v, int dtype) {
    return dtype == DT_F16 ? (u32)f32_to_half_bits(v) : (u32)f32_to_bf16_bits(v);
}

// elements i..i+7 (i a multiple of 8) of a 16-byte aligned buffer
__device__ __forceinline__ void load8(const void* p, i64 i, int dtype, float v[8]) {
    if (dtype == DT_F32) {
        const vec4u* q = reinterpret_cast<const vec4u*>((const float*)p + i);
        vec4u a = q[0], b = q[1];
        v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y);
        v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
        v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y);
        v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
    } else {
        vec4u a = *reinterpret_cast<const vec4u*>((const u16*)p + i);
        u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = bits16_to_f32((w[k >> 1] >> (16 * (k & 1))) & 0xFFFFU, dtype);
    }
}

__device__ __forceinline__ void load8_tail(const void* p, i64 i, i64 n, int dtype, float v[8]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = i + k < n ? load_f32(p, i + k, dtype) : 0.0f;
}

__device__ __forceinline__ void store8(void* p, i64 i, int dtype, const float v[8]) {
    if (dtype == DT_F32) {
        vec4u* q = reinterpret_cast<vec4u*>((float*)p + i);
        vec4u a, b;
        a.x = __float_as_uint(v[0]); a.y = __float_as_uint(v[1]);
        a.z = __float_as_uint(v[2]); a.w = __float_as_uint(v[3]);
        b.x = __float_as_uint(v[4]); b.y = __float_as_uint(v[5]);
        b.z = __float_as_uint(v[6]); b.w = __float_as_uint(v[7]);
        q[0] = a;
        q[1] = b;
    } else {
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = f32_to_bits16(v[2 * k], dtype) | (f32_to_bits16(v[2 * k + 1], dtype) << 16);
        vec4u a;
        a.x = w[0]; a.y = w[1]; a.z = w[2]; a.w = w[3];
        *reinterpret_cast<vec4u*>((u16*)p + i) = a;
    }
}

__device__ __forceinline__ void store8_tail(void* p, i64 i, i64 n, int dtype, const float v[8]) {
#pragma unroll
    for (int k = 0; k < 8; ++k)
        if (i + k < n) store_from_f32(p, i + k, v[k], dtype);
}

// a group of 8 from element i: vectorised when `vec` (16-byte aligned base) and whole
__device__ __forceinline__ void load_group(const void* p, i64 i, i64 n, int dtype, bool vec, float v[8]) {
    if (vec && i + 8 <= n) load8(p, i, dtype, v);
    else load8_tail(p, i, n, dtype, v);
}

__device__ __forceinline__ void store_group(void* p, i64 i, i64 n, int dtype, bool vec, const float v[8]) {
    if (vec && i + 8 <= n) store8(p, i, dtype, v);
    else store8_tail(p, i, n, dtype, v);
}

// The `bits` bytes of 8 codes (bits * 8 bits, element i0 at the lowest bits) at byte `off` of a
// packed stream: one naturally aligned store when `vec` (off is a multiple of bits), else bytes
// below nbytes only (the stream's last, partial group).
__device__ __forceinline__ void store_code_group(u8* packed, i64 off, unsigned long long g, int bits, bool vec,
                                                 i64 nbytes) {
    if (vec && off + bits <= nbytes) {
        if (bits == 1) packed[off] = (u8)g;
        else if (bits == 2) *reinterpret_cast<u16*>(packed + off) = (u16)g;
        else if (bits == 4) *reinterpret_cast<u32*>(packed + off) = (u32)g;
        else {
            vec2u w;
            w.x = (u32)g;
            w.y = (u32)(g >> 32);
            *reinterpret_cast<vec2u*>(packed + off) = w;
        }
        return;
    }
    for (int b = 0; b < bits && off + b < nbytes; ++b) packed[off + b] = (u8)(g >> (8 * b));
}

// The inverse: the 8 codes' `bits` bytes at byte `off` (bytes past nbytes read as 0).
__device__ __forceinline__ unsigned long long load_code_group(const u8* packed, i64 off, int bits, bool vec,
                                                              i64 nbytes) {
    if (vec && off + bits <= nbytes) {
        if (bits == 1) return packed[off];
        if (bits == 2) return *reinterpret_cast<const u16*>(packed + off);
        if (bits == 4) return *reinterpret_cast<const u32*>(packed + off);
        vec2u w = *reinterpret_cast<const vec2u*>(packed + off);
        return (unsigned long long)w.x | ((unsigned long long)w.y << 32);
    }
    unsigned long long g = 0;
    for (int b = 0; b < bits && off + b < nbytes; ++b) g |= (unsigned long long)packed[off + b] << (8 * b);
    return g;
}

#endif  // COMMPRESS_COMMON_CUH
