// Chunk attention backward, dQ: dq_i = scale * sum_j p_ij (do_i . v_j - delta_i) k_j over every
// key the query saw (prefix and chunk), p recomputed from the saved log-sum-exp.
// Inputs as the forward's plus d_out (B, HQ, L, D), lse and delta = rowsum(d_out * o), both
// (B, HQ, L) float32. dq (B, HQ, L, D) float32.
// The forward's ownership: BQ query rows of one (b, h) a threadgroup, 8 to each group of SPLIT
// simdgroups, each holding D / SPLIT head dims of dQ in registers; Q and dO staged once. Each
// block of BK keys goes through ONE threadgroup buffer, V first: V block, barrier,
// dP = dO V^T, barrier, the K block in V's place, barrier, S = Q K^T, (split: barrier, the
// partners' partial S and dP summed in one order), dS = P (dP - delta), dQ += dS K, barrier.
// Products are 8x8 in float; every fragment loop is unrolled with a compile-time trip count.
constexpr int LD = D + PAD, SG = BQ / 8 * SPLIT, THREADS = 32 * SG;
constexpr int KT = BK / 8, DW = D / SPLIT, WT = DW / 8;
threadgroup T tq[BQ * LD];
threadgroup T tdo[BQ * LD];
threadgroup T tkv[BK * LD];  // the block's V, then its K
threadgroup float ts[SPLIT > 1 ? SG * 8 * BK : 1];  // each simdgroup's partial S
threadgroup float tp[SPLIT > 1 ? SG * 8 * BK : 1];  // and dP
const int HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], BS = params[7];
const uint tid = thread_index_in_threadgroup;
const ushort lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
const ushort fr = frag_row(lane), fc = frag_col(lane);
const int blocks = (L + BQ - 1) / BQ;
const int q0 = (threadgroup_position_in_grid.x % blocks) * BQ;
const int bh = threadgroup_position_in_grid.x / blocks;  // b * HQ + h
const int b = bh / HQ, hk = (bh % HQ) / (HQ / HKV);
const device T* k_own = k + size_t(b * HKV + hk) * L * D;
const device T* v_own = v + size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N;  // this head's first store row
const auto ks = store_rows<S, D, G>(pk, pk_scales, pk_biases, pre);  // its keys, values
const auto vs = store_rows<S, D, G>(pv, pv_scales, pv_biases, pre);
const int kend = START + metal::min(q0 + BQ, L);

const int rg = sg / SPLIT, d0 = (sg % SPLIT) * DW;  // this simdgroup's 8 rows, its head dims
const int r0 = q0 + 8 * rg;
const bool active = r0 < L;
const int klim = START + metal::min(r0 + 8, L);
const int row = r0 + fr;  // this lane's row; past L it takes no key
const bool real = active && row < L;
const int sees = real ? START + row + 1 : 0;
const float sc = scale[0], c2 = sc * LOG2E;
const float lse2 = real ? lse[size_t(bh) * L + row] * LOG2E : 0.0f;
const float dl = real ? delta[size_t(bh) * L + row] : 0.0f;

stage_rows<D>(tq, LD, BQ, q + size_t(bh) * L * D, q0, L, tid, THREADS);
stage_rows<D>(tdo, LD, BQ, d_out + size_t(bh) * L * D, q0, L, tid, THREADS);
simdgroup_float8x8 acc[WT];
UNROLL for (int t = 0; t < WT; ++t) {
  acc[t] = zero_tile();
}
for (int k0 = 0; k0 < kend; k0 += BK) {
  stage_keys<D>(tkv, LD, BK, vs, v_own, k0, START, kend, tid, THREADS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int nt = active ? metal::clamp((klim - k0 + 7) / 8, 0, KT) : 0;
  simdgroup_float8x8 s[KT], dp[KT];
  UNROLL for (int j = 0; j < KT; ++j) {
    s[j] = zero_tile();
    dp[j] = zero_tile();
  }
  if (nt > 0) {
    UNROLL for (int t = 0; t < WT; ++t) {  // dP = dO V^T over this simdgroup's head dims
      simdgroup_float8x8 g;
      load_tile(g, tdo, LD, 8 * rg, d0 + 8 * t, fr, fc);
      UNROLL for (int j = 0; j < KT; ++j) {
        if (j < nt) {
          simdgroup_float8x8 vt;
          load_tile_t(vt, tkv, LD, d0 + 8 * t, 8 * j, fr, fc);
          simdgroup_multiply_accumulate(dp[j], g, vt, dp[j]);
        }
      }
    }
    if (SPLIT > 1) {
      post_partial(tp + sg * 8 * BK, dp, nt, fr, fc);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // V read (partials posted) before K lands
  stage_keys<D>(tkv, LD, BK, ks, k_own, k0, START, kend, tid, THREADS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (nt > 0) {
    UNROLL for (int t = 0; t < WT; ++t) {  // S = Q K^T over this simdgroup's head dims
      simdgroup_float8x8 a;
      load_tile(a, tq, LD, 8 * rg, d0 + 8 * t, fr, fc);
      UNROLL for (int j = 0; j < KT; ++j) {
        if (j < nt) {
          simdgroup_float8x8 kt;
          load_tile_t(kt, tkv, LD, d0 + 8 * t, 8 * j, fr, fc);
          simdgroup_multiply_accumulate(s[j], a, kt, s[j]);
        }
      }
    }
    if (SPLIT > 1) {
      post_partial(ts + sg * 8 * BK, s, nt, fr, fc);
    }
  }
  if (SPLIT > 1) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the partial S posted
  }
  if (nt > 0) {
    if (SPLIT > 1) {  // the whole S and dP: the partners' parts, summed in one order by each
      sum_partials<SPLIT>(s, ts + rg * SPLIT * 8 * BK, nt, fr, fc);
      sum_partials<SPLIT>(dp, tp + rg * SPLIT * 8 * BK, nt, fr, fc);
    }
    UNROLL for (int j = 0; j < KT; ++j) {  // dS = P (dP - delta), in place of S
      if (j < nt) {
        thread float2& e = s[j].thread_elements();
        const float2 d = dp[j].thread_elements();
        const int key = k0 + 8 * j + fc;
        e[0] = key < sees ? metal::fast::exp2(e[0] * c2 - lse2) * (d[0] - dl) : 0.0f;
        e[1] = key + 1 < sees ? metal::fast::exp2(e[1] * c2 - lse2) * (d[1] - dl) : 0.0f;
      }
    }
    UNROLL for (int t = 0; t < WT; ++t) {  // dQ += dS K over this simdgroup's head dims
      UNROLL for (int j = 0; j < KT; ++j) {
        if (j < nt) {
          simdgroup_float8x8 kf;
          load_tile(kf, tkv, LD, 8 * j, d0 + 8 * t, fr, fc);
          simdgroup_multiply_accumulate(acc[t], s[j], kf, acc[t]);
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // K and the partials read before the next V
}
if (real) {
  device float* out = dq + (size_t(bh) * L + row) * D + d0 + fc;
  UNROLL for (int t = 0; t < WT; ++t) {
    const float2 e = acc[t].thread_elements();
    out[8 * t] = e[0] * sc;
    out[8 * t + 1] = e[1] * sc;
  }
}
