// Causal attention over the paged KV cache, one tensor-core kernel for prefill chunks and decode rows.
// A work item is (sequence, first token, token count); a block serves one item, one KV head and one
// split of the key range, with every query head of that KV head's group, so each K/V tile is read
// once per group. Long contexts are split across blocks (flash-decoding): decode splits merge inside
// thread-block clusters through distributed shared memory, and between clusters the last block to
// finish merges the partials from a global workspace; launches without clusters (prefill chunks,
// verify steps) write theirs to the workspace for a merge kernel.
#pragma once
#include "../common.h"
#include "rope_kv.cuh"

namespace oi {

struct AttnWork {
  int32_t seq, tok_start, num_tok;
  // Tokens of the sequence before the item in this step (a chunk cut into several items): their keys are this
  // step's, so an early (PDL) launch requests none of them before its wait.
  int32_t lead;
};

// Kernel choice for decode rows. The defaults are what the engine runs; tests force the other kernels
// (the one-warp blocks and the workspace merge, which devices without clusters, e.g. under MPS or small
// MIG slices, take) and compare them.
struct AttnVariant {
  bool key_warps = true;  // decode blocks of kAttnKeyWarps warps splitting the keys, where clusters exist
  int cluster_cap = 0;    // > 0: decode clusters of at most this many blocks (0: the device's limit)
  // Prompt chunks on Hopper through the wgmma kernel (attention_sm90.cu): 1 where it takes the launch (the default),
  // 0 off (the mma.sync kernel: A/B and reference tests), 2 forced also for items of up to 16 rows (layout tests; the
  // caller checks prefill_wgmma_takes first).
  int prefill_wgmma = 1;
};

struct AttnArgs {
  const bf16* q;             // q of token t, head h at q + t * q_stride + h * 128
  int q_stride;
  bf16* kv_cache;               // read; written only with fuse_rope
  KvLayout kv;
  int layer;
  const int32_t* block_tables;  // [B, bt_stride]
  int bt_stride;
  const int32_t* positions;     // [T]
  const int32_t* context_lens;  // [B]
  const AttnWork* work;         // [num_work]
  int num_work;
  int num_tokens;               // T
  int num_heads;                // query heads
  int num_splits;               // >= 1; > 1 needs the workspace
  int max_rows;                 // max over items of num_tok * group size (picks the block width)
  bf16* out;                    // [T, num_heads * 128]
  float* ws_o;                  // [num_splits, T, num_heads, 128]
  float* ws_lse;                // [num_splits, T, num_heads]
  int* counters;                // [num_work * num_kv_heads], zero; cluster splits > 1 only (left zero after)
  // Decode steps only (every item one token, max_rows == group <= 16): q/k RMSNorm + RoPE and the K/V
  // write happen here instead of in qk_norm_rope_kv_write, a kernel fewer per layer; `q` then points at
  // the raw qkv rows ([T, (heads + 2 kv_heads) * 128]) and the new K/V are made from there.
  bool fuse_rope;
  const bf16 *q_norm_w, *k_norm_w;  // [128]
  const float2* cos_sin;            // rope_table_init's table
  const int32_t* slots;             // [T]; < 0: no cache write
  float eps;
  AttnVariant variant;
  // > 0: chunk-invariant keys (steps with prompt tokens): each row's keys are taken in fixed segments of this
  // many keys from position 0, every segment from a fresh softmax state, folded in segment order with pinned
  // arithmetic; num_splits is 1 (the block folds as it goes) or attn_segment_splits' count (a split per
  // segment, folded by the merge kernel). A row's result then depends on its position and keys only: not on
  // the item it shares, the split count, the rows per block or the other sequences of the step.
  int segment = 0;
  // Keys below an item's first position that the step itself writes (the drafter's block: every row sits at
  // the block's last position, block - 1 keys past its first): an early (PDL) launch requests none of them
  // before its wait, which the kernel writing them may not have passed.
  int own_keys_below = 0;
};

// query rows (tokens x group heads) per block: 8 warps x 16. Prompt chunks of the 4B at 1,024 and 8,192 tokens
// took 4% less time than with 64-row items (H100, 2026-12-07), the items taken longest first.
constexpr int kAttnMaxRowsPerBlock = 128;
constexpr int kAttnChunkAlign = 64;       // split boundaries fall on multiples of this many keys (128 measured slower)
constexpr int kAttnMaxSplits = 64;        // merge weights of a block's rows fit its shared memory
constexpr int kAttnMaxCluster = 16;       // decode splits merged through distributed shared memory
// AttnArgs::segment of chunk-invariant steps: short enough that a decode row splits over many blocks (at
// 1,024 keys a 4B batch-1 step spent 56 us per layer in attention), at most kAttnMaxSegments splits (64k keys).
constexpr int kAttnSegment = 256;
constexpr int kAttnMaxSegments = 256;     // a segmented launch's splits (its merge kernel keeps no per-split state)

// Tokens per work item for a group size (rows per block / group).
inline int attn_tokens_per_item(int group) { return group >= kAttnMaxRowsPerBlock ? 1 : kAttnMaxRowsPerBlock / group; }

// Short chunks (up to this many tokens: a verify step's span, DFlash's 16) are cut into items of at most 16 query
// rows, so that they take the decode launch (key-warp blocks, the cluster merge, early launch) instead of one
// row-warp item with a workspace merge kernel: a 4B span-8 verify at 1,024 keys spent ~20 us per layer in
// attention against ~9 us for a decode row (H100). Each item reads the sequence's whole KV range, though.
constexpr int kAttnShortChunk = 16;
// Short items only up to this context: n items read the KV n times (expected to lose at 8k+ keys). A guess, to be
// measured.
constexpr int kAttnShortItemsMaxCtx = 4096;
// Tokens per short item (16 rows), 0 where a token's group alone exceeds 16 rows (no cut).
inline int attn_short_tokens_per_item(int group) { return group > 16 ? 0 : 16 / group; }

// How many key splits fill the GPU for this launch (1 when the grid is already large).
// `max_rows` as in AttnArgs (decode rows may take key-warp splits of 16 keys).
int attn_num_splits(int num_work, int num_kv_heads, int max_context, int num_tokens, int num_sms, int max_split_rows,
                    int max_rows, AttnVariant v = {});

// The split count of a chunk-invariant launch: one split per segment where the grid is small and the
// workspace holds a partial per segment for every token, else 1 (the results are the same either way).
int attn_segment_splits(int num_work, int num_kv_heads, int max_context, int num_tokens, int num_sms, int max_split_rows);

void paged_attention(const AttnArgs& a, cudaStream_t s);

constexpr int kAttnMaxEarlyItems = 8;  // decode grids of up to this many items launch early (PDL)
constexpr int kAttnKeyWarps = 4;       // warps of a decode block that split its keys

// How paged_attention launches: key-warp blocks or not, the split count launched (a quarter of
// num_splits with key warps), the cluster size, early (PDL) or not. Tests and benchmarks read it.
struct AttnLaunch {
  bool key_warps, early;
  int splits, cluster;
};
AttnLaunch attn_launch_shape(int num_work, int max_rows, int num_splits, AttnVariant v = {});

}  // namespace oi
