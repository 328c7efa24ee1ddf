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
    __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&raw.x), b = *reinterpret_cast<__nv_bfloat162*>(&raw.y);
    const bool is_v = h >= nH + nKV;
    if (!is_v) {
      float x[4] = {__low2float(a), __high2float(a), __low2float(b), __high2float(b)};
      float ss = x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      const float rstd = rsqrtf(ss / kD + eps);
      const bf16* w = (h < nH ? qw : kw) + lane * 4;
      float y[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) y[i] = __bfloat162float(__float2bfloat16(__bfloat162float(__float2bfloat16(x[i] * rstd)) * __bfloat162float(w[i])));
      // neox rotation pairs dim d with d + 64: lane l holds d = 4l.., lane l^16 holds the partner
      const float2* cs = cos_sin + (int64_t)pos * (kD / 2) + (lane & 15) * 4;
      float r[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float other = __shfl_xor_sync(0xffffffffu, y[i], 16);
        const float2 c = cs[i];
        r[i] = lane < 16 ? y[i] * c.x - other * c.y : y[i] * c.x + other * c.y;
      }
      a = __floats2bfloat162_rn(r[0], r[1]);
      b = __floats2bfloat162_rn(r[2], r[3]);
      raw.x = *reinterpret_cast<uint32_t*>(&a);
      raw.y = *reinterpret_cast<uint32_t*>(&b);
    }
    if (h < nH) {
      *reinterpret_cast<uint2*>(src) = raw;
    } else if (slot >= 0) {
      const int kvh = is_v ? h - nH - nKV : h - nH;
      const int64_t page = slot / kv.block_size, off = slot % kv.block_size;
      bf16* dst = cache + page * kv.block_stride() + layer * kv.layer_stride() +
                  (int64_t)(is_v ? 1 : 0) * nKV * kv.block_size * kD + ((int64_t)kvh * kv.block_size + off) * kD + lane * 4;
      *reinterpret_cast<uint2*>(dst) = raw;
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
