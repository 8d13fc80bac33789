// Chunked gated delta rule, step 2 (the sequential part): the state carried through the chunks.
// For each chunk c in order, with S (DV x DK) the state entering it:
//   h_c = S,   v_new = u - w S^T,   S <- gamma_C S + v_new^T diag(gamma_C / gamma) K,
// gamma_C the chunk's whole decay exp(cum_{CHUNK-1}).
// k (B, L, HK, DK) in T; w (B, HV, NP, DK), u (B, HV, NP, DV), cum (B, HV, NP) float32 from
// prepare (NP = N * CHUNK); state (B, HV, DV, DK) float32. h (B, N, HV, DV, DK): the state
// entering each chunk; v_new (B, HV, NP, DV); final_state (B, HV, DV, DK).
// A threadgroup owns BV value columns of one (b, value head); each simdgroup owns 8 of them and
// holds its columns of S^T (DK x 8) in registers as DK / 8 tiles, v_new's as 8 (DK / 4 + 16
// floats a lane). Columns never meet: w and K are staged SL columns at a time (once per
// threadgroup) and every simdgroup reads them from there. The staged loops over DK unroll in
// full with the fragment loops inside them (DELTA_UNROLL, tiles.metal), so the step's tiles of
// S^T are picked by constants and stay in registers.
constexpr int SG = BV / 8, THREADS = 32 * SG, KT = DK / 8, LDW = SL + 4;
constexpr int LDK = SL + 16 / sizeof(T);
threadgroup float tw[CHUNK * LDW];  // SL columns of w
threadgroup T tk[CHUNK * LDK];      // SL columns of K
threadgroup float tcum[CHUNK];
const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int NP = N * CHUNK, VB = DV / BV;
const uint tid = thread_index_in_threadgroup;
const ushort lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
const ushort fr = frag_row(lane), fc = frag_col(lane);
const int bh = threadgroup_position_in_grid.x / VB;  // b * HV + value head
const int b = bh / HV, hv = bh % HV, hk = hv / (HV / HK);
const int v0 = (threadgroup_position_in_grid.x % VB) * BV + 8 * sg;  // this simdgroup's columns

// S^T(kt, own columns): element (r, c) is S[v0 + c][8 kt + r].
simdgroup_float8x8 st[KT];
const size_t own = (size_t(bh) * DV + v0 + fc) * DK + fr;  // + 8 kt, and + DK for c + 1
DELTA_UNROLL
for (int kt = 0; kt < KT; ++kt) {
  st[kt].thread_elements() = float2(state[own + 8 * kt], state[own + DK + 8 * kt]);
}
for (int c = 0; c < N; ++c) {
  const int t0 = c * CHUNK, valid = metal::min(CHUNK, L - t0);
  const size_t entering = ((size_t(b) * N + c) * HV + hv) * DV * DK + (v0 + fc) * DK + fr;
  DELTA_UNROLL
  for (int kt = 0; kt < KT; ++kt) {
    const float2 e = st[kt].thread_elements();
    h[entering + 8 * kt] = e[0];
    h[entering + DK + 8 * kt] = e[1];
  }
  // v_new = u - w S^T: u read in place (each element by one lane), w staged
  simdgroup_float8x8 vn[8];
  const size_t rows = size_t(bh) * NP + t0;
  DELTA_UNROLL
  for (int i = 0; i < 8; ++i) {
    const size_t at = (rows + 8 * i + fr) * DV + v0 + fc;
    vn[i].thread_elements() = float2(u[at], u[at + 1]);
  }
  for (int i = tid; i < CHUNK; i += THREADS) {
    tcum[i] = cum[rows + i];
  }
  DELTA_UNROLL
  for (int k0 = 0; k0 < DK; k0 += SL) {  // unrolled: st's tiles by constants
    stage(tw, LDW, w + rows * DK + k0, DK, CHUNK, CHUNK, SL, tid, THREADS);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    DELTA_UNROLL
    for (int t = 0; t < SL / 8; ++t) {
      DELTA_UNROLL
      for (int i = 0; i < 8; ++i) {
        simdgroup_float8x8 a;
        load_tile(a, tw, LDW, 8 * i, 8 * t, fr, fc);
        negate_tile(a);
        simdgroup_multiply_accumulate(vn[i], a, st[k0 / 8 + t], vn[i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float last = tcum[CHUNK - 1];
  DELTA_UNROLL
  for (int i = 0; i < 8; ++i) {
    const float2 e = vn[i].thread_elements();
    const size_t at = (rows + 8 * i + fr) * DV + v0 + fc;
    v_new[at] = e[0];
    v_new[at + 1] = e[1];
    scale_tile(vn[i], metal::exp(last - tcum[8 * i + fr]));  // diag(gamma_C / gamma) v_new
  }
  // S^T <- gamma_C S^T + K^T diag(gamma_C / gamma) v_new, K staged
  const float gc = metal::exp(last);
  DELTA_UNROLL
  for (int kt = 0; kt < KT; ++kt) {
    scale_tile(st[kt], gc);
  }
  const device T* kc = k + (size_t(b) * L + t0) * HK * DK + size_t(hk) * DK;
  DELTA_UNROLL
  for (int k0 = 0; k0 < DK; k0 += SL) {
    stage(tk, LDK, kc + k0, size_t(HK) * DK, CHUNK, valid, SL, tid, THREADS);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    DELTA_UNROLL
    for (int t = 0; t < SL / 8; ++t) {
      DELTA_UNROLL
      for (int i = 0; i < 8; ++i) {
        simdgroup_float8x8 a;
        load_tile_t(a, tk, LDK, 8 * t, 8 * i, fr, fc);  // K^T(kt, i)
        simdgroup_multiply_accumulate(st[k0 / 8 + t], a, vn[i], st[k0 / 8 + t]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
DELTA_UNROLL
for (int kt = 0; kt < KT; ++kt) {
  const float2 e = st[kt].thread_elements();
  final_state[own + 8 * kt] = e[0];
  final_state[own + DK + 8 * kt] = e[1];
}
