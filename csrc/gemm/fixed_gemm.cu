// The batch-invariant GEMM of --deterministic: Y[M, N] = X[M, K] · W[N, K]^T (+ Y), bf16 in, fp32 accumulate,
// whose rows do not depend on M.
//
// One summation order, shared by both kernels below, fixes every output bit:
//  - K is cut into at most 8 chunks whose length depends on K alone (chunk_of);
//  - within a chunk, 32-element segments in ascending order, each as two m16n8k16 MMAs with the weights as
//    the A operand (16 weight rows) and the input rows as B's 8 columns. The MMA's K index is permuted:
//    lane (g, t) holds row g's elements 8t..8t+7 of the segment (one 16-byte load), the first MMA takes
//    8t+{0,1} as k = 2t+{0,1} and 8t+{2,3} as k = 2t+8+{0,1}, the second 8t+{4..7} the same way;
//  - the chunks' sums are added in chunk order (the first taken as it is), then the residual, then rounding.
// The few-row kernel gives each chunk to a different warp of a block and adds their sums in that order; the
// tiled kernel walks the chunks of its tile in one CTA and folds them into a running total. Which
// kernel, how many rows per warp, tile sizes and grid sizes change with M; none changes the order.
// (cuBLASLt picks other kernels at other M, whose sums differ in their last bits.)
#include <algorithm>

#include "../kernels/async_copy.cuh"
#include "../kernels/launch.cuh"
#include "../kernels/mma.cuh"
#include "fixed_gemm.h"

namespace oi {
namespace {

constexpr int kSeg = 32;  // K elements per segment: one 16-byte load per row for each of four lanes

struct Args {
  const bf16* X;
  const bf16* W;
  void* Y;
  int M, N, K;
  bool accumulate, out_f32;
  int chunk_segs, num_chunks;  // segments per chunk (even); chunks (at most 8)
};

// y = v (+ y), rounded to the output type; out-of-range elements are skipped.
__device__ __forceinline__ void store_out(const Args& a, int tok, int row, float v) {
  if (tok >= a.M || row >= a.N) return;
  const size_t o = (size_t)tok * a.N + row;
  if (a.out_f32) {
    float* y = static_cast<float*>(a.Y) + o;
    if (a.accumulate) v += __ldcg(y);
    *y = v;
  } else {
    bf16* y = static_cast<bf16*>(a.Y) + o;
    if (a.accumulate) v += __bfloat162float(__ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(y))));
    *y = __float2bfloat16(v);
  }
}

// Two MMAs over one segment: w0 / w1 are rows g / g + 8 (16 bytes each), x is input row g's same 16 bytes.
__device__ __forceinline__ void mma_segment(float (&acc)[4], const uint4& w0, const uint4& w1, const uint4& x) {
  mma_bf16(acc, w0.x, w1.x, w0.y, w1.y, x.x, x.y);
  mma_bf16(acc, w0.z, w1.z, w0.w, w1.w, x.z, x.w);
}

// Few rows (decode, speculative verify): weights streamed straight into registers, the GEMV's way, with
// the MMA doing the dot products. A block owns 16 weight rows x (8 * MT) input rows (a tile) and its 8 warps
// take one K chunk each (chunk_of gives at most 8), U segments per round; the first round goes out before
// the PDL wait and the next tile's first round before this tile's reduction. The input rows come from L2
// alongside (no staging: 16 rows of a 9,728-wide input would not fit). The chunks' sums meet in shared
// memory and are added in chunk order; the buffer alternates between tiles, so one barrier per tile.
// Tiles are numbered token group fastest, so neighbouring blocks share weight rows in L2.
template <int MT, int U>
__global__ void __launch_bounds__(256, 2) few_rows_kernel(Args a, int row_tiles, int groups) {
  __shared__ float red[2][8][MT * 4 * 32];  // [tile parity][chunk][accumulator element]
  const int lane = threadIdx.x & 31, c = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int nseg = (a.K + kSeg - 1) / kSeg, tiles = row_tiles * groups;
  const int s0 = min(nseg, c * a.chunk_segs), s1 = min(nseg, s0 + a.chunk_segs);  // empty past the last chunk
  uint4 w[2][U], x[MT][U];
  auto load_w = [&](int rt, int s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = rt * 16 + g + 8 * r;
      const bf16* p = a.W + (size_t)min(row, a.N - 1) * a.K + t * 8;
#pragma unroll
      for (int v = 0; v < U; ++v) {
        const bool ok = row < a.N && s + v < s1 && (s + v) * kSeg + t * 8 < a.K;
        w[r][v] = ok ? __ldcs(reinterpret_cast<const uint4*>(p + (size_t)(s + v) * kSeg)) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  auto load_x = [&](int gi, int s) {
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int tok = gi * 8 * MT + j * 8 + g;
      const bf16* p = a.X + (size_t)min(tok, a.M - 1) * a.K + t * 8;
#pragma unroll
      for (int v = 0; v < U; ++v) {
        const bool ok = tok < a.M && s + v < s1 && (s + v) * kSeg + t * 8 < a.K;
        // L2 only: this SM's L1 may hold lines of X from before the previous kernel wrote it
        x[j][v] = ok ? __ldcg(reinterpret_cast<const uint4*>(p + (size_t)(s + v) * kSeg)) : make_uint4(0, 0, 0, 0);
      }
    }
  };

  int tile = blockIdx.x;
  if (tile < tiles) load_w(tile / groups, s0);  // the weights do not depend on the previous kernel
  pdl_wait();
  pdl_trigger();
  for (int parity = 0; tile < tiles; tile += gridDim.x, parity ^= 1) {
    const int gi = tile % groups, rt = tile / groups;
    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int s = s0; s < s1; s += U) {
      if (s != s0) load_w(rt, s);
      load_x(gi, s);
#pragma unroll
      for (int v = 0; v < U; ++v) {
        if (s + v >= s1) break;  // exactly the chunk's segments
#pragma unroll
        for (int j = 0; j < MT; ++j) mma_segment(acc[j], w[0][v], w[1][v], x[j][v]);
      }
    }
    if (tile + gridDim.x < tiles) load_w((tile + gridDim.x) / groups, s0);
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[parity][c][(j * 4 + e) * 32 + lane] = acc[j][e];
    __syncthreads();
    // accumulator element (j, e) of lane l: weight row rt * 16 + l / 4 + 8 * (e / 2), input row
    // gi * 8 * MT + j * 8 + 2 * (l % 4) + e % 2
    for (int i = threadIdx.x; i < MT * 4 * 32; i += 256) {
      const int l = i & 31, e = (i >> 5) & 3, j = i >> 7;
      float v = red[parity][0][i];
      for (int cc = 1; cc < a.num_chunks; ++cc) v += red[parity][cc][i];
      store_out(a, gi * 8 * MT + j * 8 + 2 * (l & 3) + (e & 1), rt * 16 + (l >> 2) + (e >> 1) * 8, v);
    }
  }
}

// Many rows (prefill under --deterministic): BR weight rows x BT input rows per CTA, 64 of K (two segments)
// per cp.async stage, WR x WT per warp. Shared-memory rows are 128 bytes whose 16-byte units sit at
// unit ^ 4 in odd rows, so a warp's 16-byte fragment loads (eight lanes: two rows, four units) are free of
// bank conflicts. The CTA walks its K chunk by chunk, folding each chunk's sums into a running total that
// each thread keeps in its own shared-memory column (registers would hold only half the tile).
template <int BR, int BT, int WR, int WT, int STAGES>
struct Tiled {
  static constexpr int kWarps = (BR / WR) * (BT / WT);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBK = 64;
  static constexpr int kStageElems = (BR + BT) * kBK;
  static constexpr int kAcc = (WR / 16) * (WT / 8) * 4;  // accumulators per thread
  static constexpr size_t kStagesBytes = size_t(STAGES) * kStageElems * sizeof(bf16);
  static constexpr size_t kSmem = kStagesBytes + size_t(kAcc) * kThreads * sizeof(float);
  static_assert(WR % 16 == 0 && WT % 8 == 0 && BR % WR == 0 && BT % WT == 0, "tile shape");
};

template <int BR, int BT, int WR, int WT, int STAGES>
__global__ void __launch_bounds__(Tiled<BR, BT, WR, WT, STAGES>::kThreads)
    tiled_kernel(Args a) {
  using T = Tiled<BR, BT, WR, WT, STAGES>;
  constexpr int RA = WR / 16, MT = WT / 8, BK = T::kBK;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int wr = warp / (BT / WT), wt = warp % (BT / WT);
  const int r0 = blockIdx.x * BR, t0 = blockIdx.y * BT;
  const int num_k = (a.K + BK - 1) / BK, nseg = (a.K + kSeg - 1) / kSeg;
  auto swz = [](int row, int unit) { return row * BK + ((unit ^ ((row & 1) << 2)) << 3); };

  // One stage's weight rows or input rows (`x`), BK of K from kt * BK; zero past N, M and K.
  auto load = [&](int slot, int kt, bool x) {
    bf16* dst = smem + slot * T::kStageElems + (x ? BR * BK : 0);
    const bf16* src = x ? a.X : a.W;
    const int rows = x ? BT : BR, lim = x ? a.M : a.N, base = x ? t0 : r0;
    for (int c = tid; c < rows * (BK / 8); c += T::kThreads) {
      const int row = c / (BK / 8), unit = c % (BK / 8), k = kt * BK + unit * 8, r = base + row;
      const bool ok = r < lim && k < a.K;
      cp_async16(dst + swz(row, unit), src + (size_t)(ok ? r : 0) * a.K + (ok ? k : 0), ok);
    }
  };

  float* total = reinterpret_cast<float*>(smem_raw + T::kStagesBytes) + tid;  // [kAcc][kThreads], own column
  float acc[RA][MT][4];
#pragma unroll
  for (int i = 0; i < RA; ++i)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
  bool first = true;

  // The weights' first stages before the PDL wait (no kernel writes them); commit group s then holds the
  // input's stage s (group 0 these weight stages too): stage s is complete once group s is.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < num_k) load(s, s, false);
  pdl_wait();
  pdl_trigger();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_k) load(s, s, true);
    cp_async_commit();
  }
  for (int kt = 0; kt < num_k; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt landed for every thread; the slot refilled below was read by all last round
    if (kt + STAGES - 1 < num_k) {
      load((kt + STAGES - 1) % STAGES, kt + STAGES - 1, false);
      load((kt + STAGES - 1) % STAGES, kt + STAGES - 1, true);
    }
    cp_async_commit();
    const bf16* sw = smem + (kt % STAGES) * T::kStageElems;
    const bf16* sx = sw + BR * BK;
#pragma unroll
    for (int sj = 0; sj < 2; ++sj) {
      if (kt * 2 + sj >= nseg) break;  // exactly ceil(K / 32) segments
      const int unit = sj * 4 + t;
      uint4 xf[MT];
#pragma unroll
      for (int j = 0; j < MT; ++j) xf[j] = *reinterpret_cast<const uint4*>(sx + swz(wt * WT + j * 8 + g, unit));
#pragma unroll
      for (int i = 0; i < RA; ++i) {
        const int rr = wr * WR + i * 16 + g;
        const uint4 w0 = *reinterpret_cast<const uint4*>(sw + swz(rr, unit));
        const uint4 w1 = *reinterpret_cast<const uint4*>(sw + swz(rr + 8, unit));
#pragma unroll
        for (int j = 0; j < MT; ++j) mma_segment(acc[i][j], w0, w1, xf[j]);
      }
    }
    // a chunk ends on a stage edge (chunks are multiples of 64 elements): fold it in
    if ((kt + 1) * 2 % a.chunk_segs == 0 || kt == num_k - 1) {
#pragma unroll
      for (int i = 0; i < RA; ++i)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float* p = total + ((i * MT + j) * 4 + e) * T::kThreads;
            *p = first ? acc[i][j][e] : *p + acc[i][j][e];
            acc[i][j][e] = 0.f;
          }
      first = false;
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < RA; ++i)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        store_out(a, t0 + wt * WT + j * 8 + 2 * t + (e & 1), r0 + wr * WR + i * 16 + g + (e >> 1) * 8,
                  total[((i * MT + j) * 4 + e) * T::kThreads]);
}

int num_sms() {
  static const int sms = [] {
    int dev = 0, n = 0;
    OI_CUDA_CHECK(cudaGetDevice(&dev));
    OI_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  return sms;
}

// K elements per chunk: an eighth of K rounded up to the tiled kernel's 64-element stage (Qwen3's K are
// multiples of 512: exactly eight), so at most 8 chunks, one per warp of the few-row kernel's block.
int chunk_of(int K) { return ((K + 7) / 8 + 63) / 64 * 64; }

template <int MT, int U>
void launch_few(const Args& a, cudaStream_t s) {
  const int row_tiles = (a.N + 15) / 16, groups = (a.M + 8 * MT - 1) / (8 * MT);
  const int grid = std::min(row_tiles * groups, 2 * num_sms());  // <= 2 blocks per SM: balanced when launched early
  OI_CUDA_CHECK(launch_kernel(true, few_rows_kernel<MT, U>, dim3(grid), dim3(256), 0, s, nullptr, a, row_tiles, groups));
}

template <int BR, int BT, int WR, int WT, int STAGES>
void launch_tiled(const Args& a, cudaStream_t s) {
  using T = Tiled<BR, BT, WR, WT, STAGES>;
  auto* kernel = tiled_kernel<BR, BT, WR, WT, STAGES>;
  static bool attr_set = false;  // per instantiation, set once from the launching thread
  if (!attr_set) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)T::kSmem));
    attr_set = true;
  }
  const dim3 grid((a.N + BR - 1) / BR, (a.M + BT - 1) / BT);
  OI_CUDA_CHECK(launch_kernel(false, kernel, grid, dim3(T::kThreads), T::kSmem, s, nullptr, a));
}

}  // namespace

void fixed_gemm(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
                cudaStream_t s, int config) {
  if (M == 0) return;
  OI_CHECK(K % 8 == 0 && N > 0, "fixed_gemm needs K % 8 == 0 (M=" << M << " N=" << N << " K=" << K << ")");
  OI_CHECK(reinterpret_cast<uintptr_t>(X) % 16 == 0 && reinterpret_cast<uintptr_t>(W) % 16 == 0,
           "fixed_gemm: X and W must be 16-byte aligned");
  const int chunk = chunk_of(K);
  const Args a{X, W, Y, M, N, K, accumulate, out_f32, chunk / kSeg, (K + chunk - 1) / chunk};
  if (config < 0) {
    const long big_tiles = (long)((N + 127) / 128) * ((M + 127) / 128);
    config = M <= 8 ? 0 : M <= kFixedGemmFewRows ? 1 : big_tiles >= 2L * num_sms() ? 3 : 2;
  }
  switch (config) {
    case 0: launch_few<1, 6>(a, s); break;
    case 1: launch_few<2, 4>(a, s); break;
    case 2: launch_tiled<64, 64, 32, 32, 4>(a, s); break;
    case 3: launch_tiled<128, 128, 64, 32, 3>(a, s); break;
    default: OI_CHECK(false, "fixed_gemm: no config " << config);
  }
}

}  // namespace oi
