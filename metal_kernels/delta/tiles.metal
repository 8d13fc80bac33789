// Shared by the chunked delta-rule kernels (Metal), which multiply 8x8 simdgroup matrices in
// float. A chunk is CHUNK = 64 positions, 8 tiles of 8 rows. Operands shared by a threadgroup's
// simdgroups are staged in threadgroup memory; a lane loads only its own two elements of a tile
// (Apple's layout, below) and converts them to float, so no load is a simdgroup collective.
// A chunk's lower-triangular C x C matrices (A, T, P = QK^T (.) decay, dP) are held in
// threadgroup memory as their 36 lower 8x8 tiles, packed: tile (i, j), j <= i, is the 64 floats
// from tri_at(i, j), row-major. The decays exp(cum_i - cum_j) keep Metal's precise exp: no mask
// here is a -infinity (masked elements are selected away), and with C^2 of them a chunk against
// C^2 D products the precise one costs little, where fast::exp's error grows with |x| (cum
// reaches tens over a chunk).

constant constexpr int CHUNK = 64;
constant constexpr int TRI_TILES = 36;  // 8 x 9 / 2

// Every loop over a lane's tiles unrolls in full, and so does every staged loop whose step picks
// a tile of such an array (the trip counts are template values): after unrolling each index into
// a per-lane tile array is a constant, and the array lives in registers. A runtime index would
// put it in memory (Apple GPUs have no fast stack; their compiler would rather spill to device
// memory). Clang's loop pragma, as MLX's steel kernels write it; nothing for other compilers (the
// CPU harness's g++ runs the loops as written).
#if defined(__clang__)
#define DELTA_UNROLL _Pragma("clang loop unroll(full)")
#else
#define DELTA_UNROLL
#endif

// Apple's element-to-lane map of an 8x8 simdgroup matrix: lane holds (row, col) and
// (row, col + 1). A row's 8 values sit in the 4 lanes that differ in bits 0 and 3.
inline ushort frag_row(ushort lane) {
  return ((lane / 4) & 4) + (lane / 2) % 4;
}
inline ushort frag_col(ushort lane) {
  return ((lane / 4) & 2) * 2 + (lane % 2) * 2;
}

inline simdgroup_float8x8 zero_tile() {
  return make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
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

// Packed lower tiles: tile (i, j) with j <= i, its transpose, a store.
inline int tri_at(int i, int j) {
  return (i * (i + 1) / 2 + j) * 64;
}
inline void load_packed(thread simdgroup_float8x8& m, const threadgroup float* src, int i, int j,
                        ushort r, ushort c) {
  const int at = tri_at(i, j) + r * 8 + c;
  m.thread_elements() = float2(src[at], src[at + 1]);
}
inline void load_packed_t(thread simdgroup_float8x8& m, const threadgroup float* src, int i,
                          int j, ushort r, ushort c) {
  const int at = tri_at(i, j) + c * 8 + r;
  m.thread_elements() = float2(src[at], src[at + 8]);
}
inline void store_packed(simdgroup_float8x8 m, threadgroup float* dst, int i, int j, ushort r,
                         ushort c) {
  const float2 e = m.thread_elements();
  const int at = tri_at(i, j) + r * 8 + c;
  dst[at] = e[0];
  dst[at + 1] = e[1];
}
// The packed tile index -> (i, j).
inline void tri_tile(int t, thread int& i, thread int& j) {
  i = 0;
  while (t > i) {
    t -= i + 1;
    ++i;
  }
  j = t;
}

// This lane's part of sum(a (.) b) over the tiles' elements; its row's total after row_sum.
inline float lane_dot(simdgroup_float8x8 a, simdgroup_float8x8 b) {
  const float2 x = a.thread_elements(), y = b.thread_elements();
  return x[0] * y[0] + x[1] * y[1];
}
// The sum of a row's 8 values, each lane holding 2 of them (Apple's layout).
inline float row_sum(float x) {
  x += simd_shuffle_xor(x, 1);
  return x + simd_shuffle_xor(x, 8);
}

// a *= s, and the negation, on the lane's own elements.
inline void scale_tile(thread simdgroup_float8x8& m, float s) {
  m.thread_elements() *= s;
}
inline void negate_tile(thread simdgroup_float8x8& m) {
  m.thread_elements() = -m.thread_elements();
}

// Four elements as raw bits, by element size: same-dtype copies need no vector of T (bfloat has
// none before Metal 3.1, where MLX's bfloat16_t is a struct).
template <int N> struct Bits;
template <> struct Bits<2> {
  typedef ushort4 four;
};
template <> struct Bits<4> {
  typedef uint4 four;
};

// dst[0..4) = src[0..4) as D: converted element by element from another dtype, copied as one
// vector from the same (the more specialized overload).
template <typename D, typename S>
inline void put4(threadgroup D* dst, const device S* src) {
  for (int i = 0; i < 4; ++i) {
    dst[i] = D(float(src[i]));
  }
}
template <typename D>
inline void put4(threadgroup D* dst, const device D* src) {
  typedef typename Bits<sizeof(D)>::four raw;
  *reinterpret_cast<threadgroup raw*>(dst) = *reinterpret_cast<const device raw*>(src);
}
template <typename D>
inline void zero4(threadgroup D* dst) {
  typedef typename Bits<sizeof(D)>::four raw;
  *reinterpret_cast<threadgroup raw*>(dst) = raw(0);  // +0 in every float format
}

// Stage `rows` rows of `cols` elements, row r at src + r * stride, in dst with `ld` elements a
// row; rows from `valid` are zeros (positions past the sequence). 4 elements a thread at a time
// (cols, ld, stride multiples of 4), consecutive threads on consecutive pieces.
template <typename D, typename S>
inline void stage(threadgroup D* dst, int ld, const device S* src, size_t stride, int rows,
                  int valid, int cols, uint tid, uint threads) {
  for (uint e = 4 * tid; e < uint(rows * cols); e += 4 * threads) {
    const int r = e / cols, c = e % cols;
    if (r < valid) {
      put4(dst + r * ld + c, src + r * stride + c);
    } else {
      zero4(dst + r * ld + c);
    }
  }
}
