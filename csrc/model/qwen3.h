// Qwen3 dense forward over one step's flat token batch. Owns no memory: weights, activations and the
// KV pool belong to the Engine; this file only orders the kernels and GEMMs.
#pragma once
#include <vector>

#include "../gemm/gemm.h"
#include "../kernels/attention.cuh"
#include "../kernels/persistent.cuh"
#include "../kernels/rope_kv.cuh"
#include "../kernels/sampling.cuh"

namespace oi {

struct ModelDims {
  int hidden, intermediate, layers, heads, kv_heads, head_dim, vocab;
  float eps;
  double rope_theta;
  bool tied;
  int qkv_rows() const { return (heads + 2 * kv_heads) * head_dim; }
};

struct Weights {
  bf16* embed = nullptr;
  bf16* lm_head = nullptr;  // == embed when tied
  bf16* final_norm = nullptr;
  std::vector<LayerWeights> layers;
  const LayerWeights* dev_layers = nullptr;  // a device copy of `layers` for persistent_layers()
};

// Activation buffers sized for the largest step (max tokens, max sampled rows).
struct Activations {
  bf16 *x = nullptr, *h = nullptr, *qkv = nullptr, *attn = nullptr, *gu = nullptr, *act = nullptr;
  bf16 *xs = nullptr, *hs = nullptr;  // sampled rows
  float* logits = nullptr;
  float *ws_o = nullptr, *ws_lse = nullptr;  // attention split workspace
  int* attn_counters = nullptr;               // per (work item, KV head), zeroed once
  float* layer_ws = nullptr;                  // persistent_layers(): attention partials and LL words
};

// Device pointers to one step's metadata (see docs/architecture.md for their meaning).
struct StepMeta {
  int T, B, S, bt_stride, num_work, max_rows, num_splits;
  const int32_t *ids, *positions, *slots, *context_lens, *block_tables, *sample_idx, *sample_pos;
  const float *temperature, *top_p;
  const int32_t* top_k;
  const uint64_t* seeds;
  const AttnWork* work;
  int num_logprobs;
  bool fuse_rope;  // decode buckets: q/k norm + RoPE + K/V write inside the attention kernel
  int32_t *out_tokens, *out_top_ids;
  float *out_logprobs, *out_top_logprobs;
};

// Profiling only (outputs are wrong while set): bit 0 skips the q/k norm + RoPE + KV write (its kernel,
// or its part of decode attention), bit 1 the attention (in decode buckets the RoPE work inside it
// too), so a benchmark can read their share of a step.
int& model_skip_kernels();

void qwen3_forward(const ModelDims& d, const Weights& w, const Activations& act, const StepMeta& m,
                   const float2* rope, bf16* kv_cache, const KvLayout& kv, Gemm& gemm, int num_sms, cudaStream_t s);

}  // namespace oi
