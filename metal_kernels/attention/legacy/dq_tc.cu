// Chunk attention backward, dQ, on tensor cores (CUDA only; the contract of dq.metal/dq.cu).
// A block of W warps takes 16 W query rows of one head; per tile of 32 keys: S = Q K^T and
// dP = dO V^T on tensor cores, dS = P (dP - delta) in float32, dQ += dS K on tensor cores (dQ in
// registers).
using namespace mlxwalk_tc;
constexpr int BQ = 16 * W, BK = 32, THREADS = 32 * W;
constexpr int LD = Pitch<D>::half, LP = Pitch<D>::tile, LS = Pitch<D>::score, LA = Pitch<D>::acc;
extern __shared__ __align__(32) unsigned char smem[];
T* sQ = reinterpret_cast<T*>(smem);                   // BQ x D
T* sdO = sQ + BQ * LD;                                // BQ x D
T* sK = sdO + BQ * LD;                                // BK x D
T* sV = sK + BK * LD;                                 // BK x D
T* sdS = sV + BK * LD;                                // BQ x BK
float* sS = reinterpret_cast<float*>(sdS + BQ * LP);  // BQ x BK
float* sdP = sS + BQ * LS;                            // BQ x BK
float* sA = reinterpret_cast<float*>(smem);           // BQ x D dQ, over the rest at the end

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
stage_rows<T, T, D>(sdO, LD, BQ, [&](int r, const T*& a, const T*&) {
  a = q0 + r < L ? d_out + (qrows + q0 + r) * D : nullptr;
}, tid, THREADS);
FragC acc[D / 16];
#pragma unroll
for (int n = 0; n < D / 16; ++n) {
  wm::fill_fragment(acc[n], 0.0f);
}
const int row = warp * 16 + lane / 2, half = lane % 2;
const int i = q0 + row;
const int seen = START + min(i, L - 1) + 1;
const float lse_i = i < L ? lse[qrows + i] : 0.0f, delta_i = i < L ? delta[qrows + i] : 0.0f;
const int kend = START + min(q0 + BQ, L);
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
  rows_by_rows<T, D, BK / 16>(sdP + warp * 16 * LS, LS, sdO + warp * 16 * LD, LD, sV, LD);
  __syncwarp();
  for (int c = half * 16; c < half * 16 + 16; ++c) {
    const float p = k0 + c < seen && i < L ? expf(sS[row * LS + c] * sc - lse_i) : 0.0f;
    sdS[row * LP + c] = static_cast<T>(p * (sdP[row * LS + c] - delta_i));
  }
  __syncwarp();
  accumulate_in<T, BK, D / 16>(acc, sdS + warp * 16 * LP, LP, sK, LD);
  __syncthreads();
}
#pragma unroll
for (int n = 0; n < D / 16; ++n) {
  wm::store_matrix_sync(sA + warp * 16 * LA + n * 16, acc[n], LA, wm::mem_row_major);
}
__syncwarp();
if (i < L) {
  for (int d = half; d < D; d += 2) {
    dq[(qrows + i) * D + d] = sA[row * LA + d] * sc;
  }
}
