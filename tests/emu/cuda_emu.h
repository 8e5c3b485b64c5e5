// cuda_emu.h -- a CUDA execution emulator for the csrc/ kernels: compile the .cu files as host
// C++20 (g++ -x c++ -std=c++20 -ffp-contract=off -include cuda_emu.h, after cuda_emu.py's
// rewrite of the `__shared__` declarations and the inline PTX) and launch their kernels on the
// CPU (cuda_emu_runtime.cpp; Python launcher: tests/emu/cuda_emu.py).
//
// Execution model (see csrc/README.md, "CPU emulator", for what it cannot see):
//   * every CUDA thread of a block is its own fiber (own stack, own registers); the fibers of
//     `resident` blocks at once run on one OS thread. They switch at synchronisation points
//     (__syncthreads, the warp *_sync intrinsics, atomics, thread exit) and, with an
//     `interleave` probability p > 0, at any load or store of shared or global memory: the
//     kernel translation unit is compiled with -fsanitize=thread, whose per-access callbacks
//     (__tsan_read4, __tsan_write16, ...) the runtime implements itself, so a seeded schedule
//     can run another thread -- of this block or of another resident block -- between a
//     thread's read and its write (a lost update, a cross-block race). A seed shuffles block
//     order and the fiber order of every scheduling round;
//   * every load and store of shared or global memory is checked for natural alignment (a
//     misaligned access is an error on a GPU; x86 would allow it); the vector types (uint4,
//     float4, ...) check their 8/16-byte alignment in their copy operations, because the host
//     compiler splits aggregate copies into 4-byte accesses;
//   * `__shared__` memory is per block: static declarations become slots of a per-block arena
//     (offsets fixed when the library loads), `extern __shared__` arrays its dynamic part. Both
//     are filled with garbage before each block (0xFF bytes -- NaN as floats -- or random bytes
//     with a seed); in an AddressSanitizer build everything outside the declared slots and the
//     launch's dynamic bytes is poisoned;
//   * __CUDA_ARCH__ is defined (the device branches are the ones compiled) and inline PTX
//     `asm("cvt...." : "=h"(out) : "f"(in))` is rewritten to ::emu::ptx_asm, which emulates
//     the cvt instructions the kernels use with the rounding their modifiers name;
//   * warp intrinsics exchange values through per-warp slots with a barrier over the lanes of
//     the mask; a lane that is in the mask but does not arrive (exited, or waiting elsewhere)
//     is reported as a deadlock instead of hanging; concurrent different masks in one warp
//     are reported as an error (real hardware allows disjoint ones: the kernels do not use them);
//   * float arithmetic: the _rn intrinsics are plain IEEE binary32 operations (SSE, round to
//     nearest even, no contraction), conversions round to nearest even; float atomicAdd on
//     global memory is emulated with flush-to-zero of inputs and result, as the hardware does
//     (PTX atom.global.add.f32);
//   * threadIdx / blockIdx / blockDim / gridDim read the running fiber's own copy of its state.
#ifndef COMMPRESS_CUDA_EMU_H
#define COMMPRESS_CUDA_EMU_H

#include <atomic>
#include <memory>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// -- declaration specifiers -------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __constant__ const
#define __align__(n) alignas(n)
// __shared__ is not defined: cuda_emu.py rewrites every declaration (EMU_STATIC_SHARED,
// EMU_DYNAMIC_SHARED below), so one it could not parse fails the build

struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace emu {

enum WarpOp : int { OP_SHFL = 1, OP_BALLOT = 2, OP_SYNCWARP = 3, OP_VOTE = 4 };

struct ThreadCtx {
    uint3 tid;        // threadIdx
    unsigned lin;     // linear thread index in the block
    unsigned lane;    // lin % 32
    unsigned warp;    // lin / 32
};
struct BlockCtx {
    uint3 bid;        // blockIdx
    uint3 bdim;       // blockDim
    uint3 gdim;       // gridDim
};

// Every fiber stack is a EMU_STACK_BYTES-aligned mapping whose first bytes hold its FiberHead:
// the running CUDA thread is found from the stack pointer, with no thread_local access (a
// dlopen'ed library's TLS costs a __tls_get_addr call per access).
#if defined(__SANITIZE_ADDRESS__)
#define EMU_STACK_BYTES (1UL << 20)
#else
#define EMU_STACK_BYTES (1UL << 17)
#endif
struct FiberHead {
    ThreadCtx ctx;
    BlockCtx blk;                 // a copy: reading blockIdx touches no shared state
    void* worker;
    void* fiber;
    unsigned char* shared;        // the block's static __shared__ slots
    unsigned char* dyn_shared;    // the block's dynamic shared memory (extern __shared__)
};
__attribute__((always_inline)) inline FiberHead* self() {
    uintptr_t sp = (uintptr_t)__builtin_frame_address(0);
    return reinterpret_cast<FiberHead*>(sp & ~(uintptr_t)(EMU_STACK_BYTES - 1));
}

void syncthreads();
// Barrier over the lanes of `mask` (the caller's lane must be in it); every lane publishes
// `mine`; returns the warp's 32 slots (only the mask's lanes are meaningful), valid until this
// lane's next warp operation.
const uint64_t* warp_exchange(unsigned mask, int op, uint64_t mine);
void warp_done_reading();             // the lane has read the slots of its last warp_exchange
void atomic_point(const void* p, unsigned size);  // alignment check; a scheduling point (seeded)
uint64_t atomic_load_bits(const void* p, unsigned size);
bool atomic_cas_bits(void* p, unsigned size, uint64_t* expected, uint64_t desired);
void fence();
void check_align(const void* p, unsigned size, const char* what);  // fails the thread if misaligned
[[noreturn]] void fail(const char* what);
// registers a static __shared__ declaration at library load: its offset in the block's arena
unsigned long long register_static_shared(unsigned long long size, unsigned long long align);
// PTX emulation of `asm("<text>" : "=c"(out) : "c"(in))` (cvt between f32 and f16)
uint64_t ptx_bits(const char* text, uint64_t in, unsigned in_size, unsigned out_size);
template <class Out, class In> inline Out ptx_asm(const char* text, In in);

template <class T> inline uint64_t to_bits(T v) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "warp value of <= 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> inline T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

template <class T> inline T shfl_from(unsigned mask, T v, unsigned src) {
    const uint64_t* s = warp_exchange(mask, OP_SHFL, to_bits(v));
    if (!((mask >> src) & 1U)) fail("__shfl*_sync reads a lane outside the mask (undefined value)");
    T r = from_bits<T>(s[src]);
    warp_done_reading();
    return r;
}

inline float ftz(float v) {
    return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v;
}

}  // namespace emu

#define threadIdx (::emu::self()->ctx.tid)
#define blockIdx (::emu::self()->blk.bid)
#define blockDim (::emu::self()->blk.bdim)
#define gridDim (::emu::self()->blk.gdim)
#define warpSize 32

// -- synchronisation ----------------------------------------------------------------------------
inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffU) {
    emu::warp_exchange(mask, emu::OP_SYNCWARP, 0);
    emu::warp_done_reading();
}
inline void __threadfence() { emu::fence(); }
inline void __threadfence_block() { emu::fence(); }

template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    unsigned lane = emu::self()->ctx.lane;
    unsigned base = lane & ~(unsigned)(width - 1);
    return emu::shfl_from(mask, v, base + ((unsigned)src & (unsigned)(width - 1)));
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    unsigned lane = emu::self()->ctx.lane;
    unsigned src = lane ^ (unsigned)lane_mask;
    // outside the lane's width segment: the lane keeps its own value (PTX shfl.bfly clamp)
    if ((src & ~(unsigned)(width - 1)) != (lane & ~(unsigned)(width - 1))) src = lane;
    return emu::shfl_from(mask, v, src);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    unsigned lane = emu::self()->ctx.lane;
    unsigned seg = lane & (unsigned)(width - 1);
    unsigned src = seg + delta < (unsigned)width ? lane + delta : lane;
    return emu::shfl_from(mask, v, src);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    unsigned lane = emu::self()->ctx.lane;
    unsigned seg = lane & (unsigned)(width - 1);
    unsigned src = seg >= delta ? lane - delta : lane;
    return emu::shfl_from(mask, v, src);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    const uint64_t* s = emu::warp_exchange(mask, emu::OP_BALLOT, pred ? 1U : 0U);
    unsigned r = 0;
    for (unsigned l = 0; l < 32; ++l)
        if (((mask >> l) & 1U) && s[l]) r |= 1U << l;
    emu::warp_done_reading();
    return r;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }
inline unsigned __activemask() { return 0xffffffffU; }  // emulator: every lane of a warp converges

// -- integer intrinsics -------------------------------------------------------------------------
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1U) << (31 - i);
    return r;
}
template <class A, class B> inline std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)a < (C)b ? (C)a : (C)b;
}
template <class A, class B> inline std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)a > (C)b ? (C)a : (C)b;
}
template <class T> inline T __ldg(const T* p) { return *p; }

// -- float intrinsics: IEEE binary32, round to nearest even (compile with -ffp-contract=off) ----
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __uint2float_rn(unsigned v) { return (float)v; }   // SSE cvtsi2ss: current mode (RNE)
inline float __int2float_rn(int v) { return (float)v; }
inline float __ll2float_rn(long long v) { return (float)v; }
inline float __ull2float_rn(unsigned long long v) { return (float)v; }
inline int __float2int_rz(float v) { return (int)v; }
inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }
inline int __float2int_rd(float v) { return (int)std::floor(v); }
inline unsigned __float2uint_rz(float v) { return (unsigned)v; }
inline unsigned __float2uint_rn(float v) { return (unsigned)std::nearbyint(v); }
inline unsigned __float_as_uint(float v) { return emu::from_bits<unsigned>(emu::to_bits(v)); }
inline float __uint_as_float(unsigned v) { return emu::from_bits<float>(emu::to_bits(v)); }
inline int __float_as_int(float v) { return emu::from_bits<int>(emu::to_bits(v)); }
inline float __int_as_float(int v) { return emu::from_bits<float>(emu::to_bits(v)); }
// fabsf/floorf/fminf/fmaxf come from <cmath> (C semantics: fminf/fmaxf return the non-NaN operand,
// like CUDA's)

// -- atomics: out of line in the runtime (not instrumented), a scheduling point each -----------
#define EMU_ATOMIC_RMW(name, T, expr)                                                  \
    inline T name(T* p, T v) {                                                         \
        emu::atomic_point(p, sizeof(T));                                               \
        uint64_t bits = emu::atomic_load_bits(p, sizeof(T));                           \
        for (;;) {                                                                     \
            T old = emu::from_bits<T>(bits);                                           \
            if (emu::atomic_cas_bits(p, sizeof(T), &bits, emu::to_bits((T)(expr))))   \
                return old;                                                            \
        }                                                                              \
    }
EMU_ATOMIC_RMW(atomicAdd, int, old + v)
EMU_ATOMIC_RMW(atomicAdd, unsigned, old + v)
EMU_ATOMIC_RMW(atomicAdd, unsigned long long, old + v)
// global atom.add.f32 flushes subnormal inputs and results to sign-preserving zero
EMU_ATOMIC_RMW(atomicAdd, float, emu::ftz(emu::ftz(old) + emu::ftz(v)))
EMU_ATOMIC_RMW(atomicAdd, double, old + v)
EMU_ATOMIC_RMW(atomicSub, int, old - v)
EMU_ATOMIC_RMW(atomicSub, unsigned, old - v)
EMU_ATOMIC_RMW(atomicMax, int, old > v ? old : v)
EMU_ATOMIC_RMW(atomicMax, unsigned, old > v ? old : v)
EMU_ATOMIC_RMW(atomicMin, int, old < v ? old : v)
EMU_ATOMIC_RMW(atomicMin, unsigned, old < v ? old : v)
EMU_ATOMIC_RMW(atomicExch, int, v)
EMU_ATOMIC_RMW(atomicExch, unsigned, v)
EMU_ATOMIC_RMW(atomicExch, float, v)
EMU_ATOMIC_RMW(atomicOr, unsigned, old | v)
EMU_ATOMIC_RMW(atomicAnd, unsigned, old & v)
EMU_ATOMIC_RMW(atomicXor, unsigned, old ^ v)
#undef EMU_ATOMIC_RMW
template <class T> inline T atomicCAS(T* p, T compare, T val) {
    static_assert(std::is_integral_v<T>, "atomicCAS on integers");
    emu::atomic_point(p, sizeof(T));
    uint64_t bits = emu::to_bits(compare);
    emu::atomic_cas_bits(p, sizeof(T), &bits, emu::to_bits(val));
    return emu::from_bits<T>(bits);
}

// -- vector types: CUDA's alignment, checked on every copy (the host compiler splits a 16-byte
// aggregate copy into 4-byte accesses, which the per-access check alone would pass) ----------
#define EMU_VEC(name, T, A, ...)                                                                 \
    struct alignas(A) name {                                                                     \
        T __VA_ARGS__;                                                                           \
        name() = default;                                                                        \
        name(const name& o) { emu::check_align(&o, A, "vector load"); std::memcpy((void*)this, (const void*)&o, sizeof(name)); } \
        name& operator=(const name& o) {                                                         \
            emu::check_align(this, A, "vector store");                                           \
            emu::check_align(&o, A, "vector load");                                              \
            std::memcpy((void*)this, (const void*)&o, sizeof(name));                             \
            return *this;                                                                        \
        }                                                                                        \
    };
EMU_VEC(uint2, unsigned, 8, x, y)
EMU_VEC(uint4, unsigned, 16, x, y, z, w)
EMU_VEC(int2, int, 8, x, y)
EMU_VEC(int4, int, 16, x, y, z, w)
EMU_VEC(float2, float, 8, x, y)
EMU_VEC(float4, float, 16, x, y, z, w)
EMU_VEC(ushort2, unsigned short, 4, x, y)
EMU_VEC(ushort4, unsigned short, 8, x, y, z, w)
EMU_VEC(char4, signed char, 4, x, y, z, w)
EMU_VEC(uchar4, unsigned char, 4, x, y, z, w)
#undef EMU_VEC
inline uint2 make_uint2(unsigned x, unsigned y) { uint2 r; r.x = x; r.y = y; return r; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { uint4 r; r.x = x; r.y = y; r.z = z; r.w = w; return r; }
inline int4 make_int4(int x, int y, int z, int w) { int4 r; r.x = x; r.y = y; r.z = z; r.w = w; return r; }
inline float4 make_float4(float x, float y, float z, float w) { float4 r; r.x = x; r.y = y; r.z = z; r.w = w; return r; }
inline float2 make_float2(float x, float y) { float2 r; r.x = x; r.y = y; return r; }

template <class Out, class In> inline Out emu::ptx_asm(const char* text, In in) {
    return emu::from_bits<Out>(emu::ptx_bits(text, emu::to_bits(in), sizeof(In), sizeof(Out)));
}

// -- launch glue (used by the generated exports; see cuda_emu.py) -------------------------------
namespace emu {

struct LaunchCfg {
    unsigned grid[3];
    unsigned block[3];
    unsigned long long shared_bytes;   // dynamic shared memory requested by the launch
    unsigned long long seed;           // 0: in-order schedule; else shuffled with this seed
    int workers;                       // OS threads running blocks (>= 1)
    int resident;                      // blocks interleaved on one worker (>= 1)
    double interleave;                 // probability of a scheduling point at each memory access
};

using Thunk = void (*)(void* args);
// Runs thunk(args) as every thread of every block; 0 on success, else writes err.
int run_grid(const LaunchCfg* cfg, Thunk thunk, void* args, char* err, int errlen);
template <class T> constexpr char kind_of() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_floating_point_v<T>) return 'f';
    else if constexpr (std::is_signed_v<T>) return 'i';
    else return 'u';
}
// "p8,i4,..." : one kind letter and size per kernel parameter (checked by the launcher)
template <class... A> struct Sig {
    static const char* get() {
        static char buf[8 * sizeof...(A) + 1] = {};
        int o = 0;
        ((o += std::snprintf(buf + o, sizeof buf - o, "%s%c%d", o ? "," : "", kind_of<A>(), (int)sizeof(A))), ...);
        (void)o;
        return buf;
    }
};
template <class... A> Sig<A...> sig_of(void (*)(A...)) { return {}; }

template <class... A> int launch_argv(void (*k)(A...), const LaunchCfg* cfg, void** argv, char* err, int errlen) {
    struct Call {
        void (*k)(A...);
        std::tuple<A...> args;
    };
    Call call{k, [&]<std::size_t... I>(std::index_sequence<I...>) {
                  return std::tuple<A...>(*static_cast<A*>(argv[I])...);
              }(std::index_sequence_for<A...>{})};
    return run_grid(cfg, [](void* p) { auto* c = static_cast<Call*>(p); std::apply(c->k, c->args); },
                    &call, err, errlen);
}

}  // namespace emu

// One extern "C" entry per kernel: emu_launch_<k>(cfg, argv, err, errlen) where argv[i] points
// at the value of parameter i (as cuLaunchKernel's kernelParams), and emu_sig_<k>() its types.
#define EMU_EXPORT(k)                                                                              \
    extern "C" int emu_launch_##k(const emu::LaunchCfg* cfg, void** argv, char* err, int errlen) { \
        return emu::launch_argv(&k, cfg, argv, err, errlen);                                       \
    }                                                                                              \
    extern "C" const char* emu_sig_##k() { return decltype(emu::sig_of(&k))::get(); }

// The rewritten __shared__ declarations (cuda_emu.py): a static one is a reference into the
// running block's arena at the offset registered for it (emu_shared_off_<id>, defined at the end
// of the translation unit); a dynamic one points at the block's dynamic part.
#define EMU_STATIC_SHARED(T, name, dims, id)                                                      \
    typedef T emu_shared_t_##id dims;                                                            \
    emu_shared_t_##id& name = *reinterpret_cast<emu_shared_t_##id*>(::emu::self()->shared + ::emu::emu_shared_off_##id)
#define EMU_DYNAMIC_SHARED(T, name)                                                               \
    T* const name = reinterpret_cast<T*>(::emu::self()->dyn_shared)

#endif  // COMMPRESS_CUDA_EMU_H
