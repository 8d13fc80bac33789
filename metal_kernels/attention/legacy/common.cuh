// Shared by the chunk-attention kernels (CUDA): the twin of common.metal. A warp owns one row;
// its lanes own 32 rows of the other side for the scores and D/32 head dims for the accumulators.
#define MLXWALK_NEG_INF (-__int_as_float(0x7f800000))

template <int D, typename X>
__device__ inline float row_dot(const float* a, const X* r) {
  float s = 0.0f;
#pragma unroll 8
  for (int d = 0; d < D; ++d) {
    s += a[d] * static_cast<float>(r[d]);
  }
  return s;
}

template <int D, typename X>
__device__ inline void row_axpy(float* acc, float w, const X* r, unsigned int lane) {
#pragma unroll
  for (int t = 0; t < D / 32; ++t) {
    acc[t] += w * static_cast<float>(r[lane + 32 * t]);
  }
}

template <int D, typename X>
__device__ inline void row_stage(float* dst, const X* r, float mul, unsigned int lane) {
#pragma unroll
  for (int t = 0; t < D / 32; ++t) {
    dst[lane + 32 * t] = static_cast<float>(r[lane + 32 * t]) * mul;
  }
  __syncwarp();
}

__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  }
  return x;
}
