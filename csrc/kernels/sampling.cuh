// Per-row sampling over fp32 logits: greedy, or temperature + top-k + top-p with a Gumbel-max draw
// from a counter-based hash of (seed, position, token) -- the exact rule of docs/architecture.md, so the
// NumPy reference draws the same tokens. Also log-probabilities (raw logits) and the top-N of them.
#pragma once
#include "../common.h"

namespace oi {

struct SampleArgs {
  const float* logits;  // [S, V]
  int num_rows, vocab;
  const float* temperature;
  const float* top_p;
  const int32_t* top_k;
  const uint64_t* seeds;
  const int32_t* positions;  // position of each sampled row (the draw counter is position + 1)
  int num_logprobs;          // 0..kMaxLogprobs
  int32_t* tokens;           // [S]
  float* logprobs;           // [S]
  int32_t* top_ids;          // [S, num_logprobs]
  float* top_logprobs;       // [S, num_logprobs]
};

constexpr int kMaxLogprobs = 20;

void sample(const SampleArgs& a, cudaStream_t s);

// Verify steps: sequence b's sampled rows are seq_rows[b] .. seq_rows[b+1]-1, at consecutive tokens; the
// token after each row's is the draft it checks. accepted[b] = 1 + the drafts matched in order before the
// first mismatch, i.e. how many of the rows' tokens are kept (0 for a sequence without sampled rows).
void count_accepted(const int32_t* ids, const int32_t* sample_idx, const int32_t* tokens, const int32_t* seq_rows,
                    int B, int32_t* accepted, cudaStream_t s);

}  // namespace oi
