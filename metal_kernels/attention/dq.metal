// Chunk attention backward, dQ: dq_i = scale * sum_j p_ij (do_i . v_j - delta_i) k_j over every
// key the query saw (prefix and chunk), p recomputed from the saved log-sum-exp.
// Inputs as the forward's plus d_out (B, HQ, L, D), lse and delta = rowsum(d_out * o), both
// (B, HQ, L) float32. dq (B, HQ, L, D) float32. One simdgroup per query row.
threadgroup float tq[ROWS][D];
threadgroup float tdo[ROWS][D];
threadgroup float tds[ROWS][32];
const int B = params[0], HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], BS = params[7];
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int row = threadgroup_position_in_grid.x * ROWS + sg;
if (row >= B * HQ * L) {
  return;
}
const int i = row % L, h = (row / L) % HQ, b = row / (L * HQ);
const int hk = h / (HQ / HKV);
const size_t own = size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N * D;
row_stage<D>(tq[sg], q + size_t(row) * D, scale[0], lane);
row_stage<D>(tdo[sg], d_out + size_t(row) * D, 1.0f, lane);
const float lse_i = lse[row], delta_i = delta[row];

const int nk = START + i + 1;
float acc[D / 32] = {0.0f};
for (int base = 0; base < nk; base += 32) {
  const int j = base + lane;
  float ds = 0.0f;
  if (j < START) {
    const float p = metal::exp(row_dot<D>(tq[sg], pk + pre + size_t(j) * D) - lse_i);
    ds = p * (row_dot<D>(tdo[sg], pv + pre + size_t(j) * D) - delta_i);
  } else if (j < nk) {
    const float p = metal::exp(row_dot<D>(tq[sg], k + own + size_t(j - START) * D) - lse_i);
    ds = p * (row_dot<D>(tdo[sg], v + own + size_t(j - START) * D) - delta_i);
  }
  tds[sg][lane] = ds;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const int n = metal::min(32, nk - base);
  for (int jj = 0; jj < n; ++jj) {
    const float dsj = tds[sg][jj];
    const int key = base + jj;
    if (key < START) {
      row_axpy<D>(acc, dsj, pk + pre + size_t(key) * D, lane);
    } else {
      row_axpy<D>(acc, dsj, k + own + size_t(key - START) * D, lane);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
}
for (int t = 0; t < D / 32; ++t) {
  dq[size_t(row) * D + lane + 32 * t] = acc[t] * scale[0];
}
