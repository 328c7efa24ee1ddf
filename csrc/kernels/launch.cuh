// Kernel launches with programmatic dependent launch (PDL, sm_90+). A kernel launched "early" may start
// while the previous kernel in the stream is still running: it does its independent work first (a GEMV
// requests its first round of weights), then `pdl_wait()` blocks until the previous grid has finished
// and its writes are visible. Rules:
//  - before its wait a kernel reads only memory that no kernel writes once the weights are loaded (the
//    engine synchronizes after loading), and writes nothing;
//  - every kernel launched here calls `pdl_wait()` in every thread before it touches memory that an
//    earlier kernel writes (or reads, where it writes): a grid finishes only after its own wait, so the
//    chain is transitive even through kernels launched without the attribute;
//  - `pdl_trigger()` (lets the next kernel launch) comes right after the wait: one kernel runs ahead;
//  - early launch only where the block placement stays balanced. The scheduler places an early grid's
//    blocks wherever the running kernel leaves room, so a grid of many small blocks piles onto a few SMs:
//    4B at batch 64, 6.75 ms per step with decode attention early against 5.97 without (5.8-5.9 with
//    PDL off). GEMVs (at most 3 blocks per SM by registers) gain: 63.6 -> 57.0 us per 4B layer.
//  - never right after a library (cuBLASLt) kernel, which may trigger its dependents at its start:
//    7.85 ms at batch 64 with those kernels early, 6.75 without (bench/results/pdl_ab_h200_2026-11-30.json).
// Without the attribute the wait and trigger are no-ops; graphs capture the attribute as a
// programmatic edge.
#pragma once
#include <utility>

#include "../common.h"

namespace oi {

// Process-wide (the engine sets it from its options before it launches; benchmarks flip it for A/B).
// The header is host-includable (the bindings set the switch); the device half is for nvcc only.
inline bool& pdl_enabled() {
  static bool on = true;
  return on;
}

// Set by the GEMM wrapper after each library launch, consumed by the next launch below (one stream).
inline bool& pdl_follows_library() {
  static bool v = false;
  return v;
}

#ifdef __CUDACC__
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#endif

// Launches `kernel` on `s`; `early` asks for PDL (granted when enabled and not right after a library
// kernel); `extra` adds one more attribute (a cluster shape) when given. Call it inside OI_CUDA_CHECK so
// that errors carry the caller's file:line.
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel(bool early, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                          const cudaLaunchAttribute* extra, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (early && pdl_enabled() && !pdl_follows_library()) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  pdl_follows_library() = false;
  if (extra) attrs[n++] = *extra;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace oi
