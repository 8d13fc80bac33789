// Shared by the chunk-attention kernels (Metal). A simdgroup owns one row (a query, or a key in
// the dK/dV pass); its lanes own 32 rows of the other side for the scores and D/32 head dims
// each for the accumulators, so no reduction runs per element, only two per 32 scores.

// <a, r> over D head dims: a is a row staged in threadgroup memory, r a row in device memory.
template <int D, typename X>
inline float row_dot(const threadgroup float* a, const device X* r) {
  float s = 0.0f;
  for (int d = 0; d < D; ++d) {
    s += a[d] * static_cast<float>(r[d]);
  }
  return s;
}

// acc[t] += w * r[lane + 32 t]: a lane's head dims of a weighted row.
template <int D, typename X>
inline void row_axpy(thread float* acc, float w, const device X* r, uint lane) {
  for (int t = 0; t < D / 32; ++t) {
    acc[t] += w * static_cast<float>(r[lane + 32 * t]);
  }
}

// Stage a row in threadgroup memory (times `mul`), as float, lanes striding over head dims.
template <int D, typename X>
inline void row_stage(threadgroup float* dst, const device X* r, float mul, uint lane) {
  for (int t = 0; t < D / 32; ++t) {
    dst[lane + 32 * t] = static_cast<float>(r[lane + 32 * t]) * mul;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
}
