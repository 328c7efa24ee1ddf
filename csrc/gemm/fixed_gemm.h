// The batch-invariant GEMM (fixed_gemm.cu): Y[M, N] = X[M, K] · W[N, K]^T (+ Y), whose rows do not depend on
// M (--deterministic). accumulate: Y += X·Wᵀ; out_f32: Y is fp32 (logits).
#pragma once
#include "../common.h"

namespace oi {

// config: the kernel family (-1: chosen from M and N; 0-1 the few-row kernel with 8 or 16 rows per warp,
// 2-3 the tiled kernel at 64 x 64 and 128 x 128); tests run every family on the same rows to show that the
// choice never changes a bit.
void fixed_gemm(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
                cudaStream_t s, int config = -1);
constexpr int kFixedGemmConfigs = 4;
// The most rows the few-row kernel takes when the family is chosen from M (beyond it the tiled kernel).
constexpr int kFixedGemmFewRows = 64;

}  // namespace oi
