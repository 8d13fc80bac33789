// scan_back.metal's CUDA twin: the same contract (inputs, outputs, layouts, params, all float32)
// and the same algorithm, line for line, in the same order of accumulation: one warp per row of
// dS, ROWS = 4 rows (128 threads) a block, the same grid, DK / 32 columns a lane, the row, do and
// du staged in ROWS x (DK + 2 C) floats of shared memory, no matrix units. Only the spellings
// differ: a warp of 32 for a simdgroup of 32, __shared__ for threadgroup memory, __syncwarp for
// simdgroup_barrier. The compilers may still contract multiply-adds differently, and a timing
// on an NVIDIA GPU says nothing about scan_back.metal's speed on an Apple GPU.
__shared__ float ts[ROWS][DK];  // the row of dS
__shared__ float tdo[ROWS][C];  // column d of do
__shared__ float tdu[ROWS][C];  // column d of du
const int N = params[0], H = params[1], DV = params[2];
const unsigned int lane = threadIdx.x % 32;
const unsigned int sg = threadIdx.x / 32;
const int row = blockIdx.x * ROWS + sg;
if (row >= H * DV) {
  return;
}
const int h = row / DV, d = row % DV;
float ds[DK / 32];
for (int j = 0; j < DK / 32; ++j) {
  ds[j] = ds_in[size_t(row) * DK + lane + 32 * j];
}
for (int i = N - 1; i >= 0; --i) {
  const size_t hc = size_t(i) * H + h;
  for (int j = 0; j < DK / 32; ++j) {
    ds_exit[(hc * DV + d) * DK + lane + 32 * j] = ds[j];
    ts[sg][lane + 32 * j] = ds[j];
  }
  for (int t = int(lane); t < C; t += 32) {
    tdo[sg][t] = d_out[(hc * C + t) * DV + d];
  }
  __syncwarp();
  for (int t = int(lane); t < C; t += 32) {
    float y = dot_row(ts[sg], kd + (hc * C + t) * DK, DK);
    for (int u = t; u < C; ++u) {  // p^T: p[u][t], zero for u < t
      y += p[(hc * C + u) * C + t] * tdo[sg][u];
    }
    tdu[sg][t] = y;
    du[(hc * C + t) * DV + d] = y;
  }
  __syncwarp();
  const float g = g_end[hc];
  for (int j = 0; j < DK / 32; ++j) {
    const int k = lane + 32 * j;
    float acc = g * ds[j];
    for (int t = 0; t < C; ++t) {
      acc += tdo[sg][t] * qg[(hc * C + t) * DK + k] - tdu[sg][t] * w[(hc * C + t) * DK + k];
    }
    ds[j] = acc;
  }
  __syncwarp();
}
for (int j = 0; j < DK / 32; ++j) {
  ds0[size_t(row) * DK + lane + 32 * j] = ds[j];
}
