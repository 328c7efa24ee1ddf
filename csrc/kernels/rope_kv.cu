#include <cmath>
#include <vector>

#include "launch.cuh"
#include "rope_kv.cuh"

namespace oi {
namespace {

constexpr int kD = 128;  // Qwen3 head_dim; every lane owns 4 consecutive dims

__global__ void rope_table_kernel(float2* cos_sin, const float* inv_freq, int max_pos, int half) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= (int64_t)max_pos * half) return;
  const int p = i / half, j = i % half;
  const float f = (float)p * inv_freq[j];
  float sn, cs;
  sincosf(f, &sn, &cs);  // precise path: arguments reach tens of thousands of radians
  cos_sin[i] = make_float2(cs, sn);
}

__global__ void qk_norm_rope_kv_kernel(bf16* __restrict__ qkv, const bf16* __restrict__ qw,
                                       const bf16* __restrict__ kw, const int32_t* __restrict__ positions,
                                       const int32_t* __restrict__ slots, const float2* __restrict__ cos_sin,
                                       bf16* __restrict__ cache, int layer, KvLayout kv, int nH, float eps) {
  pdl_wait();  // qkv comes from the previous kernel
  pdl_trigger();
  const int t = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nKV = kv.num_kv_heads;
  const int heads = nH + 2 * nKV;
  const int pos = positions[t];
  const int slot = slots[t];
  bf16* row = qkv + (int64_t)t * heads * kD;
  {  // one head per warp: no serial chain of heads at small T
    const int h = blockIdx.y * (blockDim.x >> 5) + warp;
    if (h >= heads) return;
    bf16* src = row + h * kD + lane * 4;
    uint2 raw = *reinterpret_cast<const uint2*>(src);
    const bool is_v = h >= nH + nKV;
    if (!is_v) raw = qk_norm_rope_lane(raw, h < nH ? qw : kw, cos_sin + (int64_t)pos * (kD / 2), eps, lane);
    if (h < nH) {
      *reinterpret_cast<uint2*>(src) = raw;
    } else if (slot >= 0) {
      const int kvh = is_v ? h - nH - nKV : h - nH;
      *reinterpret_cast<uint2*>(cache + kv_row_offset(kv, layer, slot, kvh, is_v) + lane * 4) = raw;
    }
  }
}

}  // namespace

void rope_table_init(float2* cos_sin, int max_pos, int head_dim, double theta, cudaStream_t s) {
  const int half = head_dim / 2;
  std::vector<float> inv(half);
  for (int j = 0; j < half; ++j) inv[j] = (float)(1.0 / std::pow(theta, (double)(float)(2 * j) / head_dim));
  float* d_inv = nullptr;
  OI_CUDA_CHECK(cudaMallocAsync(&d_inv, half * sizeof(float), s));
  OI_CUDA_CHECK(cudaMemcpyAsync(d_inv, inv.data(), half * sizeof(float), cudaMemcpyHostToDevice, s));
  const int64_t n = (int64_t)max_pos * half;
  rope_table_kernel<<<(n + 255) / 256, 256, 0, s>>>(cos_sin, d_inv, max_pos, half);
  OI_LAUNCH_CHECK("rope_table_kernel");
  OI_CUDA_CHECK(cudaFreeAsync(d_inv, s));
  OI_CUDA_CHECK(cudaStreamSynchronize(s));
}

void qk_norm_rope_kv_write(bf16* qkv, const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* positions,
                           const int32_t* slot_mapping, const float2* cos_sin, bf16* kv_cache, int layer,
                           const KvLayout& kv, int T, int num_heads, float eps, cudaStream_t s) {
  OI_CHECK(kv.head_dim == kD, "qk_norm_rope_kv_write: head_dim " << kv.head_dim << " is not supported (only 128)");
  if (T == 0) return;
  const int heads = num_heads + 2 * kv.num_kv_heads;
  OI_CUDA_CHECK(launch_kernel(true, qk_norm_rope_kv_kernel, dim3(T, (heads + 7) / 8), dim3(256), 0, s, nullptr, qkv,
                              q_norm_w, k_norm_w, positions, slot_mapping, cos_sin, kv_cache, layer, kv, num_heads,
                              eps));
}

}  // namespace oi
