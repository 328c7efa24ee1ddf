#include <algorithm>

#include "hash.cuh"
#include "random_init.cuh"

namespace oi {
namespace {

__device__ __forceinline__ float unit(uint64_t h) { return ((float)(h >> 40) + 0.5f) * 5.9604644775390625e-08f; }

__global__ void fill_kernel(bf16* dst, int64_t n, uint64_t seed, float a, float b, bool normal) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint64_t h = mix64(seed * 0x9E3779B97F4A7C15ull + (uint64_t)i);
    float v;
    if (normal) {
      const float u1 = unit(h), u2 = unit(mix64(h ^ 0xD1B54A32D192ED03ull));
      v = a + b * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    } else {
      v = a + b * (2.f * unit(h) - 1.f);
    }
    dst[i] = __float2bfloat16(v);
  }
}

void launch(bf16* dst, int64_t n, uint64_t seed, float a, float b, bool normal, cudaStream_t s) {
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65536);
  fill_kernel<<<(unsigned)blocks, threads, 0, s>>>(dst, n, seed, a, b, normal);
  OI_LAUNCH_CHECK("fill_kernel");
}

}  // namespace

void fill_normal(bf16* dst, int64_t n, uint64_t seed, float mean, float std, cudaStream_t s) {
  launch(dst, n, seed, mean, std, true, s);
}
void fill_uniform(bf16* dst, int64_t n, uint64_t seed, float center, float half_width, cudaStream_t s) {
  launch(dst, n, seed, center, half_width, false, s);
}

}  // namespace oi
