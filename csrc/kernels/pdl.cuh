// Programmatic dependent launch (Hopper): a kernel launched with launch_pdl may start while its
// predecessor in the stream is still finishing, so its launch and its independent reads (weights)
// overlap the predecessor's tail. Such a kernel calls pdl_wait() before touching any buffer an earlier
// kernel writes or reads, and pdl_release() once it is past that wait (releasing its own successor).
#pragma once
#include <cstdlib>
#include <utility>

#include "../common.h"

namespace oi {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Off with OPENINFER_PDL=0 (read once): plain stream-ordered launches, for comparison.
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("OPENINFER_PDL");
    return !(e && e[0] == '0');
  }();
  return on;
}

template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  OI_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace oi
