// Chunk attention backward, dK/dV of the taps [GF, START) and the chunk's own keys, on tensor
// cores (CUDA only; the contract of dkdv.metal/dkdv.cu, no atomics). A block of W warps owns 16 W
// key rows of one K/V head and walks every grouped query head's queries in tiles of 32:
// S^T = K Q^T and dP^T = V dO^T on tensor cores, P and dS in float32, dV += P^T dO and
// dK += dS^T Q on tensor cores, the accumulators in registers up to head dim 128 (in shared memory
// beyond: 2 D / 16 fragments would not fit a thread's registers).
using namespace mlxwalk_tc;
constexpr int BR = 16 * W, BQ = 32, THREADS = 32 * W;
constexpr int LD = Pitch<D>::half, LP = Pitch<D>::tile, LS = Pitch<D>::score, LA = Pitch<D>::acc;
extern __shared__ __align__(32) unsigned char smem[];
T* sK = reinterpret_cast<T*>(smem);                   // BR x D
T* sV = sK + BR * LD;                                 // BR x D
T* sQ = sV + BR * LD;                                 // BQ x D
T* sdO = sQ + BQ * LD;                                // BQ x D
T* sP = sdO + BQ * LD;                                // BR x BQ
T* sdS = sP + BR * LP;                                // BR x BQ
float* sS = reinterpret_cast<float*>(sdS + BR * LP);  // BR x BQ
float* sdP = sS + BR * LS;                            // BR x BQ
float* aK = sdP + BR * LS;                            // BR x D
float* aV = aK + BR * LA;                             // BR x D
float* sL = aV + BR * LA;                             // BQ log-sum-exps
float* sDelta = sL + BQ;                              // BQ deltas

const int B = params[0], HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], GF = params[6], BS = params[7];
const int NT = START - GF, R = HQ / HKV, ROWS_ALL = NT + L;
const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
const int blocks = (ROWS_ALL + BR - 1) / BR;
const int c0 = (blockIdx.x % blocks) * BR, hk = (blockIdx.x / blocks) % HKV;
const int b = blockIdx.x / (blocks * HKV);
const size_t own = size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N * D;
const float sc = scale[0];

auto key = [&](const T* own_rows, const S* store, int r, int d) {
  const int c = c0 + r;
  if (c < NT) return static_cast<float>(store[pre + size_t(GF + c) * D + d]);
  if (c < ROWS_ALL) return static_cast<float>(own_rows[own + size_t(c - NT) * D + d]);
  return 0.0f;
};
stage<T, D>(sK, LD, BR, [&](int r, int d) { return key(k, pk, r, d); }, tid, THREADS);
stage<T, D>(sV, LD, BR, [&](int r, int d) { return key(v, pv, r, d); }, tid, THREADS);
constexpr bool IN_REGISTERS = D <= 128;
constexpr int NF = IN_REGISTERS ? D / 16 : 1;
FragC acc_k[NF], acc_v[NF];
for (int n = 0; n < NF; ++n) {
  wm::fill_fragment(acc_k[n], 0.0f);
  wm::fill_fragment(acc_v[n], 0.0f);
}
for (int e = tid; e < BR * LA; e += THREADS) {
  aK[e] = 0.0f;
  aV[e] = 0.0f;
}
const int row = warp * 16 + lane / 2, half = lane % 2;
const int c = c0 + row;
const int first = c < NT ? 0 : c - NT;           // the first query that sees key row c
const int block_first = c0 < NT ? 0 : c0 - NT;   // the block's earliest
for (int g = 0; g < R; ++g) {
  const size_t qrows = size_t(b * HQ + hk * R + g) * L;
  for (int q0 = block_first - block_first % BQ; q0 < L; q0 += BQ) {
    __syncthreads();  // the previous tile's Q, dO, lse and delta are no longer read
    stage<T, D>(sQ, LD, BQ, [&](int r, int d) {
      return q0 + r < L ? static_cast<float>(q[(qrows + q0 + r) * D + d]) : 0.0f;
    }, tid, THREADS);
    stage<T, D>(sdO, LD, BQ, [&](int r, int d) {
      return q0 + r < L ? static_cast<float>(d_out[(qrows + q0 + r) * D + d]) : 0.0f;
    }, tid, THREADS);
    for (int r = tid; r < BQ; r += THREADS) {
      sL[r] = q0 + r < L ? lse[qrows + q0 + r] : 0.0f;
      sDelta[r] = q0 + r < L ? delta[qrows + q0 + r] : 0.0f;
    }
    __syncthreads();
    rows_by_rows<T, D, BQ / 16>(sS + warp * 16 * LS, LS, sK + warp * 16 * LD, LD, sQ, LD);
    rows_by_rows<T, D, BQ / 16>(sdP + warp * 16 * LS, LS, sV + warp * 16 * LD, LD, sdO, LD);
    __syncwarp();
    for (int col = half * 16; col < half * 16 + 16; ++col) {
      const int i = q0 + col;
      const bool sees = i < L && i >= first && c < ROWS_ALL;
      const float p = sees ? expf(sS[row * LS + col] * sc - sL[col]) : 0.0f;
      sP[row * LP + col] = static_cast<T>(p);
      sdS[row * LP + col] = static_cast<T>(p * (sdP[row * LS + col] - sDelta[col]));
    }
    __syncwarp();
    if constexpr (IN_REGISTERS) {
      accumulate_in<T, BQ, NF>(acc_v, sP + warp * 16 * LP, LP, sdO, LD);
      accumulate_in<T, BQ, NF>(acc_k, sdS + warp * 16 * LP, LP, sQ, LD);
    } else {
      accumulate<T, BQ, D>(aV + warp * 16 * LA, LA, sP + warp * 16 * LP, LP, sdO, LD);
      accumulate<T, BQ, D>(aK + warp * 16 * LA, LA, sdS + warp * 16 * LP, LP, sQ, LD);
    }
  }
}
if constexpr (IN_REGISTERS) {
  for (int n = 0; n < NF; ++n) {
    wm::store_matrix_sync(aK + warp * 16 * LA + n * 16, acc_k[n], LA, wm::mem_row_major);
    wm::store_matrix_sync(aV + warp * 16 * LA + n * 16, acc_v[n], LA, wm::mem_row_major);
  }
}
__syncthreads();
for (int e = tid; e < BR * D; e += THREADS) {
  const int r = e / D;
  if (c0 + r < ROWS_ALL) {
    const size_t at = (size_t(b * HKV + hk) * ROWS_ALL + c0 + r) * D + e % D;
    dk[at] = aK[r * LA + e % D] * sc;
    dv[at] = aV[r * LA + e % D];
  }
}
