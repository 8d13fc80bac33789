// delta/prepare_back (CUDA; the twin of prepare_back.metal): the WY backward, in parallel over
// chunks. Per value head, with X = diag(beta gamma) K, Y = diag(beta) V, w = T X, u = T Y
// (T = (I + A)^-1, A_ij = beta_i E_ij k_i.k_j below the diagonal, E_ij = gamma_i / gamma_j) and
// the cotangents dw (grads) and du = dv_new (states_back):
//   dX = T^T dw, dY = T^T du, dT = dw X^T + du Y^T, dA = -T^T dT T^T (strictly lower),
//   M = dA (.) E,   dk += diag(beta gamma) dX + diag(beta) M K + M^T diag(beta) K,
//   dv = diag(beta) dY,   dbeta = gamma (.) rowdot(dX, K) + rowdot(dY, V) + rowdot(M K, K),
//   dcum = grads's + beta gamma (.) rowdot(dX, K) + beta (.) rowdot(M K, K)
//          - rowdot(M^T diag(beta) K, K),
// and dlog_g the reverse cumsum of dcum within the chunk (dT masked to its strictly lower part).
// Shared with prepare_back.metal: the contract (chunked.py's buffers; dk = dk_in + the above
// summed over the key head's value heads, dv, dlog_g, dbeta float32, the same layouts), the math
// above and the decomposition: a block per (b, key head, chunk) walking its value heads.
// Not shared: 4 warps (128 threads, 16 of the chunk's rows each; prepare_back.metal: 8
// simdgroups, 256 threads); K, V (cp.async), T, dw, du, dT and diag(beta) M held whole in
// 73-151 KiB of shared memory (prepare_back.metal: SL columns a step as float32 beside packed
// tiles, 29 KiB);
// mma.sync m16n8k16 (float16/bfloat16; derived operands as hi + lo halves, tiles.cuh) or float32
// FMA in fragment layout, vs 8x8 simdgroup_float8x8 in float. Rounding differs; a timing on an
// NVIDIA GPU says nothing about prepare_back.metal's speed.
// Template: T, DK, DV, SMEM.
using namespace mlxwalk_dt;
constexpr int THREADS = 128, PARTS = Prec<T>::parts, PAD = Prec<T>::pad;
constexpr int PK = DK + PAD, PV = DV + PAD, PC = CH + PAD, DX = DK > DV ? DK : DV;
constexpr int O_K = 0, O_V = O_K + region<T>(CH * PK), O_T = O_V + region<T>(CH * PV);
constexpr int O_D = O_T + PARTS * region<T>(CH * PC), O_X = O_D + PARTS * region<T>(CH * (DX + PAD));
constexpr int O_G = O_X + PARTS * region<T>(CH * PC), O_B = O_G + region<float>(CH);
constexpr int O_DC = O_B + region<float>(CH), O_DB = O_DC + region<float>(CH);
constexpr int BUF = Prec<T>::half ? 0 : region<float>(16 * (CH + 4));
constexpr int O_BUF = O_DB + region<float>(CH), O_END = O_BUF + 4 * BUF;
static_assert(O_END <= SMEM, "prepare_back: shared memory past the launch's");
extern __shared__ __align__(16) unsigned char smem[];
T* sK = reinterpret_cast<T*>(smem + O_K);
T* sV = reinterpret_cast<T*>(smem + O_V);
T* sT[PARTS];
T* sD[PARTS];  // dw, then du
T* sX[PARTS];  // dT, then diag(beta) M
for (int i = 0; i < PARTS; ++i) {
  sT[i] = reinterpret_cast<T*>(smem + O_T + i * region<T>(CH * PC));
  sD[i] = reinterpret_cast<T*>(smem + O_D + i * region<T>(CH * (DX + PAD)));
  sX[i] = reinterpret_cast<T*>(smem + O_X + i * region<T>(CH * PC));
}
float* sG = reinterpret_cast<float*>(smem + O_G);
float* sB = reinterpret_cast<float*>(smem + O_B);
float* sDc = reinterpret_cast<float*>(smem + O_DC);
float* sDb = reinterpret_cast<float*>(smem + O_DB);

const int L = params[1], HK = params[2], HV = params[3], N = params[4], NKB = params[5];
const int R = HV / HK, NP = N * CH;
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int c = blockIdx.x % N, bk = blockIdx.x / N, b = bk / HK, hk = bk % HK;
const int t0 = c * CH, valid = min(CH, L - t0), i0 = 16 * warp;
const int g4 = lane >> 2, t4 = lane & 3;
float* wbuf = reinterpret_cast<float*>(smem + O_BUF + warp * BUF);
const size_t kc = ((size_t(b) * L + t0) * HK + hk) * DK;  // row r: + r HK DK

load_tile<T, CH, DK, PK, THREADS>(sK, k + kc, size_t(HK) * DK, valid, tid);
cp_commit();

// dk's rows i0.. += a part (DK columns of C fragments), in place; `base` the row's earlier sum
// (dk_in for the first part of all, else dk itself). Each element by its own lane.
auto add_dk = [&](const float (&a)[1][DK / 8][4], const float* base) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = i0 + g4 + 8 * hh;
    if (i < valid) {
      const size_t row = kc + size_t(i) * HK * DK;
#pragma unroll
      for (int n = 0; n < DK / 8; ++n) {
        const size_t e = row + n * 8 + 2 * t4;
        const float2 x = *reinterpret_cast<const float2*>(base + e);
        *reinterpret_cast<float2*>(dk + e) =
            make_float2(x.x + a[0][n][2 * hh], x.y + a[0][n][2 * hh + 1]);
      }
    }
  }
};

for (int gi = 0; gi < R; ++gi) {
  const int hv = hk * R + gi, bh = b * HV + hv;
  const size_t rows = size_t(bh) * NP + t0, at = (size_t(b) * L + t0) * HV + hv;
  __syncthreads();  // the previous value head's reads are done
  load_tile<T, CH, DV, PV, THREADS>(sV, v + at * DV, size_t(HV) * DV, valid, tid);
  load_vec<CH, THREADS>(sG, cum + rows, 1, CH, tid);
  load_vec<CH, THREADS>(sB, beta + at, HV, valid, tid);
  cp_commit();
  load_split<T, CH, CH, PC, THREADS>(sT, tri + (size_t(bh) * N + c) * CH * CH, CH, CH, tid);
  load_split<T, CH, DK, PK, THREADS>(sD, dw + rows * DK, DK, CH, tid);
  cp_commit();
  if (tid < CH) {
    float s = 0.0f;
    for (int n = 0; n < NKB; ++n) {
      s += dcum[(size_t(bh) * NKB + n) * NP + t0 + tid];
    }
    sDc[tid] = s;
  }
  cp_wait<0>();
  __syncthreads();

  float dt[1][CH / 8][4];  // dT, rows i0..
  float rdx[2], rdy[2], r1d[2], r2d[2];
  zero(dt);
  mm<1, CH / 8, DK / 16>(dt, derived<PK, false>(sD).at(i0, 0), exact<PK, false>(sK), lane);
  each(dt, lane, [&](float& x, int, int j) { x *= expd(sG[j]); });  // dw K^T diag(gamma)
  {  // dX = T^T dw (T^T(j, i) = T(i, j), zero for i < j: k-steps from the warp's rows on)
    float dx[1][DK / 8][4];
    zero(dx);
    mm<1, DK / 8, CH / 16>(dx, derived<PC, true>(sT).at(i0, 0), derived<PK, true>(sD), lane, warp);
    row_dot(rdx, dx, sK + i0 * PK, PK, lane);
    each(dx, lane, [&](float& x, int r, int) { x *= sB[i0 + r] * expd(sG[i0 + r]); });
    add_dk(dx, gi == 0 ? dk_in : dk);
  }
  __syncthreads();  // every warp is done with dw
  load_split<T, CH, DV, PV, THREADS>(sD, dv_new + rows * DV, DV, CH, tid);
  cp_commit();
  cp_wait<0>();
  __syncthreads();
  mm<1, CH / 8, DV / 16>(dt, derived<PV, false>(sD).at(i0, 0), exact<PV, false>(sV), lane);
  each(dt, lane, [&](float& x, int r, int j) {  // (dw K^T diag(gamma) + du V^T) diag(beta)
    x = j < i0 + r ? x * sB[j] : 0.0f;            // strictly lower: all dA's lower part needs
  });
  {  // dY = T^T du; dv = diag(beta) dY
    float dy[1][DV / 8][4];
    zero(dy);
    mm<1, DV / 8, CH / 16>(dy, derived<PC, true>(sT).at(i0, 0), derived<PV, true>(sD), lane, warp);
    row_dot(rdy, dy, sV + i0 * PV, PV, lane);
    each(dy, lane, [&](float& x, int r, int) { x *= sB[i0 + r]; });
    store_frag(dv + (at + size_t(i0) * HV) * DV, size_t(HV) * DV, dy, lane, valid - i0);
  }
#pragma unroll
  for (int n = 0; n < CH / 8; ++n) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      put2<T>(sX, (i0 + g4 + 8 * hh) * PC + n * 8 + 2 * t4, dt[0][n][2 * hh], dt[0][n][2 * hh + 1]);
    }
  }
  __syncthreads();  // dT is in
  float m[1][CH / 8][4];  // M = dA (.) E, rows i0..
  {
    float x1[1][CH / 8][4];  // T^T dT, rows i0.. (T(i, a) = 0 for i < a)
    zero(x1);
    mm<1, CH / 8, CH / 16>(x1, derived<PC, true>(sT).at(i0, 0), derived<PC, true>(sX), lane, warp);
    zero(m);  // dA = -(T^T dT) T^T: its columns c < a need k-steps up to the warp's rows
    mm_frag<1, CH / 8, CH / 16>(m, x1, derived<PC, false>(sT), lane, wbuf, 0, warp + 1);
    each(m, lane, [&](float& x, int r, int j) {
      const int a = i0 + r;
      x = j < a ? -x * expd(sG[a] - sG[j]) : 0.0f;
    });
  }
  {  // R1 = M K (columns c < a: k-steps up to the warp's rows)
    float r1[1][DK / 8][4];
    zero(r1);
    mm_frag<1, DK / 8, CH / 16>(r1, m, exact<PK, true>(sK), lane, wbuf, 0, warp + 1);
    row_dot(r1d, r1, sK + i0 * PK, PK, lane);
    each(r1, lane, [&](float& x, int r, int) { x *= sB[i0 + r]; });
    add_dk(r1, dk);
  }
  __syncthreads();  // every warp is done with dT
#pragma unroll
  for (int n = 0; n < CH / 8; ++n) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int a = i0 + g4 + 8 * hh;
      put2<T>(sX, a * PC + n * 8 + 2 * t4, sB[a] * m[0][n][2 * hh], sB[a] * m[0][n][2 * hh + 1]);
    }
  }
  __syncthreads();  // diag(beta) M is in
  {  // R2 = M^T diag(beta) K (rows c: M(a, c) = 0 for a <= c, k-steps from the warp's rows on)
    float r2[1][DK / 8][4];
    zero(r2);
    mm<1, DK / 8, CH / 16>(r2, derived<PC, true>(sX).at(i0, 0), exact<PK, true>(sK), lane, warp);
    row_dot(r2d, r2, sK + i0 * PK, PK, lane);
    add_dk(r2, dk);
  }
  if (t4 == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = i0 + g4 + 8 * hh;
      const float bi = sB[i], gmi = expd(sG[i]);
      sDb[i] = gmi * rdx[hh] + rdy[hh] + r1d[hh];
      sDc[i] += bi * gmi * rdx[hh] + bi * r1d[hh] - r2d[hh];
    }
  }
  __syncthreads();  // dcum and dbeta are in
  if (tid < valid) {  // dlog_g: the reverse cumsum of dcum within the chunk
    float s = 0.0f;
    for (int j = CH - 1; j >= tid; --j) {
      s += sDc[j];
    }
    dlog_g[at + size_t(tid) * HV] = s;
    dbeta[at + size_t(tid) * HV] = sDb[tid];
  }
}
