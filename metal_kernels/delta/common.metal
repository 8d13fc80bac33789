// Shared by the delta-rule scan kernels (Metal). A simdgroup owns one row d of a head's state
// S (DV x DK): its lanes hold DK / 32 of the row's columns, and take turns over the chunk's
// positions for the dot products, which read the row staged in threadgroup memory. The loops
// over a lane's DK / 32 state columns unroll in full (DELTA_UNROLL), so those per-lane arrays
// are indexed by constants and stay in registers.

#if defined(__clang__)
#define DELTA_UNROLL _Pragma("clang loop unroll(full)")
#else
#define DELTA_UNROLL
#endif

// <a, r> over n elements: a staged in threadgroup memory, r in device memory.
inline float dot_row(const threadgroup float* a, const device float* r, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) {
    s += a[i] * r[i];
  }
  return s;
}
