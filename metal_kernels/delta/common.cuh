// Shared by the delta-rule scan kernels (CUDA): the twin of common.metal.
__device__ inline float dot_row(const float* a, const float* r, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) {
    s += a[i] * r[i];
  }
  return s;
}
