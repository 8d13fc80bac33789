// Chunk attention forward: the scalar CUDA twin of forward.metal (CUDA runs it for float32
// inputs; float16/bfloat16 take forward_tc.cu).
// Shared with forward.metal: the contract (q, k, v, the store's six inputs and template G, params,
// scale; o (B, HQ, L, D) and lse (B, HQ, L) float32, the same layouts) and the math: the causal
// online softmax over the prefix [0, START) read in place from the store (an 8-bit one
// dequantized as read: StoreRows, common.cuh), then the chunk's own keys, in float32;
// o = O / l, lse = m + log(l).
// Not shared: one warp per query row, ROWS = 4 warps (128 threads) a block, each lane scoring one
// key of 32 a step (a scalar dot over D) and holding D / 32 dims of O; natural exp on pre-scaled
// Q, not exp2 on log2-domain scores; K/V read from global memory, unstaged; shared memory only
// the rows of Q and 32 probabilities (4.5 KiB at D = 256); no matrix units. forward.metal runs
// 8x8 simdgroup_float8x8 products over 8-64 query rows a threadgroup and staged K/V blocks
// (blocks.METAL, <= 32 KiB). The summation orders differ, so results agree to rounding only,
// and a timing of this kernel on an NVIDIA GPU says nothing about forward.metal's speed.
__shared__ float tq[ROWS][D];
__shared__ float tp[ROWS][32];
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

const int nk = START + i + 1;
float m = MLXWALK_NEG_INF, l = 0.0f;
float acc[D / 32] = {0.0f};
for (int base = 0; base < nk; base += 32) {
  const int j = base + lane;
  float s = MLXWALK_NEG_INF;
  if (j < START) {
    s = row_dot<D>(tq[sg], ks.row(j));
  } else if (j < nk) {
    s = row_dot<D>(tq[sg], k + own + size_t(j - START) * D);
  }
  const float m_new = fmaxf(m, warp_max(s));
  const float p = expf(s - m_new);
  const float corr = expf(m - m_new);
  l = l * corr + warp_sum(p);
#pragma unroll
  for (int t = 0; t < D / 32; ++t) {
    acc[t] *= corr;
  }
  tp[sg][lane] = p;
  __syncwarp();
  const int n = min(32, nk - base);
  for (int jj = 0; jj < n; ++jj) {
    const float pj = tp[sg][jj];
    const int key = base + jj;
    if (key < START) {
      row_axpy<D>(acc, pj, vs.row(key), lane);
    } else {
      row_axpy<D>(acc, pj, v + own + size_t(key - START) * D, lane);
    }
  }
  m = m_new;
  __syncwarp();
}
#pragma unroll
for (int t = 0; t < D / 32; ++t) {
  o[size_t(row) * D + lane + 32 * t] = acc[t] / l;
}
if (lane == 0) {
  lse[row] = m + logf(l);
}
