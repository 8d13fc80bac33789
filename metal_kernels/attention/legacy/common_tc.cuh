// Tensor-core helpers for the CUDA-only half-precision attention kernels (*_tc.cu): warp-level
// 16x16x16 matrix products through nvcuda::wmma, float accumulation, operands in shared memory.
#include <mma.h>

namespace mlxwalk_tc {
namespace wm = nvcuda::wmma;
template <typename T>
using FragA = wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major>;
template <typename T>
using FragBt = wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major>;
template <typename T>
using FragB = wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major>;
using FragC = wm::fragment<wm::accumulator, 16, 16, 16, float>;

// out (16 x 16 NT, float, ld ldo) = a (16 x K, ld lda) . b^T, b being 16 NT rows of K (ld ldb).
template <typename T, int K, int NT>
__device__ inline void rows_by_rows(float* out, int ldo, const T* a, int lda, const T* b, int ldb) {
  FragC c[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    wm::fill_fragment(c[n], 0.0f);
  }
#pragma unroll 4
  for (int kk = 0; kk < K; kk += 16) {
    FragA<T> fa;
    wm::load_matrix_sync(fa, a + kk, lda);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      FragBt<T> fb;
      wm::load_matrix_sync(fb, b + n * 16 * ldb + kk, ldb);
      wm::mma_sync(c[n], fa, fb, c[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    wm::store_matrix_sync(out + n * 16, c[n], ldo, wm::mem_row_major);
  }
}

// acc[n] += a (16 x K, ld lda) . b (K x 16 NT, ld ldb), n over NT column tiles, acc in registers.
template <typename T, int K, int NT>
__device__ inline void accumulate_in(FragC* acc, const T* a, int lda, const T* b, int ldb) {
#pragma unroll
  for (int kk = 0; kk < K; kk += 16) {
    FragA<T> fa;
    wm::load_matrix_sync(fa, a + kk, lda);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      FragB<T> fb;
      wm::load_matrix_sync(fb, b + kk * ldb + n * 16, ldb);
      wm::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// Element e of a 16x16 float accumulator fragment lies in row (lane / 4) + 8 ((e / 2) % 2) of
// it on sm_80 and later (the layout of two m16n8k16 mma tiles); the forward's per-row rescaling
// relies on it, and the self-check would catch a GPU where it does not hold.
__device__ inline int fragment_row(int lane, int e) { return lane / 4 + 8 * ((e / 2) % 2); }

template <typename A, typename B>
struct same_type {
  static constexpr bool value = false;
};
template <typename A>
struct same_type<A, A> {
  static constexpr bool value = true;
};

// Eight elements, src to shared dst, as T: one 16-byte copy when the types agree, else a vector
// load and a conversion through float.
template <typename T, typename X>
__device__ inline void copy8(T* dst, const X* src) {
  if constexpr (same_type<T, X>::value) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    alignas(16) X buf[8];
    for (int i = 0; i < int(8 * sizeof(X) / 16); ++i) {
      reinterpret_cast<uint4*>(buf)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      dst[i] = static_cast<T>(static_cast<float>(buf[i]));
    }
  }
}

// Stage `rows` rows of D elements into shared memory as T (row pitch `ld`), eight at a time.
// row(r, own, store) points one of own (a T row) or store (an S row) at row r's data, or
// neither for a row of zeros.
template <typename T, typename S, int D, typename F>
__device__ inline void stage_rows(T* dst, int ld, int rows, F row, int tid, int threads) {
  for (int e = tid; e < rows * (D / 8); e += threads) {
    const int r = e / (D / 8), d = (e % (D / 8)) * 8;
    const T* own = nullptr;
    const S* store = nullptr;
    row(r, own, store);
    T* out = dst + r * ld + d;
    if (own != nullptr) {
      copy8(out, own + d);
    } else if (store != nullptr) {
      copy8(out, store + d);
    } else {
      *reinterpret_cast<uint4*>(out) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Row pitches in shared memory, padded so that the rows of a 16x16 fragment fall in different
// banks (a pitch of a multiple of 128 bytes puts them all in one); wmma needs pitches in
// multiples of 16 bytes and fragments on 32-byte boundaries, which these keep.
template <int D>
struct Pitch {
  static constexpr int half = D + 8;  // rows of D in T
  static constexpr int tile = 32 + 8;  // rows of a 32-wide tile in T
  static constexpr int score = 32 + 4;  // rows of a 32-wide tile in float
  static constexpr int acc = D + 4;  // rows of D in float
};
}  // namespace mlxwalk_tc
