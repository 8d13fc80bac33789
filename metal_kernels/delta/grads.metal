// Chunked gated delta rule, backward step 2 (parallel over chunks): per chunk and value head, with
// h the state entering the chunk, dh the adjoint of the state leaving it, dP' = (dO v_new^T) (.)
// D (D_ij = gamma_i / gamma_j, j <= i) and d_i = gamma_C / gamma_i,
//   dq += diag(gamma) dO h + dP' K,   dk += diag(d) v_new dh + dP'^T Q,   dw = -dv_new h,
//   dcum_i = q_i.dq_i - k_i.dk_i (this value head's parts), and at the chunk's last position
//   + sum_j k_j.(diag(d) v_new dh)_j + gamma_C <dh, h>   (the gates' share of the output and
//   of the state update; w's and A's come in prepare_back).
// q, k (B, L, HK, DK) and d_out (B, L, HV, DV) in T; cum (B, HV, NP), h and dh (B, N, HV, DV,
// DK), v_new and dv_new (B, HV, NP, DV) float32. dq, dk (B, L, HK, DK): summed over the key
// head's value heads; dw (B, HV, NP, DK); dcum (B, HV, DK / KB, NP): one partial per key block.
// A threadgroup owns KB key columns of one chunk of one (b, key head) and walks its value heads;
// simdgroup s owns the chunk's row tile s. Per value head, one walk over DV, SV columns at a
// time, with v_new's SV columns and h's and dh's SV rows (KB columns) staged: dP (row tile s,
// tiles j <= s) and the state terms, each dO tile read once by the lanes that own it and used
// for both (dv_new read the same way; v_new's own rows come from the staged columns). dP' is
// then gathered in threadgroup memory for dP'^T, and the dP' terms walk KB with Q and K staged
// SK columns at a time. Registers a lane: dq, dk, dw 6 KB / 8 floats, dP 16. Every fragment
// loop unrolls in full, the staged loop over KB included (DELTA_UNROLL, tiles.metal), so the
// accumulators' tiles are picked by constants and stay in registers.
constexpr int SG = 8, THREADS = 32 * SG, KBT = KB / 8, NKB = DK / KB;
constexpr int LDQ = SK + 16 / sizeof(T), LDH = KB + 4, LDV = SV + 4;
threadgroup T tq[CHUNK * LDQ];       // SK columns of Q
threadgroup T tk[CHUNK * LDQ];       // SK columns of K
threadgroup float th[SV * LDH];      // SV rows of h (KB columns)
threadgroup float tdh[SV * LDH];     // SV rows of dh
threadgroup float tv[CHUNK * LDV];   // SV columns of v_new
threadgroup float tdp[TRI_TILES * 64];  // dP', packed lower tiles
threadgroup float tcum[CHUNK];
threadgroup float tdc[CHUNK];        // this value head's dcum
threadgroup float tred[SG];          // the last position's terms, a partial per simdgroup
const int L = params[1], HK = params[2], HV = params[3], N = params[4];
const int R = HV / HK, NP = N * CHUNK;
const uint tid = thread_index_in_threadgroup;
const ushort lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
const ushort fr = frag_row(lane), fc = frag_col(lane);
const int kb = threadgroup_position_in_grid.x % NKB, k0 = kb * KB;
const int c = (threadgroup_position_in_grid.x / NKB) % N;
const int bk = threadgroup_position_in_grid.x / NKB / N;  // b * HK + key head
const int b = bk / HK, hk = bk % HK;
const int t0 = c * CHUNK, valid = metal::min(CHUNK, L - t0);
const int i = 8 * sg + fr;  // this lane's row of the chunk
const bool real = i < valid;
const size_t qk = (size_t(b) * L + t0) * HK * DK + size_t(hk) * DK;  // row r: + r HK DK
const size_t mine = qk + size_t(i) * HK * DK + k0 + fc;  // this lane's dq, dk

for (int g = 0; g < R; ++g) {
  const int hv = hk * R + g, bh = b * HV + hv;
  const size_t rows = size_t(bh) * NP + t0;
  const size_t hc = ((size_t(b) * N + c) * HV + hv) * DV * DK + k0;  // h_c's, dh_c's columns
  const size_t dorow = ((size_t(b) * L + t0 + i) * HV + hv) * DV + fc;  // this lane's dO row
  // One walk over DV: dP = dO v_new^T (row tile sg), and the state terms dq = dO h,
  // dk = v_new dh, dw = dv_new h.
  simdgroup_float8x8 dp[8], aq[KBT], ak[KBT], aw[KBT];
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    dp[j] = zero_tile();
  }
  DELTA_UNROLL
  for (int kt = 0; kt < KBT; ++kt) {
    aq[kt] = zero_tile();
    ak[kt] = zero_tile();
    aw[kt] = zero_tile();
  }
  for (int e = tid; e < CHUNK; e += THREADS) {
    tcum[e] = cum[rows + e];
  }
  float fro = 0.0f;  // this thread's part of <dh, h> over the block's columns
  for (int v0 = 0; v0 < DV; v0 += SV) {
    stage(tv, LDV, v_new + rows * DV + v0, DV, CHUNK, CHUNK, SV, tid, THREADS);
    stage(th, LDH, h + hc + size_t(v0) * DK, DK, SV, SV, KB, tid, THREADS);
    stage(tdh, LDH, dh + hc + size_t(v0) * DK, DK, SV, SV, KB, tid, THREADS);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = tid; e < SV * KB; e += THREADS) {
      const int at = (e / KB) * LDH + e % KB;
      fro += th[at] * tdh[at];
    }
    DELTA_UNROLL
    for (int vt = 0; vt < SV / 8; ++vt) {
      const int col = v0 + 8 * vt;
      const size_t at = (rows + i) * DV + col + fc;
      simdgroup_float8x8 ao, an, ad;
      ao.thread_elements() = real ? float2(float(d_out[dorow + col]), float(d_out[dorow + col + 1]))
                                  : float2(0.0f);
      load_tile(an, tv, LDV, 8 * sg, 8 * vt, fr, fc);  // v_new(sg, vt)
      ad.thread_elements() = float2(dv_new[at], dv_new[at + 1]);
      DELTA_UNROLL
      for (int j = 0; j < 8; ++j) {
        if (j <= sg) {
          simdgroup_float8x8 vb;
          load_tile_t(vb, tv, LDV, 8 * vt, 8 * j, fr, fc);  // v_new^T(vt, j)
          simdgroup_multiply_accumulate(dp[j], ao, vb, dp[j]);
        }
      }
      DELTA_UNROLL
      for (int kt = 0; kt < KBT; ++kt) {
        simdgroup_float8x8 hb, db;
        load_tile(hb, th, LDH, 8 * vt, 8 * kt, fr, fc);
        load_tile(db, tdh, LDH, 8 * vt, 8 * kt, fr, fc);
        simdgroup_multiply_accumulate(aq[kt], ao, hb, aq[kt]);
        simdgroup_multiply_accumulate(ak[kt], an, db, ak[kt]);
        simdgroup_multiply_accumulate(aw[kt], ad, hb, aw[kt]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float ci = tcum[i], last = tcum[CHUNK - 1];
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {  // dP' = dP (.) D, gathered for dP'^T
    if (j <= sg) {
      thread float2& e = dp[j].thread_elements();
      DELTA_UNROLL
      for (int x = 0; x < 2; ++x) {
        const int col = 8 * j + fc + x;
        e[x] = col <= i ? e[x] * metal::exp(ci - tcum[col]) : 0.0f;
      }
      store_packed(dp[j], tdp, sg, j, fr, fc);
    }
  }
  const float gi = metal::exp(ci), di = metal::exp(last - ci);
  DELTA_UNROLL
  for (int kt = 0; kt < KBT; ++kt) {
    scale_tile(aq[kt], gi);
    scale_tile(ak[kt], di);
    const float2 e = aw[kt].thread_elements();
    const size_t at = (rows + i) * DK + k0 + 8 * kt + fc;
    dw[at] = -e[0];
    dw[at + 1] = -e[1];
  }

  // The dP' terms: dq += dP' K, dk += dP'^T Q, SK columns at a time; then the row dots.
  float lastk = 0.0f, rowd = 0.0f;
  DELTA_UNROLL
  for (int s0 = 0; s0 < KB; s0 += SK) {  // unrolled: the accumulators' tiles by constants
    stage(tq, LDQ, q + qk + k0 + s0, size_t(HK) * DK, CHUNK, valid, SK, tid, THREADS);
    stage(tk, LDQ, k + qk + k0 + s0, size_t(HK) * DK, CHUNK, valid, SK, tid, THREADS);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    DELTA_UNROLL
    for (int t = 0; t < SK / 8; ++t) {
      const int kt = s0 / 8 + t;
      simdgroup_float8x8 qo, ko;
      load_tile(qo, tq, LDQ, 8 * sg, 8 * t, fr, fc);
      load_tile(ko, tk, LDQ, 8 * sg, 8 * t, fr, fc);
      lastk += lane_dot(ko, ak[kt]);  // k.(the state update's part of dk)
      DELTA_UNROLL
      for (int j = 0; j < 8; ++j) {
        if (j <= sg) {
          simdgroup_float8x8 kb2;
          load_tile(kb2, tk, LDQ, 8 * j, 8 * t, fr, fc);
          simdgroup_multiply_accumulate(aq[kt], dp[j], kb2, aq[kt]);
        }
      }
      DELTA_UNROLL
      for (int r = 0; r < 8; ++r) {
        if (r >= sg) {
          simdgroup_float8x8 pt, qb;
          load_packed_t(pt, tdp, r, sg, fr, fc);  // dP'^T(sg, r)
          load_tile(qb, tq, LDQ, 8 * r, 8 * t, fr, fc);
          simdgroup_multiply_accumulate(ak[kt], pt, qb, ak[kt]);
        }
      }
      rowd += lane_dot(qo, aq[kt]) - lane_dot(ko, ak[kt]);
      if (real) {  // summed over the value heads in place: each element by its own lane
        const float2 x = aq[kt].thread_elements(), y = ak[kt].thread_elements();
        const size_t at = mine + 8 * kt;
        dq[at] = g == 0 ? x[0] : dq[at] + x[0];
        dq[at + 1] = g == 0 ? x[1] : dq[at + 1] + x[1];
        dk[at] = g == 0 ? y[0] : dk[at] + y[0];
        dk[at + 1] = g == 0 ? y[1] : dk[at + 1] + y[1];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  rowd = row_sum(rowd);
  if ((lane & 9) == 0) {  // the lane holding the row's first column
    tdc[i] = rowd;
  }
  const float part = simd_sum(lastk) + metal::exp(last) * simd_sum(fro);
  if (lane == 0) {
    tred[sg] = part;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float s = 0.0f;
    DELTA_UNROLL
    for (int n = 0; n < SG; ++n) {
      s += tred[n];
    }
    tdc[CHUNK - 1] += s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = tid; e < CHUNK; e += THREADS) {
    dcum[(size_t(bh) * NKB + kb) * NP + t0 + e] = tdc[e];
  }
}
