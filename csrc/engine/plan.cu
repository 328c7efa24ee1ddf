#include <algorithm>
#include <cmath>

#include "../kernels/sampling.cuh"
#include "plan.h"

namespace oi {

std::vector<AttnWork> attention_work(const int32_t* query_start_loc, int B, int group, int* max_rows, bool short_items,
                                     const int32_t* context_lens) {
  const int32_t* qsl = query_start_loc;
  int qt = attn_tokens_per_item(group);
  const int st = attn_short_tokens_per_item(group);
  if (short_items && st > 0) {
    bool fits = true;
    for (int b = 0; b < B && fits; ++b) {
      const int n = qsl[b + 1] - qsl[b];
      fits = n <= st || (n <= kAttnShortChunk && (!context_lens || context_lens[b] <= kAttnShortItemsMaxCtx));
    }
    if (fits) qt = st;
  }
  std::vector<AttnWork> work;
  work.reserve(qsl[B] / qt + B + 1);
  *max_rows = 1;
  for (int b = 0; b < B; ++b)
    for (int t0 = qsl[b]; t0 < qsl[b + 1]; t0 += qt) {
      const int n = std::min(qt, qsl[b + 1] - t0);
      work.push_back(AttnWork{b, t0, n, t0 - qsl[b]});
      *max_rows = std::max(*max_rows, n * group);
    }
  return work;
}

namespace {

void check_copies(const int32_t* pairs, int64_t n, bool save, const StepLimits& lim) {
  const char* name = save ? "kv_save" : "kv_load";
  OI_INPUT_CHECK(n == 0 || lim.num_host_blocks > 0, name << " without a host KV tier");
  for (int64_t i = 0; i < n; ++i) {
    const int32_t dev = pairs[2 * i + (save ? 0 : 1)], host = pairs[2 * i + (save ? 1 : 0)];
    OI_INPUT_CHECK(dev >= 1 && dev < lim.num_blocks, name << "[" << i << "]: device block " << dev << " out of range");
    OI_INPUT_CHECK(host >= 0 && host < lim.num_host_blocks, name << "[" << i << "]: host slot " << host << " out of range");
  }
}

}  // namespace

StepPlan plan_step(const StepInput& in, const ModelDims& d, const StepLimits& lim, const AttnVariant& v) {
  const int T = in.T(), B = in.B(), S = in.S();
  OI_INPUT_CHECK(T >= 1 && T <= lim.max_num_tokens, T << " tokens (1.." << lim.max_num_tokens << ")");
  OI_INPUT_CHECK(B >= 1 && B <= lim.max_num_seqs, B << " sequences (1.." << lim.max_num_seqs << ")");
  // a verify step samples several rows per sequence
  OI_INPUT_CHECK(S >= 0 && S <= lim.max_sampled_rows, S << " sampled rows (0.." << lim.max_sampled_rows << ")");
  OI_INPUT_CHECK(in.num_logprobs >= 0 && in.num_logprobs <= kMaxLogprobs, "num_logprobs " << in.num_logprobs);
  // a draft writes its block past the step's tokens (up to draft_block positions past max_model_len - 1)
  OI_INPUT_CHECK(in.bt_stride >= 1 && in.bt_stride <= (lim.max_model_len + lim.draft_block + lim.block_size - 1) / lim.block_size,
                 "block table width " << in.bt_stride);
  const int32_t* qsl = in.query_start_loc;
  OI_INPUT_CHECK(qsl[0] == 0 && qsl[B] == T, "query_start_loc must run from 0 to T");
  const int group = d.heads / d.kv_heads;
  const int64_t max_slot = lim.num_blocks * lim.block_size;
  StepPlan p;
  for (int b = 0; b < B; ++b) {
    const int s0 = qsl[b], s1 = qsl[b + 1];
    OI_INPUT_CHECK(s1 > s0, "sequence " << b << " has no tokens");
    const int ctx = in.context_lens[b];
    OI_INPUT_CHECK(ctx >= s1 - s0 && ctx <= lim.max_model_len && ctx <= in.bt_stride * lim.block_size,
                   "context_lens[" << b << "] = " << ctx << " is inconsistent");
    OI_INPUT_CHECK(in.positions[s1 - 1] == ctx - 1, "last position of sequence " << b << " must be context_len - 1");
    const int nb = (ctx + lim.block_size - 1) / lim.block_size;
    for (int j = 0; j < nb; ++j) {
      const int blk = in.block_tables[(int64_t)b * in.bt_stride + j];
      OI_INPUT_CHECK(blk >= 0 && blk < lim.num_blocks, "block id " << blk << " out of range");
    }
    p.max_ctx = std::max(p.max_ctx, ctx);
  }
  // Deterministic steps keep whole chunks: their segment items (and bits) are fixed.
  p.work = attention_work(qsl, B, group, &p.max_rows, !lim.deterministic, in.context_lens);
  if (lim.deterministic) {  // a row's attention must not depend on the step it is in
    p.segment = kAttnSegment;
    p.num_splits = attn_segment_splits((int)p.work.size(), d.kv_heads, p.max_ctx, T, lim.num_sms, lim.max_split_rows);
  } else {
    p.num_splits = attn_num_splits((int)p.work.size(), d.kv_heads, p.max_ctx, T, lim.num_sms, lim.max_split_rows,
                                   p.max_rows, v);
  }
  for (int t = 0; t < T; ++t) {
    const bool fed = in.prev_rows && t < B && in.prev_rows[t] >= 0;  // comes from the previous step's output
    OI_INPUT_CHECK(fed || (in.input_ids[t] >= 0 && in.input_ids[t] < d.vocab), "token id " << in.input_ids[t] << " out of range");
    OI_INPUT_CHECK(in.positions[t] >= 0 && in.positions[t] < lim.max_model_len, "position " << in.positions[t] << " out of range");
    OI_INPUT_CHECK(in.slot_mapping[t] >= -1 && in.slot_mapping[t] < max_slot, "slot " << in.slot_mapping[t] << " out of range");
  }
  p.sample_pos.resize(S);
  for (int r = 0; r < S; ++r) {
    OI_INPUT_CHECK(in.sample_idx[r] >= 0 && in.sample_idx[r] < T, "sample_idx " << in.sample_idx[r] << " out of range");
    OI_INPUT_CHECK(std::isfinite(in.temperature[r]) && in.top_p[r] > 0.f && in.top_p[r] <= 1.f, "bad sampling parameters in row " << r);
    p.sample_pos[r] = in.positions[in.sample_idx[r]];
  }
  if (in.verify) {
    // Sampled rows in token order; a sequence's rows on consecutive tokens (the verify of [anchor, d1..dk]).
    p.seq_rows.assign(B + 1, S);
    int r = 0;
    for (int b = 0; b < B; ++b) {
      p.seq_rows[b] = r;
      for (; r < S && in.sample_idx[r] < qsl[b + 1]; ++r) {
        OI_INPUT_CHECK(in.sample_idx[r] >= qsl[b], "verify: sample_idx must be in token order");
        OI_INPUT_CHECK(r == p.seq_rows[b] || in.sample_idx[r] == in.sample_idx[r - 1] + 1,
                       "verify: sequence " << b << "'s sampled rows must be consecutive tokens");
      }
    }
    OI_INPUT_CHECK(r == S, "verify: sample_idx must be in token order");
  }
  if (in.n_tap_layers > 0) {
    p.tap_slot.assign(d.layers, -1);
    for (int64_t i = 0; i < in.n_tap_layers; ++i) {
      const int l = in.tap_layers[i];
      OI_INPUT_CHECK(l >= 0 && l < d.layers && p.tap_slot[l] < 0, "tap layer " << l << " out of range or repeated");
      p.tap_slot[l] = (int)i;
    }
  }
  OI_INPUT_CHECK(in.n_tap_rows == 0 || in.n_tap_layers > 0, "tap_rows without tap_layers");
  // Drafting sequences: one sampled row at least (the anchor is the token of its kept row, p <= its context
  // length), and real blocks for every position its block may write (p + draft_block - 1 at most).
  for (int b = 0; b < (int)in.n_draft; ++b) {
    if (in.draft[b] == 0) continue;
    OI_INPUT_CHECK(in.draft[b] == 1 && lim.draft_block > 0, "draft[" << b << "] = " << in.draft[b] << (lim.draft_block ? "" : ": no drafter is loaded"));
    int first = -1, last = -1;
    for (int r = 0; r < S; ++r)
      if (in.sample_idx[r] >= qsl[b] && in.sample_idx[r] < qsl[b + 1]) {
        if (first < 0) first = r;
        last = r;
      }
    OI_INPUT_CHECK(first >= 0, "draft: sequence " << b << " samples no row");
    const int end = in.context_lens[b] + lim.draft_block;  // positions [0, end) must have blocks
    OI_INPUT_CHECK(end <= in.bt_stride * lim.block_size, "draft: sequence " << b << "'s block table does not cover its draft block");
    for (int j = 0; j < (end + lim.block_size - 1) / lim.block_size; ++j) {
      const int blk = in.block_tables[(int64_t)b * in.bt_stride + j];
      OI_INPUT_CHECK(blk >= 1 && blk < lim.num_blocks, "draft: sequence " << b << "'s block " << j << " is " << blk);
    }
    p.draft_seqs.push_back(b);
    p.draft_rows.push_back(in.verify ? first : last);
  }
  for (int64_t i = 0; i < in.n_tap_rows; ++i)
    OI_INPUT_CHECK(in.tap_rows[i] >= 0 && in.tap_rows[i] < T, "tap row " << in.tap_rows[i] << " out of range");
  plan_copies(in, lim);
  return p;
}

void plan_copies(const StepInput& in, const StepLimits& lim) {
  check_copies(in.kv_save, in.n_kv_save, true, lim);
  check_copies(in.kv_load, in.n_kv_load, false, lim);
  for (int64_t i = 0; i < 2 * in.n_kv_copy; ++i)
    OI_INPUT_CHECK(in.kv_copy[i] >= 1 && in.kv_copy[i] < lim.num_blocks,
                   "kv_copy[" << i / 2 << "]: block " << in.kv_copy[i] << " out of range");
}

}  // namespace oi
