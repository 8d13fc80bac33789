// The CPU stand-in for the CUDA the tensor-core bodies use (attention/*_tc.cu and delta/*.cu,
// through the primitives of metal_kernels/mma.cuh), compiled with g++ in place of NVRTC: every thread of a block is
// a fiber (ucontext), switched only where CUDA threads meet (barriers and warp collectives), one
// block at a time. What it models, after the PTX ISA:
//   ldmatrix.x4 (and .trans): lane l gives the address of row l % 8 of matrix l / 8; register i
//     of lane l receives row l / 4, columns 2 (l % 4) and + 1 of matrix i (transposed: column
//     l / 4 of rows 2 (l % 4) and + 1), the lower column or row in the low half;
//   mma.m16n8k16 (.row.col, f32 accumulators, bf16 or f16 inputs): the fragment layouts written
//     in mma.cuh, the product summed in float32 over k;
//   cp.async: the destination reads as NaN (0xFF bytes) from the copy's issue until its thread's
//     cp.async.wait_group retires it, so a read before the wait or a barrier shows;
//   bar.sync with an id and a count, __syncthreads, __syncwarp, __shfl_xor_sync; a barrier that
//     can never complete (threads waiting at different ones) is reported as a deadlock;
//   shared memory starts each block as 0xFF bytes with a guard past the kernel's size, and every
//     ldmatrix and cp.async address is checked against the size (and 16-byte alignment), every
//     cp.async source against the buffers.
// What it does not: timing, the hardware's summation order, memory ordering beyond the
// barriers, float rounding of the hardware's ex2.approx (exp2f here).
#pragma once
#define MLXWALK_EMULATE 1
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n)
#define __restrict__
namespace cooperative_groups {}

struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
struct float4 {
  float x, y, z, w;
};
struct dim3e {
  unsigned x, y, z;
};

inline float emu_half_to_float(uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}
inline uint16_t emu_float_to_half(float x) {
  _Float16 f = static_cast<_Float16>(x);
  uint16_t h;
  std::memcpy(&h, &f, 2);
  return h;
}
inline float emu_bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t emu_float_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
struct __half {
  uint16_t bits;
  operator float() const { return emu_half_to_float(bits); }
};
struct __nv_bfloat16 {
  uint16_t bits;
  operator float() const { return emu_bf16_to_float(bits); }
};
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
using std::fmaxf;
using std::fmaf;



namespace mlx::core::cu {
constexpr size_t kSharedMax = 232448;  // 227 KiB, an sm_90 block's most
constexpr size_t kGuard = 4096;
alignas(128) inline unsigned char smem[kSharedMax + kGuard];
}  // namespace mlx::core::cu

namespace emu {
using mlx::core::cu::smem;
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulator: %s\n", what);
  std::fflush(stderr);
  std::_Exit(3);
}

struct Copy {
  unsigned char* dst;
  const unsigned char* src;
  int bytes;
  bool valid;
};
struct Fiber {
  ucontext_t uc;
  std::vector<char> stack;
  bool done = false;
  std::vector<Copy> open;                  // cp.async issued, not yet committed
  std::vector<std::vector<Copy>> groups;  // committed groups, oldest first
};
struct Barrier {
  int arrived = 0;
  unsigned long gen = 0;
};
struct Slots {
  uint32_t a[32][4], b[32][2], addr[32];
  float c[32][4], f[32];
};
struct Buffer {
  const unsigned char *lo, *hi;
};

inline std::vector<Fiber> fibers;
inline ucontext_t scheduler;
inline int cur = 0, threads = 0;
inline dim3e block_idx, block_dim, grid_dim;
inline size_t shared_bytes = 0;
inline Barrier cta, warp_bar[32], named[16];
inline Slots slots[32];
inline unsigned long progress = 0;
inline std::vector<Buffer> buffers;
inline void (*body)() = nullptr;

inline int tid() { return cur; }
inline void yield() { swapcontext(&fibers[cur].uc, &scheduler); }
inline void wait(Barrier& b, int count) {
  const unsigned long g = b.gen;
  if (++b.arrived == count) {
    ++progress;
    b.arrived = 0;
    ++b.gen;
    return;
  }
  while (b.gen == g) yield();
}
inline void warp_sync() { wait(warp_bar[tid() >> 5], 32); }

inline dim3e thread_idx() {
  const unsigned t = unsigned(tid());
  return {t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
}

inline unsigned char* shared_at(uint32_t addr, int bytes, const char* what) {
  if (addr % unsigned(bytes < 16 ? bytes : 16) || size_t(addr) + size_t(bytes) > shared_bytes) {
    std::fprintf(stderr, "emulator: %s at shared byte %u (%d bytes) outside [0, %zu) or "
                 "misaligned (thread %d)\n", what, addr, bytes, shared_bytes, tid());
    std::_Exit(3);
  }
  return smem + addr;
}

inline void retire(std::vector<Copy>& group) {
  for (const Copy& c : group) {
    if (c.valid) {
      std::memcpy(c.dst, c.src, size_t(c.bytes));
    } else {
      std::memset(c.dst, 0, size_t(c.bytes));
    }
  }
}

inline void trampoline() {
  body();
  Fiber& f = fibers[cur];
  if (!f.open.empty() || !f.groups.empty()) {
    for (auto& g : f.groups) retire(g);  // outstanding copies at exit: complete them
    retire(f.open);
  }
  f.done = true;
  ++progress;
}

// Run every thread of the current block to its end.
inline void run_block(std::mt19937& rng) {
  fibers.clear();
  fibers.resize(size_t(threads));
  cta = Barrier{};
  for (auto& b : warp_bar) b = Barrier{};
  for (auto& b : named) b = Barrier{};
  for (int t = 0; t < threads; ++t) {
    Fiber& f = fibers[size_t(t)];
    f.stack.resize(256 * 1024);
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack.data();
    f.uc.uc_stack.ss_size = f.stack.size();
    f.uc.uc_link = &scheduler;
    makecontext(&f.uc, trampoline, 0);
  }
  // Warp by warp, in a random order each pass: a warp runs as far as it can (until each of its
  // threads waits at a block-wide or named barrier, or ends) before the next starts, so a warp
  // that needed a barrier to wait for the others reads what they have not written yet.
  const int warps = threads / 32;
  std::vector<int> order(static_cast<size_t>(warps), 0);
  for (int w = 0; w < warps; ++w) order[size_t(w)] = w;
  int live = threads;
  while (live > 0) {
    const unsigned long before = progress;
    std::shuffle(order.begin(), order.end(), rng);
    for (int w : order) {
      for (;;) {
        const unsigned long inner = progress;
        for (int t = 32 * w; t < 32 * w + 32; ++t) {
          if (fibers[size_t(t)].done) continue;
          cur = t;
          swapcontext(&scheduler, &fibers[size_t(t)].uc);
          if (fibers[size_t(t)].done) --live;
        }
        if (progress == inner) break;  // the warp waits for the others (or is done)
      }
    }
    if (live > 0 && progress == before) {
      fail("deadlock: every live thread waits at a barrier the others never reach");
    }
  }
}
}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::wait(emu::cta, emu::threads); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_sync(); }
inline float __shfl_xor_sync(unsigned, float x, int mask) {
  auto& s = emu::slots[emu::tid() >> 5];
  const int lane = emu::tid() & 31;
  s.f[lane] = x;
  emu::warp_sync();
  const float y = s.f[lane ^ mask];
  emu::warp_sync();
  return y;
}

inline bool __any_sync(unsigned, bool x) {
  auto& s = emu::slots[emu::tid() >> 5];
  const int lane = emu::tid() & 31;
  s.f[lane] = x ? 1.0f : 0.0f;
  emu::warp_sync();
  bool any = false;
  for (int i = 0; i < 32; ++i) any = any || s.f[i] != 0.0f;
  emu::warp_sync();
  return any;
}

namespace mlxwalk_tc {
using u32 = unsigned int;
inline u32 smem_addr(const void* p) {
  return u32(static_cast<const unsigned char*>(p) - mlx::core::cu::smem);
}

template <typename T>
inline float elem(uint16_t bits);
template <>
inline float elem<__nv_bfloat16>(uint16_t bits) {
  return emu_bf16_to_float(bits);
}
template <>
inline float elem<__half>(uint16_t bits) {
  return emu_half_to_float(bits);
}

template <typename T>
inline u32 pack2(float lo, float hi);
template <>
inline u32 pack2<__nv_bfloat16>(float lo, float hi) {
  return u32(emu_float_to_bf16(lo)) | (u32(emu_float_to_bf16(hi)) << 16);
}
template <>
inline u32 pack2<__half>(float lo, float hi) {
  return u32(emu_float_to_half(lo)) | (u32(emu_float_to_half(hi)) << 16);
}

template <typename X>
inline float to_float(X x) {
  return static_cast<float>(x);
}

template <typename T>
inline void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  auto& s = emu::slots[emu::tid() >> 5];
  const int lane = emu::tid() & 31;
  for (int i = 0; i < 4; ++i) s.a[lane][i] = a[i];
  s.b[lane][0] = b0;
  s.b[lane][1] = b1;
  emu::warp_sync();
  auto A = [&](int row, int k) {  // the A fragment's element (row, k) from the lane holding it
    const u32 r = s.a[(row % 8) * 4 + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
    return elem<T>(uint16_t(k % 2 ? r >> 16 : r & 0xffffu));
  };
  auto B = [&](int k, int n) {
    const u32 r = s.b[n * 4 + (k % 8) / 2][k >= 8 ? 1 : 0];
    return elem<T>(uint16_t(k % 2 ? r >> 16 : r & 0xffffu));
  };
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = (lane >> 2) + 8 * (e >> 1), col = 2 * (lane & 3) + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc = std::fmaf(A(row, k), B(k, col), acc);
    out[e] = acc;
  }
  emu::warp_sync();
  for (int e = 0; e < 4; ++e) c[e] = out[e];
}

inline void ldsm(u32 (&r)[4], u32 addr, bool trans) {
  auto& s = emu::slots[emu::tid() >> 5];
  const int lane = emu::tid() & 31;
  emu::shared_at(addr, 16, "ldmatrix row");
  s.addr[lane] = addr;
  emu::warp_sync();
  for (int i = 0; i < 4; ++i) {
    if (!trans) {
      const auto* row = reinterpret_cast<const uint16_t*>(emu::smem + s.addr[i * 8 + (lane >> 2)]);
      r[i] = u32(row[2 * (lane & 3)]) | (u32(row[2 * (lane & 3) + 1]) << 16);
    } else {
      const auto* r0 =
          reinterpret_cast<const uint16_t*>(emu::smem + s.addr[i * 8 + 2 * (lane & 3)]);
      const auto* r1 =
          reinterpret_cast<const uint16_t*>(emu::smem + s.addr[i * 8 + 2 * (lane & 3) + 1]);
      r[i] = u32(r0[lane >> 2]) | (u32(r1[lane >> 2]) << 16);
    }
  }
  emu::warp_sync();
}
inline void ldsm_x4(u32 (&r)[4], u32 addr) { ldsm(r, addr, false); }
inline void ldsm_x4_t(u32 (&r)[4], u32 addr) { ldsm(r, addr, true); }

inline void cp_async(u32 dst, const void* src, bool valid, int bytes) {
  unsigned char* to = emu::shared_at(dst, bytes, "cp.async destination");
  const auto* from = static_cast<const unsigned char*>(src);
  if (valid) {
    bool inside = false;
    for (const auto& b : emu::buffers) inside = inside || (from >= b.lo && from + bytes <= b.hi);
    if (!inside) emu::fail("cp.async reads outside every buffer");
  }
  std::memset(to, 0xff, size_t(bytes));  // undefined until retired
  emu::fibers[size_t(emu::tid())].open.push_back({to, from, bytes, valid});
}
inline void cp_async16(u32 dst, const void* src, bool valid) { cp_async(dst, src, valid, 16); }
inline void cp_async4(u32 dst, const void* src, bool valid) { cp_async(dst, src, valid, 4); }
inline void cp_commit() {
  auto& f = emu::fibers[size_t(emu::tid())];
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
template <int N>
inline void cp_wait() {
  auto& f = emu::fibers[size_t(emu::tid())];
  while (f.groups.size() > size_t(N)) {
    emu::retire(f.groups.front());
    f.groups.erase(f.groups.begin());
  }
}
inline float ex2(float x) { return std::exp2(x); }
inline void bar_sync(int id, int count) {
  if (id < 1 || id > 15 || count % 32) emu::fail("bar.sync: id 1..15, a multiple of 32 threads");
  emu::wait(emu::named[id], count);
}
}  // namespace mlxwalk_tc

namespace emu {
// The process: argv = directory, grid x y z (blocks), block x y z (threads), shared bytes,
// seed, inputs, then each buffer's byte size; buffers are read from dir/b<i>.bin and the outputs
// (those from `inputs` on) written back.
inline int main(int argc, char** argv, int n, void** buf, void (*kernel_body)()) {
  if (argc != 11 + n) fail("arguments: dir gx gy gz bx by bz shared seed inputs sizes...");
  const char* dir = argv[1];
  grid_dim = {unsigned(atoi(argv[2])), unsigned(atoi(argv[3])), unsigned(atoi(argv[4]))};
  block_dim = {unsigned(atoi(argv[5])), unsigned(atoi(argv[6])), unsigned(atoi(argv[7]))};
  shared_bytes = size_t(atol(argv[8]));
  std::mt19937 rng(unsigned(atoi(argv[9])));
  const int inputs = atoi(argv[10]);
  if (shared_bytes > mlx::core::cu::kSharedMax) fail("more shared memory than a block may have");
  threads = int(block_dim.x * block_dim.y * block_dim.z);
  if (threads % 32 || threads > 1024) fail("a block of whole warps, at most 1024 threads");
  std::vector<size_t> sizes(static_cast<size_t>(n), 0);
  char path[4096];
  for (int i = 0; i < n; ++i) {
    sizes[size_t(i)] = size_t(atol(argv[11 + i]));
    buf[i] = std::aligned_alloc(256, (sizes[size_t(i)] + 255) / 256 * 256 + 256);
    std::snprintf(path, sizeof path, "%s/b%d.bin", dir, i);
    FILE* f = std::fopen(path, "rb");
    if (!f || std::fread(buf[i], 1, sizes[size_t(i)], f) != sizes[size_t(i)]) fail("read");
    std::fclose(f);
    const auto* lo = static_cast<const unsigned char*>(buf[i]);
    buffers.push_back({lo, lo + sizes[size_t(i)]});
  }
  body = kernel_body;
  const char* first_env = std::getenv("MLXWALK_EMULATOR_FIRST_BLOCK");
  const unsigned first = first_env ? unsigned(atol(first_env)) : 0u;  // this process's blocks
  for (unsigned z = 0; z < grid_dim.z; ++z)
    for (unsigned y = 0; y < grid_dim.y; ++y)
      for (unsigned x = 0; x < grid_dim.x; ++x) {
        block_idx = {first + x, y, z};
        std::memset(smem, 0xff, sizeof(mlx::core::cu::smem));
        run_block(rng);
        for (size_t i = shared_bytes; i < shared_bytes + mlx::core::cu::kGuard; ++i)
          if (smem[i] != 0xff) fail("a write past the block's shared memory");
      }
  for (int i = inputs; i < n; ++i) {
    std::snprintf(path, sizeof path, "%s/b%d.bin", dir, i);
    FILE* f = std::fopen(path, "wb");
    if (!f || std::fwrite(buf[i], 1, sizes[size_t(i)], f) != sizes[size_t(i)]) fail("write");
    std::fclose(f);
  }
  return 0;
}
}  // namespace emu
