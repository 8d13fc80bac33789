// Chunk attention backward, dQ, on tensor cores (CUDA only, float16/bfloat16; float32 takes
// dq.cu): FlashAttention-2's dQ pass without atomics.
// Shared with dq.metal: the contract (the forward's inputs plus d_out, lse, delta; dq (B, HQ, L,
// D) float32) and the math: P = exp(S scale - lse) recomputed from the forward's log-sum-exp,
// dS = P (dP - delta), dQ = scale * dS K over every key the query saw, float32 accumulators,
// dQ in registers, written once.
// Not shared: a block of NW warps owns BQ = 16 MT NW query rows (128 in every blocks.CUDA entry);
// keys walked in tiles of BN, K and V double buffered through cp.async in 54-198 KiB of shared
// memory; S = Q K^T, dP = dO V^T and dQ += dS K on mma.sync m16n8k16 with ldmatrix (K read
// transposed; Q, dO in registers when QREG); dS rounded to T as the A operand of dS K.
// dq.metal: 8-64 query rows a threadgroup, 8x8 simdgroup_float8x8 products with dS in float,
// <= 32 KiB of threadgroup memory, no async copies. A timing of this kernel on an NVIDIA GPU
// says nothing about dq.metal's speed.
// Template: T, S, D, G (as forward_tc.cu's), MT, NW, BN, QREG (metal_kernels/attention/blocks.py).
using namespace mlxwalk_tc;
constexpr int BQ = 16 * MT * NW, THREADS = 32 * NW, P = D + PAD;
constexpr int NT = BN / 8, ND = D / 8;
extern __shared__ __align__(16) unsigned char smem[];
T* sQ = reinterpret_cast<T*>(smem);  // BQ x P
T* sdO = sQ + BQ * P;                // BQ x P
T* sK = sdO + BQ * P;                // 2 x BN x P
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

// Key rows: [0, START) from the store, [START, START + L) the chunk's own, zeros past them.
auto load_keys = [&](int stage, int k0) {
  load_span<T, D, BN, THREADS>(sK + stage * BN * P, k_pre, k_own, k0, START, START + L, tid);
  load_span<T, D, BN, THREADS>(sV + stage * BN * P, v_pre, v_own, k0, START, START + L, tid);
};
const int kend = START + min(q0 + BQ, L);
const int tiles = (kend + BN - 1) / BN;
const T* q_rows = q + qrows * D;
const T* o_rows = d_out + qrows * D;
load_span<T, D, BQ, THREADS>(sQ, rows_of<D>(q_rows), q_rows, q0, 0, L, tid);
load_span<T, D, BQ, THREADS>(sdO, rows_of<D>(o_rows), o_rows, q0, 0, L, tid);
load_keys(0, 0);
cp_commit();

const int row0 = warp * 16 * MT;
const int last = START + q0 + row0 + 16 * MT - 1;
float nl[MT][2], dl[MT][2];  // per row: -lse in log2 units, and delta
#pragma unroll
for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = q0 + row0 + mt * 16 + (lane >> 2) + 8 * hh;
    nl[mt][hh] = i < L ? -lse[qrows + i] * LOG2E : 0.0f;
    dl[mt][hh] = i < L ? delta[qrows + i] : 0.0f;
  }
}
float acc[MT][ND][4];
zero(acc);
u32 qa[MT][D / 16][4];  // QREG: the warp's Q fragments
u32 oa[MT][D / 16][4];  // and dO's
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
      load_a<T, D, P, MT>(oa, sdO + row0 * P, lane);
    }
  }
  const int k0 = t * BN;
  if (k0 > last) {
    continue;
  }
  const T* tK = sK + (t & 1) * BN * P;
  const T* tV = sV + (t & 1) * BN * P;
  float s[MT][NT][4], dp[MT][NT][4];
  zero(s);
  zero(dp);
  if constexpr (QREG) {
    mma_nt_ra<T, D, P, MT, NT>(s, qa, tK, lane);
    mma_nt_ra<T, D, P, MT, NT>(dp, oa, tV, lane);
  } else {
    mma_nt<T, D, P, MT, NT>(s, sQ + row0 * P, tK, lane);
    mma_nt<T, D, P, MT, NT>(dp, sdO + row0 * P, tV, lane);
  }
  const bool causal = k0 + BN - 1 > START + q0 + row0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hh = e >> 1;
        float p = ex2(fmaf(s[mt][nt][e], c, nl[mt][hh]));
        if (causal) {
          const int i = q0 + row0 + mt * 16 + (lane >> 2) + 8 * hh;
          const int j = k0 + nt * 8 + 2 * (lane & 3) + (e & 1);
          p = j > START + i ? 0.0f : p;
        }
        s[mt][nt][e] = p * (dp[mt][nt][e] - dl[mt][hh]);  // dS
      }
    }
  }
  u32 da[MT][NT / 2][4];
  to_a<T, MT, NT>(da, s);
  mma_nn<T, NT / 2, P, MT, ND>(acc, da, tK, lane);
}
#pragma unroll
for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int i = q0 + row0 + mt * 16 + (lane >> 2) + 8 * hh;
    if (i < L) {
      float* out = dq + (qrows + i) * D + 2 * (lane & 3);
#pragma unroll
      for (int nd = 0; nd < ND; ++nd) {
        *reinterpret_cast<float2*>(out + nd * 8) =
            make_float2(acc[mt][nd][2 * hh] * sc, acc[mt][nd][2 * hh + 1] * sc);
      }
    }
  }
}
