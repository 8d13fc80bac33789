// Chunked gated delta rule, backward step 1 (the reverse scan). For each chunk c from the last,
// with dS the adjoint of the state leaving it (the final state's cotangent to start with), h_c
// the state entering it, P = Q K^T (.) D (D_ij = gamma_i / gamma_j, j <= i) and
// d_i = gamma_C / gamma_i:
//   dh_c = dS,   dv_new = P^T dO + diag(d) K dS^T,
//   dS <- gamma_C dS + dO^T diag(gamma) Q - dv_new^T w,
// and after chunk 0 the initial state's gradient dS.
// q, k (B, L, HK, DK) and d_out (B, L, HV, DV) in T; w (B, HV, NP, DK), cum (B, HV, NP) float32
// from prepare; d_final (B, HV, DV, DK). dh (B, N, HV, DV, DK): dS leaving each chunk; dv_new
// (B, HV, NP, DV); d_state (B, HV, DV, DK).
// states's ownership: a threadgroup owns BV value columns of one (b, value head), a simdgroup 8
// of them with its columns of dS^T (DK / 8 tiles) and of dO and dv_new (8 tiles each) in
// registers. Per chunk, Q and K are staged SL columns at a time (as float32) for P, K dS^T and
// the dO^T diag(gamma) Q term, P's 36 tiles spread over the simdgroups and gathered in
// threadgroup memory; then w, staged the same way, for the dv_new^T w term. Registers a lane:
// dS^T DK / 4 floats, dO and dv_new 16 each, P's share 2 PT. The staged loops over DK unroll in
// full with the fragment loops (DELTA_UNROLL, tiles.metal): the step's tiles of dS^T are picked
// by constants and stay in registers.
constexpr int SG = BV / 8, THREADS = 32 * SG, KT = DK / 8, LD = SL + 4;
constexpr int PT = (TRI_TILES + SG - 1) / SG;  // P's tiles a simdgroup
threadgroup float tq[CHUNK * LD];  // SL columns of Q, then of w
threadgroup float tk[CHUNK * LD];  // SL columns of K
threadgroup float tp[TRI_TILES * 64];  // P, packed lower tiles
threadgroup float tcum[CHUNK];
const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int NP = N * CHUNK, VB = DV / BV;
const uint tid = thread_index_in_threadgroup;
const ushort lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
const ushort fr = frag_row(lane), fc = frag_col(lane);
const int bh = threadgroup_position_in_grid.x / VB;  // b * HV + value head
const int b = bh / HV, hv = bh % HV, hk = hv / (HV / HK);
const int v0 = (threadgroup_position_in_grid.x % VB) * BV + 8 * sg;  // this simdgroup's columns

simdgroup_float8x8 ds[KT];  // dS^T(kt, own columns): element (r, c) is dS[v0 + c][8 kt + r]
const size_t own = (size_t(bh) * DV + v0 + fc) * DK + fr;
DELTA_UNROLL
for (int kt = 0; kt < KT; ++kt) {
  ds[kt].thread_elements() = float2(d_final[own + 8 * kt], d_final[own + DK + 8 * kt]);
}
for (int c = N - 1; c >= 0; --c) {
  const int t0 = c * CHUNK, valid = metal::min(CHUNK, L - t0);
  const size_t rows = size_t(bh) * NP + t0;
  const size_t leaving = ((size_t(b) * N + c) * HV + hv) * DV * DK + (v0 + fc) * DK + fr;
  DELTA_UNROLL
  for (int kt = 0; kt < KT; ++kt) {
    const float2 e = ds[kt].thread_elements();
    dh[leaving + 8 * kt] = e[0];
    dh[leaving + DK + 8 * kt] = e[1];
  }
  simdgroup_float8x8 dob[8], dv[8], pacc[PT];
  DELTA_UNROLL
  for (int i = 0; i < 8; ++i) {
    const int r = 8 * i + fr;
    const size_t at = ((size_t(b) * L + t0 + r) * HV + hv) * DV + v0 + fc;
    dob[i].thread_elements() =
        r < valid ? float2(float(d_out[at]), float(d_out[at + 1])) : float2(0.0f);
    dv[i] = zero_tile();
  }
  DELTA_UNROLL
  for (int n = 0; n < PT; ++n) {
    pacc[n] = zero_tile();
  }
  for (int e = tid; e < CHUNK; e += THREADS) {
    tcum[e] = cum[rows + e];
  }
  const size_t qk = (size_t(b) * L + t0) * HK * DK + size_t(hk) * DK;
  DELTA_UNROLL
  for (int k0 = 0; k0 < DK; k0 += SL) {  // unrolled: dS^T's tiles by constants
    stage(tq, LD, q + qk + k0, size_t(HK) * DK, CHUNK, valid, SL, tid, THREADS);
    stage(tk, LD, k + qk + k0, size_t(HK) * DK, CHUNK, valid, SL, tid, THREADS);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float last = tcum[CHUNK - 1], gc = metal::exp(last);
    DELTA_UNROLL
    for (int t = 0; t < SL / 8; ++t) {
      const int kt = k0 / 8 + t;
      DELTA_UNROLL
      for (int n = 0; n < PT; ++n) {  // P's tiles sg, sg + SG, ...: Q(i, kt) K^T(kt, j)
        int i, j;
        tri_tile(sg + SG * n, i, j);
        if (sg + SG * n < TRI_TILES) {
          simdgroup_float8x8 a, kb;
          load_tile(a, tq, LD, 8 * i, 8 * t, fr, fc);
          load_tile_t(kb, tk, LD, 8 * t, 8 * j, fr, fc);
          simdgroup_multiply_accumulate(pacc[n], a, kb, pacc[n]);
        }
      }
      DELTA_UNROLL
      for (int i = 0; i < 8; ++i) {  // dv += K dS^T (decayed below)
        simdgroup_float8x8 a;
        load_tile(a, tk, LD, 8 * i, 8 * t, fr, fc);
        simdgroup_multiply_accumulate(dv[i], a, ds[kt], dv[i]);
      }
      scale_tile(ds[kt], gc);  // dS <- gamma_C dS + Q^T diag(gamma) dO, these DK rows
      DELTA_UNROLL
      for (int i = 0; i < 8; ++i) {
        simdgroup_float8x8 a, gd = dob[i];
        load_tile_t(a, tq, LD, 8 * t, 8 * i, fr, fc);  // Q^T(kt, i)
        scale_tile(gd, metal::exp(tcum[8 * i + fr]));
        simdgroup_multiply_accumulate(ds[kt], a, gd, ds[kt]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // P = Q K^T (.) D into threadgroup memory; K dS^T decayed by d
  const float last = tcum[CHUNK - 1];
  DELTA_UNROLL
  for (int n = 0; n < PT; ++n) {
    int i, j;
    tri_tile(sg + SG * n, i, j);
    if (sg + SG * n < TRI_TILES) {
      thread float2& e = pacc[n].thread_elements();
      const int r = 8 * i + fr;
      DELTA_UNROLL
      for (int x = 0; x < 2; ++x) {
        const int col = 8 * j + fc + x;
        e[x] = col <= r ? e[x] * metal::exp(tcum[r] - tcum[col]) : 0.0f;
      }
      store_packed(pacc[n], tp, i, j, fr, fc);
    }
  }
  DELTA_UNROLL
  for (int i = 0; i < 8; ++i) {
    scale_tile(dv[i], metal::exp(last - tcum[8 * i + fr]));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {  // dv(j) += sum_{i >= j} P(i, j)^T dO(i)
    DELTA_UNROLL
    for (int i = 0; i < 8; ++i) {
      if (i >= j) {
        simdgroup_float8x8 pt;
        load_packed_t(pt, tp, i, j, fr, fc);
        simdgroup_multiply_accumulate(dv[j], pt, dob[i], dv[j]);
      }
    }
    const float2 e = dv[j].thread_elements();
    const size_t at = (rows + 8 * j + fr) * DV + v0 + fc;
    dv_new[at] = e[0];
    dv_new[at + 1] = e[1];
  }
  // dS -= w^T dv_new
  DELTA_UNROLL
  for (int k0 = 0; k0 < DK; k0 += SL) {
    stage(tq, LD, w + rows * DK + k0, DK, CHUNK, CHUNK, SL, tid, THREADS);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    DELTA_UNROLL
    for (int t = 0; t < SL / 8; ++t) {
      DELTA_UNROLL
      for (int i = 0; i < 8; ++i) {
        simdgroup_float8x8 a;
        load_tile_t(a, tq, LD, 8 * t, 8 * i, fr, fc);  // w^T(kt, i)
        negate_tile(a);
        simdgroup_multiply_accumulate(ds[k0 / 8 + t], a, dv[i], ds[k0 / 8 + t]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
DELTA_UNROLL
for (int kt = 0; kt < KT; ++kt) {
  const float2 e = ds[kt].thread_elements();
  d_state[own + 8 * kt] = e[0];
  d_state[own + DK + 8 * kt] = e[1];
}
