// Chunk attention backward, dK/dV of the keys that take a gradient: the tapped prefix
// [GF, START) then the chunk's own L keys, in that order along one axis of NT + L rows.
// dk_j = scale * sum_i ds_ij q_i and dv_j = sum_i p_ij do_i over the grouped query heads and the
// queries that see key j (all of them for the prefix, i >= j inside the chunk). No atomics: one
// simdgroup owns a key row and its lanes walk 32 queries at a time.
// Inputs as dq's. dk, dv (B, HKV, NT + L, D) float32.
threadgroup float tk[ROWS][D];
threadgroup float tv[ROWS][D];
threadgroup float tp[ROWS][32];
threadgroup float tds[ROWS][32];
const int B = params[0], HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], GF = params[6], BS = params[7];
const int NT = START - GF, R = HQ / HKV;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int row = threadgroup_position_in_grid.x * ROWS + sg;
if (row >= B * HKV * (NT + L)) {
  return;
}
const int c = row % (NT + L), hk = (row / (NT + L)) % HKV, b = row / ((NT + L) * HKV);
int first = 0;  // the first query that sees this key
if (c < NT) {
  const size_t at = size_t(((BS > 1 ? b : 0) * HKV + hk) * N + GF + c) * D;
  row_stage<D>(tk[sg], pk + at, 1.0f, lane);
  row_stage<D>(tv[sg], pv + at, 1.0f, lane);
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
  const int qh = (b * HQ + hk * R + g) * L;  // this query head's first row
  for (int base = first; base < L; base += 32) {
    const int i = base + int(lane);
    float p = 0.0f, ds = 0.0f;
    if (i < L) {
      p = metal::exp(row_dot<D>(tk[sg], q + size_t(qh + i) * D) * sc - lse[qh + i]);
      ds = p * (row_dot<D>(tv[sg], d_out + size_t(qh + i) * D) - delta[qh + i]);
    }
    tp[sg][lane] = p;
    tds[sg][lane] = ds;
    simdgroup_barrier(mem_flags::mem_threadgroup);
    const int n = metal::min(32, L - base);
    for (int ii = 0; ii < n; ++ii) {
      const float pi = tp[sg][ii];
      const float dsi = tds[sg][ii];
      const size_t at = size_t(qh + base + ii) * D;
      row_axpy<D>(acc_v, pi, d_out + at, lane);
      row_axpy<D>(acc_k, dsi, q + at, lane);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
}
for (int t = 0; t < D / 32; ++t) {
  dk[size_t(row) * D + lane + 32 * t] = acc_k[t] * sc;
  dv[size_t(row) * D + lane + 32 * t] = acc_v[t];
}
