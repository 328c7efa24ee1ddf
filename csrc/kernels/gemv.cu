#include <algorithm>

#include "async_copy.cuh"
#include "gemv.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace oi {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 256;              // K elements one warp covers with one 16-byte load per lane
constexpr int kL = 12;                   // weight loads in flight per lane (chunks per round)
constexpr size_t kMaxSmem = 200 * 1024;  // staged input limit

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16(v)); }

// A row's output: y[m, n] stored, accumulated onto (residual) or kept in fp32; v is its fp32 dot product.
template <int OUT>
__device__ __forceinline__ void store_row(const GemvArgs& a, int m, int n, float v) {
  const int64_t i = (int64_t)m * a.N + n;
  if (OUT == (int)GemvOut::kF32) {
    static_cast<float*>(a.y)[i] = v;
  } else {
    bf16* y = static_cast<bf16*>(a.y);
    y[i] = __float2bfloat16(OUT == (int)GemvOut::kAccumulate ? v + __bfloat162float(y[i]) : v);
  }
}

// SiLU·up of a gate/up pair: y[m, i] = SiLU(gate) * up, each rounded to bf16 first, as unfused kernels do.
__device__ __forceinline__ void store_silu(const GemvArgs& a, int m, int i, float gate, float up) {
  static_cast<bf16*>(a.y)[(int64_t)m * (a.N / 2) + i] = __float2bfloat16(silu(bf16r(gate)) * bf16r(up));
}

// Per-thread partial sums of squares -> every thread's 1 / rms of each input row (red: [MT][kWarps]).
template <int MT>
__device__ __forceinline__ void block_rstd(float (&ss)[MT], float (&red)[MT][kWarps], float (&rstd)[MT], int K, float eps) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    for (int o = 16; o > 0; o >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
    if (lane == 0) red[m][warp] = ss[m];
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += red[m][w];
    rstd[m] = rsqrtf(t / K + eps);
  }
}

// The input rows staged in shared memory as bf16 ([MT][K], then the [K] norm weight), RMSNorm applied in
// place with the rmsnorm kernel's roundings, each thread on the elements it staged. Ends with a barrier.
template <int MT, int IN>
__device__ __forceinline__ void stage_bf16(const GemvArgs& a, bf16* sx) {
  const int K = a.K, tid = threadIdx.x;
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
    }
    float rstd[MT];
    __shared__ float red[MT][kWarps];
    block_rstd<MT>(ss, red, rstd, K, a.eps);
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
    __syncthreads();  // every warp reads the whole input
  }
}

// A block owns `rb` weight rows; each row is cut into `sw` K-slices, one per warp (rb * sw = 8), so a
// warp's whole slice is one round of kL loads per lane (registers) for every Qwen3 shape. The first round
// of weights is requested before anything else; the input staging and RMSNorm run while it streams in,
// so a small layer costs its bytes plus about one memory latency. (A shared-memory ring with three
// rounds in flight per warp measured slower: 4.45 vs 3.50 ms wall per 4B step.) Under PDL the first
// round goes out while the previous kernel is still running. (A bulk L2 prefetch of the next tile on
// top measured slower: docs/benchmarks.md.)
// FX (where fp32 input fits as many blocks per SM): the input is staged as fp32 and the FMAs chained, so a
// weight load costs no conversion of the input; ~40% fewer instructions per weight byte, 4B batch 1
// 2.74 -> 2.64 ms per step (docs/benchmarks.md). A warp's compute between rounds of loads is on the
// critical path: requesting the next tile's chunks as each is consumed measured slower.
template <int MT, int IN, int OUT, bool FX>
__global__ void __launch_bounds__(kThreads, MT == 1 ? 3 : 2) gemv_kernel(GemvArgs a, int sw, int tiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sx = reinterpret_cast<bf16*>(smem_raw);  // [MT][K] effective input, then [K] norm weight
  // FX: [MT][K] fp32; in each 256-chunk, element lane * 8 + h * 4 + i sits at h * 128 + lane * 4 + i, so a
  // warp's float4 reads are contiguous.
  float* sxf = reinterpret_cast<float*>(smem_raw);
  auto fx_at = [](int k) { return (k & ~255) + ((k >> 2) & 1) * 128 + ((k & 255) >> 3) * 4; };  // k % 4 == 0
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
  if constexpr (FX) {
    float ss[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) ss[m] = 0.f;
    for (int k = tid * 8; k < K; k += kThreads * 8) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        // L2 only, as cp.async.cg: this SM's L1 may hold lines of x from before the previous kernel wrote it
        const uint4 v = m < a.M ? __ldcg(reinterpret_cast<const uint4*>(a.x + (int64_t)m * K + k)) : make_uint4(0, 0, 0, 0);
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
        float f[8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 t = __bfloat1622float2(p[q]);
          f[2 * q] = t.x, f[2 * q + 1] = t.y;
          ss[m] += t.x * t.x + t.y * t.y;
        }
        float* d = sxf + (int64_t)m * K;
        *reinterpret_cast<float4*>(d + fx_at(k)) = make_float4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<float4*>(d + fx_at(k + 4)) = make_float4(f[4], f[5], f[6], f[7]);
      }
    }
    if (IN == (int)GemvIn::kRmsNorm) {  // the rmsnorm kernel's roundings, on the elements this thread staged
      float rstd[MT];
      block_rstd<MT>(ss, red, rstd, K, a.eps);
      for (int k = tid * 8; k < K; k += kThreads * 8) {
        const uint4 w = *reinterpret_cast<const uint4*>(a.norm_w + k);
        const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          float* d = sxf + (int64_t)m * K;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float4* q4 = reinterpret_cast<float4*>(d + fx_at(k + 4 * h));
            float4 v = *q4;
            float* e = reinterpret_cast<float*>(&v);
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
              const float2 g = __bfloat1622float2(wp[2 * h + i / 2]);
              const float2 n = __bfloat1622float2(__floats2bfloat162_rn(e[i] * rstd[m], e[i + 1] * rstd[m]));
              const float2 o = __bfloat1622float2(__floats2bfloat162_rn(n.x * g.x, n.y * g.y));
              e[i] = o.x, e[i + 1] = o.y;
            }
            *q4 = v;
          }
        }
      }
    }
    __syncthreads();  // red[] is reused below and every warp reads the whole input
  }
  if constexpr (!FX) stage_bf16<MT, IN>(a, sx);

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
          if constexpr (FX) {
            const float* xr = sxf + (int64_t)m * K + (cb + u) * kChunk + lane * 4;
            const float4 x0 = *reinterpret_cast<const float4*>(xr), x1 = *reinterpret_cast<const float4*>(xr + 128);
            float t = acc[m];
            t = fmaf(wf[0], x0.x, t);
            t = fmaf(wf[1], x0.y, t);
            t = fmaf(wf[2], x0.z, t);
            t = fmaf(wf[3], x0.w, t);
            t = fmaf(wf[4], x1.x, t);
            t = fmaf(wf[5], x1.y, t);
            t = fmaf(wf[6], x1.z, t);
            acc[m] = fmaf(wf[7], x1.w, t);
          } else {
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
          if (i < half) store_silu(a, m, i, row_sum(r), row_sum(r + rb / 2));
        } else {
          const int n = tile * rb + r;
          if (n < a.N) store_row<OUT>(a, m, n, row_sum(r));
        }
      }
    }
    if (more) __syncthreads();  // red[] is reused by the next tile
  }
}

// The same GEMV with its dot products on the tensor cores: the loads are the register kernel's (a lane's
// 16 bytes of a row per chunk, 512 contiguous bytes per warp instruction), but a warp streams two rows at
// once and one MMA takes four weights of each from every lane. Lane (g, t) puts its row-A pairs in MMA row
// g and its row-B pairs in row g + 8, and its own input elements in B column g, so the MMA's diagonal
// C[g][g] (C[g+8][g]) is the sum of lanes 4g..4g+3's products of row A (B): K is permuted alike in A and
// B. One MMA per 16-byte load replaces ~17 CUDA-core instructions (the weight conversion and 8 FMAs), the
// compute a warp does between its rounds of loads. The input is staged as bf16, rounded as in the
// register kernel's bf16 staging.
template <int MT, int IN, int OUT>
__global__ void __launch_bounds__(kThreads, MT == 1 ? 3 : 2) gemv_tc_kernel(GemvArgs a, int sw, int tiles) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sx = reinterpret_cast<bf16*>(smem_raw);  // [MT][K] effective input, then [K] norm weight
  __shared__ float red[MT][2][kWarps];
  const int K = a.K, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rp = kWarps / sw, j = warp / sw, slice = warp % sw;  // rp row pairs per tile
  const int chunks = K / kChunk, c0 = slice * chunks / sw, c1 = (slice + 1) * chunks / sw;
  constexpr int kC = kL / 2;  // chunks per round (two rows)
  // Pair j of a tile: rows 2j and 2j + 1, or (SiLU·up) gate row i and its up row half + i.
  const int half = a.N / 2;
  auto row_of = [&](int tile, int r) {
    if (OUT == (int)GemvOut::kSiluMul) return tile * rp + j + r * half;
    return tile * 2 * rp + 2 * j + r;
  };
  auto row_ok = [&](int tile, int r) {
    if (OUT == (int)GemvOut::kSiluMul) return tile * rp + j < half;
    return tile * 2 * rp + 2 * j + r < a.N;
  };

  uint4 wv[kL];  // [chunk][row]
  auto issue = [&](int tile, int cb) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bf16* wrow = a.W + (int64_t)row_of(tile, r) * K + lane * 8;
      const bool ok = row_ok(tile, r);
#pragma unroll
      for (int u = 0; u < kC; ++u)
        wv[2 * u + r] = ok && cb + u < c1 ? __ldcs(reinterpret_cast<const uint4*>(wrow + (cb + u) * kChunk))
                                          : make_uint4(0, 0, 0, 0);
    }
  };
  int tile = blockIdx.x;
  if (tile < tiles) issue(tile, c0);
  pdl_wait();
  pdl_trigger();
  stage_bf16<MT, IN>(a, sx);

  for (; tile < tiles; tile += gridDim.x) {
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
    for (int cb = c0; cb < c1; cb += kC) {
      if (cb != c0) issue(tile, cb);
#pragma unroll
      for (int u = 0; u < kC; ++u) {
        if (cb + u >= c1) break;
        const uint4 wa = wv[2 * u], wb = wv[2 * u + 1];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const uint4 xv = *reinterpret_cast<const uint4*>(sx + (int64_t)m * K + (cb + u) * kChunk + lane * 8);
          mma_bf16(acc[m], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
          mma_bf16(acc[m], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
        }
      }
    }
    const bool more = tile + gridDim.x < tiles;
    if (more) issue(tile + gridDim.x, c0);
    // The diagonal: lane (g, g / 2) holds C[g][g] in d[g & 1] (row A) and C[g+8][g] in d[2 + (g & 1)].
    const bool diag = t == (g >> 1);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float v = diag ? ((g & 1) ? acc[m][2 * r + 1] : acc[m][2 * r]) : 0.f;  // constant indices: registers
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[m][r][warp] = v;
      }
    }
    __syncthreads();
    // One thread per (output, m): the slices are summed in order (deterministic).
    const int nout = OUT == (int)GemvOut::kSiluMul ? rp : 2 * rp;
    if (tid < nout * MT) {
      const int o = tid / MT, m = tid % MT;
      auto row_sum = [&](int jj, int r) {
        float s = 0.f;
        for (int s2 = 0; s2 < sw; ++s2) s += red[m][r][jj * sw + s2];
        return s;
      };
      if (m < a.M) {
        if (OUT == (int)GemvOut::kSiluMul) {
          const int i = tile * rp + o;
          if (i < half) store_silu(a, m, i, row_sum(o, 0), row_sum(o, 1));
        } else {
          const int n = tile * 2 * rp + o;
          if (n < a.N) store_row<OUT>(a, m, n, row_sum(o >> 1, o & 1));
        }
      }
    }
    if (more) __syncthreads();
  }
}

template <int MT, int IN, int OUT, bool FX>
void launch(const GemvArgs& a, int sw, size_t smem, int num_sms, cudaStream_t s) {
  static int per_sm = 0;  // one attribute call and occupancy query per instantiation (capture safe afterwards)
  if (per_sm == 0) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<MT, IN, OUT, FX>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kMaxSmem));
    OI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_kernel<MT, IN, OUT, FX>, kThreads, 0));
    per_sm = std::max(per_sm, 1);
  }
  const int fit = std::max(1, std::min(per_sm, (int)((227 * 1024) / (smem + 2048))));
  const int rb = kWarps / sw;
  const bool pairs = OUT == (int)GemvOut::kSiluMul;
  const int rows = pairs ? a.N / 2 : a.N, per_tile = pairs ? rb / 2 : rb;
  const int tiles = (rows + per_tile - 1) / per_tile;
  const int grid = std::max(1, std::min(tiles, num_sms * fit));  // resident blocks loop over the tiles
  OI_CUDA_CHECK(
      launch_kernel(true, gemv_kernel<MT, IN, OUT, FX>, dim3(grid), dim3(kThreads), smem, s, nullptr, a, sw, tiles));
}

template <int MT, int IN, int OUT>
void launch_tc(const GemvArgs& a, int sw, size_t smem, int num_sms, cudaStream_t s) {
  static int per_sm = 0;
  if (per_sm == 0) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(gemv_tc_kernel<MT, IN, OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kMaxSmem));
    OI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_tc_kernel<MT, IN, OUT>, kThreads, 0));
    per_sm = std::max(per_sm, 1);
  }
  const int fit = std::max(1, std::min(per_sm, (int)((227 * 1024) / (smem + 2048))));
  const int rp = kWarps / sw;
  const int outs = OUT == (int)GemvOut::kSiluMul ? a.N / 2 : a.N, per_tile = OUT == (int)GemvOut::kSiluMul ? rp : 2 * rp;
  const int tiles = (outs + per_tile - 1) / per_tile;
  const int grid = std::max(1, std::min(tiles, num_sms * fit));
  OI_CUDA_CHECK(launch_kernel(true, gemv_tc_kernel<MT, IN, OUT>, dim3(grid), dim3(kThreads), smem, s, nullptr, a, sw, tiles));
}

template <int MT>
void dispatch_tc(const GemvArgs& a, GemvIn in, GemvOut out, int sw, size_t smem, int num_sms, cudaStream_t s) {
  const int i = (int)in, o = (int)out;
  if (i == 1 && o == 0) launch_tc<MT, 1, 0>(a, sw, smem, num_sms, s);
  else if (i == 1 && o == 3) launch_tc<MT, 1, 3>(a, sw, smem, num_sms, s);
  else if (i == 0 && o == 1) launch_tc<MT, 0, 1>(a, sw, smem, num_sms, s);
  else if (i == 1 && o == 2) launch_tc<MT, 1, 2>(a, sw, smem, num_sms, s);
  else if (i == 0 && o == 0) launch_tc<MT, 0, 0>(a, sw, smem, num_sms, s);
  else OI_CHECK(false, "gemv: unsupported prologue/epilogue pair " << i << "/" << o);
}

template <int MT, bool FX>
void dispatch(const GemvArgs& a, GemvIn in, GemvOut out, int sw, size_t smem, int num_sms, cudaStream_t s) {
  const int i = (int)in, o = (int)out;
  if (i == 1 && o == 0) launch<MT, 1, 0, FX>(a, sw, smem, num_sms, s);       // qkv: norm fused in
  else if (i == 1 && o == 3) launch<MT, 1, 3, FX>(a, sw, smem, num_sms, s);  // gate_up: norm in, SiLU·up out
  else if (i == 0 && o == 1) launch<MT, 0, 1, FX>(a, sw, smem, num_sms, s);  // o_proj, down_proj: residual add
  else if (i == 1 && o == 2) launch<MT, 1, 2, FX>(a, sw, smem, num_sms, s);  // lm_head: final norm in, fp32 out
  else if (i == 0 && o == 0) launch<MT, 0, 0, FX>(a, sw, smem, num_sms, s);
  else OI_CHECK(false, "gemv: unsupported prologue/epilogue pair " << i << "/" << o);
}

}  // namespace

bool gemv_takes_tensor_cores(int M, int K, GemvIn in, GemvOut out, GemvKernel kernel) {
  if (M < 1 || M > kGemvMaxRows || K % kChunk != 0) return false;
  if ((size_t)(M + (in == GemvIn::kRmsNorm ? 1 : 0)) * K * sizeof(bf16) > kMaxSmem) return false;  // bf16 staging
  // Where they measured faster (per-projection chains, docs/benchmarks.md): two rows except lm_head's
  // fp32 output, and one row from K = 8192 (the down projections); CUDA cores elsewhere.
  if (kernel != GemvKernel::kAuto) return kernel == GemvKernel::kTensorCores;
  return M == 2 ? out != GemvOut::kF32 : K >= 8192;
}

bool gemv(const GemvArgs& a, GemvIn in, GemvOut out, int num_sms, cudaStream_t s) {
  if (a.M < 1 || a.M > kGemvMaxRows || a.K % kChunk != 0) return false;
  if (out == GemvOut::kSiluMul && a.N % 2 != 0) return false;
  // The input (and norm weight) staged as bf16, or the input as fp32 where that keeps as many blocks per SM
  // (all but 32B's down projection, K = 25600).
  const size_t smem_bf = (size_t)(a.M + (in == GemvIn::kRmsNorm ? 1 : 0)) * a.K * sizeof(bf16);
  const size_t smem_fx = (size_t)a.M * a.K * sizeof(float);
  auto per_sm = [&](size_t smem) { return std::min(a.M == 1 ? 3 : 2, (int)((227 * 1024) / (smem + 2048))); };
  const bool fx = a.kernel != GemvKernel::kCudaCoresBf16 && smem_fx <= kMaxSmem && per_sm(smem_fx) >= per_sm(smem_bf);
  const size_t smem = fx ? smem_fx : smem_bf;
  if (smem > kMaxSmem) return false;
  if (gemv_takes_tensor_cores(a.M, a.K, in, out, a.kernel)) {  // two rows per warp: half the chunks per round
    int sw = 1;
    while (sw < kWarps && (a.K / kChunk + sw - 1) / sw > kL / 2) sw *= 2;
    if (a.M == 1) dispatch_tc<1>(a, in, out, sw, smem_bf, num_sms, s);
    else dispatch_tc<2>(a, in, out, sw, smem_bf, num_sms, s);
    return true;
  }
  // Fewest warps per row whose slices fit one round of loads (gate/up pairs need two rows per block).
  const int chunks = a.K / kChunk, max_sw = out == GemvOut::kSiluMul ? kWarps / 2 : kWarps;
  int sw = 1;
  while (sw < max_sw && (chunks + sw - 1) / sw > kL) sw *= 2;
  if (a.M == 1) fx ? dispatch<1, true>(a, in, out, sw, smem, num_sms, s) : dispatch<1, false>(a, in, out, sw, smem, num_sms, s);
  else fx ? dispatch<2, true>(a, in, out, sw, smem, num_sms, s) : dispatch<2, false>(a, in, out, sw, smem, num_sms, s);
  return true;
}

}  // namespace oi
