// Chunk attention backward, dQ: the scalar CUDA twin of dq.metal (CUDA runs it for float32
// inputs; float16/bfloat16 take dq_tc.cu).
// Shared with dq.metal: the contract (the forward's inputs plus d_out, lse, delta; dq (B, HQ, L,
// D) float32, the same layouts) and the math: dq_i = scale * sum_j p_ij (do_i . v_j - delta_i)
// k_j over every key the query saw, p recomputed from the saved log-sum-exp, in float32.
// Not shared: one warp per query row, ROWS = 4 warps (128 threads) a block, each lane one key of
// 32 a step (scalar dots over D), D / 32 dims of dQ a lane; natural exp, not exp2; K/V read
// from global memory, unstaged; shared memory the rows of Q and dO and 32 dS values (8.5 KiB at
// D = 256); no matrix units. dq.metal runs 8x8 simdgroup_float8x8 products over 8-64 query rows
// a threadgroup and staged K/V blocks (blocks.METAL, <= 32 KiB). The summation orders differ,
// so results agree to rounding only, and a timing of this kernel on an NVIDIA GPU says nothing
// about dq.metal's speed.
__shared__ float tq[ROWS][D];
__shared__ float tdo[ROWS][D];
__shared__ float tds[ROWS][32];
const int B = params[0], HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], BS = params[7];
const unsigned int lane = threadIdx.x % 32;
const unsigned int sg = threadIdx.x / 32;
const int row = blockIdx.x * ROWS + sg;
if (row >= B * HQ * L) {
  return;
}
const int i = row % L, h = (row / L) % HQ, b = row / (L * HQ);
const int hk = h / (HQ / HKV);
const size_t own = size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N;  // this head's first store row
const auto ks = store_rows<S, D, G>(pk, pk_scales, pk_biases, pre);
const auto vs = store_rows<S, D, G>(pv, pv_scales, pv_biases, pre);
row_stage<D>(tq[sg], q + size_t(row) * D, scale[0], lane);
row_stage<D>(tdo[sg], d_out + size_t(row) * D, 1.0f, lane);
const float lse_i = lse[row], delta_i = delta[row];

const int nk = START + i + 1;
float acc[D / 32] = {0.0f};
for (int base = 0; base < nk; base += 32) {
  const int j = base + lane;
  float ds = 0.0f;
  if (j < START) {
    const float p = expf(row_dot<D>(tq[sg], ks.row(j)) - lse_i);
    ds = p * (row_dot<D>(tdo[sg], vs.row(j)) - delta_i);
  } else if (j < nk) {
    const float p = expf(row_dot<D>(tq[sg], k + own + size_t(j - START) * D) - lse_i);
    ds = p * (row_dot<D>(tdo[sg], v + own + size_t(j - START) * D) - delta_i);
  }
  tds[sg][lane] = ds;
  __syncwarp();
  const int n = min(32, nk - base);
  for (int jj = 0; jj < n; ++jj) {
    const float dsj = tds[sg][jj];
    const int key = base + jj;
    if (key < START) {
      row_axpy<D>(acc, dsj, ks.row(key), lane);
    } else {
      row_axpy<D>(acc, dsj, k + own + size_t(key - START) * D, lane);
    }
  }
  __syncwarp();
}
#pragma unroll
for (int t = 0; t < D / 32; ++t) {
  dq[size_t(row) * D + lane + 32 * t] = acc[t] * scale[0];
}
