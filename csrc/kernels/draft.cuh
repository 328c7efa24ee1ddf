// The drafter's block inputs, made on the device from the step's own results: a round's anchor is the
// token of the sequence's last kept row, known only once the verify step's accepted counts are (the
// host never waits for them). See model/drafter.h for the layout of the rows.
#pragma once
#include "../common.h"

namespace oi {

struct DraftInputs {
  int D, block, first_slot, num_drafts, mask_token, page, bt_stride;
  const int32_t* seqs;         // [D] the step's sequence index of each drafting sequence
  const int32_t* rows;         // [D] its sampled row (verify: its first; the kept one is rows + accepted - 1)
  const int32_t* accepted;     // [B] verify steps, else null
  const int32_t* tokens;       // [S] the step's sampled tokens
  const int32_t* sample_pos;   // [S] their rows' positions
  const float *temperature, *top_p;  // [S] the step's sampling parameters
  const int32_t* top_k;
  const uint64_t* seeds;
  const int32_t* block_tables;  // [B, bt_stride]
  // outputs: [D * block] token rows, [B] context lengths, [num_drafts * D] draft rows (slot-major), [D]
  int32_t *ids, *positions, *mask_pos, *slots, *context_lens, *anchors, *rows_out, *d_top_k, *d_pos;
  float *d_temperature, *d_top_p;
  uint64_t* d_seeds;
};

void draft_inputs(const DraftInputs& a, cudaStream_t s);

}  // namespace oi
