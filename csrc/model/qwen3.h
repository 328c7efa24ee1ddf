// Qwen3 dense forward over one step's flat token batch. Owns no memory: weights, activations and the
// KV pool belong to the Engine; this file only orders the kernels and GEMMs.
#pragma once
#include <vector>

#include "../gemm/gemm.h"
#include "../kernels/attention.cuh"
#include "../kernels/gemv.cuh"
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

// Which kernels a step runs where there is a choice. Engines run the defaults (the measured winners);
// tests force the alternatives on eager launches and compare them.
struct KernelChoice {
  bool persistent = true;  // batch-1 decode buckets: every layer in persistent_layers() where it fits
  bool fuse_rope = true;   // decode buckets: q/k norm + RoPE + K/V write inside decode attention
  AttnVariant attention;
  GemvKernel gemv = GemvKernel::kAuto;
};

// The GEMM a linear layer takes: cuBLASLt beyond the GEMV's rows, or the batch-invariant one (fixed_gemm.h)
// at every M and never the GEMV (EngineConfig.deterministic). (Its few-row kernel in place of cuBLASLt at
// 3-64 rows measured slower: docs/benchmarks.md.)
enum class GemmPath : uint8_t { kLibrary, kInvariant };

// Device pointers to one step's metadata (see docs/architecture.md for their meaning).
struct StepMeta {
  int T, B, S, bt_stride, num_work, max_rows, num_splits;
  const int32_t *ids, *positions, *slots, *context_lens, *block_tables, *sample_idx, *sample_pos;
  const float *temperature, *top_p;
  const int32_t* top_k;
  const uint64_t* seeds;
  const AttnWork* work;
  int num_logprobs;
  bool fuse_rope;   // decode buckets: q/k norm + RoPE + K/V write inside the attention kernel
  bool persistent;  // batch-1 decode bucket: every layer in persistent_layers() (the caller checked the fit)
  AttnVariant attention;
  GemvKernel gemv;
  GemmPath gemm_path;  // the GEMM beyond the GEMV's rows (EngineConfig.deterministic: fixed_gemm always)
  int attn_segment;   // AttnArgs::segment (EngineConfig.deterministic), 0 otherwise
  int32_t *out_tokens, *out_top_ids;
  float *out_logprobs, *out_top_logprobs;
  // Verify steps: [B + 1] first sampled row of each sequence (device) and accepted counts [B]; else null.
  const int32_t* seq_rows;
  int32_t* out_accepted;
  // Tap layers: tap_slot[l] (host, [layers]) >= 0 copies the residual stream after layer l of the rows
  // tap_rows [num_tap_rows] to out_taps[r, tap_slot[l], :] ([num_tap_rows, num_taps, hidden]); else null.
  const int* tap_slot;
  int num_taps, num_tap_rows;
  const int32_t* tap_rows;
  bf16* out_taps;
  // The drafter's context features: ctx_slot[l] (host, [layers]) >= 0 copies every row's residual stream
  // after layer l to ctx_feats[t, ctx_slot[l], :] ([T, num_ctx_taps, hidden]); ctx_rows = 0..T-1. Else null.
  const int* ctx_slot;
  int num_ctx_taps;
  const int32_t* ctx_rows;
  bf16* ctx_feats;
  uint64_t* trace;  // persistent_layers() profiling buffer, or null
  // A restore and the chunk that reads it in one launch: layer l starts after layer_ready[l] (host, [layers];
  // null entries do not wait), the event after which layer l of every loaded block is on the device. Else null.
  const cudaEvent_t* layer_ready;
};

// One linear layer: the fused small-batch kernel when the rows fit it, else the separate element-wise
// kernels (through `scratch`) around cuBLASLt. kSiluMul writes SiLU(gate)·up ([M, N/2]) to y.
void linear(GemvIn in, GemvOut out, const bf16* x, const bf16* norm_w, float eps, const bf16* W, void* y, int M, int N,
            int K, bf16* scratch, bf16* gu, Gemm& gemm, int num_sms, GemvKernel kernel, cudaStream_t s,
            GemmPath path = GemmPath::kLibrary);

// The attention arguments every step shares (buffers, geometry); the caller sets the step's own.
AttnArgs attn_args(const ModelDims& d, const Activations& a, bf16* kv_cache, const KvLayout& kv, const float2* rope);

// One decoder layer over T rows, x updated in place (qwen3.cu).
void decoder_layer(const ModelDims& d, const LayerWeights& lw, int l, const Activations& a, AttnArgs& at, int T,
                   const int32_t* rope_pos, const int32_t* slots, bool fuse_rope, Gemm& gemm, int num_sms,
                   GemvKernel gk, cudaStream_t s, GemmPath path = GemmPath::kLibrary);

void qwen3_forward(const ModelDims& d, const Weights& w, const Activations& act, const StepMeta& m,
                   const float2* rope, bf16* kv_cache, const KvLayout& kv, Gemm& gemm, int num_sms, cudaStream_t s);

}  // namespace oi
