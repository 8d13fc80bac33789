// Chunked gated delta rule, backward step 3 (parallel over chunks): the WY backward. Per chunk and
// value head, with X = diag(beta gamma) K, Y = diag(beta) V, w = T X, u = T Y (T = (I + A)^-1,
// A_ij = beta_i E_ij k_i.k_j below the diagonal, E_ij = gamma_i / gamma_j) and the cotangents dw
// (grads) and du = dv_new (states_back):
//   dX = T^T dw, dY = T^T du, dT = dw X^T + du Y^T, dA = -T^T dT T^T (strictly lower),
//   M = dA (.) E,   dk += diag(beta gamma) dX + diag(beta) M K + M^T diag(beta) K,
//   dv = diag(beta) dY,   dbeta = gamma (.) rowdot(dX, K) + rowdot(dY, V) + rowdot(M K, K),
//   dcum = grads's + beta gamma (.) rowdot(dX, K) + beta (.) rowdot(M K, K)
//          - rowdot(M^T diag(beta) K, K),
// and dlog_g the reverse cumsum of dcum within the chunk.
// k (B, L, HK, DK), v (B, L, HV, DV) in T; beta (B, L, HV), cum (B, HV, NP), tri (B, HV, N,
// CHUNK, CHUNK), dw (B, HV, NP, DK), dv_new (B, HV, NP, DV), dk_in (B, L, HK, DK) (grads's), dcum
// (B, HV, KB, NP) (grads's partials) float32. dk (B, L, HK, DK) = dk_in + the above summed over
// the key head's value heads; dv (B, L, HV, DV); dlog_g, dbeta (B, L, HV), all float32.
// A threadgroup owns one chunk of one (b, key head) and walks its value heads, simdgroup s owning
// row tile s (its dk in registers throughout). T and then dT T^T and M sit in threadgroup memory
// as packed lower tiles; K and dw, then V and du, then K again are staged SL columns at a time
// (as float32); dT's row tile s accumulates in registers across the first two passes.
constexpr int SG = 8, THREADS = 32 * SG, KT = DK / 8, LD = SL + 4;
static_assert(DK == DV, "prepare_back walks K and V with one loop");
threadgroup float tx[CHUNK * LD];  // SL columns of K or V
threadgroup float ty[CHUNK * LD];  // SL columns of dw or du
threadgroup float tt[TRI_TILES * 64];  // T
threadgroup float tm[TRI_TILES * 64];  // dT T^T, then M
threadgroup float tcum[CHUNK];
threadgroup float tb[CHUNK];
threadgroup float tbg[CHUNK];  // beta gamma
threadgroup float tdc[CHUNK];
threadgroup float tdb[CHUNK];
const int L = params[1], HK = params[2], HV = params[3], N = params[4], NKB = params[5];
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
const size_t kc = (size_t(b) * L + t0) * HK * DK + size_t(hk) * DK;  // row r: + r HK DK

simdgroup_float8x8 gk[KT];  // dk(sg, kt), over every value head
DELTA_UNROLL
for (int kt = 0; kt < KT; ++kt) {
  gk[kt] = zero_tile();
}
for (int g = 0; g < R; ++g) {
  const int hv = hk * R + g, bh = b * HV + hv;
  const size_t rows = size_t(bh) * NP + t0;
  const device float* tc = tri + (size_t(bh) * N + c) * CHUNK * CHUNK;
  for (int e = tid; e < CHUNK; e += THREADS) {
    const size_t at = (size_t(b) * L + t0 + e) * HV + hv;
    tcum[e] = cum[rows + e];
    tb[e] = e < valid ? beta[at] : 0.0f;
    tbg[e] = tb[e] * metal::exp(tcum[e]);
    float s = 0.0f;
    for (int n = 0; n < NKB; ++n) {
      s += dcum[(size_t(bh) * NKB + n) * NP + t0 + e];
    }
    tdc[e] = s;
  }
  for (int e = tid; e < TRI_TILES * 64; e += THREADS) {
    int ti, tj;
    tri_tile(e / 64, ti, tj);
    tt[e] = tc[(8 * ti + (e % 64) / 8) * CHUNK + 8 * tj + e % 8];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float ci = tcum[i], bi = tb[i], gi = metal::exp(ci);

  // K and dw: dT += dw X^T, dX = T^T dw, dk += diag(beta gamma) dX; then V and du:
  // dT += du Y^T, dY = T^T du, dv = diag(beta) dY. The walk over the columns unrolls (dk's
  // tiles by constants); the two passes share its code.
  simdgroup_float8x8 dt[8];  // dT(sg, j), j <= sg
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    dt[j] = zero_tile();
  }
  float rdx = 0.0f, rdy = 0.0f;  // this lane's parts of rowdot(dX, K), rowdot(dY, V)
  const size_t vc = (size_t(b) * L + t0) * HV * DV + size_t(hv) * DV;
  for (int pass = 0; pass < 2; ++pass) {  // K and dw, then V and du
    const bool keys = pass == 0;
    const threadgroup float* scale = keys ? tbg : tb;  // X = diag(beta gamma) K, Y = diag(beta) V
    DELTA_UNROLL
    for (int k0 = 0; k0 < DK; k0 += SL) {  // DK == DV
      if (keys) {
        stage(tx, LD, k + kc + k0, size_t(HK) * DK, CHUNK, valid, SL, tid, THREADS);
        stage(ty, LD, dw + rows * DK + k0, DK, CHUNK, CHUNK, SL, tid, THREADS);
      } else {
        stage(tx, LD, v + vc + k0, size_t(HV) * DV, CHUNK, valid, SL, tid, THREADS);
        stage(ty, LD, dv_new + rows * DV + k0, DV, CHUNK, CHUNK, SL, tid, THREADS);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      DELTA_UNROLL
      for (int t = 0; t < SL / 8; ++t) {
        simdgroup_float8x8 a;
        load_tile(a, ty, LD, 8 * sg, 8 * t, fr, fc);  // dw(sg, t) or du(sg, t)
        DELTA_UNROLL
        for (int j = 0; j < 8; ++j) {  // dT(sg, j) += dw(sg, t) X^T(t, j), or du Y^T
          if (j <= sg) {
            simdgroup_float8x8 xt;
            load_tile_t(xt, tx, LD, 8 * t, 8 * j, fr, fc);
            thread float2& e = xt.thread_elements();
            e *= float2(scale[8 * j + fc], scale[8 * j + fc + 1]);
            simdgroup_multiply_accumulate(dt[j], a, xt, dt[j]);
          }
        }
        simdgroup_float8x8 dx = zero_tile(), own;  // dX(sg, t) = sum_{r >= sg} T(r, sg)^T dw(r, t)
        DELTA_UNROLL
        for (int r = 0; r < 8; ++r) {
          if (r >= sg) {
            simdgroup_float8x8 tr, wb;
            load_packed_t(tr, tt, r, sg, fr, fc);
            load_tile(wb, ty, LD, 8 * r, 8 * t, fr, fc);
            simdgroup_multiply_accumulate(dx, tr, wb, dx);
          }
        }
        load_tile(own, tx, LD, 8 * sg, 8 * t, fr, fc);
        if (keys) {
          rdx += lane_dot(dx, own);
          gk[k0 / 8 + t].thread_elements() += (bi * gi) * dx.thread_elements();
        } else {  // dY(sg, t): dv = diag(beta) dY
          rdy += lane_dot(dx, own);
          if (real) {
            const float2 e = dx.thread_elements();
            const size_t at = ((size_t(b) * L + t0 + i) * HV + hv) * DV + k0 + 8 * t + fc;
            dv[at] = bi * e[0];
            dv[at + 1] = bi * e[1];
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  // dT strictly lower; Y1 = dT T^T (lower tiles): Y1(sg, j) = sum_{q <= j} dT(sg, q) T(j, q)^T.
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    if (j == sg) {
      thread float2& e = dt[j].thread_elements();
      e[0] = fc < fr ? e[0] : 0.0f;
      e[1] = fc + 1 < fr ? e[1] : 0.0f;
    }
  }
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    if (j <= sg) {
      simdgroup_float8x8 y1 = zero_tile();
      DELTA_UNROLL
      for (int q = 0; q < 8; ++q) {
        if (q <= j) {
          simdgroup_float8x8 tr;
          load_packed_t(tr, tt, j, q, fr, fc);
          simdgroup_multiply_accumulate(y1, dt[q], tr, y1);
        }
      }
      store_packed(y1, tm, sg, j, fr, fc);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // dA(sg, j) = -sum_{r >= sg} T(r, sg)^T Y1(r, j); M = dA (.) E, strictly lower.
  simdgroup_float8x8 m[8];
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    if (j <= sg) {
      m[j] = zero_tile();
      DELTA_UNROLL
      for (int r = 0; r < 8; ++r) {
        if (r >= sg) {
          simdgroup_float8x8 tr, y1;
          load_packed_t(tr, tt, r, sg, fr, fc);
          load_packed(y1, tm, r, j, fr, fc);
          simdgroup_multiply_accumulate(m[j], tr, y1, m[j]);
        }
      }
      thread float2& e = m[j].thread_elements();
      DELTA_UNROLL
      for (int x = 0; x < 2; ++x) {
        const int col = 8 * j + fc + x;
        e[x] = col < i ? -e[x] * metal::exp(ci - tcum[col]) : 0.0f;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // Y1 read, then M in its place
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    if (j <= sg) {
      store_packed(m[j], tm, sg, j, fr, fc);
    }
  }

  // K again: R1 = M K, R2 = M^T diag(beta) K; dk += diag(beta) R1 + R2.
  float r1d = 0.0f, r2d = 0.0f;
  DELTA_UNROLL
  for (int k0 = 0; k0 < DK; k0 += SL) {  // unrolled: dk's tiles by constants
    stage(tx, LD, k + kc + k0, size_t(HK) * DK, CHUNK, valid, SL, tid, THREADS);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    DELTA_UNROLL
    for (int t = 0; t < SL / 8; ++t) {
      simdgroup_float8x8 r1 = zero_tile(), r2 = zero_tile(), own;
      DELTA_UNROLL
      for (int j = 0; j < 8; ++j) {
        if (j <= sg) {
          simdgroup_float8x8 kb;
          load_tile(kb, tx, LD, 8 * j, 8 * t, fr, fc);
          simdgroup_multiply_accumulate(r1, m[j], kb, r1);
        }
      }
      DELTA_UNROLL
      for (int r = 0; r < 8; ++r) {
        if (r >= sg) {
          simdgroup_float8x8 mt, kb;
          load_packed_t(mt, tm, r, sg, fr, fc);  // M^T(sg, r)
          load_tile(kb, tx, LD, 8 * r, 8 * t, fr, fc);
          scale_tile(kb, tb[8 * r + fr]);
          simdgroup_multiply_accumulate(r2, mt, kb, r2);
        }
      }
      load_tile(own, tx, LD, 8 * sg, 8 * t, fr, fc);
      r1d += lane_dot(r1, own);
      r2d += lane_dot(r2, own);
      gk[k0 / 8 + t].thread_elements() += bi * r1.thread_elements() + r2.thread_elements();
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  rdx = row_sum(rdx);
  rdy = row_sum(rdy);
  r1d = row_sum(r1d);
  r2d = row_sum(r2d);
  if ((lane & 9) == 0) {  // the lane holding the row's first column
    tdb[i] = gi * rdx + rdy + r1d;
    tdc[i] += bi * gi * rdx + bi * r1d - r2d;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {  // dlog_g: the reverse cumsum of dcum, 32 positions a pass
    const float x1 = tdc[CHUNK - 1 - lane], x0 = tdc[31 - lane];
    const float s1 = simd_prefix_inclusive_sum(x1);
    const float s0 = simd_prefix_inclusive_sum(x0) + simd_shuffle(s1, 31);
    const int p1 = CHUNK - 1 - lane, p0 = 31 - lane;
    if (p1 < valid) {
      const size_t at = (size_t(b) * L + t0 + p1) * HV + hv;
      dlog_g[at] = s1;
      dbeta[at] = tdb[p1];
    }
    if (p0 < valid) {
      const size_t at = (size_t(b) * L + t0 + p0) * HV + hv;
      dlog_g[at] = s0;
      dbeta[at] = tdb[p0];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the gates and T read before the next head's
}
if (real) {
  const size_t at = kc + size_t(i) * HK * DK + fc;
  DELTA_UNROLL
  for (int kt = 0; kt < KT; ++kt) {
    const float2 e = gk[kt].thread_elements();
    dk[at + 8 * kt] = dk_in[at + 8 * kt] + e[0];
    dk[at + 8 * kt + 1] = dk_in[at + 8 * kt + 1] + e[1];
  }
}
