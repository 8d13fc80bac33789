// Chunk attention forward on tensor cores (CUDA only; float16/bfloat16 inputs, float32
// accumulation): the contract of forward.metal/forward.cu. A block of W warps takes 16 W query
// rows of one head and walks the keys in tiles of 32: S = Q K^T and O += P V on tensor cores, the
// online softmax in float32 with two lanes per row, O in registers, rescaled per row each tile.
using namespace mlxwalk_tc;
constexpr int BQ = 16 * W, BK = 32, THREADS = 32 * W;
constexpr int LD = Pitch<D>::half, LP = Pitch<D>::tile, LS = Pitch<D>::score, LO = Pitch<D>::acc;
extern __shared__ __align__(32) unsigned char smem[];
T* sQ = reinterpret_cast<T*>(smem);                  // BQ x D
T* sK = sQ + BQ * LD;                                // BK x D
T* sV = sK + BK * LD;                                // BK x D
T* sP = sV + BK * LD;                                // BQ x BK probabilities
float* sS = reinterpret_cast<float*>(sP + BQ * LP);  // BQ x BK scores
float* sCorr = sS + BQ * LS;                         // BQ per-row rescaling of O
float* sO = reinterpret_cast<float*>(smem);          // BQ x D output, over the rest at the end

const int B = params[0], HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], BS = params[7];
const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
const int blocks = (L + BQ - 1) / BQ;
const int q0 = (blockIdx.x % blocks) * BQ, h = (blockIdx.x / blocks) % HQ;
const int b = blockIdx.x / (blocks * HQ), hk = h / (HQ / HKV);
const size_t own = size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N * D;
const size_t qrows = size_t(b * HQ + h) * L;
const float sc = scale[0];

stage_rows<T, T, D>(sQ, LD, BQ, [&](int r, const T*& a, const T*&) {
  a = q0 + r < L ? q + (qrows + q0 + r) * D : nullptr;
}, tid, THREADS);
FragC acc[D / 16];
#pragma unroll
for (int n = 0; n < D / 16; ++n) {
  wm::fill_fragment(acc[n], 0.0f);
}
const int row = warp * 16 + lane / 2, half = lane % 2;  // two lanes per row, 16 columns each
const int i = q0 + row;
const int seen = START + min(i, L - 1) + 1;  // keys row i sees
const int kend = START + min(q0 + BQ, L);
float m = MLXWALK_NEG_INF, l = 0.0f;
for (int k0 = 0; k0 < kend; k0 += BK) {
  auto keys = [&](const T* own_rows, const S* store) {
    return [=](int r, const T*& a, const S*& s) {
      const int j = k0 + r;
      if (j < START) {
        s = store + pre + size_t(j) * D;
      } else if (j < START + L) {
        a = own_rows + own + size_t(j - START) * D;
      }
    };
  };
  stage_rows<T, S, D>(sK, LD, BK, keys(k, pk), tid, THREADS);
  stage_rows<T, S, D>(sV, LD, BK, keys(v, pv), tid, THREADS);
  __syncthreads();
  rows_by_rows<T, D, BK / 16>(sS + warp * 16 * LS, LS, sQ + warp * 16 * LD, LD, sK, LD);
  __syncwarp();
  float* s = sS + row * LS + half * 16;
  float top = MLXWALK_NEG_INF;
  for (int c = 0; c < 16; ++c) {
    const float x = k0 + half * 16 + c < seen ? s[c] * sc : MLXWALK_NEG_INF;
    s[c] = x;
    top = fmaxf(top, x);
  }
  top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
  const float m_new = fmaxf(m, top);
  const float corr = expf(m - m_new);
  float sum = 0.0f;
  for (int c = 0; c < 16; ++c) {
    const float p = expf(s[c] - m_new);
    sum += p;
    sP[row * LP + half * 16 + c] = static_cast<T>(p);
  }
  l = l * corr + sum + __shfl_xor_sync(0xffffffffu, sum, 1);
  m = m_new;
  if (half == 0) {
    sCorr[row] = corr;
  }
  __syncwarp();
  const float lo = sCorr[warp * 16 + lane / 4], hi = sCorr[warp * 16 + lane / 4 + 8];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
#pragma unroll
    for (int e = 0; e < acc[n].num_elements; ++e) {
      acc[n].x[e] *= fragment_row(lane, e) < 8 ? lo : hi;
    }
  }
  accumulate_in<T, BK, D / 16>(acc, sP + warp * 16 * LP, LP, sV, LD);
  __syncthreads();  // every warp is done with this tile's K and V
}
#pragma unroll
for (int n = 0; n < D / 16; ++n) {
  wm::store_matrix_sync(sO + warp * 16 * LO + n * 16, acc[n], LO, wm::mem_row_major);
}
__syncwarp();
if (i < L) {
  for (int d = half; d < D; d += 2) {
    o[(qrows + i) * D + d] = sO[row * LO + d] / l;
  }
  if (half == 0) {
    lse[qrows + i] = m + logf(l);
  }
}
