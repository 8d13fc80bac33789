// delta/states (CUDA; the twin of states.metal): the sequential part. For each chunk c in order,
// with S (DV x DK) the state entering it:
//   h_c = S,   v_new = u - w S^T,   S <- gamma_C S + v_new^T diag(gamma_C / gamma) K.
// Shared with states.metal: the contract (chunked.py's k, w, u, cum, state; h, v_new and
// final_state float32, the same layouts), the recurrence above chunk by chunk, the state kept in
// float32 registers for the whole walk, a block per (b, value head, BV = 32 value rows), 128
// threads.
// Not shared: DKS = 2 warps on each 16 value rows, each with DK / 2 key columns of S as
// m16n8k16 C fragments, partial v_new^T sums meeting through shared memory (states.metal: a
// simdgroup per 8 value rows, all DK, S^T as DK / 8 8x8 tiles); mma.sync m16n8k16 (float16/
// bfloat16; derived w and S as hi + lo halves, tiles.cuh) or float32 FMA in fragment layout, vs
// simdgroup_float8x8 in float; each chunk's K, w, u, cum double buffered through cp.async in
// 104.5-199.5 KiB of shared memory (states.metal: SL columns a step, 18.3-26.3 KiB, no async
// copies). Rounding differs; a timing on an NVIDIA GPU says nothing about states.metal's speed.
// Template: T, DK, DV, BV (value rows a block, 16 per DKS warps), DKS (1 or 2), SMEM.
using namespace mlxwalk_dt;
constexpr int NW = BV / 16 * DKS, THREADS = 32 * NW, PARTS = Prec<T>::parts, PAD = Prec<T>::pad;
constexpr int DKH = DK / DKS;  // a warp's key columns
constexpr int PK = DK + PAD, PW = DK + 4, PU = BV + 4;
constexpr int S_K = region<T>(CH * PK), S_W = region<float>(CH * PW), S_U = region<float>(CH * PU);
constexpr int STAGE = S_K + S_W + S_U + region<float>(CH);
constexpr int O_WH = 2 * STAGE;                                   // w's parts (half path)
constexpr int O_BUF = O_WH + (Prec<T>::half ? 2 * region<T>(CH * PK) : 0);
constexpr int BUF = Prec<T>::half ? 0 : region<float>(16 * ((DK > CH ? DK : CH) + 4));
constexpr int O_X = O_BUF + NW * BUF;  // the float32 path's A operands, a buffer a warp
constexpr int XCH = DKS > 1 ? region<float>(16 * CH) : 0;  // a warp's partial v_new^T
constexpr int O_END = O_X + NW * XCH;
static_assert(O_END <= SMEM, "states: shared memory past the launch's");
static_assert(BV % 16 == 0 && DV % BV == 0 && (DKS == 1 || DKS == 2), "shape");
extern __shared__ __align__(16) unsigned char smem[];

const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int NP = N * CH, VB = DV / BV;
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int bh = blockIdx.x / VB, b = bh / HV, hv = bh % HV, hk = hv / (HV / HK);
const int rw = warp / DKS, part = warp % DKS;  // the warp's rows, its part of the key columns
const int vb0 = (blockIdx.x % VB) * BV, v0 = vb0 + 16 * rw, dk0 = part * DKH;
// Stage s's buffers (computed, not indexed: a run-time index into an array would go to memory).
auto sK = [&](int s) { return reinterpret_cast<T*>(smem + s * STAGE); };
auto sW = [&](int s) { return reinterpret_cast<float*>(smem + s * STAGE + S_K); };
auto sU = [&](int s) { return reinterpret_cast<float*>(smem + s * STAGE + S_K + S_W); };
auto sG = [&](int s) { return reinterpret_cast<float*>(smem + s * STAGE + S_K + S_W + S_U); };
T* sWh[PARTS];
for (int i = 0; i < PARTS; ++i) {
  sWh[i] = reinterpret_cast<T*>(smem + O_WH + i * region<T>(CH * PK));
}
float* wbuf = reinterpret_cast<float*>(smem + O_BUF + warp * BUF);
float* mine = reinterpret_cast<float*>(smem + O_X + warp * XCH);
const float* theirs = reinterpret_cast<const float*>(smem + O_X + (warp ^ 1) * XCH);

auto stage = [&](int c, int s) {  // chunk c's K, w, u (this block's rows), cum
  const int t0 = c * CH;
  const size_t rows = size_t(bh) * NP + t0;
  load_tile<T, CH, DK, PK, THREADS>(sK(s), k + ((size_t(b) * L + t0) * HK + hk) * DK,
                                    size_t(HK) * DK, min(CH, L - t0), tid);
  load_tile<float, CH, DK, PW, THREADS>(sW(s), w + rows * DK, DK, CH, tid);
  load_tile<float, CH, BV, PU, THREADS>(sU(s), u + rows * DV + vb0, DV, CH, tid);
  load_vec<CH, THREADS>(sG(s), cum + rows, 1, CH, tid);
};

float st[1][DKH / 8][4];  // S, rows v0.., key columns dk0.. (16 x DK / DKS)
load_frag(st, state + (size_t(bh) * DV + v0) * DK + dk0, DK, lane);
stage(0, 0);
cp_commit();
for (int c = 0; c < N; ++c) {
  const int s = c & 1;
  cp_wait<0>();
  __syncthreads();  // chunk c is in; every warp is done with chunk c - 1's buffers
  if (c + 1 < N) {
    stage(c + 1, s ^ 1);
  }
  cp_commit();
  T* wop[PARTS];  // w as the B operand: its hi/lo parts (half), or the staged floats
  if constexpr (Prec<T>::half) {
    split_tile<T, CH, DK, PW, PK, THREADS>(sWh, sW(s), tid);
    for (int i = 0; i < PARTS; ++i) {
      wop[i] = sWh[i];
    }
  } else {
    wop[0] = reinterpret_cast<T*>(sW(s));
  }
  store_frag(h + (((size_t(b) * N + c) * HV + hv) * DV + v0) * DK + dk0, DK, st, lane);
  __syncthreads();  // w's parts are in

  // v_new^T = u^T - S w^T, accumulated negated: -u^T + S w^T, over this warp's key columns
  float vn[1][CH / 8][4];
  each(vn, lane, [&](float& x, int r, int j) {
    x = part == 0 ? -sU(s)[j * PU + 16 * rw + r] : 0.0f;
  });
  mm_frag<1, CH / 8, DKH / 16>(vn, st, derived<PK, false>(wop).at(0, dk0), lane, wbuf);
  if constexpr (DKS == 2) {
    pair_sum(vn, mine, theirs, 1 + rw, lane);
  }
  const float last = sG(s)[CH - 1];
  float* vout = v_new + (size_t(bh) * NP + c * CH) * DV + v0;
  each(vn, lane, [&](float& x, int r, int j) {
    x = -x;
    if (j / (CH / DKS) == part) {  // each warp of the pair stores half the positions
      vout[size_t(j) * DV + r] = x;
    }
    x *= expd(last - sG(s)[j]);  // diag(gamma_C / gamma) v_new, transposed
  });
  const float gc = expd(last);
  each(st, lane, [&](float& x, int, int) { x *= gc; });
  // S += (decayed v_new)^T K: K as it is (B rows of K: element (k = position, n = key))
  mm_frag<1, DKH / 8, CH / 16>(st, vn, exact<PK, true>(sK(s)).at(dk0, 0), lane, wbuf);
}
store_frag(final_state + (size_t(bh) * DV + v0) * DK + dk0, DK, st, lane);
