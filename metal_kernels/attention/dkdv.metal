// Chunk attention backward, dK/dV of the keys that take a gradient: the tapped prefix
// [GF, START) then the chunk's own L keys, in that order along one axis of NT + L rows.
// dk_j = scale * sum_i ds_ij q_i and dv_j = sum_i p_ij do_i over the grouped query heads and the
// queries that see key j (all of them for the prefix, i >= j inside the chunk).
// Inputs as dq's. dk, dv (B, HKV, NT + L, D) float32.
// A threadgroup owns BK key rows of one (b, kv head), 8 per group of SPLIT simdgroups; each of
// those holds D / SPLIT head dims of its 8 rows' K, V, dK and dV in registers (read from device
// memory once) and adds its partial S^T = K Q^T and dP^T = V dO^T to its partners' through
// threadgroup memory. The threadgroup walks every query of every grouped head in blocks of BQ,
// staging each Q and dO block (and its lse, delta) once for all simdgroups; both stay staged
// for the whole step (S^T and dK read Q, dP^T and dV read dO), so unlike the forward's K and V
// they do not share one buffer. dV += P^T dO and dK += dS^T Q are 8x8 products in float; every
// fragment loop is unrolled with a compile-time trip count, the query tiles outside the causal
// edge skipped by predicates inside. No atomics: one threadgroup per key row.
constexpr int LD = D + PAD, SG = BK / 8 * SPLIT, THREADS = 32 * SG;
constexpr int DW = D / SPLIT, WT = DW / 8, QT = BQ / 8;
threadgroup T tq[BQ * LD];
threadgroup T tdo[BQ * LD];
threadgroup float tl[BQ];  // the block's lse (log2 domain)
threadgroup float td[BQ];  // and delta
threadgroup float tx[SPLIT > 1 ? 2 * SG * 8 * BQ : 1];  // each simdgroup's partial S^T, dP^T
const int HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], GF = params[6], BS = params[7];
const int NT = START - GF, NK = NT + L, R = HQ / HKV;
const uint tid = thread_index_in_threadgroup;
const ushort lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
const ushort fr = frag_row(lane), fc = frag_col(lane);
const int blocks = (NK + BK - 1) / BK;
const int c0 = (threadgroup_position_in_grid.x % blocks) * BK;
const int bk = threadgroup_position_in_grid.x / blocks;  // b * HKV + kv head
const int b = bk / HKV, hk = bk % HKV;
const int rg = sg / SPLIT, d0 = (sg % SPLIT) * DW;  // this simdgroup's 8 rows, its head dims
const int kr0 = c0 + 8 * rg;
const bool active = kr0 < NK;
const int kc = kr0 + fr;  // this lane's key row
const float sc = scale[0], c2 = sc * LOG2E;

// K and V: this lane's elements of its head dims, as the twin reads them (the store as T)
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N;  // this head's first store row
const auto ks = store_rows<S, D, G>(pk, pk_scales, pk_biases, pre);
const auto vs = store_rows<S, D, G>(pv, pv_scales, pv_biases, pre);
simdgroup_float8x8 kf[WT], vf[WT], gk[WT], gv[WT];
UNROLL for (int t = 0; t < WT; ++t) {
  const int d = d0 + 8 * t + fc;
  float2 x = 0.0f, y = 0.0f;
  if (kc < NT) {
    const int at = GF + kc;  // the tap's store row
    x = float2(float(T(ks.at(at, d))), float(T(ks.at(at, d + 1))));
    y = float2(float(T(vs.at(at, d))), float(T(vs.at(at, d + 1))));
  } else if (kc < NK) {
    const size_t at = (size_t(bk) * L + kc - NT) * D + d;
    x = float2(float(k[at]), float(k[at + 1]));
    y = float2(float(v[at]), float(v[at + 1]));
  }
  kf[t].thread_elements() = x;
  vf[t].thread_elements() = y;
  gk[t] = zero_tile();
  gv[t] = zero_tile();
}
const int first = metal::max(0, c0 - NT);  // the first query that sees one of the group's keys
const int sfirst = metal::max(0, kr0 - NT);  // one of this simdgroup's

for (int g = 0; g < R; ++g) {
  const int qh = b * HQ + hk * R + g;  // the query head
  for (int q0 = first; q0 < L; q0 += BQ) {
    stage_rows<D>(tq, LD, BQ, q + size_t(qh) * L * D, q0, L, tid, THREADS);
    stage_rows<D>(tdo, LD, BQ, d_out + size_t(qh) * L * D, q0, L, tid, THREADS);
    for (uint i = tid; i < uint(BQ); i += THREADS) {
      const bool in = q0 + int(i) < L;
      tl[i] = in ? lse[size_t(qh) * L + q0 + i] * LOG2E : 0.0f;
      td[i] = in ? delta[size_t(qh) * L + q0 + i] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // query tiles [u0, u1) hold queries that see this simdgroup's keys (the same for its lanes)
    const int u0 = metal::max(0, (sfirst - q0) / 8);
    const int u1 = active ? metal::min(QT, (L - q0 + 7) / 8) : 0;
    simdgroup_float8x8 st[QT], dpt[QT];
    UNROLL for (int u = 0; u < QT; ++u) {
      st[u] = zero_tile();
      dpt[u] = zero_tile();
    }
    UNROLL for (int t = 0; t < WT; ++t) {  // partial S^T = K Q^T, dP^T = V dO^T (own dims)
      UNROLL for (int u = 0; u < QT; ++u) {
        if (u >= u0 && u < u1) {
          simdgroup_float8x8 qa, ga;
          load_tile_t(qa, tq, LD, d0 + 8 * t, 8 * u, fr, fc);
          load_tile_t(ga, tdo, LD, d0 + 8 * t, 8 * u, fr, fc);
          simdgroup_multiply_accumulate(st[u], kf[t], qa, st[u]);
          simdgroup_multiply_accumulate(dpt[u], vf[t], ga, dpt[u]);
        }
      }
    }
    if (SPLIT > 1) {  // the whole S^T, dP^T: the partners' parts summed in one order by all
      const int mine = (2 * sg) * 8 * BQ + fr * BQ + fc;
      UNROLL for (int u = 0; u < QT; ++u) {
        if (u >= u0 && u < u1) {
          const float2 x = st[u].thread_elements(), y = dpt[u].thread_elements();
          tx[mine + 8 * u] = x[0];
          tx[mine + 8 * u + 1] = x[1];
          tx[mine + 8 * BQ + 8 * u] = y[0];
          tx[mine + 8 * BQ + 8 * u + 1] = y[1];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      UNROLL for (int u = 0; u < QT; ++u) {
        if (u >= u0 && u < u1) {
          float2 x = 0.0f, y = 0.0f;
          UNROLL for (int p = 0; p < SPLIT; ++p) {
            const int at = (2 * (rg * SPLIT + p)) * 8 * BQ + fr * BQ + fc + 8 * u;
            x += float2(tx[at], tx[at + 1]);
            y += float2(tx[at + 8 * BQ], tx[at + 8 * BQ + 1]);
          }
          st[u].thread_elements() = x;
          dpt[u].thread_elements() = y;
        }
      }
    }
    UNROLL for (int u = 0; u < QT; ++u) {  // P^T, then dS^T = P^T (dP^T - delta) in place of dP^T
      if (u >= u0 && u < u1) {
        thread float2& s = st[u].thread_elements();
        thread float2& dp = dpt[u].thread_elements();
        UNROLL for (int e = 0; e < 2; ++e) {
          const int c = 8 * u + fc + e, i = q0 + c;  // the query, its place in the block
          const bool sees = i < L && kc < NK && (kc < NT || kc - NT <= i);
          s[e] = sees ? metal::fast::exp2(s[e] * c2 - tl[c]) : 0.0f;
          dp[e] = s[e] * (dp[e] - td[c]);
        }
      }
    }
    UNROLL for (int t = 0; t < WT; ++t) {  // dV += P^T dO, dK += dS^T Q over this simdgroup's dims
      UNROLL for (int u = 0; u < QT; ++u) {
        if (u >= u0 && u < u1) {
          simdgroup_float8x8 qa, ga;
          load_tile(ga, tdo, LD, 8 * u, d0 + 8 * t, fr, fc);
          load_tile(qa, tq, LD, 8 * u, d0 + 8 * t, fr, fc);
          simdgroup_multiply_accumulate(gv[t], st[u], ga, gv[t]);
          simdgroup_multiply_accumulate(gk[t], dpt[u], qa, gk[t]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the block is read before the next one
  }
}
if (active && kc < NK) {
  const size_t at = (size_t(bk) * NK + kc) * D + d0 + fc;
  UNROLL for (int t = 0; t < WT; ++t) {
    const float2 x = gk[t].thread_elements(), y = gv[t].thread_elements();
    dk[at + 8 * t] = x[0] * sc;
    dk[at + 8 * t + 1] = x[1] * sc;
    dv[at + 8 * t] = y[0];
    dv[at + 8 * t + 1] = y[1];
  }
}
