// delta/grads (CUDA; the twin of grads.metal): in parallel over chunks, per value head, with h
// the state entering the chunk, dh the adjoint of the state leaving it, dP' = (dO v_new^T) (.) D
// (D_ij = gamma_i / gamma_j, j <= i) and d_j = gamma_C / gamma_j:
//   dq += diag(gamma) dO h + dP' K,   dk += diag(d) v_new dh + dP'^T Q,   dw = -dv_new h,
//   dcum_i = q_i.dq_i - k_i.dk_i (this value head's parts), and at the chunk's last position
//   + sum_j k_j.(diag(d) v_new dh)_j + gamma_C <dh, h>.
// Shared with grads.metal: the contract (chunked.py's buffers: dq, dk summed over the key head's
// value heads, dw, dcum one partial per key block, float32, the same layouts), the math above and
// the decomposition: a block per (b, key head, chunk, KB = 64 key columns) walking the key
// head's value heads, summing dq and dk in place; no Q K^T (the gates' share from q.dq - k.dk).
// Not shared: 4 warps (128 threads, 16 of the chunk's rows each; grads.metal: 8 simdgroups, 256
// threads, an 8-row tile each); Q, K, dO (cp.async), v_new, h and dh staged whole in
// 63.5-167.5 KiB of shared memory (grads.metal: SK / SV columns a step, 26.8 KiB); dP' kept in
// registers as an A operand and dP'^T recomputed as v_new dO^T (grads.metal: dP' gathered in
// threadgroup memory as packed tiles); mma.sync m16n8k16 (float16/bfloat16;
// v_new, h, dh as hi + lo halves, tiles.cuh) or float32 FMA in fragment layout, vs 8x8
// simdgroup_float8x8 in float. Rounding differs; a timing on an NVIDIA GPU says nothing about
// grads.metal's speed.
// Template: T, DK, DV, KB, SMEM.
using namespace mlxwalk_dt;
constexpr int THREADS = 128, PARTS = Prec<T>::parts, PAD = Prec<T>::pad;
constexpr int PQ = KB + PAD, PV = DV + PAD, NKB = DK / KB;
constexpr int O_Q = 0, O_K = O_Q + region<T>(CH * PQ), O_O = O_K + region<T>(CH * PQ);
constexpr int O_N = O_O + region<T>(CH * PV), O_S = O_N + PARTS * region<T>(CH * PV);
constexpr int O_G = O_S + PARTS * region<T>(DV * PQ), O_DC = O_G + region<float>(CH);
constexpr int O_RED = O_DC + region<float>(CH);
constexpr int BUF = Prec<T>::half ? 0 : region<float>(16 * ((DV > CH ? DV : CH) + 4));
constexpr int O_BUF = O_RED + region<float>(8), O_END = O_BUF + 4 * BUF;
static_assert(O_END <= SMEM, "grads: shared memory past the launch's");
static_assert(KB % 16 == 0 && DK % KB == 0, "key columns in 16s");
extern __shared__ __align__(16) unsigned char smem[];
T* sQ = reinterpret_cast<T*>(smem + O_Q);
T* sK = reinterpret_cast<T*>(smem + O_K);
T* sO = reinterpret_cast<T*>(smem + O_O);
T* sN[PARTS];
T* sS[PARTS];
for (int i = 0; i < PARTS; ++i) {
  sN[i] = reinterpret_cast<T*>(smem + O_N + i * region<T>(CH * PV));
  sS[i] = reinterpret_cast<T*>(smem + O_S + i * region<T>(DV * PQ));
}
float* sG = reinterpret_cast<float*>(smem + O_G);
float* sDc = reinterpret_cast<float*>(smem + O_DC);
float* sRed = reinterpret_cast<float*>(smem + O_RED);

const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int R = HV / HK, NP = N * CH;
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int kb = blockIdx.x % NKB, k0 = kb * KB, c = (blockIdx.x / NKB) % N;
const int bk = blockIdx.x / (NKB * N), b = bk / HK, hk = bk % HK;
const int t0 = c * CH, valid = min(CH, L - t0), i0 = 16 * warp;
const int g4 = lane >> 2, t4 = lane & 3;
float* wbuf = reinterpret_cast<float*>(smem + O_BUF + warp * BUF);
const size_t qk = ((size_t(b) * L + t0) * HK + hk) * DK + k0;  // row r: + r HK DK

load_tile<T, CH, KB, PQ, THREADS>(sQ, q + qk, size_t(HK) * DK, valid, tid);
load_tile<T, CH, KB, PQ, THREADS>(sK, k + qk, size_t(HK) * DK, valid, tid);
cp_commit();

// Sum over value heads in place: dq or dk (B, L, HK, DK), the warp's rows.
auto add_rows = [&](float* dst, const float (&a)[1][KB / 8][4], bool first) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = i0 + g4 + 8 * hh;
    if (i < valid) {
      float* row = dst + qk + size_t(i) * HK * DK;
#pragma unroll
      for (int n = 0; n < KB / 8; ++n) {
        float2* at = reinterpret_cast<float2*>(row + n * 8 + 2 * t4);
        const float2 x = make_float2(a[0][n][2 * hh], a[0][n][2 * hh + 1]);
        *at = first ? x : make_float2(at->x + x.x, at->y + x.y);
      }
    }
  }
};

for (int gi = 0; gi < R; ++gi) {
  const int hv = hk * R + gi, bh = b * HV + hv;
  const size_t rows = size_t(bh) * NP + t0;
  const size_t hc = ((size_t(b) * N + c) * HV + hv) * DV * DK + k0;  // h_c's, dh_c's columns
  __syncthreads();  // the previous value head's reads are done
  load_tile<T, CH, DV, PV, THREADS>(sO, d_out + ((size_t(b) * L + t0) * HV + hv) * DV,
                                    size_t(HV) * DV, valid, tid);
  load_vec<CH, THREADS>(sG, cum + rows, 1, CH, tid);
  cp_commit();
  load_split<T, CH, DV, PV, THREADS>(sN, v_new + rows * DV, DV, CH, tid);
  load_split<T, DV, KB, PQ, THREADS>(sS, h + hc, DK, DV, tid);
  cp_commit();
  cp_wait<0>();
  __syncthreads();
  const float last = sG[CH - 1];

  float dqk[2], ddot[2];  // this lane's rows: q.dq, then k.dk
  {  // dq = diag(gamma) dO h + dP' K
    float aq[1][KB / 8][4];
    zero(aq);
    mm<1, KB / 8, DV / 16>(aq, exact<PV, false>(sO).at(i0, 0), derived<PQ, true>(sS), lane);
    each(aq, lane, [&](float& x, int r, int) { x *= expd(sG[i0 + r]); });
    float dp[1][CH / 8][4];
    zero(dp);
    mm<1, CH / 8, DV / 16>(dp, exact<PV, false>(sO).at(i0, 0), derived<PV, false>(sN), lane);
    each(dp, lane, [&](float& x, int r, int j) {
      const int i = i0 + r;
      x = j <= i ? x * expd(sG[i] - sG[j]) : 0.0f;
    });
    mm_frag<1, KB / 8, CH / 16>(aq, dp, exact<PQ, true>(sK), lane, wbuf, 0, warp + 1);
    add_rows(dq, aq, gi == 0);
    row_dot(dqk, aq, sQ + i0 * PQ, PQ, lane);
  }
  {  // dw = -dv_new h: dv_new's rows as the A operand, straight from global memory
    float dvf[1][DV / 8][4];
    load_frag(dvf, dv_new + (rows + i0) * DV, DV, lane);
    float aw[1][KB / 8][4];
    zero(aw);
    mm_frag<1, KB / 8, DV / 16>(aw, dvf, derived<PQ, true>(sS), lane, wbuf);
    each(aw, lane, [&](float& x, int, int) { x = -x; });
    store_frag(dw + (rows + i0) * DK + k0, DK, aw, lane);
  }
  float ak[1][KB / 8][4];  // dk: dP'^T Q, then + diag(d) v_new dh
  zero(ak);
  {
    float dpt[1][CH / 8][4];  // dP^T for the warp's rows j: v_new dO^T
    zero(dpt);
    mm<1, CH / 8, DV / 16>(dpt, derived<PV, false>(sN).at(i0, 0), exact<PV, false>(sO), lane);
    each(dpt, lane, [&](float& x, int r, int i) {
      const int j = i0 + r;
      x = i >= j ? x * expd(sG[i] - sG[j]) : 0.0f;
    });
    mm_frag<1, KB / 8, CH / 16>(ak, dpt, exact<PQ, true>(sQ), lane, wbuf, warp, CH / 16);
  }
  __syncthreads();  // every warp is done with h's parts
  // dh's columns where h's were, this thread's part of <dh, h> taken on the way (h as its parts:
  // within 2^-16 of it on the half path)
  const float fro = swap_split<T, DV, KB, PQ, THREADS>(sS, dh + hc, DK, tid);
  __syncthreads();
  float lastk;  // this lane's part of sum_j k_j.(diag(d) v_new dh)_j
  {
    float av[1][KB / 8][4];
    zero(av);
    mm<1, KB / 8, DV / 16>(av, derived<PV, false>(sN).at(i0, 0), derived<PQ, true>(sS), lane);
    each(av, lane, [&](float& x, int r, int) { x *= expd(last - sG[i0 + r]); });
    float kd[2];
    row_dot(kd, av, sK + i0 * PQ, PQ, lane);
    lastk = (t4 == 0) ? kd[0] + kd[1] : 0.0f;
#pragma unroll
    for (int n = 0; n < KB / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ak[0][n][e] += av[0][n][e];
      }
    }
  }
  add_rows(dk, ak, gi == 0);
  row_dot(ddot, ak, sK + i0 * PQ, PQ, lane);
  if (t4 == 0) {
    sDc[i0 + g4] = dqk[0] - ddot[0];
    sDc[i0 + g4 + 8] = dqk[1] - ddot[1];
  }
  float part = lastk + expd(last) * fro;  // the block's sum, through the warps
#pragma unroll
  for (int m = 1; m < 32; m *= 2) {
    part += __shfl_xor_sync(0xffffffffu, part, m);
  }
  if (lane == 0) {
    sRed[warp] = part;
  }
  __syncthreads();
  if (tid < CH) {
    float x = sDc[tid];
    if (tid == CH - 1) {
      x += sRed[0] + sRed[1] + sRed[2] + sRed[3];
    }
    dcum[(size_t(bh) * NKB + kb) * NP + t0 + tid] = x;
  }
}
