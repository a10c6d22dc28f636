// castor_host.h: what CUDA C code uses, for the host build of castor's kernels.
//
// The kernel sources (every family's .cu files and the fused kernels castor generates) compile unmodified
// as C++ for the host with this header force-included (`g++ -include castor_host.h`): no
// `#ifdef` host paths inside kernel bodies. The program emulator and the kernel tests run them
// on the CPU, so their arithmetic and control flow are tested where there is no GPU.
//
// Execution model (runtime.cpp): the blocks of a launch run one after another; the threads of
// a block run concurrently as fibers on one OS thread, switching only at barriers and warp
// operations, so `__syncthreads`, `__syncwarp`, shuffles, votes and `__match_any_sync` behave
// as on the device, with their lane semantics. Misuse the device leaves undefined is an error
// that names the thread: a warp operation whose mask names a lane that exited or waits
// elsewhere, a shuffle reading a lane outside the mask, lanes of one warp at different warp
// operations, a barrier that some threads never reach (deadlock).
//
// Memory: `__shared__` variables are `thread_local` statics, one instance per OS thread, so
// one per running block (blocks of a launch run in sequence). Dynamic shared memory is
// declared through `CASTOR_DYNAMIC_SHARED(name)` (castor_common.cuh: `extern __shared__` on the
// device); here the name is the runtime's buffer of exactly the launch's `shared_bytes`, filled
// with 0xFF before each block (up to the device's 227 KiB per block).
// Atomics are the host's atomics with CUDA's relaxed ordering.
//
// Arithmetic: compiled with -ffp-contract=off (the device build uses --fmad=false), IEEE
// single and double precision with round-to-nearest-even, no flush to zero, as the device with
// --prec-div=true --prec-sqrt=true --ftz=false. Where CUDA's math functions are not correctly
// rounded, the host build uses the CPU twin's function instead, so that a kernel run here is
// bit-identical to the CPU executor where its header says so; the device can differ there:
//   expf   the CPU executor's Cephes expf (runtime/src/cpu/math.rs, within 2 ulp); CUDA's expf
//          is within 2 ulp, so the two may differ by up to 2 ulp of F32 (supplied by the host
//          process: castor_host_set_math).
//   erff   the CPU executor's erff (the libm crate, within 1 ulp); CUDA's erff is within 2 ulp
//          (supplied by the host process).
//   tanhf, powf, sinf, cosf, sincosf: the C library's (the CPU executor calls the same); CUDA's
//          are within 2 (tanhf), 4 (powf) and 2 (sinf, cosf) ulp.
//   exp, log, pow (double): the C library's (correctly rounded in practice, as the CPU twin's
//          f64::exp/ln); CUDA's are within 1 (exp), 1 (log) and 2 (pow) ulp of F64.
//   sqrtf, sqrt, division: correctly rounded on both.
// Conversions: __float2half_rn / __float2bfloat16_rn round to nearest, ties to even, as the
// device and the CPU executor's `half` crate do; the _rz, _rd, _ru variants round toward zero,
// down and up. A NaN converts to a quiet NaN keeping the sign and the top payload bits (the
// `half` crate's result); the device returns the canonical NaN 0x7fff: both are NaN.
#pragma once

// ---- qualifiers ---------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ thread_local
#define __constant__ const
// __restrict__ is a GCC/Clang keyword already.

typedef unsigned int uint;

// ---- vector types ---------------------------------------------------------------------------

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(16) longlong2 { long long x, y; };

inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline double2 make_double2(double x, double y) { return {x, y}; }

// ---- the execution model's interface (runtime.cpp) -------------------------------------------

// The runtime is one shared library per process (loaded before the modules, its symbols
// global); modules call into it.
#define CASTOR_HOST_API __attribute__((visibility("default")))
// Its thread-local pointers are read at every threadIdx: initial-exec, no lookup call.
#define CASTOR_HOST_TLS __attribute__((tls_model("initial-exec")))

namespace castor_host {

// The running thread (fiber) and block. Kernels read them through threadIdx & co.
struct ThreadRef {
    uint3 idx;
};
struct BlockRef {
    uint3 idx;
    dim3 dim;
    dim3 grid;
};
// __thread rather than thread_local: no dynamic initialization, so no wrapper call per use.
extern __thread const ThreadRef* tls_thread CASTOR_HOST_API CASTOR_HOST_TLS;
extern __thread const BlockRef* tls_block CASTOR_HOST_API CASTOR_HOST_TLS;

// Warp operations, by kind (the lanes of one call must all make the same kind and mask).
enum Collective : int {
    kShflIdx = 0,
    kShflUp = 1,
    kShflDown = 2,
    kShflXor = 3,
    kVoteAll = 4,
    kVoteAny = 5,
    kBallot = 6,
    kMatchAny = 7,
    kMatchAll = 8,
    kSyncWarp = 9,
    // castor_common.cuh's host forms of its warp matrix operations (see below): the value is
    // the address of the lane's MmaFragments or GatherLane.
    kWarpMma = 10,
    kGather = 11,
};

// A lane's operands and accumulator of a warp's m16n8k16 product (castor_host_warp_mma).
struct MmaFragments {
    const float* a;  // 8 values
    const float* b;  // 4 values
    float* d;        // 4 values
};
// A lane's value and where it receives every lane's (castor_host_gather).
struct GatherLane {
    unsigned long long value;
    unsigned long long* all;  // 32 values, by lane
};

CASTOR_HOST_API void syncthreads();
// A warp operation: every lane of `mask` calls it with its `value` (and `arg`: the source
// lane, delta or lane mask of a shuffle; `width` of a shuffle); returns the lane's result.
CASTOR_HOST_API unsigned long long warp_op(Collective kind, unsigned mask, unsigned long long value, int arg,
                           int width);
// The lanes of the calling thread's warp that have not exited.
CASTOR_HOST_API unsigned active_mask();
// The running block's dynamic shared memory (null when the launch asked for none).
CASTOR_HOST_API unsigned char* dynamic_shared();
// Ends the running thread with an error naming it (the launch fails with `message`).
[[noreturn]] CASTOR_HOST_API void kernel_error(const char* message);
// F32 functions the host process supplies (the CPU executor's), see castor_host_set_math.
extern CASTOR_HOST_API float (*host_expf)(float);
extern CASTOR_HOST_API float (*host_erff)(float);

}  // namespace castor_host

#define CASTOR_DYNAMIC_SHARED(name) unsigned char* const name = ::castor_host::dynamic_shared()

#define threadIdx (::castor_host::tls_thread->idx)
#define blockIdx (::castor_host::tls_block->idx)
#define blockDim (::castor_host::tls_block->dim)
#define gridDim (::castor_host::tls_block->grid)
#define warpSize 32

inline void __syncthreads() { ::castor_host::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    ::castor_host::warp_op(::castor_host::kSyncWarp, mask, 0, 0, 32);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// Loads and stores that bypass L1 on the device (what another block wrote): plain here.
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }
// castor_common.cuh's wait_flag: the blocks of a launch run one at a time, in index order for
// a kernel that waits for earlier blocks, so the flag must already hold `value`: waiting for it
// would never end.
inline void castor_host_wait_flag(const int* flag, int value) {
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < value) {
        ::castor_host::kernel_error(
            "waits for a flag no earlier block raised (a block it waits for has not run: the "
            "kernel needs its blocks in index order, or a flag was not cleared before the "
            "launch)");
    }
}
inline unsigned __activemask() { return ::castor_host::active_mask(); }

// ---- bit casts -------------------------------------------------------------------------------

namespace castor_host {
template <typename To, typename From> inline To bit_cast(From v) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
    To out;
    __builtin_memcpy(&out, &v, sizeof(To));
    return out;
}
}  // namespace castor_host

inline float __int_as_float(int x) { return ::castor_host::bit_cast<float>(x); }
inline int __float_as_int(float x) { return ::castor_host::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return ::castor_host::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return ::castor_host::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return ::castor_host::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return ::castor_host::bit_cast<long long>(x); }

// ---- warp shuffles, votes, match -------------------------------------------------------------

namespace castor_host {
template <typename T> inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp operations move values of at most 8 bytes");
    unsigned long long b = 0;
    __builtin_memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T> inline T from_bits(unsigned long long b) {
    T v;
    __builtin_memcpy(&v, &b, sizeof(T));
    return v;
}
template <typename T>
inline T shfl(Collective kind, unsigned mask, T var, int arg, int width) {
    return from_bits<T>(warp_op(kind, mask, to_bits(var), arg, width));
}
}  // namespace castor_host

template <typename T> inline T __shfl_sync(unsigned mask, T var, int src, int width = 32) {
    return ::castor_host::shfl(::castor_host::kShflIdx, mask, var, src, width);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T var, unsigned d, int width = 32) {
    return ::castor_host::shfl(::castor_host::kShflUp, mask, var, int(d), width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned d, int width = 32) {
    return ::castor_host::shfl(::castor_host::kShflDown, mask, var, int(d), width);
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T var, int m, int width = 32) {
    return ::castor_host::shfl(::castor_host::kShflXor, mask, var, m, width);
}
inline int __all_sync(unsigned mask, int pred) {
    return int(::castor_host::warp_op(::castor_host::kVoteAll, mask, pred != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int pred) {
    return int(::castor_host::warp_op(::castor_host::kVoteAny, mask, pred != 0, 0, 32));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    return unsigned(::castor_host::warp_op(::castor_host::kBallot, mask, pred != 0, 0, 32));
}
template <typename T> inline unsigned __match_any_sync(unsigned mask, T value) {
    return unsigned(::castor_host::warp_op(::castor_host::kMatchAny, mask,
                                           ::castor_host::to_bits(value), 0, 32));
}
template <typename T> inline unsigned __match_all_sync(unsigned mask, T value, int* pred) {
    const unsigned long long r = ::castor_host::warp_op(::castor_host::kMatchAll, mask,
                                                        ::castor_host::to_bits(value), 0, 32);
    *pred = r != 0;
    return unsigned(r);
}

// ---- warp matrix operations -------------------------------------------------------------------
// castor_common.cuh's host forms of mma.sync and ldmatrix, each one warp operation of the whole
// warp (mask 0xffffffff) where their shuffle forms make 64 (a product) and up to 8 (an
// ldmatrix): the emulated tensor-core kernels spent most of their time switching fibers there.
// castor_host_warp_mma: D += A B over the lanes' F32 fragments in castor_common.cuh's
// warp_mma_shuffle layout, computed by the last lane to arrive with that function's
// arithmetic (each lane's 16 products summed in k order in F32, then added to D): the same
// bits. castor_host_gather: every lane receives the 32 lanes' values, by lane (what a shuffle
// from each lane would give it); what a lane then reads through them it reads itself, so the
// sanitizers see those loads.
inline void castor_host_warp_mma(float (&d)[4], const float (&a)[8], const float (&b)[4]) {
    ::castor_host::MmaFragments f{a, b, d};
    ::castor_host::warp_op(::castor_host::kWarpMma, 0xffffffffu,
                           reinterpret_cast<unsigned long long>(&f), 0, 32);
}
inline void castor_host_gather(unsigned long long (&all)[32], unsigned long long value) {
    ::castor_host::GatherLane g{value, all};
    ::castor_host::warp_op(::castor_host::kGather, 0xffffffffu,
                           reinterpret_cast<unsigned long long>(&g), 0, 32);
}

// sm_80's warp reductions (redux.sync), over the shuffles above.
#define CASTOR_HOST_REDUCE(name, T, pick)                                                      \
    inline T name(unsigned mask, T v) {                                                        \
        for (int o = 16; o > 0; o >>= 1) {                                                     \
            const T w = __shfl_xor_sync(mask, v, o);                                           \
            v = pick;                                                                          \
        }                                                                                      \
        return v;                                                                              \
    }
CASTOR_HOST_REDUCE(__reduce_min_sync, int, w < v ? w : v)
CASTOR_HOST_REDUCE(__reduce_min_sync, unsigned, w < v ? w : v)
CASTOR_HOST_REDUCE(__reduce_max_sync, int, w > v ? w : v)
CASTOR_HOST_REDUCE(__reduce_max_sync, unsigned, w > v ? w : v)
#undef CASTOR_HOST_REDUCE

// ---- integer intrinsics ----------------------------------------------------------------------

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}

// ---- atomics (relaxed, as CUDA's atomic functions) -------------------------------------------

#define CASTOR_HOST_ATOMIC_INT(T)                                                              \
    inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }       \
    inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }       \
    inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }       \
    inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }         \
    inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }       \
    inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }     \
    inline T atomicCAS(T* p, T expected, T desired) {                                          \
        __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED,            \
                                    __ATOMIC_RELAXED);                                         \
        return expected;                                                                       \
    }                                                                                          \
    inline T atomicMin(T* p, T v) {                                                            \
        T old = __atomic_load_n(p, __ATOMIC_RELAXED);                                          \
        while (v < old &&                                                                      \
               !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,                \
                                            __ATOMIC_RELAXED)) {                               \
        }                                                                                      \
        return old;                                                                            \
    }                                                                                          \
    inline T atomicMax(T* p, T v) {                                                            \
        T old = __atomic_load_n(p, __ATOMIC_RELAXED);                                          \
        while (v > old &&                                                                      \
               !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,                \
                                            __ATOMIC_RELAXED)) {                               \
        }                                                                                      \
        return old;                                                                            \
    }
CASTOR_HOST_ATOMIC_INT(int)
CASTOR_HOST_ATOMIC_INT(unsigned int)
CASTOR_HOST_ATOMIC_INT(long long)
CASTOR_HOST_ATOMIC_INT(unsigned long long)
#undef CASTOR_HOST_ATOMIC_INT

// Float atomics: a compare-and-swap loop on the bits (castor's kernels use none; provided so
// that a kernel that does compiles, with the device's result for a given order).
#define CASTOR_HOST_ATOMIC_FLOAT(T, U)                                                         \
    inline T atomicAdd(T* p, T v) {                                                            \
        U* q = reinterpret_cast<U*>(p);                                                        \
        U old = __atomic_load_n(q, __ATOMIC_RELAXED);                                          \
        while (!__atomic_compare_exchange_n(                                                   \
            q, &old, ::castor_host::bit_cast<U>(::castor_host::bit_cast<T>(old) + v), true,    \
            __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {                                             \
        }                                                                                      \
        return ::castor_host::bit_cast<T>(old);                                                \
    }
CASTOR_HOST_ATOMIC_FLOAT(float, unsigned int)
CASTOR_HOST_ATOMIC_FLOAT(double, unsigned long long)
#undef CASTOR_HOST_ATOMIC_FLOAT

// ---- min, max (CUDA's overloads) ---------------------------------------------------------------

#define CASTOR_HOST_MINMAX(T)                                                                  \
    inline T min(T a, T b) { return a < b ? a : b; }                                           \
    inline T max(T a, T b) { return a > b ? a : b; }
CASTOR_HOST_MINMAX(int)
CASTOR_HOST_MINMAX(unsigned int)
CASTOR_HOST_MINMAX(long)
CASTOR_HOST_MINMAX(unsigned long)
CASTOR_HOST_MINMAX(long long)
CASTOR_HOST_MINMAX(unsigned long long)
#undef CASTOR_HOST_MINMAX
// Mixed integer arguments promote as CUDA's overloads do.
inline unsigned int min(int a, unsigned int b) { return min(unsigned(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, unsigned(b)); }
inline unsigned int max(int a, unsigned int b) { return max(unsigned(a), b); }
inline unsigned int max(unsigned int a, int b) { return max(a, unsigned(b)); }
inline long long min(int a, long long b) { return min((long long)a, b); }
inline long long min(long long a, int b) { return min(a, (long long)b); }
inline long long max(int a, long long b) { return max((long long)a, b); }
inline long long max(long long a, int b) { return max(a, (long long)b); }
// Floats: fminf/fmaxf semantics (a NaN argument gives the other one), as CUDA's min/max.
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline double min(double a, double b) { return __builtin_fmin(a, b); }
inline double max(double a, double b) { return __builtin_fmax(a, b); }

// ---- math --------------------------------------------------------------------------------------
// See the top of this file for which implementation each function has and how the device's
// differs. The C library's functions are declared here (no <math.h>: the kernels' names must
// not collide with its macros).

extern "C" {
float tanhf(float);
float powf(float, float);
float sinf(float);
float cosf(float);
float logf(float);
float log2f(float);
float exp2f(float);
float cbrtf(float);
double exp(double);
double log(double);
double pow(double, double);
double tanh(double);
double erf(double);
}

inline float expf(float x) { return ::castor_host::host_expf(x); }
inline float erff(float x) { return ::castor_host::host_erff(x); }
inline void sincosf(float x, float* s, float* c) {
    *s = sinf(x);
    *c = cosf(x);
}
inline float sqrtf(float x) { return __builtin_sqrtf(x); }
inline double sqrt(double x) { return __builtin_sqrt(x); }
inline float rsqrtf(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float fabsf(float x) { return __builtin_fabsf(x); }
inline double fabs(double x) { return __builtin_fabs(x); }
inline float fminf(float a, float b) { return __builtin_fminf(a, b); }
inline float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
inline double fmin(double a, double b) { return __builtin_fmin(a, b); }
inline double fmax(double a, double b) { return __builtin_fmax(a, b); }
inline float floorf(float x) { return __builtin_floorf(x); }
inline float ceilf(float x) { return __builtin_ceilf(x); }
inline float truncf(float x) { return __builtin_truncf(x); }
inline float copysignf(float a, float b) { return __builtin_copysignf(a, b); }
inline float fmaf(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline double fma(double a, double b, double c) { return __builtin_fma(a, b, c); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(double x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(double x) { return __builtin_isinf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(double x) { return __builtin_isfinite(x); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool signbit(double x) { return __builtin_signbit(x); }

// ---- integer and float conversions with explicit rounding ---------------------------------------

namespace castor_host {
// Rounds toward zero: the saturating conversions of the device (NaN gives 0; the device's
// result for NaN is 0x8000000000000000 for long long, castor's kernels test for NaN first).
inline long long f32_to_ll_rz(float x) {
    if (__builtin_isnan(x)) return 0;
    if (x >= 9223372036854775808.0f) return 0x7fffffffffffffffll;
    if (x <= -9223372036854775808.0f) return -0x7fffffffffffffffll - 1;
    return (long long)x;
}
inline int f32_to_int_rz(float x) {
    if (__builtin_isnan(x)) return 0;
    if (x >= 2147483648.0f) return 0x7fffffff;
    if (x <= -2147483648.0f) return int(0x80000000u);
    return int(x);
}
}  // namespace castor_host

inline long long __float2ll_rz(float x) { return ::castor_host::f32_to_ll_rz(x); }
inline int __float2int_rz(float x) { return ::castor_host::f32_to_int_rz(x); }
inline int __float2int_rn(float x) { return ::castor_host::f32_to_int_rz(__builtin_rintf(x)); }
inline int __float2int_rd(float x) { return ::castor_host::f32_to_int_rz(__builtin_floorf(x)); }
inline int __float2int_ru(float x) { return ::castor_host::f32_to_int_rz(__builtin_ceilf(x)); }
// Integer to F32: the host's conversion rounds to nearest even (the default rounding mode).
inline float __ll2float_rn(long long x) { return float(x); }
inline float __int2float_rn(int x) { return float(x); }
inline float __uint2float_rn(unsigned x) { return float(x); }
inline double __ll2double_rn(long long x) { return double(x); }
inline float __double2float_rn(double x) { return float(x); }

// ---- half and bfloat16 ---------------------------------------------------------------------------
// Storage types with CUDA's conversion intrinsics; arithmetic operators are not provided
// (castor's kernels convert to F32 to compute).

struct alignas(2) __half {
    unsigned short __x;
};
struct alignas(2) __nv_bfloat16 {
    unsigned short __x;
};
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

namespace castor_host {
enum Round { kNearest, kZero, kDown, kUp };

// Whether a value whose magnitude was truncated should instead be incremented by one unit of
// the last kept bit: `rest` the dropped bits, `half` the value of half a unit, `odd` the kept
// value's last bit, `neg` the sign.
inline bool round_up(Round r, unsigned rest, unsigned half, bool odd, bool neg) {
    switch (r) {
    case kNearest: return rest > half || (rest == half && odd);
    case kZero: return false;
    case kDown: return neg && rest != 0;
    case kUp: return !neg && rest != 0;
    }
    return false;
}

// F32 to IEEE binary16.
inline unsigned short f32_to_f16(float f, Round r) {
    const unsigned x = bit_cast<unsigned>(f);
    const unsigned sign = (x >> 16) & 0x8000u;
    const bool neg = sign != 0;
    const unsigned exp = (x >> 23) & 0xffu;
    const unsigned man = x & 0x7fffffu;
    if (exp == 0xffu) {
        // inf stays inf; NaN stays a quiet NaN with the top payload bits.
        return man == 0 ? (unsigned short)(sign | 0x7c00u)
                        : (unsigned short)(sign | 0x7e00u | (man >> 13));
    }
    const int e = int(exp) - 127 + 15;  // the binary16 exponent field if normal
    // Overflow: above the largest finite half. What it becomes depends on the mode.
    auto overflow = [&]() -> unsigned short {
        const bool to_inf = r == kNearest || (r == kUp && !neg) || (r == kDown && neg);
        return (unsigned short)(sign | (to_inf ? 0x7c00u : 0x7bffu));
    };
    if (e >= 0x1f) return overflow();
    if (e <= 0) {
        // Subnormal (or zero) half: the value is m * 2^-24 with m < 1024.
        if (e < -10) {
            // Below half the smallest subnormal (or exactly zero): 0, or one unit when the
            // mode rounds away and something was dropped.
            const bool any = exp != 0 || man != 0;
            const bool up = (r == kUp && !neg && any) || (r == kDown && neg && any);
            return (unsigned short)(sign | (up ? 1u : 0u));
        }
        const unsigned m = man | 0x800000u;  // implicit bit (exp != 0 here since e >= -10)
        const int shift = 14 - e;            // 13 + (1 - e)
        const unsigned kept = m >> shift;
        const unsigned rest = m & ((1u << shift) - 1u);
        const unsigned halfway = 1u << (shift - 1);
        const unsigned v = kept + (round_up(r, rest, halfway, kept & 1u, neg) ? 1u : 0u);
        return (unsigned short)(sign | v);  // a carry into the exponent field is right
    }
    const unsigned kept = (unsigned(e) << 10) | (man >> 13);
    const unsigned rest = man & 0x1fffu;
    unsigned v = kept + (round_up(r, rest, 0x1000u, kept & 1u, neg) ? 1u : 0u);
    if (v >= 0x7c00u) return overflow();
    return (unsigned short)(sign | v);
}

inline float f16_to_f32(unsigned short h) {
    const unsigned sign = unsigned(h & 0x8000u) << 16;
    const unsigned exp = (h >> 10) & 0x1fu;
    const unsigned man = h & 0x3ffu;
    if (exp == 0x1fu) {
        // inf, or a NaN made quiet with its payload kept.
        return bit_cast<float>(sign | (man == 0 ? 0x7f800000u : 0x7fc00000u | (man << 13)));
    }
    if (exp == 0) {
        if (man == 0) return bit_cast<float>(sign);
        // Subnormal: exact in F32.
        const float v = float(man) * 5.9604644775390625e-8f;  // 2^-24
        return sign ? -v : v;
    }
    return bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

// F32 to bfloat16 (the top 16 bits of an F32, rounded).
inline unsigned short f32_to_bf16(float f, Round r) {
    const unsigned x = bit_cast<unsigned>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x0040u);
    const bool neg = (x >> 31) != 0;
    const unsigned kept = x >> 16;
    const unsigned rest = x & 0xffffu;
    const unsigned mag = kept & 0x7fffu;
    if (mag == 0x7f80u) return (unsigned short)kept;  // inf
    unsigned v = kept + (round_up(r, rest, 0x8000u, kept & 1u, neg) ? 1u : 0u);
    // Directed modes never round a finite value to infinity away from their direction.
    if ((v & 0x7fffu) == 0x7f80u && r != kNearest) {
        const bool to_inf = (r == kUp && !neg) || (r == kDown && neg);
        if (!to_inf) v = kept;
    }
    return (unsigned short)v;
}

inline float bf16_to_f32(unsigned short b) { return bit_cast<float>(unsigned(b) << 16); }
}  // namespace castor_host

inline __half castor_host_half(unsigned short b) { return __half{b}; }
inline __nv_bfloat16 castor_host_bf16(unsigned short b) { return __nv_bfloat16{b}; }

inline float __half2float(__half h) { return ::castor_host::f16_to_f32(h.__x); }
inline __half __float2half_rn(float f) {
    return __half{::castor_host::f32_to_f16(f, ::castor_host::kNearest)};
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __float2half_rz(float f) {
    return __half{::castor_host::f32_to_f16(f, ::castor_host::kZero)};
}
inline __half __float2half_rd(float f) {
    return __half{::castor_host::f32_to_f16(f, ::castor_host::kDown)};
}
inline __half __float2half_ru(float f) {
    return __half{::castor_host::f32_to_f16(f, ::castor_host::kUp)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return ::castor_host::bf16_to_f32(b.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    return __nv_bfloat16{::castor_host::f32_to_bf16(f, ::castor_host::kNearest)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
    return __nv_bfloat16{::castor_host::f32_to_bf16(f, ::castor_host::kZero)};
}
inline __nv_bfloat16 __float2bfloat16_rd(float f) {
    return __nv_bfloat16{::castor_host::f32_to_bf16(f, ::castor_host::kDown)};
}
inline __nv_bfloat16 __float2bfloat16_ru(float f) {
    return __nv_bfloat16{::castor_host::f32_to_bf16(f, ::castor_host::kUp)};
}
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return __nv_bfloat16{b}; }
