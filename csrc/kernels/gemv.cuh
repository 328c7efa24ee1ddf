// Small-batch GEMM (M <= 4 rows: decode) reading each weight once at full memory bandwidth, with the
// neighbouring element-wise work fused so that it costs no extra pass: RMSNorm of the input (prologue),
// SiLU(gate)·up of the input (prologue), residual add or fp32 output (epilogue).
//   y[m, n] (+)= sum_k x_eff[m, k] * W[n, k]
#pragma once
#include "../common.h"

namespace oi {

enum class GemvIn { kPlain = 0, kRmsNorm = 1, kSiluMul = 2 };
enum class GemvOut { kStore = 0, kAccumulate = 1, kF32 = 2 };

struct GemvArgs {
  const bf16* x;       // [M, K], or [M, 2K] (gate then up) for kSiluMul
  const bf16* norm_w;  // [K] for kRmsNorm
  float eps;
  const bf16* W;       // [N, K]
  void* y;             // [M, N]: bf16, or fp32 for kF32
  int M, N, K;
};

// Above 4 rows the CUDA-core FMAs, not memory, bound this kernel; cuBLASLt's tensor cores win there.
constexpr int kGemvMaxRows = 4;

// False (and nothing launched) when the shape does not suit the kernel (M > 4, staged input too large);
// the caller then takes the cuBLASLt path.
bool gemv(const GemvArgs& a, GemvIn in, GemvOut out, int num_sms, cudaStream_t s);

}  // namespace oi
