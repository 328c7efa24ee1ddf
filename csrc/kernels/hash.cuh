// Counter-based random numbers shared by the sampler and the random-weight generator.
#pragma once
#include <cstdint>

namespace oi {

// splitmix64 finaliser (docs/architecture.md, "Sampling")
__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

}  // namespace oi
