// The chunk recurrence's adjoint (mlxwalk/ops/delta/recurrence.py's _recurrence_vjp), walked
// in reverse: with dS the adjoint of the state leaving chunk i, S the state entering it and do = dL/do,
//   du = p^T do + kd dS^T,   dS <- g_end dS + do^T qg - du^T w.
// Row d of dS meets column d of do and du only, so rows run independently. Every other gradient
// is a product over the chunks in parallel, left to MLX given dS and du per chunk.
// w, qg, p, kd, g_end as scan.metal's; d_out (N, H, C, DV);
// ds_in (H, DV, DK), the adjoint of the final state. ds_exit (N, H, DV, DK): dS leaving each
// chunk; du (N, H, C, DV); ds0 (H, DV, DK): the initial state's adjoint.
threadgroup float ts[ROWS][DK];  // the row of dS
threadgroup float tdo[ROWS][C];  // column d of do
threadgroup float tdu[ROWS][C];  // column d of du
const int N = params[0], H = params[1], DV = params[2];
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int row = threadgroup_position_in_grid.x * ROWS + sg;
if (row >= H * DV) {
  return;
}
const int h = row / DV, d = row % DV;
float ds[DK / 32];
DELTA_UNROLL
for (int j = 0; j < DK / 32; ++j) {
  ds[j] = ds_in[size_t(row) * DK + lane + 32 * j];
}
for (int i = N - 1; i >= 0; --i) {
  const size_t hc = size_t(i) * H + h;
  DELTA_UNROLL
  for (int j = 0; j < DK / 32; ++j) {
    ds_exit[(hc * DV + d) * DK + lane + 32 * j] = ds[j];
    ts[sg][lane + 32 * j] = ds[j];
  }
  for (int t = int(lane); t < C; t += 32) {
    tdo[sg][t] = d_out[(hc * C + t) * DV + d];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int t = int(lane); t < C; t += 32) {
    float y = dot_row(ts[sg], kd + (hc * C + t) * DK, DK);
    for (int u = t; u < C; ++u) {  // p^T: p[u][t], zero for u < t
      y += p[(hc * C + u) * C + t] * tdo[sg][u];
    }
    tdu[sg][t] = y;
    du[(hc * C + t) * DV + d] = y;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const float g = g_end[hc];
  DELTA_UNROLL
  for (int j = 0; j < DK / 32; ++j) {
    const int k = lane + 32 * j;
    float acc = g * ds[j];
    for (int t = 0; t < C; ++t) {
      acc += tdo[sg][t] * qg[(hc * C + t) * DK + k] - tdu[sg][t] * w[(hc * C + t) * DK + k];
    }
    ds[j] = acc;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
}
DELTA_UNROLL
for (int j = 0; j < DK / 32; ++j) {
  ds0[size_t(row) * DK + lane + 32 * j] = ds[j];
}
