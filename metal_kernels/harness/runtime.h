// The CPU runtime behind metal.h: one pthread per GPU thread, one threadgroup at a time (so
// `threadgroup` storage can be function-static), barriers, the slots a simdgroup's lanes exchange
// values through, and the traffic counters. Included by metal.h for the g++ build only.
#pragma once
// C headers only: they parse in a fraction of the time the C++ thread library takes, and the
// harness compiles one library per kernel instance.
#include <pthread.h>
#include <stdint.h>

namespace harness {
// A call's counts (the order of harness/__init__.py's COUNTERS). Memory traffic is counted only
// in a build with HARNESS_COUNT_MEMORY (see the hooks at the end).
enum Count {
  device_read, device_write, threadgroup_read, threadgroup_write, mma, barriers,
  simdgroup_barriers, threadgroup_memory, count_kinds
};

constexpr int kSlots = 128;  // doubles a lane group posts per exchange: 4 a lane

struct Group {
  explicit Group(uint threads) : simd_count(threads / 32) {
    pthread_barrier_init(&all, nullptr, threads);
    simd = new pthread_barrier_t[simd_count];
    slots = new double[simd_count * 2 * kSlots];
    for (uint i = 0; i < simd_count; ++i) pthread_barrier_init(&simd[i], nullptr, 32);
  }
  ~Group() {
    pthread_barrier_destroy(&all);
    for (uint i = 0; i < simd_count; ++i) pthread_barrier_destroy(&simd[i]);
    delete[] simd;
    delete[] slots;
  }
  uint simd_count;
  pthread_barrier_t all;
  pthread_barrier_t* simd;
  double* slots;  // two banks of kSlots per simdgroup: its lanes exchange values through them
  long long total[count_kinds] = {};
};
inline thread_local Group* group = nullptr;
inline thread_local uint lane = 0, simd_index = 0;
inline thread_local uint bank = 0;  // the bank a simdgroup's next exchange uses
inline thread_local long long counted[count_kinds] = {};

inline uint lane_id() { return lane; }
inline void simd_sync() { pthread_barrier_wait(&group->simd[simd_index]); }

// Lanes post to this bank, meet once, read, and the next exchange takes the other bank: a lane
// can only reach a third exchange (this bank again) once every lane has met at the second, so
// after reading this one. One barrier per exchange instead of two.
inline double* slots() { return group->slots + (2 * simd_index + bank) * kSlots; }
inline void slots_done() { bank ^= 1; }

inline void threadgroup_sync() {
  if (pthread_barrier_wait(&group->all) == PTHREAD_BARRIER_SERIAL_THREAD) ++counted[barriers];
}
inline void simdgroup_sync() {
  counted[simdgroup_barriers] += lane == 0;
  simd_sync();
}
inline void count_mma() { counted[mma] += lane == 0; }  // once per simdgroup

// Address ranges the memory counters tell apart: the call's buffers and the kernel's threadgroup
// arrays (each registered once, by a static Storage beside its declaration).
struct Span {
  const char *lo, *hi;
};
constexpr int kSpans = 64;
inline Span device_spans[kSpans];
inline int device_spans_n = 0;
inline Span threadgroup_spans[kSpans];
inline int threadgroup_spans_n = 0;
inline long long threadgroup_bytes = 0;  // the kernel's threadgroup memory

struct Storage {
  __attribute__((no_sanitize_thread)) Storage(const void* p, unsigned long bytes) {
    int i = __atomic_fetch_add(&threadgroup_spans_n, 1, __ATOMIC_SEQ_CST);
    if (i < kSpans) threadgroup_spans[i] = {(const char*)p, (const char*)p + bytes};
    __atomic_fetch_add(&threadgroup_bytes, (long long)bytes, __ATOMIC_SEQ_CST);
  }
};

inline void set_buffers(void** buf, const unsigned long* bytes, int n) {
  device_spans_n = n < kSpans ? n : kSpans;
  for (int i = 0; i < device_spans_n; ++i)
    device_spans[i] = {(const char*)buf[i], (const char*)buf[i] + bytes[i]};
}

// Outside the counted memory: adding a thread's counts into its group's.
__attribute__((no_sanitize_thread)) inline void add_counts(Group* g) {
  for (int i = 0; i < count_kinds; ++i) __atomic_fetch_add(&g->total[i], counted[i], __ATOMIC_SEQ_CST);
}

struct Pos {
  uint3 thread_position_in_grid, threadgroup_position_in_grid, thread_position_in_threadgroup;
  uint3 threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin;
  uint3 dispatch_threads_per_threadgroup;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint threads_per_simdgroup, thread_execution_width, simdgroups_per_threadgroup;
  uint dispatch_simdgroups_per_threadgroup, thread_index_in_quadgroup;
  uint quadgroup_index_in_threadgroup, quadgroups_per_threadgroup;
  uint dispatch_quadgroups_per_threadgroup;
};

template <class Body> struct Thread {
  const Body* body;
  Group* g;
  uint t, grid[3], tg[3];
};

inline Pos position(const uint* grid, const uint* tg, uint3 g, uint t) {
  const uint n = tg[0] * tg[1] * tg[2];
  const uint3 local(t % tg[0], (t / tg[0]) % tg[1], t / (tg[0] * tg[1]));
  const uint3 size(tg[0], tg[1], tg[2]), all(grid[0], grid[1], grid[2]);
  Pos p;
  p.thread_position_in_grid = uint3(g.x * tg[0] + local.x, g.y * tg[1] + local.y, g.z * tg[2] + local.z);
  p.threadgroup_position_in_grid = g;
  p.thread_position_in_threadgroup = local;
  p.threads_per_threadgroup = p.dispatch_threads_per_threadgroup = size;
  p.threadgroups_per_grid = uint3(grid[0] / tg[0], grid[1] / tg[1], grid[2] / tg[2]);
  p.threads_per_grid = p.grid_size = all;
  p.grid_origin = uint3(0u);
  p.thread_index_in_threadgroup = t;
  p.thread_index_in_simdgroup = t % 32;
  p.simdgroup_index_in_threadgroup = t / 32;
  p.threads_per_simdgroup = p.thread_execution_width = 32;
  p.simdgroups_per_threadgroup = p.dispatch_simdgroups_per_threadgroup = n / 32;
  p.thread_index_in_quadgroup = t % 4;
  p.quadgroup_index_in_threadgroup = t / 4;
  p.quadgroups_per_threadgroup = p.dispatch_quadgroups_per_threadgroup = n / 4;
  return p;
}

// One OS thread per thread of a group walks every group in turn, all meeting at a barrier
// between groups, so a group's `threadgroup` storage is never shared with the next group's.
template <class Body> void* walk_groups(void* arg) {
  auto& a = *static_cast<Thread<Body>*>(arg);
  group = a.g;
  lane = a.t % 32;
  simd_index = a.t / 32;
  const uint3 groups(a.grid[0] / a.tg[0], a.grid[1] / a.tg[1], a.grid[2] / a.tg[2]);
  for (uint gz = 0; gz < groups.z; ++gz)
    for (uint gy = 0; gy < groups.y; ++gy)
      for (uint gx = 0; gx < groups.x; ++gx) {
        (*a.body)(position(a.grid, a.tg, uint3(gx, gy, gz), a.t));
        pthread_barrier_wait(&a.g->all);
      }
  add_counts(a.g);
  return nullptr;
}

// dispatchThreads over `grid` threads in groups of `tg`; the grid must fill whole groups.
// `counts` receives the call's counters (count_kinds of them).
template <class Body>
int run(const uint* grid, const uint* tg, const Body& body, long long* counts) {
  uint n = tg[0] * tg[1] * tg[2];
  if (n % 32 || grid[0] % tg[0] || grid[1] % tg[1] || grid[2] % tg[2]) return 1;
  Group g(n);
  Thread<Body>* args = new Thread<Body>[n];
  pthread_t* threads = new pthread_t[n];
  for (uint t = 0; t < n; ++t) {
    args[t] = {&body, &g, t, {grid[0], grid[1], grid[2]}, {tg[0], tg[1], tg[2]}};
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    pthread_create(&threads[t], &attr, walk_groups<Body>, &args[t]);
    pthread_attr_destroy(&attr);
  }
  for (uint t = 0; t < n; ++t) pthread_join(threads[t], nullptr);
  g.total[threadgroup_memory] = threadgroup_bytes;
  for (int i = 0; i < count_kinds; ++i) counts[i] = g.total[i];
  delete[] args;
  delete[] threads;
  return 0;
}
}  // namespace harness

#ifdef HARNESS_COUNT_MEMORY
// Memory traffic, counted without touching the kernel's source: the counting build is compiled
// with -fsanitize=thread (and linked without its runtime), so the compiler calls these hooks for
// every load and store that reaches memory; each is classed by address as a device buffer's, a
// threadgroup array's, or neither (a thread's own stack).
namespace harness {
__attribute__((no_sanitize_thread, always_inline)) inline void touch(const void* p, long n,
                                                                     bool write) {
  const char* a = (const char*)p;
  for (int i = 0; i < threadgroup_spans_n && i < kSpans; ++i)
    if (a >= threadgroup_spans[i].lo && a < threadgroup_spans[i].hi) {
      counted[write ? threadgroup_write : threadgroup_read] += n;
      return;
    }
  for (int i = 0; i < device_spans_n; ++i)
    if (a >= device_spans[i].lo && a < device_spans[i].hi) {
      counted[write ? device_write : device_read] += n;
      return;
    }
}
}  // namespace harness

#define HARNESS_HOOK(N)                                                                         \
  extern "C" __attribute__((no_sanitize_thread)) void __tsan_read##N(void* p) {                 \
    harness::touch(p, N, false);                                                                \
  }                                                                                             \
  extern "C" __attribute__((no_sanitize_thread)) void __tsan_write##N(void* p) {                \
    harness::touch(p, N, true);                                                                 \
  }                                                                                             \
  extern "C" __attribute__((no_sanitize_thread)) void __tsan_unaligned_read##N(void* p) {       \
    harness::touch(p, N, false);                                                                \
  }                                                                                             \
  extern "C" __attribute__((no_sanitize_thread)) void __tsan_unaligned_write##N(void* p) {      \
    harness::touch(p, N, true);                                                                 \
  }
HARNESS_HOOK(1)
HARNESS_HOOK(2)
HARNESS_HOOK(4)
HARNESS_HOOK(8)
HARNESS_HOOK(16)
#undef HARNESS_HOOK
extern "C" __attribute__((no_sanitize_thread)) void __tsan_read_range(void* p, unsigned long n) {
  harness::touch(p, (long)n, false);
}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_write_range(void* p, unsigned long n) {
  harness::touch(p, (long)n, true);
}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_init() {}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_func_entry(void*) {}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_func_exit() {}
// The guards of function-static objects load their flag atomically.
extern "C" __attribute__((no_sanitize_thread)) char __tsan_atomic8_load(const volatile char* a,
                                                                         int) {
  return __atomic_load_n(a, __ATOMIC_SEQ_CST);
}
#endif
