#include "../kernels/elementwise.cuh"
#include "../gemm/skinny_gemm.h"
#include "../kernels/gemv.cuh"
#include "qwen3.h"

namespace oi {

void linear(GemvIn in, GemvOut out, const bf16* x, const bf16* norm_w, float eps, const bf16* W, void* y, int M, int N,
            int K, bf16* scratch, bf16* gu, Gemm& gemm, int num_sms, GemvKernel kernel, cudaStream_t s,
            GemmPath path) {
  GemvArgs g{x, norm_w, eps, W, y, M, N, K, kernel};
  if (path != GemmPath::kInvariant && gemv(g, in, out, num_sms, s)) return;
  const bool fixed = path == GemmPath::kInvariant;
  const bf16* src = x;
  if (in == GemvIn::kRmsNorm) {
    rmsnorm(x, norm_w, scratch, M, K, eps, s);
    src = scratch;
  }
  if (out == GemvOut::kSiluMul) {
    if (!fixed && M <= kSkinnyEngineRows && skinny_gemm(src, W, y, M, N, K, false, false, s, true)) return;
    // --deterministic: the batch-invariant GEMM with SiLU·up fused, every M (Gemm::run's choice, fused)
    if (fixed && skinny_gemm_invariant(src, W, y, M, N, K, false, false, s, true)) return;
    gemm.run(src, W, gu, M, N, K, false, false, s, fixed);
    silu_mul(gu, static_cast<bf16*>(y), M, N / 2, s);
    return;
  }
  gemm.run(src, W, y, M, N, K, out == GemvOut::kAccumulate, out == GemvOut::kF32, s, fixed);
}

AttnArgs attn_args(const ModelDims& d, const Activations& a, bf16* kv_cache, const KvLayout& kv, const float2* rope) {
  AttnArgs at{};
  at.q = a.qkv;
  at.q_stride = d.qkv_rows();
  at.kv_cache = kv_cache;
  at.kv = kv;
  at.num_heads = d.heads;
  at.out = a.attn;
  at.ws_o = a.ws_o;
  at.ws_lse = a.ws_lse;
  at.counters = a.attn_counters;
  at.cos_sin = rope;
  at.eps = d.eps;
  return at;
}

// One decoder layer over T rows, x updated in place. `at` carries the step's attention arguments (its
// positions mask the keys); RoPE and the cache writes use rope_pos / slots (the same positions, except in
// the drafter's block, which is not causal).
void decoder_layer(const ModelDims& d, const LayerWeights& lw, int l, const Activations& a, AttnArgs& at, int T,
                   const int32_t* rope_pos, const int32_t* slots, bool fuse_rope, Gemm& gemm, int num_sms,
                   GemvKernel gk, cudaStream_t s, GemmPath path) {
  using In = GemvIn;
  using Out = GemvOut;
  const int H = d.hidden, I = d.intermediate;
  linear(In::kRmsNorm, Out::kStore, a.x, lw.input_norm, d.eps, lw.qkv, a.qkv, T, d.qkv_rows(), H, a.h, nullptr, gemm,
         num_sms, gk, s, path);
  if (!fuse_rope)
    qk_norm_rope_kv_write(a.qkv, lw.q_norm, lw.k_norm, rope_pos, slots, at.cos_sin, at.kv_cache, l, at.kv, T, d.heads,
                          d.eps, s);
  at.layer = l;
  at.fuse_rope = fuse_rope;
  at.q_norm_w = lw.q_norm;
  at.k_norm_w = lw.k_norm;
  paged_attention(at, s);
  // x += attn · Woᵀ, then x += (SiLU(gate)·up) · Wdownᵀ: the residual adds ride in the GEMM epilogues
  linear(In::kPlain, Out::kAccumulate, a.attn, nullptr, d.eps, lw.o, a.x, T, H, d.heads * d.head_dim, nullptr, nullptr,
         gemm, num_sms, gk, s, path);
  linear(In::kRmsNorm, Out::kSiluMul, a.x, lw.post_norm, d.eps, lw.gate_up, a.act, T, 2 * I, H, a.h, a.gu, gemm,
         num_sms, gk, s, path);
  linear(In::kPlain, Out::kAccumulate, a.act, nullptr, d.eps, lw.down, a.x, T, H, I, nullptr, nullptr, gemm, num_sms,
         gk, s, path);
}

void qwen3_forward(const ModelDims& d, const Weights& w, const Activations& a, const StepMeta& m,
                   const float2* rope, bf16* kv_cache, const KvLayout& kv, Gemm& gemm, int num_sms, cudaStream_t s) {
  const int T = m.T, H = d.hidden, I = d.intermediate;
  using In = GemvIn;
  using Out = GemvOut;
  embedding_lookup(w.embed, m.ids, a.x, T, H, s);
  // The attention arguments of this step; each layer sets its own index and q/k norm weights.
  AttnArgs at = attn_args(d, a, kv_cache, kv, rope);
  at.block_tables = m.block_tables;
  at.bt_stride = m.bt_stride;
  at.positions = m.positions;
  at.context_lens = m.context_lens;
  at.work = m.work;
  at.num_work = m.num_work;
  at.num_tokens = T;
  at.num_splits = m.num_splits;
  at.max_rows = m.max_rows;
  at.slots = m.slots;
  at.variant = m.attention;
  at.segment = m.attn_segment;
  // Batch-1 decode: every layer in one persistent kernel (kernels/persistent.cuh).
  const bool persistent = m.persistent;
  OI_CHECK(!persistent || (T == 1 && m.fuse_rope && w.dev_layers && !m.tap_slot && !m.ctx_slot), "qwen3_forward: persistent step misplanned");
  if (persistent) {
    PersistentArgs pa{};
    pa.layers = w.dev_layers;
    pa.num_layers = d.layers;
    pa.hidden = H;
    pa.intermediate = I;
    pa.heads = d.heads;
    pa.kv_heads = d.kv_heads;
    pa.eps = d.eps;
    pa.x = a.x;
    pa.kv_cache = kv_cache;
    pa.kv = kv;
    pa.positions = m.positions;
    pa.slots = m.slots;
    pa.context_lens = m.context_lens;
    pa.block_tables = m.block_tables;
    pa.cos_sin = rope;
    pa.ws = a.layer_ws;
    pa.trace = m.trace;
    persistent_layers(pa, num_sms, s);
  }
  for (int l = 0; l < (persistent ? 0 : d.layers); ++l) {
    if (m.layer_ready && m.layer_ready[l]) OI_CUDA_CHECK(cudaStreamWaitEvent(s, m.layer_ready[l], 0));
    decoder_layer(d, w.layers[l], l, a, at, T, m.positions, m.slots, m.fuse_rope, gemm, num_sms, m.gemv, s, m.gemm_path);
    if (m.tap_slot && m.tap_slot[l] >= 0)  // x is now the residual stream after layer l (HF hidden_states[l + 1])
      gather_rows(a.x, m.tap_rows, m.out_taps + (int64_t)m.tap_slot[l] * H, m.num_tap_rows, H, s, (int64_t)m.num_taps * H);
    if (m.ctx_slot && m.ctx_slot[l] >= 0)  // the drafter's context features: every row
      gather_rows(a.x, m.ctx_rows, m.ctx_feats + (int64_t)m.ctx_slot[l] * H, T, H, s, (int64_t)m.num_ctx_taps * H);
  }
  // Only the rows that sample go through the final norm and the lm_head.
  gather_rows(a.x, m.sample_idx, a.xs, m.S, H, s);
  if (m.S > 0)
    linear(In::kRmsNorm, Out::kF32, a.xs, w.final_norm, d.eps, w.lm_head, a.logits, m.S, d.vocab, H, a.hs, nullptr,
           gemm, num_sms, m.gemv, s, m.gemm_path);
  SampleArgs sa{};
  sa.logits = a.logits;
  sa.num_rows = m.S;
  sa.vocab = d.vocab;
  sa.temperature = m.temperature;
  sa.top_p = m.top_p;
  sa.top_k = m.top_k;
  sa.seeds = m.seeds;
  sa.positions = m.sample_pos;
  sa.num_logprobs = m.num_logprobs;
  sa.tokens = m.out_tokens;
  sa.logprobs = m.out_logprobs;
  sa.top_ids = m.out_top_ids;
  sa.top_logprobs = m.out_top_logprobs;
  sample(sa, s);
  if (m.out_accepted) count_accepted(m.ids, m.sample_idx, m.out_tokens, m.seq_rows, m.B, m.out_accepted, s);
}

}  // namespace oi
