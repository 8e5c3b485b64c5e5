// cuda_emu.h -- a CUDA execution emulator for the csrc/ kernels: compile a .cu file UNMODIFIED as
// host C++20 (g++ -x c++ -std=c++20 -ffp-contract=off -include cuda_emu.h) and launch its
// kernels on the CPU (cuda_emu_runtime.cpp; Python launcher: tests/emu/emu.py).
//
// Execution model (see csrc/README.md, "CPU emulator", for what it cannot see):
//   * every CUDA thread of a block is its own fiber (own stack, own registers); the fibers of a
//     block run on one OS thread and switch only at synchronisation points: __syncthreads, the
//     warp *_sync intrinsics, atomics (in shuffle mode) and thread exit. Blocks run one after
//     another on each worker thread, in any order (a seed shuffles block order and the fiber
//     order of every scheduling round);
//   * __shared__ is `thread_local`: a block runs on one worker thread from start to end, so a
//     thread_local is per-block memory for the block's lifetime (static and function-local
//     __shared__ alike). `extern __shared__ T name[]` declares a thread_local array that the
//     build defines (EMU_DYNAMIC_SHARED_BYTES) and the runtime fills with garbage (0xFF bytes,
//     random bytes in shuffle mode) before each block: CUDA shared memory is uninitialised;
//   * warp intrinsics exchange values through per-warp slots with a barrier over the lanes of
//     the mask; a lane that is in the mask but does not arrive (exited, or waiting elsewhere)
//     is reported as a deadlock instead of hanging; concurrent different masks in one warp
//     are reported as an error (real hardware allows disjoint ones: the kernels do not use them);
//   * float arithmetic: the _rn intrinsics are plain IEEE binary32 operations (SSE, round to
//     nearest even, no contraction), conversions round to nearest even; float atomicAdd on
//     global memory is emulated with flush-to-zero of inputs and result, as the hardware does
//     (PTX atom.global.add.f32);
//   * threadIdx / blockIdx / blockDim / gridDim read the running fiber's and block's state.
#ifndef COMMPRESS_CUDA_EMU_H
#define COMMPRESS_CUDA_EMU_H

#include <atomic>
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
#define __shared__ thread_local
#define __constant__ const

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
    const BlockCtx* block;
    void* worker;
    void* fiber;
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
void atomic_point();                  // a scheduling point before an atomic (shuffle mode)
[[noreturn]] void fail(const char* what);

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
#define blockIdx (::emu::self()->block->bid)
#define blockDim (::emu::self()->block->bdim)
#define gridDim (::emu::self()->block->gdim)
#define warpSize 32

// -- synchronisation ----------------------------------------------------------------------------
inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffU) {
    emu::warp_exchange(mask, emu::OP_SYNCWARP, 0);
    emu::warp_done_reading();
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

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

// -- atomics (std::atomic_ref: blocks may run on several worker threads) ------------------------
#define EMU_ATOMIC_RMW(name, T, expr)                                   \
    inline T name(T* p, T v) {                                          \
        emu::atomic_point();                                            \
        std::atomic_ref<T> a(*p);                                       \
        T old = a.load();                                               \
        while (!a.compare_exchange_weak(old, (T)(expr))) {}             \
        return old;                                                     \
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
    emu::atomic_point();
    std::atomic_ref<T> a(*p);
    T old = compare;
    a.compare_exchange_strong(old, val);
    return old;
}

// -- launch glue (used by the generated exports; see emu.py) ------------------------------------
namespace emu {

struct LaunchCfg {
    unsigned grid[3];
    unsigned block[3];
    unsigned long long shared_bytes;   // dynamic shared memory requested by the launch
    unsigned long long seed;           // 0: in-order schedule; else shuffled with this seed
    int workers;                       // OS threads running blocks (>= 1)
};

using Thunk = void (*)(void* args);
// Runs thunk(args) as every thread of every block; 0 on success, else writes err.
int run_grid(const LaunchCfg* cfg, Thunk thunk, void* args, char* err, int errlen);
// Registers a dynamic shared memory array (extern __shared__): its per-thread address getter.
int register_dynamic_shared(void* (*addr)(), unsigned long long bytes);

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

// Definition of an `extern __shared__ T name[]` array, registered for garbage-filling per block.
#ifndef EMU_DYNAMIC_SHARED_BYTES
#define EMU_DYNAMIC_SHARED_BYTES (48 * 1024)
#endif
#define EMU_DYNAMIC_SHARED(T, name)                                                               \
    alignas(16) thread_local T name[EMU_DYNAMIC_SHARED_BYTES / sizeof(T)];                       \
    static int emu_reg_##name = emu::register_dynamic_shared(                                     \
        []() -> void* { return (void*)name; }, EMU_DYNAMIC_SHARED_BYTES);

#endif  // COMMPRESS_CUDA_EMU_H
