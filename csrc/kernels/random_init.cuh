// Seeded random weights made on the GPU (load_format="random"): no file, same values for the same seed.
#pragma once
#include "../common.h"

namespace oi {

// dst[i] = mean + std * N(0,1)  (Box-Muller on a counter hash of (seed, i))
void fill_normal(bf16* dst, int64_t n, uint64_t seed, float mean, float std, cudaStream_t s);
// dst[i] = center + U(-half_width, half_width)
void fill_uniform(bf16* dst, int64_t n, uint64_t seed, float center, float half_width, cudaStream_t s);

}  // namespace oi
