// Tensor-core helpers for the CUDA-only half-precision attention kernels (*_tc.cu), in the shape
// of FlashAttention-2, over the primitives of metal_kernels/mma.cuh (which comes first in their
// header list, with the fragment layouts): operands read from shared memory with ldmatrix (rows
// padded by 16 bytes, so the eight rows of an 8x8 matrix fall in eight different groups of four
// banks), tiles copied from global memory with cp.async and double buffered. The C fragments of
// two neighbouring n-tiles are, once packed to T, the A fragment of one 16-wide k-step: the
// probabilities P (and dS) never leave the registers that computed them.

namespace mlxwalk_tc {
constexpr int PAD = 8;  // elements of padding per shared row: 16 bytes (see above)
constexpr float LOG2E = 1.4426950408889634f;
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Eight elements of S at src, converted to T, into shared memory at dst (16 bytes): the
// store's rows when its dtype is not the model's (a float32 store under bfloat16 queries).
template <typename T, typename S>
__device__ __forceinline__ void convert8(T* dst, const S* src) {
  alignas(16) S in[8];
#pragma unroll
  for (int i = 0; i < int(8 * sizeof(S) / 16); ++i) {
    reinterpret_cast<uint4*>(in)[i] = reinterpret_cast<const uint4*>(src)[i];
  }
  u32 out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[i] = pack2<T>(to_float(in[2 * i]), to_float(in[2 * i + 1]));
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
}

// One 16-byte chunk of a row of `a` (S) into shared memory: cp.async when S is T, else
// converted through registers.
template <typename T, typename S>
__device__ __forceinline__ void chunk_from(T* to, const S* from) {
  if constexpr (same_type<T, S>::value) {
    cp_async16(smem_addr(to), from, true);
  } else {
    convert8<T, S>(to, from);
  }
}

// x rounded to S (as a float): the dequantization's roundings, each operation in S.
template <typename S>
__device__ __forceinline__ float round_to(float x) {
  if constexpr (same_type<S, float>::value) {
    return x;
  } else {
    const u32 two = pack2<S>(x, x);
    return to_float(*reinterpret_cast<const S*>(&two));
  }
}

// Rows of D elements as the kernels read them into shared memory, 8 elements (16 bytes of T) a
// `chunk` (col a multiple of 8): a float store's rows, or Q and dO (G = 0: dtype S, `chunk_from`),
// or mlx-lm's 8-bit store read in place (G > 0): mx.quantize's triple, each row's D elements one
// byte each, four to a uint32 (element 4w + i in bits 8i..8i+7 of word w), per G elements of a
// row a scale and a bias in S (the model's dtype). MLX's affine quantization: an element is
// scale * q + bias, each operation rounded to S as mx.dequantize computes it, then rounded to T
// (the ops twin's read). `store_rows`: from row `row0` of the arrays on.
template <typename S, int D, int G>
struct StoreRows {
  const u32* x;  // D / 4 words a row
  const S* scales;  // D / G a row
  const S* biases;

  __device__ __forceinline__ static float value(u32 w, int i, float s, float b) {
    return round_to<S>(round_to<S>(s * float((w >> (8 * i)) & 0xffu)) + b);
  }
  template <typename T>
  __device__ __forceinline__ void chunk(T* to, size_t row, int col) const {
    const u32* w = x + (row * D + col) / 4;
    const size_t g = row * (D / G) + col / G;
    const float s = to_float(scales[g]), b = to_float(biases[g]);
    u32 out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 word = w[i / 2];
      const int e = 2 * (i % 2);
      out[i] = pack2<T>(value(word, e, s, b), value(word, e + 1, s, b));
    }
    *reinterpret_cast<uint4*>(to) = make_uint4(out[0], out[1], out[2], out[3]);
  }
};
template <typename S, int D>
struct StoreRows<S, D, 0> {
  const S* x;

  template <typename T>
  __device__ __forceinline__ void chunk(T* to, size_t row, int col) const {
    chunk_from<T, S>(to, x + row * D + col);
  }
};

template <typename S, int D, int G, typename X, typename Y>
__device__ __forceinline__ StoreRows<S, D, G> store_rows(const X* x, const Y* scales,
                                                         const Y* biases, size_t row0) {
  if constexpr (G == 0) {
    return {x + row0 * D};
  } else {
    return {reinterpret_cast<const u32*>(x) + row0 * (D / 4), scales + row0 * (D / G),
            biases + row0 * (D / G)};
  }
}

// Plain rows of T (Q, dO): G = 0.
template <int D, typename T>
__device__ __forceinline__ StoreRows<T, D, 0> rows_of(const T* x) {
  return {x};
}

// Rows [r0, r0 + ROWS) of a row space into shared memory (pitch D + PAD), 16 bytes per thread
// per step, consecutive threads on consecutive 16 bytes of a row (coalesced): row r is row r of
// `a` (StoreRows: the store) for r < split, b + (r - split) D (dtype T: the chunk's own rows,
// or Q and dO with split 0) for split <= r < end, zeros from end on. A tile wholly in one part
// (every tile but the one or two at the boundaries) takes affine addresses with no per-row
// choice; cp.async copies (the caller commits the group), a store of another dtype is
// converted (an 8-bit one dequantized) through registers.
template <typename T, int D, int ROWS, int THREADS, typename A>
__device__ __forceinline__ void load_span(T* dst, const A& a, const T* b, int r0, int split,
                                          int end, int tid) {
  constexpr int CH = D / 8, P = D + PAD, CHUNKS = ROWS * CH;
  static_assert(THREADS % CH == 0, "a step covers whole rows");
  constexpr int STEP = THREADS / CH, STEPS = (CHUNKS + THREADS - 1) / THREADS;
  const int rt = tid / CH, col = (tid % CH) * 8;
  T* to = dst + rt * P + col;
  if (r0 + ROWS <= split) {  // wholly the store's
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
      if (CHUNKS % THREADS == 0 || rt + i * STEP < ROWS) {
        a.chunk(to + i * STEP * P, size_t(r0 + rt + i * STEP), col);
      }
    }
  } else if (r0 >= split && r0 + ROWS <= end) {  // wholly b's
    const T* from = b + size_t(r0 - split + rt) * D + col;
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
      if (CHUNKS % THREADS == 0 || rt + i * STEP < ROWS) {
        cp_async16(smem_addr(to + i * STEP * P), from + size_t(i * STEP) * D, true);
      }
    }
  } else {  // a boundary: row by row
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
      const int r = rt + i * STEP, row = r0 + r;
      if (CHUNKS % THREADS == 0 || r < ROWS) {
        if (row < split) {
          a.chunk(to + i * STEP * P, size_t(row), col);
        } else {
          const bool valid = row < end;
          const T* from = valid ? b + size_t(row - split) * D + col : b;
          cp_async16(smem_addr(to + i * STEP * P), from, valid);
        }
      }
    }
  }
}

// N floats from src[0..n) to shared memory (zeros from n on), 4 bytes per thread per step.
template <int N, int THREADS>
__device__ __forceinline__ void load_floats(float* dst, const float* src, int n, int tid) {
#pragma unroll
  for (int i = 0; i < (N + THREADS - 1) / THREADS; ++i) {
    const int e = tid + i * THREADS;
    if (N % THREADS == 0 || e < N) {
      cp_async4(smem_addr(dst + e), e < n ? src + e : src, e < n);
    }
  }
}

// The A fragments of MT m-tiles of 16 rows by K columns at `a` (shared, pitch P), into
// registers: af[m][k-step].
template <typename T, int K, int P, int MT>
__device__ __forceinline__ void load_a(u32 (&af)[MT][K / 16][4], const T* a, int lane) {
  const u32 base = smem_addr(a + (lane & 15) * P + (lane >> 4) * 8);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      ldsm_x4(af[m][ks], base + (m * 16 * P + ks * 16) * int(sizeof(T)));
    }
  }
}

// acc[m][n] += A_m . B_n^T over K: A is MT m-tiles of 16 rows at `a`, B is NT n-tiles of 8 rows
// at `b`, both row-major in shared memory (pitch P) with K columns: S = Q K^T, dP = dO V^T and
// their transposes. A fragments are read once per k-step, each B fragment once per warp.
template <typename T, int K, int P, int MT, int NT>
__device__ __forceinline__ void mma_nt(float (&acc)[MT][NT][4], const T* a, const T* b,
                                       int lane) {
  static_assert(NT % 2 == 0, "n-tiles go in pairs (one ldmatrix.x4)");
  const u32 a0 = smem_addr(a + (lane & 15) * P + (lane >> 4) * 8);
  const u32 b0 = smem_addr(b + ((lane & 7) + (lane >> 4) * 8) * P + ((lane >> 3) & 1) * 8);
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    u32 af[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      ldsm_x4(af[m], a0 + (m * 16 * P + ks * 16) * int(sizeof(T)));
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 bf[4];
      ldsm_x4(bf, b0 + (np * 16 * P + ks * 16) * int(sizeof(T)));
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma<T>(acc[m][2 * np], af[m], bf[0], bf[1]);
        mma<T>(acc[m][2 * np + 1], af[m], bf[2], bf[3]);
      }
    }
  }
}

// The same with A already in registers (af from load_a).
template <typename T, int K, int P, int MT, int NT>
__device__ __forceinline__ void mma_nt_ra(float (&acc)[MT][NT][4], const u32 (&af)[MT][K / 16][4],
                                          const T* b, int lane) {
  static_assert(NT % 2 == 0, "n-tiles go in pairs (one ldmatrix.x4)");
  const u32 b0 = smem_addr(b + ((lane & 7) + (lane >> 4) * 8) * P + ((lane >> 3) & 1) * 8);
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 bf[4];
      ldsm_x4(bf, b0 + (np * 16 * P + ks * 16) * int(sizeof(T)));
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma<T>(acc[m][2 * np], af[m][ks], bf[0], bf[1]);
        mma<T>(acc[m][2 * np + 1], af[m][ks], bf[2], bf[3]);
      }
    }
  }
}

// acc[m][n] += A_m . B over KK k-steps of 16: A in registers (packed probabilities or dS), B
// row-major [k][n] in shared memory (pitch P), read transposed by ldmatrix: O += P V,
// dQ += dS K, dV += P^T dO, dK += dS^T Q. NN n-tiles of 8 columns from `b`.
template <typename T, int KK, int P, int MT, int NN>
__device__ __forceinline__ void mma_nn(float (&acc)[MT][NN][4], const u32 (&af)[MT][KK][4],
                                       const T* b, int lane) {
  static_assert(NN % 2 == 0, "n-tiles go in pairs (one ldmatrix.x4)");
  const u32 b0 = smem_addr(b + ((lane & 7) + ((lane >> 3) & 1) * 8) * P + (lane >> 4) * 8);
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
    for (int np = 0; np < NN / 2; ++np) {
      u32 bf[4];
      ldsm_x4_t(bf, b0 + (kk * 16 * P + np * 16) * int(sizeof(T)));
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma<T>(acc[m][2 * np], af[m][kk], bf[0], bf[1]);
        mma<T>(acc[m][2 * np + 1], af[m][kk], bf[2], bf[3]);
      }
    }
  }
}

// C fragments (MT x NT n-tiles of 8 columns) packed to T as A fragments of NT / 2 k-steps.
template <typename T, int MT, int NT>
__device__ __forceinline__ void to_a(u32 (&af)[MT][NT / 2][4], const float (&c)[MT][NT][4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
      af[m][kk][0] = pack2<T>(c[m][2 * kk][0], c[m][2 * kk][1]);
      af[m][kk][1] = pack2<T>(c[m][2 * kk][2], c[m][2 * kk][3]);
      af[m][kk][2] = pack2<T>(c[m][2 * kk + 1][0], c[m][2 * kk + 1][1]);
      af[m][kk][3] = pack2<T>(c[m][2 * kk + 1][2], c[m][2 * kk + 1][3]);
    }
  }
}

}  // namespace mlxwalk_tc
