// A step's validation and plan: every input a client could influence is range-checked here, on the host,
// before any device work (std::invalid_argument, ValueError in Python); then the attention work items
// and split count the forward uses. The kernel test ops plan their attention through the same functions.
#pragma once
#include <vector>

#include "../kernels/attention.cuh"
#include "../model/qwen3.h"
#include "step.h"

// A step input out of range: std::invalid_argument (ValueError in Python), naming what is wrong.
#define OI_INPUT_CHECK(cond, msg)                 \
  do {                                            \
    if (!(cond)) {                                \
      std::ostringstream oi_os_;                  \
      oi_os_ << "step: " << msg;                  \
      throw std::invalid_argument(oi_os_.str());  \
    }                                             \
  } while (0)

namespace oi {

struct StepLimits {
  int max_num_tokens, max_num_seqs, max_sampled_rows, max_model_len, block_size, num_sms, max_split_rows;
  int draft_block;  // the drafter's block size (positions a draft writes past the step's), 0: no drafter
  bool deterministic;  // EngineConfig.deterministic: segmented attention in every step
  int64_t num_blocks, num_host_blocks;
};

struct StepPlan {
  std::vector<AttnWork> work;
  std::vector<int32_t> sample_pos;  // [S] position of each sampled row
  std::vector<int32_t> seq_rows;    // verify: [B + 1] first sampled row of each sequence
  std::vector<int> tap_slot;        // [layers] index among tap_layers, or -1; empty without taps
  std::vector<int32_t> draft_seqs;  // sequences that draft after the step, and the sampled row of each (verify:
  std::vector<int32_t> draft_rows;  // its first; the drafter adds the accepted count on the device)
  int max_ctx = 0, max_rows = 1, num_splits = 1;
  int segment = 0;  // AttnArgs::segment: kAttnSegment in chunk-invariant steps
};

// Attention work items of a step: each sequence's tokens in items of up to attn_tokens_per_item(group).
// max_rows gets the most query rows (tokens x group) of one item. short_items: chunks of up to kAttnShortChunk
// tokens in items of attn_short_tokens_per_item(group) (16 rows), where every item of the step then has at most
// 16 rows (a launch of wider items takes row-warp blocks whatever these are cut to); context_lens, where given
// (null: a graph's capture), keeps sequences past kAttnShortItemsMaxCtx keys whole, and so the whole step.
std::vector<AttnWork> attention_work(const int32_t* query_start_loc, int B, int group, int* max_rows,
                                     bool short_items = false, const int32_t* context_lens = nullptr);

StepPlan plan_step(const StepInput& in, const ModelDims& d, const StepLimits& lim, const AttnVariant& v);

// A step of no tokens (B = 0) carries only KV copies: the checks of those.
void plan_copies(const StepInput& in, const StepLimits& lim);

}  // namespace oi
