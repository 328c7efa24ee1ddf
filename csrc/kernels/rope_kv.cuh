// Per-head q/k RMSNorm + neox RoPE, fused with the paged K/V cache write.
// KV cache layout (docs/architecture.md): [block][layer][K|V][kv_head][block_size][head_dim].
#pragma once
#include "../common.h"

namespace oi {

struct KvLayout {
  int num_layers, num_kv_heads, block_size, head_dim;
  __host__ __device__ int64_t layer_stride() const { return 2LL * num_kv_heads * block_size * head_dim; }
  __host__ __device__ int64_t block_stride() const { return num_layers * layer_stride(); }
};

// cos_sin[p * (D/2) + j] = (cos, sin)(p * inv_freq[j]) in fp32 for p < max_pos (HF's arithmetic).
void rope_table_init(float2* cos_sin, int max_pos, int head_dim, double theta, cudaStream_t s);

// qkv: [T, (nH + 2*nKV) * D] bf16. q heads are normalised + rotated in place; k heads are normalised,
// rotated and written to the cache; v heads are copied to the cache. slot_mapping[t] < 0 skips the write.
void qk_norm_rope_kv_write(bf16* qkv, const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* positions,
                           const int32_t* slot_mapping, const float2* cos_sin, bf16* kv_cache, int layer,
                           const KvLayout& kv, int T, int num_heads, float eps, cudaStream_t s);

}  // namespace oi
