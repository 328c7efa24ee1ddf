#include "../kernels/elementwise.cuh"
#include "qwen3.h"

namespace oi {

void qwen3_forward(const ModelDims& d, const Weights& w, const Activations& a, const StepMeta& m,
                   const float2* rope, bf16* kv_cache, const KvLayout& kv, Gemm& gemm, cudaStream_t s) {
  const int T = m.T, H = d.hidden, I = d.intermediate;
  embedding_lookup(w.embed, m.ids, a.x, T, H, s);
  for (int l = 0; l < d.layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    rmsnorm(a.x, lw.input_norm, a.h, T, H, d.eps, s);
    gemm.run(a.h, lw.qkv, a.qkv, T, d.qkv_rows(), H, false, false, s);
    qk_norm_rope_kv_write(a.qkv, lw.q_norm, lw.k_norm, m.positions, m.slots, rope, kv_cache, l, kv, T, d.heads,
                          d.eps, s);
    AttnArgs at{};
    at.q = a.qkv;
    at.q_stride = d.qkv_rows();
    at.kv_cache = kv_cache;
    at.kv = kv;
    at.layer = l;
    at.block_tables = m.block_tables;
    at.bt_stride = m.bt_stride;
    at.positions = m.positions;
    at.context_lens = m.context_lens;
    at.work = m.work;
    at.num_work = m.num_work;
    at.num_tokens = T;
    at.num_heads = d.heads;
    at.num_splits = m.num_splits;
    at.max_rows = m.max_rows;
    at.out = a.attn;
    at.ws_o = a.ws_o;
    at.ws_lse = a.ws_lse;
    paged_attention(at, s);
    gemm.run(a.attn, lw.o, a.x, T, H, d.heads * d.head_dim, true, false, s);  // x += attn · Woᵀ
    rmsnorm(a.x, lw.post_norm, a.h, T, H, d.eps, s);
    gemm.run(a.h, lw.gate_up, a.gu, T, 2 * I, H, false, false, s);
    silu_mul(a.gu, a.act, T, I, s);
    gemm.run(a.act, lw.down, a.x, T, H, I, true, false, s);  // x += act · Wdownᵀ
  }
  // Only the rows that sample go through the final norm and the lm_head.
  gather_rows(a.x, m.sample_idx, a.xs, m.S, H, s);
  rmsnorm(a.xs, w.final_norm, a.hs, m.S, H, d.eps, s);
  gemm.run(a.hs, w.lm_head, a.logits, m.S, d.vocab, H, false, true, s);
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
}

}  // namespace oi
