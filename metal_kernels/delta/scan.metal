// The gated delta rule's chunk recurrence, forward (mlxwalk/ops/delta/recurrence.py's
// _walk_chunks): for every chunk i in order, with S the state entering it,
//   x = u0 - w S^T,   o = qg S^T + p x,   S <- g_end S + x^T kd.
// Each row d of S only ever meets column d of u0, x and o, so rows run independently.
// u0 (N, H, C, DV); w, qg, kd (N, H, C, DK); p (N, H, C, C); g_end (N, H); s0 (H, DV, DK),
// H = batch x value heads. o (N, H, C, DV), entries (N, H, DV, DK): S entering each chunk,
// s_out (H, DV, DK). One simdgroup per state row (h, d). Without KEEP, entries is not written.
threadgroup float ts[ROWS][DK];  // the row, for the dot products
threadgroup float tx[ROWS][C];   // x for the row, one per position
const int N = params[0], H = params[1], DV = params[2];
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int row = threadgroup_position_in_grid.x * ROWS + sg;
if (row >= H * DV) {
  return;
}
const int h = row / DV, d = row % DV;
float s[DK / 32];
DELTA_UNROLL
for (int j = 0; j < DK / 32; ++j) {
  s[j] = s0[size_t(row) * DK + lane + 32 * j];
}
for (int i = 0; i < N; ++i) {
  const size_t hc = size_t(i) * H + h;  // chunk i of head h
  DELTA_UNROLL
  for (int j = 0; j < DK / 32; ++j) {
    if (KEEP) {  // the states are kept for a backward pass only
      entries[(hc * DV + d) * DK + lane + 32 * j] = s[j];
    }
    ts[sg][lane + 32 * j] = s[j];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int t = int(lane); t < C; t += 32) {
    tx[sg][t] = u0[(hc * C + t) * DV + d] - dot_row(ts[sg], w + (hc * C + t) * DK, DK);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int t = int(lane); t < C; t += 32) {
    float y = dot_row(ts[sg], qg + (hc * C + t) * DK, DK);
    for (int u = 0; u <= t; ++u) {  // p is causal: zero above the diagonal (p is read in
      y += p[(hc * C + t) * C + u] * tx[sg][u];  // place: MLX passes a small one as `constant`)
    }
    o[(hc * C + t) * DV + d] = y;
  }
  const float g = g_end[hc];
  DELTA_UNROLL
  for (int j = 0; j < DK / 32; ++j) {
    float acc = g * s[j];
    for (int t = 0; t < C; ++t) {
      acc += tx[sg][t] * kd[(hc * C + t) * DK + lane + 32 * j];
    }
    s[j] = acc;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // ts and tx are read before they are rewritten
}
DELTA_UNROLL
for (int j = 0; j < DK / 32; ++j) {
  s_out[size_t(row) * DK + lane + 32 * j] = s[j];
}
