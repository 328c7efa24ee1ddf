// The drafter of speculative decoding inside the Engine: its weights and KV pool, and its part of an eager
// step (model/drafter.h orders the kernels). Per step: every token's context features are gathered during
// the target's forward; after the target has sampled (and counted what a verify accepted), the context
// pass writes their K/V, then each chunk of drafting sequences runs its block pass.
#include <cstring>

#include "../kernels/elementwise.cuh"
#include "engine.h"

namespace oi {

void Engine::set_drafter(const DrafterDims& dd) {
  OI_CHECK(!finalized_, "set_drafter() after finalize()");
  OI_CHECK(!dr_, "set_drafter() called twice");
  OI_CHECK(dd.layers >= 1 && dd.block_size >= 2 && dd.block_size <= kMaxDraftBlock,
           "drafter: " << dd.layers << " layers, block size " << dd.block_size << " (2.." << kMaxDraftBlock << ")");
  OI_CHECK(dd.first_slot >= 0 && dd.num_drafts == dd.block_size - dd.first_slot, "drafter: first slot " << dd.first_slot);
  OI_CHECK(dd.mask_token >= 0 && dd.mask_token < d_.vocab, "drafter: mask token " << dd.mask_token);
  OI_CHECK(dd.markov_rank >= 0 && dd.markov_rank % 8 == 0, "drafter: Markov rank " << dd.markov_rank << " (a multiple of 8)");
  OI_CHECK(!dd.taps.empty(), "drafter: no tap layers");
  OI_CHECK(opt_.host_kv_bytes == 0, "a drafter with the host KV tier is not supported");
  auto st = std::make_unique<DrafterState>();
  st->dims = dd;
  st->md = d_;
  st->md.layers = dd.layers;
  st->kv = KvLayout{dd.layers, d_.kv_heads, opt_.kv_block_size, d_.head_dim};
  st->ctx_slot.assign(d_.layers, -1);
  for (size_t i = 0; i < dd.taps.size(); ++i) {
    const int l = dd.taps[i];
    OI_CHECK(l >= 0 && l < d_.layers && st->ctx_slot[l] < 0, "drafter: tap layer " << l << " out of range or repeated");
    st->ctx_slot[l] = (int)i;
  }
  const int64_t H = d_.hidden, I = d_.intermediate, D = d_.head_dim, V = d_.vocab, taps = (int64_t)dd.taps.size();
  auto wt = [&](int64_t n) { return static_cast<bf16*>(alloc(n * sizeof(bf16), &weight_bytes_)); };
  st->w.layers.resize(dd.layers);
  for (auto& L : st->w.layers) {
    L.input_norm = wt(H);
    L.post_norm = wt(H);
    L.q_norm = wt(D);
    L.k_norm = wt(D);
    L.qkv = wt((int64_t)d_.qkv_rows() * H);
    L.o = wt(H * d_.heads * D);
    L.gate_up = wt(2 * I * H);
    L.down = wt(H * I);
  }
  st->w.fc = wt(H * taps * H);
  st->w.hidden_norm = wt(H);
  st->w.norm = wt(H);
  if (dd.markov_rank) {
    st->w.markov_w1 = wt(V * dd.markov_rank);
    st->w.markov_w2 = wt(V * dd.markov_rank);
  }
  dr_ = std::move(st);
}

bf16* Engine::drafter_slot(const std::string& kind, int layer, int64_t* rows, int64_t* cols) {
  OI_CHECK(dr_, "tensor " << kind << " without a drafter (set_drafter() first)");
  const int64_t H = d_.hidden, r = dr_->dims.markov_rank;
  DrafterWeights& w = dr_->w;
  if (kind == "fc") { *rows = H; *cols = (int64_t)dr_->dims.taps.size() * H; return w.fc; }
  if (kind == "hidden_norm") { *rows = 1; *cols = H; return w.hidden_norm; }
  if (kind == "norm") { *rows = 1; *cols = H; return w.norm; }
  if (kind == "markov_w1" || kind == "markov_w2") {
    OI_CHECK(r > 0, "tensor " << kind << " for a drafter without a Markov head");
    *rows = d_.vocab; *cols = r;
    return kind == "markov_w1" ? w.markov_w1 : w.markov_w2;
  }
  OI_CHECK(layer >= 0 && layer < dr_->dims.layers, "drafter layer " << layer << " out of range for " << kind);
  return layer_slot(w.layers[layer], kind, rows, cols);
}

void Engine::allocate_drafter() {
  DrafterState& st = *dr_;
  const int64_t T = opt_.max_num_batched_tokens, H = d_.hidden, taps = (int64_t)st.dims.taps.size();
  const int64_t tok = (int64_t)st.chunk * st.dims.block_size, rows = (int64_t)st.chunk * st.dims.num_drafts;
  OI_CHECK(st.chunk >= 1, "max_num_batched_tokens " << T << " is below the drafter's block of " << st.dims.block_size);
  st.feats = static_cast<bf16*>(alloc(T * taps * H * sizeof(bf16), &act_bytes_));
  st.iota = static_cast<int32_t*>(alloc(T * 4, &act_bytes_));
  std::vector<int32_t> iota(T);
  for (int64_t i = 0; i < T; ++i) iota[i] = (int32_t)i;
  OI_CUDA_CHECK(cudaMemcpy(st.iota, iota.data(), T * 4, cudaMemcpyHostToDevice));
  auto i32 = [&](int64_t n) { return static_cast<int32_t*>(alloc(n * 4, &act_bytes_)); };
  DraftInputs& s = st.scratch;
  s.ids = i32(tok);
  s.positions = i32(tok);
  s.mask_pos = i32(tok);
  s.slots = i32(tok);
  s.context_lens = i32(opt_.max_num_seqs);
  s.anchors = i32(st.chunk);
  s.rows_out = i32(rows);
  s.d_top_k = i32(rows);
  s.d_pos = i32(rows);
  s.d_temperature = static_cast<float*>(alloc(rows * 4, &act_bytes_));
  s.d_top_p = static_cast<float*>(alloc(rows * 4, &act_bytes_));
  s.d_seeds = static_cast<uint64_t*>(alloc(rows * 8, &act_bytes_));
  st.logprobs = static_cast<float*>(alloc(rows * 4, &act_bytes_));
  if (st.dims.markov_rank) {
    st.markov_u = static_cast<bf16*>(alloc((int64_t)st.chunk * st.dims.markov_rank * sizeof(bf16), &act_bytes_));
    st.markov_part = static_cast<float2*>(alloc((size_t)2 * num_sms_ * kMaxMarkovSeqs * sizeof(float2), &act_bytes_));
    st.markov_sync = static_cast<unsigned*>(alloc(2 * sizeof(unsigned), &act_bytes_));
    OI_CUDA_CHECK(cudaMemset(st.markov_sync, 0, 2 * sizeof(unsigned)));
  }
}

// The drafting sequences and their block passes' attention items, chunk by chunk, into the step's staging.
Engine::DraftStage Engine::stage_draft(const StepInput& in, const StepPlan& plan, Stager& st) {
  DraftStage ds;
  const int D = (int)plan.draft_seqs.size(), bsz = dr_->dims.block_size, C = dr_->chunk;
  if (D == 0) return ds;
  ds.num_seqs = D;
  ds.seqs = (const int32_t*)st.put(plan.draft_seqs.data(), D * 4);
  ds.rows = (const int32_t*)st.put(plan.draft_rows.data(), D * 4);
  const int qt = attn_tokens_per_item(d_.heads / d_.kv_heads);
  std::vector<AttnWork> work;
  for (int c0 = 0; c0 < D; c0 += C) {
    ds.work_start.push_back((int)work.size());
    int max_ctx = 0;
    for (int d = c0; d < std::min(D, c0 + C); ++d) {
      const int b = plan.draft_seqs[d];
      for (int t0 = 0; t0 < bsz; t0 += qt) work.push_back(AttnWork{b, (d - c0) * bsz + t0, std::min(qt, bsz - t0), 0});
      max_ctx = std::max(max_ctx, in.context_lens[b] + bsz);  // p <= the sequence's context length
    }
    ds.max_ctx.push_back(max_ctx);
  }
  ds.work_start.push_back((int)work.size());
  ds.work = (const AttnWork*)st.put(work.data(), work.size() * sizeof(AttnWork));
  return ds;
}

void Engine::run_drafter(const StepMeta& m, const DraftStage& ds, int32_t* out_drafts, const AttnVariant& v) {
  DrafterState& st = *dr_;
  const DrafterDims& dd = st.dims;
  drafter_context(st.md, dd, st.w, act_, st.feats, m.positions, m.slots, m.T, rope_, st.kv_cache, st.kv, *gemm_,
                  num_sms_, stream_);
  const int group = d_.heads / d_.kv_heads, qt = attn_tokens_per_item(group);
  int done = 0;  // drafting sequences of earlier chunks
  for (int c = 0; done < ds.num_seqs; ++c) {
    const int n_work = ds.work_start[c + 1] - ds.work_start[c];
    const int Dc = std::min(st.chunk, ds.num_seqs - done);
    DraftInputs a = st.scratch;
    a.D = Dc;
    a.block = dd.block_size;
    a.first_slot = dd.first_slot;
    a.num_drafts = dd.num_drafts;
    a.mask_token = dd.mask_token;
    a.page = opt_.kv_block_size;
    a.bt_stride = m.bt_stride;
    a.seqs = ds.seqs + done;
    a.rows = ds.rows + done;
    a.accepted = m.out_accepted;
    a.tokens = m.out_tokens;
    a.sample_pos = m.sample_pos;
    a.temperature = m.temperature;
    a.top_p = m.top_p;
    a.top_k = m.top_k;
    a.seeds = m.seeds;
    a.block_tables = m.block_tables;
    draft_inputs(a, stream_);
    DraftBlock b{};
    b.D = Dc;
    b.ids = a.ids;
    b.positions = a.positions;
    b.mask_pos = a.mask_pos;
    b.slots = a.slots;
    b.context_lens = a.context_lens;
    b.block_tables = m.block_tables;
    b.bt_stride = m.bt_stride;
    b.work = ds.work + ds.work_start[c];
    b.num_work = n_work;
    b.max_rows = std::min(qt, dd.block_size) * group;
    b.num_splits = attn_num_splits(n_work, d_.kv_heads, ds.max_ctx[c], Dc * dd.block_size, num_sms_, max_split_rows_,
                                   b.max_rows, v);
    b.rows = a.rows_out;
    b.anchors = a.anchors;
    b.temperature = a.d_temperature;
    b.top_p = a.d_top_p;
    b.top_k = a.d_top_k;
    b.sample_pos = a.d_pos;
    b.seeds = a.d_seeds;
    b.tokens = out_drafts + (int64_t)done * dd.num_drafts;
    b.logprobs = st.logprobs;
    b.markov_u = st.markov_u;
    b.markov_part = st.markov_part;
    b.markov_sync = st.markov_sync;
    drafter_block(st.md, dd, st.w, w_.embed, w_.lm_head, act_, b, rope_, st.kv_cache, st.kv, *gemm_, num_sms_, stream_);
    done += Dc;
  }
}

// Drafts back in [B, num_drafts] (-1 where a sequence did not draft); each chunk's are slot-major.
void Engine::take_drafts(const Pending& p, const int32_t* h, StepResult& r) const {
  const int nd = dr_->dims.num_drafts, D = (int)p.draft_seqs.size(), C = dr_->chunk;
  r.draft_rows = p.B;
  r.num_drafts = nd;
  r.drafts.assign((size_t)p.B * nd, -1);
  for (int c0 = 0; c0 < D; c0 += C) {
    const int Dc = std::min(C, D - c0);
    for (int d = 0; d < Dc; ++d)
      for (int j = 0; j < nd; ++j) r.drafts[(size_t)p.draft_seqs[c0 + d] * nd + j] = h[(int64_t)c0 * nd + j * Dc + d];
  }
}

}  // namespace oi
