// castor_host_entries.h: how the host process finds and launches a host-built module's entry
// points. The build appends, after the module's source, a table naming each entry point:
//
//   CASTOR_HOST_ENTRIES(CASTOR_HOST_ENTRY(layer_norm_fwd_f32), CASTOR_HOST_ENTRY(...), ...)
//
// which defines `castor_host_entry_table` and `castor_host_entry_count`. Each entry carries a
// launcher that reads the arguments as CUDA's launch API passes them (an array of pointers to
// the argument values, in parameter order) and the parameter list (kind and size of each,
// from the function's own type), so the host process checks every argument against the real
// signature before it launches.
#pragma once

#include <stddef.h>

#include <utility>

#ifndef CASTOR_HOST_API
#define CASTOR_HOST_API __attribute__((visibility("default")))
#endif

extern "C" {
// Grid and block shape of a launch; `order` 0 runs blocks and threads in index order, 1 in the
// reverse order, 2 threads in the reverse order and blocks in index order.
struct castor_host_launch {
    unsigned grid[3];
    unsigned block[3];
    unsigned shared_bytes;
    unsigned order;
};

// Parameter kinds.
enum {
    CASTOR_HOST_PTR = 1,
    CASTOR_HOST_I8 = 2,
    CASTOR_HOST_U8 = 3,
    CASTOR_HOST_I16 = 4,
    CASTOR_HOST_U16 = 5,
    CASTOR_HOST_I32 = 6,
    CASTOR_HOST_U32 = 7,
    CASTOR_HOST_I64 = 8,
    CASTOR_HOST_U64 = 9,
    CASTOR_HOST_F32 = 10,
    CASTOR_HOST_F64 = 11,
    CASTOR_HOST_STRUCT = 12,
};

struct castor_host_param {
    int kind;
    int size;     // bytes of the argument value
    int pointee;  // bytes of the pointed-to type (0 for void and non-pointers)
};

// Returns 0, or 1 with a message in `err`.
typedef int (*castor_host_launch_fn)(const castor_host_launch* launch, void* const* args,
                                     char* err, size_t err_len);

struct castor_host_entry {
    const char* name;
    castor_host_launch_fn launch;
    int n_params;
    const castor_host_param* params;
};
}

namespace castor_host {

CASTOR_HOST_API int run_grid(const castor_host_launch* launch, void (*thunk)(void*), void* args, char* err,
             size_t err_len);

template <typename T> struct Pointee {
    static constexpr int size = int(sizeof(T));
};
template <> struct Pointee<void> {
    static constexpr int size = 0;
};
template <> struct Pointee<const void> {
    static constexpr int size = 0;
};

template <typename T> struct ParamOf {
    static constexpr castor_host_param value = {CASTOR_HOST_STRUCT, int(sizeof(T)), 0};
};
template <typename T> struct ParamOf<T*> {
    static constexpr castor_host_param value = {CASTOR_HOST_PTR, int(sizeof(T*)),
                                                Pointee<T>::size};
};
#define CASTOR_HOST_SCALAR(T, KIND)                                                            \
    template <> struct ParamOf<T> {                                                            \
        static constexpr castor_host_param value = {KIND, int(sizeof(T)), 0};                  \
    };
CASTOR_HOST_SCALAR(signed char, CASTOR_HOST_I8)
CASTOR_HOST_SCALAR(unsigned char, CASTOR_HOST_U8)
CASTOR_HOST_SCALAR(short, CASTOR_HOST_I16)
CASTOR_HOST_SCALAR(unsigned short, CASTOR_HOST_U16)
CASTOR_HOST_SCALAR(int, CASTOR_HOST_I32)
CASTOR_HOST_SCALAR(unsigned int, CASTOR_HOST_U32)
CASTOR_HOST_SCALAR(long, CASTOR_HOST_I64)
CASTOR_HOST_SCALAR(unsigned long, CASTOR_HOST_U64)
CASTOR_HOST_SCALAR(long long, CASTOR_HOST_I64)
CASTOR_HOST_SCALAR(unsigned long long, CASTOR_HOST_U64)
CASTOR_HOST_SCALAR(float, CASTOR_HOST_F32)
CASTOR_HOST_SCALAR(double, CASTOR_HOST_F64)
#undef CASTOR_HOST_SCALAR

// A thread-local variable of the module: touching it makes the C library allocate the module's
// thread-local block (its `__shared__` variables) on the launching thread before any fiber
// runs, so the allocation is ordered before the fibers' accesses (ThreadSanitizer would
// otherwise see the first fiber's lazy allocation race with the others' use).
static thread_local int tls_anchor;

template <typename F, F f> struct Entry;

template <typename... A, void (*f)(A...)> struct Entry<void (*)(A...), f> {
    static constexpr int n_params = int(sizeof...(A));
    // One more than needed, so a kernel without parameters has a valid array.
    static constexpr castor_host_param params[sizeof...(A) + 1] = {ParamOf<A>::value...,
                                                                   {0, 0, 0}};

    template <size_t... I> static void call(void* const* args, std::index_sequence<I...>) {
        f(*static_cast<A*>(args[I])...);
    }
    // Every thread reads its own copy of the arguments, as from the device's parameter space.
    static void thunk(void* args) {
        call(static_cast<void* const*>(args), std::index_sequence_for<A...>{});
    }
    static int launch(const castor_host_launch* l, void* const* args, char* err,
                      size_t err_len) {
        asm volatile("" : : "r"(&tls_anchor) : "memory");
        return run_grid(l, &thunk, const_cast<void**>(args), err, err_len);
    }
};

}  // namespace castor_host

#define CASTOR_HOST_ENTRY(name)                                                                \
    castor_host_entry {                                                                        \
        #name, &::castor_host::Entry<decltype(&name), &name>::launch,                          \
            ::castor_host::Entry<decltype(&name), &name>::n_params,                            \
            ::castor_host::Entry<decltype(&name), &name>::params                               \
    }

#define CASTOR_HOST_ENTRIES(...)                                                               \
    extern "C" __attribute__((visibility("default")))                                          \
    const castor_host_entry castor_host_entry_table[] = {__VA_ARGS__};                         \
    extern "C" __attribute__((visibility("default"))) const int castor_host_entry_count =      \
        int(sizeof(castor_host_entry_table) / sizeof(castor_host_entry_table[0]));
