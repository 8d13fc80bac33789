// Chunk attention backward, dK/dV of the taps [GF, START) and the chunk's own keys, on tensor
// cores (CUDA only; the contract of dkdv.metal/dkdv.cu, no atomics). A block of W warps owns 16 W
// key rows of one K/V head and walks every grouped query head's queries in tiles of 32:
// S^T = K Q^T and dP^T = V dO^T on tensor cores, P and dS in float32, dV += P^T dO and
// dK += dS^T Q on tensor cores. The accumulators stay in registers (above head dim 128 the walk
// runs once per 128 columns of dK/dV, recomputing the scores: 2 D / 16 fragments would not fit)
// and go straight to dk and dv, whose rows are padded to whole blocks (PADDED).
using namespace mlxwalk_tc;
constexpr int BR = 16 * W, BQ = 32, THREADS = 32 * W;
constexpr int LD = Pitch<D>::half, LP = Pitch<D>::tile, LS = Pitch<D>::score;
constexpr int DA = D < 128 ? D : 128, NF = DA / 16;  // columns of dK/dV per walk
extern __shared__ __align__(32) unsigned char smem[];
T* sK = reinterpret_cast<T*>(smem);                   // BR x D
T* sV = sK + BR * LD;                                 // BR x D
T* sQ = sV + BR * LD;                                 // BQ x D
T* sdO = sQ + BQ * LD;                                // BQ x D
T* sP = sdO + BQ * LD;                                // BR x BQ
T* sdS = sP + BR * LP;                                // BR x BQ
float* sS = reinterpret_cast<float*>(sdS + BR * LP);  // BR x BQ
float* sdP = sS + BR * LS;                            // BR x BQ
float* sL = sdP + BR * LS;                            // BQ log-sum-exps
float* sDelta = sL + BQ;                              // BQ deltas

const int B = params[0], HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], GF = params[6], BS = params[7];
const int NT = START - GF, R = HQ / HKV, ROWS_ALL = NT + L;
const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
const int blocks = (ROWS_ALL + BR - 1) / BR, PADDED = blocks * BR;
const int c0 = (blockIdx.x % blocks) * BR, hk = (blockIdx.x / blocks) % HKV;
const int b = blockIdx.x / (blocks * HKV);
const size_t own = size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N * D;
const float sc = scale[0];

auto keys = [&](const T* own_rows, const S* store) {
  return [=](int r, const T*& a, const S*& s) {
    const int c = c0 + r;
    if (c < NT) {
      s = store + pre + size_t(GF + c) * D;
    } else if (c < ROWS_ALL) {
      a = own_rows + own + size_t(c - NT) * D;
    }
  };
};
stage_rows<T, S, D>(sK, LD, BR, keys(k, pk), tid, THREADS);
stage_rows<T, S, D>(sV, LD, BR, keys(v, pv), tid, THREADS);
const int row = warp * 16 + lane / 2, half = lane % 2;
const int c = c0 + row;
const int first = c < NT ? 0 : c - NT;          // the first query that sees key row c
const int block_first = c0 < NT ? 0 : c0 - NT;  // the block's earliest
for (int part = 0; part < D / DA; ++part) {
  FragC acc_k[NF], acc_v[NF];
#pragma unroll
  for (int n = 0; n < NF; ++n) {
    wm::fill_fragment(acc_k[n], 0.0f);
    wm::fill_fragment(acc_v[n], 0.0f);
  }
  for (int g = 0; g < R; ++g) {
    const size_t qrows = size_t(b * HQ + hk * R + g) * L;
    for (int q0 = block_first - block_first % BQ; q0 < L; q0 += BQ) {
      __syncthreads();  // the previous tile's Q, dO, lse and delta are no longer read
      stage_rows<T, T, D>(sQ, LD, BQ, [&](int r, const T*& a, const T*&) {
        a = q0 + r < L ? q + (qrows + q0 + r) * D : nullptr;
      }, tid, THREADS);
      stage_rows<T, T, D>(sdO, LD, BQ, [&](int r, const T*& a, const T*&) {
        a = q0 + r < L ? d_out + (qrows + q0 + r) * D : nullptr;
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
      accumulate_in<T, BQ, NF>(acc_v, sP + warp * 16 * LP, LP, sdO + part * DA, LD);
      accumulate_in<T, BQ, NF>(acc_k, sdS + warp * 16 * LP, LP, sQ + part * DA, LD);
    }
  }
  const size_t at = (size_t(b * HKV + hk) * PADDED + c0 + warp * 16) * D + part * DA;
#pragma unroll
  for (int n = 0; n < NF; ++n) {
    for (int e = 0; e < acc_k[n].num_elements; ++e) {
      acc_k[n].x[e] *= sc;
    }
    wm::store_matrix_sync(dk + at + n * 16, acc_k[n], D, wm::mem_row_major);
    wm::store_matrix_sync(dv + at + n * 16, acc_v[n], D, wm::mem_row_major);
  }
}
