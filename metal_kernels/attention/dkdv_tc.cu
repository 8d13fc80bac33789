// Chunk attention backward, dK/dV of the taps [GF, START) and the chunk's own keys, on tensor
// cores (CUDA only, float16/bfloat16; float32 takes dkdv.cu): FlashAttention-2's dK/dV pass.
// Shared with dkdv.metal: the contract (dq's inputs; dk, dv (B, HKV, NT + L, D) float32, the taps
// then the own keys) and the math: P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - delta),
// dV = sum P^T dO and dK = scale * sum dS^T Q over every query of the grouped heads that sees the
// key, summed inside the block (no atomics), float32 accumulators.
// Not shared: a block of NW warps owns BKV key rows (128; 64 at D = 256, SPLIT = 2: two warps on
// each 16 rows, each with half of D, swapping packed P^T/dS^T fragments through shared memory);
// queries walked in tiles of BM, Q, dO, lse and delta double buffered through cp.async in
// 73-215 KiB of shared memory; products on mma.sync m16n8k16 with ldmatrix (K, V in registers
// when KREG), P^T and dS^T rounded to T as A operands. dkdv.metal: 16-32 key rows a threadgroup,
// SPLIT simdgroups per 8 rows summing partial scores, 8x8 simdgroup_float8x8 products in float,
// <= 32 KiB of threadgroup memory, no async copies. A timing of this kernel on an NVIDIA GPU
// says nothing about dkdv.metal's speed.
// Template: T, S, D, G (as forward_tc.cu's), NW, BM, SPLIT, KREG (attention/blocks.py).
using namespace mlxwalk_tc;
constexpr int GROUPS = NW / SPLIT, BKV = 16 * GROUPS, THREADS = 32 * NW, P = D + PAD;
constexpr int QC = BM / SPLIT, DC = D / SPLIT;  // a warp's query columns and dK/dV columns
constexpr int NQ = QC / 8, NDC = DC / 8, KQ = QC / 16, KB = BM / 16;
extern __shared__ __align__(16) unsigned char smem[];
T* sK = reinterpret_cast<T*>(smem);  // BKV x P
T* sV = sK + BKV * P;                // BKV x P
T* sQ = sV + BKV * P;                // 2 x BM x P
T* sdO = sQ + 2 * BM * P;            // 2 x BM x P
float* sL = reinterpret_cast<float*>(sdO + 2 * BM * P);  // 2 x BM log-sum-exps
float* sDl = sL + 2 * BM;                                // 2 x BM deltas
u32* sX = reinterpret_cast<u32*>(sDl + 2 * BM);          // SPLIT: NW x 2 KQ x 4 x 32 fragments

const int HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], GF = params[6], BS = params[7];
const int NTAP = START - GF, R = HQ / HKV, ROWS_ALL = NTAP + L;
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int grp = warp / SPLIT, part = warp % SPLIT;
const int blocks = (ROWS_ALL + BKV - 1) / BKV;
const int c0 = int(blockIdx.x % blocks) * BKV, hk = (blockIdx.x / blocks) % HKV;
const int b = blockIdx.x / (blocks * HKV);
const size_t own = size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N + GF;  // the first tap's store row
const float sc = scale[0], c = sc * LOG2E;

// The queries the block's keys see start at the first own key's (the taps see every query).
const int qs = max(0, c0 - NTAP);
const int per_head = (L - qs + BM - 1) / BM;
const int tiles = R * per_head;
auto load_tile = [&](int t, int stage) {
  const int g = t / per_head, q0 = qs + (t % per_head) * BM;
  const size_t qrows = size_t(b * HQ + hk * R + g) * L;
  const T* q_rows = q + qrows * D;
  const T* o_rows = d_out + qrows * D;
  load_span<T, D, BM, THREADS>(sQ + stage * BM * P, rows_of<D>(q_rows), q_rows, q0, 0, L, tid);
  load_span<T, D, BM, THREADS>(sdO + stage * BM * P, rows_of<D>(o_rows), o_rows, q0, 0, L, tid);
  load_floats<BM, THREADS>(sL + stage * BM, lse + qrows + q0, L - q0, tid);
  load_floats<BM, THREADS>(sDl + stage * BM, delta + qrows + q0, L - q0, tid);
};
// Key rows: the taps [0, NTAP) from the store (positions GF on), then the chunk's own.
const auto k_taps = store_rows<S, D, G>(pk, pk_scales, pk_biases, pre);
const auto v_taps = store_rows<S, D, G>(pv, pv_scales, pv_biases, pre);
load_span<T, D, BKV, THREADS>(sK, k_taps, k + own, c0, NTAP, ROWS_ALL, tid);
load_span<T, D, BKV, THREADS>(sV, v_taps, v + own, c0, NTAP, ROWS_ALL, tid);
load_tile(0, 0);
cp_commit();

const int kr0 = grp * 16;                         // the warp's key rows in the block
const int first_row = c0 + kr0 + (lane >> 2);     // this lane's rows: first_row, first_row + 8
float dk_acc[1][NDC][4], dv_acc[1][NDC][4];
zero(dk_acc);
zero(dv_acc);
u32 ka[1][D / 16][4], va[1][D / 16][4];  // KREG: the warp's K and V fragments
for (int t = 0; t < tiles; ++t) {
  cp_wait<0>();
  __syncthreads();  // tile t is in; every warp is done with tile t - 1's buffers
  if (t + 1 < tiles) {
    load_tile(t + 1, (t + 1) & 1);
  }
  cp_commit();
  if constexpr (KREG) {
    if (t == 0) {
      load_a<T, D, P, 1>(ka, sK + kr0 * P, lane);
      load_a<T, D, P, 1>(va, sV + kr0 * P, lane);
    }
  }
  const int stage = t & 1;
  const int q0 = qs + (t % per_head) * BM;
  const T* tQ = sQ + stage * BM * P;
  const T* tdO = sdO + stage * BM * P;
  const int col0 = part * QC;  // the warp's first query column in the tile
  float s[1][NQ][4], dp[1][NQ][4];
  zero(s);
  zero(dp);
  if constexpr (KREG) {
    mma_nt_ra<T, D, P, 1, NQ>(s, ka, tQ + col0 * P, lane);
    mma_nt_ra<T, D, P, 1, NQ>(dp, va, tdO + col0 * P, lane);
  } else {
    mma_nt<T, D, P, 1, NQ>(s, sK + kr0 * P, tQ + col0 * P, lane);
    mma_nt<T, D, P, 1, NQ>(dp, sV + kr0 * P, tdO + col0 * P, lane);
  }
  // Key row r sees query i when i < L and (r is a tap, or i >= r - NTAP).
  const bool edge = q0 + col0 + QC > L || c0 + kr0 + 15 - NTAP > q0 + col0;
#pragma unroll
  for (int nt = 0; nt < NQ; ++nt) {
    const int col = col0 + nt * 8 + 2 * (lane & 3);
    const float2 lc = *reinterpret_cast<const float2*>(sL + stage * BM + col);
    const float2 dc = *reinterpret_cast<const float2*>(sDl + stage * BM + col);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = ex2(fmaf(s[0][nt][e], c, -((e & 1) ? lc.y : lc.x) * LOG2E));
      if (edge) {
        const int i = q0 + col + (e & 1), row = first_row + 8 * (e >> 1);
        p = i < L && (row < NTAP || i >= row - NTAP) ? p : 0.0f;
      }
      s[0][nt][e] = p;
      dp[0][nt][e] = p * (dp[0][nt][e] - ((e & 1) ? dc.y : dc.x));  // dS^T
    }
  }
  u32 mp[1][KQ][4], md[1][KQ][4];  // this warp's columns, packed
  to_a<T, 1, NQ>(mp, s);
  to_a<T, 1, NQ>(md, dp);
  u32 pa[1][KB][4], da[1][KB][4];  // the whole tile's
  if constexpr (SPLIT == 1) {
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pa[0][kk][r] = mp[0][kk][r];
        da[0][kk][r] = md[0][kk][r];
      }
    }
  } else {
    u32* mine = sX + warp * (2 * KQ * 4 * 32);
    const u32* theirs = sX + (warp ^ 1) * (2 * KQ * 4 * 32);
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        mine[(kk * 4 + r) * 32 + lane] = mp[0][kk][r];
        mine[((KQ + kk) * 4 + r) * 32 + lane] = md[0][kk][r];
      }
    }
    bar_sync(1 + grp, 64);  // the pair's fragments are both written
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const u32 op = theirs[(kk * 4 + r) * 32 + lane];
        const u32 od = theirs[((KQ + kk) * 4 + r) * 32 + lane];
        pa[0][kk][r] = part == 0 ? mp[0][kk][r] : op;  // columns [0, QC): part 0's
        da[0][kk][r] = part == 0 ? md[0][kk][r] : od;
        pa[0][(KQ + kk) % KB][r] = part == 0 ? op : mp[0][kk][r];  // [QC, BM): part 1's
        da[0][(KQ + kk) % KB][r] = part == 0 ? od : md[0][kk][r];
      }
    }
  }
  mma_nn<T, KB, P, 1, NDC>(dv_acc, pa, tdO + part * DC, lane);
  mma_nn<T, KB, P, 1, NDC>(dk_acc, da, tQ + part * DC, lane);
}
#pragma unroll
for (int hh = 0; hh < 2; ++hh) {
  const int row = first_row + 8 * hh;
  if (row < ROWS_ALL) {
    const size_t at = (size_t(b * HKV + hk) * ROWS_ALL + row) * D + part * DC + 2 * (lane & 3);
#pragma unroll
    for (int nd = 0; nd < NDC; ++nd) {
      *reinterpret_cast<float2*>(dk + at + nd * 8) =
          make_float2(dk_acc[0][nd][2 * hh] * sc, dk_acc[0][nd][2 * hh + 1] * sc);
      *reinterpret_cast<float2*>(dv + at + nd * 8) =
          make_float2(dv_acc[0][nd][2 * hh], dv_acc[0][nd][2 * hh + 1]);
    }
  }
}
