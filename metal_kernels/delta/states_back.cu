// delta/states_back (CUDA; the twin of states_back.metal): the reverse scan. For each chunk c
// from the last, with dS the adjoint of the state leaving it (d_final to start with),
// P = Q K^T (.) D (D_ij = gamma_i / gamma_j, j <= i) and d_j = gamma_C / gamma_j:
//   dh_c = dS,   dv_new = P^T dO + diag(d) K dS^T,
//   dS <- gamma_C dS + dO^T diag(gamma) Q - dv_new^T w,
// and after chunk 0 the initial state's gradient d_state = dS.
// Shared with states_back.metal: the contract (chunked.py's q, k, w, cum, d_out, d_final; dh,
// dv_new and d_state float32, the same layouts), the reverse recurrence above, dS in float32
// registers for the whole walk, a block per (b, value head, BV = 32 value rows), 128 threads.
// Not shared: states.cu's split (DKS = 2 warps on each 16 value rows, DK / 2 key columns each,
// partial sums meeting through shared memory; states_back.metal: a simdgroup per 8 value rows,
// all DK); Q, K, w, dO, cum double buffered through cp.async (STAGES 2; 1 at DK 128 float32)
// in 142.5-222.5 KiB of shared memory
// (states_back.metal: SL columns a step as float32, 27.3 KiB); mma.sync m16n8k16 (float16/
// bfloat16; derived operands as hi + lo, tiles.cuh) or float32 FMA in fragment layout, vs 8x8
// simdgroup_float8x8 in float. Rounding differs; a timing on an NVIDIA GPU says nothing about
// states_back.metal's speed.
// Template: T, DK, DV, BV, DKS (1 or 2), STAGES (1 or 2), SMEM.
using namespace mlxwalk_dt;
constexpr int NW = BV / 16 * DKS, THREADS = 32 * NW, PARTS = Prec<T>::parts, PAD = Prec<T>::pad;
constexpr int DKH = DK / DKS;  // a warp's key columns
constexpr int PK = DK + PAD, PW = DK + 4, PO = BV + PAD, PM = CH + PAD;
constexpr int S_Q = region<T>(CH * PK), S_W = region<float>(CH * PW), S_O = region<T>(CH * PO);
constexpr int STAGE = 2 * S_Q + S_W + S_O + region<float>(CH);
constexpr int O_WH = STAGES * STAGE;
constexpr int O_M = O_WH + (Prec<T>::half ? 2 * region<T>(CH * PK) : 0);
constexpr int O_OG = O_M + PARTS * region<T>(CH * PM), O_BUF = O_OG + PARTS * region<T>(CH * PO);
constexpr int BUF = Prec<T>::half ? 0 : region<float>(16 * ((DK > CH ? DK : CH) + 4));
constexpr int O_X = O_BUF + NW * BUF;
constexpr int XCH = DKS > 1 ? region<float>(16 * CH) : 0;  // a warp's partial dv_new^T
constexpr int O_END = O_X + NW * XCH;
static_assert(O_END <= SMEM, "states_back: shared memory past the launch's");
static_assert(BV % 16 == 0 && DV % BV == 0 && (STAGES == 1 || STAGES == 2), "shape");
static_assert(DKS == 1 || DKS == 2, "one or two warps on 16 rows");
extern __shared__ __align__(16) unsigned char smem[];

const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int NP = N * CH, VB = DV / BV;
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int bh = blockIdx.x / VB, b = bh / HV, hv = bh % HV, hk = hv / (HV / HK);
const int rw = warp / DKS, part = warp % DKS;  // the warp's rows, its part of the key columns
const int vb0 = (blockIdx.x % VB) * BV, v0 = vb0 + 16 * rw, dk0 = part * DKH;
// Stage s's buffers (computed, not indexed: a run-time index into an array would go to memory).
auto sQ = [&](int s) { return reinterpret_cast<T*>(smem + s * STAGE); };
auto sK = [&](int s) { return reinterpret_cast<T*>(smem + s * STAGE + S_Q); };
auto sW = [&](int s) { return reinterpret_cast<float*>(smem + s * STAGE + 2 * S_Q); };
auto sO = [&](int s) { return reinterpret_cast<T*>(smem + s * STAGE + 2 * S_Q + S_W); };
auto sG = [&](int s) { return reinterpret_cast<float*>(smem + s * STAGE + 2 * S_Q + S_W + S_O); };
T* sWh[PARTS];
T* sM[PARTS];
T* sOg[PARTS];
for (int i = 0; i < PARTS; ++i) {
  sWh[i] = reinterpret_cast<T*>(smem + O_WH + i * region<T>(CH * PK));
  sM[i] = reinterpret_cast<T*>(smem + O_M + i * region<T>(CH * PM));
  sOg[i] = reinterpret_cast<T*>(smem + O_OG + i * region<T>(CH * PO));
}
float* wbuf = reinterpret_cast<float*>(smem + O_BUF + warp * BUF);
float* mine = reinterpret_cast<float*>(smem + O_X + warp * XCH);
const float* theirs = reinterpret_cast<const float*>(smem + O_X + (warp ^ 1) * XCH);

auto stage = [&](int c, int s) {  // chunk c's Q, K, dO (the block's columns), w, cum
  const int t0 = c * CH, valid = min(CH, L - t0);
  const size_t rows = size_t(bh) * NP + t0, qk = ((size_t(b) * L + t0) * HK + hk) * DK;
  load_tile<T, CH, DK, PK, THREADS>(sQ(s), q + qk, size_t(HK) * DK, valid, tid);
  load_tile<T, CH, DK, PK, THREADS>(sK(s), k + qk, size_t(HK) * DK, valid, tid);
  load_tile<T, CH, BV, PO, THREADS>(sO(s), d_out + ((size_t(b) * L + t0) * HV + hv) * DV + vb0,
                                    size_t(HV) * DV, valid, tid);
  load_tile<float, CH, DK, PW, THREADS>(sW(s), w + rows * DK, DK, CH, tid);
  load_vec<CH, THREADS>(sG(s), cum + rows, 1, CH, tid);
};

float ds[1][DKH / 8][4];  // dS, rows v0.., key columns dk0.. (16 x DK / DKS)
load_frag(ds, d_final + (size_t(bh) * DV + v0) * DK + dk0, DK, lane);
if constexpr (STAGES == 2) {
  stage(N - 1, 0);
  cp_commit();
}
for (int n = 0; n < N; ++n) {
  const int c = N - 1 - n, s = STAGES == 2 ? (n & 1) : 0, t0 = c * CH;
  if constexpr (STAGES == 1) {
    __syncthreads();  // every warp is done with chunk c + 1's buffers
    stage(c, 0);
    cp_commit();
  }
  cp_wait<0>();
  __syncthreads();  // chunk c is in; every warp is done with chunk c + 1's buffers
  if constexpr (STAGES == 2) {
    if (c > 0) {
      stage(c - 1, s ^ 1);
    }
    cp_commit();
  }
  const float* g = sG(s);
  T* wop[PARTS];
  if constexpr (Prec<T>::half) {
    split_tile<T, CH, DK, PW, PK, THREADS>(sWh, sW(s), tid);
    for (int i = 0; i < PARTS; ++i) {
      wop[i] = sWh[i];
    }
  } else {
    wop[0] = reinterpret_cast<T*>(sW(s));
  }
  for (int e = tid; e < CH * BV / 2; e += THREADS) {  // diag(gamma) dO
    const int i = e / (BV / 2), j = 2 * (e % (BV / 2));
    const float gi = expd(g[i]);
    put2<T>(sOg, i * PO + j, gi * to_float(sO(s)[i * PO + j]), gi * to_float(sO(s)[i * PO + j + 1]));
  }
  for (int rb = warp; rb < CH / 16; rb += NW) {  // P's row block rb, as parts
    float p[1][CH / 8][4];
    zero(p);
    mm<1, CH / 8, DK / 16>(p, exact<PK, false>(sQ(s)).at(16 * rb, 0), exact<PK, false>(sK(s)),
                           lane);
    const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int nt = 0; nt < CH / 8; ++nt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 16 * rb + g4 + 8 * hh, j = nt * 8 + 2 * t4;
        const float a = j <= i ? p[0][nt][2 * hh] * expd(g[i] - g[j]) : 0.0f;
        const float bb = j + 1 <= i ? p[0][nt][2 * hh + 1] * expd(g[i] - g[j + 1]) : 0.0f;
        put2<T>(sM, i * PM + j, a, bb);
      }
    }
  }
  store_frag(dh + (((size_t(b) * N + c) * HV + hv) * DV + v0) * DK + dk0, DK, ds, lane);
  __syncthreads();  // P, diag(gamma) dO and w's parts are in

  // dv_new^T = (dS K^T) diag(d) + dO^T P, in one accumulator: the state's part first, decayed
  const float last = g[CH - 1];
  float dvn[1][CH / 8][4];
  zero(dvn);
  mm_frag<1, CH / 8, DKH / 16>(dvn, ds, exact<PK, false>(sK(s)).at(0, dk0), lane, wbuf);
  each(dvn, lane, [&](float& x, int, int j) { x *= expd(last - g[j]); });
  const auto dot = exact<PO, true>(sO(s)).at(16 * rw, 0);  // dO^T: element (value, position)
  if constexpr (DKS == 1) {
    mm<1, CH / 8, CH / 16>(dvn, dot, derived<PM, true>(sM), lane);
  } else {  // the pair's halves of dO^T P's columns (P(i, j) = 0 for i < j: k-steps from 2 part)
    float half[1][CH / 16][4];
    zero(half);
    mm<1, CH / 16, CH / 16>(half, dot, derived<PM, true>(sM).at(part * CH / 2, 0), lane, 2 * part);
#pragma unroll
    for (int nt = 0; nt < CH / 16; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (part == 0) {
          dvn[0][nt][e] += half[0][nt][e];
        } else {
          dvn[0][CH / 16 + nt][e] += half[0][nt][e];
        }
      }
    }
    pair_sum(dvn, mine, theirs, 1 + rw, lane);
  }
  float* out = dv_new + (size_t(bh) * NP + t0) * DV + v0;
  each(dvn, lane, [&](float& x, int r, int j) {
    if (j / (CH / DKS) == part) {  // each warp of the pair stores half the positions
      out[size_t(j) * DV + r] = x;
    }
    x = -x;  // the A operand of dS -= dv_new^T w
  });
  const float gc = expd(last);
  each(ds, lane, [&](float& x, int, int) { x *= gc; });
  // dS += (diag(gamma) dO)^T Q - dv_new^T w, the warp's key columns
  mm<1, DKH / 8, CH / 16>(ds, derived<PO, true>(sOg).at(16 * rw, 0),
                          exact<PK, true>(sQ(s)).at(dk0, 0), lane);
  mm_frag<1, DKH / 8, CH / 16>(ds, dvn, derived<PK, true>(wop).at(dk0, 0), lane, wbuf);
}
store_frag(d_state + (size_t(bh) * DV + v0) * DK + dk0, DK, ds, lane);
