// Chunked gated delta rule, step 1 (parallel over chunks): per chunk of CHUNK positions and value
// head, the cumulative log gate cum_i = sum_{j <= i} log_g_j (gamma_i = exp(cum_i)), the WY
// factors of the chunk's writes
//   A_ij = beta_i (gamma_i / gamma_j) k_i.k_j (j < i),   T = (I + A)^-1,
//   w = T diag(beta gamma) K,   u = T diag(beta) V.
// k (B, L, HK, DK), v (B, L, HV, DV) in T; log_g, beta (B, L, HV) float32; params [B, L, HK, HV,
// N, ...]. cum (B, HV, N * CHUNK), w (B, HV, N * CHUNK, DK), u (B, HV, N * CHUNK, DV), and with
// KEEP tri (B, HV, N, CHUNK, CHUNK) = T (zeros above the diagonal), all float32. Positions past L
// count as k = v = beta = log_g = 0: they write nothing and do not decay.
// A threadgroup owns one chunk of one (b, key head) and walks its value heads: the Gram K K^T is
// computed once for them, simdgroup s holding row tile s (tiles (s, j <= s)) in registers. Per
// value head, A goes to threadgroup memory as packed lower tiles; T replaces it in place: 16x16
// diagonal blocks by forward substitution (one thread per column), then blocks merged pairwise,
// [[T11, 0], [A21, T22]] -> [[T11, 0], [-T22 A21 T11, T22]], to 32 and 64 (one simdgroup per
// tile column of the merged block, 8x8 products). Simdgroup s then holds T's row tile s and
// computes rows s of w and u from K and V staged KS columns at a time. Every fragment loop (and
// the substitution's 16 x 16) unrolls in full (DELTA_UNROLL, tiles.metal): the Gram's, T's and
// the merges' tiles and the substitution's column are indexed by constants, in registers.
constexpr int SG = 8, THREADS = 32 * SG, LD = KS + 16 / sizeof(T);
threadgroup T tx[CHUNK * LD];              // KS columns of K or V
threadgroup float ta[TRI_TILES * 64];      // A, then T
threadgroup float tcum[CHUNK];             // cum
threadgroup float tb[CHUNK];               // beta
threadgroup float tbg[CHUNK];              // beta gamma
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
const device T* kc = k + (size_t(b) * L + t0) * HK * DK + size_t(hk) * DK;  // row r: + r HK DK

// The Gram matrix G = K K^T, row tile sg: gram[j] = G(sg, j) for j <= sg.
simdgroup_float8x8 gram[8];
DELTA_UNROLL
for (int j = 0; j < 8; ++j) {
  gram[j] = zero_tile();
}
for (int k0 = 0; k0 < DK; k0 += KS) {
  stage(tx, LD, kc + k0, size_t(HK) * DK, CHUNK, valid, KS, tid, THREADS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  DELTA_UNROLL
  for (int t = 0; t < KS / 8; ++t) {
    simdgroup_float8x8 a;
    load_tile(a, tx, LD, 8 * sg, 8 * t, fr, fc);
    DELTA_UNROLL
    for (int j = 0; j < 8; ++j) {
      if (j <= sg) {
        simdgroup_float8x8 kt;
        load_tile_t(kt, tx, LD, 8 * t, 8 * j, fr, fc);
        simdgroup_multiply_accumulate(gram[j], a, kt, gram[j]);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int g = 0; g < R; ++g) {
  const int hv = hk * R + g, bh = b * HV + hv;
  // The gates: cum by a prefix sum over the chunk, in simdgroup 0 (32 positions a pass).
  if (sg == 0) {
    const size_t at = (size_t(b) * L + t0 + lane) * HV + hv;
    const size_t at2 = at + size_t(32) * HV;
    const float x0 = int(lane) < valid ? log_g[at] : 0.0f;
    const float x1 = int(lane) + 32 < valid ? log_g[at2] : 0.0f;
    const float b0 = int(lane) < valid ? beta[at] : 0.0f;
    const float b1 = int(lane) + 32 < valid ? beta[at2] : 0.0f;
    const float c0 = simd_prefix_inclusive_sum(x0);
    const float c1 = simd_prefix_inclusive_sum(x1) + simd_shuffle(c0, 31);
    tcum[lane] = c0;
    tcum[lane + 32] = c1;
    tb[lane] = b0;
    tb[lane + 32] = b1;
    tbg[lane] = b0 * metal::exp(c0);
    tbg[lane + 32] = b1 * metal::exp(c1);
    cum[size_t(bh) * NP + t0 + lane] = c0;
    cum[size_t(bh) * NP + t0 + lane + 32] = c1;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // A = beta_i exp(cum_i - cum_j) G_ij below the diagonal, zero on and above it.
  const float ci = tcum[i], bi = tb[i];
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    if (j <= sg) {
      simdgroup_float8x8 a = gram[j];
      thread float2& e = a.thread_elements();
      DELTA_UNROLL
      for (int x = 0; x < 2; ++x) {
        const int col = 8 * j + fc + x;
        e[x] = col < i ? bi * metal::exp(ci - tcum[col]) * e[x] : 0.0f;
      }
      store_packed(a, ta, sg, j, fr, fc);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // T's 16x16 diagonal blocks: column `col` of block `blk` by forward substitution,
  // x_r = [r == col] - sum_{s < r} A_rs x_s, one thread per column.
  float x[16];
  const int blk = tid / 16, col = tid % 16, base = 16 * blk;
  if (tid < 64) {
    DELTA_UNROLL
    for (int r = 0; r < 16; ++r) {
      float s = r == col ? 1.0f : 0.0f;
      DELTA_UNROLL
      for (int q = 0; q < 16; ++q) {
        if (q < r) {
          const int ra = base + r, ca = base + q;
          s -= ta[tri_at(ra / 8, ca / 8) + (ra % 8) * 8 + ca % 8] * x[q];
        }
      }
      x[r] = s;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // A's diagonal blocks read, then replaced
  if (tid < 64) {
    DELTA_UNROLL
    for (int r = 0; r < 16; ++r) {
      if (r >= col) {
        const int ra = base + r, ca = base + col;
        ta[tri_at(ra / 8, ca / 8) + (ra % 8) * 8 + ca % 8] = x[r];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Merge blocks of m tiles pairwise: T21 = -T22 (A21 T11). Simdgroup sg < 8 / 2 = 4 owns the
  // tile column cc of pair p: Z = A21(:, cc) by T11's column, then -T22 Z.
  DELTA_UNROLL
  for (int level = 1; level <= 2; ++level) {
    const int m = 2 * level;  // 2, then 4
    const int p = sg / m, cc = p * 2 * m + sg % m, r0 = p * 2 * m + m;
    const bool busy = sg < 4;  // (8 / (2m) pairs) x (m columns)
    simdgroup_float8x8 z[4], out[4];
    if (busy) {
      DELTA_UNROLL
      for (int r = 0; r < 4; ++r) {
        if (r < m) {
          z[r] = zero_tile();
          DELTA_UNROLL
          for (int q = 0; q < 4; ++q) {
            const int kt = p * 2 * m + q;  // T11's tile rows, lower: kt >= cc
            if (q < m && kt >= cc) {
              simdgroup_float8x8 a, t11;
              load_packed(a, ta, r0 + r, kt, fr, fc);
              load_packed(t11, ta, kt, cc, fr, fc);
              simdgroup_multiply_accumulate(z[r], a, t11, z[r]);
            }
          }
        }
      }
      DELTA_UNROLL
      for (int r = 0; r < 4; ++r) {
        if (r < m) {
          out[r] = zero_tile();
          DELTA_UNROLL
          for (int q = 0; q < 4; ++q) {
            if (q <= r) {
              simdgroup_float8x8 t22;
              load_packed(t22, ta, r0 + r, r0 + q, fr, fc);
              simdgroup_multiply_accumulate(out[r], t22, z[q], out[r]);
            }
          }
          negate_tile(out[r]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // A21 read by every column, then replaced
    if (busy) {
      DELTA_UNROLL
      for (int r = 0; r < 4; ++r) {
        if (r < m) {
          store_packed(out[r], ta, r0 + r, cc, fr, fc);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (KEEP) {  // T for the backward (zeros above the diagonal)
    device float* dst = tri + (size_t(bh) * N + c) * CHUNK * CHUNK;
    for (int e = tid; e < CHUNK * CHUNK; e += THREADS) {
      const int r = e / CHUNK, q = e % CHUNK;
      dst[e] = q <= r ? ta[tri_at(r / 8, q / 8) + (r % 8) * 8 + q % 8] : 0.0f;
    }
  }
  simdgroup_float8x8 trow[8];  // T(sg, j), j <= sg
  DELTA_UNROLL
  for (int j = 0; j < 8; ++j) {
    if (j <= sg) {
      load_packed(trow[j], ta, sg, j, fr, fc);
    }
  }

  // w = T diag(beta gamma) K, then u = T diag(beta) V: the operand's rows scaled as loaded. With
  // the whole of K staged (KS == DK), the first value head finds it still in place.
  const device T* vc = v + (size_t(b) * L + t0) * HV * DV + size_t(hv) * DV;
  for (int pass = 0; pass < 2; ++pass) {
    const int D = pass == 0 ? DK : DV;
    const threadgroup float* scale = pass == 0 ? tbg : tb;
    device float* dst = (pass == 0 ? w + size_t(bh) * NP * DK : u + size_t(bh) * NP * DV) +
                        size_t(t0 + i) * D + fc;
    for (int k0 = 0; k0 < D; k0 += KS) {
      if (pass == 1 || KS < DK || g > 0) {
        if (pass == 0) {
          stage(tx, LD, kc + k0, size_t(HK) * DK, CHUNK, valid, KS, tid, THREADS);
        } else {
          stage(tx, LD, vc + k0, size_t(HV) * DV, CHUNK, valid, KS, tid, THREADS);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      DELTA_UNROLL
      for (int t = 0; t < KS / 8; ++t) {
        simdgroup_float8x8 acc = zero_tile();
        DELTA_UNROLL
        for (int j = 0; j < 8; ++j) {
          if (j <= sg) {
            simdgroup_float8x8 xt;
            load_tile(xt, tx, LD, 8 * j, 8 * t, fr, fc);
            scale_tile(xt, scale[8 * j + fr]);
            simdgroup_multiply_accumulate(acc, trow[j], xt, acc);
          }
        }
        const float2 e = acc.thread_elements();
        dst[k0 + 8 * t] = e[0];
        dst[k0 + 8 * t + 1] = e[1];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}
