// Chunk attention forward on tensor cores (CUDA only, float16/bfloat16 queries; float32 takes
// forward.cu): FlashAttention-2's forward.
// Shared with forward.metal: the contract (the same inputs, params and layouts; o (B, HQ, L, D)
// and lse (B, HQ, L) float32) and the math: the causal online softmax over the prefix [0, START)
// from the store, then the chunk's own keys, scores in the log2 domain, float32 softmax state
// and accumulators in registers, O / l written once with the log-sum-exp.
// Not shared: a block of NW warps owns BQ = 16 MT NW query rows (128 in every blocks.CUDA entry),
// each warp MT m-tiles of 16 rows; keys walked in tiles of BN, K and V double buffered through
// cp.async in 54-198 KiB of shared memory; S = Q K^T and O += P V on mma.sync m16n8k16 with
// ldmatrix (Q in registers when QREG); O rescaled only when a row's max grows past 2^8; P rounded
// to T as the A operand of P V. forward.metal: 8-64 query rows a threadgroup, 8x8
// simdgroup_float8x8 products with P in float, <= 32 KiB of threadgroup memory, no async copies,
// a rescale every block. A timing of this kernel on an NVIDIA GPU says nothing about its speed.
// Template: T, S (the store's dtype; an 8-bit store's scales'), D, G (an 8-bit store's group, 0
// for a float store: StoreRows, common_tc.cuh), MT, NW, BN, QREG (attention/blocks.py).
using namespace mlxwalk_tc;
constexpr int BQ = 16 * MT * NW, THREADS = 32 * NW, P = D + PAD;
constexpr int NT = BN / 8, ND = D / 8;  // n-tiles of a score tile, of an output row block
extern __shared__ __align__(16) unsigned char smem[];
T* sQ = reinterpret_cast<T*>(smem);  // BQ x P
T* sK = sQ + BQ * P;                 // 2 x BN x P
T* sV = sK + 2 * BN * P;             // 2 x BN x P

const int HQ = params[1], HKV = params[2], L = params[3];
const int N = params[4], START = params[5], BS = params[7];
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int blocks = (L + BQ - 1) / BQ;
const int q0 = (blocks - 1 - int(blockIdx.x % blocks)) * BQ;  // the longest rows go first
const int h = (blockIdx.x / blocks) % HQ, b = blockIdx.x / (blocks * HQ);
const int hk = h / (HQ / HKV);
const T* k_own = k + size_t(b * HKV + hk) * L * D;
const T* v_own = v + size_t(b * HKV + hk) * L * D;
const size_t pre = size_t((BS > 1 ? b : 0) * HKV + hk) * N;  // this head's first store row
const auto k_pre = store_rows<S, D, G>(pk, pk_scales, pk_biases, pre);
const auto v_pre = store_rows<S, D, G>(pv, pv_scales, pv_biases, pre);
const size_t qrows = size_t(b * HQ + h) * L;
const float sc = scale[0], c = sc * LOG2E;

const int kend = START + min(q0 + BQ, L);  // keys the block's last row sees
const int tiles = (kend + BN - 1) / BN;
// Key rows: [0, START) from the store, [START, START + L) the chunk's own, zeros past them.
auto load_keys = [&](int stage, int k0) {
  load_span<T, D, BN, THREADS>(sK + stage * BN * P, k_pre, k_own, k0, START, START + L, tid);
  load_span<T, D, BN, THREADS>(sV + stage * BN * P, v_pre, v_own, k0, START, START + L, tid);
};
const T* q_rows = q + qrows * D;
load_span<T, D, BQ, THREADS>(sQ, rows_of<D>(q_rows), q_rows, q0, 0, L, tid);
load_keys(0, 0);
cp_commit();

const int row0 = warp * 16 * MT;  // the warp's first row in the block
const int last = START + q0 + row0 + 16 * MT - 1;  // the last key the warp's rows see
float acc[MT][ND][4];
zero(acc);
float m[MT][2], l[MT][2];
#pragma unroll
for (int mt = 0; mt < MT; ++mt) {
  m[mt][0] = m[mt][1] = neg_inf();
  l[mt][0] = l[mt][1] = 0.0f;
}
u32 qa[MT][D / 16][4];  // QREG: the warp's Q fragments
for (int t = 0; t < tiles; ++t) {
  cp_wait<0>();
  __syncthreads();  // tile t is in; every warp is done with tile t - 1's buffers
  if (t + 1 < tiles) {
    load_keys((t + 1) & 1, (t + 1) * BN);
  }
  cp_commit();
  if constexpr (QREG) {
    if (t == 0) {
      load_a<T, D, P, MT>(qa, sQ + row0 * P, lane);
    }
  }
  const int k0 = t * BN;
  if (k0 > last) {
    continue;  // past every row of this warp (the block's last tiles, causally)
  }
  const T* tK = sK + (t & 1) * BN * P;
  const T* tV = sV + (t & 1) * BN * P;
  float s[MT][NT][4];
  zero(s);
  if constexpr (QREG) {
    mma_nt_ra<T, D, P, MT, NT>(s, qa, tK, lane);
  } else {
    mma_nt<T, D, P, MT, NT>(s, sQ + row0 * P, tK, lane);
  }
  if (k0 + BN - 1 > START + q0 + row0) {  // the tile reaches past the warp's first row: causal
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = q0 + row0 + mt * 16 + (lane >> 2) + 8 * (e >> 1);
          const int j = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
          if (j > START + i) {
            s[mt][nt][e] = neg_inf();
          }
        }
      }
    }
  }
  // The online softmax. Each row keeps a reference max m (raw score units): P = 2^(c (s - m)).
  // The reference moves, rescaling O and the row sum, only where the tile's max passes it by
  // more than 8 in log2 units, and only in a tile where some row of the warp needs it (a vote):
  // over a long prefix the max settles within a few tiles, and P stays at most 2^8 meanwhile.
  // Exact either way: the log-sum-exp is taken against the same reference.
  float top[MT][2];
  bool move = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // rows g and g + 8 of the m-tile
      float x = neg_inf();
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        x = fmaxf(x, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
      }
      top[mt][hh] = quad_max(x);
      move = move || (top[mt][hh] - m[mt][hh]) * c > 8.0f;  // m = -inf at first: true
    }
  }
  if (__any_sync(0xffffffffu, move)) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        // Tile 0 holds key 0, which every row sees: m is finite from then on.
        const float m_new = fmaxf(m[mt][hh], top[mt][hh]);
        const float corr = ex2((m[mt][hh] - m_new) * c);
        m[mt][hh] = m_new;
        l[mt][hh] *= corr;
#pragma unroll
        for (int nd = 0; nd < ND; ++nd) {
          acc[mt][nd][2 * hh] *= corr;
          acc[mt][nd][2 * hh + 1] *= corr;
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float mc = m[mt][hh] * c;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          const float p = ex2(fmaf(s[mt][nt][e], c, -mc));
          s[mt][nt][e] = p;
          sum += p;
        }
      }
      l[mt][hh] += sum;  // this lane's part of the row sum
    }
  }
  u32 pa[MT][NT / 2][4];
  to_a<T, MT, NT>(pa, s);
  mma_nn<T, NT / 2, P, MT, ND>(acc, pa, tV, lane);
}
#pragma unroll
for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float total = quad_sum(l[mt][hh]);
    const int i = q0 + row0 + mt * 16 + (lane >> 2) + 8 * hh;
    if (i < L) {
      const float inv = 1.0f / total;
      float* out = o + (qrows + i) * D + 2 * (lane & 3);
#pragma unroll
      for (int nd = 0; nd < ND; ++nd) {
        *reinterpret_cast<float2*>(out + nd * 8) =
            make_float2(acc[mt][nd][2 * hh] * inv, acc[mt][nd][2 * hh + 1] * inv);
      }
      if ((lane & 3) == 0) {
        lse[qrows + i] = m[mt][hh] * sc + logf(total);
      }
    }
  }
}
