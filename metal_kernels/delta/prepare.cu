// delta/prepare (CUDA; the twin of prepare.metal): per chunk of 64 positions and value head, the
// intra-chunk factors of the WY form, in parallel over chunks x heads. With b the gate's
// cumulative log within the chunk (gamma = exp(b)):
//   A = beta_i (gamma_i / gamma_j) k_i.k_j (j < i),  T = (I + A)^-1,
//   w = T diag(beta gamma) K,  u = T diag(beta) V.
// Shared with prepare.metal: the contract (chunked.py's inputs, params and buffers: cum (= b),
// w, u and with KEEP tri = T, float32, the same layouts), the math above and T's construction:
// 16 x 16 diagonal blocks by forward substitution, merged pairwise to 64 (T21 = -T22 A21 T11).
// Not shared: a block of 4 warps (128 threads, 16 of the chunk's rows each) per (b, value head,
// chunk), so K K^T is computed per value head (prepare.metal: 8 simdgroups, 256 threads, per
// (b, key head, chunk), the Gram once for its value heads); K, V staged by cp.async in
// 88.8-134.8 KiB of shared memory (prepare.metal: 18.8-26.8 KiB); products on mma.sync m16n8k16
// (float16/bfloat16; derived operands as hi + lo halves, tiles.cuh) or float32 FMA in fragment
// layout, the merges in float32 FMA (prepare.metal: 8x8 simdgroup_float8x8 in float). Rounding
// differs; a timing of this kernel on an NVIDIA GPU says nothing about prepare.metal's speed.
// Template: T (q/k/v's dtype), DK, DV, KEEP, SMEM (the launch's shared bytes, checked here).
using namespace mlxwalk_dt;
constexpr int THREADS = 128, PARTS = Prec<T>::parts, PAD = Prec<T>::pad;
constexpr int PK = DK + PAD, PV = DV + PAD, PC = CH + 4, PCT = CH + PAD;
constexpr int O_K = 0, O_V = O_K + region<T>(CH * PK), O_G = O_V + region<T>(CH * PV);
constexpr int O_BETA = O_G + region<float>(CH), O_LG = O_BETA + region<float>(CH);
constexpr int O_A = O_LG + region<float>(CH), O_T = O_A + region<float>(CH * PC);
constexpr int O_R = O_T + region<float>(CH * PC);  // the merges' scratch, then T diag(.) parts
constexpr int R_SCRATCH = region<float>(CH * PC), R_PARTS = 2 * PARTS * region<T>(CH * PCT);
constexpr int O_END = O_R + (R_SCRATCH > R_PARTS ? R_SCRATCH : R_PARTS);
static_assert(O_END <= SMEM, "prepare: shared memory past the launch's");
extern __shared__ __align__(16) unsigned char smem[];
T* sK = reinterpret_cast<T*>(smem + O_K);
T* sV = reinterpret_cast<T*>(smem + O_V);
float* sG = reinterpret_cast<float*>(smem + O_G);
float* sBeta = reinterpret_cast<float*>(smem + O_BETA);
float* sLg = reinterpret_cast<float*>(smem + O_LG);
float* sA = reinterpret_cast<float*>(smem + O_A);
float* sT = reinterpret_cast<float*>(smem + O_T);
float* sX = reinterpret_cast<float*>(smem + O_R);
T* sTw[PARTS];
T* sTu[PARTS];
for (int i = 0; i < PARTS; ++i) {
  sTw[i] = reinterpret_cast<T*>(smem + O_R + i * region<T>(CH * PCT));
  sTu[i] = reinterpret_cast<T*>(smem + O_R + (PARTS + i) * region<T>(CH * PCT));
}

const int L = params[1], HK = params[2], HV = params[3], NC = params[4];
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int c = blockIdx.x % NC, hv = (blockIdx.x / NC) % HV, b = blockIdx.x / (NC * HV);
const int hk = hv / (HV / HK), t0 = c * CH, rows = min(CH, L - t0);
const size_t chunk = (size_t(b) * HV + hv) * NC + c;  // the chunk's index in chunk arrays
const size_t at = size_t(b) * L + t0;                  // its first position in the inputs

load_tile<T, CH, DK, PK, THREADS>(sK, k + at * HK * DK + size_t(hk) * DK, size_t(HK) * DK, rows,
                                  tid);
load_tile<T, CH, DV, PV, THREADS>(sV, v + (at * HV + hv) * DV, size_t(HV) * DV, rows, tid);
load_vec<CH, THREADS>(sLg, log_g + at * HV + hv, HV, rows, tid);
load_vec<CH, THREADS>(sBeta, beta + at * HV + hv, HV, rows, tid);
cp_commit();
for (int i = tid; i < CH * PC; i += THREADS) {
  sT[i] = 0.0f;
}
cp_wait<0>();
__syncthreads();
if (tid < CH) {  // b: the cumulative log gate (padded positions add 0)
  float s = 0.0f;
  for (int j = 0; j <= tid; ++j) {
    s += sLg[j];
  }
  sG[tid] = s;
  cum[chunk * CH + tid] = s;
}
__syncthreads();

// A = beta_i exp(b_i - b_j) k_i.k_j below the diagonal: warp w's 16 rows.
{
  float kk[1][CH / 8][4];
  zero(kk);
  mm<1, CH / 8, DK / 16>(kk, exact<PK, false>(sK).at(16 * warp, 0), exact<PK, false>(sK), lane);
  each(kk, lane, [&](float& x, int r, int j) {
    const int i = 16 * warp + r;
    sA[i * PC + j] = j < i ? sBeta[i] * expd(sG[i] - sG[j]) * x : 0.0f;
  });
}
__syncthreads();

// T = (I + A)^-1. The diagonal blocks: warp w substitutes block w row by row (lane = column).
{
  const int r0 = 16 * warp;
  for (int i = 0; i < 16; ++i) {
    if (lane < 16) {
      float x = lane == i ? 1.0f : 0.0f;
      for (int j = lane; j < i; ++j) {  // T[i][c] = -sum_{c <= j < i} A[i][j] T[j][c]
        x -= sA[(r0 + i) * PC + r0 + j] * sT[(r0 + j) * PC + r0 + lane];
      }
      sT[(r0 + i) * PC + r0 + lane] = x;
    }
    __syncwarp();
  }
}
__syncthreads();
// C = alpha A B (size x size, float32 in shared memory, outputs spread over the block), with B
// lower triangular (b_lower: the sum from k = column on) or A lower triangular (to k = row).
auto small_mm = [&](float* cm, const float* am, const float* bm, int size, float alpha,
                    bool b_lower) {
  for (int e = tid; e < size * size; e += THREADS) {
    const int i = e / size, j = e % size;
    float s = 0.0f;
    for (int q = b_lower ? j : 0; q < (b_lower ? size : i + 1); ++q) {
      s = fmaf(am[i * PC + q], bm[q * PC + j], s);
    }
    cm[i * PC + j] = alpha * s;
  }
};
for (int size = 16; size < CH; size *= 2) {  // merge pairs of blocks: 16 -> 32 -> 64
  for (int p = 0; p < CH / (2 * size); ++p) {  // X = A21 T11
    const int r1 = 2 * p * size, r2 = r1 + size;
    small_mm(sX + r1 * PC, sA + r2 * PC + r1, sT + r1 * PC + r1, size, 1.0f, true);
  }
  __syncthreads();
  for (int p = 0; p < CH / (2 * size); ++p) {  // T21 = -T22 X
    const int r1 = 2 * p * size, r2 = r1 + size;
    small_mm(sT + r2 * PC + r1, sT + r2 * PC + r2, sX + r1 * PC, size, -1.0f, false);
  }
  __syncthreads();
}
if constexpr (KEEP) {
  for (int i = tid; i < CH * CH; i += THREADS) {
    tri[chunk * CH * CH + i] = sT[(i / CH) * PC + i % CH];
  }
}
// T diag(beta gamma) and T diag(beta) as derived operands (the scratch is free again).
for (int e = tid; e < CH * CH / 2; e += THREADS) {
  const int i = e / (CH / 2), j = 2 * (e % (CH / 2));
  const float t0v = sT[i * PC + j], t1v = sT[i * PC + j + 1];
  const float b0 = sBeta[j], b1 = sBeta[j + 1];
  put2<T>(sTw, i * PCT + j, t0v * b0 * expd(sG[j]), t1v * b1 * expd(sG[j + 1]));
  put2<T>(sTu, i * PCT + j, t0v * b0, t1v * b1);
}
__syncthreads();

{  // w = T diag(beta gamma) K: warp w's rows need k-steps 0..w (T is lower triangular)
  float acc[1][DK / 8][4];
  zero(acc);
  mm<1, DK / 8, CH / 16>(acc, derived<PCT, false>(sTw).at(16 * warp, 0), exact<PK, true>(sK),
                         lane, 0, warp + 1);
  store_frag(w + (chunk * CH + 16 * warp) * DK, DK, acc, lane);
}
{  // u = T diag(beta) V
  float acc[1][DV / 8][4];
  zero(acc);
  mm<1, DV / 8, CH / 16>(acc, derived<PCT, false>(sTu).at(16 * warp, 0), exact<PV, true>(sV),
                         lane, 0, warp + 1);
  store_frag(u + (chunk * CH + 16 * warp) * DV, DV, acc, lane);
}
