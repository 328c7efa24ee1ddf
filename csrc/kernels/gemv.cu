#include <algorithm>

#include "async_copy.cuh"
#include "gemv.cuh"
#include "launch.cuh"

namespace oi {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 256;              // K elements one warp covers with one 16-byte load per lane
constexpr int kL = 12;                   // weight loads in flight per lane (chunks per round)
constexpr size_t kMaxSmem = 200 * 1024;  // staged input limit

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16(v)); }

// A block owns `rb` weight rows; each row is cut into `sw` K-slices, one per warp (rb * sw = 8), so a
// warp's whole slice is one round of kL loads per lane (registers) for every Qwen3 shape. The first round
// of weights is requested before anything else; the input staging and RMSNorm run while it streams in,
// so a small layer costs its bytes plus about one memory latency. (A shared-memory ring with three
// rounds in flight per warp measured slower: 4.45 vs 3.50 ms wall per 4B step.) Under PDL the first
// round goes out while the previous kernel is still running. (A bulk L2 prefetch of the next tile on
// top measured slower: docs/benchmarks.md.)
template <int MT, int IN, int OUT>
__global__ void __launch_bounds__(kThreads, MT == 1 ? 3 : 2) gemv_kernel(GemvArgs a, int sw, int tiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sx = reinterpret_cast<bf16*>(smem_raw);  // [MT][K] effective input, then [K] norm weight
  __shared__ float red[MT][kWarps];
  const int K = a.K, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rb = kWarps / sw, j = warp / sw, slice = warp % sw;
  const int chunks = K / kChunk, c0 = slice * chunks / sw, c1 = (slice + 1) * chunks / sw;
  // SiLU·up: the block's first rb/2 rows are gate rows, the last rb/2 the matching up rows.
  const int half = a.N / 2;
  auto row_of = [&](int tile) {
    if (OUT == (int)GemvOut::kSiluMul) return j < rb / 2 ? tile * (rb / 2) + j : half + tile * (rb / 2) + j - rb / 2;
    return tile * rb + j;
  };
  auto row_ok = [&](int tile) {
    if (OUT == (int)GemvOut::kSiluMul) return tile * (rb / 2) + (j % (rb / 2)) < half;
    return tile * rb + j < a.N;
  };

  uint4 wv[kL];
  auto issue = [&](int tile, int cb) {
    const bf16* wrow = a.W + (int64_t)row_of(tile) * K + lane * 8;
    const bool ok = row_ok(tile);
#pragma unroll
    for (int u = 0; u < kL; ++u)
      wv[u] = ok && cb + u < c1 ? __ldcs(reinterpret_cast<const uint4*>(wrow + (cb + u) * kChunk))  // read once
                                : make_uint4(0, 0, 0, 0);
  };
  // The weights do not depend on the previous kernel: they go out first.
  int tile = blockIdx.x;
  if (tile < tiles) issue(tile, c0);
  pdl_wait();  // the input (and, for a residual add, y) come from earlier kernels
  pdl_trigger();
  bf16* snw = sx + MT * K;  // [K] norm weight
  for (int k = tid * 8; k < K; k += kThreads * 8) {
#pragma unroll
    for (int m = 0; m < MT; ++m) cp_async16(sx + (int64_t)m * K + k, a.x + (int64_t)(m < a.M ? m : 0) * K + k, m < a.M);
    if (IN == (int)GemvIn::kRmsNorm) cp_async16(snw + k, a.norm_w + k, true);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // Prologue: RMSNorm in place, each thread on the elements it staged (the rmsnorm kernel's roundings).
  if (IN == (int)GemvIn::kRmsNorm) {
    float ss[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      ss[m] = 0.f;
      for (int k = tid * 8; k < K; k += kThreads * 8) {
        const uint4 v = *reinterpret_cast<const uint4*>(sx + (int64_t)m * K + k);
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(p[q]);
          ss[m] += f.x * f.x + f.y * f.y;
        }
      }
      for (int o = 16; o > 0; o >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
      if (lane == 0) red[m][warp] = ss[m];
    }
    __syncthreads();
    float rstd[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) t += red[m][w];
      rstd[m] = rsqrtf(t / K + a.eps);
    }
    for (int k = tid * 8; k < K; k += kThreads * 8) {
      const uint4 w = *reinterpret_cast<const uint4*>(snw + k);
      const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        uint4 v = *reinterpret_cast<const uint4*>(sx + (int64_t)m * K + k);
        __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(o[q]), g = __bfloat1622float2(wp[q]);
          const float2 n = __bfloat1622float2(__floats2bfloat162_rn(f.x * rstd[m], f.y * rstd[m]));
          o[q] = __floats2bfloat162_rn(n.x * g.x, n.y * g.y);
        }
        *reinterpret_cast<uint4*>(sx + (int64_t)m * K + k) = v;
      }
    }
    __syncthreads();  // red[] is reused below and every warp reads the whole input
  }

  for (; tile < tiles; tile += gridDim.x) {
    float acc[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m] = 0.f;
    for (int cb = c0; cb < c1; cb += kL) {
      if (cb != c0) issue(tile, cb);  // slices longer than one round (K > 12 * 256 * sw)
#pragma unroll
      for (int u = 0; u < kL; ++u) {
        if (cb + u >= c1) break;
        const int k = (cb + u) * kChunk + lane * 8;
        const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv[u]);
        float wf[8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(wp[q]);
          wf[2 * q] = f.x;
          wf[2 * q + 1] = f.y;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const uint4 xv = *reinterpret_cast<const uint4*>(sx + (int64_t)m * K + k);
          const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 f = __bfloat1622float2(xp[q]);
            acc[m] += wf[2 * q] * f.x + wf[2 * q + 1] * f.y;
          }
        }
      }
    }
    // The next tile's loads go out before this tile's reduction and epilogue.
    const bool more = tile + gridDim.x < tiles;
    if (more) issue(tile + gridDim.x, c0);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
      if (lane == 0) red[m][warp] = acc[m];
    }
    __syncthreads();
    // One thread per (output row, m): the slices are summed in order (deterministic).
    const int nout = OUT == (int)GemvOut::kSiluMul ? rb / 2 : rb;
    if (tid < nout * MT) {
      const int r = tid / MT, m = tid % MT;
      auto row_sum = [&](int jj) {
        float t = 0.f;
        for (int s2 = 0; s2 < sw; ++s2) t += red[m][jj * sw + s2];
        return t;
      };
      if (m < a.M) {
        if (OUT == (int)GemvOut::kSiluMul) {
          const int i = tile * (rb / 2) + r;
          if (i < half) {
            const float g = bf16r(row_sum(r)), u = bf16r(row_sum(r + rb / 2));
            static_cast<bf16*>(a.y)[(int64_t)m * half + i] = __float2bfloat16(silu(g) * u);
          }
        } else {
          const int n = tile * rb + r;
          if (n < a.N) {
            const int64_t i = (int64_t)m * a.N + n;
            const float v = row_sum(r);
            if (OUT == (int)GemvOut::kF32) {
              static_cast<float*>(a.y)[i] = v;
            } else {
              bf16* y = static_cast<bf16*>(a.y);
              y[i] = __float2bfloat16(OUT == (int)GemvOut::kAccumulate ? v + __bfloat162float(y[i]) : v);
            }
          }
        }
      }
    }
    if (more) __syncthreads();  // red[] is reused by the next tile
  }
}

template <int MT, int IN, int OUT>
void launch(const GemvArgs& a, int sw, size_t smem, int num_sms, cudaStream_t s) {
  static int per_sm = 0;  // one attribute call and occupancy query per instantiation (capture safe afterwards)
  if (per_sm == 0) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<MT, IN, OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kMaxSmem));
    OI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_kernel<MT, IN, OUT>, kThreads, 0));
    per_sm = std::max(per_sm, 1);
  }
  const int fit = std::max(1, std::min(per_sm, (int)((227 * 1024) / (smem + 2048))));
  const int rb = kWarps / sw;
  const bool pairs = OUT == (int)GemvOut::kSiluMul;
  const int rows = pairs ? a.N / 2 : a.N, per_tile = pairs ? rb / 2 : rb;
  const int tiles = (rows + per_tile - 1) / per_tile;
  const int grid = std::max(1, std::min(tiles, num_sms * fit));  // resident blocks loop over the tiles
  OI_CUDA_CHECK(
      launch_kernel(true, gemv_kernel<MT, IN, OUT>, dim3(grid), dim3(kThreads), smem, s, nullptr, a, sw, tiles));
}

template <int MT>
void dispatch(const GemvArgs& a, GemvIn in, GemvOut out, int sw, size_t smem, int num_sms, cudaStream_t s) {
  const int i = (int)in, o = (int)out;
  if (i == 1 && o == 0) launch<MT, 1, 0>(a, sw, smem, num_sms, s);       // qkv: norm fused in
  else if (i == 1 && o == 3) launch<MT, 1, 3>(a, sw, smem, num_sms, s);  // gate_up: norm in, SiLU·up out
  else if (i == 0 && o == 1) launch<MT, 0, 1>(a, sw, smem, num_sms, s);  // o_proj, down_proj: residual add
  else if (i == 1 && o == 2) launch<MT, 1, 2>(a, sw, smem, num_sms, s);  // lm_head: final norm in, fp32 out
  else if (i == 0 && o == 0) launch<MT, 0, 0>(a, sw, smem, num_sms, s);
  else OI_CHECK(false, "gemv: unsupported prologue/epilogue pair " << i << "/" << o);
}

}  // namespace

bool gemv(const GemvArgs& a, GemvIn in, GemvOut out, int num_sms, cudaStream_t s) {
  if (a.M < 1 || a.M > kGemvMaxRows || a.K % kChunk != 0) return false;
  const size_t smem = (size_t)(a.M + (in == GemvIn::kRmsNorm ? 1 : 0)) * a.K * sizeof(bf16);
  if (smem > kMaxSmem) return false;
  // Fewest warps per row whose slices fit one round of loads (gate/up pairs need two rows per block).
  const int chunks = a.K / kChunk, max_sw = out == GemvOut::kSiluMul ? kWarps / 2 : kWarps;
  int sw = 1;
  while (sw < max_sw && (chunks + sw - 1) / sw > kL) sw *= 2;
  if (out == GemvOut::kSiluMul && a.N % 2 != 0) return false;
  if (a.M == 1) dispatch<1>(a, in, out, sw, smem, num_sms, s);
  else dispatch<2>(a, in, out, sw, smem, num_sms, s);
  return true;
}

}  // namespace oi
