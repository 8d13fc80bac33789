// What the kernel bodies use of Metal, in C++: enough to compile MLX's generated source with g++
// and run each threadgroup's threads concurrently (one std::thread per GPU thread, one
// threadgroup at a time, so `threadgroup` storage can be function-static).
#pragma once
// C headers only (pthreads for the threads and barriers): they parse in a fraction of the time
// the C++ thread library takes, and the harness compiles one library per kernel instance.
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

using uint = unsigned int;
using ushort = unsigned short;
using half = _Float16;
using float16_t = half;  // MLX names float16 so
struct uint3 {
  uint x, y, z;
};

// bfloat16 as Metal and MLX hold it: the top half of a float32 (round to nearest even on store).
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    bits = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };

namespace metal {
inline float exp(float x) { return expf(x); }
inline float log(float x) { return logf(x); }
inline float sqrt(float x) { return sqrtf(x); }
template <class X> inline X max(X a, X b) { return a > b ? a : b; }
template <class X> inline X min(X a, X b) { return a < b ? a : b; }
namespace fast {
inline float exp(float x) { return expf(x); }
inline float log(float x) { return logf(x); }
}  // namespace fast
namespace precise {
inline float exp(float x) { return expf(x); }
inline float log(float x) { return logf(x); }
}  // namespace precise
}  // namespace metal

namespace harness {
struct Group {
  explicit Group(uint threads) : simd_count(threads / 32) {
    pthread_barrier_init(&all, nullptr, threads);
    simd = new pthread_barrier_t[simd_count];
    slots = new double[simd_count * 32];
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
  double* slots;  // 32 per simdgroup: a simdgroup's lanes exchange values through them
};
inline thread_local Group* group = nullptr;
inline thread_local uint lane = 0, simd_index = 0;

inline void simd_sync() { pthread_barrier_wait(&group->simd[simd_index]); }

// Every lane posts its value, all read what they need, then wait before the slots are reused.
template <class X, class F> inline X exchange(X x, F read) {
  double* slots = group->slots + 32 * simd_index;
  slots[lane] = double(x);
  simd_sync();
  X out = read(slots);
  simd_sync();
  return out;
}

struct Pos {
  uint3 thread_position_in_grid, threadgroup_position_in_grid, thread_position_in_threadgroup;
  uint3 threads_per_threadgroup, threadgroups_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint threads_per_simdgroup;
};

template <class Body> struct Thread {
  const Body* body;
  Group* g;
  uint t, grid[3], tg[3];
};

// One OS thread per thread of a group walks every group in turn, all meeting at a barrier
// between groups, so a group's `threadgroup` storage is never shared with the next group's.
template <class Body> void* walk_groups(void* arg) {
  auto& a = *static_cast<Thread<Body>*>(arg);
  const uint* tg = a.tg;
  uint t = a.t;
  group = a.g;
  lane = t % 32;
  simd_index = t / 32;
  uint3 groups{a.grid[0] / tg[0], a.grid[1] / tg[1], a.grid[2] / tg[2]};
  uint3 local{t % tg[0], (t / tg[0]) % tg[1], t / (tg[0] * tg[1])};
  for (uint gz = 0; gz < groups.z; ++gz)
    for (uint gy = 0; gy < groups.y; ++gy)
      for (uint gx = 0; gx < groups.x; ++gx) {
        Pos p{{gx * tg[0] + local.x, gy * tg[1] + local.y, gz * tg[2] + local.z},
              {gx, gy, gz}, local, {tg[0], tg[1], tg[2]}, groups, t, t % 32, t / 32, 32};
        (*a.body)(p);
        pthread_barrier_wait(&a.g->all);
      }
  return nullptr;
}

// dispatchThreads over `grid` threads in groups of `tg`; the grid must fill whole groups.
template <class Body> int run(const uint* grid, const uint* tg, const Body& body) {
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
  delete[] args;
  delete[] threads;
  return 0;
}
}  // namespace harness

inline void threadgroup_barrier(mem_flags) { pthread_barrier_wait(&harness::group->all); }
inline void simdgroup_barrier(mem_flags) { harness::simd_sync(); }

template <class X> inline X simd_sum(X x) {
  return harness::exchange(x, [](const double* s) { X a = 0; for (int i = 0; i < 32; ++i) a += X(s[i]); return a; });
}
template <class X> inline X simd_max(X x) {
  return harness::exchange(x, [](const double* s) {
    X a = X(s[0]);
    for (int i = 1; i < 32; ++i) a = X(s[i]) > a ? X(s[i]) : a;
    return a;
  });
}
template <class X> inline X simd_shuffle(X x, ushort from) {
  return harness::exchange(x, [from](const double* s) { return X(s[from]); });
}
template <class X> inline X simd_broadcast(X x, ushort from) { return simd_shuffle(x, from); }
template <class X> inline X simd_shuffle_xor(X x, ushort mask) {
  return harness::exchange(x, [mask](const double* s) { return X(s[harness::lane ^ mask]); });
}

// Address spaces mean nothing on the CPU; `threadgroup` declarations are made static by the
// harness before compiling (harness/__init__.py), every other use of the word is dropped.
#define device
#define constant
#define thread
#define threadgroup
