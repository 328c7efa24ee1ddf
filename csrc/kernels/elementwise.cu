#include "elementwise.cuh"
#include "launch.cuh"

namespace oi {
namespace {

constexpr int kVec = 8;  // 8 bf16 = one 16-byte access

struct alignas(16) Vec8 {
  __nv_bfloat162 h[4];
};

__global__ void embedding_kernel(const bf16* __restrict__ table, const int32_t* __restrict__ ids,
                                 bf16* __restrict__ out, int H, int64_t out_stride) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const Vec8* src = reinterpret_cast<const Vec8*>(table + (int64_t)ids[t] * H);
  Vec8* dst = reinterpret_cast<Vec8*>(out + (int64_t)t * out_stride);
  for (int i = threadIdx.x; i < H / kVec; i += blockDim.x) dst[i] = src[i];
}

__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  v = lane < nw ? red[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // every thread holds the total
}

// One block per row; the row is held in registers between the two passes (H <= kMaxVec*8*blockDim).
constexpr int kNormThreads = 256;
constexpr int kMaxVec = 4;  // up to 8192 hidden

__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(const bf16* __restrict__ x,
                                                               const bf16* __restrict__ w,
                                                               bf16* __restrict__ out, int H, float eps) {
  pdl_wait();
  pdl_trigger();
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const Vec8* xr = reinterpret_cast<const Vec8*>(x + row * H);
  const Vec8* wr = reinterpret_cast<const Vec8*>(w);
  Vec8* orow = reinterpret_cast<Vec8*>(out + row * H);
  const int nvec = H / kVec;
  Vec8 v[kMaxVec];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kMaxVec; ++k) {
    const int i = threadIdx.x + k * kNormThreads;
    if (i < nvec) {
      v[k] = xr[i];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 f = __bfloat1622float2(v[k].h[j]);
        ss += f.x * f.x + f.y * f.y;
      }
    }
  }
  const float rstd = rsqrtf(block_sum(ss, red) / H + eps);
#pragma unroll
  for (int k = 0; k < kMaxVec; ++k) {
    const int i = threadIdx.x + k * kNormThreads;
    if (i < nvec) {
      Vec8 wv = wr[i], o;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 f = __bfloat1622float2(v[k].h[j]);
        float2 g = __bfloat1622float2(wv.h[j]);
        // round the normalised value to bf16 first, then scale by the weight (HF's order)
        float2 n = __bfloat1622float2(__floats2bfloat162_rn(f.x * rstd, f.y * rstd));
        o.h[j] = __floats2bfloat162_rn(n.x * g.x, n.y * g.y);
      }
      orow[i] = o;
    }
  }
}

__global__ void silu_mul_kernel(const bf16* __restrict__ gu, bf16* __restrict__ out, int I) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.y;
  const Vec8* g = reinterpret_cast<const Vec8*>(gu + t * 2 * I);
  const Vec8* u = reinterpret_cast<const Vec8*>(gu + t * 2 * I + I);
  Vec8* o = reinterpret_cast<Vec8*>(out + t * I);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= I / kVec) return;
  Vec8 gv = g[i], uv = u[i], ov;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float2 a = __bfloat1622float2(gv.h[j]);
    float2 b = __bfloat1622float2(uv.h[j]);
    a.x = a.x / (1.f + __expf(-a.x));
    a.y = a.y / (1.f + __expf(-a.y));
    ov.h[j] = __floats2bfloat162_rn(a.x * b.x, a.y * b.y);
  }
  o[i] = ov;
}

}  // namespace

void embedding_lookup(const bf16* table, const int32_t* ids, bf16* out, int T, int H, cudaStream_t s) {
  OI_CHECK(H % kVec == 0, "embedding_lookup: hidden size " << H << " is not a multiple of 8");
  if (T == 0) return;
  OI_CUDA_CHECK(launch_kernel(true, embedding_kernel, dim3(T), dim3(128), 0, s, nullptr, table, ids, out, H, (int64_t)H));
}

void gather_rows(const bf16* x, const int32_t* idx, bf16* out, int R, int H, cudaStream_t s, int64_t out_stride) {
  OI_CHECK(H % kVec == 0, "gather_rows: hidden size " << H << " is not a multiple of 8");
  OI_CHECK(out_stride == 0 || (out_stride >= H && out_stride % kVec == 0), "gather_rows: bad output stride " << out_stride);
  if (R == 0) return;
  // a gather is the same access pattern
  OI_CUDA_CHECK(launch_kernel(true, embedding_kernel, dim3(R), dim3(128), 0, s, nullptr, x, idx, out, H,
                              out_stride ? out_stride : (int64_t)H));
}

void rmsnorm(const bf16* x, const bf16* w, bf16* out, int T, int H, float eps, cudaStream_t s) {
  OI_CHECK(H % kVec == 0 && H <= kMaxVec * kVec * kNormThreads,
           "rmsnorm: hidden size " << H << " must be a multiple of 8 and at most " << kMaxVec * kVec * kNormThreads);
  if (T == 0) return;
  OI_CUDA_CHECK(launch_kernel(true, rmsnorm_kernel, dim3(T), dim3(kNormThreads), 0, s, nullptr, x, w, out, H, eps));
}

void silu_mul(const bf16* gu, bf16* out, int T, int I, cudaStream_t s) {
  OI_CHECK(I % kVec == 0, "silu_mul: intermediate size " << I << " is not a multiple of 8");
  if (T == 0) return;
  const int threads = 256;
  dim3 grid((I / kVec + threads - 1) / threads, T);
  OI_CUDA_CHECK(launch_kernel(true, silu_mul_kernel, grid, dim3(threads), 0, s, nullptr, gu, out, I));
}

namespace {
__global__ void feed_tokens_kernel(int32_t* ids, const int32_t* prev_rows, const int32_t* prev_tokens, int B) {
  pdl_wait();
  pdl_trigger();
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < B && prev_rows[b] >= 0) ids[b] = prev_tokens[prev_rows[b]];
}
}  // namespace

void feed_tokens(int32_t* ids, const int32_t* prev_rows, const int32_t* prev_tokens, int B, cudaStream_t s) {
  if (B <= 0) return;
  // Follows the step's metadata copy: the attribute has no effect there.
  OI_CUDA_CHECK(launch_kernel(false, feed_tokens_kernel, dim3((B + 255) / 256), dim3(256), 0, s, nullptr, ids,
                              prev_rows, prev_tokens, B));
}

}  // namespace oi
