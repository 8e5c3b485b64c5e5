// cuda_emu_runtime.cpp -- scheduler of the CUDA emulator (cuda_emu.h): fibers, barriers, warp
// exchange, block order, shared memory arenas, the per-access callbacks of the instrumented
// kernels, error reporting. Built once per source hash by tests/emu/cuda_emu.py; this file is
// NOT compiled with -fsanitize=thread (its own accesses are not scheduling points).
//
// Each worker OS thread runs `resident` blocks at a time; their blockDim threads are fibers
// that switch at synchronisation points and, with `interleave` > 0, at memory accesses of the
// kernels (a fiber runs until it waits or yields, then the scheduler resumes the next one). A
// scheduling round resumes every unfinished fiber once, in index order or, with a seed, in a
// fresh random order each round; a round in which no fiber makes progress is a deadlock and
// fails the launch with a description instead of hanging.
#include "cuda_emu.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <cinttypes>
#include <vector>

#include <sys/mman.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

#if defined(__x86_64__)
// Minimal context switch (System V x86-64): callee-saved registers on the old stack, then the
// stack pointer swap (a few ns, where glibc's swapcontext makes a sigprocmask system call per
// switch). MXCSR and the x87 control word are not switched: nothing here changes them, and a
// fiber starts with the (shared) modes of its OS thread.
extern "C" void emu_switch(void** save_sp, void* load_sp);
extern "C" void emu_fiber_start();
asm(R"(
    .text
    .p2align 4
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch

    .p2align 4
    .globl emu_fiber_start
    .hidden emu_fiber_start
    .type emu_fiber_start,@function
emu_fiber_start:
    movq %r12, %rdi
    call emu_fiber_main@PLT
    ud2
    .size emu_fiber_start, .-emu_fiber_start
)");
#else
#include <ucontext.h>
#endif

namespace emu {

namespace {

constexpr size_t kStack = EMU_STACK_BYTES;  // [FiberHead page][guard page][stack ... top]
constexpr size_t kLow = 8192;
constexpr size_t kRedzone = 64;             // bytes between shared slots (poisoned under ASan)
constexpr size_t kDynMax = 48 * 1024;       // dynamic shared memory a launch gets without opt-in

thread_local bool t_in_fiber = false;       // a fiber of this OS thread is running

struct Fiber {
    void* sp = nullptr;               // saved stack pointer while suspended
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
    char* stack = nullptr;            // kStack-aligned mapping, FiberHead at its start
    FiberHead* head = nullptr;
    unsigned slot = 0;                // its block's slot in the worker
    bool done = false;
    bool blocked = false;             // waits in a barrier: not resumed until released
    const char* waiting = nullptr;    // what it waits for (deadlock report)
    int read_buf = 0;                 // slot buffer of its last warp exchange
    void* fake_stack = nullptr;       // ASan fiber bookkeeping
};

struct WarpState {
    unsigned mask = 0;
    int op = 0;
    unsigned arrived = 0;
    unsigned arrived_lanes = 0;
    unsigned live_lanes = 0;
    uint64_t gen = 0;
    unsigned readers[2] = {0, 0};
    uint64_t slots[2][32] = {};
    std::vector<Fiber*> waiters;
};

// static __shared__ declarations: [offset, offset + size) of the block arena each
struct StaticSlot {
    size_t off, size;
};
std::mutex& registry_mutex() {
    static std::mutex m;
    return m;
}
std::vector<StaticSlot>& static_slots() {
    static std::vector<StaticSlot> v;
    return v;
}
size_t& static_end() {
    static size_t e = kRedzone;
    return e;
}
size_t dyn_offset() { return (static_end() + kRedzone + 127) & ~(size_t)127; }

// one resident block: its barrier, warps and shared memory
struct BlockSlot {
    BlockCtx ctx{};
    unsigned nthreads = 0, live = 0;
    unsigned bar_arrived = 0;
    uint64_t bar_gen = 0;
    std::vector<Fiber*> bar_waiters;
    std::vector<WarpState> warps;
    unsigned char* arena = nullptr;
    size_t arena_bytes = 0;
    ~BlockSlot() { std::free(arena); }
};

struct Worker {
    std::vector<Fiber> fibers;
    std::vector<std::unique_ptr<BlockSlot>> slots;
    unsigned nslots = 0;
    void* sched_sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    const void* sched_bottom = nullptr;
    size_t sched_size = 0;
    Fiber* running = nullptr;
    unsigned live = 0;
    uint64_t progress = 0;
    bool shuffle = false;
    std::mt19937_64 rng;
    uint64_t xs = 1;                  // xorshift state of the interleaving decisions
    uint64_t interleave_thr = 0;      // yield at an access when the next draw is below it
    Thunk thunk = nullptr;
    void* args = nullptr;
    std::string error;

    uint64_t draw() {
        xs ^= xs >> 12;
        xs ^= xs << 25;
        xs ^= xs >> 27;
        return xs * 0x2545F4914F6CDD1DULL;
    }
    ~Worker() {
        for (auto& f : fibers)
            if (f.stack) munmap(f.stack, kStack);
    }
    Worker() = default;
    Worker(const Worker&) = delete;
};

inline Worker* cur_worker() { return static_cast<Worker*>(self()->worker); }
inline Fiber* cur_fiber() { return static_cast<Fiber*>(self()->fiber); }
inline BlockSlot& slot_of(Worker& w, const Fiber* f) { return *w.slots[f->slot]; }

void switch_to_scheduler(Worker* W, Fiber* f) {
    t_in_fiber = false;
#if EMU_ASAN
    __sanitizer_start_switch_fiber(f->done ? nullptr : &f->fake_stack, W->sched_bottom, W->sched_size);
#endif
#if defined(__x86_64__)
    emu_switch(&f->sp, W->sched_sp);
#else
    swapcontext(&f->uc, &W->sched_uc);
#endif
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
    t_in_fiber = true;
}

void yield(const char* why) {
    Fiber* f = cur_fiber();
    f->waiting = why;
    switch_to_scheduler(cur_worker(), f);
    f->waiting = nullptr;
}

std::string where(const Fiber* f) {
    char buf[160];
    const ThreadCtx& c = f->head->ctx;
    const BlockCtx& b = f->head->blk;
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", b.bid.x, b.bid.y, b.bid.z,
                  c.tid.x, c.tid.y, c.tid.z);
    return buf;
}

void block_on(std::vector<Fiber*>& q, const char* why) {
    Fiber* f = cur_fiber();
    f->blocked = true;
    q.push_back(f);
    yield(why);
}

void release(std::vector<Fiber*>& q) {
    for (Fiber* f : q) f->blocked = false;
    q.clear();
}

void fiber_exit(Fiber* f) {
    Worker& w = *cur_worker();
    BlockSlot& b = slot_of(w, f);
    f->done = true;
    b.live--;
    w.live--;
    w.progress++;
    const ThreadCtx& c = f->head->ctx;
    WarpState& ws = b.warps[c.warp];
    ws.live_lanes &= ~(1U << c.lane);
    if (ws.arrived && ((ws.mask >> c.lane) & 1U) && !((ws.arrived_lanes >> c.lane) & 1U) &&
        w.error.empty())
        w.error = where(f) + " exited while lanes of its warp wait for it in a *_sync with mask " +
                  std::to_string(ws.mask) + " (undefined behaviour on a GPU)";
    if (b.bar_arrived && b.bar_arrived == b.live) {  // exited threads no longer hold a barrier
        b.bar_arrived = 0;
        b.bar_gen++;
        release(b.bar_waiters);
    }
}

}  // namespace

[[noreturn]] void fail(const char* what) {
    Worker* W = cur_worker();
    Fiber* f = cur_fiber();
    if (W->error.empty()) W->error = where(f) + ": " + what;
    f->done = true;  // never resumed
    slot_of(*W, f).live--;
    W->live--;
    switch_to_scheduler(W, f);
    std::abort();
}

}  // namespace emu

extern "C" __attribute__((visibility("hidden"))) void emu_fiber_main(void* p) {
    using namespace emu;
    Fiber* f = static_cast<Fiber*>(p);
    Worker* W = static_cast<Worker*>(f->head->worker);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &W->sched_bottom, &W->sched_size);
#endif
    t_in_fiber = true;
    W->thunk(W->args);
    fiber_exit(f);
    switch_to_scheduler(W, f);
    std::abort();  // a finished fiber is never resumed
}

#if !defined(__x86_64__)
static void emu_fiber_entry_uc(unsigned lo, unsigned hi) {
    emu_fiber_main((void*)(((uintptr_t)hi << 32) | lo));
}
#endif

namespace emu {
namespace {

void init_fiber(Worker& w, Fiber& f) {
    if (!f.stack) {  // a kStack-aligned kStack bytes: map twice the size, trim the ends
        void* m = mmap(nullptr, 2 * kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) std::abort();
        uintptr_t a = ((uintptr_t)m + kStack - 1) & ~(uintptr_t)(kStack - 1);
        if (a > (uintptr_t)m) munmap(m, a - (uintptr_t)m);
        uintptr_t end = (uintptr_t)m + 2 * kStack;
        if (end > a + kStack) munmap((void*)(a + kStack), end - (a + kStack));
        f.stack = reinterpret_cast<char*>(a);
        mprotect(f.stack + 4096, 4096, PROT_NONE);  // stack overflow faults instead of corrupting
        f.head = new (f.stack) FiberHead{};
    }
#if EMU_ASAN
    __asan_unpoison_memory_region(f.stack + kLow, kStack - kLow);
#endif
    f.head->worker = &w;
    f.head->fiber = &f;
    f.done = false;
    f.blocked = false;
    f.waiting = nullptr;
    f.fake_stack = nullptr;
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(f.stack + kStack)) & ~(uintptr_t)15;
    // pop order r15 r14 r13 r12 rbx rbp, then ret: after it rsp = top - 16 (16-aligned for the
    // call in emu_fiber_start)
    uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
    std::memset(sp, 0, 72);
    sp[3] = (uint64_t)(uintptr_t)&f;  // r12: the fiber
    sp[6] = (uint64_t)(uintptr_t)&emu_fiber_start;
    f.sp = sp;
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack + kLow;
    f.uc.uc_stack.ss_size = kStack - kLow;
    f.uc.uc_link = nullptr;
    uintptr_t p = (uintptr_t)&f;
    makecontext(&f.uc, (void (*)())emu_fiber_entry_uc, 2, (unsigned)p, (unsigned)(p >> 32));
#endif
}

void resume(Worker& w, Fiber& f) {
    w.running = &f;
#if EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack + kLow, kStack - kLow);
#endif
    t_in_fiber = true;
#if defined(__x86_64__)
    emu_switch(&w.sched_sp, f.sp);
#else
    swapcontext(&w.sched_uc, &f.uc);
#endif
    t_in_fiber = false;
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    w.running = nullptr;
}

std::string deadlock_report(Worker& w) {
    std::string s = "deadlock: ";
    int shown = 0;
    for (auto& f : w.fibers) {
        if (f.done || shown >= 4) continue;
        s += where(&f) + " waits in " + (f.waiting ? f.waiting : "?") + "; ";
        shown++;
    }
    s += std::to_string(w.live) + " threads unfinished";
    return s;
}

void fill_garbage(Worker& w, unsigned char* p, size_t n) {
    if (!w.shuffle) {
        std::memset(p, 0xFF, n);  // NaN as floats, -1 as integers
        return;
    }
    for (size_t i = 0; i < n; i += 8) {
        uint64_t r = w.rng();
        std::memcpy(p + i, &r, std::min<size_t>(8, n - i));
    }
}

// The block's shared memory before it starts: garbage in every declared byte; under ASan
// everything else (redzones, dynamic bytes past the launch's request) poisoned.
void prepare_arena(Worker& w, BlockSlot& b, const LaunchCfg& cfg) {
    const size_t dyn = dyn_offset(), need = dyn + kDynMax + kRedzone;
    if (b.arena_bytes < need) {
        std::free(b.arena);
        b.arena_bytes = (need + 127) & ~(size_t)127;
        b.arena = static_cast<unsigned char*>(std::aligned_alloc(128, b.arena_bytes));
        if (!b.arena) std::abort();
    }
#if EMU_ASAN
    __asan_unpoison_memory_region(b.arena, b.arena_bytes);
#endif
    for (const StaticSlot& s : static_slots()) fill_garbage(w, b.arena + s.off, s.size);
    fill_garbage(w, b.arena + dyn, cfg.shared_bytes);
#if EMU_ASAN
    __asan_poison_memory_region(b.arena, b.arena_bytes);
    for (const StaticSlot& s : static_slots()) __asan_unpoison_memory_region(b.arena + s.off, s.size);
    __asan_unpoison_memory_region(b.arena + dyn, cfg.shared_bytes);
#endif
}

// Runs `count` blocks together to completion; false (w.error set) on a failure.
bool run_blocks(Worker& w, const uint3* bids, unsigned count, const LaunchCfg& cfg) {
    const unsigned n = cfg.block[0] * cfg.block[1] * cfg.block[2];
    const unsigned total = n * count;
    while (w.slots.size() < count) w.slots.push_back(std::make_unique<BlockSlot>());
    if (w.fibers.size() < total) w.fibers.resize(total);
    w.nslots = count;
    w.live = total;
    for (unsigned s = 0; s < count; ++s) {
        BlockSlot& b = *w.slots[s];
        b.ctx.bid = bids[s];
        b.ctx.bdim = uint3{cfg.block[0], cfg.block[1], cfg.block[2]};
        b.ctx.gdim = uint3{cfg.grid[0], cfg.grid[1], cfg.grid[2]};
        b.nthreads = b.live = n;
        b.bar_arrived = 0;
        b.bar_waiters.clear();
        b.warps.assign((n + 31) / 32, WarpState{});
        for (unsigned i = 0; i < n; ++i) b.warps[i / 32].live_lanes |= 1U << (i % 32);
        prepare_arena(w, b, cfg);
        for (unsigned i = 0; i < n; ++i) {
            Fiber& f = w.fibers[s * n + i];
            init_fiber(w, f);
            f.slot = s;
            FiberHead& h = *f.head;
            h.blk = b.ctx;
            h.shared = b.arena;
            h.dyn_shared = b.arena + dyn_offset();
            ThreadCtx& c = h.ctx;
            c.lin = i;
            c.lane = i % 32;
            c.warp = i / 32;
            c.tid = uint3{i % cfg.block[0], (i / cfg.block[0]) % cfg.block[1], i / (cfg.block[0] * cfg.block[1])};
        }
    }
    std::vector<unsigned> order(total);
    std::iota(order.begin(), order.end(), 0U);
    while (w.live > 0) {
        if (w.shuffle) std::shuffle(order.begin(), order.end(), w.rng);
        uint64_t p0 = w.progress;
        for (unsigned i : order) {
            Fiber& f = w.fibers[i];
            if (f.done || f.blocked) continue;
            resume(w, f);
            if (!w.error.empty()) return false;
        }
        if (w.live > 0 && w.progress == p0) {
            w.error = deadlock_report(w);
            return false;
        }
    }
    return true;
}

// Every instrumented load and store of the kernels: alignment, then maybe a scheduling point.
inline void on_access(const void* p, unsigned size, bool aligned, bool write) {
    if (!t_in_fiber) return;  // launch glue on the calling thread, static initialisers
    FiberHead* h = self();
    const uintptr_t a = (uintptr_t)p;
    if (a - (uintptr_t)h < kStack) return;  // the thread's own stack: its registers / local memory
    if (aligned && (a & (size - 1))) {
        char buf[128];
        std::snprintf(buf, sizeof buf, "misaligned %u-byte %s at %p (CUDA needs natural alignment)", size,
                      write ? "store" : "load", p);
        fail(buf);
    }
    Worker* w = static_cast<Worker*>(h->worker);
    if (w->interleave_thr && w->draw() < w->interleave_thr) {
        w->progress++;
        yield(write ? "a store (interleaved)" : "a load (interleaved)");
    }
}

}  // namespace

void syncthreads() {
    Worker& w = *cur_worker();
    BlockSlot& b = slot_of(w, cur_fiber());
    uint64_t g = b.bar_gen;
    b.bar_arrived++;
    w.progress++;
    if (b.bar_arrived == b.live) {
        b.bar_arrived = 0;
        b.bar_gen++;
        release(b.bar_waiters);
        if (w.shuffle) yield("__syncthreads (released)");
        return;
    }
    while (b.bar_gen == g) block_on(b.bar_waiters, "__syncthreads");
}

const uint64_t* warp_exchange(unsigned mask, int op, uint64_t mine) {
    FiberHead* h = self();
    Worker& w = *static_cast<Worker*>(h->worker);
    Fiber* f = static_cast<Fiber*>(h->fiber);
    BlockSlot& b = slot_of(w, f);
    const unsigned lane = h->ctx.lane;
    WarpState& ws = b.warps[h->ctx.warp];
    if (!((mask >> lane) & 1U)) fail("a *_sync intrinsic called by a lane outside its mask");
    const unsigned nwarp = std::min(32U, b.nthreads - 32U * h->ctx.warp);
    if (nwarp < 32 && (mask >> nwarp)) fail("*_sync mask names lanes past the end of the block");
    int bi = (int)(ws.gen & 1U);
    while (ws.readers[bi] > 0) {  // the buffer's previous values are still being read
        yield("warp op (previous values unread)");
        bi = (int)(ws.gen & 1U);
    }
    if (ws.arrived && (ws.mask != mask || ws.op != op))
        fail("lanes of one warp in different *_sync operations or masks at the same time "
             "(divergent warp code, or an emulator limit: concurrent disjoint masks)");
    if ((mask & ws.live_lanes) != mask) fail("*_sync mask names a lane that has exited");
    ws.mask = mask;
    ws.op = op;
    ws.slots[bi][lane] = mine;
    ws.arrived++;
    ws.arrived_lanes |= 1U << lane;
    w.progress++;
    f->read_buf = bi;
    const uint64_t g = ws.gen;
    if (ws.arrived == (unsigned)__builtin_popcount(mask)) {
        ws.arrived = 0;
        ws.arrived_lanes = 0;
        ws.readers[bi] = (unsigned)__builtin_popcount(mask);
        ws.gen++;
        release(ws.waiters);
        if (w.shuffle) yield("warp op (released)");
    } else {
        while (ws.gen == g) block_on(ws.waiters, "a warp *_sync");
    }
    return ws.slots[bi];
}

void warp_done_reading() {
    FiberHead* h = self();
    Worker& w = *static_cast<Worker*>(h->worker);
    Fiber* f = static_cast<Fiber*>(h->fiber);
    slot_of(w, f).warps[h->ctx.warp].readers[f->read_buf]--;
    w.progress++;
}

void check_align(const void* p, unsigned size, const char* what) {
    if (!t_in_fiber || !((uintptr_t)p & (size - 1))) return;
    char buf[128];
    std::snprintf(buf, sizeof buf, "misaligned %s of %u bytes at %p (CUDA needs natural alignment)", what, size, p);
    fail(buf);
}

void atomic_point(const void* p, unsigned size) {
    check_align(p, size, "atomic");
    Worker* w = cur_worker();
    if (w->shuffle || w->interleave_thr) {
        w->progress++;
        yield("atomic");
    }
}

uint64_t atomic_load_bits(const void* p, unsigned size) {
    switch (size) {
        case 4: return __atomic_load_n(static_cast<const uint32_t*>(p), __ATOMIC_SEQ_CST);
        case 8: return __atomic_load_n(static_cast<const uint64_t*>(p), __ATOMIC_SEQ_CST);
        case 2: return __atomic_load_n(static_cast<const uint16_t*>(p), __ATOMIC_SEQ_CST);
        default: return __atomic_load_n(static_cast<const uint8_t*>(p), __ATOMIC_SEQ_CST);
    }
}

template <class U> static bool cas_as(void* p, uint64_t* expected, uint64_t desired) {
    U e = (U)*expected;
    bool ok = __atomic_compare_exchange_n(static_cast<U*>(p), &e, (U)desired, false, __ATOMIC_SEQ_CST,
                                          __ATOMIC_SEQ_CST);
    *expected = e;
    return ok;
}

bool atomic_cas_bits(void* p, unsigned size, uint64_t* expected, uint64_t desired) {
    switch (size) {
        case 4: return cas_as<uint32_t>(p, expected, desired);
        case 8: return cas_as<uint64_t>(p, expected, desired);
        case 2: return cas_as<uint16_t>(p, expected, desired);
        default: return cas_as<uint8_t>(p, expected, desired);
    }
}

void fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

unsigned long long register_static_shared(unsigned long long size, unsigned long long align) {
    std::lock_guard<std::mutex> g(registry_mutex());
    size_t a = std::max<size_t>(align, 16);
    size_t off = (static_end() + a - 1) & ~(a - 1);
    static_slots().push_back({off, (size_t)size});
    static_end() = off + size + kRedzone;
    return off;
}

// -- PTX conversions: cvt.f32.f16 and cvt.{rn,rz,rm,rp}.f16.f32 ------------------------------
namespace {

uint32_t f16_to_f32_bits(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000U) << 16, e = ((uint32_t)h >> 10) & 0x1FU, m = (uint32_t)h & 0x3FFU;
    if (e == 0x1FU) return sign | 0x7F800000U | (m << 13);  // inf, NaN (payload kept)
    if (e == 0) {
        if (m == 0) return sign;
        int k = 0;  // normalise the subnormal: m * 2^-24 = 1.f * 2^(-14 - k)
        while (!(m & 0x400U)) {
            m <<= 1;
            k++;
        }
        return sign | ((uint32_t)(127 - 14 - k) << 23) | ((m & 0x3FFU) << 13);
    }
    return sign | ((e + 112U) << 23) | (m << 13);
}

enum Round { RN, RZ, RM, RP };

// IEEE binary32 -> binary16 with the given rounding; NaN -> 0x7FFF (cvt's canonical NaN)
uint16_t f32_to_f16_bits(uint32_t x, Round mode) {
    const uint32_t sign = (x >> 16) & 0x8000U, ax = x & 0x7FFFFFFFU;
    const bool neg = sign != 0;
    if (ax > 0x7F800000U) return 0x7FFF;
    if (ax == 0x7F800000U) return (uint16_t)(sign | 0x7C00U);
    uint32_t e = ax >> 23, m = ax & 0x7FFFFFU;
    uint64_t base, rem, half;
    if (e >= 113U) {  // normal range of binary16 (or above: the carry / exponent overflows below)
        if (e > 142U) {  // >= 2^16: beyond the largest finite half (65504)
            bool to_inf = mode == RN || (mode == RP && !neg) || (mode == RM && neg);
            return (uint16_t)(sign | (to_inf ? 0x7C00U : 0x7BFFU));
        }
        base = ((uint64_t)(e - 112U) << 10) | (m >> 13);
        rem = m & 0x1FFFU;
        half = 0x1000U;
    } else {  // a subnormal half: units of 2^-24
        uint64_t mm = e ? (m | 0x800000U) : m;
        unsigned s = 126U - (e ? e : 1U);  // value = mm * 2^(e' - 150) = (mm >> s) units
        if (s > 40U) s = 40U;
        base = mm >> s;
        rem = mm & ((1ULL << s) - 1ULL);
        half = 1ULL << (s - 1U);
    }
    bool up = false;
    if (mode == RN) up = rem > half || (rem == half && (base & 1U));
    else if (mode == RP) up = !neg && rem != 0;
    else if (mode == RM) up = neg && rem != 0;
    if (up) base++;  // a carry bumps the exponent (to inf past 65504)
    if (base > 0x7C00U) base = 0x7C00U;
    if (mode == RZ || (mode == RP && neg) || (mode == RM && !neg))
        if (base >= 0x7C00U) base = 0x7BFFU;
    return (uint16_t)(sign | base);
}

bool op_is(const char* text, const char* op) {
    size_t n = std::strlen(op);
    return std::strncmp(text, op, n) == 0 && (text[n] == ' ' || text[n] == '\t');
}

}  // namespace

uint64_t ptx_bits(const char* text, uint64_t in, unsigned in_size, unsigned out_size) {
    while (*text == ' ' || *text == '\t' || *text == '\n') ++text;
    if (op_is(text, "cvt.f32.f16") && in_size == 2 && out_size == 4) return f16_to_f32_bits((uint16_t)in);
    static const struct {
        const char* op;
        Round mode;
    } to_half[] = {{"cvt.rn.f16.f32", RN}, {"cvt.rz.f16.f32", RZ}, {"cvt.rm.f16.f32", RM}, {"cvt.rp.f16.f32", RP}};
    for (auto& c : to_half)
        if (op_is(text, c.op) && in_size == 4 && out_size == 2) return f32_to_f16_bits((uint32_t)in, c.mode);
    char buf[200];
    std::snprintf(buf, sizeof buf, "inline PTX the emulator does not know (%u -> %u bytes): %.120s", in_size, out_size,
                  text);
    fail(buf);
}

int run_grid(const LaunchCfg* cfg, Thunk thunk, void* args, char* err, int errlen) {
    auto report = [&](const std::string& m) {
        if (err && errlen > 0) std::snprintf(err, (size_t)errlen, "%s", m.c_str());
        return 1;
    };
    const unsigned long long nthreads = (unsigned long long)cfg->block[0] * cfg->block[1] * cfg->block[2];
    if (!nthreads || nthreads > 1024 || cfg->block[2] > 64) return report("invalid block dimensions");
    if (!cfg->grid[0] || !cfg->grid[1] || !cfg->grid[2] || cfg->grid[1] > 65535 || cfg->grid[2] > 65535)
        return report("invalid grid dimensions");
    if (cfg->shared_bytes > kDynMax)
        return report("dynamic shared memory " + std::to_string(cfg->shared_bytes) + " B exceeds the " +
                      std::to_string(kDynMax) + " B a launch gets without an opt-in attribute");
    const unsigned resident = (unsigned)std::max(1, std::min(cfg->resident, 16));
    const unsigned long long nblocks = (unsigned long long)cfg->grid[0] * cfg->grid[1] * cfg->grid[2];
    std::vector<unsigned long long> order(nblocks);
    std::iota(order.begin(), order.end(), 0ULL);
    if (cfg->seed) std::shuffle(order.begin(), order.end(), std::mt19937_64(cfg->seed));
    std::atomic<unsigned long long> next{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::string first_error;
    const double p = std::min(1.0, std::max(0.0, cfg->interleave));
    const uint64_t thr = p <= 0 ? 0 : p >= 1 ? ~0ULL : (uint64_t)(p * 18446744073709551616.0);

    auto work = [&](Worker& w, int wid) {
        w.error.clear();
        w.shuffle = cfg->seed != 0;
        w.rng.seed(cfg->seed * 0x9E3779B97F4A7C15ULL + (unsigned long long)wid);
        w.xs = (cfg->seed + 1) * 0xD1B54A32D192ED03ULL + (unsigned long long)wid * 0x9E3779B97F4A7C15ULL + 1;
        w.interleave_thr = thr;
        w.thunk = thunk;
        w.args = args;
        std::vector<uint3> bids(resident);
        for (unsigned long long k; !failed.load() && (k = next.fetch_add(resident)) < nblocks;) {
            unsigned count = (unsigned)std::min<unsigned long long>(resident, nblocks - k);
            for (unsigned s = 0; s < count; ++s) {
                unsigned long long b = order[k + s];
                bids[s] = uint3{(unsigned)(b % cfg->grid[0]), (unsigned)((b / cfg->grid[0]) % cfg->grid[1]),
                                (unsigned)(b / ((unsigned long long)cfg->grid[0] * cfg->grid[1]))};
            }
            if (!run_blocks(w, bids.data(), count, *cfg)) {
                std::lock_guard<std::mutex> g(mu);
                if (first_error.empty()) first_error = w.error;
                failed = true;
            }
        }
#if EMU_ASAN
        for (auto& s : w.slots)
            if (s->arena) __asan_unpoison_memory_region(s->arena, s->arena_bytes);
#endif
    };
    int nw = std::max(1, std::min<int>(cfg->workers, (int)std::min<unsigned long long>(nblocks, 64)));
    if (nw == 1) {
        static thread_local Worker cached;  // keeps its fiber stacks from launch to launch
        work(cached, 0);
    } else {
        std::vector<std::thread> ts;
        for (int i = 0; i < nw; ++i) ts.emplace_back([&work, i] { Worker w; work(w, i); });
        for (auto& t : ts) t.join();
    }
    return failed ? report(first_error) : 0;
}

}  // namespace emu

// -- the callbacks of -fsanitize=thread instrumentation (the kernel translation unit) ----------
#define EMU_HOOK extern "C" __attribute__((visibility("hidden")))
EMU_HOOK void __tsan_init() {}
EMU_HOOK void __tsan_func_entry(void*) {}
EMU_HOOK void __tsan_func_exit() {}
EMU_HOOK void __tsan_read_range(void*, unsigned long) {}
EMU_HOOK void __tsan_write_range(void*, unsigned long) {}
EMU_HOOK void __tsan_vptr_update(void**, void*) {}
EMU_HOOK void __tsan_vptr_read(void**) {}
#define EMU_ACCESS(n)                                                                     \
    EMU_HOOK void __tsan_read##n(void* p) { emu::on_access(p, n, true, false); }          \
    EMU_HOOK void __tsan_write##n(void* p) { emu::on_access(p, n, true, true); }          \
    EMU_HOOK void __tsan_unaligned_read##n(void* p) { emu::on_access(p, n, false, false); } \
    EMU_HOOK void __tsan_unaligned_write##n(void* p) { emu::on_access(p, n, false, true); }
EMU_ACCESS(1)
EMU_ACCESS(2)
EMU_ACCESS(4)
EMU_ACCESS(8)
EMU_ACCESS(16)
#undef EMU_ACCESS
