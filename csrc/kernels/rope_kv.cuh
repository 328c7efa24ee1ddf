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

// Where token slot `slot`'s K (or V) row of one KV head lives in the cache.
__host__ __device__ inline int64_t kv_row_offset(const KvLayout& kv, int layer, int64_t slot, int kvh, bool is_v) {
  const int64_t page = slot / kv.block_size, off = slot % kv.block_size;
  return page * kv.block_stride() + layer * kv.layer_stride() + (int64_t)(is_v ? 1 : 0) * kv.num_kv_heads * kv.block_size * kv.head_dim +
         ((int64_t)kvh * kv.block_size + off) * kv.head_dim;
}

#ifdef __CUDACC__
// One 128-dim head, 4 dims per lane (lane l holds dims 4l..4l+3), all 32 lanes together: RMSNorm with
// weight `w`, then neox RoPE from the cos/sin row `cs` of the token's position (dim d rotates with
// d + 64, held by lane l ^ 16). Roundings as HF: normalised value to bf16, times the weight to bf16.
// The same with the lane's 4 weights (bf16) and its 4 cos/sin pairs (dims 4 (l % 16) + i) already loaded,
// so that a caller can issue those reads before waiting for the head itself.
__device__ __forceinline__ uint2 qk_norm_rope_vals(uint2 raw, uint2 wv, const float2 (&c)[4], float eps, int lane) {
  const __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&raw.x), b = *reinterpret_cast<__nv_bfloat162*>(&raw.y);
  const float x[4] = {__low2float(a), __high2float(a), __low2float(b), __high2float(b)};
  const __nv_bfloat162 wa = *reinterpret_cast<__nv_bfloat162*>(&wv.x), wb = *reinterpret_cast<__nv_bfloat162*>(&wv.y);
  const float wf[4] = {__low2float(wa), __high2float(wa), __low2float(wb), __high2float(wb)};
  float ss = x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float rstd = rsqrtf(ss / 128 + eps);
  float y[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) y[i] = __bfloat162float(__float2bfloat16(__bfloat162float(__float2bfloat16(x[i] * rstd)) * wf[i]));
  float r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float other = __shfl_xor_sync(0xffffffffu, y[i], 16);
    r[i] = lane < 16 ? y[i] * c[i].x - other * c[i].y : y[i] * c[i].x + other * c[i].y;
  }
  __nv_bfloat162 p = __floats2bfloat162_rn(r[0], r[1]), q = __floats2bfloat162_rn(r[2], r[3]);
  return make_uint2(*reinterpret_cast<uint32_t*>(&p), *reinterpret_cast<uint32_t*>(&q));
}
__device__ __forceinline__ uint2 qk_norm_rope_lane(uint2 raw, const bf16* w, const float2* cs, float eps, int lane) {
  const uint2 wv = *reinterpret_cast<const uint2*>(w + lane * 4);
  cs += (lane & 15) * 4;
  const float2 c[4] = {cs[0], cs[1], cs[2], cs[3]};
  return qk_norm_rope_vals(raw, wv, c, eps, lane);
}
#endif

// cos_sin[p * (D/2) + j] = (cos, sin)(p * inv_freq[j]) in fp32 for p < max_pos (HF's arithmetic).
void rope_table_init(float2* cos_sin, int max_pos, int head_dim, double theta, cudaStream_t s);

// qkv: [T, (nH + 2*nKV) * D] bf16. q heads are normalised + rotated in place; k heads are normalised,
// rotated and written to the cache; v heads are copied to the cache. slot_mapping[t] < 0 skips the write.
void qk_norm_rope_kv_write(bf16* qkv, const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* positions,
                           const int32_t* slot_mapping, const float2* cos_sin, bf16* kv_cache, int layer,
                           const KvLayout& kv, int T, int num_heads, float eps, cudaStream_t s);

}  // namespace oi
