// Small-batch GEMM (M <= 2 rows: decode) reading each weight once at full memory bandwidth, with the
// neighbouring element-wise work fused so that it costs no extra pass: RMSNorm of the input (prologue);
// residual add, fp32 output, or SiLU(gate)·up of the two output halves (epilogue).
//   y[m, n] (+)= sum_k x_eff[m, k] * W[n, k]
#pragma once
#include "../common.h"

namespace oi {

enum class GemvIn { kPlain = 0, kRmsNorm = 1 };
// kSiluMul: W is [gate; up] (2I rows); y[m, i] = SiLU(gate_i) * up_i, each rounded to bf16 first, [M, I].
enum class GemvOut { kStore = 0, kAccumulate = 1, kF32 = 2, kSiluMul = 3 };

struct GemvArgs {
  const bf16* x;       // [M, K]
  const bf16* norm_w;  // [K] for kRmsNorm
  float eps;
  const bf16* W;       // [N, K]
  void* y;             // [M, N]: bf16, or fp32 for kF32
  int M, N, K;
};

// From 3 rows on cuBLASLt's tensor cores win: this kernel's CUDA-core FMAs bound it (the 4-row version
// reached half the memory floor; docs/benchmarks.md has the A/B).
constexpr int kGemvMaxRows = 2;

// False (and nothing launched) when the shape does not suit the kernel (M > 2, K not a multiple of 256,
// staged input too large); the caller then takes the cuBLASLt path.
bool gemv(const GemvArgs& a, GemvIn in, GemvOut out, int num_sms, cudaStream_t s);

// A/B switch (default 1): the fused kernel's input staged as fp32 where it fits (kernels/gemv.cu); set
// before an engine captures its graphs.
int& gemv_fp32_input();

// The GEMV's dot products on the tensor cores (gemv_tc_kernel): 0 never, 1 (default) where they measured
// faster (gemv.cu), 2 always (tests); set before an engine captures its graphs.
int& gemv_tensor_cores();

// Whether gemv() takes the tensor-core kernel for this shape under the current mode (host only).
bool gemv_takes_tensor_cores(int M, int K, GemvIn in, GemvOut out);

}  // namespace oi
