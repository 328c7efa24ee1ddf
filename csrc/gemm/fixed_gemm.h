// The batch-invariant GEMM of --deterministic (fixed_gemm.cu): Y[M, N] = X[M, K] · W[N, K]^T (+ Y), whose
// rows do not depend on M. accumulate: Y += X·Wᵀ; out_f32: Y is fp32 (logits).
#pragma once
#include "../common.h"

namespace oi {

// config: the tile family (-1: chosen from M and N); tests run every family on the same rows to show
// that the choice never changes a bit.
void fixed_gemm(const bf16* X, const bf16* W, void* Y, int M, int N, int K, bool accumulate, bool out_f32,
                cudaStream_t s, int config = -1);
int fixed_gemm_config(int M, int N);
constexpr int kFixedGemmConfigs = 4;

}  // namespace oi
