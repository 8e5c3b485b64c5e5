// cuda_emu_runtime.cpp -- scheduler of the CUDA emulator (cuda_emu.h): fibers, barriers, warp
// exchange, block order, error reporting. Built once per source hash by tests/emu/emu.py.
//
// One block at a time per worker OS thread: its blockDim threads are fibers that switch only
// at synchronisation points (a fiber runs until it waits, then the scheduler resumes the next
// one). A scheduling round resumes every unfinished fiber once, in index order or, with a seed,
// in a fresh random order each round; a round in which no fiber makes progress is a deadlock
// and fails the launch with a description instead of hanging.
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

struct Fiber {
    void* sp = nullptr;               // saved stack pointer while suspended
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
    char* stack = nullptr;            // kStack-aligned mapping, FiberHead at its start
    FiberHead* head = nullptr;
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

struct DynShared {
    void* (*addr)();
    unsigned long long bytes;
};

std::vector<DynShared>& dyn_shared() {
    static std::vector<DynShared> v;
    return v;
}

struct Worker {
    std::vector<Fiber> fibers;
    void* sched_sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    const void* sched_bottom = nullptr;
    size_t sched_size = 0;
    Fiber* running = nullptr;
    unsigned nthreads = 0, live = 0;
    unsigned bar_arrived = 0;
    uint64_t bar_gen = 0;
    std::vector<Fiber*> bar_waiters;
    std::vector<WarpState> warps;
    uint64_t progress = 0;
    bool shuffle = false;
    std::mt19937_64 rng;
    Thunk thunk = nullptr;
    void* args = nullptr;
    std::string error;
    BlockCtx block{};

    ~Worker() {
        for (auto& f : fibers)
            if (f.stack) munmap(f.stack, kStack);
    }
    Worker() = default;
    Worker(const Worker&) = delete;
};

inline Worker* cur_worker() { return static_cast<Worker*>(self()->worker); }
inline Fiber* cur_fiber() { return static_cast<Fiber*>(self()->fiber); }

void switch_to_scheduler(Worker* W, Fiber* f) {
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
}

void yield(const char* why) {
    Fiber* f = cur_fiber();
    f->waiting = why;
    switch_to_scheduler(cur_worker(), f);
    f->waiting = nullptr;
}

std::string where(const Worker& w, const Fiber* f) {
    char buf[160];
    const ThreadCtx& c = f->head->ctx;
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", w.block.bid.x, w.block.bid.y,
                  w.block.bid.z, c.tid.x, c.tid.y, c.tid.z);
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
    f->done = true;
    w.live--;
    w.progress++;
    const ThreadCtx& c = f->head->ctx;
    WarpState& ws = w.warps[c.warp];
    ws.live_lanes &= ~(1U << c.lane);
    if (ws.arrived && ((ws.mask >> c.lane) & 1U) && !((ws.arrived_lanes >> c.lane) & 1U) &&
        w.error.empty())
        w.error = where(w, f) + " exited while lanes of its warp wait for it in a *_sync with mask " +
                  std::to_string(ws.mask) + " (undefined behaviour on a GPU)";
    if (w.bar_arrived && w.bar_arrived == w.live) {  // exited threads no longer hold a barrier
        w.bar_arrived = 0;
        w.bar_gen++;
        release(w.bar_waiters);
    }
}

}  // namespace

[[noreturn]] void fail(const char* what) {
    Worker* W = cur_worker();
    Fiber* f = cur_fiber();
    if (W->error.empty()) W->error = where(*W, f) + ": " + what;
    f->done = true;  // never resumed
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
    f.head->block = &w.block;
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
#if defined(__x86_64__)
    emu_switch(&w.sched_sp, f.sp);
#else
    swapcontext(&w.sched_uc, &f.uc);
#endif
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    w.running = nullptr;
}

std::string deadlock_report(Worker& w) {
    std::string s = "deadlock in block (" + std::to_string(w.block.bid.x) + "," + std::to_string(w.block.bid.y) +
                    "," + std::to_string(w.block.bid.z) + "): ";
    int shown = 0;
    for (auto& f : w.fibers) {
        if (f.done || shown >= 4) continue;
        s += "thread " + std::to_string(f.head->ctx.lin) + " waits in " + (f.waiting ? f.waiting : "?") + "; ";
        shown++;
    }
    s += std::to_string(w.live) + " threads unfinished, " + std::to_string(w.nthreads - w.live) + " exited";
    return s;
}

// Runs one block to completion; false (w.error set) on a failure.
bool run_block(Worker& w, uint3 bid, const LaunchCfg& cfg) {
    w.block.bid = bid;
    const unsigned n = cfg.block[0] * cfg.block[1] * cfg.block[2];
    w.nthreads = w.live = n;
    w.bar_arrived = 0;
    w.bar_waiters.clear();
    w.warps.assign((n + 31) / 32, WarpState{});
    for (unsigned i = 0; i < n; ++i) w.warps[i / 32].live_lanes |= 1U << (i % 32);
    if (w.fibers.size() < n) w.fibers.resize(n);
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = w.fibers[i];
        init_fiber(w, f);
        ThreadCtx& c = f.head->ctx;
        c.lin = i;
        c.lane = i % 32;
        c.warp = i / 32;
        c.tid = uint3{i % cfg.block[0], (i / cfg.block[0]) % cfg.block[1], i / (cfg.block[0] * cfg.block[1])};
    }
    // CUDA shared memory is uninitialised: garbage in the dynamic buffers (NaN as floats)
    for (auto& d : dyn_shared()) {
        auto* p = static_cast<unsigned char*>(d.addr());
#if EMU_ASAN
        __asan_unpoison_memory_region(p, d.bytes);
#endif
        if (w.shuffle) {
            for (unsigned long long i = 0; i < d.bytes; ++i) p[i] = (unsigned char)w.rng();
        } else {
            std::memset(p, 0xFF, d.bytes);
        }
#if EMU_ASAN
        if (cfg.shared_bytes < d.bytes)  // past the launch's request: out of bounds
            __asan_poison_memory_region(p + cfg.shared_bytes, d.bytes - cfg.shared_bytes);
#endif
    }
    std::vector<unsigned> order(n);
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

}  // namespace

void syncthreads() {
    Worker& w = *cur_worker();
    uint64_t g = w.bar_gen;
    w.bar_arrived++;
    w.progress++;
    if (w.bar_arrived == w.live) {
        w.bar_arrived = 0;
        w.bar_gen++;
        release(w.bar_waiters);
        if (w.shuffle) yield("__syncthreads (released)");
        return;
    }
    while (w.bar_gen == g) block_on(w.bar_waiters, "__syncthreads");
}

const uint64_t* warp_exchange(unsigned mask, int op, uint64_t mine) {
    FiberHead* h = self();
    Worker& w = *static_cast<Worker*>(h->worker);
    Fiber* f = static_cast<Fiber*>(h->fiber);
    const unsigned lane = h->ctx.lane;
    WarpState& ws = w.warps[h->ctx.warp];
    if (!((mask >> lane) & 1U)) fail("a *_sync intrinsic called by a lane outside its mask");
    const unsigned nwarp = std::min(32U, w.nthreads - 32U * h->ctx.warp);
    if (nwarp < 32 && (mask >> nwarp)) fail("*_sync mask names lanes past the end of the block");
    int b = (int)(ws.gen & 1U);
    while (ws.readers[b] > 0) {  // the buffer's previous values are still being read
        yield("warp op (previous values unread)");
        b = (int)(ws.gen & 1U);
    }
    if (ws.arrived && (ws.mask != mask || ws.op != op))
        fail("lanes of one warp in different *_sync operations or masks at the same time "
             "(divergent warp code, or an emulator limit: concurrent disjoint masks)");
    if ((mask & ws.live_lanes) != mask) fail("*_sync mask names a lane that has exited");
    ws.mask = mask;
    ws.op = op;
    ws.slots[b][lane] = mine;
    ws.arrived++;
    ws.arrived_lanes |= 1U << lane;
    w.progress++;
    f->read_buf = b;
    const uint64_t g = ws.gen;
    if (ws.arrived == (unsigned)__builtin_popcount(mask)) {
        ws.arrived = 0;
        ws.arrived_lanes = 0;
        ws.readers[b] = (unsigned)__builtin_popcount(mask);
        ws.gen++;
        release(ws.waiters);
        if (w.shuffle) yield("warp op (released)");
    } else {
        while (ws.gen == g) block_on(ws.waiters, "a warp *_sync");
    }
    return ws.slots[b];
}

void warp_done_reading() {
    FiberHead* h = self();
    Worker& w = *static_cast<Worker*>(h->worker);
    w.warps[h->ctx.warp].readers[static_cast<Fiber*>(h->fiber)->read_buf]--;
    w.progress++;
}

void atomic_point() {
    Worker* w = cur_worker();
    if (w->shuffle) {
        w->progress++;
        yield("atomic");
    }
}

int register_dynamic_shared(void* (*addr)(), unsigned long long bytes) {
    dyn_shared().push_back({addr, bytes});
    return 1;
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
    for (auto& d : dyn_shared())
        if (cfg->shared_bytes > d.bytes)
            return report("dynamic shared memory " + std::to_string(cfg->shared_bytes) + " B exceeds the " +
                          std::to_string(d.bytes) + " B a launch gets without an opt-in attribute");
    const unsigned long long nblocks = (unsigned long long)cfg->grid[0] * cfg->grid[1] * cfg->grid[2];
    std::vector<unsigned long long> order(nblocks);
    std::iota(order.begin(), order.end(), 0ULL);
    if (cfg->seed) std::shuffle(order.begin(), order.end(), std::mt19937_64(cfg->seed));
    std::atomic<unsigned long long> next{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::string first_error;

    auto work = [&](Worker& w, int wid) {
        w.error.clear();
        w.shuffle = cfg->seed != 0;
        w.rng.seed(cfg->seed * 0x9E3779B97F4A7C15ULL + (unsigned long long)wid);
        w.thunk = thunk;
        w.args = args;
        w.block.bdim = uint3{cfg->block[0], cfg->block[1], cfg->block[2]};
        w.block.gdim = uint3{cfg->grid[0], cfg->grid[1], cfg->grid[2]};
        for (unsigned long long k; !failed.load() && (k = next.fetch_add(1)) < nblocks;) {
            unsigned long long b = order[k];
            uint3 bid{(unsigned)(b % cfg->grid[0]), (unsigned)((b / cfg->grid[0]) % cfg->grid[1]),
                      (unsigned)(b / ((unsigned long long)cfg->grid[0] * cfg->grid[1]))};
            if (!run_block(w, bid, *cfg)) {
                std::lock_guard<std::mutex> g(mu);
                if (first_error.empty()) first_error = w.error;
                failed = true;
            }
        }
        for (auto& d : dyn_shared()) {
#if EMU_ASAN
            __asan_unpoison_memory_region(d.addr(), d.bytes);
#else
            (void)d;
#endif
        }
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
