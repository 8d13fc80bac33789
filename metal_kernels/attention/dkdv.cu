// Chunk attention backward, dK/dV of the tapped prefix and the chunk's own keys: the scalar CUDA
// twin of dkdv.metal (CUDA runs it for float32 inputs; float16/bfloat16 take dkdv_tc.cu).
// Shared with dkdv.metal: the contract (dq's inputs; dk, dv (B, HKV, NT + L, D) float32, the
// taps [GF, START) then the own keys) and the math: dk_j = scale * sum_i ds_ij q_i and
// dv_j = sum_i p_ij do_i over the grouped query heads and the queries that see key j, in
// float32, no atomics.
// Not shared: one warp per key row, ROWS = 4 warps (128 threads) a block, the row's K and V
// staged as float32 (shared memory 9 KiB at D = 256 with 32 p and dS values), Q/dO read from
// global memory, 32 queries a step, scalar dots; natural exp; no matrix units. dkdv.metal owns
// 16-32 key rows a threadgroup, SPLIT simdgroups per 8 rows summing partial scores, Q/dO blocks
// staged (blocks.METAL, <= 32 KiB), 8x8 simdgroup_float8x8 products. The summation orders
// differ, so results agree to rounding only, and a timing of this kernel on an NVIDIA GPU says
// nothing about dkdv.metal's speed.
__shared__ float tk[ROWS][D];
__shared__ float tv[ROWS][D];
__shared__ float tp[ROWS][32];
__shared__ float tds[ROWS][32];
const int B = params[0], HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], GF = params[6], BS = params[7];
const int NT = START - GF, R = HQ / HKV;
const unsigned int lane = threadIdx.x % 32;
const unsigned int sg = threadIdx.x / 32;
const int row = blockIdx.x * ROWS + sg;
if (row >= B * HKV * (NT + L)) {
  return;
}
const int c = row % (NT + L), hk = (row / (NT + L)) % HKV, b = row / ((NT + L) * HKV);
int first = 0;
if (c < NT) {
  const size_t at = size_t((BS > 1 ? b : 0) * HKV + hk) * N + GF + c;  // the tap's store row
  row_stage<D>(tk[sg], store_rows<S, D, G>(pk, pk_scales, pk_biases, at).row(0), 1.0f, lane);
  row_stage<D>(tv[sg], store_rows<S, D, G>(pv, pv_scales, pv_biases, at).row(0), 1.0f, lane);
} else {
  first = c - NT;
  const size_t at = size_t((b * HKV + hk) * L + first) * D;
  row_stage<D>(tk[sg], k + at, 1.0f, lane);
  row_stage<D>(tv[sg], v + at, 1.0f, lane);
}
const float sc = scale[0];
float acc_k[D / 32] = {0.0f};
float acc_v[D / 32] = {0.0f};
for (int g = 0; g < R; ++g) {
  const int qh = (b * HQ + hk * R + g) * L;
  for (int base = first; base < L; base += 32) {
    const int i = base + int(lane);
    float p = 0.0f, ds = 0.0f;
    if (i < L) {
      p = expf(row_dot<D>(tk[sg], q + size_t(qh + i) * D) * sc - lse[qh + i]);
      ds = p * (row_dot<D>(tv[sg], d_out + size_t(qh + i) * D) - delta[qh + i]);
    }
    tp[sg][lane] = p;
    tds[sg][lane] = ds;
    __syncwarp();
    const int n = min(32, L - base);
    for (int ii = 0; ii < n; ++ii) {
      const float pi = tp[sg][ii];
      const float dsi = tds[sg][ii];
      const size_t at = size_t(qh + base + ii) * D;
      row_axpy<D>(acc_v, pi, d_out + at, lane);
      row_axpy<D>(acc_k, dsi, q + at, lane);
    }
    __syncwarp();
  }
}
#pragma unroll
for (int t = 0; t < D / 32; ++t) {
  dk[size_t(row) * D + lane + 32 * t] = acc_k[t] * sc;
  dv[size_t(row) * D + lane + 32 * t] = acc_v[t];
}
