// scan.metal's CUDA twin: the same contract (inputs, outputs, layouts, params, all float32) and
// the same algorithm, line for line, in the same order of accumulation: one warp per state row,
// ROWS = 4 rows (128 threads) a block, the same grid, DK / 32 columns a lane, the row and x
// staged in ROWS x (DK + C) floats of shared memory, no matrix units. Only the spellings differ:
// a warp of 32 for a simdgroup of 32, __shared__ for threadgroup memory, __syncwarp for
// simdgroup_barrier. The compilers may still contract multiply-adds differently, and a timing
// on an NVIDIA GPU says nothing about scan.metal's speed on an Apple GPU.
__shared__ float ts[ROWS][DK];  // the row, for the dot products
__shared__ float tx[ROWS][C];   // x for the row, one per position
const int N = params[0], H = params[1], DV = params[2];
const unsigned int lane = threadIdx.x % 32;
const unsigned int sg = threadIdx.x / 32;
const int row = blockIdx.x * ROWS + sg;
if (row >= H * DV) {
  return;
}
const int h = row / DV, d = row % DV;
float s[DK / 32];
for (int j = 0; j < DK / 32; ++j) {
  s[j] = s0[size_t(row) * DK + lane + 32 * j];
}
for (int i = 0; i < N; ++i) {
  const size_t hc = size_t(i) * H + h;  // chunk i of head h
  for (int j = 0; j < DK / 32; ++j) {
    if (KEEP) {  // the states are kept for a backward pass only
      entries[(hc * DV + d) * DK + lane + 32 * j] = s[j];
    }
    ts[sg][lane + 32 * j] = s[j];
  }
  __syncwarp();
  for (int t = int(lane); t < C; t += 32) {
    tx[sg][t] = u0[(hc * C + t) * DV + d] - dot_row(ts[sg], w + (hc * C + t) * DK, DK);
  }
  __syncwarp();
  for (int t = int(lane); t < C; t += 32) {
    float y = dot_row(ts[sg], qg + (hc * C + t) * DK, DK);
    for (int u = 0; u <= t; ++u) {  // p is causal: zero above the diagonal (p is read in
      y += p[(hc * C + t) * C + u] * tx[sg][u];  // place: MLX passes a small one as `constant`)
    }
    o[(hc * C + t) * DV + d] = y;
  }
  const float g = g_end[hc];
  for (int j = 0; j < DK / 32; ++j) {
    float acc = g * s[j];
    for (int t = 0; t < C; ++t) {
      acc += tx[sg][t] * kd[(hc * C + t) * DK + lane + 32 * j];
    }
    s[j] = acc;
  }
  __syncwarp();  // ts and tx are read before they are rewritten
}
for (int j = 0; j < DK / 32; ++j) {
  s_out[size_t(row) * DK + lane + 32 * j] = s[j];
}
