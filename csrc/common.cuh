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

// The device path is one PTX cvt each. Host compilers (the CPU emulator of tests/emu builds
// these files with g++) take the same conversions written in integer ops: exact widening;
// round to nearest even, overflow to inf, NaN -> 0x7FFF (cvt.rn.f16.f32's canonical NaN).
__device__ __forceinline__ float half_bits_to_f32(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    u32 sign = ((u32)h & 0x8000U) << 16, e = ((u32)h >> 10) & 0x1FU, m = (u32)h & 0x3FFU;
    if (e == 0x1FU) return __uint_as_float(sign | 0x7F800000U | (m << 13));  // inf, NaN
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
        float v = __fmul_rn(__uint2float_rn(m), 5.9604644775390625e-08f);
        return __uint_as_float(sign | __float_as_uint(v));
    }
    return __uint_as_float(sign | ((e + 112U) << 23) | (m << 13));
#endif
}

__device__ __forceinline__ u16 f32_to_half_bits(float f) {
#ifdef __CUDA_ARCH__
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u32 x = __float_as_uint(f), sign = (x >> 16) & 0x8000U, ax = x & 0x7FFFFFFFU;
    if (ax > 0x7F800000U) return (u16)0x7FFF;                // NaN
    if (ax >= 0x477FF000U) return (u16)(sign | 0x7C00U);     // >= 65520 rounds to inf
    u32 e = ax >> 23, base, rem, halfway;
    if (e < 113U) {  // below 2^-14: a subnormal half (units of 2^-24) or zero
        if (ax < 0x33000000U) return (u16)sign;              // <= 2^-25 rounds to zero
        u32 m = (ax & 0x7FFFFFU) | 0x800000U, s = 126U - e;  // value = m * 2^(e-150)
        base = m >> s;
        rem = m & ((1U << s) - 1U);
        halfway = 1U << (s - 1U);
    } else {
        base = ((e - 112U) << 10) | ((ax >> 13) & 0x3FFU);
        rem = ax & 0x1FFFU;
        halfway = 0x1000U;
    }
    if (rem > halfway || (rem == halfway && (base & 1U))) base++;  // a carry bumps the exponent
    return (u16)(sign | base);
#endif
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

#endif  // COMMPRESS_COMMON_CUH
