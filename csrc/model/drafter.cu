#include "../kernels/elementwise.cuh"
#include "drafter.h"

namespace oi {

void drafter_context(const ModelDims& d, const DrafterDims& dd, const DrafterWeights& w, const Activations& a,
                     const bf16* feats, const int32_t* positions, const int32_t* slots, int T, const float2* rope,
                     bf16* kv_cache, const KvLayout& kv, Gemm& gemm, int num_sms, cudaStream_t s) {
  if (T == 0) return;
  const int H = d.hidden, taps = (int)dd.taps.size(), q_rows = d.heads * d.head_dim;
  linear(GemvIn::kPlain, GemvOut::kStore, feats, nullptr, d.eps, w.fc, a.x, T, H, taps * H, nullptr, nullptr, gemm,
         num_sms, GemvKernel::kAuto, s);
  rmsnorm(a.x, w.hidden_norm, a.h, T, H, d.eps, s);
  const int kv_rows = 2 * d.kv_heads * d.head_dim;
  for (int l = 0; l < dd.layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    // k and v only: their rows follow q's in the fused qkv weight; [T, k | v] is the kernel's layout with no q heads
    linear(GemvIn::kPlain, GemvOut::kStore, a.h, nullptr, d.eps, lw.qkv + (int64_t)q_rows * H, a.qkv, T, kv_rows, H,
           nullptr, nullptr, gemm, num_sms, GemvKernel::kAuto, s);
    qk_norm_rope_kv_write(a.qkv, lw.q_norm, lw.k_norm, positions, slots, rope, kv_cache, l, kv, T, 0, d.eps, s);
  }
}

void drafter_block(const ModelDims& d, const DrafterDims& dd, const DrafterWeights& w, const bf16* embed,
                   const bf16* lm_head, const Activations& a, const DraftBlock& b, const float2* rope, bf16* kv_cache,
                   const KvLayout& kv, Gemm& gemm, int num_sms, cudaStream_t s) {
  const int N = b.D * dd.block_size, H = d.hidden, R = b.D * dd.num_drafts;
  embedding_lookup(embed, b.ids, a.x, N, H, s);
  AttnArgs at = attn_args(d, a, kv_cache, kv, rope);
  at.block_tables = b.block_tables;
  at.bt_stride = b.bt_stride;
  at.positions = b.mask_pos;
  at.own_keys_below = dd.block_size - 1;  // the block's keys, written by the layer's previous kernel
  at.context_lens = b.context_lens;
  at.work = b.work;
  at.num_work = b.num_work;
  at.num_tokens = N;
  at.num_splits = b.num_splits;
  at.max_rows = b.max_rows;
  at.slots = b.slots;
  for (int l = 0; l < dd.layers; ++l)
    decoder_layer(d, w.layers[l], l, a, at, N, b.positions, b.slots, false, gemm, num_sms, GemvKernel::kAuto, s);
  gather_rows(a.x, b.rows, a.xs, R, H, s);
  linear(GemvIn::kRmsNorm, GemvOut::kF32, a.xs, w.norm, d.eps, lm_head, a.logits, R, d.vocab, H, a.hs, nullptr, gemm,
         num_sms, GemvKernel::kAuto, s);
  SampleArgs sa{};
  sa.vocab = d.vocab;
  sa.num_logprobs = 0;
  auto sample_rows = [&](int r0, int n) {
    sa.logits = a.logits + (int64_t)r0 * d.vocab;
    sa.num_rows = n;
    sa.temperature = b.temperature + r0;
    sa.top_p = b.top_p + r0;
    sa.top_k = b.top_k + r0;
    sa.seeds = b.seeds + r0;
    sa.positions = b.sample_pos + r0;
    sa.tokens = b.tokens + r0;
    sa.logprobs = b.logprobs + r0;
    sample(sa, s);
  };
  if (!dd.markov_rank) {
    sample_rows(0, R);
    return;
  }
  // The Markov head, left to right: slot j's logits += W2 · W1[token before it] (the anchor for slot 0), for
  // every sequence of the chunk at once: one launch for every slot (sampling.cuh), or, for chunks it does
  // not take, a gather and one [D, rank] x [rank, V] GEMM per slot.
  MarkovArgs ma{};
  ma.logits = a.logits;
  ma.w1 = w.markov_w1;
  ma.w2 = w.markov_w2;
  ma.anchors = b.anchors;
  ma.D = b.D;
  ma.num_drafts = dd.num_drafts;
  ma.V = d.vocab;
  ma.R = dd.markov_rank;
  ma.temperature = b.temperature;
  ma.top_p = b.top_p;
  ma.top_k = b.top_k;
  ma.positions = b.sample_pos;
  ma.seeds = b.seeds;
  ma.tokens = b.tokens;
  ma.logprobs = b.logprobs;
  ma.part = b.markov_part;
  ma.sync = b.markov_sync;
  if (markov_sample(ma, num_sms, s)) return;
  for (int j = 0; j < dd.num_drafts; ++j) {
    gather_rows(w.markov_w1, j == 0 ? b.anchors : b.tokens + (j - 1) * b.D, b.markov_u, b.D, dd.markov_rank, s);
    gemm.run(b.markov_u, w.markov_w2, a.logits + (int64_t)j * b.D * d.vocab, b.D, d.vocab, dd.markov_rank, true, true,
             s);
    sample_rows(j * b.D, b.D);
  }
}

}  // namespace oi
