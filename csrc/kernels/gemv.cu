#include <algorithm>

#include "gemv.cuh"

namespace oi {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLoads = 8;                // 16-byte weight loads in flight per lane
constexpr size_t kMaxSmem = 200 * 1024;  // staged input limit

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

template <int MT, int IN, int OUT>
__global__ void __launch_bounds__(kThreads) gemv_kernel(GemvArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sx = reinterpret_cast<bf16*>(smem_raw);  // [MT][K] effective input
  __shared__ float red[MT][kWarps];
  const int K = a.K, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  // The weights do not depend on the previous kernel: start pulling this warp's first rows into L2 now,
  // so the memory system is busy while the prologue below runs (it is most of a small layer's time).
  {
    const int n = blockIdx.x * kWarps + warp;
    if (n < a.N) {
      const char* row = reinterpret_cast<const char*>(a.W + (int64_t)n * K);
      for (int off = lane * 128; off < K * 2; off += 32 * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
    }
  }
  // Prologue: every block stages the whole (small) input, transformed, in shared memory.
  float rstd[MT];
  if (IN == (int)GemvIn::kRmsNorm) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float ss = 0.f;
      if (m < a.M)
        for (int k = tid * 8; k < K; k += kThreads * 8) {
          const uint4 v = *reinterpret_cast<const uint4*>(a.x + (int64_t)m * K + k);
          const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(p[j]);
            ss += f.x * f.x + f.y * f.y;
          }
        }
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) red[m][warp] = ss;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) t += red[m][w];
      rstd[m] = rsqrtf(t / K + a.eps);
    }
  }
  for (int k = tid * 8; k < K; k += kThreads * 8) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      uint4 out = make_uint4(0, 0, 0, 0);
      if (m < a.M) {
        __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
        if (IN == (int)GemvIn::kSiluMul) {
          const uint4 g = *reinterpret_cast<const uint4*>(a.x + (int64_t)m * 2 * K + k);
          const uint4 u = *reinterpret_cast<const uint4*>(a.x + (int64_t)m * 2 * K + K + k);
          const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&g);
          const __nv_bfloat162* up = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 gf = __bfloat1622float2(gp[j]), uf = __bfloat1622float2(up[j]);
            o[j] = __floats2bfloat162_rn(silu(gf.x) * uf.x, silu(gf.y) * uf.y);
          }
        } else {
          out = *reinterpret_cast<const uint4*>(a.x + (int64_t)m * K + k);
          if (IN == (int)GemvIn::kRmsNorm) {  // the rounding points of the rmsnorm kernel
            const uint4 w = *reinterpret_cast<const uint4*>(a.norm_w + k);
            const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 f = __bfloat1622float2(o[j]), g = __bfloat1622float2(wp[j]);
              const float2 n = __bfloat1622float2(__floats2bfloat162_rn(f.x * rstd[m], f.y * rstd[m]));
              o[j] = __floats2bfloat162_rn(n.x * g.x, n.y * g.y);
            }
          }
        }
      }
      *reinterpret_cast<uint4*>(sx + (int64_t)m * K + k) = out;
    }
  }
  __syncthreads();

  // Main loop: one weight row per warp at a time; every lane keeps kLoads 16-byte loads in flight, so
  // that even the smallest projections have enough bytes moving to reach the memory bandwidth.
  const int total_warps = gridDim.x * kWarps;
  for (int n = blockIdx.x * kWarps + warp; n < a.N; n += total_warps) {
    const bf16* wrow = a.W + (int64_t)n * K;
    float acc[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m] = 0.f;
    for (int base = 0; base < K; base += 32 * 8 * kLoads) {
      uint4 wv[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int k = base + (u * 32 + lane) * 8;
        wv[u] = k < K ? __ldcs(reinterpret_cast<const uint4*>(wrow + k)) : make_uint4(0, 0, 0, 0);  // read once
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int k = base + (u * 32 + lane) * 8;
        if (k >= K) break;
        const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv[u]);
        float wf[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(wp[j]);
          wf[2 * j] = f.x;
          wf[2 * j + 1] = f.y;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const uint4 xv = *reinterpret_cast<const uint4*>(sx + (int64_t)m * K + k);
          const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(xp[j]);
            acc[m] += wf[2 * j] * f.x + wf[2 * j + 1] * f.y;
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
      for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= a.M) break;
        const int64_t i = (int64_t)m * a.N + n;
        if (OUT == (int)GemvOut::kF32) {
          static_cast<float*>(a.y)[i] = acc[m];
        } else {
          bf16* y = static_cast<bf16*>(a.y);
          y[i] = __float2bfloat16(OUT == (int)GemvOut::kAccumulate ? acc[m] + __bfloat162float(y[i]) : acc[m]);
        }
      }
    }
  }
}

template <int MT, int IN, int OUT>
void launch(const GemvArgs& a, size_t smem, int num_sms, cudaStream_t s) {
  static bool configured = false;  // one attribute call per instantiation (graph capture safe afterwards)
  if (!configured) {
    OI_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<MT, IN, OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kMaxSmem));
    configured = true;
  }
  const int per_sm = std::max(1, std::min(2048 / kThreads, (int)((227 * 1024) / (smem + 1024))));
  const int need = (a.N + kWarps - 1) / kWarps;
  const int grid = std::max(1, std::min(need, num_sms * per_sm));
  gemv_kernel<MT, IN, OUT><<<grid, kThreads, smem, s>>>(a);
  OI_LAUNCH_CHECK("gemv_kernel");
}

template <int MT>
void dispatch(const GemvArgs& a, GemvIn in, GemvOut out, size_t smem, int num_sms, cudaStream_t s) {
  const int i = (int)in, o = (int)out;
  if (i == 1 && o == 0) launch<MT, 1, 0>(a, smem, num_sms, s);       // qkv, gate_up: norm fused in
  else if (i == 0 && o == 1) launch<MT, 0, 1>(a, smem, num_sms, s);  // o_proj: residual add
  else if (i == 2 && o == 1) launch<MT, 2, 1>(a, smem, num_sms, s);  // down_proj: SiLU·up in, residual out
  else if (i == 1 && o == 2) launch<MT, 1, 2>(a, smem, num_sms, s);  // lm_head: final norm in, fp32 out
  else if (i == 0 && o == 0) launch<MT, 0, 0>(a, smem, num_sms, s);
  else OI_CHECK(false, "gemv: unsupported prologue/epilogue pair " << i << "/" << o);
}

}  // namespace

bool gemv(const GemvArgs& a, GemvIn in, GemvOut out, int num_sms, cudaStream_t s) {
  if (a.M < 1 || a.M > kGemvMaxRows || a.K % 8 != 0) return false;
  const int mt = a.M <= 1 ? 1 : a.M <= 2 ? 2 : 4;
  const size_t smem = (size_t)mt * a.K * sizeof(bf16);
  if (smem > kMaxSmem) return false;
  switch (mt) {
    case 1: dispatch<1>(a, in, out, smem, num_sms, s); break;
    case 2: dispatch<2>(a, in, out, smem, num_sms, s); break;
    default: dispatch<4>(a, in, out, smem, num_sms, s); break;
  }
  return true;
}

}  // namespace oi
