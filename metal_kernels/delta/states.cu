// delta/states (CUDA; the twin of states.metal): the sequential part. For each chunk c in order,
// with S (DV x DK) the state entering it:
//   h_c = S,   v_new = u - w S^T,   S <- gamma_C S + v_new^T diag(gamma_C / gamma) K.
// A block owns BV value rows of one (b, value head): warp j holds rows 16 j.. of S (16 x DK,
// float32 C fragments, DK / 2 floats a lane) for the whole walk. Both products keep the state
// in registers: v_new^T (16 x 64) = u^T - S w^T takes S's fragments as its A operand (split into
// hi + lo per k-step) against w (B = w rows, split once per chunk in shared memory), and
// S += (diag(gamma_C / gamma) v_new)^T K takes v_new^T's fragments, decayed, as its A operand
// against K as it is (exact). Warps never meet but for the chunk's K, w, u and cum, staged once
// per block and double buffered through cp.async (chunk c + 1's in flight while c is walked):
// two barriers a chunk.
// Template: T, DK, DV, BV (value rows a block, 16 a warp), SMEM.
using namespace mlxwalk_dt;
constexpr int NW = BV / 16, THREADS = 32 * NW, PARTS = Prec<T>::parts, PAD = Prec<T>::pad;
constexpr int PK = DK + PAD, PW = DK + 4, PU = BV + 4;
constexpr int S_K = region<T>(CH * PK), S_W = region<float>(CH * PW), S_U = region<float>(CH * PU);
constexpr int STAGE = S_K + S_W + S_U + region<float>(CH);
constexpr int O_WH = 2 * STAGE;                                   // w's parts (half path)
constexpr int O_BUF = O_WH + (Prec<T>::half ? 2 * region<T>(CH * PK) : 0);
constexpr int BUF = Prec<T>::half ? 0 : region<float>(16 * ((DK > CH ? DK : CH) + 4));
constexpr int O_END = O_BUF + NW * BUF;  // the float32 path's A operands, a buffer a warp
static_assert(O_END <= SMEM, "states: shared memory past the launch's");
static_assert(BV % 16 == 0 && DV % BV == 0, "16 value rows a warp");
extern __shared__ __align__(16) unsigned char smem[];

const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int NP = N * CH, VB = DV / BV;
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int bh = blockIdx.x / VB, b = bh / HV, hv = bh % HV, hk = hv / (HV / HK);
const int v0 = (blockIdx.x % VB) * BV + 16 * warp;  // this warp's first value row
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

auto stage = [&](int c, int s) {  // chunk c's K, w, u (this block's rows), cum
  const int t0 = c * CH;
  const size_t rows = size_t(bh) * NP + t0;
  load_tile<T, CH, DK, PK, THREADS>(sK(s), k + ((size_t(b) * L + t0) * HK + hk) * DK,
                                    size_t(HK) * DK, min(CH, L - t0), tid);
  load_tile<float, CH, DK, PW, THREADS>(sW(s), w + rows * DK, DK, CH, tid);
  load_tile<float, CH, BV, PU, THREADS>(sU(s), u + rows * DV + v0 - 16 * warp, DV, CH, tid);
  load_vec<CH, THREADS>(sG(s), cum + rows, 1, CH, tid);
};

float st[1][DK / 8][4];  // S, rows v0.. (16 x DK)
load_frag(st, state + (size_t(bh) * DV + v0) * DK, DK, lane);
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
  store_frag(h + (((size_t(b) * N + c) * HV + hv) * DV + v0) * DK, DK, st, lane);
  __syncthreads();  // w's parts are in

  // v_new^T = u^T - S w^T, accumulated negated: -u^T + S w^T
  float vn[1][CH / 8][4];
  each(vn, lane, [&](float& x, int r, int j) { x = -sU(s)[j * PU + 16 * warp + r]; });
  mm_frag<1, CH / 8, DK / 16>(vn, st, derived<PK, false>(wop), lane, wbuf);
  const float last = sG(s)[CH - 1];
  float* vout = v_new + (size_t(bh) * NP + c * CH) * DV + v0;
  each(vn, lane, [&](float& x, int r, int j) {
    x = -x;
    vout[size_t(j) * DV + r] = x;
    x *= expd(last - sG(s)[j]);  // diag(gamma_C / gamma) v_new, transposed
  });
  const float gc = expd(last);
  each(st, lane, [&](float& x, int, int) { x *= gc; });
  // S += (decayed v_new)^T K: K as it is (B rows of K: element (k = position, n = key))
  mm_frag<1, DK / 8, CH / 16>(st, vn, exact<PK, true>(sK(s)), lane, wbuf);
}
store_frag(final_state + (size_t(bh) * DV + v0) * DK, DK, st, lane);
