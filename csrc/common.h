// Shared helpers for every CUDA file: error checks that carry file:line, bf16 conversions.
// No pybind11 or Python headers here (kernels must stay framework-free).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace oi {

using bf16 = __nv_bfloat16;

// Byte offsets of staged step metadata: every array starts on a 256-byte boundary.
constexpr size_t kStageAlign = 256;
inline size_t align_up(size_t x) { return (x + kStageAlign - 1) / kStageAlign * kStageAlign; }

[[noreturn]] inline void fail(const std::string& what, const char* file, int line) {
  std::ostringstream os;
  os << what << " (" << file << ":" << line << ")";
  throw std::runtime_error(os.str());
}

[[noreturn]] inline void fail_cuda(cudaError_t e, const char* expr, const char* file, int line) {
  std::ostringstream os;
  os << "CUDA error " << cudaGetErrorName(e) << ": " << cudaGetErrorString(e) << " in " << expr;
  fail(os.str(), file, line);
}

}  // namespace oi

#define OI_CUDA_CHECK(expr)                                              \
  do {                                                                   \
    cudaError_t oi_e_ = (expr);                                          \
    if (oi_e_ != cudaSuccess) ::oi::fail_cuda(oi_e_, #expr, __FILE__, __LINE__); \
  } while (0)

// After every launch: catches bad configurations at once (asynchronous faults surface at the next sync).
#define OI_LAUNCH_CHECK(name)                                            \
  do {                                                                   \
    cudaError_t oi_e_ = cudaGetLastError();                              \
    if (oi_e_ != cudaSuccess) ::oi::fail_cuda(oi_e_, "launch of " name, __FILE__, __LINE__); \
  } while (0)

#define OI_CHECK(cond, msg)                                              \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::ostringstream oi_os_;                                         \
      oi_os_ << msg;                                                     \
      ::oi::fail(oi_os_.str(), __FILE__, __LINE__);                      \
    }                                                                    \
  } while (0)
