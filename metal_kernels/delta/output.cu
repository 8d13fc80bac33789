// delta/output (CUDA; the twin of output.metal): in parallel over chunks,
//   O = diag(gamma) Q h_c^T + (Q K^T (.) D) v_new,   D_ij = gamma_i / gamma_j for j <= i, else 0.
// Shared with output.metal: the contract (chunked.py's q, k, cum, h, v_new; y float32, the same
// layouts) and the math above, in float32.
// Not shared: the decomposition. A block of 4 warps (128 threads, 16 of the chunk's rows each)
// owns BV = 64 value columns of one chunk of one (b, value head), so the scores Q K^T are
// recomputed per value head and value block (output.metal: 8 simdgroups, 256 threads, per
// (b, key head, chunk), the scores once for all its value heads, SV columns a step). Q, K
// (cp.async), h_c's BV rows and v_new's BV columns staged once, whole, in 54.3-133.3 KiB of
// shared memory (output.metal: 26.5-30.5 KiB); mma.sync m16n8k16 (float16/bfloat16; h_c and
// v_new as hi + lo halves, tiles.cuh) or float32 FMA in fragment layout, vs 8x8
// simdgroup_float8x8 in float.
// Rounding differs; a timing on an NVIDIA GPU says nothing about output.metal's speed.
// Template: T, DK, DV, BV, SMEM.
using namespace mlxwalk_dt;
constexpr int THREADS = 128, PARTS = Prec<T>::parts, PAD = Prec<T>::pad;
constexpr int PK = DK + PAD, PN = BV + PAD;
constexpr int O_Q = 0, O_K = O_Q + region<T>(CH * PK), O_H = O_K + region<T>(CH * PK);
constexpr int O_N = O_H + PARTS * region<T>(BV * PK), O_G = O_N + PARTS * region<T>(CH * PN);
constexpr int BUF = Prec<T>::half ? 0 : region<float>(16 * (CH + 4));
constexpr int O_BUF = O_G + region<float>(CH), O_END = O_BUF + 4 * BUF;
static_assert(O_END <= SMEM, "output: shared memory past the launch's");
static_assert(BV % 16 == 0 && DV % BV == 0, "value columns in 16s");
extern __shared__ __align__(16) unsigned char smem[];
T* sQ = reinterpret_cast<T*>(smem + O_Q);
T* sK = reinterpret_cast<T*>(smem + O_K);
T* sH[PARTS];
T* sN[PARTS];
for (int i = 0; i < PARTS; ++i) {
  sH[i] = reinterpret_cast<T*>(smem + O_H + i * region<T>(BV * PK));
  sN[i] = reinterpret_cast<T*>(smem + O_N + i * region<T>(CH * PN));
}
float* sG = reinterpret_cast<float*>(smem + O_G);

const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int NP = N * CH, VB = DV / BV;
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int v0 = (blockIdx.x % VB) * BV, c = (blockIdx.x / VB) % N;
const int bh = blockIdx.x / (VB * N), b = bh / HV, hv = bh % HV, hk = hv / (HV / HK);
const int t0 = c * CH, valid = min(CH, L - t0);
float* wbuf = reinterpret_cast<float*>(smem + O_BUF + warp * BUF);

const size_t qk = ((size_t(b) * L + t0) * HK + hk) * DK;
load_tile<T, CH, DK, PK, THREADS>(sQ, q + qk, size_t(HK) * DK, valid, tid);
load_tile<T, CH, DK, PK, THREADS>(sK, k + qk, size_t(HK) * DK, valid, tid);
load_vec<CH, THREADS>(sG, cum + size_t(bh) * NP + t0, 1, CH, tid);
cp_commit();
load_split<T, BV, DK, PK, THREADS>(sH, h + (((size_t(b) * N + c) * HV + hv) * DV + v0) * DK, DK,
                                   BV, tid);
load_split<T, CH, BV, PN, THREADS>(sN, v_new + (size_t(bh) * NP + t0) * DV + v0, DV, CH, tid);
cp_commit();
cp_wait<0>();
__syncthreads();

const int i0 = 16 * warp;
float o[1][BV / 8][4];  // diag(gamma) Q h^T: B = h's rows (element (k = key, n = value))
zero(o);
mm<1, BV / 8, DK / 16>(o, exact<PK, false>(sQ).at(i0, 0), derived<PK, false>(sH), lane);
each(o, lane, [&](float& x, int r, int) { x *= expd(sG[i0 + r]); });
float p[1][CH / 8][4];  // Q K^T (.) D, causal
zero(p);
mm<1, CH / 8, DK / 16>(p, exact<PK, false>(sQ).at(i0, 0), exact<PK, false>(sK), lane, 0, DK / 16);
each(p, lane, [&](float& x, int r, int j) {
  const int i = i0 + r;
  x = j <= i ? x * expd(sG[i] - sG[j]) : 0.0f;
});
mm_frag<1, BV / 8, CH / 16>(o, p, derived<PN, true>(sN), lane, wbuf, 0, warp + 1);
store_frag(y + ((size_t(b) * L + t0 + i0) * HV + hv) * DV + v0, size_t(HV) * DV, o, lane,
           valid - i0);
