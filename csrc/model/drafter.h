// The DFlash / DSpark drafter's forward (openinfer/reference/drafter.py is its NumPy oracle; the design is
// in docs/architecture.md, "Speculative decoding"). Two passes, both ordered here over memory the Engine
// owns:
//  - context: each committed token's target residual streams after the tap layers, [T, taps * H], become
//    c = hidden_norm(fc(.)); every drafter layer projects c with its k/v projections (+ k_norm, RoPE) into
//    the drafter's paged KV pool, which shares the target's block ids (a prefix hit serves both models);
//  - block: D sequences' blocks [anchor, mask, ...] at positions p.. through the drafter's layers, the
//    block attending to its context (positions < p) and to the whole block without a causal mask; then
//    the final norm, the target's lm_head and the sampler (left to right with the Markov head's term).
#pragma once
#include <vector>

#include "qwen3.h"

namespace oi {

constexpr int kMaxDraftBlock = 16;  // the largest draft block (z-lab's)

// The drafter's geometry: its layers have the target's head layout, hidden and intermediate sizes.
struct DrafterDims {
  int layers = 0;
  int block_size = 0;   // tokens per block: anchor + masks
  int first_slot = 0;   // block slot of the first draft (z-lab: 1, DeepSpec: 0)
  int num_drafts = 0;   // block_size - first_slot
  int mask_token = 0;
  int markov_rank = 0;  // 0: no Markov head
  std::vector<int> taps;  // target layers whose residual streams make the context features
};

struct DrafterWeights {
  std::vector<LayerWeights> layers;
  bf16 *fc = nullptr, *hidden_norm = nullptr, *norm = nullptr;  // fc: [H, taps * H]
  bf16 *markov_w1 = nullptr, *markov_w2 = nullptr;               // [V, rank] each
};

// One chunk of drafting sequences' block pass (device pointers unless noted). Token rows are d * block +
// i for sequence d of the chunk; draft rows are slot-major, j * D + d (slot j's rows are contiguous, so
// the Markov pass samples a slot of every sequence at once).
struct DraftBlock {
  int D = 0;                      // sequences in the chunk
  const int32_t *ids, *positions;  // [D * block] anchor and mask ids; positions p + i (RoPE, cache slots)
  const int32_t *mask_pos, *slots; // [D * block] p + block - 1 for every row (no causal mask in the block)
  const int32_t* context_lens;     // [B] p + block for each drafting sequence (its other entries unused)
  const int32_t* block_tables;     // [B, bt_stride] the step's
  int bt_stride;
  const AttnWork* work;            // items of sequence index b (the step's) over the chunk's token rows
  int num_work, max_rows, num_splits;
  const int32_t* rows;             // [num_drafts * D] token row of each draft row
  const int32_t* anchors;          // [D]
  const float *temperature, *top_p;  // [num_drafts * D] the anchor row's parameters
  const int32_t *top_k, *sample_pos;
  const uint64_t* seeds;
  int32_t* tokens;                 // [num_drafts * D] out
  float* logprobs;                 // [num_drafts * D] out (scratch)
  bf16* markov_u;                  // [D, rank] scratch
  float2* markov_part;             // [2 * num_sms * kMaxMarkovSeqs] scratch of the one-launch pass
  unsigned* markov_sync;           // [2] its barrier (zeroed once)
};

// The context pass over a step's T tokens: feats [T, taps * H] (the target's residual streams).
void drafter_context(const ModelDims& d, const DrafterDims& dd, const DrafterWeights& w, const Activations& a,
                     const bf16* feats, const int32_t* positions, const int32_t* slots, int T, const float2* rope,
                     bf16* kv_cache, const KvLayout& kv, Gemm& gemm, int num_sms, cudaStream_t s);

// The block pass of one chunk; embed / lm_head are the target's.
void drafter_block(const ModelDims& d, const DrafterDims& dd, const DrafterWeights& w, const bf16* embed,
                   const bf16* lm_head, const Activations& a, const DraftBlock& b, const float2* rope, bf16* kv_cache,
                   const KvLayout& kv, Gemm& gemm, int num_sms, cudaStream_t s);

}  // namespace oi
