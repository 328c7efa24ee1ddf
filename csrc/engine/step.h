// The step contract, C++ side: what one engine step takes and returns. openinfer/step.py declares the
// same fields for Python; docs/architecture.md has the table. Each field is listed once, in the lists
// below; the struct members and the binding's conversions are generated from them.
#pragma once
#include <cstdint>
#include <vector>

namespace oi {

// Arrays of a step: X(element type, name, length rule). The binding checks each against its rule:
// T (tokens: len(input_ids)), B (sequences: len(context_lens)), B1 (B + 1), S (sampled rows:
// len(sample_idx)), BxM (2-D [B, M] block tables), B_OPT (absent, or B), PAIRS (2-D [N, 2], N >= 0),
// ANY (any length, absent = empty).
#define OI_STEP_ARRAYS(X)         \
  X(int32_t, input_ids, T)        \
  X(int32_t, positions, T)        \
  X(int32_t, query_start_loc, B1) \
  X(int32_t, context_lens, B)     \
  X(int32_t, block_tables, BxM)   \
  X(int32_t, slot_mapping, T)     \
  X(int32_t, sample_idx, S)       \
  X(float, temperature, S)        \
  X(float, top_p, S)              \
  X(int32_t, top_k, S)            \
  X(uint64_t, seeds, S)           \
  X(int32_t, prev_rows, B_OPT)    \
  X(int32_t, draft, B_OPT)        \
  X(int32_t, tap_layers, ANY)     \
  X(int32_t, tap_rows, ANY)       \
  X(int32_t, kv_save, PAIRS)      \
  X(int32_t, kv_load, PAIRS)      \
  X(int32_t, kv_copy, PAIRS)

// Scalars of a step: X(type, name).
#define OI_STEP_SCALARS(X) \
  X(int, num_logprobs)     \
  X(bool, return_logits)   \
  X(bool, verify)          \
  X(bool, force_eager)     \
  X(bool, kv_load_wait)

// One step's inputs as host pointers into the caller's arrays (valid for the call). n_<name> is the
// element count of each array (pairs for kv_save/kv_load/kv_copy, rows for block_tables).
struct StepInput {
#define OI_DECLARE_ARRAY(type, name, rule) \
  const type* name = nullptr;              \
  int64_t n_##name = 0;
  OI_STEP_ARRAYS(OI_DECLARE_ARRAY)
#undef OI_DECLARE_ARRAY
#define OI_DECLARE_SCALAR(type, name) type name{};
  OI_STEP_SCALARS(OI_DECLARE_SCALAR)
#undef OI_DECLARE_SCALAR
  int bt_stride = 0;  // columns of block_tables
  int T() const { return (int)n_input_ids; }
  int B() const { return (int)n_context_lens; }
  int S() const { return (int)n_sample_idx; }
};

// Outputs of a step: X(element type, name, present, rows, cols): present and the shape are expressions
// over a StepResult `r` (cols 0: one dimension). An output that is not present was not asked for.
#define OI_STEP_OUTPUTS(X)                                                     \
  X(int32_t, tokens, true, r.S, 0)                                             \
  X(float, logprobs, true, r.S, 0)                                             \
  X(int32_t, top_ids, r.num_logprobs > 0, r.S, r.num_logprobs)                 \
  X(float, top_logprobs, r.num_logprobs > 0, r.S, r.num_logprobs)              \
  X(float, logits, r.logit_rows > 0, r.logit_rows, r.vocab)                    \
  X(int32_t, accepted, r.accepted_rows > 0, r.accepted_rows, 0)                \
  X(uint16_t, hidden, r.tap_rows > 0, r.tap_rows, r.tap_width)                \
  X(int32_t, drafts, r.draft_rows > 0, r.draft_rows, r.num_drafts)

struct StepResult {
#define OI_DECLARE_OUTPUT(type, name, present, rows, cols) std::vector<type> name;
  OI_STEP_OUTPUTS(OI_DECLARE_OUTPUT)
#undef OI_DECLARE_OUTPUT
  int S = 0, num_logprobs = 0, logit_rows = 0, vocab = 0, accepted_rows = 0, tap_rows = 0, tap_width = 0;
  int draft_rows = 0, num_drafts = 0;
  float gpu_ms = 0.f;
  float draft_ms = 0.f;  // the drafter's part of gpu_ms
};

}  // namespace oi
