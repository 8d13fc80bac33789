// Chunked gated delta rule, step 3 (parallel over chunks): the output
//   O = diag(gamma) Q h_c^T + (Q K^T (.) D) v_new,   D_ij = gamma_i / gamma_j for j <= i, else 0.
// q, k (B, L, HK, DK) in T; cum (B, HV, NP), h (B, N, HV, DV, DK), v_new (B, HV, NP, DV) float32
// from prepare and states. y (B, L, HV, DV) float32.
// A threadgroup owns one chunk of one (b, key head) and walks its value heads; simdgroup s owns
// the chunk's row tile s. Q's rows are read once into registers (DK / 8 tiles a simdgroup); the
// scores S = Q K^T (row tile s: tiles j <= s) are computed once for all value heads, K staged KS
// columns at a time. Per value head, the output goes out SV columns at a time: the state's SV
// rows (SV x DK) and v_new's SV columns staged, each read from device memory once. Registers a
// lane: Q DK / 4 floats, S and P 16 each. The staged loop over K unrolls in full with the
// fragment loops (DELTA_UNROLL, tiles.metal), so Q's tile of each step is picked by a constant.
constexpr int SG = 8, THREADS = 32 * SG, KT = DK / 8, LDK = KS + 16 / sizeof(T);
constexpr int LDH = DK + 4, LDV = SV + 4;
threadgroup T tk[CHUNK * LDK];    // KS columns of K
threadgroup float th[SV * LDH];   // SV rows of the state h_c
threadgroup float tv[CHUNK * LDV];  // SV columns of v_new
threadgroup float tcum[CHUNK];
const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int R = HV / HK, NP = N * CHUNK;
const uint tid = thread_index_in_threadgroup;
const ushort lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
const ushort fr = frag_row(lane), fc = frag_col(lane);
const int c = threadgroup_position_in_grid.x % N;
const int bk = threadgroup_position_in_grid.x / N;  // b * HK + key head
const int b = bk / HK, hk = bk % HK;
const int t0 = c * CHUNK, valid = metal::min(CHUNK, L - t0);
const int i = 8 * sg + fr;  // this lane's row of the chunk
const bool real = i < valid;

simdgroup_float8x8 qa[KT];  // Q(sg, kt)
const size_t qrow = ((size_t(b) * L + t0 + i) * HK + hk) * DK + fc;
DELTA_UNROLL
for (int kt = 0; kt < KT; ++kt) {
  qa[kt].thread_elements() =
      real ? float2(float(q[qrow + 8 * kt]), float(q[qrow + 8 * kt + 1])) : float2(0.0f);
}
simdgroup_float8x8 s[8];  // S(sg, j), j <= sg
DELTA_UNROLL
for (int j = 0; j < 8; ++j) {
  s[j] = zero_tile();
}
const device T* kc = k + (size_t(b) * L + t0) * HK * DK + size_t(hk) * DK;
DELTA_UNROLL
for (int k0 = 0; k0 < DK; k0 += KS) {  // unrolled: Q's tiles by constants
  stage(tk, LDK, kc + k0, size_t(HK) * DK, CHUNK, valid, KS, tid, THREADS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  DELTA_UNROLL
  for (int t = 0; t < KS / 8; ++t) {
    DELTA_UNROLL
    for (int j = 0; j < 8; ++j) {
      if (j <= sg) {
        simdgroup_float8x8 kt;
        load_tile_t(kt, tk, LDK, 8 * t, 8 * j, fr, fc);
        simdgroup_multiply_accumulate(s[j], qa[k0 / 8 + t], kt, s[j]);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int g = 0; g < R; ++g) {
  const int hv = hk * R + g, bh = b * HV + hv;
  const size_t rows = size_t(bh) * NP + t0;
  const device float* hc = h + ((size_t(b) * N + c) * HV + hv) * DV * DK;
  for (int e = tid; e < CHUNK; e += THREADS) {
    tcum[e] = cum[rows + e];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float ci = tcum[i], gi = metal::exp(ci);
  simdgroup_float8x8 p[8];  // P(sg, j) = S (.) D
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    if (j <= sg) {
      p[j] = s[j];
      thread float2& e = p[j].thread_elements();
      DELTA_UNROLL
      for (int x = 0; x < 2; ++x) {
        const int col = 8 * j + fc + x;
        e[x] = col <= i ? e[x] * metal::exp(ci - tcum[col]) : 0.0f;
      }
    }
  }
  for (int v0 = 0; v0 < DV; v0 += SV) {
    stage(th, LDH, hc + size_t(v0) * DK, DK, SV, SV, DK, tid, THREADS);
    stage(tv, LDV, v_new + rows * DV + v0, DV, CHUNK, CHUNK, SV, tid, THREADS);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    DELTA_UNROLL
    for (int vt = 0; vt < SV / 8; ++vt) {
      simdgroup_float8x8 acc = zero_tile();
      DELTA_UNROLL
      for (int kt = 0; kt < KT; ++kt) {  // Q h^T: h^T(kt, vt) is the transpose of h's tile
        simdgroup_float8x8 ht;
        load_tile_t(ht, th, LDH, 8 * kt, 8 * vt, fr, fc);
        simdgroup_multiply_accumulate(acc, qa[kt], ht, acc);
      }
      scale_tile(acc, gi);
      DELTA_UNROLL
      for (int j = 0; j < 8; ++j) {
        if (j <= sg) {
          simdgroup_float8x8 vb;
          load_tile(vb, tv, LDV, 8 * j, 8 * vt, fr, fc);
          simdgroup_multiply_accumulate(acc, p[j], vb, acc);
        }
      }
      if (real) {
        const float2 e = acc.thread_elements();
        const size_t at = ((size_t(b) * L + t0 + i) * HV + hv) * DV + v0 + 8 * vt + fc;
        y[at] = e[0];
        y[at + 1] = e[1];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
