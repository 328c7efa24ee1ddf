// Programmatic dependent launch (PDL, sm_90+). A kernel launched with the attribute may start while the
// previous kernel in the stream is still running: it does its independent work first (a GEMV requests
// its weights), then `pdl_wait()` blocks until the previous grid has finished and its writes are
// visible. Every kernel launched through `launch_pdl` must call `pdl_wait()` in every thread before it
// touches memory that an earlier kernel writes, or that an earlier kernel reads and it writes; since a
// grid finishes only after its own wait, the chain is transitive. `pdl_trigger()` lets the next kernel
// launch; we call it right after the wait, so at most one kernel runs ahead. Without the attribute both
// are no-ops, and the attribute is captured into CUDA graphs as a programmatic edge.
#pragma once
#include <utility>

#include "../common.h"

namespace oi {

// Process-wide switch (the engine sets it from its options; benchmarks flip it for A/B runs). The header
// is host-includable (the bindings set the switch); the device half is for nvcc only.
inline bool& pdl_enabled() {
  static bool on = true;
  return on;
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

// Launches `kernel` on `s`, with the PDL attribute when enabled; `extra` adds one more attribute (a
// cluster shape) when given. Call it inside OI_CUDA_CHECK so that errors carry the caller's file:line.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                       const cudaLaunchAttribute* extra, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (pdl_enabled()) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (extra) attrs[n++] = *extra;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace oi
