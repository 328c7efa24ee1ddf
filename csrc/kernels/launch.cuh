// Kernel launches with programmatic dependent launch (PDL, sm_90+). A kernel launched "early" may start
// while the previous kernel in the stream is still running: it does its independent work first (a GEMV
// requests its first round of weights), then `pdl_wait()` blocks until the previous grid has finished
// and its writes are visible. Rules:
//  - before its wait a kernel reads only memory that no kernel writes once the weights are loaded (the
//    engine synchronizes after loading) or that only kernels known to be complete wrote (the decode
//    attention's step metadata and K/V of earlier steps: attention.cu), and writes nothing;
//  - every grid launched early waits in every thread before it touches memory that an earlier kernel
//    writes (or reads, where it writes) and before it exits, so it finishes only after its predecessor:
//    the chain is transitive. Kernels launched normally are fully serialized anyway; the kernels here
//    call `pdl_wait()` either way, which costs nothing without the attribute;
//  - `pdl_trigger()` (lets the next kernel launch) comes right after the wait: one kernel runs ahead;
//  - early launch only where the block placement stays balanced. The scheduler places an early grid's
//    blocks wherever the running kernel leaves room, so a grid of many small blocks piles onto a few
//    SMs (decode attention early cost ~0.8 ms per 4B step at batch 64; it goes early up to 8 items,
//    attention.cu); GEMVs, at most 3 blocks per SM by registers, gain;
//  - never right after a library (cuBLASLt) kernel, which may trigger its dependents at its start
//    (another ~1 ms at batch 64). Measurements: docs/benchmarks.md, "Programmatic dependent launch".
// Graphs capture the attribute as a programmatic edge.
#pragma once
#include <utility>

#include "../common.h"

namespace oi {

// Per host thread (an engine launches from the thread that calls it and sets the switch from its
// options first; benchmarks flip it for A/B). The header is host-includable (the bindings set the
// switch); the device half is for nvcc only.
inline bool& pdl_enabled() {
  static thread_local bool on = true;
  return on;
}

// Set by the GEMM wrapper after each library launch, consumed by the thread's next launch below (an
// engine launches on one stream).
inline bool& pdl_follows_library() {
  static thread_local bool v = false;
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
