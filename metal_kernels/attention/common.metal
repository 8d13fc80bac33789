// Shared by the chunk-attention kernels (Metal), which multiply 8x8 simdgroup matrices in float.
// Operands come from threadgroup memory (staged once per threadgroup in the inputs' dtype) or
// device memory; each lane loads only its own two elements of a matrix (Apple's layout, below)
// and converts them to float, as MLX's steel kernels do, so no load is a simdgroup collective.
// Scores are kept in the log2 domain: s * scale * log2(e), and fast::exp2 (what MLX's steel
// attention uses; the safe math mode's exp2 is the precise one).
// A lane's tiles live in arrays (`simdgroup_float8x8 acc[DT]`) indexed only in loops marked
// UNROLL with compile-time trip counts, so after unrolling every index is a constant and the
// tiles stay in registers: Apple GPUs have no fast stack, and a tile array indexed at run time
// goes to memory. Bounds known only at run time (the causal edge) are predicates inside.

#define UNROLL _Pragma("clang loop unroll(full)")

constant constexpr float LOG2E = 1.4426950408889634f;
constant constexpr float LN2 = 0.6931471805599453f;
// A masked score and the running max before any key: finite (-FLT_MAX), as MLX's steel
// attention keeps it, so no difference of two of them is inf - inf. Probabilities of masked
// scores are set to 0 by a select, not left to exp2 of a large negative number.
constant constexpr float MASKED = -3.402823466e38f;

// Apple's element-to-lane map of an 8x8 simdgroup matrix: lane holds (row, col) and
// (row, col + 1). A row's 8 values sit in the 4 lanes that differ in bits 0 and 3.
inline ushort frag_row(ushort lane) {
  return ((lane / 4) & 4) + (lane / 2) % 4;
}
inline ushort frag_col(ushort lane) {
  return ((lane / 4) & 2) * 2 + (lane % 2) * 2;
}

// The 8x8 block at (r0, c0) of a row-major matrix with `ld` elements a row; `(r, c)` the
// lane's frag_row, frag_col.
template <typename X>
inline void load_tile(thread simdgroup_float8x8& m, const threadgroup X* src, int ld, int r0,
                      int c0, ushort r, ushort c) {
  const int at = (r0 + r) * ld + c0 + c;
  m.thread_elements() = float2(float(src[at]), float(src[at + 1]));
}

// The transpose of the 8x8 block at (c0, r0): element (i, j) is src[(c0 + j) * ld + r0 + i].
template <typename X>
inline void load_tile_t(thread simdgroup_float8x8& m, const threadgroup X* src, int ld, int r0,
                        int c0, ushort r, ushort c) {
  const int at = (c0 + c) * ld + r0 + r;
  m.thread_elements() = float2(float(src[at]), float(src[at + ld]));
}

// Four elements as raw bits, by element size: copies need no vector of T (bfloat has none
// before Metal 3.1, where MLX's bfloat16_t is a struct).
template <int N> struct Bits;
template <> struct Bits<2> {
  typedef ushort4 four;
};
template <> struct Bits<4> {
  typedef uint4 four;
};

// dst[0..4) = src[0..4) as T: converted element by element from another dtype, copied as one
// vector from the same (the more specialized overload).
template <typename T, typename S>
inline void put4(threadgroup T* dst, const device S* src) {
  for (int i = 0; i < 4; ++i) {
    dst[i] = T(float(src[i]));
  }
}
template <typename T>
inline void put4(threadgroup T* dst, const device T* src) {
  typedef typename Bits<sizeof(T)>::four raw;
  *reinterpret_cast<threadgroup raw*>(dst) = *reinterpret_cast<const device raw*>(src);
}
template <typename T>
inline void zero4(threadgroup T* dst) {
  typedef typename Bits<sizeof(T)>::four raw;
  *reinterpret_cast<threadgroup raw*>(dst) = raw(0);  // +0 in every float format
}

// Stage `rows` rows of D elements, row r0 + r of `src` (zeros from row `end`), in `dst` with
// `ld` elements a row: 4 elements a thread at a time (D and ld are multiples of 4; threadgroup
// arrays cast to vectors as MLX's steel loaders do), consecutive threads on consecutive pieces.
template <int D, typename T>
inline void stage_rows(threadgroup T* dst, int ld, int rows, const device T* src, int r0, int end,
                       uint tid, uint threads) {
  for (uint e = 4 * tid; e < uint(rows * D); e += 4 * threads) {
    const int r = e / D, c = e % D;
    if (r0 + r < end) {
      put4(dst + r * ld + c, src + size_t(r0 + r) * D + c);
    } else {
      zero4(dst + r * ld + c);
    }
  }
}

// The store's rows of one K/V head as the kernels read them (`store_rows`: from the head's first
// row, `row0`): a float store's elements (G = 0; P its dtype S, `scales` and `biases` unused), or
// mlx-lm's 8-bit format (G > 0), mx.quantize's triple read in place: each row's D elements one
// byte each, packed four to a uint32 (element 4w + i in bits 8i..8i+7 of word w), and per G
// elements of a row a scale and a bias in S (the model's dtype; QP their pointer type: MLX passes
// an input of fewer than 8 elements in `constant` memory). MLX's affine quantization: an element
// is scale * q + bias, each operation rounded to S as mx.dequantize computes it, so the kernels
// read the values the ops twin dequantizes. `four`: elements c..c+3 of a row as T into
// threadgroup memory (c a multiple of 4: one word, one group); `at`: one element as a float.
template <typename S, int D, int G, typename P, typename QP, bool BYTES = (G > 0)>
struct StoreRows {
  const device P* x;
  QP scales;  // (unused)
  QP biases;

  template <typename T>
  void four(threadgroup T* dst, int row, int c) const {
    put4(dst, x + size_t(row) * D + c);
  }
  float at(int row, int d) const {
    return float(x[size_t(row) * D + d]);
  }
};

template <typename S, int D, int G, typename P, typename QP>
struct StoreRows<S, D, G, P, QP, true> {
  const device P* x;  // uint32 words, D / 4 a row
  QP scales;  // D / G a row
  QP biases;

  // element i (0..3) of word w, its group's scale s and bias b as floats
  static float value(uint w, int i, float s, float b) {
    return float(S(float(S(s * float((w >> (8 * i)) & 0xffu))) + b));
  }
  template <typename T>
  void four(threadgroup T* dst, int row, int c) const {
    const uint w = x[(size_t(row) * D + c) / 4];
    const size_t g = size_t(row) * (D / G) + c / G;
    const float s = float(scales[g]), b = float(biases[g]);
    UNROLL for (int i = 0; i < 4; ++i) {
      dst[i] = T(value(w, i, s, b));
    }
  }
  float at(int row, int d) const {
    const size_t g = size_t(row) * (D / G) + d / G;
    const uint w = x[(size_t(row) * D + d) / 4];
    return value(w, d % 4, float(scales[g]), float(biases[g]));
  }
};

// StoreRows from row `row0` of the head's arrays on (the offsets an 8-bit store's own).
template <typename S, int D, int G, typename P, typename QP>
inline StoreRows<S, D, G, P, QP> store_rows(const device P* x, QP scales, QP biases,
                                            size_t row0) {
  const size_t words = G > 0 ? D / 4 : D;  // elements of P a row
  const size_t groups = G > 0 ? D / (G > 0 ? G : 1) : 0;  // scales a row
  return {x + row0 * words, scales + row0 * groups, biases + row0 * groups};
}

// Stage key rows [k0, k0 + rows) of the window as T, 4 elements a thread at a time: below
// `start` from the store (StoreRows: its dtype converted or its 8-bit rows dequantized, as the
// ops twin reads them), then the chunk's own rows, zeros from `end`.
template <int D, typename T, typename R>
inline void stage_keys(threadgroup T* dst, int ld, int rows, thread const R& store,
                       const device T* own, int k0, int start, int end, uint tid, uint threads) {
  for (uint e = 4 * tid; e < uint(rows * D); e += 4 * threads) {
    const int r = e / D, c = e % D, key = k0 + r;
    if (key < start) {
      store.four(dst + r * ld + c, key, c);
    } else if (key < end) {
      put4(dst + r * ld + c, own + size_t(key - start) * D + c);
    } else {
      zero4(dst + r * ld + c);
    }
  }
}

inline simdgroup_float8x8 zero_tile() {
  return make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

// The largest and the sum of a row's 8 values, each lane holding 2 of them (Apple's layout).
inline float row_max(float x) {
  x = metal::max(x, simd_shuffle_xor(x, 1));
  return metal::max(x, simd_shuffle_xor(x, 8));
}
inline float row_sum(float x) {
  x += simd_shuffle_xor(x, 1);
  return x + simd_shuffle_xor(x, 8);
}

// Post this simdgroup's partial tiles x[0, n) (its 8 rows, 8 N columns) to its slot of `slot`
// (8 x 8 N floats); `(r, c)` the lane's frag_row, frag_col.
template <int N>
inline void post_partial(threadgroup float* slot, thread simdgroup_float8x8 (&x)[N], int n,
                         ushort r, ushort c) {
  UNROLL for (int j = 0; j < N; ++j) {
    if (j < n) {
      const float2 e = x[j].thread_elements();
      slot[r * 8 * N + 8 * j + c] = e[0];
      slot[r * 8 * N + 8 * j + c + 1] = e[1];
    }
  }
}

// x[0, n) = the sum of P partners' partial tiles, posted in consecutive slots from `first`,
// added in the same order by every partner (so all of them hold the same sums).
template <int P, int N>
inline void sum_partials(thread simdgroup_float8x8 (&x)[N], const threadgroup float* first, int n,
                         ushort r, ushort c) {
  UNROLL for (int j = 0; j < N; ++j) {
    if (j < n) {
      float2 e = 0.0f;
      UNROLL for (int p = 0; p < P; ++p) {
        const int at = p * 8 * 8 * N + r * 8 * N + 8 * j + c;
        e += float2(first[at], first[at + 1]);
      }
      x[j].thread_elements() = e;
    }
  }
}
