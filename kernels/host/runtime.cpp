// runtime.cpp: the execution model of the host build (see castor_host.h): a launch's blocks
// run one after another on the calling OS thread; a block's threads are fibers that switch at
// barriers and warp operations.
//
// Why fibers: a barrier or a warp operation needs every thread of its scope to arrive before
// any leaves, so each CUDA thread needs its own stack. One OS thread per CUDA thread (a
// 1024-thread block = 1024 OS threads) is far slower to create and to switch; a fiber switch
// here saves six registers and swaps the stack pointer. The cost: ThreadSanitizer cannot see
// the fibers' concurrency by itself, so the switches and the barriers are annotated for it
// (__tsan_switch_to_fiber, __tsan_release/__tsan_acquire), and AddressSanitizer is told of
// each stack switch (__sanitizer_start/finish_switch_fiber).
//
// Scheduling: a run queue of the block's threads. A thread runs until it waits at a barrier or
// a warp operation, or exits, then switches straight to the next queued thread; the thread
// that completes a barrier or a warp operation queues the others and goes on. Two orders
// (`castor_host_launch::order`): forward starts threads in index order and queues released
// threads at the back (the warps take turns at every warp operation); reverse starts them,
// and the blocks, in the reverse order and queues the lanes a warp operation releases at the
// front (a warp runs ahead of the others as far as it can before a barrier). A kernel whose
// blocks wait for earlier ones (castor_common.cuh's wait_flag) runs its blocks in index order
// either way (order 2: the reverse thread order, blocks in index order), as the device
// dispatches them. A missing
// barrier usually gives different results in the two; ThreadSanitizer reports it as a race
// whatever the order.
//
// Memory order under ThreadSanitizer: a __syncthreads is a release by every arriving thread
// and an acquire by every leaving one, as on the device; __syncwarp the same for its lanes.
// Shuffles, votes and matches exchange values but order no memory (the device gives them no
// memory-ordering guarantee). Every thread of a block starts after the block's setup and the
// previous blocks, so races between blocks are not reported (blocks run in sequence here).
//
// This file is compiled without sanitizer instrumentation: its own bookkeeping (the thread
// states, the exchanged values) is invisible to the sanitizers, which see the kernels only.

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include <string>

#include "castor_host.h"
#include "castor_host_entries.h"

#if defined(CASTOR_HOST_ASAN)
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                     size_t* size_old);
void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
}
#endif
#if defined(CASTOR_HOST_TSAN)
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
// __tsan_switch_to_fiber_no_sync: a switch is not a synchronization; what orders the threads
// is released and acquired explicitly.
static const unsigned kTsanNoSync = 1;
#define CASTOR_TSAN_RELEASE(p) __tsan_release(p)
#define CASTOR_TSAN_ACQUIRE(p) __tsan_acquire(p)
#else
#define CASTOR_TSAN_RELEASE(p) ((void)0)
#define CASTOR_TSAN_ACQUIRE(p) ((void)0)
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace castor_host {

__thread const ThreadRef* tls_thread CASTOR_HOST_TLS = nullptr;
__thread const BlockRef* tls_block CASTOR_HOST_TLS = nullptr;
float (*host_expf)(float) = nullptr;
float (*host_erff)(float) = nullptr;

namespace {

// ---- contexts ----------------------------------------------------------------------------------

#if defined(CASTOR_HOST_ASAN) || defined(CASTOR_HOST_TSAN)
const size_t kStackBytes = 256 << 10;  // instrumented frames are larger
#else
const size_t kStackBytes = 64 << 10;
#endif
const size_t kGuardBytes = 4096;  // a PROT_NONE page below each stack

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save
// and resumes the context whose stack pointer is `next` (System V ABI).
extern "C" void castor_host_switch(void** save, void* next);
asm(R"(
    .text
    .p2align 4
    .hidden castor_host_switch
    .globl castor_host_switch
    .type castor_host_switch, @function
castor_host_switch:
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
    .size castor_host_switch, .-castor_host_switch
)");

struct Context {
    void* sp = nullptr;
};
#else
struct Context {
    ucontext_t uc;
};
#endif

void fiber_entry();

// A stack to run on: a thread's fiber, or the OS thread's own stack (the scheduler's).
struct Fiber {
    Context ctx;
    char* stack = nullptr;  // the usable stack's lowest byte
    size_t size = 0;
    void* tsan = nullptr;
    void* asan_fake = nullptr;

    bool allocate() {
        void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return false;
        mprotect(p, kGuardBytes, PROT_NONE);
        stack = static_cast<char*>(p) + kGuardBytes;
        size = kStackBytes;
#if defined(CASTOR_HOST_TSAN)
        tsan = __tsan_create_fiber(0);
#endif
        return true;
    }

    void release() {
        if (stack != nullptr) munmap(stack - kGuardBytes, kStackBytes + kGuardBytes);
#if defined(CASTOR_HOST_TSAN)
        if (tsan != nullptr) __tsan_destroy_fiber(tsan);
#endif
        stack = nullptr;
        tsan = nullptr;
    }

    // A fresh start at fiber_entry. `color` staggers the stack tops: stacks a power of two
    // apart would put every fiber's live frames in the same cache sets.
    void reset(unsigned color) {
#if defined(CASTOR_HOST_ASAN)
        // An abandoned fiber (a failed launch) may leave poisoned frames behind.
        __asan_unpoison_memory_region(stack, size);
#endif
        asan_fake = nullptr;
#if defined(__x86_64__)
        const uintptr_t stagger = (uintptr_t(color) * 448u) % (kStackBytes / 2);
        const uintptr_t top =
            (reinterpret_cast<uintptr_t>(stack) + kStackBytes - stagger) & ~uintptr_t(15);
        void** sp = reinterpret_cast<void**>(top);
        *--sp = nullptr;                                // fiber_entry's return address
        *--sp = reinterpret_cast<void*>(&fiber_entry);  // where the first switch returns
        for (int i = 0; i < 6; ++i) *--sp = nullptr;    // rbp rbx r12-r15
        ctx.sp = sp;
#else
        getcontext(&ctx.uc);
        ctx.uc.uc_stack.ss_sp = stack;
        ctx.uc.uc_stack.ss_size = kStackBytes;
        ctx.uc.uc_link = nullptr;
        makecontext(&ctx.uc, &fiber_entry, 0);
#endif
    }
};

// Leaves `from` for `to`; returns when something switches back to `from`. `exiting`: `from`
// never resumes.
void switch_fiber(Fiber& from, Fiber& to, bool exiting) {
#if defined(CASTOR_HOST_ASAN)
    __sanitizer_start_switch_fiber(exiting ? nullptr : &from.asan_fake, to.stack, to.size);
#else
    (void)exiting;
#endif
#if defined(CASTOR_HOST_TSAN)
    __tsan_switch_to_fiber(to.tsan, kTsanNoSync);
#endif
#if defined(__x86_64__)
    castor_host_switch(&from.ctx.sp, to.ctx.sp);
#else
    swapcontext(&from.ctx.uc, &to.ctx.uc);
#endif
#if defined(CASTOR_HOST_ASAN)
    __sanitizer_finish_switch_fiber(from.asan_fake, nullptr, nullptr);
#endif
}

// ---- threads, warps, the block -------------------------------------------------------------------

enum State { kRunnable, kAtBarrier, kAtWarpOp, kExited };

const char* op_name(Collective k) {
    switch (k) {
    case kShflIdx: return "__shfl_sync";
    case kShflUp: return "__shfl_up_sync";
    case kShflDown: return "__shfl_down_sync";
    case kShflXor: return "__shfl_xor_sync";
    case kVoteAll: return "__all_sync";
    case kVoteAny: return "__any_sync";
    case kBallot: return "__ballot_sync";
    case kMatchAny: return "__match_any_sync";
    case kMatchAll: return "__match_all_sync";
    case kSyncWarp: return "__syncwarp";
    case kWarpMma: return "mma.sync (castor_host_warp_mma)";
    case kGather: return "ldmatrix (castor_host_gather)";
    }
    return "a warp operation";
}

struct Thread : ThreadRef {
    unsigned index = 0, lane = 0, warp = 0;
    State state = kRunnable;
    // The warp operation it is in: the value it gave, the result it gets.
    int arg = 0;
    unsigned long long value = 0, result = 0;
    Fiber fiber;
};

// A warp operation some lanes of `mask` have reached.
struct Pending {
    Collective kind;
    unsigned mask;
    int width;
    unsigned arrived;
};

struct Warp {
    unsigned lanes = 0;       // lanes the block has
    unsigned exited = 0;      // lanes that returned
    unsigned at_barrier = 0;  // lanes waiting at __syncthreads
    Pending pending[32];      // operations waiting for lanes, in no order
    int n_pending = 0;
#if defined(CASTOR_HOST_TSAN)
    char sync[2] = {};  // __syncwarp's release/acquire objects, by generation parity
    unsigned generation = 0;
#endif
};

const int kMaxThreads = 1024;
// The most dynamic shared memory a block may opt in to (H100: 227 KiB).
const unsigned long long kMaxDynamicShared = 232448;

struct Scheduler {
    Thread threads[kMaxThreads];
    Warp warps[kMaxThreads / 32];
    int allocated = 0;  // threads whose fiber has a stack
    BlockRef block{};
    int n = 0, exited = 0, at_barrier = 0;
    bool reverse = false;
    // The run queue: a ring of thread indices (a thread is queued at most once).
    int queue[kMaxThreads];
    int head = 0, queued = 0;
    Fiber main;  // the OS thread's own stack: where a block starts and ends
    Thread* current = nullptr;
    void (*thunk)(void*) = nullptr;
    void* args = nullptr;
    bool failed = false;
    std::string error;
    // The running launch's dynamic shared memory (`CASTOR_DYNAMIC_SHARED`): exactly its
    // `shared_bytes`, so AddressSanitizer reports a byte past them; refilled for every block.
    unsigned char* dynamic_shared = nullptr;
    size_t dynamic_bytes = 0;
#if defined(CASTOR_HOST_TSAN)
    char barrier_sync[2] = {};  // by the barrier generation's parity
    unsigned generation = 0;
    char block_start = 0, block_end = 0;
#endif

    ~Scheduler() {
        for (int i = 0; i < allocated; ++i) threads[i].fiber.release();
    }

    void push(Thread& t) {
        t.state = kRunnable;
        queue[(head + queued) % kMaxThreads] = int(t.index);
        ++queued;
    }

    // Queues `t` to run next.
    void push_front(Thread& t) {
        t.state = kRunnable;
        head = (head + kMaxThreads - 1) % kMaxThreads;
        queue[head] = int(t.index);
        ++queued;
    }
};

__thread Scheduler* tls_sched CASTOR_HOST_TLS = nullptr;

// One scheduler per OS thread, freed when the thread exits.
struct SchedulerOwner {
    Scheduler* s = nullptr;
    ~SchedulerOwner() { delete s; }
};
thread_local SchedulerOwner tls_owner;

Scheduler& scheduler() {
    if (tls_owner.s == nullptr) {
        tls_owner.s = new Scheduler();
#if defined(CASTOR_HOST_ASAN)
        // ASan needs the bounds of the stack it switches back to.
        pthread_attr_t attr;
        if (pthread_getattr_np(pthread_self(), &attr) == 0) {
            void* lo = nullptr;
            size_t size = 0;
            pthread_attr_getstack(&attr, &lo, &size);
            tls_owner.s->main.stack = static_cast<char*>(lo);
            tls_owner.s->main.size = size;
            pthread_attr_destroy(&attr);
        }
#endif
    }
    return *tls_owner.s;
}

std::string thread_name(const Thread& t) {
    char buf[64];
    snprintf(buf, sizeof buf, "thread (%u, %u, %u)", t.idx.x, t.idx.y, t.idx.z);
    return buf;
}

std::string hex(unsigned x) {
    char buf[16];
    snprintf(buf, sizeof buf, "0x%08x", x);
    return buf;
}

// The running thread waits (or has exited): the next queued thread runs, or, with none, the
// scheduler (the block is done, failed or deadlocked).
void run_next(Scheduler& s, Thread& t, bool exiting) {
    Fiber* to = &s.main;
    s.current = nullptr;
    if (s.queued > 0 && !s.failed) {
        Thread& next = s.threads[s.queue[s.head]];
        s.head = (s.head + 1) % kMaxThreads;
        --s.queued;
        s.current = &next;
        to = &next.fiber;
    }
    tls_thread = s.current;
    switch_fiber(t.fiber, *to, exiting);
}

// Records an error about thread `who` (the running one by default; the first error wins) and
// leaves the running fiber for good.
[[noreturn]] __attribute__((noinline, cold)) void fail(const std::string& message,
                                                       const Thread* who = nullptr) {
    Scheduler& s = *tls_sched;
    Thread& t = *s.current;
    if (!s.failed) {
        s.failed = true;
        s.error = thread_name(who != nullptr ? *who : t) + ": " + message;
    }
    t.state = kExited;
    run_next(s, t, true);
    __builtin_trap();  // a failed launch never resumes its fibers
}

// Every thread waiting at the block barrier may go on.
void release_barrier(Scheduler& s) {
    for (int k = 0; k < s.n; ++k) {
        Thread& o = s.threads[s.reverse ? s.n - 1 - k : k];
        if (o.state == kAtBarrier) s.push(o);
    }
    const int nwarps = (s.n + 31) / 32;
    for (int w = 0; w < nwarps; ++w) s.warps[w].at_barrier = 0;
    s.at_barrier = 0;
#if defined(CASTOR_HOST_TSAN)
    ++s.generation;
#endif
}

// A lane about to wait at the barrier or to exit must not be one a warp operation waits for.
void check_not_awaited(Scheduler& s, const Thread& t, const char* what) {
    const Warp& w = s.warps[t.warp];
    for (int i = 0; i < w.n_pending; ++i) {
        const Pending& p = w.pending[i];
        if (p.mask >> t.lane & 1u) {
            const Thread& o = s.threads[32 * t.warp + __builtin_ctz(p.arrived)];
            fail(std::string(what) + " while " + thread_name(o) + " waits for it at " +
                 op_name(p.kind) + " with mask " + hex(p.mask));
        }
    }
}

void fiber_entry() {
#if defined(CASTOR_HOST_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    Scheduler& s = *tls_sched;
    Thread& t = *s.current;
    CASTOR_TSAN_ACQUIRE(&s.block_start);
    s.thunk(s.args);
    check_not_awaited(s, t, "exits");
    t.state = kExited;
    ++s.exited;
    s.warps[t.warp].exited |= 1u << t.lane;
    // Threads that exit count as arrived at the block's barrier.
    if (s.at_barrier > 0 && s.at_barrier + s.exited == s.n) release_barrier(s);
    CASTOR_TSAN_RELEASE(&s.block_end);
    run_next(s, t, true);
    __builtin_trap();
}

// Why no thread of the block can proceed.
std::string deadlock(const Scheduler& s) {
    std::string m = "deadlock: no thread can proceed (" + std::to_string(s.at_barrier) +
                    " wait at __syncthreads, " + std::to_string(s.exited) + " exited";
    int shown = 0;
    for (int w = 0; w < (s.n + 31) / 32 && shown < 4; ++w) {
        for (int i = 0; i < s.warps[w].n_pending && shown < 4; ++i, ++shown) {
            const Pending& p = s.warps[w].pending[i];
            m += "; lanes " + hex(p.arrived) + " of warp " + std::to_string(w) + " wait at " +
                 op_name(p.kind) + " with mask " + hex(p.mask);
        }
    }
    return m + ")";
}

std::string block_name(const BlockRef& b) {
    char buf[64];
    snprintf(buf, sizeof buf, "block (%u, %u, %u)", b.idx.x, b.idx.y, b.idx.z);
    return buf;
}

// Runs one block to completion; false (with s.error) on an error.
bool run_block(Scheduler& s) {
    s.exited = 0;
    s.at_barrier = 0;
    s.failed = false;
    s.head = 0;
    s.queued = 0;
    const unsigned bx = s.block.dim.x, by = s.block.dim.y;
    for (int i = 0; i < s.n; ++i) {
        Thread& t = s.threads[i];
        t.index = unsigned(i);
        t.idx = uint3{unsigned(i) % bx, (unsigned(i) / bx) % by, unsigned(i) / (bx * by)};
        t.lane = unsigned(i) % 32;
        t.warp = unsigned(i) / 32;
        t.fiber.reset(unsigned(i));
    }
    for (int k = 0; k < s.n; ++k) s.push(s.threads[s.reverse ? s.n - 1 - k : k]);
    const int nwarps = (s.n + 31) / 32;
    for (int w = 0; w < nwarps; ++w) {
        const int lanes = s.n - 32 * w < 32 ? s.n - 32 * w : 32;
        s.warps[w].lanes = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
        s.warps[w].exited = 0;
        s.warps[w].at_barrier = 0;
        s.warps[w].n_pending = 0;
    }
    CASTOR_TSAN_RELEASE(&s.block_start);
    Thread& first = s.threads[s.queue[s.head]];
    s.head = (s.head + 1) % kMaxThreads;
    --s.queued;
    s.current = &first;
    tls_thread = &first;
    switch_fiber(s.main, first.fiber, false);
    // Back here when no thread is runnable.
    tls_thread = nullptr;
    CASTOR_TSAN_ACQUIRE(&s.block_end);
    if (s.failed) return false;
    if (s.exited != s.n) {
        s.error = deadlock(s);
        return false;
    }
    return true;
}

}  // namespace

// ---- what kernels call ----------------------------------------------------------------------------

void syncthreads() {
    Scheduler& s = *tls_sched;
    Thread& t = *s.current;
#if defined(CASTOR_HOST_TSAN)
    const unsigned gen = s.generation;
    __tsan_release(&s.barrier_sync[gen & 1]);
#endif
    if (__builtin_expect(s.warps[t.warp].n_pending != 0, 0)) {
        check_not_awaited(s, t, "reaches __syncthreads");
    }
    ++s.at_barrier;
    if (s.at_barrier + s.exited == s.n) {
        release_barrier(s);
    } else {
        s.warps[t.warp].at_barrier |= 1u << t.lane;
        t.state = kAtBarrier;
        run_next(s, t, false);
    }
    CASTOR_TSAN_ACQUIRE(&s.barrier_sync[gen & 1]);
}

unsigned active_mask() {
    Scheduler& s = *tls_sched;
    const Warp& w = s.warps[s.current->warp];
    return w.lanes & ~w.exited;
}

namespace {

[[noreturn]] __attribute__((noinline, cold)) void bad_mask(const Scheduler& s, const Thread& t,
                                                           Collective kind, unsigned mask,
                                                           int width) {
    const Warp& w = s.warps[t.warp];
    const std::string op = std::string(op_name(kind)) + " with mask " + hex(mask);
    if ((mask >> t.lane & 1u) == 0) {
        fail(op + ", which does not name the calling lane " + std::to_string(t.lane));
    }
    if ((mask & ~w.lanes) != 0) {
        fail(op + ": the warp has lanes " + hex(w.lanes) + " only (" + std::to_string(s.n) +
             " threads per block)");
    }
    if ((mask & w.exited) != 0) {
        fail(op + " names lane " + std::to_string(__builtin_ctz(mask & w.exited)) +
             ", which has exited");
    }
    if (kind >= kWarpMma) fail(op + ": the warp's matrix operations take all 32 lanes");
    fail(op + " and width " + std::to_string(width) + " (a power of two up to 32)");
}

[[noreturn]] __attribute__((noinline, cold)) void divergent(const Scheduler& s, const Warp& w,
                                                            const Pending& p, Collective kind,
                                                            unsigned mask) {
    const Thread& o = s.threads[32 * unsigned(&w - s.warps) + __builtin_ctz(p.arrived)];
    fail(std::string(op_name(kind)) + " with mask " + hex(mask) + " while " + thread_name(o) +
         " of its warp waits at " + op_name(p.kind) + " with mask " + hex(p.mask));
}

[[noreturn]] __attribute__((noinline, cold)) void at_barrier(const Scheduler& s, const Warp& w,
                                                             Collective kind, unsigned mask) {
    const Thread& o =
        s.threads[32 * unsigned(&w - s.warps) + __builtin_ctz(mask & w.at_barrier)];
    fail(std::string(op_name(kind)) + " with mask " + hex(mask) + " names " + thread_name(o) +
         ", which waits at __syncthreads");
}

[[noreturn]] __attribute__((noinline, cold)) void outside_mask(const Pending& p,
                                                               const Thread& reader, int src) {
    fail(std::string(op_name(p.kind)) + " reads lane " + std::to_string(src) +
             ", which is not in the mask " + hex(p.mask),
         &reader);
}

// castor_host_warp_mma over a whole warp: each lane's D += A B, summed as
// castor_common.cuh's warp_mma_shuffle sums it (lane l = 4 g + c holds A rows g and g + 8 and
// B column g; products in k order, each multiply and add rounded to F32), so that replacing its
// 64 shuffles changes no bit. Every lane's sums are made before any D is written (a lane's D
// may be another's operand).
void warp_mma(const Scheduler& s, unsigned base) {
    const MmaFragments* f[32];
    for (int l = 0; l < 32; ++l) {
        f[l] = reinterpret_cast<const MmaFragments*>(s.threads[base + l].value);
    }
    float acc[32][4];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, c = l & 3;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        for (int k = 0; k < 16; ++k) {
            const int ra = (k & 1) + ((k >> 3) << 2);
            const int rb = (k & 1) + ((k >> 3) << 1);
            const int part = (k & 7) >> 1;
            const float a_lo = f[g * 4 + part]->a[ra];
            const float a_hi = f[g * 4 + part]->a[ra + 2];
            const float b0 = f[(2 * c) * 4 + part]->b[rb];
            const float b1 = f[(2 * c + 1) * 4 + part]->b[rb];
            a0 += a_lo * b0;
            a1 += a_lo * b1;
            a2 += a_hi * b0;
            a3 += a_hi * b1;
        }
        acc[l][0] = a0;
        acc[l][1] = a1;
        acc[l][2] = a2;
        acc[l][3] = a3;
    }
    for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < 4; ++i) f[l]->d[i] += acc[l][i];
    }
}

// castor_host_gather over a whole warp: every lane receives every lane's value.
void gather(const Scheduler& s, unsigned base) {
    unsigned long long values[32];
    for (int l = 0; l < 32; ++l) {
        values[l] = reinterpret_cast<const GatherLane*>(s.threads[base + l].value)->value;
    }
    for (int l = 0; l < 32; ++l) {
        memcpy(reinterpret_cast<const GatherLane*>(s.threads[base + l].value)->all, values,
               sizeof values);
    }
}

// The results of a completed warp operation, in each lane's `result`.
void complete(Scheduler& s, const Pending& p, unsigned base) {
    if (p.kind == kWarpMma) return warp_mma(s, base);
    if (p.kind == kGather) return gather(s, base);
    const unsigned mask = p.mask;
    const int width = p.width;
    unsigned long long ballot = 0;
    bool all_equal = true;
    const unsigned long long first = s.threads[base + __builtin_ctz(mask)].value;
    for (unsigned m = mask; m != 0; m &= m - 1) {
        const Thread& o = s.threads[base + __builtin_ctz(m)];
        ballot |= (o.value != 0 ? 1ull : 0ull) << o.lane;
        all_equal = all_equal && o.value == first;
    }
    for (unsigned m = mask; m != 0; m &= m - 1) {
        Thread& o = s.threads[base + __builtin_ctz(m)];
        const int lane = int(o.lane);
        const int seg = lane & ~(width - 1);
        int src = -1;
        unsigned long long r = 0;
        switch (p.kind) {
        case kShflIdx: src = seg + (o.arg & (width - 1)); break;
        case kShflUp: src = lane - o.arg < seg ? lane : lane - o.arg; break;
        case kShflDown: src = lane + o.arg >= seg + width ? lane : lane + o.arg; break;
        case kShflXor:
            src = lane ^ o.arg;
            if (src >= seg + width || src < 0) src = lane;
            break;
        case kVoteAll: r = (ballot & mask) == mask ? 1 : 0; break;
        case kVoteAny: r = ballot != 0 ? 1 : 0; break;
        case kBallot: r = ballot; break;
        case kMatchAny:
            for (unsigned q = mask; q != 0; q &= q - 1) {
                const Thread& u = s.threads[base + __builtin_ctz(q)];
                if (u.value == o.value) r |= 1ull << u.lane;
            }
            break;
        case kMatchAll: r = all_equal ? mask : 0; break;
        case kSyncWarp:
        case kWarpMma:
        case kGather: break;
        }
        if (src >= 0) {
            if (src > 31 || (mask >> src & 1u) == 0) outside_mask(p, o, src);
            r = s.threads[base + unsigned(src)].value;
        }
        o.result = r;
    }
}

}  // namespace

unsigned long long warp_op(Collective kind, unsigned mask, unsigned long long value, int arg,
                           int width) {
    Scheduler& s = *tls_sched;
    Thread& t = *s.current;
    Warp& w = s.warps[t.warp];
    const unsigned me = 1u << t.lane;
    const unsigned base = 32 * t.warp;
    if ((mask & me) == 0 || (mask & ~w.lanes) != 0 || (mask & w.exited) != 0 ||
        (kind <= kShflXor && (width < 1 || width > 32 || (width & (width - 1)) != 0)) ||
        (kind >= kWarpMma && mask != 0xffffffffu)) {
        bad_mask(s, t, kind, mask, width);
    }
    // Lanes of the mask must all make this same operation; none may wait at the barrier.
    Pending* group = nullptr;
    for (int i = 0; i < w.n_pending; ++i) {
        Pending& p = w.pending[i];
        if ((p.mask & mask) == 0) continue;
        if (p.kind != kind || p.mask != mask || p.width != width) divergent(s, w, p, kind, mask);
        group = &p;
    }
    if (group == nullptr) {
        if ((mask & w.at_barrier) != 0) at_barrier(s, w, kind, mask);
        group = &w.pending[w.n_pending++];
        *group = Pending{kind, mask, width, 0};
    }
    t.arg = arg;
    t.value = value;
#if defined(CASTOR_HOST_TSAN)
    const unsigned gen = w.generation;
    if (kind == kSyncWarp) __tsan_release(&w.sync[gen & 1]);
#endif
    group->arrived |= me;
    if (group->arrived != mask) {
        t.state = kAtWarpOp;
        run_next(s, t, false);
    } else {
        // The last lane to arrive computes every lane's result and queues the others.
        const Pending done = *group;
        *group = w.pending[--w.n_pending];
#if defined(CASTOR_HOST_TSAN)
        if (kind == kSyncWarp) ++w.generation;
#endif
        complete(s, done, base);
        // Forward: the lanes rejoin the back of the queue, so warps take turns. Reverse: they
        // run next, so a warp runs ahead of the others as far as it can before a barrier.
        for (unsigned lane = 0; lane < 32; ++lane) {
            if ((mask >> lane & 1u) == 0 || lane == t.lane) continue;
            Thread& o = s.threads[base + lane];
            if (s.reverse) {
                s.push_front(o);
            } else {
                s.push(o);
            }
        }
    }
#if defined(CASTOR_HOST_TSAN)
    if (kind == kSyncWarp) __tsan_acquire(&w.sync[gen & 1]);
#endif
    return t.result;
}

}  // namespace castor_host

using namespace castor_host;

// ---- the launch ---------------------------------------------------------------------------------

int castor_host::run_grid(const castor_host_launch* l, void (*thunk)(void*), void* args,
                          char* err, size_t err_len) {
    auto error = [&](const std::string& m) {
        snprintf(err, err_len, "%s", m.c_str());
        return 1;
    };
    if (host_expf == nullptr || host_erff == nullptr) {
        return error("the host process has not supplied expf/erff (castor_host_set_math)");
    }
    const unsigned long long threads =
        (unsigned long long)l->block[0] * l->block[1] * l->block[2];
    if (threads == 0 || threads > unsigned(kMaxThreads)) {
        return error("block (" + std::to_string(l->block[0]) + ", " +
                     std::to_string(l->block[1]) + ", " + std::to_string(l->block[2]) +
                     ") has " + std::to_string(threads) + " threads (1 to 1024)");
    }
    if (l->shared_bytes > kMaxDynamicShared) {
        return error(std::to_string(l->shared_bytes) +
                     " bytes of dynamic shared memory (the device allows " +
                     std::to_string(kMaxDynamicShared) + " per block)");
    }
    if (tls_sched != nullptr) return error("a launch from inside a kernel");
    Scheduler& s = scheduler();
    s.n = int(threads);
    while (s.allocated < s.n) {
        if (!s.threads[s.allocated].fiber.allocate()) return error("cannot map a fiber stack");
        ++s.allocated;
    }
    s.thunk = thunk;
    s.args = args;
    s.reverse = l->order != 0;
    s.block.dim = dim3{l->block[0], l->block[1], l->block[2]};
    s.block.grid = dim3{l->grid[0], l->grid[1], l->grid[2]};
#if defined(CASTOR_HOST_TSAN)
    s.main.tsan = __tsan_get_current_fiber();
#endif
    const unsigned long long blocks = (unsigned long long)l->grid[0] * l->grid[1] * l->grid[2];
    s.dynamic_bytes = l->shared_bytes;
    s.dynamic_shared = s.dynamic_bytes > 0 ? new unsigned char[s.dynamic_bytes] : nullptr;
    tls_sched = &s;
    tls_block = &s.block;
    bool ok = true;
    for (unsigned long long k = 0; k < blocks && ok; ++k) {
        const unsigned long long b = l->order == 1 ? blocks - 1 - k : k;
        s.block.idx = uint3{unsigned(b % l->grid[0]), unsigned(b / l->grid[0] % l->grid[1]),
                            unsigned(b / l->grid[0] / l->grid[1])};
        // What an earlier block left is not this block's: a NaN pattern in every float dtype.
        if (s.dynamic_shared != nullptr) memset(s.dynamic_shared, 0xFF, s.dynamic_bytes);
        ok = run_block(s);
    }
    tls_sched = nullptr;
    tls_block = nullptr;
    delete[] s.dynamic_shared;
    s.dynamic_shared = nullptr;
    s.dynamic_bytes = 0;
    if (!ok) return error(block_name(s.block) + ", " + s.error);
    return 0;
}

void castor_host::kernel_error(const char* message) { fail(message); }

unsigned char* castor_host::dynamic_shared() {
    return tls_sched != nullptr ? tls_sched->dynamic_shared : nullptr;
}

extern "C" CASTOR_HOST_API void castor_host_set_math(
    float (*expf_fn)(float), float (*erff_fn)(float)) {
    host_expf = expf_fn;
    host_erff = erff_fn;
}
