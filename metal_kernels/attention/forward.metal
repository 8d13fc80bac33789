// Chunk attention forward: o = softmax(q [prefix; k]^T * scale) [prefix; v] and its
// log-sum-exp, causal inside the chunk, the prefix read in place from the K/V store.
// q (B, HQ, L, D); k, v (B, HKV, L, D); pk, pv the store (BS, HKV, N, D), prefix = [0, START).
// o (B, HQ, L, D) float32, lse (B, HQ, L) float32. One simdgroup per query row.
threadgroup float tq[ROWS][D];
threadgroup float tp[ROWS][32];  // a tile's probabilities, read by every lane
const int B = params[0], HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], BS = params[7];
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int row = threadgroup_position_in_grid.x * ROWS + sg;
if (row >= B * HQ * L) {
  return;  // the whole simdgroup: no barrier is shared across simdgroups
}
const int i = row % L, h = (row / L) % HQ, b = row / (L * HQ);
const int hk = h / (HQ / HKV);
const size_t own = size_t(b * HKV + hk) * L * D;            // this head's own K/V rows
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N * D;  // this head's store rows
row_stage<D>(tq[sg], q + size_t(row) * D, scale[0], lane);

const int nk = START + i + 1;  // keys this query sees: the prefix, then its chunk up to itself
float m = -INFINITY, l = 0.0f;
float acc[D / 32] = {0.0f};
for (int base = 0; base < nk; base += 32) {
  const int j = base + lane;
  float s = -INFINITY;
  if (j < START) {
    s = row_dot<D>(tq[sg], pk + pre + size_t(j) * D);
  } else if (j < nk) {
    s = row_dot<D>(tq[sg], k + own + size_t(j - START) * D);
  }
  const float m_new = metal::max(m, simd_max(s));
  const float p = metal::exp(s - m_new);
  const float corr = metal::exp(m - m_new);
  l = l * corr + simd_sum(p);
  for (int t = 0; t < D / 32; ++t) {
    acc[t] *= corr;
  }
  tp[sg][lane] = p;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const int n = metal::min(32, nk - base);
  for (int jj = 0; jj < n; ++jj) {
    const float pj = tp[sg][jj];
    const int key = base + jj;
    if (key < START) {
      row_axpy<D>(acc, pj, pv + pre + size_t(key) * D, lane);
    } else {
      row_axpy<D>(acc, pj, v + own + size_t(key - START) * D, lane);
    }
  }
  m = m_new;
  simdgroup_barrier(mem_flags::mem_threadgroup);  // tp is read before the next tile writes it
}
for (int t = 0; t < D / 32; ++t) {
  o[size_t(row) * D + lane + 32 * t] = acc[t] / l;
}
if (lane == 0) {
  lse[row] = m + metal::log(l);
}
