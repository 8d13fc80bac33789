// Shared by the chunk-attention kernels (CUDA): the twin of common.metal. A warp owns one row;
// its lanes own 32 rows of the other side for the scores and D/32 head dims for the accumulators.
#define MLXWALK_NEG_INF (-__int_as_float(0x7f800000))

// One row of mlx-lm's 8-bit store, read in place (r[d] a float): D elements one byte each, four
// to a uint32 (element 4w + i in bits 8i..8i+7 of word w), per G elements a scale and a bias in
// S (the model's dtype). MLX's affine quantization: scale * q + bias, each operation rounded to
// S as mx.dequantize computes it.
template <typename S, int G>
struct Q8Row {
  const uint32_t* x;
  const S* scales;
  const S* biases;

  __device__ static float in_s(float v) {
    return static_cast<float>(static_cast<S>(v));
  }
  __device__ float operator[](int d) const {
    const float q = float((x[d / 4] >> (8 * (d % 4))) & 0xffu);
    return in_s(in_s(static_cast<float>(scales[d / G]) * q) + static_cast<float>(biases[d / G]));
  }
};

// The store's rows of one K/V head from row `row0` on, `row(r)` what the row helpers below read:
// a float store's (G = 0: a pointer to its elements, dtype S) or an 8-bit store's (Q8Row).
template <typename S, int D, int G>
struct StoreRows {
  const uint32_t* x;
  const S* scales;
  const S* biases;

  __device__ Q8Row<S, G> row(size_t r) const {
    return {x + r * (D / 4), scales + r * (D / G), biases + r * (D / G)};
  }
};
template <typename S, int D>
struct StoreRows<S, D, 0> {
  const S* x;

  __device__ const S* row(size_t r) const {
    return x + r * D;
  }
};

template <typename S, int D, int G, typename X, typename Y>
__device__ inline StoreRows<S, D, G> store_rows(const X* x, const Y* scales, const Y* biases,
                                                size_t row0) {
  if constexpr (G == 0) {
    return {x + row0 * D};
  } else {
    return {reinterpret_cast<const uint32_t*>(x) + row0 * (D / 4), scales + row0 * (D / G),
            biases + row0 * (D / G)};
  }
}

// The row helpers read r[d] of a pointer to a row or a Q8Row.
template <int D, typename X>
__device__ inline float row_dot(const float* a, X r) {
  float s = 0.0f;
#pragma unroll 8
  for (int d = 0; d < D; ++d) {
    s += a[d] * static_cast<float>(r[d]);
  }
  return s;
}

template <int D, typename X>
__device__ inline void row_axpy(float* acc, float w, X r, unsigned int lane) {
#pragma unroll
  for (int t = 0; t < D / 32; ++t) {
    acc[t] += w * static_cast<float>(r[lane + 32 * t]);
  }
}

template <int D, typename X>
__device__ inline void row_stage(float* dst, X r, float mul, unsigned int lane) {
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
