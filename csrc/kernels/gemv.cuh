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

// Which kernel does the dot products. The engine always asks for kAuto (the measured rule in gemv.cu);
// tests force each kernel at every shape and compare them.
enum class GemvKernel {
  kAuto = 0,
  kCudaCores = 1,      // input staged as fp32 where that keeps as many blocks per SM, else bf16
  kCudaCoresBf16 = 2,  // input staged as bf16
  kTensorCores = 3,    // the MMA-diagonal kernel (bf16 input)
};

struct GemvArgs {
  const bf16* x;       // [M, K]
  const bf16* norm_w;  // [K] for kRmsNorm
  float eps;
  const bf16* W;       // [N, K]
  void* y;             // [M, N]: bf16, or fp32 for kF32
  int M, N, K;
  GemvKernel kernel = GemvKernel::kAuto;
};

// From 3 rows on cuBLASLt's tensor cores win: this kernel's CUDA-core FMAs bound it (the 4-row version
// reached half the memory floor; docs/benchmarks.md has the A/B).
constexpr int kGemvMaxRows = 2;

// False (and nothing launched) when the shape does not suit the kernel (M > 2, K not a multiple of 256,
// staged input too large); the caller then takes the cuBLASLt path.
bool gemv(const GemvArgs& a, GemvIn in, GemvOut out, int num_sms, cudaStream_t s);

// Whether gemv() takes the tensor-core kernel for this shape and kernel choice (host only).
bool gemv_takes_tensor_cores(int M, int K, GemvIn in, GemvOut out, GemvKernel kernel = GemvKernel::kAuto);

}  // namespace oi
