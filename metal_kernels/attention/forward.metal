// Chunk attention forward: o = softmax(q [prefix; k]^T * scale) [prefix; v] and its
// log-sum-exp, causal inside the chunk, the prefix read in place from the K/V store.
// q (B, HQ, L, D); k, v (B, HKV, L, D); pk, pv the store (BS, HKV, N, D), prefix = [0, START).
// o (B, HQ, L, D) float32, lse (B, HQ, L) float32.
// A threadgroup owns BQ query rows of one (b, h), each of its BQ / 8 simdgroups 8 of them. It
// walks the keys its last row sees in blocks of BK: all its threads stage each K and V block
// once in threadgroup memory, every simdgroup reads them from there. S = Q K^T and O += P V are
// 8x8 products in float; the online softmax runs on each lane's own elements (a lane keeps one
// row's running max and its part of the row's sum); O stays in registers, D / 8 tiles.
constexpr int LD = D + PAD, THREADS = 4 * BQ, KT = BK / 8, DT = D / 8;
threadgroup T tq[BQ * LD];
threadgroup T tk[BK * LD];
threadgroup T tv[BK * LD];
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
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N * D;  // this head's store rows
const int kend = START + metal::min(q0 + BQ, L);  // keys the group's last row sees

const int r0 = q0 + 8 * sg;  // this simdgroup's first row
const bool active = r0 < L;
const int klim = START + metal::min(r0 + 8, L);  // keys its last row sees
// This lane's row (rows past L repeat row L - 1, never written: no row sees no key).
const int sees = START + metal::min(r0 + fr, L - 1) + 1;
const float c2 = scale[0] * LOG2E;

stage_rows<D>(tq, LD, BQ, q + size_t(bh) * L * D, q0, L, tid, THREADS);
simdgroup_float8x8 acc[DT];
for (int t = 0; t < DT; ++t) {
  acc[t] = zero_tile();
}
float m = -INFINITY, l = 0.0f;  // this lane's row: running max (log2 domain), its part of the sum
for (int k0 = 0; k0 < kend; k0 += BK) {
  stage_keys<D>(tk, LD, BK, pk + pre, k_own, k0, START, kend, tid, THREADS);
  stage_keys<D>(tv, LD, BK, pv + pre, v_own, k0, START, kend, tid, THREADS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // key tiles this simdgroup's rows see in the block (the same for its 32 lanes)
  const int nt = active ? metal::clamp((klim - k0 + 7) / 8, 0, KT) : 0;
  if (nt > 0) {
    simdgroup_float8x8 s[KT];
    for (int j = 0; j < KT; ++j) {
      s[j] = zero_tile();
    }
    for (int t = 0; t < DT; ++t) {  // S = Q K^T, one Q tile at a time
      simdgroup_float8x8 a;
      load_tile(a, tq, LD, 8 * sg, 8 * t, fr, fc);
      for (int j = 0; j < KT; ++j) {
        if (j < nt) {
          simdgroup_float8x8 kt;
          load_tile_t(kt, tk, LD, 8 * t, 8 * j, fr, fc);
          simdgroup_multiply_accumulate(s[j], a, kt, s[j]);
        }
      }
    }
    float mx = -INFINITY;
    for (int j = 0; j < KT; ++j) {
      if (j < nt) {
        thread float2& e = s[j].thread_elements();
        const int key = k0 + 8 * j + fc;
        e[0] = key < sees ? e[0] * c2 : -INFINITY;
        e[1] = key + 1 < sees ? e[1] * c2 : -INFINITY;
        mx = metal::max(mx, metal::max(e[0], e[1]));
      }
    }
    // finite: the group's first block holds key 0, which every row sees
    const float m_new = metal::max(m, row_max(mx));
    const float corr = metal::exp2(m - m_new);
    float sum = 0.0f;
    for (int j = 0; j < KT; ++j) {
      if (j < nt) {
        thread float2& e = s[j].thread_elements();
        e[0] = metal::exp2(e[0] - m_new);
        e[1] = metal::exp2(e[1] - m_new);
        sum += e[0] + e[1];
      }
    }
    l = l * corr + sum;
    m = m_new;
    for (int t = 0; t < DT; ++t) {  // O = O * corr + P V
      acc[t].thread_elements() *= corr;
      for (int j = 0; j < KT; ++j) {
        if (j < nt) {
          simdgroup_float8x8 vt;
          load_tile(vt, tv, LD, 8 * j, 8 * t, fr, fc);
          simdgroup_multiply_accumulate(acc[t], s[j], vt, acc[t]);
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the block is read before the next one
}
if (active) {
  l = row_sum(l);
  const int row = r0 + fr;
  if (row < L) {
    device float* out = o + (size_t(bh) * L + row) * D + fc;
    for (int t = 0; t < DT; ++t) {
      const float2 e = acc[t].thread_elements();
      out[8 * t] = e[0] / l;
      out[8 * t + 1] = e[1] / l;
    }
    if ((lane & 9) == 0) {  // the lane holding the row's first column
      lse[size_t(bh) * L + row] = (m + metal::log2(l)) * LN2;
    }
  }
}
