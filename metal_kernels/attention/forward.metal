// Chunk attention forward: o = softmax(q [prefix; k]^T * scale) [prefix; v] and its
// log-sum-exp, causal inside the chunk, the prefix read in place from the K/V store.
// q (B, HQ, L, D); k, v (B, HKV, L, D); pk, pv the store (BS, HKV, N, D), prefix = [0, START):
// a float store (G = 0; pk_scales ... pv_biases unused), or with G > 0 mlx-lm's 8-bit one read
// in place, pk, pv its packed words (BS, HKV, N, D / 4) and pk_scales, pk_biases, pv_scales,
// pv_biases (BS, HKV, N, D / G) in S (StoreRows, common.metal).
// o (B, HQ, L, D) float32, lse (B, HQ, L) float32.
// A threadgroup owns BQ query rows of one (b, h), 8 of them to each group of SPLIT simdgroups,
// each of which holds D / SPLIT head dims of O in registers. Q is staged once; the keys its last
// row sees are walked in blocks of BK through ONE threadgroup buffer, as MLX's steel attention
// does: K block, barrier, S = Q K^T, barrier, the V block in the same place, barrier, O += P V,
// barrier. Every simdgroup reads them from there; split partners add their partial S (over
// their head dims) through threadgroup memory, in one order, so they hold the same S. The online
// softmax runs on each lane's own elements (a lane keeps one row's running max and its part of
// the row's sum). Every fragment loop is unrolled with a compile-time trip count (UNROLL).
constexpr int LD = D + PAD, SG = BQ / 8 * SPLIT, THREADS = 32 * SG;
constexpr int KT = BK / 8, DW = D / SPLIT, WT = DW / 8;
threadgroup T tq[BQ * LD];
threadgroup T tkv[BK * LD];  // the block's K, then its V
threadgroup float ts[SPLIT > 1 ? SG * 8 * BK : 1];  // each simdgroup's partial S
const int HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], BS = params[7];
const uint tid = thread_index_in_threadgroup;
const ushort lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
const ushort fr = frag_row(lane), fc = frag_col(lane);
const int blocks = (L + BQ - 1) / BQ;
const int q0 = (threadgroup_position_in_grid.x % blocks) * BQ;
const int bh = threadgroup_position_in_grid.x / blocks;  // b * HQ + h
const int b = bh / HQ, hk = (bh % HQ) / (HQ / HKV);
const device T* k_own = k + size_t(b * HKV + hk) * L * D;  // this head's own K/V rows
const device T* v_own = v + size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N;  // this head's first store row
const auto ks = store_rows<S, D, G>(pk, pk_scales, pk_biases, pre);  // its keys, values
const auto vs = store_rows<S, D, G>(pv, pv_scales, pv_biases, pre);
const int kend = START + metal::min(q0 + BQ, L);  // keys the group's last row sees

const int rg = sg / SPLIT, d0 = (sg % SPLIT) * DW;  // this simdgroup's 8 rows, its head dims
const int r0 = q0 + 8 * rg;  // its first row
const bool active = r0 < L;
const int klim = START + metal::min(r0 + 8, L);  // keys its last row sees
// This lane's row (rows past L repeat row L - 1, never written: no row sees no key).
const int sees = START + metal::min(r0 + fr, L - 1) + 1;
const float c2 = scale[0] * LOG2E;

stage_rows<D>(tq, LD, BQ, q + size_t(bh) * L * D, q0, L, tid, THREADS);
simdgroup_float8x8 acc[WT];
UNROLL for (int t = 0; t < WT; ++t) {
  acc[t] = zero_tile();
}
float m = MASKED, l = 0.0f;  // this lane's row: running max (log2 domain), its part of the sum
for (int k0 = 0; k0 < kend; k0 += BK) {
  stage_keys<D>(tkv, LD, BK, ks, k_own, k0, START, kend, tid, THREADS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // key tiles this simdgroup's rows see in the block (the same for its 32 lanes and partners)
  const int nt = active ? metal::clamp((klim - k0 + 7) / 8, 0, KT) : 0;
  simdgroup_float8x8 s[KT];
  UNROLL for (int j = 0; j < KT; ++j) {
    s[j] = zero_tile();
  }
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
  threadgroup_barrier(mem_flags::mem_threadgroup);  // K read (partials posted) before V lands
  stage_keys<D>(tkv, LD, BK, vs, v_own, k0, START, kend, tid, THREADS);
  if (nt > 0) {
    if (SPLIT > 1) {  // the whole S: the partners' parts, summed in one order by each
      sum_partials<SPLIT>(s, ts + rg * SPLIT * 8 * BK, nt, fr, fc);
    }
    float mx = MASKED;
    UNROLL for (int j = 0; j < KT; ++j) {
      if (j < nt) {
        thread float2& e = s[j].thread_elements();
        const int key = k0 + 8 * j + fc;
        e[0] = key < sees ? e[0] * c2 : MASKED;
        e[1] = key + 1 < sees ? e[1] * c2 : MASKED;
        mx = metal::max(mx, metal::max(e[0], e[1]));
      }
    }
    // finite: the group's first block holds key 0, which every row sees
    const float m_new = metal::max(m, row_max(mx));
    const float corr = metal::fast::exp2(m - m_new);
    float sum = 0.0f;
    UNROLL for (int j = 0; j < KT; ++j) {
      if (j < nt) {
        thread float2& e = s[j].thread_elements();
        const int key = k0 + 8 * j + fc;
        e[0] = key < sees ? metal::fast::exp2(e[0] - m_new) : 0.0f;
        e[1] = key + 1 < sees ? metal::fast::exp2(e[1] - m_new) : 0.0f;
        sum += e[0] + e[1];
      }
    }
    l = l * corr + sum;
    m = m_new;
    UNROLL for (int t = 0; t < WT; ++t) {
      acc[t].thread_elements() *= corr;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // V staged
  if (nt > 0) {
    UNROLL for (int t = 0; t < WT; ++t) {  // O += P V over this simdgroup's head dims
      UNROLL for (int j = 0; j < KT; ++j) {
        if (j < nt) {
          simdgroup_float8x8 vt;
          load_tile(vt, tkv, LD, 8 * j, d0 + 8 * t, fr, fc);
          simdgroup_multiply_accumulate(acc[t], s[j], vt, acc[t]);
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // V read before the next K lands
}
if (active) {
  l = row_sum(l);
  const int row = r0 + fr;
  if (row < L) {
    device float* out = o + (size_t(bh) * L + row) * D + d0 + fc;
    UNROLL for (int t = 0; t < WT; ++t) {
      const float2 e = acc[t].thread_elements();
      out[8 * t] = e[0] / l;
      out[8 * t + 1] = e[1] / l;
    }
    if ((lane & 9) == 0 && d0 == 0) {  // the lane holding the row's first column
      lse[size_t(bh) * L + row] = (m + metal::log2(l)) * LN2;
    }
  }
}
