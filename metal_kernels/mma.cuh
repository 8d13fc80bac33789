// The tensor-core primitives of the CUDA kernels, shared by attention's (*_tc.cu, with
// attention/common_tc.cuh) and the delta rule's (delta/*.cu, with delta/tiles.cuh): warp-level
// mma.sync.m16n8k16 with float32 accumulators, ldmatrix from shared memory, cp.async from global
// memory (zero-filled where `valid` is false), named barriers, in namespace mlxwalk_tc. A
// kernel's header list puts this file first (metal_kernels/build.py finds it at the top level).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16/.f16 inputs), g = lane / 4, t = lane % 4:
//   A 16x16 (row-major), four 32-bit registers of two elements: a0 (g, 2t..2t+1),
//     a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
//   B 16x8 (k x n), two registers: b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g);
//   C/D 16x8 float: c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1).
//
// Built with NVRTC by MLX (mx.fast.cuda_kernel, sm_90a there) and with nvcc by
// scripts/compile-cuda.py. Under MLXWALK_EMULATE the CPU emulator's stand-ins
// (metal_kernels/cuda_emulator/emulate.h) take the place of everything in the #ifndef below,
// lane by lane.

namespace mlxwalk_tc {
using u32 = unsigned int;

template <typename A, typename B>
struct same_type {
  static constexpr bool value = false;
};
template <typename A>
struct same_type<A, A> {
  static constexpr bool value = true;
};
}  // namespace mlxwalk_tc

#ifndef MLXWALK_EMULATE
namespace mlxwalk_tc {
__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Two floats as one register of two T, `lo` in the low half (the lower column).
template <typename T>
__device__ __forceinline__ u32 pack2(float lo, float hi);
template <>
__device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <>
__device__ __forceinline__ u32 pack2<__half>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <typename X>
__device__ __forceinline__ float to_float(X x) {
  return static_cast<float>(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}

// c += a . b, one m16n8k16 product (float32 accumulators).
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (same_type<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 matrices of 16-bit elements: lane l gives the address of row l % 8 of matrix l / 8;
// r[i] receives row g, columns 2t, 2t+1 of matrix i (with .trans: column g, rows 2t, 2t+1).
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16 (or 4) bytes from global to shared memory, asynchronously; `valid` false: zeros instead
// (the source is then not read).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A barrier for `threads` threads (a multiple of 32) under id (1..15; 0 is __syncthreads').
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
}  // namespace mlxwalk_tc
#endif

namespace mlxwalk_tc {
// C fragments (MT x NT tiles of 16 x 8 floats) set to zero.
template <int MT, int NT>
__device__ __forceinline__ void zero(float (&c)[MT][NT][4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c[m][n][e] = 0.0f;
      }
    }
  }
}

// A row's max or sum over the four lanes of a quad (the lanes holding one C-fragment row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
}  // namespace mlxwalk_tc
