// What the kernel bodies use of Metal, in C++. Two builds of the same source (harness/__init__.py):
//   g++ (with runtime.h): MLX's generated source compiled and run on the CPU, every thread of a
//     threadgroup a pthread; address spaces are defined away.
//   clang, HARNESS_SPACES: parsed only, with Metal's address spaces as clang's, so a pointer that
//     crosses them (a threadgroup array where a device pointer is expected) fails as on a Mac.
//   clang, HARNESS_SPACES and HARNESS_PROXY: compiled to LLVM IR (harness/proxy.py), with the
//     simdgroup functions and matrix operations as opaque calls on values, as Metal's builtins
//     are, so that their stand-ins neither take a lane's tiles by address nor inflate the loops.
#pragma once

#ifdef HARNESS_SPACES
// Nothing runs: no system header is read and the runtime is declared, not defined.
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#define HARNESS_THREADGROUP(name)
#define HARNESS_EACH_SPACE(F) F(device) F(threadgroup)
using size_t = decltype(sizeof 0);
using int8_t = signed char;
using uint8_t = unsigned char;
using int16_t = short;
using uint16_t = unsigned short;
using int32_t = int;
using uint32_t = unsigned int;
using int64_t = long;
using uint64_t = unsigned long;
// Builtin types only: a class object in device or threadgroup memory would need member
// functions qualified with an address space, which clang's C++ has not (Metal's has).
using bfloat16_t = __bf16;
namespace metal {
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
}
#else
#include <stdint.h>
#define HARNESS_EACH_SPACE(F) F()
// bfloat16 as Metal and MLX hold it: the top half of a float32 (round to nearest even on store).
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    bits = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
};

namespace harness {
template <bool B> struct enable_if {};
template <> struct enable_if<true> {
  using type = int;
};
template <class X> struct same {  // a non-deduced context: a scalar converts to the element type
  using type = X;
};
}  // namespace harness

namespace metal {
template <class T, int N> struct vec_members;
template <class T> struct vec_members<T, 2> {
  T x, y;
};
template <class T> struct vec_members<T, 3> {
  T x, y, z;
};
template <class T> struct vec_members<T, 4> {
  T x, y, z, w;
};

// Metal's vectors: components, a scalar splat, one value per component, explicit conversions.
template <class T, int N> struct vec : vec_members<T, N> {
  vec() = default;
  vec(T s) {
    for (int i = 0; i < N; ++i) (*this)[i] = s;
  }
  template <class... A, typename harness::enable_if<sizeof...(A) == N>::type = 0>
  vec(A... a) {
    const T v[] = {T(a)...};
    for (int i = 0; i < N; ++i) (*this)[i] = v[i];
  }
  template <class U> explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
  }
  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }
};

#define HARNESS_VEC_OP(OP)                                                                      \
  template <class T, int N> inline vec<T, N> operator OP(vec<T, N> a, const vec<T, N>& b) {     \
    for (int i = 0; i < N; ++i) a[i] = T(a[i] OP b[i]);                                         \
    return a;                                                                                   \
  }                                                                                             \
  template <class T, int N>                                                                     \
  inline vec<T, N> operator OP(vec<T, N> a, typename harness::same<T>::type s) {                \
    for (int i = 0; i < N; ++i) a[i] = T(a[i] OP s);                                            \
    return a;                                                                                   \
  }                                                                                             \
  template <class T, int N>                                                                     \
  inline vec<T, N> operator OP(typename harness::same<T>::type s, vec<T, N> a) {                \
    for (int i = 0; i < N; ++i) a[i] = T(s OP a[i]);                                            \
    return a;                                                                                   \
  }                                                                                             \
  template <class T, int N> inline vec<T, N>& operator OP##=(vec<T, N>& a, const vec<T, N>& b) { \
    return a = a OP b;                                                                          \
  }                                                                                             \
  template <class T, int N>                                                                     \
  inline vec<T, N>& operator OP##=(vec<T, N>& a, typename harness::same<T>::type s) {           \
    return a = a OP s;                                                                          \
  }
HARNESS_VEC_OP(+)
HARNESS_VEC_OP(-)
HARNESS_VEC_OP(*)
HARNESS_VEC_OP(/)
#undef HARNESS_VEC_OP
template <class T, int N> inline vec<T, N> operator-(vec<T, N> a) {
  for (int i = 0; i < N; ++i) a[i] = T(-a[i]);
  return a;
}
}  // namespace metal
#endif

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = unsigned long;  // 64 bits, as Metal's
using half = _Float16;
using bfloat = bfloat16_t;
using float16_t = half;  // MLX names float16 so
using metal::vec;
#define HARNESS_VECTORS(T, NAME) \
  using NAME##2 = vec<T, 2>;     \
  using NAME##3 = vec<T, 3>;     \
  using NAME##4 = vec<T, 4>;
HARNESS_VECTORS(float, float)
HARNESS_VECTORS(half, half)
HARNESS_VECTORS(bfloat16_t, bfloat)
HARNESS_VECTORS(int, int)
HARNESS_VECTORS(uint, uint)
HARNESS_VECTORS(short, short)
HARNESS_VECTORS(ushort, ushort)
HARNESS_VECTORS(long, long)
HARNESS_VECTORS(ulong, ulong)
HARNESS_VECTORS(char, char)
HARNESS_VECTORS(uchar, uchar)
#undef HARNESS_VECTORS

#ifdef HARNESS_SPACES
// Metal writes `float2(a, b)`; clang's C++ casts to a builtin vector from one value only.
namespace harness {
template <class V, class... A> V make(A... a);
uint lane_id();
void simd_sync();
double* slots();
void slots_done();
void threadgroup_sync();
void simdgroup_sync();
void count_mma();
}  // namespace harness
#define HARNESS_MAKE(N) harness::make<N>
#define float2(...) HARNESS_MAKE(float2)(__VA_ARGS__)
#define float3(...) HARNESS_MAKE(float3)(__VA_ARGS__)
#define float4(...) HARNESS_MAKE(float4)(__VA_ARGS__)
#define half2(...) HARNESS_MAKE(half2)(__VA_ARGS__)
#define half3(...) HARNESS_MAKE(half3)(__VA_ARGS__)
#define half4(...) HARNESS_MAKE(half4)(__VA_ARGS__)
#define bfloat2(...) HARNESS_MAKE(bfloat2)(__VA_ARGS__)
#define bfloat3(...) HARNESS_MAKE(bfloat3)(__VA_ARGS__)
#define bfloat4(...) HARNESS_MAKE(bfloat4)(__VA_ARGS__)
#define int2(...) HARNESS_MAKE(int2)(__VA_ARGS__)
#define int3(...) HARNESS_MAKE(int3)(__VA_ARGS__)
#define int4(...) HARNESS_MAKE(int4)(__VA_ARGS__)
#define uint2(...) HARNESS_MAKE(uint2)(__VA_ARGS__)
#define uint3(...) HARNESS_MAKE(uint3)(__VA_ARGS__)
#define uint4(...) HARNESS_MAKE(uint4)(__VA_ARGS__)
#define short2(...) HARNESS_MAKE(short2)(__VA_ARGS__)
#define ushort2(...) HARNESS_MAKE(ushort2)(__VA_ARGS__)
#define long2(...) HARNESS_MAKE(long2)(__VA_ARGS__)
#define ulong2(...) HARNESS_MAKE(ulong2)(__VA_ARGS__)
#else
#include "runtime.h"
// A `threadgroup` declaration (made function-static by the harness) registers its span, for the
// memory counters and the 32 KiB a threadgroup has on Apple GPUs.
#define HARNESS_THREADGROUP(name) \
  static harness::Storage harness_storage_##name(&name, sizeof(name))
#endif

#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define HUGE_VALF __builtin_huge_valf()
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__

namespace metal {
enum class mem_flags {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 16,
  mem_object_data = 32
};
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

// Math (float; other scalars convert), and on vectors component by component.
#define HARNESS_MATH(NAME, EXPR)                                                 \
  inline float NAME(float x) { return EXPR; }                                    \
  template <class T, int N> inline vec<T, N> NAME(vec<T, N> v) {                 \
    for (int i = 0; i < N; ++i) v[i] = T(NAME(float(v[i])));                     \
    return v;                                                                    \
  }
#define HARNESS_MATHS                                                            \
  HARNESS_MATH(exp, __builtin_expf(x))                                           \
  HARNESS_MATH(exp2, __builtin_exp2f(x))                                         \
  HARNESS_MATH(log, __builtin_logf(x))                                           \
  HARNESS_MATH(log2, __builtin_log2f(x))                                         \
  HARNESS_MATH(sqrt, __builtin_sqrtf(x))                                         \
  HARNESS_MATH(rsqrt, 1.0f / __builtin_sqrtf(x))                                 \
  HARNESS_MATH(fabs, __builtin_fabsf(x))                                         \
  HARNESS_MATH(floor, __builtin_floorf(x))                                       \
  HARNESS_MATH(ceil, __builtin_ceilf(x))                                         \
  HARNESS_MATH(tanh, __builtin_tanhf(x))
HARNESS_MATHS
namespace fast {
HARNESS_MATHS
}
namespace precise {
HARNESS_MATHS
}
#undef HARNESS_MATHS
#undef HARNESS_MATH
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
template <class T, int N> inline vec<T, N> fma(vec<T, N> a, vec<T, N> b, vec<T, N> c) {
  for (int i = 0; i < N; ++i) a[i] = T(fma(float(a[i]), float(b[i]), float(c[i])));
  return a;
}
template <class X> inline X abs(X a) { return a < X(0) ? X(-a) : a; }
template <class X> inline X max(X a, X b) { return a > b ? a : b; }
template <class X> inline X min(X a, X b) { return a < b ? a : b; }
template <class X> inline X clamp(X x, X lo, X hi) { return min(max(x, lo), hi); }
template <class T, int N> inline vec<T, N> max(vec<T, N> a, vec<T, N> b) {
  for (int i = 0; i < N; ++i) a[i] = max(a[i], b[i]);
  return a;
}
template <class T, int N> inline vec<T, N> min(vec<T, N> a, vec<T, N> b) {
  for (int i = 0; i < N; ++i) a[i] = min(a[i], b[i]);
  return a;
}
template <class To, class From> inline To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type keeps the size");
  To t;
  __builtin_memcpy(&t, &x, sizeof(To));
  return t;
}

inline void threadgroup_barrier(mem_flags) { harness::threadgroup_sync(); }
inline void simdgroup_barrier(mem_flags) { harness::simdgroup_sync(); }
}  // namespace metal

namespace harness {
#ifdef HARNESS_PROXY
template <class X> X builtin(X x);  // a simdgroup function: the lane's value in, one out
template <class X, class F> inline X exchange(X x, F) { return builtin(x); }
#else
// Every lane posts its value, all meet once, then each reads what it needs (runtime.h: slots).
template <class X, class F> inline X exchange(X x, F read) {
  double* s = slots();
  s[lane_id()] = double(x);
  simd_sync();
  X out = read(s);
  slots_done();
  return out;
}
#endif
}  // namespace harness

namespace metal {
template <class X> inline X simd_sum(X x) {
  return harness::exchange(x, [](const double* s) {
    X a = X(s[0]);
    for (int i = 1; i < 32; ++i) a = X(a + X(s[i]));
    return a;
  });
}
template <class X> inline X simd_max(X x) {
  return harness::exchange(x, [](const double* s) {
    X a = X(s[0]);
    for (int i = 1; i < 32; ++i) a = X(s[i]) > a ? X(s[i]) : a;
    return a;
  });
}
template <class X> inline X simd_min(X x) {
  return harness::exchange(x, [](const double* s) {
    X a = X(s[0]);
    for (int i = 1; i < 32; ++i) a = X(s[i]) < a ? X(s[i]) : a;
    return a;
  });
}
template <class X> inline X simd_prefix_exclusive_sum(X x) {
  return harness::exchange(x, [](const double* s) {
    X a = X(0);
    for (uint i = 0; i < harness::lane_id(); ++i) a = X(a + X(s[i]));
    return a;
  });
}
template <class X> inline X simd_prefix_inclusive_sum(X x) {
  return X(simd_prefix_exclusive_sum(x) + x);
}
template <class X> inline X simd_shuffle(X x, ushort from) {
  return harness::exchange(x, [from](const double* s) { return X(s[from]); });
}
template <class X> inline X simd_broadcast(X x, ushort from) { return simd_shuffle(x, from); }
template <class X> inline X simd_shuffle_xor(X x, ushort mask) {
  return harness::exchange(x, [mask](const double* s) { return X(s[harness::lane_id() ^ mask]); });
}
template <class X> inline X simd_shuffle_down(X x, ushort delta) {  // the top lanes keep theirs
  return harness::exchange(x, [delta](const double* s) {
    const uint from = harness::lane_id() + delta;
    return X(s[from < 32 ? from : harness::lane_id()]);
  });
}
template <class X> inline X simd_shuffle_up(X x, ushort delta) {  // the bottom lanes keep theirs
  return harness::exchange(x, [delta](const double* s) {
    const uint l = harness::lane_id();
    return X(s[l >= delta ? l - delta : l]);
  });
}
// On vectors: component by component.
#define HARNESS_SIMD_VEC(NAME)                                                  \
  template <class T, int N, class... A> inline vec<T, N> NAME(vec<T, N> v, A... a) { \
    for (int i = 0; i < N; ++i) v[i] = NAME(T(v[i]), a...);                    \
    return v;                                                                   \
  }
HARNESS_SIMD_VEC(simd_sum)
HARNESS_SIMD_VEC(simd_max)
HARNESS_SIMD_VEC(simd_min)
HARNESS_SIMD_VEC(simd_shuffle)
HARNESS_SIMD_VEC(simd_broadcast)
HARNESS_SIMD_VEC(simd_shuffle_xor)
HARNESS_SIMD_VEC(simd_shuffle_down)
HARNESS_SIMD_VEC(simd_shuffle_up)
#undef HARNESS_SIMD_VEC
}  // namespace metal

// SIMD-group matrices, 8x8, with Apple's element-to-lane layout: each lane holds only its own two
// elements, and loads, stores and products are collective over the simdgroup's 32 lanes, so a
// kernel that assumes another layout in its thread_elements() computes wrong numbers here too.
namespace harness {
// Apple's map from a lane to its two elements (row, col) and (row, col + 1): MLX's
// steel/attn/mma.h get_coord, metal-flash-attention's morton_order.
inline void lane_coord(uint lane, uint& row, uint& col) {
  const uint qid = lane / 4;
  row = (qid & 4) + (lane / 2) % 4;
  col = (qid & 2) * 2 + (lane % 2) * 2;
}
// The inverse: 2 * the lane holding element (row, col) + which of its two it is.
struct Owners {
  uint8_t of[8][8];
  Owners() {
    for (uint l = 0; l < 32; ++l) {
      uint r, c;
      lane_coord(l, r, c);
      of[r][c] = uint8_t(2 * l);
      of[r][c + 1] = uint8_t(2 * l + 1);
    }
  }
};
inline uint owner(uint row, uint col) {
  static const Owners owners;
  return owners.of[row][col];
}
}  // namespace harness

namespace metal {
template <class T, uint Cols, uint Rows = Cols> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "Apple GPUs multiply 8x8 simdgroup matrices");
  vec<T, 2> elements;  // this lane's: harness::lane_coord
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal) {
    uint r, c;
    harness::lane_coord(harness::lane_id(), r, c);
    elements[0] = r == c ? diagonal : T(0);
    elements[1] = r == c + 1 ? diagonal : T(0);
  }
  vec<T, 2>& thread_elements() { return elements; }
  const vec<T, 2>& thread_elements() const { return elements; }
};
using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;

template <class T, uint Cols, uint Rows = Cols>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elements[0] = m.elements[1] = value;
  return m;
}
}  // namespace metal

namespace harness {
#ifdef HARNESS_PROXY
// Metal's builtins: a lane's two elements in and out by value, the memory by its pointer.
template <class V, class P> V matrix_load(P src, ulong per_row, ulong col, ulong row, bool t);
template <class V, class P> void matrix_store(V a, P dst, ulong per_row, ulong col, ulong row, bool t);
template <class V> V matrix_product(V a, V b);
template <class V> V matrix_product(V a, V b, V c);
template <class M, class P>
inline void load_matrix(M& d, P src, ulong per_row, ulong origin_col, ulong origin_row, bool t) {
  d.elements = matrix_load<decltype(d.elements)>(src, per_row, origin_col, origin_row, t);
}
template <class M, class P>
inline void store_matrix(const M& a, P dst, ulong per_row, ulong origin_col, ulong origin_row, bool t) {
  matrix_store(a.elements, dst, per_row, origin_col, origin_row, t);
}
template <class T, class C>
inline void multiply(vec<T, 2>& d, const vec<T, 2>& a, const vec<T, 2>& b, const C* c) {
  d = c ? matrix_product(a, b, *c) : matrix_product(a, b);
}
#else
// Element i of this lane in memory: origin is (column, row), transposed memory holds columns.
inline ulong matrix_index(uint i, ulong per_row, ulong origin_col, ulong origin_row, bool t) {
  uint r, c;
  lane_coord(lane_id(), r, c);
  const ulong row = origin_row + r, col = origin_col + c + i;
  return t ? col * per_row + row : row * per_row + col;
}
template <class M, class P>
inline void load_matrix(M& d, P src, ulong per_row, ulong origin_col, ulong origin_row, bool t) {
  simd_sync();  // collective: every lane's earlier stores are seen, as in lockstep
  for (uint i = 0; i < 2; ++i) d.elements[i] = src[matrix_index(i, per_row, origin_col, origin_row, t)];
}
template <class M, class P>
inline void store_matrix(const M& a, P dst, ulong per_row, ulong origin_col, ulong origin_row, bool t) {
  for (uint i = 0; i < 2; ++i) dst[matrix_index(i, per_row, origin_col, origin_row, t)] = a.elements[i];
  simd_sync();  // collective: every lane sees the whole tile stored after it
}
// d = a b (+ c): every lane posts its elements of a and b, then computes its own two of d.
template <class T, class C>
inline void multiply(vec<T, 2>& d, const vec<T, 2>& a, const vec<T, 2>& b, const C* c) {
  double* s = slots();
  const uint l = lane_id();
  s[4 * l] = double(a[0]), s[4 * l + 1] = double(a[1]);
  s[4 * l + 2] = double(b[0]), s[4 * l + 3] = double(b[1]);
  simd_sync();
  uint r, col;
  lane_coord(l, r, col);
  float out[2];
  for (uint i = 0; i < 2; ++i) {
    float acc = c ? float((*c)[i]) : 0.0f;
    for (uint k = 0; k < 8; ++k) {
      const uint oa = owner(r, k), ob = owner(k, col + i);
      acc += float(s[4 * (oa / 2) + oa % 2]) * float(s[4 * (ob / 2) + 2 + ob % 2]);
    }
    out[i] = acc;
  }
  slots_done();
  count_mma();
  d[0] = T(out[0]), d[1] = T(out[1]);
}
#endif
}  // namespace harness

namespace metal {
// Metal's overloads for device and threadgroup memory (one function when they are defined away).
#define HARNESS_MATRIX_MEMORY(SPACE)                                                          \
  template <class T, uint C, uint R>                                                          \
  inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const SPACE T* src,                \
                             ulong elements_per_row = C, ulong2 matrix_origin = 0,            \
                             bool transpose_matrix = false) {                                 \
    harness::load_matrix(d, src, elements_per_row, matrix_origin.x, matrix_origin.y,         \
                         transpose_matrix);                                                   \
  }                                                                                           \
  template <class T, uint C, uint R>                                                          \
  inline void simdgroup_store(simdgroup_matrix<T, C, R> a, SPACE T* dst,                      \
                              ulong elements_per_row = C, ulong2 matrix_origin = 0,           \
                              bool transpose_matrix = false) {                                \
    harness::store_matrix(a, dst, elements_per_row, matrix_origin.x, matrix_origin.y,        \
                          transpose_matrix);                                                  \
  }
HARNESS_EACH_SPACE(HARNESS_MATRIX_MEMORY)
#undef HARNESS_MATRIX_MEMORY

// As Metal declares them: one element type, operands by (non-const) reference.
template <class T, uint K, uint C, uint R>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, C, R>& d,
                                          simdgroup_matrix<T, K, R>& a,
                                          simdgroup_matrix<T, C, K>& b,
                                          simdgroup_matrix<T, C, R>& c) {
  harness::multiply(d.elements, a.elements, b.elements, &c.elements);
}
template <class T, uint K, uint C, uint R>
inline void simdgroup_multiply(simdgroup_matrix<T, C, R>& d, simdgroup_matrix<T, K, R>& a,
                               simdgroup_matrix<T, C, K>& b) {
  harness::multiply(d.elements, a.elements, b.elements, (const vec<T, 2>*)nullptr);
}
}  // namespace metal

using namespace metal;  // as MLX's utils.h, which its generated kernels include

#ifndef HARNESS_SPACES
// On the CPU address spaces mean nothing; the harness makes `threadgroup` declarations static
// (harness/__init__.py), every other use of the words is dropped.
#define device
#define constant
#define thread
#define threadgroup
#endif
