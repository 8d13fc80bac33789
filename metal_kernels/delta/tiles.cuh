// The chunked gated delta rule on tensor cores (CUDA): the header of prepare.cu, states.cu,
// output.cu, states_back.cu, grads.cu and prepare_back.cu (tiles.metal's CUDA counterpart).
// Over the tensor-core primitives of metal_kernels/mma.cuh (first in its header list; the CPU
// emulator's stand-ins under MLXWALK_EMULATE), taken into namespace mlxwalk_dt.
//
// Precision. q, k, v (and dy) arrive in T: float16/bfloat16 (the tensor-core path) or float32
// (the FMA path). Everything derived from them (the WY factors T, w, u, the states h, v_new, the
// state gradients dh, dv_new, dw, the intra-chunk matrices M, dM, dA, ...) is float32, as in
// the ops twin. On the half path a product takes an input as it is (exact: q, k, v, dy are
// already T) and a derived float32 operand as two T parts, hi = round(x) and lo = round(x - hi),
// summed over the products hi.B + lo.B (derived x derived: hi.hi + hi.lo + lo.hi; lo.lo is
// below float32's rounding of the sum). So no float32 value is rounded to half precision without
// its remainder: the products keep about 16 bits (bf16) or 22 bits (fp16) of every derived
// operand, and the kernels' error stays near float32's instead of adding half-precision
// roundings to the twin's. Accumulators are float32. On the float32 path every product is float32
// FMA in the same fragment layout (TF32 would miss the 1e-5 bar), so one body serves both.
// fp16's range applies to the parts: a derived value past 65504 would not survive, and one
// below ~2^-3 keeps fewer of lo's bits (lo falls among fp16's subnormals): measured through the
// emulator, the output kernel's y (scores ~0.01) lands 4-7e-6 from the float32 twin with fp16,
// no closer than bf16's 4-5e-6, where the other kernels' fp16 results sit near 1e-7-1e-6.
//
// Fragments (mma.m16n8k16): a warp's product is MT x NT C tiles of 16 x 8 floats, lane l holding
// rows g = l / 4 and g + 8 of each m-tile at columns 2t, 2t + 1 (t = l % 4) of each n-tile;
// A 16x16: a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..); B 16x8:
// b0 (k = 2t.., n = g), b1 (k = 2t + 8.., n = g). Operands live in shared memory as tiles of
// rows padded by 16 bytes (the eight rows of an 8x8 ldmatrix fall in distinct bank groups):
// element (r, k) of an A (r = m) or B (r = n) operand sits at p[r * P + k] (KR = false) or
// p[k * P + r] (KR = true, read with ldmatrix.trans), in PARTS arrays (hi, lo) when derived on
// the half path. An A operand may also be float C fragments in registers (mm_frag), split per
// k-step on the way: a product's result feeds the next product without leaving the registers.

namespace mlxwalk_dt {
using mlxwalk_tc::bar_sync;
using mlxwalk_tc::cp_async16;
using mlxwalk_tc::cp_async4;
using mlxwalk_tc::cp_commit;
using mlxwalk_tc::cp_wait;
using mlxwalk_tc::ex2;
using mlxwalk_tc::ldsm_x4;
using mlxwalk_tc::ldsm_x4_t;
using mlxwalk_tc::mma;
using mlxwalk_tc::pack2;
using mlxwalk_tc::quad_sum;
using mlxwalk_tc::same_type;
using mlxwalk_tc::smem_addr;
using mlxwalk_tc::to_float;
using mlxwalk_tc::u32;
using mlxwalk_tc::zero;
}  // namespace mlxwalk_dt

// x rounded to T (to nearest even), as a float.
#ifndef MLXWALK_EMULATE
namespace mlxwalk_dt {
template <typename T>
__device__ __forceinline__ float round_to(float x);
template <>
__device__ __forceinline__ float round_to<__nv_bfloat16>(float x) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return __int_as_float(int(h) << 16);
}
template <>
__device__ __forceinline__ float round_to<__half>(float x) {
  unsigned short h;
  float y;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(h));
  return y;
}
}  // namespace mlxwalk_dt
#else
namespace mlxwalk_dt {
template <typename T>
inline float round_to(float x);
template <>
inline float round_to<__nv_bfloat16>(float x) {
  return emu_bf16_to_float(emu_float_to_bf16(x));
}
template <>
inline float round_to<__half>(float x) {
  return emu_half_to_float(emu_float_to_half(x));
}
}  // namespace mlxwalk_dt
#endif

namespace mlxwalk_dt {
constexpr int CH = 64;  // positions a chunk
constexpr float LOG2E = 1.4426950408889634f;

template <typename T>
struct Prec {
  static constexpr bool half = !same_type<T, float>::value;
  static constexpr int parts = half ? 2 : 1;  // parts of a derived operand: hi + lo, or itself
  static constexpr int pad = 16 / int(sizeof(T));  // elements of padding a shared row
};

// Bytes of n elements of X in shared memory, rounded up to 16 (regions start 16-byte aligned).
template <typename X>
__host__ __device__ constexpr int region(int n) {
  return (n * int(sizeof(X)) + 15) / 16 * 16;
}

__device__ __forceinline__ float expd(float x) { return ex2(x * LOG2E); }

// Two floats as their hi and lo parts, each packed as two T (a in the low half).
template <typename T>
__device__ __forceinline__ void split2(float a, float b, u32& hi, u32& lo) {
  const float ra = round_to<T>(a), rb = round_to<T>(b);
  hi = pack2<T>(ra, rb);
  lo = pack2<T>(a - ra, b - rb);
}

// Elements (idx, idx + 1) of a derived tile (idx even): hi/lo parts, or the floats themselves.
template <typename T>
__device__ __forceinline__ void put2(T* const (&p)[Prec<T>::parts], int idx, float a, float b) {
  if constexpr (Prec<T>::half) {
    u32 hi, lo;
    split2<T>(a, b, hi, lo);
    *reinterpret_cast<u32*>(p[0] + idx) = hi;
    *reinterpret_cast<u32*>(p[1] + idx) = lo;
  } else {
    *reinterpret_cast<float2*>(p[0] + idx) = make_float2(a, b);
  }
}

// An operand tile in shared memory (see the top). `at(r, k)`: the tile from element (r, k) on.
template <typename T, int P_, bool KR_, int PARTS_>
struct Tile {
  using type = T;
  static constexpr int P = P_, PARTS = PARTS_;
  static constexpr bool KR = KR_;
  const T* p[PARTS_];
  __device__ __forceinline__ Tile at(int r, int k) const {
    Tile t;
#pragma unroll
    for (int i = 0; i < PARTS_; ++i) {
      t.p[i] = p[i] + (KR_ ? k * P_ + r : r * P_ + k);
    }
    return t;
  }
};
template <int P, bool KR, typename T>
__device__ __forceinline__ Tile<T, P, KR, 1> exact(const T* p) {
  Tile<T, P, KR, 1> t;
  t.p[0] = p;
  return t;
}
template <int P, bool KR, typename T>
__device__ __forceinline__ Tile<T, P, KR, Prec<T>::parts> derived(T* const (&p)[Prec<T>::parts]) {
  Tile<T, P, KR, Prec<T>::parts> t;
#pragma unroll
  for (int i = 0; i < Prec<T>::parts; ++i) {
    t.p[i] = p[i];
  }
  return t;
}

// ldmatrix lane offsets (elements) and per-fragment steps of the two operand kinds.
template <int P, bool KR>
__device__ __forceinline__ int a_lane(int lane) {
  return KR ? ((lane & 7) + (lane >> 4) * 8) * P + ((lane >> 3) & 1) * 8
            : (lane & 15) * P + (lane >> 4) * 8;
}
template <int P, bool KR>
__device__ __forceinline__ int b_lane(int lane) {
  return KR ? ((lane & 7) + ((lane >> 3) & 1) * 8) * P + (lane >> 4) * 8
            : ((lane & 7) + (lane >> 4) * 8) * P + ((lane >> 3) & 1) * 8;
}
template <int P, bool KR>
__host__ __device__ constexpr int step(int r16, int k16) {  // element offset of 16-row block r16, 16-column k16
  return KR ? k16 * 16 * P + r16 * 16 : r16 * 16 * P + k16 * 16;
}
template <bool KR>
__device__ __forceinline__ void ldsm(u32 (&r)[4], u32 addr) {
  if constexpr (KR) {
    ldsm_x4_t(r, addr);
  } else {
    ldsm_x4(r, addr);
  }
}

// acc[m][n] += A B over k-steps [ks0, ks1) of 16: A an MT x 16-row tile, B NT x 8 columns,
// both in shared memory (Tile). Half path: ldmatrix + mma per part pair; float32: FMA.
template <int MT, int NT, int KS, class TA, class TB>
__device__ __forceinline__ void mm(float (&acc)[MT][NT][4], const TA& a, const TB& b, int lane,
                                   int ks0 = 0, int ks1 = KS) {
  using T = typename TA::type;
  static_assert(same_type<T, typename TB::type>::value, "operands of one type");
  if constexpr (Prec<T>::half) {
    static_assert(NT % 2 == 0, "n-tiles go in pairs (one ldmatrix.x4)");
#pragma unroll
    for (int pa = 0; pa < TA::PARTS; ++pa) {
#pragma unroll
      for (int pb = 0; pb < TB::PARTS; ++pb) {
        if (pa + pb > 1) {
          continue;  // lo x lo
        }
        const u32 a0 = smem_addr(a.p[pa] + a_lane<TA::P, TA::KR>(lane));
        const u32 b0 = smem_addr(b.p[pb] + b_lane<TB::P, TB::KR>(lane));
#pragma unroll 2  // (fully unrolled, ptxas hoists every k-step's B fragments)
        for (int ks = 0; ks < KS; ++ks) {
          if (ks < ks0 || ks >= ks1) {
            continue;
          }
          u32 af[MT][4];
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            ldsm<TA::KR>(af[m], a0 + step<TA::P, TA::KR>(m, ks) * 2);
          }
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            u32 bf[4];
            ldsm<TB::KR>(bf, b0 + step<TB::P, TB::KR>(np, ks) * 2);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              mma<T>(acc[m][2 * np], af[m], bf[0], bf[1]);
              mma<T>(acc[m][2 * np + 1], af[m], bf[2], bf[3]);
            }
          }
        }
      }
    }
  } else {
    const int g = lane >> 2, t = lane & 3;
    const float* pa = a.p[0];
    const float* pb = b.p[0];
#pragma unroll 2
    for (int k = ks0 * 16; k < ks1 * 16; ++k) {
      float av[MT][2], bv[NT][2];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = m * 16 + g + 8 * h;
          av[m][h] = TA::KR ? pa[k * TA::P + r] : pa[r * TA::P + k];
        }
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = n * 8 + 2 * t + j;
          bv[n][j] = TB::KR ? pb[k * TB::P + c] : pb[c * TB::P + k];
        }
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            acc[m][n][e] = fmaf(av[m][e >> 1], bv[n][e & 1], acc[m][n][e]);
          }
        }
      }
    }
  }
}

// Float C fragments [MT][NT][4] into a warp's own shared rows (pitch PW, row-major).
template <int MT, int NT, int PW>
__device__ __forceinline__ void frag_to_rows(float* dst, const float (&c)[MT][NT][4], int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        *reinterpret_cast<float2*>(dst + (m * 16 + g + 8 * h) * PW + n * 8 + 2 * t) =
            make_float2(c[m][n][2 * h], c[m][n][2 * h + 1]);
      }
    }
  }
}

// acc += A B with A the float C fragments a[MT][2 KS][4] (a derived operand of 16 MT rows and
// 16 KS columns in registers, as a product left it) over k-steps [ks0, ks1). Half path: each
// k-step's A fragments packed as hi and lo where they are (three products against a derived B:
// hi.hi, lo.hi, hi.lo). Float32 path: the fragments go through the warp's own rows `wbuf`
// (16 MT x (16 KS + 4) floats) to FMA.
template <int MT, int NT, int KS, class TB>
__device__ __forceinline__ void mm_frag(float (&acc)[MT][NT][4], const float (&a)[MT][2 * KS][4],
                                        const TB& b, int lane, float* wbuf, int ks0 = 0,
                                        int ks1 = KS) {
  using T = typename TB::type;
  if constexpr (Prec<T>::half) {
    const u32 b0[2] = {smem_addr(b.p[0] + b_lane<TB::P, TB::KR>(lane)),
                       smem_addr(b.p[TB::PARTS - 1] + b_lane<TB::P, TB::KR>(lane))};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      if (ks < ks0 || ks >= ks1) {
        continue;
      }
      u32 hi[MT][4], lo[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        split2<T>(a[m][2 * ks][0], a[m][2 * ks][1], hi[m][0], lo[m][0]);
        split2<T>(a[m][2 * ks][2], a[m][2 * ks][3], hi[m][1], lo[m][1]);
        split2<T>(a[m][2 * ks + 1][0], a[m][2 * ks + 1][1], hi[m][2], lo[m][2]);
        split2<T>(a[m][2 * ks + 1][2], a[m][2 * ks + 1][3], hi[m][3], lo[m][3]);
      }
#pragma unroll
      for (int pb = 0; pb < TB::PARTS; ++pb) {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          u32 bf[4];
          ldsm<TB::KR>(bf, b0[pb] + step<TB::P, TB::KR>(np, ks) * 2);
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma<T>(acc[m][2 * np], hi[m], bf[0], bf[1]);
            mma<T>(acc[m][2 * np + 1], hi[m], bf[2], bf[3]);
            if (pb == 0) {
              mma<T>(acc[m][2 * np], lo[m], bf[0], bf[1]);
              mma<T>(acc[m][2 * np + 1], lo[m], bf[2], bf[3]);
            }
          }
        }
      }
    }
  } else {
    constexpr int PW = 16 * KS + 4;
    __syncwarp();  // the warp's earlier reads of wbuf are done
    frag_to_rows<MT, 2 * KS, PW>(wbuf, a, lane);
    __syncwarp();
    mm<MT, NT, KS>(acc, exact<PW, false>(static_cast<const float*>(wbuf)), b, lane, ks0, ks1);
  }
}

// Rows [0, ROWS) x COLS of T from global memory (row r at src + r * stride) into shared memory
// (pitch P) through cp.async, 16 bytes a thread a step, zeros from row `rows` on (the caller
// commits the group).
template <typename T, int ROWS, int COLS, int P, int THREADS>
__device__ __forceinline__ void load_tile(T* dst, const T* src, size_t stride, int rows, int tid) {
  constexpr int E = 16 / int(sizeof(T)), CHN = COLS / E, N = ROWS * CHN;
  static_assert(COLS % E == 0, "whole 16-byte chunks");
#pragma unroll 2  // (fully unrolled, the issued addresses crowd the registers)
  for (int s = 0; s < (N + THREADS - 1) / THREADS; ++s) {
    const int i = tid + s * THREADS;
    if (N % THREADS == 0 || i < N) {
      const int r = i / CHN, c = (i % CHN) * E;
      const bool valid = r < rows;
      cp_async16(smem_addr(dst + r * P + c), valid ? src + size_t(r) * stride + c : src, valid);
    }
  }
}

// The same for a derived float32 tile: on the half path split into hi/lo as it is stored
// (through registers: float4 loads), on the float32 path copied by cp.async.
template <typename T, int ROWS, int COLS, int P, int THREADS>
__device__ __forceinline__ void load_split(T* const (&dst)[Prec<T>::parts], const float* src,
                                           size_t stride, int rows, int tid) {
  if constexpr (Prec<T>::half) {
    constexpr int CHN = COLS / 4, N = ROWS * CHN, S = (N + THREADS - 1) / THREADS;
    constexpr int G = S < 8 ? S : 8;  // loads in flight at once: 8 float4 (32 registers)
#pragma unroll
    for (int s0 = 0; s0 < S; s0 += G) {
      float4 x[G];
#pragma unroll
      for (int s = 0; s < G; ++s) {
        const int i = tid + (s0 + s) * THREADS;
        const int r = i / CHN, c = (i % CHN) * 4;
        if ((N % THREADS == 0 || i < N) && s0 + s < S && r < rows) {
          x[s] = *reinterpret_cast<const float4*>(src + size_t(r) * stride + c);
        } else {
          x[s].x = x[s].y = x[s].z = x[s].w = 0.0f;
        }
      }
#pragma unroll
      for (int s = 0; s < G; ++s) {
        const int i = tid + (s0 + s) * THREADS;
        if ((N % THREADS == 0 || i < N) && s0 + s < S) {
          const int r = i / CHN, c = (i % CHN) * 4;
          put2<T>(dst, r * P + c, x[s].x, x[s].y);
          put2<T>(dst, r * P + c + 2, x[s].z, x[s].w);
        }
      }
    }
  } else {
    load_tile<float, ROWS, COLS, P, THREADS>(dst[0], src, stride, rows, tid);
  }
}

// load_split through registers on both paths, each element's value in the tile before (hi + lo,
// or the float) dotted with its new one on the way: this thread's part of <old, new>.
template <typename T, int ROWS, int COLS, int P, int THREADS>
__device__ __forceinline__ float swap_split(T* const (&dst)[Prec<T>::parts], const float* src,
                                            size_t stride, int tid) {
  constexpr int CHN = COLS / 4, N = ROWS * CHN, S = (N + THREADS - 1) / THREADS;
  constexpr int G = S < 8 ? S : 8;
  float dot = 0.0f;
#pragma unroll
  for (int s0 = 0; s0 < S; s0 += G) {
    float4 x[G];
#pragma unroll
    for (int s = 0; s < G; ++s) {
      const int i = tid + (s0 + s) * THREADS;
      if ((N % THREADS == 0 || i < N) && s0 + s < S) {
        x[s] = *reinterpret_cast<const float4*>(src + size_t(i / CHN) * stride + (i % CHN) * 4);
      }
    }
#pragma unroll
    for (int s = 0; s < G; ++s) {
      const int i = tid + (s0 + s) * THREADS;
      if ((N % THREADS == 0 || i < N) && s0 + s < S) {
        const int at = (i / CHN) * P + (i % CHN) * 4;
        const float nx[4] = {x[s].x, x[s].y, x[s].z, x[s].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float old = to_float(dst[0][at + e]);
          if constexpr (Prec<T>::half) {
            old += to_float(dst[1][at + e]);
          }
          dot = fmaf(old, nx[e], dot);
        }
        if constexpr (Prec<T>::half) {
          put2<T>(dst, at, nx[0], nx[1]);
          put2<T>(dst, at + 2, nx[2], nx[3]);
        } else {
          *reinterpret_cast<float4*>(dst[0] + at) = x[s];
        }
      }
    }
  }
  return dot;
}

// A float32 tile staged in shared memory (pitch PS) into a derived tile (half path: hi/lo).
template <typename T, int ROWS, int COLS, int PS, int P, int THREADS>
__device__ __forceinline__ void split_tile(T* const (&dst)[Prec<T>::parts], const float* src,
                                           int tid) {
  constexpr int CHN = COLS / 4, N = ROWS * CHN;
#pragma unroll 2  // (fully unrolled, the issued addresses crowd the registers)
  for (int s = 0; s < (N + THREADS - 1) / THREADS; ++s) {
    const int i = tid + s * THREADS;
    if (N % THREADS == 0 || i < N) {
      const int r = i / CHN, c = (i % CHN) * 4;
      const float4 x = *reinterpret_cast<const float4*>(src + r * PS + c);
      put2<T>(dst, r * P + c, x.x, x.y);
      put2<T>(dst, r * P + c + 2, x.z, x.w);
    }
  }
}

// N floats src[i * stride] (i < n; zeros after) into shared memory through cp.async.
template <int N, int THREADS>
__device__ __forceinline__ void load_vec(float* dst, const float* src, size_t stride, int n,
                                         int tid) {
#pragma unroll
  for (int s = 0; s < (N + THREADS - 1) / THREADS; ++s) {
    const int i = tid + s * THREADS;
    if (N % THREADS == 0 || i < N) {
      cp_async4(smem_addr(dst + i), i < n ? src + size_t(i) * stride : src, i < n);
    }
  }
}

// f(value, row, col) for every element of a warp's C fragments (rows and columns in the tile).
template <int MT, int NT, class F>
__device__ __forceinline__ void each(float (&c)[MT][NT][4], int lane, F f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        f(c[m][n][e], m * 16 + g + 8 * (e >> 1), n * 8 + 2 * t + (e & 1));
      }
    }
  }
}


// C fragments to global float32 rows (row r at dst + r * stride), rows [0, rows) only.
template <int MT, int NT>
__device__ __forceinline__ void store_frag(float* dst, size_t stride, const float (&c)[MT][NT][4],
                                           int lane, int rows = 16 * MT) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m * 16 + g + 8 * h;
      if (r < rows) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          *reinterpret_cast<float2*>(dst + size_t(r) * stride + n * 8 + 2 * t) =
              make_float2(c[m][n][2 * h], c[m][n][2 * h + 1]);
        }
      }
    }
  }
}

// C fragments from global float32 rows (the same addressing).
template <int MT, int NT>
__device__ __forceinline__ void load_frag(float (&c)[MT][NT][4], const float* src, size_t stride,
                                          int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const float2 x = *reinterpret_cast<const float2*>(
            src + size_t(m * 16 + g + 8 * h) * stride + n * 8 + 2 * t);
        c[m][n][2 * h] = x.x;
        c[m][n][2 * h + 1] = x.y;
      }
    }
  }
}


// A warp pair's partial C fragments summed (two warps sharing rows, each with part of a product's
// k range): this warp's go to `mine` (in fragment order, lane-major: no bank conflicts), the pair
// meets at named barrier `id` (64 threads), the partner's (`theirs`) are added. Both warps end
// with the same sums (a + b == b + a). `mine` is rewritten only after a barrier both pass later.
template <int MT, int NT>
__device__ __forceinline__ void pair_sum(float (&c)[MT][NT][4], float* mine, const float* theirs,
                                         int id, int lane) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mine[((m * NT + n) * 4 + e) * 32 + lane] = c[m][n][e];
      }
    }
  }
  bar_sync(id, 64);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c[m][n][e] += theirs[((m * NT + n) * 4 + e) * 32 + lane];
      }
    }
  }
}

// Rows g and g + 8 of a 16-row C fragment (NT n-tiles) dotted with the same rows of a staged
// tile (element (r, col) at rows[r * pitch + col]): the quad's sums, in every lane of the quad.
template <int NT, typename X>
__device__ __forceinline__ void row_dot(float (&out)[2], const float (&a)[1][NT][4],
                                        const X* rows, int pitch, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const X* row = rows + (g + 8 * hh) * pitch;
    float s = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s = fmaf(a[0][n][2 * hh], to_float(row[n * 8 + 2 * t]), s);
      s = fmaf(a[0][n][2 * hh + 1], to_float(row[n * 8 + 2 * t + 1]), s);
    }
    out[hh] = quad_sum(s);
  }
}
}  // namespace mlxwalk_dt
