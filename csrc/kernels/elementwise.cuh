// Row-wise kernels of the Qwen3 layer: embedding gather, RMSNorm, SiLU·up, row gather.
// Launchers take raw device pointers and a stream; they check the launch.
#pragma once
#include "../common.h"

namespace oi {

// out[t, :] = table[ids[t], :]            (H % 8 == 0)
void embedding_lookup(const bf16* table, const int32_t* ids, bf16* out, int T, int H, cudaStream_t s);

// out[t] = bf16(w * bf16(x[t] * rsqrt(mean(x[t]^2) + eps)))  -- the rounding points of HF's Qwen3RMSNorm
void rmsnorm(const bf16* x, const bf16* w, bf16* out, int T, int H, float eps, cudaStream_t s);

// out[t, i] = bf16(silu(gu[t, i]) * gu[t, I + i])   (gate rows first, then up rows, as fused at load)
void silu_mul(const bf16* gu, bf16* out, int T, int I, cudaStream_t s);

// out[r * out_stride + :H] = x[idx[r], :]   (the rows that sample, before the final norm and lm_head; the
// tap layers' rows, several layers side by side: out_stride 0 means H)
void gather_rows(const bf16* x, const int32_t* idx, bf16* out, int R, int H, cudaStream_t s, int64_t out_stride = 0);

// ids[b] = prev_tokens[prev_rows[b]] where prev_rows[b] >= 0: a decode step launched before the previous
// step's tokens reached the host takes them on the device.
void feed_tokens(int32_t* ids, const int32_t* prev_rows, const int32_t* prev_tokens, int B, cudaStream_t s);

}  // namespace oi
