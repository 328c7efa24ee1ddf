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

// The DSpark drafter's Markov head over a chunk of D drafting sequences, in one launch: for each draft
// slot j, left to right, logits[j * D + d] += W2 · W1[token before it] (the anchor for slot 0), then the
// row is sampled exactly as sample() samples it (greedy rows: the maximum, lowest id among ties).
constexpr int kMaxMarkovSeqs = 16;
constexpr int kMaxMarkovRank = 256;
struct MarkovArgs {
  float* logits;              // [num_drafts * D, V] the lm_head's logits of the draft rows, slot-major
  const bf16 *w1, *w2;        // [V, R] each
  const int32_t* anchors;     // [D]
  int D, num_drafts, V, R;
  const float *temperature, *top_p;  // [num_drafts * D] per draft row, as SampleArgs
  const int32_t *top_k, *positions;
  const uint64_t* seeds;
  int32_t* tokens;            // [num_drafts * D] out
  float* logprobs;            // [num_drafts * D] out (0 for greedy rows)
  float2* part;               // [2 * num_sms * D] scratch: the blocks' maxima
  unsigned* sync;             // [2] grid barrier: arrivals (zero before the first launch; each launch leaves
                              // it zero) and generation (any value)
};

// False (nothing launched) for a chunk it does not take (D > kMaxMarkovSeqs, R not a positive multiple of
// 64 or above kMaxMarkovRank); the caller then runs the slots one by one. One block per SM, launched
// cooperatively: num_sms at most the device's (and part sized by it).
bool markov_sample(const MarkovArgs& a, int num_sms, cudaStream_t s);

}  // namespace oi
