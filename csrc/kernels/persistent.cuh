// Every decoder layer of a batch-1 decode step in one persistent kernel (one block per SM), the default for
// batch-1 decode buckets where the geometry fits (Qwen3 0.6B-8B).
// Kernel by kernel, memory idles at every dependency: a projection's blocks land only once the previous
// kernel's leave, and the o projection waits for attention. Here each block's copy warp streams the block's
// share of every weight matrix, layer after layer, into a ring of shared-memory stages with bulk copies
// (and, after each layer's qkv stages, the K and V rows its attention split reads), so weights keep
// arriving while the compute warps wait for a projection's input or run attention. Every compute warp works
// on every stage (tensor-core dot products, the MMA diagonal of gemv.cu). Activations pass between blocks
// as LL words (two bf16 and a flag naming step, layer and phase, in one 8-byte store): a reader polls the
// words themselves, so a dependency costs one trip through L2, not a release, a counter and a second read.
// The copy warp keeps ~64 KB per SM in flight: more queues in the memory system ahead of those reads.
#pragma once
#include "../common.h"
#include "rope_kv.cuh"

namespace oi {

struct LayerWeights {
  bf16 *input_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  bf16 *qkv = nullptr, *o = nullptr, *gate_up = nullptr, *down = nullptr;
};

struct PersistentArgs {
  const LayerWeights* layers;  // device array [num_layers]
  int num_layers, hidden, intermediate, heads, kv_heads;
  float eps;
  bf16* x;     // [hidden] residual stream, updated in place
  bf16* kv_cache;
  KvLayout kv;
  const int32_t *positions, *slots, *context_lens, *block_tables;  // row 0 of the step's metadata
  const float2* cos_sin;
  float* ws;      // persistent_ws_floats(): attention split partials, the LL words, the step counter
  uint64_t* trace;  // profiling: [blocks][kPersistentEvents] globaltimer ns of layer kPersistentTraceLayer, or null
};

constexpr int kPersistentEvents = 32;
constexpr int kPersistentTraceLayer = 10;

// Whether the kernel serves this geometry on this device (head_dim 128, 4 query heads per KV head,
// every K a multiple of 256, a weight row or gate/up pair fits a ring slot).
bool persistent_fits(int hidden, int intermediate, int heads, int kv_heads, int head_dim);
// Attention partials, the LL activation words and a step counter; zeroed once at allocation.
int64_t persistent_ws_floats(int hidden, int intermediate, int heads, int kv_heads);

// Launches cooperatively: every block must be resident.
void persistent_layers(const PersistentArgs& a, int num_sms, cudaStream_t s);

}  // namespace oi
